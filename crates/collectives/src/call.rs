//! One call lifecycle for every backend.
//!
//! A backend is a [`Transport`]: how its bytes move and how it tells its peers that it failed.
//! What a communicator is whatever moves its bytes lives in its [`GroupCore`] (rank, size,
//! group name, deadline, abort handle, poison), and the one [`Communicator`] implementation
//! below runs every call the same way, so failure behaviour cannot drift between backends:
//!
//! 1. refuse at once when poisoned or aborted ([`GroupCore::begin`]), before touching anything;
//! 2. the backend's per-call entry ([`Transport::enter`]: NCCL binds its CUDA context, TCP
//!    counts the collective);
//! 3. check the arguments against the conventions of [`Communicator`] (`comm::check`), so
//!    every backend refuses the same bad call with the same words;
//! 4. move the data ([`Transport`]'s method for the operation), within the call's deadline;
//! 5. on any error from 2-4, poison the communicator (the first error is kept as the cause of
//!    every later refusal) and let the backend tell its peers ([`Transport::publish_failure`]).

use crate::comm::{check, AbortHandle, Communicator, DeviceRange, DeviceStream};
use crate::dtype::{ElemType, ReduceOp};
use crate::error::{Error, Op, Result, Site};
use crate::release::{DeviceResources, Lease};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The state every communicator has, whatever its backend.
#[derive(Debug)]
pub(crate) struct GroupCore {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) group: Arc<str>,
    pub(crate) timeout: Duration,
    pub(crate) abort: AbortHandle,
    /// Why the communicator refuses every call: the first failure's message.
    poisoned: Option<String>,
}

impl GroupCore {
    /// Rank `rank` of a healthy group of `size` named `group`, with `timeout` per call.
    pub(crate) fn new(group: Arc<str>, rank: usize, size: usize, timeout: Duration) -> GroupCore {
        GroupCore { rank, size, group, timeout, abort: AbortHandle::default(), poisoned: None }
    }

    /// Where a call of `op` runs, for its errors.
    pub(crate) fn site(&self, op: Op) -> Site {
        check::site(op, &self.group, self.rank, self.size)
    }

    /// Starts a call of `op`: its site and deadline, or the refusal of a poisoned or aborted
    /// communicator.
    ///
    /// # Errors
    /// [`Error::Poisoned`] after an earlier failure, [`Error::Aborted`] after an abort.
    pub(crate) fn begin(&self, op: Op) -> Result<(Site, Instant)> {
        let at = self.site(op);
        if let Some(cause) = &self.poisoned {
            return Err(Error::Poisoned { at, cause: cause.clone() });
        }
        if self.abort.is_aborted() {
            return Err(Error::Aborted { at });
        }
        Ok((at, Instant::now() + self.timeout))
    }

    /// Records `cause` unless the communicator is poisoned already; true when this poisoned it.
    pub(crate) fn poison(&mut self, cause: String) -> bool {
        if self.poisoned.is_some() {
            return false;
        }
        self.poisoned = Some(cause);
        true
    }
}

/// The part of a communicator a backend writes. Each data method gets the call's [`Site`]
/// and deadline, with the arguments already checked (step 3 of the module docs); an error it
/// returns poisons the communicator.
pub(crate) trait Transport: Send {
    /// The shared state.
    fn core(&self) -> &GroupCore;
    /// The shared state, to change the deadline or poison it.
    fn core_mut(&mut self) -> &mut GroupCore;
    /// The backend's name (`local`, `shm`, `tcp`, `nccl`, `solo`).
    fn backend(&self) -> &'static str;

    /// Tells the peers that this rank's call failed with `error`, so none of them waits for
    /// it; `first` is whether this failure poisoned the communicator (a backend may tell its
    /// peers only once).
    fn publish_failure(&mut self, error: &Error, first: bool);

    /// Work every call does once the core accepted it, before its arguments are checked. A
    /// backend with a reduction in flight ([`Transport::device_in_flight`]) waits for it here,
    /// within its deadline, so no two operations of a communicator overlap on the device.
    ///
    /// # Errors
    /// As the call.
    fn enter(&mut self, at: &Site) -> Result<()> {
        let _ = at;
        Ok(())
    }

    /// See [`Communicator::all_reduce_raw`].
    fn all_reduce(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()>;
    /// See [`Communicator::all_gather_uneven_raw`] (and the equal-size all-gather).
    fn all_gather(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        dtype: ElemType,
    ) -> Result<()>;
    /// See [`Communicator::reduce_scatter_raw`].
    fn reduce_scatter(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()>;
    /// See [`Communicator::broadcast_raw`].
    fn broadcast(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        root: usize,
    ) -> Result<()>;
    /// See [`Communicator::send_raw`].
    fn send(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &[u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()>;
    /// See [`Communicator::recv_raw`].
    fn recv(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()>;
    /// See [`Communicator::all_to_all_raw`].
    fn all_to_all(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
    ) -> Result<()>;
    /// See [`Communicator::barrier`].
    fn barrier(&mut self, at: &Site, deadline: Instant) -> Result<()>;

    /// See [`Communicator::cuda_device`]; a backend with device buffers also implements
    /// [`Transport::all_reduce_device`].
    fn cuda_device(&self) -> Option<usize> {
        None
    }

    /// See [`Communicator::all_reduce_device_ptr`]; called only when
    /// [`Transport::cuda_device`] is `Some`.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_device_ptr`].
    unsafe fn all_reduce_device(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let _ = (deadline, buf, dtype, op);
        Err(check::invalid(at, "this backend has no device buffers"))
    }

    /// See [`Communicator::all_reduce_device_enqueue`]; called only when
    /// [`Transport::cuda_device`] is `Some`, with the buffer and stream checked to be on it.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_device_enqueue`].
    unsafe fn all_reduce_device_enqueue(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
        stream: DeviceStream,
    ) -> Result<()> {
        let _ = (deadline, buf, dtype, op, stream);
        Err(check::invalid(at, "this backend has no device buffers"))
    }

    /// Whether a reduction queued by [`Transport::all_reduce_device_enqueue`] has not been
    /// waited for ([`Transport::enter`] waits for it).
    fn device_in_flight(&self) -> bool {
        false
    }

    /// The lease every call enters, for a backend whose device resources can be released
    /// from another thread ([`Transport::device_resources`]); `None` for the others.
    fn lease(&self) -> Option<Arc<Lease>> {
        None
    }

    /// See [`Communicator::device_resources`].
    fn device_resources(&self) -> Option<Arc<dyn DeviceResources>> {
        None
    }
}

/// Runs one call of `op` through the lifecycle of the module docs: `body` checks the
/// arguments and moves the data.
///
/// # Errors
/// The refusal of a poisoned or aborted communicator, or what `body` (or the entry) returns.
pub(crate) fn run<T: Transport + ?Sized, R>(
    t: &mut T,
    op: Op,
    body: impl FnOnce(&mut T, &Site, Instant) -> Result<R>,
) -> Result<R> {
    let (at, deadline) = t.core().begin(op)?;
    // A communicator whose device resources can be released: the call holds them for its
    // duration, or is refused (without poisoning) while they are released.
    let lease = t.lease();
    let _inside = match &lease {
        Some(lease) => Some(lease.enter().map_err(|_| Error::Released { at: at.clone() })?),
        None => None,
    };
    let result = t.enter(&at).and_then(|()| body(t, &at, deadline));
    finish(t, result)
}

/// Ends a call: an error poisons the communicator and is published to the peers.
pub(crate) fn finish<T: Transport + ?Sized, R>(t: &mut T, result: Result<R>) -> Result<R> {
    if let Err(e) = &result {
        let first = t.core_mut().poison(e.to_string());
        t.publish_failure(e, first);
    }
    result
}

/// The CUDA device `t` reduces device buffers on, or the refusal of a host backend (made
/// without a call: a host group is still usable for host buffers).
fn device_of<T: Transport + ?Sized>(t: &T) -> Result<usize> {
    t.cuda_device().ok_or_else(|| check::host_memory_only(t.backend(), &t.core().group))
}

/// Refuses `what` on device `on` when the group works on `device`.
fn on_group_device(at: &Site, what: &str, on: usize, device: usize) -> Result<()> {
    if on == device {
        return Ok(());
    }
    Err(check::invalid(
        at,
        format!("the {what} is on cuda:{on}, this group works on cuda:{device}"),
    ))
}

impl<T: Transport> Communicator for T {
    fn rank(&self) -> usize {
        self.core().rank
    }
    fn size(&self) -> usize {
        self.core().size
    }
    fn group(&self) -> &str {
        &self.core().group
    }
    fn backend(&self) -> &'static str {
        Transport::backend(self)
    }
    fn timeout(&self) -> Duration {
        self.core().timeout
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.core_mut().timeout = timeout;
    }
    fn abort_handle(&self) -> AbortHandle {
        self.core().abort.clone()
    }

    fn device_resources(&self) -> Option<Arc<dyn DeviceResources>> {
        Transport::device_resources(self)
    }

    fn fail(&mut self, reason: &str) {
        let at = self.core().site(Op::Barrier);
        let _ =
            finish::<T, ()>(self, Err(check::invalid(&at, format!("this rank failed: {reason}"))));
    }

    fn all_reduce_raw(&mut self, buf: &mut [u8], dtype: ElemType, op: ReduceOp) -> Result<()> {
        run(self, Op::AllReduce, |t, at, deadline| {
            check::elements(at, "buffer", buf, dtype)?;
            t.all_reduce(at, deadline, buf, dtype, op)
        })
    }

    fn all_gather_uneven_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        dtype: ElemType,
    ) -> Result<()> {
        run(self, Op::AllGatherUneven, |t, at, deadline| {
            check::gather(at, send, recv, sizes, dtype)?;
            t.all_gather(at, deadline, send, recv, sizes, dtype)
        })
    }

    fn all_gather_raw(&mut self, send: &[u8], recv: &mut [u8], dtype: ElemType) -> Result<()> {
        run(self, Op::AllGather, |t, at, deadline| {
            let sizes = vec![send.len(); at.size];
            check::gather(at, send, recv, &sizes, dtype)?;
            t.all_gather(at, deadline, send, recv, &sizes, dtype)
        })
    }

    fn reduce_scatter_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        run(self, Op::ReduceScatter, |t, at, deadline| {
            check::elements(at, "send buffer", send, dtype)?;
            check::elements(at, "receive buffer", recv, dtype)?;
            check::chunked(at, send, recv.len(), "send buffer")?;
            t.reduce_scatter(at, deadline, send, recv, dtype, op)
        })
    }

    fn broadcast_raw(&mut self, buf: &mut [u8], dtype: ElemType, root: usize) -> Result<()> {
        run(self, Op::Broadcast, |t, at, deadline| {
            check::elements(at, "buffer", buf, dtype)?;
            check::rank(at, "root", root)?;
            t.broadcast(at, deadline, buf, dtype, root)
        })
    }

    fn send_raw(&mut self, buf: &[u8], dtype: ElemType, peer: usize) -> Result<()> {
        run(self, Op::Send, |t, at, deadline| {
            check::peer(at, peer)?;
            check::elements(at, "buffer", buf, dtype)?;
            t.send(at, deadline, buf, dtype, peer)
        })
    }

    fn recv_raw(&mut self, buf: &mut [u8], dtype: ElemType, peer: usize) -> Result<()> {
        run(self, Op::Recv, |t, at, deadline| {
            check::peer(at, peer)?;
            check::elements(at, "buffer", buf, dtype)?;
            t.recv(at, deadline, buf, dtype, peer)
        })
    }

    fn all_to_all_raw(&mut self, send: &[u8], recv: &mut [u8], dtype: ElemType) -> Result<()> {
        run(self, Op::AllToAll, |t, at, deadline| {
            check::elements(at, "send buffer", send, dtype)?;
            check::elements(at, "receive buffer", recv, dtype)?;
            check::exchanged(at, send, recv, dtype)?;
            t.all_to_all(at, deadline, send, recv, dtype)
        })
    }

    fn barrier(&mut self) -> Result<()> {
        run(self, Op::Barrier, |t, at, deadline| t.barrier(at, deadline))
    }

    fn cuda_device(&self) -> Option<usize> {
        Transport::cuda_device(self)
    }

    unsafe fn all_reduce_device_ptr(
        &mut self,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let device = device_of(self)?;
        run(self, Op::AllReduce, |t, at, deadline| {
            on_group_device(at, "buffer", buf.device, device)?;
            check::device_elements(at, "buffer", buf.bytes, dtype)?;
            // SAFETY: forwarded from this function's own contract; the buffer is on this
            // group's device (checked above).
            unsafe { t.all_reduce_device(at, deadline, buf, dtype, op) }
        })
    }

    unsafe fn all_reduce_device_enqueue(
        &mut self,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
        stream: DeviceStream,
    ) -> Result<()> {
        let device = device_of(self)?;
        run(self, Op::AllReduce, |t, at, deadline| {
            on_group_device(at, "buffer", buf.device, device)?;
            on_group_device(at, "stream", stream.device, device)?;
            check::device_elements(at, "buffer", buf.bytes, dtype)?;
            // SAFETY: forwarded from this function's own contract; the buffer and the stream
            // are on this group's device (checked above).
            unsafe { t.all_reduce_device_enqueue(at, deadline, buf, dtype, op, stream) }
        })
    }

    fn wait_device(&mut self) -> Result<()> {
        if !Transport::device_in_flight(self) {
            return Ok(());
        }
        // Every call's entry waits for the reduction in flight: a call with nothing to do.
        run(self, Op::AllReduce, |_, _, _| Ok(()))
    }
}
