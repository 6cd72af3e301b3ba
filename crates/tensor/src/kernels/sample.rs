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
/// `e^((l - top) / temperature)`, those below `min_p` of the top's weight left out, the most
/// likely holding `top_p` of the weight kept, and `u`, the request's uniform number in
/// `[0, 1)`, picking one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// 0 or below is greedy.
    pub temperature: f32,
    /// Tokens less likely than this fraction of the most likely one are left out.
    pub min_p: f32,
    /// The uniform number that picks.
    pub u: f64,
    /// Keeps the most likely tokens that hold this share of the weight (1 keeps all; see
    /// [`draw_columns`]).
    pub top_p: f32,
}

/// `1/k!` for `k` in `0..=13`, each the previous one divided by `k` (the same literals in the
/// CUDA kernel).
pub(super) const INV_FACTORIAL: [f64; 14] = [
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

/// ln 2 in two parts for [`exp_det`]'s reduction: the high one with few enough bits that its
/// product with `n` is exact.
pub(super) const LN2_HI: f64 = 0.6931471803691238;
pub(super) const LN2_LO: f64 = 1.9082149292705877e-10;

/// `e^x` for `x <= 0` (0 below -708, for -inf and for NaN), by operations that give the same
/// bits on every IEEE machine: `x = n·ln 2 + r` with `n` rounded half away from zero and `r`
/// from two fused multiply-adds (ln 2 in two parts), `e^r` by its Taylor polynomial of degree
/// 13 in Horner's form (one fused multiply-add per degree; |r| <= 0.35 keeps it within a few
/// ulps), and `2^n` as the exponent bits.
#[inline(always)]
pub fn exp_det(x: f64) -> f64 {
    if !(-708.0..=0.0).contains(&x) {
        return if x > 0.0 { f64::INFINITY } else { 0.0 };
    }
    let n = (x * std::f64::consts::LOG2_E).round();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p = INV_FACTORIAL[13];
    for c in INV_FACTORIAL[..13].iter().rev() {
        p = p.mul_add(r, *c);
    }
    // n is in -1022..=0 here: a normal power of two.
    p * f64::from_bits(((n as i64 + 1023) as u64) << 52)
}

/// The draw's weight of logit `l`: `exp_det((l - top) / t)`, or 0 below `floor`.
#[inline(always)]
pub(super) fn weight(l: f32, top: f32, t: f64, floor: f64) -> f64 {
    let w = exp_det((f64::from(l) - f64::from(top)) / t);
    if w >= floor {
        w
    } else {
        0.0
    }
}

/// A logit's order as an unsigned key: a larger logit has a larger key, -0 and +0 the same
/// one (the CUDA kernels' `order_key`). For numbers, not NaN.
pub(super) fn order_key(l: f32) -> u32 {
    let u = if l == 0.0 { 0 } else { l.to_bits() };
    if u & 0x8000_0000 != 0 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// A column that weighs in a draw: its column, its logit's order key and its weight (above 0).
#[derive(Clone, Copy)]
pub(super) struct Weighed {
    column: u32,
    key: u32,
    weight: f64,
}

/// The pairs' columns with a weight above 0, in column order. A column of weight 0 adds 0 to
/// every sum of the draw and is never picked, so leaving it out changes nothing.
pub(super) fn weighed(pairs: &[(f32, u32)], top: f32, t: f64, floor: f64) -> Vec<Weighed> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("sse4.1") {
        // SAFETY: the CPU has the features the function is compiled for.
        #[allow(unsafe_code)]
        return unsafe { weighed_fma(pairs, top, t, floor) };
    }
    weighed_plain(pairs, top, t, floor)
}

/// [`weighed`], in a plain loop so that all of it is compiled into [`weighed_fma`].
#[inline(always)]
fn weighed_plain(pairs: &[(f32, u32)], top: f32, t: f64, floor: f64) -> Vec<Weighed> {
    let mut out = Vec::with_capacity(pairs.len());
    for &(l, column) in pairs {
        let weight = weight(l, top, t, floor);
        if weight > 0.0 {
            out.push(Weighed { column, key: order_key(l), weight });
        }
    }
    out
}

/// [`weighed_plain`] with the CPU's fused multiply-add and rounding instructions: the same
/// bits as the library's `fma` and `round`, which `mul_add` and `round` call without them,
/// about four times slower.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,sse4.1")]
fn weighed_fma(pairs: &[(f32, u32)], top: f32, t: f64, floor: f64) -> Vec<Weighed> {
    weighed_plain(pairs, top, t, floor)
}

/// The sum of the weights of `live` whose key is at least `floor_key`, summed as the kernels
/// sum a row: per chunk of [`DRAW_CHUNK`] columns in column order, then the chunk sums in
/// chunk order (the columns left out add 0 to both).
pub(super) fn chunked_sum(live: &[Weighed], floor_key: u32) -> f64 {
    let mut total = 0.0;
    let mut chunk = None;
    let mut sum = 0.0;
    for w in live {
        let c = w.column as usize / DRAW_CHUNK;
        if chunk != Some(c) {
            if chunk.is_some() {
                total += sum;
            }
            chunk = Some(c);
            sum = 0.0;
        }
        sum += if w.key >= floor_key { w.weight } else { 0.0 };
    }
    if chunk.is_some() {
        total += sum;
    }
    total
}

/// The token `d` draws from a row's numbers: `(logit, column)` pairs in column order, NaN
/// left out (see the module docs); token 0 for a row without numbers. Greedy picks the
/// largest logit, the lowest column among equal ones (-0 and +0 equal).
///
/// Top-p keeps the tokens whose logit is at least the largest logit `θ` at which the weight
/// of the tokens at or above it reaches `top_p` of the total (ties at `θ` all kept); `θ` is
/// found bit by bit over the logits' order keys, each weight summed as [`chunked_sum`] sums,
/// so the GPU finds the same one. The draw walks the kept weights' chunk sums, then the chosen
/// chunk. Where rounding leaves the draw past the last kept weight, the last kept column with
/// a weight takes it (else the first number's).
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
    // The same token from the weights laid out for SIMD, where the columns are dense enough.
    if let Some(token) = super::draw_grid::draw(pairs, d, best.0) {
        return token;
    }
    draw_listed(pairs, d, best.0)
}

/// [`draw_columns`] past the greedy pick, over the numbers with a weight in a list: the
/// definition as the module docs say it, for columns too sparse for
/// [`super::draw_grid`]'s grid (and the reference its tests check against).
pub(super) fn draw_listed(pairs: &[(f32, u32)], d: &Draw, top: f32) -> u32 {
    let Some(first) = pairs.first() else { return 0 };
    let (t, floor) = (f64::from(d.temperature), f64::from(d.min_p));
    let mut live = weighed(pairs, top, t, floor);
    if d.top_p < 1.0 {
        let target = chunked_sum(&live, 0) * f64::from(d.top_p);
        // The smallest key kept, bit by bit. A column below the keys tried from then on adds
        // 0 to every later sum: it leaves `live`.
        let mut kept = 0u32;
        for bit in (0..32).rev() {
            let trial = kept | (1 << bit);
            if chunked_sum(&live, trial) >= target {
                kept = trial;
                live.retain(|w| w.key >= kept);
            }
        }
    }
    let fallback = live.last().map_or(first.1, |w| w.column);
    // Per chunk its run in `live` and its sum, as `chunked_sum` sums them; then the walk.
    let same_chunk =
        |a: &Weighed, b: &Weighed| a.column as usize / DRAW_CHUNK == b.column as usize / DRAW_CHUNK;
    let runs: Vec<(&[Weighed], f64)> = live
        .chunk_by(same_chunk)
        .map(|run| (run, run.iter().fold(0.0, |acc, w| acc + w.weight)))
        .collect();
    let mut u = d.u * runs.iter().fold(0.0, |acc, r| acc + r.1);
    for (run, s) in runs {
        if u < s {
            for w in run {
                if u < w.weight {
                    return w.column;
                }
                u -= w.weight;
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
                        .map(|(r, d)| super::draw_grid::draw_row(x.row(r), d))
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

    /// The weights with the CPU's instructions are the library's, bit for bit.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn weights_with_the_fma_instruction_are_the_library_fmas() {
        if !(std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("sse4.1")) {
            return;
        }
        let pairs: Vec<(f32, u32)> =
            (0..20_000).map(|i| (((i * 7919) % 20_011) as f32 * -0.013 + 3.0, i)).collect();
        for t in [0.1, 0.7, 1.0, 3.3] {
            let plain = weighed_plain(&pairs, 3.0, t, 1e-12);
            #[allow(unsafe_code)]
            // SAFETY: the CPU has the features (checked above).
            let fast = unsafe { weighed_fma(&pairs, 3.0, t, 1e-12) };
            assert_eq!(plain.len(), fast.len());
            for (a, b) in plain.iter().zip(&fast) {
                assert_eq!((a.column, a.weight.to_bits()), (b.column, b.weight.to_bits()), "{t}");
            }
        }
    }

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

    /// The plain definition over the whole row: every column's weight (0 for NaN), the
    /// top-p key by bits, each sum per chunk in column order, then the walk.
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
        let key = |i: usize| if row[i].is_nan() { 0 } else { order_key(row[i]) };
        let mass = |at_least: u32| {
            let sums = w.chunks(DRAW_CHUNK).enumerate().map(|(c, ch)| {
                ch.iter().enumerate().fold(0.0, |a, (j, &x)| {
                    a + if key(c * DRAW_CHUNK + j) >= at_least { x } else { 0.0 }
                })
            });
            sums.fold(0.0, |a, x| a + x)
        };
        let mut kept = 0u32;
        if d.top_p < 1.0 {
            let target = mass(0) * f64::from(d.top_p);
            for bit in (0..32).rev() {
                if mass(kept | (1 << bit)) >= target {
                    kept |= 1 << bit;
                }
            }
        }
        let w: Vec<f64> =
            w.iter().enumerate().map(|(i, &x)| if key(i) >= kept { x } else { 0.0 }).collect();
        let sums: Vec<f64> =
            w.chunks(DRAW_CHUNK).map(|c| c.iter().fold(0.0, |a, &x| a + x)).collect();
        let total = sums.iter().fold(0.0, |a, &x| a + x);
        let fallback = w.iter().rposition(|&x| x > 0.0).unwrap_or(first) as u32;
        let mut u = d.u * total;
        for (c, &s) in sums.iter().enumerate() {
            if u < s {
                for (i, &x) in w.iter().enumerate().skip(c * DRAW_CHUNK).take(DRAW_CHUNK) {
                    if row[i].is_nan() {
                        continue;
                    }
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

    /// Top-p keeps the most likely tokens holding at least `top_p` of the weight, ties at the
    /// edge all kept: a row of weights 4, 2, 2, 1 (as logits of the log of those) keeps the
    /// first with `top_p` up to 4/9, the first three up to 8/9.
    #[test]
    fn top_p_keeps_the_likeliest_tokens_that_hold_its_share() {
        let row = [4f32.ln(), 2f32.ln(), 2f32.ln(), 0.0];
        let pairs: Vec<(f32, u32)> = row.iter().enumerate().map(|(i, &l)| (l, i as u32)).collect();
        let kept = |top_p: f32| {
            let mut seen = std::collections::BTreeSet::new();
            for i in 0..400 {
                let d = Draw { temperature: 1.0, min_p: 0.0, u: (i as f64 + 0.5) / 400.0, top_p };
                seen.insert(draw_columns(&pairs, &d));
            }
            seen.into_iter().collect::<Vec<_>>()
        };
        assert_eq!(kept(0.3), [0]);
        assert_eq!(kept(0.44), [0]);
        assert_eq!(kept(0.5), [0, 1, 2]);
        assert_eq!(kept(0.88), [0, 1, 2]);
        assert_eq!(kept(0.95), [0, 1, 2, 3]);
        assert_eq!(kept(1.0), [0, 1, 2, 3]);
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
            draws.push(Draw {
                temperature,
                min_p: [0.0, 0.1][r % 2],
                u: next(),
                top_p: [1.0, 0.9, 0.5, 0.05, 1.0][r % 5],
            });
        }
        // A row of NaN only, and a row with one number.
        rows.extend(vec![f32::NAN; cols]);
        draws.push(Draw { temperature: 1.0, min_p: 0.0, u: 0.5, top_p: 0.9 });
        let mut one = vec![f32::NAN; cols];
        one[777] = -3.0;
        rows.extend(one);
        draws.push(Draw { temperature: 0.7, min_p: 0.0, u: 0.999, top_p: 0.5 });
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
        let d = |u| Draw { temperature: 1.5, min_p: 0.0, u, top_p: 1.0 };
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
