//! A step's work as calls with every argument ([`Call`]: a kernel launch, a product, a staged
//! copy), issued through one door ([`CudaBackend::issue`]), and the CUDA graphs made of them:
//! a decode step that repeats its shape's calls exactly is captured once and then replayed
//! with one graph launch per step (the bookkeeping, tested without a GPU, is
//! `kernels::cuda::graph_book`).
//!
//! What the host still does in a replayed step is the model's own code: it stages the step's
//! inputs (their new values into the pinned memory the graph copies from, at the same
//! addresses) and takes its buffers from the step's workspace (the same slots), and each call
//! it would issue is compared with the graph's next one instead. Anything else the driver is
//! asked in a step passes through `Inner::count`, which ends the graph there: a host read (a
//! download, a wait) launches it (or issues the calls it skipped, when the step did not
//! match), and anything else (an allocation, a plain upload, a reduction, a launch that is not
//! a [`Call`]) first issues what was skipped, then goes on eagerly. A capture that fails
//! leaves its shape eager for good, with a log line and [`GraphStats::failed_captures`].
//!
//! [`GraphStats::failed_captures`]: crate::kernels::cuda::GraphStats::failed_captures

use super::{unavailable, Count, CudaBackend, Inner, OrUnavailable};
use crate::error::Result;
use crate::kernels::cuda::graph_book::{GraphBook, Leave, OnCall, Shape};
use crate::kernels::GemmDtype;
use cudarc::cublas::sys::cudaDataType;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaFunction, CudaGraph, LaunchConfig};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The most arguments a kernel of `kernels.cu` takes.
const MAX_ARGS: usize = 24;

/// One call of a step, with every argument: two calls that compare equal do the same work.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Call {
    Kernel(KernelCall),
    Gemm(GemmCall),
    /// `bytes` from pinned host memory at `src` to device address `dst` (a staged input).
    Upload {
        dst: u64,
        src: usize,
        bytes: usize,
    },
    /// `bytes` from device address `src` to device address `dst`.
    Copy {
        dst: u64,
        src: u64,
        bytes: usize,
    },
}

/// A kernel launch: the function, its grid and its arguments, each held in 8 bytes (a 4-byte
/// parameter is read from the low half, as the driver reads `sizeof` bytes at its address).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct KernelCall {
    func: usize,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: u32,
    args: [u64; MAX_ARGS],
    len: usize,
}

/// A kernel argument of `kernels.cu`: a device address or a 64-bit size, an int, a float.
pub(super) trait KernelArg: Copy {
    /// The argument's bytes, little-endian in the low bytes of a u64.
    fn bits(self) -> u64;
}

impl<A: KernelArg> KernelArg for &A {
    fn bits(self) -> u64 {
        (*self).bits()
    }
}

impl KernelArg for u64 {
    fn bits(self) -> u64 {
        self
    }
}

impl KernelArg for i32 {
    fn bits(self) -> u64 {
        u64::from(self as u32)
    }
}

impl KernelArg for f32 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
}

impl KernelCall {
    /// A launch of `f` over `cfg`, with no arguments yet.
    pub(super) fn new(f: &CudaFunction, cfg: LaunchConfig) -> KernelCall {
        KernelCall {
            func: f.cu_function() as usize,
            grid: cfg.grid_dim,
            block: cfg.block_dim,
            shared: cfg.shared_mem_bytes,
            args: [0; MAX_ARGS],
            len: 0,
        }
    }

    /// Appends an argument.
    ///
    /// # Panics
    /// Past [`MAX_ARGS`] arguments (no kernel takes more).
    pub(super) fn arg(&mut self, a: impl KernelArg) -> &mut Self {
        assert!(self.len < MAX_ARGS, "a kernel takes at most {MAX_ARGS} arguments");
        self.args[self.len] = a.bits();
        self.len += 1;
        self
    }

    /// Appends arguments.
    pub(super) fn args<A: KernelArg>(&mut self, a: &[A]) -> &mut Self {
        for &x in a {
            self.arg(x);
        }
        self
    }
}

/// A product `out[m, n] = x[m, k] · w[n, k]ᵀ` through cuBLAS (see `gemm.rs`): sgemm in f32,
/// GemmEx with f32 accumulation in bf16/f16.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct GemmCall {
    pub(super) dtype: GemmDtype,
    /// Out features, rows, in features.
    pub(super) n: i32,
    pub(super) m: i32,
    pub(super) k: i32,
    pub(super) w: u64,
    pub(super) x: u64,
    pub(super) out: u64,
}

/// A captured step graph. `CudaGraph` is neither `Send` nor `Sync`: the CUDA documentation
/// asks that calls on one graph be serialized, which the backend's mutex over its graphs does.
pub(super) struct StepGraph(CudaGraph);

// SAFETY: a `StepGraph` is only reached through `Inner::graphs`, a mutex, so calls on it are
// serialized whatever thread makes them; the CUDA handles it holds are not tied to a thread.
unsafe impl Send for StepGraph {}

/// The graphs of a backend, and an error a graph left behind where it could not be returned
/// (reported by the next call, or the next wait).
pub(super) struct Graphs {
    book: GraphBook<Call, StepGraph>,
    failed: Option<String>,
    /// When the capture in progress began.
    capture_began: Option<std::time::Instant>,
}

impl Graphs {
    pub(super) fn new(enabled: bool) -> Mutex<Graphs> {
        Mutex::new(Graphs { book: GraphBook::new(enabled), failed: None, capture_began: None })
    }

    /// Turns graphs on or off for the steps that begin from now on.
    pub(super) fn set_enabled(&mut self, enabled: bool) {
        self.book.set_enabled(enabled);
    }
}

impl Inner {
    pub(super) fn graphs(&self) -> MutexGuard<'_, Graphs> {
        self.graphs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Issues `call` on the stream, now (or into the capture).
    ///
    /// # Safety
    /// The call's arguments match its kernel's parameters (or the product's shapes), and
    /// what it reads and writes is alive until the stream has passed it.
    unsafe fn run(&self, op: &str, call: &Call) -> Result<()> {
        // The raw driver and cuBLAS calls below need the context current on this thread.
        self.stream
            .context()
            .bind_to_thread()
            .or_unavailable(|| format!("{op}: binding the context"))?;
        let stream = self.stream.cu_stream();
        match call {
            Call::Kernel(k) => {
                self.counters.add(Count::Launch);
                let mut params: Vec<*mut std::ffi::c_void> =
                    k.args[..k.len].iter().map(|a| (a as *const u64).cast_mut().cast()).collect();
                // SAFETY: the caller's; each parameter points at 8 bytes that outlive the
                // call, of which the kernel reads its parameter's size.
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        k.func as cudarc::driver::sys::CUfunction,
                        k.grid,
                        k.block,
                        k.shared,
                        stream,
                        &mut params,
                    )
                }
                .or_unavailable(|| format!("{op}: launch"))
            }
            Call::Gemm(g) => {
                // SAFETY: the caller's.
                unsafe { self.gemm(g) }.or_unavailable(|| {
                    format!("{op}: {} gemm {}x{} by {}x{}", g.dtype.name(), g.m, g.k, g.k, g.n)
                })
            }
            Call::Upload { dst, src, bytes } => {
                self.counters.add(Count::Upload);
                // SAFETY: the caller's: `src` is pinned memory of at least `bytes` bytes,
                // unwritten until the copy has run.
                let host = unsafe { std::slice::from_raw_parts(*src as *const u8, *bytes) };
                // SAFETY: as above; `dst` holds `bytes` bytes of this device.
                unsafe { cudarc::driver::result::memcpy_htod_async(*dst, host, stream) }
                    .or_unavailable(|| format!("{op}: copying {bytes} bytes to the device"))
            }
            Call::Copy { dst, src, bytes } => {
                self.counters.add(Count::DeviceCopy);
                // SAFETY: the caller's: `src` and `dst` hold `bytes` bytes of this device.
                unsafe { cudarc::driver::result::memcpy_dtod_async(*dst, *src, *bytes, stream) }
                    .or_unavailable(|| format!("{op}: copying {bytes} bytes on the device"))
            }
        }
    }

    /// The product of `g` through cuBLAS on the backend's stream.
    ///
    /// # Safety
    /// `w`, `x` and `out` hold n·k, m·k and m·n elements of the product's types (the weight
    /// and activations in `dtype`, out in f32) of this device.
    unsafe fn gemm(&self, g: &GemmCall) -> std::result::Result<(), impl std::fmt::Display> {
        self.counters.add(Count::Launch);
        let handle = *self.blas.handle();
        let (alpha, beta) = (1.0f32, 0.0f32);
        // cuBLAS is column-major: row-major out[m, n] is column-major outᵀ[n, m] = W·xᵀ, where
        // the row-major weight read column-major is Wᵀ[k, n] (so transpose it back) and the
        // row-major x is xᵀ[k, m] as it stands.
        let (transa, transb) = (cublasOperation_t::CUBLAS_OP_T, cublasOperation_t::CUBLAS_OP_N);
        // SAFETY: the caller's, for the buffers; the handle was made on this stream, and
        // alpha and beta are f32, as sgemm and GemmEx's f32 compute type want.
        unsafe {
            match g.dtype {
                GemmDtype::F32 => cudarc::cublas::result::sgemm(
                    handle,
                    transa,
                    transb,
                    g.n,
                    g.m,
                    g.k,
                    &alpha,
                    g.w as *const f32,
                    g.k,
                    g.x as *const f32,
                    g.k,
                    &beta,
                    g.out as *mut f32,
                    g.n,
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
                        g.n,
                        g.m,
                        g.k,
                        (&alpha as *const f32).cast(),
                        g.w as *const std::ffi::c_void,
                        t,
                        g.k,
                        g.x as *const std::ffi::c_void,
                        t,
                        g.k,
                        (&beta as *const f32).cast(),
                        g.out as *mut std::ffi::c_void,
                        cudaDataType::CUDA_R_32F,
                        g.n,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
            }
        }
    }

    /// Issues `calls` now, in order (calls a replay skipped, or a capture abandoned).
    fn run_all(&self, op: &str, calls: &[Call]) -> Result<()> {
        if !calls.is_empty() {
            self.work_starts();
        }
        for call in calls {
            // SAFETY: each was a call of this step, compared equal to what the step asked
            // for (so with its arguments checked by its caller), and what it touches is the
            // step's: inputs staged, slots of the workspace, weights, caches, alive until the
            // stream passes the step.
            unsafe { self.run(op, call) }?;
        }
        Ok(())
    }

    /// Ends a capture and discards what it captured.
    fn abandon_capture(&self) {
        if let Err(e) = self.stream.end_capture(CUgraphInstantiate_flags(0)) {
            tracing::debug!("cuda:{}: ending an abandoned capture: {e}", self.ordinal);
        }
    }

    /// Ends the step's graph (see the module docs): at a host read (`host_read`), where the
    /// graph is launched, or before anything else, which goes on eagerly. An error is kept
    /// for the next wait or call to report.
    pub(super) fn leave_graph(&self, host_read: bool) {
        let mut graphs = self.graphs();
        let Graphs { book, failed, capture_began } = &mut *graphs;
        if !book.in_graph() {
            return;
        }
        let leave = if host_read { book.flush() } else { book.other() };
        let done = match leave {
            Leave::Nothing => Ok(()),
            Leave::Launch(g) => {
                self.work_starts();
                self.counters.add(Count::GraphLaunch);
                let launched = g.0.launch();
                if launched.is_err() {
                    book.launch_failed();
                }
                launched.or_unavailable(|| "launching the step's graph".to_owned())
            }
            Leave::Issue(calls) => self.run_all("graph", &calls),
            Leave::AbortCapture(calls) => {
                self.abandon_capture();
                self.run_all("graph", &calls)
            }
            Leave::EndCapture => self.end_capture(book, capture_began.take()),
        };
        if let Err(e) = done {
            failed.get_or_insert(e.to_string());
        }
    }

    /// Ends the capture of the step, makes its graph and launches it; a capture that made no
    /// graph leaves its shape eager, and its calls are issued.
    fn end_capture(
        &self,
        book: &mut GraphBook<Call, StepGraph>,
        began: Option<std::time::Instant>,
    ) -> Result<()> {
        let made = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| e.to_string())
            .and_then(|g| g.ok_or_else(|| "the capture made no graph".to_owned()));
        match made {
            Ok(graph) => {
                let took = began.map(|t| t.elapsed()).unwrap_or_default();
                self.counters.add(Count::GraphLaunch);
                let launched = graph.launch();
                book.captured(StepGraph(graph), took);
                launched.or_unavailable(|| "launching the step's graph".to_owned())
            }
            Err(why) => {
                tracing::warn!(
                    "cuda:{}: capturing a step as a CUDA graph failed ({why}); steps of its \
                     shape run eagerly",
                    self.ordinal
                );
                let calls = book.capture_failed();
                self.run_all("graph", &calls)
            }
        }
    }

    /// The error a graph left behind, if any (reported once).
    pub(super) fn graph_failure(&self, op: &str) -> Result<()> {
        match self.graphs().failed.take() {
            Some(e) => Err(unavailable(format!("{op}: an earlier step's graph failed: {e}"))),
            None => Ok(()),
        }
    }
}

impl CudaBackend {
    /// Issues `call`: now, into the step's capture, or not at all when the step's graph will
    /// do it (see the module docs).
    ///
    /// # Safety
    /// The call's arguments match its kernel's parameters (or the product's shapes: each
    /// caller's SAFETY note), and what it reads and writes is alive until the stream has
    /// passed it: the caller's buffers, or the step's (staged inputs, workspace slots).
    pub(super) unsafe fn issue(&self, op: &str, call: Call) -> Result<()> {
        let inner = &*self.inner;
        let mut graphs = inner.graphs();
        if let Some(e) = graphs.failed.take() {
            return Err(unavailable(format!("{op}: an earlier step's graph failed: {e}")));
        }
        match graphs.book.call(&call) {
            OnCall::Skip => return Ok(()),
            OnCall::Issue => {}
            OnCall::Recover(skipped) => inner.run_all(op, &skipped)?,
        }
        let capturing = graphs.book.capturing();
        if !capturing {
            inner.work_starts();
        }
        // SAFETY: the caller's.
        let done = unsafe { inner.run(op, &call) };
        if done.is_err() && capturing {
            // The capture is broken: end it, and issue nothing more of it.
            if let Leave::AbortCapture(_) = graphs.book.other() {
                inner.abandon_capture();
            }
        }
        done
    }

    /// Starts the graph of a step of `shape` (`None`: never captured): begins its capture
    /// when its shape's last steps repeated.
    pub(super) fn begin_graph(&self, shape: Option<Shape>) {
        let inner = &*self.inner;
        let mut graphs = inner.graphs();
        if !graphs.book.begin(shape) {
            return;
        }
        // The step's start goes on the stream before the capture: nothing inside it runs
        // until the graph is launched.
        inner.work_starts();
        graphs.capture_began = Some(std::time::Instant::now());
        if let Err(e) =
            inner.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        {
            tracing::warn!("cuda:{}: beginning a capture: {e}", inner.ordinal);
            if let Leave::AbortCapture(_) = graphs.book.other() {
                inner.abandon_capture();
            }
        }
    }

    /// Ends the step's graph at the step's end.
    pub(super) fn end_graph(&self) {
        self.inner.leave_graph(true);
    }

    /// Drops every graph (a sleep: the buffers they name may go).
    pub(super) fn clear_graphs(&self) -> usize {
        let mut graphs = self.inner.graphs();
        let held = graphs.book.graphs();
        graphs.book.clear();
        held
    }

    /// What this backend's graphs have done.
    pub fn graph_stats(&self) -> crate::kernels::cuda::GraphStats {
        self.inner.graphs().book.stats()
    }
}
