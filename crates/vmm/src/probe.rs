//! Memory probes: what a process holds in host memory (procfs) and what a device holds (NVML).
//!
//! A multi-rank sleep uses them to prove that every rank really gave its memory back.

use crate::error::{Error, Result};
use std::path::PathBuf;

/// Host memory of one process, from `/proc/PID/smaps_rollup` (or `/proc/PID/status` where
/// that is missing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessMemory {
    /// The process.
    pub pid: u32,
    /// Resident bytes (`Rss`).
    pub resident: u64,
    /// Resident anonymous bytes (`Anonymous`; `RssAnon` in `status`). This is where the CPU
    /// backend's allocations show up.
    pub anonymous: u64,
    /// Resident bytes in shared pages (`Shared_Clean + Shared_Dirty`; `RssFile + RssShmem`
    /// in `status`).
    pub shared: u64,
    /// Resident shared-memory bytes (`RssShmem` from `status`): memfds and tmpfs.
    pub shmem: u64,
}

impl ProcessMemory {
    /// The calling process.
    ///
    /// # Errors
    /// [`Error::Procfs`] when procfs cannot be read; [`Error::ProcfsFormat`] when a field
    /// is missing.
    pub fn current() -> Result<ProcessMemory> {
        ProcessMemory::of(std::process::id())
    }

    /// Process `pid`.
    ///
    /// # Errors
    /// [`Error::Procfs`] when the process does not exist or its files cannot be read;
    /// [`Error::ProcfsFormat`] when a field is missing.
    pub fn of(pid: u32) -> Result<ProcessMemory> {
        let status_path = PathBuf::from(format!("/proc/{pid}/status"));
        let status = std::fs::read_to_string(&status_path)
            .map_err(|source| Error::Procfs { path: status_path.clone(), source })?;
        let rollup_path = PathBuf::from(format!("/proc/{pid}/smaps_rollup"));
        match std::fs::read_to_string(&rollup_path) {
            Ok(rollup) => {
                ProcessMemory::parse(pid, Some(&rollup), &status, &rollup_path, &status_path)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                ProcessMemory::parse(pid, None, &status, &rollup_path, &status_path)
            }
            Err(source) => Err(Error::Procfs { path: rollup_path, source }),
        }
    }

    /// Resident bytes of the calling process from the kernel's counters (`/proc/self/statm`):
    /// a few microseconds, where [`ProcessMemory::current`] walks every mapping
    /// (`smaps_rollup`: milliseconds for a large process). The counters are the same `VmRSS`
    /// reports.
    ///
    /// # Errors
    /// [`Error::Procfs`] when procfs cannot be read; [`Error::ProcfsFormat`] when the field is
    /// missing.
    pub fn resident_now() -> Result<u64> {
        let path = PathBuf::from("/proc/self/statm");
        let statm = std::fs::read_to_string(&path)
            .map_err(|source| Error::Procfs { path: path.clone(), source })?;
        let pages: u64 = statm
            .split_whitespace()
            .nth(1)
            .and_then(|w| w.parse().ok())
            .ok_or(Error::ProcfsFormat { path, field: "resident" })?;
        Ok(pages * page_size())
    }

    fn parse(
        pid: u32,
        rollup: Option<&str>,
        status: &str,
        rollup_path: &std::path::Path,
        status_path: &std::path::Path,
    ) -> Result<ProcessMemory> {
        let need = |text: &str, path: &std::path::Path, field: &'static str| {
            kib_field(text, field)
                .ok_or_else(|| Error::ProcfsFormat { path: path.to_path_buf(), field })
        };
        let shmem = need(status, status_path, "RssShmem")?;
        match rollup {
            Some(r) => Ok(ProcessMemory {
                pid,
                resident: need(r, rollup_path, "Rss")?,
                anonymous: need(r, rollup_path, "Anonymous")?,
                shared: need(r, rollup_path, "Shared_Clean")?
                    + need(r, rollup_path, "Shared_Dirty")?,
                shmem,
            }),
            None => Ok(ProcessMemory {
                pid,
                resident: need(status, status_path, "VmRSS")?,
                anonymous: need(status, status_path, "RssAnon")?,
                shared: need(status, status_path, "RssFile")? + shmem,
                shmem,
            }),
        }
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
}

/// The value of a `Field:   123 kB` line, in bytes.
fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let mut words = rest.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => Some(n * 1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// Memory use of one device, from [`NvmlMemory::device`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceUsage {
    /// Device index (NVML order).
    pub index: u32,
    /// Total bytes.
    pub total: u64,
    /// Used bytes, all processes together.
    pub used: u64,
    /// Free bytes.
    pub free: u64,
    /// Each compute process on the device with its bytes (`None` where the driver does not
    /// say).
    pub processes: Vec<(u32, Option<u64>)>,
    /// The device's UUID (`GPU-…`, `MIG-…`), where NVML gives it.
    pub uuid: Option<String>,
    /// A MIG instance (its memory and processes are the instance's; `index` is its GPU's).
    pub mig: bool,
}

impl DeviceUsage {
    /// The bytes process `pid` holds on this device; `None` when the driver does not say,
    /// or does not list the process at all. An unlisted process is unknown, not empty: in a
    /// container NVML lists processes by the host's PIDs (or none), so a process that holds
    /// memory may be missing from the list. Callers fall back to the device's used bytes.
    pub fn bytes_of(&self, pid: u32) -> Option<u64> {
        self.processes.iter().find(|(p, _)| *p == pid).and_then(|(_, bytes)| *bytes)
    }
}

/// How NVML names a device a CUDA ordinal refers to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NvmlDevice {
    /// NVML's index (NVML numbers every device of the machine).
    Index(u32),
    /// The device's UUID (`GPU-...`, or `MIG-...` for a MIG instance).
    Uuid(String),
}

/// The NVML device behind CUDA ordinal `ordinal`, given `CUDA_VISIBLE_DEVICES` (`visible`):
/// CUDA numbers only the devices that variable lists, in its order, while NVML numbers all of
/// them, so with `CUDA_VISIBLE_DEVICES=2,3` CUDA's device 0 is NVML's device 2. Entries are
/// indices or UUIDs; as CUDA does, the list ends at the first entry that is neither. `None`
/// when the ordinal is past the list.
pub fn nvml_device_of_cuda_ordinal(ordinal: usize, visible: Option<&str>) -> Option<NvmlDevice> {
    let Some(visible) = visible else {
        return u32::try_from(ordinal).ok().map(NvmlDevice::Index);
    };
    visible
        .split(',')
        .map(str::trim)
        .map_while(|entry| {
            if let Ok(index) = entry.parse::<u32>() {
                Some(NvmlDevice::Index(index))
            } else if entry.starts_with("GPU-") || entry.starts_with("MIG-") {
                Some(NvmlDevice::Uuid(entry.to_owned()))
            } else {
                None
            }
        })
        .nth(ordinal)
}

/// The NVML device a rank on CUDA ordinal `ordinal` reads, and a warning when that is a guess.
///
/// `cuda_uuid` is what the driver says the device is (`cuDeviceGetUuid`, as `GPU-…`): NVML
/// finds it by UUID, whatever the numbering. Without it the ordinal is mapped through
/// `CUDA_VISIBLE_DEVICES` (`visible`, [`nvml_device_of_cuda_ordinal`]), which holds only when
/// CUDA numbers devices as NVML does: in PCI bus order (`CUDA_DEVICE_ORDER=PCI_BUS_ID`, `order`).
/// CUDA's default order is fastest first, so with more than one device to choose from the
/// mapping is then a guess, and the warning says so.
pub fn nvml_device_for(
    ordinal: usize,
    cuda_uuid: Option<&str>,
    visible: Option<&str>,
    order: Option<&str>,
) -> (Option<NvmlDevice>, Option<String>) {
    if let Some(uuid) = cuda_uuid.filter(|u| !u.is_empty()) {
        return (Some(NvmlDevice::Uuid(uuid.to_owned())), None);
    }
    let device = nvml_device_of_cuda_ordinal(ordinal, visible);
    let one_choice = visible.is_some_and(|v| !v.trim().is_empty() && !v.contains(','));
    let pci_order = order.is_some_and(|o| o.trim() == "PCI_BUS_ID");
    let warning = match &device {
        Some(NvmlDevice::Index(index)) if !pci_order && !one_choice => Some(format!(
            "the memory probe reads NVML device {index} for cuda:{ordinal} without knowing the device's UUID; CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so on a machine of mixed GPUs that may be another device"
        )),
        _ => None,
    };
    (device, warning)
}

/// Device memory through NVML (feature `cuda`).
pub struct NvmlMemory {
    #[cfg(feature = "cuda")]
    nvml: nvml_wrapper::Nvml,
}

impl std::fmt::Debug for NvmlMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlMemory").finish_non_exhaustive()
    }
}

#[cfg(feature = "cuda")]
fn nvml_err(op: &str) -> impl FnOnce(nvml_wrapper::error::NvmlError) -> Error + '_ {
    move |e| Error::Nvml { op: op.to_owned(), reason: e.to_string() }
}

impl NvmlMemory {
    /// Loads NVML.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the NVML library (libnvidia-ml) is missing or fails
    /// to initialize; [`Error::NotCompiledWith`] without the `cuda` feature.
    pub fn new() -> Result<NvmlMemory> {
        #[cfg(feature = "cuda")]
        {
            let nvml = nvml_wrapper::Nvml::init().map_err(|e| Error::BackendUnavailable {
                backend: "nvml",
                reason: e.to_string(),
            })?;
            Ok(NvmlMemory { nvml })
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::NotCompiledWith { feature: "cuda" })
        }
    }

    /// The number of devices.
    ///
    /// # Errors
    /// [`Error::Nvml`] when the query fails.
    pub fn device_count(&self) -> Result<u32> {
        #[cfg(feature = "cuda")]
        {
            self.nvml.device_count().map_err(nvml_err("device_count"))
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(Error::NotCompiledWith { feature: "cuda" })
        }
    }

    /// NVML's index of `device`.
    ///
    /// # Errors
    /// [`Error::Nvml`] when no device has that UUID or the query fails.
    pub fn index_of(&self, device: &NvmlDevice) -> Result<u32> {
        match device {
            NvmlDevice::Index(index) => Ok(*index),
            #[cfg(feature = "cuda")]
            NvmlDevice::Uuid(uuid) => self
                .nvml
                .device_by_uuid(uuid.as_str())
                .and_then(|d| d.index())
                .map_err(nvml_err("device_by_uuid")),
            #[cfg(not(feature = "cuda"))]
            NvmlDevice::Uuid(_) => Err(Error::NotCompiledWith { feature: "cuda" }),
        }
    }

    /// Memory use of device `index` and of each compute process on it.
    ///
    /// # Errors
    /// [`Error::Nvml`] when the device does not exist or a query fails.
    pub fn device(&self, index: u32) -> Result<DeviceUsage> {
        self.usage(&NvmlDevice::Index(index))
    }

    /// Memory use of `device` and of each compute process on it. A UUID may name a MIG
    /// instance (`MIG-…`): the reading is then the instance's, not its GPU's. A `GPU-…` UUID
    /// that NVML does not know is tried as `MIG-…` (the driver's `cuDeviceGetUuid` gives a MIG
    /// instance's UUID without saying it is one).
    ///
    /// # Errors
    /// [`Error::Nvml`] when the device does not exist or a query fails.
    pub fn usage(&self, device: &NvmlDevice) -> Result<DeviceUsage> {
        #[cfg(feature = "cuda")]
        {
            use nvml_wrapper::enums::device::UsedGpuMemory;
            let device = match device {
                NvmlDevice::Index(index) => {
                    self.nvml.device_by_index(*index).map_err(nvml_err("device_by_index"))?
                }
                NvmlDevice::Uuid(uuid) => match self.nvml.device_by_uuid(uuid.as_str()) {
                    Ok(d) => d,
                    Err(e) => match uuid.strip_prefix("GPU-") {
                        Some(rest) => self
                            .nvml
                            .device_by_uuid(format!("MIG-{rest}"))
                            .map_err(|_| nvml_err("device_by_uuid")(e))?,
                        None => return Err(nvml_err("device_by_uuid")(e)),
                    },
                },
            };
            let mig = device.mig_is_mig_device_handle().unwrap_or(false);
            let index = if mig {
                device.mig_parent_device().and_then(|p| p.index())
            } else {
                device.index()
            }
            .map_err(nvml_err("index"))?;
            let info = device.memory_info().map_err(nvml_err("memory_info"))?;
            let processes = device
                .running_compute_processes()
                .map_err(nvml_err("running_compute_processes"))?
                .into_iter()
                .map(|p| {
                    let bytes = match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    };
                    (p.pid, bytes)
                })
                .collect();
            Ok(DeviceUsage {
                index,
                total: info.total,
                used: info.used,
                free: info.free,
                processes,
                uuid: device.uuid().ok(),
                mig,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Err(Error::NotCompiledWith { feature: "cuda" })
        }
    }

    /// Memory use of every device.
    ///
    /// # Errors
    /// As [`NvmlMemory::device`].
    pub fn devices(&self) -> Result<Vec<DeviceUsage>> {
        (0..self.device_count()?).map(|i| self.device(i)).collect()
    }
}

#[cfg(test)]
mod tests;
