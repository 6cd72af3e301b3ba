//! A sequence's KV cache on one rank (buffers of its own or blocks of a pool), and the
//! [`ParallelModel`] methods that make caches and KV pools for the rank's heads.

use super::{kv_head_range, ParallelModel};
use crate::error::{Error, Result};
use crate::model::{KvCache, KvGroups, KvPool, LayerCache, PagedCache, SplitRope};
use std::sync::Arc;
use tensor::kernels::{Backend, GemmDtype, Kv, KvElem, Projected};
use tensor::memory::{alloc_device_exact, alloc_exact, padded, Arena, DeviceArena};
use tensor::{Storage, Tensor};

/// A sequence's KV cache on one rank: its shard of the keys and values, and how many tokens
/// every CP rank holds (the same bookkeeping on every rank).
#[derive(Debug)]
pub struct ParallelCache {
    local: Local,
    pub(super) cp_lens: Vec<usize>,
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
    pub(super) fn append(
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
    pub(super) fn append_tensors(
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

    /// The paged caches of `caches` when every one is blocks of one pool, else `None`.
    fn one_pool<'c>(caches: &'c mut [&mut ParallelCache]) -> Option<Vec<&'c mut PagedCache>> {
        let paged: Vec<&mut PagedCache> = caches
            .iter_mut()
            .map(|c| match &mut c.local {
                Local::Paged(p) => Some(p),
                Local::Own(_) => None,
            })
            .collect::<Option<_>>()?;
        let same = paged
            .first()
            .is_none_or(|first| paged.iter().all(|c| Arc::ptr_eq(c.pool(), first.pool())));
        same.then_some(paged)
    }

    /// Whether every cache of `caches` is blocks of one pool (see
    /// [`ParallelCache::split_rope_append`]).
    pub(super) fn in_one_pool(caches: &mut [&mut ParallelCache]) -> bool {
        Self::one_pool(caches).is_some()
    }

    /// The queries of a decode step's fused QKV projection `y` (row `i` the one new token of
    /// cache `i`, at `positions[i]`), each token's rotated keys and values appended to `layer`
    /// of its cache in the same pass ([`PagedCache::split_rope_append`]), when every cache is
    /// blocks of one pool; else `None`, and nothing is written.
    pub(super) fn split_rope_append(
        be: &Backend,
        layer: usize,
        caches: &mut [&mut ParallelCache],
        y: Projected<'_>,
        positions: &[usize],
        rope: SplitRope<'_>,
    ) -> Result<Option<Tensor>> {
        let Some(mut paged) = Self::one_pool(caches) else { return Ok(None) };
        Ok(Some(PagedCache::split_rope_append(be, layer, &mut paged, y, positions, rope)?))
    }

    /// Appends one token to `layer` of each of `caches`: row `i` of `k` and `v` at
    /// `positions[i]` (a step's decode rows, which lead its rows). When every cache is blocks
    /// of one pool that is one write for all of them ([`PagedCache::append_tokens`]: one
    /// launch each for the keys and the values on a GPU); else each cache appends its row.
    pub(super) fn append_singles(
        be: &Backend,
        layer: usize,
        caches: &mut [&mut ParallelCache],
        k: &Tensor,
        v: &Tensor,
        positions: &[usize],
    ) -> Result<()> {
        if let Some(mut paged) = Self::one_pool(caches) {
            return PagedCache::append_tokens(be, layer, &mut paged, k, v, positions);
        }
        for (i, (c, &p)) in caches.iter_mut().zip(positions).enumerate() {
            let (ki, vi) = (be.slice_first(k, i..i + 1)?, be.slice_first(v, i..i + 1)?);
            c.append_tensors(be, layer, &ki, &vi, &[p])?;
        }
        Ok(())
    }

    /// Calls `f` with `layer`'s keys and values and their positions, during a step (whose
    /// first query is at [`ParallelCache::len`]: the lengths grow after the last layer). A
    /// paged cache leaves out a windowed layer's blocks that no query of the step sees.
    pub(super) fn with_kv<R>(&self, layer: usize, f: impl FnOnce(Kv<'_>, &[usize]) -> R) -> R {
        match &self.local {
            Local::Own(c) => f(c.layer(layer).kv(), c.layer(layer).positions()),
            Local::Paged(c) => c.with_kv(layer, self.len(), f),
        }
    }

    /// Appends blocks of the pool to a paged cache's block table (room for more tokens).
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] for a cache with buffers of its own, or a block outside the pool.
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
    /// [`tensor::Error::Shape`] with CP, for a cache that is not paged or not empty;
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

    /// The block table of a paged cache's first group (empty otherwise).
    pub fn table(&self) -> &[u32] {
        match &self.local {
            Local::Paged(c) => c.table(),
            Local::Own(_) => &[],
        }
    }

    /// The block tables of a paged cache, one per group of its pool (none otherwise).
    pub fn tables(&self) -> &[Vec<u32>] {
        match &self.local {
            Local::Paged(c) => c.tables(),
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

impl ParallelModel {
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
    /// rounded up to [`tensor::memory::ALIGN`], summed.
    pub fn cache_bytes(&self, capacity: usize, elem: KvElem) -> usize {
        2 * self.config.n_layers * padded(self.cache_buffer_bytes(capacity, elem))
    }

    /// An empty cache for one sequence, `capacity` tokens on this rank, whose keys and values
    /// live in memory from `arena`: two allocations per layer, in the order layer 0 keys,
    /// layer 0 values, layer 1 keys, ... (see [`ParallelModel::cache_bytes`]).
    ///
    /// # Errors
    /// [`tensor::Error::Arena`] when an allocation fails or has the wrong size, [`tensor::Error::Shape`] when
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
    /// [`tensor::Error::Arena`] when an allocation fails or has the wrong size or alignment.
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

    /// How this model's KV pools group its layers ([`KvGroups::of`]: one group unless some
    /// layers have a sliding window).
    pub fn kv_groups(&self) -> KvGroups {
        KvGroups::of(&self.config)
    }

    /// A KV pool of `blocks` blocks of `block_size` tokens for this rank's heads, in owned
    /// memory (see [`KvPool`]), its layers grouped by [`ParallelModel::kv_groups`].
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when `block_size` is not a power of two.
    pub fn new_pool(&self, block_size: usize, blocks: usize) -> Result<KvPool> {
        let c = &self.config;
        KvPool::new(self.kv_groups(), self.local_kv_heads(), c.head_dim, block_size, blocks)
    }

    /// Bytes of this rank's KV pool of `blocks` blocks of `block_size` tokens stored as
    /// `elem`.
    pub fn pool_bytes(&self, block_size: usize, blocks: usize, elem: KvElem) -> usize {
        let (c, slots) = (&self.config, self.kv_groups().slots());
        KvPool::bytes(elem, slots, self.local_kv_heads(), c.head_dim, block_size, blocks)
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
        let (c, groups) = (&self.config, self.kv_groups());
        KvPool::with_storage(storage, groups, self.local_kv_heads(), c.head_dim, block_size)
    }

    /// A KV pool of `blocks` blocks of `block_size` tokens for this rank's heads in device
    /// memory from `arena` (one `kv_cache` allocation on the GPU the model computes on), values
    /// stored as `elem`, read and written by the CUDA backend in place.
    ///
    /// # Errors
    /// [`tensor::Error::Arena`] when the memory cannot be had; as [`KvPool::on_device`].
    pub fn pool_on_device(
        &self,
        arena: &dyn DeviceArena,
        block_size: usize,
        blocks: usize,
        elem: KvElem,
    ) -> Result<KvPool> {
        let memory = alloc_device_exact(arena, self.pool_bytes(block_size, blocks, elem))?;
        let (c, groups) = (&self.config, self.kv_groups());
        KvPool::on_device(memory, elem, groups, self.local_kv_heads(), c.head_dim, block_size)
    }

    /// An empty cache for one sequence whose keys and values live in blocks of `pool` (none
    /// yet: see [`ParallelCache::extend_table`]).
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the pool was made for another model or rank.
    pub fn new_paged_cache(&self, pool: &Arc<KvPool>) -> Result<ParallelCache> {
        let row = self.local_kv_heads() * self.config.head_dim;
        if pool.is_on_device() && self.backend.device() == tensor::Device::Cpu {
            return Err(tensor::Error::BackendUnavailable {
                backend: "cpu",
                reason: "a KV pool in device memory is read only by the CUDA backend".into(),
            }
            .into());
        }
        if *pool.groups() != self.kv_groups() || pool.row() != row {
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
}
