//! Where weights come from: [`WeightSource`], the reading side every checkpoint format
//! implements (GGUF in [`crate::gguf`], Hugging Face safetensors in [`crate::safetensors`]),
//! and the [`Shard`] of a matrix a rank asks it for.

use crate::error::Result;
use std::ops::Range;
use tensor::kernels::QMatrix;

/// A checkpoint that can hand out slices of its tensors as f32. Names are GGUF llama names
/// (`blk.0.attn_q.weight`); a Hugging Face loader maps its names onto them.
pub trait WeightSource {
    /// The shape of `name`, outermost first.
    ///
    /// # Errors
    /// [`crate::Error::Tensor`] when the tensor is missing.
    fn shape(&self, name: &str) -> Result<Vec<usize>>;

    /// Whether `name` exists.
    fn has(&self, name: &str) -> bool;

    /// Rows `rows` of `name` viewed as `[rows, row_len]`.
    ///
    /// # Errors
    /// [`crate::Error::Tensor`] when the tensor is missing, unsupported, or the range out of bounds.
    fn rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>>;

    /// Columns `cols` of every row of `name`.
    ///
    /// # Errors
    /// As [`WeightSource::rows`].
    fn cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>>;

    /// The slice `shard` of `name` in its stored block-quantized form, or `None` when the
    /// tensor is not block-quantized or the slice does not fall on block boundaries.
    ///
    /// # Errors
    /// As [`WeightSource::rows`].
    fn quantized(&self, name: &str, shard: &Shard) -> Result<Option<QMatrix>> {
        let _ = (name, shard);
        Ok(None)
    }

    /// Whether Q/K projection rows (and Q/K biases) are stored permuted for interleaved
    /// (adjacent-pair) rotary embedding, as GGUF llama files are; they are un-permuted at load.
    fn qk_interleaved(&self) -> bool;
}

/// A borrowed source reads as the source (so [`crate::Checkpoint::weights`] can hand out a
/// file it holds).
impl<T: WeightSource + ?Sized> WeightSource for &T {
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        (**self).shape(name)
    }

    fn has(&self, name: &str) -> bool {
        (**self).has(name)
    }

    fn rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        (**self).rows(name, rows)
    }

    fn cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>> {
        (**self).cols(name, cols)
    }

    fn quantized(&self, name: &str, shard: &Shard) -> Result<Option<QMatrix>> {
        (**self).quantized(name, shard)
    }

    fn qk_interleaved(&self) -> bool {
        (**self).qk_interleaved()
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

/// The names and shapes of a model's tensors and its Q/K convention, without their values:
/// enough to check a [`crate::Bucket`] against the model ([`crate::Bucket::open`]) with no
/// file open. Reading values from it is an error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShapeCatalog {
    shapes: std::collections::BTreeMap<String, Vec<usize>>,
    qk_interleaved: bool,
}

impl ShapeCatalog {
    /// The shapes of those of `names` that `src` has, and its Q/K convention.
    ///
    /// # Errors
    /// `src` cannot give the shape of a tensor it has.
    pub fn of<'a>(
        src: &dyn WeightSource,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<ShapeCatalog> {
        let shapes = names
            .into_iter()
            .filter(|name| src.has(name))
            .map(|name| Ok((name.to_owned(), src.shape(name)?)))
            .collect::<Result<_>>()?;
        Ok(ShapeCatalog { shapes, qk_interleaved: src.qk_interleaved() })
    }

    fn no_values(name: &str) -> crate::Error {
        crate::Error::tensor(name, "a shape catalog holds no values")
    }
}

impl WeightSource for ShapeCatalog {
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        self.shapes.get(name).cloned().ok_or_else(|| crate::Error::tensor(name, "not in the model"))
    }

    fn has(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }

    fn rows(&self, name: &str, _: Range<usize>) -> Result<Vec<f32>> {
        Err(ShapeCatalog::no_values(name))
    }

    fn cols(&self, name: &str, _: Range<usize>) -> Result<Vec<f32>> {
        Err(ShapeCatalog::no_values(name))
    }

    fn qk_interleaved(&self) -> bool {
        self.qk_interleaved
    }
}
