//! Tensors, the memory they live in, and the kernels that compute on them.
//!
//! Layout: [`tensor`] (the `Tensor` type and its storage), [`memory`] (arenas that weights and
//! KV caches can live in instead of the heap), [`kernels`] (the `Backend` seam, the CPU kernels
//! and the CUDA backend). Checkpoint formats, the tokenizer and the model sit above this crate.
//!
//! Conventions every module relies on:
//! - Tensors are row-major f32; weight matrices are `[out_features, in_features]`.
//! - Rotary embedding is rotate-half (Hugging Face); loaders bring every checkpoint to that
//!   layout, so every format runs the same kernels.
//! - Attention masks by absolute position (`kv_pos <= q_pos`) and can return the log-sum-exp
//!   of each row, so partial results over disjoint keys merge exactly.
//!
//! `unsafe` is denied crate-wide; the exceptions are local and documented: the `gemm` call in
//! `kernels::cpu::matmul`, the AVX-512 loads and stores of `kernels::cpu::sgemm`, the AVX-512
//! kernels of the block-quantized product in `kernels::cpu::qdot_avx512`, the prefetch hint of
//! `kernels::cpu::matvec`, the call of the draw's weights compiled for the CPU's fused
//! multiply-add in `kernels::sample`, and the kernel launches and device copies of
//! `kernels::cuda` (feature `cuda`).
#![deny(unsafe_code)]

pub mod error;
pub mod kernels;
pub mod memory;
pub mod tensor;
pub mod test_util;

pub use error::{Error, Result};
pub use kernels::Backend;
pub use memory::{Arena, DeviceArena, HeapArena};
pub use tensor::{DType, Device, ExternalMemory, Storage, Tensor};
