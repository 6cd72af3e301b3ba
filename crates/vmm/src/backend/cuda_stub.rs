//! The CUDA backend when the crate is built without the `cuda` feature: every entry point
//! returns [`Error::NotCompiledWith`], so callers carry no `#[cfg]`.

use super::Backend;
use crate::error::{Error, Result};

/// Always fails: CUDA support is not compiled in.
pub(crate) fn create(_device: usize) -> Result<Box<dyn Backend>> {
    Err(Error::NotCompiledWith { feature: "cuda" })
}
