//! The enqueue half of each NCCL operation on device addresses, and the mapping of element
//! types and reductions to NCCL's.

use super::{DevPtr, NcclCommunicator};
use crate::dtype::{ElemType, ReduceOp};
use cudarc::nccl::sys;
use std::ffi::c_void;

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

/// An NCCL call's result as `run` wants it.
fn ok(
    call: &'static str,
    code: sys::ncclResult_t,
) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
    match code {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        code => Err((call, code)),
    }
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
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        dtype: ElemType,
        op: ReduceOp,
        stream: sys::cudaStream_t,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclAllReduce(
                src as *const c_void,
                dst as *mut c_void,
                count,
                nccl_type(dtype),
                nccl_op(op),
                self.raw(),
                stream,
            )
        };
        ok("ncclAllReduce", code)
    }

    /// # Safety
    /// `src` holds `bytes`, `dst` `size * bytes` on this communicator's device.
    pub(super) unsafe fn enqueue_all_gather(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclAllGather(
                src as *const c_void,
                dst as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclAllGather", code)
    }

    /// # Safety
    /// `src` holds `size * count`, `dst` `count` elements of `dtype` on this device.
    pub(super) unsafe fn enqueue_reduce_scatter(
        &self,
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        dtype: ElemType,
        op: ReduceOp,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclReduceScatter(
                src as *const c_void,
                dst as *mut c_void,
                count,
                nccl_type(dtype),
                nccl_op(op),
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclReduceScatter", code)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    pub(super) unsafe fn enqueue_broadcast(
        &self,
        buf: DevPtr,
        bytes: usize,
        root: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract; in place, as NCCL allows.
        let code = unsafe {
            sys::ncclBroadcast(
                buf as *const c_void,
                buf as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                root as i32,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclBroadcast", code)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    pub(super) unsafe fn enqueue_send(
        &self,
        buf: DevPtr,
        bytes: usize,
        peer: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclSend(
                buf as *const c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                peer as i32,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclSend", code)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    pub(super) unsafe fn enqueue_recv(
        &self,
        buf: DevPtr,
        bytes: usize,
        peer: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclRecv(
                buf as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                peer as i32,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclRecv", code)
    }

    /// # Safety
    /// `src` and `dst` hold `size * chunk` bytes on this device.
    pub(super) unsafe fn enqueue_all_to_all(
        &self,
        src: DevPtr,
        dst: DevPtr,
        chunk: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: group calls take no pointers.
        ok("ncclGroupStart", unsafe { sys::ncclGroupStart() })?;
        let mut result = Ok(());
        for peer in 0..self.core.size {
            let off = (peer * chunk) as DevPtr;
            // SAFETY: chunk `peer` of each buffer is in bounds per this function's contract.
            result = unsafe { self.enqueue_send(src + off, chunk, peer) }
                .and_then(|()| unsafe { self.enqueue_recv(dst + off, chunk, peer) });
            if result.is_err() {
                break;
            }
        }
        // The group is closed even after a failed call, so NCCL's group state stays sane.
        // SAFETY: as above.
        let end = ok("ncclGroupEnd", unsafe { sys::ncclGroupEnd() });
        result.and(end)
    }
}
