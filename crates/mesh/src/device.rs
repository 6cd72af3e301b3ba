//! Which device a rank owns: the CPU, or the CUDA device its `LOCAL_RANK` selects.
//!
//! Without `LOCAL_RANK` the device current on the caller's thread is kept: a library must not
//! move a caller that chose its GPU itself back to device 0.
//!
//! [`DeviceMemory`] is the contract between the crate that owns device memory (`vmm`, whose
//! allocations a sleep unmaps and a wakeup maps again at the same address) and the crates
//! whose kernels read and write it (`layers`).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::rendezvous::Rendezvous;

mod cuda;

pub use cuda::{cuda_driver, DriverProbe};

/// A range of memory that someone else owns and kernels may use in place: a weight buffer or
/// a KV cache that sleep releases and wakeup restores at the same address.
///
/// The trait is `unsafe` because code that launches kernels on the range, or copies into it,
/// trusts what it says without being able to check it.
///
/// # Safety
///
/// An implementation promises, for as long as the value lives:
/// - [`device_ptr`](DeviceMemory::device_ptr), [`size`](DeviceMemory::size) and
///   [`device`](DeviceMemory::device) return the same values on every call;
/// - `[device_ptr, device_ptr + size)` is memory of [`device`](DeviceMemory::device) (for
///   CUDA, a `CUdeviceptr` range of that device), not freed and not handed to anyone else
///   while the value lives;
/// - the range is mapped whenever a kernel may touch it: its owner unmaps it only while every
///   engine that was given it is quiesced at a step boundary, and maps it again before that
///   engine runs (the gate that `vmm::Region` describes, kept by the session's sleep path).
#[allow(unsafe_code)] // Declaring the contract; implementations carry their own SAFETY notes.
pub unsafe trait DeviceMemory: Send + Sync + fmt::Debug {
    /// The address of the first byte (for CUDA, a `CUdeviceptr`).
    fn device_ptr(&self) -> u64;
    /// The length in bytes.
    fn size(&self) -> usize;
    /// The device the memory belongs to.
    fn device(&self) -> Device;
}

/// A device that holds a rank's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal (after `CUDA_VISIBLE_DEVICES`).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `cpu` or `cuda:N`. A bare `cuda` is refused: which device it means depends on the
    /// thread, and guessing 0 is the mistake this module exists to avoid.
    fn from_str(s: &str) -> Result<Device> {
        let s = s.trim();
        let parsed = match s {
            "cpu" => Some(Device::Cpu),
            _ => s.strip_prefix("cuda:").and_then(|i| i.parse().ok()).map(Device::Cuda),
        };
        parsed.ok_or_else(|| Error::Parse {
            what: "device",
            value: s.to_owned(),
            expected: "cpu or cuda:N",
        })
    }
}

/// What [`Device::select_with`] needs to know about the CUDA devices of this process.
///
/// [`DriverProbe`] asks the CUDA driver (feature `cuda`); tests and crates that may use unsafe
/// code can pass their own.
pub trait CudaProbe {
    /// Number of CUDA devices this process can see.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the CUDA driver is missing or fails;
    /// [`Error::NotCompiledWith`] without the feature `cuda`.
    fn device_count(&self) -> Result<usize>;

    /// The ordinal of the device current on the calling thread, `None` when none is current.
    ///
    /// # Errors
    /// As [`CudaProbe::device_count`].
    fn current_device(&self) -> Result<Option<usize>>;
}

/// A test override: `1` lets ranks whose `LOCAL_RANK` is past the visible devices share them
/// (`cuda:LOCAL_RANK % count`) instead of failing, so two NCCL ranks can run on one GPU (each
/// with its own `NCCL_HOSTID` and NCCL's P2P and SHM transports off, NCCL then sees two hosts;
/// see docs/gpu.md). Not for production: ranks on one device contend for it.
pub const SHARE_DEVICE_ENV: &str = "TPCTL_SHARE_DEVICE";

impl Device {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// The device this rank owns, asking the CUDA driver through [`DriverProbe`]: see
    /// [`Device::select_with`].
    ///
    /// # Errors
    /// See [`Device::select_with`].
    pub fn select(rv: &Rendezvous, want_cuda: bool) -> Result<Device> {
        let share = std::env::var_os(SHARE_DEVICE_ENV).is_some_and(|v| v == "1");
        Device::select_with(rv, want_cuda, &DriverProbe, share)
    }

    /// The device this rank owns: the CPU unless `want_cuda`; otherwise `cuda:LOCAL_RANK`, or,
    /// without `LOCAL_RANK`, the device current on this thread (device 0 when none is current
    /// yet, which is what CUDA itself would use).
    ///
    /// # Errors
    /// [`Error::NotCompiledWith`] or [`Error::BackendUnavailable`] when CUDA is wanted but not
    /// usable (no driver, no device); [`Error::InvalidDevice`] when `LOCAL_RANK` names a device
    /// that is not visible.
    ///
    /// With `share` ([`SHARE_DEVICE_ENV`], a test override), a `LOCAL_RANK` past the visible
    /// devices wraps around instead (ranks share a device), with a warning.
    pub fn select_with(
        rv: &Rendezvous,
        want_cuda: bool,
        probe: &dyn CudaProbe,
        share: bool,
    ) -> Result<Device> {
        if !want_cuda {
            return Ok(Device::Cpu);
        }
        let count = probe.device_count()?;
        if count == 0 {
            return Err(Error::BackendUnavailable {
                backend: "cuda",
                reason: format!(
                    "rank {} sees no CUDA device (check CUDA_VISIBLE_DEVICES)",
                    rv.rank
                ),
            });
        }
        let device = match rv.local_rank {
            Some(local) if local >= count && share => {
                tracing::warn!(
                    rank = rv.rank,
                    "LOCAL_RANK={local} shares cuda:{} ({SHARE_DEVICE_ENV}=1: a test override)",
                    local % count
                );
                local % count
            }
            Some(local) if local >= count => {
                return Err(Error::InvalidDevice {
                    reason: format!(
                        "LOCAL_RANK={local} selects cuda:{local} but rank {} sees only {count} \
                         CUDA device{}",
                        rv.rank,
                        if count == 1 { "" } else { "s" }
                    ),
                })
            }
            Some(local) => local,
            None => match probe.current_device()? {
                Some(current) => current,
                None => {
                    if rv.world_size > 1 {
                        tracing::warn!(
                            rank = rv.rank,
                            "LOCAL_RANK is not set and no CUDA device is current: using cuda:0"
                        );
                    }
                    0
                }
            },
        };
        Ok(Device::Cuda(device))
    }
}

#[cfg(test)]
mod tests;
