//! The CUDA backend proper (feature `cuda`): cuBLAS for products, NVRTC-compiled kernels for
//! everything else, behind the same tensor seam as the CPU backend.
//!
//! How data moves, and what it costs:
//! - Activations stay on the device. Every op returns a tensor over its output buffer
//!   ([`DeviceBuf`] as [`DeviceData`]) without waiting; the next op reads it in place (an
//!   input in host memory is uploaded for the call), in-place ops write the buffer when no
//!   clone shares it (else a device copy first), and the host gets a copy, after a stream
//!   synchronization, only when host code reads the numbers. All of a backend's work runs on
//!   its one stream, so queued kernels see their inputs and buffers are freed in stream order.
//!   Inside a model step the output buffers are slots of the step shape's workspace, planned
//!   from its first step ([`crate::kernels::workspace`], `buffers::StepBuf`), so a warm step
//!   allocates none.
//! - Weight matrices ([`Weight`]) are uploaded once and cached for the life of the backend,
//!   keyed by the address and length of their host buffer (weights live in allocations that
//!   keep their addresses) and trusted within one weights generation: whoever rewrites weight
//!   bytes in place or frees them calls [`weights_changed`] (a weight update, a wakeup's
//!   restore, a dropped model), and every copy is uploaded again at its next use, without the
//!   host bytes being read to check (`cache`, with the rules in `weight_stamps`; builds with
//!   debug assertions also compare a fingerprint and log a change nobody announced). The
//!   device copies come from the driver's memory pool, or from a
//!   [`DeviceArena`] given with [`CudaBackend::keep_weights_in`] (tagged `vmm` memory that a
//!   sleep unmaps): there a cleared weight keeps its region and is written into it again at
//!   its next use, so the weights keep their device addresses across a sleep.
//! - A KV cache in device memory ([`Kv::Device`]) is appended to with one host-to-device copy
//!   of the new rows and read in place by `attention`; a host one is uploaded per call.
//! - Quantized linear weights stay packed on the device ([`quant`]): a product of up to 64
//!   rows (decode) reads the packed arrays and dequantizes in registers (`qmatvec`); a larger
//!   one (a prefill) dequantizes the weight into a step buffer first and goes through cuBLAS
//!   like a dense one (sgemm for f32; `cublasGemmEx` with f32 accumulation for bf16/f16, after
//!   rounding the activations to the same type). The dequantization rounds as the CPU's
//!   `QMatrix::dequantize`, so an f32 quantized product here is a product of the CPU's
//!   dequantized values, in another summation order.
//!   Embedding tables are kept in f32 whatever the dtype (a tied LM head has both copies).
//! - A model's small vectors (norm weights, biases) are cached like the weight matrices
//!   (`CudaBackend::vector`); a step's small inputs (ids, positions, block tables, per-row
//!   offsets, draws, logit edits) are staged at addresses fixed per step shape ([`staging`]).
//! - A step's launches, products and copies are [`graphs`]' `Call`s, issued through one door:
//!   a decode step that repeats its shape's calls is captured as a CUDA graph and replayed
//!   with one launch.
//!
//! Kernels are compiled from `kernels.cu` with NVRTC for the device's architecture (a CUBIN),
//! once per architecture and process, and kept in an on-disk cache (`kernel_image`, with the
//! cache's files in `kernel_cache`) so later processes load them without compiling; generic
//! PTX is the fallback when the CUBIN cannot be made or loaded. All work runs on one stream
//! per backend.
//! Runtime failures (out of device memory, a failed launch) are reported as
//! [`Error::BackendUnavailable`] naming the op.
//!
//! The parts: this file holds the backend's state and the helpers every part shares;
//! [`context`] opens the device, [`kernel_image`] compiles (or finds) and loads the kernels, [`waits`] waits for the stream (and
//! the reductions queued on it), [`buffers`] moves tensors to and from device buffers,
//! [`cache`] keeps the uploaded weights and small arrays, [`gemm`], [`ops`] and [`attention`]
//! launch the work, [`copies`] copies rows on the device, [`staging`] puts a step's small
//! inputs at fixed addresses, and [`pool_arena`] carves driver-pool memory into arena regions.
//!
//! [`DeviceBuf`]: buffers
//! [`DeviceData`]: crate::tensor::DeviceData
//! [`Weight`]: crate::kernels::Weight
//! [`DeviceArena`]: crate::memory::DeviceArena
//! [`Kv::Device`]: crate::kernels::Kv::Device
//! [`weights_changed`]: crate::memory::weights_changed
#![allow(unsafe_code)]

mod attention;
mod buffers;
mod cache;
mod context;
mod copies;
mod fused;
mod gemm;
mod graphs;
mod kernel_image;
mod ops;
mod pool_arena;
mod quant;
mod staging;
mod timing;
mod waits;

pub use pool_arena::PoolArena;

use crate::error::{Error, Result};
use crate::kernels::cuda::counters::{Count, Counters, DeviceCounters};
use crate::kernels::GemmDtype;
use cache::{Recent, WeightCache};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use waits::InFlight;

/// Threads per block of the element-wise and row kernels (`BLOCK` in `kernels.cu`).
const BLOCK: u32 = 256;

fn unavailable(reason: impl Into<String>) -> Error {
    Error::BackendUnavailable { backend: "cuda", reason: reason.into() }
}

/// Turns a foreign error into [`Error::BackendUnavailable`] with what was being done.
trait OrUnavailable<T> {
    fn or_unavailable(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: fmt::Display> OrUnavailable<T> for std::result::Result<T, E> {
    fn or_unavailable(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| unavailable(format!("{}: {e}", what())))
    }
}

/// `x` as an `i32` kernel argument.
fn int(op: &str, what: &str, x: usize) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| unavailable(format!("{op}: {what} = {x} exceeds the kernels' 32-bit sizes")))
}

/// One thread per element, `BLOCK` per block.
fn elementwise(op: &str, n: usize) -> Result<LaunchConfig> {
    let blocks = n.div_ceil(BLOCK as usize);
    let blocks = u32::try_from(blocks)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| unavailable(format!("{op}: {n} elements need too many thread blocks")))?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 })
}

/// One block of `threads` per row.
fn per_row(op: &str, rows: usize, threads: u32) -> Result<LaunchConfig> {
    let blocks = int(op, "rows", rows)? as u32;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

/// The loaded kernels of one context.
struct Kernels {
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    rope: CudaFunction,
    split_rope: CudaFunction,
    split_rope_append: CudaFunction,
    silu_mul: CudaFunction,
    gated_halves: CudaFunction,
    gelu_tanh_mul: CudaFunction,
    scale: CudaFunction,
    soft_cap: CudaFunction,
    add_assign: CudaFunction,
    add_rows: CudaFunction,
    embedding: CudaFunction,
    argmax_rows: CudaFunction,
    top_k_rows: CudaFunction,
    sample_rows: CudaFunction,
    normalizers: CudaFunction,
    columns_at: CudaFunction,
    dequantize: CudaFunction,
    qmatvec: CudaFunction,
    edit_rows: CudaFunction,
    attention: CudaFunction,
    attention_merge: CudaFunction,
    to_bf16: CudaFunction,
    to_f16: CudaFunction,
    copy_cols: CudaFunction,
    write_rows: CudaFunction,
}

struct Inner {
    ordinal: usize,
    dtype: GemmDtype,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    /// Which form of the kernels was loaded.
    kernel_image: crate::kernels::cuda::KernelImage,
    weights: Mutex<WeightCache>,
    /// Position arrays uploaded lately, most recent last (see [`CudaBackend::positions`]).
    positions: Mutex<Recent<u64>>,
    /// Block tables of paged KV caches uploaded lately, most recent last.
    tables: Mutex<Recent<u32>>,
    /// A reduction queued on the stream and not yet waited for through its communicator.
    in_flight: Mutex<Option<InFlight>>,
    /// The step workspaces (see [`crate::kernels::workspace`]): the buffers of a planned
    /// step's kernels.
    workspace: Mutex<crate::kernels::workspace::StepMemory<cudarc::driver::CudaSlice<u8>>>,
    /// The events around each step (see [`timing`]).
    times: Mutex<timing::StepTimes>,
    /// A step is open whose start event waits for its first work.
    step_armed: std::sync::atomic::AtomicBool,
    /// The step graphs (see [`graphs`]).
    graphs: Mutex<graphs::Graphs>,
    /// The step inputs' staging buffers (see [`staging`]), made at the first step.
    staging: Mutex<Option<staging::InputStaging>>,
    /// Nanoseconds the host has spent blocked waiting for the device (see
    /// [`CudaBackend::device_wait`]).
    waited_ns: AtomicU64,
    /// What this backend asked of the driver (see [`CudaBackend::counters`]).
    counters: DeviceCounters,
}

impl Inner {
    /// Counts one call to the driver of kind `what`, made outside [`CudaBackend::issue`]: it
    /// ends the step's graph first (a host read launches it; anything else goes on eagerly,
    /// see [`graphs`]).
    fn count(&self, what: Count) {
        self.leave_graph(matches!(what, Count::Download | Count::HostWait));
        if !matches!(what, Count::HostWait | Count::Allocation) {
            self.work_starts();
        }
        self.counters.add(what);
    }
}

impl CudaBackend {
    /// What this backend (and its clones) has asked of the driver since it opened: launches,
    /// device copies, allocations, uploads, downloads and host waits. Two snapshots around a
    /// step give the step's counts ([`Counters::since`]).
    pub fn counters(&self) -> Counters {
        self.inner.counters.snapshot()
    }

    /// Counts one call to the driver of kind `what`.
    fn count(&self, what: Count) {
        self.inner.count(what);
    }
}

/// Kernels on CUDA device `ordinal`, taking and returning host tensors (see the module docs
/// for the copies this implies). Clones share the device state and the weight cache.
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.inner.ordinal)
            .field("dtype", &self.inner.dtype)
            .field("cached_weights", &self.cache().entries.len())
            .finish()
    }
}
