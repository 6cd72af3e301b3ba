//! The CUDA backend (feature `cuda`): the driver's virtual memory API.
//!
//! `cuMemAddressReserve` gives each allocation its address range once; materialize is
//! `cuMemCreate` + `cuMemMap` + `cuMemSetAccess`, release is `cuMemUnmap` + `cuMemRelease`, so
//! device pointers held by kernels and captured graphs stay valid across cycles. Host backups
//! live in pinned memory (`cuMemHostAlloc`). The driver library is loaded at run time, through
//! `mesh::cuda_driver`; without it [`create`] returns [`Error::BackendUnavailable`].
//!
//! Backups and restores go in chunks (`crate::chunked`): each chunk is an asynchronous copy
//! on a stream of the backend's own, followed by an event; the host queues chunk `i + 1` before
//! it waits for chunk `i`'s event, so the copy engine never waits for the host between chunks.

use super::{Backend, HostBuf, Init, Phys};
use crate::chunked::{Direction, IN_FLIGHT};
use crate::error::{Error, Result};
use crate::policy::BackupStore;
use cudarc::driver::sys;
use std::os::unix::fs::FileExt;

/// Host staging buffer size for spill files and file sources.
const STAGING: usize = 64 << 20;

/// `Ok` for `CUDA_SUCCESS`, else [`Error::Cuda`] naming `op`.
pub(crate) fn check(op: impl FnOnce() -> String, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { op: op(), code: format!("{r:?}") })
    }
}

/// Opens device `device`, or says why it cannot.
pub(crate) fn create(device: usize) -> Result<Box<dyn Backend>> {
    Ok(Box::new(CudaBackend::new(device)?))
}

/// Device memory backend for one device, through its primary context.
pub(crate) struct CudaBackend {
    /// The device ordinal, as the caller named it.
    ordinal: usize,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    granularity: usize,
    total: u64,
    /// The stream of chunked copies (non-blocking: it does not wait for the legacy default
    /// stream); null until created in `new`.
    stream: sys::CUstream,
    /// One event per chunk in flight, recorded on `stream` after the chunk's copy; chunk `i`
    /// uses `events[i % IN_FLIGHT]`. Null until created.
    events: [sys::CUevent; IN_FLIGHT],
}

// SAFETY: `ctx` is the device's primary context, a process-wide driver handle that is valid
// on every thread; the backend makes it current on the calling thread before every driver
// call (`bind`), and the manager's mutex serializes all calls, so moving the backend to
// another thread cannot race on it. The stream and events belong to that context and are
// used under the same lock.
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    fn new(device: usize) -> Result<CudaBackend> {
        let unavailable = |reason: String| Error::BackendUnavailable { backend: "cuda", reason };
        // The driver is loaded and initialized (cuInit) by its one probe.
        mesh::cuda_driver().map_err(|e| unavailable(e.reason()))?;
        let ordinal =
            i32::try_from(device).map_err(|_| unavailable(format!("no device {device}")))?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: `dev` is a valid out pointer; the driver is initialized.
        check(|| format!("cuDeviceGet({device})"), unsafe { sys::cuDeviceGet(&mut dev, ordinal) })
            .map_err(|e| unavailable(e.to_string()))?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer and device handle.
        check(|| format!("cuDevicePrimaryCtxRetain({device})"), unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let mut total = 0usize;
        // SAFETY: valid out pointer and device handle.
        check(|| "cuDeviceTotalMem".into(), unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) })?;
        let mut backend = CudaBackend {
            ordinal: device,
            device: dev,
            ctx,
            granularity: 0,
            total: total as u64,
            stream: std::ptr::null_mut(),
            events: [std::ptr::null_mut(); IN_FLIGHT],
        };
        backend.bind()?;
        // SAFETY: valid out pointer; the context is current (just above). `Drop` destroys it.
        check(|| "cuStreamCreate for chunked copies".into(), unsafe {
            sys::cuStreamCreate(
                &mut backend.stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        for event in &mut backend.events {
            // SAFETY: valid out pointer; the context is current. `Drop` destroys it.
            check(|| "cuEventCreate for chunked copies".into(), unsafe {
                sys::cuEventCreate(event, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            })?;
        }
        let prop = backend.prop();
        let mut granularity = 0usize;
        // SAFETY: valid out pointer and a fully initialized property struct.
        check(|| "cuMemGetAllocationGranularity".into(), unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        backend.granularity = granularity.max(1).next_power_of_two();
        Ok(backend)
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context, valid until `Drop`.
        check(|| "cuCtxSetCurrent".into(), unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// Binds the context and waits for all of its work: the kernels' streams (the model's
    /// backend shares this primary context, on streams of its own that the synchronous copies
    /// here do not order with) finish reading or writing memory before it is copied out,
    /// unmapped or freed.
    fn settle(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: a current context is bound (just above).
        check(|| "cuCtxSynchronize".into(), unsafe { sys::cuCtxSynchronize() })
    }

    fn prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: the struct is plain old data for which all-zero is a valid value; the fields
        // that matter are set below.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.device;
        prop
    }

    fn release_handle(&self, addr: u64, len: usize, handle: u64, mapped: bool) -> Result<()> {
        if mapped {
            // SAFETY: `addr..addr+len` is mapped to `handle` by this backend.
            check(|| format!("cuMemUnmap({addr:#x}, {len})"), unsafe {
                sys::cuMemUnmap(addr, len)
            })?;
        }
        // SAFETY: `handle` came from cuMemCreate and is no longer mapped.
        check(|| "cuMemRelease".into(), unsafe { sys::cuMemRelease(handle) })
    }

    fn copy_in(&self, addr: u64, src: &[u8]) -> Result<()> {
        // SAFETY: `addr..addr+src.len()` is mapped device memory of this backend; `src` is a
        // live host slice. The copy is synchronous.
        check(|| format!("cuMemcpyHtoD({addr:#x}, {} bytes)", src.len()), unsafe {
            sys::cuMemcpyHtoD_v2(addr, src.as_ptr().cast(), src.len())
        })
    }

    fn zero(&self, addr: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: mapped device memory of this backend.
        check(|| format!("cuMemsetD8({addr:#x}, {len})"), unsafe {
            sys::cuMemsetD8_v2(addr, 0, len)
        })?;
        // SAFETY: a current context is bound; memset is asynchronous to the host.
        check(|| "cuCtxSynchronize".into(), unsafe { sys::cuCtxSynchronize() })
    }

    fn init(&self, addr: u64, len: usize, init: Init<'_>) -> Result<()> {
        match init {
            Init::Fresh => Ok(()),
            Init::Zero => self.zero(addr, len),
            Init::File { file, offset, len: n, what } => {
                let n = n.min(len);
                let mut staging = PinnedBuf::new(n.min(STAGING))?;
                let mut done = 0;
                while done < n {
                    let chunk = (n - done).min(STAGING);
                    let buf = &mut staging.as_mut_slice()[..chunk];
                    file.read_exact_at(buf, offset + done as u64).map_err(|e| {
                        Error::os_with(format!("reading {chunk} bytes from {what}"), e)
                    })?;
                    self.copy_in(addr + done as u64, buf)?;
                    done += chunk;
                }
                self.zero(addr + n as u64, len - n)
            }
            Init::Fill { len: n, fill } => {
                let n = n.min(len);
                let mut host = PinnedBuf::new(n)?;
                fill(host.as_mut_slice())?;
                self.copy_in(addr, host.as_slice())?;
                self.zero(addr + n as u64, len - n)
            }
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            for &event in &self.events {
                if !event.is_null() {
                    // SAFETY: the event was created in `new` in this context (bound above),
                    // is destroyed once, and no copy waits on it (every chunked copy waited
                    // for or drained its chunks before returning).
                    unsafe { sys::cuEventDestroy_v2(event) };
                }
            }
            if !self.stream.is_null() {
                // SAFETY: as for the events: created in `new`, idle, destroyed once.
                unsafe { sys::cuStreamDestroy_v2(self.stream) };
            }
        }
        // SAFETY: the context was retained in `new` for this device and is released once.
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn device(&self) -> mesh::Device {
        mesh::Device::Cuda(self.ordinal)
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn max_bytes(&self) -> u64 {
        self.total
    }

    fn default_store(&self) -> BackupStore {
        BackupStore::Host
    }

    fn reserve(&mut self, len: usize) -> Result<u64> {
        self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer; `len` is a multiple of the granularity.
        check(|| format!("cuMemAddressReserve({len})"), unsafe {
            sys::cuMemAddressReserve(&mut ptr, len, self.granularity, 0, 0)
        })?;
        Ok(ptr)
    }

    fn map(&mut self, addr: u64, len: usize, _label: &str, init: Init<'_>) -> Result<Phys> {
        self.bind()?;
        let prop = self.prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out pointer and property struct; `len` is a multiple of the granularity.
        check(|| format!("cuMemCreate({len})"), unsafe {
            sys::cuMemCreate(&mut handle, len, &prop, 0)
        })?;
        // SAFETY: `addr..addr+len` is a reservation of this backend with nothing mapped in it.
        let mapped = check(|| format!("cuMemMap({addr:#x}, {len})"), unsafe {
            sys::cuMemMap(addr, len, 0, handle, 0)
        });
        if let Err(e) = mapped {
            let _ = self.release_handle(addr, len, handle, false);
            return Err(e);
        }
        // SAFETY: the struct is plain old data for which all-zero is valid; fields set below.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location = prop.location;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range was just mapped; one valid descriptor.
        let ready = check(|| format!("cuMemSetAccess({addr:#x}, {len})"), unsafe {
            sys::cuMemSetAccess(addr, len, &access, 1)
        })
        .and_then(|()| self.init(addr, len, init));
        if let Err(e) = ready {
            let _ = self.release_handle(addr, len, handle, true);
            return Err(e);
        }
        Ok(Phys::Cuda(handle))
    }

    fn unmap(&mut self, addr: u64, len: usize, phys: Phys) -> Result<(), (Phys, Error)> {
        let Phys::Cuda(handle) = phys else {
            return Err((
                phys,
                Error::Cuda { op: "unmap".into(), code: "not a cuda allocation".into() },
            ));
        };
        if let Err(e) = self.settle() {
            return Err((phys, e));
        }
        // SAFETY: `addr..addr+len` is mapped to `handle` by this backend.
        let r = unsafe { sys::cuMemUnmap(addr, len) };
        if let Err(e) = check(|| format!("cuMemUnmap({addr:#x}, {len})"), r) {
            return Err((phys, e));
        }
        // A handle that fails to release after a successful unmap leaks device memory but the
        // address range is consistent (unmapped), so the release counts as done.
        if let Err(e) = self.release_handle(addr, len, handle, false) {
            tracing::error!(error = %e, "cuMemRelease failed after cuMemUnmap; device memory leaked");
        }
        Ok(())
    }

    fn free(&mut self, addr: u64, len: usize, phys: Option<Phys>) -> Result<()> {
        self.settle()?;
        if let Some(Phys::Cuda(handle)) = phys {
            self.release_handle(addr, len, handle, true)?;
        }
        // SAFETY: the reservation belongs to this backend and nothing is mapped in it any more.
        check(|| format!("cuMemAddressFree({addr:#x}, {len})"), unsafe {
            sys::cuMemAddressFree(addr, len)
        })
    }

    fn host_ptr(&self, _addr: u64) -> Option<*mut u8> {
        None
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuf> {
        self.bind()?;
        Ok(HostBuf::Pinned(PinnedBuf::new(len)?))
    }

    fn copy_to_host(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        self.settle()?;
        let len = dst.len();
        // SAFETY: `addr..addr+len` is mapped device memory; `dst` is a live host slice.
        let r = unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), addr, len) };
        check(|| format!("cuMemcpyDtoH({addr:#x}, {len} bytes)"), r)
    }

    fn copy_from_host(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        self.copy_in(addr, src)
    }

    fn save(&self, addr: u64, len: usize, sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        self.settle()?;
        let mut staging = PinnedBuf::new(len.min(STAGING))?;
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(STAGING);
            let buf = &mut staging.as_mut_slice()[..chunk];
            self.copy_to_host(addr + done as u64, buf)?;
            sink(buf)?;
            done += chunk;
        }
        Ok(())
    }

    fn begin_chunks(&self, direction: Direction) -> Result<()> {
        match direction {
            // The kernels' streams finish writing the memory before it is copied out.
            Direction::ToHost => self.settle(),
            // The memory was just mapped: no kernel uses it yet.
            Direction::FromHost => self.bind(),
        }
    }

    unsafe fn start_to_host(
        &self,
        addr: u64,
        dst: *mut u8,
        len: usize,
        chunk: usize,
    ) -> Result<()> {
        // SAFETY: `addr..addr+len` is mapped device memory of this backend (the manager copies
        // only materialized allocations, under their write lock); the caller keeps
        // `dst..dst+len` alive and untouched until this chunk's event is waited for or the
        // stream drained. The context is current (`begin_chunks`).
        check(|| format!("cuMemcpyDtoHAsync({addr:#x}, {len} bytes)"), unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), addr, len, self.stream)
        })?;
        self.record(chunk)
    }

    unsafe fn start_from_host(
        &self,
        addr: u64,
        src: *const u8,
        len: usize,
        chunk: usize,
    ) -> Result<()> {
        // SAFETY: as in `start_to_host`, the other way: mapped device memory, and host memory
        // the caller keeps readable and unwritten until the chunk is waited for.
        check(|| format!("cuMemcpyHtoDAsync({addr:#x}, {len} bytes)"), unsafe {
            sys::cuMemcpyHtoDAsync_v2(addr, src.cast(), len, self.stream)
        })?;
        self.record(chunk)
    }

    fn wait_chunk(&self, chunk: usize) -> Result<()> {
        let event = self.events[chunk % IN_FLIGHT];
        // SAFETY: an event of this backend's context, recorded after the chunk's copy.
        check(|| format!("cuEventSynchronize (chunk {})", chunk + 1), unsafe {
            sys::cuEventSynchronize(event)
        })
    }

    fn drain_chunks(&self) -> Result<()> {
        // SAFETY: the stream belongs to this backend's context; once the call returns nothing
        // queued on it runs (an error means the context failed and its work was abandoned).
        check(|| "cuStreamSynchronize (chunked copies)".into(), unsafe {
            sys::cuStreamSynchronize(self.stream)
        })
    }
}

impl CudaBackend {
    /// Records chunk `chunk`'s event after the copies queued on the stream so far.
    fn record(&self, chunk: usize) -> Result<()> {
        let event = self.events[chunk % IN_FLIGHT];
        // SAFETY: the event and the stream belong to this backend's context, which is current.
        // The event is not waited on elsewhere: the chunk `IN_FLIGHT` before this one, which
        // used it last, was waited for before this chunk was queued (`crate::chunked`).
        check(|| format!("cuEventRecord (chunk {})", chunk + 1), unsafe {
            sys::cuEventRecord(event, self.stream)
        })
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
pub(crate) struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a PinnedBuf owns its allocation exclusively, like a `Box<[u8]>`: nothing else holds
// the pointer, shared references only read, and `cuMemFreeHost` may be called from any thread.
unsafe impl Send for PinnedBuf {}
// SAFETY: `&PinnedBuf` only hands out `&[u8]`; mutation needs `&mut PinnedBuf`.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    fn new(len: usize) -> Result<PinnedBuf> {
        if len == 0 {
            return Ok(PinnedBuf { ptr: std::ptr::NonNull::dangling().as_ptr(), len });
        }
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; a context is current (callers bind first).
        check(|| format!("cuMemHostAlloc({len})"), unsafe {
            sys::cuMemHostAlloc(&mut ptr, len, 0)
        })?;
        Ok(PinnedBuf { ptr: ptr.cast(), len })
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes owned by self (or is dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed once.
            unsafe {
                sys::cuMemFreeHost(self.ptr.cast());
            }
        }
    }
}
