//! GGML block formats beyond Q8_0/Q4_0/Q4_1: the K-quants (Q2_K..Q6_K, 256-element
//! super-blocks) and Q5_0, Q5_1, IQ4_NL, IQ4_XS. Layouts, exact dequantization to f32, and
//! the lossless repackings into the forms [`QMatrix`](tensor::kernels::QMatrix) keeps.
//!
//! Every formula is ggml's (`dequantize_row_*` in `ggml-quants.c`), evaluated in its order
//! without fused multiply-adds, so the values are bit for bit those of gguf-py's
//! `gguf.quants.dequantize`. Most products are exact anyway: a sub-block scale is an f16
//! times a small integer (at most 19 significant bits), and times a quant it stays within
//! f32's 24; only the `- min` of the formats with minimums and Q6_K's `(d·scale)·q` round.
//!
//! Super-block layouts (`d`, `dmin` are little-endian f16; a "sub-block" is 16 or 32
//! consecutive elements sharing a scale):
//! - Q2_K (84 bytes): `scales[16]` (low nibble scale, high nibble min of sub-block `i` of 16),
//!   `qs[64]`, `d`, `dmin`. Element `128n + 32j + l` is `(qs[32n + l] >> 2j) & 3`;
//!   `x = d·sc·q − dmin·m`.
//! - Q3_K (110 bytes): `hmask[32]`, `qs[64]`, `scales[12]` (sixteen 6-bit scales, stored
//!   minus 32), `d`. Element `128n + 32j + l` is `(qs[32n + l] >> 2j) & 3`, minus 4 unless
//!   bit `4n + j` of `hmask[l]` is set; `x = d·(sc − 32)·q`.
//! - Q4_K (144 bytes): `d`, `dmin`, `scales[12]` (eight 6-bit scales and mins, see
//!   [`scale_min_k4`]), `qs[128]`. Element `64c + l` is the low nibble of `qs[32c + l]`,
//!   `64c + 32 + l` its high nibble (sub-blocks of 32); `x = d·sc·q − dmin·m`.
//! - Q5_K (176 bytes): as Q4_K with `qh[32]` before `qs`: bit `i` of `qh[l]` is the fifth bit
//!   of element `32i + l`.
//! - Q6_K (210 bytes): `ql[128]`, `qh[64]`, `scales[16]` (i8), `d`. Element `128n + 32k + l`
//!   takes its low four bits from `ql[64n + 32(k % 2) + l]` (low nibble for `k < 2`, else
//!   high) and its top two from `(qh[32n + l] >> 2k) & 3`; `x = (d·sc)·(q − 32)`.
//! - IQ4_XS (136 bytes): `d`, `scales_h` (u16), `scales_l[4]`, `qs[128]`: eight sub-blocks of
//!   32, each with a 6-bit scale (stored minus 32) and its 16 bytes of nibbles in the Q4_0
//!   order, each nibble an index into [`IQ4_VALUES`]; `x = d·(sc − 32)·value`.
//!
//! Blocks of 32 (nibbles in the Q4_0 order: byte `j` holds element `j` low, `j + 16` high):
//! - Q5_0 (22 bytes): `d`, `qh` (u32, bit `i` the fifth bit of element `i`), `qs[16]`;
//!   `x = d·(q − 16)`.
//! - Q5_1 (24 bytes): `d`, `m` (f16), `qh`, `qs[16]`; `x = d·q + m`.
//! - IQ4_NL (18 bytes): `d`, `qs[16]`; `x = d·IQ4_VALUES[nibble]`.

use half::f16;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// The non-linear 4-bit grid of IQ4_NL and IQ4_XS.
pub const IQ4_VALUES: [i8; 16] =
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// A GGML block format read by dequantizing (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(non_camel_case_types)] // GGML's names, as files, tools and error messages spell them
pub enum QuantFormat {
    /// 5-bit, symmetric around 16, blocks of 32 (id 6).
    Q5_0,
    /// 5-bit with a minimum, blocks of 32 (id 7).
    Q5_1,
    /// 2-bit K-quant with minimums (id 10).
    Q2_K,
    /// 3-bit K-quant, symmetric (id 11).
    Q3_K,
    /// 4-bit K-quant with minimums (id 12).
    Q4_K,
    /// 5-bit K-quant with minimums (id 13).
    Q5_K,
    /// 6-bit K-quant, symmetric (id 14).
    Q6_K,
    /// 4-bit indices into a non-linear grid, blocks of 32 (id 20).
    IQ4_NL,
    /// IQ4_NL's grid in 256-element super-blocks with 6-bit sub-block scales (id 23).
    IQ4_XS,
}

impl QuantFormat {
    /// Every format, in GGML id order.
    pub const ALL: [QuantFormat; 9] = [
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q2_K,
        QuantFormat::Q3_K,
        QuantFormat::Q4_K,
        QuantFormat::Q5_K,
        QuantFormat::Q6_K,
        QuantFormat::IQ4_NL,
        QuantFormat::IQ4_XS,
    ];

    /// The format of a GGML type id, if it is one of these.
    pub fn from_id(id: u32) -> Option<Self> {
        QuantFormat::ALL.into_iter().find(|f| f.id() == id)
    }

    /// The GGML type id.
    pub fn id(self) -> u32 {
        match self {
            QuantFormat::Q5_0 => 6,
            QuantFormat::Q5_1 => 7,
            QuantFormat::Q2_K => 10,
            QuantFormat::Q3_K => 11,
            QuantFormat::Q4_K => 12,
            QuantFormat::Q5_K => 13,
            QuantFormat::Q6_K => 14,
            QuantFormat::IQ4_NL => 20,
            QuantFormat::IQ4_XS => 23,
        }
    }

    /// GGML's name (`Q4_K`).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q5_0 => "Q5_0",
            QuantFormat::Q5_1 => "Q5_1",
            QuantFormat::Q2_K => "Q2_K",
            QuantFormat::Q3_K => "Q3_K",
            QuantFormat::Q4_K => "Q4_K",
            QuantFormat::Q5_K => "Q5_K",
            QuantFormat::Q6_K => "Q6_K",
            QuantFormat::IQ4_NL => "IQ4_NL",
            QuantFormat::IQ4_XS => "IQ4_XS",
        }
    }

    /// Elements per block (32, or [`QK_K`] for the super-block formats).
    pub fn block_len(self) -> usize {
        match self {
            QuantFormat::Q5_0 | QuantFormat::Q5_1 | QuantFormat::IQ4_NL => 32,
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5_1 => 24,
            QuantFormat::Q2_K => 84,
            QuantFormat::Q3_K => 110,
            QuantFormat::Q4_K => 144,
            QuantFormat::Q5_K => 176,
            QuantFormat::Q6_K => 210,
            QuantFormat::IQ4_NL => 18,
            QuantFormat::IQ4_XS => 136,
        }
    }

    /// Whether [`to_q8_0`] repacks this format (its values are exactly `d·q` with an f16 `d`
    /// per 32 elements and `q` in −128..=127).
    pub fn fits_q8_0(self) -> bool {
        matches!(self, QuantFormat::Q5_0 | QuantFormat::IQ4_NL | QuantFormat::Q3_K)
    }

    /// Whether [`to_eight16`] repacks this format (its values are `d·q` or `d·q + m` with a
    /// scale and minimum per 16 elements and `q` in −128..=127).
    pub fn fits_eight16(self) -> bool {
        matches!(
            self,
            QuantFormat::Q5_1
                | QuantFormat::Q2_K
                | QuantFormat::Q5_K
                | QuantFormat::Q6_K
                | QuantFormat::IQ4_XS
        )
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K or Q5_K super-block from its
/// 12 packed bytes: bytes 0..4 hold scales 0..4 in their low six bits, bytes 4..8 minimums
/// 0..4; scales and minimums 4..8 have their low four bits in the nibbles of bytes 8..12 and
/// their top two in the spare high bits of bytes 0..8.
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The sixteen 6-bit scales of a Q3_K super-block (as stored, before subtracting 32): low
/// four bits in the nibbles of bytes 0..8 (scales 0..8 low, 8..16 high), top two in the bit
/// pairs of bytes 8..12 (scale `i` in byte `8 + i % 4`, pair `i / 4`).
fn q3_k_scales(s: &[u8]) -> [i32; 16] {
    std::array::from_fn(|i| {
        let low = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        i32::from(low | (high << 4))
    })
}

/// The sub-block scale of sub-block `i` (0..8) of an IQ4_XS super-block, as stored.
fn iq4_xs_scale(blk: &[u8], i: usize) -> i32 {
    let high = u16::from_le_bytes([blk[2], blk[3]]);
    let low = (blk[4 + i / 2] >> (4 * (i % 2))) & 0x0f;
    i32::from(low) | (i32::from((high >> (2 * i)) & 3) << 4)
}

/// The 32 quants of a block of 32 with nibbles in the Q4_0 order (`qs` 16 bytes) and fifth
/// bits in `qh`.
fn five_bit(qs: &[u8], qh: u32) -> [u8; 32] {
    std::array::from_fn(|i| {
        let nibble = if i < 16 { qs[i] & 0x0f } else { qs[i - 16] >> 4 };
        nibble | ((((qh >> i) & 1) as u8) << 4)
    })
}

/// The 256 quants of one Q3_K super-block, in −4..=3.
fn q3_k_quants(blk: &[u8]) -> [i32; QK_K] {
    let (hmask, qs) = (&blk[..32], &blk[32..96]);
    std::array::from_fn(|e| {
        let (n, j, l) = (e / 128, e % 128 / 32, e % 32);
        let low = i32::from((qs[32 * n + l] >> (2 * j)) & 3);
        let high_set = (hmask[l] >> (4 * n + j)) & 1 == 1;
        if high_set {
            low
        } else {
            low - 4
        }
    })
}

/// Dequantizes whole blocks: `bytes` holds `out.len() / format.block_len()` blocks of
/// `format`.
///
/// Lengths must agree (`out.len()` a multiple of the block length, `bytes.len()` the matching
/// block bytes); callers check.
pub fn dequantize(format: QuantFormat, bytes: &[u8], out: &mut [f32]) {
    let blocks = bytes.chunks_exact(format.block_bytes());
    for (blk, o) in blocks.zip(out.chunks_exact_mut(format.block_len())) {
        match format {
            QuantFormat::Q5_0 => {
                let d = f16_at(blk, 0);
                let q = five_bit(&blk[6..22], u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]));
                for (x, &q) in o.iter_mut().zip(&q) {
                    *x = f32::from(i16::from(q) - 16) * d;
                }
            }
            QuantFormat::Q5_1 => {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                let q = five_bit(&blk[8..24], u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]));
                for (x, &q) in o.iter_mut().zip(&q) {
                    *x = f32::from(q) * d + m;
                }
            }
            QuantFormat::IQ4_NL => {
                let d = f16_at(blk, 0);
                for (j, &q) in blk[2..18].iter().enumerate() {
                    o[j] = d * f32::from(IQ4_VALUES[usize::from(q & 0x0f)]);
                    o[j + 16] = d * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
                }
            }
            QuantFormat::Q2_K => {
                let (scales, qs) = (&blk[..16], &blk[16..80]);
                let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
                for (i, sub) in o.chunks_exact_mut(16).enumerate() {
                    let dl = d * f32::from(scales[i] & 0x0f);
                    let ml = dmin * f32::from(scales[i] >> 4);
                    let (n, j, l0) = (i / 8, i % 8 / 2, i % 2 * 16);
                    for (l, x) in (l0..l0 + 16).zip(sub) {
                        *x = dl * f32::from((qs[32 * n + l] >> (2 * j)) & 3) - ml;
                    }
                }
            }
            QuantFormat::Q3_K => {
                let d = f16_at(blk, 108);
                let (q, scales) = (q3_k_quants(blk), q3_k_scales(&blk[96..108]));
                for (i, sub) in o.chunks_exact_mut(16).enumerate() {
                    let dl = d * (scales[i] - 32) as f32;
                    for (x, &q) in sub.iter_mut().zip(&q[16 * i..16 * i + 16]) {
                        *x = dl * q as f32;
                    }
                }
            }
            QuantFormat::Q4_K | QuantFormat::Q5_K => {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let scales = &blk[4..16];
                let (qh, qs) = if format == QuantFormat::Q5_K {
                    (Some(&blk[16..48]), &blk[48..176])
                } else {
                    (None, &blk[16..144])
                };
                for (i, sub) in o.chunks_exact_mut(32).enumerate() {
                    let (sc, m) = scale_min_k4(i, scales);
                    let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
                    let c = i / 2;
                    for (l, x) in sub.iter_mut().enumerate() {
                        let byte = qs[32 * c + l];
                        let mut q = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                        if let Some(qh) = qh {
                            q |= ((qh[l] >> i) & 1) << 4;
                        }
                        *x = d1 * f32::from(q) - m1;
                    }
                }
            }
            QuantFormat::Q6_K => {
                let (ql, qh, scales) = (&blk[..128], &blk[128..192], &blk[192..208]);
                let d = f16_at(blk, 208);
                for (i, sub) in o.chunks_exact_mut(16).enumerate() {
                    let dl = d * f32::from(scales[i] as i8);
                    let (n, k, l0) = (i / 8, i % 8 / 2, i % 2 * 16);
                    for (l, x) in (l0..l0 + 16).zip(sub) {
                        let low = ql[64 * n + 32 * (k % 2) + l];
                        let low = if k < 2 { low & 0x0f } else { low >> 4 };
                        let high = (qh[32 * n + l] >> (2 * k)) & 3;
                        *x = dl * f32::from(i16::from(low | (high << 4)) - 32);
                    }
                }
            }
            QuantFormat::IQ4_XS => {
                let d = f16_at(blk, 0);
                let qs = &blk[8..136];
                for (i, sub) in o.chunks_exact_mut(32).enumerate() {
                    let dl = d * (iq4_xs_scale(blk, i) - 32) as f32;
                    for (j, &q) in qs[16 * i..16 * i + 16].iter().enumerate() {
                        sub[j] = dl * f32::from(IQ4_VALUES[usize::from(q & 0x0f)]);
                        sub[j + 16] = dl * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
                    }
                }
            }
        }
    }
}

/// Repacks whole blocks of `format` into Q8_0 blocks (an f16 `d` and 32 signed bytes per 32
/// elements) with the same values, or `None` when the format has no such form (see
/// [`QuantFormat::fits_q8_0`]).
///
/// The values are bit for bit those of [`dequantize`], except that a Q3_K zero may change
/// sign: Q3_K's integers `(sc − 32)·q` reach +128, so a block of 32 holding one is stored
/// negated with the scale `−d`.
///
/// `bytes` must be whole blocks; callers check.
pub fn to_q8_0(format: QuantFormat, bytes: &[u8]) -> Option<Vec<u8>> {
    if !format.fits_q8_0() {
        return None;
    }
    let n = bytes.len() / format.block_bytes() * format.block_len();
    let mut out = Vec::with_capacity(n / 32 * 34);
    for blk in bytes.chunks_exact(format.block_bytes()) {
        match format {
            QuantFormat::Q5_0 => {
                out.extend_from_slice(&blk[..2]);
                let q = five_bit(&blk[6..22], u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]));
                out.extend(q.iter().map(|&q| (q as i8 - 16) as u8));
            }
            QuantFormat::IQ4_NL => {
                out.extend_from_slice(&blk[..2]);
                let q = |n: u8| IQ4_VALUES[usize::from(n)] as u8;
                out.extend(blk[2..18].iter().map(|&b| q(b & 0x0f)));
                out.extend(blk[2..18].iter().map(|&b| q(b >> 4)));
            }
            QuantFormat::Q3_K => {
                // `d·((sc − 32)·q)` equals ggml's `(d·(sc − 32))·q`: both products are exact.
                let d = u16::from_le_bytes([blk[108], blk[109]]);
                let (q, scales) = (q3_k_quants(blk), q3_k_scales(&blk[96..108]));
                let ints: Vec<i32> = (0..QK_K).map(|e| (scales[e / 16] - 32) * q[e]).collect();
                for part in ints.chunks_exact(32) {
                    let flip = part.contains(&128);
                    let d = if flip { d ^ 0x8000 } else { d };
                    out.extend(d.to_le_bytes());
                    out.extend(part.iter().map(|&v| (if flip { -v } else { v }) as i8 as u8));
                }
            }
            _ => return None,
        }
    }
    Some(out)
}

/// Q4_K super-blocks in the 4-bit form of [`QMatrix`](tensor::kernels::QMatrix) (`d·q + m`
/// per block of 32, f32 scales and minimums, nibbles in the Q4_0 order): per block of 32 the
/// scale `d·sc`, the minimum `−(dmin·m)` and 16 bytes of nibbles. `scale·q + min` is bit for
/// bit the dequantized value (`scale·q` is exact, and `x + (−y)` is `x − y` in IEEE
/// arithmetic).
#[derive(Clone, Debug, PartialEq)]
pub struct FourBit {
    /// One scale per block of 32.
    pub scales: Vec<f32>,
    /// One minimum per block of 32.
    pub mins: Vec<f32>,
    /// 16 bytes per block of 32: byte `j` holds element `j` low, `j + 16` high.
    pub qs: Vec<u8>,
}

/// Repacks whole Q4_K super-blocks into [`FourBit`]; `bytes` must be whole super-blocks.
pub fn q4_k_four_bit(bytes: &[u8]) -> FourBit {
    let nb = bytes.len() / QuantFormat::Q4_K.block_bytes() * (QK_K / 32);
    let mut four =
        FourBit { scales: Vec::with_capacity(nb), mins: Vec::with_capacity(nb), qs: Vec::new() };
    four.qs.reserve(nb * 16);
    for blk in bytes.chunks_exact(QuantFormat::Q4_K.block_bytes()) {
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let qs = &blk[16..144];
        for i in 0..8 {
            let (sc, m) = scale_min_k4(i, &blk[4..16]);
            four.scales.push(d * f32::from(sc));
            four.mins.push(-(dmin * f32::from(m)));
            let q = &qs[32 * (i / 2)..32 * (i / 2) + 32];
            let nibble = |b: u8| if i % 2 == 0 { b & 0x0f } else { b >> 4 };
            four.qs.extend((0..16).map(|j| nibble(q[j]) | (nibble(q[j + 16]) << 4)));
        }
    }
    four
}

/// Blocks in the form of [`QMatrix::eight16`](tensor::kernels::QMatrix::eight16): one signed
/// byte per element, in order, with a scale per 16 elements and a minimum per 16 (or none).
/// `scale·q + min` (or `scale·q`) is bit for bit the dequantized value: each scale and minimum
/// is the product ggml computes before it multiplies the quant, and `x + (−y)` is `x − y` in
/// IEEE arithmetic.
#[derive(Clone, Debug, PartialEq)]
pub struct Eight16 {
    /// One scale per 16 elements.
    pub scales: Vec<f32>,
    /// One minimum per 16 elements, or none (Q6_K, IQ4_XS).
    pub mins: Vec<f32>,
    /// One signed byte per element.
    pub qs: Vec<u8>,
}

/// Repacks whole blocks of `format` into [`Eight16`], or `None` when the format has no such
/// form (see [`QuantFormat::fits_eight16`]). `bytes` must be whole blocks.
pub fn to_eight16(format: QuantFormat, bytes: &[u8]) -> Option<Eight16> {
    if !format.fits_eight16() {
        return None;
    }
    let n = bytes.len() / format.block_bytes() * format.block_len();
    let with_mins = matches!(format, QuantFormat::Q5_1 | QuantFormat::Q2_K | QuantFormat::Q5_K);
    let mut out = Eight16 {
        scales: Vec::with_capacity(n / 16),
        mins: Vec::with_capacity(if with_mins { n / 16 } else { 0 }),
        qs: Vec::with_capacity(n),
    };
    // A scale (and minimum) shared by the next `times` groups of 16.
    let group = |out: &mut Eight16, d: f32, m: Option<f32>, times: usize| {
        for _ in 0..times {
            out.scales.push(d);
            out.mins.extend(m);
        }
    };
    for blk in bytes.chunks_exact(format.block_bytes()) {
        match format {
            QuantFormat::Q5_1 => {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                group(&mut out, d, Some(m), 2);
                out.qs.extend(five_bit(
                    &blk[8..24],
                    u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]),
                ));
            }
            QuantFormat::Q2_K => {
                let (scales, qs) = (&blk[..16], &blk[16..80]);
                let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
                for (i, &sc) in scales.iter().enumerate() {
                    let dl = d * f32::from(sc & 0x0f);
                    let ml = dmin * f32::from(sc >> 4);
                    group(&mut out, dl, Some(-ml), 1);
                    let (n, j, l0) = (i / 8, i % 8 / 2, i % 2 * 16);
                    out.qs.extend((l0..l0 + 16).map(|l| (qs[32 * n + l] >> (2 * j)) & 3));
                }
            }
            QuantFormat::Q5_K => {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let (scales, qh, qs) = (&blk[4..16], &blk[16..48], &blk[48..176]);
                for i in 0..8 {
                    let (sc, m) = scale_min_k4(i, scales);
                    group(&mut out, d * f32::from(sc), Some(-(dmin * f32::from(m))), 2);
                    let c = i / 2;
                    out.qs.extend((0..32).map(|l| {
                        let byte = qs[32 * c + l];
                        let low = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                        low | (((qh[l] >> i) & 1) << 4)
                    }));
                }
            }
            QuantFormat::Q6_K => {
                let (ql, qh, scales) = (&blk[..128], &blk[128..192], &blk[192..208]);
                let d = f16_at(blk, 208);
                for (i, &sc) in scales.iter().enumerate() {
                    group(&mut out, d * f32::from(sc as i8), None, 1);
                    let (n, k, l0) = (i / 8, i % 8 / 2, i % 2 * 16);
                    out.qs.extend((l0..l0 + 16).map(|l| {
                        let low = ql[64 * n + 32 * (k % 2) + l];
                        let low = if k < 2 { low & 0x0f } else { low >> 4 };
                        let high = (qh[32 * n + l] >> (2 * k)) & 3;
                        // In −32..=31: the two's complement byte of `q − 32`.
                        (low | (high << 4)).wrapping_sub(32)
                    }));
                }
            }
            QuantFormat::IQ4_XS => {
                let d = f16_at(blk, 0);
                let qs = &blk[8..136];
                for i in 0..8 {
                    group(&mut out, d * (iq4_xs_scale(blk, i) - 32) as f32, None, 2);
                    let q = &qs[16 * i..16 * i + 16];
                    let value = |n: u8| IQ4_VALUES[usize::from(n)] as u8;
                    out.qs.extend(q.iter().map(|&b| value(b & 0x0f)));
                    out.qs.extend(q.iter().map(|&b| value(b >> 4)));
                }
            }
            _ => unreachable!("checked by fits_eight16"),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scale and minimum of sub-block `i` of [`q4_k_by_hand`]: the last ones use the top bits
    /// of the split 6-bit encoding.
    fn by_hand_scale_min(i: usize) -> (u8, u8) {
        let i = i as u8;
        (if i == 7 { 40 } else { i + 1 }, 9 * i)
    }

    /// A Q4_K super-block with every field set by hand: `d = 0.5`, `dmin = 0.25`, sub-block
    /// scales and minimums from [`by_hand_scale_min`], and in each 32-byte chunk byte `l` with
    /// low nibble `l % 16` and high nibble `(l + 5) % 16`.
    fn q4_k_by_hand() -> Vec<u8> {
        let mut blk = f16::from_f32(0.5).to_le_bytes().to_vec();
        blk.extend(f16::from_f32(0.25).to_le_bytes());
        let (sc, m): (Vec<u8>, Vec<u8>) = (0..8).map(by_hand_scale_min).unzip();
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
        }
        blk.extend(s);
        for _chunk in 0..4 {
            blk.extend((0..32u8).map(|l| (((l + 5) % 16) << 4) | (l % 16)));
        }
        blk
    }

    #[test]
    fn q4_k_scales_minimums_and_nibbles_by_hand() {
        let blk = q4_k_by_hand();
        assert_eq!(blk.len(), 144);
        for i in 0..8 {
            assert_eq!(scale_min_k4(i, &blk[4..16]), by_hand_scale_min(i), "sub-block {i}");
        }
        let mut out = [0.0; 256];
        dequantize(QuantFormat::Q4_K, &blk, &mut out);
        // Element 64c + l: low nibble of byte l (sub-block 2c); 64c + 32 + l: its high nibble.
        assert_eq!(out[3], 0.5 * 1.0 * 3.0 - 0.25 * 0.0);
        assert_eq!(out[32 + 5], 0.5 * 2.0 * 10.0 - 0.25 * 9.0);
        assert_eq!(out[224 + 17], 0.5 * 40.0 * 6.0 - 0.25 * 63.0);
    }

    #[test]
    fn q4_k_four_bit_form_is_the_dequantized_value_bit_for_bit() {
        let mut bytes = q4_k_by_hand();
        bytes.extend(q4_k_by_hand().iter().map(|b| b.wrapping_mul(37).wrapping_add(11)));
        let mut want = vec![0.0; 512];
        dequantize(QuantFormat::Q4_K, &bytes, &mut want);
        let four = q4_k_four_bit(&bytes);
        assert_eq!((four.scales.len(), four.mins.len(), four.qs.len()), (16, 16, 256));
        for (e, w) in want.iter().enumerate() {
            let (b, j) = (e / 32, e % 32);
            let byte = four.qs[16 * b + j % 16];
            let q = if j < 16 { byte & 0x0f } else { byte >> 4 };
            let got = four.scales[b] * f32::from(q) + four.mins[b];
            assert_eq!(got.to_bits(), w.to_bits(), "element {e}: {got} vs {w}");
        }
    }

    #[test]
    fn every_format_has_its_ggml_id_and_size() {
        for f in QuantFormat::ALL {
            assert_eq!(QuantFormat::from_id(f.id()), Some(f));
        }
        let bits: Vec<f64> = QuantFormat::ALL
            .iter()
            .map(|f| f.block_bytes() as f64 * 8.0 / f.block_len() as f64)
            .collect();
        assert_eq!(bits, [5.5, 6.0, 2.625, 3.4375, 4.5, 5.5, 6.5625, 4.5, 4.25]);
    }

    /// `blocks` pseudo-random blocks of `format` whose f16 scales are ordinary numbers.
    fn random_blocks(format: QuantFormat, blocks: usize, seed: u32) -> Vec<u8> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let mut bytes: Vec<u8> = (0..blocks * format.block_bytes())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 8) as u8
            })
            .collect();
        let halves: &[usize] = match format {
            QuantFormat::Q5_1 | QuantFormat::Q5_K => &[0, 2],
            QuantFormat::Q2_K => &[80, 82],
            QuantFormat::Q6_K => &[208],
            _ => &[0],
        };
        for (b, blk) in bytes.chunks_exact_mut(format.block_bytes()).enumerate() {
            for (k, &at) in halves.iter().enumerate() {
                let v =
                    f16::from_f32(0.013 * (1 + b + 3 * k) as f32 * if k == 0 { 1.0 } else { 0.7 });
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn the_eight16_form_is_the_dequantized_value_bit_for_bit() {
        for format in QuantFormat::ALL {
            let bytes = random_blocks(format, 3, format.id());
            let Some(e) = to_eight16(format, &bytes) else {
                assert!(!format.fits_eight16(), "{format:?}");
                continue;
            };
            let n = 3 * format.block_len();
            let mut want = vec![0.0; n];
            dequantize(format, &bytes, &mut want);
            assert_eq!((e.scales.len(), e.qs.len()), (n / 16, n), "{format:?}");
            assert!(e.mins.is_empty() || e.mins.len() == n / 16, "{format:?}");
            for (i, w) in want.iter().enumerate() {
                let mut got = e.scales[i / 16] * f32::from(e.qs[i] as i8);
                if let Some(m) = e.mins.get(i / 16) {
                    got += m;
                }
                assert_eq!(got.to_bits(), w.to_bits(), "{format:?} element {i}: {got} vs {w}");
            }
        }
    }
}
