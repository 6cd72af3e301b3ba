//! The CUDA driver as a [`CudaProbe`]: real with the feature `cuda`, a stub that says so
//! without it.

use super::CudaProbe;
#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::error::Result;

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
        match cudarc::driver::result::ctx::get_current().map_err(driver::unavailable)? {
            None => Ok(None),
            // Reading the device of a context is `cuCtxGetDevice`, which cudarc only offers as
            // an unsafe raw binding, and this crate forbids unsafe code.
            Some(_) => Err(crate::error::Error::BackendUnavailable {
                backend: "cuda",
                reason: "a CUDA context is current on this thread but tpctl-mesh cannot read \
                         its device (cuCtxGetDevice needs unsafe code); set LOCAL_RANK or pass \
                         a CudaProbe that can"
                    .into(),
            }),
        }
    }
}

#[cfg(feature = "cuda")]
mod driver {
    use std::sync::OnceLock;

    use crate::error::{Error, Result};

    pub(super) fn unavailable(e: cudarc::driver::DriverError) -> Error {
        Error::BackendUnavailable {
            backend: "cuda",
            reason: format!("the CUDA driver failed: {e}"),
        }
    }

    /// Loads and initializes the driver once.
    ///
    /// cudarc panics when `libcuda` cannot be loaded. Its probe, `is_culib_present`, is an
    /// unsafe function and this crate forbids unsafe code, so the probe is the first driver
    /// call itself, with the panic caught (the panic hook still prints cudarc's message, which
    /// says where it looked).
    pub(super) fn init() -> Result<()> {
        static INIT: OnceLock<Result<(), String>> = OnceLock::new();
        let outcome =
            INIT.get_or_init(|| match std::panic::catch_unwind(cudarc::driver::result::init) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("cuInit failed: {e}")),
                Err(_) => Err("the CUDA driver library (libcuda) could not be loaded".to_owned()),
            });
        outcome.clone().map_err(|reason| Error::BackendUnavailable { backend: "cuda", reason })
    }
}
