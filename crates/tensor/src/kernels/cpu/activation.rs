//! Element-wise kernels: SiLU- and GELU-gated products, scaling, residual add, argmax.

/// `gate[i] = silu(gate[i]) · up[i]`, the Llama MLP's activation, in place.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `√(2/π)` and the cubic coefficient of GELU's tanh approximation.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044_715;

/// GELU in its tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// `gate[i] = gelu_tanh(gate[i]) · up[i]`, Gemma's MLP activation, in place.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// `x[i] *= s`.
pub fn scale(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
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
    fn gelu_tanh_matches_the_erf_gelu_closely_and_gates() {
        // The exact GELU x·Φ(x) at a few points (Φ from erf, computed elsewhere).
        for (x, exact) in
            [(-3.0f32, -0.004_049_7), (-1.0, -0.158_655_3), (0.5, 0.345_731_1), (2.0, 1.954_5)]
        {
            assert!((gelu_tanh(x) - exact).abs() < 2e-3, "{x}: {} vs {exact}", gelu_tanh(x));
        }
        assert_eq!(gelu_tanh(0.0), 0.0);
        let mut g = [1.0, -2.0];
        gelu_tanh_mul(&mut g, &[3.0, 0.5]);
        assert_eq!(g, [gelu_tanh(1.0) * 3.0, gelu_tanh(-2.0) * 0.5]);
        let mut x = [1.0, -2.5];
        scale(&mut x, 4.0);
        assert_eq!(x, [4.0, -10.0]);
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
