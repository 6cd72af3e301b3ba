//! The CUDA backend: [`CudaBackend`] runs the kernels of [`super::Backend`] on a GPU (feature
//! `cuda`), taking and returning host tensors so the model code runs unchanged.
//!
//! Without feature `cuda` this module is a stub: [`CudaBackend::new`] returns
//! [`crate::Error::NotCompiledWith`] and no value of the type can exist, so the dispatch in
//! [`super::Backend`] carries no `#[cfg]`. With it, the real backend (`device.rs`, with the CUDA
//! C source in `kernels.cu`) loads the CUDA libraries at run time and reports
//! [`crate::Error::BackendUnavailable`] with the reason when it cannot run.

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{CudaBackend, PoolArena};

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaBackend, PoolArena};

#[cfg(test)]
mod tests;
