//! Quantized weight matrices kept packed on the device: the repacked arrays of a `QMatrix`
//! (quants, scales, minimums) in one cached slot, read by `qmatvec` for the few rows of a
//! decode step (dequantized in registers: 4 to 7 times fewer bytes per product than a dense
//! f32 copy) and dequantized into a step buffer for the many rows of a prefill, which cuBLAS
//! then multiplies as a dense weight. No dense copy of a quantized linear weight is kept.

use super::buffers::StepBuf;
use super::cache::Slot;
use super::graphs::{Call, KernelCall};
use super::{elementwise, int, per_row, CudaBackend};
use crate::error::Result;
use crate::kernels::cpu::qmatrix::QBits;
use crate::kernels::cuda::weight_stamps::WeightKey;
use crate::kernels::{GemmDtype, QMatrix};
use crate::tensor::Tensor;
use std::sync::Arc;

/// Threads per block of `qmatvec` (`QMV_BLOCK` in `kernels.cu`).
const QMV_BLOCK: u32 = 64;
/// Rows of the activations one `qmatvec` block takes (`QMV_ROWS` in `kernels.cu`).
const QMV_ROWS: usize = 8;
/// The most activation rows a product takes through `qmatvec` (each block of `QMV_ROWS` rows
/// reads the packed weight once); more go through a dense copy and cuBLAS.
pub(super) const QMV_ROWS_MAX: usize = 64;

/// The kernels' number for a `QMatrix`'s packing (see `dequantize` in `kernels.cu`): 0, 8-bit
/// with a scale per 32; 1, 4-bit with a scale and a minimum per 32; 2, 8-bit with a scale per
/// 16; 3, as 2 with a minimum per 16.
pub(super) fn packing(q: &QMatrix) -> i32 {
    match q.bits() {
        QBits::Eight => 0,
        QBits::Four => 1,
        QBits::Eight16 if q.parts().1.is_empty() => 2,
        QBits::Eight16 => 3,
    }
}

/// A quantized matrix's packed device copy: the addresses of its quants, scales and minimums
/// in its slot (kept alive here), and its packing.
pub(super) struct Packed {
    _slot: Arc<Slot>,
    qs: u64,
    scales: u64,
    mins: u64,
    kind: i32,
}

/// Where each part of a packed copy starts in its slot, in bytes (each part aligned).
fn layout(q: &QMatrix) -> (usize, usize, usize) {
    const ALIGN: usize = 256;
    let (scales, mins, qs) = q.parts();
    let scales_at = qs.len().next_multiple_of(ALIGN);
    let mins_at = scales_at + (4 * scales.len()).next_multiple_of(ALIGN);
    // Minimums or not, the kernels get an address inside the slot.
    let end = mins_at + 4 * mins.len().max(1);
    (scales_at, mins_at, end)
}

impl CudaBackend {
    /// The packed device copy of `q`, uploaded on first use (or again after a clear or a
    /// change of the weights generation), cached like the dense weights.
    pub(super) fn packed(&self, op: &str, q: &QMatrix) -> Result<Packed> {
        let (scales, mins, qs) = q.parts();
        let key = WeightKey {
            addr: qs.as_ptr() as usize,
            len: qs.len(),
            dtype: GemmDtype::F32,
            packed: true,
        };
        let (scales_at, mins_at, end) = layout(q);
        let parts: [&[u8]; 3] = [qs, bytemuck::cast_slice(scales), bytemuck::cast_slice(mins)];
        let slot = self.cached(op, key, &parts, end.div_ceil(4), |dst| {
            // SAFETY: the slot holds `end` bytes (at least end/4 floats) of this device and
            // is used by no one else while the cache's lock is held; each part goes to its
            // own range of it (`layout`).
            unsafe {
                self.copy_to_addr(op, dst, qs)?;
                self.copy_to_addr(op, dst + scales_at as u64, scales)?;
                if !mins.is_empty() {
                    self.copy_to_addr(op, dst + mins_at as u64, mins)?;
                }
            }
            Ok(())
        })?;
        let base = self.slot_addr(&slot);
        Ok(Packed {
            _slot: slot,
            qs: base,
            scales: base + scales_at as u64,
            mins: base + mins_at as u64,
            kind: packing(q),
        })
    }

    /// `x[m, k] · qᵀ` (`q` of `[n, k]`, k a multiple of 32, m at most [`QMV_ROWS_MAX`])
    /// shaped `shape`, reading the packed weight (`qmatvec`).
    pub(super) fn quantized_product(
        &self,
        q: &QMatrix,
        x: &Tensor,
        (m, n, k): (usize, usize, usize),
        shape: &[usize],
    ) -> Result<Tensor> {
        const OP: &str = "linear";
        debug_assert!(k % 32 == 0 && m <= QMV_ROWS_MAX && q.dims() == (n, k));
        let p = self.packed(OP, q)?;
        let xd = self.input(OP, x)?;
        // Written whole: block (r, c) writes column r of rows c·QMV_ROWS.. of out.
        let od = self.output_buf(OP, m * n)?;
        let mut cfg = per_row(OP, n, QMV_BLOCK)?;
        cfg.grid_dim.1 = int(OP, "row blocks", m.div_ceil(QMV_ROWS))? as u32;
        let mut b = KernelCall::new(&self.inner.k.qmatvec, cfg);
        b.arg(p.scales).arg(p.mins).arg(p.qs).arg(xd.ptr).arg(od.ptr);
        b.arg(int(OP, "out_features", n)?).arg(int(OP, "in_features", k)?);
        b.arg(int(OP, "rows", m)?).arg(p.kind);
        // SAFETY: the arguments match `qmatvec(const float*, const float*, const unsigned
        // char*, const float*, float*, int, int, int, int)`. Block (r, c) reads row r of the
        // packed weight: k/32 groups of 32 quants (16 bytes each for kind 1), their scales
        // (and minimums for kinds 1 and 3; never read otherwise), all inside the slot
        // (`layout` of a well-formed QMatrix of n rows of k columns), and rows c·8..
        // min(m, c·8 + 8) of x (k floats each; x holds m·k), and writes those rows' element r
        // of out, which holds m·n floats. The slot, x and out outlive the launch (cached,
        // borrowed, or freed stream-ordered).
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        self.output(shape, od)
    }

    /// A dense copy of `q` in `dtype` in a step buffer, for one product (the many rows of a
    /// prefill): dequantized from the packed copy, then rounded for bf16/f16. The caller
    /// keeps the buffers returned alive while the product is queued.
    pub(super) fn dequantized(
        &self,
        q: &QMatrix,
        dtype: GemmDtype,
    ) -> Result<(u64, StepBuf<f32>, Option<StepBuf<u16>>)> {
        const OP: &str = "linear";
        let (rows, cols) = q.dims();
        let n = rows * cols;
        let p = self.packed(OP, q)?;
        // Written whole by the dequantization right below.
        let dense = self.output_buf(OP, n.max(1))?;
        let mut b = KernelCall::new(&self.inner.k.dequantize, elementwise(OP, n)?);
        b.arg(p.scales).arg(p.mins).arg(p.qs).arg(dense.ptr).arg(n as u64).arg(p.kind);
        // SAFETY: the arguments match `dequantize(const float*, const float*, const unsigned
        // char*, float*, u64, int)`; for n = rows·cols elements it reads the packed parts of
        // `q` in its slot (see `quantized_product`) and writes the n floats `dense` holds.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        if dtype == GemmDtype::F32 {
            return Ok((dense.ptr, dense, None));
        }
        // Written whole by the rounding.
        let half = self.step_buf::<u16>(OP, n.max(1))?;
        self.round_to(OP, dtype, dense.ptr, half.ptr, n)?;
        Ok((half.ptr, dense, Some(half)))
    }
}
