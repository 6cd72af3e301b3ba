//! The NCCL handle a communicator shares with a sleep ([`DeviceResources`]): released by
//! finalizing and destroying the NCCL communicator (its buffers, channels and proxy threads
//! go), restored by a new rendezvous of the group through the store and a new NCCL
//! communicator in its place. Calls enter the [`Lease`] meanwhile (see [`crate::release`]).

use super::library::describe;
use super::{cuda_err, start_init, RawComm};
use crate::comm::check;
use crate::error::{Error, Op, Result, Site};
use crate::nccl::NcclId;
use crate::release::{DeviceResources, Lease};
use cudarc::driver::CudaContext;
use cudarc::nccl::sys;
use mesh::Store;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How a released communicator meets its group again: a store connection of its own and the
/// group's key prefix, under which each wakeup's unique id gets a key of its own.
pub(super) struct Rejoin {
    store: Store,
    prefix: String,
    /// Restores so far (the same count on every member: they release and restore together).
    wakes: AtomicU64,
}

impl Rejoin {
    pub(super) fn new(store: Store, prefix: &str) -> Rejoin {
        Rejoin { store, prefix: prefix.to_owned(), wakes: AtomicU64::new(0) }
    }
}

/// What a [`super::NcclCommunicator`] shares with its sleep handle.
pub(super) struct Shared {
    comm: Mutex<RawComm>,
    lease: Arc<Lease>,
    rejoin: Option<Rejoin>,
    group: Arc<str>,
    rank: usize,
    size: usize,
    device: usize,
    timeout: Duration,
    /// The communicator was dropped: a restore would make an NCCL communicator nobody uses.
    gone: AtomicBool,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclResources")
            .field("group", &self.group)
            .field("rank", &self.rank)
            .field("released", &self.lease.is_taken())
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn new(
        comm: RawComm,
        rejoin: Option<Rejoin>,
        (group, rank, size): (Arc<str>, usize, usize),
        device: usize,
        timeout: Duration,
    ) -> Shared {
        Shared {
            comm: Mutex::new(comm),
            lease: Arc::default(),
            rejoin,
            group,
            rank,
            size,
            device,
            timeout,
            gone: AtomicBool::new(false),
        }
    }

    /// The live NCCL handle (null once aborted or released).
    pub(super) fn raw(&self) -> sys::ncclComm_t {
        self.slot().0
    }

    /// Takes the NCCL handle out, leaving null.
    pub(super) fn take_comm(&self) -> RawComm {
        RawComm(std::mem::replace(&mut self.slot().0, std::ptr::null_mut()))
    }

    /// Whether a restore can meet the group again (the communicator was made through a store).
    pub(super) fn rejoins(&self) -> bool {
        self.rejoin.is_some()
    }

    /// The lease the communicator's calls enter.
    pub(super) fn lease(&self) -> Arc<Lease> {
        self.lease.clone()
    }

    /// The communicator is gone (dropped).
    pub(super) fn owner_gone(&self) {
        self.gone.store(true, Ordering::SeqCst);
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, RawComm> {
        self.comm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn site(&self) -> Site {
        check::site(Op::Setup, &self.group, self.rank, self.size)
    }

    /// Makes the device's context current on this thread (NCCL works on the current device).
    fn bind(&self, at: &Site) -> Result<()> {
        let ctx =
            CudaContext::new(self.device).map_err(cuda_err(at, "cuDevicePrimaryCtxRetain"))?;
        ctx.bind_to_thread().map_err(cuda_err(at, "cuCtxSetCurrent"))
    }

    /// This wakeup's unique id: made and published by the group's rank 0, awaited by the others.
    fn rendezvous(&self, at: &Site, rejoin: &Rejoin) -> Result<NcclId> {
        let wake = rejoin.wakes.fetch_add(1, Ordering::SeqCst) + 1;
        let key = format!("{}/wake-{wake}/nccl-id", rejoin.prefix);
        if self.rank == 0 {
            let id = NcclId::new()?;
            rejoin.store.set(&key, id.as_bytes())?;
            return Ok(id);
        }
        let bytes = rejoin.store.wait(&[&key], self.timeout).map_err(|e| match e {
            mesh::Error::StoreTimeout { .. } => {
                Error::Timeout { at: at.clone(), elapsed: self.timeout, waiting_for: vec![0] }
            }
            other => other.into(),
        })?;
        let bytes = bytes.into_iter().next().unwrap_or_default();
        NcclId::from_bytes(&bytes).ok_or_else(|| {
            check::invalid(
                at,
                format!("store key {key} holds {} bytes, not an NCCL id", bytes.len()),
            )
        })
    }
}

/// Waits for `call` on `raw`, which returned `code` (non-blocking: success or in progress
/// go on in the background): polls NCCL's asynchronous state until it is no longer in
/// progress, or `deadline`. Any other code is the call's failure.
fn settle(
    at: &Site,
    raw: sys::ncclComm_t,
    (call, code): (&'static str, sys::ncclResult_t),
    deadline: Instant,
) -> Result<()> {
    if !matches!(code, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
        return Err(Error::Nccl { at: at.clone(), call, reason: describe(code, raw) });
    }
    let start = Instant::now();
    loop {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live handle (made or finalized by the caller, not yet destroyed)
        // that no other thread uses (the lease is taken); `state` is a live local.
        let code = unsafe { sys::ncclCommGetAsyncError(raw, &mut state) };
        match (code, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => return Ok(()),
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => {}
            (sys::ncclResult_t::ncclSuccess, failed) | (failed, _) => {
                return Err(Error::Nccl { at: at.clone(), call, reason: describe(failed, raw) })
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                at: at.clone(),
                elapsed: now - start,
                waiting_for: Vec::new(),
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Aborts `raw` (a handle nobody else uses), logging a failure.
fn abort(raw: sys::ncclComm_t, group: &str) {
    // SAFETY: the caller owns `raw`, a live handle used by no other thread, and never uses it
    // again.
    let code = unsafe { sys::ncclCommAbort(raw) };
    if code != sys::ncclResult_t::ncclSuccess {
        tracing::warn!(group, "ncclCommAbort: {code:?}");
    }
}

impl DeviceResources for Shared {
    fn group(&self) -> &str {
        &self.group
    }

    fn release(&self) -> Result<()> {
        let at = self.site();
        if self.lease.is_taken() {
            // Released already: nothing is held.
            return Ok(());
        }
        self.lease
            .take()
            .map_err(|_| check::invalid(&at, "a collective call of the group is in progress"))?;
        // The device first: a failure to reach it leaves the handle where it was and lets
        // calls in again, instead of losing the handle.
        if let Err(e) = self.bind(&at) {
            self.lease.give_back();
            return Err(e);
        }
        let raw = self.take_comm().0;
        if raw.is_null() {
            // Aborted after a failure: nothing is held.
            return Ok(());
        }
        // Finalize (every operation issued so far completes, the network resources go), then
        // destroy. A teardown that fails is an abort, which frees the memory all the same.
        // SAFETY: `raw` was taken out of the shared slot: no call can reach it (the lease is
        // taken) and nothing else will.
        let code = unsafe { sys::ncclCommFinalize(raw) };
        let deadline = Instant::now() + self.timeout;
        match settle(&at, raw, ("ncclCommFinalize", code), deadline) {
            Ok(()) => {
                // SAFETY: as above; `raw` is finalized and never used after this.
                let code = unsafe { sys::ncclCommDestroy(raw) };
                if code != sys::ncclResult_t::ncclSuccess {
                    tracing::warn!(group = %self.group, rank = self.rank, "ncclCommDestroy: {code:?}");
                }
            }
            Err(e) => {
                tracing::warn!(group = %self.group, rank = self.rank, "releasing NCCL's memory: {e}; aborting the communicator instead");
                abort(raw, &self.group);
            }
        }
        Ok(())
    }

    fn restore(&self) -> Result<()> {
        if !self.lease.is_taken() {
            return Ok(());
        }
        let at = self.site();
        if self.gone.load(Ordering::SeqCst) {
            return Err(check::invalid(&at, "the communicator is gone"));
        }
        let Some(rejoin) = &self.rejoin else {
            return Err(check::invalid(
                &at,
                "made without a store, it cannot meet its group again",
            ));
        };
        let id = self.rendezvous(&at, rejoin)?;
        self.bind(&at)?;
        let (Ok(nranks), Ok(myrank)) = (i32::try_from(self.size), i32::try_from(self.rank)) else {
            return Err(check::invalid(
                &at,
                format!("a group of {} ranks is too large", self.size),
            ));
        };
        let (raw, code) = start_init(&id, nranks, myrank);
        let deadline = Instant::now() + self.timeout;
        if let Err(e) = settle(&at, raw, ("ncclCommInitRankConfig", code), deadline) {
            if !raw.is_null() {
                abort(raw, &self.group);
            }
            return Err(e);
        }
        *self.slot() = RawComm(raw);
        self.lease.give_back();
        Ok(())
    }

    fn is_released(&self) -> bool {
        self.lease.is_taken()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The communicator aborts its handle when dropped; one made by a restore after that
        // is aborted here.
        let raw = self.take_comm().0;
        if !raw.is_null() {
            abort(raw, &self.group);
        }
    }
}
