//! Causal softmax attention with grouped-query heads, returning the per-row log-sum-exp.
//!
//! Masking uses absolute positions, not indices: query `i` sees key `j` when
//! `kv_pos[j] <= q_pos[i]`. That one rule covers prefill over a token range, decode against a
//! cache, and (later) context parallelism, where a rank holds an arbitrary subset of the keys.
//! A row that sees no key yields zeros and a log-sum-exp of `-inf`, which is the neutral
//! element of the log-sum-exp merge of partial results. A sliding window (Gemma 2) narrows the
//! rule to `q_pos[i] - window < kv_pos[j] <= q_pos[i]`, still by positions, so a CP rank's
//! subset of the keys is masked alike; soft-capping (Gemma 2) maps each scaled score `s` to
//! `cap · tanh(s / cap)` before the softmax.

use super::decode_attention;
use super::matmul::{gemm_strided, MatRef};
use rayon::prelude::*;

/// Head counts and score rules of one attention call. `q_heads` must be a multiple of
/// `kv_heads`; query head `h` reads key/value head `h / (q_heads / kv_heads)`. The rules
/// default to plain causal attention scaled by `1 / sqrt(head_dim)`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnShape {
    /// Query heads.
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// The factor on `q·k` when not `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// Scaled scores become `cap · tanh(score / cap)` (Gemma 2's attention soft-capping).
    pub softcap: Option<f32>,
    /// A query at `p` sees keys at `p - window + 1 ..= p` only (sliding-window attention).
    pub window: Option<usize>,
}

impl AttnShape {
    /// Plain causal attention over these heads.
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        AttnShape { q_heads, kv_heads, head_dim, ..Default::default() }
    }

    /// Whether soft-capping or a window change the plain causal rule (the CPU and CUDA
    /// kernels both apply them).
    pub fn has_rules(&self) -> bool {
        self.softcap.is_some() || self.window.is_some()
    }

    /// The factor on `q·k`.
    pub(crate) fn factor(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// The oldest position a query at `q_pos` sees (0 without a window).
    #[inline(always)]
    pub(super) fn first_visible(&self, q_pos: usize) -> usize {
        self.window.map_or(0, |w| (q_pos + 1).saturating_sub(w))
    }
}

/// Soft-caps a scaled score (see [`AttnShape::softcap`]).
#[inline(always)]
pub(super) fn capped(score: f32, cap: Option<f32>) -> f32 {
    match cap {
        Some(c) => c * (score / c).tanh(),
        None => score,
    }
}

/// Keys and values in blocks of a power-of-two number of tokens (a paged KV cache): token `j`
/// is row `j % block_size` of block `j / block_size`, each block laid out `[block_size,
/// kv_heads, head_dim]` (the last one may be partly filled). Contiguous keys and values are
/// one block.
#[derive(Clone, Copy, Debug)]
pub struct KvBlocks<'a> {
    k: &'a [&'a [f32]],
    v: &'a [&'a [f32]],
    shift: u32,
}

impl<'a> KvBlocks<'a> {
    /// Blocks of `block_size` tokens; `None` unless `block_size` is a power of two and `k`
    /// and `v` have as many blocks.
    pub fn new(k: &'a [&'a [f32]], v: &'a [&'a [f32]], block_size: usize) -> Option<Self> {
        (block_size.is_power_of_two() && k.len() == v.len()).then(|| KvBlocks {
            k,
            v,
            shift: block_size.trailing_zeros(),
        })
    }

    /// One block holding every token.
    pub fn contiguous(k: &'a [&'a [f32]; 1], v: &'a [&'a [f32]; 1]) -> Self {
        KvBlocks { k, v, shift: usize::BITS - 1 }
    }

    /// Tokens per block (for a contiguous view, more than any length).
    pub fn block_size(&self) -> usize {
        1 << self.shift
    }

    /// The blocks of keys and of values.
    pub fn blocks(&self) -> (&'a [&'a [f32]], &'a [&'a [f32]]) {
        (self.k, self.v)
    }

    /// Whether the blocks hold `tokens` rows of `row` values: every block before the last
    /// of them full, the last holding the rest.
    pub fn holds(&self, tokens: usize, row: usize) -> bool {
        let mut left = tokens;
        for (kb, vb) in self.k.iter().zip(self.v) {
            if left == 0 {
                break;
            }
            let n = left.min(self.block_size());
            if kb.len() < n * row || vb.len() < n * row {
                return false;
            }
            left -= n;
        }
        left == 0
    }

    /// Block and element offset of token `j`'s row.
    #[inline(always)]
    fn at(&self, j: usize, stride: usize) -> (usize, usize) {
        (j >> self.shift, (j & ((1usize << self.shift) - 1)) * stride)
    }

    /// Token `j`'s key of `d` values at `offset` in its row of `stride` values.
    #[inline(always)]
    pub(super) fn key(&self, j: usize, stride: usize, offset: usize, d: usize) -> &'a [f32] {
        let (b, at) = self.at(j, stride);
        &self.k[b][at + offset..][..d]
    }

    /// Token `j`'s value, as [`KvBlocks::key`].
    #[inline(always)]
    pub(super) fn value(&self, j: usize, stride: usize, offset: usize, d: usize) -> &'a [f32] {
        let (b, at) = self.at(j, stride);
        &self.v[b][at + offset..][..d]
    }

    /// The first `tokens` rows of `row` values of keys and of values, copied into two
    /// contiguous buffers.
    pub fn gather(&self, tokens: usize, row: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut k, mut v) = (Vec::with_capacity(tokens * row), Vec::with_capacity(tokens * row));
        let mut left = tokens;
        for (kb, vb) in self.k.iter().zip(self.v) {
            let n = left.min(self.block_size());
            k.extend_from_slice(&kb[..n * row]);
            v.extend_from_slice(&vb[..n * row]);
            left -= n;
            if left == 0 {
                break;
            }
        }
        (k, v)
    }
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
    let (k, v) = ([k], [v]);
    attention_blocks(q, q_pos, KvBlocks::contiguous(&k, &v), kv_pos, shape, out, lse);
}

/// [`attention`] over keys and values in blocks (a paged KV cache): the same results, bit for
/// bit, as over the same rows laid out contiguously. A few query tokens (decode) read the
/// blocks in place, each token's keys in chunks that are tasks of their own
/// (`decode_attention`); many queries (prefill) work on a contiguous copy of the rows.
///
/// Lengths must agree; callers check (see [`KvBlocks::holds`]).
pub fn attention_blocks(
    q: &[f32],
    q_pos: &[usize],
    kv: KvBlocks<'_>,
    kv_pos: &[usize],
    shape: AttnShape,
    out: &mut [f32],
    lse: Option<&mut [f32]>,
) {
    let AttnShape { q_heads, kv_heads, head_dim: d, .. } = shape;
    let mut scratch;
    let lse = match lse {
        Some(l) => l,
        None => {
            scratch = vec![0.0f32; q_pos.len() * q_heads];
            &mut scratch[..]
        }
    };
    if q_pos.len() >= BLOCKED_MIN_QUERIES {
        if let ([k], [v]) = kv.blocks() {
            attention_blocked(q, q_pos, k, v, kv_pos, shape, out, lse);
        } else {
            let (k, v) = kv.gather(kv_pos.len(), kv_heads * d);
            attention_blocked(q, q_pos, &k, &v, kv_pos, shape, out, lse);
        }
        return;
    }
    decode_attention::attend(q, q_pos, kv, kv_pos, shape, out, lse);
}

/// Sequence `i`'s keys and values for [`attention_rows`]: `kv(i, f)` calls `f` with its
/// blocks and their positions.
pub type RowBlocks<'a> = dyn Fn(usize, &mut dyn FnMut(KvBlocks<'_>, &[usize])) + Sync + 'a;

/// Query rows `q` (`[n, q_heads, head_dim]`) of `n` sequences, one row each at `q_pos[i]`
/// (the decode rows of a step), each against its own keys and values: `kv(i, f)` calls `f`
/// with sequence `i`'s blocks and positions. Row `i` of `out` is [`attention_blocks`]' result
/// for that row alone, bit for bit. One parallel loop over the step's rows, each row's heads on
/// one thread, instead of a parallel loop per sequence (of only `q_heads` rows). `kv` runs
/// on the pool's threads, one call per row, and no work of the pool runs inside `f`.
///
/// Lengths must agree; callers check (see [`KvBlocks::holds`]).
pub fn attention_rows(
    q: &[f32],
    q_pos: &[usize],
    shape: AttnShape,
    out: &mut [f32],
    kv: &RowBlocks<'_>,
) {
    let AttnShape { q_heads, head_dim: d, .. } = shape;
    out.par_chunks_mut(q_heads * d).enumerate().for_each_init(
        || (decode_attention::Scratch::default(), vec![0.0f32; q_heads]),
        |(scratch, lse), (i, o)| {
            kv(i, &mut |blocks, kv_pos| {
                let q = &q[i * q_heads * d..][..q_heads * d];
                decode_attention::attend_row(q, q_pos[i], blocks, kv_pos, shape, scratch, o, lse);
            });
        },
    );
}

/// From this many query tokens on, [`attention`] works on blocks of queries with `gemm`;
/// below it (decode), each token's chunks of keys are tasks ([`decode_attention`]).
const BLOCKED_MIN_QUERIES: usize = 4;

/// Most query tokens per block of [`attention_blocked`].
const MAX_QUERY_BLOCK: usize = 32;

/// [`attention`] for many queries: per block of query tokens and KV head, the scores of the
/// group's query heads against the visible prefix of the keys come from one `gemm`
/// (`S = Q·Kᵀ`, keys read in place through strides), the rows are masked and normalized, and a
/// second `gemm` forms `P·V`. Blocks run in parallel, each `gemm` on one thread.
#[allow(clippy::too_many_arguments)]
fn attention_blocked(
    q: &[f32],
    q_pos: &[usize],
    k: &[f32],
    v: &[f32],
    kv_pos: &[usize],
    shape: AttnShape,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let AttnShape { q_heads, kv_heads, head_dim: d, .. } = shape;
    let group = q_heads / kv_heads;
    let scale = shape.factor();
    // At least ~8 blocks so both threads stay busy on short prompts.
    let block = q_pos.len().div_ceil(8).clamp(1, MAX_QUERY_BLOCK);
    let kv_stride = kv_heads * d;
    out.par_chunks_mut(block * q_heads * d)
        .zip(lse.par_chunks_mut(block * q_heads))
        .enumerate()
        .for_each(|(b, (ob, lb))| {
            let first = b * block;
            let n = lb.len() / q_heads;
            let bpos = &q_pos[first..first + n];
            let max_pos = bpos.iter().copied().max().unwrap_or(0);
            // Keys after the last one any query of the block sees are never needed.
            let Some(last) = kv_pos.iter().rposition(|&p| p <= max_pos) else {
                ob.fill(0.0);
                lb.fill(f32::NEG_INFINITY);
                return;
            };
            let t = last + 1;
            let m = n * group;
            let mut qg = vec![0.0f32; m * d];
            let mut scores = vec![0.0f32; m * t];
            let mut og = vec![0.0f32; m * d];
            for g in 0..kv_heads {
                // The group's query rows, token-major: row i·group + h.
                for i in 0..n {
                    let src = &q[((first + i) * q_heads + g * group) * d..][..group * d];
                    qg[i * group * d..(i + 1) * group * d].copy_from_slice(src);
                }
                let kt = MatRef { data: k, offset: g * d, row_stride: 1, col_stride: kv_stride };
                let vg = MatRef { data: v, offset: g * d, row_stride: kv_stride, col_stride: 1 };
                let ok = gemm_strided(MatRef::row_major(&qg, d), kt, &mut scores, t, m, t, d, 1)
                    .and_then(|()| {
                        for (r, row) in scores.chunks_exact_mut(t).enumerate() {
                            let lse_at = &mut lb[(r / group) * q_heads + g * group + r % group];
                            let q_pos = bpos[r / group];
                            let visible = (shape.first_visible(q_pos), q_pos);
                            *lse_at = softmax_row(row, kv_pos, visible, scale, shape.softcap);
                        }
                        gemm_strided(MatRef::row_major(&scores, t), vg, &mut og, d, m, d, t, 1)
                    });
                // The views were built from lengths the caller checked; a failure here is a
                // bug, and zeros with -inf (no keys) are the safest result to hand back.
                debug_assert!(ok.is_ok(), "{ok:?}");
                if ok.is_err() {
                    og.fill(0.0);
                    for r in 0..m {
                        lb[(r / group) * q_heads + g * group + r % group] = f32::NEG_INFINITY;
                    }
                }
                for i in 0..n {
                    let dst = &mut ob[(i * q_heads + g * group) * d..][..group * d];
                    dst.copy_from_slice(&og[i * group * d..(i + 1) * group * d]);
                }
            }
        });
}

/// Turns one row of raw scores into attention weights in place: keys outside
/// `first..=q_pos` (by position) get 0, the rest `softmax(capped(score · scale))`. Returns
/// the log-sum-exp (−∞ and an all-zero row when no key is visible).
fn softmax_row(
    row: &mut [f32],
    kv_pos: &[usize],
    (first, q_pos): (usize, usize),
    scale: f32,
    softcap: Option<f32>,
) -> f32 {
    let mut max = f32::NEG_INFINITY;
    for (x, &p) in row.iter_mut().zip(kv_pos) {
        if p <= q_pos && p >= first {
            *x = capped(*x * scale, softcap);
            max = max.max(*x);
        } else {
            *x = f32::NEG_INFINITY;
        }
    }
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return f32::NEG_INFINITY;
    }
    let mut sum = 0.0f32;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    for x in row.iter_mut() {
        *x *= inv;
    }
    max + sum.ln()
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
                    .filter(|&j| kp[j] <= qpos && s.window.is_none_or(|w| kp[j] + w > qpos))
                    .map(|j| {
                        let dotp: f64 = (0..d)
                            .map(|x| q[row * d + x] as f64 * k[(j * s.kv_heads + g) * d + x] as f64)
                            .sum();
                        let scale = s.scale.map_or(1.0 / (d as f64).sqrt(), f64::from);
                        let score = dotp * scale;
                        let cap = s.softcap.map(f64::from);
                        (j, cap.map_or(score, |c| c * (score / c).tanh()))
                    })
                    .collect();
                if sc.is_empty() {
                    lse[row] = f32::NEG_INFINITY;
                    continue;
                }
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
        let s = AttnShape::new(6, 2, 8);
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
    fn blocked_and_row_paths_agree_with_naive_on_gqa_shapes_and_scattered_positions() {
        // Keys arrive out of order and some queries see none of them (a context-parallel
        // rank's view); 40 queries take the blocked path, 3 the row path.
        let s = AttnShape::new(6, 2, 16);
        let t = 50;
        let k = random_vec(t * 2 * 16, 30);
        let v = random_vec(t * 2 * 16, 31);
        let kp: Vec<usize> = (0..t).map(|j| (j * 37) % 60 + 5).collect();
        for n in [40, 3] {
            let q = random_vec(n * 6 * 16, 32);
            let qp: Vec<usize> = (0..n).map(|i| i * 2).collect();
            let (want, want_lse) = naive(&q, &qp, &k, &v, &kp, s);
            let mut out = vec![f32::NAN; want.len()];
            let mut lse = vec![f32::NAN; want_lse.len()];
            attention(&q, &qp, &k, &v, &kp, s, &mut out, Some(&mut lse));
            assert_close(&out, &want, 1e-5);
            assert_close(&lse, &want_lse, 1e-5);
            assert!(lse.contains(&f32::NEG_INFINITY), "some rows see no key");
        }
    }

    /// Soft-capping, a sliding window and a query scale of their own, on both paths, against
    /// the reference (a single row without keys is checked below), and the
    /// caps and window change the result (so the test would catch them being ignored).
    #[test]
    fn softcap_window_and_scale_match_naive_on_both_paths() {
        let plain = AttnShape::new(6, 2, 16);
        let ruled = AttnShape { scale: Some(0.4), softcap: Some(1.5), window: Some(4), ..plain };
        let t = 40;
        let k = random_vec(t * 2 * 16, 40);
        let v = random_vec(t * 2 * 16, 41);
        // Keys in scrambled order with gaps, as a CP rank holds them.
        let kp: Vec<usize> = (0..t).map(|j| (j * 37) % 53 + 3).collect();
        for n in [24, 2] {
            let q: Vec<f32> = random_vec(n * 6 * 16, 42).iter().map(|x| x * 4.0).collect();
            let qp: Vec<usize> = (0..n).map(|i| 55 - i * 2).collect();
            let (want, want_lse) = naive(&q, &qp, &k, &v, &kp, ruled);
            let mut out = vec![f32::NAN; want.len()];
            let mut lse = vec![f32::NAN; want_lse.len()];
            attention(&q, &qp, &k, &v, &kp, ruled, &mut out, Some(&mut lse));
            assert_close(&out, &want, 1e-5);
            assert_close(&lse, &want_lse, 1e-5);
            assert!(out.iter().all(|x| x.is_finite()), "{n} queries: a row without keys is 0");
            let (plain_out, _) = naive(&q, &qp, &k, &v, &kp, plain);
            let diff = plain_out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(diff > 1e-2, "{n} queries: the rules changed nothing ({diff})");
        }
        // Position 9 with a window of 4 sees 6..=9: the key at 5 is out, so no key is visible.
        let s = AttnShape { window: Some(4), ..AttnShape::new(1, 1, 4) };
        let (mut out, mut lse) = (vec![1.0; 4], vec![0.0; 1]);
        attention(&[1.0; 4], &[9], &[1.0; 4], &[1.0; 4], &[5], s, &mut out, Some(&mut lse));
        assert_eq!((out, lse[0]), (vec![0.0; 4], f32::NEG_INFINITY));
    }

    /// Decode rows over many keys (taken in chunks, merged): against the reference with keys
    /// in order and a window that leaves whole chunks unseen, and with scrambled positions;
    /// one to three query tokens.
    #[test]
    fn decode_rows_over_many_chunks_of_keys_match_naive() {
        let plain = AttnShape::new(6, 2, 16);
        let ruled = AttnShape { scale: Some(0.4), softcap: Some(1.5), window: Some(150), ..plain };
        let t = 600;
        let k = random_vec(t * 2 * 16, 60);
        let v = random_vec(t * 2 * 16, 61);
        let ordered: Vec<usize> = (0..t).collect();
        let scrambled: Vec<usize> = (0..t).map(|j| (j * 37) % 613 + 3).collect();
        for (kp, s) in
            [(&ordered, plain), (&ordered, ruled), (&scrambled, plain), (&scrambled, ruled)]
        {
            for n in 1..=3 {
                let q: Vec<f32> = random_vec(n * 6 * 16, 62).iter().map(|x| x * 3.0).collect();
                let qp: Vec<usize> = (0..n).map(|i| 599 - 170 * i).collect();
                let (want, want_lse) = naive(&q, &qp, &k, &v, kp, s);
                let mut out = vec![f32::NAN; want.len()];
                let mut lse = vec![f32::NAN; want_lse.len()];
                attention(&q, &qp, &k, &v, kp, s, &mut out, Some(&mut lse));
                assert_close(&out, &want, 1e-5);
                assert_close(&lse, &want_lse, 1e-5);
            }
        }
    }

    #[test]
    fn rows_without_visible_keys_give_zero_and_neg_inf() {
        let s = AttnShape::new(1, 1, 4);
        let mut out = vec![1.0; 4];
        let mut lse = vec![0.0; 1];
        attention(&[1.0; 4], &[2], &[1.0; 4], &[1.0; 4], &[3], s, &mut out, Some(&mut lse));
        assert_eq!(out, vec![0.0; 4]);
        assert_eq!(lse[0], f32::NEG_INFINITY);
    }

    #[test]
    fn merging_two_key_halves_equals_attention_over_all_keys() {
        let s = AttnShape::new(4, 2, 8);
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
