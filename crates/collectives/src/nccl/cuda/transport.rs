//! The [`Transport`] impl: the host API, staged through the device buffer, and failing and
//! entering a call as the shared call machinery asks.

use super::{cuda_err, DevPtr, NcclCommunicator};
use crate::call::{GroupCore, Transport};
use crate::comm::{DeviceRange, DeviceStream};
use crate::common::blame_word;
use crate::dtype::{ElemType, ReduceOp};
use crate::error::{Error, Result, Site};
use crate::release::{DeviceResources, Lease};
use cudarc::driver::result as cu;
use cudarc::nccl::sys;
use std::sync::Arc;
use std::time::Instant;

impl Transport for NcclCommunicator {
    fn core(&self) -> &GroupCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        &mut self.core
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }

    /// Once: the failure published through the store (unless it came from a peer, or is a
    /// timeout every rank sees by itself), then the NCCL communicator aborted, which stops any
    /// kernel of it still running.
    fn publish_failure(&mut self, error: &Error, first: bool) {
        if !first {
            return;
        }
        let from_peer = matches!(error, Error::PeerFailed { .. } | Error::PeerDied { .. });
        if !from_peer && !matches!(error, Error::Timeout { .. }) {
            self.publish(blame_word(error, self.core.rank));
        }
        self.abort_comm();
    }

    /// Makes this communicator's CUDA context current on the calling thread, and waits for a
    /// reduction still in flight on a caller's stream (`settle`): the operations of one
    /// communicator never overlap on the device, whichever streams they were queued on.
    fn enter(&mut self, at: &Site) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(cuda_err(at, "cuCtxSetCurrent"))?;
        self.settle(at)
    }

    fn cuda_device(&self) -> Option<usize> {
        Some(self.device)
    }

    fn lease(&self) -> Option<Arc<Lease>> {
        Some(self.shared.lease())
    }

    /// The NCCL communicator, released by finalizing and destroying it and restored by a new
    /// rendezvous through the store (`sleep`); none for one made without a store.
    fn device_resources(&self) -> Option<Arc<dyn DeviceResources>> {
        let shared: Arc<dyn DeviceResources> = self.shared.clone();
        self.shared.rejoins().then_some(shared)
    }

    unsafe fn all_reduce_device(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let (ptr, bytes) = (buf.addr, buf.bytes);
        // SAFETY: the caller guarantees `bytes` bytes of this device at `ptr`, untouched by
        // other work until the reduction (waited for by `run`) completes.
        self.run(at, |me| unsafe {
            me.enqueue_all_reduce((ptr, ptr), bytes / dtype.size(), (dtype, op), me.cu_stream())
        })
    }

    unsafe fn all_reduce_device_enqueue(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
        stream: DeviceStream,
    ) -> Result<()> {
        let start = Instant::now();
        let (ptr, count) = (buf.addr, buf.bytes / dtype.size());
        let raw = stream.raw as sys::cudaStream_t;
        // SAFETY: the caller guarantees `buf` on this device and `stream` a live stream of
        // it, with only the stream's own work touching `buf` until the reduction completes
        // (`settle`, from the next call's `enter`).
        self.accept(at, start, deadline, |me| unsafe {
            me.enqueue_all_reduce((ptr, ptr), count, (dtype, op), raw)
        })?;
        // SAFETY: `done` is this communicator's event, of this device's primary context, as
        // the caller guarantees `stream` is.
        unsafe { cu::event::record(self.done.cu_event(), stream.raw as _) }
            .map_err(cuda_err(at, "cuEventRecord"))?;
        self.in_flight = Some(start);
        Ok(())
    }

    fn device_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    fn all_reduce(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        self.upload(at, dev, buf)?;
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe {
            me.enqueue_all_reduce((dev, dev), buf.len() / dtype.size(), (dtype, op), me.cu_stream())
        })?;
        self.download(at, buf, dev)?;
        self.sync(at)
    }

    fn all_gather(
        &mut self,
        at: &Site,
        _deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        _dtype: ElemType,
    ) -> Result<()> {
        // NCCL gathers equal shards: pad each to the widest, drop the padding after.
        let width = sizes.iter().copied().max().unwrap_or(0);
        let dev = self.staging(at, width * (self.core.size + 1))?;
        let out = dev + width as DevPtr;
        self.upload(at, dev, send)?;
        // SAFETY: the staging buffer holds `width` bytes at `dev` and `size * width` after.
        self.run(at, |me| unsafe { me.enqueue_all_gather(dev, out, width) })?;
        let mut off = 0;
        for (r, &n) in sizes.iter().enumerate() {
            let src = out + (r * width) as DevPtr;
            self.download(at, &mut recv[off..off + n], src)?;
            off += n;
        }
        self.sync(at)
    }

    fn reduce_scatter(
        &mut self,
        at: &Site,
        _deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let dev = self.staging(at, send.len() + recv.len())?;
        let out = dev + send.len() as DevPtr;
        self.upload(at, dev, send)?;
        let count = recv.len() / dtype.size();
        // SAFETY: `size * count` elements at `dev`, `count` at `out`.
        self.run(at, |me| unsafe { me.enqueue_reduce_scatter((dev, out), count, (dtype, op)) })?;
        self.download(at, recv, out)?;
        self.sync(at)
    }

    fn broadcast(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &mut [u8],
        _dtype: ElemType,
        root: usize,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        if self.core.rank == root {
            self.upload(at, dev, buf)?;
        }
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe { me.enqueue_broadcast(dev, buf.len(), root) })?;
        if self.core.rank != root {
            self.download(at, buf, dev)?;
        }
        self.sync(at)
    }

    fn send(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &[u8],
        _dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        self.upload(at, dev, buf)?;
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe { me.enqueue_send(dev, buf.len(), peer) })
            .map_err(|e| name_peer(e, peer))
    }

    fn recv(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &mut [u8],
        _dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe { me.enqueue_recv(dev, buf.len(), peer) })
            .and_then(|()| self.download(at, buf, dev))
            .and_then(|()| self.sync(at))
            .map_err(|e| name_peer(e, peer))
    }

    fn all_to_all(
        &mut self,
        at: &Site,
        _deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        _dtype: ElemType,
    ) -> Result<()> {
        let chunk = send.len() / self.core.size;
        let dev = self.staging(at, 2 * send.len())?;
        let out = dev + send.len() as DevPtr;
        self.upload(at, dev, send)?;
        // SAFETY: `size * chunk` bytes at `dev` and at `out`.
        self.run(at, |me| unsafe { me.enqueue_all_to_all(dev, out, chunk) })?;
        self.download(at, recv, out)?;
        self.sync(at)
    }

    fn barrier(&mut self, at: &Site, _deadline: Instant) -> Result<()> {
        let dev = self.staging(at, 1)?;
        // SAFETY: the staging buffer holds at least one byte at `dev`; its value is irrelevant.
        self.run(at, |me| unsafe {
            me.enqueue_all_reduce((dev, dev), 1, (ElemType::U8, ReduceOp::Max), me.cu_stream())
        })?;
        self.sync(at)
    }
}

/// A timeout of a send or receive waits for exactly one peer.
pub(super) fn name_peer(e: Error, peer: usize) -> Error {
    match e {
        Error::Timeout { at, elapsed, .. } => {
            Error::Timeout { at, elapsed, waiting_for: vec![peer] }
        }
        e => e,
    }
}
