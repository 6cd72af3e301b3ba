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
//! - Weight matrices ([`Weight`]) are uploaded once and cached for the life of the backend,
//!   keyed by the address and length of their host buffer (weights live in allocations that
//!   keep their addresses), and checked on every use against a fingerprint of 64 sampled
//!   words, so a freed buffer whose address is reused by another weight is noticed in
//!   practice. A weight rewritten in place at an unsampled word is not: call
//!   [`CudaBackend::clear_weight_cache`] after changing weights in place (a restore that
//!   zeroes or reloads them). The device copies come from the driver's memory pool, or from a
//!   [`DeviceArena`] given with [`CudaBackend::keep_weights_in`] (tagged `vmm` memory that a
//!   sleep unmaps): there a cleared weight keeps its region and is written into it again at
//!   its next use, so the weights keep their device addresses across a sleep.
//! - A KV cache in device memory ([`Kv::Device`]) is appended to with one host-to-device copy
//!   of the new rows and read in place by `attention`; a host one is uploaded per call.
//! - Quantized weights are dequantized on the device at first use, and only the dense copy is
//!   kept, in the backend's [`GemmDtype`]: products then go through cuBLAS like dense ones
//!   (sgemm for f32; `cublasGemmEx` with f32 accumulation for bf16/f16, after rounding the
//!   activations to the same type). In f32 this costs 4x (Q8_0) to 7x (Q4) more device memory
//!   and bandwidth than the packed form (a 135M-parameter model takes about 540 MB; half that
//!   in bf16). The dequantization rounds exactly as the CPU's `QMatrix::dequantize`, so an f32
//!   quantized product here equals the CPU's (an f32 product of the same dequantized values,
//!   in another summation order).
//!   Embedding tables are kept in f32 whatever the dtype (a tied LM head has both copies).
//! - Small per-call vectors (norm weights, biases) are copied per call like activations.
//!
//! Kernels are compiled from `kernels.cu` with NVRTC once per process (the PTX is kept in a
//! `OnceLock`) and loaded into each backend's context; all work runs on one stream per backend.
//! Runtime failures (out of device memory, a failed launch) are reported as
//! [`Error::BackendUnavailable`] naming the op.
#![allow(unsafe_code)]

use super::{attention_blocks, attention_splits};
use crate::error::{Error, Result};
use crate::kernels::cpu::attention::AttnShape;
use crate::kernels::cpu::qmatrix::QBits;
use crate::kernels::{GemmDtype, Kv, KvElem, Weight};
use crate::memory::{alloc_device_exact, DeviceArena};
use crate::tensor::{DeviceData, Tensor};
use collectives::{Communicator, DeviceRange, DeviceStream, ElemType, ReduceOp};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};
use mesh::DeviceMemory;
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// The CUDA C source of every kernel.
const SOURCE: &str = include_str!("kernels.cu");

/// Threads per block of the element-wise and row kernels (`BLOCK` in `kernels.cu`).
const BLOCK: u32 = 256;
/// Threads per block of `attention` (`ATTN_BLOCK` in `kernels.cu`).
const ATTN_BLOCK: u32 = super::ATTN_TILE as u32;
/// Largest head dimension `attention` handles (`ATTN_BLOCK * ATTN_DIMS` in `kernels.cu`).
const ATTN_MAX_HEAD_DIM: usize = 512;

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

/// The device's default memory pool, from which cudarc's stream-ordered allocations come;
/// `None` where the device has no memory pools.
fn default_pool(ctx: &CudaContext) -> Option<cudarc::driver::sys::CUmemoryPool> {
    // SAFETY: the device handle is the context's own.
    unsafe { cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device()) }.ok()
}

/// Lets the device's default memory pool keep the memory of freed buffers instead of giving
/// it back to the device at every synchronization (its default release threshold is 0): a
/// decode step frees and allocates the same temporaries again, and with the memory kept the
/// next allocation is served from the pool instead of the driver.
/// [`CudaBackend::trim_pool`] gives it back before a sleep. A failure only costs speed.
fn keep_pool_memory(ctx: &CudaContext, ordinal: usize) {
    let Some(pool) = default_pool(ctx) else { return };
    let mut keep = u64::MAX;
    // SAFETY: `pool` is valid for the context's life, and the release threshold attribute
    // takes a pointer to a cuuint64_t.
    let set = unsafe {
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
    };
    if let Err(e) = set {
        tracing::warn!("cuda:{ordinal}: keeping freed memory in the pool: {e}");
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

/// The kernels' PTX, compiled once per process. A failure is kept too: it does not fix itself.
fn ptx() -> std::result::Result<&'static Ptx, String> {
    static PTX: OnceLock<std::result::Result<Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        // No fused multiply-add, so products and sums round as on the CPU.
        let opts = CompileOptions {
            fmad: Some(false),
            name: Some("tpctl_kernels.cu".into()),
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                format!(
                    "nvrtc failed to compile the kernels ({nvrtc:?}):\n{}",
                    log.to_string_lossy()
                )
            }
            other => format!("nvrtc: {other}"),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The loaded kernels of one context.
struct Kernels {
    rms_norm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    gelu_tanh_mul: CudaFunction,
    scale: CudaFunction,
    add_assign: CudaFunction,
    add_rows: CudaFunction,
    embedding: CudaFunction,
    argmax_rows: CudaFunction,
    dequantize: CudaFunction,
    attention: CudaFunction,
    attention_merge: CudaFunction,
    to_bf16: CudaFunction,
    to_f16: CudaFunction,
    copy_cols: CudaFunction,
}

/// Where a cached weight came from (the address and length of its first host buffer) and the
/// element type of its device copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct WeightKey {
    addr: usize,
    len: usize,
    dtype: GemmDtype,
}

/// The device memory of one cached weight: dense, row-major, in its key's dtype.
enum Slot {
    /// From the driver's memory pool; freed when the weight leaves the cache.
    Pool(CudaSlice<u8>),
    /// A region of the weight arena; kept (and written again) when the weight is cleared.
    Arena(Box<dyn DeviceMemory>),
}

impl Slot {
    fn bytes(&self) -> usize {
        match self {
            Slot::Pool(s) => s.len(),
            Slot::Arena(m) => m.size(),
        }
    }
}

struct CachedWeight {
    fingerprint: u64,
    /// Whether the slot holds the weight's values (false after a clear kept an arena slot).
    fresh: bool,
    slot: Arc<Slot>,
}

/// A hash of the length and 64 evenly spaced 32-bit words of each of `parts` (all of them when
/// shorter): cheap enough for every call, and enough to notice a different weight at a reused
/// address.
fn fingerprint(parts: &[&[u8]]) -> u64 {
    const SAMPLES: usize = 64;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in parts {
        p.len().hash(&mut h);
        let words = p.len() / 4;
        let step = words.div_ceil(SAMPLES).max(1);
        for w in (0..words).step_by(step) {
            p[4 * w..4 * w + 4].hash(&mut h);
        }
        p[4 * words..].hash(&mut h);
    }
    h.finish()
}

/// The weight cache and where its slots come from.
#[derive(Default)]
struct WeightCache {
    entries: HashMap<WeightKey, CachedWeight>,
    arena: Option<Arc<dyn DeviceArena>>,
}

struct Inner {
    ordinal: usize,
    dtype: GemmDtype,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    weights: Mutex<WeightCache>,
    /// Position arrays uploaded lately, most recent last (see [`CudaBackend::positions`]).
    positions: Mutex<Recent<u64>>,
    /// Block tables of paged KV caches uploaded lately, most recent last.
    tables: Mutex<Recent<u32>>,
    /// A reduction queued on the stream and not yet waited for through its communicator.
    in_flight: Mutex<Option<InFlight>>,
    /// Nanoseconds the host has spent blocked waiting for the device (see
    /// [`CudaBackend::device_wait`]).
    waited_ns: AtomicU64,
}

/// A reduction [`CudaBackend::all_reduce_sum`] queued on the stream: from when, within what
/// deadline, over which group. While one is in flight the backend's own waits for the stream
/// are bounded by its deadline, since a reduction whose peer died never completes.
#[derive(Debug)]
struct InFlight {
    since: Instant,
    limit: Duration,
    group: String,
}

impl Inner {
    /// Waits until the work queued on the stream has completed. With a reduction in flight
    /// the wait polls until the reduction's deadline and then fails naming its group (the
    /// communicator's own wait, [`CudaBackend::wait_collectives`], also names a failed peer).
    fn sync(&self, op: &str) -> Result<()> {
        self.blocking(|| self.wait_for_stream(op))
    }

    /// Runs `wait`, a wait for the device, counting its time as the host's time blocked on
    /// the device.
    fn blocking<R>(&self, wait: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let result = wait();
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        result
    }

    fn wait_for_stream(&self, op: &str) -> Result<()> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(pending) = in_flight.as_ref() else {
            return self
                .stream
                .synchronize()
                .or_unavailable(|| format!("{op}: waiting for the device"));
        };
        let done = self
            .stream
            .record_event(None)
            .or_unavailable(|| format!("{op}: marking the stream"))?;
        let deadline = pending.since + pending.limit;
        let mut nap = Duration::from_micros(20);
        loop {
            if done.try_is_complete().or_unavailable(|| format!("{op}: polling the stream"))? {
                *in_flight = None;
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                // Kept: every later wait fails as fast until the reduction ends (its
                // communicator's failure aborts it).
                return Err(unavailable(format!(
                    "cuda:{}: {op}: the device did not finish within {:?} of an all-reduce over \
                     the `{}` group queued before it; a rank of that group may have failed",
                    self.ordinal, pending.limit, pending.group
                )));
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

/// Small host arrays and their device copies, most recently used last.
type Recent<T> = Vec<(Vec<T>, Arc<CudaSlice<T>>)>;

/// Arrays of each kind kept on the device: a step's query positions and its keys' positions
/// (the same in every layer), or its block tables (one per sequence, the same in every layer),
/// with room for a CP rank's two views.
const RECENT_UPLOADS: usize = 4;

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

impl CudaBackend {
    /// Opens device `ordinal`: checks that the driver, NVRTC and cuBLAS libraries load and the
    /// device exists, creates a stream and a cuBLAS handle, and loads the kernels.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] naming what is missing: the driver library, a device
    /// `ordinal`, NVRTC or cuBLAS, or the compile log when the kernels fail to compile.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_gemm_dtype(ordinal, GemmDtype::F32)
    }

    /// Opens device `ordinal` as [`CudaBackend::new`] does, keeping weight matrices in `dtype`.
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn with_gemm_dtype(ordinal: usize, dtype: GemmDtype) -> Result<Self> {
        let at = |reason: String| unavailable(format!("device {ordinal}: {reason}"));
        // cudarc panics when a library it calls into cannot be loaded; probe each first.
        // SAFETY: the probes only try to load the shared libraries by name and drop them
        // again; loading runs the CUDA libraries' own initializers and nothing else.
        let (driver, nvrtc, cublas) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        };
        if !driver {
            return Err(
                at("the CUDA driver library (libcuda.so) is not on the loader path".into()),
            );
        }
        let count = CudaContext::device_count().map_err(|e| at(format!("cuInit failed: {e}")))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(at(format!("no such device: {count} CUDA device(s) visible")));
        }
        if !nvrtc {
            return Err(at("NVRTC (libnvrtc.so.12) is not on the loader path".into()));
        }
        if !cublas {
            return Err(at("cuBLAS (libcublas.so.12) is not on the loader path".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| at(format!("creating a context: {e}")))?;
        // All of this backend's work runs on its one stream (NCCL's reductions of its buffers
        // included), and its buffers meet other streams (vmm's copies) only across a host
        // synchronization, so cudarc's
        // per-buffer events would cost two event creations per allocation and a record per
        // use for nothing.
        // SAFETY: this context value is this backend's own (`CudaContext::new` makes a new
        // one), no buffer has been made from it yet, and every buffer made from it is used on
        // `stream` alone: none needs events to order its uses.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx, ordinal);
        let stream = ctx.new_stream().map_err(|e| at(format!("creating a stream: {e}")))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| at(format!("creating a cuBLAS handle: {e}")))?;
        let ptx = ptx().map_err(at)?;
        let module = ctx.load_module(ptx.clone()).map_err(|e| {
            at(format!("loading the kernels' PTX (a driver older than NVRTC?): {e}"))
        })?;
        let f = |name: &str| {
            module.load_function(name).map_err(|e| at(format!("kernel `{name}`: {e}")))
        };
        let k = Kernels {
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            silu_mul: f("silu_mul")?,
            gelu_tanh_mul: f("gelu_tanh_mul")?,
            scale: f("scale")?,
            add_assign: f("add_assign")?,
            add_rows: f("add_rows")?,
            embedding: f("embedding")?,
            argmax_rows: f("argmax_rows")?,
            dequantize: f("dequantize")?,
            attention: f("attention")?,
            attention_merge: f("attention_merge")?,
            to_bf16: f("to_bf16")?,
            to_f16: f("to_f16")?,
            copy_cols: f("copy_cols")?,
        };
        tracing::debug!(ordinal, dtype = dtype.name(), "cuda backend ready");
        let inner = Inner {
            ordinal,
            dtype,
            stream,
            blas,
            k,
            weights: Mutex::default(),
            positions: Mutex::default(),
            tables: Mutex::default(),
            in_flight: Mutex::default(),
            waited_ns: AtomicU64::new(0),
        };
        Ok(CudaBackend { inner: Arc::new(inner) })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The element type of the weight matrices on the device.
    pub fn gemm_dtype(&self) -> GemmDtype {
        self.inner.dtype
    }

    /// Keeps the device copies of weights (and norm vectors) in memory from `arena` from now on:
    /// one region of exactly the copy's size per weight, never returned. The weights cached so
    /// far are dropped and uploaded there at their next use.
    pub fn keep_weights_in(&self, arena: Arc<dyn DeviceArena>) {
        let mut cache = self.cache();
        cache.entries.clear();
        cache.arena = Some(arena);
        drop(cache);
        self.wait_for_frees();
    }

    /// Forgets the device values of every cached weight: the next use of a weight uploads it
    /// again. Needed after weights change in place, and when the arena's memory was unmapped
    /// (a sleep); weights that move to new host buffers are uploaded again anyway.
    ///
    /// Copies in pool memory are freed, on the backend's stream, into the driver's memory
    /// pool, which is then trimmed ([`CudaBackend::trim_pool`]) so a sleep's NVML reading
    /// sees the memory free. Copies in arena memory keep their regions (the arena's owner
    /// releases those).
    pub fn clear_weight_cache(&self) {
        let mut cache = self.cache();
        cache.entries.retain(|_, w| matches!(*w.slot, Slot::Arena(_)));
        cache.entries.values_mut().for_each(|w| w.fresh = false);
        drop(cache);
        self.trim_pool();
    }

    /// Gives the memory the driver's pool keeps between steps back to the device: waits for
    /// the stream (so every freed buffer is back in the pool), then trims the pool to nothing.
    /// The pool keeps freed memory otherwise (see `keep_pool_memory`), so a sleep calls this
    /// before it measures what it released.
    pub fn trim_pool(&self) {
        self.wait_for_frees();
        let Some(pool) = default_pool(self.stream().context()) else { return };
        // SAFETY: `pool` is the device's default pool, which lives as long as the context.
        let trimmed = unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) };
        if let Err(e) = trimmed {
            tracing::warn!("cuda:{}: trimming the memory pool: {e}", self.inner.ordinal);
        }
    }

    fn wait_for_frees(&self) {
        if let Err(e) = self.inner.sync("freeing") {
            tracing::warn!("cuda:{}: waiting for freed weights: {e}", self.inner.ordinal);
        }
    }

    /// The time the host has spent blocked waiting for this device since the backend was
    /// made: copies of results to the host, waits for uploads, and the waits of the
    /// reductions it queues. A step's wall time minus its share of this is the host's own
    /// time (queueing kernels, the CPU-side work); the rest the host waited for the GPU.
    pub fn device_wait(&self) -> Duration {
        Duration::from_nanos(self.inner.waited_ns.load(Ordering::Relaxed))
    }

    /// What the driver says about this backend's device: name, compute capability, memory,
    /// UUID, and the CUDA version the driver supports.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when a driver query fails.
    pub fn describe(&self) -> Result<super::CudaDeviceInfo> {
        let ctx = self.stream().context();
        let query = |what: &str| format!("cuda:{}: querying the {what}", self.inner.ordinal);
        let (free_bytes, total_bytes) = ctx.mem_get_info().or_unavailable(|| query("memory"))?;
        let uuid = ctx.uuid().or_unavailable(|| query("UUID"))?;
        let mut version = 0;
        // SAFETY: the driver is loaded (this backend made a context with it);
        // `cuDriverGetVersion` writes one int through the pointer, a live local.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
            .result()
            .or_unavailable(|| query("driver version"))?;
        Ok(super::CudaDeviceInfo {
            name: ctx.name().or_unavailable(|| query("name"))?,
            compute_capability: ctx
                .compute_capability()
                .or_unavailable(|| query("compute capability"))?,
            total_bytes,
            free_bytes,
            uuid: super::uuid_text(uuid.bytes.map(|b| b as u8)),
            driver_cuda: (version / 1000, version % 1000 / 10),
        })
    }

    /// Device bytes held by cached weights (arena regions included).
    pub fn cached_weight_bytes(&self) -> usize {
        self.cache().entries.values().map(|w| w.slot.bytes()).sum()
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, WeightCache> {
        // The map stays consistent even if a holder panicked: entries are inserted whole.
        self.inner.weights.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Makes the backend's context current on this thread, for the raw driver and cuBLAS
    /// calls (the safe API binds it itself).
    fn bind(&self, op: &str) -> Result<()> {
        self.stream()
            .context()
            .bind_to_thread()
            .or_unavailable(|| format!("{op}: binding the context"))
    }

    /// A device copy of `host`.
    fn upload<T: DeviceRepr>(&self, op: &str, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream().clone_htod(host).or_unavailable(|| format!("{op}: copying to the device"))
    }

    /// A device buffer of `len` zeros.
    fn zeros(&self, op: &str, len: usize) -> Result<CudaSlice<f32>> {
        self.stream().alloc_zeros(len).or_unavailable(|| format!("{op}: allocating {len} floats"))
    }

    /// A device buffer of `len` floats for an output that the next kernel or cuBLAS call
    /// writes whole: no memset (one launch fewer per op). Its contents are unspecified until
    /// then; every caller says in its SAFETY note why each element is written.
    fn output_buf(&self, op: &str, len: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: an unwritten device buffer is never read on the host: it is handed only to
        // the launch that writes it (each caller), in stream order before any read.
        unsafe { self.stream().alloc::<f32>(len) }
            .or_unavailable(|| format!("{op}: allocating {len} floats"))
    }

    /// Copies `dev` into `host` (same length) and waits for the stream.
    fn download<T: DeviceRepr>(&self, op: &str, dev: &CudaSlice<T>, host: &mut [T]) -> Result<()> {
        let stream = self.stream();
        stream.memcpy_dtoh(dev, host).or_unavailable(|| format!("{op}: copying to the host"))?;
        self.inner.sync(op)
    }

    /// The device address of `s`, for raw calls on the backend's stream. The slice must
    /// outlive the work queued with the address; dropping it is enough, as a slice is freed in
    /// stream order, after the work queued before.
    fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(self.stream()).0
    }

    /// The address of memory someone else owns, checked to be of this backend's device (what
    /// [`DeviceMemory`] promises beyond that is its implementation's contract).
    fn owned_addr(&self, op: &str, mem: &dyn DeviceMemory) -> Result<u64> {
        let want = mesh::Device::Cuda(self.inner.ordinal);
        if mem.device() != want {
            return Err(Error::WrongDevice { op: op.to_owned(), got: mem.device(), want });
        }
        Ok(mem.device_ptr())
    }

    /// The device address of a weight slot; see [`CudaBackend::addr`].
    fn slot_addr(&self, slot: &Slot) -> u64 {
        match slot {
            Slot::Pool(s) => self.addr(s),
            Slot::Arena(m) => m.device_ptr(),
        }
    }

    /// Copies `src` to device address `dst` and waits for the copy.
    ///
    /// # Safety
    /// `dst..dst + 4·src.len()` is device memory of this backend's context that nothing else
    /// uses while the copy runs.
    unsafe fn copy_to_addr<T: DeviceRepr>(&self, op: &str, dst: u64, src: &[T]) -> Result<()> {
        self.bind(op)?;
        let stream = self.stream();
        // SAFETY: the caller vouches for the destination; `src` is a live host slice and the
        // stream is synchronized before it can be dropped.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .or_unavailable(|| format!("{op}: copying {} values to the device", src.len()))?;
        self.inner.sync(op)
    }

    /// Copies `src` into device memory `dst`, stored as `elem` (bf16 rounded on the host, to
    /// nearest even as the `to_bf16` kernel rounds), from its `offset`-th element on (the
    /// caller checked that they fit).
    pub(crate) fn write_device(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        offset: usize,
        src: &[f32],
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        const OP: &str = "kv cache append";
        debug_assert!(elem.size() * (offset + src.len()) <= dst.size());
        let at = self.owned_addr(OP, dst)? + (elem.size() * offset) as u64;
        match elem {
            // SAFETY: `dst` is memory of this device (checked above) that its `DeviceMemory`
            // implementation promises is mapped while kernels may run; the src.len() elements
            // from `offset` lie inside it (checked by the caller).
            KvElem::F32 => unsafe { self.copy_to_addr(OP, at, src) },
            KvElem::Bf16 => {
                let bits: Vec<u16> =
                    src.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                // SAFETY: as for f32, with two bytes an element.
                unsafe { self.copy_to_addr(OP, at, &bits) }
            }
        }
    }

    /// The device copy of `w` as dense `[rows, cols]` in `dtype`, uploading (and dequantizing)
    /// it on first use, or again after a clear.
    fn weight(&self, op: &str, w: &Weight, dtype: GemmDtype) -> Result<Arc<Slot>> {
        let (addr, len, print) = match w {
            Weight::F32(t) => {
                let bytes: &[u8] = bytemuck::cast_slice(t.data());
                (bytes.as_ptr() as usize, bytes.len(), fingerprint(&[bytes]))
            }
            Weight::Quant(q) => {
                let (scales, mins, qs) = q.parts();
                let parts: [&[u8]; 3] =
                    [bytemuck::cast_slice(scales), bytemuck::cast_slice(mins), qs];
                (qs.as_ptr() as usize, qs.len(), fingerprint(&parts))
            }
        };
        let (rows, cols) = w.dims();
        let n = rows * cols;
        self.cached(op, WeightKey { addr, len, dtype }, print, n, |dst| match (dtype, w) {
            // SAFETY: the slot holds at least n floats of this device and is used by no one
            // else while the cache's lock is held.
            (GemmDtype::F32, Weight::F32(t)) => unsafe { self.copy_to_addr(op, dst, t.data()) },
            (GemmDtype::F32, Weight::Quant(q)) => self.dequantize(op, q, dst),
            (half, _) => {
                // Dense f32 first, then rounded into the slot.
                let dense = match w {
                    Weight::F32(t) => self.upload(op, t.data())?,
                    Weight::Quant(q) => {
                        let out = self.zeros(op, n.max(1))?;
                        self.dequantize(op, q, self.addr(&out))?;
                        out
                    }
                };
                self.round_to(op, half, self.addr(&dense), dst, n)?;
                // `dense` is freed on return: wait until the rounding has read it.
                self.inner.sync(op)
            }
        })
    }

    /// `positions` as u64 on the device. Every layer of a step passes the same query and key
    /// positions, so the last few arrays are kept and a repeat is not uploaded again (checked
    /// by value: the host comparison costs far less than a copy and its synchronization).
    fn positions(&self, op: &str, positions: &[usize]) -> Result<Arc<CudaSlice<u64>>> {
        let wanted: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
        self.recent(op, &self.inner.positions, wanted)
    }

    /// The device copy of `wanted` from `cache` when it holds the same values, else a new
    /// upload, kept there in place of the least recently used one.
    fn recent<T: DeviceRepr + PartialEq>(
        &self,
        op: &str,
        cache: &Mutex<Recent<T>>,
        wanted: Vec<T>,
    ) -> Result<Arc<CudaSlice<T>>> {
        let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = cache.iter().position(|(p, _)| *p == wanted) {
            let hit = cache.remove(i);
            let dev = hit.1.clone();
            cache.push(hit);
            return Ok(dev);
        }
        let dev = Arc::new(self.upload(op, &wanted)?);
        if cache.len() == RECENT_UPLOADS {
            // Freed in stream order, after the kernels queued with it.
            cache.remove(0);
        }
        cache.push((wanted, dev.clone()));
        Ok(dev)
    }

    /// The device copy of a small f32 vector of the model (a norm's weight), cached like the
    /// weight matrices.
    fn vector(&self, op: &str, v: &[f32]) -> Result<Arc<Slot>> {
        let bytes: &[u8] = bytemuck::cast_slice(v);
        let key =
            WeightKey { addr: bytes.as_ptr() as usize, len: bytes.len(), dtype: GemmDtype::F32 };
        // SAFETY: as in `weight`: the slot holds at least v.len() floats and is this call's.
        self.cached(op, key, fingerprint(&[bytes]), v.len(), |dst| unsafe {
            self.copy_to_addr(op, dst, v)
        })
    }

    /// The cache entry of `key` when it is current (fingerprint `print`, not cleared since),
    /// else a slot of `elements` values of the key's dtype filled by `fill` (given its device
    /// address): the entry's old slot when it has that size, so a weight keeps its address.
    fn cached(
        &self,
        op: &str,
        key: WeightKey,
        print: u64,
        elements: usize,
        fill: impl FnOnce(u64) -> Result<()>,
    ) -> Result<Arc<Slot>> {
        // Held through the upload, so two threads never upload the same weight twice.
        let mut cache = self.cache();
        if let Some(hit) = cache.entries.get(&key).filter(|c| c.fresh && c.fingerprint == print) {
            return Ok(hit.slot.clone());
        }
        let bytes = elements.max(1) * key.dtype.size();
        let slot = match cache.entries.remove(&key) {
            Some(old) if old.slot.bytes() == bytes => old.slot,
            _ => Arc::new(match &cache.arena {
                Some(arena) => {
                    let memory = alloc_device_exact(arena.as_ref(), bytes)?;
                    self.owned_addr(op, memory.as_ref())?;
                    Slot::Arena(memory)
                }
                None => Slot::Pool(
                    self.stream()
                        .alloc_zeros::<u8>(bytes)
                        .or_unavailable(|| format!("{op}: allocating {bytes} bytes"))?,
                ),
            }),
        };
        fill(self.slot_addr(&slot))?;
        cache
            .entries
            .insert(key, CachedWeight { fingerprint: print, fresh: true, slot: slot.clone() });
        Ok(slot)
    }

    /// Rounds `n` floats at device address `src` to `dtype` (bf16 or f16) at `dst`.
    fn round_to(&self, op: &str, dtype: GemmDtype, src: u64, dst: u64, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = match dtype {
            GemmDtype::Bf16 => &self.inner.k.to_bf16,
            GemmDtype::F16 => &self.inner.k.to_f16,
            GemmDtype::F32 => {
                return Err(unavailable(format!(
                    "{op}: rounding f32 to f32 is a copy, not a kernel"
                )));
            }
        };
        let n64 = n as u64;
        let cfg = elementwise(op, n)?;
        let mut b = self.stream().launch_builder(f);
        b.arg(&src).arg(&dst).arg(&n64);
        // SAFETY: the arguments match `to_bf16` / `to_f16(const float*, unsigned short*, u64)`;
        // thread i < n reads float i of `src` and writes half i of `dst`, and the callers pass
        // buffers of at least n floats and n halves of this device, alive until the stream is
        // synchronized.
        unsafe { b.launch(cfg) }
            .or_unavailable(|| format!("{op}: launching to_{}", dtype.name()))?;
        Ok(())
    }

    /// Uploads a quantized matrix and expands it to f32 on the device at address `out`, which
    /// holds at least rows·cols floats.
    fn dequantize(&self, op: &str, q: &crate::kernels::QMatrix, out: u64) -> Result<()> {
        let (rows, cols) = q.dims();
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        let (scales, mins, qs) = q.parts();
        let kind: i32 = match q.bits() {
            QBits::Eight => 0,
            QBits::Four => 1,
            QBits::Eight16 if q.parts().1.is_empty() => 2,
            QBits::Eight16 => 3,
        };
        let scales = self.upload(op, scales)?;
        // 8-bit weights have no minimums (nor may `Eight16` ones); the kernel then never reads
        // them, but needs a pointer.
        let mins = if mins.is_empty() { self.zeros(op, 1)? } else { self.upload(op, mins)? };
        let qs = self.upload(op, qs)?;
        let n64 = n as u64;
        let cfg = elementwise(op, n)?;
        let mut b = self.stream().launch_builder(&self.inner.k.dequantize);
        b.arg(&scales).arg(&mins).arg(&qs).arg(&out).arg(&n64).arg(&kind);
        // SAFETY: the arguments match `dequantize(const float*, const float*, const unsigned
        // char*, float*, u64, int)`. For n = rows·cols elements it reads n/32 scales (n/16 for
        // kinds 2 and 3), as many minimums (kinds 1 and 3 only), n (8-bit) or n/2 (4-bit)
        // quant bytes, and writes n floats:
        // exactly the lengths of the buffers uploaded from a well-formed `QMatrix`, and at
        // most what `out` holds (the caller's promise).
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{op}: launching dequantize"))?;
        // The uploaded parts are freed on return: wait until the kernel has read them.
        self.inner.sync(op)
    }

    /// The device address of `t`'s elements for a kernel to read: its own device buffer when
    /// it is this backend's output (read in place), else a copy uploaded for the call (device
    /// data of another backend goes through the host). The returned [`Input`] keeps an upload
    /// alive; the caller keeps `t` borrowed while queuing the work.
    fn input(&self, op: &str, t: &Tensor) -> Result<Input> {
        if let Some(buf) = self.own(t.storage().device_data()) {
            return Ok(Input { ptr: self.addr(buf), _staged: None });
        }
        let staged = self.upload(op, t.data())?;
        Ok(Input { ptr: self.addr(&staged), _staged: Some(staged) })
    }

    /// `data`'s buffer when it is an output of this backend (same stream, so no ordering to add).
    fn own<'a>(&self, data: Option<&'a Arc<dyn DeviceData>>) -> Option<&'a CudaSlice<f32>> {
        let buf = data?.as_any().downcast_ref::<DeviceBuf>()?;
        Arc::ptr_eq(&buf.owner, &self.inner).then_some(&buf.buf)
    }

    /// The device address of `t`'s elements for a kernel to overwrite in place: its own buffer
    /// when it is this backend's output and no clone shares it, else a fresh device copy that
    /// becomes `t`'s data. Either way `t` is device data whose host copy is gone.
    fn writable(&self, op: &str, t: &mut Tensor) -> Result<u64> {
        if let Some(buf) = self.own(t.storage_mut().device_data_for_write()) {
            return Ok(self.addr(buf));
        }
        let buf = match self.own(t.storage().device_data()) {
            Some(shared) => self
                .stream()
                .clone_dtod(shared)
                .or_unavailable(|| format!("{op}: copying on the device"))?,
            None => self.upload(op, t.data())?,
        };
        let ptr = self.addr(&buf);
        t.set_device_data(self.wrap(buf))?;
        Ok(ptr)
    }

    /// `buf` as tensor data that stays on the device until the host reads it.
    fn wrap(&self, buf: CudaSlice<f32>) -> Arc<dyn DeviceData> {
        Arc::new(DeviceBuf { buf, owner: self.inner.clone() })
    }

    /// A tensor of `shape` over the output `buf`.
    fn output(&self, shape: &[usize], buf: CudaSlice<f32>) -> Result<Tensor> {
        Tensor::from_device(shape, self.wrap(buf))
    }

    /// `x[m, k] · wᵀ` (`w` of `[n, k]`) shaped `shape`, with cuBLAS: sgemm in f32, GemmEx with
    /// f32 accumulation in bf16/f16.
    pub(crate) fn linear(
        &self,
        x: &Tensor,
        w: &Weight,
        (m, n, k): (usize, usize, usize),
        shape: &[usize],
    ) -> Result<Tensor> {
        const OP: &str = "linear";
        if m == 0 || n == 0 || k == 0 {
            return Ok(Tensor::zeros(shape));
        }
        let dtype = self.inner.dtype;
        let wd = self.weight(OP, w, dtype)?;
        let xd = self.input(OP, x)?;
        // Written whole by the product (beta = 0).
        let mut od = self.output_buf(OP, m * n)?;
        // The activations in the weights' type (a half copy for bf16/f16).
        let half = match dtype {
            GemmDtype::F32 => None,
            _ => {
                // SAFETY: written whole by the rounding kernel right below, before the
                // product reads it (stream order).
                let h = unsafe { self.stream().alloc::<u16>(m * k) }
                    .or_unavailable(|| format!("{OP}: allocating {} halves", m * k))?;
                self.round_to(OP, dtype, xd.ptr, self.addr(&h), m * k)?;
                Some(h)
            }
        };
        let xp = half.as_ref().map_or(xd.ptr, |h| self.addr(h));
        let wp = self.slot_addr(&wd);
        // cuBLAS is column-major. Row-major out[m, n] is column-major outᵀ[n, m] = W·xᵀ, where
        // the row-major weight buffer read column-major is Wᵀ[k, n] (so transpose it back) and
        // the row-major x buffer is xᵀ[k, m] as it stands.
        let rows = int(OP, "out_features", n)?;
        let cols = int(OP, "rows", m)?;
        let inner = int(OP, "in_features", k)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (out_ptr, record) = od.device_ptr_mut(self.stream());
        self.bind(OP)?;
        let handle = *self.inner.blas.handle();
        let (transa, transb) = (cublasOperation_t::CUBLAS_OP_T, cublasOperation_t::CUBLAS_OP_N);
        // SAFETY: the handle was created on this backend's stream and context (bound above).
        // With these dimensions the product reads n·k elements of the weight (lda = k,
        // transposed), k·m of x (ldb = k) and writes n·m floats of out (ldc = n); the weight
        // slot holds the n·k values of `w` in `dtype`, x (or its half copy, of the weight's
        // type) and out hold m·k and m·n elements. Every buffer is freed stream-ordered, after
        // the product. beta = 0, so out is not read; alpha and beta are f32, as the f32
        // compute type of GemmEx wants.
        let done = unsafe {
            match dtype {
                GemmDtype::F32 => cudarc::cublas::result::sgemm(
                    handle,
                    transa,
                    transb,
                    rows,
                    cols,
                    inner,
                    &alpha,
                    wp as *const f32,
                    inner,
                    xp as *const f32,
                    inner,
                    &beta,
                    out_ptr as *mut f32,
                    rows,
                ),
                half => {
                    let t = match half {
                        GemmDtype::Bf16 => cudaDataType::CUDA_R_16BF,
                        _ => cudaDataType::CUDA_R_16F,
                    };
                    cudarc::cublas::result::gemm_ex(
                        handle,
                        transa,
                        transb,
                        rows,
                        cols,
                        inner,
                        (&alpha as *const f32).cast(),
                        wp as *const std::ffi::c_void,
                        t,
                        inner,
                        xp as *const std::ffi::c_void,
                        t,
                        inner,
                        (&beta as *const f32).cast(),
                        out_ptr as *mut std::ffi::c_void,
                        cudaDataType::CUDA_R_32F,
                        rows,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
            }
        };
        done.or_unavailable(|| format!("{OP}: {} gemm {m}x{k} by {k}x{n}", dtype.name()))?;
        drop(record);
        self.output(shape, od)
    }

    /// RMSNorm of rows of `weight.len()` elements.
    pub(crate) fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        let d = weight.len();
        if x.is_empty() || d == 0 {
            return Ok(Tensor::zeros(x.shape()));
        }
        let rows = x.len() / d;
        let xd = self.input(OP, x)?;
        let wd = self.vector(OP, weight.data())?;
        let wp = self.slot_addr(&wd);
        // Written whole: block r writes the d floats of row r.
        let mut od = self.output_buf(OP, x.len())?;
        let d32 = int(OP, "row length", d)?;
        let cfg = per_row(OP, rows, BLOCK)?;
        let mut b = self.stream().launch_builder(&self.inner.k.rms_norm);
        b.arg(&xd.ptr).arg(&wp).arg(&mut od).arg(&d32).arg(&eps);
        // SAFETY: the arguments match `rms_norm(const float*, const float*, float*, int,
        // float)`; block r reads and writes row r (d floats) of x and out, which hold rows·d
        // floats, and reads the d floats of the weight's device copy.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        self.output(x.shape(), od)
    }

    /// Rotate-half rotary embedding in place (see `cpu::rope::rope`).
    pub(crate) fn rope(
        &self,
        x: &mut Tensor,
        positions: &[usize],
        (heads, head_dim, rot_dim): (usize, usize, usize),
        theta: f32,
        factors: Option<&[f32]>,
    ) -> Result<()> {
        const OP: &str = "rope";
        let pairs = positions.len() * heads * (rot_dim / 2);
        if pairs == 0 {
            return Ok(());
        }
        let xp = self.writable(OP, x)?;
        let pd = self.positions(OP, positions)?;
        // The factors' device copy, cached as a model vector; null for none.
        let fd = factors.map(|f| self.vector(OP, f)).transpose()?;
        let fp = fd.as_ref().map_or(0, |f| self.slot_addr(f));
        let args = [
            int(OP, "tokens", positions.len())?,
            int(OP, "heads", heads)?,
            int(OP, "head_dim", head_dim)?,
            int(OP, "rot_dim", rot_dim)?,
        ];
        let cfg = elementwise(OP, pairs)?;
        let mut b = self.stream().launch_builder(&self.inner.k.rope);
        b.arg(&xp).arg(&*pd);
        for a in &args {
            b.arg(a);
        }
        b.arg(&theta).arg(&fp);
        // SAFETY: the arguments match `rope(float*, const u64*, int, int, int, int, float,
        // const float*)`. Thread (t, h, i) for i < rot_dim/2 reads position t (and factor i:
        // the caller checked there are rot_dim/2, or the pointer is null and not read) and
        // rewrites elements i and i + rot_dim/2 of head h of token t; the caller checked x
        // holds tokens·heads·head_dim floats with rot_dim <= head_dim, and threads past the
        // last pair return at once. `writable` made x's buffer this tensor's own.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        Ok(())
    }

    /// Causal GQA attention with per-row log-sum-exp (see `cpu::attention::attention`):
    /// returns `[q_pos.len(), q_heads, head_dim]` and, when `want_lse`, `[q_pos.len(), q_heads]`.
    pub(crate) fn attention(
        &self,
        q: &Tensor,
        q_pos: &[usize],
        kv: Kv<'_>,
        kv_pos: &[usize],
        shape: AttnShape,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "attention";
        let AttnShape { q_heads, kv_heads, head_dim } = shape;
        let rows = q_pos.len() * q_heads;
        let (out_shape, lse_shape) = ([q_pos.len(), q_heads, head_dim], [q_pos.len(), q_heads]);
        if head_dim > ATTN_MAX_HEAD_DIM {
            return Err(Error::shape(
                OP,
                format!("head_dim {head_dim} exceeds the cuda kernel's {ATTN_MAX_HEAD_DIM}"),
            ));
        }
        if rows == 0 || head_dim == 0 || kv_pos.is_empty() {
            // No keys at all: zeros and -inf, the neutral partial result.
            let lse = want_lse
                .then(|| Tensor::from_vec(&lse_shape, vec![f32::NEG_INFINITY; rows]))
                .transpose()?;
            return Ok((Tensor::zeros(&out_shape), lse));
        }
        let qd = self.input(OP, q)?;
        let qpd = self.positions(OP, q_pos)?;
        // Host keys and values are uploaded for this call; a device cache is read in place,
        // a paged one through its block table (uploaded here).
        let mut staged = None;
        let mut table = None;
        // Key row j is at `table[j / block_size] · block_stride + (j % block_size) · row`
        // with a table, at `j · row` without.
        let (mut block_size, mut block_stride) = (1, 0u64);
        // Only device caches and pools may hold bf16 keys and values.
        let mut kv_bf16 = 0i32;
        let (kp, vp) = match kv {
            Kv::Host { k, v } => {
                let (kd, vd) = staged.insert((self.upload(OP, k)?, self.upload(OP, v)?));
                (self.addr(kd), self.addr(vd))
            }
            Kv::Device { k, v, elem } => {
                kv_bf16 = i32::from(elem == KvElem::Bf16);
                (self.owned_addr(OP, k)?, self.owned_addr(OP, v)?)
            }
            Kv::Paged(blocks) => {
                // Host blocks are copied into one buffer per tensor and uploaded.
                let (k, v) = blocks.gather(kv_pos.len(), kv_heads * head_dim);
                let (kd, vd) = staged.insert((self.upload(OP, &k)?, self.upload(OP, &v)?));
                (self.addr(kd), self.addr(vd))
            }
            Kv::PagedDevice(blocks) => {
                let used = kv_pos.len().div_ceil(blocks.block_size);
                // The same table in every layer of a step: uploaded once.
                let wanted = blocks.table[..used].to_vec();
                table = Some(self.recent(OP, &self.inner.tables, wanted)?);
                block_size = int(OP, "block_size", blocks.block_size)?;
                block_stride = blocks.block_stride as u64;
                let base = self.owned_addr(OP, blocks.memory)?;
                kv_bf16 = i32::from(blocks.elem == KvElem::Bf16);
                let at = |elements: usize| base + (blocks.elem.size() * elements) as u64;
                (at(blocks.keys), at(blocks.values))
            }
        };
        let tp = table.as_ref().map_or(0, |t| self.addr(t));
        let kpd = self.positions(OP, kv_pos)?;
        let n_kv = kv_pos.len();
        let blocks = attention_blocks(q_pos.len(), q_heads, kv_heads);
        let (splits, chunk) = attention_splits(blocks, n_kv);
        // Written whole: block (r, s) writes row s·rows + r of out (head_dim floats) and of
        // lse; with one range those are the answer, with several the partial results.
        let mut od = self.output_buf(OP, splits * rows * head_dim)?;
        let mut ld = self.output_buf(OP, splits * rows)?;
        let args = [
            int(OP, "keys", n_kv)?,
            int(OP, "q_heads", q_heads)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
        ];
        let chunk32 = int(OP, "key range", chunk)?;
        // The CPU scales by 1/sqrt(d) computed in f32 the same way.
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut cfg = per_row(OP, blocks, ATTN_BLOCK)?;
        cfg.grid_dim.1 = splits as u32;
        let mut b = self.stream().launch_builder(&self.inner.k.attention);
        b.arg(&qd.ptr).arg(&*qpd).arg(&kp).arg(&vp).arg(&*kpd);
        b.arg(&tp).arg(&block_size).arg(&block_stride);
        for a in &args {
            b.arg(a);
        }
        b.arg(&scale).arg(&chunk32).arg(&kv_bf16).arg(&mut od).arg(&mut ld);
        // SAFETY: the arguments match `attention(const float*, const u64*, const float*,
        // const float*, const u64*, const unsigned*, int, u64, int, int, int, int, float, int,
        // int, float*, float*)`; keys and values are bf16 (two bytes an element) exactly when
        // kv_bf16 is 1. Block (b, s) serves query token i, KV head g and up to ATTN_GROUP
        // of g's query heads (b = (i·kv_heads + g)·slices + slice, the grid's first dimension
        // being `attention_blocks`): it reads q_pos[i] and those heads' rows of q (head_dim
        // floats each), the key positions of its range [s·chunk, (s+1)·chunk) ∩ [0, n_kv) and
        // head g of those key and value rows, and writes those rows' entries s·rows + row of
        // out and lse, which hold splits·rows rows (splits·chunk >= n_kv, from
        // `attention_splits`). The caller checked q holds q_pos.len()·q_heads·head_dim
        // floats and that the keys and values hold kv_pos.len() rows of kv_heads·head_dim:
        // contiguous buffers at least that long (staged ones are freed stream-ordered, after
        // the kernel; a device cache is mapped while steps run, as `DeviceMemory` promises),
        // or a paged pool whose table (uploaded above, ceil(n_kv / block_size) ids, freed
        // stream-ordered) names blocks that lie inside it (`DeviceBlocks::holds`); q_heads is
        // a multiple of kv_heads (so g < kv_heads); head_dim <= 512 fits the kernel's
        // per-thread output slots and shared query copy.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        let (od, ld) = if splits == 1 {
            (od, ld)
        } else {
            self.merge_attention(&od, &ld, splits, rows, head_dim)?
        };
        let lse = want_lse.then(|| self.output(&lse_shape, ld)).transpose()?;
        Ok((self.output(&out_shape, od)?, lse))
    }

    /// Row r of the combined attention result from the `splits` partial results of key
    /// ranges in `part` / `part_lse` (rows s·rows + r): `[rows, head_dim]` and `[rows]`.
    fn merge_attention(
        &self,
        part: &CudaSlice<f32>,
        part_lse: &CudaSlice<f32>,
        splits: usize,
        rows: usize,
        head_dim: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        const OP: &str = "attention merge";
        // Written whole: block r writes row r of out (head_dim floats) and lse[r].
        let mut od = self.output_buf(OP, rows * head_dim)?;
        let mut ld = self.output_buf(OP, rows)?;
        let args =
            [int(OP, "splits", splits)?, int(OP, "rows", rows)?, int(OP, "head_dim", head_dim)?];
        let cfg = per_row(OP, rows, ATTN_BLOCK)?;
        let mut b = self.stream().launch_builder(&self.inner.k.attention_merge);
        b.arg(part).arg(part_lse);
        for a in &args {
            b.arg(a);
        }
        b.arg(&mut od).arg(&mut ld);
        // SAFETY: the arguments match `attention_merge(const float*, const float*, int, int,
        // int, float*, float*)`. Block r reads rows s·rows + r (s < splits) of part (head_dim
        // floats each) and part_lse, which hold splits·rows rows, written by the attention
        // launch before it on this stream, and writes row r of out and lse[r], which hold
        // rows rows.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        Ok((od, ld))
    }

    /// Launches one of the element-wise kernels `f(float* x, const float* y, u64 n, ...)` on
    /// `x` with `y` (plus `width` for `add_rows`), in place on `x`'s device data.
    fn binary(
        &self,
        op: &str,
        f: &CudaFunction,
        x: &mut Tensor,
        y: &Tensor,
        width: Option<i32>,
    ) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        let yd = self.input(op, y)?;
        let xp = self.writable(op, x)?;
        let n = x.len() as u64;
        let cfg = elementwise(op, x.len())?;
        let mut b = self.stream().launch_builder(f);
        b.arg(&xp).arg(&yd.ptr).arg(&n);
        if let Some(w) = width.as_ref() {
            b.arg(w);
        }
        // SAFETY: the caller passes a kernel of signature `(float*, const float*, u64)` (or
        // `(float*, const float*, u64, int)` with `width`); element i < n of x is updated
        // from element i of y (i % width for add_rows), and the callers checked that y has
        // x's length (or, for add_rows, that width = y.len() > 0 divides it). x's buffer is
        // its own (`writable`), so y, read before, is never the same buffer.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{op}: launch"))?;
        Ok(())
    }

    /// `gate = silu(gate) · up`.
    pub(crate) fn silu_mul(&self, gate: &mut Tensor, up: &Tensor) -> Result<()> {
        self.binary("silu_mul", &self.inner.k.silu_mul, gate, up, None)
    }

    /// `gate = gelu_tanh(gate) · up`.
    pub(crate) fn gelu_tanh_mul(&self, gate: &mut Tensor, up: &Tensor) -> Result<()> {
        self.binary("gelu_tanh_mul", &self.inner.k.gelu_tanh_mul, gate, up, None)
    }

    /// `x *= s`.
    pub(crate) fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        const OP: &str = "scale";
        if x.is_empty() {
            return Ok(());
        }
        let xp = self.writable(OP, x)?;
        let n = x.len() as u64;
        let cfg = elementwise(OP, x.len())?;
        let mut b = self.stream().launch_builder(&self.inner.k.scale);
        b.arg(&xp).arg(&s).arg(&n);
        // SAFETY: the arguments match `scale(float*, float, u64)`; element i < n of x, its own
        // buffer (`writable`) of n floats, is multiplied in place.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        Ok(())
    }

    /// `x += y`.
    pub(crate) fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        self.binary("add_assign", &self.inner.k.add_assign, x, y, None)
    }

    /// `bias` added to every row of `x`.
    pub(crate) fn add_rows(&self, x: &mut Tensor, bias: &Tensor) -> Result<()> {
        let width = int("add_bias", "bias length", bias.len())?;
        self.binary("add_bias", &self.inner.k.add_rows, x, bias, Some(width))
    }

    /// Consecutive column blocks of `sizes` of every row of `x` (see [`Tensor::split_last`]),
    /// each a device tensor.
    pub(crate) fn split_last(&self, x: &Tensor, sizes: &[usize]) -> Result<Vec<Tensor>> {
        const OP: &str = "split_last";
        let (rows, width) = (x.rows(), x.row_len());
        if x.is_empty() {
            return x.split_last(sizes);
        }
        let xd = self.input(OP, x)?;
        let lead = &x.shape()[..x.shape().len().saturating_sub(1)];
        let mut at = 0usize;
        let mut parts = Vec::with_capacity(sizes.len());
        for &size in sizes {
            let mut shape = lead.to_vec();
            shape.push(size);
            if size == 0 {
                parts.push(Tensor::zeros(&shape));
                continue;
            }
            // Written whole: one thread per element.
            let mut od = self.output_buf(OP, rows * size)?;
            let args = [int(OP, "width", width)?, int(OP, "offset", at)?, int(OP, "size", size)?];
            let n = (rows * size) as u64;
            let cfg = elementwise(OP, rows * size)?;
            let mut b = self.stream().launch_builder(&self.inner.k.copy_cols);
            b.arg(&xd.ptr).arg(&mut od).arg(&n).arg(&args[0]).arg(&args[1]).arg(&args[2]);
            // SAFETY: the arguments match `copy_cols(const float*, float*, u64, int, int,
            // int)`; element i < n = rows·size of out reads x[(i / size)·width + offset +
            // i % size], inside x's rows·width elements because the caller checked that the
            // sizes add up to width (so offset + size <= width).
            unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
            parts.push(self.output(&shape, od)?);
            at += size;
        }
        Ok(parts)
    }

    /// Rows `ids` of `table` (ids already checked against its row count): `[ids.len(), dim]`.
    pub(crate) fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        const OP: &str = "embedding";
        let dim = table.dims().1;
        let shape = [ids.len(), dim];
        if ids.is_empty() || dim == 0 {
            return Ok(Tensor::zeros(&shape));
        }
        let td = self.weight(OP, table, GemmDtype::F32)?;
        let table_ptr = self.slot_addr(&td);
        let idd = self.upload(OP, ids)?;
        // Written whole: one thread per element.
        let mut od = self.output_buf(OP, ids.len() * dim)?;
        let args = [int(OP, "tokens", ids.len())?, int(OP, "dim", dim)?];
        let cfg = elementwise(OP, ids.len() * dim)?;
        let mut b = self.stream().launch_builder(&self.inner.k.embedding);
        b.arg(&table_ptr).arg(&idd).arg(&mut od).arg(&args[0]).arg(&args[1]);
        // SAFETY: the arguments match `embedding(const float*, const unsigned int*, float*,
        // int, int)`; element (r, c) reads ids[r] and table[ids[r]·dim + c], and the caller
        // checked every id is below the table's row count; out holds ids.len()·dim floats.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        self.output(&shape, od)
    }

    /// The index of the largest element of each row of `x` (first on ties, NaN never wins, 0
    /// for a row without a number).
    pub(crate) fn argmax_rows(&self, x: &Tensor) -> Result<Vec<usize>> {
        const OP: &str = "argmax_rows";
        let rows = x.rows();
        if rows == 0 || x.is_empty() {
            return Ok(vec![0; rows]);
        }
        let cols = int(OP, "columns", x.row_len())?;
        let xd = self.input(OP, x)?;
        let mut od = self
            .stream()
            .alloc_zeros::<u32>(rows)
            .or_unavailable(|| format!("{OP}: allocating"))?;
        let cfg = per_row(OP, rows, BLOCK)?;
        let mut b = self.stream().launch_builder(&self.inner.k.argmax_rows);
        b.arg(&xd.ptr).arg(&cols).arg(&mut od);
        // SAFETY: the arguments match `argmax_rows(const float*, int, unsigned int*)`; block
        // r reads row r (cols floats) of x, which holds rows·cols, and writes out[r] of rows.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        let mut idx = vec![0u32; rows];
        self.download(OP, &od, &mut idx)?;
        Ok(idx.into_iter().map(|i| i as usize).collect())
    }

    /// `t` summed over `comm`'s group in place on the device (`comm` works on this device:
    /// NCCL), queued on the backend's stream after the work that computed `t`: the kernels
    /// queued next read the sums, and the host does not wait. The communicator waits for it
    /// before its next call; [`CudaBackend::wait_collectives`] waits for it with the
    /// communicator's failure detection, and the backend's own waits meanwhile are bounded
    /// by its deadline.
    pub(crate) fn all_reduce_sum(&self, comm: &mut dyn Communicator, t: &mut Tensor) -> Result<()> {
        const OP: &str = "all_reduce";
        if t.is_empty() {
            return Ok(());
        }
        let ptr = self.writable(OP, t)?;
        let since = Instant::now();
        let ordinal = self.ordinal();
        let buf = DeviceRange { addr: ptr, bytes: 4 * t.len(), device: ordinal };
        let stream = DeviceStream { raw: self.stream().cu_stream() as usize, device: ordinal };
        // SAFETY: `writable` made `ptr` t's own buffer of t.len() floats on this device (the
        // communicator's, checked by the caller); only work on this backend's stream touches
        // it (a host read waits for the stream first), and it is freed in stream order, after
        // the reduction. The stream, of the device's primary context, lives as long as the
        // backend, and a stream destroyed with work queued finishes that work first.
        self.inner.blocking(|| unsafe {
            comm.all_reduce_device_enqueue(buf, ElemType::F32, ReduceOp::Sum, stream)
        })?;
        // The enqueue waited for the reduction before it: this one is the only one in flight.
        let limit = comm.timeout();
        let group = comm.group().to_owned();
        *self.inner.in_flight.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(InFlight { since, limit, group });
        Ok(())
    }

    /// Waits, through `comm` (its deadline and failure detection), for the reduction
    /// [`CudaBackend::all_reduce_sum`] queued last over it, if any.
    ///
    /// # Errors
    /// The communicator's: a timeout or a failed peer, named.
    pub(crate) fn wait_collectives(&self, comm: &mut dyn Communicator) -> Result<()> {
        self.inner.blocking(|| comm.wait_device())?;
        let mut in_flight = self.inner.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        if in_flight.as_ref().is_some_and(|p| p.group == comm.group()) {
            *in_flight = None;
        }
        Ok(())
    }

    /// Rows `range` of `t`'s first dimension: a device-to-device copy when `t` is this
    /// backend's output, else [`Tensor::slice_first`] (which also reports a bad range).
    pub(crate) fn slice_first(&self, t: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
        const OP: &str = "slice rows";
        let first = t.shape().first().copied().unwrap_or(0);
        let Some(buf) = self.own(t.storage().device_data()) else {
            return t.slice_first(range);
        };
        if range.start > range.end || range.end > first {
            return t.slice_first(range);
        }
        let step = t.len() / first.max(1);
        let mut shape = t.shape().to_vec();
        shape[0] = range.len();
        let n = range.len() * step;
        if n == 0 {
            return Ok(Tensor::zeros(&shape));
        }
        // Written whole by the copy below.
        let mut od = self.output_buf(OP, n)?;
        self.bind(OP)?;
        let from = self.addr(buf) + 4 * (range.start * step) as u64;
        let (to, record) = od.device_ptr_mut(self.stream());
        // SAFETY: `buf` holds t.len() floats of this stream's device, of which the n from
        // range.start·step are read (range checked above); `od` holds n floats; both are
        // freed stream-ordered, after the copy.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(to, from, 4 * n, self.stream().cu_stream())
        }
        .or_unavailable(|| format!("{OP}: copying {n} floats on the device"))?;
        drop(record);
        self.output(&shape, od)
    }

    /// `parts` stacked along their first dimension: device-to-device copies when every part is
    /// this backend's output, else [`Tensor::cat_first`] (which also checks the shapes).
    pub(crate) fn cat_first(&self, parts: &[Tensor]) -> Result<Tensor> {
        const OP: &str = "stack rows";
        let bufs: Option<Vec<&CudaSlice<f32>>> =
            parts.iter().map(|p| self.own(p.storage().device_data())).collect();
        let (Some(bufs), Some(head)) = (bufs, parts.first()) else {
            return Tensor::cat_first(parts);
        };
        let inner = &head.shape()[1.min(head.shape().len())..];
        if parts.iter().any(|p| p.shape().is_empty() || &p.shape()[1..] != inner) {
            return Tensor::cat_first(parts);
        }
        let mut shape = head.shape().to_vec();
        shape[0] = parts.iter().map(|p| p.shape()[0]).sum();
        let total: usize = parts.iter().map(Tensor::len).sum();
        if total == 0 {
            return Ok(Tensor::zeros(&shape));
        }
        // Written whole: the parts' lengths add up to `total`.
        let mut od = self.output_buf(OP, total)?;
        self.bind(OP)?;
        let (base, record) = od.device_ptr_mut(self.stream());
        let mut at = 0usize;
        for (part, buf) in parts.iter().zip(bufs) {
            let n = part.len();
            if n == 0 {
                continue;
            }
            // SAFETY: `buf` holds the part's n floats on this stream's device; `od` holds
            // `total` floats, of which at..at + n are written (the lengths add up to total);
            // both are freed stream-ordered, after the copy.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    base + 4 * at as u64,
                    self.addr(buf),
                    4 * n,
                    self.stream().cu_stream(),
                )
            }
            .or_unavailable(|| format!("{OP}: copying {n} floats on the device"))?;
            at += n;
        }
        drop(record);
        self.output(&shape, od)
    }

    /// Copies elements `range` of `src` to device memory `dst` from its `offset`-th f32 on
    /// (the caller checked that they fit and lie in `src`): a device-to-device copy for this
    /// backend's outputs.
    pub(crate) fn write_tensor(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        offset: usize,
        src: &Tensor,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        const OP: &str = "kv cache append";
        let Some(buf) = self.own(src.storage().device_data()) else {
            return self.write_device(dst, elem, offset, &src.data()[range]);
        };
        if range.is_empty() {
            return Ok(());
        }
        debug_assert!(elem.size() * (offset + range.len()) <= dst.size() && range.end <= src.len());
        self.bind(OP)?;
        let from = self.addr(buf) + 4 * range.start as u64;
        let to = self.owned_addr(OP, dst)? + (elem.size() * offset) as u64;
        if elem == KvElem::Bf16 {
            // Rounded on the device straight into the pool: `round_to` writes range.len()
            // halves at `to`, inside `dst` (checked by the caller), reading range.len() floats
            // of `buf` from range.start, on this stream.
            return self.round_to(OP, GemmDtype::Bf16, from, to, range.len());
        }
        // SAFETY: `dst` is memory of this device (checked above) that its `DeviceMemory`
        // implementation promises is mapped while kernels may run, and the range lies inside
        // it (checked by the caller); `buf` holds the
        // src.len() floats of which `range` is read, on this stream, and is freed
        // stream-ordered after the copy.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                to,
                from,
                4 * range.len(),
                self.stream().cu_stream(),
            )
        }
        .or_unavailable(|| format!("{OP}: copying {} floats on the device", range.len()))
    }
}

/// A device address for a kernel, with the upload behind it (if any) kept alive.
struct Input {
    ptr: u64,
    _staged: Option<CudaSlice<f32>>,
}

/// An output of a [`CudaBackend`]: its buffer and the backend whose stream writes it.
struct DeviceBuf {
    buf: CudaSlice<f32>,
    owner: Arc<Inner>,
}

impl fmt::Debug for DeviceBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuf")
            .field("ordinal", &self.owner.ordinal)
            .field("len", &self.buf.len())
            .finish()
    }
}

impl DeviceData for DeviceBuf {
    fn device(&self) -> crate::tensor::Device {
        crate::tensor::Device::Cuda(self.owner.ordinal)
    }

    fn byte_len(&self) -> usize {
        4 * self.buf.len()
    }

    fn download(&self, out: &mut [u8]) -> std::result::Result<(), String> {
        let stream = &self.owner.stream;
        stream.context().bind_to_thread().map_err(|e| e.to_string())?;
        let (src, _record) = self.buf.device_ptr(stream);
        let n = out.len().min(self.byte_len());
        // SAFETY: `src` holds byte_len bytes of this stream's device; `out` is a live host
        // slice, and the stream is synchronized before it is returned to the caller.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out[..n], src, stream.cu_stream())
        }
        .map_err(|e| e.to_string())?;
        self.owner.sync("copying a tensor to the host").map_err(|e| e.to_string())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A [`DeviceArena`] of driver-pool memory: one buffer carved front to back, for a KV cache
/// or weights that never sleep (tests; callers without `vmm`). Regions keep the buffer alive.
pub struct PoolArena {
    buf: Arc<CudaSlice<u8>>,
    base: u64,
    ordinal: usize,
    next: Mutex<usize>,
}

impl fmt::Debug for PoolArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolArena").field("bytes", &self.buf.len()).finish_non_exhaustive()
    }
}

/// A region of a [`PoolArena`].
#[derive(Debug)]
struct PoolRegion {
    _buf: Arc<PoolBuf>,
    ptr: u64,
    bytes: usize,
    ordinal: usize,
}

/// Keeps a pool buffer alive for its regions (a newtype, so it can be `Debug`).
struct PoolBuf(#[allow(dead_code)] Arc<CudaSlice<u8>>);

impl fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PoolBuf")
    }
}

// SAFETY: the fields never change; `ptr..ptr + bytes` lies inside the pool buffer (checked
// by `PoolArena::alloc_device`), a `cudaMalloc`-style allocation of the arena's device that
// `_buf` keeps alive and that is never unmapped while it lives; regions never overlap.
unsafe impl DeviceMemory for PoolRegion {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn size(&self) -> usize {
        self.bytes
    }
    fn device(&self) -> mesh::Device {
        mesh::Device::Cuda(self.ordinal)
    }
}

impl PoolArena {
    /// `bytes` bytes of zeroed device memory on `backend`'s device.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the device is out of memory.
    pub fn new(backend: &CudaBackend, bytes: usize) -> Result<PoolArena> {
        let buf = backend
            .stream()
            .alloc_zeros::<u8>(bytes.max(1))
            .or_unavailable(|| format!("device arena: allocating {bytes} bytes"))?;
        let base = backend.addr(&buf);
        let ordinal = backend.ordinal();
        Ok(PoolArena { buf: Arc::new(buf), base, ordinal, next: Mutex::new(0) })
    }
}

#[cfg(test)]
impl PoolArena {
    /// Overwrites every byte with `value`, as a lost mapping would (tests).
    pub(crate) fn scribble(&self, backend: &CudaBackend, value: u8) {
        backend.bind("scribble").unwrap();
        let stream = backend.stream();
        // SAFETY: the range is exactly the arena's buffer, alive while `self` is.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.base,
                value,
                self.buf.len(),
                stream.cu_stream(),
            )
        }
        .unwrap();
        stream.synchronize().unwrap();
    }
}

impl DeviceArena for PoolArena {
    fn alloc_device(&self, bytes: usize) -> Result<Box<dyn DeviceMemory>> {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let offset = next.next_multiple_of(crate::memory::ALIGN);
        let end = offset.checked_add(bytes).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(Error::Arena {
                bytes,
                source: format!(
                    "the device arena has {} of {} bytes left",
                    self.buf.len() - offset.min(self.buf.len()),
                    self.buf.len()
                )
                .into(),
            });
        };
        *next = end;
        let keep = Arc::new(PoolBuf(self.buf.clone()));
        let ptr = self.base + offset as u64;
        Ok(Box::new(PoolRegion { _buf: keep, ptr, bytes, ordinal: self.ordinal }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC works without a GPU, so this runs wherever `libnvrtc.so.12` loads (skipping with a
    /// note elsewhere, unless `TPCTL_REQUIRE_GPU=1`).
    #[test]
    fn cuda_kernels_compile_with_nvrtc() {
        // SAFETY: as in `CudaBackend::new`: only loads the library by name.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!require, "TPCTL_REQUIRE_GPU=1 but NVRTC is not on the loader path");
            eprintln!("note: NVRTC is not on the loader path, not compiling the kernels");
            return;
        }
        let ptx = ptx().unwrap_or_else(|log| panic!("{log}"));
        let text = ptx.to_src();
        for name in [
            "rms_norm",
            "rope",
            "silu_mul",
            "gelu_tanh_mul",
            "scale",
            "add_assign",
            "add_rows",
            "embedding",
            "argmax_rows",
            "dequantize",
            "attention",
            "to_bf16",
            "to_f16",
            "copy_cols",
        ] {
            assert!(text.contains(&format!(".entry {name}(")), "no kernel `{name}` in the PTX");
        }
    }
}
