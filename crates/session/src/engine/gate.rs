//! The engine's side of sleep and wakeup: the [`Gate`] that the control plane closes
//! ([`Quiesce::quiesce`]) to bring this rank's engine to a step boundary before its memory goes
//! away, and opens again ([`Quiesce::resume`]) once the memory is back.
//!
//! Rank 0 decides every step, so quiescing the deployment is rank 0's business: its
//! [`Leader`](super::Leader) polls the gate at each boundary and, per [`QuiesceMode`], stops
//! admitting (`wait`), fails the running requests (`abort`) or keeps them (`keep`), then parks:
//! it runs only idle ticks until the gate opens. A worker only has to finish the step (or the
//! session's model build) it is in: its gate closes as soon as none runs, and a step that
//! arrives while it is closed is a protocol error (its memory may be gone), never a step run
//! over released memory.

use crate::sleep::{Quiesce, QuiesceError, QuiesceMode};
use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

#[derive(Debug, Default)]
struct State {
    /// What the control plane asked for; `None` while the engine may run.
    request: Option<QuiesceMode>,
    /// The engine stands at a step boundary and runs no step until the gate opens.
    parked: bool,
    /// A step or a model build runs on this rank (workers).
    busy: bool,
    /// Tags whose contents do not survive a sleep.
    lossy: BTreeSet<String>,
    /// Tags released while the gate was closed whose contents a wakeup does not bring back.
    lost: BTreeSet<String>,
}

/// The gate between an engine and the control plane (see the module docs). Shared as an
/// `Arc`: the engine holds one end, [`crate::sleep::start`] the other.
#[derive(Debug)]
pub struct Gate {
    state: Mutex<State>,
    changed: Condvar,
    timeout: Duration,
    leader: bool,
}

impl Gate {
    /// The gate of rank 0's engine (`leader`) or a worker's, whose [`Quiesce::quiesce`]
    /// waits at most `timeout` for the engine to reach a step boundary.
    pub(crate) fn new(leader: bool, timeout: Duration) -> Gate {
        Gate { state: Mutex::new(State::default()), changed: Condvar::new(), timeout, leader }
    }

    /// A gate for the engine of `rank`, made before the engine when the control plane must
    /// start first (hand it to the engine with `with_gate`).
    pub fn for_rank(rank: usize, timeout: Duration) -> Arc<Gate> {
        Arc::new(Gate::new(rank == 0, timeout))
    }

    /// Names the tags whose contents do not survive a sleep (restored by discarding or
    /// zeroing). When `kv_cache` is among them and was released, rank 0 recomputes the paused
    /// sequences from their tokens after the wakeup.
    pub fn set_lossy(&self, tags: impl IntoIterator<Item = String>) {
        self.lock().lossy = tags.into_iter().collect();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the control plane asks of the engine now (`None`: run).
    pub(crate) fn request(&self) -> Option<QuiesceMode> {
        self.lock().request
    }

    /// Whether the engine is parked.
    pub fn is_parked(&self) -> bool {
        self.lock().parked
    }

    /// Rank 0 stands at a step boundary with nothing left to run per the request: parked
    /// until the gate opens.
    pub(crate) fn park(&self) {
        let mut s = self.lock();
        if s.request.is_some() {
            s.parked = true;
            self.changed.notify_all();
        }
    }

    /// Waits while the engine is parked, at most `timeout`: returns as soon as the gate opens.
    pub(crate) fn wait_parked(&self, timeout: Duration) {
        let s = self.lock();
        let _ = self
            .changed
            .wait_timeout_while(s, timeout, |s| s.parked)
            .unwrap_or_else(PoisonError::into_inner);
    }

    /// A worker starts a step (or a session's model build: anything that touches the model's
    /// memory). Refused while the gate is closed.
    pub(crate) fn enter_step(&self) -> Result<(), String> {
        let mut s = self.lock();
        if s.parked {
            return Err(
                "rank 0 asked for model work while this rank is quiesced for a sleep".into()
            );
        }
        s.busy = true;
        Ok(())
    }

    /// A worker's step ended (either way).
    pub(crate) fn leave_step(&self) {
        let mut s = self.lock();
        s.busy = false;
        self.changed.notify_all();
    }

    /// Takes whether the contents of the KV cache were lost in a sleep since the last call.
    pub(crate) fn take_kv_lost(&self) -> bool {
        let mut s = self.lock();
        let lost = s.lost.remove(vmm::Tag::KV_CACHE.as_str());
        s.lost.clear();
        lost
    }
}

impl Quiesce for Gate {
    fn quiesce(&self, mode: QuiesceMode) -> Result<(), QuiesceError> {
        let mut s = self.lock();
        if s.parked {
            return Ok(());
        }
        s.request = Some(mode);
        // A worker parks itself as soon as its step ends; rank 0 parks in its loop.
        let (mut s, wait) = self
            .changed
            .wait_timeout_while(s, self.timeout, |s| {
                if !s.parked && !s.busy && s.request.is_some() && !self.leader {
                    s.parked = true;
                }
                !s.parked
            })
            .unwrap_or_else(PoisonError::into_inner);
        if wait.timed_out() && !s.parked {
            s.request = None;
            return Err(QuiesceError::Timeout { mode, waited: self.timeout });
        }
        Ok(())
    }

    fn released(&self, tags: &[String]) {
        let mut s = self.lock();
        let lost: Vec<String> = tags.iter().filter(|t| s.lossy.contains(*t)).cloned().collect();
        s.lost.extend(lost);
    }

    fn weights_changed(&self) {
        // The caches hold keys and values of the old weights: recompute as after a discard.
        self.lock().lost.insert(vmm::Tag::KV_CACHE.as_str().to_owned());
    }

    fn resume(&self) {
        let mut s = self.lock();
        s.request = None;
        s.parked = false;
        self.changed.notify_all();
    }
}
