//! A bucket of an update from memory handed over as CUDA IPC handles of the trainer's device
//! tensors instead of a file (vLLM's weight transfer names the fields `names`, `dtype_names`
//! and `shapes`; the handles here are plain JSON, not pickles).
//!
//! Rank 0's server reads the tensors from the trainer's GPU memory into a safetensors file of
//! its own ([`write_bucket`]), which from then on is an ordinary bucket: checked against the
//! model, kept, laid over the live weights by every rank at the finish. So the trainer may
//! reuse its tensors as soon as the call returns. With PyTorch, for a contiguous tensor `t`:
//!
//! ```python
//! storage = t.untyped_storage()
//! (_, handle, _, offset, *_) = storage._share_cuda_()
//! entry = {"device": str(torch.cuda.get_device_properties(t.device).uuid),
//!          "handle": base64.b64encode(handle).decode(),
//!          "offset": offset + t.storage_offset() * t.element_size()}
//! ```
//!
//! and `torch.cuda.synchronize()` before the request, so the values are written.

use base64::Engine;
use checkpoint::safetensors::{write_raw_safetensors, RawTensor, StDType};
use serde::{Deserialize, Serialize};
use std::path::Path;
use vmm::ipc::{ExportedSpan, ExportingDevice, IPC_HANDLE_BYTES};

/// The tensors of one bucket, as their device memory: `names[i]`, of `dtype_names[i]` and
/// `shapes[i]`, is at `ipc_handles[i]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IpcBucket {
    /// The tensors' names (Hugging Face's or the GGUF file's).
    pub names: Vec<String>,
    /// Their element types: `float32`, `float16`, `bfloat16` (PyTorch's names, with or
    /// without `torch.`, or safetensors' `F32`, `F16`, `BF16`).
    pub dtype_names: Vec<String>,
    /// Their shapes, row-major and contiguous.
    pub shapes: Vec<Vec<usize>>,
    /// Where each one's bytes are.
    pub ipc_handles: Vec<IpcHandle>,
}

/// One tensor's device memory: `offset` bytes into the allocation exported as `handle`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IpcHandle {
    /// The device, by UUID (`GPU-…` or PyTorch's form), or an ordinal as this server numbers
    /// its devices.
    pub device: DeviceRef,
    /// The allocation's `cudaIpcMemHandle_t` (64 bytes), base64.
    pub handle: String,
    /// Bytes from the allocation's start to the tensor's first element.
    #[serde(default)]
    pub offset: u64,
}

/// A device by UUID or by ordinal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceRef {
    /// A CUDA ordinal of the server's process.
    Ordinal(usize),
    /// A device UUID.
    Uuid(String),
}

/// A tensor of the bucket, checked: what to read and how to store it.
#[derive(Debug)]
struct Planned {
    name: String,
    dtype: StDType,
    shape: Vec<usize>,
    span: ExportedSpan,
}

impl IpcBucket {
    /// Each tensor checked (lengths of the four lists, element types, handles), in order.
    fn plan(&self) -> Result<Vec<Planned>, String> {
        let n = self.names.len();
        let lists =
            [("dtype_names", self.dtype_names.len()), ("shapes", self.shapes.len())].into_iter();
        for (field, len) in lists.chain([("ipc_handles", self.ipc_handles.len())]) {
            if len != n {
                return Err(format!("`{field}` has {len} entries for {n} `names`"));
            }
        }
        if n == 0 {
            return Err("the bucket names no tensor (`names` is empty)".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        let mut planned = Vec::with_capacity(n);
        for (i, name) in self.names.iter().enumerate() {
            let at = |why: String| format!("tensor `{name}` (entry {i}): {why}");
            if !seen.insert(name.as_str()) {
                return Err(at("named twice in the bucket".into()));
            }
            let dtype_name = &self.dtype_names[i];
            let dtype = StDType::from_name(dtype_name).ok_or_else(|| {
                at(format!("dtype `{dtype_name}` is none of float32, float16, bfloat16"))
            })?;
            let shape = self.shapes[i].clone();
            let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            let len = elements.and_then(|e| e.checked_mul(dtype.size())).ok_or_else(|| {
                at(format!("shape {shape:?} of {dtype_name} is too large to address"))
            })?;
            let h = &self.ipc_handles[i];
            let device = match &h.device {
                DeviceRef::Ordinal(o) => ExportingDevice::Ordinal(*o),
                DeviceRef::Uuid(u) => ExportingDevice::uuid(u).map_err(at)?,
            };
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(h.handle.trim())
                .map_err(|e| at(format!("`handle` is not base64: {e}")))?;
            let handle: [u8; IPC_HANDLE_BYTES] = bytes.as_slice().try_into().map_err(|_| {
                at(format!(
                    "`handle` holds {} bytes; a CUDA IPC handle has {IPC_HANDLE_BYTES}",
                    bytes.len()
                ))
            })?;
            let span = ExportedSpan { device, handle, offset: h.offset, len };
            planned.push(Planned { name: name.clone(), dtype, shape, span });
        }
        Ok(planned)
    }
}

/// Why a bucket of handles could not be written.
#[derive(Debug, thiserror::Error)]
pub enum IpcBucketError {
    /// The request itself is malformed (a list's length, a dtype, a handle).
    #[error("{0}")]
    Malformed(String),
    /// This build cannot read device memory.
    #[error(
        "this tpctl was built without CUDA (cargo build --features cuda), so it cannot read \
         CUDA IPC handles: push the bucket as a safetensors file (`path`) instead"
    )]
    NoCuda,
    /// The device memory could not be read (no driver, a device not visible here, a handle
    /// the driver refuses).
    #[error("reading the tensors from the trainer's GPU: {0}")]
    Read(vmm::Error),
    /// The file could not be written.
    #[error("writing the bucket: {0}")]
    Write(checkpoint::Error),
}

/// Reads `bucket`'s tensors with `read` (in production [`vmm::ipc::read_exported`]) and
/// writes them to `path` as one safetensors file, in the bucket's order and element types.
///
/// # Errors
/// [`IpcBucketError`]; nothing is left at `path` after a failure.
pub fn write_bucket(
    bucket: &IpcBucket,
    path: &Path,
    read: impl FnOnce(&[ExportedSpan]) -> vmm::Result<Vec<Vec<u8>>>,
) -> Result<(), IpcBucketError> {
    let planned = bucket.plan().map_err(IpcBucketError::Malformed)?;
    let spans: Vec<ExportedSpan> = planned.iter().map(|p| p.span.clone()).collect();
    let bytes = read(&spans).map_err(|e| match e {
        vmm::Error::NotCompiledWith { .. } => IpcBucketError::NoCuda,
        e => IpcBucketError::Read(e),
    })?;
    let raw: Vec<RawTensor<'_>> = planned
        .iter()
        .zip(&bytes)
        .map(|(p, b)| RawTensor { name: &p.name, shape: &p.shape, dtype: p.dtype, bytes: b })
        .collect();
    write_raw_safetensors(path, &raw).map_err(|e| {
        let _ = std::fs::remove_file(path);
        IpcBucketError::Write(e)
    })
}

#[cfg(test)]
mod tests;
