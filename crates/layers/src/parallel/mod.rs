//! Tensor- and context-parallel modules and the sharded Llama-family model.
//!
//! A rank of a `tp × cp` mesh holds:
//! - attention for a range of whole KV heads (`balanced_ranges` over the KV heads, so 9 query
//!   heads in 3 KV groups on TP=2 split 6 + 3), or, with more TP ranks than KV heads, one KV
//!   head replicated on `tp / n_kv_heads` ranks that split its query heads ([`head_shard`]);
//!   the output projection row-parallel over the rank's query heads;
//! - the MLP for a range of inner units (aligned to quantized blocks), down-projection
//!   row-parallel;
//! - the embedding and LM head for a range of the vocabulary;
//! - its own tokens' keys and values, in its KV-cache shard.
//!
//! A step runs in one of two ways, the same on every rank:
//! - **Prefill** (the sequence's cache is empty and it has at least `cp` tokens): tokens are
//!   split over CP by [`TokenShard`]; each rank projects its tokens, the keys and values are
//!   gathered over CP (`all_gather_uneven`), and each rank attends its queries to all of them
//!   with global positions, keeping only its own keys and values.
//! - **Extend** (decode, or more tokens after a prefill): every CP rank computes every new
//!   token; each new token's keys and values go to the CP rank holding the fewest; every rank
//!   attends to its cache shard and the partial outputs are merged by their log-sum-exp
//!   (an empty shard contributes `-inf`), in rank order so every rank gets the same bits.
//!
//! Row-parallel outputs (attention output, MLP down) are all-reduced over TP. Logits end up on
//! every rank: the last token's hidden state is broadcast over CP from the rank holding it,
//! and the vocabulary-parallel LM head gathers over TP (or picks the argmax without gathering).

mod linear;
mod sequence;
#[cfg(test)]
mod tests;

pub use linear::{
    aligned_ranges, gather_columns, ColumnParallelLinear, ParallelLmHead, ParallelRmsNorm,
    RowParallelLinear, VocabParallelEmbedding,
};
pub use sequence::{gather_tokens, gather_tokens_backward};

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::cpu::attention::merge_partial;
use crate::kernels::{AttnShape, Backend, GemmDtype, Kv, KvElem};
use crate::memory::{alloc_device_exact, alloc_exact, padded, Arena, DeviceArena, WeightBuffers};
use crate::model::{
    load_vector, Attention, KvCache, KvPool, LayerCache, Linear, Logits, Mlp, PagedCache, Shard,
    WeightForm, WeightSource,
};
use crate::tensor::{Storage, Tensor};
use collectives::{Collective, Communicator};
use mesh::TokenShard;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// The communicators a rank's forward pass uses.
pub struct Comms<'a> {
    /// Tensor-parallel group (this rank's row of the mesh).
    pub tp: &'a mut dyn Communicator,
    /// Context-parallel group (this rank's column).
    pub cp: &'a mut dyn Communicator,
}

/// Where a rank sits in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Rank in the TP group.
    pub tp_rank: usize,
    /// TP group size.
    pub tp: usize,
    /// Rank in the CP group.
    pub cp_rank: usize,
    /// CP group size.
    pub cp: usize,
}

impl Placement {
    /// The placement of the owner of `comms`.
    pub fn of(comms: &Comms<'_>) -> Placement {
        Placement {
            tp_rank: comms.tp.rank(),
            tp: comms.tp.size(),
            cp_rank: comms.cp.rank(),
            cp: comms.cp.size(),
        }
    }

    /// A single rank.
    pub fn single() -> Placement {
        Placement { tp_rank: 0, tp: 1, cp_rank: 0, cp: 1 }
    }
}

/// The attention heads one TP rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadShard {
    /// KV heads: whole heads, or a single head that other ranks hold too.
    pub kv: Range<usize>,
    /// Query heads: the groups of `kv`, or a share of the single KV head's group.
    pub q: Range<usize>,
}

/// The heads TP rank `rank` of `tp` holds.
///
/// With at most as many ranks as KV heads, each rank holds whole KV heads, balanced
/// (`balanced_ranges` over the KV heads, so 9 query heads in 3 KV groups on TP=2 split
/// 6 + 3), and their query heads. With more ranks than KV heads, `tp / n_kv_heads`
/// consecutive ranks share each KV head: each holds that head's keys and values (the K/V
/// projections and the cache are replicated) and a balanced share of its query heads.
///
/// # Errors
/// [`Error::Shape`] when `rank` is not below `tp`, when `tp` exceeds the KV heads without
/// being a multiple of them, or when more ranks share a KV head than it has query heads.
pub fn head_shard(cfg: &LlamaConfig, rank: usize, tp: usize) -> Result<HeadShard> {
    let (n_kv, g) = (cfg.n_kv_heads, cfg.group_size());
    if rank >= tp || n_kv == 0 {
        return Err(Error::shape(
            "tensor parallel attention",
            format!("tp rank {rank} of tp={tp} over {n_kv} KV heads"),
        ));
    }
    if tp <= n_kv {
        let kv = mesh::balanced_ranges(n_kv, tp)[rank].clone();
        return Ok(HeadShard { q: kv.start * g..kv.end * g, kv });
    }
    if !tp.is_multiple_of(n_kv) {
        return Err(Error::shape(
            "tensor parallel attention",
            format!(
                "tp={tp} exceeds the model's {n_kv} KV heads and is not a multiple of them; \
                 with more ranks than KV heads every KV head must be shared by the same number \
                 of ranks (use tp <= {n_kv} or a multiple of {n_kv})"
            ),
        ));
    }
    let sharing = tp / n_kv;
    if sharing > g {
        return Err(Error::shape(
            "tensor parallel attention",
            format!(
                "tp={tp} puts {sharing} ranks on each of the model's {n_kv} KV heads, more than \
                 the {g} query heads of a KV head (use tp <= {})",
                cfg.n_heads
            ),
        ));
    }
    let head = rank / sharing;
    let share = mesh::balanced_ranges(g, sharing)[rank % sharing].clone();
    Ok(HeadShard { kv: head..head + 1, q: head * g + share.start..head * g + share.end })
}

/// The KV heads TP rank `rank` of `tp` holds (see [`head_shard`]): whole KV heads, balanced,
/// or the one KV head it shares with other ranks when ranks outnumber KV heads.
///
/// # Errors
/// As [`head_shard`].
pub fn kv_head_range(cfg: &LlamaConfig, rank: usize, tp: usize) -> Result<Range<usize>> {
    Ok(head_shard(cfg, rank, tp)?.kv)
}

/// Bytes of one KV block of `block_size` tokens stored as `elem` on the TP rank holding the
/// most KV heads: a pool sized in bytes holds this many fewer blocks, the same count on every rank (see
/// [`KvPool`]).
///
/// # Errors
/// As [`head_shard`].
pub fn kv_block_bytes(
    cfg: &LlamaConfig,
    tp: usize,
    block_size: usize,
    elem: KvElem,
) -> Result<usize> {
    let mut most = 0;
    for rank in 0..tp.max(1) {
        most = most.max(kv_head_range(cfg, rank, tp.max(1))?.len());
    }
    Ok(KvPool::bytes(elem, cfg.n_layers, most, cfg.head_dim, block_size, 1))
}

/// The `head_groups` to give `mesh::plan_mesh` (and `InitOptions::head_groups`) for this
/// model and a requested TP size. With `tp` unset, the KV heads, so the automatic choice
/// `gcd(world, n_kv_heads)` keeps whole KV heads per rank; with `tp` set, the query heads, so
/// a TP size above the KV heads reaches [`head_shard`], which checks it: a multiple of the KV
/// heads, at most the query heads (see [`check_tp`]).
pub fn mesh_head_groups(cfg: &LlamaConfig, tp: Option<usize>) -> usize {
    match tp {
        None => cfg.n_kv_heads,
        Some(_) => cfg.n_heads,
    }
}

/// Checks that attention can be split over `tp` ranks (see [`head_shard`]), before any rank
/// starts.
///
/// # Errors
/// As [`head_shard`], naming `tp` and the model's KV heads.
pub fn check_tp(cfg: &LlamaConfig, tp: usize) -> Result<()> {
    if tp == 0 {
        return Err(Error::shape("tensor parallel attention", "tp=0: at least one rank is needed"));
    }
    (0..tp).try_for_each(|rank| head_shard(cfg, rank, tp).map(drop))
}

/// Inner MLP units of TP rank `rank`: balanced, in multiples of 32 (a quantized block) when
/// the width allows.
pub fn ffn_range(cfg: &LlamaConfig, rank: usize, tp: usize) -> Range<usize> {
    aligned_ranges(cfg.ffn, tp, 32)[rank].clone()
}

/// Self-attention over this rank's KV heads, for both step kinds.
#[derive(Clone, Debug)]
pub struct ParallelAttention {
    attn: Attention,
    shape: AttnShape,
}

impl ParallelAttention {
    /// Loads layer `layer`'s attention for TP rank `tp_rank` of `tp`.
    ///
    /// # Errors
    /// Missing weights, or a `tp` the heads cannot be split over (see [`head_shard`]).
    pub fn load(
        src: &dyn WeightSource,
        layer: usize,
        cfg: &LlamaConfig,
        tp_rank: usize,
        tp: usize,
        form: WeightForm,
    ) -> Result<Self> {
        let heads = head_shard(cfg, tp_rank, tp)?;
        let attn = Attention::load_heads(src, layer, cfg, heads.kv.clone(), heads.q.clone(), form)?;
        let shape =
            AttnShape { q_heads: heads.q.len(), kv_heads: heads.kv.len(), head_dim: cfg.head_dim };
        Ok(ParallelAttention { attn, shape })
    }

    /// Attention of layer `layer` for every sequence of a step: `h` holds this rank's rows of
    /// all of them, packed in `parts` order, and `caches` their caches in the same order.
    /// Q/K/V and the output projection are one product each over all rows; each sequence
    /// attends over its own keys and values; with CP, one collective per layer carries every
    /// prefill's key/value shards and every extend's partial outputs.
    fn forward(
        &self,
        be: &Backend,
        comms: &mut Comms<'_>,
        h: &Tensor,
        parts: &[Part],
        layer: usize,
        caches: &mut [&mut ParallelCache],
    ) -> Result<Tensor> {
        let positions: Vec<usize> =
            parts.iter().flat_map(|p| p.positions.iter().copied()).collect();
        let (q, k, v) = self.attn.qkv(be, h, &positions)?;
        let cp = comms.cp.size();
        // A step of one sequence uses the projections as they are (on the device, say).
        let rows = |t: &Tensor, p: &Part| -> Result<Tensor> {
            if parts.len() == 1 {
                Ok(t.clone())
            } else {
                be.slice_first(t, p.rows.clone())
            }
        };
        let kv_width = self.shape.kv_heads * self.shape.head_dim;
        let mut queries = Vec::with_capacity(parts.len());
        // Extend outputs (partial with CP); prefill outputs come after the exchange.
        let mut outs: Vec<Option<Tensor>> = Vec::with_capacity(parts.len());
        let mut mine = Vec::new();
        for (p, cache) in parts.iter().zip(caches.iter_mut()) {
            let (qe, ke, ve) = (rows(&q, p)?, rows(&k, p)?, rows(&v, p)?);
            match &p.split {
                Split::Prefill(_) => {
                    cache.append_tensors(be, layer, &ke, &ve, &p.positions)?;
                    mine.extend_from_slice(ke.data());
                    mine.extend_from_slice(ve.data());
                    outs.push(None);
                }
                Split::Extend(_) if p.owned.iter().all(|&o| o) => {
                    // Every new token is this rank's (always without CP).
                    cache.append_tensors(be, layer, &ke, &ve, &p.positions)?;
                }
                Split::Extend(_) => {
                    let (mut mk, mut mv, mut mp) = (Vec::new(), Vec::new(), Vec::new());
                    for (i, _) in p.owned.iter().enumerate().filter(|(_, &o)| o) {
                        mk.extend_from_slice(&ke.data()[i * kv_width..(i + 1) * kv_width]);
                        mv.extend_from_slice(&ve.data()[i * kv_width..(i + 1) * kv_width]);
                        mp.push(p.positions[i]);
                    }
                    cache.append(be, layer, &mk, &mv, &mp)?;
                }
            }
            if let Split::Extend(_) = p.split {
                let (out, lse) = cache.with_kv(layer, |kv, kv_pos| {
                    be.attention(&qe, &p.positions, kv, kv_pos, self.shape, cp > 1)
                })?;
                if cp > 1 {
                    let lse = lse.ok_or_else(|| {
                        Error::shape("extend attention", "no log-sum-exp returned")
                    })?;
                    mine.extend_from_slice(out.data());
                    mine.extend_from_slice(lse.data());
                }
                outs.push(Some(out));
            }
            queries.push(qe);
        }
        if cp > 1 {
            self.exchange(be, comms.cp, &mine, parts, &queries, &mut outs)?;
        }
        let outs = outs
            .into_iter()
            .map(|o| o.ok_or_else(|| Error::shape("attention", "a sequence has no output")))
            .collect::<Result<Vec<_>>>()?;
        let out = match <[Tensor; 1]>::try_from(outs) {
            Ok([one]) => one,
            Err(outs) => be.cat_first(&outs)?,
        };
        self.finish(be, comms, out)
    }

    /// The CP exchange of one layer: every rank sends `mine` (per part, in order: a prefill's
    /// keys then values, an extend's partial output then log-sum-exp); then each prefill
    /// attends to every rank's keys and values and each extend merges the partial outputs in
    /// rank order, so every rank gets the same bits.
    fn exchange(
        &self,
        be: &Backend,
        cp: &mut dyn Communicator,
        mine: &[f32],
        parts: &[Part],
        queries: &[Tensor],
        outs: &mut [Option<Tensor>],
    ) -> Result<()> {
        let ranks = cp.size();
        let AttnShape { q_heads, kv_heads, head_dim } = self.shape;
        let piece = |p: &Part, r: usize| match &p.split {
            Split::Prefill(shard) => 2 * shard.sizes()[r] * kv_heads * head_dim,
            Split::Extend(_) => p.positions.len() * q_heads * (head_dim + 1),
        };
        let sizes: Vec<usize> =
            (0..ranks).map(|r| parts.iter().map(|p| piece(p, r)).sum()).collect();
        let mut all = vec![0f32; sizes.iter().sum()];
        cp.all_gather_uneven(mine, &mut all, &sizes)?;
        // Where each part's piece starts in each rank's segment.
        let mut at: Vec<usize> =
            sizes.iter().scan(0, |end, s| Some(std::mem::replace(end, *end + s))).collect();
        let pieces: Vec<Vec<&[f32]>> = parts
            .iter()
            .map(|p| {
                (0..ranks)
                    .map(|r| {
                        let start = at[r];
                        at[r] += piece(p, r);
                        &all[start..at[r]]
                    })
                    .collect()
            })
            .collect();
        for (((p, q), out), pieces) in parts.iter().zip(queries).zip(outs.iter_mut()).zip(&pieces) {
            match &p.split {
                Split::Prefill(_) => {
                    let total = p.all_positions.len() * kv_heads * head_dim;
                    let (mut k_all, mut v_all) =
                        (Vec::with_capacity(total), Vec::with_capacity(total));
                    for both in pieces {
                        let (ks, vs) = both.split_at(both.len() / 2);
                        k_all.extend_from_slice(ks);
                        v_all.extend_from_slice(vs);
                    }
                    let kv = Kv::Host { k: &k_all, v: &v_all };
                    let (o, _) =
                        be.attention(q, &p.positions, kv, &p.all_positions, self.shape, false)?;
                    *out = Some(o);
                }
                Split::Extend(_) => {
                    let width = p.positions.len() * q_heads * head_dim;
                    let (first_o, first_l) = pieces[0].split_at(width);
                    let (mut acc_o, mut acc_l) = (first_o.to_vec(), first_l.to_vec());
                    for rest in &pieces[1..] {
                        let (o, l) = rest.split_at(width);
                        merge_partial(&mut acc_o, &mut acc_l, o, l, head_dim);
                    }
                    *out = Some(Tensor::from_vec(&[p.positions.len(), q_heads, head_dim], acc_o)?);
                }
            }
        }
        Ok(())
    }

    /// Output projection of this rank's heads, all-reduced over TP.
    fn finish(&self, be: &Backend, comms: &mut Comms<'_>, attn: Tensor) -> Result<Tensor> {
        let mut y = self.attn.project_out(be, attn)?;
        be.all_reduce_sum(comms.tp, &mut y)?;
        Ok(y)
    }
}

#[derive(Clone, Debug)]
struct ParallelBlock {
    attn_norm: Tensor,
    attn: ParallelAttention,
    ffn_norm: Tensor,
    mlp: Mlp,
}

/// The buffers in the order attention norm, attention (see [`Attention`]'s order), MLP norm,
/// MLP.
impl WeightBuffers for ParallelBlock {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.attn_norm.buffers(out);
        self.attn.attn.buffers(out);
        self.ffn_norm.buffers(out);
        self.mlp.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> Result<()> {
        self.attn_norm.move_to(arena)?;
        self.attn.attn.move_to(arena)?;
        self.ffn_norm.move_to(arena)?;
        self.mlp.move_to(arena)
    }
}

/// A sequence's KV cache on one rank: its shard of the keys and values, and how many tokens
/// every CP rank holds (the same bookkeeping on every rank).
#[derive(Debug)]
pub struct ParallelCache {
    local: Local,
    cp_lens: Vec<usize>,
}

/// Where a rank keeps a sequence's keys and values.
#[derive(Debug)]
enum Local {
    /// Buffers of its own (host or device), sized for the sequence.
    Own(KvCache),
    /// Blocks of the rank's pool, named by the sequence's block table.
    Paged(PagedCache),
}

impl ParallelCache {
    /// Appends `layer`'s keys and values of `positions.len()` tokens.
    fn append(
        &mut self,
        be: &Backend,
        layer: usize,
        k: &[f32],
        v: &[f32],
        positions: &[usize],
    ) -> Result<()> {
        match &mut self.local {
            Local::Own(c) => c.layer_mut(layer).append(be, k, v, positions),
            Local::Paged(c) => c.append(be, layer, k, v, positions),
        }
    }

    /// As [`ParallelCache::append`] from tensors (a device cache copies device outputs on
    /// the device).
    fn append_tensors(
        &mut self,
        be: &Backend,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        positions: &[usize],
    ) -> Result<()> {
        match &mut self.local {
            Local::Own(c) => c.layer_mut(layer).append_tensors(be, k, v, positions),
            Local::Paged(c) => c.append_tensors(be, layer, k, v, positions),
        }
    }

    /// Calls `f` with `layer`'s keys and values and their positions.
    fn with_kv<R>(&self, layer: usize, f: impl FnOnce(Kv<'_>, &[usize]) -> R) -> R {
        match &self.local {
            Local::Own(c) => f(c.layer(layer).kv(), c.layer(layer).positions()),
            Local::Paged(c) => c.with_kv(layer, f),
        }
    }

    /// Appends blocks of the pool to a paged cache's block table (room for more tokens).
    ///
    /// # Errors
    /// [`Error::Shape`] for a cache with buffers of its own, or a block outside the pool.
    pub fn extend_table(&mut self, blocks: &[u32]) -> Result<()> {
        match &mut self.local {
            Local::Paged(c) => c.extend_table(blocks),
            Local::Own(_) if blocks.is_empty() => Ok(()),
            Local::Own(_) => Err(Error::shape(
                "kv block table",
                "blocks given to a cache with buffers of its own",
            )),
        }
    }

    /// Takes the first `tokens` tokens of an empty paged cache as already in its blocks (a
    /// shared prompt prefix). Only without CP: with CP a rank's blocks hold an uneven share.
    ///
    /// # Errors
    /// [`Error::Shape`] with CP, for a cache that is not paged or not empty;
    /// [`Error::CacheFull`] when the table does not cover the prefix.
    pub fn assume_prefix(&mut self, tokens: usize) -> Result<()> {
        match (&mut self.local, self.cp_lens.as_mut_slice()) {
            (Local::Paged(c), [len]) => {
                c.assume_prefix(tokens)?;
                *len = tokens;
                Ok(())
            }
            _ => Err(Error::shape(
                "kv cache prefix",
                "a cached prefix needs a paged cache and one CP rank",
            )),
        }
    }

    /// The block table of a paged cache (empty otherwise).
    pub fn table(&self) -> &[u32] {
        match &self.local {
            Local::Paged(c) => c.table(),
            Local::Own(_) => &[],
        }
    }

    /// Tokens of the sequence, over all CP ranks.
    pub fn len(&self) -> usize {
        self.cp_lens.iter().sum()
    }

    /// Whether the sequence has no tokens yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens this rank holds.
    pub fn local_len(&self) -> usize {
        match &self.local {
            Local::Own(c) => c.len(),
            Local::Paged(c) => c.len(),
        }
    }

    /// Tokens each CP rank holds.
    pub fn cp_lens(&self) -> &[usize] {
        &self.cp_lens
    }

    /// Tokens this rank can hold.
    pub fn capacity(&self) -> usize {
        match &self.local {
            Local::Own(c) => c.capacity(),
            Local::Paged(c) => c.capacity(),
        }
    }

    /// Forgets every token (a paged cache keeps its block table).
    pub fn clear(&mut self) {
        match &mut self.local {
            Local::Own(c) => c.clear(),
            Local::Paged(c) => c.truncate(0),
        }
        self.cp_lens.iter_mut().for_each(|l| *l = 0);
    }
}

/// How one sequence's tokens of a step are split over CP.
enum Split {
    Prefill(TokenShard),
    /// Which CP rank keeps each new token's keys and values.
    Extend(Vec<usize>),
}

/// One sequence's place in a step on this rank.
struct Part {
    split: Split,
    /// This rank's rows of the sequence in the step's packed activations.
    rows: Range<usize>,
    /// Positions of all the sequence's tokens in the step.
    all_positions: Vec<usize>,
    /// Positions of this rank's rows.
    positions: Vec<usize>,
    /// Extend: which rows' keys and values this rank keeps.
    owned: Vec<bool>,
}

impl Part {
    /// Tokens of the step each CP rank keeps.
    fn kept(&self, ranks: usize) -> Vec<usize> {
        match &self.split {
            Split::Prefill(shard) => shard.sizes().to_vec(),
            Split::Extend(owners) => {
                let mut kept = vec![0; ranks];
                owners.iter().for_each(|&o| kept[o] += 1);
                kept
            }
        }
    }
}

/// One sequence of a batched step (see [`ParallelModel::forward_batch`]).
#[derive(Debug)]
pub struct Sequence<'a> {
    /// The next token ids, continuing where `cache` ends.
    pub tokens: &'a [u32],
    /// The sequence's KV-cache shard on this rank.
    pub cache: &'a mut ParallelCache,
    /// Whether the logits of its last token are wanted.
    pub sample: bool,
}

/// How [`ParallelModel::load`] and [`ParallelModel::from_source`] build a rank's shard: its
/// place in the mesh, where it computes (the CPU with `threads` threads unless a backend is
/// given), the form of its weights, and who hears of the progress.
///
/// ```no_run
/// # use layers::parallel::{LoadOptions, ParallelModel, Placement};
/// # use layers::model::WeightForm;
/// let model = ParallelModel::load(
///     "model.gguf",
///     LoadOptions::new(Placement::single()).threads(4).form(WeightForm::F32),
/// )?;
/// # Ok::<(), layers::Error>(())
/// ```
pub struct LoadOptions<'a> {
    placement: Placement,
    backend: Option<Backend>,
    threads: usize,
    form: WeightForm,
    progress: Option<&'a mut dyn FnMut(usize, usize)>,
}

impl LoadOptions<'static> {
    /// The shard at `placement`, on the CPU with one thread, weights in their native form,
    /// no progress reports.
    pub fn new(placement: Placement) -> LoadOptions<'static> {
        LoadOptions {
            placement,
            backend: None,
            threads: 1,
            form: WeightForm::default(),
            progress: None,
        }
    }
}

impl<'a> LoadOptions<'a> {
    /// Computes on the CPU with `threads` threads (ignored when a backend is given).
    #[must_use]
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }

    /// Computes on `backend` (a GPU's, say).
    #[must_use]
    pub fn on(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Keeps the weights in `form`.
    #[must_use]
    pub fn form(mut self, form: WeightForm) -> Self {
        self.form = form;
        self
    }

    /// Calls `progress(done, total)` as the shard loads: after the embedding, each layer and
    /// the head (`total` is the layer count plus 2).
    #[must_use]
    pub fn progress<'b>(self, progress: &'b mut dyn FnMut(usize, usize)) -> LoadOptions<'b> {
        let LoadOptions { placement, backend, threads, form, .. } = self;
        LoadOptions { placement, backend, threads, form, progress: Some(progress) }
    }
}

impl std::fmt::Debug for LoadOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("placement", &self.placement)
            .field("backend", &self.backend)
            .field("threads", &self.threads)
            .field("form", &self.form)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// The Llama-family decoder sharded over a `tp × cp` mesh.
#[derive(Clone, Debug)]
pub struct ParallelModel {
    config: LlamaConfig,
    backend: Backend,
    placement: Placement,
    embed: VocabParallelEmbedding,
    blocks: Vec<ParallelBlock>,
    norm: Tensor,
    lm_head: ParallelLmHead,
}

impl ParallelModel {
    /// Loads this rank's shard of a model: a GGUF file, or a Hugging Face folder
    /// (`config.json` and safetensors); only the rank's slices of each tensor are read.
    ///
    /// # Errors
    /// Starting the CPU kernels, opening the file, reading the config, loading a weight, or a
    /// layout the model cannot be split into.
    pub fn load(path: impl AsRef<Path>, opts: LoadOptions<'_>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            let ck = crate::safetensors::HfCheckpoint::open(path)?;
            let config = ck.config()?;
            return ParallelModel::from_source(&ck, config, opts);
        }
        let file = GgufFile::open(path)?;
        let config = LlamaConfig::from_gguf(&file)?;
        let fused;
        let src: &dyn WeightSource = if file.has_fused_projections() {
            fused = crate::model::fused::FusedSource::new(&file, &config);
            &fused
        } else {
            &file
        };
        ParallelModel::from_source(src, config, opts)
    }

    /// Builds this rank's shard from any weight source.
    ///
    /// # Errors
    /// As [`ParallelModel::load`].
    pub fn from_source(
        src: &dyn WeightSource,
        config: LlamaConfig,
        opts: LoadOptions<'_>,
    ) -> Result<Self> {
        let LoadOptions { placement, backend, threads, form, progress } = opts;
        let backend = match backend {
            Some(backend) => backend,
            None => Backend::cpu(threads)?,
        };
        let mut silent = |_: usize, _: usize| {};
        let progress: &mut dyn FnMut(usize, usize) = match progress {
            Some(progress) => progress,
            None => &mut silent,
        };
        let Placement { tp_rank, tp, .. } = placement;
        let total = config.n_layers + 2;
        let vocab = aligned_ranges(config.vocab_size, tp, 1);
        let embed =
            VocabParallelEmbedding::load(src, "token_embd.weight", vocab[tp_rank].clone(), form)?;
        progress(1, total);
        let mut blocks = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            blocks.push(ParallelBlock {
                attn_norm: load_vector(src, &format!("blk.{l}.attn_norm.weight"), config.hidden)?,
                attn: ParallelAttention::load(src, l, &config, tp_rank, tp, form)?,
                ffn_norm: load_vector(src, &format!("blk.{l}.ffn_norm.weight"), config.hidden)?,
                mlp: Mlp::load(src, l, ffn_range(&config, tp_rank, tp), form)?
                    .with_activation(config.activation),
            });
            progress(l + 2, total);
        }
        let norm = load_vector(src, "output_norm.weight", config.hidden)?;
        let lm_head = if config.tied_embeddings {
            ParallelLmHead::tied(&embed, vocab, tp_rank)
        } else {
            let rows = Shard::Rows(vocab[tp_rank].clone());
            let weight = Linear::load(src, "output.weight", &rows, form)?.weight().clone();
            ParallelLmHead::new(weight, vocab, tp_rank)
        };
        progress(total, total);
        Ok(ParallelModel { config, backend, placement, embed, blocks, norm, lm_head })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Where this rank sits.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The bytes of every weight buffer this rank holds, in the order
    /// [`ParallelModel::move_weights_to`] allocates them:
    /// 1. the embedding table (this rank's vocabulary rows);
    /// 2. for each layer: the attention norm, the fused Q/K/V projection, the Q/K/V bias (when
    ///    the model has one), the output projection, the MLP norm, the fused gate/up
    ///    projection and the down projection;
    /// 3. the final norm;
    /// 4. the LM head, unless it is tied to the embedding (the shared table is listed once).
    ///
    /// A matrix is one buffer of f32 values, or, quantized, its scales, its minimums (4-bit
    /// formats only) and its quants. Empty buffers are left out.
    pub fn weight_buffers(&self) -> Vec<&[u8]> {
        let mut out = Vec::new();
        self.embed.buffers(&mut out);
        for b in &self.blocks {
            b.buffers(&mut out);
        }
        self.norm.buffers(&mut out);
        if !self.lm_head.is_tied_to(&self.embed) {
            self.lm_head.buffers(&mut out);
        }
        out
    }

    /// The arena bytes [`ParallelModel::move_weights_to`] needs when its allocations are carved
    /// out of one region: each of [`ParallelModel::weight_buffers`] rounded up to
    /// [`crate::memory::ALIGN`], summed.
    pub fn weight_bytes(&self) -> usize {
        self.weight_buffers().iter().map(|b| padded(b.len())).sum()
    }

    /// Moves every weight buffer into memory from `arena`: one allocation per buffer, of
    /// exactly its length, in the order of [`ParallelModel::weight_buffers`]. The values are
    /// copied bit for bit and the heap copies are freed; a tied LM head keeps sharing the
    /// embedding table.
    ///
    /// # Errors
    /// [`Error::Arena`] when an allocation fails or has the wrong size, [`Error::Shape`] when
    /// one is misaligned. The buffers moved until then stay in the arena and the rest on the
    /// heap: the model computes the same either way.
    pub fn move_weights_to(&mut self, arena: &dyn Arena) -> Result<()> {
        let tied = self.lm_head.is_tied_to(&self.embed);
        self.embed.move_to(arena)?;
        if tied {
            self.lm_head.tie_to(&self.embed);
        }
        for b in &mut self.blocks {
            b.move_to(arena)?;
        }
        self.norm.move_to(arena)?;
        if !tied {
            self.lm_head.move_to(arena)?;
        }
        Ok(())
    }

    /// KV heads this rank holds (its cache rows are this many heads wide).
    fn local_kv_heads(&self) -> usize {
        kv_head_range(&self.config, self.placement.tp_rank, self.placement.tp)
            .map_or(self.config.n_kv_heads, |r| r.len())
    }

    /// Bytes of one layer's key (or value) buffer for `capacity` tokens.
    fn cache_buffer_bytes(&self, capacity: usize, elem: KvElem) -> usize {
        capacity * self.local_kv_heads() * self.config.head_dim * elem.size()
    }

    /// An empty cache for one sequence; `capacity` tokens on this rank.
    pub fn new_cache(&self, capacity: usize) -> ParallelCache {
        ParallelCache {
            local: Local::Own(KvCache::new(
                self.config.n_layers,
                self.local_kv_heads(),
                self.config.head_dim,
                capacity,
            )),
            cp_lens: vec![0; self.placement.cp],
        }
    }

    /// The arena bytes [`ParallelModel::new_cache_in`] (`elem` f32) or
    /// [`ParallelModel::new_cache_on_device`] needs for `capacity` tokens stored as `elem`
    /// when its allocations are carved out of one region: every layer's key and value buffer
    /// rounded up to [`crate::memory::ALIGN`], summed.
    pub fn cache_bytes(&self, capacity: usize, elem: KvElem) -> usize {
        2 * self.config.n_layers * padded(self.cache_buffer_bytes(capacity, elem))
    }

    /// An empty cache for one sequence, `capacity` tokens on this rank, whose keys and values
    /// live in memory from `arena`: two allocations per layer, in the order layer 0 keys,
    /// layer 0 values, layer 1 keys, ... (see [`ParallelModel::cache_bytes`]).
    ///
    /// # Errors
    /// [`Error::Arena`] when an allocation fails or has the wrong size, [`Error::Shape`] when
    /// one is misaligned.
    pub fn new_cache_in(&self, capacity: usize, arena: &dyn Arena) -> Result<ParallelCache> {
        let (kv, bytes) = (self.local_kv_heads(), self.cache_buffer_bytes(capacity, KvElem::F32));
        let buffer = || Storage::external(alloc_exact(arena, bytes)?);
        self.cache_of_layers(|| {
            let k = buffer()?;
            LayerCache::with_storage(k, buffer()?, kv, self.config.head_dim)
        })
    }

    /// An empty cache for one sequence, `capacity` tokens on this rank, whose keys and values
    /// live in device memory from `arena`, stored as `elem` (see
    /// [`ParallelModel::device_kv_elem`]), in the allocation order of
    /// [`ParallelModel::new_cache_in`] (and [`ParallelModel::cache_bytes`] bytes in all). Only
    /// a model computing on the CUDA backend of that device can use it.
    ///
    /// # Errors
    /// [`Error::Arena`] when an allocation fails or has the wrong size or alignment.
    pub fn new_cache_on_device(
        &self,
        capacity: usize,
        elem: KvElem,
        arena: &dyn DeviceArena,
    ) -> Result<ParallelCache> {
        let (kv, bytes) = (self.local_kv_heads(), self.cache_buffer_bytes(capacity, elem));
        let buffer = || alloc_device_exact(arena, bytes);
        self.cache_of_layers(|| {
            let k = buffer()?;
            LayerCache::on_device(k, buffer()?, elem, kv, self.config.head_dim)
        })
    }

    /// An empty cache of one layer cache per model layer, each made by `layer` in order.
    fn cache_of_layers(&self, layer: impl FnMut() -> Result<LayerCache>) -> Result<ParallelCache> {
        let layers =
            std::iter::repeat_with(layer).take(self.config.n_layers).collect::<Result<Vec<_>>>()?;
        Ok(ParallelCache {
            local: Local::Own(KvCache::from_layers(layers)),
            cp_lens: vec![0; self.placement.cp],
        })
    }

    /// A KV pool of `blocks` blocks of `block_size` tokens for this rank's heads, in owned
    /// memory (see [`KvPool`]).
    ///
    /// # Errors
    /// [`Error::Shape`] when `block_size` is not a power of two.
    pub fn new_pool(&self, block_size: usize, blocks: usize) -> Result<KvPool> {
        let c = &self.config;
        KvPool::new(c.n_layers, self.local_kv_heads(), c.head_dim, block_size, blocks)
    }

    /// Bytes of this rank's KV pool of `blocks` blocks of `block_size` tokens stored as
    /// `elem`.
    pub fn pool_bytes(&self, block_size: usize, blocks: usize, elem: KvElem) -> usize {
        let c = &self.config;
        KvPool::bytes(elem, c.n_layers, self.local_kv_heads(), c.head_dim, block_size, blocks)
    }

    /// How a KV pool in device memory stores values by default: bf16 when the model's weights
    /// are half precision on the GPU (as vLLM's `auto` follows the model's type), else f32.
    pub fn device_kv_elem(&self) -> KvElem {
        match &self.backend {
            Backend::Cuda(gpu) if gpu.gemm_dtype() != GemmDtype::F32 => KvElem::Bf16,
            _ => KvElem::F32,
        }
    }

    /// A KV pool for this rank's heads over `storage` (one `kv_cache` allocation, say): as
    /// many blocks of `block_size` tokens as it holds.
    ///
    /// # Errors
    /// As [`KvPool::with_storage`].
    pub fn pool_in(&self, storage: Storage, block_size: usize) -> Result<KvPool> {
        let c = &self.config;
        KvPool::with_storage(storage, c.n_layers, self.local_kv_heads(), c.head_dim, block_size)
    }

    /// A KV pool of `blocks` blocks of `block_size` tokens for this rank's heads in device
    /// memory from `arena` (one `kv_cache` allocation on the GPU the model computes on), values
    /// stored as `elem`, read and written by the CUDA backend in place.
    ///
    /// # Errors
    /// [`Error::Arena`] when the memory cannot be had; as [`KvPool::on_device`].
    pub fn pool_on_device(
        &self,
        arena: &dyn DeviceArena,
        block_size: usize,
        blocks: usize,
        elem: KvElem,
    ) -> Result<KvPool> {
        let memory = alloc_device_exact(arena, self.pool_bytes(block_size, blocks, elem))?;
        let c = &self.config;
        KvPool::on_device(memory, elem, c.n_layers, self.local_kv_heads(), c.head_dim, block_size)
    }

    /// An empty cache for one sequence whose keys and values live in blocks of `pool` (none
    /// yet: see [`ParallelCache::extend_table`]).
    ///
    /// # Errors
    /// [`Error::Shape`] when the pool was made for another model or rank.
    pub fn new_paged_cache(&self, pool: &Arc<KvPool>) -> Result<ParallelCache> {
        let row = self.local_kv_heads() * self.config.head_dim;
        if pool.is_on_device() && self.backend.device() == crate::Device::Cpu {
            return Err(Error::BackendUnavailable {
                backend: "cpu",
                reason: "a KV pool in device memory is read only by the CUDA backend".into(),
            });
        }
        if pool.layers() != self.config.n_layers || pool.row() != row {
            return Err(Error::shape(
                "paged kv cache",
                format!(
                    "a pool of {} layers × {} values for a rank of {} layers × {row}",
                    pool.layers(),
                    pool.row(),
                    self.config.n_layers
                ),
            ));
        }
        Ok(ParallelCache {
            local: Local::Paged(PagedCache::new(pool.clone())),
            cp_lens: vec![0; self.placement.cp],
        })
    }

    /// The backend the model computes on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// How `n` more tokens of the sequence in `cache` split over CP: a prefill when the
    /// cache is empty and every CP rank gets a token (never with one CP rank: an extend keeps
    /// its keys and values where attention reads them), an extend otherwise.
    fn split(&self, cache: &ParallelCache, n: usize) -> Result<Split> {
        let cp = self.placement.cp;
        if cp > 1 && cache.is_empty() && n >= cp {
            return Ok(Split::Prefill(TokenShard::new(n, cp, self.placement.cp_rank)?));
        }
        let mut lens = cache.cp_lens.clone();
        let owners = (0..n)
            .map(|_| {
                let owner = (0..cp).min_by_key(|&r| (lens[r], r)).unwrap_or(0);
                lens[owner] += 1;
                owner
            })
            .collect();
        Ok(Split::Extend(owners))
    }

    /// Checks that `n` more tokens fit in `cache` on this rank.
    ///
    /// # Errors
    /// [`Error::CacheFull`] when they do not; [`Error::Shape`] for no tokens.
    pub fn check_room(&self, cache: &ParallelCache, n: usize) -> Result<()> {
        self.part_into(cache, &[], n, 0, &mut Vec::new()).map(drop)
    }

    /// The place of `n` tokens of the sequence in `cache` in a step whose rows before it
    /// number `at`; of `tokens` (empty when only checking), the rows this rank computes are
    /// appended to `local`.
    fn part_into(
        &self,
        cache: &ParallelCache,
        tokens: &[u32],
        n: usize,
        at: usize,
        local: &mut Vec<u32>,
    ) -> Result<Part> {
        if n == 0 {
            return Err(Error::shape("ParallelModel::forward", "a sequence with no tokens"));
        }
        let start = cache.len();
        let all_positions: Vec<usize> = (start..start + n).collect();
        let me = self.placement.cp_rank;
        let split = self.split(cache, n)?;
        let (positions, owned, needed) = match &split {
            Split::Prefill(shard) => {
                if !tokens.is_empty() {
                    local.extend_from_slice(shard.select(tokens)?);
                }
                let positions = shard.select(&all_positions)?.to_vec();
                let needed = positions.len();
                (positions, Vec::new(), needed)
            }
            Split::Extend(owners) => {
                local.extend_from_slice(tokens);
                let owned: Vec<bool> = owners.iter().map(|&o| o == me).collect();
                let needed = owned.iter().filter(|&&o| o).count();
                (all_positions.clone(), owned, needed)
            }
        };
        if cache.local_len() + needed > cache.capacity() {
            return Err(Error::CacheFull {
                len: cache.local_len(),
                capacity: cache.capacity(),
                requested: needed,
            });
        }
        Ok(Part { rows: at..at + positions.len(), split, all_positions, positions, owned })
    }

    /// Runs `tokens` (the next ones of the sequence in `cache`) and returns logits
    /// `[rows, vocab]`, identical on every rank. On error the cache may hold part of the
    /// step: clear it (the peers failed too).
    ///
    /// # Errors
    /// Empty input, an id outside the vocabulary, a full cache, a failed collective.
    pub fn forward(
        &self,
        comms: &mut Comms<'_>,
        tokens: &[u32],
        cache: &mut ParallelCache,
        logits: Logits,
    ) -> Result<Tensor> {
        self.backend.run(|| {
            let x = self.hidden(comms, tokens, cache, logits)?;
            self.lm_head.logits(&self.backend, comms.tp, &x)
        })
    }

    /// Greedy next tokens (one per returned row) without gathering the logits.
    ///
    /// # Errors
    /// As [`ParallelModel::forward`].
    pub fn forward_argmax(
        &self,
        comms: &mut Comms<'_>,
        tokens: &[u32],
        cache: &mut ParallelCache,
        logits: Logits,
    ) -> Result<Vec<u32>> {
        self.backend.run(|| {
            let x = self.hidden(comms, tokens, cache, logits)?;
            self.lm_head.argmax(&self.backend, comms.tp, &x)
        })
    }

    /// One step of many sequences as one forward pass: their tokens packed into one
    /// activation matrix (every linear layer one product over all of them, one TP all-reduce
    /// per layer and, with CP, one exchange per layer), each sequence attending over its own
    /// cache. Returns the logits `[sampled, vocab]` of the last token of every sequence with
    /// `sample` set, in order, on the rank at TP 0 and CP 0 only (`None` elsewhere): the other
    /// ranks send it their share rather than gathering the vocabulary everywhere.
    ///
    /// A sequence's logits are those of [`ParallelModel::forward`] on it alone up to f32
    /// summation order: the kernels a linear layer picks depend on the step's row count.
    /// On error the caches may hold part of the step: clear them (the peers failed too).
    ///
    /// # Errors
    /// A sequence with no tokens or no room left ([`Error::CacheFull`]), an id outside the
    /// vocabulary, a failed collective.
    pub fn forward_batch(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
    ) -> Result<Option<Tensor>> {
        self.backend.run(|| self.forward_batch_here(comms, seqs))
    }

    fn forward_batch_here(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
    ) -> Result<Option<Tensor>> {
        let (x, parts) = self.layers(comms, seqs)?;
        let Placement { cp_rank, cp, .. } = self.placement;
        let sampled: Vec<&Part> =
            seqs.iter().zip(&parts).filter(|(s, _)| s.sample).map(|(_, p)| p).collect();
        let hidden = self.config.hidden;
        if sampled.is_empty() {
            // Nothing to sample (prompt chunks only): no rank moves anything.
            let root = (cp_rank, self.placement.tp_rank) == (0, 0);
            return Ok(root.then(|| Tensor::zeros(&[0, self.config.vocab_size])));
        }
        // Prefill rows end on the last CP rank (shards ascend); it sends them to CP rank 0.
        let holder = cp - 1;
        let from_holder: Vec<usize> = sampled
            .iter()
            .filter(|p| matches!(p.split, Split::Prefill(_)))
            .map(|p| p.rows.end - 1)
            .collect();
        if cp_rank != 0 {
            if cp_rank == holder && !from_holder.is_empty() {
                let mut rows = Vec::with_capacity(from_holder.len() * hidden);
                from_holder.iter().for_each(|&r| rows.extend_from_slice(x.row(r)));
                comms.cp.send(&rows, 0)?;
            }
            return Ok(None);
        }
        let mut received = vec![0f32; from_holder.len() * hidden];
        if !from_holder.is_empty() {
            comms.cp.recv(&mut received, holder)?;
        }
        let mut received = received.chunks_exact(hidden);
        let mut rows = Vec::with_capacity(sampled.len() * hidden);
        for p in &sampled {
            match p.split {
                Split::Prefill(_) => rows.extend_from_slice(received.next().unwrap_or_default()),
                Split::Extend(_) => rows.extend_from_slice(x.row(p.rows.end - 1)),
            }
        }
        let x = Tensor::from_vec(&[sampled.len(), hidden], rows)?;
        let x = self.backend.rms_norm(&x, &self.norm, self.config.rms_eps)?;
        self.lm_head.logits_to(&self.backend, comms.tp, &x, 0)
    }

    /// Greedy generation: `prompt`, then argmax tokens until `max_new`, a `stop` token or a
    /// full cache. Every rank returns the same tokens.
    ///
    /// # Errors
    /// As [`ParallelModel::forward`].
    pub fn generate(
        &self,
        comms: &mut Comms<'_>,
        prompt: &[u32],
        max_new: usize,
        stop: &[u32],
        cache: &mut ParallelCache,
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if max_new == 0 || prompt.is_empty() {
            return Ok(out);
        }
        let mut next = self.forward_argmax(comms, prompt, cache, Logits::Last)?[0];
        loop {
            out.push(next);
            on_token(next);
            let full = cache.cp_lens.iter().min().copied().unwrap_or(0) >= cache.capacity();
            if out.len() >= max_new || stop.contains(&next) || full {
                return Ok(out);
            }
            next = self.forward_argmax(comms, &[next], cache, Logits::Last)?[0];
        }
    }

    /// The decoder stack over one step of `seqs`: returns this rank's rows of the last hidden
    /// states (before the final norm), packed in order, and each sequence's place.
    fn layers(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
    ) -> Result<(Tensor, Vec<Part>)> {
        if seqs.is_empty() {
            return Err(Error::shape("ParallelModel::forward_batch", "no sequences"));
        }
        let (be, c) = (&self.backend, &self.config);
        let mut tokens = Vec::new();
        let mut parts = Vec::with_capacity(seqs.len());
        for s in seqs.iter() {
            let at = tokens.len();
            parts.push(self.part_into(s.cache, s.tokens, s.tokens.len(), at, &mut tokens)?);
        }
        let mut x = self.embed.forward(be, comms.tp, &tokens)?;
        if let Some(s) = c.embedding_scale {
            be.scale(&mut x, s)?;
        }
        for (l, b) in self.blocks.iter().enumerate() {
            let h = be.rms_norm(&x, &b.attn_norm, c.rms_eps)?;
            let mut caches: Vec<&mut ParallelCache> =
                seqs.iter_mut().map(|s| &mut *s.cache).collect();
            let a = b.attn.forward(be, comms, &h, &parts, l, &mut caches)?;
            be.add_assign(&mut x, &a)?;
            let h = be.rms_norm(&x, &b.ffn_norm, c.rms_eps)?;
            let mut m = b.mlp.forward(be, &h)?;
            be.all_reduce_sum(comms.tp, &mut m)?;
            be.add_assign(&mut x, &m)?;
        }
        // The reductions above are queued on the device without host waits; the last one is
        // waited for here, where a failed peer is named.
        be.wait_collectives(comms.tp)?;
        for (s, p) in seqs.iter_mut().zip(&parts) {
            let kept = p.kept(self.placement.cp);
            s.cache.cp_lens.iter_mut().zip(kept).for_each(|(len, k)| *len += k);
        }
        Ok((x, parts))
    }

    /// The final normalized hidden states of the rows `logits` asks for, on every rank.
    fn hidden(
        &self,
        comms: &mut Comms<'_>,
        tokens: &[u32],
        cache: &mut ParallelCache,
        logits: Logits,
    ) -> Result<Tensor> {
        let c = &self.config;
        let mut seqs = [Sequence { tokens, cache, sample: true }];
        let (x, mut parts) = self.layers(comms, &mut seqs)?;
        let part = parts.remove(0);
        // Bring the rows asked for onto every rank.
        let x = match (&part.split, logits) {
            (Split::Prefill(shard), Logits::All) => gather_tokens(comms.cp, &x, shard)?,
            (Split::Prefill(_), Logits::Last) => {
                // Shards ascend, so the last CP rank holds the last token.
                let holder = self.placement.cp - 1;
                let mut last = if self.placement.cp_rank == holder {
                    x.row(x.rows() - 1).to_vec()
                } else {
                    vec![0f32; c.hidden]
                };
                comms.cp.broadcast(&mut last, holder)?;
                Tensor::from_vec(&[1, c.hidden], last)?
            }
            (Split::Extend(_), Logits::All) => x,
            (Split::Extend(_), Logits::Last) => {
                Tensor::from_vec(&[1, c.hidden], x.row(x.rows() - 1).to_vec())?
            }
        };
        self.backend.rms_norm(&x, &self.norm, c.rms_eps)
    }
}
