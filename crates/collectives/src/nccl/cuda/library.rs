//! Loading and checking the CUDA driver and the NCCL library once per process, and NCCL's
//! process-wide queries: its version, the device count, unique ids and error text.

use crate::error::{Error, Result};
use crate::nccl::{NcclId, ID_BYTES, MIN_VERSION};
use cudarc::driver::result as cu;
use cudarc::nccl::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

/// Functions this backend calls, checked once so that a library missing one is a clear error
/// instead of cudarc's panic at the first call.
const SYMBOLS: [&str; 18] = [
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRankConfig",
    "ncclCommAbort",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommGetAsyncError",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclAllReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclBroadcast",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclCommCount",
];

/// Loads and checks the CUDA driver and NCCL once per process; the reason when unusable.
pub(in crate::nccl) fn probe() -> std::result::Result<(), String> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // The driver's one probe loads and initializes it.
            mesh::cuda_driver().map_err(|e| e.reason())?;
            // SAFETY: the probe only tries to dlopen libnccl; it calls nothing in it.
            if !unsafe { sys::is_culib_present() } {
                return Err(format!(
                    "the NCCL library cannot be loaded (looked for {}; NCCL ships as \
                     libnccl.so.2: put a libnccl.so link to it on LD_LIBRARY_PATH)",
                    cudarc::get_lib_name_candidates("nccl").join(", ")
                ));
            }
            // SAFETY: the library is present (checked above), so `culib` loads it without
            // panicking; looking a symbol up calls nothing.
            let lib = unsafe { sys::culib() };
            for name in SYMBOLS {
                // SAFETY: the symbol is only looked up, never called through this type.
                if unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                    return Err(format!("the NCCL library has no {name}: it is too old"));
                }
            }
            let v = version()?;
            if v < MIN_VERSION {
                return Err(format!(
                    "NCCL {} is too old: 2.14 or newer is needed",
                    show_version(v)
                ));
            }
            Ok(())
        })
        .clone()
}

/// The loaded library's version code.
pub(in crate::nccl) fn version() -> std::result::Result<i32, String> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer; the symbol exists (or cudarc panics, which `probe`
    // rules out before any caller gets here).
    let code = unsafe { sys::ncclGetVersion(&mut v) };
    match code {
        sys::ncclResult_t::ncclSuccess => Ok(v),
        code => Err(format!("ncclGetVersion failed: {}", describe(code, std::ptr::null_mut()))),
    }
}

fn show_version(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100)
}

pub(in crate::nccl) fn device_count() -> Result<usize> {
    let n = cu::device::get_count().map_err(|e| Error::BackendUnavailable {
        backend: "nccl",
        reason: format!("cuDeviceGetCount failed: {e}"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(in crate::nccl) fn unique_id() -> Result<NcclId> {
    let mut id = sys::ncclUniqueId { internal: [0; ID_BYTES] };
    // SAFETY: `id` is a valid out-pointer; `available` checked the symbol.
    let code = unsafe { sys::ncclGetUniqueId(&mut id) };
    if code != sys::ncclResult_t::ncclSuccess {
        return Err(Error::BackendUnavailable {
            backend: "nccl",
            reason: format!("ncclGetUniqueId failed: {}", describe(code, std::ptr::null_mut())),
        });
    }
    // `c_char` is `i8` or `u8` depending on the target; either way a byte.
    Ok(NcclId(id.internal.map(|c| c as u8)))
}

/// NCCL's name and description of `code`, with the communicator's last error message.
pub(super) fn describe(code: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: both return pointers to static or thread-local NUL-terminated strings (or null),
    // which are copied out at once; a null `comm` asks for the thread's last error.
    let (what, last) = unsafe {
        let text = |p: *const std::ffi::c_char| {
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        (text(sys::ncclGetErrorString(code)), text(sys::ncclGetLastError(comm)))
    };
    let mut s = format!("{code:?}");
    if !what.is_empty() {
        s.push_str(&format!(" ({what})"));
    }
    if !last.is_empty() {
        s.push_str(&format!(": {last}"));
    }
    s
}
