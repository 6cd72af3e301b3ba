//! The device entry points: the NCCL operations on cudarc buffers already on the
//! communicator's device, for the CUDA tensor backend.

use super::transport::name_peer;
use super::NcclCommunicator;
use crate::call;
use crate::comm::check;
#[cfg(doc)]
use crate::comm::Communicator;
use crate::dtype::{ElemType, ReduceOp};
use crate::error::{Op, Result, Site};
use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Device entry points: the same operations on buffers already on this communicator's device,
/// for the CUDA tensor backend. Each returns when the operation has completed (the same
/// watchdog as the host API); lengths are in bytes, as in [`Communicator`].
impl NcclCommunicator {
    fn device_call(
        &mut self,
        op: Op,
        body: impl FnOnce(&mut Self, &Site) -> Result<()>,
    ) -> Result<()> {
        call::run(self, op, |me, at, _| body(me, at))
    }

    /// In-place all-reduce of `buf`, which holds elements of `dtype` on this device.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    pub fn all_reduce_device(
        &mut self,
        buf: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        self.device_call(Op::AllReduce, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe {
                me.enqueue_all_reduce((ptr, ptr), len / dtype.size(), (dtype, op), me.cu_stream())
            })
        })
    }

    /// Equal all-gather: `recv` gets every rank's `send` in rank order
    /// (`recv.len() == size * send.len()`).
    ///
    /// # Errors
    /// As [`Communicator::all_gather_raw`].
    pub fn all_gather_device(
        &mut self,
        send: &impl DevicePtr<u8>,
        recv: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
    ) -> Result<()> {
        self.device_call(Op::AllGather, |me, at| {
            let (n, total) = (send.len(), recv.len());
            check::device_elements(at, "send buffer", n, dtype)?;
            if total != n * me.core.size {
                return Err(check::invalid(
                    at,
                    format!("receive buffer has {total} bytes, not {} ranks x {n}", me.core.size),
                ));
            }
            let stream = me.stream.clone();
            let (src, _s) = send.device_ptr(&stream);
            let (dst, _d) = recv.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees the sizes checked above while the guards live.
            me.run(at, |me| unsafe { me.enqueue_all_gather(src, dst, n) })
        })
    }

    /// Reduce-scatter: rank `r` gets chunk `r` of the reduction
    /// (`send.len() == size * recv.len()`).
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter_raw`].
    pub fn reduce_scatter_device(
        &mut self,
        send: &impl DevicePtr<u8>,
        recv: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        self.device_call(Op::ReduceScatter, |me, at| {
            let (total, n) = (send.len(), recv.len());
            check::device_elements(at, "receive buffer", n, dtype)?;
            if total != n * me.core.size {
                return Err(check::invalid(
                    at,
                    format!("send buffer: {total} bytes is not {} ranks x {n} bytes", me.core.size),
                ));
            }
            let stream = me.stream.clone();
            let (src, _s) = send.device_ptr(&stream);
            let (dst, _d) = recv.device_ptr_mut(&stream);
            let count = n / dtype.size();
            // SAFETY: cudarc guarantees the sizes checked above while the guards live.
            me.run(at, |me| unsafe { me.enqueue_reduce_scatter((src, dst), count, (dtype, op)) })
        })
    }

    /// Copies `root`'s `buf` to every rank, in place.
    ///
    /// # Errors
    /// As [`Communicator::broadcast_raw`].
    pub fn broadcast_device(
        &mut self,
        buf: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        root: usize,
    ) -> Result<()> {
        self.device_call(Op::Broadcast, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            check::rank(at, "root", root)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe { me.enqueue_broadcast(ptr, len, root) })
        })
    }

    /// Sends `buf` to `peer`, which receives it with [`NcclCommunicator::recv_device`] or
    /// [`Communicator::recv_raw`].
    ///
    /// # Errors
    /// As [`Communicator::send_raw`].
    pub fn send_device(
        &mut self,
        buf: &impl DevicePtr<u8>,
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        self.device_call(Op::Send, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            check::peer(at, peer)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe { me.enqueue_send(ptr, len, peer) })
                .map_err(|e| name_peer(e, peer))
        })
    }

    /// Receives `buf` from `peer`.
    ///
    /// # Errors
    /// As [`Communicator::recv_raw`].
    pub fn recv_device(
        &mut self,
        buf: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        self.device_call(Op::Recv, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            check::peer(at, peer)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe { me.enqueue_recv(ptr, len, peer) })
                .map_err(|e| name_peer(e, peer))
        })
    }
}
