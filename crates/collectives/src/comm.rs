//! The [`Communicator`] trait every backend implements, its typed front end [`Collective`],
//! and the [`AbortHandle`] that unblocks a rank stuck in a call.

use crate::dtype::{ElemType, Element, ReduceOp};
use crate::error::{Error, Op, Result, Site};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Default deadline of one collective call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A group of ranks that run collectives together.
///
/// Buffers are bytes tagged with a [`ElemType`]; the typed methods of [`Collective`] are the usual
/// way in. Every call has a deadline ([`Communicator::timeout`]); every error names the
/// operation, the group, this rank and the peer involved. A communicator is owned by one thread
/// (`&mut self`); other threads hold only its [`AbortHandle`]. After a failed call the
/// communicator is poisoned and every later call fails at once: a group whose ranks disagree
/// about what happened cannot be trusted with another collective.
///
/// Argument conventions, all lengths in bytes:
/// - `all_gather`: `recv.len() == size * send.len()`, rank `r`'s data at `r * send.len()`.
/// - `all_gather_uneven`: `sizes[r]` bytes from rank `r`, concatenated in rank order;
///   `send.len() == sizes[rank]`.
/// - `reduce_scatter`: `send.len() == size * recv.len()`; rank `r` gets chunk `r` reduced.
/// - `all_to_all`: `send.len() == recv.len() == size * chunk`; chunk `s` of `recv` comes from
///   rank `s`'s chunk `rank`.
pub trait Communicator: Send {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// The group's name, used in errors (for example `tp[cp=0]`).
    fn group(&self) -> &str;
    /// The backend's name (`local`, `shm`, `tcp`, `nccl`).
    fn backend(&self) -> &'static str;
    /// Deadline of one call.
    fn timeout(&self) -> Duration;
    /// Sets the deadline of one call.
    fn set_timeout(&mut self, timeout: Duration);
    /// A handle another thread can use to abort a call in progress.
    fn abort_handle(&self) -> AbortHandle;

    /// What this communicator holds on a device that a sleep can give back (NCCL's buffers),
    /// as a handle another thread releases and restores while this one makes no call (see
    /// [`crate::release`]); `None` for a backend that holds none (the host backends).
    fn device_resources(&self) -> Option<Arc<dyn crate::DeviceResources>> {
        None
    }

    /// Tells the group that this rank failed for `reason`, without blocking: peers waiting
    /// for this rank (now or in their next call) fail with [`Error::PeerFailed`] naming it,
    /// and this communicator is poisoned. A rank whose step failed calls this so that its
    /// peers stop waiting for collectives it will never join.
    fn fail(&mut self, reason: &str);

    /// Element-wise reduction; every rank ends with the same bits.
    ///
    /// # Errors
    /// Timeout, a dead or failed peer, mismatched arguments across ranks, abort.
    fn all_reduce_raw(&mut self, buf: &mut [u8], dtype: ElemType, op: ReduceOp) -> Result<()>;
    /// Concatenation of every rank's `send` of possibly different lengths.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn all_gather_uneven_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        dtype: ElemType,
    ) -> Result<()>;
    /// Reduction followed by a scatter of equal chunks.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn reduce_scatter_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()>;
    /// Copies `root`'s buffer to every rank.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn broadcast_raw(&mut self, buf: &mut [u8], dtype: ElemType, root: usize) -> Result<()>;
    /// Sends to one peer; the peer must `recv` the same number of bytes and dtype.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn send_raw(&mut self, buf: &[u8], dtype: ElemType, peer: usize) -> Result<()>;
    /// Receives from one peer.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn recv_raw(&mut self, buf: &mut [u8], dtype: ElemType, peer: usize) -> Result<()>;
    /// Personalized exchange of equal chunks.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn all_to_all_raw(&mut self, send: &[u8], recv: &mut [u8], dtype: ElemType) -> Result<()>;
    /// Returns when every rank has entered the barrier.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn barrier(&mut self) -> Result<()>;

    /// The CUDA device whose memory [`Communicator::all_reduce_device_ptr`] reduces in place,
    /// for a backend that works on device buffers (NCCL); `None` for the host backends.
    fn cuda_device(&self) -> Option<usize> {
        None
    }

    /// In-place all-reduce of the `dtype` elements of `buf`, which must be on
    /// [`Communicator::cuda_device`]; returns when the reduction has completed.
    ///
    /// # Safety
    /// `buf` is live memory of the device it names, and no other work reads or writes it until
    /// this returns.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] on a backend without device buffers; a buffer on another
    /// device than the group's; otherwise as [`Communicator::all_reduce_raw`].
    unsafe fn all_reduce_device_ptr(
        &mut self,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let _ = (buf, dtype, op);
        Err(check::host_memory_only(self.backend(), self.group()))
    }

    /// Queues an in-place all-reduce of the `dtype` elements of `buf` on the caller's CUDA
    /// `stream`, after the work already queued there, and returns once the backend has
    /// accepted it, before it completes: work queued on `stream` afterwards reads the sums,
    /// with no host round trip between. A communicator keeps one such reduction in flight: this
    /// first waits for the previous one (as [`Communicator::wait_device`] does), so the host
    /// runs at most one reduction ahead of the device.
    ///
    /// # Safety
    /// `buf` is live memory of the device it names, and `stream` a live stream of that
    /// device's primary context; until the reduction has completed, only work queued on
    /// `stream` after this call touches `buf` (a host copy that waits for the stream is such
    /// work), and `buf` is not freed other than in `stream`'s order.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_device_ptr`]; a stream of another device.
    unsafe fn all_reduce_device_enqueue(
        &mut self,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
        stream: DeviceStream,
    ) -> Result<()> {
        let _ = (buf, dtype, op, stream);
        Err(check::host_memory_only(self.backend(), self.group()))
    }

    /// Waits until the reduction queued by [`Communicator::all_reduce_device_enqueue`], if one
    /// is in flight, has completed, within the call deadline counted from its enqueue, and
    /// with the failure detection of every other call (a peer's published failure, the
    /// backend's asynchronous errors, an abort). Returns at once when none is in flight, and
    /// always on a backend without device buffers. A caller must wait through this before it
    /// blocks on the stream by other means: only this wait has a deadline that names a peer.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn wait_device(&mut self) -> Result<()> {
        Ok(())
    }

    /// Equal-size all-gather.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    fn all_gather_raw(&mut self, send: &[u8], recv: &mut [u8], dtype: ElemType) -> Result<()> {
        let sizes = vec![send.len(); self.size()];
        self.all_gather_uneven_raw(send, recv, &sizes, dtype)
    }
}

/// A range of device memory as a device API names it: its address (a `CUdeviceptr`), its
/// length in bytes, and the CUDA device (ordinal) it belongs to. Making one is safe and
/// dereferences nothing; the `unsafe` call it is given to is where the caller vouches for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    /// The device address of the first byte.
    pub addr: u64,
    /// The length in bytes.
    pub bytes: usize,
    /// The CUDA device ordinal.
    pub device: usize,
}

/// A CUDA stream as the driver names it (a `CUstream`, the same handle as a `cudaStream_t`),
/// and the device (ordinal) whose primary context it belongs to. Making one is safe and
/// dereferences nothing; the `unsafe` call it is given to is where the caller vouches for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStream {
    /// The stream handle, as an integer.
    pub raw: usize,
    /// The CUDA device ordinal.
    pub device: usize,
}

/// Typed collectives over [`Element`] slices, for every [`Communicator`].
pub trait Collective: Communicator {
    /// See [`Communicator::all_reduce_raw`].
    ///
    /// # Errors
    /// As the raw call.
    fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_raw(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }
    /// See [`Communicator::all_gather_raw`].
    ///
    /// # Errors
    /// As the raw call.
    fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_gather_raw(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), T::DTYPE)
    }
    /// See [`Communicator::all_gather_uneven_raw`]; `sizes` in elements.
    ///
    /// # Errors
    /// As the raw call.
    fn all_gather_uneven<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        sizes: &[usize],
    ) -> Result<()> {
        let bytes: Vec<usize> = sizes.iter().map(|s| s * size_of::<T>()).collect();
        self.all_gather_uneven_raw(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            &bytes,
            T::DTYPE,
        )
    }
    /// See [`Communicator::reduce_scatter_raw`].
    ///
    /// # Errors
    /// As the raw call.
    fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_raw(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }
    /// See [`Communicator::broadcast_raw`].
    ///
    /// # Errors
    /// As the raw call.
    fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_raw(bytemuck::cast_slice_mut(buf), T::DTYPE, root)
    }
    /// See [`Communicator::send_raw`].
    ///
    /// # Errors
    /// As the raw call.
    fn send<T: Element>(&mut self, buf: &[T], peer: usize) -> Result<()> {
        self.send_raw(bytemuck::cast_slice(buf), T::DTYPE, peer)
    }
    /// See [`Communicator::recv_raw`].
    ///
    /// # Errors
    /// As the raw call.
    fn recv<T: Element>(&mut self, buf: &mut [T], peer: usize) -> Result<()> {
        self.recv_raw(bytemuck::cast_slice_mut(buf), T::DTYPE, peer)
    }
    /// See [`Communicator::all_to_all_raw`].
    ///
    /// # Errors
    /// As the raw call.
    fn all_to_all<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all_raw(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv), T::DTYPE)
    }
}

impl<C: Communicator + ?Sized> Collective for C {}

/// Unblocks a rank stuck in a collective, from another thread (a watchdog, a signal handler
/// thread, the control plane). Aborting poisons the communicator: the call in progress and
/// every later one return [`Error::Aborted`].
#[derive(Clone, Default)]
pub struct AbortHandle {
    inner: Arc<AbortInner>,
}

#[derive(Default)]
struct AbortInner {
    aborted: AtomicBool,
    /// Backend hooks that wake a blocked call (a futex wake, a socket shutdown).
    wakers: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl AbortHandle {
    /// Aborts: sets the flag and wakes the blocked call.
    pub fn abort(&self) {
        self.inner.aborted.store(true, Ordering::SeqCst);
        let wakers = self.inner.wakers.lock().unwrap_or_else(|e| e.into_inner());
        for wake in wakers.iter() {
            wake();
        }
    }

    /// Whether [`AbortHandle::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.inner.aborted.load(Ordering::SeqCst)
    }

    /// Registers a hook that wakes a blocked call of the owning backend.
    pub(crate) fn on_abort(&self, wake: impl Fn() + Send + Sync + 'static) {
        self.inner.wakers.lock().unwrap_or_else(|e| e.into_inner()).push(Box::new(wake));
    }
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortHandle").field("aborted", &self.is_aborted()).finish()
    }
}

/// Checks shared by every backend, so arguments are refused the same way everywhere.
pub(crate) mod check {
    use super::*;

    pub(crate) fn invalid(at: &Site, reason: impl Into<String>) -> Error {
        Error::InvalidArgument { at: at.clone(), reason: reason.into() }
    }

    /// The refusal of a device-buffer call by `backend`, whose `group` reduces host memory.
    pub(crate) fn host_memory_only(backend: &'static str, group: &str) -> Error {
        Error::BackendUnavailable {
            backend,
            reason: format!("the {group} group reduces host memory, not device buffers"),
        }
    }

    /// `buf` holds whole, aligned elements of `dtype`.
    pub(crate) fn elements(at: &Site, name: &str, buf: &[u8], dtype: ElemType) -> Result<()> {
        device_elements(at, name, buf.len(), dtype)?;
        if !(buf.as_ptr() as usize).is_multiple_of(dtype.size()) {
            return Err(invalid(at, format!("{name} is not aligned for {dtype}")));
        }
        Ok(())
    }

    /// `len` bytes (of a buffer this process cannot see) are whole elements of `dtype`.
    pub(crate) fn device_elements(
        at: &Site,
        name: &str,
        len: usize,
        dtype: ElemType,
    ) -> Result<()> {
        if !len.is_multiple_of(dtype.size()) {
            return Err(invalid(
                at,
                format!("{name} has {len} bytes, not a whole number of {dtype} elements"),
            ));
        }
        Ok(())
    }

    /// The buffers of an all-to-all: equal, and split into one whole chunk per rank.
    pub(crate) fn exchanged(at: &Site, send: &[u8], recv: &[u8], dtype: ElemType) -> Result<()> {
        if send.len() != recv.len() || !send.len().is_multiple_of(at.size * dtype.size()) {
            return Err(invalid(
                at,
                format!(
                    "send ({} bytes) and receive ({} bytes) must be equal and split into {} \
                     whole {dtype} chunks",
                    send.len(),
                    recv.len(),
                    at.size
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn rank(at: &Site, what: &str, r: usize) -> Result<()> {
        if r >= at.size {
            return Err(invalid(at, format!("{what} {r} is not in a group of {} ranks", at.size)));
        }
        Ok(())
    }

    pub(crate) fn peer(at: &Site, peer: usize) -> Result<()> {
        rank(at, "peer rank", peer)?;
        if peer == at.rank {
            return Err(invalid(at, format!("peer rank {peer} is this rank")));
        }
        Ok(())
    }

    pub(crate) fn gather(
        at: &Site,
        send: &[u8],
        recv: &[u8],
        sizes: &[usize],
        dtype: ElemType,
    ) -> Result<()> {
        elements(at, "send buffer", send, dtype)?;
        elements(at, "receive buffer", recv, dtype)?;
        if sizes.len() != at.size {
            return Err(invalid(at, format!("{} sizes for {} ranks", sizes.len(), at.size)));
        }
        if let Some(r) = sizes.iter().position(|s| s % dtype.size() != 0) {
            return Err(invalid(
                at,
                format!("size of rank {r} ({} bytes) is not whole {dtype} elements", sizes[r]),
            ));
        }
        if send.len() != sizes[at.rank] {
            return Err(invalid(
                at,
                format!(
                    "send buffer has {} bytes but sizes[{}] is {}",
                    send.len(),
                    at.rank,
                    sizes[at.rank]
                ),
            ));
        }
        let total: usize = sizes.iter().sum();
        if recv.len() != total {
            return Err(invalid(
                at,
                format!("receive buffer has {} bytes, the sizes add up to {total}", recv.len()),
            ));
        }
        Ok(())
    }

    /// `big.len() == size * small.len()` for reduce_scatter / all_to_all.
    pub(crate) fn chunked(at: &Site, big: &[u8], small_len: usize, what: &str) -> Result<()> {
        if big.len() != at.size * small_len {
            return Err(invalid(
                at,
                format!("{what}: {} bytes is not {} ranks x {small_len} bytes", big.len(), at.size),
            ));
        }
        Ok(())
    }

    pub(crate) fn site(op: Op, group: &Arc<str>, rank: usize, size: usize) -> Site {
        Site { op, group: group.clone(), rank, size }
    }
}
