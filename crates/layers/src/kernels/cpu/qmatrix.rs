//! Weight matrices kept block-quantized for decode, and their matrix-vector product.
//!
//! Decode (one token) reads every weight once, so its speed is the memory bandwidth divided by
//! the weight bytes: 4-bit weights move 7× fewer bytes than f32. The activation vector is
//! quantized to 8 bits per block of 32 (one f32 scale per block, as GGML's Q8 formats), and
//! each block's dot product runs in 16/32-bit integers, which vectorize well. Kernels are
//! dispatched at run time to the widest SIMD level the CPU has (through `pulp`), without
//! `target-cpu=native`.
//!
//! Storage is repacked at load: scales (and minimums) as f32 arrays, quants as bytes, all in
//! row-major block order. Q4_0 is stored as Q4_1 with minimum `-8·d`, so one 4-bit kernel
//! serves both. The three arrays are [`Storage`], so a matrix can live in arena memory.

use super::quant::{BlockFormat, BLOCK};
use crate::error::Result;
use crate::memory::{Arena, WeightBuffers};
use crate::tensor::Storage;
use half::f16;
use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;

/// Rows per parallel task in [`qmatvec`].
const ROWS_PER_TASK: usize = 32;

/// Bits per quantized weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QBits {
    /// One signed byte per weight: `w = d · q`.
    Eight,
    /// One nibble per weight (low nibbles are elements 0..16 of a block, high 16..32):
    /// `w = d · q + m`.
    Four,
}

/// A block-quantized `[rows, cols]` matrix (`cols` a multiple of 32).
#[derive(Clone, Debug, PartialEq)]
pub struct QMatrix {
    bits: QBits,
    rows: usize,
    cols: usize,
    scales: Storage<f32>,
    /// Empty for 8-bit weights.
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
        if cols % BLOCK != 0 || bytes.len() != nb * format.block_bytes() {
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
        let nb = self.cols / BLOCK;
        let qrow = match self.bits {
            QBits::Eight => nb * BLOCK,
            QBits::Four => nb * BLOCK / 2,
        };
        let (scales, mins, qs) = (self.scales.as_slice(), self.mins.as_slice(), self.qs.as_slice());
        let (mut out_scales, mut out_mins, mut out_qs) = (Vec::new(), Vec::new(), Vec::new());
        for &r in order {
            out_scales.extend_from_slice(&scales[r * nb..(r + 1) * nb]);
            if self.bits == QBits::Four {
                out_mins.extend_from_slice(&mins[r * nb..(r + 1) * nb]);
            }
            out_qs.extend_from_slice(&qs[r * qrow..(r + 1) * qrow]);
        }
        QMatrix::from_parts(self.bits, order.len(), self.cols, out_scales, out_mins, out_qs)
    }

    /// The rows of `parts` stacked in order, or `None` when the parts differ in width or bits.
    pub fn concat_rows(parts: &[&QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.cols != first.cols || p.bits != first.bits) {
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

    /// The repacked arrays in row-major block order: one scale per block, one minimum per
    /// block (empty for 8-bit weights), and the quants (one byte per 8-bit weight; for 4-bit
    /// weights 16 bytes per block, elements 0..16 in the low nibbles, 16..32 in the high ones).
    pub fn parts(&self) -> (&[f32], &[f32], &[u8]) {
        (self.scales.as_slice(), self.mins.as_slice(), self.qs.as_slice())
    }

    /// Bytes held (quants, scales and minimums).
    pub fn nbytes(&self) -> usize {
        self.qs.len() + 4 * (self.scales.len() + self.mins.len())
    }

    /// Dequantizes row `r` into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let nb = self.cols / BLOCK;
        let (scales, mins, qs) = (self.scales.as_slice(), self.mins.as_slice(), self.qs.as_slice());
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            let bi = r * nb + b;
            let d = scales[bi];
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

/// An activation vector quantized to 8 bits per block of 32.
#[derive(Clone, Debug, Default)]
pub struct Q8Vector {
    scales: Vec<f32>,
    /// `scale · Σ q` per block, for the minimum term of 4-bit weights.
    sums: Vec<f32>,
    qs: Vec<i8>,
}

impl Q8Vector {
    /// Quantizes `x` (a multiple of 32 values).
    pub fn quantize(x: &[f32]) -> Self {
        let nb = x.len() / BLOCK;
        let mut v = Q8Vector {
            scales: Vec::with_capacity(nb),
            sums: Vec::with_capacity(nb),
            qs: Vec::with_capacity(x.len()),
        };
        for blk in x.chunks_exact(BLOCK) {
            let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for &val in blk {
                let q = (val * id).round() as i8;
                sum += i32::from(q);
                v.qs.push(q);
            }
            v.scales.push(d);
            v.sums.push(d * sum as f32);
        }
        v
    }
}

/// Unpacks one 4-bit row into bytes 0..=15 in element order, eight nibbles per operation.
#[inline(always)]
fn unpack_nibbles(qs: &[u8], out: &mut [u8]) {
    const LOW: u64 = 0x0F0F_0F0F_0F0F_0F0F;
    for (dst, src) in out.chunks_exact_mut(BLOCK).zip(qs.chunks_exact(BLOCK / 2)) {
        let a = u64::from_le_bytes(src[..8].try_into().expect("8 bytes"));
        let b = u64::from_le_bytes(src[8..16].try_into().expect("8 bytes"));
        dst[..8].copy_from_slice(&(a & LOW).to_le_bytes());
        dst[8..16].copy_from_slice(&(b & LOW).to_le_bytes());
        dst[16..24].copy_from_slice(&((a >> 4) & LOW).to_le_bytes());
        dst[24..32].copy_from_slice(&((b >> 4) & LOW).to_le_bytes());
    }
}

struct RowsOp<'a> {
    w: &'a QMatrix,
    x: &'a Q8Vector,
    first_row: usize,
    out: &'a mut [f32],
    scratch: &'a mut Vec<u8>,
}

impl WithSimd for RowsOp<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _simd: S) -> Self::Output {
        let RowsOp { w, x, first_row, out, scratch } = self;
        let (cols, nb) = (w.cols, w.cols / BLOCK);
        let (w_scales, w_mins, w_qs) = (w.scales.as_slice(), w.mins.as_slice(), w.qs.as_slice());
        scratch.resize(cols, 0);
        let (xq, xs, xsum) = (&x.qs[..cols], &x.scales[..nb], &x.sums[..nb]);
        for (i, o) in out.iter_mut().enumerate() {
            let r = first_row + i;
            let scales = &w_scales[r * nb..(r + 1) * nb];
            *o = match w.bits {
                QBits::Eight => {
                    let qs: &[i8] = bytemuck_i8(&w_qs[r * cols..(r + 1) * cols]);
                    row_dot(qs, xq, scales, xs)
                }
                QBits::Four => {
                    unpack_nibbles(&w_qs[r * cols / 2..(r + 1) * cols / 2], scratch);
                    let mins = &w_mins[r * nb..(r + 1) * nb];
                    let min_term: f32 = mins.iter().zip(xsum).map(|(m, s)| m * s).sum();
                    row_dot(bytemuck_i8(scratch), xq, scales, xs) + min_term
                }
            };
        }
    }
}

/// Lanes of the per-row accumulators: one AVX2 register of i32 / f32.
const LANES: usize = 8;

/// Σ_j w[j]·x[j] of one block, as 8 i32 lanes: each lane sums adjacent pairs, the shape of
/// the widening multiply-add instruction (`pmaddwd`) the compiler turns it into.
#[inline(always)]
fn block_lanes(w: &[i8], x: &[i8]) -> [i32; LANES] {
    let mut p = [0i32; LANES];
    for (wl, xl) in w.chunks_exact(2 * LANES).zip(x.chunks_exact(2 * LANES)) {
        for l in 0..LANES {
            p[l] += i32::from(wl[2 * l]) * i32::from(xl[2 * l])
                + i32::from(wl[2 * l + 1]) * i32::from(xl[2 * l + 1]);
        }
    }
    p
}

/// Σ_b scale_w[b]·scale_x[b]·Σ_j w[b,j]·x[b,j] over a row of signed bytes. Each block's
/// integer lanes are scaled into f32 lanes, so no block needs a horizontal reduction; two
/// accumulators (even and odd blocks) hide the add latency. The lanes are added once.
#[inline(always)]
fn row_dot(w: &[i8], x: &[i8], sw: &[f32], sx: &[f32]) -> f32 {
    let mut acc = [[0.0f32; LANES]; 2];
    let pairs = w.chunks_exact(2 * BLOCK).zip(x.chunks_exact(2 * BLOCK));
    for (i, (wc, xc)) in pairs.enumerate() {
        for (h, a) in acc.iter_mut().enumerate() {
            let p = block_lanes(&wc[h * BLOCK..][..BLOCK], &xc[h * BLOCK..][..BLOCK]);
            let scale = sw[2 * i + h] * sx[2 * i + h];
            for l in 0..LANES {
                a[l] += p[l] as f32 * scale;
            }
        }
    }
    let nb = w.len() / BLOCK;
    if nb % 2 == 1 {
        let b = nb - 1;
        let p = block_lanes(&w[b * BLOCK..][..BLOCK], &x[b * BLOCK..][..BLOCK]);
        let scale = sw[b] * sx[b];
        for l in 0..LANES {
            acc[0][l] += p[l] as f32 * scale;
        }
    }
    (0..LANES).map(|l| acc[0][l] + acc[1][l]).sum()
}

/// Views bytes as signed bytes without copying (same size and alignment).
#[inline(always)]
fn bytemuck_i8(b: &[u8]) -> &[i8] {
    bytemuck::cast_slice(b)
}

/// `out[r] = w[r, :] · x` with `x` quantized, in the current rayon pool.
///
/// Lengths must agree (`out.len() == rows`, `x` quantized from `cols` values); callers check.
pub fn qmatvec(w: &QMatrix, x: &Q8Vector, out: &mut [f32]) {
    qmatvec_with(w, x, out, true);
}

/// [`qmatvec`], optionally without the AVX2 kernels (so tests cover the portable ones too).
fn qmatvec_with(w: &QMatrix, x: &Q8Vector, out: &mut [f32], allow_avx2: bool) {
    #[cfg(target_arch = "x86_64")]
    if let Some(v3) = pulp::x86::V3::try_new().filter(|_| allow_avx2) {
        out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(c, chunk)| {
            <pulp::x86::V3 as Simd>::vectorize(
                v3,
                Avx2Rows { v3, w, x, first_row: c * ROWS_PER_TASK, out: chunk },
            );
        });
        return;
    }
    let arch = Arch::new();
    out.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each_init(Vec::new, |scratch, (c, chunk)| {
        arch.dispatch(RowsOp { w, x, first_row: c * ROWS_PER_TASK, out: chunk, scratch });
    });
}

/// Rows of [`qmatvec`] on the AVX2 kernels.
#[cfg(target_arch = "x86_64")]
struct Avx2Rows<'a> {
    v3: pulp::x86::V3,
    w: &'a QMatrix,
    x: &'a Q8Vector,
    first_row: usize,
    out: &'a mut [f32],
}

#[cfg(target_arch = "x86_64")]
impl WithSimd for Avx2Rows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _simd: S) -> Self::Output {
        use super::qdot_avx2::{row_dot_q4, row_dot_q8};
        let Avx2Rows { v3, w, x, first_row, out } = self;
        let (cols, nb) = (w.cols, w.cols / BLOCK);
        let (w_scales, w_mins, w_qs) = (w.scales.as_slice(), w.mins.as_slice(), w.qs.as_slice());
        let xq: &[u8] = bytemuck::cast_slice(&x.qs[..cols]);
        let (xs, xsum) = (&x.scales[..nb], &x.sums[..nb]);
        for (i, o) in out.iter_mut().enumerate() {
            let r = first_row + i;
            let scales = &w_scales[r * nb..(r + 1) * nb];
            *o = match w.bits {
                QBits::Eight => row_dot_q8(v3, &w_qs[r * cols..(r + 1) * cols], xq, scales, xs),
                QBits::Four => {
                    let mins = &w_mins[r * nb..(r + 1) * nb];
                    let min_term: f32 = mins.iter().zip(xsum).map(|(m, s)| m * s).sum();
                    row_dot_q4(v3, &w_qs[r * cols / 2..(r + 1) * cols / 2], xq, scales, xs)
                        + min_term
                }
            };
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

    #[test]
    fn qmatvec_matches_the_f32_product_of_the_dequantized_matrix() {
        let (rows, cols) = (70, 256);
        let w = random_vec(rows * cols, 2);
        let x = random_vec(cols, 3);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for f in [BlockFormat::Q8_0, BlockFormat::Q4_0, BlockFormat::Q4_1] {
            let m = QMatrix::from_blocks(f, rows, cols, &quantize(f, &w)).unwrap();
            let deq = m.dequantize();
            let want: Vec<f32> =
                deq.chunks(cols).map(|r| r.iter().zip(&x).map(|(a, b)| a * b).sum()).collect();
            let xq = Q8Vector::quantize(&x);
            let mut out = vec![0.0; rows];
            pool.install(|| qmatvec(&m, &xq, &mut out));
            // The activation's 8-bit rounding bounds the error: |Δ| ≲ Σ|w|·amax/254.
            for (g, w) in out.iter().zip(&want) {
                assert!((g - w).abs() < 0.05 * (cols as f32).sqrt() / 8.0, "{f:?}: {g} vs {w}");
            }
            // The portable kernels compute the same integer sums: equal up to f32 rounding.
            let mut portable = vec![0.0; rows];
            pool.install(|| qmatvec_with(&m, &xq, &mut portable, false));
            for (a, b) in portable.iter().zip(&out) {
                assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{f:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn a_matrix_in_arena_memory_multiplies_bit_for_bit_like_the_heap_one() {
        let (rows, cols) = (40, 96);
        let w = random_vec(rows * cols, 4);
        let xq = Q8Vector::quantize(&random_vec(cols, 5));
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
            assert!(after.iter().all(|b| b.as_ptr() as usize % crate::memory::ALIGN == 0));
            assert_eq!(moved.nbytes(), heap.nbytes());
            for avx2 in [true, false] {
                let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
                pool.install(|| qmatvec_with(&heap, &xq, &mut a, avx2));
                pool.install(|| qmatvec_with(&moved, &xq, &mut b, avx2));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{f:?}, avx2 allowed: {avx2}");
            }
            assert_eq!(moved.dequantize(), heap.dequantize());
        }
    }
}
