//! Which communication backend each axis of the mesh uses, chosen independently per axis
//! (for example NCCL for TP, shared memory for CP, TCP for the control group).
//!
//! Which to use where: ranks on one host, `shm`; CPU ranks on several hosts, `mpi` (OpenMPI's
//! transports, InfiniBand or EFA included, under `mpirun`) or `tcp` (no MPI needed); GPUs,
//! `nccl` for the data axes.

use std::fmt;
use std::str::FromStr;

use crate::device::Device;
use crate::error::{Error, Result};

/// A communication backend of the collectives crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommBackend {
    /// Threads of one process (tests).
    Local,
    /// Processes on one host, through shared memory.
    Shm,
    /// Processes on any hosts, through TCP.
    Tcp,
    /// CUDA devices, through NCCL (feature `cuda`).
    Nccl,
    /// Processes started by `mpirun`, through the system's MPI library (feature `mpi`).
    Mpi,
}

impl CommBackend {
    /// Every backend, in the order of [`CommBackend::name`]'s documentation.
    pub const ALL: [CommBackend; 5] = [
        CommBackend::Local,
        CommBackend::Shm,
        CommBackend::Tcp,
        CommBackend::Nccl,
        CommBackend::Mpi,
    ];

    /// The backend's name: `local`, `shm`, `tcp`, `nccl` or `mpi`.
    pub fn name(self) -> &'static str {
        match self {
            CommBackend::Local => "local",
            CommBackend::Shm => "shm",
            CommBackend::Tcp => "tcp",
            CommBackend::Nccl => "nccl",
            CommBackend::Mpi => "mpi",
        }
    }
}

impl fmt::Display for CommBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CommBackend {
    type Err = Error;

    fn from_str(s: &str) -> Result<CommBackend> {
        CommBackend::ALL.into_iter().find(|b| b.name() == s.trim()).ok_or_else(|| Error::Parse {
            what: "backend",
            value: s.to_owned(),
            expected: "local, shm, tcp, nccl or mpi",
        })
    }
}

/// The backend of each communicator a rank creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AxisBackends {
    /// Tensor-parallel group (all-reduce of row-parallel outputs).
    pub tp: CommBackend,
    /// Context-parallel group (K/V gathers, log-sum-exp merges).
    pub cp: CommBackend,
    /// The control group (step agreement, sleep/wakeup): host-side messages only.
    pub control: CommBackend,
}

impl Default for AxisBackends {
    /// Shared memory on every axis: CPU ranks on one host.
    fn default() -> AxisBackends {
        AxisBackends { tp: CommBackend::Shm, cp: CommBackend::Shm, control: CommBackend::Shm }
    }
}

impl AxisBackends {
    /// Threads of one process on every axis, for tests; [`AxisBackends::validate`] refuses it.
    pub fn local() -> AxisBackends {
        AxisBackends { tp: CommBackend::Local, cp: CommBackend::Local, control: CommBackend::Local }
    }

    /// The usual choice: NCCL for the data axes on CUDA, shared memory on one host, TCP across
    /// hosts; the control group never uses NCCL.
    pub fn for_device(device: Device, single_host: bool) -> AxisBackends {
        let host = if single_host { CommBackend::Shm } else { CommBackend::Tcp };
        let data = match device {
            Device::Cuda(_) => CommBackend::Nccl,
            Device::Cpu => host,
        };
        AxisBackends { tp: data, cp: data, control: host }
    }

    /// The axes with their names, `tp`, `cp`, `control`.
    pub fn axes(&self) -> [(&'static str, CommBackend); 3] {
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
                CommBackend::Nccl if axis == "control" => Some(
                    "cannot carry control messages: they are host-side; use tcp or shm".to_owned(),
                ),
                CommBackend::Nccl if device == Device::Cpu => {
                    Some("needs a CUDA device but this rank runs on cpu; use shm or tcp".to_owned())
                }
                CommBackend::Shm if !same_host => Some(
                    "needs every rank on one host but the ranks span several hosts; use tcp"
                        .to_owned(),
                ),
                CommBackend::Local => Some(
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
