//! The per-rank engine: step agreement, session lifecycle and the failure policy.
//!
//! Rank 0 runs a [`Leader`] (scheduler, tokenizer, output and metrics sinks); every
//! other rank runs a [`Worker`], which owns none of these (its constructor takes no sink, and
//! handing it one is an error). At each step boundary all ranks meet on the control group
//! (`protocol`): an admission that agrees on go / stop / failed and carries rank 0's step
//! plan, then a confirmation once every rank prepared the step. Models plug in through
//! [`StepModel`] and [`ModelFactory`]; [`replicated`] runs the single-rank Llama model of the
//! `layers` crate on every rank, [`sharded`] its TP/CP-sharded model.
//!
//! This crate never prints: results go to rank 0's [`OutputSink`], numbers to its
//! [`MetricsSink`], and what a rank went through is kept as [`Event`]s.
#![forbid(unsafe_code)]

mod blocks;
mod engine;
mod error;
mod model;
pub mod model_memory;
mod plan;
#[cfg(not(feature = "bench-internals"))]
mod protocol;
/// The step agreement's wire format, public for the `session` benchmark only (feature
/// `bench-internals`); not part of the API.
#[cfg(feature = "bench-internals")]
pub mod protocol;
pub mod replicated;
mod sampler;
mod scheduler;
mod sequences;
pub mod sharded;
mod sink;
pub mod sleep;

pub use engine::{
    panic_message, Decider, Decision, EngineOptions, Event, Gate, Leader, Role, RunSummary,
    SessionReport, Sinks, StopHandle, Worker,
};
pub use error::{BoxError, Error, Result};
pub use model::{Groups, KvLayout, ModelFactory, SampledToken, StepModel, StepOutput};
pub use plan::{PlanEntry, SeqId, SeqSampling, SessionConfig, SessionDecision, StepPlan};
pub use sampler::{
    argmax, PromptLogprobs, RankedLogprobs, SampleError, Sampler, Samplers, SamplingParams,
    Scoring, TokenLogprobs,
};
pub use scheduler::{Cancel, Prompt, Request};
pub use sink::{
    Collect, Detokenizer, FinishReason, Finished, MetricsSink, NoMetrics, OutputSink, StepMetrics,
    StepPhases, TextCodec, TokenizerCodec,
};
