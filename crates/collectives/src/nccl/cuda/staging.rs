//! The device staging buffer of the host API, and the copies between it and host slices.

use super::{cuda_err, DevPtr, NcclCommunicator};
use crate::error::{Result, Site};
use cudarc::driver::{result as cu, CudaSlice, DevicePtr};

/// The device staging buffer of the host API, grown on demand.
pub(super) struct Staging {
    buf: CudaSlice<u8>,
    ptr: DevPtr,
}

impl NcclCommunicator {
    /// A device buffer of at least `bytes`, its base address.
    pub(super) fn staging(&mut self, at: &Site, bytes: usize) -> Result<DevPtr> {
        if self.staging.as_ref().is_none_or(|s| s.buf.len() < bytes) {
            self.staging = None;
            let cap = bytes.max(4096).next_power_of_two();
            let buf = self.stream.alloc_zeros::<u8>(cap).map_err(cuda_err(at, "cuMemAlloc"))?;
            let ptr = {
                let (ptr, _sync) = buf.device_ptr(&self.stream);
                ptr
            };
            self.staging = Some(Staging { buf, ptr });
        }
        Ok(self.staging.as_ref().map_or(0, |s| s.ptr))
    }

    pub(super) fn upload(&self, at: &Site, dst: DevPtr, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` points into the staging buffer with room for `src` (the caller sized
        // it), on this communicator's context, which is current.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(cuda_err(at, "cuMemcpyHtoDAsync"))
    }

    pub(super) fn download(&self, at: &Site, dst: &mut [u8], src: DevPtr) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` points into the staging buffer holding at least `dst.len()` bytes; the
        // copy into pageable memory returns once it is complete, and the stream holds no other
        // work (the operation before it finished under `run`).
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(cuda_err(at, "cuMemcpyDtoHAsync"))
    }

    pub(super) fn sync(&self, at: &Site) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err(at, "cuStreamSynchronize"))
    }
}
