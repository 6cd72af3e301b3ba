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
    fn with_simd<S: Simd>(self, _simd: S) {
        let k = self.x.len();
        for (o, row) in self.out.iter_mut().zip(self.w.chunks_exact(k)) {
            *o = dot(row, self.x);
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
