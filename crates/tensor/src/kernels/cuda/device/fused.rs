//! Launches of the fused kernels: one kernel where a layer made several (issue 29's launch
//! count), each the same arithmetic as the kernels it replaces, so the same bits:
//! `split_rope` (a fused QKV projection split into rotated queries, rotated keys and values:
//! three column copies and two rotations before) and `gated_halves` (the MLP's gated
//! activation read from the fused gate/up projection in place: two column copies and an
//! activation before).

use super::buffers::Input;
use super::cache::Slot;
use super::graphs::{Call, KernelCall};
use super::staging::Staged;
use super::{elementwise, int, CudaBackend};
use crate::error::Result;
use crate::kernels::{Activation, KvElem, Projected};
use crate::tensor::Tensor;
use mesh::DeviceMemory;
use std::sync::Arc;

/// The arguments `split_rope` and `split_rope_append` share, from `pos` on: the step's
/// positions, the head geometry and the rotation, with the device copies behind them kept
/// alive; and the projection they read.
struct SplitArgs {
    y: Input,
    positions: Staged<u64>,
    /// `tokens, q_heads, kv_heads, head_dim, rot_dim`.
    dims: [i32; 5],
    theta: f32,
    /// The factors' device copy (a cached model vector), and its address (null for none).
    _factors: Option<Arc<Slot>>,
    factors: u64,
    attn_factor: f32,
    /// The projection's bias (a cached model vector), and its address (null for none).
    _bias: Option<Arc<Slot>>,
    bias: u64,
}

impl SplitArgs {
    /// Pushes `pos, tokens, q_heads, kv_heads, head_dim, rot_dim, theta, factors,
    /// attn_factor, bias`, the kernels' common tail.
    fn push_tail(&self, b: &mut KernelCall) {
        b.arg(self.positions.ptr);
        b.args(&self.dims);
        b.arg(self.theta).arg(self.factors).arg(self.attn_factor).arg(self.bias);
    }
}

impl CudaBackend {
    /// Queries `[tokens, q_heads·head_dim]`, keys and values `[tokens, kv_heads·head_dim]`
    /// from the rows of `y` (`[tokens, (q_heads + 2·kv_heads)·head_dim]`), the queries and keys
    /// rotated as [`CudaBackend::rope`] rotates them. The caller checked the sizes (`y`'s, the
    /// positions', `rot_dim <= head_dim` and even, `rot_dim / 2` factors).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn split_rope(
        &self,
        y: Projected<'_>,
        positions: &[usize],
        dims: (usize, usize, usize, usize),
        rotation: (f32, Option<&[f32]>, f32),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "split_rope";
        let (q_heads, kv_heads, head_dim, _) = dims;
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
        let split = self.split_args(OP, y, positions, dims, rotation)?;
        // Each written whole: one thread per element of the three.
        let qd = self.output_buf(OP, tokens * qw)?;
        let kd = self.output_buf(OP, tokens * kw)?;
        let vd = self.output_buf(OP, tokens * kw)?;
        let cfg = elementwise(OP, n)?;
        let mut b = KernelCall::new(&self.inner.k.split_rope, cfg);
        b.arg(split.y.ptr).arg(qd.ptr).arg(kd.ptr).arg(vd.ptr);
        split.push_tail(&mut b);
        // SAFETY: the arguments match `split_rope(const float*, float*, float*, float*, const
        // u64*, int, int, int, int, int, float, const float*, float, const float*)`. Thread
        // (t, slot, d) for t < tokens reads position t, factor i < rot_dim/2 (the caller
        // checked there are rot_dim/2, or the pointer is null and not read), elements of head
        // `slot` of the bias (a row of (q_heads + 2·kv_heads)·head_dim, checked by the
        // caller, or null) and of y's row t, which holds (q_heads + 2·kv_heads)·head_dim floats per row for `tokens` rows
        // (checked by the caller), and writes element d of that head in q, k or v, each a
        // fresh buffer of tokens·heads·head_dim floats; threads past n return at once.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
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
        let od = self.output_buf(OP, n)?;
        // The values rounded for a bf16 product too (the down projection's input).
        let half = self.half_buf(OP, n)?;
        let hp = self.half_addr(&half);
        let gelu = i32::from(matches!(act, Activation::GeluTanh));
        let (len, units_arg) = (n as u64, int(OP, "units", units)?);
        let cfg = elementwise(OP, n)?;
        let mut b = KernelCall::new(&self.inner.k.gated_halves, cfg);
        b.arg(xd.ptr).arg(od.ptr).arg(len).arg(units_arg).arg(gelu).arg(hp);
        // SAFETY: the arguments match `gated_halves(const float*, float*, u64, int, int,
        // unsigned short*)`; element i < n = rows·units of out (and of `half`, n halves,
        // unless it is null) reads elements i % units and units + i % units of row i / units
        // of x, which holds rows·2·units floats (the caller checked the row length is
        // 2·units); out is a fresh buffer of n floats.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        self.output_with_half(&shape, od, half)
    }
}

/// A paged pool's device memory for [`CudaBackend::split_rope_append`]: the memory, its
/// element, each token's place, the shift of every place, and the values' distance from the
/// keys (see `kernels::PoolRows`).
pub(crate) type DevicePool<'a> = (&'a dyn DeviceMemory, KvElem, &'a [usize], usize, usize);

impl CudaBackend {
    /// [`CudaBackend::split_rope`] with each token's keys and values written into `pool`
    /// instead of returned (the caller checked that the rows fit it): the queries, in one
    /// launch.
    pub(crate) fn split_rope_append(
        &self,
        y: Projected<'_>,
        positions: &[usize],
        dims: (usize, usize, usize, usize),
        rotation: (f32, Option<&[f32]>, f32),
        (memory, elem, places, shift, values): DevicePool<'_>,
    ) -> Result<Tensor> {
        const OP: &str = "split_rope_append";
        let (q_heads, kv_heads, head_dim, _) = dims;
        let tokens = positions.len();
        let qw = q_heads * head_dim;
        let n = tokens * (qw + 2 * kv_heads * head_dim);
        if n == 0 {
            return Ok(Tensor::zeros(&[tokens, qw]));
        }
        let to = self.owned_addr(OP, memory)?;
        let split = self.split_args(OP, y, positions, dims, rotation)?;
        let placed = self.positions(OP, places)?;
        // Written whole: one thread per query element.
        let qd = self.output_buf(OP, tokens * qw)?;
        let (shift, values) = (shift as u64, values as u64);
        let bf16 = i32::from(elem == KvElem::Bf16);
        let cfg = elementwise(OP, n)?;
        let mut b = KernelCall::new(&self.inner.k.split_rope_append, cfg);
        b.arg(split.y.ptr).arg(qd.ptr).arg(to).arg(placed.ptr).arg(shift).arg(values);
        b.arg(bf16);
        split.push_tail(&mut b);
        // SAFETY: the arguments match `split_rope_append(const float*, float*, float*, const
        // u64*, u64, u64, int, const u64*, int, int, int, int, int, float, const float*,
        // float, const float*)`. Thread (t, slot, d) reads position t, place t (one per token,
        // uploaded), factor i < rot_dim/2 (or none: a null pointer) and elements of head
        // `slot` of the bias (one row, or null) and of y's row t, which holds (q_heads + 2·kv_heads)·head_dim floats per row for `tokens` rows
        // (checked by the caller), and writes element d of that head in q (a fresh buffer of
        // tokens·q_heads·head_dim floats) or at shift + places[t] (+ values) + the head's
        // offset in `memory`, in f32 or (bf16 = 1, two bytes) bf16: inside it, as the caller
        // checked every row does, memory of this device (checked above) that its
        // `DeviceMemory` implementation promises is mapped while kernels may run.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        self.output(&[tokens, qw], qd)
    }
}

impl CudaBackend {
    /// The arguments the split kernels share (see [`SplitArgs`]), for the projection `p`'s
    /// rows at `positions`, heads `(q_heads, kv_heads, head_dim, rot_dim)` and rotation
    /// `(theta, factors, attn_factor)`.
    fn split_args(
        &self,
        op: &str,
        p: Projected<'_>,
        positions: &[usize],
        (q_heads, kv_heads, head_dim, rot_dim): (usize, usize, usize, usize),
        (theta, factors, attn_factor): (f32, Option<&[f32]>, f32),
    ) -> Result<SplitArgs> {
        let factors = factors.map(|f| self.vector(op, f)).transpose()?;
        let bias = p.bias.map(|b| self.vector(op, b.host()?)).transpose()?;
        Ok(SplitArgs {
            y: self.input(op, p.y)?,
            positions: self.positions(op, positions)?,
            dims: [
                int(op, "tokens", positions.len())?,
                int(op, "q_heads", q_heads)?,
                int(op, "kv_heads", kv_heads)?,
                int(op, "head_dim", head_dim)?,
                int(op, "rot_dim", rot_dim)?,
            ],
            theta,
            factors: factors.as_ref().map_or(0, |f| self.slot_addr(f)),
            _factors: factors,
            attn_factor,
            bias: bias.as_ref().map_or(0, |b| self.slot_addr(b)),
            _bias: bias,
        })
    }
}
