//! [`PoolArena`]: a [`DeviceArena`] carved out of one buffer of the driver's memory pool.

use super::{Count, CudaBackend, OrUnavailable};
use crate::error::{Error, Result};
use crate::memory::DeviceArena;
use cudarc::driver::CudaSlice;
use mesh::DeviceMemory;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A [`DeviceArena`] of driver-pool memory: one buffer carved front to back, for a KV cache
/// or weights that never sleep (tests; callers without `vmm`). Regions keep the buffer alive.
pub struct PoolArena {
    buf: Arc<CudaSlice<u8>>,
    base: u64,
    ordinal: usize,
    next: Mutex<usize>,
}

impl fmt::Debug for PoolArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolArena").field("bytes", &self.buf.len()).finish_non_exhaustive()
    }
}

/// A region of a [`PoolArena`].
#[derive(Debug)]
struct PoolRegion {
    _buf: Arc<PoolBuf>,
    ptr: u64,
    bytes: usize,
    ordinal: usize,
}

/// Keeps a pool buffer alive for its regions (a newtype, so it can be `Debug`).
struct PoolBuf(#[allow(dead_code)] Arc<CudaSlice<u8>>);

impl fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PoolBuf")
    }
}

// SAFETY: the fields never change; `ptr..ptr + bytes` lies inside the pool buffer (checked
// by `PoolArena::alloc_device`), a `cudaMalloc`-style allocation of the arena's device that
// `_buf` keeps alive and that is never unmapped while it lives; regions never overlap.
unsafe impl DeviceMemory for PoolRegion {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn size(&self) -> usize {
        self.bytes
    }
    fn device(&self) -> mesh::Device {
        mesh::Device::Cuda(self.ordinal)
    }
}

impl PoolArena {
    /// `bytes` bytes of zeroed device memory on `backend`'s device.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the device is out of memory.
    pub fn new(backend: &CudaBackend, bytes: usize) -> Result<PoolArena> {
        backend.count(Count::Allocation);
        backend.count(Count::DeviceCopy);
        let buf = backend
            .stream()
            .alloc_zeros::<u8>(bytes.max(1))
            .or_unavailable(|| format!("device arena: allocating {bytes} bytes"))?;
        let base = backend.addr(&buf);
        let ordinal = backend.ordinal();
        Ok(PoolArena { buf: Arc::new(buf), base, ordinal, next: Mutex::new(0) })
    }
}

impl PoolArena {
    /// Overwrites every byte with `value`, as a lost mapping would (for tests).
    pub fn scribble(&self, backend: &CudaBackend, value: u8) {
        backend.bind("scribble").unwrap();
        let stream = backend.stream();
        backend.count(Count::DeviceCopy);
        // SAFETY: the range is exactly the arena's buffer, alive while `self` is.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.base,
                value,
                self.buf.len(),
                stream.cu_stream(),
            )
        }
        .unwrap();
        backend.count(Count::HostWait);
        stream.synchronize().unwrap();
    }
}

impl DeviceArena for PoolArena {
    fn alloc_device(&self, bytes: usize) -> Result<Box<dyn DeviceMemory>> {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let offset = next.next_multiple_of(crate::memory::ALIGN);
        let end = offset.checked_add(bytes).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(Error::Arena {
                bytes,
                source: format!(
                    "the device arena has {} of {} bytes left",
                    self.buf.len() - offset.min(self.buf.len()),
                    self.buf.len()
                )
                .into(),
            });
        };
        *next = end;
        let keep = Arc::new(PoolBuf(self.buf.clone()));
        let ptr = self.base + offset as u64;
        Ok(Box::new(PoolRegion { _buf: keep, ptr, bytes, ordinal: self.ordinal }))
    }
}
