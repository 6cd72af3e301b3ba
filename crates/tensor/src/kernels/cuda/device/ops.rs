//! Launches of the row and element-wise kernels: norms (alone and fused with the residual
//! add), rotary embedding, activations, sums, column splits, embedding lookups, argmax, and
//! rounding to bf16/f16.

use super::graphs::{Call, KernelCall};
use super::{elementwise, int, per_row, unavailable, CudaBackend, BLOCK};
use crate::error::Result;
use crate::kernels::{GemmDtype, Weight};
use crate::tensor::Tensor;
use cudarc::driver::CudaFunction;
use std::sync::Arc;

impl CudaBackend {
    /// Rounds `n` floats at device address `src` to `dtype` (bf16 or f16) at `dst`.
    pub(super) fn round_to(
        &self,
        op: &str,
        dtype: GemmDtype,
        src: u64,
        dst: u64,
        n: usize,
    ) -> Result<()> {
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
        let mut b = KernelCall::new(f, cfg);
        b.arg(src).arg(dst).arg(n64);
        // SAFETY: the arguments match `to_bf16` / `to_f16(const float*, unsigned short*, u64)`;
        // thread i < n reads float i of `src` and writes half i of `dst`, and the callers pass
        // buffers of at least n floats and n halves of this device, alive until the stream is
        // synchronized.
        unsafe { self.issue(op, Call::Kernel(b)) }?;
        Ok(())
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
        let od = self.output_buf(OP, x.len())?;
        // The values rounded for a bf16 product too, when this backend's products are bf16.
        let half = self.half_buf(OP, x.len())?;
        let hp = self.half_addr(&half);
        let d32 = int(OP, "row length", d)?;
        let cfg = per_row(OP, rows, BLOCK)?;
        let mut b = KernelCall::new(&self.inner.k.rms_norm, cfg);
        b.arg(xd.ptr).arg(wp).arg(od.ptr).arg(d32).arg(eps).arg(hp);
        // SAFETY: the arguments match `rms_norm(const float*, const float*, float*, int,
        // float, unsigned short*)`; block r reads and writes row r (d floats) of x and out,
        // which hold rows·d floats, and of `half` (rows·d halves) unless it is null, and reads
        // the d floats of the weight's device copy.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        self.output_with_half(x.shape(), od, half)
    }

    /// `x += y`, then RMSNorm of rows of `weight.len()` elements of the sum: one launch for
    /// the residual add and the norm that reads it.
    pub(crate) fn add_rms_norm(
        &self,
        x: &mut Tensor,
        y: &Tensor,
        weight: &Tensor,
        eps: f32,
    ) -> Result<Tensor> {
        const OP: &str = "add_rms_norm";
        let d = weight.len();
        if x.is_empty() || d == 0 {
            return Ok(Tensor::zeros(x.shape()));
        }
        let rows = x.len() / d;
        let yd = self.input(OP, y)?;
        let wd = self.vector(OP, weight.data())?;
        let wp = self.slot_addr(&wd);
        let xp = self.writable(OP, x)?;
        // Written whole: block r writes the d floats of row r.
        let od = self.output_buf(OP, x.len())?;
        let half = self.half_buf(OP, x.len())?;
        let hp = self.half_addr(&half);
        let d32 = int(OP, "row length", d)?;
        let cfg = per_row(OP, rows, BLOCK)?;
        let mut b = KernelCall::new(&self.inner.k.add_rms_norm, cfg);
        b.arg(xp).arg(yd.ptr).arg(wp).arg(od.ptr).arg(d32).arg(eps).arg(hp);
        // SAFETY: the arguments match `add_rms_norm(float*, const float*, const float*,
        // float*, int, float, unsigned short*)`; block r rewrites row r (d floats) of x and
        // reads row r of y and writes row r of out (and of `half`, rows·d halves, unless it is
        // null), all of which hold rows·d elements (the caller checked that y has x's length
        // and d is the row length), and reads the d floats of the weight's device copy. x's
        // buffer is its own (`writable`), so y, read before, and the fresh out are other
        // buffers.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        self.output_with_half(x.shape(), od, half)
    }

    /// Rotate-half rotary embedding in place (see `cpu::rope::rope_scaled`).
    pub(crate) fn rope(
        &self,
        x: &mut Tensor,
        positions: &[usize],
        (heads, head_dim, rot_dim): (usize, usize, usize),
        theta: f32,
        factors: Option<&[f32]>,
        attn_factor: f32,
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
        let mut b = KernelCall::new(&self.inner.k.rope, cfg);
        b.arg(xp).arg(pd.ptr).args(&args).arg(theta).arg(fp).arg(attn_factor);
        // SAFETY: the arguments match `rope(float*, const u64*, int, int, int, int, float,
        // const float*, float)`. Thread (t, h, i) for i < rot_dim/2 reads position t (and
        // factor i: the caller checked there are rot_dim/2, or the pointer is null and not
        // read) and
        // rewrites elements i and i + rot_dim/2 of head h of token t; the caller checked x
        // holds tokens·heads·head_dim floats with rot_dim <= head_dim, and threads past the
        // last pair return at once. `writable` made x's buffer this tensor's own.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        Ok(())
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
        let mut b = KernelCall::new(f, cfg);
        b.arg(xp).arg(yd.ptr).arg(n);
        if let Some(w) = width.as_ref() {
            b.arg(w);
        }
        // SAFETY: the caller passes a kernel of signature `(float*, const float*, u64)` (or
        // `(float*, const float*, u64, int)` with `width`); element i < n of x is updated
        // from element i of y (i % width for add_rows), and the callers checked that y has
        // x's length (or, for add_rows, that width = y.len() > 0 divides it). x's buffer is
        // its own (`writable`), so y, read before, is never the same buffer.
        unsafe { self.issue(op, Call::Kernel(b)) }?;
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
        self.with_scalar("scale", &self.inner.k.scale, x, s)
    }

    /// `x = cap · tanh(x / cap)` (Gemma 2's final logit soft-capping).
    pub(crate) fn soft_cap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        self.with_scalar("soft_cap", &self.inner.k.soft_cap, x, cap)
    }

    /// Runs `kernel(float* x, float s, u64 n)`, which changes each element of `x` in place
    /// from its own value and `s`.
    fn with_scalar(&self, op: &str, kernel: &CudaFunction, x: &mut Tensor, s: f32) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        let xp = self.writable(op, x)?;
        let n = x.len() as u64;
        let cfg = elementwise(op, x.len())?;
        let mut b = KernelCall::new(kernel, cfg);
        b.arg(xp).arg(s).arg(n);
        // SAFETY: `kernel` is `scale` or `soft_cap`, both `(float*, float, u64)`; element
        // i < n of x, its own buffer (`writable`) of n floats, is rewritten in place.
        unsafe { self.issue(op, Call::Kernel(b)) }?;
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
            let od = self.output_buf(OP, rows * size)?;
            let args = [int(OP, "width", width)?, int(OP, "offset", at)?, int(OP, "size", size)?];
            let n = (rows * size) as u64;
            let cfg = elementwise(OP, rows * size)?;
            let mut b = KernelCall::new(&self.inner.k.copy_cols, cfg);
            b.arg(xd.ptr).arg(od.ptr).arg(n).arg(args[0]).arg(args[1]).arg(args[2]);
            // SAFETY: the arguments match `copy_cols(const float*, float*, u64, int, int,
            // int)`; element i < n = rows·size of out reads x[(i / size)·width + offset +
            // i % size], inside x's rows·width elements because the caller checked that the
            // sizes add up to width (so offset + size <= width).
            unsafe { self.issue(OP, Call::Kernel(b)) }?;
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
        let idd = self.stage(OP, ids, || Ok(Arc::new(self.upload(OP, ids)?)))?;
        // Written whole: one thread per element.
        let od = self.output_buf(OP, ids.len() * dim)?;
        let args = [int(OP, "tokens", ids.len())?, int(OP, "dim", dim)?];
        let cfg = elementwise(OP, ids.len() * dim)?;
        let mut b = KernelCall::new(&self.inner.k.embedding, cfg);
        b.arg(table_ptr).arg(idd.ptr).arg(od.ptr).arg(args[0]).arg(args[1]);
        // SAFETY: the arguments match `embedding(const float*, const unsigned int*, float*,
        // int, int)`; element (r, c) reads ids[r] and table[ids[r]·dim + c], and the caller
        // checked every id is below the table's row count; out holds ids.len()·dim floats.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
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
        // Written whole: block r writes out[r].
        let od = self.step_buf::<u32>(OP, rows)?;
        let cfg = per_row(OP, rows, BLOCK)?;
        let mut b = KernelCall::new(&self.inner.k.argmax_rows, cfg);
        b.arg(xd.ptr).arg(cols).arg(od.ptr);
        // SAFETY: the arguments match `argmax_rows(const float*, int, unsigned int*)`; block
        // r reads row r (cols floats) of x, which holds rows·cols, and writes out[r] of rows.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        let mut idx = vec![0u32; rows];
        self.download(OP, &od, &mut idx)?;
        Ok(idx.into_iter().map(|i| i as usize).collect())
    }

    /// The `k` largest values of each row of `x` and their columns, in the order of
    /// `kernels::candidate_order`, padded with (NaN, `u32::MAX`) past a row's numbers (see
    /// `Backend::top_k_rows`); `k` is at most the row length and `TOP_K_MAX`, as the caller
    /// checked. One block per row; only the candidates come to the host.
    pub(crate) fn top_k_rows(&self, x: &Tensor, k: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        const OP: &str = "top_k_rows";
        let rows = x.rows();
        if rows == 0 || k == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let cols = int(OP, "columns", x.row_len())?;
        let k_arg = int(OP, "k", k)?;
        let xd = self.input(OP, x)?;
        // Written whole: block r writes its row's k values and ids.
        let vd = self.output_buf(OP, rows * k)?;
        let id = self.step_buf::<u32>(OP, rows * k)?;
        let cfg = per_row(OP, rows, BLOCK)?;
        let mut b = KernelCall::new(&self.inner.k.top_k_rows, cfg);
        b.arg(xd.ptr).arg(cols).arg(k_arg).arg(vd.ptr).arg(id.ptr);
        // SAFETY: the arguments match `top_k_rows(const float*, int, int, float*, unsigned
        // int*)`; block r reads row r (cols floats) of x, which holds rows·cols, and writes
        // elements r·k..(r+1)·k of vals and ids, each rows·k long; k <= cols and k <=
        // TOP_K_MAX (1024, the kernel's shared arrays), as the caller checked.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        let mut values = vec![0f32; rows * k];
        let mut ids = vec![0u32; rows * k];
        self.download(OP, &vd, &mut values)?;
        self.download(OP, &id, &mut ids)?;
        Ok((values, ids))
    }

    /// One token per row of `x` by `draws` (see `Backend::sample_rows`), drawn on the device:
    /// the draws' numbers go up in one copy, the ids come down in one. The caller checked the
    /// counts and the row length.
    /// [`crate::Backend::edit_rows`]: one thread per row applies the row's edits in order.
    pub(crate) fn edit_rows(
        &self,
        x: &mut Tensor,
        edits: &crate::kernels::LogitEdits,
        first: usize,
    ) -> Result<()> {
        const OP: &str = "edit_rows";
        let rows = x.rows();
        if rows == 0 {
            return Ok(());
        }
        let cols = int(OP, "columns", x.row_len())?;
        let (offsets, words) = edits.words();
        let od = self.stage(OP, &offsets, || Ok(Arc::new(self.upload(OP, &offsets)?)))?;
        let ed = self.stage(OP, &words, || Ok(Arc::new(self.upload(OP, &words)?)))?;
        let xp = self.writable(OP, x)?;
        let mut b = KernelCall::new(&self.inner.k.edit_rows, per_row(OP, rows, 32)?);
        b.arg(xp).arg(cols).arg(od.ptr).arg(ed.ptr).arg(first as u64);
        // SAFETY: the arguments match `edit_rows(float*, int, const unsigned int*, const
        // unsigned int*, u64)`; block r's first thread reads offsets r and r + 1 of the rows + 1
        // staged (the caller checked there is a row of edits per row of x), the 3 words of
        // each edit between them (three per edit, staged), and rewrites elements of row r of
        // x (cols floats of rows·cols, `writable` made it this tensor's own), each only at a
        // column inside the row.
        unsafe { self.issue(OP, Call::Kernel(b)) }
    }

    pub(crate) fn sample_rows(
        &self,
        x: &Tensor,
        draws: &[crate::kernels::Draw],
    ) -> Result<Vec<u32>> {
        const OP: &str = "sample_rows";
        let rows = x.rows();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let cols = int(OP, "columns", x.row_len())?;
        let params: Vec<f64> = draws
            .iter()
            .flat_map(|d| [f64::from(d.temperature), f64::from(d.min_p), d.u, f64::from(d.top_p)])
            .collect();
        let xd = self.input(OP, x)?;
        let pd = self.stage(OP, &params, || Ok(Arc::new(self.upload(OP, &params)?)))?;
        // Block r writes out[r], and a weight to every column of its row before reading it.
        let od = self.step_buf::<u32>(OP, rows)?;
        let wd = self.step_buf::<f64>(OP, x.len())?;
        let cfg = per_row(OP, rows, BLOCK)?;
        let mut b = KernelCall::new(&self.inner.k.sample_rows, cfg);
        b.arg(xd.ptr).arg(cols).arg(pd.ptr).arg(wd.ptr).arg(od.ptr);
        // SAFETY: the arguments match `sample_rows(const float*, int, const double*, double*,
        // unsigned int*)`; block r reads row r (cols floats) of x, which holds rows·cols,
        // params 4r..4r+4 of 4·rows, and weights r·cols..(r+1)·cols of rows·cols (which it
        // writes first), and writes out[r] of rows; cols is at most DRAW_MAX_COLUMNS (the
        // kernel's chunk sums in shared memory), as the caller checked.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        let mut ids = vec![0u32; rows];
        self.download(OP, &od, &mut ids)?;
        Ok(ids)
    }

    /// Each row's normalizer (`Backend::normalizers`): one block per row; two numbers per
    /// row come to the host. The caller checked the row length.
    pub(crate) fn normalizers(&self, x: &Tensor) -> Result<Vec<crate::kernels::Normalizer>> {
        const OP: &str = "normalizers";
        let rows = x.rows();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let cols = int(OP, "columns", x.row_len())?;
        let xd = self.input(OP, x)?;
        // Written whole: block r writes tops[r] and sums[r].
        let td = self.step_buf::<f32>(OP, rows)?;
        let sd = self.step_buf::<f64>(OP, rows)?;
        let mut b = KernelCall::new(&self.inner.k.normalizers, per_row(OP, rows, BLOCK)?);
        b.arg(xd.ptr).arg(cols).arg(td.ptr).arg(sd.ptr);
        // SAFETY: the arguments match `normalizers(const float*, int, float*, double*)`; block
        // r reads row r (cols floats) of x, which holds rows·cols, and writes element r of
        // tops and sums, rows each; cols is at most DRAW_MAX_COLUMNS (the kernel's chunk sums
        // in shared memory), as the caller checked.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        let mut tops = vec![0f32; rows];
        let mut sums = vec![0f64; rows];
        self.download(OP, &td, &mut tops)?;
        self.download(OP, &sd, &mut sums)?;
        Ok(tops
            .into_iter()
            .zip(sums)
            .map(|(top, sum)| crate::kernels::Normalizer { top, sum })
            .collect())
    }

    /// `x[r, columns[r]]` per row (`Backend::columns_at`): the columns go up in one copy,
    /// the values come down in one. The caller checked there is a column per row.
    pub(crate) fn columns_at(&self, x: &Tensor, columns: &[u32]) -> Result<Vec<f32>> {
        const OP: &str = "columns_at";
        let rows = x.rows();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let cols = int(OP, "columns", x.row_len())?;
        let rows_arg = int(OP, "rows", rows)?;
        let xd = self.input(OP, x)?;
        let cd = self.stage(OP, columns, || Ok(Arc::new(self.upload(OP, columns)?)))?;
        // Written whole: thread r writes out[r].
        let od = self.step_buf::<f32>(OP, rows)?;
        let mut b = KernelCall::new(&self.inner.k.columns_at, elementwise(OP, rows)?);
        b.arg(xd.ptr).arg(cols).arg(cd.ptr).arg(od.ptr).arg(rows_arg);
        // SAFETY: the arguments match `columns_at(const float*, int, const unsigned int*,
        // float*, int)`; thread r < rows reads columns[r] of the rows staged and, when it is
        // inside the row, element r·cols + columns[r] of x (rows·cols), and writes out[r] of
        // rows.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        let mut out = vec![0f32; rows];
        self.download(OP, &od, &mut out)?;
        Ok(out)
    }
}
