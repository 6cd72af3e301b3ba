//! The TP/CP-sharded Llama model of the `layers` crate behind the [`StepModel`] seam: each rank
//! loads the shard of its mesh coordinates and runs its collectives on the lent [`Groups`].

use crate::error::BoxError;
use crate::model::{Groups, KvLayout, ModelFactory, StepModel, StepOutput};
use crate::model_memory::{ModelMemory, ShardOrigin};
use crate::plan::{PlanEntry, SeqId, SessionConfig, StepPlan};
use crate::replicated::LlamaFactory;
use crate::sequences::Sequences;
use crate::sink::TextCodec;
use layers::model::KvPool;
use layers::model::WeightForm;
use layers::parallel::{Comms, LoadOptions, ParallelModel, Placement};
use std::sync::{Arc, PoisonError, RwLock};
use tensor::kernels::KvElem;

/// Builds a [`ShardedLlama`] from the GGUF file named by [`SessionConfig::model`].
#[derive(Clone)]
pub struct ShardedFactory {
    threads: usize,
    form: WeightForm,
    /// Tokens of KV cache per sequence (over all CP ranks); `None`: the model's context.
    context: Option<usize>,
    /// Where weights and KV caches live; `None`: the heap.
    memory: Option<ModelMemory>,
    /// Told `(done, total)` while a shard loads.
    progress: Option<Progress>,
    /// The kernels' backend; `None`: the CPU with `threads` threads.
    backend: Option<tensor::kernels::Backend>,
    /// Rank 0's tokenizer, shared with its caller; `None`: loaded from the model file.
    tokenizer: Option<std::sync::Arc<text::Tokenizer>>,
    /// A paged KV pool per rank; `None`: a cache per sequence.
    kv: Option<KvCacheConfig>,
    /// The grammar engine of constrained sequences, on the rank that samples.
    grammars: Option<text::GrammarEngine>,
}

/// A paged KV cache: one pool per rank, the same number of blocks on every rank.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvCacheConfig {
    /// Bytes of the pool on the rank holding the most KV heads (the others hold as many
    /// blocks in fewer bytes). `None`: room for [`DEFAULT_SEQUENCES`] sequences of the whole
    /// context, at most `cap_bytes`, at least one sequence.
    pub bytes: Option<u64>,
    /// The most bytes of a default-sized pool.
    pub cap_bytes: u64,
    /// Tokens per block (a power of two).
    pub block_size: usize,
    /// Whether full blocks are reused by later prompts that start with the same tokens
    /// (without context parallelism only).
    pub prefix_caching: bool,
    /// On a GPU, the pool's share of the device's free memory once the weights are loaded,
    /// replacing `bytes` (which then holds that share of the host's memory, for the CPU).
    #[serde(default)]
    pub device_fraction: Option<f64>,
}

/// Sequences of the whole context a default-sized KV pool holds (when its cap allows).
pub const DEFAULT_SEQUENCES: usize = 2;

/// Why a KV pool cannot be sized.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvSizeError {
    /// The model's KV heads cannot be split as the layout asks.
    #[error(transparent)]
    Layout(#[from] layers::Error),
    /// The configured pool holds less than one sequence of the context length.
    #[error(
        "kv_cache_memory of {bytes} bytes holds {blocks} blocks of {block_size} tokens \
         ({block_bytes} bytes each per rank), but one sequence of the context length {context} \
         needs {need}: raise kv_cache_memory to at least {} bytes or lower max-model-len",
        need * block_bytes
    )]
    TooSmall {
        /// The configured pool size.
        bytes: u64,
        /// Blocks it holds.
        blocks: usize,
        /// Tokens per block.
        block_size: usize,
        /// Bytes per block on one rank.
        block_bytes: usize,
        /// The context length.
        context: usize,
        /// Blocks one sequence needs.
        need: usize,
    },
}

impl KvCacheConfig {
    /// Blocks of `block_size` tokens stored as `elem` in a pool of `bytes` bytes for `config`
    /// split over `tp` ranks, and the blocks one sequence of `context` tokens split over `cp`
    /// ranks needs.
    ///
    /// # Errors
    /// The heads cannot be split over `tp`, or the pool cannot hold one sequence of
    /// `context` tokens (the message names the sizes and what to change).
    pub fn blocks(
        &self,
        config: &checkpoint::LlamaConfig,
        (tp, cp): (usize, usize),
        context: usize,
        elem: KvElem,
    ) -> Result<usize, KvSizeError> {
        let block = layers::parallel::kv_block_bytes(config, tp, self.block_size, elem)?.max(1);
        // A block holds one group of layers; a sequence holds one per group for each
        // `block_size` tokens (its windowed groups fewer once it is past the window, but a
        // prompt chunk of the whole context needs them all).
        let groups = layers::model::KvGroups::of(config).len();
        let need = context.div_ceil(cp.max(1)).div_ceil(self.block_size) * groups;
        let Some(bytes) = self.bytes else {
            let cap = usize::try_from(self.cap_bytes).unwrap_or(usize::MAX) / block;
            return Ok((need * DEFAULT_SEQUENCES).min(cap).max(need));
        };
        let blocks = usize::try_from(bytes).unwrap_or(usize::MAX) / block;
        if blocks < need {
            let block_size = self.block_size;
            return Err(KvSizeError::TooSmall {
                bytes,
                blocks,
                block_size,
                block_bytes: block,
                context,
                need,
            });
        }
        Ok(blocks)
    }
}

/// A load-progress callback: `(steps done, steps in all)`.
pub type Progress = std::sync::Arc<dyn Fn(usize, usize) + Send + Sync>;

impl std::fmt::Debug for ShardedFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedFactory")
            .field("threads", &self.threads)
            .field("form", &self.form)
            .field("context", &self.context)
            .field("memory", &self.memory)
            .field("backend", &self.backend.as_ref().map(tensor::kernels::Backend::device))
            .finish_non_exhaustive()
    }
}

impl ShardedFactory {
    /// A factory whose shards compute with `threads` CPU threads per rank.
    pub fn new(threads: usize) -> Self {
        ShardedFactory {
            threads: threads.max(1),
            form: WeightForm::Native,
            context: None,
            memory: None,
            progress: None,
            backend: None,
            tokenizer: None,
            kv: None,
            grammars: None,
        }
    }

    /// Keeps every rank's KV caches in one paged pool sized by `kv` (see [`KvCacheConfig`]);
    /// rank 0's scheduler then hands out its blocks. With a GPU backend and memory (see
    /// [`ShardedFactory::with_memory`]) the pool lives in the GPU's memory.
    pub fn with_kv_cache(mut self, kv: KvCacheConfig) -> Self {
        self.kv = Some(kv);
        self
    }

    /// `kv` with its share of the GPU's free memory resolved to bytes, when the model
    /// computes on a GPU and `kv` asks for a share of it.
    fn on_this_device(&self, kv: KvCacheConfig, model: &ParallelModel) -> KvCacheConfig {
        let (Some(share), Some(memory)) = (kv.device_fraction, &self.memory) else { return kv };
        match memory.device_free_bytes(model.backend()) {
            Some(free) => KvCacheConfig { bytes: Some((free as f64 * share) as u64), ..kv },
            None => kv,
        }
    }

    /// Decodes rank 0's output with `tokenizer` (the one its caller encodes prompts with), so
    /// rank 0 holds one tokenizer, not two.
    pub fn with_tokenizer(mut self, tokenizer: std::sync::Arc<text::Tokenizer>) -> Self {
        self.tokenizer = Some(tokenizer);
        self
    }

    /// Samples constrained sequences (structured outputs) with grammars compiled by
    /// `engine`, on the rank where the logits are (TP 0, CP 0); give it to rank 0's factory.
    pub fn with_grammars(mut self, engine: text::GrammarEngine) -> Self {
        self.grammars = Some(engine);
        self
    }

    /// Keeps weights in `form` (quantized weights stay quantized by default).
    pub fn with_weights(mut self, form: WeightForm) -> Self {
        self.form = form;
        self
    }

    /// Caps a sequence at `tokens` (prompt and generated), instead of the model's context.
    pub fn with_context(mut self, tokens: usize) -> Self {
        self.context = Some(tokens.max(1));
        self
    }

    /// Keeps weights and KV caches in `memory`'s tagged allocations, so the deployment can
    /// sleep ([`crate::model_memory`]).
    pub fn with_memory(mut self, memory: ModelMemory) -> Self {
        self.memory = Some(memory);
        self
    }

    /// Computes on `backend` (a GPU's) instead of the CPU.
    pub fn with_backend(mut self, backend: tensor::kernels::Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// The backend given to [`ShardedFactory::with_backend`], if any.
    pub fn backend(&self) -> Option<&tensor::kernels::Backend> {
        self.backend.as_ref()
    }

    /// Reports the progress of every shard load to `progress` (the file's layers, then the
    /// move into tagged memory).
    pub fn with_progress(mut self, progress: Progress) -> Self {
        self.progress = Some(progress);
        self
    }
}

impl ModelFactory for ShardedFactory {
    fn build(
        &mut self,
        config: &SessionConfig,
        groups: &mut Groups<'_>,
    ) -> Result<Box<dyn StepModel>, BoxError> {
        let mut comms = Comms { tp: &mut *groups.tp, cp: &mut *groups.cp };
        let placement = Placement::of(&comms);
        // After the file's steps: the move into tagged memory, and the KV pool's commit.
        let after = 1 + usize::from(self.kv.is_some());
        let report = |done, total| {
            if let Some(p) = &self.progress {
                p(done, total + after);
            }
        };
        let backend = match &self.backend {
            Some(b) => b.clone(),
            None => tensor::kernels::Backend::cpu(self.threads)?,
        };
        let mut opts = LoadOptions::new(placement).on(backend).form(self.form);
        if let Some(tokens) = self.context {
            // Longrope's factors follow the context the session serves.
            opts = opts.context(tokens);
        }
        let mut model = ParallelModel::load(
            &config.model,
            opts.progress(&mut |done, total| report(done, total)),
        )
        .map_err(|e| format!("loading the {placement:?} shard of {}: {e}", config.model))?;
        if let Some(memory) = &self.memory {
            let origin = ShardOrigin::checkpoint(config.model.clone(), placement, self.form);
            memory.place_weights(&mut model, &origin)?;
        }
        let steps = model.config().n_layers + 2 + after;
        if let Some(p) = &self.progress {
            p(steps + 1 - after, steps);
        }
        let context = self.context.unwrap_or(model.config().context_length);
        let pool = match self.kv {
            Some(kv) => {
                let kv = self.on_this_device(kv, &model);
                let elem = self.memory.as_ref().map_or(KvElem::F32, |m| m.kv_elem(&model));
                let layout = (placement.tp, placement.cp);
                let blocks = kv.blocks(model.config(), layout, context, elem)?;
                let pool = match &self.memory {
                    Some(m) => m.new_pool(&model, kv.block_size, blocks)?,
                    None => model.new_pool(kv.block_size, blocks)?,
                };
                let groups = model.kv_groups();
                let windows = groups.windows();
                let windowed = windows.iter().filter(|w| w.is_some()).count();
                let layout = KvLayout {
                    blocks: u32::try_from(blocks).map_err(|_| format!("{blocks} KV blocks"))?,
                    block_size: kv.block_size as u32,
                    spread: placement.cp as u32,
                    prefix_caching: kv.prefix_caching,
                    groups: windows.len() as u32,
                    windowed: windowed as u32,
                    // One window in every model read so far; the widest frees least.
                    window: windows.iter().flatten().max().map_or(0, |&w| w as u32),
                };
                if let Some(p) = &self.progress {
                    // Committed: the first request faults no page of it in.
                    p(steps, steps);
                }
                Some((Arc::new(pool), layout))
            }
            None => None,
        };
        let on_cpu = matches!(model.backend(), tensor::kernels::Backend::Cpu(_));
        if on_cpu {
            warm_up(&model, &mut comms, context)
                .map_err(|e| format!("the warm-up pass of the {placement:?} shard: {e}"))?;
        } else {
            // A device backend's first request would otherwise upload every weight.
            model
                .prepare_device()
                .map_err(|e| format!("the device copies of the {placement:?} shard: {e}"))?;
        }
        let mut sequences = Sequences::default();
        if let Some(engine) =
            self.grammars.clone().filter(|_| (placement.tp_rank, placement.cp_rank) == (0, 0))
        {
            sequences = sequences.with_grammars(engine);
        }
        let model = Arc::new(RwLock::new(model));
        if let Some(memory) = self.memory.as_ref().filter(|_| !on_cpu) {
            // A wakeup makes this model's device copies before its receipt. The memory keeps a
            // weak handle: a session's model goes with its session.
            let weak = Arc::downgrade(&model);
            memory.set_device_preparation(Some(Arc::new(move || match weak.upgrade() {
                Some(model) => read(&model).prepare_device().map_err(|e| e.to_string()),
                None => Ok(()),
            })));
        }
        Ok(Box::new(ShardedLlama { model, sequences, context, memory: self.memory.clone(), pool }))
    }

    fn codec(&mut self, config: &SessionConfig) -> Result<Option<Box<dyn TextCodec>>, BoxError> {
        match &self.tokenizer {
            Some(t) => Ok(Some(Box::new(crate::sink::TokenizerCodec(t.clone())))),
            None => LlamaFactory::new(1).codec(config),
        }
    }
}

/// Tokens of the warm-up pass (a prompt chunk of the size requests commonly bring), for a
/// model whose pass of that many costs at most [`WARM_UP_MACS`].
const WARM_UP_TOKENS: usize = 128;

/// The most multiply-adds the warm-up pass costs a rank: a little above SmolLM2-135M's 128
/// tokens (17 G). A larger model warms up on fewer tokens, down to [`WARM_UP_MIN_TOKENS`]:
/// 128 tokens of a model of Llama 3 8B's shapes took about 10 s of its 35 s start-up on 2
/// cores, for costs a first pass pays once whatever its size.
const WARM_UP_MACS: usize = 20_000_000_000;

/// The fewest tokens of the warm-up pass.
const WARM_UP_MIN_TOKENS: usize = 8;

/// The multiply-adds of one token through a rank's share of the model's matrices (its
/// projections, MLP and LM head, split over `ranks` tensor-parallel ranks).
fn macs_per_token(c: &checkpoint::LlamaConfig, ranks: usize) -> usize {
    let attention = c.hidden * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads);
    let mlp = 3 * c.hidden * c.ffn;
    (c.n_layers * (attention + mlp) + c.vocab_size * c.hidden) / ranks.max(1)
}

/// Tokens of the warm-up pass for a model that costs `macs` multiply-adds a token per rank.
fn warm_up_tokens(macs: usize) -> usize {
    (WARM_UP_MACS / macs.max(1)).clamp(WARM_UP_MIN_TOKENS, WARM_UP_TOKENS)
}

/// One throwaway forward pass before the deployment reports ready, so the first request pays
/// none of the one-time costs of a first pass (the compute threads' first wakeup, the heap
/// that activations grow into). Every rank builds its model at the same agreed point of the
/// session's opening, so the passes' collectives meet (and each computes the same number of
/// tokens from the same configuration). Its cache is its own and dropped: the
/// KV pool and every answer are as without it. CPU backends only: a device backend makes its
/// weights' device copies instead ([`ParallelModel::prepare_device`]).
fn warm_up(model: &ParallelModel, comms: &mut Comms<'_>, context: usize) -> layers::Result<()> {
    let n = warm_up_tokens(macs_per_token(model.config(), comms.tp.size())).min(context);
    let cp = comms.cp.size();
    if n < cp {
        return Ok(());
    }
    // Token 0 is in every vocabulary.
    let tokens = vec![0u32; n];
    let mut cache = model.new_cache(n);
    let mut seqs = [layers::parallel::Sequence::sampled(&tokens, &mut cache)];
    model.forward_batch(comms, &mut seqs)?;
    Ok(())
}

/// The model behind its lock (see [`ShardedLlama::model`]); a panic while it was held left
/// nothing half written that a read could see (the weights are written through the memory's
/// own paths, not under this lock).
fn read(model: &RwLock<ParallelModel>) -> std::sync::RwLockReadGuard<'_, ParallelModel> {
    model.read().unwrap_or_else(PoisonError::into_inner)
}

/// This rank's shard of the model, one KV-cache shard per sequence.
pub struct ShardedLlama {
    /// Shared with the model memory's device preparation, which runs on the sleep thread
    /// while the engine is quiesced; the engine reads it for its steps and writes it only to
    /// adopt new weights.
    model: Arc<RwLock<ParallelModel>>,
    sequences: Sequences,
    context: usize,
    memory: Option<ModelMemory>,
    /// The paged KV pool every sequence's cache lives in, when there is one.
    pool: Option<(Arc<KvPool>, KvLayout)>,
}

impl std::fmt::Debug for ShardedLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedLlama")
            .field("placement", &read(&self.model).placement())
            .field("sequences", &self.sequences.len())
            .finish()
    }
}

impl StepModel for ShardedLlama {
    fn forward(
        &mut self,
        plan: &StepPlan,
        groups: &mut Groups<'_>,
    ) -> Result<Option<StepOutput>, BoxError> {
        if let Some(new) = self.memory.as_ref().and_then(ModelMemory::take_new_weights) {
            // A weight update in another form (the engine was quiesced through it): the old
            // buffers are freed here, as the model drops them.
            let mut model = self.model.write().unwrap_or_else(PoisonError::into_inner);
            model
                .adopt_weights(new)
                .map_err(|e| format!("swapping in the updated weights: {e}"))?;
            if let tensor::kernels::Backend::Cuda(gpu) = model.backend() {
                // The old weights' device copies are stale (adopting bumped the weights
                // generation) and never used again: give their device memory back.
                gpu.clear_weight_cache();
            }
        }
        let mut comms = Comms { tp: &mut *groups.tp, cp: &mut *groups.cp };
        let model = read(&self.model);
        let (model, memory, context) = (&*model, self.memory.as_ref(), self.context);
        // A new sequence's cache holds what it can reach (its prompt and every token it may
        // generate), not the whole context. A CP rank holds about 1/cp of a sequence; one
        // more token absorbs the rounding.
        let capacity = |e: &PlanEntry| {
            (e.reserve as usize).clamp(e.tokens.len(), context).div_ceil(model.placement().cp) + 1
        };
        let pool = self.pool.as_ref().map(|(p, _)| p);
        // The logits come back on rank 0 (TP 0, CP 0) only, and are sampled there.
        self.sequences.run(model, &mut comms, plan, |e| match (pool, memory) {
            (Some(pool), _) => model.new_paged_cache(pool).map_err(BoxError::from),
            (None, Some(m)) => m.new_cache(model, capacity(e)).map_err(BoxError::from),
            (None, None) => Ok(model.new_cache(capacity(e))),
        })
    }

    fn release(&mut self, seq: SeqId) {
        self.sequences.release(seq);
    }

    fn take_prompt_logprobs(&mut self) -> Vec<crate::sampler::PromptLogprobs> {
        self.sequences.take_prompt_logprobs()
    }

    fn sampling_time(&self) -> std::time::Duration {
        self.sequences.sampling_time()
    }

    fn kv_layout(&self) -> Option<KvLayout> {
        self.pool.as_ref().map(|(_, layout)| *layout)
    }

    fn context_len(&self) -> usize {
        self.context
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M warms up on a whole 128-token chunk, a model of Llama 3 8B's shapes on 8
    /// tokens (128 would cost 60 times the budget), and a tensor-parallel rank counts its
    /// share of the matrices.
    #[test]
    fn the_warm_up_pass_costs_a_rank_at_most_a_budget_of_multiply_adds() {
        let path =
            std::env::temp_dir().join(format!("tpctl-session-warm-up-{}.gguf", std::process::id()));
        layers::model::random::RandomLlama::default().write(&path).unwrap();
        let file = checkpoint::gguf::GgufFile::open(&path).unwrap();
        let small = checkpoint::LlamaConfig::from_gguf(&file).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(warm_up_tokens(macs_per_token(&small, 1)), WARM_UP_TOKENS);
        let smollm2 = checkpoint::LlamaConfig {
            n_layers: 30,
            hidden: 576,
            ffn: 1536,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            vocab_size: 49152,
            ..small.clone()
        };
        assert_eq!(macs_per_token(&smollm2, 1), 134_479_872);
        assert_eq!(warm_up_tokens(macs_per_token(&smollm2, 1)), 128);
        let llama3_8b = checkpoint::LlamaConfig {
            n_layers: 32,
            hidden: 4096,
            ffn: 14336,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            vocab_size: 128_256,
            ..small
        };
        assert_eq!(warm_up_tokens(macs_per_token(&llama3_8b, 1)), WARM_UP_MIN_TOKENS);
        let (one, eight) = (macs_per_token(&llama3_8b, 1), macs_per_token(&llama3_8b, 8));
        assert_eq!(eight, one / 8);
        assert_eq!(warm_up_tokens(eight), 21, "an eighth of the matrices each");
    }
}
