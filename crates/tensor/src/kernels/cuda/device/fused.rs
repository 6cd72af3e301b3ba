//! Launches of the fused kernels: one kernel where a layer made several (issue 29's launch
//! count), each the same arithmetic as the kernels it replaces, so the same bits:
//! `split_rope` (a fused QKV projection split into rotated queries, rotated keys and values:
//! three column copies and two rotations before) and `gated_halves` (the MLP's gated
//! activation read from the fused gate/up projection in place: two column copies and an
//! activation before).

use super::{elementwise, int, Count, CudaBackend, OrUnavailable};
use crate::error::Result;
use crate::kernels::Activation;
use crate::tensor::Tensor;
use cudarc::driver::PushKernelArg;

impl CudaBackend {
    /// Queries `[tokens, q_heads·head_dim]`, keys and values `[tokens, kv_heads·head_dim]`
    /// from the rows of `y` (`[tokens, (q_heads + 2·kv_heads)·head_dim]`), the queries and keys
    /// rotated as [`CudaBackend::rope`] rotates them. The caller checked the sizes (`y`'s, the
    /// positions', `rot_dim <= head_dim` and even, `rot_dim / 2` factors).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn split_rope(
        &self,
        y: &Tensor,
        positions: &[usize],
        (q_heads, kv_heads, head_dim, rot_dim): (usize, usize, usize, usize),
        theta: f32,
        factors: Option<&[f32]>,
        attn_factor: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "split_rope";
        let tokens = positions.len();
        let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
        let n = tokens * (qw + 2 * kw);
        if n == 0 {
            return Ok((
                Tensor::zeros(&[tokens, qw]),
                Tensor::zeros(&[tokens, kw]),
                Tensor::zeros(&[tokens, kw]),
            ));
        }
        let yd = self.input(OP, y)?;
        let pd = self.positions(OP, positions)?;
        // The factors' device copy, cached as a model vector; null for none.
        let fd = factors.map(|f| self.vector(OP, f)).transpose()?;
        let fp = fd.as_ref().map_or(0, |f| self.slot_addr(f));
        // Each written whole: one thread per element of the three.
        let mut qd = self.output_buf(OP, tokens * qw)?;
        let mut kd = self.output_buf(OP, tokens * kw)?;
        let mut vd = self.output_buf(OP, tokens * kw)?;
        let args = [
            int(OP, "tokens", tokens)?,
            int(OP, "q_heads", q_heads)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
            int(OP, "rot_dim", rot_dim)?,
        ];
        let cfg = elementwise(OP, n)?;
        self.count(Count::Launch);
        let mut b = self.stream().launch_builder(&self.inner.k.split_rope);
        b.arg(&yd.ptr).arg(&mut qd).arg(&mut kd).arg(&mut vd).arg(&*pd);
        for a in &args {
            b.arg(a);
        }
        b.arg(&theta).arg(&fp).arg(&attn_factor);
        // SAFETY: the arguments match `split_rope(const float*, float*, float*, float*, const
        // u64*, int, int, int, int, int, float, const float*, float)`. Thread (t, slot, d) for
        // t < tokens reads position t, factor i < rot_dim/2 (the caller checked there are
        // rot_dim/2, or the pointer is null and not read) and elements of head `slot` of y's
        // row t, which holds (q_heads + 2·kv_heads)·head_dim floats per row for `tokens` rows
        // (checked by the caller), and writes element d of that head in q, k or v, each a
        // fresh buffer of tokens·heads·head_dim floats; threads past n return at once.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        Ok((
            self.output(&[tokens, qw], qd)?,
            self.output(&[tokens, kw], kd)?,
            self.output(&[tokens, kw], vd)?,
        ))
    }

    /// `act(gate) · up` for every row of `x` (`[rows, 2·units]`: the gate's `units` values,
    /// then the up projection's): the last dimension halved. The caller checked the row length.
    pub(crate) fn gated_halves(&self, act: Activation, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "gated_halves";
        let (rows, units) = (x.rows(), x.row_len() / 2);
        let n = rows * units;
        let mut shape = x.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = units;
        }
        if n == 0 {
            return Ok(Tensor::zeros(&shape));
        }
        let xd = self.input(OP, x)?;
        // Written whole: one thread per element.
        let mut od = self.output_buf(OP, n)?;
        // The values rounded for a bf16 product too (the down projection's input).
        let half = self.half_buf(OP, n)?;
        let hp = self.half_addr(&half);
        let gelu = i32::from(matches!(act, Activation::GeluTanh));
        let (len, units_arg) = (n as u64, int(OP, "units", units)?);
        let cfg = elementwise(OP, n)?;
        self.count(Count::Launch);
        let mut b = self.stream().launch_builder(&self.inner.k.gated_halves);
        b.arg(&xd.ptr).arg(&mut od).arg(&len).arg(&units_arg).arg(&gelu).arg(&hp);
        // SAFETY: the arguments match `gated_halves(const float*, float*, u64, int, int,
        // unsigned short*)`; element i < n = rows·units of out (and of `half`, n halves,
        // unless it is null) reads elements i % units and units + i % units of row i / units
        // of x, which holds rows·2·units floats (the caller checked the row length is
        // 2·units); out is a fresh buffer of n floats.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        self.output_with_half(&shape, od, half)
    }
}
