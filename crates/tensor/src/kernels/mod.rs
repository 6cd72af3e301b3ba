//! Kernels behind one seam: [`Backend`] takes and returns [`Tensor`]s and dispatches to the
//! device's implementation.
//!
//! Model code calls only `Backend` methods, so the CUDA backend (feature `cuda`, see [`cuda`])
//! is one more variant that takes and returns the same tensors; its outputs stay on the device
//! until host code reads them (see [`crate::tensor::DeviceData`]). Each method documents its
//! shapes; all compute is f32 with f32 accumulation. Quantized weights are a storage format
//! only: every product multiplies f32 activations by the dequantized weight values (on the
//! CPU dequantized in registers, see [`QMatrix`]), so decode, batches and prefill differ
//! only in summation order; the CUDA backend multiplies the dequantized weights in f32, or
//! in bf16/f16 with [`GemmDtype`].

pub mod cpu;
pub mod cuda;
mod draw_grid;
mod edit;
mod fused;
mod logprob;
mod prepare;
mod sample;
mod select;
mod step_attention;
pub mod workspace;

pub use cpu::attention::AttnShape;
pub use cpu::qmatrix::{QBits, QMatrix};
pub use cpu::quant::BlockFormat;
use cpu::CpuBackend;
pub use cuda::{CudaBackend, CudaDeviceInfo, PoolArena};
pub use edit::{EditKind, LogitEdit, LogitEdits};
pub use fused::{PoolMemory, PoolRows, Projected};
pub use logprob::Normalizer;
pub use prepare::WeightUse;
pub use sample::{draw_columns, exp_det, Draw, DRAW_CHUNK, DRAW_MAX_COLUMNS};
pub use select::{candidate_order, row_numbers, TopK, TOP_K_MAX};
pub use step_attention::RowKv;

use crate::error::{Error, Result};
use crate::memory::{Arena, WeightBuffers};
use crate::tensor::{Device, Tensor};
use collectives::{Collective, Communicator};
use mesh::DeviceMemory;

/// The activation of an MLP's gate projection, multiplied into its up projection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (Llama, Qwen2, Phi-3).
    #[default]
    Silu,
    /// GELU in its tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// A weight matrix `[out_features, in_features]` as a linear layer stores it.
#[derive(Clone, Debug, PartialEq)]
pub enum Weight {
    /// Dense f32, row-major.
    F32(Tensor),
    /// Block-quantized (Q8_0, Q4_0, Q4_1 as stored in the checkpoint).
    Quant(QMatrix),
}

impl Weight {
    /// `(out_features, in_features)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Weight::F32(t) => (t.rows(), t.row_len()),
            Weight::Quant(q) => q.dims(),
        }
    }

    /// The rows of `parts` stacked in order (fusing projections that read the same input into
    /// one product). Quantized parts stay quantized when they share a format; otherwise the
    /// result is f32.
    ///
    /// # Errors
    /// [`Error::Shape`] when the parts differ in width or there are none.
    pub fn concat_rows(parts: &[&Weight]) -> Result<Weight> {
        let cols =
            parts.first().ok_or_else(|| Error::shape("Weight::concat_rows", "no parts"))?.dims().1;
        if parts.iter().any(|p| p.dims().1 != cols) {
            let widths: Vec<usize> = parts.iter().map(|p| p.dims().1).collect();
            return Err(Error::shape("Weight::concat_rows", format!("widths {widths:?} differ")));
        }
        let quants: Option<Vec<&QMatrix>> =
            parts.iter().map(|p| if let Weight::Quant(q) = p { Some(q) } else { None }).collect();
        if let Some(q) = quants.and_then(|q| QMatrix::concat_rows(&q)) {
            return Ok(Weight::Quant(q));
        }
        let rows: usize = parts.iter().map(|p| p.dims().0).sum();
        let mut data = Vec::with_capacity(rows * cols);
        for p in parts {
            match p {
                Weight::F32(t) => data.extend_from_slice(t.data()),
                Weight::Quant(q) => data.extend(q.dequantize()),
            }
        }
        Ok(Weight::F32(Tensor::from_vec(&[rows, cols], data)?))
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        match self {
            Weight::F32(t) => 4 * t.len(),
            Weight::Quant(q) => q.nbytes(),
        }
    }

    /// A copy with every buffer in memory from `arena`, allocated in the order the crate's
    /// weight listings use: the data of an f32 matrix; the scales, minimums (4-bit only) and
    /// quants of a quantized one.
    ///
    /// # Errors
    /// As [`crate::Storage::copy_to`].
    pub fn copy_to(&self, arena: &dyn Arena) -> Result<Weight> {
        Ok(match self {
            Weight::F32(t) => Weight::F32(t.copy_to(arena)?),
            Weight::Quant(q) => Weight::Quant(q.copy_to(arena)?),
        })
    }

    /// Row `r` (one output feature's weights; a token's embedding) as f32.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        match self {
            Weight::F32(t) => t.row(r).to_vec(),
            Weight::Quant(q) => {
                let mut out = vec![0.0; q.dims().1];
                q.dequantize_row(r, &mut out);
                out
            }
        }
    }
}

impl WeightBuffers for Weight {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        match self {
            Weight::F32(t) => t.buffers(out),
            Weight::Quant(q) => q.buffers(out),
        }
    }

    fn move_to(&mut self, arena: &dyn Arena) -> Result<()> {
        *self = self.copy_to(arena)?;
        Ok(())
    }
}

/// The keys and values attention reads: host slices `[n_kv, kv_heads, head_dim]`, or the
/// buffers of a device KV cache whose first `n_kv` rows are filled (CUDA backend only).
#[derive(Clone, Copy, Debug)]
pub enum Kv<'a> {
    /// Host memory, exactly the rows to read.
    Host {
        /// Keys.
        k: &'a [f32],
        /// Values.
        v: &'a [f32],
    },
    /// Device memory holding at least the rows to read.
    Device {
        /// Keys.
        k: &'a dyn DeviceMemory,
        /// Values.
        v: &'a dyn DeviceMemory,
        /// How they are stored.
        elem: KvElem,
    },
    /// Host memory in blocks of a paged KV cache.
    Paged(cpu::attention::KvBlocks<'a>),
    /// Device memory in blocks of a paged KV cache (CUDA backend only).
    PagedDevice(DeviceBlocks<'a>),
}

/// One layer's keys and values of a sequence in a paged KV pool in device memory: token `j` is
/// row `j % block_size` of block `table[j / block_size]`, whose keys of this layer start
/// `block · block_stride + keys` floats into the pool, `[block_size, kv_heads, head_dim]`, and
/// its values `block · block_stride + values` floats in.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBlocks<'a> {
    /// The pool.
    pub memory: &'a dyn DeviceMemory,
    /// How the pool stores keys and values.
    pub elem: KvElem,
    /// The sequence's blocks in token order.
    pub table: &'a [u32],
    /// Tokens per block.
    pub block_size: usize,
    /// Elements from the start of one block to the next.
    pub block_stride: usize,
    /// Elements from the start of a block to this layer's keys.
    pub keys: usize,
    /// Elements from the start of a block to this layer's values.
    pub values: usize,
}

impl DeviceBlocks<'_> {
    /// Whether the blocks hold `tokens` rows of `row` values inside the pool.
    pub fn holds(&self, tokens: usize, row: usize) -> bool {
        if self.block_size == 0 {
            return tokens == 0;
        }
        let Some(used) = self.table.get(..tokens.div_ceil(self.block_size)) else {
            return false;
        };
        let Some(&last) = used.iter().max() else { return true };
        let end =
            last as usize * self.block_stride + self.keys.max(self.values) + self.block_size * row;
        self.elem.size() * end <= self.memory.size()
    }
}

/// How a KV cache in device memory stores keys and values. Host caches are always f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvElem {
    /// 32-bit floats, as the activations (and the CPU's caches) are.
    #[default]
    F32,
    /// bfloat16, rounded to nearest even when written: half the memory and the bytes each
    /// attention reads, at about 3 significant digits per value.
    Bf16,
}

impl KvElem {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvElem::F32 => 4,
            KvElem::Bf16 => 2,
        }
    }

    /// Its name in messages and configuration (`f32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            KvElem::F32 => "f32",
            KvElem::Bf16 => "bf16",
        }
    }
}

/// The element type the CUDA backend keeps weight matrices in and multiplies them in (cuBLAS,
/// accumulating in f32). Half types halve the device memory and bandwidth of the weights at
/// about 3 (bf16) or 4 (f16) significant digits per element; the activations are rounded to
/// the same type for the product. The CPU backend always computes in f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GemmDtype {
    /// 32-bit floats: the CPU's arithmetic.
    #[default]
    F32,
    /// bfloat16 (8 exponent bits, as f32: no overflow).
    Bf16,
    /// IEEE half (5 exponent bits: magnitudes above 65504 overflow).
    F16,
}

impl GemmDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            GemmDtype::F32 => 4,
            GemmDtype::Bf16 | GemmDtype::F16 => 2,
        }
    }

    /// The name used in configs: `f32`, `bf16`, `f16`.
    pub fn name(self) -> &'static str {
        match self {
            GemmDtype::F32 => "f32",
            GemmDtype::Bf16 => "bf16",
            GemmDtype::F16 => "f16",
        }
    }
}

/// The error for device memory handed to the CPU backend.
fn device_memory_on_cpu(op: &str) -> Error {
    Error::BackendUnavailable {
        backend: "cpu",
        reason: format!("{op}: the data lives in device memory, which only the CUDA backend reads"),
    }
}

/// Where and how kernels run.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Backend {
    /// CPU kernels on a private thread pool.
    Cpu(CpuBackend),
    /// CUDA kernels on one device, its outputs kept in device memory (without
    /// feature `cuda` no value of this variant can be made).
    Cuda(CudaBackend),
}

fn check(op: &'static str, ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::shape(op, msg()))
    }
}

impl Backend {
    /// The CPU backend with `threads` worker threads.
    ///
    /// # Errors
    /// [`Error::ThreadPool`] when the threads cannot be spawned.
    pub fn cpu(threads: usize) -> Result<Self> {
        Ok(Backend::Cpu(CpuBackend::new(threads)?))
    }

    /// The CUDA backend on device `ordinal` (see [`CudaBackend`]).
    ///
    /// # Errors
    /// [`Error::NotCompiledWith`] without feature `cuda`; with it
    /// [`Error::BackendUnavailable`] saying why the device cannot be used (no driver library,
    /// no device `ordinal`, NVRTC or cuBLAS missing, the kernels' compile log).
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Ok(Backend::Cuda(CudaBackend::new(ordinal)?))
    }

    /// The CUDA backend on device `ordinal`, keeping weight matrices in `dtype` (see
    /// [`GemmDtype`]).
    ///
    /// # Errors
    /// As [`Backend::cuda`].
    pub fn cuda_with(ordinal: usize, dtype: GemmDtype) -> Result<Self> {
        Ok(Backend::Cuda(CudaBackend::with_gemm_dtype(ordinal, dtype)?))
    }

    /// Runs `f` with this backend's CPU workers as the calling context: the kernels `f`
    /// launches split their work from a worker thread instead of handing every op from this
    /// thread to the pool and sleeping until it is done (on a decode step, ~150 small ops, the
    /// hand-offs cost more than the arithmetic). The CUDA backend runs `f` here.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self {
            Backend::Cpu(cpu) => cpu.install(f),
            Backend::Cuda(_) => f(),
        }
    }

    /// This backend for one step of many sequences whose first `single_rows` activation rows
    /// are each one sequence's single new token (decode rows, in the order the scheduler packs
    /// a step): linear layers multiply those rows with the direct kernels whatever the size of
    /// the step, so a decoded token's result is the same bits alone and in a batch of any
    /// size and mix; the other rows choose their kernels by their own count. The CUDA backend
    /// is returned as it is.
    pub fn for_step(&self, single_rows: usize) -> Backend {
        match self {
            Backend::Cpu(cpu) => Backend::Cpu(cpu.for_step(single_rows)),
            Backend::Cuda(_) => self.clone(),
        }
    }

    /// The device the kernels run on. The CUDA backend takes tensors wherever they are and
    /// returns its outputs on its device (host code reading them gets a copy).
    pub fn device(&self) -> Device {
        match self {
            Backend::Cpu(_) => Device::Cpu,
            Backend::Cuda(cuda) => Device::Cuda(cuda.ordinal()),
        }
    }

    /// The time the host has spent blocked waiting for the GPU so far
    /// ([`CudaBackend::device_wait`]); `None` on the CPU, where the host does the work.
    pub fn device_wait(&self) -> Option<std::time::Duration> {
        match self {
            Backend::Cpu(_) => None,
            Backend::Cuda(cuda) => Some(cuda.device_wait()),
        }
    }

    /// What the backend has asked of the GPU's driver so far (launches, allocations, copies,
    /// host waits: [`cuda::Counters`]); `None` on the CPU.
    pub fn device_counters(&self) -> Option<cuda::Counters> {
        match self {
            Backend::Cpu(_) => None,
            Backend::Cuda(cuda) => Some(cuda.counters()),
        }
    }

    /// `x[m, k] · wᵀ` for `w` of `[n, k]`: returns `[m, n]`. `x` may have any leading shape;
    /// the result keeps it and replaces the last dimension by `n`.
    ///
    /// # Errors
    /// [`Error::Shape`] when `x`'s last dimension is not `k`.
    pub fn linear(&self, x: &Tensor, w: &Weight) -> Result<Tensor> {
        let (n, k) = w.dims();
        check("linear", x.row_len() == k, || {
            format!("input rows have {} elements, weight expects {k}", x.row_len())
        })?;
        let m = x.rows();
        let mut shape = x.shape().to_vec();
        match shape.last_mut() {
            Some(last) => *last = n,
            None => shape.push(n),
        }
        let cpu = match self {
            Backend::Cpu(cpu) => cpu,
            Backend::Cuda(cuda) => return cuda.linear(x, w, (m, n, k), &shape),
        };
        let x = x.host()?;
        let mut out = Tensor::zeros(&shape);
        // The step's single rows, then the rest (a prompt chunk's rows), each product
        // choosing its kernels by its own rows only.
        let single = cpu.single_rows.min(m);
        let (x_single, x_rest) = x.split_at(single * k);
        let (out_single, out_rest) = out.data_mut().split_at_mut(single * n);
        cpu.install(|| {
            cpu::linear_rows(w, x_single, single, out_single, true, cpu.threads())?;
            cpu::linear_rows(w, x_rest, m - single, out_rest, false, cpu.threads())
        })?;
        cpu.output(out)
    }

    /// RMSNorm of every row of `x` with `weight` (one element per column).
    ///
    /// # Errors
    /// [`Error::Shape`] when the row length differs from the weight length.
    pub fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        check("rms_norm", x.row_len() == weight.len(), || {
            format!("rows of {} elements, weight of {}", x.row_len(), weight.len())
        })?;
        match self {
            Backend::Cpu(cpu) => {
                let mut out = Tensor::zeros(x.shape());
                let (x, weight, rows) = (x.host()?, weight.host()?, out.data_mut());
                cpu.install(|| cpu::norm::rms_norm(x, weight, eps, rows));
                cpu.output(out)
            }
            Backend::Cuda(cuda) => cuda.rms_norm(x, weight, eps),
        }
    }

    /// `x += y` (the residual connection), then returns the RMSNorm of every row of the sum
    /// with `weight`: [`Backend::add_assign`] followed by [`Backend::rms_norm`] in one pass
    /// over the rows (one kernel launch on the GPU), with the same bits.
    ///
    /// # Errors
    /// [`Error::Shape`] when `x` and `y` differ in length or the row length differs from the
    /// weight length.
    pub fn add_rms_norm(
        &self,
        x: &mut Tensor,
        y: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<Tensor> {
        check("add_rms_norm", x.len() == y.len(), || {
            format!("a sum of {} and {} elements", x.len(), y.len())
        })?;
        check("add_rms_norm", x.row_len() == weight.len(), || {
            format!("rows of {} elements, weight of {}", x.row_len(), weight.len())
        })?;
        match self {
            Backend::Cpu(cpu) => {
                let (y, weight) = (y.host()?, weight.host()?);
                let mut out = Tensor::zeros(x.shape());
                let rows = out.data_mut();
                cpu.in_place(x, |x| {
                    cpu.install(|| cpu::norm::add_rms_norm(x, y, weight, eps, rows))
                })?;
                cpu.output(out)
            }
            Backend::Cuda(cuda) => cuda.add_rms_norm(x, y, weight, eps),
        }
    }

    /// Rotary embedding (rotate-half convention, see `cpu::rope`) of `x` viewed as
    /// `[positions.len(), heads, head_dim]`, over the first `rot_dim` elements of each head.
    ///
    /// # Errors
    /// [`Error::Shape`] when the sizes disagree or `rot_dim` is odd or above `head_dim`.
    pub fn rope(
        &self,
        x: &mut Tensor,
        positions: &[usize],
        heads: usize,
        head_dim: usize,
        rot_dim: usize,
        theta: f32,
    ) -> Result<()> {
        self.rope_scaled(x, positions, (heads, head_dim, rot_dim), theta, None, 1.0)
    }

    /// [`Backend::rope`] with per-pair frequency factors and a factor on the cosines and
    /// sines (see `cpu::rope::rope_scaled`); factors that are all 1 are no scaling.
    ///
    /// # Errors
    /// As [`Backend::rope`]; [`Error::Shape`] when there are not `rot_dim / 2` factors.
    pub fn rope_scaled(
        &self,
        x: &mut Tensor,
        positions: &[usize],
        (heads, head_dim, rot_dim): (usize, usize, usize),
        theta: f32,
        factors: Option<&[f32]>,
        attn_factor: f32,
    ) -> Result<()> {
        check(
            "rope",
            x.len() == positions.len() * heads * head_dim
                && rot_dim.is_multiple_of(2)
                && rot_dim <= head_dim
                && factors.is_none_or(|f| f.len() == rot_dim / 2),
            || {
                format!(
                    "{} elements for {} positions x {heads} heads x {head_dim}, rot_dim {rot_dim}, \
                     {:?} frequency factors",
                    x.len(),
                    positions.len(),
                    factors.map(<[f32]>::len)
                )
            },
        )?;
        let factors = factors.filter(|f| f.iter().any(|&s| s != 1.0));
        match self {
            Backend::Cpu(cpu) => cpu.in_place(x, |x| {
                cpu::rope::rope_scaled(
                    x,
                    positions,
                    (heads, head_dim, rot_dim),
                    theta,
                    factors,
                    attn_factor,
                )
            })?,
            Backend::Cuda(cuda) => {
                let dims = (heads, head_dim, rot_dim);
                cuda.rope(x, positions, dims, theta, factors, attn_factor)?;
            }
        }
        Ok(())
    }

    /// Causal attention (see `cpu::attention::attention`): `q` is `[q_pos.len(), q_heads,
    /// head_dim]`, the keys and values `[kv_pos.len(), kv_heads, head_dim]` (a cache's filled
    /// prefix). Returns the output shaped like `q` and, when `want_lse`, the per-row
    /// log-sum-exp `[q_pos.len(), q_heads]`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the sizes disagree or `q_heads` is not a multiple of `kv_heads`;
    /// [`Error::BackendUnavailable`] for device keys and values on the CPU backend.
    pub fn attention(
        &self,
        q: &Tensor,
        q_pos: &[usize],
        kv: Kv<'_>,
        kv_pos: &[usize],
        shape: AttnShape,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let AttnShape { q_heads, kv_heads, head_dim, .. } = shape;
        let (k_len, v_len, fits) = step_attention::extent(&kv, kv_pos.len(), kv_heads * head_dim);
        check(
            "attention",
            kv_heads > 0
                && q_heads % kv_heads == 0
                && q.len() == q_pos.len() * q_heads * head_dim
                && fits,
            || {
                format!(
                    "q {} for {} tokens, k {k_len} v {v_len} for {} keys, {shape:?}",
                    q.len(),
                    q_pos.len(),
                    kv_pos.len()
                )
            },
        )?;
        let cpu = match self {
            Backend::Cpu(cpu) => cpu,
            Backend::Cuda(cuda) => return cuda.attention(q, q_pos, kv, kv_pos, shape, want_lse),
        };
        let mut out = Tensor::zeros(&[q_pos.len(), q_heads, head_dim]);
        let mut lse = want_lse.then(|| Tensor::zeros(&[q_pos.len(), q_heads]));
        let (k, v);
        let blocks = match kv {
            Kv::Host { k: kh, v: vh } => {
                (k, v) = ([kh], [vh]);
                cpu::attention::KvBlocks::contiguous(&k, &v)
            }
            Kv::Paged(blocks) => blocks,
            Kv::Device { .. } | Kv::PagedDevice(_) => {
                return Err(device_memory_on_cpu("attention"))
            }
        };
        let q = q.host()?;
        cpu.install(|| {
            cpu::attention::attention_blocks(
                q,
                q_pos,
                blocks,
                kv_pos,
                shape,
                out.data_mut(),
                lse.as_mut().map(|l| l.data_mut()),
            )
        });
        Ok((cpu.output(out)?, lse.map(|l| cpu.output(l)).transpose()?))
    }

    /// `t` summed over `comm`'s group in place. A group of one is the identity (nothing
    /// moves); a CUDA backend's tensor is reduced on the device when the communicator works on
    /// this backend's device (NCCL), and through host memory otherwise.
    ///
    /// # Errors
    /// A failed collective (see [`collectives::Error`]).
    pub fn all_reduce_sum(&self, comm: &mut dyn Communicator, t: &mut Tensor) -> Result<()> {
        if comm.size() == 1 {
            return Ok(());
        }
        if let Backend::Cuda(cuda) = self {
            if comm.cuda_device() == Some(cuda.ordinal()) {
                return cuda.all_reduce_sum(comm, t);
            }
        }
        match self {
            Backend::Cpu(cpu) => {
                cpu.in_place(t, |t| comm.all_reduce(t, collectives::ReduceOp::Sum))??
            }
            // A device tensor reduced through host memory comes back to the host.
            Backend::Cuda(_) => comm.all_reduce(t.host_mut()?, collectives::ReduceOp::Sum)?,
        }
        Ok(())
    }

    /// Waits for the reductions [`Backend::all_reduce_sum`] left queued on the device over
    /// `comm` (the CUDA backend queues them on its stream and does not wait), with the
    /// communicator's deadline and failure detection. A model calls it once its forward has
    /// queued the last one, so a failed peer is named there rather than found by a later
    /// wait; a no-op on the CPU.
    ///
    /// # Errors
    /// A failed collective (see [`collectives::Error`]).
    pub fn wait_collectives(&self, comm: &mut dyn Communicator) -> Result<()> {
        match self {
            Backend::Cuda(cuda) => cuda.wait_collectives(comm),
            Backend::Cpu(_) => Ok(()),
        }
    }

    /// Splits the last dimension of `x` into consecutive parts of `sizes` elements (see
    /// [`Tensor::split_last`]); on the CUDA backend the parts stay on the device.
    ///
    /// # Errors
    /// [`Error::Shape`] when the sizes do not add up to the last dimension.
    pub fn split_last(&self, x: &Tensor, sizes: &[usize]) -> Result<Vec<Tensor>> {
        let width = x.row_len();
        check("split_last", sizes.iter().sum::<usize>() == width, || {
            format!("{sizes:?} of a last dimension of {width}")
        })?;
        match self {
            Backend::Cpu(cpu) => {
                x.host()?;
                x.split_last(sizes)?.into_iter().map(|p| cpu.output(p)).collect()
            }
            Backend::Cuda(cuda) => cuda.split_last(x, sizes),
        }
    }

    /// Copies elements `range` of `src` into device memory `dst`, stored as `elem`, from its
    /// `offset`-th element on (a device copy, rounded there for bf16, when `src` is the CUDA
    /// backend's output).
    ///
    /// # Errors
    /// As [`Backend::write_device`], and [`Error::Shape`] when `range` is not in `src`.
    pub fn write_tensor(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        offset: usize,
        src: &Tensor,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        check("write_device", range.start <= range.end && range.end <= src.len(), || {
            format!("values {range:?} of a tensor of {}", src.len())
        })?;
        let cuda = self.device_writer(dst, elem, offset, range.len())?;
        cuda.write_tensor(dst, elem, offset, src, range)
    }

    /// Copies `src` into device memory `dst`, stored as `elem`, from its `offset`-th element
    /// on.
    ///
    /// # Errors
    /// [`Error::Shape`] when the values do not fit; [`Error::BackendUnavailable`] on the CPU
    /// backend or when the copy fails.
    pub fn write_device(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        offset: usize,
        src: &[f32],
    ) -> Result<()> {
        self.device_writer(dst, elem, offset, src.len())?.write_device(dst, elem, offset, src)
    }

    /// The CUDA backend, to write `len` values into `dst` (elements of `elem`) from its
    /// `offset`-th one.
    ///
    /// # Errors
    /// [`Error::Shape`] when they do not fit; [`Error::BackendUnavailable`] on the CPU.
    pub fn device_writer(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        offset: usize,
        len: usize,
    ) -> Result<&CudaBackend> {
        let floats = dst.size() / elem.size();
        check("write_device", offset + len <= floats, || {
            format!("{len} values at {offset} overflow {floats}")
        })?;
        match self {
            Backend::Cpu(_) => Err(device_memory_on_cpu("kv cache append")),
            Backend::Cuda(cuda) => Ok(cuda),
        }
    }

    /// `gate = silu(gate) · up`, in place.
    ///
    /// # Errors
    /// [`Error::Shape`] when the lengths differ.
    pub fn silu_mul(&self, gate: &mut Tensor, up: &Tensor) -> Result<()> {
        check("silu_mul", gate.len() == up.len(), || format!("{} vs {}", gate.len(), up.len()))?;
        match self {
            Backend::Cpu(cpu) => {
                let up = up.host()?;
                cpu.in_place(gate, |gate| cpu::activation::silu_mul(gate, up))?;
            }
            Backend::Cuda(cuda) => cuda.silu_mul(gate, up)?,
        }
        Ok(())
    }

    /// `gate = act(gate) · up`, in place, for the MLP's activation `act`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the lengths differ.
    pub fn gated(&self, act: Activation, gate: &mut Tensor, up: &Tensor) -> Result<()> {
        match act {
            Activation::Silu => return self.silu_mul(gate, up),
            Activation::GeluTanh => {}
        }
        check("gelu_mul", gate.len() == up.len(), || format!("{} vs {}", gate.len(), up.len()))?;
        match self {
            Backend::Cpu(cpu) => {
                let up = up.host()?;
                cpu.in_place(gate, |gate| cpu::activation::gelu_tanh_mul(gate, up))?;
            }
            Backend::Cuda(cuda) => cuda.gelu_tanh_mul(gate, up)?,
        }
        Ok(())
    }

    /// `x *= s`, in place.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the device fails.
    pub fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        match self {
            Backend::Cpu(cpu) => cpu.in_place(x, |x| cpu::activation::scale(x, s))?,
            Backend::Cuda(cuda) => cuda.scale(x, s)?,
        }
        Ok(())
    }

    /// `x = cap · tanh(x / cap)`, in place (Gemma 2's final logit soft-capping).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the device fails.
    pub fn soft_cap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        match self {
            Backend::Cpu(cpu) => cpu.in_place(x, |x| {
                x.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
            })?,
            Backend::Cuda(cuda) => cuda.soft_cap(x, cap)?,
        }
        Ok(())
    }

    /// `x += y` (the residual connection).
    ///
    /// # Errors
    /// [`Error::Shape`] when the lengths differ.
    pub fn add_assign(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        check("add_assign", x.len() == y.len(), || format!("{} vs {}", x.len(), y.len()))?;
        match self {
            Backend::Cpu(cpu) => {
                let y = y.host()?;
                cpu.in_place(x, |x| cpu::activation::add_assign(x, y))?;
            }
            Backend::Cuda(cuda) => cuda.add_assign(x, y)?,
        }
        Ok(())
    }

    /// Rows `range` of `t`'s first dimension ([`Tensor::slice_first`]); a CUDA tensor's rows
    /// are copied on the device.
    ///
    /// # Errors
    /// [`Error::Shape`] when the range is outside the first dimension.
    pub fn slice_first(&self, t: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
        match self {
            Backend::Cpu(cpu) => {
                t.host()?;
                cpu.output(t.slice_first(range)?)
            }
            Backend::Cuda(cuda) => cuda.slice_first(t, range),
        }
    }

    /// `parts` stacked along their first dimension ([`Tensor::cat_first`]); CUDA tensors are
    /// stacked on the device.
    ///
    /// # Errors
    /// [`Error::Shape`] when there are no parts or their other dimensions differ.
    pub fn cat_first(&self, parts: &[Tensor]) -> Result<Tensor> {
        match self {
            Backend::Cpu(cpu) => {
                for p in parts {
                    p.host()?;
                }
                cpu.output(Tensor::cat_first(parts)?)
            }
            Backend::Cuda(cuda) => cuda.cat_first(parts),
        }
    }

    /// `x[.., i] += bias[i]`: a bias added to every row of `x`.
    ///
    /// # Errors
    /// [`Error::Shape`] when `x`'s last dimension is not the bias length.
    pub fn add_bias(&self, x: &mut Tensor, bias: &Tensor) -> Result<()> {
        let width = x.shape().last().copied().unwrap_or(0);
        check("add_bias", width == bias.len() && !bias.is_empty(), || {
            format!("rows of {width} with a bias of {}", bias.len())
        })?;
        match self {
            Backend::Cpu(cpu) => {
                let bias = bias.host()?;
                cpu.in_place(x, |x| cpu::activation::add_rows(x, bias))?;
            }
            Backend::Cuda(cuda) => cuda.add_rows(x, bias)?,
        }
        Ok(())
    }

    /// Rows `ids` of `table` (`[vocab, dim]`): returns `[ids.len(), dim]`.
    ///
    /// # Errors
    /// [`Error::TokenOutOfRange`] for an id at or above the table's row count.
    pub fn embedding(&self, table: &Weight, ids: &[u32]) -> Result<Tensor> {
        let (vocab, dim) = table.dims();
        if let Some((index, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::TokenOutOfRange { id, index, vocab });
        }
        let cpu = match self {
            Backend::Cpu(cpu) => cpu,
            Backend::Cuda(cuda) => return cuda.embedding(table, ids),
        };
        let mut out = Tensor::zeros(&[ids.len(), dim]);
        if dim > 0 {
            for (&id, row) in ids.iter().zip(out.data_mut().chunks_exact_mut(dim)) {
                row.copy_from_slice(&table.row_f32(id as usize));
            }
        }
        cpu.output(out)
    }

    /// The index of the largest element of each row of `x` (the first on ties; NaN never wins;
    /// 0 for a row without a number).
    ///
    /// # Errors
    /// The CUDA kernel failed, or the CPU backend could not copy a device tensor to the host.
    pub fn argmax_rows(&self, x: &Tensor) -> Result<Vec<usize>> {
        match self {
            Backend::Cpu(cpu) => {
                use rayon::prelude::*;
                let width = x.row_len();
                if width == 0 {
                    return Ok(vec![0; x.rows()]);
                }
                // A batch's rows on the pool's threads (32 rows of a 49k vocabulary are a
                // millisecond on one).
                let rows = x.host()?.par_chunks_exact(width);
                Ok(cpu.install(|| {
                    rows.map(|row| cpu::activation::argmax(row).unwrap_or(0)).collect()
                }))
            }
            Backend::Cuda(cuda) => cuda.argmax_rows(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_close, random_vec};

    /// Each row's first largest value (NaN never wins, a row of NaN gives 0), whether the rows
    /// go to the pool's threads (a batch) or not (one row), and 0 for rows of no columns.
    #[test]
    fn argmax_rows_gives_each_rows_first_largest() {
        let be = Backend::cpu(2).unwrap();
        let rows: Vec<Vec<f32>> = vec![
            vec![1.0, 3.0, 3.0, 2.0],
            vec![f32::NAN, -1.0, -2.0, -3.0],
            vec![f32::NAN; 4],
            vec![0.0, 0.0, 0.0, 5.0],
            vec![-1.0, -0.5, -0.5, -2.0],
        ];
        let all = Tensor::from_vec(&[5, 4], rows.concat()).unwrap();
        assert_eq!(be.argmax_rows(&all).unwrap(), [1, 1, 0, 3, 1]);
        let one = Tensor::from_vec(&[1, 4], rows[3].clone()).unwrap();
        assert_eq!(be.argmax_rows(&one).unwrap(), [3]);
        assert_eq!(be.argmax_rows(&Tensor::zeros(&[3, 0])).unwrap(), [0, 0, 0]);
    }

    #[test]
    fn linear_uses_matvec_and_gemm_with_the_same_result() {
        let be = Backend::cpu(2).unwrap();
        let (n, k) = (40, 24);
        let w = Weight::F32(Tensor::from_vec(&[n, k], random_vec(n * k, 1)).unwrap());
        let x = Tensor::from_vec(&[5, k], random_vec(5 * k, 2)).unwrap();
        let all = be.linear(&x, &w).unwrap();
        assert_eq!(all.shape(), &[5, n]);
        for r in 0..5 {
            let one =
                be.linear(&Tensor::from_vec(&[1, k], x.row(r).to_vec()).unwrap(), &w).unwrap();
            assert_close(one.data(), all.row(r), 1e-5);
        }
        let err = be.linear(&Tensor::zeros(&[1, 3]), &w).unwrap_err();
        assert!(err.to_string().contains("weight expects 24"), "{err}");
    }

    #[test]
    fn quantized_linear_agrees_with_f32_for_decode_and_prefill_batches() {
        use crate::kernels::cpu::quant::{quantize, BlockFormat};
        let be = Backend::cpu(2).unwrap();
        let (n, k) = (48, 64);
        let wf = random_vec(n * k, 3);
        let q = QMatrix::from_blocks(BlockFormat::Q4_1, n, k, &quantize(BlockFormat::Q4_1, &wf))
            .unwrap();
        let dense = Weight::F32(Tensor::from_vec(&[n, k], q.dequantize()).unwrap());
        let quant = Weight::Quant(q);
        for m in [1, 3, 12] {
            let x = Tensor::from_vec(&[m, k], random_vec(m * k, 4)).unwrap();
            let a = be.linear(&x, &dense).unwrap();
            let b = be.linear(&x, &quant).unwrap();
            for (g, w) in b.data().iter().zip(a.data()) {
                assert!((g - w).abs() < 0.05, "m={m}: {g} vs {w}");
            }
        }
        assert_eq!(quant.row_f32(5), dense.row_f32(5));
    }

    /// The greedy-token tests compare models bit for bit, so the fused residual add and norm
    /// must be exactly the two ops it replaces, also behind the device-data seam.
    #[test]
    fn add_rms_norm_is_add_assign_then_rms_norm_bit_for_bit() {
        let bits = |t: &Tensor| t.host().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for be in [Backend::cpu(2).unwrap(), crate::test_util::cpu_with_device_outputs(1)] {
            for shape in [&[1, 1][..], &[3, 64], &[2, 5, 576], &[4, 1000]] {
                let (n, d) = (shape.iter().product(), shape[shape.len() - 1]);
                let x = Tensor::from_vec(shape, random_vec(n, 5)).unwrap();
                let y = Tensor::from_vec(shape, random_vec(n, 6)).unwrap();
                let w = Tensor::from_vec(&[d], random_vec(d, 7)).unwrap();
                let (mut apart, mut fused) = (x.clone(), x);
                be.add_assign(&mut apart, &y).unwrap();
                let want = be.rms_norm(&apart, &w, 1e-5).unwrap();
                let got = be.add_rms_norm(&mut fused, &y, &w, 1e-5).unwrap();
                assert_eq!(got.shape(), shape);
                assert_eq!(bits(&fused), bits(&apart), "{shape:?}: the sum");
                assert_eq!(bits(&got), bits(&want), "{shape:?}: the norm");
            }
        }
        let be = Backend::cpu(1).unwrap();
        let (mut x, w) = (Tensor::zeros(&[2, 4]), Tensor::zeros(&[4]));
        let err = be.add_rms_norm(&mut x, &Tensor::zeros(&[2, 3]), &w, 1e-5).unwrap_err();
        assert!(err.to_string().contains("a sum of 8 and 6 elements"), "{err}");
        let err = be.add_rms_norm(&mut x, &Tensor::zeros(&[8]), &Tensor::zeros(&[3]), 1e-5);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("rows of 4 elements, weight of 3"), "{err}");
    }

    #[test]
    fn embedding_rejects_out_of_range_ids_and_cuda_reports_why() {
        let be = Backend::cpu(1).unwrap();
        let table =
            Weight::F32(Tensor::from_vec(&[3, 2], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap());
        assert_eq!(be.embedding(&table, &[2, 0]).unwrap().data(), &[4.0, 5.0, 0.0, 1.0]);
        let err = be.embedding(&table, &[1, 3]).unwrap_err();
        assert!(err.to_string().contains("token id 3 at index 1"), "{err}");
        // Where a GPU is usable its backend rejects the same id the same way; elsewhere the
        // error says that CUDA is what is missing.
        match Backend::cuda(0) {
            Ok(gpu) => {
                let err = gpu.embedding(&table, &[1, 3]).unwrap_err();
                assert!(err.to_string().contains("token id 3 at index 1"), "{err}");
            }
            Err(err) => assert!(err.to_string().contains("cuda"), "{err}"),
        }
    }
}
