//! The enqueue half of each NCCL operation on device addresses, through cudarc's NCCL result
//! layer, and the mapping of element types and reductions to NCCL's.

use super::{DevPtr, NcclCommunicator};
use crate::dtype::{ElemType, ReduceOp};
use cudarc::nccl::result::{self, NcclError, NcclStatus};
use cudarc::nccl::sys;

fn nccl_type(dtype: ElemType) -> sys::ncclDataType_t {
    match dtype {
        ElemType::U8 => sys::ncclDataType_t::ncclUint8,
        ElemType::F32 => sys::ncclDataType_t::ncclFloat32,
        ElemType::F16 => sys::ncclDataType_t::ncclFloat16,
        ElemType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        ElemType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// What an enqueue gives `run`: the NCCL call and its code when it failed.
type Enqueued = std::result::Result<(), (&'static str, sys::ncclResult_t)>;

/// An NCCL call's result as `run` wants it (in progress counts as queued: the communicator
/// is non-blocking and the watchdog polls it).
fn ok(call: &'static str, result: std::result::Result<NcclStatus, NcclError>) -> Enqueued {
    result.map(drop).map_err(|NcclError(code)| (call, code))
}

/// The enqueue half of each operation, on device addresses. All `unsafe`: the addresses must
/// be valid for the sizes given, on the communicator's device.
impl NcclCommunicator {
    /// # Safety
    /// `src` and `dst` hold `count` elements of `dtype` on this communicator's device, and
    /// `stream` is a live stream of it (its own, [`NcclCommunicator::cu_stream`], or a
    /// caller's).
    pub(super) unsafe fn enqueue_all_reduce(
        &self,
        (src, dst): (DevPtr, DevPtr),
        count: usize,
        (dtype, op): (ElemType, ReduceOp),
        stream: sys::cudaStream_t,
    ) -> Enqueued {
        let (ty, op) = (nccl_type(dtype), nccl_op(op));
        // SAFETY: per this function's contract.
        let r =
            unsafe { result::all_reduce(src as _, dst as _, count, ty, op, self.raw(), stream) };
        ok("ncclAllReduce", r)
    }

    /// # Safety
    /// `src` holds `bytes`, `dst` `size * bytes` on this communicator's device.
    pub(super) unsafe fn enqueue_all_gather(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    ) -> Enqueued {
        let (ty, stream) = (sys::ncclDataType_t::ncclUint8, self.cu_stream());
        // SAFETY: per this function's contract.
        let r = unsafe { result::all_gather(src as _, dst as _, bytes, ty, self.raw(), stream) };
        ok("ncclAllGather", r)
    }

    /// # Safety
    /// `src` holds `size * count`, `dst` `count` elements of `dtype` on this device.
    pub(super) unsafe fn enqueue_reduce_scatter(
        &self,
        (src, dst): (DevPtr, DevPtr),
        count: usize,
        (dtype, op): (ElemType, ReduceOp),
    ) -> Enqueued {
        let (ty, op, comm, stream) = (nccl_type(dtype), nccl_op(op), self.raw(), self.cu_stream());
        // SAFETY: per this function's contract.
        let r = unsafe { result::reduce_scatter(src as _, dst as _, count, ty, op, comm, stream) };
        ok("ncclReduceScatter", r)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    pub(super) unsafe fn enqueue_broadcast(
        &self,
        buf: DevPtr,
        bytes: usize,
        root: usize,
    ) -> Enqueued {
        let (ty, comm, stream) = (sys::ncclDataType_t::ncclUint8, self.raw(), self.cu_stream());
        // SAFETY: per this function's contract; in place, as NCCL allows.
        let r =
            unsafe { result::broadcast(buf as _, buf as _, bytes, ty, root as i32, comm, stream) };
        ok("ncclBroadcast", r)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    pub(super) unsafe fn enqueue_send(&self, buf: DevPtr, bytes: usize, peer: usize) -> Enqueued {
        let (ty, comm, stream) = (sys::ncclDataType_t::ncclUint8, self.raw(), self.cu_stream());
        // SAFETY: per this function's contract.
        let r = unsafe { result::send(buf as _, bytes, ty, peer as i32, comm, stream) };
        ok("ncclSend", r)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    pub(super) unsafe fn enqueue_recv(&self, buf: DevPtr, bytes: usize, peer: usize) -> Enqueued {
        let (ty, comm, stream) = (sys::ncclDataType_t::ncclUint8, self.raw(), self.cu_stream());
        // SAFETY: per this function's contract.
        let r = unsafe { result::recv(buf as _, bytes, ty, peer as i32, comm, stream) };
        ok("ncclRecv", r)
    }

    /// # Safety
    /// `src` and `dst` hold `size * chunk` bytes on this device.
    pub(super) unsafe fn enqueue_all_to_all(
        &self,
        src: DevPtr,
        dst: DevPtr,
        chunk: usize,
    ) -> Enqueued {
        ok("ncclGroupStart", result::group_start())?;
        let mut queued = Ok(());
        for peer in 0..self.core.size {
            let off = (peer * chunk) as DevPtr;
            // SAFETY: chunk `peer` of each buffer is in bounds per this function's contract.
            queued = unsafe { self.enqueue_send(src + off, chunk, peer) }
                .and_then(|()| unsafe { self.enqueue_recv(dst + off, chunk, peer) });
            if queued.is_err() {
                break;
            }
        }
        // The group is closed even after a failed call, so NCCL's group state stays sane.
        let end = ok("ncclGroupEnd", result::group_end());
        queued.and(end)
    }
}
