//! Read-only memory maps of model files: the crate's only `unsafe` besides the `gemm` call.
#![allow(unsafe_code)]

use crate::error::{Error, Result};
use std::path::Path;

/// Maps `path` read-only.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened or mapped.
pub(crate) fn map(path: &Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(path).map_err(|source| Error::Io {
        what: "opening",
        path: path.to_owned(),
        source,
    })?;
    // SAFETY: the map is read-only and private to this process. Model files are treated as
    // immutable while loaded (they are written once into the cache and renamed into place);
    // if another process truncated or rewrote one anyway, reads could fault or see changed
    // bytes, which is the documented contract of `Mmap::map` that callers of `GgufFile::open`
    // accept by not modifying loaded files.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Io {
        what: "mapping",
        path: path.to_owned(),
        source,
    })
}
