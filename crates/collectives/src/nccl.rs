//! NCCL communicator (feature `cuda`): the GPU backend of [`Communicator`](crate::Communicator).
//!
//! [`NcclCommunicator`] implements the byte-buffer [`Communicator`](crate::Communicator) trait by
//! staging: each call copies the host slices into a device buffer owned by the communicator,
//! runs the NCCL operation on the communicator's own CUDA stream, waits for it, and copies the
//! result back. Every existing caller and test therefore runs unchanged on NCCL, and the results
//! can be compared with the CPU backends. Code whose data already lives on the GPU uses the
//! device entry points (`all_reduce_device`, ...), which take cudarc device buffers and skip the
//! copies.
//!
//! How it differs from the CPU backends:
//! - Uneven all-gathers pad every shard to the widest one (NCCL's all-gather is equal-sized)
//!   and drop the padding on the way back.
//! - `all_to_all` is one NCCL group of sends and receives; `barrier` a one-byte all-reduce.
//! - Sums of `f16`/`bf16` accumulate in the element type inside NCCL, so with more than two
//!   ranks they may round differently from the CPU backends (which accumulate in `f32`).
//! - NCCL does not compare the ranks' arguments: ranks that disagree about an operation or its
//!   sizes hang or read garbage instead of failing with [`Error::Mismatch`]; the hang ends at
//!   the deadline.
//!
//! Deadlines: the communicator is created non-blocking, so no NCCL call blocks its thread. The
//! owning thread waits for each operation by polling (a CUDA event, NCCL's asynchronous error
//! state, the [`AbortHandle`](crate::AbortHandle) and, from time to time, the group's failure key
//! in the store); this loop is the watchdog. Past the deadline, on an NCCL asynchronous error, or
//! on abort, it calls `ncclCommAbort`, which stops the kernels, and the call fails naming the
//! group and the operation. The communicator is then poisoned, as on the other backends.
//! [`Communicator::fail`](crate::Communicator::fail) and every failed call publish this rank's
//! failure in the store, so peers stuck in the same operation fail with
//! [`Error::PeerFailed`] within a fraction of a second instead of at their deadline.
//!
//! Without the feature `cuda` every entry point returns [`Error::NotCompiledWith`]; with it, on
//! a machine without the CUDA driver, a device or `libnccl.so`, [`Error::BackendUnavailable`].

use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::NcclCommunicator;
#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::NcclCommunicator;

#[cfg(test)]
mod tests;

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// The NCCL version this build's bindings describe (cudarc's `nccl` feature: 2.30); older
/// libraries down to [`MIN_VERSION`] work too.
#[cfg(feature = "cuda")]
const BINDINGS_VERSION: i32 = 23000;

/// Oldest NCCL accepted: non-blocking communicators and `ncclCommGetAsyncError` with
/// `ncclInProgress` need 2.14.
pub const MIN_VERSION: i32 = 21400;

/// The unique id that names one NCCL communicator: made by one rank ([`NcclId::new`]) and
/// handed to the others (the group set-up passes it through the job's store).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; ID_BYTES]);

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`): this process hosts the communicator's bootstrap.
    ///
    /// # Errors
    /// [`Error::NotCompiledWith`] without the feature `cuda`; [`Error::BackendUnavailable`] when
    /// NCCL cannot be used here or cannot make an id (no network interface, for example).
    pub fn new() -> Result<NcclId> {
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::NotCompiledWith { feature: "cuda" })
        }
        #[cfg(feature = "cuda")]
        {
            available()?;
            cuda::unique_id()
        }
    }

    /// The id whose bytes are `bytes`, or `None` when they are not [`ID_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Option<NcclId> {
        bytes.try_into().ok().map(NcclId)
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; ID_BYTES] {
        &self.0
    }
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The bytes are an address and a secret-ish magic; a fingerprint is enough to compare.
        write!(f, "NcclId({:016x})", crate::common::fnv_bytes(&self.0))
    }
}

/// Checks that NCCL can be used here: the CUDA driver loads and initializes, `libnccl.so`
/// loads, has every function this backend calls and is at least version 2.14.
///
/// # Errors
/// [`Error::NotCompiledWith`] without the feature `cuda`; [`Error::BackendUnavailable`] when
/// the NCCL or CUDA library cannot be used, saying which and why.
pub fn available() -> Result<()> {
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }
    #[cfg(feature = "cuda")]
    {
        cuda::probe().map_err(|reason| Error::BackendUnavailable { backend: "nccl", reason })
    }
}

/// Number of CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`).
///
/// # Errors
/// As [`available`].
pub fn device_count() -> Result<usize> {
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }
    #[cfg(feature = "cuda")]
    {
        available()?;
        cuda::device_count()
    }
}

/// The version of the NCCL library loaded here, as NCCL codes it (`2.21.5` is `22105`).
///
/// # Errors
/// As [`available`].
pub fn version() -> Result<i32> {
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }
    #[cfg(feature = "cuda")]
    {
        available()?;
        cuda::version().map_err(|reason| Error::BackendUnavailable { backend: "nccl", reason })
    }
}
