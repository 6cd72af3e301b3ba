//! What every rank runs in one step: the [`StepPlan`] rank 0 schedules and broadcasts, and the
//! [`SessionConfig`] every rank builds its model from.

use crate::sampler::SamplingParams;

/// A sequence (one request's tokens) as the model sees it; stable for the request's lifetime.
pub type SeqId = u64;

/// One sequence's share of a step: a prefill chunk of its prompt or one decode token.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanEntry {
    /// The sequence.
    pub seq: SeqId,
    /// Absolute position of `tokens[0]`; token `i` sits at `start + i`.
    pub start: u32,
    /// Token ids: a prompt chunk, or the one token sampled in the previous step.
    pub tokens: Vec<u32>,
    /// Whether rank 0 samples a token from this entry's last logits row (false for a prompt
    /// chunk that is not the last one).
    pub sample: bool,
    /// The most tokens the sequence can hold (its prompt and every token it may generate,
    /// within the model's context): a model with a cache per sequence sizes it by this.
    pub reserve: u32,
    /// Blocks of the rank's KV pool the sequence gets in this step, appended to its block
    /// table before the step runs (a paged KV cache; empty otherwise). A sequence's first
    /// entry with `start > 0` begins with a cached prompt prefix: its first blocks already
    /// hold tokens `0..start`.
    pub blocks: Vec<u32>,
    /// How the model runner picks the sequence's tokens: set on the sequence's first entry
    /// (again under its new id after a recompute), `None` on the later ones.
    pub sampling: Option<Box<SeqSampling>>,
}

/// What the model runner needs to pick a sequence's tokens where its logits are, sent once
/// with the sequence's first plan entry (vLLM's new-request data): the request's parameters,
/// its generator's position, and the tokens its penalties count.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SeqSampling {
    /// The request's sampling parameters.
    pub params: SamplingParams,
    /// Tokens the request generated before this sequence id began (a recomputed sequence
    /// continues its generator where it stopped).
    pub drawn: u32,
    /// The prompt, when a penalty counts it (empty otherwise).
    pub prompt: Vec<u32>,
    /// The tokens generated before, when a penalty counts them or a grammar constrains the
    /// output (the runner replays them through it); empty otherwise.
    pub generated: Vec<u32>,
}

impl PlanEntry {
    /// The absolute positions of the tokens.
    pub fn positions(&self) -> std::ops::Range<usize> {
        let start = self.start as usize;
        start..start + self.tokens.len()
    }

    /// Whether this entry feeds a sampled token back (a decode step of a running sequence).
    pub fn is_decode(&self) -> bool {
        self.tokens.len() == 1 && self.start > 0
    }
}

/// The inputs of one step, identical on every rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// The session number.
    pub epoch: u64,
    /// The step number within the session, from 1.
    pub step: u64,
    /// Sequences that run in this step, prefill chunks next to decode tokens.
    pub entries: Vec<PlanEntry>,
    /// Sequences that finished before this step: every rank frees their state.
    pub released: Vec<SeqId>,
}

impl StepPlan {
    /// Tokens in the step.
    pub fn tokens(&self) -> usize {
        self.entries.iter().map(|e| e.tokens.len()).sum()
    }

    /// Entries the model runner samples a token for, in plan order.
    pub fn sampled(&self) -> impl Iterator<Item = &PlanEntry> {
        self.entries.iter().filter(|e| e.sample)
    }
}

/// One configured model instance: what every rank builds, and the limits of its run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// The model, as the [`ModelFactory`](crate::ModelFactory) understands it (a GGUF path
    /// for [`LlamaFactory`](crate::replicated::LlamaFactory)).
    pub model: String,
    /// The most steps the session runs before its model work ends (`None`: no limit).
    pub max_steps: Option<u64>,
    /// Tokens per step across the batch (prefill chunks and decode tokens).
    pub token_budget: u32,
    /// Sequences per step.
    pub max_batch: u32,
}

impl SessionConfig {
    /// A session of `model` with the default limits (no step limit, 256 tokens and 32
    /// sequences per step).
    pub fn new(model: impl Into<String>) -> Self {
        SessionConfig { model: model.into(), max_steps: None, token_budget: 256, max_batch: 32 }
    }
}

/// What rank 0 decides once a session's model work has ended; the same on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionDecision {
    /// Close the session and stop the engine.
    Stop,
    /// Keep the session open and idle: workers poll rank 0 once per tick.
    KeepOpen,
    /// Close the session and open a new one with this config, on every rank together.
    Replace(SessionConfig),
}
