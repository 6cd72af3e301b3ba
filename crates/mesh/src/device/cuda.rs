//! The CUDA driver as a [`CudaProbe`]: real with the feature `cuda`, a stub that says so
//! without it.

use super::CudaProbe;
#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::error::Result;

/// Loads and initializes the CUDA driver, once per process: the one probe of the driver
/// library that every crate using CUDA goes through (a missing `libcuda` is found here, before
/// cudarc would panic on it). Returns why the driver cannot be used, in words.
///
/// # Errors
/// [`crate::Error::BackendUnavailable`] naming what is missing or what `cuInit` said;
/// [`crate::Error::NotCompiledWith`] without the feature `cuda`.
pub fn cuda_driver() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        driver::init()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }
}

/// Asks the CUDA driver, loaded at run time, about the devices of this process.
#[derive(Debug, Clone, Copy, Default)]
pub struct DriverProbe;

#[cfg(not(feature = "cuda"))]
impl CudaProbe for DriverProbe {
    fn device_count(&self) -> Result<usize> {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }

    fn current_device(&self) -> Result<Option<usize>> {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }
}

#[cfg(feature = "cuda")]
impl CudaProbe for DriverProbe {
    fn device_count(&self) -> Result<usize> {
        driver::init()?;
        let count = cudarc::driver::result::device::get_count().map_err(driver::unavailable)?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    fn current_device(&self) -> Result<Option<usize>> {
        driver::init()?;
        if cudarc::driver::result::ctx::get_current().map_err(driver::unavailable)?.is_none() {
            return Ok(None);
        }
        let device = driver::current_context_device()?;
        // A `CUdevice` is a handle; the ordinal is the index whose handle it is.
        let count = self.device_count()?;
        for ordinal in 0..count {
            let handle = i32::try_from(ordinal).map_err(|_| driver::too_many(count))?;
            if cudarc::driver::result::device::get(handle).map_err(driver::unavailable)? == device {
                return Ok(Some(ordinal));
            }
        }
        Err(crate::error::Error::BackendUnavailable {
            backend: "cuda",
            reason: format!(
                "the CUDA context current on this thread is on device handle {device}, which is \
                 none of the {count} visible devices"
            ),
        })
    }
}

#[cfg(feature = "cuda")]
mod driver {
    use std::sync::OnceLock;

    use crate::error::{Error, Result};

    pub(super) fn too_many(count: usize) -> Error {
        Error::BackendUnavailable { backend: "cuda", reason: format!("{count} CUDA devices") }
    }

    /// The device of the context current on this thread (`cuCtxGetDevice`, which cudarc
    /// offers only as a raw binding). Call it after [`init`] and with a context current.
    #[allow(unsafe_code)]
    pub(super) fn current_context_device() -> Result<cudarc::driver::sys::CUdevice> {
        let mut device: cudarc::driver::sys::CUdevice = 0;
        // SAFETY: the driver is loaded and initialized (`init` succeeded, so the dynamically
        // loaded symbol exists); `cuCtxGetDevice` writes one `CUdevice` through the pointer,
        // which points at a live local of that type, and reads nothing else.
        let status = unsafe { cudarc::driver::sys::cuCtxGetDevice(&mut device) };
        status.result().map_err(unavailable)?;
        Ok(device)
    }

    pub(super) fn unavailable(e: cudarc::driver::DriverError) -> Error {
        Error::BackendUnavailable {
            backend: "cuda",
            reason: format!("the CUDA driver failed: {e}"),
        }
    }

    /// Loads and initializes the driver once.
    ///
    /// cudarc panics when `libcuda` cannot be loaded. Its probe, `is_culib_present`, is an
    /// unsafe function and this crate forbids unsafe code, so the library is first looked for
    /// where the dynamic loader would find it ([`findable`]), and the first driver call is then
    /// made with a panic caught, for the cases the search cannot foresee.
    pub(super) fn init() -> Result<()> {
        static INIT: OnceLock<Result<(), String>> = OnceLock::new();
        let outcome = INIT.get_or_init(|| {
            let candidates = cudarc::get_lib_name_candidates("cuda");
            if !findable(&candidates) {
                return Err(format!(
                    "the CUDA driver library is not installed (looked for {} in LD_LIBRARY_PATH, \
                     the loader cache and the system library directories)",
                    candidates.first().map_or("libcuda", String::as_str)
                ));
            }
            match std::panic::catch_unwind(cudarc::driver::result::init) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("cuInit failed: {e}")),
                Err(_) => Err("the CUDA driver library (libcuda) could not be loaded".to_owned()),
            }
        });
        outcome.clone().map_err(|reason| Error::BackendUnavailable { backend: "cuda", reason })
    }

    /// Whether the dynamic loader would likely find one of `names`: in `LD_LIBRARY_PATH`, in
    /// `/etc/ld.so.cache` or in a system library directory. Off Linux it cannot tell and says
    /// yes.
    fn findable(names: &[String]) -> bool {
        if !cfg!(target_os = "linux") {
            return true;
        }
        let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        dirs.extend(
            [
                "/lib",
                "/lib64",
                "/usr/lib",
                "/usr/lib64",
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu",
                "/usr/lib/wsl/lib",
            ]
            .map(std::path::PathBuf::from),
        );
        if names.iter().any(|n| dirs.iter().any(|d| d.join(n).exists())) {
            return true;
        }
        // The cache holds NUL-terminated names and paths.
        let cache = std::fs::read("/etc/ld.so.cache").unwrap_or_default();
        names.iter().any(|n| {
            let needle = [n.as_bytes(), b"\0"].concat();
            cache.windows(needle.len()).any(|w| w == needle.as_slice())
        })
    }
}
