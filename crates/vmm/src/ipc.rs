//! Device memory another process exported with CUDA IPC (`cuIpcGetMemHandle`, what PyTorch's
//! `untyped_storage()._share_cuda_()` returns): a trainer hands its tensors to tpctl by handle,
//! and [`read_exported`] copies their bytes to the host, each distinct handle opened once.
//!
//! The handles and where the tensors sit in their allocations are plain data ([`ExportedSpan`]),
//! parsed and checked on any machine; reading them needs the feature `cuda` and the driver.

use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
mod cuda;

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// The device that exported a span, as the exporting process names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExportingDevice {
    /// The device's UUID as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (lower case): the same
    /// device in every process, whatever each one's `CUDA_VISIBLE_DEVICES`.
    Uuid(String),
    /// A CUDA ordinal of *this* process (after its `CUDA_VISIBLE_DEVICES`); right only when the
    /// exporting process numbers its devices the same way.
    Ordinal(usize),
}

impl ExportingDevice {
    /// A UUID as `nvidia-smi -L` (`GPU-…`) or PyTorch (`str(props.uuid)`, no prefix) writes
    /// it: 32 hex digits, hyphens anywhere, any case.
    ///
    /// # Errors
    /// Anything else, in words.
    pub fn uuid(text: &str) -> std::result::Result<ExportingDevice, String> {
        let t = text.trim();
        let body = t.strip_prefix("GPU-").or_else(|| t.strip_prefix("gpu-")).unwrap_or(t);
        let hex: String = body.chars().filter(|c| *c != '-').collect();
        if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!(
                "`{text}` is not a device UUID (32 hex digits, as `nvidia-smi -L` or torch's \
                 get_device_properties(d).uuid write it)"
            ));
        }
        let h = hex.to_ascii_lowercase();
        Ok(ExportingDevice::Uuid(format!(
            "GPU-{}-{}-{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..]
        )))
    }
}

impl std::fmt::Display for ExportingDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExportingDevice::Uuid(u) => f.write_str(u),
            ExportingDevice::Ordinal(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// `len` bytes at `offset` into the allocation another process exported as `handle`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedSpan {
    /// The device the allocation is on.
    pub device: ExportingDevice,
    /// The allocation's IPC handle.
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// Where the span starts, in bytes from the allocation's start.
    pub offset: u64,
    /// Its length in bytes.
    pub len: usize,
}

/// The bytes of every span, in order: each distinct (device, handle) is opened once in this
/// process (on the device's primary context), its spans copied to the host, and closed. The
/// exporting process must have finished writing them (for PyTorch, `torch.cuda.synchronize()`
/// before it sends the handles) and keep them until this returns.
///
/// # Errors
/// [`Error::NotCompiledWith`] without the feature `cuda`; [`Error::BackendUnavailable`] when
/// the driver cannot be used or no visible device has the span's UUID; [`Error::Cuda`] naming
/// the handle or the span when the driver refuses one (a handle of this process or of a freed
/// allocation, a span past the allocation's end).
pub fn read_exported(spans: &[ExportedSpan]) -> Result<Vec<Vec<u8>>> {
    #[cfg(feature = "cuda")]
    {
        cuda::read(spans)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = spans;
        Err(Error::NotCompiledWith { feature: "cuda" })
    }
}

/// The indices of `spans` grouped by (device, handle), groups in order of first appearance.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn by_allocation(spans: &[ExportedSpan]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, s) in spans.iter().enumerate() {
        let same = |g: &&mut Vec<usize>| {
            let first = &spans[g[0]];
            first.device == s.device && first.handle == s.handle
        };
        match groups.iter_mut().find(same) {
            Some(g) => g.push(i),
            None => groups.push(vec![i]),
        }
    }
    groups
}

/// `Error` for a span that cannot be read, naming it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn span_error(span: &ExportedSpan, what: &str, code: String) -> Error {
    Error::Cuda {
        op: format!(
            "{what} of {} bytes at offset {} of the allocation exported on {}",
            span.len, span.offset, span.device
        ),
        code,
    }
}

#[cfg(test)]
mod tests;
