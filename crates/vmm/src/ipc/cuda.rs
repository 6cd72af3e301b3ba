//! Reading exported spans through the CUDA driver (feature `cuda`).

use super::{by_allocation, span_error, ExportedSpan, ExportingDevice};
use crate::backend::cuda::check;
use crate::error::{Error, Result};
use cudarc::driver::sys;

fn unavailable(reason: String) -> Error {
    Error::BackendUnavailable { backend: "cuda", reason }
}

pub(super) fn read(spans: &[ExportedSpan]) -> Result<Vec<Vec<u8>>> {
    mesh::cuda_driver().map_err(|e| unavailable(e.reason()))?;
    let mut out: Vec<Vec<u8>> = spans.iter().map(|_| Vec::new()).collect();
    for group in by_allocation(spans) {
        let first = &spans[group[0]];
        let context = Primary::retain(device(&first.device)?)?;
        let opened = Opened::open(&context, first)?;
        for i in group {
            let span = &spans[i];
            let end = span.offset.checked_add(span.len as u64);
            if end.is_none_or(|end| end > opened.size as u64) {
                let code = format!("the allocation holds {} bytes", opened.size);
                return Err(span_error(span, "a span past the allocation's end", code));
            }
            let mut bytes = vec![0u8; span.len];
            // SAFETY: `bytes` holds `span.len` writable bytes; the source range lies inside
            // the opened allocation (checked above against the size the driver reports), and
            // the context it was opened in is current on this thread.
            let r = unsafe {
                sys::cuMemcpyDtoH_v2(bytes.as_mut_ptr().cast(), opened.base + span.offset, span.len)
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(span_error(span, "copying", format!("{r:?}")));
            }
            out[i] = bytes;
        }
    }
    Ok(out)
}

/// This process's handle of the device `d` names.
fn device(d: &ExportingDevice) -> Result<sys::CUdevice> {
    let mut count = 0;
    // SAFETY: a valid out pointer; the driver is initialized.
    check(|| "cuDeviceGetCount".into(), unsafe { sys::cuDeviceGetCount(&mut count) })?;
    let mut handles = Vec::new();
    for ordinal in 0..count {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: a valid out pointer and an ordinal below the count.
        check(|| format!("cuDeviceGet({ordinal})"), unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        handles.push(dev);
    }
    match d {
        ExportingDevice::Ordinal(i) => handles.get(*i).copied().ok_or_else(|| {
            unavailable(format!("no CUDA device {i} in this process ({count} visible)"))
        }),
        ExportingDevice::Uuid(wanted) => {
            let mut seen = Vec::new();
            for &dev in &handles {
                // SAFETY: `CUuuid` is plain bytes; zero is a valid value to overwrite.
                let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
                // SAFETY: a valid out pointer and a device handle of this process.
                check(|| "cuDeviceGetUuid".into(), unsafe {
                    sys::cuDeviceGetUuid_v2(&mut uuid, dev)
                })?;
                let hex: String = uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect();
                let text = ExportingDevice::uuid(&hex).map_err(unavailable)?;
                if &text == d {
                    return Ok(dev);
                }
                seen.push(text.to_string());
            }
            Err(unavailable(format!(
                "no device visible to this process has UUID {wanted} (it sees {})",
                if seen.is_empty() { "none".to_owned() } else { seen.join(", ") }
            )))
        }
    }
}

/// A device's primary context, retained and current on this thread while the value lives
/// (the context current before comes back after).
struct Primary {
    dev: sys::CUdevice,
    before: sys::CUcontext,
}

impl Primary {
    fn retain(dev: sys::CUdevice) -> Result<Primary> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out pointer and device handle.
        check(|| "cuDevicePrimaryCtxRetain".into(), unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let mut primary = Primary { dev, before: std::ptr::null_mut() };
        // SAFETY: a valid out pointer.
        check(|| "cuCtxGetCurrent".into(), unsafe { sys::cuCtxGetCurrent(&mut primary.before) })?;
        // SAFETY: the context was just retained and stays so while `primary` lives.
        check(|| "cuCtxSetCurrent".into(), unsafe { sys::cuCtxSetCurrent(ctx) })?;
        Ok(primary)
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        // SAFETY: `before` was current on this thread when `retain` ran (or null: none), so
        // it is still a live context of this process; the primary context was retained once
        // there and is released once here, after the allocations opened in it were closed
        // (`Opened` borrows it).
        unsafe {
            sys::cuCtxSetCurrent(self.before);
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// An exported allocation opened in this process: its base address and size.
struct Opened<'a> {
    base: sys::CUdeviceptr,
    size: usize,
    _context: &'a Primary,
}

impl<'a> Opened<'a> {
    fn open(context: &'a Primary, span: &ExportedSpan) -> Result<Opened<'a>> {
        // SAFETY: `CUipcMemHandle` is 64 plain bytes.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (dst, src) in handle.reserved.iter_mut().zip(span.handle) {
            *dst = src as std::ffi::c_char;
        }
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: a valid out pointer; the handle is passed by value and the driver checks it
        // (an unknown or own-process handle is an error, not undefined behaviour); the
        // context is current.
        let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, handle, flags) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(span_error(span, "opening the IPC handle", format!("{r:?}")));
        }
        let mut opened = Opened { base, size: 0, _context: context };
        let mut start: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointers and an address the driver just mapped.
        check(|| "cuMemGetAddressRange on an opened IPC handle".into(), unsafe {
            sys::cuMemGetAddressRange_v2(&mut start, &mut opened.size, base)
        })?;
        Ok(opened)
    }
}

impl Drop for Opened<'_> {
    fn drop(&mut self) {
        // SAFETY: `base` came from `cuIpcOpenMemHandle` in the current context and is closed
        // once; every copy from it was synchronous and has returned.
        unsafe {
            sys::cuIpcCloseMemHandle(self.base);
        }
    }
}
