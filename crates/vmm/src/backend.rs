//! The backend interface: reserve address space, back it with physical memory, move bytes.
//!
//! A backend knows nothing of tags or policies; the [`crate::Manager`] drives it and owns all
//! bookkeeping. Addresses are plain `u64` so the same interface covers host and device memory.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "backend/cuda_stub.rs"]
pub(crate) mod cuda;
#[cfg(test)]
pub(crate) mod fake;

use crate::chunked::Direction;
use crate::error::{Error, Result};
use crate::policy::BackupStore;
use std::fs::File;

/// Which backend a manager drives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// Host memory: private anonymous memory mapped into a reserved range of the process's
    /// address space.
    #[default]
    Cpu,
    /// Device memory through the CUDA driver's virtual memory API (feature `cuda`).
    Cuda {
        /// The device ordinal.
        device: usize,
    },
}

/// How a fresh mapping is filled before anyone can see it.
pub(crate) enum Init<'a> {
    /// Whatever the backend hands out (zero on CPU, undefined on CUDA), physically held from
    /// the start (the CPU backend faults every page in).
    Fresh,
    /// Zeros.
    Zero,
    /// `len` bytes read from `file` at `offset`, then zeros; `what` names the file in errors.
    File { file: &'a File, offset: u64, len: usize, what: &'a str },
    /// Zeros, then the function runs on the first `len` bytes.
    Fill { len: usize, fill: &'a mut dyn FnMut(&mut [u8]) -> Result<()> },
}

/// The physical memory behind a mapped allocation.
#[derive(Debug)]
pub(crate) enum Phys {
    /// Anonymous memory of the CPU backend, returned when its range is mapped over again.
    Anonymous,
    /// A `CUmemGenericAllocationHandle` of the CUDA backend.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda(u64),
}

/// Host memory that holds a backup: a heap buffer, or pinned memory for CUDA.
pub(crate) enum HostBuf {
    Heap(Vec<u8>),
    Mapped(cpu::MappedBuf),
    #[cfg(feature = "cuda")]
    Pinned(cuda::PinnedBuf),
    /// Host memory of the test backend, which counts when it is freed.
    #[cfg(test)]
    Fake(fake::FakeHostBuf),
}

impl HostBuf {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            HostBuf::Heap(v) => v,
            HostBuf::Mapped(m) => m.as_slice(),
            #[cfg(feature = "cuda")]
            HostBuf::Pinned(p) => p.as_slice(),
            #[cfg(test)]
            HostBuf::Fake(f) => &f.bytes,
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            HostBuf::Heap(v) => v,
            HostBuf::Mapped(m) => m.as_mut_slice(),
            #[cfg(feature = "cuda")]
            HostBuf::Pinned(p) => p.as_mut_slice(),
            #[cfg(test)]
            HostBuf::Fake(f) => &mut f.bytes,
        }
    }
}

/// What the manager needs from a kind of memory. Calls are serialized by the manager's lock.
pub(crate) trait Backend: Send {
    /// A short name for messages.
    fn name(&self) -> &'static str;
    /// Where its memory lives.
    fn device(&self) -> mesh::Device;
    /// Every size and address is a multiple of this.
    fn granularity(&self) -> usize;
    /// The largest allocation this backend can ever back.
    fn max_bytes(&self) -> u64;
    /// The store [`BackupStore::Default`] means for this backend.
    fn default_store(&self) -> BackupStore;
    /// Reserves `len` bytes of inaccessible address space; returns its base.
    fn reserve(&mut self, len: usize) -> Result<u64>;
    /// Backs `[addr, addr + len)` with fresh physical memory filled per `init`.
    /// On error nothing stays mapped.
    fn map(&mut self, addr: u64, len: usize, label: &str, init: Init<'_>) -> Result<Phys>;
    /// Returns the physical memory behind `[addr, addr + len)`, keeping the reservation.
    /// On error the mapping is unchanged and `phys` comes back.
    fn unmap(&mut self, addr: u64, len: usize, phys: Phys) -> Result<(), (Phys, Error)>;
    /// Unmaps (when `phys` is given) and gives back the reservation.
    fn free(&mut self, addr: u64, len: usize, phys: Option<Phys>) -> Result<()>;
    /// A host pointer to `addr` when the host can address the memory directly.
    fn host_ptr(&self, addr: u64) -> Option<*mut u8>;
    /// Allocates `len` bytes of host memory suited for copies to and from this backend.
    fn alloc_host(&self, len: usize) -> Result<HostBuf>;
    /// Copies `dst.len()` bytes from `addr` into `dst`.
    fn copy_to_host(&self, addr: u64, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` to `addr`.
    fn copy_from_host(&self, addr: u64, src: &[u8]) -> Result<()>;
    /// Calls `sink` with the `len` bytes at `addr`, in order, in one or more pieces.
    fn save(&self, addr: u64, len: usize, sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>;

    // Chunked copies between mapped memory and host memory, driven by `crate::chunked`, which
    // owns the order of these calls (see its docs): a backend that copies asynchronously
    // overlaps the copy of one chunk with the queueing of the next.

    /// Gets ready for a chunked copy `direction`: the CUDA backend waits for the kernels'
    /// work on its memory before a backup reads it.
    fn begin_chunks(&self, direction: Direction) -> Result<()>;
    /// Queues the copy of the `len` bytes at `addr` (mapped memory of this backend) to host
    /// memory at `dst`, as chunk `chunk` of a chunked copy; the copy may still run when this
    /// returns.
    ///
    /// # Safety
    /// `dst..dst + len` is valid for writes, and nothing else reads or writes it, until
    /// `wait_chunk(chunk)` or `drain_chunks()` returned; at most [`crate::chunked::IN_FLIGHT`]
    /// chunks are queued and not waited for.
    unsafe fn start_to_host(&self, addr: u64, dst: *mut u8, len: usize, chunk: usize)
        -> Result<()>;
    /// Queues the copy of `len` bytes of host memory at `src` to `addr` (mapped memory of this
    /// backend), as chunk `chunk`; the copy may still run when this returns.
    ///
    /// # Safety
    /// `src..src + len` is valid for reads, and nothing writes it, until `wait_chunk(chunk)` or
    /// `drain_chunks()` returned; at most [`crate::chunked::IN_FLIGHT`] chunks are queued and
    /// not waited for.
    unsafe fn start_from_host(
        &self,
        addr: u64,
        src: *const u8,
        len: usize,
        chunk: usize,
    ) -> Result<()>;
    /// Waits until chunk `chunk`, and every chunk queued before it, is copied.
    fn wait_chunk(&self, chunk: usize) -> Result<()>;
    /// Waits, after a failure, until no queued chunk can read or write host memory any more;
    /// when it returns, that holds even if it returns an error.
    fn drain_chunks(&self) -> Result<()>;
}

/// Creates the backend `kind`.
pub(crate) fn create(kind: BackendKind) -> Result<Box<dyn Backend>> {
    match kind {
        BackendKind::Cpu => Ok(Box::new(cpu::CpuBackend::new()?)),
        BackendKind::Cuda { device } => cuda::create(device),
    }
}
