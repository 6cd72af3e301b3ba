//! GGUF as a [`WeightSource`]: a rank's [`Shard`] of a tensor read straight from the mapped
//! file, block-quantized tensors handed out in a form [`QMatrix`] keeps (as stored, or
//! repacked losslessly).

use super::kquant::{self, QuantFormat};
use super::{GgmlType, GgufFile};
use crate::error::Result;
use crate::source::{Shard, WeightSource};
use std::borrow::Cow;
use std::ops::Range;
use tensor::kernels::cpu::quant::{BlockFormat, BLOCK};
use tensor::kernels::QMatrix;

impl GgufFile {
    /// Whether the file stores Q/K/V as one `attn_qkv` tensor and the gate with the up
    /// projection in `ffn_up` (Phi-3): load it through [`crate::fused::FusedSource`].
    pub fn has_fused_projections(&self) -> bool {
        self.has_tensor("blk.0.attn_qkv.weight")
    }
}

impl WeightSource for GgufFile {
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.tensor_info(name)?.shape())
    }

    fn has(&self, name: &str) -> bool {
        self.has_tensor(name)
    }

    fn rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        self.tensor_rows(name, rows)
    }

    fn cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>> {
        self.tensor_cols(name, cols)
    }

    /// Q8_0, Q4_0 and Q4_1 as stored; Q4_K as 4-bit blocks of 32 ([`kquant::q4_k_four_bit`]);
    /// Q5_0, IQ4_NL and Q3_K repacked losslessly as Q8_0 ([`kquant::to_q8_0`]); Q5_1, Q2_K,
    /// Q5_K, Q6_K and IQ4_XS as bytes with a scale per 16 ([`kquant::to_eight16`]); `None` for
    /// the other formats, which load as f32.
    fn quantized(&self, name: &str, shard: &Shard) -> Result<Option<QMatrix>> {
        let info = self.tensor_info(name)?;
        // `None`: Q4_K or an `Eight16` format, repacked below.
        let format = match info.ggml_type {
            GgmlType::Block(format) => Some(format),
            GgmlType::Quant(f) if f.fits_q8_0() => Some(BlockFormat::Q8_0),
            GgmlType::Quant(QuantFormat::Q4_K) => None,
            GgmlType::Quant(f) if f.fits_eight16() => None,
            _ => return Ok(None),
        };
        let (rows, cols) = (info.rows(), info.row_len());
        let (row_range, col_range) = match shard {
            Shard::Full => (0..rows, 0..cols),
            Shard::Rows(r) => (r.clone(), 0..cols),
            Shard::Cols(c) => (0..rows, c.clone()),
        };
        if col_range.start % BLOCK != 0 || col_range.end % BLOCK != 0 || col_range.end > cols {
            return Ok(None);
        }
        if let GgmlType::Quant(f) = info.ggml_type {
            if f.fits_eight16() {
                let (_, stored) = self.raw_rows(name, row_range.clone())?;
                let Some(e) = kquant::to_eight16(f, stored) else { return Ok(None) };
                if col_range == (0..cols) {
                    // Every column: the repacked rows as they are (a copy of gigabytes of
                    // fresh memory less for a large model).
                    let (scales, mins, qs) = (e.scales, e.mins, e.qs);
                    return Ok(QMatrix::eight16(row_range.len(), cols, scales, mins, qs));
                }
                // Per row: `2·nb` scales (and minimums) and `cols` bytes; the columns' share.
                let (ng, g0, g1) = (cols / 16, col_range.start / 16, col_range.end / 16);
                let (mut scales, mut mins, mut qs) = (Vec::new(), Vec::new(), Vec::new());
                for r in 0..row_range.len() {
                    scales.extend_from_slice(&e.scales[r * ng + g0..r * ng + g1]);
                    if !e.mins.is_empty() {
                        mins.extend_from_slice(&e.mins[r * ng + g0..r * ng + g1]);
                    }
                    qs.extend_from_slice(
                        &e.qs[r * cols + col_range.start..r * cols + col_range.end],
                    );
                }
                return Ok(QMatrix::eight16(row_range.len(), col_range.len(), scales, mins, qs));
            }
        }
        let Some(format) = format else {
            let (_, stored) = self.raw_rows(name, row_range.clone())?;
            let four = kquant::q4_k_four_bit(stored);
            if col_range == (0..cols) {
                // Every column: the repacked rows as they are, as above.
                let (scales, mins, qs) = (four.scales, four.mins, four.qs);
                return Ok(QMatrix::four_bit(row_range.len(), cols, scales, mins, qs));
            }
            let (nb, c0, c1) = (cols / BLOCK, col_range.start / BLOCK, col_range.end / BLOCK);
            let picked = (0..row_range.len()).map(|r| r * nb + c0..r * nb + c1);
            let (mut scales, mut mins, mut qs) = (Vec::new(), Vec::new(), Vec::new());
            for blocks in picked {
                scales.extend_from_slice(&four.scales[blocks.clone()]);
                mins.extend_from_slice(&four.mins[blocks.clone()]);
                qs.extend_from_slice(&four.qs[blocks.start * 16..blocks.end * 16]);
            }
            return Ok(QMatrix::four_bit(row_range.len(), col_range.len(), scales, mins, qs));
        };
        let (info, stored) = self.raw_rows(name, row_range.clone())?;
        let bytes = match info.ggml_type {
            GgmlType::Quant(f) => match kquant::to_q8_0(f, stored) {
                Some(q8) => Cow::Owned(q8),
                None => return Ok(None),
            },
            _ => Cow::Borrowed(stored),
        };
        let bb = format.block_bytes();
        let row_bytes = cols / BLOCK * bb;
        let (b0, b1) = (col_range.start / BLOCK * bb, col_range.end / BLOCK * bb);
        let picked: Cow<'_, [u8]> = if col_range == (0..cols) {
            bytes
        } else {
            bytes.chunks_exact(row_bytes).flat_map(|row| &row[b0..b1]).copied().collect()
        };
        Ok(QMatrix::from_blocks(format, row_range.len(), col_range.len(), &picked))
    }

    /// llama.cpp permutes Q/K rows for the llama architecture; Qwen2, Qwen3, Phi-3 and Gemma
    /// (1, 2, 3) files keep the Hugging Face order (their NEOX rotary is rotate-half already).
    fn qk_interleaved(&self) -> bool {
        let arch = self.get("general.architecture").and_then(|v| v.as_str());
        !matches!(arch, Some("qwen2" | "qwen3" | "phi3" | "gemma" | "gemma2" | "gemma3"))
    }
}
