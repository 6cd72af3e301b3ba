//! RMSNorm: `y = x / sqrt(mean(x²) + eps) · weight`, row by row.

/// Normalizes each row of `x` (rows of `weight.len()` elements) into `out`.
///
/// Lengths must agree (`x.len() == out.len()`, a multiple of `weight.len()`); callers check.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, yr) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let scale = 1.0 / (ms + eps).sqrt();
        for ((y, v), w) in yr.iter_mut().zip(xr).zip(weight) {
            *y = v * scale * w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
