//! Which communication backend each axis of the mesh uses, chosen independently per axis
//! (for example NCCL for TP, shared memory for CP, TCP for the control group).

use std::fmt;
use std::str::FromStr;

use crate::device::Device;
use crate::error::{Error, Result};

/// A communication backend of the collectives crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Threads of one process (tests).
    Local,
    /// Processes on one host, through shared memory.
    Shm,
    /// Processes on any hosts, through TCP.
    Tcp,
    /// CUDA devices, through NCCL (feature `cuda`).
    Nccl,
}

impl Backend {
    /// Every backend, in the order of [`Backend::name`]'s documentation.
    pub const ALL: [Backend; 4] = [Backend::Local, Backend::Shm, Backend::Tcp, Backend::Nccl];

    /// The backend's name: `local`, `shm`, `tcp` or `nccl`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
            Backend::Nccl => "nccl",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == s.trim()).ok_or_else(|| Error::Parse {
            what: "backend",
            value: s.to_owned(),
            expected: "local, shm, tcp or nccl",
        })
    }
}

/// The backend of each communicator a rank creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AxisBackends {
    /// Tensor-parallel group (all-reduce of row-parallel outputs).
    pub tp: Backend,
    /// Context-parallel group (K/V gathers, log-sum-exp merges).
    pub cp: Backend,
    /// The control group (step agreement, sleep/wakeup): host-side messages only.
    pub control: Backend,
}

impl Default for AxisBackends {
    /// Shared memory on every axis: CPU ranks on one host.
    fn default() -> AxisBackends {
        AxisBackends { tp: Backend::Shm, cp: Backend::Shm, control: Backend::Shm }
    }
}

impl AxisBackends {
    /// Threads of one process on every axis, for tests; [`AxisBackends::validate`] refuses it.
    pub fn local() -> AxisBackends {
        AxisBackends { tp: Backend::Local, cp: Backend::Local, control: Backend::Local }
    }

    /// The usual choice: NCCL for the data axes on CUDA, shared memory on one host, TCP across
    /// hosts; the control group never uses NCCL.
    pub fn for_device(device: Device, single_host: bool) -> AxisBackends {
        let host = if single_host { Backend::Shm } else { Backend::Tcp };
        let data = match device {
            Device::Cuda(_) => Backend::Nccl,
            Device::Cpu => host,
        };
        AxisBackends { tp: data, cp: data, control: host }
    }

    /// The axes with their names, `tp`, `cp`, `control`.
    pub fn axes(&self) -> [(&'static str, Backend); 3] {
        [("tp", self.tp), ("cp", self.cp), ("control", self.control)]
    }

    /// Checks that every axis's backend works for processes on `device`, with all ranks on one
    /// host when `same_host`.
    ///
    /// # Errors
    /// [`Error::InvalidBackend`] naming the first axis that cannot work: `nccl` without a CUDA
    /// device or on the control axis, `shm` across hosts, `local` (threads only) anywhere.
    pub fn validate(&self, device: Device, same_host: bool) -> Result<()> {
        for (axis, backend) in self.axes() {
            let reason = match backend {
                Backend::Nccl if axis == "control" => Some(
                    "cannot carry control messages: they are host-side; use tcp or shm".to_owned(),
                ),
                Backend::Nccl if device == Device::Cpu => {
                    Some("needs a CUDA device but this rank runs on cpu; use shm or tcp".to_owned())
                }
                Backend::Shm if !same_host => Some(
                    "needs every rank on one host but the ranks span several hosts; use tcp"
                        .to_owned(),
                ),
                Backend::Local => Some(
                    "connects threads of one process (tests) and cannot connect rank processes"
                        .to_owned(),
                ),
                _ => None,
            };
            if let Some(reason) = reason {
                return Err(Error::InvalidBackend { axis, backend, reason });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
