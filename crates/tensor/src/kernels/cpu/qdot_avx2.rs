//! AVX2 kernels for [`super::qmatrix::qmatmul`]: each block of 32 quantized weights is
//! dequantized into four registers of f32 (`d·q + m`, multiplied then added, so the values are
//! exactly [`super::qmatrix::QMatrix::dequantize_row`]'s) and multiplied into the f32
//! activations of up to `T` rows at once, so the weights are read and dequantized once per
//! tile of rows.
//!
//! The intrinsics come from `pulp`'s `V3` token, which proves at run time that the CPU has
//! AVX2 and FMA and exposes them as safe functions; callers run these kernels inside
//! `V3::vectorize`, so everything inlines into code compiled for those features.
//!
//! Each activation row has its own accumulator (the block's four quarters in order), and its
//! operations do not depend on the other rows of the tile: a row's result is the same bits
//! whatever tile it is computed in.

use core::arch::x86_64::{__m128i, __m256};
use pulp::x86::V3;

#[inline(always)]
fn hsum(v: __m256) -> f32 {
    let a: [f32; 8] = pulp::cast(v);
    a.iter().sum()
}

#[inline(always)]
fn to_f32(v3: V3, v: __m128i, signed: bool) -> __m256 {
    let i = if signed { v3.avx2._mm256_cvtepi8_epi32(v) } else { v3.avx2._mm256_cvtepu8_epi32(v) };
    v3.avx._mm256_cvtepi32_ps(i)
}

/// A weight row's blocks, dequantized one at a time.
pub(super) trait Blocks: Copy {
    /// Blocks in the row.
    fn len(&self) -> usize;
    /// Block `b` as four registers of f32 (elements 0..8, 8..16, 16..24, 24..32).
    fn get(&self, v3: V3, b: usize) -> [__m256; 4];
}

/// A 4-bit row: 16 bytes per block (low nibbles are elements 0..16), a scale and a minimum.
#[derive(Clone, Copy)]
pub(super) struct Q4Row<'a> {
    pub qs: &'a [[u8; 16]],
    pub scales: &'a [f32],
    pub mins: &'a [f32],
}

/// An 8-bit row: 32 signed bytes per block and a scale.
#[derive(Clone, Copy)]
pub(super) struct Q8Row<'a> {
    pub qs: &'a [[u8; 32]],
    pub scales: &'a [f32],
}

/// An 8-bit row with a scale per 16 weights (two per block) and a minimum per 16 (or none:
/// `mins` empty).
#[derive(Clone, Copy)]
pub(super) struct Q8x16Row<'a> {
    pub qs: &'a [[u8; 32]],
    pub scales: &'a [f32],
    pub mins: &'a [f32],
}

/// Eight 4-bit values (the low bytes of `q`) as `d·q + m`: multiplied, then added, as
/// [`super::qmatrix::QMatrix::dequantize_row`] does.
#[inline(always)]
fn dequant4(v3: V3, q: __m128i, d: __m256, m: __m256) -> __m256 {
    v3.avx._mm256_add_ps(v3.avx._mm256_mul_ps(d, to_f32(v3, q, false)), m)
}

impl Blocks for Q4Row<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.scales.len()
    }

    #[inline(always)]
    fn get(&self, v3: V3, b: usize) -> [__m256; 4] {
        let q: __m128i = pulp::cast(self.qs[b]);
        let mask = v3.sse2._mm_set1_epi8(0x0F);
        let lo = v3.sse2._mm_and_si128(q, mask);
        let hi = v3.sse2._mm_and_si128(v3.sse2._mm_srli_epi16::<4>(q), mask);
        let (d, m) = (v3.avx._mm256_set1_ps(self.scales[b]), v3.avx._mm256_set1_ps(self.mins[b]));
        [
            dequant4(v3, lo, d, m),
            dequant4(v3, v3.sse2._mm_srli_si128::<8>(lo), d, m),
            dequant4(v3, hi, d, m),
            dequant4(v3, v3.sse2._mm_srli_si128::<8>(hi), d, m),
        ]
    }
}

impl Blocks for Q8Row<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.scales.len()
    }

    #[inline(always)]
    fn get(&self, v3: V3, b: usize) -> [__m256; 4] {
        let [a, c]: [__m128i; 2] = pulp::cast(self.qs[b]);
        let d = v3.avx._mm256_set1_ps(self.scales[b]);
        [
            v3.avx._mm256_mul_ps(d, to_f32(v3, a, true)),
            v3.avx._mm256_mul_ps(d, to_f32(v3, v3.sse2._mm_srli_si128::<8>(a), true)),
            v3.avx._mm256_mul_ps(d, to_f32(v3, c, true)),
            v3.avx._mm256_mul_ps(d, to_f32(v3, v3.sse2._mm_srli_si128::<8>(c), true)),
        ]
    }
}

impl Blocks for Q8x16Row<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.qs.len()
    }

    #[inline(always)]
    fn get(&self, v3: V3, b: usize) -> [__m256; 4] {
        let [a, c]: [__m128i; 2] = pulp::cast(self.qs[b]);
        let (d0, d1) = (self.scales[2 * b], self.scales[2 * b + 1]);
        let (d0, d1) = (v3.avx._mm256_set1_ps(d0), v3.avx._mm256_set1_ps(d1));
        let w = [
            v3.avx._mm256_mul_ps(d0, to_f32(v3, a, true)),
            v3.avx._mm256_mul_ps(d0, to_f32(v3, v3.sse2._mm_srli_si128::<8>(a), true)),
            v3.avx._mm256_mul_ps(d1, to_f32(v3, c, true)),
            v3.avx._mm256_mul_ps(d1, to_f32(v3, v3.sse2._mm_srli_si128::<8>(c), true)),
        ];
        if self.mins.is_empty() {
            return w;
        }
        let (m0, m1) = (self.mins[2 * b], self.mins[2 * b + 1]);
        let (m0, m1) = (v3.avx._mm256_set1_ps(m0), v3.avx._mm256_set1_ps(m1));
        [
            v3.avx._mm256_add_ps(w[0], m0),
            v3.avx._mm256_add_ps(w[1], m0),
            v3.avx._mm256_add_ps(w[2], m1),
            v3.avx._mm256_add_ps(w[3], m1),
        ]
    }
}

/// `rows[r] · x[t]` for `R` weight rows and the `T` activation rows `xs`, each as long as the
/// rows, 8 per register. Each pair has its own accumulator: the `R` rows are independent
/// chains of multiply-adds, and a result is the same bits whatever `R` and `T` are.
#[inline(always)]
pub(super) fn row_dots<const T: usize, const R: usize, B: Blocks>(
    v3: V3,
    rows: [B; R],
    xs: [&[__m256]; T],
) -> [[f32; T]; R] {
    let nb = rows[0].len();
    let xs = xs.map(|x| &x[..4 * nb]);
    let mut acc = [[v3.avx._mm256_setzero_ps(); T]; R];
    for b in 0..nb {
        for r in 0..R {
            let w = rows[r].get(v3, b);
            for t in 0..T {
                let x = &xs[t][4 * b..4 * b + 4];
                let a = &mut acc[r][t];
                *a = v3.fma._mm256_fmadd_ps(w[0], x[0], *a);
                *a = v3.fma._mm256_fmadd_ps(w[1], x[1], *a);
                *a = v3.fma._mm256_fmadd_ps(w[2], x[2], *a);
                *a = v3.fma._mm256_fmadd_ps(w[3], x[3], *a);
            }
        }
    }
    acc.map(|a| a.map(hsum))
}
