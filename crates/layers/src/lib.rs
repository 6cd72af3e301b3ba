//! The GGUF and safetensors loaders, the tokenizer, the Llama-family model and its
//! tensor/context-parallel modules, on the tensors and kernels of the `tensor` crate.
//!
//! Layout: [`source`] (what every checkpoint format hands out: `WeightSource` and
//! the `Shard` a rank reads), [`gguf`] (reader and writer), [`safetensors`] (Hugging Face
//! checkpoints),
//! [`config`] (model hyper-parameters), [`tokenizer`] (byte-level BPE and chat template),
//! [`model`] (the Llama decoder, its shardable attention/MLP blocks, KV cache and greedy
//! generation). Tensor/context-parallel modules come on top of these.
//!
//! Conventions every module relies on:
//! - Tensors are row-major f32; weight matrices are `[out_features, in_features]`.
//! - Rotary embedding is rotate-half (Hugging Face). GGUF llama files store Q/K rows (and Q/K
//!   biases) permuted for the interleaved form; loading un-permutes them per head, so all
//!   weights in memory are in the Hugging Face layout and both checkpoint formats run the same
//!   kernels. GGUF qwen2 files are stored rotate-half already; their Q/K/V biases are added
//!   after the projection, before the rotation.
//! - Attention masks by absolute position (`kv_pos <= q_pos`) and can return the log-sum-exp
//!   of each row, so partial results over disjoint keys merge exactly.
//!
//! `unsafe` is denied crate-wide; the one exception is the file map in `mmap`.
#![deny(unsafe_code)]

pub mod config;
#[cfg(test)]
mod cuda_tests;
pub mod error;
pub mod generation;
pub mod gguf;
mod mmap;
pub mod model;
pub mod parallel;
pub mod safetensors;
pub mod source;
#[cfg(test)]
mod test_util;
pub mod tokenizer;

pub use config::{Activation, LlamaConfig};
pub use error::{Error, Result};
pub use generation::GenerationConfig;
pub use model::{KvCache, Logits, Model};
pub use tokenizer::{ChatMessage, Tokenizer};
