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

/// Σ_b sw[b]·sx[b]·Σ_j w[b,j]·x[b,j] for a row of 4-bit weights (`qs`: 16 bytes per block,
/// low nibbles first) and 8-bit activations `x`.
#[inline(always)]
pub(super) fn row_dot_q4(v3: V3, qs: &[u8], x: &[u8], sw: &[f32], sx: &[f32]) -> f32 {
    let mask = v3.avx._mm256_set1_epi8(0x0F);
    let ones = v3.avx._mm256_set1_epi16(1);
    let mut acc = [v3.avx._mm256_setzero_ps(); 2];
    for (b, ((q, xb), (a, s))) in
        qs.chunks_exact(BLOCK / 2).zip(x.chunks_exact(BLOCK)).zip(sw.iter().zip(sx)).enumerate()
    {
        let lo = load16(q);
        let hi = v3.sse2._mm_srli_epi16::<4>(lo);
        let w = v3.avx2._mm256_and_si256(v3.avx._mm256_set_m128i(hi, lo), mask);
        let p16 = v3.avx2._mm256_maddubs_epi16(w, load32(xb));
        let p32 = v3.avx2._mm256_madd_epi16(p16, ones);
        let scale = v3.avx._mm256_set1_ps(a * s);
        acc[b & 1] = v3.fma._mm256_fmadd_ps(v3.avx._mm256_cvtepi32_ps(p32), scale, acc[b & 1]);
    }
    hsum(v3.avx._mm256_add_ps(acc[0], acc[1]))
}

/// Σ_b sw[b]·sx[b]·Σ_j w[b,j]·x[b,j] for a row of 8-bit weights and 8-bit activations.
#[inline(always)]
pub(super) fn row_dot_q8(v3: V3, w: &[u8], x: &[u8], sw: &[f32], sx: &[f32]) -> f32 {
    let ones = v3.avx._mm256_set1_epi16(1);
    let mut acc = [v3.avx._mm256_setzero_ps(); 2];
    for (b, ((wb, xb), (a, s))) in
        w.chunks_exact(BLOCK).zip(x.chunks_exact(BLOCK)).zip(sw.iter().zip(sx)).enumerate()
    {
        let wv = load32(wb);
        let xv = load32(xb);
        // maddubs multiplies unsigned by signed bytes: move w's sign onto x.
        let p16 = v3.avx2._mm256_maddubs_epi16(
            v3.avx2._mm256_sign_epi8(wv, wv),
            v3.avx2._mm256_sign_epi8(xv, wv),
        );
        let p32 = v3.avx2._mm256_madd_epi16(p16, ones);
        let scale = v3.avx._mm256_set1_ps(a * s);
        acc[b & 1] = v3.fma._mm256_fmadd_ps(v3.avx._mm256_cvtepi32_ps(p32), scale, acc[b & 1]);
    }
    hsum(v3.avx._mm256_add_ps(acc[0], acc[1]))
}
