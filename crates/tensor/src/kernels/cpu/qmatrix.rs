//! Weight matrices kept block-quantized, and their products with f32 activations.
//!
//! Quantization is a storage format only: products multiply f32 activations by the
//! dequantized weights (`d·q + m`, the values [`QMatrix::dequantize`] gives), dequantized in
//! registers block by block, so every path (decode, a batch, a prefill chunk) computes f32
//! products of the same weight values and differs only in summation order. Decode reads every
//! weight once, so its speed is the memory bandwidth divided by the weight bytes: 4-bit
//! weights move 7× fewer bytes than f32, and a batch of rows reads them once per tile.
//! Kernels are chosen at run time, without `target-cpu=native`: AVX-512 (`qdot_avx512`) when
//! the CPU has AVX-512F, else AVX2 (`qdot_avx2`, through `pulp`), else portable code; the same
//! family for every batch size, so a row's bits do not depend on how many rows share a call.
//!
//! Storage is repacked at load: scales (and minimums) as f32 arrays, quants as bytes, all in
//! row-major block order. Q4_0 is stored as Q4_1 with minimum `-8·d`, so one 4-bit kernel
//! serves both. Formats whose quants do not fit a nibble or whose scales change every 16
//! weights (Q6_K, Q5_K, Q2_K, Q5_1, IQ4_XS) are kept as one signed byte per weight with a scale
//! (and a minimum) per 16 weights ([`QBits::Eight16`]), the same values as ggml's. The three
//! arrays are [`Storage`], so a matrix can live in arena memory.

use super::quant::{BlockFormat, BLOCK};
use crate::error::Result;
use crate::memory::{Arena, WeightBuffers};
use crate::tensor::Storage;
use half::f16;
use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;

/// Weight rows per parallel task in [`qmatmul`].
const ROWS_PER_TASK: usize = 32;

/// Bits per quantized weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QBits {
    /// One signed byte per weight: `w = d · q`.
    Eight,
    /// One nibble per weight (low nibbles are elements 0..16 of a block, high 16..32):
    /// `w = d · q + m`.
    Four,
    /// One signed byte per weight with a scale per 16 weights, and a minimum per 16 unless
    /// the matrix has none: `w = d · q + m` (or `d · q`).
    Eight16,
}

/// A block-quantized `[rows, cols]` matrix (`cols` a multiple of 32).
#[derive(Clone, Debug, PartialEq)]
pub struct QMatrix {
    bits: QBits,
    rows: usize,
    cols: usize,
    /// One per block of 32 weights, or per 16 ([`QBits::Eight16`]).
    scales: Storage<f32>,
    /// As many as the scales for 4-bit weights, none for 8-bit ones, either for
    /// [`QBits::Eight16`].
    mins: Storage<f32>,
    qs: Storage<u8>,
}

impl QMatrix {
    /// Repacks GGML blocks (`rows` rows of `cols / 32` blocks of `format`, row-major).
    ///
    /// Returns `None` when `cols` is not a multiple of 32 or the byte count is wrong.
    pub fn from_blocks(
        format: BlockFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Option<Self> {
        let nb = rows * (cols / BLOCK);
        if !cols.is_multiple_of(BLOCK) || bytes.len() != nb * format.block_bytes() {
            return None;
        }
        let f16_at = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        let blocks = bytes.chunks_exact(format.block_bytes());
        let mut scales = Vec::with_capacity(nb);
        let (bits, mins, qs) = match format {
            BlockFormat::Q8_0 => {
                let mut qs = Vec::with_capacity(nb * BLOCK);
                for b in blocks {
                    scales.push(f16_at(b, 0));
                    qs.extend_from_slice(&b[2..34]);
                }
                (QBits::Eight, Vec::new(), qs)
            }
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                let mut mins = Vec::with_capacity(nb);
                let mut qs = Vec::with_capacity(nb * BLOCK / 2);
                for b in blocks {
                    let d = f16_at(b, 0);
                    scales.push(d);
                    if format == BlockFormat::Q4_1 {
                        mins.push(f16_at(b, 2));
                        qs.extend_from_slice(&b[4..20]);
                    } else {
                        mins.push(-8.0 * d);
                        qs.extend_from_slice(&b[2..18]);
                    }
                }
                (QBits::Four, mins, qs)
            }
        };
        Some(QMatrix::from_parts(bits, rows, cols, scales, mins, qs))
    }

    /// A 4-bit matrix from its parts, per block of 32 weights (row-major): `w = d·q + m`
    /// with one scale `d` and one minimum `m` per block and 16 bytes of nibbles (byte `j`
    /// holds element `j` low, `j + 16` high). Formats with other blocks (Q4_K's 256-weight
    /// super-blocks of eight 32-weight sub-blocks) repack to this.
    ///
    /// Returns `None` when `cols` is not a multiple of 32 or a part has the wrong length.
    pub fn four_bit(
        rows: usize,
        cols: usize,
        scales: Vec<f32>,
        mins: Vec<f32>,
        qs: Vec<u8>,
    ) -> Option<Self> {
        let nb = rows * (cols / BLOCK);
        let fits = cols.is_multiple_of(BLOCK)
            && scales.len() == nb
            && mins.len() == nb
            && qs.len() == nb * BLOCK / 2;
        fits.then(|| QMatrix::from_parts(QBits::Four, rows, cols, scales, mins, qs))
    }

    /// A matrix of one signed byte per weight (`qs`, row-major) with a scale per 16 weights and
    /// a minimum per 16 (or none: `mins` empty): `w = d·q + m`, or `d·q`. Formats with finer
    /// scales or more levels than a nibble (Q6_K, Q5_K, Q2_K, Q5_1, IQ4_XS) repack to this.
    ///
    /// Returns `None` when `cols` is not a multiple of 32 or a part has the wrong length.
    pub fn eight16(
        rows: usize,
        cols: usize,
        scales: Vec<f32>,
        mins: Vec<f32>,
        qs: Vec<u8>,
    ) -> Option<Self> {
        let groups = rows * (cols / 16);
        let fits = cols.is_multiple_of(BLOCK)
            && scales.len() == groups
            && (mins.is_empty() || mins.len() == groups)
            && qs.len() == rows * cols;
        fits.then(|| QMatrix::from_parts(QBits::Eight16, rows, cols, scales, mins, qs))
    }

    /// Scales (and minimums, where there are any) per row, and quant bytes per row.
    fn per_row(&self) -> (usize, usize, usize) {
        let nb = self.cols / BLOCK;
        let per_scale = if self.bits == QBits::Eight16 { 2 * nb } else { nb };
        let mins = if self.mins.is_empty() { 0 } else { per_scale };
        let qs = if self.bits == QBits::Four { self.cols / 2 } else { self.cols };
        (per_scale, mins, qs)
    }

    fn from_parts(
        bits: QBits,
        rows: usize,
        cols: usize,
        scales: Vec<f32>,
        mins: Vec<f32>,
        qs: Vec<u8>,
    ) -> Self {
        let (scales, mins, qs) = (Storage::Owned(scales), Storage::Owned(mins), Storage::Owned(qs));
        QMatrix { bits, rows, cols, scales, mins, qs }
    }

    /// The matrix made of rows `order[0]`, `order[1]`, ... of this one.
    ///
    /// Indices must be below `rows`; callers check.
    pub fn select_rows(&self, order: &[usize]) -> QMatrix {
        let (ns, nm, nq) = self.per_row();
        let (scales, mins, qs) = (self.scales.as_slice(), self.mins.as_slice(), self.qs.as_slice());
        let (mut out_scales, mut out_mins, mut out_qs) = (Vec::new(), Vec::new(), Vec::new());
        for &r in order {
            out_scales.extend_from_slice(&scales[r * ns..(r + 1) * ns]);
            out_mins.extend_from_slice(&mins[r * nm..(r + 1) * nm]);
            out_qs.extend_from_slice(&qs[r * nq..(r + 1) * nq]);
        }
        QMatrix::from_parts(self.bits, order.len(), self.cols, out_scales, out_mins, out_qs)
    }

    /// The rows of `parts` stacked in order, or `None` when the parts differ in width or bits.
    pub fn concat_rows(parts: &[&QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        let differ = |p: &&QMatrix| {
            p.cols != first.cols
                || p.bits != first.bits
                || p.mins.is_empty() != first.mins.is_empty()
        };
        if parts.iter().any(differ) {
            return None;
        }
        let (mut rows, mut scales, mut mins, mut qs) = (0, Vec::new(), Vec::new(), Vec::new());
        for p in parts {
            rows += p.rows;
            scales.extend_from_slice(p.scales.as_slice());
            mins.extend_from_slice(p.mins.as_slice());
            qs.extend_from_slice(p.qs.as_slice());
        }
        Some(QMatrix::from_parts(first.bits, rows, first.cols, scales, mins, qs))
    }

    /// A copy with the scales, minimums and quants (in this order) in memory from `arena`
    /// (see [`Storage::copy_to`]).
    ///
    /// # Errors
    /// As [`Storage::copy_to`].
    pub fn copy_to(&self, arena: &dyn Arena) -> Result<QMatrix> {
        Ok(QMatrix {
            bits: self.bits,
            rows: self.rows,
            cols: self.cols,
            scales: self.scales.copy_to(arena)?,
            mins: self.mins.copy_to(arena)?,
            qs: self.qs.copy_to(arena)?,
        })
    }

    /// `(rows, cols)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The weight width.
    pub fn bits(&self) -> QBits {
        self.bits
    }

    /// The repacked arrays in row-major block order: one scale per block (per 16 weights for
    /// [`QBits::Eight16`]), as many minimums (none for 8-bit weights, none or as many for
    /// `Eight16`), and the quants (one byte per 8-bit weight; for 4-bit weights 16 bytes per
    /// block, elements 0..16 in the low nibbles, 16..32 in the high ones).
    pub fn parts(&self) -> (&[f32], &[f32], &[u8]) {
        (self.scales.as_slice(), self.mins.as_slice(), self.qs.as_slice())
    }

    /// Bytes held (quants, scales and minimums).
    pub fn nbytes(&self) -> usize {
        self.qs.len() + 4 * (self.scales.len() + self.mins.len())
    }

    /// Dequantizes row `r` into `out` (`cols` values), with AVX-512 when the CPU has it: the
    /// same bits either way.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(k) = super::qdot_avx512::Avx512::try_new() {
            return k.dequantize_row(self, r, out);
        }
        self.dequantize_row_scalar(r, out);
    }

    /// [`QMatrix::dequantize_row`] one value at a time: `d·q` (plus `m`), multiplied, then
    /// added, as the kernels do.
    pub(crate) fn dequantize_row_scalar(&self, r: usize, out: &mut [f32]) {
        let nb = self.cols / BLOCK;
        let (scales, mins, qs) = (self.scales.as_slice(), self.mins.as_slice(), self.qs.as_slice());
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            let bi = r * nb + b;
            let d = scales.get(bi).copied().unwrap_or_default();
            match self.bits {
                QBits::Eight => {
                    for (x, &q) in o.iter_mut().zip(&qs[bi * BLOCK..(bi + 1) * BLOCK]) {
                        *x = d * f32::from(q as i8);
                    }
                }
                QBits::Four => {
                    let m = mins[bi];
                    for (j, &q) in qs[bi * 16..(bi + 1) * 16].iter().enumerate() {
                        o[j] = d * f32::from(q & 15) + m;
                        o[j + 16] = d * f32::from(q >> 4) + m;
                    }
                }
                QBits::Eight16 => {
                    let qs = &qs[bi * BLOCK..(bi + 1) * BLOCK];
                    for (h, (o, q)) in o.chunks_exact_mut(16).zip(qs.chunks_exact(16)).enumerate() {
                        let d = scales[2 * bi + h];
                        for (x, &q) in o.iter_mut().zip(q) {
                            *x = d * f32::from(q as i8);
                        }
                        if let Some(&m) = mins.get(2 * bi + h) {
                            o.iter_mut().for_each(|x| *x += m);
                        }
                    }
                }
            }
        }
    }

    /// The whole matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        out.par_chunks_mut(self.cols.max(1))
            .enumerate()
            .for_each(|(r, row)| self.dequantize_row(r, row));
        out
    }
}

/// The buffers in the order scales, minimums (4-bit weights only), quants.
impl WeightBuffers for QMatrix {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.scales.buffers(out);
        self.mins.buffers(out);
        self.qs.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> Result<()> {
        *self = self.copy_to(arena)?;
        Ok(())
    }
}

/// Activation rows multiplied together by the AVX2 kernels: each weight block is dequantized
/// once per tile (one accumulator per row, the block's four registers and the constants fit
/// AVX2's 16).
const X_TILE: usize = 8;

/// `out[i, r] = x[i, :] · w[r, :]` for the `m` rows of `x` (`[m, cols]`, row-major) into
/// `out` (`[m, rows]`), in the current rayon pool: f32 products of the dequantized weights
/// (dequantized in registers, block by block, never into a matrix), so the result differs
/// from the f32 product with [`QMatrix::dequantize`]'s matrix only by summation order. Each
/// weight block is read once per tile of up to 8 rows, so a batch of decode rows costs little
/// more memory traffic than one.
///
/// The kernels are the widest the CPU has (AVX-512F, else AVX2 with FMA, else portable code),
/// the same for every `m`. A row's result does not depend on the other rows of `x`: a sequence
/// decoded alone or in a batch gets the same bits.
///
/// Lengths must agree (`x.len() == m * cols`, `out.len() == m * rows`); callers check.
pub fn qmatmul(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    qmatmul_with(w, x, m, out, Kernels::Avx512);
}

/// The kernel families of [`qmatmul`], narrowest first.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kernels {
    /// Plain Rust (`pulp`'s dispatch), in the AVX2 kernels' lane order.
    Portable,
    /// AVX2 and FMA, 8 lanes per accumulator.
    Avx2,
    /// AVX-512F, 16 lanes per accumulator.
    Avx512,
}

/// [`qmatmul`] on the widest kernels the CPU has, but no wider than `widest` (so tests cover
/// the narrower ones too); returns the kernels that ran (`Portable` when there was nothing to
/// compute).
fn qmatmul_with(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32], widest: Kernels) -> Kernels {
    if m == 0 || w.rows == 0 {
        return Kernels::Portable;
    }
    tasks(w, x, m, out, widest)
}

/// [`qmatmul_with`]'s tasks, which own ranges of weight rows (see
/// [`super::shared_out::by_weight_rows`]), into `out`.
#[cfg(target_arch = "x86_64")]
fn tasks(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32], widest: Kernels) -> Kernels {
    use super::qdot_avx512::Avx512;
    use super::shared_out::by_weight_rows;
    if let Some(k) = Avx512::try_new().filter(|_| widest >= Kernels::Avx512) {
        // Interleaved once per product (one row is its own interleaving).
        let owned;
        let packed = if m == 1 {
            pulp::as_arrays::<16, f32>(&x[..w.cols]).0
        } else {
            owned = super::matvec::interleave(&x[..m * w.cols], m, 16, super::qdot_avx512::X_TILE);
            pulp::as_arrays::<16, f32>(&owned).0
        };
        by_weight_rows(w.rows, m, ROWS_PER_TASK, out, |first, part| {
            k.rows(w, packed, m, first, part);
        });
        return Kernels::Avx512;
    }
    if let Some(v3) = pulp::x86::V3::try_new().filter(|_| widest >= Kernels::Avx2) {
        // The activations as registers, converted once: the kernels then load them directly.
        let x: Vec<core::arch::x86_64::__m256> =
            pulp::as_arrays::<8, f32>(x).0.iter().map(|a| pulp::cast(*a)).collect();
        let x = &x[..];
        by_weight_rows(w.rows, m, ROWS_PER_TASK, out, |first_row, part| {
            <pulp::x86::V3 as Simd>::vectorize(v3, Avx2Rows { v3, w, x, m, first_row, out: part });
        });
        return Kernels::Avx2;
    }
    portable(w, x, m, out);
    Kernels::Portable
}

/// [`qmatmul_with`]'s tasks, into `out`.
#[cfg(not(target_arch = "x86_64"))]
fn tasks(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32], _widest: Kernels) -> Kernels {
    portable(w, x, m, out);
    Kernels::Portable
}

/// [`qmatmul_with`]'s tasks on the portable kernels, into `out`.
fn portable(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    let arch = Arch::new();
    super::shared_out::by_weight_rows(w.rows, m, ROWS_PER_TASK, out, |first_row, part| {
        arch.dispatch(RowsOp { w, x, m, first_row, out: part });
    });
}

/// Rows `first_row..` of [`qmatmul`] on portable code: `out` is `[rows of the task, m]`.
struct RowsOp<'a> {
    w: &'a QMatrix,
    x: &'a [f32],
    m: usize,
    first_row: usize,
    out: &'a mut [f32],
}

impl WithSimd for RowsOp<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _simd: S) -> Self::Output {
        let RowsOp { w, x, m, first_row, out } = self;
        let cols = w.cols;
        let mut row = vec![0f32; cols];
        for (j, o) in out.chunks_exact_mut(m).enumerate() {
            w.dequantize_row(first_row + j, &mut row);
            for (i, o) in o.iter_mut().enumerate() {
                *o = dot_lanes(&row, &x[i * cols..(i + 1) * cols]);
            }
        }
    }
}

/// `Σ w[j]·x[j]` in the lane order of the AVX2 kernels (one accumulator of 8 lanes), without
/// fused multiply-adds.
#[inline(always)]
fn dot_lanes(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (wq, xq) in w.chunks_exact(8).zip(x.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += wq[l] * xq[l];
        }
    }
    acc.iter().sum()
}

/// Rows `first_row..` of [`qmatmul`] on the AVX2 kernels: `out` is `[rows of the task, m]`.
#[cfg(target_arch = "x86_64")]
struct Avx2Rows<'a> {
    v3: pulp::x86::V3,
    w: &'a QMatrix,
    /// The activations, 8 per register.
    x: &'a [core::arch::x86_64::__m256],
    m: usize,
    first_row: usize,
    out: &'a mut [f32],
}

#[cfg(target_arch = "x86_64")]
impl WithSimd for Avx2Rows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _simd: S) -> Self::Output {
        use super::qdot_avx2::{Q4Row, Q8Row, Q8x16Row};
        let Avx2Rows { v3, w, x, m, first_row, out } = self;
        let (cols, nb) = (w.cols, w.cols / BLOCK);
        let (w_scales, w_mins, w_qs) = (w.scales.as_slice(), w.mins.as_slice(), w.qs.as_slice());
        let scales = move |r: usize| &w_scales[(first_row + r) * nb..][..nb];
        let tiles = Avx2Tiles { v3, x, groups: cols / 8, m, rows: out.len() / m };
        match w.bits {
            QBits::Eight => tiles.run(
                |r| {
                    let qs = &w_qs[(first_row + r) * cols..][..cols];
                    Q8Row { qs: pulp::as_arrays::<32, u8>(qs).0, scales: scales(r) }
                },
                out,
            ),
            QBits::Four => tiles.run(
                |r| {
                    let qs = &w_qs[(first_row + r) * cols / 2..][..cols / 2];
                    let mins = &w_mins[(first_row + r) * nb..][..nb];
                    Q4Row { qs: pulp::as_arrays::<16, u8>(qs).0, scales: scales(r), mins }
                },
                out,
            ),
            QBits::Eight16 => {
                let ng = 2 * nb;
                let mins = move |r: usize| match w_mins {
                    [] => w_mins,
                    all => &all[(first_row + r) * ng..][..ng],
                };
                tiles.run(
                    |r| {
                        let qs = &w_qs[(first_row + r) * cols..][..cols];
                        let scales = &w_scales[(first_row + r) * ng..][..ng];
                        Q8x16Row { qs: pulp::as_arrays::<32, u8>(qs).0, scales, mins: mins(r) }
                    },
                    out,
                )
            }
        }
    }
}

/// The weight rows of one task times every activation row (`x` 8 per register, `groups`
/// registers per row), into `out` (`[rows, m]`).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Avx2Tiles<'a> {
    v3: pulp::x86::V3,
    x: &'a [core::arch::x86_64::__m256],
    groups: usize,
    m: usize,
    rows: usize,
}

#[cfg(target_arch = "x86_64")]
impl Avx2Tiles<'_> {
    /// Activation rows in tiles of up to [`X_TILE`]; with few of them, several weight rows at
    /// once (independent chains of multiply-adds for the core, the same sums for every row).
    #[inline(always)]
    fn run<B: super::qdot_avx2::Blocks>(self, row: impl Fn(usize) -> B + Copy, out: &mut [f32]) {
        let mut i = 0;
        while i < self.m {
            let t = (self.m - i).min(X_TILE);
            let o = &mut out[i..];
            match t {
                1 => self.tile::<1, 4, B>(row, i, o),
                2 => self.tile::<2, 2, B>(row, i, o),
                3 => self.tile::<3, 2, B>(row, i, o),
                4 => self.tile::<4, 1, B>(row, i, o),
                5 => self.tile::<5, 1, B>(row, i, o),
                6 => self.tile::<6, 1, B>(row, i, o),
                7 => self.tile::<7, 1, B>(row, i, o),
                _ => self.tile::<8, 1, B>(row, i, o),
            }
            i += t;
        }
    }

    /// Activation rows `first..first + T` times every weight row, `R` weight rows at a time:
    /// `out[r * m + t]`.
    #[inline(always)]
    fn tile<const T: usize, const R: usize, B: super::qdot_avx2::Blocks>(
        self,
        row: impl Fn(usize) -> B,
        first: usize,
        out: &mut [f32],
    ) {
        use super::qdot_avx2::row_dots;
        let g = self.groups;
        let xs: [&[core::arch::x86_64::__m256]; T] =
            core::array::from_fn(|t| &self.x[(first + t) * g..][..g]);
        let mut r = 0;
        while r + R <= self.rows {
            let dots = row_dots::<T, R, B>(self.v3, core::array::from_fn(|j| row(r + j)), xs);
            for (j, d) in dots.iter().enumerate() {
                out[(r + j) * self.m..][..T].copy_from_slice(d);
            }
            r += R;
        }
        for r in r..self.rows {
            let [d] = row_dots::<T, 1, B>(self.v3, [row(r)], xs);
            out[r * self.m..][..T].copy_from_slice(&d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::quant::quantize;
    use crate::test_util::random_vec;

    #[test]
    fn repacked_blocks_dequantize_like_the_ggml_reference() {
        let (rows, cols) = (3, 64);
        let x = random_vec(rows * cols, 1);
        for f in [BlockFormat::Q8_0, BlockFormat::Q4_0, BlockFormat::Q4_1] {
            let bytes = quantize(f, &x);
            let mut want = vec![0.0; rows * cols];
            super::super::quant::dequantize(f, &bytes, &mut want);
            let m = QMatrix::from_blocks(f, rows, cols, &bytes).unwrap();
            assert_eq!(m.dequantize(), want, "{f:?}");
        }
        assert!(QMatrix::from_blocks(BlockFormat::Q8_0, 1, 48, &[0; 51]).is_none());
        let m =
            QMatrix::from_blocks(BlockFormat::Q4_1, rows, cols, &quantize(BlockFormat::Q4_1, &x))
                .unwrap();
        let deq = m.dequantize();
        let stacked = QMatrix::concat_rows(&[&m, &m.select_rows(&[1])]).unwrap();
        assert_eq!(stacked.dims(), (rows + 1, cols));
        assert_eq!(stacked.dequantize()[rows * cols..], deq[cols..2 * cols]);
        let q8 =
            QMatrix::from_blocks(BlockFormat::Q8_0, rows, cols, &quantize(BlockFormat::Q8_0, &x))
                .unwrap();
        assert!(QMatrix::concat_rows(&[&m, &q8]).is_none());
        let picked = m.select_rows(&[2, 0]).dequantize();
        assert_eq!(picked[..cols], deq[2 * cols..]);
        assert_eq!(picked[cols..], deq[..cols]);
    }

    /// The GEMM panels take their weights from `dequantize_row`, the direct kernels compute
    /// them in registers: with AVX-512 the two must be the same values, or a prompt chunk's rows
    /// would multiply other weights than the decode rows beside it.
    #[test]
    fn every_form_dequantizes_to_the_same_bits_with_and_without_avx512() {
        let (rows, cols) = (5, 96);
        let w = random_vec(rows * cols, 4);
        for (name, m) in forms(rows, cols, &w) {
            for r in 0..rows {
                let (mut fast, mut scalar) = (vec![f32::NAN; cols], vec![f32::NAN; cols]);
                m.dequantize_row(r, &mut fast);
                m.dequantize_row_scalar(r, &mut scalar);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&scalar), "{name}, row {r}");
            }
        }
    }

    /// `w` (`[rows, cols]`) as a matrix of every form: Q8_0, Q4_0 and Q4_1 blocks, and bytes
    /// with a scale per 16 weights without and with minimums (6-bit and 5-bit quants, as Q6_K
    /// and Q5_K repack).
    fn forms(rows: usize, cols: usize, w: &[f32]) -> Vec<(&'static str, QMatrix)> {
        let mut out: Vec<(&'static str, QMatrix)> =
            [("Q8_0", BlockFormat::Q8_0), ("Q4_0", BlockFormat::Q4_0), ("Q4_1", BlockFormat::Q4_1)]
                .into_iter()
                .map(|(name, f)| {
                    (name, QMatrix::from_blocks(f, rows, cols, &quantize(f, w)).unwrap())
                })
                .collect();
        let (mut scales6, mut scales5, mut mins) = (vec![], vec![], vec![]);
        let (mut qs6, mut qs5) = (vec![], vec![]);
        for g in w.chunks_exact(16) {
            let (lo, hi) = g.iter().fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
            let d6 = lo.abs().max(hi.abs()) / 31.0;
            scales6.push(d6);
            qs6.extend(g.iter().map(|x| (x / d6).round().clamp(-32.0, 31.0) as i8 as u8));
            let d5 = (hi - lo) / 31.0;
            scales5.push(d5);
            mins.push(lo);
            qs5.extend(g.iter().map(|x| ((x - lo) / d5).round().clamp(0.0, 31.0) as u8));
        }
        let six = QMatrix::eight16(rows, cols, scales6, Vec::new(), qs6).unwrap();
        let five = QMatrix::eight16(rows, cols, scales5, mins, qs5).unwrap();
        out.extend([("Eight16", six), ("Eight16+min", five)]);
        out
    }

    #[test]
    fn eight16_rows_select_stack_and_refuse_a_mix_with_and_without_minimums() {
        let (rows, cols) = (3, 64);
        let w = random_vec(rows * cols, 11);
        let all = forms(rows, cols, &w);
        for (name, q) in &all[3..] {
            let deq = q.dequantize();
            let picked = q.select_rows(&[2, 0]).dequantize();
            assert_eq!(picked[..cols], deq[2 * cols..], "{name}");
            assert_eq!(picked[cols..], deq[..cols], "{name}");
            let stacked = QMatrix::concat_rows(&[q, &q.select_rows(&[1])]).unwrap();
            assert_eq!(stacked.dequantize()[rows * cols..], deq[cols..2 * cols], "{name}");
            // Close to the weights: 6-bit levels of the group's range.
            let err = deq.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 0.05, "{name}: {err}");
        }
        assert!(QMatrix::concat_rows(&[&all[3].1, &all[4].1]).is_none());
        assert!(QMatrix::eight16(1, 32, vec![1.0; 2], vec![0.0; 1], vec![0; 32]).is_none());
        assert!(QMatrix::eight16(1, 48, vec![1.0; 3], Vec::new(), vec![0; 48]).is_none());
    }

    /// `x · deq(w)ᵀ` in f64, and the bound of an f32 sum's rounding for each element.
    fn reference(deq: &[f32], x: &[f32], m: usize, cols: usize) -> Vec<(f64, f64)> {
        let rows = deq.len() / cols;
        let mut out = vec![(0.0, 0.0); m * rows];
        for i in 0..m {
            for r in 0..rows {
                let (w, xi) = (&deq[r * cols..(r + 1) * cols], &x[i * cols..(i + 1) * cols]);
                let dot: f64 = w.iter().zip(xi).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                let mag: f64 = w.iter().zip(xi).map(|(a, b)| f64::from((a * b).abs())).sum();
                out[i * rows + r] = (dot, mag * cols as f64 * f64::from(f32::EPSILON));
            }
        }
        out
    }

    /// The kernels [`qmatmul_with`] should run when allowed up to `widest` on this CPU.
    fn expected(widest: Kernels) -> Kernels {
        #[cfg(target_arch = "x86_64")]
        let has = if std::is_x86_feature_detected!("avx512f") {
            Kernels::Avx512
        } else if pulp::x86::V3::try_new().is_some() {
            Kernels::Avx2
        } else {
            Kernels::Portable
        };
        #[cfg(not(target_arch = "x86_64"))]
        let has = Kernels::Portable;
        has.min(widest)
    }

    const ALL_KERNELS: [Kernels; 3] = [Kernels::Avx512, Kernels::Avx2, Kernels::Portable];

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn qmatmul_is_the_f32_product_of_the_dequantized_matrix() {
        let (rows, cols) = (70, 256);
        let w = random_vec(rows * cols, 2);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let mut ran = Vec::new();
        for (f, q) in forms(rows, cols, &w) {
            let deq = q.dequantize();
            for m in [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33] {
                let x = random_vec(m * cols, 3 + m as u64);
                let want = reference(&deq, &x, m, cols);
                for widest in ALL_KERNELS {
                    let mut out = vec![0.0; m * rows];
                    let k = pool.install(|| qmatmul_with(&q, &x, m, &mut out, widest));
                    assert_eq!(k, expected(widest), "{f:?} m={m}, up to {widest:?}");
                    for (g, (w, bound)) in out.iter().zip(&want) {
                        assert!(
                            (f64::from(*g) - w).abs() <= *bound,
                            "{f:?} m={m} on {k:?}: {g} vs {w} (bound {bound})"
                        );
                    }
                    ran.push(k);
                }
            }
        }
        ran.sort();
        ran.dedup();
        eprintln!("checked kernels: {ran:?}");
    }

    /// A row's product is the same bits alone and in any batch: every batch size up to past
    /// both kernels' tiles (so every tile size, and rows in every place of a tile), on every
    /// kernel family the CPU has.
    #[test]
    fn a_rows_product_does_not_depend_on_the_rest_of_the_batch() {
        let (rows, cols) = (45, 192);
        let w = random_vec(rows * cols, 6);
        let most = X_TILE.max(super::super::qdot_avx512::X_TILE) + 3;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for (f, q) in forms(rows, cols, &w) {
            let batch = random_vec(most * cols, 7);
            for widest in ALL_KERNELS {
                let alone: Vec<Vec<f32>> = (0..most)
                    .map(|i| {
                        let mut one = vec![0.0; rows];
                        let x = &batch[i * cols..(i + 1) * cols];
                        let k = pool.install(|| qmatmul_with(&q, x, 1, &mut one, widest));
                        assert_eq!(k, expected(widest));
                        one
                    })
                    .collect();
                for m in 2..=most {
                    let mut all = vec![0.0; m * rows];
                    let k =
                        pool.install(|| qmatmul_with(&q, &batch[..m * cols], m, &mut all, widest));
                    for (i, one) in alone.iter().take(m).enumerate() {
                        let got = &all[i * rows..(i + 1) * rows];
                        assert_eq!(bits(one), bits(got), "{f:?} on {k:?}: row {i} of {m}");
                    }
                }
            }
        }
    }

    /// `Σ w[j]·x[j]` in the AVX-512 kernels' order: fused multiply-adds into 16 lanes (`j` into
    /// lane `j % 16`, in order), then the lanes summed by `qdot_avx512::hsum`'s tree.
    fn fused_lanes16(w: &[f32], x: &[f32]) -> f32 {
        let mut a = [0f32; 16];
        for (j, (w, x)) in w.iter().zip(x).enumerate() {
            a[j % 16] = w.mul_add(*x, a[j % 16]);
        }
        let s8: [f32; 8] = core::array::from_fn(|l| a[l] + a[l + 8]);
        let s4: [f32; 4] = core::array::from_fn(|l| s8[l] + s8[l + 4]);
        (s4[0] + s4[2]) + (s4[1] + s4[3])
    }

    /// The AVX-512 kernels multiply exactly the dequantized weights, in the order of
    /// `fused_lanes16`: bit for bit, for every batch size past a tile.
    #[test]
    fn the_avx512_kernels_are_the_16_lane_fused_sum_of_the_dequantized_weights() {
        let (rows, cols) = (37, 160);
        let w = random_vec(rows * cols, 8);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for (f, q) in forms(rows, cols, &w) {
            let deq = q.dequantize();
            for m in 1..=17 {
                let x = random_vec(m * cols, 9 + m as u64);
                let mut out = vec![0.0; m * rows];
                let k = pool.install(|| qmatmul_with(&q, &x, m, &mut out, Kernels::Avx512));
                if k != Kernels::Avx512 {
                    // Without AVX-512F the widest kernels the CPU has must have run instead.
                    assert_eq!(k, expected(Kernels::Avx512));
                    eprintln!("note: the CPU lacks AVX-512F; {k:?} ran in its place");
                    return;
                }
                let want: Vec<f32> = (0..m * rows)
                    .map(|o| {
                        let (i, r) = (o / rows, o % rows);
                        fused_lanes16(&deq[r * cols..][..cols], &x[i * cols..][..cols])
                    })
                    .collect();
                assert_eq!(bits(&out), bits(&want), "{f:?} m={m}");
            }
        }
    }

    #[test]
    fn a_matrix_in_arena_memory_multiplies_bit_for_bit_like_the_heap_one() {
        let (rows, cols) = (40, 96);
        let w = random_vec(rows * cols, 4);
        let x = random_vec(3 * cols, 5);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for (f, buffers) in [(BlockFormat::Q8_0, 2), (BlockFormat::Q4_1, 3)] {
            let heap = QMatrix::from_blocks(f, rows, cols, &quantize(f, &w)).unwrap();
            let mut moved = heap.clone();
            moved.move_to(&crate::HeapArena).unwrap();
            let (mut before, mut after) = (Vec::new(), Vec::new());
            heap.buffers(&mut before);
            moved.buffers(&mut after);
            // Scales, minimums (4-bit only), quants: same bytes, now in aligned arena memory.
            assert_eq!(after.len(), buffers, "{f:?}");
            assert_eq!(after, before, "{f:?}");
            assert_eq!(before[0].len(), 4 * rows * cols / BLOCK);
            assert!([&moved.scales, &moved.mins].iter().all(|s| s.is_external() || s.is_empty()));
            assert!(moved.qs.is_external());
            assert!(after
                .iter()
                .all(|b| (b.as_ptr() as usize).is_multiple_of(crate::memory::ALIGN)));
            assert_eq!(moved.nbytes(), heap.nbytes());
            for widest in ALL_KERNELS {
                let (mut a, mut b) = (vec![0.0; 3 * rows], vec![0.0; 3 * rows]);
                let k = pool.install(|| qmatmul_with(&heap, &x, 3, &mut a, widest));
                pool.install(|| qmatmul_with(&moved, &x, 3, &mut b, widest));
                assert_eq!(bits(&a), bits(&b), "{f:?} on {k:?}");
            }
            assert_eq!(moved.dequantize(), heap.dequantize());
        }
    }
}
