//! Weight loading: where weights come from ([`WeightSource`]), which slice of a matrix a rank
//! keeps ([`Shard`]), and the [`Linear`] layer.
//!
//! Tensor parallelism shards Q/K/V/gate/up by output rows and O/down by input columns, always
//! by whole KV-head groups for attention; loading reads only the requested slice from the file.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::{Backend, Weight};
use crate::tensor::Tensor;
use std::ops::Range;

/// A checkpoint that can hand out slices of its tensors as f32. Names are GGUF llama names
/// (`blk.0.attn_q.weight`); a Hugging Face loader maps its names onto them.
pub trait WeightSource {
    /// The shape of `name`, outermost first.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the tensor is missing.
    fn shape(&self, name: &str) -> Result<Vec<usize>>;

    /// Whether `name` exists.
    fn has(&self, name: &str) -> bool;

    /// Rows `rows` of `name` viewed as `[rows, row_len]`.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the tensor is missing, unsupported, or the range out of bounds.
    fn rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>>;

    /// Columns `cols` of every row of `name`.
    ///
    /// # Errors
    /// As [`WeightSource::rows`].
    fn cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>>;

    /// Whether Q/K projection rows are stored permuted for interleaved (adjacent-pair) rotary
    /// embedding, as GGUF llama files are; they are un-permuted at load.
    fn qk_interleaved(&self) -> bool;
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

    fn qk_interleaved(&self) -> bool {
        true
    }
}

/// The part of a `[out_features, in_features]` weight matrix a rank keeps.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Shard {
    /// The whole matrix.
    #[default]
    Full,
    /// Output rows (column-parallel linear: Q/K/V/gate/up).
    Rows(Range<usize>),
    /// Input columns (row-parallel linear: O/down; outputs are partial sums).
    Cols(Range<usize>),
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

    /// Loads `shard` of the 2-d tensor `name`.
    ///
    /// # Errors
    /// [`Error::Tensor`] when it is missing, not 2-d, or the shard is out of bounds.
    pub fn load(src: &dyn WeightSource, name: &str, shard: &Shard) -> Result<Self> {
        let shape = src.shape(name)?;
        let [out, inp] = shape[..] else {
            return Err(Error::tensor(
                name,
                format!("expected a 2-d weight, found shape {shape:?}"),
            ));
        };
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
    ) -> Result<Self> {
        let lin =
            Linear::load(src, name, &Shard::Rows(heads.start * head_dim..heads.end * head_dim))?;
        if !src.qk_interleaved() {
            return Ok(lin);
        }
        let Weight::F32(t) = lin.weight;
        let shape = t.shape().to_vec();
        Ok(Linear {
            weight: Weight::F32(Tensor::from_vec(
                &shape,
                unpermute_rows(t.data(), shape[1], head_dim),
            )?),
        })
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
    /// [`Error::Shape`] when the input width differs from `in_features`.
    pub fn forward(&self, be: &Backend, x: &Tensor) -> Result<Tensor> {
        be.linear(x, &self.weight)
    }
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
    }
}
