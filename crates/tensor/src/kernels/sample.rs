//! Drawing a token from a whole logits row where the row is ([`Backend::sample_rows`]): a
//! sampler that weighs every token (a temperature, perhaps min-p, no top-k or top-p cut) needs
//! one number from the host per row, its uniform draw, and sends back one id, so a GPU keeps
//! its logits.
//!
//! The arithmetic is defined so that a GPU block and the CPU give the same bits: the
//! weights `e^((l - top) / T)` are computed in f64 by [`exp_det`], whose every step is an
//! IEEE operation or a fused multiply-add (no library `exp`, which differs between the two);
//! they are summed per chunk of [`DRAW_CHUNK`] columns in column order (a GPU thread's loop),
//! the chunk sums in chunk order (one thread), and the draw walks the chunk sums, then the
//! chosen chunk's weights. The host sampler draws the same way ([`draw_columns`]), so a
//! request's tokens are the same wherever its logits were.

use super::{check, Backend};
use crate::error::Result;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// Columns per chunk of a row's weight sums.
pub const DRAW_CHUNK: usize = 256;

/// The most columns a row drawn on the GPU may have (its chunk sums sit in one block's
/// shared memory: 2,048 of them).
pub const DRAW_MAX_COLUMNS: usize = 2048 * DRAW_CHUNK;

/// One row's draw: greedy (the argmax) when `temperature <= 0`, else every token weighted by
/// `e^((l - top) / temperature)`, those below `min_p` of the top's weight left out, and `u`,
/// the request's uniform number in `[0, 1)`, picking one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// 0 or below is greedy.
    pub temperature: f32,
    /// Tokens less likely than this fraction of the most likely one are left out.
    pub min_p: f32,
    /// The uniform number that picks.
    pub u: f64,
}

/// `1/k!` for `k` in `0..=13`, each the previous one divided by `k` (the same literals in the
/// CUDA kernel).
const INV_FACTORIAL: [f64; 14] = [
    1.0,
    1.0,
    0.5,
    0.16666666666666666,
    0.041666666666666664,
    0.008333333333333333,
    0.001388888888888889,
    0.0001984126984126984,
    2.48015873015873e-05,
    2.7557319223985893e-06,
    2.7557319223985894e-07,
    2.505210838544172e-08,
    2.08767569878681e-09,
    1.6059043836821616e-10,
];

/// `e^x` for `x <= 0` (0 below -708, for -inf and for NaN), by operations that give the same
/// bits on every IEEE machine: `x = n·ln 2 + r` with `n` rounded half away from zero and `r`
/// from two fused multiply-adds (ln 2 in two parts), `e^r` by its Taylor polynomial of degree
/// 13 in Horner's form (one fused multiply-add per degree; |r| <= 0.35 keeps it within a few
/// ulps), and `2^n` as the exponent bits.
pub fn exp_det(x: f64) -> f64 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    const LN2_HI: f64 = 0.6931471803691238;
    const LN2_LO: f64 = 1.9082149292705877e-10;
    if !(-708.0..=0.0).contains(&x) {
        return if x > 0.0 { f64::INFINITY } else { 0.0 };
    }
    let n = (x * LOG2E).round();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = INV_FACTORIAL[13];
    for c in INV_FACTORIAL[..13].iter().rev() {
        p = p.mul_add(r, *c);
    }
    // n is in -1022..=0 here: a normal power of two.
    p * f64::from_bits(((n as i64 + 1023) as u64) << 52)
}

/// The draw's weight of logit `l`: `exp_det((l - top) / t)`, or 0 below `floor`.
fn weight(l: f32, top: f32, t: f64, floor: f64) -> f64 {
    let w = exp_det((f64::from(l) - f64::from(top)) / t);
    if w >= floor {
        w
    } else {
        0.0
    }
}

/// The token `d` draws from a row's numbers: `(logit, column)` pairs in column order, NaN
/// left out (see the module docs); token 0 for a row without numbers. Greedy picks the
/// largest logit, the lowest column among equal ones (-0 and +0 equal).
///
/// Where rounding leaves the draw past the last weight, the last column with a weight takes
/// it (else the first number's).
pub fn draw_columns(pairs: &[(f32, u32)], d: &Draw) -> u32 {
    let Some(first) = pairs.first() else { return 0 };
    let mut best = *first;
    for &p in &pairs[1..] {
        if p.0 > best.0 {
            best = p;
        }
    }
    if d.temperature <= 0.0 {
        return best.1;
    }
    let (top, t, floor) = (best.0, f64::from(d.temperature), f64::from(d.min_p));
    let chunk_of = |p: &(f32, u32)| p.1 as usize / DRAW_CHUNK;
    // Per chunk with numbers: its range in `pairs` and its sum, in column order.
    let mut chunks: Vec<(usize, usize, f64)> = Vec::new();
    let mut last = None;
    for (i, p) in pairs.iter().enumerate() {
        let w = weight(p.0, top, t, floor);
        if w > 0.0 {
            last = Some(p.1);
        }
        match chunks.last_mut() {
            Some((start, end, s)) if chunk_of(&pairs[*start]) == chunk_of(p) => {
                *end = i + 1;
                *s += w;
            }
            _ => chunks.push((i, i + 1, 0.0 + w)),
        }
    }
    let total = chunks.iter().fold(0.0, |acc, c| acc + c.2);
    let fallback = last.unwrap_or(first.1);
    let mut u = d.u * total;
    for &(start, end, s) in &chunks {
        if u < s {
            for p in &pairs[start..end] {
                let w = weight(p.0, top, t, floor);
                if u < w {
                    return p.1;
                }
                u -= w;
            }
            return fallback;
        }
        u -= s;
    }
    fallback
}

impl Backend {
    /// One token per row of `x` by `draws` (one per row; see [`Draw`]), drawn where the row
    /// is, each the token [`draw_columns`] draws from the row: only the ids move.
    ///
    /// # Errors
    /// Another number of draws than rows, rows over [`DRAW_MAX_COLUMNS`] on the GPU; the CUDA
    /// kernel failed, or the CPU backend could not copy a device tensor to the host.
    pub fn sample_rows(&self, x: &Tensor, draws: &[Draw]) -> Result<Vec<u32>> {
        check("sample_rows", draws.len() == x.rows(), || {
            format!("{} draws for {} rows", draws.len(), x.rows())
        })?;
        match self {
            Backend::Cpu(cpu) => {
                x.host()?;
                Ok(cpu.install(|| {
                    draws
                        .par_iter()
                        .enumerate()
                        .map(|(r, d)| {
                            let pairs: Vec<(f32, u32)> = x
                                .row(r)
                                .iter()
                                .enumerate()
                                .filter(|(_, l)| !l.is_nan())
                                .map(|(i, &l)| (l, i as u32))
                                .collect();
                            draw_columns(&pairs, d)
                        })
                        .collect()
                }))
            }
            Backend::Cuda(cuda) => {
                check("sample_rows", x.row_len() <= DRAW_MAX_COLUMNS, || {
                    format!("rows of {} columns; at most {DRAW_MAX_COLUMNS}", x.row_len())
                })?;
                cuda.sample_rows(x, draws)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_det_is_within_a_few_ulps_of_exp() {
        for i in 0..=70_000 {
            let x = -(i as f64) * 0.01013;
            let (got, want) = (exp_det(x), x.exp());
            if x < -708.0 {
                assert_eq!(got, 0.0, "{x}");
                continue;
            }
            assert!((got - want).abs() <= 4.0 * f64::EPSILON * want, "{x}: {got} vs {want}");
        }
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-0.0), 1.0);
        assert_eq!(exp_det(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp_det(f64::NAN), 0.0);
    }

    /// The plain definition: every column's weight, summed in column order by chunk, then
    /// the walk.
    fn reference(row: &[f32], d: &Draw) -> u32 {
        let nums: Vec<usize> = (0..row.len()).filter(|&i| !row[i].is_nan()).collect();
        let Some(&first) = nums.first() else { return 0 };
        let mut best = first;
        for &i in &nums {
            if row[i] > row[best] {
                best = i;
            }
        }
        if d.temperature <= 0.0 {
            return best as u32;
        }
        let top = row[best];
        let (t, floor) = (f64::from(d.temperature), f64::from(d.min_p));
        let w: Vec<f64> =
            row.iter().map(|&l| if l.is_nan() { 0.0 } else { weight(l, top, t, floor) }).collect();
        let sums: Vec<f64> =
            w.chunks(DRAW_CHUNK).map(|c| c.iter().fold(0.0, |a, &x| a + x)).collect();
        let total = sums.iter().fold(0.0, |a, &x| a + x);
        let fallback = w.iter().rposition(|&x| x > 0.0).unwrap_or(first) as u32;
        let mut u = d.u * total;
        for (c, &s) in sums.iter().enumerate() {
            if u < s {
                for (i, &x) in w.iter().enumerate().skip(c * DRAW_CHUNK).take(DRAW_CHUNK) {
                    if u < x {
                        return i as u32;
                    }
                    u -= x;
                }
                return fallback;
            }
            u -= s;
        }
        fallback
    }

    #[test]
    fn rows_draw_what_the_plain_definition_draws_and_follow_the_weights() {
        let be = Backend::cpu(2).unwrap();
        let cols = 1000;
        let mut state = 5u64;
        let mut next = move || {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut rows = Vec::new();
        let mut draws = Vec::new();
        for r in 0..60 {
            let row: Vec<f32> = (0..cols)
                .map(|_| match (r % 3, (next() * 10.0) as u32) {
                    (0, 0) => f32::NAN,
                    (0, 1) => f32::NEG_INFINITY,
                    _ => ((next() * 8.0) as f32).floor() - 4.0,
                })
                .collect();
            rows.extend_from_slice(&row);
            let temperature = [0.0, 0.3, 1.0, 2.5][r % 4];
            draws.push(Draw { temperature, min_p: [0.0, 0.1][r % 2], u: next() });
        }
        // A row of NaN only, and a row with one number.
        rows.extend(vec![f32::NAN; cols]);
        draws.push(Draw { temperature: 1.0, min_p: 0.0, u: 0.5 });
        let mut one = vec![f32::NAN; cols];
        one[777] = -3.0;
        rows.extend(one);
        draws.push(Draw { temperature: 0.7, min_p: 0.0, u: 0.999 });
        let n = draws.len();
        let x = Tensor::from_vec(&[n, cols], rows).unwrap();
        let got = be.sample_rows(&x, &draws).unwrap();
        for (r, d) in draws.iter().enumerate() {
            assert_eq!(got[r], reference(x.row(r), d), "row {r}");
        }
        assert_eq!(got[n - 2], 0);
        assert_eq!(got[n - 1], 777);
        let err = be.sample_rows(&x, &draws[1..]).unwrap_err().to_string();
        assert!(err.contains("61 draws for 62 rows"), "{err}");
        // The draws follow the weights: over 20,000 draws of one row of three levels, each
        // token's share is within 5 standard deviations of its probability.
        let row = [0.0f32, 1.0, f32::NAN, -1.0, 1.0];
        let pairs: Vec<(f32, u32)> =
            [(0.0, 0), (1.0, 1), (-1.0, 3), (1.0, 4)].into_iter().collect();
        let d = |u| Draw { temperature: 1.5, min_p: 0.0, u };
        let mut counts = [0usize; 5];
        let trials = 20_000;
        for _ in 0..trials {
            counts[draw_columns(&pairs, &d(next())) as usize] += 1;
        }
        let w: Vec<f64> = row
            .iter()
            .map(|&l| if l.is_nan() { 0.0 } else { ((f64::from(l) - 1.0) / 1.5).exp() })
            .collect();
        let total: f64 = w.iter().sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = w[i] / total;
            let sd = (trials as f64 * p * (1.0 - p)).sqrt();
            let off = (c as f64 - trials as f64 * p).abs();
            assert!(off <= 5.0 * sd + 1e-9, "token {i}: {c} of {trials}, p {p}");
        }
    }
}
