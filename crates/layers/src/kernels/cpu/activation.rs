//! Element-wise kernels: SiLU-gated product, residual add, argmax.

/// `gate[i] = silu(gate[i]) · up[i]`, the Llama MLP's activation, in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x[i] += y[i]`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every row of `x` (`x.len()` a multiple of `bias.len()`).
pub fn add_rows(x: &mut [f32], bias: &[f32]) {
    if bias.is_empty() {
        return;
    }
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// Index of the largest element (the first on ties; NaN never wins); `None` when empty.
pub fn argmax(x: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        let better = match best {
            Some((_, b)) => v > b,
            None => !v.is_nan(),
        };
        if better {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_matches_formula() {
        let mut g = [0.0, 1.0, -2.0];
        silu_mul(&mut g, &[2.0, 3.0, 1.0]);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 3.0 * silu(1.0)).abs() < 1e-6);
        assert!((g[2] - silu(-2.0)).abs() < 1e-6);
    }

    #[test]
    fn argmax_takes_first_max_and_skips_nan() {
        assert_eq!(argmax(&[]), None);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[f32::NAN, -1.0, -2.0]), Some(1));
        let mut x = [1.0, 2.0];
        add_assign(&mut x, &[0.5, -2.0]);
        assert_eq!(x, [1.5, 0.0]);
    }
}
