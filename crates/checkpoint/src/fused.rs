//! Checkpoints that store some projections fused (Phi-3's GGUF files: `attn_qkv` holds the Q,
//! K and V rows one after another, `ffn_up` the gate rows then the up rows), seen through the
//! llama names the loaders ask for: [`FusedSource`] maps `attn_q`, `attn_k`, `attn_v`,
//! `ffn_gate` and `ffn_up` onto row ranges of the fused tensors.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::source::{Shard, WeightSource};
use std::ops::Range;
use tensor::kernels::QMatrix;

/// A weight source whose Q/K/V and gate/up projections are row ranges of fused tensors.
pub struct FusedSource<'a> {
    inner: &'a dyn WeightSource,
    /// Rows of Q, K and V in `attn_qkv`.
    qkv: [Range<usize>; 3],
    /// Rows of the gate and the up projection in the fused `ffn_up`.
    gate_up: [Range<usize>; 2],
}

impl<'a> FusedSource<'a> {
    /// `inner` with the fused layout of `config`'s shapes.
    pub fn new(inner: &'a dyn WeightSource, config: &LlamaConfig) -> Self {
        let (q, kv) = (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim);
        FusedSource {
            inner,
            qkv: [0..q, q..q + kv, q + kv..q + 2 * kv],
            gate_up: [0..config.ffn, config.ffn..2 * config.ffn],
        }
    }

    /// The fused tensor and the rows of it that `name` means, when it is one of the parts.
    fn part(&self, name: &str) -> Option<(String, Range<usize>)> {
        let rest = name.strip_prefix("blk.")?;
        let (layer, tensor) = rest.split_once('.')?;
        let fused = |t: &str| format!("blk.{layer}.{t}.weight");
        match tensor {
            "attn_q.weight" => Some((fused("attn_qkv"), self.qkv[0].clone())),
            "attn_k.weight" => Some((fused("attn_qkv"), self.qkv[1].clone())),
            "attn_v.weight" => Some((fused("attn_qkv"), self.qkv[2].clone())),
            "ffn_gate.weight" => Some((fused("ffn_up"), self.gate_up[0].clone())),
            "ffn_up.weight" => Some((fused("ffn_up"), self.gate_up[1].clone())),
            _ => None,
        }
    }

    /// `rows` of a part, as rows of its fused tensor.
    fn inside(name: &str, part: &Range<usize>, rows: Range<usize>) -> Result<Range<usize>> {
        if rows.end > part.len() {
            return Err(Error::tensor(
                name,
                format!("rows {rows:?} of a part of {} rows of its fused tensor", part.len()),
            ));
        }
        Ok(part.start + rows.start..part.start + rows.end)
    }
}

impl WeightSource for FusedSource<'_> {
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        match self.part(name) {
            Some((fused, part)) => {
                let shape = self.inner.shape(&fused)?;
                if shape.len() != 2 || shape[0] < part.end {
                    return Err(Error::tensor(
                        &fused,
                        format!("shape {shape:?} cannot hold rows {part:?} ({name})"),
                    ));
                }
                Ok(vec![part.len(), shape[1]])
            }
            None => self.inner.shape(name),
        }
    }

    fn has(&self, name: &str) -> bool {
        match self.part(name) {
            Some((fused, _)) => self.inner.has(&fused),
            None => self.inner.has(name),
        }
    }

    fn rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        match self.part(name) {
            Some((fused, part)) => self.inner.rows(&fused, Self::inside(name, &part, rows)?),
            None => self.inner.rows(name, rows),
        }
    }

    fn cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>> {
        let Some((fused, part)) = self.part(name) else { return self.inner.cols(name, cols) };
        let width = cols.len();
        let all = self.inner.cols(&fused, cols)?;
        Ok(all[part.start * width..part.end * width].to_vec())
    }

    fn quantized(&self, name: &str, shard: &Shard) -> Result<Option<QMatrix>> {
        let Some((fused, part)) = self.part(name) else {
            return self.inner.quantized(name, shard);
        };
        match shard {
            Shard::Full => self.inner.quantized(&fused, &Shard::Rows(part)),
            Shard::Rows(r) => {
                let rows = Self::inside(name, &part, r.clone())?;
                self.inner.quantized(&fused, &Shard::Rows(rows))
            }
            Shard::Cols(c) => {
                let all = self.inner.quantized(&fused, &Shard::Cols(c.clone()))?;
                Ok(all.map(|q| q.select_rows(&part.collect::<Vec<_>>())))
            }
        }
    }

    fn qk_interleaved(&self) -> bool {
        self.inner.qk_interleaved()
    }
}
