//! Products with the weight matrices through cuBLAS: sgemm in f32, `cublasGemmEx` with f32
//! accumulation in bf16/f16.

use super::{int, Count, CudaBackend, OrUnavailable};
use crate::error::Result;
use crate::kernels::{GemmDtype, Weight};
use crate::tensor::Tensor;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};

impl CudaBackend {
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
        let wd = self.weight(OP, w, dtype)?;
        // Written whole by the product (beta = 0).
        let od = self.output_buf(OP, m * n)?;
        let wp = self.slot_addr(&wd);
        // cuBLAS is column-major. Row-major out[m, n] is column-major outᵀ[n, m] = W·xᵀ, where
        // the row-major weight buffer read column-major is Wᵀ[k, n] (so transpose it back) and
        // the row-major x buffer is xᵀ[k, m] as it stands.
        let rows = int(OP, "out_features", n)?;
        let cols = int(OP, "rows", m)?;
        let inner = int(OP, "in_features", k)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let out_ptr = od.ptr;
        self.bind(OP)?;
        let handle = *self.inner.blas.handle();
        let (transa, transb) = (cublasOperation_t::CUBLAS_OP_T, cublasOperation_t::CUBLAS_OP_N);
        // One product: sgemm or GemmEx below (cuBLAS may run it as more than one kernel).
        self.count(Count::Launch);
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
        self.output(shape, od)
    }
}
