//! Device mesh arithmetic, rendezvous, the TCP key-value store and device ownership.
//!
//! Everything here is agreed on by every rank without communication (pure arithmetic over the
//! world size and the layout) or exchanged once at start-up through the store.
//!
//! - [`rendezvous`]: who this process is ([`Rendezvous`]), read from the torchrun, Slurm or
//!   OpenMPI environment.
//! - [`store`]: the TCP key-value [`Store`] that rank 0 hosts ([`StoreServer`],
//!   [`rendezvous_store`]).
//! - [`failpoint`]: named fault-injection points (feature `failpoints`).
#![forbid(unsafe_code)]

mod error;
pub mod failpoint;
pub mod rendezvous;
pub mod store;

pub use error::{Error, Result};
pub use rendezvous::Rendezvous;
pub use store::{rendezvous_store, Store, StoreServer};
