//! The watchdog: the loop that waits for NCCL under the deadline, the abort handle and the
//! peers' published failures, and what failing does (publish, then `ncclCommAbort`).

use super::library::describe;
use super::{cuda_err, NcclCommunicator};
use crate::common::blamed;
use crate::error::{Error, Result, Site};
use cudarc::nccl::sys;
use mesh::Store;
use std::time::{Duration, Instant};

/// How long a wait spins before it starts sleeping: collectives of a decode step take tens of
/// microseconds, and a sleep costs about as much.
const SPIN: Duration = Duration::from_micros(200);
/// Longest sleep between two polls, so the abort handle and the deadline are noticed promptly.
const MAX_NAP: Duration = Duration::from_millis(1);
/// When a wait first looks at the group's failure key, and how often after that: a store
/// round trip is cheap, but not free.
const STORE_FIRST: Duration = Duration::from_millis(20);
const STORE_EVERY: Duration = Duration::from_millis(100);

impl NcclCommunicator {
    pub(super) fn publish(&self, word: u32) {
        if let Some(f) = &self.fail_key {
            if let Err(e) = f.store.set(&f.key, format!("{}:{word}", self.core.rank).as_bytes()) {
                tracing::warn!(group = %self.core.group, rank = self.core.rank, "could not publish a failure: {e}");
            }
        }
    }

    pub(super) fn abort_comm(&mut self) {
        let raw = self.shared.take_comm().0;
        if !raw.is_null() {
            // SAFETY: `raw` is this communicator's live handle, used by no other thread (see
            // `RawComm`; the sleep's handle touches it only while no call is inside the lease,
            // and this runs in a call or in the owner's drop), and never used again: the
            // shared slot is null from here on.
            let code = unsafe { sys::ncclCommAbort(raw) };
            if code != sys::ncclResult_t::ncclSuccess {
                tracing::warn!(group = %self.core.group, rank = self.core.rank, "ncclCommAbort: {code:?}");
            }
        }
    }

    /// NCCL's asynchronous state: `Ok(true)` when idle, `Ok(false)` while an operation is still
    /// being set up or enqueued (`ncclInProgress`), an error when NCCL failed.
    fn async_state(&self, at: &Site) -> Result<bool> {
        let raw = self.raw();
        if raw.is_null() {
            return Err(Error::Aborted { at: at.clone() });
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is live (not null) and used only by this thread; `state` is valid.
        let code = unsafe { sys::ncclCommGetAsyncError(raw, &mut state) };
        let failed = |call, code| Error::Nccl { at: at.clone(), call, reason: describe(code, raw) };
        match (code, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => Ok(true),
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => Ok(false),
            (sys::ncclResult_t::ncclSuccess, state) => Err(failed("operation", state)),
            (code, _) => Err(failed("ncclCommGetAsyncError", code)),
        }
    }

    /// The watchdog: polls until NCCL is idle and `ready` says so, failing on an NCCL error,
    /// abort, a peer's published failure, or the deadline.
    pub(super) fn wait(
        &self,
        at: &Site,
        start: Instant,
        deadline: Instant,
        mut ready: impl FnMut(&Self) -> Result<bool>,
    ) -> Result<()> {
        let mut nap = Duration::from_micros(20);
        let mut next_store = start + STORE_FIRST;
        loop {
            if self.async_state(at)? && ready(self)? {
                return Ok(());
            }
            if self.core.abort.is_aborted() {
                return Err(Error::Aborted { at: at.clone() });
            }
            let now = Instant::now();
            if now >= next_store {
                if let Some(f) = &self.fail_key {
                    if let Some(e) = peer_failure(&f.store, &f.key, at, self.core.rank, now - start)
                    {
                        return Err(e);
                    }
                }
                next_store = now + STORE_EVERY;
            }
            if now >= deadline {
                return Err(Error::Timeout {
                    at: at.clone(),
                    elapsed: now - start,
                    waiting_for: self.others(),
                });
            }
            if now - start < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(MAX_NAP);
            }
        }
    }

    /// Runs one NCCL operation: `enqueue` issues its calls on the communicator's stream; then
    /// waits for it under the watchdog.
    pub(super) fn run(
        &mut self,
        at: &Site,
        enqueue: impl FnOnce(&Self) -> std::result::Result<(), (&'static str, sys::ncclResult_t)>,
    ) -> Result<()> {
        let start = Instant::now();
        let deadline = start + self.core.timeout;
        self.accept(at, start, deadline, enqueue)?;
        self.done.record(&self.stream).map_err(cuda_err(at, "cuEventRecord"))?;
        self.wait(at, start, deadline, |me| {
            me.done.try_is_complete().map_err(cuda_err(at, "cuEventQuery"))
        })
    }

    /// Issues `enqueue`'s calls and waits until NCCL has accepted them (a non-blocking
    /// communicator may still be enqueuing when its calls return).
    pub(super) fn accept(
        &mut self,
        at: &Site,
        start: Instant,
        deadline: Instant,
        enqueue: impl FnOnce(&Self) -> std::result::Result<(), (&'static str, sys::ncclResult_t)>,
    ) -> Result<()> {
        if let Err((call, code)) = enqueue(self) {
            return Err(Error::Nccl { at: at.clone(), call, reason: describe(code, self.raw()) });
        }
        self.wait(at, start, deadline, |_| Ok(true))
    }

    /// Waits, under the watchdog, for the reduction queued on a caller's stream, if one is
    /// in flight: within the call deadline counted from its enqueue.
    pub(super) fn settle(&mut self, at: &Site) -> Result<()> {
        let Some(since) = self.in_flight else { return Ok(()) };
        self.wait(at, since, since + self.core.timeout, |me| {
            me.done.try_is_complete().map_err(cuda_err(at, "cuEventQuery"))
        })?;
        self.in_flight = None;
        Ok(())
    }
}

/// The error a peer's published failure means for this rank, if the group's failure key is set.
pub(super) fn peer_failure(
    store: &Store,
    key: &str,
    at: &Site,
    me: usize,
    elapsed: Duration,
) -> Option<Error> {
    let value = store.get(key).ok().flatten()?;
    let text = String::from_utf8_lossy(&value);
    let (reporter, word) = text.split_once(':')?;
    let (reporter, word) = (reporter.parse::<usize>().ok()?, word.parse::<u32>().ok()?);
    if reporter == me {
        return None;
    }
    blamed(word, at, reporter, |_| 0, elapsed)
}
