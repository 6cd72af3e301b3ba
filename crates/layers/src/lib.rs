//! Tensors, CPU kernels, the GGUF loader, the tokenizer and the single-rank Llama model.
//!
//! Layout: [`tensor`] (the `Tensor` type and its storage), [`kernels`] (the `Backend` seam and
//! the CPU kernels), [`gguf`] (reader and writer), [`config`] (model hyper-parameters),
//! [`tokenizer`] (byte-level BPE and chat template), [`model`] (the Llama decoder, KV cache and
//! greedy generation). Tensor/context-parallel modules come on top of these.
//!
//! `unsafe` is denied crate-wide; the two exceptions are local and documented: the `gemm` call
//! in `kernels::cpu::matmul` and the file map in `mmap`.
#![deny(unsafe_code)]

pub mod config;
pub mod error;
pub mod gguf;
pub mod kernels;
mod mmap;
pub mod model;
pub mod safetensors;
pub mod tensor;
#[cfg(test)]
mod test_util;
pub mod tokenizer;

pub use config::LlamaConfig;
pub use error::{Error, Result};
pub use model::{KvCache, Logits, Model};
pub use tensor::{DType, Device, ExternalMemory, Storage, Tensor};
pub use tokenizer::{ChatMessage, Tokenizer};
