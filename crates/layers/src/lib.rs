//! The Llama-family model and its tensor/context-parallel modules, on the checkpoints of the
//! `checkpoint` crate and the kernels of the `tensor` crate.
//!
//! Layout: [`model`] (the
//! Llama decoder's shardable attention/MLP blocks, linear layers, KV caches and the paged
//! pool, random test checkpoints, and for the tests the single-rank reference decoder),
//! [`parallel`] (the TP/CP model every rank runs, on one rank too).
//!
//! Conventions every module relies on:
//! - Tensors are row-major f32; weight matrices are `[out_features, in_features]`.
//! - Rotary embedding is rotate-half (Hugging Face). GGUF llama files store Q/K rows (and Q/K
//!   biases) permuted for the interleaved form; loading un-permutes them per head, so all
//!   weights in memory are in the Hugging Face layout and both checkpoint formats run the same
//!   kernels. GGUF qwen2 and qwen3 files are stored rotate-half already; Q/K/V biases are
//!   added after the projection, and Qwen3's per-head query/key norms applied after them,
//!   before the rotation.
//! - Attention masks by absolute position (`kv_pos <= q_pos`) and can return the log-sum-exp
//!   of each row, so partial results over disjoint keys merge exactly.
#![forbid(unsafe_code)]

#[cfg(test)]
mod checkpoint_tests;
#[cfg(test)]
mod cuda_tests;
pub mod error;
pub mod model;
pub mod parallel;
#[cfg(test)]
mod test_util;

pub use error::{Error, Result};
pub use model::{KvCache, Logits};
