//! CPU kernels on plain slices, and [`CpuBackend`], which runs them on a per-rank thread pool.
//!
//! The slice functions are the reference semantics of every op; the CUDA backend will
//! implement the same ops on device memory.

pub mod activation;
pub mod attention;
pub mod matmul;
pub mod matvec;
pub mod norm;
#[cfg(target_arch = "x86_64")]
mod qdot_avx2;
#[cfg(target_arch = "x86_64")]
mod qdot_avx512;
pub mod qmatrix;
pub mod quant;
pub mod rope;
pub mod sgemm;

use crate::error::{Error, Result};
use std::sync::Arc;

/// Runs CPU kernels on its own rayon pool of a fixed size, so each rank (or each test) decides
/// how many cores it uses regardless of what else runs in the process.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
}

impl CpuBackend {
    /// A backend with `threads` worker threads (at least 1).
    ///
    /// # Errors
    /// [`Error::ThreadPool`] when the threads cannot be spawned.
    pub fn new(threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("layers-cpu-{i}"))
            .build()
            .map_err(|e| Error::ThreadPool { threads, message: e.to_string() })?;
        Ok(CpuBackend { pool: Arc::new(pool), threads })
    }

    /// The number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` inside this backend's pool (rayon calls in `f` use its threads).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}
