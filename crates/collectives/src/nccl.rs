//! NCCL communicator (feature `cuda`): the GPU backend of [`Communicator`](crate::Communicator).
//!
//! The NCCL communicator itself arrives with the GPU work; until then, and on every machine
//! without the NCCL library, asking for it is a clear error rather than a panic.

use crate::error::{Error, Result};

/// Checks that NCCL can be used here.
///
/// # Errors
/// [`Error::NotCompiledWith`] without the feature `cuda`; [`Error::BackendUnavailable`] when
/// the NCCL or CUDA library cannot be loaded.
pub fn available() -> Result<()> {
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }
    #[cfg(feature = "cuda")]
    {
        // SAFETY: the probes only try to dlopen the libraries; they call nothing in them.
        let (cuda, nccl) = unsafe {
            (cudarc::driver::sys::is_culib_present(), cudarc::nccl::sys::is_culib_present())
        };
        let reason = match (cuda, nccl) {
            (false, _) => "the CUDA driver library (libcuda) cannot be loaded",
            (true, false) => "the NCCL library (libnccl.so) cannot be loaded",
            (true, true) => return Ok(()),
        };
        Err(Error::BackendUnavailable { backend: "nccl", reason: reason.to_owned() })
    }
}
