//! Tensors, kernels, tensor/context-parallel modules and the Llama-family model.
//!
//! Not built yet: see the layers issue.
#![forbid(unsafe_code)]
