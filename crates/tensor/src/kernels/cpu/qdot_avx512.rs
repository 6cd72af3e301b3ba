//! AVX-512 kernels for [`super::qmatrix::qmatmul`]: each block of 32 quantized weights is
//! dequantized into two registers of 16 f32 (elements 0..16 and 16..32) and multiplied into
//! the f32 activations of up to [`X_TILE`] rows at once, so the weights are read and
//! dequantized once per tile of rows.
//!
//! A 4-bit block's values are `d·q + m` for `q` in 0..16, so the kernel computes those 16
//! values once per block (multiplied, then added, exactly as
//! [`super::qmatrix::QMatrix::dequantize_row`] does) and picks each weight's value from them
//! with one permute per 16 weights, indexed by the nibbles: the weights are the same f32
//! values, for fewer instructions than converting every nibble to f32. The low nibbles are
//! elements 0..16 of the block and the high nibbles 16..32, which is one register each.
//!
//! Every (weight row, activation row) pair has one accumulator of 16 lanes, into which the
//! blocks are multiplied and added in order (the low half, then the high half), and which is
//! summed by [`hsum`]'s fixed tree: the operations on a pair do not depend on the other rows
//! of the tile, so a row's result is the same bits whatever tile it is computed in.
//!
//! A decoded row reads each weight once, so decode is limited by how fast the weights stream
//! in; the rows of a tile are short streams side by side, which the hardware prefetchers do
//! not follow well, so the kernels prefetch each row's quants [`PREFETCH`] bytes ahead (on
//! this project's machines that made the single-row product about 1.5× faster).
//!
//! One of the modules of the crate with `unsafe`: the kernels are compiled for AVX-512F, and
//! the safe entry point, a method of [`Avx512`], calls them because that token exists only
//! when the CPU has it; the loads take pointers into arrays of exactly one register's bytes.
//!
//! Needs Rust 1.89, where the AVX-512 intrinsics and target features became stable.
#![allow(unsafe_code)]

use super::qmatrix::{QBits, QMatrix};
use super::quant::BLOCK;
use core::arch::x86_64::*;

/// Activation rows multiplied together: with two weight rows, their 16 accumulators, the two
/// blocks' four registers and the constants fit in the 32 zmm registers.
pub(super) const X_TILE: usize = 8;
/// How far ahead of each row's quants the kernels prefetch, in bytes (several tiles of rows
/// ahead; 2 KiB was slower, 8 KiB no faster).
const PREFETCH: usize = 4096;
/// Weight rows dequantized together by [`Job::run_dequantized`]: their 24 accumulators against
/// a tile of [`X_TILE`] activation rows, a register of each weight row and an activation
/// register fit in the 32 zmm registers (each activation load then serves three rows; with
/// two, 32-row products of SmolLM2's shapes ran 10-25% slower).
const DEQ_ROWS: usize = 3;

/// The weight forms, as the kernels' const parameter (see [`QBits`]).
const EIGHT: u8 = 0;
const FOUR: u8 = 1;
const EIGHT16: u8 = 2;

/// Proof that the CPU has AVX-512F, which the kernels need.
#[derive(Clone, Copy, Debug)]
pub(super) struct Avx512(());

impl Avx512 {
    /// The token, when the CPU has AVX-512F.
    pub(super) fn try_new() -> Option<Self> {
        std::is_x86_feature_detected!("avx512f").then_some(Avx512(()))
    }

    /// Rows `first_row..` of [`super::qmatrix::qmatmul`] of `w` and `m` activation rows of
    /// `cols` values, as [`super::matvec::interleave`] lays them out in `packed` by 16 lanes
    /// and tiles of [`X_TILE`] (one row is its own interleaving; the kernels read a tile
    /// through one pointer at fixed offsets, where eight row pointers beside the weight rows'
    /// overflowed the general registers): `out` is `[rows of the task, m]`, `out[r · m + i]` the product of
    /// weight row `first_row + r` and activation row `i`.
    ///
    /// Lengths must agree (`packed.len() · 16 == m · cols`, `out.len()` a multiple of `m`,
    /// the rows in `w`); slicing panics otherwise.
    pub(super) fn rows(
        self,
        w: &QMatrix,
        packed: &[[f32; 16]],
        m: usize,
        first_row: usize,
        out: &mut [f32],
    ) {
        let (scales, mins, qs) = w.parts();
        let nb = w.dims().1 / BLOCK;
        let rows = out.len() / m;
        let packed = &packed[..m * 2 * nb];
        let job = Job { scales: &scales[first_row * nb..][..rows * nb], mins, qs, nb, packed, m };
        match w.bits() {
            QBits::Four => {
                let mins = &mins[first_row * nb..][..rows * nb];
                let qs = &qs[first_row * nb * 16..][..rows * nb * 16];
                // SAFETY: `self` exists only when the CPU has AVX-512F.
                unsafe { Job { mins, qs, ..job }.run::<FOUR>(out) }
            }
            QBits::Eight => {
                let qs = &qs[first_row * nb * 32..][..rows * nb * 32];
                // SAFETY: as above.
                unsafe { Job { qs, ..job }.run::<EIGHT>(out) }
            }
            QBits::Eight16 => {
                let scales = &scales[first_row * 2 * nb..][..rows * 2 * nb];
                let mins = match mins {
                    [] => mins,
                    all => &all[first_row * 2 * nb..][..rows * 2 * nb],
                };
                let qs = &qs[first_row * nb * 32..][..rows * nb * 32];
                // SAFETY: as above.
                unsafe { Job { scales, mins, qs, ..job }.run::<EIGHT16>(out) }
            }
        }
    }
}

impl Avx512 {
    /// Row `r` of `w`, dequantized into `out` (`cols` values): the values the kernels multiply
    /// by, the same bits as [`QMatrix::dequantize_row_scalar`], a block's two halves as two
    /// registers instead of 32 scalar multiply-adds (a prefill GEMM dequantizes every weight
    /// row of the model this way).
    ///
    /// # Panics
    /// When `out` is not `cols` long or the matrix has no row `r`.
    pub(super) fn dequantize_row(self, w: &QMatrix, r: usize, out: &mut [f32]) {
        let (scales, mins, qs) = w.parts();
        let nb = w.dims().1 / BLOCK;
        assert_eq!(
            out.len(),
            nb * BLOCK,
            "dequantize_row: {} values for a row of {}",
            out.len(),
            nb * BLOCK
        );
        let out = pulp::as_arrays_mut::<16, f32>(out).0;
        let job = Job { scales, mins, qs, nb, packed: &[], m: 0 };
        match w.bits() {
            QBits::Four => {
                // SAFETY: `self` exists only when the CPU has AVX-512F.
                unsafe { job.dequantize::<FOUR>(r, out) }
            }
            QBits::Eight => {
                // SAFETY: as above.
                unsafe { job.dequantize::<EIGHT>(r, out) }
            }
            QBits::Eight16 => {
                // SAFETY: as above.
                unsafe { job.dequantize::<EIGHT16>(r, out) }
            }
        }
    }
}

/// A task's weight rows and every activation row.
#[derive(Clone, Copy)]
struct Job<'a> {
    /// The task's rows' scales, `nb` per row (`2 · nb` for [`QBits::Eight16`]).
    scales: &'a [f32],
    /// Their minimums, as many as the scales (4-bit weights, and `Eight16` ones with
    /// minimums) or none.
    mins: &'a [f32],
    /// Their quants, `nb · 16` (4-bit) or `nb · 32` bytes per row.
    qs: &'a [u8],
    /// Blocks per row.
    nb: usize,
    /// The activations, 16 values per array, `2 · nb` arrays per row, interleaved by
    /// [`super::matvec::interleave`].
    packed: &'a [[f32; 16]],
    m: usize,
}

/// One weight row's blocks: `qs` holds 16 bytes per block (4-bit) or 32 (8-bit); a scale per
/// block (two for `Eight16`) and as many minimums or none.
#[derive(Clone, Copy)]
struct Row<'a> {
    scales: &'a [f32],
    mins: &'a [f32],
    qs: &'a [[u8; 16]],
}

impl<'a> Job<'a> {
    /// Weight row `r` of the task, for weights of form `K`.
    #[inline(always)]
    fn row<const K: u8>(&self, r: usize) -> Row<'a> {
        let nb = self.nb;
        let per_block = if K == FOUR { 1 } else { 2 };
        let ns = if K == EIGHT16 { 2 * nb } else { nb };
        let qs = pulp::as_arrays::<16, u8>(self.qs).0;
        Row {
            scales: &self.scales[r * ns..][..ns],
            mins: if K == EIGHT || self.mins.is_empty() { &[] } else { &self.mins[r * ns..][..ns] },
            qs: &qs[r * nb * per_block..][..nb * per_block],
        }
    }

    /// Weight row `r` (of the whole matrix: the job's slices start at row 0) of form `K`,
    /// dequantized into `out` (`2 · nb` arrays).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn dequantize<const K: u8>(self, r: usize, out: &mut [[f32; 16]]) {
        let with_mins = K == FOUR || (K == EIGHT16 && !self.mins.is_empty());
        let row = self.row::<K>(r);
        let out = &mut out[..2 * self.nb];
        for b in 0..self.nb {
            // SAFETY: `b < nb`, and `Job::row` sliced the row's `nb` blocks with their scales,
            // and minimums exactly when `with_mins` (or panicked).
            let [lo, hi] = unsafe { block::<K>(row, b, with_mins) };
            // SAFETY: `2 · b + 1 < 2 · nb`, the length of `out`; the stores need no alignment.
            unsafe {
                _mm512_storeu_ps(out[2 * b].as_mut_ptr(), lo);
                _mm512_storeu_ps(out[2 * b + 1].as_mut_ptr(), hi);
            }
        }
    }

    /// Every activation row, in tiles of up to [`X_TILE`], each against `R` weight rows at a
    /// time: 2 (two chains of multiply-adds for the core, and for more rows each activation
    /// load serves two; on the model's shapes this was faster than 1 for every tile size, and
    /// 3 runs out of registers). A lone row took 4 before: each row is three streams from
    /// memory (scales, minimums, quants), and 12 of them were more than the core's prefetchers
    /// kept up with (an 8B-shaped `Q4_K` model's decode on 2 threads went from 3.2 to 3.9
    /// tokens/s, 4.1 with the scales' prefetch of [`row_dots`]). The sums are the same for
    /// every tile.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn run<const K: u8>(self, out: &mut [f32]) {
        if self.m > X_TILE {
            // SAFETY: the caller's promise.
            return unsafe { self.run_dequantized::<K>(out) };
        }
        let mut i = 0;
        while i < self.m {
            let t = (self.m - i).min(X_TILE);
            match t {
                1 => self.tile::<1, 2, K>(i, out),
                2 => self.tile::<2, 2, K>(i, out),
                3 => self.tile::<3, 2, K>(i, out),
                4 => self.tile::<4, 2, K>(i, out),
                5 => self.tile::<5, 2, K>(i, out),
                6 => self.tile::<6, 2, K>(i, out),
                7 => self.tile::<7, 2, K>(i, out),
                _ => self.tile::<8, 2, K>(i, out),
            }
            i += t;
        }
    }

    /// [`Job::run`] for more than one tile of activation rows: each group of [`DEQ_ROWS`]
    /// weight rows is dequantized once, into registers' worth of memory that stays in L1 (the
    /// values the in-register kernels compute, block by block), and multiplied from there into
    /// every tile, instead of dequantized again for each tile. Each (weight row, activation
    /// row) pair's multiply-adds are those of [`row_dots`], in the same order, so the bits are
    /// the same.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn run_dequantized<const K: u8>(self, out: &mut [f32]) {
        let g = 2 * self.nb;
        let rows = out.len() / self.m;
        let with_mins = K == FOUR || (K == EIGHT16 && !self.mins.is_empty());
        let mut deq = vec![_mm512_setzero_ps(); DEQ_ROWS * g];
        let mut r = 0;
        while r < rows {
            let group = (rows - r).min(DEQ_ROWS);
            for j in 0..group {
                let row = self.row::<K>(r + j);
                for b in 0..self.nb {
                    prefetch_ahead::<K>(row, b);
                    // SAFETY: `b < nb`, and `Job::row` sliced the row's `nb` blocks with their
                    // scales, and minimums exactly when `with_mins` (or panicked).
                    let [lo, hi] = unsafe { block::<K>(row, b, with_mins) };
                    deq[j * g + 2 * b] = lo;
                    deq[j * g + 2 * b + 1] = hi;
                }
            }
            match group {
                1 => self.deq_tiles::<1>(&deq, r, out),
                2 => self.deq_tiles::<2>(&deq, r, out),
                _ => self.deq_tiles::<DEQ_ROWS>(&deq, r, out),
            }
            r += group;
        }
    }

    /// Every tile of activation rows times the `R` dequantized weight rows in `deq` (rows
    /// `r..r + R` of the task).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn deq_tiles<const R: usize>(self, deq: &[__m512], r: usize, out: &mut [f32]) {
        let mut i = 0;
        while i < self.m {
            let t = (self.m - i).min(X_TILE);
            match t {
                1 => self.deq_tile::<1, R>(deq, r, i, out),
                2 => self.deq_tile::<2, R>(deq, r, i, out),
                3 => self.deq_tile::<3, R>(deq, r, i, out),
                4 => self.deq_tile::<4, R>(deq, r, i, out),
                5 => self.deq_tile::<5, R>(deq, r, i, out),
                6 => self.deq_tile::<6, R>(deq, r, i, out),
                7 => self.deq_tile::<7, R>(deq, r, i, out),
                _ => self.deq_tile::<8, R>(deq, r, i, out),
            }
            i += t;
        }
    }

    /// Activation rows `first..first + T` times the `R` dequantized weight rows in `deq`
    /// (`2 · nb` registers each, rows `r..r + R` of the task), into `out[r · m + first + t]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    // `v` indexes `R` weight rows and `T` activation rows in lockstep.
    #[allow(clippy::needless_range_loop)]
    fn deq_tile<const T: usize, const R: usize>(
        self,
        deq: &[__m512],
        r: usize,
        first: usize,
        out: &mut [f32],
    ) {
        let g = 2 * self.nb;
        // Arrays filled by loops, not `core::array::from_fn`: its closure is compiled without
        // this function's target features, so it is called instead of inlined (a call per
        // step of the loop below).
        let mut ws: [&[__m512]; R] = [&deq[..g]; R];
        for (j, w) in ws.iter_mut().enumerate() {
            *w = &deq[j * g..][..g];
        }
        let p = &self.packed[first * g..][..T * g];
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for (v, xv) in p.chunks_exact(T).enumerate() {
            let mut w = [_mm512_setzero_ps(); R];
            for j in 0..R {
                w[j] = ws[j][v];
            }
            for t in 0..T {
                // SAFETY: `t < T`, the length of the chunk (array `v` of the tile's rows).
                let x = unsafe { load(xv.as_ptr().add(t)) };
                for j in 0..R {
                    acc[j][t] = _mm512_fmadd_ps(w[j], x, acc[j][t]);
                }
            }
        }
        for j in 0..R {
            for t in 0..T {
                out[(r + j) * self.m + first + t] = hsum(acc[j][t]);
            }
        }
    }

    /// Activation rows `first..first + T` times every weight row of the task, `R` weight rows
    /// at a time, into `out[r · m + first + t]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn tile<const T: usize, const R: usize, const K: u8>(self, first: usize, out: &mut [f32]) {
        let g = 2 * self.nb;
        let xs = &self.packed[first * g..][..T * g];
        let rows = out.len() / self.m;
        let mut r = 0;
        while r + R <= rows {
            let mut rows = [self.row::<K>(r); R];
            for (j, row) in rows.iter_mut().enumerate().skip(1) {
                *row = self.row::<K>(r + j);
            }
            let dots = row_dots::<T, R, K>(rows, xs);
            for (j, d) in dots.iter().enumerate() {
                out[(r + j) * self.m + first..][..T].copy_from_slice(d);
            }
            r += R;
        }
        for r in r..rows {
            let [d] = row_dots::<T, 1, K>([self.row::<K>(r)], xs);
            out[r * self.m + first..][..T].copy_from_slice(&d);
        }
    }
}

/// `rows[r] · x[t]` for `R` weight rows and `T` activation rows (each `2 · nb` arrays of 16,
/// interleaved in `xs` as [`super::matvec::interleave`] lays out a tile), one accumulator per
/// pair.
///
/// # Panics
/// When the rows do not all hold `nb` blocks, or `xs` is not `T` rows of `2 · nb` arrays.
#[target_feature(enable = "avx512f")]
#[inline]
fn row_dots<const T: usize, const R: usize, const K: u8>(
    rows: [Row<'_>; R],
    xs: &[[f32; 16]],
) -> [[f32; T]; R] {
    let per_block = if K == FOUR { 1 } else { 2 };
    let nb = rows[0].qs.len() / per_block;
    let ns = if K == EIGHT16 { 2 * nb } else { nb };
    let with_mins = K == FOUR || (K == EIGHT16 && !rows[0].mins.is_empty());
    assert!(rows.iter().all(|r| {
        r.scales.len() == ns
            && r.qs.len() == per_block * nb
            && r.mins.len() == if with_mins { ns } else { 0 }
    }));
    assert_eq!(xs.len(), T * 2 * nb);
    // A pointer, checked above: with slices, every load would keep its bounds check.
    let xs = xs.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for b in 0..nb {
        for r in 0..R {
            if T == 1 {
                // A lone row's scales and minimums too: left to the hardware, their streams
                // stalled the loads. (With a tile of 8 rows, 8 streams of SmolLM2 ran 5%
                // slower with them.)
                prefetch_ahead::<K>(rows[r], b);
            } else {
                prefetch_quants::<K>(rows[r], b);
            }
            // SAFETY: `b < nb`, and the row holds `nb` blocks (checked above).
            let [lo, hi] = unsafe { block::<K>(rows[r], b, with_mins) };
            for (t, a) in acc[r].iter_mut().enumerate() {
                // SAFETY: `(2 · b + 1) · T + t < 2 · nb · T`, the length of `xs`.
                let (xl, xh) =
                    unsafe { (load(xs.add(2 * b * T + t)), load(xs.add((2 * b + 1) * T + t))) };
                *a = _mm512_fmadd_ps(lo, xl, *a);
                *a = _mm512_fmadd_ps(hi, xh, *a);
            }
        }
    }
    let mut out = [[0.0; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = hsum(acc[r][t]);
        }
    }
    out
}

/// Asks for the quants of a row of form `K` [`PREFETCH`] bytes past block `b`'s: a hint only
/// (the address may lie past the matrix, which a prefetch does not fault on; `wrapping_add`
/// keeps the pointer arithmetic defined).
#[target_feature(enable = "avx512f")]
#[inline]
fn prefetch_quants<const K: u8>(row: Row<'_>, b: usize) {
    let per_block = if K == FOUR { 1 } else { 2 };
    let ahead = row.qs.as_ptr().wrapping_add(b * per_block).cast::<i8>();
    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(PREFETCH));
}

/// [`prefetch_quants`], and the row's scales and minimums, a line (16 of them) at a time, at
/// least as many blocks ahead (4 or 8 bytes a block against 16 or 32): each row is three
/// streams from memory, which the core's prefetchers alone did not keep up with.
#[target_feature(enable = "avx512f")]
#[inline]
fn prefetch_ahead<const K: u8>(row: Row<'_>, b: usize) {
    prefetch_quants::<K>(row, b);
    let per_scale = if K == EIGHT16 { 2 } else { 1 };
    if (b * per_scale).is_multiple_of(16) {
        for p in [row.scales.as_ptr(), row.mins.as_ptr()] {
            let at = p.wrapping_add(b * per_scale).cast::<i8>();
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH / 4));
        }
    }
}

/// Block `b` of a row of form `K` (with its minimums when `with_mins`), dequantized: elements
/// 0..16 and 16..32.
///
/// # Safety
/// The CPU has AVX-512F, and the row has more than `b` blocks (with their scales, and
/// minimums when `with_mins`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block<const K: u8>(row: Row<'_>, b: usize, with_mins: bool) -> [__m512; 2] {
    // SAFETY: the caller's promise.
    unsafe {
        match K {
            FOUR => q4_block(row, b),
            EIGHT16 if with_mins => q8x16_block::<true>(row, b),
            EIGHT16 => q8x16_block::<false>(row, b),
            _ => q8_block(row, b),
        }
    }
}

/// Block `b` of a 4-bit row: `d·q + m` for the 16 values of `q`, then each nibble's value.
///
/// # Safety
/// The CPU has AVX-512F, and the row has more than `b` blocks.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn q4_block(row: Row<'_>, b: usize) -> [__m512; 2] {
    let steps = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    // SAFETY: the row has more than `b` blocks, by the caller's promise.
    let (d, m, q) = unsafe {
        (*row.scales.get_unchecked(b), *row.mins.get_unchecked(b), row.qs.as_ptr().add(b))
    };
    let values = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), steps), _mm512_set1_ps(m));
    // One byte per lane: the permute reads the low 4 bits of each lane, the low nibble.
    // SAFETY: `q` points to the block's 16 bytes.
    let q = _mm512_cvtepu8_epi32(unsafe { load_bytes(q) });
    [_mm512_permutexvar_ps(q, values), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), values)]
}

/// Block `b` of an 8-bit row: `d·q`.
///
/// # Safety
/// The CPU has AVX-512F, and the row has more than `b` blocks.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn q8_block(row: Row<'_>, b: usize) -> [__m512; 2] {
    // SAFETY: the row has more than `b` blocks of two arrays of 16 bytes, by the caller's
    // promise.
    let (d, q) = unsafe { (*row.scales.get_unchecked(b), row.qs.as_ptr().add(2 * b)) };
    let d = _mm512_set1_ps(d);
    // SAFETY: `q` and the array after it are the block's 32 bytes.
    let (lo, hi) = unsafe { (load_bytes(q), load_bytes(q.add(1))) };
    [
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))),
        _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))),
    ]
}

/// Block `b` of an 8-bit row with a scale per 16 weights: `d·q`, plus `m` with `MINS`.
///
/// # Safety
/// The CPU has AVX-512F, and the row has more than `b` blocks, two scales each (and two
/// minimums with `MINS`).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn q8x16_block<const MINS: bool>(row: Row<'_>, b: usize) -> [__m512; 2] {
    // SAFETY: the row has more than `b` blocks of two arrays of 16 bytes and two scales (and
    // minimums), by the caller's promise.
    let (d, q) = unsafe { (row.scales.as_ptr().add(2 * b), row.qs.as_ptr().add(2 * b)) };
    // SAFETY: as above: `d` and the scale after it are the block's.
    let (d0, d1) = unsafe { (_mm512_set1_ps(*d), _mm512_set1_ps(*d.add(1))) };
    // SAFETY: `q` and the array after it are the block's 32 bytes.
    let (lo, hi) = unsafe { (load_bytes(q), load_bytes(q.add(1))) };
    let lo = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    let hi = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
    if !MINS {
        return [lo, hi];
    }
    // SAFETY: with `MINS` the row has two minimums per block, by the caller's promise.
    let m = unsafe { row.mins.as_ptr().add(2 * b) };
    // SAFETY: as above.
    let (m0, m1) = unsafe { (_mm512_set1_ps(*m), _mm512_set1_ps(*m.add(1))) };
    [_mm512_add_ps(lo, m0), _mm512_add_ps(hi, m1)]
}

/// The 16 bytes at `q` as a register.
///
/// # Safety
/// The CPU has AVX-512F, and `q` points into a live array.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_bytes(q: *const [u8; 16]) -> __m128i {
    // SAFETY: the caller's promise; the load has no alignment requirement.
    unsafe { _mm_loadu_si128(q.cast()) }
}

/// The 16 floats at `x` as a register.
///
/// # Safety
/// The CPU has AVX-512F, and `x` points into a live array.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load(x: *const [f32; 16]) -> __m512 {
    // SAFETY: the caller's promise; the load has no alignment requirement.
    unsafe { _mm512_loadu_ps(x.cast()) }
}

/// The sum of the 16 lanes as a fixed tree: lanes `l` and `l + 8` first, then `l` and `l + 4`,
/// `l` and `l + 2`, and the last two (the twin of the tests' scalar reference).
#[target_feature(enable = "avx512f")]
#[inline]
fn hsum(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2)))
}
