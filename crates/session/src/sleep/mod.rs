//! Multi-rank sleep and wakeup: a two-phase commit over a dedicated control channel, with
//! rollback and per-rank memory receipts.
//!
//! Rank 0 runs the [`Coordinator`]; every other rank runs a listener thread ([`listener`]).
//! The control channel ([`transport`]; [`transport::tcp`] between processes) is created
//! collectively at start-up, before worker threads run, and is separate from the data plane
//! and from the step agreement, so a missed ACK here never poisons a model communicator.
//!
//! `Coordinator::sleep(tags)` / `wakeup(tags)`:
//!
//! 1. take the sleep/wakeup lock ([`OpLock`]; concurrent callers are serialized; a single
//!    rank too);
//! 2. quiesce rank 0's engine at a step boundary ([`Quiesce`], [`QuiesceMode`]);
//! 3. PREPARE `{op_id, action, tags}` to every peer, all frames sent before any ACK is
//!    awaited; a peer quiesces, checks the tags and ACKs without touching memory;
//! 4. drain the PREPARE ACKs within the ACK timeout, keeping only those whose `op_id` and
//!    phase match (stale or wrong-phase frames are dropped and logged);
//! 5. run the local operation, then COMMIT to the prepared peers, which run it and ACK with
//!    `{status, error, op_id, phase, receipt}`;
//! 6. a failure before memory changed anywhere: ABORT to the prepared peers, drain their
//!    ACKs ([`Outcome::Aborted`]); a peer records an ABORT that overtakes its PREPARE and
//!    drops that PREPARE when it comes;
//! 7. a failure after some ranks changed memory: ROLLBACK on those ranks (release is undone
//!    by a materialize from the backups, which vmm keeps until then) and raise
//!    ([`Outcome::RolledBack`]); if a rollback fails, every listener is told to stop and the
//!    deployment is failed ([`Outcome::FailStop`]) rather than left half asleep;
//! 8. one aggregate [`Error`] lists every failing rank, its phase and its message.
//!
//! Frames ([`Message`]) are a 4-byte little-endian length then JSON:
//! `{"op_id":3,"phase":"commit","action":"sleep","tags":["weights"],"mode":"wait",
//! "status":"ok","error":null,"receipt":{...}}`.
//!
//! Receipts ([`OpReceipt`]) hold, per rank and per tag, the bytes released or restored, the
//! rank's memory probe before and after (resident host memory; NVML bytes of the process on a
//! GPU) and the time taken. With [`OpOptions::verify`], a sleep fails (and is rolled back)
//! when any single rank's probe dropped by less than 90% of the bytes it released (less 1 MiB
//! of probe noise, [`VERIFY_SLACK`]), so one rank's leak is never hidden by another rank's
//! release; ranks whose device readings are the whole device's (the driver does not list
//! their processes) are verified together per physical device, matched by UUID
//! (`sleep::verify`).
//!
//! Requests around a sleep are the engine's business, through [`Quiesce`] (see
//! [`quiesce`] for what each mode must do).

mod coordinator;
mod error;
pub mod listener;
pub mod lock;
mod memory;
mod message;
pub mod quiesce;
pub mod transport;
mod verify;
mod version;

pub use coordinator::{
    Coordinator, CoordinatorOptions, DeploymentState, DeploymentStatus, OpOptions, OpReceipt,
    VERIFY_FRACTION, VERIFY_SLACK,
};
pub use error::{Error, Outcome, RankFailure, Result};
pub use listener::{ListenerExit, ListenerHandle};
pub use lock::{LocalLock, OpLock};
pub use memory::{MemoryError, NoMemory, RankMemory, Refusal, VmmMemory};
pub use message::{Action, Message, Phase, Probe, RankReceipt, Status, TagReceipt};
pub use quiesce::{Idle, Quiesce, QuiesceError, QuiesceMode};
pub use transport::{LinkError, ReadError};
pub use version::{WeightUpdate, WeightVersion};

use std::sync::Arc;
use std::time::Duration;

/// This rank's end of the control plane, as [`start`] returns it.
#[derive(Debug)]
pub enum ControlPlane {
    /// Rank 0.
    Coordinator(Box<Coordinator>),
    /// Every other rank: the listener thread.
    Listener(ListenerHandle),
}

/// Creates the TCP control channel collectively (every rank calls it at start-up, before its
/// worker threads run) and starts this rank's side: the coordinator on rank 0, a listener
/// thread elsewhere. `bind_host` is the address rank 0 listens on (reachable by the peers).
///
/// # Errors
/// [`Error::Channel`] when the channel cannot be set up within `timeout`.
#[allow(clippy::too_many_arguments)]
pub fn start(
    store: &mesh::Store,
    rank: usize,
    world: usize,
    bind_host: &str,
    memory: Arc<dyn RankMemory>,
    engine: Arc<dyn Quiesce>,
    opts: CoordinatorOptions,
    timeout: Duration,
) -> Result<ControlPlane> {
    match transport::tcp::connect(store, rank, world, bind_host, timeout)? {
        transport::tcp::Endpoint::Coordinator(link) => {
            Ok(ControlPlane::Coordinator(Box::new(Coordinator::new(link, memory, engine, opts))))
        }
        transport::tcp::Endpoint::Peer(link) => {
            listener::spawn(rank, link, memory, engine).map(ControlPlane::Listener)
        }
    }
}

#[cfg(test)]
mod tests;
