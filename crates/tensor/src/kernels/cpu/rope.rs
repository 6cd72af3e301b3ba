//! Rotary position embedding, "rotate-half" (Hugging Face / NeoX) convention.
//!
//! Within each head, element `i` is paired with element `i + rot_dim/2` for `i < rot_dim/2`
//! and the pair is rotated by `pos · theta^(-2i/rot_dim)`; elements at `rot_dim..head_dim`
//! pass through. GGUF llama checkpoints store the Q/K projection rows permuted for the
//! interleaved (adjacent-pair) convention instead; the GGUF loader undoes that permutation,
//! so every weight in memory is in the HF layout.

/// Rotates `x` laid out as `[tokens, heads, head_dim]` in place; `positions[t]` is the absolute
/// position of token `t`.
///
/// Lengths must agree (`x.len() == positions.len() * heads * head_dim`, `rot_dim` even and at
/// most `head_dim`); callers check.
#[cfg(test)]
pub fn rope(
    x: &mut [f32],
    positions: &[usize],
    heads: usize,
    head_dim: usize,
    rot_dim: usize,
    theta: f32,
) {
    rope_scaled(x, positions, (heads, head_dim, rot_dim), theta, None, 1.0);
}

/// [`rope`] with the angle of pair `i` divided by `factors[i]` (`rot_dim / 2` of them): the
/// frequency factors of Llama 3's rope scaling (GGUF's `rope_freqs.weight`), or one factor
/// everywhere for linear scaling, or the long or short factors of Phi-3's longrope. The cosines
/// and sines are multiplied by `attn_factor` (longrope's attention factor: it scales the
/// rotated elements, not those passed through). `None` and 1 are [`rope`].
pub fn rope_scaled(
    x: &mut [f32],
    positions: &[usize],
    (heads, head_dim, rot_dim): (usize, usize, usize),
    theta: f32,
    factors: Option<&[f32]>,
    attn_factor: f32,
) {
    let half = rot_dim / 2;
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| {
            let f = (theta as f64).powf(-((2 * i) as f64) / rot_dim as f64);
            factors.map_or(f, |s| f / f64::from(s[i]))
        })
        .collect();
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..half {
            // f64 angles: positions reach thousands, where f32 products lose the low bits.
            let a = pos as f64 * inv_freq[i];
            cos[i] = (a.cos() * f64::from(attn_factor)) as f32;
            sin[i] = (a.sin() * f64::from(attn_factor)) as f32;
        }
        for h in 0..heads {
            let base = (t * heads + h) * head_dim;
            let v = &mut x[base..base + rot_dim];
            let (lo, hi) = v.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * cos[i] - b * sin[i];
                hi[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norms() {
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.5).collect();
        let mut x = orig.clone();
        rope(&mut x, &[0, 0], 1, 8, 8, 10000.0);
        assert_eq!(x, orig);
        let mut y = orig.clone();
        rope(&mut y, &[5, 1000], 2, 4, 4, 10000.0);
        for h in 0..4 {
            let n0: f32 =
                (0..2).map(|i| orig[h * 4 + i].powi(2) + orig[h * 4 + i + 2].powi(2)).sum();
            let n1: f32 = (0..2).map(|i| y[h * 4 + i].powi(2) + y[h * 4 + i + 2].powi(2)).sum();
            assert!((n0 - n1).abs() < 1e-5);
        }
    }

    #[test]
    fn first_pair_rotates_by_the_position_in_radians() {
        // Pair (x0, x2) has frequency theta^0 = 1: angle = pos. Pair (x1, x3): theta^(-1/2).
        let mut x = vec![1.0, 1.0, 0.0, 0.0];
        rope(&mut x, &[3], 1, 4, 4, 100.0);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[2] - 3f32.sin()).abs() < 1e-6);
        assert!((x[1] - 0.3f32.cos()).abs() < 1e-6 && (x[3] - 0.3f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn partial_rotary_leaves_the_tail_alone() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope(&mut x, &[7], 1, 6, 4, 10000.0);
        assert_eq!(&x[4..], &[5.0, 6.0]);
    }

    /// Linear scaling by 2 at position 2p is the plain rotation at position p, bit for bit,
    /// and a factor divides only its own pair's angle.
    #[test]
    fn frequency_factors_divide_each_pairs_angle() {
        let orig: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut scaled, mut plain) = (orig.clone(), orig.clone());
        rope_scaled(&mut scaled, &[14, 400], (2, 8, 8), 10000.0, Some(&[2.0; 4]), 1.0);
        rope(&mut plain, &[7, 200], 2, 8, 8, 10000.0);
        assert_eq!(scaled, plain);
        // Only pair 1 (elements 1 and 5) slows down.
        let mut one = orig[..8].to_vec();
        rope_scaled(&mut one, &[9], (1, 8, 8), 10000.0, Some(&[1.0, 3.0, 1.0, 1.0]), 1.0);
        let mut base = orig[..8].to_vec();
        rope(&mut base, &[9], 1, 8, 8, 10000.0);
        for i in [0, 2, 3, 4, 6, 7] {
            assert_eq!(one[i], base[i], "element {i}");
        }
        let a = 9.0f64 * 10000f64.powf(-2.0 / 8.0) / 3.0;
        let (x, y) = (f64::from(orig[1]), f64::from(orig[5]));
        assert!((f64::from(one[1]) - (x * a.cos() - y * a.sin())).abs() < 1e-6);
        assert!((f64::from(one[5]) - (y * a.cos() + x * a.sin())).abs() < 1e-6);
    }

    /// The attention factor multiplies the rotated elements and leaves the rest alone.
    #[test]
    fn the_attention_factor_scales_only_the_rotated_elements() {
        let orig: Vec<f32> = (0..12).map(|i| (i as f32 * 0.53).cos()).collect();
        let (mut scaled, mut plain) = (orig.clone(), orig.clone());
        let factors = [1.5, 4.0];
        rope_scaled(&mut scaled, &[0, 300], (1, 6, 4), 10000.0, Some(&factors), 1.25);
        rope_scaled(&mut plain, &[0, 300], (1, 6, 4), 10000.0, Some(&factors), 1.0);
        for t in 0..2 {
            for e in 0..6 {
                let (s, p) = (scaled[t * 6 + e], plain[t * 6 + e]);
                let want = if e < 4 { p * 1.25 } else { p };
                assert!((s - want).abs() < 1e-6, "token {t}, element {e}: {s} vs {want}");
            }
        }
        assert_eq!(&scaled[4..6], &orig[4..6]);
    }
}
