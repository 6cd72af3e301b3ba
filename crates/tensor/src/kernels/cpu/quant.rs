//! GGML block-quantized formats (Q8_0, Q4_0, Q4_1): dequantization to f32.
//!
//! Each block covers 32 consecutive elements of a row and starts with an f16 scale `d`:
//! - Q8_0 (34 bytes): `d`, then 32 signed bytes `q`; `x = d · q`.
//! - Q4_0 (18 bytes): `d`, then 16 bytes; byte `j` holds element `j` in its low nibble and
//!   element `j + 16` in its high nibble; `x = d · (nibble − 8)`.
//! - Q4_1 (20 bytes): `d`, an f16 minimum `m`, then 16 bytes as in Q4_0; `x = d · nibble + m`.

use half::f16;

/// Elements per block in all supported block formats.
pub const BLOCK: usize = 32;

/// A block-quantized format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 8-bit, symmetric.
    Q8_0,
    /// 4-bit, symmetric around 8.
    Q4_0,
    /// 4-bit with a per-block minimum.
    Q4_1,
}

impl BlockFormat {
    /// Bytes per block of 32 elements.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes whole blocks: `bytes` holds `out.len() / 32` blocks of `format`.
///
/// Lengths must agree (`out.len()` a multiple of 32, `bytes.len()` the matching block bytes);
/// callers check.
pub fn dequantize(format: BlockFormat, bytes: &[u8], out: &mut [f32]) {
    let bb = format.block_bytes();
    for (blk, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        let d = f16_at(blk, 0);
        match format {
            BlockFormat::Q8_0 => {
                for (x, &q) in o.iter_mut().zip(&blk[2..34]) {
                    *x = d * f32::from(q as i8);
                }
            }
            BlockFormat::Q4_0 => {
                for (j, &q) in blk[2..18].iter().enumerate() {
                    o[j] = d * (f32::from(q & 0x0f) - 8.0);
                    o[j + 16] = d * (f32::from(q >> 4) - 8.0);
                }
            }
            BlockFormat::Q4_1 => {
                let m = f16_at(blk, 2);
                for (j, &q) in blk[4..20].iter().enumerate() {
                    o[j] = d * f32::from(q & 0x0f) + m;
                    o[j + 16] = d * f32::from(q >> 4) + m;
                }
            }
        }
    }
}

/// Quantizes `x` (a multiple of 32 elements) to `format` with the reference rounding of the
/// GGML formats (used to write test files and, for Q8_0, activations).
pub fn quantize(format: BlockFormat, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / BLOCK * format.block_bytes());
    for blk in x.chunks_exact(BLOCK) {
        match format {
            BlockFormat::Q8_0 => {
                let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
            }
            BlockFormat::Q4_0 => {
                // The signed value of largest magnitude maps to -8.
                let max = blk.iter().fold(0.0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
            }
            BlockFormat::Q4_1 => {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id).round() as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_then_dequantize_is_close_for_every_format() {
        let x = crate::test_util::random_vec(64, 9);
        for (f, tol) in
            [(BlockFormat::Q8_0, 0.01), (BlockFormat::Q4_0, 0.15), (BlockFormat::Q4_1, 0.08)]
        {
            let bytes = quantize(f, &x);
            assert_eq!(bytes.len(), 2 * f.block_bytes());
            let mut y = vec![0.0; 64];
            dequantize(f, &bytes, &mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < tol, "{f:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn q8_0_block_by_hand() {
        let mut blk = f16::from_f32(0.5).to_le_bytes().to_vec();
        blk.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut out = [0.0; 32];
        dequantize(BlockFormat::Q8_0, &blk, &mut out);
        assert_eq!(out[0], -8.0);
        assert_eq!(out[16], 0.0);
        assert_eq!(out[31], 7.5);
    }

    #[test]
    fn q4_0_and_q4_1_nibble_order_by_hand() {
        // Byte j = (hi << 4) | lo with lo = j, hi = 15 - j.
        let nibbles: Vec<u8> = (0..16u8).map(|j| ((15 - j) << 4) | j).collect();
        let mut q40 = f16::from_f32(2.0).to_le_bytes().to_vec();
        q40.extend(&nibbles);
        let mut out = [0.0; 32];
        dequantize(BlockFormat::Q4_0, &q40, &mut out);
        assert_eq!(out[0], 2.0 * (0.0 - 8.0)); // low nibble of byte 0
        assert_eq!(out[15], 2.0 * (15.0 - 8.0)); // low nibble of byte 15
        assert_eq!(out[16], 2.0 * (15.0 - 8.0)); // high nibble of byte 0
        assert_eq!(out[31], 2.0 * (0.0 - 8.0)); // high nibble of byte 15

        let mut q41 = f16::from_f32(0.25).to_le_bytes().to_vec();
        q41.extend(f16::from_f32(-1.0).to_le_bytes());
        q41.extend(&nibbles);
        dequantize(BlockFormat::Q4_1, &q41, &mut out);
        assert_eq!(out[1], 0.25 * 1.0 - 1.0);
        assert_eq!(out[17], 0.25 * 14.0 - 1.0);
    }
}
