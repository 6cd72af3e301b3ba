//! Products of f32 weights with the few activation rows of a decode step (a batch of
//! sequences, one token each): row-parallel dot products.
//!
//! Decode is bound by memory bandwidth: each weight is read once per step, where `gemm`'s
//! packing of the weight matrix (a copy of it per call) and tiling only cost. The weight rows
//! are split into chunks that rayon spreads over the pool's threads; each weight row is
//! multiplied into the activation rows by tiles of [`X_TILE`], while it sits in L1, with
//! independent accumulators per activation row so the compiler keeps the SIMD units busy and a
//! row's result does not depend on the rest of the batch. The activation rows are interleaved
//! first (see [`Pack`]), so that the product reads them through one pointer. With AVX-512
//! (pulp's `x86-v4` level, picked at run time) a step of 8 sequences on SmolLM2 f32 went from
//! 131 to 163 tokens/s (AVX2) and to 180 with the interleaving, on 2 threads.

use pulp::{Arch, Simd, WithSimd};

/// Rows per parallel task: large enough that scheduling is negligible, small enough that the
/// two halves of a 576-row projection still land on different threads, and a multiple of
/// the weight rows the kernels take together (8 beside one activation row, 3 beside a tile of
/// 8), so no task ends with rows multiplied one at a time. With 16, a tile's 16th row went
/// alone: 24 made SmolLM2's f32 decode of 8 and 32 sequences 5-10% faster.
const ROWS_PER_TASK: usize = 24;

/// Dot product with 16 independent accumulators (vectorizes without fast-math), reduced as a
/// tree: a sequential sum of the lanes would be a chain of 15 dependent adds, which costs more
/// than the products for short vectors such as attention heads.
#[cfg(test)]
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 16];
    let ac = a.chunks_exact(16);
    let bc = b.chunks_exact(16);
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut half = [0.0f32; 8];
    for l in 0..8 {
        half[l] = acc[l] + acc[l + 8];
    }
    let mut quarter = [0.0f32; 4];
    for l in 0..4 {
        quarter[l] = half[l] + half[l + 4];
    }
    let mut s = (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// [`dot`] on explicit SIMD vectors of `simd`'s width with two accumulators, for code that
/// already runs inside a SIMD dispatch.
#[inline(always)]
pub(crate) fn simd_dot<S: Simd>(simd: S, a: &[f32], b: &[f32]) -> f32 {
    let (ah, at) = S::as_simd_f32s(a);
    let (bh, bt) = S::as_simd_f32s(b);
    // Two named accumulators (an indexed array would live in memory, not registers).
    let (mut acc0, mut acc1) = (simd.splat_f32s(0.0), simd.splat_f32s(0.0));
    let (a2, b2) = (ah.chunks_exact(2), bh.chunks_exact(2));
    if let (Some(x), Some(y)) = (a2.remainder().first(), b2.remainder().first()) {
        acc1 = simd.mul_add_e_f32s(*x, *y, acc1);
    }
    for (x, y) in a2.zip(b2) {
        acc0 = simd.mul_add_e_f32s(x[0], y[0], acc0);
        acc1 = simd.mul_add_e_f32s(x[1], y[1], acc1);
    }
    let mut s = simd.reduce_sum_f32s(simd.add_f32s(acc0, acc1));
    for (x, y) in at.iter().zip(bt) {
        s += x * y;
    }
    s
}

/// `out += e · v` on explicit SIMD vectors of `simd`'s width.
#[inline(always)]
pub(crate) fn simd_axpy<S: Simd>(simd: S, e: f32, v: &[f32], out: &mut [f32]) {
    let (oh, ot) = S::as_mut_simd_f32s(out);
    let (vh, vt) = S::as_simd_f32s(v);
    let es = simd.splat_f32s(e);
    for (o, x) in oh.iter_mut().zip(vh) {
        *o = simd.mul_add_e_f32s(es, *x, *o);
    }
    for (o, x) in ot.iter_mut().zip(vt) {
        *o += e * x;
    }
}

/// `out += Σ_i e[i] · v[i]` for four vectors at once: one load and store of `out` per four
/// products instead of per product.
#[inline(always)]
pub(crate) fn simd_axpy4<S: Simd>(simd: S, e: [f32; 4], v: [&[f32]; 4], out: &mut [f32]) {
    let (oh, ot) = S::as_mut_simd_f32s(out);
    let vs = v.map(|x| S::as_simd_f32s(x));
    let es = e.map(|x| simd.splat_f32s(x));
    for (i, o) in oh.iter_mut().enumerate() {
        let a = simd.mul_add_e_f32s(es[0], vs[0].0[i], *o);
        let b = simd.mul_f32s(es[1], vs[1].0[i]);
        let a = simd.mul_add_e_f32s(es[2], vs[2].0[i], a);
        let b = simd.mul_add_e_f32s(es[3], vs[3].0[i], b);
        *o = simd.add_f32s(a, b);
    }
    for (i, o) in ot.iter_mut().enumerate() {
        *o += e[0] * vs[0].1[i] + e[1] * vs[1].1[i] + e[2] * vs[2].1[i] + e[3] * vs[3].1[i];
    }
}

/// Activation rows multiplied by one weight row at a time in [`matmul_rows`]: one
/// accumulator each, plus the weight register, fit the 16 registers of AVX2.
const X_TILE: usize = 8;

/// How far ahead of the product [`row_dots`] asks for weights (bytes): the weights stream
/// from memory, and a hint this far ahead keeps more of them in flight than the hardware
/// prefetcher alone does while the tile's products run (measured 1.3x at 8 rows; 4 KiB, into
/// the rows the next calls read, was 5-10% faster than 1 KiB at 1 and 8 rows). The lines go
/// to L2 ([`prefetch`]), not L1: 4 KiB ahead on each of 8 rows (one activation row) is all of
/// a 32 KiB L1, and 3 rows beside a tile of 8 activation rows overflow it, so lines fetched
/// into L1 were evicted before their use.
const PREFETCH_AHEAD: usize = 4096;

/// `out[i, r] = x[i, :] · w[r, :]` for the `m` rows of `x` (`[m, k]`) and `w` of shape
/// `[rows, k]`, into `out` (`[m, rows]`), in the current rayon pool. Every weight is read from
/// memory once for all `m` rows. A row's result is the same bits alone or in any batch.
///
/// Lengths must agree (`x.len() == m * k`, `w.len() == rows * k`, `out.len() == m * rows`);
/// callers check them.
pub fn matmul_rows(w: &[f32], x: &[f32], m: usize, out: &mut [f32]) {
    if m == 0 || out.is_empty() {
        return;
    }
    let (k, rows) = (x.len() / m, out.len() / m);
    debug_assert_eq!(w.len(), rows * k);
    let arch = Arch::new();
    // One row needs no packing: its vectors are already in order.
    let owned;
    let packed = if m == 1 {
        x
    } else {
        owned = arch.dispatch(Pack { x, m });
        &owned[..]
    };
    // Tasks own ranges of weight rows.
    super::shared_out::by_weight_rows(rows, m, ROWS_PER_TASK, out, |first, chunk| {
        let w = &w[first * k..][..chunk.len() / m * k];
        arch.dispatch(Rows { w, x, packed, m, out: chunk });
    });
}

/// The `m` rows of `x` interleaved by vectors of `lanes` values: within each tile of up to
/// `tile` rows, vector `v` of every row of the tile, row after row, then vector `v + 1`. A
/// product then reads a tile's activations through one pointer at fixed offsets instead of one
/// pointer per row (which would not fit the registers beside the accumulators). The rows'
/// tails past the last whole vector are left out. Used by [`matmul_rows`] (the dispatch's SIMD
/// width, tiles of [`X_TILE`]) and the AVX-512 block-quantized kernels (16 lanes).
pub(super) fn interleave(x: &[f32], m: usize, lanes: usize, tile: usize) -> Interleaved {
    use rayon::prelude::*;
    let k = x.len() / m.max(1);
    let wide = k / lanes;
    // Every value is written below: a longer buffer is cut (nothing cleared), a shorter one
    // grows (cleared once).
    let mut packed = PACKED.take();
    packed.resize(m * wide * lanes, 0.0);
    // The tiles on the pool's threads (one thread packing a 32-row step's activations left
    // the other idle before every product).
    let per_tile = (tile * wide * lanes).max(1);
    packed.par_chunks_mut(per_tile).enumerate().for_each(|(n, out)| {
        let i0 = n * tile;
        let rows = out.len() / (wide * lanes).max(1);
        let mut at = 0;
        for v in 0..wide {
            for t in i0..i0 + rows {
                out[at..at + lanes].copy_from_slice(&x[t * k + v * lanes..][..lanes]);
                at += lanes;
            }
        }
    });
    Interleaved(packed)
}

thread_local! {
    /// The thread's buffer for [`interleave`], kept between products (a new one per product
    /// was a cleared allocation of up to 400 KB on the step's thread).
    static PACKED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Activations laid out by [`interleave`], in a buffer that goes back to the thread's when
/// dropped (a product on the same thread meanwhile makes its own).
pub(super) struct Interleaved(Vec<f32>);

impl std::ops::Deref for Interleaved {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl Drop for Interleaved {
    fn drop(&mut self) {
        PACKED.set(std::mem::take(&mut self.0));
    }
}

/// [`interleave`] for the SIMD width the dispatch picks.
struct Pack<'a> {
    x: &'a [f32],
    m: usize,
}

impl WithSimd for Pack<'_> {
    type Output = Interleaved;

    #[inline(always)]
    fn with_simd<S: Simd>(self, _simd: S) -> Interleaved {
        interleave(self.x, self.m, std::mem::size_of::<S::f32s>() / 4, X_TILE)
    }
}

/// A chunk of [`matmul_rows`]' weight rows, dispatched to the widest SIMD level available:
/// `out` is `[rows of the chunk, m]`.
struct Rows<'a> {
    w: &'a [f32],
    x: &'a [f32],
    /// `x` as [`Pack`] lays it out.
    packed: &'a [f32],
    m: usize,
    out: &'a mut [f32],
}

impl WithSimd for Rows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Rows { w, x, packed, m, out } = self;
        let k = x.len() / m;
        let wide = k / (std::mem::size_of::<S::f32s>() / 4);
        let packed = S::as_simd_f32s(packed).0;
        // 32 registers (AVX-512) hold more weight rows' accumulators beside a tile than 16.
        let wide_regs = std::mem::size_of::<S::f32s>() >= 64;
        let mut i = 0;
        while i < m {
            let t = (m - i).min(X_TILE);
            let x = &x[i * k..(i + t) * k];
            let p = &packed[i * wide..(i + t) * wide];
            let out = &mut out[i..];
            match (t, wide_regs) {
                (1, _) => weight_rows::<S, 1, 8>(simd, w, x, p, m, out),
                (2, true) => weight_rows::<S, 2, 8>(simd, w, x, p, m, out),
                (2, false) => weight_rows::<S, 2, 4>(simd, w, x, p, m, out),
                (3, true) => weight_rows::<S, 3, 6>(simd, w, x, p, m, out),
                (3, false) => weight_rows::<S, 3, 2>(simd, w, x, p, m, out),
                (4, true) => weight_rows::<S, 4, 4>(simd, w, x, p, m, out),
                (4, false) => weight_rows::<S, 4, 2>(simd, w, x, p, m, out),
                (5, true) => weight_rows::<S, 5, 4>(simd, w, x, p, m, out),
                (5, false) => weight_rows::<S, 5, 1>(simd, w, x, p, m, out),
                (6, true) => weight_rows::<S, 6, 3>(simd, w, x, p, m, out),
                (6, false) => weight_rows::<S, 6, 1>(simd, w, x, p, m, out),
                (7, true) => weight_rows::<S, 7, 3>(simd, w, x, p, m, out),
                (7, false) => weight_rows::<S, 7, 1>(simd, w, x, p, m, out),
                (_, true) => weight_rows::<S, 8, 3>(simd, w, x, p, m, out),
                (_, false) => weight_rows::<S, 8, 1>(simd, w, x, p, m, out),
            }
            i += t;
        }
    }
}

/// Every weight row of `w` times the `T` activation rows `x` (packed as `p`, see [`Pack`]),
/// `R` weight rows at a time: `out[r * stride + t]` gets row `r`'s product with `x[t]`. The
/// `R` rows give the core independent chains of multiply-adds (and memory streams) when `T`
/// alone would leave it waiting, without changing any row's order of summation.
#[inline(always)]
fn weight_rows<S: Simd, const T: usize, const R: usize>(
    simd: S,
    w: &[f32],
    x: &[f32],
    p: &[S::f32s],
    stride: usize,
    out: &mut [f32],
) {
    let k = x.len() / T;
    let xs: [&[f32]; T] = core::array::from_fn(|t| &x[t * k..(t + 1) * k]);
    let mut rows = w.chunks_exact(k);
    let mut r = 0;
    while rows.len() >= R {
        let ws: [&[f32]; R] = core::array::from_fn(|_| rows.next().unwrap_or_default());
        let dots = row_dots::<S, T, R>(simd, ws, p, xs);
        for (j, d) in dots.iter().enumerate() {
            out[(r + j) * stride..][..T].copy_from_slice(d);
        }
        r += R;
    }
    for row in rows {
        out[r * stride..][..T].copy_from_slice(&row_dots::<S, T, 1>(simd, [row], p, xs)[0]);
        r += 1;
    }
}

/// `ws[r] · xs[t]` for `R` weight rows and `T` activation rows, all as long (`p` holds the
/// rows' whole vectors interleaved, see [`Pack`]): per pair one accumulator over the
/// SIMD-wide part in order, reduced, then the tail, whatever `R` and `T` are (so a result does
/// not depend on the batch or on its neighbours).
#[inline(always)]
fn row_dots<S: Simd, const T: usize, const R: usize>(
    simd: S,
    ws: [&[f32]; R],
    p: &[S::f32s],
    xs: [&[f32]; T],
) -> [[f32; T]; R] {
    let n = ws[0].len();
    let whs = ws.map(|w| S::as_simd_f32s(w).0);
    let wide = whs[0].len();
    let mut acc = [[simd.splat_f32s(0.0); T]; R];
    let lanes = std::mem::size_of::<S::f32s>() / 4;
    let per_line = (16 / lanes.max(1)).max(1);
    // The element the hints ask for, `i · lanes + PREFETCH_AHEAD / 4` from each row's start,
    // and how many rows' ends it has passed: past a row's end the hint moves on to the row
    // `R` further, which the next call reads in this row's place (the rows are consecutive in
    // memory), and so on. Counted as the loop goes: a division in the loop (the quotient
    // recomputed at every step) took as long as the multiply-adds of a step.
    let row = n.max(1);
    let mut ahead = PREFETCH_AHEAD / 4;
    let mut passed = ahead / row;
    let mut next_end = (passed + 1) * row;
    for (i, xv) in p[..wide * T].chunks_exact(T).enumerate() {
        if i % per_line == 0 {
            let at = ahead + passed * (R - 1) * row;
            for w in &ws {
                prefetch(w.as_ptr().wrapping_add(at));
            }
        }
        ahead += lanes;
        while ahead >= next_end {
            passed += 1;
            next_end += row;
        }
        // The weights in registers and one activation vector at a time: with the activations
        // loaded first, 8 of them beside 24 accumulators and a weight overflow AVX-512's 32
        // registers, and an accumulator spilled to the stack became the loop's critical path.
        let wv: [S::f32s; R] = core::array::from_fn(|r| whs[r][i]);
        for (t, x) in xv.iter().enumerate() {
            for r in 0..R {
                acc[r][t] = simd.mul_add_e_f32s(wv[r], *x, acc[r][t]);
            }
        }
    }
    let head = wide * lanes;
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let mut s = simd.reduce_sum_f32s(acc[r][t]);
            for (a, b) in ws[r][head..n].iter().zip(&xs[t][head..]) {
                s += a * b;
            }
            out[r][t] = s;
        }
    }
    out
}

/// Asks the CPU to start loading the cache line holding `p` into L2 (and the caches past it):
/// a hint, with no effect on any result. Into L1 (`T0`) instead, SmolLM2's f32 decode was
/// 15-20% slower at 1 and 8 sequences on this project's Zen 4 machines. The one `unsafe` of this module: the intrinsic takes a raw pointer.
#[inline(always)]
#[allow(unsafe_code)]
pub(super) fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and reads nothing into the program, whatever the
    // address (`p` may point past the slice; it is only a hint).
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T1 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_close, random_vec};

    #[test]
    fn dot_matches_sequential_sum_with_remainders() {
        for n in [0, 1, 15, 16, 17, 100] {
            let a = random_vec(n, 3);
            let b = random_vec(n, 4);
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - want).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn matmul_rows_matches_naive_and_a_row_does_not_depend_on_the_batch() {
        let (rows, cols) = (77, 129);
        let w = random_vec(rows * cols, 5);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 40] {
            let x = random_vec(m * cols, 6 + m as u64);
            let want: Vec<f32> = (0..m * rows)
                .map(|o| {
                    let (i, r) = (o / rows, o % rows);
                    (0..cols).map(|c| w[r * cols + c] * x[i * cols + c]).sum()
                })
                .collect();
            let mut out = vec![0.0; m * rows];
            pool.install(|| matmul_rows(&w, &x, m, &mut out));
            assert_close(&out, &want, 1e-4);
            for i in 0..m {
                let mut one = vec![0.0; rows];
                pool.install(|| matmul_rows(&w, &x[i * cols..(i + 1) * cols], 1, &mut one));
                assert_eq!(bits(&one), bits(&out[i * rows..(i + 1) * rows]), "m={m} row {i}");
            }
        }
    }
}
