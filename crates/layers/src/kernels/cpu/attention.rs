//! Causal softmax attention with grouped-query heads, returning the per-row log-sum-exp.
//!
//! Masking uses absolute positions, not indices: query `i` sees key `j` when
//! `kv_pos[j] <= q_pos[i]`. That one rule covers prefill over a token range, decode against a
//! cache, and (later) context parallelism, where a rank holds an arbitrary subset of the keys.
//! A row that sees no key yields zeros and a log-sum-exp of `-inf`, which is the neutral
//! element of the log-sum-exp merge of partial results.

use super::matvec::dot;
use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;

/// Head counts of one attention call. `q_heads` must be a multiple of `kv_heads`; query head
/// `h` reads key/value head `h / (q_heads / kv_heads)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

/// `out[i, h] = softmax_j(q[i,h]·k[j,g] / sqrt(d)) · v[j,g]` over visible keys, with `q` and
/// `out` laid out `[q_pos.len(), q_heads, head_dim]`, `k` and `v` `[kv_pos.len(), kv_heads,
/// head_dim]`. When `lse` is given (`[q_pos.len(), q_heads]`) it receives the natural-log
/// log-sum-exp of each row's scaled scores. Runs in the current rayon pool.
///
/// Lengths must agree; callers check.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    q_pos: &[usize],
    k: &[f32],
    v: &[f32],
    kv_pos: &[usize],
    shape: AttnShape,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let AttnShape { q_heads, kv_heads, head_dim: d } = shape;
    let group = q_heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut scratch;
    let lse = match lse {
        Some(l) => l,
        None => {
            scratch = vec![0.0f32; q_pos.len() * q_heads];
            &mut scratch[..]
        }
    };
    let arch = Arch::new();
    out.par_chunks_mut(d).zip(lse.par_iter_mut()).enumerate().for_each_init(
        Vec::new,
        |scores, (row, (o, l))| {
            let (i, h) = (row / q_heads, row % q_heads);
            let op = Row {
                q: &q[row * d..(row + 1) * d],
                q_pos: q_pos[i],
                k,
                v,
                kv_pos,
                stride: kv_heads * d,
                offset: (h / group) * d,
                scale,
                scores,
                out: o,
            };
            *l = arch.dispatch(op);
        },
    );
}

/// One query row of [`attention`], dispatched to the widest SIMD level available so the
/// plain loops below vectorize for it. Returns the row's log-sum-exp.
struct Row<'a> {
    q: &'a [f32],
    q_pos: usize,
    k: &'a [f32],
    v: &'a [f32],
    kv_pos: &'a [usize],
    /// Elements between consecutive tokens in `k`/`v`.
    stride: usize,
    /// This row's KV head within a token.
    offset: usize,
    scale: f32,
    scores: &'a mut Vec<f32>,
    out: &'a mut [f32],
}

impl WithSimd for Row<'_> {
    type Output = f32;

    #[inline(always)]
    fn with_simd<S: Simd>(self, _simd: S) -> f32 {
        let Row { q, q_pos, k, v, kv_pos, stride, offset, scale, scores, out } = self;
        let d = q.len();
        out.fill(0.0);
        // Keys after the last visible one never contribute: stop there.
        let Some(last) = kv_pos.iter().rposition(|&p| p <= q_pos) else {
            return f32::NEG_INFINITY;
        };
        scores.clear();
        scores.resize(last + 1, f32::NEG_INFINITY);
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            if kv_pos[j] <= q_pos {
                *s = dot(q, &k[j * stride + offset..][..d]) * scale;
                max = max.max(*s);
            }
        }
        let mut sum = 0.0f32;
        for (j, &s) in scores.iter().enumerate() {
            if s == f32::NEG_INFINITY {
                continue;
            }
            let e = (s - max).exp();
            sum += e;
            for (a, b) in out.iter_mut().zip(&v[j * stride + offset..][..d]) {
                *a += e * b;
            }
        }
        let inv = 1.0 / sum;
        for a in out.iter_mut() {
            *a *= inv;
        }
        max + sum.ln()
    }
}

/// Merges two partial attention results over disjoint key sets: `(out_a, lse_a)` is updated to
/// the result over the union. Rows are `[rows, head_dim]` with one log-sum-exp per row.
pub fn merge_partial(
    out_a: &mut [f32],
    lse_a: &mut [f32],
    out_b: &[f32],
    lse_b: &[f32],
    head_dim: usize,
) {
    for (r, (la, &lb)) in lse_a.iter_mut().zip(lse_b).enumerate() {
        let m = la.max(lb);
        if m == f32::NEG_INFINITY {
            continue;
        }
        let (wa, wb) = ((*la - m).exp(), (lb - m).exp());
        let total = wa + wb;
        let oa = &mut out_a[r * head_dim..(r + 1) * head_dim];
        let ob = &out_b[r * head_dim..(r + 1) * head_dim];
        for (a, b) in oa.iter_mut().zip(ob) {
            *a = (*a * wa + b * wb) / total;
        }
        *la = m + total.ln();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_close, random_vec};

    /// Straightforward reference: full score matrix, explicit mask, two-pass softmax in f64.
    fn naive(
        q: &[f32],
        qp: &[usize],
        k: &[f32],
        v: &[f32],
        kp: &[usize],
        s: AttnShape,
    ) -> (Vec<f32>, Vec<f32>) {
        let d = s.head_dim;
        let mut out = vec![0.0; qp.len() * s.q_heads * d];
        let mut lse = vec![0.0; qp.len() * s.q_heads];
        for (i, &qpos) in qp.iter().enumerate() {
            for h in 0..s.q_heads {
                let g = h * s.kv_heads / s.q_heads;
                let row = i * s.q_heads + h;
                let sc: Vec<(usize, f64)> = (0..kp.len())
                    .filter(|&j| kp[j] <= qpos)
                    .map(|j| {
                        let dotp: f64 = (0..d)
                            .map(|x| q[row * d + x] as f64 * k[(j * s.kv_heads + g) * d + x] as f64)
                            .sum();
                        (j, dotp / (d as f64).sqrt())
                    })
                    .collect();
                let m = sc.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x.1 - m).exp()).sum();
                lse[row] = (m + z.ln()) as f32;
                for &(j, sv) in &sc {
                    let p = (sv - m).exp() / z;
                    for x in 0..d {
                        out[row * d + x] += (p * v[(j * s.kv_heads + g) * d + x] as f64) as f32;
                    }
                }
            }
        }
        (out, lse)
    }

    #[test]
    fn matches_naive_gqa_prefill_with_offset_positions() {
        let s = AttnShape { q_heads: 6, kv_heads: 2, head_dim: 8 };
        let (n, t) = (5, 9);
        let q = random_vec(n * 6 * 8, 10);
        let k = random_vec(t * 2 * 8, 11);
        let v = random_vec(t * 2 * 8, 12);
        let kp: Vec<usize> = (0..t).collect();
        let qp: Vec<usize> = (4..9).collect();
        let (want, want_lse) = naive(&q, &qp, &k, &v, &kp, s);
        let mut out = vec![0.0; want.len()];
        let mut lse = vec![0.0; want_lse.len()];
        attention(&q, &qp, &k, &v, &kp, s, &mut out, Some(&mut lse));
        assert_close(&out, &want, 1e-5);
        assert_close(&lse, &want_lse, 1e-5);
    }

    #[test]
    fn rows_without_visible_keys_give_zero_and_neg_inf() {
        let s = AttnShape { q_heads: 1, kv_heads: 1, head_dim: 4 };
        let mut out = vec![1.0; 4];
        let mut lse = vec![0.0; 1];
        attention(&[1.0; 4], &[2], &[1.0; 4], &[1.0; 4], &[3], s, &mut out, Some(&mut lse));
        assert_eq!(out, vec![0.0; 4]);
        assert_eq!(lse[0], f32::NEG_INFINITY);
    }

    #[test]
    fn merging_two_key_halves_equals_attention_over_all_keys() {
        let s = AttnShape { q_heads: 4, kv_heads: 2, head_dim: 8 };
        let t = 10;
        let q = random_vec(4 * 8, 20);
        let k = random_vec(t * 16, 21);
        let v = random_vec(t * 16, 22);
        let kp: Vec<usize> = (0..t).collect();
        let mut full = vec![0.0; 32];
        let mut full_lse = vec![0.0; 4];
        attention(&q, &[9], &k, &v, &kp, s, &mut full, Some(&mut full_lse));
        let split = 6 * 16;
        let (mut a, mut la, mut b, mut lb) =
            (vec![0.0; 32], vec![0.0; 4], vec![0.0; 32], vec![0.0; 4]);
        attention(&q, &[9], &k[..split], &v[..split], &kp[..6], s, &mut a, Some(&mut la));
        attention(&q, &[9], &k[split..], &v[split..], &kp[6..], s, &mut b, Some(&mut lb));
        merge_partial(&mut a, &mut la, &b, &lb, 8);
        assert_close(&a, &full, 1e-5);
        assert_close(&la, &full_lse, 1e-5);
    }
}
