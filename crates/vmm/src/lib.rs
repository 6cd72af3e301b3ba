//! Tagged virtual memory that releases and re-materializes physical memory at stable addresses.
//!
//! A [`Manager`] hands out [`Allocation`]s, each with a [`Tag`] and a restore [`Policy`].
//! An allocation's address range is reserved once and kept for its whole life;
//! [`Manager::release`] gives the physical memory behind every allocation of some tags back
//! to the OS (or the driver) and [`Manager::materialize`] maps fresh memory at the same
//! addresses and restores the contents per policy, so pointers held by kernels, caches and
//! captured graphs stay valid.
//!
//! ```
//! use vmm::{Manager, Policy, BackupStore, Tag};
//!
//! let dir = std::env::temp_dir().join("vmm-doc-spill");
//! let manager = Manager::builder().spill_dir(&dir).build()?;
//! let kv = manager.allocate(Tag::KV_CACHE, 1 << 20, Policy::Backup(BackupStore::Spill))?;
//! kv.write()?.fill(7);
//! let base = kv.base();
//!
//! let receipts = manager.release([Tag::KV_CACHE])?;
//! assert_eq!(receipts[0].bytes, 1 << 20);
//! assert!(kv.read().is_err()); // released: no access
//!
//! manager.materialize(["kv_cache"])?;
//! assert_eq!(kv.base(), base);
//! assert!(kv.read()?.iter().all(|&b| b == 7));
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), vmm::Error>(())
//! ```
//!
//! Backends: host memory (anonymous memory mapped into a reserved range; the default) and CUDA device
//! memory (`cuMem*`, feature `cuda`). Backups to host memory are carved from a host pool
//! (pinned for CUDA) that is kept and reused across cycles, allocated at the first release or
//! up front ([`Manager::preallocate_host_backups`]) and freed with the manager or by
//! [`Manager::free_host_pool`]; they and their restores copy in 64 MiB chunks, the next one
//! queued while the previous one copies. Probes: [`ProcessMemory`] (procfs) and
//! [`NvmlMemory`] (NVML, feature `cuda`).

mod backend;
mod chunked;
mod error;
mod fail;
pub mod ipc;
mod manager;
mod policy;
mod pool;
mod probe;
mod receipt;
mod region;
mod spill;
mod tag;

pub use backend::BackendKind;
pub use error::{Error, Failure, Result};
pub use manager::{
    total_elapsed, Allocation, AllocationInfo, Manager, ManagerBuilder, ReadGuard, WriteGuard,
};
pub use policy::{BackupStore, Policy, Source};
pub use pool::HostBuffer;
pub use probe::{
    nvml_device_for, nvml_device_of_cuda_ordinal, DeviceUsage, NvmlDevice, NvmlMemory,
    ProcessMemory,
};
pub use receipt::{Op, Receipt};
pub use region::{DeviceSlice, Region, Regions};
pub use spill::default_spill_dir;
pub use tag::Tag;

/// Whether the CUDA driver can be loaded and initialized here ([`mesh::cuda_driver`]; always
/// false without the `cuda` feature). Creating a CUDA manager can still fail when no device
/// is usable.
pub fn cuda_driver_present() -> bool {
    mesh::cuda_driver().is_ok()
}

/// Returns the C heap's free memory to the OS (glibc `malloc_trim`; nothing elsewhere).
///
/// A reload that builds a whole model shard on the heap to copy it into its allocation frees
/// it again, but glibc keeps large freed ranges mapped; after a wakeup that would leave the
/// process's resident memory well above where it was before the sleep.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; no Rust object refers to
    // free heap memory.
    unsafe {
        libc::malloc_trim(0);
    }
}
