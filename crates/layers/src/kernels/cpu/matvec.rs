//! Matrix-vector products for decode (`m` = 1): row-parallel dot products.
//!
//! At `m` = 1 the work is bound by memory bandwidth (each weight is read once and used once),
//! where `gemm`'s packing and tiling only cost. The rows are split into chunks that rayon
//! spreads over the pool's threads; each output is one dot product with several independent
//! accumulators so the compiler can keep the SIMD units busy.

use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;

/// Rows per parallel task: large enough that scheduling is negligible, small enough that the
/// two halves of a 576-row projection still land on different threads.
const ROWS_PER_TASK: usize = 16;

/// Dot product with 16 independent accumulators (vectorizes without fast-math), reduced as a
/// tree: a sequential sum of the lanes would be a chain of 15 dependent adds, which costs more
/// than the products for short vectors such as attention heads.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 16];
    let ac = a.chunks_exact(16);
    let bc = b.chunks_exact(16);
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut half = [0.0f32; 8];
    for l in 0..8 {
        half[l] = acc[l] + acc[l + 8];
    }
    let mut quarter = [0.0f32; 4];
    for l in 0..4 {
        quarter[l] = half[l] + half[l + 4];
    }
    let mut s = (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// [`dot`] on explicit SIMD vectors of `simd`'s width with two accumulators, for code that
/// already runs inside a SIMD dispatch.
#[inline(always)]
pub(crate) fn simd_dot<S: Simd>(simd: S, a: &[f32], b: &[f32]) -> f32 {
    let (ah, at) = S::as_simd_f32s(a);
    let (bh, bt) = S::as_simd_f32s(b);
    // Two named accumulators (an indexed array would live in memory, not registers).
    let (mut acc0, mut acc1) = (simd.splat_f32s(0.0), simd.splat_f32s(0.0));
    let (a2, b2) = (ah.chunks_exact(2), bh.chunks_exact(2));
    if let (Some(x), Some(y)) = (a2.remainder().first(), b2.remainder().first()) {
        acc1 = simd.mul_add_e_f32s(*x, *y, acc1);
    }
    for (x, y) in a2.zip(b2) {
        acc0 = simd.mul_add_e_f32s(x[0], y[0], acc0);
        acc1 = simd.mul_add_e_f32s(x[1], y[1], acc1);
    }
    let mut s = simd.reduce_sum_f32s(simd.add_f32s(acc0, acc1));
    for (x, y) in at.iter().zip(bt) {
        s += x * y;
    }
    s
}

/// `out += e · v` on explicit SIMD vectors of `simd`'s width.
#[inline(always)]
pub(crate) fn simd_axpy<S: Simd>(simd: S, e: f32, v: &[f32], out: &mut [f32]) {
    let (oh, ot) = S::as_mut_simd_f32s(out);
    let (vh, vt) = S::as_simd_f32s(v);
    let es = simd.splat_f32s(e);
    for (o, x) in oh.iter_mut().zip(vh) {
        *o = simd.mul_add_e_f32s(es, *x, *o);
    }
    for (o, x) in ot.iter_mut().zip(vt) {
        *o += e * x;
    }
}

/// `out += Σ_i e[i] · v[i]` for four vectors at once: one load and store of `out` per four
/// products instead of per product.
#[inline(always)]
pub(crate) fn simd_axpy4<S: Simd>(simd: S, e: [f32; 4], v: [&[f32]; 4], out: &mut [f32]) {
    let (oh, ot) = S::as_mut_simd_f32s(out);
    let vs = v.map(|x| S::as_simd_f32s(x));
    let es = e.map(|x| simd.splat_f32s(x));
    for (i, o) in oh.iter_mut().enumerate() {
        let a = simd.mul_add_e_f32s(es[0], vs[0].0[i], *o);
        let b = simd.mul_f32s(es[1], vs[1].0[i]);
        let a = simd.mul_add_e_f32s(es[2], vs[2].0[i], a);
        let b = simd.mul_add_e_f32s(es[3], vs[3].0[i], b);
        *o = simd.add_f32s(a, b);
    }
    for (i, o) in ot.iter_mut().enumerate() {
        *o += e[0] * vs[0].1[i] + e[1] * vs[1].1[i] + e[2] * vs[2].1[i] + e[3] * vs[3].1[i];
    }
}

/// `out[r] = w[r, :] · x` for `w` of shape `[out.len(), x.len()]`, in the current rayon pool.
///
/// Lengths must agree (`w.len() == out.len() * x.len()`); callers check them.
pub fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let k = x.len();
    debug_assert_eq!(w.len(), out.len() * k);
    let arch = Arch::new();
    out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
        let rows = &w[c * ROWS_PER_TASK * k..][..chunk.len() * k];
        arch.dispatch(Rows { w: rows, x, out: chunk });
    });
}

/// A chunk of [`matvec`] rows, dispatched to the widest SIMD level available.
struct Rows<'a> {
    w: &'a [f32],
    x: &'a [f32],
    out: &'a mut [f32],
}

impl WithSimd for Rows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let k = self.x.len();
        for (o, row) in self.out.iter_mut().zip(self.w.chunks_exact(k)) {
            *o = simd_dot(simd, row, self.x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_close, random_vec};

    #[test]
    fn dot_matches_sequential_sum_with_remainders() {
        for n in [0, 1, 15, 16, 17, 100] {
            let a = random_vec(n, 3);
            let b = random_vec(n, 4);
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - want).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn matvec_matches_naive_in_a_two_thread_pool() {
        let (rows, cols) = (77, 129);
        let w = random_vec(rows * cols, 5);
        let x = random_vec(cols, 6);
        let want: Vec<f32> =
            (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] * x[c]).sum()).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let mut out = vec![0.0; rows];
        pool.install(|| matvec(&w, &x, &mut out));
        assert_close(&out, &want, 1e-4);
    }
}
