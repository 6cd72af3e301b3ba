//! Device mesh arithmetic, rendezvous, the TCP key-value store and device ownership.
//!
//! Everything here is agreed on by every rank without communication (pure arithmetic over the
//! world size and the layout) or exchanged once at start-up through the store.
//!
//! - [`layout`]: the TP x CP [`DeviceMesh`] ([`plan_mesh`], TP innermost:
//!   `rank = cp_rank * tp + tp_rank`), its groups, and the [`TokenShard`] of each CP rank
//!   ([`balanced_ranges`]).
//! - [`backend`]: the communication [`CommBackend`] of each axis ([`AxisBackends`]).
//! - [`rendezvous`]: who this process is ([`Rendezvous`]), read from the torchrun, Slurm or
//!   OpenMPI environment.
//! - [`store`]: the TCP key-value [`Store`] that rank 0 hosts ([`StoreServer`],
//!   [`rendezvous_store`]).
//! - [`device`]: the [`Device`] a rank owns (`LOCAL_RANK` picks the GPU).
//! - [`failpoint`]: named fault-injection points (feature `failpoints`).
// One driver call has no safe binding (`device::cuda`, `cuCtxGetDevice`): it allows unsafe
// code for itself with its safety argument; nothing else may.
#![deny(unsafe_code)]

pub mod backend;
pub mod device;
mod error;
pub mod failpoint;
pub mod layout;
pub mod rendezvous;
pub mod store;

pub use backend::{AxisBackends, CommBackend};
pub use device::{cuda_driver, CudaProbe, Device, DeviceMemory, DriverProbe};
pub use error::{Error, Result};
pub use layout::{balanced_ranges, plan_mesh, DeviceMesh, MeshShape, TokenShard};
pub use rendezvous::Rendezvous;
pub use store::{rendezvous_store, Store, StoreServer};
