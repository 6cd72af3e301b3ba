//! Opening a device: probing the CUDA libraries, the context, its stream and cuBLAS handle,
//! the kernels (`kernel_image`: a CUBIN for the device, cached on disk), and the driver's
//! memory pool.

use super::{unavailable, CudaBackend, Inner, Kernels, OrUnavailable};
use crate::error::Result;
use crate::kernels::cuda::{uuid_text, CudaDeviceInfo};
use crate::kernels::workspace::Released;
use crate::kernels::GemmDtype;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

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

/// The bytes `pool` holds from the device now (`None` when the driver cannot say).
fn pool_reserved(pool: cudarc::driver::sys::CUmemoryPool) -> Option<u64> {
    let mut bytes = 0u64;
    // SAFETY: `pool` is valid for the context's life, and the reserved-memory attribute is
    // written through a pointer to a cuuint64_t, a live local.
    let read = unsafe {
        cudarc::driver::result::mem_pool::get_attribute(
            pool,
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            (&mut bytes as *mut u64).cast(),
        )
    };
    read.ok().map(|()| bytes)
}

impl CudaBackend {
    /// Opens device `ordinal`: checks that the driver, NVRTC and cuBLAS libraries load and the
    /// device exists, creates a stream and a cuBLAS handle, and loads the kernels.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] naming what is missing: the driver library, a device
    /// `ordinal`, NVRTC or cuBLAS, or the compile log when the kernels fail to compile.
    ///
    /// [`Error::BackendUnavailable`]: crate::Error::BackendUnavailable
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_gemm_dtype(ordinal, GemmDtype::F32)
    }

    /// Opens device `ordinal` as [`CudaBackend::new`] does, keeping weight matrices in `dtype`.
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn with_gemm_dtype(ordinal: usize, dtype: GemmDtype) -> Result<Self> {
        let at = |reason: String| unavailable(format!("device {ordinal}: {reason}"));
        // cudarc panics when a library it calls into cannot be loaded: the driver has its one
        // probe (`mesh::cuda_driver`, which also initializes it); NVRTC and cuBLAS are probed
        // here.
        mesh::cuda_driver().map_err(|e| at(e.reason()))?;
        // SAFETY: the probes only try to load the shared libraries by name and drop them
        // again; loading runs the CUDA libraries' own initializers and nothing else.
        let (nvrtc, cublas) = unsafe {
            (cudarc::nvrtc::sys::is_culib_present(), cudarc::cublas::sys::is_culib_present())
        };
        let count =
            CudaContext::device_count().map_err(|e| at(format!("counting the devices: {e}")))?;
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
        let (module, kernel_image) = super::kernel_image::load(&ctx, ordinal).map_err(at)?;
        let f = |name: &str| {
            module.load_function(name).map_err(|e| at(format!("kernel `{name}`: {e}")))
        };
        let k = Kernels {
            rms_norm: f("rms_norm")?,
            add_rms_norm: f("add_rms_norm")?,
            rope: f("rope")?,
            split_rope: f("split_rope")?,
            split_rope_append: f("split_rope_append")?,
            silu_mul: f("silu_mul")?,
            gated_halves: f("gated_halves")?,
            gelu_tanh_mul: f("gelu_tanh_mul")?,
            scale: f("scale")?,
            soft_cap: f("soft_cap")?,
            add_assign: f("add_assign")?,
            add_rows: f("add_rows")?,
            embedding: f("embedding")?,
            argmax_rows: f("argmax_rows")?,
            top_k_rows: f("top_k_rows")?,
            sample_rows: f("sample_rows")?,
            normalizers: f("normalizers")?,
            columns_at: f("columns_at")?,
            dequantize: f("dequantize")?,
            qmatvec: f("qmatvec")?,
            edit_rows: f("edit_rows")?,
            attention: f("attention")?,
            attention_merge: f("attention_merge")?,
            to_bf16: f("to_bf16")?,
            to_f16: f("to_f16")?,
            copy_cols: f("copy_cols")?,
            write_rows: f("write_rows")?,
        };
        tracing::debug!(ordinal, dtype = dtype.name(), "cuda backend ready");
        let inner = Inner {
            ordinal,
            dtype,
            stream,
            blas,
            k,
            kernel_image,
            weights: Mutex::default(),
            positions: Mutex::default(),
            tables: Mutex::default(),
            in_flight: Mutex::default(),
            workspace: Mutex::default(),
            staging: Mutex::default(),
            graphs: super::graphs::Graphs::new(true),
            times: Mutex::default(),
            step_armed: Default::default(),
            waited_ns: AtomicU64::new(0),
            counters: Default::default(),
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

    /// Gives the memory the driver's pool keeps between steps back to the device, with the
    /// step workspaces and graphs (see [`CudaBackend::release_workspace`]). The pool keeps
    /// freed memory otherwise (see `keep_pool_memory`), so a sleep calls this before it
    /// measures what it released.
    pub fn trim_pool(&self) {
        let _ = self.release_workspace();
    }

    /// Destroys the step graphs (a sleep of `cuda_graph`), once the stream is waited for: how
    /// many there were. Their memory is the driver's, which says nothing of it per process (a
    /// device-wide reading would count what other ranks on the device free meanwhile), so no
    /// bytes are claimed; the probes around the sleep show it. Each shape's next steps
    /// capture theirs again.
    pub fn release_graphs(&self) -> Released {
        self.wait_for_frees();
        Released { items: self.clear_graphs(), device_bytes: 0, host_bytes: 0 }
    }

    /// Gives back what the steps hold between them (a sleep of `workspace`): the graphs
    /// (they name the workspaces' memory), the step workspaces, the step inputs' staging
    /// buffers and the temporaries the driver's pool keeps. Counts the workspace plans, the
    /// pool's bytes given back to the device (the workspaces' and the staging's device
    /// buffer among them) and the pinned host bytes.
    pub fn release_workspace(&self) -> Released {
        // The graphs first: they name the workspaces' memory. Then the step workspaces:
        // their memory is the pool's once no slot is held.
        self.clear_graphs();
        let plans = self.workspace().release();
        self.wait_for_frees();
        // After the wait: no copy reads the pinned buffer any more.
        let (pinned, staged) = self.drop_staging();
        let Some(pool) = default_pool(self.stream().context()) else {
            return Released {
                items: plans.items,
                device_bytes: plans.device_bytes,
                host_bytes: pinned,
            };
        };
        let held = pool_reserved(pool);
        // SAFETY: `pool` is the device's default pool, which lives as long as the context.
        let trimmed = unsafe { cudarc::driver::result::mem_pool::trim_to(pool, 0) };
        if let Err(e) = trimmed {
            tracing::warn!("cuda:{}: trimming the memory pool: {e}", self.inner.ordinal);
        }
        let device_bytes = match (held, pool_reserved(pool)) {
            (Some(before), Some(after)) => before.saturating_sub(after),
            _ => plans.device_bytes + staged,
        };
        Released { items: plans.items, device_bytes, host_bytes: pinned }
    }

    /// Starts a step of `tokens` tokens over `seqs` sequences, planned as shape `key` (see
    /// [`crate::Backend::step`]); a planned step may be captured as a graph, or replay one.
    pub(crate) fn begin_step(
        &self,
        key: Option<crate::kernels::workspace::StepKey>,
        (tokens, seqs): (usize, usize),
    ) {
        let outermost = self.workspace().begin(key);
        if outermost {
            self.ready_staging();
            self.start_step_timing();
            self.begin_graph(key.map(|_| (tokens, seqs)));
        }
    }

    /// Ends the step begun last.
    pub(crate) fn end_step(&self) {
        let outermost = self.workspace().end();
        if outermost {
            self.end_graph();
            self.end_step_timing();
            self.end_staging();
        }
    }

    /// Turns CUDA graphs of decode steps on or off (vLLM's `--enforce-eager` turns them
    /// off); on by default.
    pub fn set_graphs(&self, enabled: bool) {
        self.inner.graphs().set_enabled(enabled);
    }

    /// What the step workspaces have done so far (see [`crate::Backend::workspace_stats`]).
    pub(crate) fn workspace_stats(&self) -> crate::kernels::workspace::WorkspaceStats {
        self.workspace().stats()
    }

    pub(super) fn workspace(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        crate::kernels::workspace::StepMemory<cudarc::driver::CudaSlice<u8>>,
    > {
        self.inner.workspace.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the driver says about this backend's device: name, compute capability, memory,
    /// UUID, and the CUDA version the driver supports.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when a driver query fails.
    ///
    /// [`Error::BackendUnavailable`]: crate::Error::BackendUnavailable
    pub fn describe(&self) -> Result<CudaDeviceInfo> {
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
        Ok(CudaDeviceInfo {
            name: ctx.name().or_unavailable(|| query("name"))?,
            compute_capability: ctx
                .compute_capability()
                .or_unavailable(|| query("compute capability"))?,
            total_bytes,
            free_bytes,
            uuid: uuid_text(uuid.bytes.map(|b| b as u8)),
            driver_cuda: (version / 1000, version % 1000 / 10),
        })
    }

    /// Which form of the kernels this backend loaded: a CUBIN for its device's architecture
    /// (from the kernel cache or compiled as it opened), or the PTX fallback and why.
    pub fn kernel_image(&self) -> &crate::kernels::cuda::KernelImage {
        &self.inner.kernel_image
    }

    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Makes the backend's context current on this thread, for the raw driver and cuBLAS
    /// calls (the safe API binds it itself).
    pub(super) fn bind(&self, op: &str) -> Result<()> {
        self.stream()
            .context()
            .bind_to_thread()
            .or_unavailable(|| format!("{op}: binding the context"))
    }
}
