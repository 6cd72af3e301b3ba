//! The seam between the engine and a model: what a rank runs per step ([`StepModel`]) and how
//! a session's model is built on every rank ([`ModelFactory`]).

use crate::error::BoxError;
use crate::plan::{SeqId, SessionConfig, StepPlan};
use crate::sampler::{PromptLogprobs, TokenLogprobs};
use crate::sink::TextCodec;
use collectives::Communicator;
use mesh::DeviceMesh;

/// This rank's data groups, lent to the model for one call: a sharded model runs its TP and
/// CP collectives on them (their deadline is the engine's step deadline). The control group
/// stays with the engine.
pub struct Groups<'a> {
    /// This rank in the world.
    pub rank: usize,
    /// The mesh layout (this rank's TP and CP coordinates).
    pub mesh: DeviceMesh,
    /// The tensor-parallel group (this rank's row of the mesh).
    pub tp: &'a mut dyn Communicator,
    /// The context-parallel group (this rank's column of the mesh).
    pub cp: &'a mut dyn Communicator,
}

impl std::fmt::Debug for Groups<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("rank", &self.rank)
            .field("tp", &(self.tp.rank(), self.tp.size()))
            .field("cp", &(self.cp.rank(), self.cp.size()))
            .finish()
    }
}

/// How a model keeps its sequences' keys and values in a paged pool, the same on every rank
/// (see [`StepModel::kv_layout`]): rank 0's scheduler hands out the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Blocks in every rank's pool.
    pub blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Ranks a sequence's tokens are spread over (context parallelism): a rank holds at most
    /// `ceil(n / spread)` of a sequence's `n` tokens.
    pub spread: u32,
    /// Whether full blocks are remembered by their tokens and reused by later prompts that
    /// start the same way.
    pub prefix_caching: bool,
    /// Groups of layers whose blocks a sequence holds apart (vLLM's KV cache groups,
    /// `layers::model::KvGroups`): a sequence gets one block per group for each `block_size`
    /// tokens, in group order. 1 for a model without a sliding window.
    pub groups: u32,
    /// How many of the groups, the last ones, hold sliding-window layers: their blocks that
    /// the window has left go back to the pool as the sequence advances. 0 without a window.
    pub windowed: u32,
    /// The positions a query of a windowed layer sees (itself included); unused without
    /// windowed groups.
    pub window: u32,
}

impl KvLayout {
    /// A pool of `blocks` blocks of `block_size` tokens of every layer (one group, no
    /// window), with sequences spread over `spread` ranks.
    pub fn single(blocks: u32, block_size: u32, spread: u32, prefix_caching: bool) -> Self {
        KvLayout { blocks, block_size, spread, prefix_caching, groups: 1, windowed: 0, window: 0 }
    }
}

/// The token a model runner picked for one sampled entry of a plan (vLLM's model runner
/// output): its id and, when the request asked for them, its log-probability and the most
/// likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    /// The token.
    pub token: u32,
    /// Its log-probabilities ([`SamplingParams::logprobs`](crate::SamplingParams::logprobs)).
    pub logprobs: Option<TokenLogprobs>,
}

/// One [`SampledToken`] per sampled entry of a plan, in plan order.
pub type StepOutput = Vec<SampledToken>;

/// What one rank runs in a step. Every rank runs every admitted step with the same plan; a
/// sharded model does its TP/CP collectives inside [`StepModel::forward`] on the [`Groups`].
pub trait StepModel: Send {
    /// Runs the plan's tokens at their positions, keeping each sequence's state (KV cache),
    /// and samples where the logits are: returns one [`SampledToken`] per entry with `sample`
    /// set, in plan order, on rank 0 at least (other ranks may return `None`). Sequences
    /// bring their sampling parameters with their first entry
    /// ([`PlanEntry::sampling`](crate::PlanEntry::sampling)); [`Samplers`](crate::Samplers)
    /// keeps them and picks the tokens.
    ///
    /// # Errors
    /// Any failure of the model; the engine reports it with the rank, epoch and step.
    fn forward(
        &mut self,
        plan: &StepPlan,
        groups: &mut Groups<'_>,
    ) -> Result<Option<StepOutput>, BoxError>;

    /// Gets ready for a step that every rank was admitted to, before the confirmation (for
    /// example reserving cache room). The default does nothing.
    ///
    /// # Errors
    /// Any failure; the engine reports it at the confirmation, so no rank runs the step.
    fn prepare(&mut self, plan: &StepPlan) -> Result<(), BoxError> {
        let _ = plan;
        Ok(())
    }

    /// Frees a finished sequence's state (its cache and its sampler).
    fn release(&mut self, seq: SeqId);

    /// The prompt log-probabilities the last [`StepModel::forward`] computed (for the
    /// sequences whose parameters ask for them,
    /// [`SamplingParams::prompt_logprobs`](crate::SamplingParams::prompt_logprobs)), taken:
    /// on rank 0, where the tokens are sampled. The default has none.
    fn take_prompt_logprobs(&mut self) -> Vec<PromptLogprobs> {
        Vec::new()
    }

    /// The part of the last [`StepModel::forward`] spent sampling on this rank after the
    /// logits reached the host (the [`Samplers`](crate::Samplers)), which the engine reports
    /// apart from the forward pass. A greedy step picks its tokens inside the forward pass
    /// (an argmax where the logits are made), so that pick is not counted here. The default:
    /// none measured.
    fn sampling_time(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// The paged KV pool, when the model keeps its caches in one: plans then name the blocks
    /// each sequence gets ([`PlanEntry::blocks`](crate::PlanEntry::blocks)). `None` (the
    /// default): each sequence's cache is the model's own business.
    fn kv_layout(&self) -> Option<KvLayout> {
        None
    }

    /// The longest sequence (prompt and generated tokens) the model holds.
    fn context_len(&self) -> usize;
}

/// Builds a session's model on each rank from the [`SessionConfig`] rank 0 broadcast.
pub trait ModelFactory: Send {
    /// Builds the model of a session on this rank (a sharded model loads the shard of its
    /// mesh coordinates, and may run collectives on the groups).
    ///
    /// # Errors
    /// Any failure to load the model.
    fn build(
        &mut self,
        config: &SessionConfig,
        groups: &mut Groups<'_>,
    ) -> Result<Box<dyn StepModel>, BoxError>;

    /// The tokenizer of the session's model; only rank 0 asks. `None`: requests must come as
    /// token ids and output is reported as ids only.
    ///
    /// # Errors
    /// Any failure to load the tokenizer.
    fn codec(&mut self, config: &SessionConfig) -> Result<Option<Box<dyn TextCodec>>, BoxError> {
        let _ = config;
        Ok(None)
    }
}
