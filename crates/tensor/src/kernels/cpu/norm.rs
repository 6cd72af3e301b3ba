//! RMSNorm: `y = x / sqrt(mean(x²) + eps) · weight`, row by row, alone or after a residual add.
//! The rows of a batch go to the current rayon pool's threads (each row's arithmetic is the
//! same on any thread): one thread normalizing a 32-row decode step left the other idle.

use super::activation::add_assign;
use rayon::prelude::*;

/// Rows per parallel task (a task of SmolLM2's 576 columns is a few microseconds; fewer rows
/// stay on the calling thread).
const ROWS_PER_TASK: usize = 4;

/// Normalizes each row of `x` (rows of `weight.len()` elements) into `out`.
///
/// Lengths must agree (`x.len() == out.len()`, a multiple of `weight.len()`); callers check.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    if d == 0 {
        return;
    }
    x.par_chunks_exact(d)
        .zip(out.par_chunks_exact_mut(d))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(xr, yr)| rms_norm_row(xr, weight, eps, yr));
}

/// `x += y`, then RMSNorm of each row of the sum into `out`: one pass over each row while it
/// is in cache, with the same arithmetic in the same order as [`add_assign`] over all of `x`
/// followed by [`rms_norm`], so the bits are the same.
///
/// Lengths must agree (`x`, `y` and `out` of one length, a multiple of `weight.len()`);
/// callers check.
pub fn add_rms_norm(x: &mut [f32], y: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    if d == 0 {
        return;
    }
    let rows =
        x.par_chunks_exact_mut(d).zip(y.par_chunks_exact(d)).zip(out.par_chunks_exact_mut(d));
    rows.with_min_len(ROWS_PER_TASK).for_each(|((xr, yr), or)| {
        add_assign(xr, yr);
        rms_norm_row(xr, weight, eps, or);
    });
}

/// One row of [`rms_norm`].
fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / weight.len() as f32;
    let scale = 1.0 / (ms + eps).sqrt();
    for ((y, v), w) in out.iter_mut().zip(x).zip(weight) {
        *y = v * scale * w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    #[test]
    fn matches_hand_computed_values() {
        // Row [3, 4]: mean square 12.5, so y = x / sqrt(12.5 + eps) * w.
        let x = [3.0, 4.0, 0.0, 0.0];
        let w = [1.0, 2.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        let s = 12.5f32.sqrt();
        assert!((out[0] - 3.0 / s).abs() < 1e-6 && (out[1] - 8.0 / s).abs() < 1e-6);
        // An all-zero row stays zero thanks to eps, with no NaN.
        let mut out2 = [1.0; 4];
        rms_norm(&x, &w, 1e-5, &mut out2);
        assert_eq!(&out2[2..], &[0.0, 0.0]);
    }

    #[test]
    fn the_fused_add_is_the_add_then_the_norm_bit_for_bit() {
        for (rows, d) in [(1, 1), (3, 64), (2, 1000), (5, 7), (13, 64)] {
            let (x, y, w) = (random_vec(rows * d, 1), random_vec(rows * d, 2), random_vec(d, 3));
            let (mut apart, mut fused) = (x.clone(), x);
            add_assign(&mut apart, &y);
            let mut want = vec![0.0; rows * d];
            rms_norm(&apart, &w, 1e-6, &mut want);
            let mut got = vec![0.0; rows * d];
            add_rms_norm(&mut fused, &y, &w, 1e-6, &mut got);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused), bits(&apart), "{rows}x{d}: the sum");
            assert_eq!(bits(&got), bits(&want), "{rows}x{d}: the norm");
        }
    }
}
