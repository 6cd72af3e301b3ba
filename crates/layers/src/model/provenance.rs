//! Where each weight buffer's values come from in the checkpoint: a map that lets a weight
//! update write a trainer's tensors straight into the live buffers, row by row, instead of
//! loading a whole new shard and copying it over them.
//!
//! The map is stated by each module next to the buffers it lists (same order as
//! [`WeightBuffers::buffers`]), from the slices it loaded: a column-parallel projection holds
//! rows of its tensor, a row-parallel one columns, a fused projection its parts one after the
//! other. Values are in the order the loader leaves them, which is a Hugging Face
//! checkpoint's (Q/K rows rotate-half, whatever the file stored).

use checkpoint::Bucket;
use std::ops::Range;
use tensor::kernels::Weight;
use tensor::memory::WeightBuffers;
use tensor::Tensor;

/// Rows `rows` and columns `cols` of checkpoint tensor `tensor` (viewed as `[rows, row_len]`,
/// a 1-d tensor as one row), laid row-major into a buffer from its f32 element `at`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    /// The tensor's name as the model reads it (`blk.3.attn_q.weight`).
    pub tensor: String,
    /// The tensor's rows.
    pub rows: Range<usize>,
    /// The tensor's columns.
    pub cols: Range<usize>,
    /// The buffer's first f32 element this span fills.
    pub at: usize,
}

impl Span {
    /// Whole rows `rows` of `tensor`, `row_len` elements each, at element `at`.
    pub(crate) fn rows(tensor: String, rows: Range<usize>, row_len: usize, at: usize) -> Span {
        Span { tensor, rows, cols: 0..row_len, at }
    }

    /// The f32 elements it fills.
    pub fn len(&self) -> usize {
        self.rows.len() * self.cols.len()
    }

    /// Whether it fills nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where the values of one weight buffer come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BufferSource {
    /// f32 values, each from one of these spans (which tile the buffer).
    F32(Vec<Span>),
    /// Another form (block-quantized scales, minimums or quants): only a load rebuilds it.
    Other,
}

/// Appends the sources of `weight`'s buffers: `spans` for an f32 weight, [`BufferSource::Other`]
/// for each buffer of a quantized one.
pub(crate) fn weight_sources(weight: &Weight, spans: Vec<Span>, out: &mut Vec<BufferSource>) {
    match weight {
        Weight::F32(t) => vector_source(t, spans, out),
        Weight::Quant(q) => {
            let mut buffers = Vec::new();
            q.buffers(&mut buffers);
            out.extend(buffers.iter().map(|_| BufferSource::Other));
        }
    }
}

/// Appends the source of the f32 tensor `t` (nothing when it is empty, as its buffers are).
pub(crate) fn vector_source(t: &Tensor, spans: Vec<Span>, out: &mut Vec<BufferSource>) {
    if !t.is_empty() {
        out.push(BufferSource::F32(spans));
    }
}

/// Where the values of each of a model shard's weight buffers come from, in buffer order
/// (built by `ParallelModel::weight_map`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightMap {
    buffers: Vec<BufferSource>,
}

impl WeightMap {
    /// The map of `buffers` from `sources`, checked: an f32 source whose spans do not tile its
    /// buffer exactly (in length, without overlap) is demoted to [`BufferSource::Other`], so
    /// the map never claims values it does not place; lists of different lengths demote
    /// every source.
    pub(crate) fn checked(sources: Vec<BufferSource>, buffers: &[&[u8]]) -> WeightMap {
        if sources.len() != buffers.len() {
            return WeightMap { buffers: vec![BufferSource::Other; buffers.len()] };
        }
        let buffers = sources
            .into_iter()
            .zip(buffers)
            .map(|(source, bytes)| match source {
                BufferSource::F32(spans)
                    if bytes.len() % 4 == 0 && tiles(&spans, bytes.len() / 4) =>
                {
                    BufferSource::F32(spans)
                }
                _ => BufferSource::Other,
            })
            .collect();
        WeightMap { buffers }
    }

    /// The source of each buffer.
    pub fn buffers(&self) -> &[BufferSource] {
        &self.buffers
    }

    /// The tensors its f32 buffers hold values of (a tensor may be named more than once).
    pub fn tensors(&self) -> impl Iterator<Item = &str> {
        self.buffers
            .iter()
            .flat_map(|b| match b {
                BufferSource::F32(spans) => spans.as_slice(),
                BufferSource::Other => &[],
            })
            .map(|s| s.tensor.as_str())
    }

    /// Whether the values of `tensor` that the shard holds are all in f32 buffers, where
    /// [`WeightMap::write`] can put new ones (false for a tensor the shard keeps quantized,
    /// or does not read).
    pub fn places(&self, tensor: &str) -> bool {
        self.buffers.iter().any(|b| match b {
            BufferSource::F32(spans) => spans.iter().any(|s| s.tensor == tensor),
            BufferSource::Other => false,
        })
    }

    /// Writes into `dst`, the f32 values of buffer `buffer`, every span whose tensor one of
    /// `buckets` holds (the last one holding it wins); spans of other tensors keep their
    /// values. Returns the values written (none for a buffer of another form).
    ///
    /// # Errors
    /// As [`WeightMap::pieces`] and [`Piece::write_from`]; the spans before it are written.
    pub fn write(
        &self,
        buckets: &[Bucket],
        buffer: usize,
        dst: &mut [f32],
    ) -> checkpoint::Result<usize> {
        let pieces = self.pieces(buffer, dst, usize::MAX)?;
        pieces.into_iter().map(|p| p.write_from(buckets)).sum()
    }

    /// Cuts `dst`, the f32 values of buffer `buffer`, into the pieces its spans fill, each of
    /// whole rows and at most `max` values (a row longer than that is a piece of its own), so
    /// that several threads can write them. None for a buffer of another form.
    ///
    /// # Errors
    /// `dst` is not the buffer's length.
    pub fn pieces<'a>(
        &'a self,
        buffer: usize,
        dst: &'a mut [f32],
        max: usize,
    ) -> checkpoint::Result<Vec<Piece<'a>>> {
        let Some(BufferSource::F32(spans)) = self.buffers.get(buffer) else {
            return Ok(Vec::new());
        };
        let len: usize = spans.iter().map(Span::len).sum();
        if dst.len() != len {
            return Err(checkpoint::Error::tensor(
                spans.first().map_or("", |s| s.tensor.as_str()),
                format!("weight buffer {buffer} holds {len} values, {} given", dst.len()),
            ));
        }
        let mut order: Vec<&Span> = spans.iter().collect();
        order.sort_unstable_by_key(|s| s.at);
        let mut rest = dst;
        let mut pieces = Vec::new();
        for span in order {
            let (mut values, tail) = std::mem::take(&mut rest).split_at_mut(span.len());
            rest = tail;
            let width = span.cols.len().max(1);
            let rows_per_piece = (max / width).max(1);
            let mut row = span.rows.start;
            while row < span.rows.end {
                let end = (row + rows_per_piece).min(span.rows.end);
                let (head, tail) =
                    std::mem::take(&mut values).split_at_mut((end - row) * span.cols.len());
                values = tail;
                pieces.push(Piece {
                    tensor: &span.tensor,
                    rows: row..end,
                    cols: span.cols.clone(),
                    dst: head,
                });
                row = end;
            }
        }
        Ok(pieces)
    }
}

/// Rows of one span and the memory they fill ([`WeightMap::pieces`]).
#[derive(Debug)]
pub struct Piece<'a> {
    /// The checkpoint tensor.
    pub tensor: &'a str,
    /// Its rows.
    pub rows: Range<usize>,
    /// Its columns.
    pub cols: Range<usize>,
    /// Where their values go, row-major.
    pub dst: &'a mut [f32],
}

impl Piece<'_> {
    /// Writes its values from the last of `buckets` that holds its tensor (none when no
    /// bucket does); returns the values written.
    ///
    /// # Errors
    /// The bucket cannot give them ([`Bucket::read_into`]).
    pub fn write_from(self, buckets: &[Bucket]) -> checkpoint::Result<usize> {
        let Some(bucket) = buckets.iter().rev().find(|b| b.holds(self.tensor)) else {
            return Ok(0);
        };
        bucket.read_into(self.tensor, self.rows, self.cols, self.dst)?;
        Ok(self.dst.len())
    }
}

/// Whether `spans`, sorted by their start, cover `0..len` end to end.
fn tiles(spans: &[Span], len: usize) -> bool {
    let mut sorted: Vec<(usize, usize)> = spans.iter().map(|s| (s.at, s.len())).collect();
    sorted.sort_unstable();
    let mut next = 0;
    for (at, n) in sorted {
        if at != next {
            return false;
        }
        next += n;
    }
    next == len
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(at: usize, rows: usize, cols: usize) -> Span {
        Span { tensor: "t".into(), rows: 0..rows, cols: 0..cols, at }
    }

    #[test]
    fn spans_must_tile_their_buffer() {
        let bytes: &[u8] = &[0u8; 40];
        let ok = BufferSource::F32(vec![span(4, 3, 2), span(0, 2, 2)]);
        let gap = BufferSource::F32(vec![span(0, 2, 2), span(5, 1, 5)]);
        let short = BufferSource::F32(vec![span(0, 3, 3)]);
        let long = BufferSource::F32(vec![span(0, 4, 3)]);
        let map = WeightMap::checked(vec![ok.clone(), gap, short, long], &[bytes; 4]);
        let other = BufferSource::Other;
        assert_eq!(map.buffers(), [ok, other.clone(), other.clone(), other]);
        assert!(map.places("t") && !map.places("u"));
        // A list of the wrong length places nothing.
        let map = WeightMap::checked(vec![BufferSource::F32(vec![span(0, 1, 10)])], &[bytes; 2]);
        assert_eq!(map.buffers(), [BufferSource::Other, BufferSource::Other]);
        assert!(!map.places("t"));
    }
}
