//! Products with the weight matrices through cuBLAS: sgemm in f32, `cublasGemmEx` with f32
//! accumulation in bf16/f16; a quantized weight's few-row products through `qmatvec` (see
//! `quant`).

use super::graphs::{Call, GemmCall};
use super::quant::QMV_ROWS_MAX;
use super::{int, CudaBackend};
use crate::error::Result;
use crate::kernels::{GemmDtype, Weight};
use crate::tensor::Tensor;

impl CudaBackend {
    /// `x[m, k] · wᵀ` (`w` of `[n, k]`) shaped `shape`, with cuBLAS: sgemm in f32, GemmEx with
    /// f32 accumulation in bf16/f16; a quantized `w` times at most
    /// [`QMV_ROWS_MAX`] rows reads its packed copy instead.
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
        if let Weight::Quant(q) = w {
            if k % 32 == 0 && m <= QMV_ROWS_MAX {
                return self.quantized_product(q, x, (m, n, k), shape);
            }
        }
        let dtype = self.inner.dtype;
        // The activations already rounded to bf16 by the kernel that wrote them, if it did.
        if dtype == GemmDtype::Bf16 {
            let done = self.with_half(x, |half| {
                half.map(|xp| self.product(w, xp, (m, n, k), shape)).transpose()
            })?;
            if let Some(out) = done {
                return Ok(out);
            }
        }
        let xd = self.input(OP, x)?;
        // The activations in the weights' type (a half copy for bf16/f16).
        let half = match dtype {
            GemmDtype::F32 => None,
            _ => {
                // Written whole by the rounding kernel right below, before the product reads
                // it (stream order).
                let h = self.step_buf::<u16>(OP, m * k)?;
                self.round_to(OP, dtype, xd.ptr, h.ptr, m * k)?;
                Some(h)
            }
        };
        let xp = half.as_ref().map_or(xd.ptr, |h| h.ptr);
        self.product(w, xp, (m, n, k), shape)
    }

    /// `x · wᵀ` with the activations `x` at device address `xp` in the backend's product type
    /// (f32, or a half copy), which the caller keeps alive while the product is queued.
    fn product(
        &self,
        w: &Weight,
        xp: u64,
        (m, n, k): (usize, usize, usize),
        shape: &[usize],
    ) -> Result<Tensor> {
        const OP: &str = "linear";
        let dtype = self.inner.dtype;
        // The weight in `dtype`: its cached dense copy, or a quantized one's dequantized for
        // this product (kept packed, see `quant`). Alive until the product is queued.
        let (wp, _cached, _dense) = match w {
            Weight::Quant(q) if k % 32 == 0 => {
                let (wp, dense, half) = self.dequantized(q, dtype)?;
                (wp, None, Some((dense, half)))
            }
            _ => {
                let wd = self.weight(OP, w, dtype)?;
                (self.slot_addr(&wd), Some(wd), None)
            }
        };
        // Written whole by the product (beta = 0).
        let od = self.output_buf(OP, m * n)?;
        // cuBLAS's dimensions (column-major: see `GemmCall`).
        let rows = int(OP, "out_features", n)?;
        let cols = int(OP, "rows", m)?;
        let inner = int(OP, "in_features", k)?;
        let out_ptr = od.ptr;
        let call = GemmCall { dtype, n: rows, m: cols, k: inner, w: wp, x: xp, out: out_ptr };
        // SAFETY: with these dimensions the product reads n·k elements of the weight, k·m of
        // x and writes n·m floats of out; the weight's slot (or its dequantized step buffer)
        // holds the n·k values of `w` in `dtype`, x (or its half copy, of the weight's type)
        // and out hold m·k and m·n elements. Every buffer is freed stream-ordered, after the
        // product. One product (cuBLAS may run it as more than one kernel).
        unsafe { self.issue(OP, Call::Gemm(call)) }?;
        self.output(shape, od)
    }
}
