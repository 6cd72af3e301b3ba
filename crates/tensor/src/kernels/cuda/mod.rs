//! The CUDA backend: [`CudaBackend`] runs the kernels of [`super::Backend`] on a GPU (feature
//! `cuda`), taking and returning host tensors so the model code runs unchanged.
//!
//! Without feature `cuda` this module is a stub: [`CudaBackend::new`] returns
//! [`crate::Error::NotCompiledWith`] and no value of the type can exist, so the dispatch in
//! [`super::Backend`] carries no `#[cfg]`. With it, the real backend (`device/`, with the CUDA
//! C source in `kernels.cu`) loads the CUDA libraries at run time and reports
//! [`crate::Error::BackendUnavailable`] with the reason when it cannot run.

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{CudaBackend, PoolArena};

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaBackend, PoolArena};

mod counters;
#[cfg(any(feature = "cuda", test))]
mod graph_book;
#[cfg(any(feature = "cuda", test))]
mod kernel_cache;
#[cfg(any(feature = "cuda", test))]
mod stage_layout;
#[cfg(any(feature = "cuda", test))]
mod weight_stamps;

pub use counters::{Counters, GraphStats, PerStep};

#[cfg(test)]
mod tests;

/// What the driver says about a [`CudaBackend`]'s device ([`CudaBackend::describe`]), for a
/// preflight such as `tpctl doctor`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability, major and minor.
    pub compute_capability: (i32, i32),
    /// Device memory, total and free now, in bytes.
    pub total_bytes: usize,
    /// See `total_bytes`.
    pub free_bytes: usize,
    /// The UUID as `nvidia-smi` and `CUDA_VISIBLE_DEVICES` write it (`GPU-` and 32 hex digits
    /// in groups of 8-4-4-4-12).
    pub uuid: String,
    /// The newest CUDA version the driver supports, major and minor.
    pub driver_cuda: (i32, i32),
}

/// Which form of the kernels a [`CudaBackend`] loaded ([`CudaBackend::kernel_image`]), for
/// `tpctl doctor` and the logs: machine code for the device's architecture (a CUBIN), from
/// the kernel cache or compiled as the backend opened, or generic PTX that the driver compiles
/// at every load, when the CUBIN path failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelImage {
    /// A CUBIN for `arch` (`sm_90`), read from the kernel cache at `path`.
    CachedCubin {
        /// The architecture.
        arch: String,
        /// The cache entry.
        path: std::path::PathBuf,
    },
    /// A CUBIN for `arch` compiled with NVRTC as the backend opened, and saved to the kernel
    /// cache at the path (or not, and why).
    CompiledCubin {
        /// The architecture.
        arch: String,
        /// The cache entry written, or why none was.
        saved: std::result::Result<std::path::PathBuf, String>,
    },
    /// Generic PTX, compiled by the driver at load, because the CUBIN could not be made or
    /// loaded (`reason`).
    PtxFallback {
        /// What failed on the CUBIN path.
        reason: String,
    },
}

impl KernelImage {
    /// Whether the kernels are machine code for the device (not the PTX fallback).
    pub fn is_cubin(&self) -> bool {
        !matches!(self, KernelImage::PtxFallback { .. })
    }
}

impl std::fmt::Display for KernelImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelImage::CachedCubin { arch, path } => {
                write!(f, "{arch} CUBIN from the cache at {}", path.display())
            }
            KernelImage::CompiledCubin { arch, saved: Ok(path) } => {
                write!(f, "{arch} CUBIN compiled now (NVRTC), cached at {}", path.display())
            }
            KernelImage::CompiledCubin { arch, saved: Err(why) } => {
                write!(f, "{arch} CUBIN compiled now (NVRTC), not cached: {why}")
            }
            KernelImage::PtxFallback { reason } => {
                write!(f, "PTX fallback (compiled by the driver at every load) because {reason}")
            }
        }
    }
}

/// `bytes` as `nvidia-smi` writes a device UUID.
#[cfg(any(feature = "cuda", test))]
fn uuid_text(bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// Blocks an attention launch should have at least, so a decode step (a few rows, one per
/// query head) still keeps every multiprocessor of a large GPU busy.
#[cfg(any(feature = "cuda", test))]
const ATTN_TARGET_BLOCKS: usize = 512;

/// Keys per tile of the attention kernel (its threads per block, `ATTN_BLOCK` in `kernels.cu`).
#[cfg(any(feature = "cuda", test))]
const ATTN_TILE: usize = 128;

/// Query heads of one KV head that one attention block serves (`ATTN_GROUP` in `kernels.cu`).
#[cfg(any(feature = "cuda", test))]
const ATTN_GROUP: usize = 4;

/// Blocks of an attention launch per key range: one per query token, KV head and slice of up
/// to [`ATTN_GROUP`] of the query heads that share it (their keys and values are read once).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn attention_blocks(tokens: usize, q_heads: usize, kv_heads: usize) -> usize {
    let per_group = q_heads / kv_heads.max(1);
    tokens * kv_heads * per_group.div_ceil(ATTN_GROUP)
}

/// The key ranges of an attention launch of `rows` blocks per range ([`attention_blocks`]):
/// 1 for a launch that fills the GPU (a prefill), else enough for [`ATTN_TARGET_BLOCKS`]
/// blocks. It depends on the step's shape, not on its keys: the kernel splits each token's
/// keys over the ranges ([`attention_chunk`]), a range past its keys is empty, and the merge
/// weighs it 0. So a decode step's launch, its partial results and its merge are the same
/// at every context length (the step workspace, `kernels::workspace`, plans them once, and
/// a CUDA graph can replay them).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn attention_most_splits(rows: usize) -> usize {
    ATTN_TARGET_BLOCKS.div_ceil(rows.max(1)).max(1)
}

/// Keys per range of a token with `n_kv` keys over `ranges` ranges: its keys split evenly, in
/// whole tiles (the attention kernel's rule when its `chunk` is 0, written here for the
/// tests and the docs).
#[cfg(test)]
pub(crate) fn attention_chunk(ranges: usize, n_kv: usize) -> usize {
    n_kv.div_ceil(ranges.max(1)).next_multiple_of(ATTN_TILE).max(ATTN_TILE)
}
