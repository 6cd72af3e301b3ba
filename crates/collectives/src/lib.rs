//! Communicators for the tensor-parallel, context-parallel and control groups of a mesh.
//!
//! [`Communicator`] is the interface every backend implements (byte buffers tagged with a
//! [`ElemType`]); [`Collective`] adds typed methods over `f32`, `f16`, `bf16`, `i64` and `u8`
//! slices. Backends:
//!
//! - [`local`]: threads of one process (tests);
//! - [`shm`]: processes on one host, through one shared-memory segment per group;
//! - [`tcp`]: processes on any hosts, ring algorithms over TCP;
//! - `nccl` (feature `cuda`): NVIDIA GPUs;
//! - [`mpi`] (feature `mpi`): processes started by `mpirun`, through the system's MPI library;
//! - [`Solo`]: a group of one rank (arguments still checked), for code that runs unsharded.
//!
//! Every call has a deadline; every error names the operation, the group, this rank and the
//! peer at fault; an [`AbortHandle`] unblocks a call from another thread.

mod call;
mod comm;
mod common;
mod dtype;
mod error;
mod group;
pub mod local;
pub mod mpi;
pub mod nccl;
pub mod release;
pub mod shm;
mod solo;
pub mod tcp;
#[cfg(any(not(feature = "cuda"), not(feature = "mpi")))]
mod unavailable;

pub use comm::{AbortHandle, Collective, Communicator, DeviceRange, DeviceStream, DEFAULT_TIMEOUT};
pub use dtype::{ElemType, Element, ReduceOp};
pub use error::{Error, Op, Result, Site};
pub use group::{init_parallel, init_parallel_with, InitOptions, ParallelContext, World};
pub use mpi::MpiComm;
pub use release::DeviceResources;
pub use shm::{ShmComm, ShmOptions};
pub use solo::Solo;
pub use tcp::TcpComm;
#[cfg(test)]
mod tests;
