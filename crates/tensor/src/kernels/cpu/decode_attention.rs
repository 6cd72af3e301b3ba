//! Attention of a few query tokens against their keys (decode steps, and the one-token rows
//! of a context-parallel rank): per query token and KV head, the query heads that share the
//! head's keys read each key and value once, and the keys are taken in chunks of
//! [`KEY_CHUNK`]. A chunk gives a partial result per query head (its largest score, its sum of
//! weights and its weighted sum of values); the partials are merged in chunk order. A lone
//! sequence's chunks are tasks of their own, so one long context keeps every thread busy,
//! and since the chunks follow from the key count alone (never the threads or the batch), a
//! row's bits do not depend on either: the rows of a step ([`attend_row`], each on one
//! thread) are the bits of each row alone ([`attend`]).
//!
//! A long context's keys and values stream from memory, and each token's row holds every KV
//! head, so the kernel asks for the rows [`AHEAD`] tokens before it reads them (30 layers of
//! 1,000 keys on two threads of this project's machines: 6.1 ms with a task per query head,
//! 5.1 with the rows shared and the chunks, 3.7 with the prefetch). The weights are `e^(s - max)` by [`exp_weight`], a polynomial of IEEE
//! operations and fused multiply-adds that the compiler vectorizes (the library's `exp` is
//! one call per score).

use super::attention::{capped, AttnShape, KvBlocks};
use super::matvec::{prefetch, simd_axpy, simd_axpy4, simd_dot};
use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;
use std::ops::Range;

/// Keys per chunk: a partial result each.
pub(super) const KEY_CHUNK: usize = 128;

/// How many tokens ahead of the one in hand the kernels ask for key and value rows: the rows
/// of a KV head's tokens are apart by the other heads' rows, which the hardware's prefetchers
/// do not follow far enough.
const AHEAD: usize = 8;

/// Asks for the cache lines of `row` (a hint, see [`prefetch`]).
#[inline(always)]
fn prefetch_row(row: &[f32]) {
    for line in row.chunks(16) {
        prefetch(line.as_ptr());
    }
}

/// Floats of a chunk's partial result per query head: the weighted sum of the values
/// (`head_dim`), then the chunk's largest score and its sum of weights.
fn part_len(head_dim: usize) -> usize {
    head_dim + 2
}

/// The chunks of keys a query at `q_pos` reads, by index: every key up to the last it sees
/// (keys after it never contribute), [`KEY_CHUNK`] at a time.
fn key_chunks(kv_pos: &[usize], q_pos: usize) -> impl Iterator<Item = Range<usize>> {
    let keys = kv_pos.iter().rposition(|&p| p <= q_pos).map_or(0, |last| last + 1);
    (0..keys).step_by(KEY_CHUNK).map(move |at| at..(at + KEY_CHUNK).min(keys))
}

/// `e^x` for `x <= 0`, and 0 below -87 (where `e^x` leaves f32's normal numbers): `x` is
/// `n·ln 2 + r` with `n` rounded to nearest by adding `1.5·2^23` and `r` from two fused
/// multiply-adds (ln 2 in two parts), `e^r` by its Taylor polynomial of degree 7 in Horner's
/// form (|r| <= 0.35: within 2 ulp), and `2^n` as the exponent bits of that sum. Every step is
/// an IEEE operation or a fused multiply-add, so every SIMD width gives the same bits. NaN
/// stays NaN.
#[inline(always)]
pub(super) fn exp_weight(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const C: [f32; 8] =
        [1.0, 1.0, 0.5, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];
    let under = x < -87.0;
    let xc = if under { -87.0 } else { x };
    let t = xc.mul_add(std::f32::consts::LOG2_E, MAGIC);
    let n = t - MAGIC;
    let r = n.mul_add(-LN2_HI, xc);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = C[7];
    for c in C[..7].iter().rev() {
        p = p.mul_add(r, *c);
    }
    // `t`'s low mantissa bits hold n (-126..=0): its exponent field is n + 127.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    if under {
        0.0
    } else {
        p * scale
    }
}

/// `w`'s sum in sixteen lanes (element `i` into lane `i % 16`), the lanes summed in a fixed
/// tree: a loop the compiler vectorizes, unlike one running sum.
#[inline(always)]
fn lane_sum(w: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let blocks = w.chunks_exact(16);
    let rest = blocks.remainder();
    for b in blocks {
        for (l, x) in lanes.iter_mut().zip(b) {
            *l += x;
        }
    }
    for (l, x) in lanes.iter_mut().zip(rest) {
        *l += x;
    }
    let mut width = 8;
    while width > 0 {
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// One query token's heads against one chunk of keys, into `out` (a partial result of
/// [`part_len`] floats per query head). Each key's and value's row (every KV head) is read
/// once, in token order.
struct Chunk<'a> {
    /// The query heads of KV heads `heads` (all of them, or one KV head's group), one after
    /// another.
    q: &'a [f32],
    /// The KV heads the chunk's task computes.
    heads: Range<usize>,
    q_pos: usize,
    shape: AttnShape,
    kv: KvBlocks<'a>,
    kv_pos: &'a [usize],
    /// The chunk's keys, by index.
    keys: Range<usize>,
    scores: &'a mut Vec<f32>,
    out: &'a mut [f32],
}

impl WithSimd for Chunk<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Chunk { q, heads, q_pos, shape, kv, kv_pos, keys, scores, out } = self;
        let AttnShape { q_heads, kv_heads, head_dim: d, .. } = shape;
        let group = q_heads / kv_heads;
        // Each token's row holds every KV head; the task reads the part of its heads.
        let (stride, offset, row) = (kv_heads * d, heads.start * d, heads.len() * d);
        let (scale, first) = (shape.factor(), shape.first_visible(q_pos));
        let n = keys.len();
        // Scores, head-major.
        scores.clear();
        scores.resize(heads.len() * group * n, f32::NEG_INFINITY);
        for (at, j) in keys.clone().enumerate() {
            if j + AHEAD < keys.end {
                prefetch_row(kv.key(j + AHEAD, stride, offset, row));
            }
            if kv_pos[j] > q_pos || kv_pos[j] < first {
                continue;
            }
            let key = kv.key(j, stride, offset, row);
            for (h, q) in q.chunks_exact(d).enumerate() {
                let k = &key[(h / group) * d..][..d];
                scores[h * n + at] = capped(simd_dot(simd, q, k) * scale, shape.softcap);
            }
        }
        // Weights in place (masked keys get 0), each head's largest score and sum.
        let mut live = false;
        for (w, part) in scores.chunks_exact_mut(n).zip(out.chunks_exact_mut(part_len(d))) {
            let max = w.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            part.fill(0.0);
            if max == f32::NEG_INFINITY {
                part[d] = f32::NEG_INFINITY;
                continue;
            }
            live = true;
            for s in w.iter_mut() {
                *s = exp_weight(*s - max);
            }
            part[d] = max;
            part[d + 1] = lane_sum(w);
        }
        if !live {
            return;
        }
        // The weighted values, four keys at a time.
        let value = |j: usize| kv.value(keys.start + j, stride, offset, row);
        let scores = &scores[..];
        let quads = n / 4;
        for c in 0..quads {
            let j = 4 * c;
            for ahead in j + AHEAD..(j + AHEAD + 4).min(n) {
                prefetch_row(value(ahead));
            }
            let v = [value(j), value(j + 1), value(j + 2), value(j + 3)];
            let heads = scores.chunks_exact(n).zip(out.chunks_exact_mut(part_len(d)));
            for (h, (w, part)) in heads.enumerate() {
                let v = v.map(|v| &v[(h / group) * d..][..d]);
                simd_axpy4(simd, [w[j], w[j + 1], w[j + 2], w[j + 3]], v, &mut part[..d]);
            }
        }
        for j in 4 * quads..n {
            let v = value(j);
            let heads = scores.chunks_exact(n).zip(out.chunks_exact_mut(part_len(d)));
            for (h, (w, part)) in heads.enumerate() {
                simd_axpy(simd, w[j], &v[(h / group) * d..][..d], &mut part[..d]);
            }
        }
    }
}

/// The partial results of one query token's heads over its chunks (`parts`: chunk after
/// chunk, each a partial per head), merged in chunk order into `out` (`[heads, d]`) and `lse`
/// (`heads`): zeros and -inf for a head that sees no key.
fn merge(parts: &[f32], d: usize, out: &mut [f32], lse: &mut [f32]) {
    let per_chunk = lse.len() * part_len(d);
    for (h, (o, l)) in out.chunks_exact_mut(d).zip(lse.iter_mut()).enumerate() {
        let head = |c: &'_ [f32]| -> (f32, f32) {
            let p = &c[h * part_len(d)..];
            (p[d], p[d + 1])
        };
        let max = parts.chunks_exact(per_chunk).fold(f32::NEG_INFINITY, |m, c| m.max(head(c).0));
        o.fill(0.0);
        if max == f32::NEG_INFINITY {
            *l = f32::NEG_INFINITY;
            continue;
        }
        let mut sum = 0.0f32;
        for c in parts.chunks_exact(per_chunk) {
            let (m, s) = head(c);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let w = exp_weight(m - max);
            sum += s * w;
            let acc = &c[h * part_len(d)..][..d];
            for (a, x) in o.iter_mut().zip(acc) {
                *a += w * x;
            }
        }
        let inv = 1.0 / sum;
        for a in o.iter_mut() {
            *a *= inv;
        }
        *l = max + sum.ln();
    }
}

/// Per-thread buffers of [`attend_row`].
#[derive(Default)]
pub(super) struct Scratch {
    scores: Vec<f32>,
    parts: Vec<f32>,
}

/// [`super::attention::attention_blocks`] for queries of one token each at `q_pos[i]` (`q`,
/// `out` `[tokens, q_heads, head_dim]`, `lse` `[tokens, q_heads]`), every (token, chunk) a
/// task, or (token, chunk, KV head) where that leaves the pool's threads too few tasks (short
/// contexts), in the current rayon pool. Which task computes a head changes none of its
/// arithmetic.
pub(super) fn attend(
    q: &[f32],
    q_pos: &[usize],
    kv: KvBlocks<'_>,
    kv_pos: &[usize],
    shape: AttnShape,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let AttnShape { q_heads, kv_heads, head_dim: d, .. } = shape;
    let group = q_heads / kv_heads;
    let per_chunk = q_heads * part_len(d);
    // (token, chunk) pairs, and where each token's run of them starts.
    let mut chunks = Vec::new();
    let mut starts = Vec::with_capacity(q_pos.len() + 1);
    for (i, &p) in q_pos.iter().enumerate() {
        starts.push(chunks.len());
        chunks.extend(key_chunks(kv_pos, p).map(|keys| (i, keys)));
    }
    starts.push(chunks.len());
    let split = chunks.len() < 2 * rayon::current_num_threads();
    let heads_per_task = if split { 1 } else { kv_heads };
    let tasks = chunks.iter().flat_map(|(i, keys)| {
        (0..kv_heads)
            .step_by(heads_per_task)
            .map(move |h| (*i, keys.clone(), h..h + heads_per_task))
    });
    let tasks: Vec<(usize, Range<usize>, Range<usize>)> = tasks.collect();
    let arch = Arch::new();
    let per_task = heads_per_task * group * part_len(d);
    // A task's partials into `part`.
    let run =
        |task: &(usize, Range<usize>, Range<usize>), scores: &mut Vec<f32>, part: &mut [f32]| {
            let (i, keys, heads) = task.clone();
            let q = &q[(i * q_heads + heads.start * group) * d..][..heads.len() * group * d];
            arch.dispatch(Chunk {
                q,
                heads,
                q_pos: q_pos[i],
                shape,
                kv,
                kv_pos,
                keys,
                scores,
                out: part,
            });
        };
    if starts.windows(2).all(|w| w[1] == w[0] + 1) {
        // One chunk per token (short contexts): each task merges its own heads' one partial
        // (the merge of a lone chunk), so there is no second loop.
        let outs = out.par_chunks_mut(heads_per_task * group * d);
        let lses = lse.par_chunks_mut(heads_per_task * group);
        let init = || (Vec::new(), vec![0.0f32; per_task]);
        outs.zip(lses).zip(&tasks).for_each_init(init, |(scores, part), ((o, l), task)| {
            run(task, scores, part);
            merge(part, d, o, l);
        });
        return;
    }
    let mut parts = vec![0.0f32; chunks.len() * per_chunk];
    parts
        .par_chunks_mut(per_task)
        .zip(&tasks)
        .for_each_init(Vec::new, |scores, (part, task)| run(task, scores, part));
    out.par_chunks_mut(q_heads * d).zip(lse.par_chunks_mut(q_heads)).enumerate().for_each(
        |(i, (o, l))| merge(&parts[starts[i] * per_chunk..starts[i + 1] * per_chunk], d, o, l),
    );
}

/// One query token at `q_pos` (`q`, `out` `[q_heads, head_dim]`) against its keys on the
/// calling thread: the same chunks, partials and merge as [`attend`], so the same bits;
/// `lse` (`q_heads`) gets each head's log-sum-exp.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_row(
    q: &[f32],
    q_pos: usize,
    kv: KvBlocks<'_>,
    kv_pos: &[usize],
    shape: AttnShape,
    scratch: &mut Scratch,
    out: &mut [f32],
    lse: &mut [f32],
) {
    let per_chunk = shape.q_heads * part_len(shape.head_dim);
    let arch = Arch::new();
    let Scratch { scores, parts } = scratch;
    parts.clear();
    parts.resize(key_chunks(kv_pos, q_pos).count() * per_chunk, 0.0);
    let heads = 0..shape.kv_heads;
    for (keys, part) in key_chunks(kv_pos, q_pos).zip(parts.chunks_exact_mut(per_chunk)) {
        let heads = heads.clone();
        arch.dispatch(Chunk { q, heads, q_pos, shape, kv, kv_pos, keys, scores, out: part });
    }
    merge(parts, shape.head_dim, out, lse);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_weight_is_close_to_exp_and_exact_where_it_must_be() {
        assert_eq!(exp_weight(0.0), 1.0);
        assert_eq!(exp_weight(-0.0), 1.0);
        assert_eq!(exp_weight(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_weight(-87.5), 0.0);
        assert!(exp_weight(f32::NAN).is_nan());
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp_weight(x));
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "relative error {worst}");
    }

    #[test]
    fn lane_sums_are_sums() {
        for n in [0, 1, 15, 16, 17, 100, 256] {
            let w: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
            assert_eq!(lane_sum(&w), w.iter().sum::<f32>(), "{n}");
        }
    }
}
