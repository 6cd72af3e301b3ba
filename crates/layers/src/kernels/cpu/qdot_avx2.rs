//! AVX2 row dot products for [`super::qmatrix`]: the same arithmetic as the portable
//! kernels, written with explicit multiply-add instructions (what GGML does), because the
//! compiler's auto-vectorizer does not find `pmaddubsw` in plain loops.
//!
//! The intrinsics come from `pulp`'s `V3` token, which proves at run time that the CPU has
//! AVX2 and FMA and exposes them as safe functions; callers run these kernels inside
//! `V3::vectorize`, so everything inlines into code compiled for those features.

use super::quant::BLOCK;
use core::arch::x86_64::{__m128i, __m256, __m256i};
use pulp::x86::V3;

#[inline(always)]
fn load32(b: &[u8]) -> __m256i {
    let a: [u8; 32] = b[..32].try_into().expect("a block has 32 bytes");
    pulp::cast(a)
}

#[inline(always)]
fn load16(b: &[u8]) -> __m128i {
    let a: [u8; 16] = b[..16].try_into().expect("a 4-bit block has 16 bytes");
    pulp::cast(a)
}

#[inline(always)]
fn hsum(v: __m256) -> f32 {
    let a: [f32; 8] = pulp::cast(v);
    a.iter().sum()
}

/// Σ_j w[j]·x[j] of one 4-bit block (`q`: 16 bytes, low nibbles first) as 8 f32 lanes.
#[inline(always)]
fn q4_block(v3: V3, q: &[u8], x: &[u8]) -> __m256 {
    let lo = load16(q);
    let hi = v3.sse2._mm_srli_epi16::<4>(lo);
    let w =
        v3.avx2._mm256_and_si256(v3.avx._mm256_set_m128i(hi, lo), v3.avx._mm256_set1_epi8(0x0F));
    let p16 = v3.avx2._mm256_maddubs_epi16(w, load32(x));
    v3.avx._mm256_cvtepi32_ps(v3.avx2._mm256_madd_epi16(p16, v3.avx._mm256_set1_epi16(1)))
}

/// Σ_j w[j]·x[j] of one 8-bit block as 8 f32 lanes.
#[inline(always)]
fn q8_block(v3: V3, w: &[u8], x: &[u8]) -> __m256 {
    let (wv, xv) = (load32(w), load32(x));
    // maddubs multiplies unsigned by signed bytes: move w's sign onto x.
    let p16 = v3
        .avx2
        ._mm256_maddubs_epi16(v3.avx2._mm256_sign_epi8(wv, wv), v3.avx2._mm256_sign_epi8(xv, wv));
    v3.avx._mm256_cvtepi32_ps(v3.avx2._mm256_madd_epi16(p16, v3.avx._mm256_set1_epi16(1)))
}

/// Σ_b sw[b]·sx[b]·Σ_j w[b,j]·x[b,j] for a row of 4-bit weights (`qs`: 16 bytes per block,
/// low nibbles first) and 8-bit activations `x`. Two named accumulators (even and odd blocks)
/// let the adds overlap; an indexed accumulator array would be kept in memory.
#[inline(always)]
pub(super) fn row_dot_q4(v3: V3, qs: &[u8], x: &[u8], sw: &[f32], sx: &[f32]) -> f32 {
    let half = BLOCK / 2;
    let (mut acc0, mut acc1) = (v3.avx._mm256_setzero_ps(), v3.avx._mm256_setzero_ps());
    let nb = sw.len().min(sx.len());
    let mut b = 0;
    while b + 1 < nb {
        let p0 = q4_block(v3, &qs[b * half..][..half], &x[b * BLOCK..][..BLOCK]);
        let p1 = q4_block(v3, &qs[(b + 1) * half..][..half], &x[(b + 1) * BLOCK..][..BLOCK]);
        acc0 = v3.fma._mm256_fmadd_ps(p0, v3.avx._mm256_set1_ps(sw[b] * sx[b]), acc0);
        acc1 = v3.fma._mm256_fmadd_ps(p1, v3.avx._mm256_set1_ps(sw[b + 1] * sx[b + 1]), acc1);
        b += 2;
    }
    if b < nb {
        let p0 = q4_block(v3, &qs[b * half..][..half], &x[b * BLOCK..][..BLOCK]);
        acc0 = v3.fma._mm256_fmadd_ps(p0, v3.avx._mm256_set1_ps(sw[b] * sx[b]), acc0);
    }
    hsum(v3.avx._mm256_add_ps(acc0, acc1))
}

/// Σ_b sw[b]·sx[b]·Σ_j w[b,j]·x[b,j] for a row of 8-bit weights and 8-bit activations, with
/// the same two accumulators as [`row_dot_q4`].
#[inline(always)]
pub(super) fn row_dot_q8(v3: V3, w: &[u8], x: &[u8], sw: &[f32], sx: &[f32]) -> f32 {
    let (mut acc0, mut acc1) = (v3.avx._mm256_setzero_ps(), v3.avx._mm256_setzero_ps());
    let nb = sw.len().min(sx.len());
    let mut b = 0;
    while b + 1 < nb {
        let p0 = q8_block(v3, &w[b * BLOCK..][..BLOCK], &x[b * BLOCK..][..BLOCK]);
        let p1 = q8_block(v3, &w[(b + 1) * BLOCK..][..BLOCK], &x[(b + 1) * BLOCK..][..BLOCK]);
        acc0 = v3.fma._mm256_fmadd_ps(p0, v3.avx._mm256_set1_ps(sw[b] * sx[b]), acc0);
        acc1 = v3.fma._mm256_fmadd_ps(p1, v3.avx._mm256_set1_ps(sw[b + 1] * sx[b + 1]), acc1);
        b += 2;
    }
    if b < nb {
        let p0 = q8_block(v3, &w[b * BLOCK..][..BLOCK], &x[b * BLOCK..][..BLOCK]);
        acc0 = v3.fma._mm256_fmadd_ps(p0, v3.avx._mm256_set1_ps(sw[b] * sx[b]), acc0);
    }
    hsum(v3.avx._mm256_add_ps(acc0, acc1))
}
