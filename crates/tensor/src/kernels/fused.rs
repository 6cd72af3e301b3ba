//! Ops that do in one pass what a layer did in several: on the CUDA backend each is one
//! kernel launch and one output per tensor where the separate ops made several (issue 29's
//! launch count), with the same arithmetic, so the same bits as the ops they replace; on the
//! CPU they are those ops (the gated activation reads its two halves in place). Also the write
//! of a step's new key (or value) rows of every sequence into a device pool in one launch.

use super::{check, cpu, device_memory_on_cpu, Activation, Backend, KvElem};
use crate::error::Result;
use crate::tensor::Tensor;
use mesh::DeviceMemory;
use rayon::prelude::*;

/// A fused QKV projection's rows (`[tokens, (q_heads + 2·kv_heads)·head_dim]`) and its bias
/// (one such row, or none), not yet added: [`Backend::split_rope`] adds it in the same pass.
#[derive(Clone, Copy, Debug)]
pub struct Projected<'a> {
    /// The projection's rows.
    pub y: &'a Tensor,
    /// The bias of every row.
    pub bias: Option<&'a Tensor>,
}

impl<'a> Projected<'a> {
    /// Rows without a bias.
    pub fn rows(y: &'a Tensor) -> Projected<'a> {
        Projected { y, bias: None }
    }
}

/// That `p` holds the fused projections of `positions.len()` tokens of `dims` (query heads,
/// KV heads, head size, rotated size: even, at most the head size) with a bias of one row (if
/// any), and `factors` are one per rotated pair.
fn check_split_rope(
    p: Projected<'_>,
    positions: &[usize],
    (q_heads, kv_heads, head_dim, rot_dim): (usize, usize, usize, usize),
    factors: Option<&[f32]>,
) -> Result<()> {
    let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
    check(
        "split_rope",
        p.y.len() == positions.len() * (qw + 2 * kw)
            && p.bias.is_none_or(|b| b.len() == qw + 2 * kw)
            && rot_dim.is_multiple_of(2)
            && rot_dim <= head_dim
            && factors.is_none_or(|f| f.len() == rot_dim / 2),
        || {
            format!(
                "{} elements for {} positions x ({q_heads} + 2 x {kv_heads}) heads x \
                 {head_dim}, a bias of {:?}, rot_dim {rot_dim}, {:?} frequency factors",
                p.y.len(),
                positions.len(),
                p.bias.map(Tensor::len),
                factors.map(<[f32]>::len)
            )
        },
    )
}

/// Where [`Backend::split_rope_append`] writes each token's keys and values: a paged pool in
/// device memory or on the host, token `t`'s key row at element `shift + places[t]`, its value
/// row `values` elements after.
pub struct PoolRows<'a> {
    /// The pool's memory.
    pub memory: PoolMemory<'a>,
    /// Each token's place, relative to `shift`.
    pub places: &'a [usize],
    /// What every place is relative to (a layer's place in a block).
    pub shift: usize,
    /// Elements from a key row to its value row.
    pub values: usize,
}

/// A pool's memory, for [`PoolRows`].
pub enum PoolMemory<'a> {
    /// Device memory, in elements of `elem`.
    Device(&'a dyn DeviceMemory, KvElem),
    /// Host memory, f32.
    Host(&'a mut [f32]),
}

impl Backend {
    /// [`Backend::split_rope`] with each token's keys and values written into a paged pool
    /// (`dst`) instead of returned: the queries. On the CUDA backend over device memory that is
    /// one launch for the projection's split, both rotations and the KV append, where they
    /// made three (the split with the rotations, then the keys' and the values' writes); the
    /// same bits either way.
    ///
    /// # Errors
    /// As [`Backend::split_rope`]; [`crate::Error::Shape`] when the places are not one per
    /// token or a row does not fit the memory; [`crate::Error::BackendUnavailable`] for device
    /// memory on the CPU backend.
    pub fn split_rope_append(
        &self,
        y: Projected<'_>,
        positions: &[usize],
        dims: (usize, usize, usize, usize),
        (theta, factors, attn_factor): (f32, Option<&[f32]>, f32),
        dst: PoolRows<'_>,
    ) -> Result<Tensor> {
        let (_, kv_heads, head_dim, _) = dims;
        let row = kv_heads * head_dim;
        let PoolRows { memory, places, shift, values } = dst;
        let floats = match &memory {
            PoolMemory::Device(mem, elem) => mem.size() / elem.size(),
            PoolMemory::Host(data) => data.len(),
        };
        // A value row ends after its key row: the last one bounds both.
        let far = places.iter().map(|&p| shift + p + values + row).max().unwrap_or(0);
        check("split_rope_append", places.len() == positions.len() && far <= floats, || {
            format!(
                "{} places for {} tokens, rows reaching value {far} of {floats}",
                places.len(),
                positions.len()
            )
        })?;
        match (self, memory) {
            (Backend::Cuda(cuda), PoolMemory::Device(mem, elem)) => {
                check_split_rope(y, positions, dims, factors)?;
                let factors = factors.filter(|f| f.iter().any(|&s| s != 1.0));
                let pool = (mem, elem, places, shift, values);
                cuda.split_rope_append(y, positions, dims, (theta, factors, attn_factor), pool)
            }
            (Backend::Cpu(_), PoolMemory::Device(..)) => {
                Err(device_memory_on_cpu("kv cache append"))
            }
            (_, PoolMemory::Host(data)) => {
                let (q, k, v) =
                    self.split_rope(y, positions, dims, (theta, factors, attn_factor))?;
                let (k, v) = (k.host()?, v.host()?);
                for (t, &p) in places.iter().enumerate() {
                    let at = shift + p;
                    data[at..at + row].copy_from_slice(&k[t * row..(t + 1) * row]);
                    data[at + values..at + values + row]
                        .copy_from_slice(&v[t * row..(t + 1) * row]);
                }
                Ok(q)
            }
        }
    }

    /// Queries `[tokens, q_heads·head_dim]`, keys and values `[tokens, kv_heads·head_dim]`
    /// from a fused QKV projection's rows and bias `p`, the queries and keys rotated by
    /// `(theta, factors, attn_factor)` as [`Backend::rope_scaled`] rotates them: the same
    /// values as [`Backend::add_bias`], [`Backend::split_last`] then two rotations.
    ///
    /// # Errors
    /// [`crate::Error::Shape`] when the sizes disagree, as [`Backend::rope_scaled`] checks
    /// them.
    pub fn split_rope(
        &self,
        p: Projected<'_>,
        positions: &[usize],
        (q_heads, kv_heads, head_dim, rot_dim): (usize, usize, usize, usize),
        (theta, factors, attn_factor): (f32, Option<&[f32]>, f32),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
        check_split_rope(p, positions, (q_heads, kv_heads, head_dim, rot_dim), factors)?;
        match self {
            Backend::Cpu(_) => {
                let biased;
                let y = match p.bias {
                    Some(bias) => {
                        let mut y = p.y.clone();
                        self.add_bias(&mut y, bias)?;
                        biased = y;
                        &biased
                    }
                    None => p.y,
                };
                let mut parts = self.split_last(y, &[qw, kw, kw])?.into_iter();
                let (Some(mut q), Some(mut k), Some(v)) =
                    (parts.next(), parts.next(), parts.next())
                else {
                    unreachable!("split_last gives one part per size");
                };
                let dims = |heads| (heads, head_dim, rot_dim);
                self.rope_scaled(&mut q, positions, dims(q_heads), theta, factors, attn_factor)?;
                self.rope_scaled(&mut k, positions, dims(kv_heads), theta, factors, attn_factor)?;
                Ok((q, k, v))
            }
            Backend::Cuda(cuda) => {
                // As `rope_scaled`: factors that are all 1 are no scaling.
                let factors = factors.filter(|f| f.iter().any(|&s| s != 1.0));
                let dims = (q_heads, kv_heads, head_dim, rot_dim);
                cuda.split_rope(p, positions, dims, (theta, factors, attn_factor))
            }
        }
    }

    /// Row `s` of `src` (rows of `row` floats) into elements `shift + d..` of device memory
    /// `dst` (`row` of them), stored as `elem` (bf16 rounded as [`Backend::write_tensor`]
    /// rounds), for every `(s, d)` of `moves`: one launch for a step's new keys (or values) of
    /// every sequence of a paged pool, where [`Backend::write_tensor`] made one copy per row.
    /// `shift` is what differs between layers (their place in a block), so a step's moves are
    /// the same, and uploaded once, for every layer.
    ///
    /// # Errors
    /// [`crate::Error::Shape`] naming the first move whose row is not in `src` or whose place
    /// is not inside `dst`; [`crate::Error::BackendUnavailable`] on the CPU backend or when the
    /// copy fails.
    pub fn write_rows(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        src: &Tensor,
        row: usize,
        moves: &[(usize, usize)],
        shift: usize,
    ) -> Result<()> {
        let (rows, floats) = (src.len() / row.max(1), dst.size() / elem.size());
        if let Some((i, &(s, d))) =
            moves.iter().enumerate().find(|(_, &(s, d))| s >= rows || shift + d + row > floats)
        {
            check("write_rows", false, || {
                format!(
                    "move {i}: row {s} of {rows} rows of {row} into values {}.. of {floats}",
                    shift + d
                )
            })?;
        }
        match self {
            Backend::Cpu(_) => Err(device_memory_on_cpu("kv cache append")),
            Backend::Cuda(cuda) => cuda.write_rows(dst, elem, src, row, moves, shift),
        }
    }

    /// `act(gate) · up` for every row of `x`, whose last dimension is the gate's values then
    /// the up projection's (a fused gate/up projection's output): the last dimension halved.
    /// The same values as [`Backend::split_last`] then [`Backend::gated`], read in place.
    ///
    /// # Errors
    /// [`crate::Error::Shape`] when the rows have an odd length.
    pub fn gated_halves(&self, act: Activation, x: &Tensor) -> Result<Tensor> {
        let width = x.row_len();
        check("gated_halves", width.is_multiple_of(2), || {
            format!("a row of {width} values is not a gate and an up half")
        })?;
        let units = width / 2;
        match self {
            Backend::Cpu(cpu) => {
                let mut shape = x.shape().to_vec();
                if let Some(last) = shape.last_mut() {
                    *last = units;
                }
                let mut out = vec![0f32; x.rows() * units];
                let rows = x.host()?.par_chunks_exact(width.max(1));
                // The rows of a batch on the pool's threads, a few to a task (one thread doing
                // a 32-row step's left the other idle); each row's values as alone.
                let pairs = out.par_chunks_exact_mut(units.max(1)).zip(rows).with_min_len(4);
                cpu.install(|| {
                    pairs.for_each(|(o, row)| {
                        let (gate, up) = row.split_at(units);
                        o.copy_from_slice(gate);
                        match act {
                            Activation::Silu => cpu::activation::silu_mul(o, up),
                            Activation::GeluTanh => cpu::activation::gelu_tanh_mul(o, up),
                        }
                    })
                });
                cpu.output(Tensor::from_vec(&shape, out)?)
            }
            Backend::Cuda(cuda) => cuda.gated_halves(act, x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{cpu_with_device_outputs, random_vec};

    fn bits(t: &Tensor) -> Vec<u32> {
        t.host().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// The fused ops against the ops they replace, bit for bit, on the plain CPU backend and on
    /// one that hands outputs out as device data: GQA with a partial rotation, frequency
    /// factors and an attention factor, then a whole rotation; both activations.
    #[test]
    fn fused_ops_give_the_bits_of_the_ops_they_replace() {
        let backends = [Backend::cpu(2).unwrap(), cpu_with_device_outputs(2)];
        for be in &backends {
            for (q_heads, kv_heads, head_dim, rot, scaled) in
                [(6, 2, 8, 6, true), (4, 4, 16, 16, false)]
            {
                let positions = [3usize, 40, 1000];
                let width = (q_heads + 2 * kv_heads) * head_dim;
                let y = Tensor::from_vec(&[3, width], random_vec(3 * width, 5)).unwrap();
                let factors: Vec<f32> = (0..rot / 2).map(|i| 1.0 + (i % 3) as f32).collect();
                let (factors, attn) = if scaled { (Some(&factors[..]), 1.25) } else { (None, 1.0) };
                let dims = (q_heads, kv_heads, head_dim, rot);
                let rotation = (500.0, factors, attn);
                let rows = Projected::rows(&y);
                let (q, k, v) = be.split_rope(rows, &positions, dims, rotation).unwrap();
                let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
                let parts = be.split_last(&y, &[qw, kw, kw]).unwrap();
                let (mut q2, mut k2) = (parts[0].clone(), parts[1].clone());
                let rope = |t: &mut Tensor, heads| {
                    be.rope_scaled(t, &positions, (heads, head_dim, rot), 500.0, factors, attn)
                };
                rope(&mut q2, q_heads).unwrap();
                rope(&mut k2, kv_heads).unwrap();
                assert_eq!(q.shape(), &[3, qw]);
                assert_eq!((k.shape(), v.shape()), (&[3, kw][..], &[3, kw][..]));
                assert_eq!((bits(&q), bits(&k)), (bits(&q2), bits(&k2)));
                assert_eq!(bits(&v), bits(&parts[2]));
                assert_ne!(bits(&q), bits(&parts[0]), "the queries were rotated");
                // With a bias: the split of the rows with the bias added.
                let bias = Tensor::from_vec(&[width], random_vec(width, 6)).unwrap();
                let with_bias = Projected { y: &y, bias: Some(&bias) };
                let got = be.split_rope(with_bias, &positions, dims, rotation).unwrap();
                let mut added = y.clone();
                be.add_bias(&mut added, &bias).unwrap();
                let want = be.split_rope(Projected::rows(&added), &positions, dims, rotation);
                let want = want.unwrap();
                for (g, w) in [(&got.0, &want.0), (&got.1, &want.1), (&got.2, &want.2)] {
                    assert_eq!(bits(g), bits(w), "with a bias");
                }
                assert_ne!(bits(&got.2), bits(&v), "the bias was added");
            }
            let x = Tensor::from_vec(&[4, 2, 30], random_vec(240, 6)).unwrap();
            for act in [Activation::Silu, Activation::GeluTanh] {
                let h = be.gated_halves(act, &x).unwrap();
                assert_eq!(h.shape(), &[4, 2, 15]);
                let parts = be.split_last(&x, &[15, 15]).unwrap();
                let mut g = parts[0].clone();
                be.gated(act, &mut g, &parts[1]).unwrap();
                assert_eq!(bits(&h), bits(&g), "{act:?}");
            }
        }
    }

    /// A move out of its source or past the memory is named before anything is written; the
    /// CPU backend writes no device memory.
    #[test]
    fn write_rows_names_a_move_that_does_not_fit() {
        use crate::test_util::FakeDeviceMemory;
        let be = Backend::cpu(1).unwrap();
        let mem = FakeDeviceMemory(4 * 64);
        let src = Tensor::zeros(&[3, 8]);
        let bad = be.write_rows(&mem, KvElem::F32, &src, 8, &[(0, 0), (3, 8)], 0).unwrap_err();
        assert!(bad.to_string().contains("move 1: row 3 of 3 rows of 8"), "{bad}");
        let past = be.write_rows(&mem, KvElem::F32, &src, 8, &[(2, 50)], 8).unwrap_err();
        assert!(past.to_string().contains("into values 58.. of 64"), "{past}");
        // Two bytes an element: the same memory holds 128 bf16 values.
        let err = be.write_rows(&mem, KvElem::Bf16, &src, 8, &[(2, 112)], 8).unwrap_err();
        assert!(matches!(err, crate::Error::BackendUnavailable { .. }), "{err}");
    }

    /// The queries of `split_rope`, and its keys and values at each token's place of a host
    /// pool (shifted, values a block after), nothing else written; places that do not fit and
    /// device memory on the CPU are refused.
    #[test]
    fn split_rope_append_writes_split_ropes_keys_and_values_at_their_places() {
        use crate::test_util::FakeDeviceMemory;
        let be = Backend::cpu(1).unwrap();
        let dims = (6, 2, 8, 6);
        let positions = [5usize, 9, 40];
        let y = Tensor::from_vec(&[3, 80], random_vec(240, 3)).unwrap();
        let factors: Vec<f32> = vec![1.0, 2.0, 4.0];
        let rope = (500.0, Some(&factors[..]), 1.25);
        let (q, k, v) = be.split_rope(Projected::rows(&y), &positions, dims, rope).unwrap();
        let (row, values, shift) = (16, 64, 3);
        let places = [130usize, 0, 260];
        let mut pool = vec![-1.0f32; 3 + 260 + 64 + 16];
        let len = pool.len();
        let memory = PoolMemory::Host(&mut pool);
        let got = be.split_rope_append(
            Projected::rows(&y),
            &positions,
            dims,
            rope,
            PoolRows { memory, places: &places, shift, values },
        );
        assert_eq!(bits(&got.unwrap()), bits(&q));
        let mut want = vec![-1.0f32; len];
        for (t, &p) in places.iter().enumerate() {
            want[shift + p..][..row].copy_from_slice(&k.data()[t * row..][..row]);
            want[shift + p + values..][..row].copy_from_slice(&v.data()[t * row..][..row]);
        }
        assert_eq!(pool, want);
        let mut short = vec![0.0f32; len - 1];
        let memory = PoolMemory::Host(&mut short);
        let dst = PoolRows { memory, places: &places, shift, values };
        let err =
            be.split_rope_append(Projected::rows(&y), &positions, dims, rope, dst).unwrap_err();
        assert!(err.to_string().contains("rows reaching value 343 of 342"), "{err}");
        let mem = FakeDeviceMemory(4 * len);
        let memory = PoolMemory::Device(&mem, KvElem::F32);
        let dst = PoolRows { memory, places: &places, shift, values };
        let err =
            be.split_rope_append(Projected::rows(&y), &positions, dims, rope, dst).unwrap_err();
        assert!(matches!(err, crate::Error::BackendUnavailable { .. }), "{err}");
    }

    #[test]
    fn fused_ops_name_a_size_that_does_not_fit() {
        let be = Backend::cpu(1).unwrap();
        let y = Tensor::zeros(&[2, 40]);
        let err = be.split_rope(Projected::rows(&y), &[0, 1], (2, 1, 8, 8), (1e4, None, 1.0));
        let err = err.unwrap_err();
        assert!(
            err.to_string().contains("80 elements for 2 positions x (2 + 2 x 1) heads"),
            "{err}"
        );
        let zeros = Tensor::zeros(&[2, 32]);
        let err = be.split_rope(Projected::rows(&zeros), &[0, 1], (2, 1, 4, 6), (1e4, None, 1.0));
        assert!(err.unwrap_err().to_string().contains("rot_dim 6"));
        let err = be.gated_halves(Activation::Silu, &Tensor::zeros(&[2, 7])).unwrap_err();
        assert!(err.to_string().contains("a row of 7 values"), "{err}");
    }
}
