//! Weight loading: reading a rank's [`Shard`] of a matrix from a [`WeightSource`], and the
//! [`Linear`] layer.
//!
//! Tensor parallelism shards Q/K/V/gate/up by output rows and O/down by input columns, always
//! by whole KV-head groups for attention; loading reads only the requested slice from the file.

use crate::error::{Error, Result};
use checkpoint::{Shard, WeightSource};
use std::ops::Range;
use tensor::kernels::{Backend, Weight};
use tensor::memory::{Arena, WeightBuffers};
use tensor::Tensor;

/// How a linear layer keeps its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightForm {
    /// Keep block-quantized weights quantized (decode reads 4-8× fewer bytes): Q8_0, Q4_0 and
    /// Q4_1 as stored, Q4_K as 4-bit, Q5_0, IQ4_NL and Q3_K as 8-bit; others as f32.
    #[default]
    Native,
    /// Convert everything to f32.
    F32,
}

/// A bias-free linear layer `y = x · Wᵀ`.
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    weight: Weight,
}

impl Linear {
    /// Wraps a weight.
    pub fn new(weight: Weight) -> Self {
        Linear { weight }
    }

    /// Loads `shard` of the 2-d tensor `name`, in `form`.
    ///
    /// # Errors
    /// [`Error::Tensor`] when it is missing, not 2-d, or the shard is out of bounds.
    pub fn load(
        src: &dyn WeightSource,
        name: &str,
        shard: &Shard,
        form: WeightForm,
    ) -> Result<Self> {
        let shape = src.shape(name)?;
        let [out, inp] = shape[..] else {
            return Err(Error::tensor(
                name,
                format!("expected a 2-d weight, found shape {shape:?}"),
            ));
        };
        let in_bounds = match shard {
            Shard::Full => true,
            Shard::Rows(r) => r.start <= r.end && r.end <= out,
            Shard::Cols(c) => c.start <= c.end && c.end <= inp,
        };
        if !in_bounds {
            return Err(Error::tensor(
                name,
                format!("shard {shard:?} outside its shape {shape:?}"),
            ));
        }
        if form == WeightForm::Native {
            if let Some(q) = src.quantized(name, shard)? {
                return Ok(Linear { weight: Weight::Quant(q) });
            }
        }
        let (shape, data) = match shard {
            Shard::Full => ([out, inp], src.rows(name, 0..out)?),
            Shard::Rows(r) => ([r.len(), inp], src.rows(name, r.clone())?),
            Shard::Cols(c) => ([out, c.len()], src.cols(name, c.clone())?),
        };
        Ok(Linear { weight: Weight::F32(Tensor::from_vec(&shape, data)?) })
    }

    /// Loads the query or key projection rows of heads `heads` (of `head_dim` rows each), in
    /// the rotate-half layout: when the source stores them interleaved, each head's rows are
    /// un-permuted (see [`unpermute_rows`]).
    ///
    /// # Errors
    /// As [`Linear::load`].
    pub fn load_qk(
        src: &dyn WeightSource,
        name: &str,
        heads: Range<usize>,
        head_dim: usize,
        form: WeightForm,
    ) -> Result<Self> {
        let rows = Shard::Rows(heads.start * head_dim..heads.end * head_dim);
        let lin = Linear::load(src, name, &rows, form)?;
        if !src.qk_interleaved() {
            return Ok(lin);
        }
        let weight = match lin.weight {
            Weight::F32(t) => {
                let shape = t.shape().to_vec();
                Weight::F32(Tensor::from_vec(&shape, unpermute_rows(t.data(), shape[1], head_dim))?)
            }
            Weight::Quant(q) => {
                Weight::Quant(q.select_rows(&unpermute_order(q.dims().0, head_dim)))
            }
        };
        Ok(Linear { weight })
    }

    /// One layer computing all of `parts` from the same input: its output is their outputs
    /// side by side (split with [`Tensor::split_last`]).
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the parts differ in input width.
    pub fn concat(parts: &[&Linear]) -> Result<Linear> {
        let weights: Vec<&Weight> = parts.iter().map(|p| &p.weight).collect();
        Ok(Linear { weight: Weight::concat_rows(&weights)? })
    }

    /// The weight.
    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    /// `(out_features, in_features)` of the stored shard.
    pub fn dims(&self) -> (usize, usize) {
        self.weight.dims()
    }

    /// `x · Wᵀ` for `x` of `[.., in_features]`.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the input width differs from `in_features`.
    pub fn forward(&self, be: &Backend, x: &Tensor) -> Result<Tensor> {
        Ok(be.linear(x, &self.weight)?)
    }
}

impl super::WeightUses for Linear {
    fn weight_uses<'a>(&'a self, out: &mut Vec<tensor::kernels::WeightUse<'a>>) {
        out.push(tensor::kernels::WeightUse::Linear(&self.weight));
    }
}

impl WeightBuffers for Linear {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.weight.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> tensor::Result<()> {
        self.weight.move_to(arena)
    }
}

/// For each rotate-half row of `rows` rows (whole heads), the stored interleaved row it comes
/// from (see [`unpermute_rows`]).
pub fn unpermute_order(rows: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    (0..rows)
        .map(|r| {
            let (head, within) = (r / head_dim, r % head_dim);
            let (h, i) = (within / half, within % half);
            head * head_dim + 2 * i + h
        })
        .collect()
}

/// Undoes the GGUF llama Q/K row permutation head by head: within a head of `head_dim` rows,
/// GGUF row `2i + h` holds the rotate-half row `h · head_dim/2 + i` (`h` ∈ {0, 1}).
/// `w` is `[rows, cols]` with `rows` a multiple of `head_dim`.
pub fn unpermute_rows(w: &[f32], cols: usize, head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; w.len()];
    for (src_head, dst_head) in
        w.chunks_exact(head_dim * cols).zip(out.chunks_exact_mut(head_dim * cols))
    {
        for i in 0..half {
            for h in 0..2 {
                let src = &src_head[(2 * i + h) * cols..][..cols];
                dst_head[(h * half + i) * cols..][..cols].copy_from_slice(src);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_gguf_permutation() {
        // Two heads of 4 rows, 1 column: rotate-half rows r0..r3 are stored as r0 r2 r1 r3.
        let gguf = [0.0, 2.0, 1.0, 3.0, 10.0, 12.0, 11.0, 13.0];
        assert_eq!(unpermute_rows(&gguf, 1, 4), vec![0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]);
        let order = unpermute_order(8, 4);
        assert_eq!(order, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(order.iter().map(|&i| gguf[i]).collect::<Vec<_>>(), unpermute_rows(&gguf, 1, 4));
    }
}
