//! Tensor-parallel linear layers, the vocabulary-parallel embedding and LM head, and the
//! RMSNorm over a TP-sharded dimension.
//!
//! Conventions (Megatron's): a column-parallel layer keeps a range of output features and needs
//! no collective; a row-parallel layer keeps the matching range of input features, so its
//! output is a partial sum that an all-reduce over the TP group completes.

use crate::error::{Error, Result};
use crate::model::{Linear, WeightForm, WeightUses};
use checkpoint::{Shard, WeightSource};
use collectives::{Collective, Communicator, ReduceOp};
use std::ops::Range;
use std::sync::Arc;
use tensor::kernels::{Backend, LogitEdits, TopK, Weight, WeightUse};
use tensor::memory::{Arena, WeightBuffers};
use tensor::Tensor;

/// Ranges of `total` split over `parts`, each boundary a multiple of `align` where possible
/// (remainder blocks to the low ranks), so quantized blocks are never cut.
pub fn aligned_ranges(total: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    if align > 1 && total.is_multiple_of(align) && total / align >= parts {
        mesh::balanced_ranges(total / align, parts)
            .into_iter()
            .map(|r| r.start * align..r.end * align)
            .collect()
    } else {
        mesh::balanced_ranges(total, parts)
    }
}

/// Interleaves per-rank blocks `[rank][rows, width_r]` into `[rows, sum(width_r)]`.
fn interleave(blocks: &[f32], rows: usize, widths: &[usize]) -> Vec<f32> {
    let total: usize = widths.iter().sum();
    let mut out = vec![0f32; rows * total];
    let mut block_start = 0;
    let mut col = 0;
    for &w in widths {
        for r in 0..rows {
            let src = &blocks[block_start + r * w..block_start + (r + 1) * w];
            out[r * total + col..r * total + col + w].copy_from_slice(src);
        }
        block_start += rows * w;
        col += w;
    }
    out
}

/// Gathers column shards `[rows, width_rank]` from every TP rank into `[rows, total]`.
///
/// # Errors
/// A failed collective.
pub fn gather_columns(
    tp: &mut dyn Communicator,
    local: &Tensor,
    widths: &[usize],
) -> Result<Tensor> {
    if tp.size() == 1 {
        // Nothing to gather (and a device tensor stays on its device).
        return Ok(local.clone());
    }
    let rows = local.rows();
    let sizes: Vec<usize> = widths.iter().map(|w| w * rows).collect();
    let mut blocks = vec![0f32; sizes.iter().sum()];
    tp.all_gather_uneven(local.host()?, &mut blocks, &sizes)?;
    Ok(Tensor::from_vec(&[rows, widths.iter().sum()], interleave(&blocks, rows, widths))?)
}

/// A linear layer whose output features are split over the TP group.
#[derive(Clone, Debug)]
pub struct ColumnParallelLinear {
    linear: Linear,
    bias: Option<Vec<f32>>,
    ranges: Vec<Range<usize>>,
    rank: usize,
}

impl ColumnParallelLinear {
    /// Loads this rank's output rows of `name` (`ranges[rank]`), and the matching slice of
    /// `bias` when given.
    ///
    /// # Errors
    /// A missing or misshapen tensor.
    pub fn load(
        src: &dyn WeightSource,
        name: &str,
        bias: Option<&str>,
        ranges: Vec<Range<usize>>,
        rank: usize,
        form: WeightForm,
    ) -> Result<Self> {
        let rows = ranges[rank].clone();
        let linear = Linear::load(src, name, &Shard::Rows(rows.clone()), form)?;
        let bias = match bias {
            Some(b) => Some(src.rows(b, 0..1).map(|v| v[rows].to_vec())?),
            None => None,
        };
        Ok(ColumnParallelLinear { linear, bias, ranges, rank })
    }

    /// This rank's output features of `x`: `[n, ranges[rank].len()]`.
    ///
    /// # Errors
    /// `x` has the wrong width.
    pub fn forward(&self, be: &Backend, x: &Tensor) -> Result<Tensor> {
        let mut y = self.linear.forward(be, x)?;
        if let Some(b) = &self.bias {
            for row in y.host_mut()?.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        Ok(y)
    }

    /// Every output feature: the local ones gathered over TP.
    ///
    /// # Errors
    /// As [`ColumnParallelLinear::forward`], or a failed collective.
    pub fn forward_gathered(
        &self,
        be: &Backend,
        tp: &mut dyn Communicator,
        x: &Tensor,
    ) -> Result<Tensor> {
        let local = self.forward(be, x)?;
        let widths: Vec<usize> = self.ranges.iter().map(|r| r.len()).collect();
        gather_columns(tp, &local, &widths)
    }

    /// The output features this rank holds.
    pub fn local_range(&self) -> Range<usize> {
        self.ranges[self.rank].clone()
    }
}

/// A linear layer whose input features are split over the TP group; its output is the
/// all-reduced sum, with the bias added by TP rank 0 alone.
#[derive(Clone, Debug)]
pub struct RowParallelLinear {
    linear: Linear,
    bias: Option<Vec<f32>>,
    cols: Range<usize>,
}

impl RowParallelLinear {
    /// Loads input columns `cols` of `name`; `bias` only on the rank that adds it.
    ///
    /// # Errors
    /// A missing or misshapen tensor.
    pub fn load(
        src: &dyn WeightSource,
        name: &str,
        bias: Option<&str>,
        cols: Range<usize>,
        adds_bias: bool,
        form: WeightForm,
    ) -> Result<Self> {
        let linear = Linear::load(src, name, &Shard::Cols(cols.clone()), form)?;
        let bias = match (bias, adds_bias) {
            (Some(b), true) => Some(src.rows(b, 0..1)?),
            _ => None,
        };
        Ok(RowParallelLinear { linear, bias, cols })
    }

    /// Wraps an already sharded layer.
    pub fn from_linear(linear: Linear, cols: Range<usize>) -> Self {
        RowParallelLinear { linear, bias: None, cols }
    }

    /// `all_reduce(x_local · W_localᵀ) + bias` over the TP group.
    ///
    /// # Errors
    /// `x_local` has the wrong width, or a failed collective.
    pub fn forward(
        &self,
        be: &Backend,
        tp: &mut dyn Communicator,
        x_local: &Tensor,
    ) -> Result<Tensor> {
        let mut y = self.linear.forward(be, x_local)?;
        if let Some(b) = &self.bias {
            for row in y.host_mut()?.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        be.all_reduce_sum(tp, &mut y)?;
        Ok(y)
    }

    /// The input features this rank holds.
    pub fn cols(&self) -> Range<usize> {
        self.cols.clone()
    }
}

/// The token embedding with the vocabulary split over the TP group: each rank looks up the
/// ids in its range (zeros elsewhere) and an all-reduce completes every row. A tied LM head
/// shares the table ([`ParallelLmHead::tied`]).
#[derive(Clone, Debug)]
pub struct VocabParallelEmbedding {
    table: Arc<Weight>,
    vocab: Range<usize>,
    total: usize,
}

impl VocabParallelEmbedding {
    /// Loads rows `vocab` of the embedding table `name` (`[vocab, hidden]`).
    ///
    /// # Errors
    /// A missing or misshapen tensor.
    pub fn load(
        src: &dyn WeightSource,
        name: &str,
        vocab: Range<usize>,
        form: WeightForm,
    ) -> Result<Self> {
        let total = src.shape(name)?.first().copied().unwrap_or(0);
        let table = Linear::load(src, name, &Shard::Rows(vocab.clone()), form)?.weight().clone();
        Ok(VocabParallelEmbedding { table: Arc::new(table), vocab, total })
    }

    /// Embeddings of `ids`: `[ids.len(), hidden]`, identical on every TP rank. Without
    /// tensor parallelism the backend looks them up (on its device).
    ///
    /// # Errors
    /// An id outside the vocabulary, or a failed collective.
    pub fn forward(&self, be: &Backend, tp: &mut dyn Communicator, ids: &[u32]) -> Result<Tensor> {
        if tp.size() == 1 && self.vocab.len() == self.total {
            return Ok(be.embedding(&self.table, ids)?);
        }
        let hidden = self.table.dims().1;
        let mut out = Tensor::zeros(&[ids.len(), hidden]);
        for (index, (&id, row)) in
            ids.iter().zip(out.data_mut().chunks_exact_mut(hidden)).enumerate()
        {
            let id_us = id as usize;
            if id_us >= self.total {
                return Err(tensor::Error::TokenOutOfRange { id, index, vocab: self.total }.into());
            }
            if self.vocab.contains(&id_us) {
                row.copy_from_slice(&self.table.row_f32(id_us - self.vocab.start));
            }
        }
        tp.all_reduce(out.data_mut(), ReduceOp::Sum)?;
        Ok(out)
    }

    /// The local table (tied LM heads reuse it).
    pub fn table(&self) -> &Weight {
        &self.table
    }

    /// The vocabulary rows this rank holds.
    pub fn vocab(&self) -> Range<usize> {
        self.vocab.clone()
    }
}

impl WeightUses for VocabParallelEmbedding {
    fn weight_uses<'a>(&'a self, out: &mut Vec<WeightUse<'a>>) {
        out.push(WeightUse::Embedding(&self.table));
    }
}

/// The one buffer group of the table. Moving replaces the shared table, so a head tied to it
/// keeps the heap copy until it is tied again ([`ParallelLmHead::tie_to`]).
impl WeightBuffers for VocabParallelEmbedding {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.table.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> tensor::Result<()> {
        self.table = Arc::new(self.table.copy_to(arena)?);
        Ok(())
    }
}

/// The LM head with the vocabulary split over the TP group.
#[derive(Clone, Debug)]
pub struct ParallelLmHead {
    /// Shared with the embedding when the head is tied to it.
    weight: Arc<Weight>,
    ranges: Vec<Range<usize>>,
    rank: usize,
}

impl ParallelLmHead {
    /// A head over this rank's vocabulary rows `ranges[rank]` of `weight`.
    pub fn new(weight: Weight, ranges: Vec<Range<usize>>, rank: usize) -> Self {
        ParallelLmHead { weight: Arc::new(weight), ranges, rank }
    }

    /// A head tied to the embedding: it shares `embed`'s table (one copy in memory) over
    /// the vocabulary rows `ranges[rank]` the table holds.
    pub fn tied(embed: &VocabParallelEmbedding, ranges: Vec<Range<usize>>, rank: usize) -> Self {
        ParallelLmHead { weight: Arc::clone(&embed.table), ranges, rank }
    }

    /// Whether this head shares `embed`'s table.
    pub fn is_tied_to(&self, embed: &VocabParallelEmbedding) -> bool {
        Arc::ptr_eq(&self.weight, &embed.table)
    }

    /// Shares `embed`'s table again after it moved (see [`WeightBuffers::move_to`]).
    pub(crate) fn tie_to(&mut self, embed: &VocabParallelEmbedding) {
        self.weight = Arc::clone(&embed.table);
    }

    /// The weight: this rank's vocabulary rows.
    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    /// The vocabulary rows this rank holds.
    pub fn vocab(&self) -> Range<usize> {
        self.ranges[self.rank].clone()
    }

    /// Full logits `[n, vocab]` on every TP rank (local logits gathered over TP).
    ///
    /// # Errors
    /// `x` has the wrong width, or a failed collective.
    pub fn logits(&self, be: &Backend, tp: &mut dyn Communicator, x: &Tensor) -> Result<Tensor> {
        let local = be.linear(x, &self.weight)?;
        let widths: Vec<usize> = self.ranges.iter().map(|r| r.len()).collect();
        gather_columns(tp, &local, &widths)
    }

    /// Full logits `[n, vocab]` on TP rank `root` only (`None` on the others, which send it
    /// their columns).
    ///
    /// # Errors
    /// `x` has the wrong width, or a failed collective.
    pub fn logits_to(
        &self,
        be: &Backend,
        tp: &mut dyn Communicator,
        x: &Tensor,
        root: usize,
    ) -> Result<Option<Tensor>> {
        let local = be.linear(x, &self.weight)?;
        if tp.size() == 1 {
            return Ok(Some(local));
        }
        if tp.rank() != root {
            tp.send(local.host()?, root)?;
            return Ok(None);
        }
        let n = x.rows();
        let vocab = self.ranges.last().map_or(0, |r| r.end);
        let mut out = vec![0f32; n * vocab];
        let mut part = Vec::new();
        for (r, range) in self.ranges.iter().enumerate() {
            let cols: &[f32] = if r == root {
                local.host()?
            } else {
                part.resize(n * range.len(), 0.0);
                tp.recv(&mut part, r)?;
                &part
            };
            for (row, src) in out.chunks_exact_mut(vocab).zip(cols.chunks_exact(range.len().max(1)))
            {
                row[range.clone()].copy_from_slice(src);
            }
        }
        Ok(Some(Tensor::from_vec(&[n, vocab], out)?))
    }

    /// Greedy tokens per row without gathering the logits: each rank's best (value, id) pair
    /// is gathered and the largest wins, the lowest id on ties, NaN never, token 0 for a row
    /// without a number (as a serial argmax). With `edits`, each rank first edits its
    /// vocabulary's share of the logits, soft-capped by `softcap` as the model's final logits
    /// are (the host sampler edits the capped logits); without, the cap changes no argmax.
    ///
    /// # Errors
    /// `x` has the wrong width, or a failed collective.
    pub fn argmax(
        &self,
        be: &Backend,
        tp: &mut dyn Communicator,
        x: &Tensor,
        edits: Option<&LogitEdits>,
        softcap: Option<f32>,
    ) -> Result<Vec<u32>> {
        let mut local = be.linear(x, &self.weight)?;
        if let Some(edits) = edits {
            if let Some(cap) = softcap {
                be.soft_cap(&mut local, cap)?;
            }
            be.edit_rows(&mut local, edits, self.ranges[self.rank].start)?;
        }
        if tp.size() == 1 {
            // The whole vocabulary is here: the backend's argmax (on its device).
            return Ok(be.argmax_rows(&local)?.into_iter().map(|i| i as u32).collect());
        }
        let n = local.rows();
        let start = self.ranges[self.rank].start;
        let mut best = vec![f32::NEG_INFINITY; n];
        let mut ids = vec![i64::MAX; n];
        for r in 0..n {
            for (j, &v) in local.host_row(r)?.iter().enumerate() {
                // The first number counts even at -inf; NaN never does (the serial argmax).
                if !v.is_nan() && (ids[r] == i64::MAX || v > best[r]) {
                    best[r] = v;
                    ids[r] = (start + j) as i64;
                }
            }
        }
        let tp_size = tp.size();
        let mut all_best = vec![0f32; n * tp_size];
        let mut all_ids = vec![0i64; n * tp_size];
        tp.all_gather(&best, &mut all_best)?;
        tp.all_gather(&ids, &mut all_ids)?;
        Ok((0..n)
            .map(|r| {
                let mut pick = (f32::NEG_INFINITY, i64::MAX);
                for t in 0..tp_size {
                    let cand = (all_best[t * n + r], all_ids[t * n + r]);
                    if cand.0 > pick.0 || (cand.0 == pick.0 && cand.1 < pick.1) {
                        pick = cand;
                    }
                }
                // No rank holds a number: token 0, as the serial argmax gives.
                u32::try_from(pick.1).unwrap_or(0)
            })
            .collect())
    }
}

impl ParallelLmHead {
    /// The `k` most likely tokens of each row (at most [`tensor::kernels::TOP_K_MAX`]): their
    /// logits, soft-capped by `softcap` as the model's final logits are and then edited by
    /// `edits` (each rank its share of the vocabulary), and ids, the largest
    /// first and the lower id among equal logits, without gathering the logits: each rank
    /// finds its own vocabulary's `k` best on its device and the ranks gather those (the `k`
    /// best of the union are the row's). The same candidates as
    /// [`Backend::top_k_rows`] of the gathered, soft-capped logits.
    ///
    /// # Errors
    /// `x` has the wrong width, `k` is too large, or a failed collective.
    pub fn top_k(
        &self,
        be: &Backend,
        tp: &mut dyn Communicator,
        x: &Tensor,
        k: usize,
        softcap: Option<f32>,
        edits: Option<&LogitEdits>,
    ) -> Result<TopK> {
        let mut local = be.linear(x, &self.weight)?;
        if let Some(cap) = softcap {
            be.soft_cap(&mut local, cap)?;
        }
        if let Some(edits) = edits {
            be.edit_rows(&mut local, edits, self.ranges[self.rank].start)?;
        }
        let mine = be.top_k_rows(&local, k)?;
        if k == 0 {
            return Ok(mine);
        }
        let start = self.ranges[self.rank].start as i64;
        let tp_size = tp.size();
        if tp_size == 1 {
            return Ok(mine);
        }
        // Every rank sends k entries per row (a narrow shard pads), its ids in the model's
        // numbering; padding keeps its id.
        let n = x.rows();
        let (mut values, mut ids) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
        for r in 0..n {
            let row: Vec<(f32, u32)> = mine.row(r).collect();
            values.extend(row.iter().map(|c| c.0));
            ids.extend(row.iter().map(|c| i64::from(c.1) + start));
            values.extend(std::iter::repeat_n(f32::NAN, k - row.len()));
            ids.extend(std::iter::repeat_n(i64::from(u32::MAX), k - row.len()));
        }
        let mut all_values = vec![0f32; n * k * tp_size];
        let mut all_ids = vec![0i64; n * k * tp_size];
        tp.all_gather(&values, &mut all_values)?;
        tp.all_gather(&ids, &mut all_ids)?;
        let parts: Vec<TopK> = all_values
            .chunks_exact(n * k)
            .zip(all_ids.chunks_exact(n * k))
            .map(|(v, i)| {
                let ids = i.iter().map(|&id| u32::try_from(id).unwrap_or(u32::MAX)).collect();
                TopK::from_parts(k, v.to_vec(), ids)
            })
            .collect();
        let vocab = self.ranges.last().map_or(0, |r| r.end);
        Ok(TopK::merge(&parts, k.min(vocab)))
    }
}

impl WeightUses for ParallelLmHead {
    fn weight_uses<'a>(&'a self, out: &mut Vec<WeightUse<'a>>) {
        out.push(WeightUse::Linear(&self.weight));
    }
}

impl WeightBuffers for ParallelLmHead {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.weight.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> tensor::Result<()> {
        self.weight = Arc::new(self.weight.copy_to(arena)?);
        Ok(())
    }
}

/// RMSNorm over a hidden dimension split over the TP group: the sum of squares is
/// all-reduced so every rank normalizes its slice by the full row's RMS.
///
/// No model family loaded today needs it: in Megatron's layout every norm (attention, MLP,
/// final) reads the whole hidden row, which each rank holds after the row-parallel
/// all-reduce, so the norms are replicated and cost no collective. It is kept, tested against
/// the full norm, for the norms whose input TP does split: a norm over the whole query or key
/// projection (OLMo 2's and Cohere's `q_norm` / `k_norm` across all heads), and sequence
/// parallelism's sharded activations. Per-head norms (Qwen 3, Gemma 3) stay local.
#[derive(Clone, Debug)]
pub struct ParallelRmsNorm {
    weight: Vec<f32>,
    full_width: usize,
    eps: f32,
}

impl ParallelRmsNorm {
    /// A norm whose local weight slice is `weight` of a row `full_width` wide.
    pub fn new(weight: Vec<f32>, full_width: usize, eps: f32) -> Self {
        ParallelRmsNorm { weight, full_width, eps }
    }

    /// Normalizes `x_local` (`[n, weight.len()]`).
    ///
    /// # Errors
    /// `x_local` has the wrong width, or a failed collective.
    pub fn forward(&self, tp: &mut dyn Communicator, x_local: &Tensor) -> Result<Tensor> {
        let w = self.weight.len();
        if x_local.row_len() != w {
            return Err(Error::shape(
                "ParallelRmsNorm",
                format!("rows of {} elements, weight slice of {w}", x_local.row_len()),
            ));
        }
        let n = x_local.rows();
        let rows = x_local.host()?.chunks_exact(w.max(1)).take(n);
        let mut sums: Vec<f32> = rows.map(|row| row.iter().map(|v| v * v).sum()).collect();
        tp.all_reduce(&mut sums, ReduceOp::Sum)?;
        let mut out = x_local.clone();
        for (r, row) in out.host_mut()?.chunks_exact_mut(w).enumerate() {
            let scale = 1.0 / (sums[r] / self.full_width as f32 + self.eps).sqrt();
            row.iter_mut().zip(&self.weight).for_each(|(x, g)| *x *= scale * g);
        }
        Ok(out)
    }
}
