//! Model checkpoints on disk: GGUF files (split or not) and Hugging Face folders
//! (`config.json` with safetensors), read as a model's hyper-parameters ([`LlamaConfig`]),
//! its sampling defaults ([`GenerationConfig`]) and its weights ([`WeightSource`]).
//!
//! [`Checkpoint::open`] is the one place that tells the formats apart (a folder is a Hugging
//! Face checkpoint, a file is GGUF); the rest of tpctl asks it for the config, the weights and
//! the check that every tensor type can be read.
//!
//! Layout: [`source`] (`WeightSource` and the `Shard` a rank reads), [`gguf`] (reader, writer,
//! k-quants, GGUF as a `WeightSource`), [`safetensors`] (safetensors files and Hugging Face
//! folders), [`fused`] (Phi-3's fused projections seen under llama names), [`overlay`] (weight
//! updates in buckets over a loaded checkpoint), [`config`],
//! [`generation`], [`cache`] (where tpctl keeps models).
//!
//! Every loader brings weights to the Hugging Face layout: GGUF llama files store Q/K rows
//! (and Q/K biases) permuted for interleaved rotary embedding, which
//! [`WeightSource::qk_interleaved`] reports so the model un-permutes them per head; GGUF qwen2,
//! qwen3, phi3 and gemma files are rotate-half already.
//!
//! `unsafe` is denied crate-wide; the one exception is the read-only file map in `mmap`.
#![deny(unsafe_code)]

pub mod cache;
pub mod config;
pub mod error;
mod format;
pub mod fused;
pub mod generation;
pub mod gguf;
mod mmap;
pub mod overlay;
pub mod safetensors;
pub mod source;
#[cfg(test)]
mod test_util;

pub use config::{Activation, LlamaConfig, SlidingWindow};
pub use error::{Error, Result};
pub use format::{Checkpoint, Format};
pub use generation::GenerationConfig;
pub use overlay::{bucket_tensor_names, live_buckets, Bucket, Overlay};
pub use source::{ShapeCatalog, Shard, WeightSource};
