//! A paged KV cache (the layout of vLLM's PagedAttention): one pool of fixed-size blocks per
//! rank, shared by its sequences, and per sequence a block table naming the blocks that hold
//! its tokens in order.
//!
//! A block holds `block_size` tokens of the layers of one group ([`KvGroups`]: all the layers
//! of a model without a sliding window): block `b`'s keys of the layer in slot `s` are
//! `[block_size, kv_heads, head_dim]` at element `(b · slots + s) · 2 · block_size · row`,
//! its values right after them. A sequence has a block table per group, all as long. Who
//! holds which block is decided elsewhere (rank 0's scheduler, which hands the same ids to
//! every rank); the pool only stores, and a sequence writes only the blocks its tables name.
//! Blocks of a shared prompt prefix are named by several tables and only read. A windowed
//! group's leading blocks that the window has left ([`window_dead_blocks`]) are never read
//! again, so the scheduler may give them to other sequences.

#[cfg(doc)]
use super::kv_groups::window_dead_blocks;
use super::kv_groups::KvGroups;
use crate::error::{Error, Result};
use mesh::DeviceMemory;
use std::sync::{Arc, PoisonError, RwLock};
use tensor::kernels::cpu::attention::KvBlocks;
use tensor::kernels::{Backend, DeviceBlocks, Kv, KvElem, PoolMemory, PoolRows, Projected};
use tensor::{Storage, Tensor};

/// One rank's KV blocks, in one buffer (a `kv_cache` allocation, say).
#[derive(Debug)]
pub struct KvPool {
    data: Blocks,
    /// How the blocks store values (f32 on the host).
    elem: KvElem,
    /// Which layers a block holds, and where.
    groups: KvGroups,
    /// Values per token of one layer's keys (or values): `kv_heads × head_dim`.
    row: usize,
    block_size: usize,
    blocks: usize,
}

/// A layer's split of its fused QKV projection and its rotation, as
/// [`PagedCache::split_rope_append`] takes them: query heads, KV heads, head size and rotated
/// size; the rotation's base, frequency factors and attention factor.
pub type SplitRope<'a> = ((usize, usize, usize, usize), (f32, Option<&'a [f32]>, f32));

/// Where a pool's blocks live.
#[derive(Debug)]
enum Blocks {
    /// Host memory, read by the CPU backend in place.
    Host(RwLock<Storage>),
    /// Device memory, read and written by the CUDA backend of that device only.
    Device(Box<dyn DeviceMemory>),
}

/// The keys and values of tokens being appended.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Host(&'a [f32], &'a [f32]),
    Tensors(&'a Tensor, &'a Tensor),
}

impl KvPool {
    /// A pool of `blocks` blocks in owned (heap) memory, for `layers`: a number of layers
    /// (one group) or their [`KvGroups`].
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when `block_size` is not a power of two.
    pub fn new(
        layers: impl Into<KvGroups>,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        blocks: usize,
    ) -> Result<Self> {
        let layers = layers.into();
        let slots = layers.slots();
        let floats = Self::bytes(KvElem::F32, slots, kv_heads, head_dim, block_size, blocks) / 4;
        Self::with_storage(
            Storage::Owned(vec![0.0; floats]),
            layers,
            kv_heads,
            head_dim,
            block_size,
        )
    }

    /// A pool over `storage`; it holds as many blocks as fit.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when `block_size` is not a power of two, a token has no values, or
    /// the storage is not a whole number of blocks.
    pub fn with_storage(
        storage: Storage,
        layers: impl Into<KvGroups>,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> Result<Self> {
        let floats = storage.len();
        Self::over(
            Blocks::Host(RwLock::new(storage)),
            KvElem::F32,
            floats,
            layers.into(),
            kv_heads,
            head_dim,
            block_size,
        )
    }

    /// A pool over device memory `memory` (one `kv_cache` allocation of a GPU, say) storing
    /// values as `elem`, written and read by the CUDA backend of that device; it holds as many
    /// blocks as fit.
    ///
    /// # Errors
    /// As [`KvPool::with_storage`].
    pub fn on_device(
        memory: Box<dyn DeviceMemory>,
        elem: KvElem,
        layers: impl Into<KvGroups>,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> Result<Self> {
        let values = memory.size() / elem.size();
        let layers = layers.into();
        Self::over(Blocks::Device(memory), elem, values, layers, kv_heads, head_dim, block_size)
    }

    /// A pool of `data` holding `floats` values, checked to be whole blocks.
    fn over(
        data: Blocks,
        elem: KvElem,
        floats: usize,
        groups: KvGroups,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> Result<Self> {
        let (row, layers) = (kv_heads * head_dim, groups.slots());
        let block_floats = 2 * layers * block_size * row;
        if !block_size.is_power_of_two() || block_floats == 0 {
            return Err(Error::shape(
                "KvPool",
                format!(
                    "blocks of {block_size} tokens (a power of two is needed) of {layers} layers \
                     × {row} values"
                ),
            ));
        }
        if !floats.is_multiple_of(block_floats) {
            return Err(Error::shape(
                "KvPool",
                format!("{floats} values are not whole blocks of {block_floats}"),
            ));
        }
        let blocks = floats / block_floats;
        Ok(KvPool { data, elem, groups, row, block_size, blocks })
    }

    /// Bytes of a pool of `blocks` blocks of `layers` layers each ([`KvGroups::slots`])
    /// storing values as `elem`.
    pub fn bytes(
        elem: KvElem,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        blocks: usize,
    ) -> usize {
        blocks * 2 * layers * block_size * kv_heads * head_dim * elem.size()
    }

    /// How the pool stores values.
    pub fn elem(&self) -> KvElem {
        self.elem
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Layers of the model the pool is for.
    pub fn layers(&self) -> usize {
        self.groups.layers()
    }

    /// Which layers a block holds, and where.
    pub fn groups(&self) -> &KvGroups {
        &self.groups
    }

    /// Values per token of one layer's keys.
    pub fn row(&self) -> usize {
        self.row
    }

    /// Whether the blocks live in device memory.
    pub fn is_on_device(&self) -> bool {
        matches!(self.data, Blocks::Device(_))
    }

    /// Element offset of block `block`'s keys of the layer in `slot` (its values follow).
    fn offset(&self, block: u32, slot: usize) -> usize {
        (block as usize * self.groups.slots() + slot) * 2 * self.block_size * self.row
    }

    /// Checks that `table` names blocks of this pool.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] naming the first id out of range.
    pub fn check_table(&self, table: &[u32]) -> Result<()> {
        match table.iter().find(|&&b| b as usize >= self.blocks) {
            Some(b) => Err(Error::shape(
                "kv block table",
                format!("block {b} of a pool of {} blocks", self.blocks),
            )),
            None => Ok(()),
        }
    }

    /// Writes the keys and values of tokens `at..at + n` of a sequence whose block table of
    /// `layer`'s group is `table` in `layer` (`n` from the lengths of the rows); `be` writes a
    /// device pool.
    fn write(
        &self,
        be: &Backend,
        layer: usize,
        table: &[u32],
        at: usize,
        rows: Rows<'_>,
    ) -> Result<()> {
        let (row, bs) = (self.row, self.block_size);
        let (k_len, v_len) = match rows {
            Rows::Host(k, v) => (k.len(), v.len()),
            Rows::Tensors(k, v) => (k.len(), v.len()),
        };
        let n = k_len / row;
        let slot = self.groups.place(layer).map(|(_, slot)| slot);
        let Some(slot) = slot.filter(|_| k_len == v_len && k_len == n * row) else {
            return Err(Error::shape(
                "kv pool write",
                format!(
                    "layer {layer} of {}, k {k_len} v {v_len} for rows of {row}",
                    self.layers()
                ),
            ));
        };
        if at + n > table.len() * bs {
            return Err(Error::CacheFull { len: at, capacity: table.len() * bs, requested: n });
        }
        // Runs of tokens within one block, contiguous there and in the source: (offset in the
        // pool, offset in the source, values).
        let runs = block_runs(at, n, bs).map(|(t, len)| {
            (self.offset(table[t / bs], slot) + (t % bs) * row, (t - at) * row, len * row)
        });
        match (&self.data, rows) {
            (Blocks::Host(data), _) => {
                let (k, v) = match rows {
                    Rows::Host(k, v) => (k, v),
                    Rows::Tensors(k, v) => (k.host()?, v.host()?),
                };
                let mut data = data.write().unwrap_or_else(PoisonError::into_inner);
                let data = data.as_mut_slice();
                for (dst, src, len) in runs {
                    data[dst..dst + len].copy_from_slice(&k[src..src + len]);
                    data[dst + bs * row..][..len].copy_from_slice(&v[src..src + len]);
                }
            }
            (Blocks::Device(mem), Rows::Host(k, v)) => {
                for (dst, src, len) in runs {
                    be.write_device(mem.as_ref(), self.elem, dst, &k[src..src + len])?;
                    be.write_device(mem.as_ref(), self.elem, dst + bs * row, &v[src..src + len])?;
                }
            }
            (Blocks::Device(mem), Rows::Tensors(k, v)) => {
                for (dst, src, len) in runs {
                    be.write_tensor(mem.as_ref(), self.elem, dst, k, src..src + len)?;
                    be.write_tensor(mem.as_ref(), self.elem, dst + bs * row, v, src..src + len)?;
                }
            }
        }
        Ok(())
    }
}

impl KvPool {
    /// Writes one token's keys and values for each of `places` of `layer`: row `s` of `k` and
    /// of `v` (rows of [`KvPool::row`] values) as the keys at element `d` of the layer's slot
    /// 0 place (see [`PagedCache::next_place`]) and the values after them. A device pool takes
    /// all of them in one launch for the keys and one for the values (`Backend::write_rows`,
    /// shifted to the layer's slot, so a step's places are the same, and uploaded once, in
    /// every layer of a group), where [`PagedCache::append_tensors`] made two copies per
    /// sequence.
    fn write_token_rows(
        &self,
        be: &Backend,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        places: &[(usize, usize)],
    ) -> Result<()> {
        let (row, values) = (self.row, self.block_size * self.row);
        let shift = self.slot_shift(layer);
        match &self.data {
            Blocks::Host(data) => {
                let (k, v) = (k.host()?, v.host()?);
                let mut data = data.write().unwrap_or_else(PoisonError::into_inner);
                let data = data.as_mut_slice();
                for &(s, d) in places {
                    let d = shift + d;
                    data[d..d + row].copy_from_slice(&k[s * row..(s + 1) * row]);
                    data[d + values..d + values + row].copy_from_slice(&v[s * row..(s + 1) * row]);
                }
            }
            Blocks::Device(mem) => {
                be.write_rows(mem.as_ref(), self.elem, k, row, places, shift)?;
                be.write_rows(mem.as_ref(), self.elem, v, row, places, shift + values)?;
            }
        }
        Ok(())
    }
}

impl KvPool {
    /// Where `layer`'s keys start in every block (elements): what a layer's token places are
    /// relative to in [`KvPool::write_token_rows`] and [`KvPool::split_rope_append`].
    fn slot_shift(&self, layer: usize) -> usize {
        self.offset(0, self.groups.place(layer).map_or(0, |(_, slot)| slot))
    }

    /// The queries of a fused projection `y`, each token's rotated keys and its values written
    /// at `shift + places[t]` of the pool (values a block's rows after): see
    /// [`PagedCache::split_rope_append`].
    fn split_rope_append(
        &self,
        be: &Backend,
        y: Projected<'_>,
        positions: &[usize],
        (dims, rotation): SplitRope<'_>,
        places: &[usize],
        shift: usize,
    ) -> Result<Tensor> {
        let values = self.block_size * self.row;
        let rows = |memory| PoolRows { memory, places, shift, values };
        Ok(match &self.data {
            Blocks::Host(data) => {
                let mut data = data.write().unwrap_or_else(PoisonError::into_inner);
                let memory = PoolMemory::Host(data.as_mut_slice());
                be.split_rope_append(y, positions, dims, rotation, rows(memory))?
            }
            Blocks::Device(mem) => {
                let memory = PoolMemory::Device(mem.as_ref(), self.elem);
                be.split_rope_append(y, positions, dims, rotation, rows(memory))?
            }
        })
    }
}

/// Tokens `at..at + n` cut where blocks of `block_size` tokens end: (first token, tokens).
fn block_runs(at: usize, n: usize, block_size: usize) -> impl Iterator<Item = (usize, usize)> {
    let end = at + n;
    std::iter::successors((n > 0).then_some(at), move |&t| {
        let next = (t / block_size + 1) * block_size;
        (next < end).then_some(next)
    })
    .map(move |t| (t, (block_size - t % block_size).min(end - t)))
}

/// One sequence's tokens on this rank in a [`KvPool`]: its block table per group (see
/// [`KvGroups`]), and per layer how many tokens are written (layers fill one after another
/// within a forward pass).
#[derive(Debug)]
pub struct PagedCache {
    pool: Arc<KvPool>,
    /// One table per group, all as long: logical block `i` of group `g` is `tables[g][i]`.
    tables: Vec<Vec<u32>>,
    positions: Vec<usize>,
    filled: Vec<usize>,
}

impl PagedCache {
    /// An empty cache with no blocks yet.
    pub fn new(pool: Arc<KvPool>) -> Self {
        let filled = vec![0; pool.layers()];
        let tables = vec![Vec::new(); pool.groups.len()];
        PagedCache { pool, tables, positions: Vec::new(), filled }
    }

    /// Appends `blocks` to the block tables (room for more tokens): one id per group for each
    /// `block_size` tokens, in group order (`[b0 of group 0, b0 of group 1, ..., b1 of group
    /// 0, ...]`; one group: the table itself).
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when a block is not in the pool or the ids are not a whole
    /// number per group; the tables are unchanged.
    pub fn extend_table(&mut self, blocks: &[u32]) -> Result<()> {
        self.pool.check_table(blocks)?;
        let groups = self.tables.len();
        if let [table] = self.tables.as_mut_slice() {
            table.extend_from_slice(blocks);
            return Ok(());
        }
        if !blocks.len().is_multiple_of(groups) {
            return Err(Error::shape(
                "kv block table",
                format!("{} block ids for {groups} groups", blocks.len()),
            ));
        }
        for ids in blocks.chunks_exact(groups) {
            self.tables.iter_mut().zip(ids).for_each(|(t, &id)| t.push(id));
        }
        Ok(())
    }

    /// Takes the first `tokens` tokens as already written at positions `0..tokens` in every
    /// layer (a prompt prefix whose blocks another sequence filled).
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the cache is not empty, [`Error::CacheFull`] when the table does
    /// not cover them.
    pub fn assume_prefix(&mut self, tokens: usize) -> Result<()> {
        if !self.positions.is_empty() {
            return Err(Error::shape(
                "kv cache prefix",
                format!("a cache holding {} tokens", self.positions.len()),
            ));
        }
        if tokens > self.capacity() {
            return Err(Error::CacheFull { len: 0, capacity: self.capacity(), requested: tokens });
        }
        self.positions.extend(0..tokens);
        self.filled.iter_mut().for_each(|f| *f = tokens);
        Ok(())
    }

    /// The block table of the first group (with one group: the table).
    pub fn table(&self) -> &[u32] {
        &self.tables[0]
    }

    /// The block table of each group.
    pub fn tables(&self) -> &[Vec<u32>] {
        &self.tables
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Appends the keys and values of `positions.len()` tokens to `layer`; `be` writes them
    /// when the pool lives in device memory (it must then be the CUDA backend of that
    /// device).
    ///
    /// # Errors
    /// [`Error::CacheFull`] when the table has no room; [`tensor::Error::Shape`] when the lengths
    /// disagree; [`tensor::Error::BackendUnavailable`] when a device pool is given a CPU backend or
    /// the copy fails. The cache's length is unchanged on error.
    pub fn append(
        &mut self,
        be: &Backend,
        layer: usize,
        k: &[f32],
        v: &[f32],
        positions: &[usize],
    ) -> Result<()> {
        self.append_rows(be, layer, Rows::Host(k, v), positions)
    }

    /// As [`PagedCache::append`] from tensors: a device pool takes a backend's device outputs
    /// with copies on the device.
    ///
    /// # Errors
    /// As [`PagedCache::append`].
    pub fn append_tensors(
        &mut self,
        be: &Backend,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        positions: &[usize],
    ) -> Result<()> {
        self.append_rows(be, layer, Rows::Tensors(k, v), positions)
    }

    fn append_rows(
        &mut self,
        be: &Backend,
        layer: usize,
        rows: Rows<'_>,
        positions: &[usize],
    ) -> Result<()> {
        let (at, place) = self.layer_at(layer)?;
        let k_len = match rows {
            Rows::Host(k, _) => k.len(),
            Rows::Tensors(k, _) => k.len(),
        };
        if k_len != positions.len() * self.pool.row {
            return Err(Error::shape(
                "kv cache append",
                format!(
                    "{} tokens need {} values, got {k_len}",
                    positions.len(),
                    positions.len() * self.pool.row,
                ),
            ));
        }
        self.pool.write(be, layer, &self.tables[place.0], at, rows)?;
        // The first layer to reach a token records its position.
        let known = self.positions.len().saturating_sub(at).min(positions.len());
        self.positions.extend_from_slice(&positions[known..]);
        self.filled[layer] += positions.len();
        Ok(())
    }

    /// How many tokens `layer` holds, and its (group, slot) in the pool's blocks.
    fn layer_at(&self, layer: usize) -> Result<(usize, (usize, usize))> {
        match (self.filled.get(layer), self.pool.groups.place(layer)) {
            (Some(&at), Some(place)) => Ok((at, place)),
            _ => Err(Error::shape(
                "kv cache append",
                format!("layer {layer} of {}", self.filled.len()),
            )),
        }
    }

    /// The element offset in the pool where `layer`'s next token's keys go (its values follow
    /// [`KvPool::block_size`] rows later), for a write of many sequences' tokens at once
    /// ([`PagedCache::append_tokens`]); nothing is taken.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] for a layer the pool does not have; [`Error::CacheFull`] when
    /// the table has no room for one more token.
    pub fn next_place(&self, layer: usize) -> Result<usize> {
        let (at, place) = self.layer_at(layer)?;
        let (table, bs) = (&self.tables[place.0], self.pool.block_size);
        let Some(&block) = table.get(at / bs) else {
            return Err(Error::CacheFull { len: at, capacity: table.len() * bs, requested: 1 });
        };
        Ok(self.pool.offset(block, place.1) + (at % bs) * self.pool.row)
    }

    /// Appends one token to `layer` of each cache of `caches` (all of one pool): row `i` of
    /// `k` and `v` (rows of [`KvPool::row`] values; more rows may follow) at `positions[i]`,
    /// written in one pass (one launch each for the keys and the values on a device pool)
    /// instead of two copies per cache.
    /// Nothing is taken unless every cache has room and the write succeeds.
    ///
    /// # Errors
    /// As [`PagedCache::next_place`] for the first cache without room; [`tensor::Error::Shape`]
    /// when the caches are not of one pool or the lengths disagree; the write's errors.
    pub fn append_tokens(
        be: &Backend,
        layer: usize,
        caches: &mut [&mut PagedCache],
        k: &Tensor,
        v: &Tensor,
        positions: &[usize],
    ) -> Result<()> {
        let Some(pool) = caches.first().map(|c| Arc::clone(&c.pool)) else { return Ok(()) };
        let n = caches.len();
        if caches.iter().any(|c| !Arc::ptr_eq(&c.pool, &pool))
            || positions.len() != n
            || k.len() < n * pool.row
            || v.len() < n * pool.row
        {
            return Err(Error::shape(
                "kv cache append",
                format!(
                    "{n} caches (of one pool: {}), {} positions, k {} v {} for rows of {}",
                    caches.iter().all(|c| Arc::ptr_eq(&c.pool, &pool)),
                    positions.len(),
                    k.len(),
                    v.len(),
                    pool.row
                ),
            ));
        }
        // Relative to the layer's slot: the same places in every layer of its group.
        let shift = pool.slot_shift(layer);
        let places = caches
            .iter()
            .enumerate()
            .map(|(i, c)| c.next_place(layer).map(|d| (i, d - shift)))
            .collect::<Result<Vec<_>>>()?;
        pool.write_token_rows(be, layer, k, v, &places)?;
        Self::took_tokens(caches, layer, positions);
        Ok(())
    }

    /// The queries of a decode step's fused projection `y` (one token per cache of `caches`,
    /// all of one pool, row `i` at `positions[i]`), with each token's rotated keys and its
    /// values appended to `layer` of its cache in the same pass
    /// ([`Backend::split_rope_append`]: one launch on a device pool for the split, the
    /// rotations and the append). Nothing is taken unless every cache has room and the write
    /// succeeds.
    ///
    /// # Errors
    /// As [`PagedCache::append_tokens`], and those of [`Backend::split_rope_append`].
    pub fn split_rope_append(
        be: &Backend,
        layer: usize,
        caches: &mut [&mut PagedCache],
        y: Projected<'_>,
        positions: &[usize],
        (dims, rotation): SplitRope<'_>,
    ) -> Result<Tensor> {
        let Some(pool) = caches.first().map(|c| Arc::clone(&c.pool)) else {
            return Ok(Tensor::zeros(&[0, dims.0 * dims.2]));
        };
        let n = caches.len();
        if caches.iter().any(|c| !Arc::ptr_eq(&c.pool, &pool)) || positions.len() != n {
            return Err(Error::shape(
                "kv cache append",
                format!("{n} caches of more than one pool, or {} positions", positions.len()),
            ));
        }
        let shift = pool.slot_shift(layer);
        let places = caches
            .iter()
            .map(|c| c.next_place(layer).map(|d| d - shift))
            .collect::<Result<Vec<_>>>()?;
        let q = pool.split_rope_append(be, y, positions, (dims, rotation), &places, shift)?;
        Self::took_tokens(caches, layer, positions);
        Ok(q)
    }

    /// Takes one token at `positions[i]` into `layer` of cache `i`, whose rows were written.
    fn took_tokens(caches: &mut [&mut PagedCache], layer: usize, positions: &[usize]) {
        for (c, &p) in caches.iter_mut().zip(positions) {
            // The first layer to reach a token records its position.
            if c.positions.len() == c.filled[layer] {
                c.positions.push(p);
            }
            c.filled[layer] += 1;
        }
    }

    /// Calls `f` with `layer`'s keys and values (blocks of the pool, read in place) and their
    /// positions.
    ///
    /// `first_query` is the position of the step's first query: a windowed layer's leading
    /// blocks whose every token lies before that query's window are left out (they are
    /// masked anyway, and rank 0 may have given them to another sequence: see
    /// [`window_dead_blocks`]).
    pub fn with_kv<R>(
        &self,
        layer: usize,
        first_query: usize,
        f: impl FnOnce(Kv<'_>, &[usize]) -> R,
    ) -> R {
        let tokens = self.filled.get(layer).copied().unwrap_or(0);
        let (bs, row) = (self.pool.block_size, self.pool.row);
        let (group, slot) = self.pool.groups.place(layer).unwrap_or((0, 0));
        // Whole blocks whose last token is before the window of the first query.
        let skip = match self.pool.groups.windows()[group] {
            Some(w) => {
                let seen_from = (first_query + 1).saturating_sub(w);
                self.positions[..tokens].partition_point(|&p| p < seen_from) / bs
            }
            None => 0,
        };
        let used = &self.tables[group][skip..tokens.div_ceil(bs)];
        let positions = &self.positions[skip * bs..tokens];
        let data = match &self.pool.data {
            Blocks::Host(data) => data.read().unwrap_or_else(PoisonError::into_inner),
            Blocks::Device(memory) => {
                let keys = self.pool.offset(0, slot);
                let blocks = DeviceBlocks {
                    memory: memory.as_ref(),
                    elem: self.pool.elem,
                    table: used,
                    block_size: bs,
                    block_stride: self.pool.offset(1, 0),
                    keys,
                    values: keys + bs * row,
                };
                return f(Kv::PagedDevice(blocks), positions);
            }
        };
        let data = data.as_slice();
        let k: Vec<&[f32]> =
            used.iter().map(|&b| &data[self.pool.offset(b, slot)..][..bs * row]).collect();
        let v: Vec<&[f32]> = used
            .iter()
            .map(|&b| &data[self.pool.offset(b, slot) + bs * row..][..bs * row])
            .collect();
        // The table's blocks were checked against the pool and the size is a power of two.
        let blocks = KvBlocks::new(&k, &v, bs).expect("a power-of-two block size");
        f(Kv::Paged(blocks), positions)
    }

    /// Tokens held (in the first layer, which every forward pass fills first).
    pub fn len(&self) -> usize {
        self.filled.first().copied().unwrap_or(0)
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens the block tables have room for.
    pub fn capacity(&self) -> usize {
        self.tables[0].len() * self.pool.block_size
    }

    /// Keeps the first `len` tokens (drops a failed step's partial appends); the block table
    /// stays.
    pub fn truncate(&mut self, len: usize) {
        self.positions.truncate(len);
        self.filled.iter_mut().for_each(|f| *f = (*f).min(len));
    }

    /// Overwrites every value of block `block` with NaN, as another sequence given the block
    /// might: a test's check that nobody reads a block rank 0 gave back.
    #[cfg(test)]
    pub(crate) fn poison(pool: &KvPool, block: u32) {
        let Blocks::Host(data) = &pool.data else { return };
        let mut data = data.write().unwrap_or_else(PoisonError::into_inner);
        let floats = 2 * pool.groups.slots() * pool.block_size * pool.row;
        let start = pool.offset(block, 0);
        data.as_mut_slice()[start..start + floats].fill(f32::NAN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{random_vec, FakeDeviceMemory as Fake};
    use tensor::kernels::cpu::attention::attention;
    use tensor::kernels::{AttnShape, Backend};
    use tensor::Tensor;

    /// Tokens written through scattered, shared and partly filled blocks read back as the
    /// contiguous rows, and attention over them gives the contiguous result bit for bit,
    /// on the row path (one query) and the blocked path (many).
    #[test]
    fn attention_over_blocks_equals_attention_over_contiguous_rows() {
        let be = Backend::cpu(2).unwrap();
        let shape = AttnShape::new(6, 2, 8);
        let row = 16;
        for (bs, tokens) in [(1usize, 5usize), (4, 13), (16, 16), (16, 40), (32, 7)] {
            let pool = Arc::new(KvPool::new(3, 2, 8, bs, 64).unwrap());
            let mut cache = PagedCache::new(pool.clone());
            // Blocks in a scrambled order, as a pool hands them out after some churn.
            let table: Vec<u32> =
                (0..tokens.div_ceil(bs) as u32).map(|b| (b * 37 + 5) % 64).collect();
            cache.extend_table(&table).unwrap();
            let k = random_vec(tokens * row, bs as u64);
            let v = random_vec(tokens * row, 100 + bs as u64);
            let pos: Vec<usize> = (0..tokens).collect();
            for layer in 0..3 {
                // Two appends, the second across a block boundary.
                let cut = tokens / 2;
                cache.append(&be, layer, &k[..cut * row], &v[..cut * row], &pos[..cut]).unwrap();
                cache.append(&be, layer, &k[cut * row..], &v[cut * row..], &pos[cut..]).unwrap();
            }
            assert_eq!((cache.len(), cache.capacity()), (tokens, table.len() * bs));
            for n_q in [1, 9] {
                let q = random_vec(n_q * 6 * 8, 7);
                let qp: Vec<usize> = (tokens - n_q.min(tokens)..tokens).cycle().take(n_q).collect();
                let mut want = vec![0.0; n_q * 48];
                let mut want_lse = vec![0.0; n_q * 6];
                attention(&q, &qp, &k, &v, &pos, shape, &mut want, Some(&mut want_lse));
                let qt = Tensor::from_vec(&[n_q, 6, 8], q.clone()).unwrap();
                let (out, lse) = cache
                    .with_kv(1, 0, |kv, kp| be.attention(&qt, &qp, kv, kp, shape, true))
                    .unwrap();
                assert_eq!(
                    out.data(),
                    &want[..],
                    "block size {bs}, {tokens} tokens, {n_q} queries"
                );
                assert_eq!(lse.unwrap().data(), &want_lse[..]);
            }
        }
    }

    /// One token per cache in one write is what each cache's own append writes, layer after
    /// layer over scattered blocks and across block boundaries; a cache without room fails the
    /// write before anything is taken, and caches of two pools are refused.
    #[test]
    fn one_write_of_many_caches_tokens_is_each_caches_append() {
        let be = Backend::cpu(1).unwrap();
        let (row, bs, layers) = (16, 4, 3);
        let pools = [(); 2].map(|_| Arc::new(KvPool::new(layers, 2, 8, bs, 32).unwrap()));
        let starts = [0usize, 3, 6];
        let caches = |pool: &Arc<KvPool>| -> Vec<PagedCache> {
            starts
                .iter()
                .enumerate()
                .map(|(i, &start)| {
                    let mut c = PagedCache::new(pool.clone());
                    let table: Vec<u32> = (0..3).map(|b| ((i * 3 + b) * 7 % 32) as u32).collect();
                    c.extend_table(&table).unwrap();
                    let pos: Vec<usize> = (0..start).collect();
                    let (k, v) = (random_vec(start * row, 1), random_vec(start * row, 2));
                    for layer in 0..layers {
                        c.append(&be, layer, &k, &v, &pos).unwrap();
                    }
                    c
                })
                .collect()
        };
        let (mut batched, mut alone) = (caches(&pools[0]), caches(&pools[1]));
        // Three steps: the third crosses the first cache's block boundary (tokens 3 -> 4).
        for step in 0..3 {
            let positions: Vec<usize> = starts.iter().map(|s| s + step).collect();
            for layer in 0..layers {
                let seed = (10 * step + layer) as u64;
                let k = Tensor::from_vec(&[3, row], random_vec(3 * row, seed)).unwrap();
                let v = Tensor::from_vec(&[3, row], random_vec(3 * row, seed + 100)).unwrap();
                let mut all: Vec<&mut PagedCache> = batched.iter_mut().collect();
                PagedCache::append_tokens(&be, layer, &mut all, &k, &v, &positions).unwrap();
                for (i, c) in alone.iter_mut().enumerate() {
                    let (ki, vi) = (&k.data()[i * row..][..row], &v.data()[i * row..][..row]);
                    c.append(&be, layer, ki, vi, &positions[i..=i]).unwrap();
                }
            }
        }
        for (b, a) in batched.iter().zip(&alone) {
            assert_eq!(b.len(), a.len());
            for layer in 0..layers {
                let read = |c: &PagedCache| {
                    c.with_kv(layer, 0, |kv, pos| match kv {
                        Kv::Paged(blocks) => (blocks.gather(pos.len(), row), pos.to_vec()),
                        _ => unreachable!("a host pool"),
                    })
                };
                assert_eq!(read(b), read(a), "layer {layer}");
            }
        }
        // The second cache is full (3 blocks of 4: 12 tokens): nothing is taken.
        let mut full = caches(&pools[0]);
        for layer in 0..layers {
            let (k, v) = (random_vec(6 * row, 3), random_vec(6 * row, 4));
            full[1].append(&be, layer, &k, &v, &(3..9).collect::<Vec<_>>()).unwrap();
            full[1].append(&be, layer, &k[..3 * row], &v[..3 * row], &[9, 10, 11]).unwrap();
        }
        let lens: Vec<usize> = full.iter().map(PagedCache::len).collect();
        let k = Tensor::zeros(&[3, row]);
        let mut all: Vec<&mut PagedCache> = full.iter_mut().collect();
        let err = PagedCache::append_tokens(&be, 0, &mut all, &k, &k, &[9, 12, 9]).unwrap_err();
        assert!(matches!(err, Error::CacheFull { capacity: 12, requested: 1, .. }), "{err}");
        assert_eq!(full.iter().map(PagedCache::len).collect::<Vec<_>>(), lens);
        let mut mixed = vec![&mut batched[0], &mut alone[1]];
        let err = PagedCache::append_tokens(&be, 0, &mut mixed, &k, &k, &[7, 7]).unwrap_err();
        assert!(err.to_string().contains("of one pool: false"), "{err}");
    }

    #[test]
    fn a_full_table_refuses_more_tokens_and_ids_outside_the_pool() {
        let be = Backend::cpu(1).unwrap();
        let pool = Arc::new(KvPool::new(1, 1, 2, 2, 3).unwrap());
        let mut cache = PagedCache::new(pool.clone());
        let err = cache.extend_table(&[1, 3]).unwrap_err();
        assert!(err.to_string().contains("block 3 of a pool of 3 blocks"), "{err}");
        assert!(cache.table().is_empty());
        cache.extend_table(&[2]).unwrap();
        let err = cache.append(&be, 0, &[0.0; 6], &[0.0; 6], &[0, 1, 2]).unwrap_err();
        assert!(matches!(err, Error::CacheFull { capacity: 2, requested: 3, .. }), "{err}");
        assert!(cache.is_empty());
        cache.append(&be, 0, &[1.0; 4], &[2.0; 4], &[0, 1]).unwrap();
        cache.truncate(1);
        assert_eq!(cache.len(), 1);
        let err = KvPool::new(1, 1, 2, 3, 1).unwrap_err();
        assert!(err.to_string().contains("power of two"), "{err}");
        let err = KvPool::with_storage(Storage::Owned(vec![0.0; 7]), 1, 1, 2, 2).unwrap_err();
        assert!(err.to_string().contains("whole blocks of 8"), "{err}");
        let mut reused = PagedCache::new(pool);
        reused.extend_table(&[2]).unwrap();
        reused.assume_prefix(1).unwrap();
        reused.with_kv(0, 0, |_, positions| assert_eq!(positions, &[0]));
        assert!(reused.assume_prefix(1).is_err());
    }

    /// A pool in device memory hands attention its blocks through the table (offsets of the
    /// layer's keys and values, bounds checked against the memory), and the CPU backend
    /// neither writes nor reads it.
    /// A bf16 device pool counts two bytes a value: the same memory holds twice the blocks,
    /// its size is half an f32 pool's, and its blocks are checked against the memory in bytes.
    #[test]
    fn a_bf16_device_pool_holds_twice_the_blocks_of_its_bytes() {
        let bytes = 3 * 128 * 4;
        let pool = KvPool::on_device(Box::new(Fake(bytes)), KvElem::Bf16, 2, 1, 8, 4).unwrap();
        assert_eq!((pool.blocks(), pool.elem()), (6, KvElem::Bf16));
        assert_eq!(KvPool::bytes(KvElem::Bf16, 2, 1, 8, 4, 6), bytes);
        assert_eq!(KvPool::bytes(KvElem::F32, 2, 1, 8, 4, 6), 2 * bytes);
        let memory = Fake(bytes);
        let blocks = |table, elem| DeviceBlocks {
            memory: &memory,
            elem,
            table,
            block_size: 4,
            block_stride: 128,
            keys: 64,
            values: 96,
        };
        assert!(blocks(&[5], KvElem::Bf16).holds(4, 8), "block 5 of 6 fits in bf16");
        assert!(!blocks(&[5], KvElem::F32).holds(4, 8), "but not in f32");
        let cache = PagedCache::new(Arc::new(pool));
        cache.with_kv(0, 0, |kv, _| {
            let Kv::PagedDevice(b) = kv else { panic!("a device pool gave {kv:?}") };
            assert_eq!(b.elem, KvElem::Bf16);
        });
    }

    #[test]
    fn a_device_pool_names_its_blocks_and_is_refused_by_the_cpu() {
        let be = Backend::cpu(1).unwrap();
        // 2 layers × (k, v) × 4 tokens × 8 values: blocks of 128 floats.
        let pool = Arc::new(
            KvPool::on_device(Box::new(Fake(3 * 128 * 4)), KvElem::F32, 2, 1, 8, 4).unwrap(),
        );
        assert!(pool.is_on_device());
        assert_eq!(pool.blocks(), 3);
        let err = KvPool::on_device(Box::new(Fake(100 * 4)), KvElem::F32, 2, 1, 8, 4).unwrap_err();
        assert!(err.to_string().contains("whole blocks of 128"), "{err}");
        let mut cache = PagedCache::new(pool);
        cache.extend_table(&[2, 0]).unwrap();
        let err = cache.append(&be, 0, &[0.0; 8], &[0.0; 8], &[0]).unwrap_err();
        assert!(matches!(err, Error::Kernel(tensor::Error::BackendUnavailable { .. })), "{err}");
        assert!(cache.is_empty());
        cache.with_kv(1, 0, |kv, positions| {
            let Kv::PagedDevice(b) = kv else { panic!("a device pool gave {kv:?}") };
            assert!(positions.is_empty());
            assert_eq!((b.block_size, b.block_stride, b.keys, b.values), (4, 128, 64, 96));
            assert_eq!(b.table, &[] as &[u32]);
        });
        let blocks = |table| DeviceBlocks {
            memory: &Fake(3 * 128 * 4),
            elem: KvElem::F32,
            table,
            block_size: 4,
            block_stride: 128,
            keys: 64,
            values: 96,
        };
        assert!(blocks(&[2, 0]).holds(8, 8));
        assert!(!blocks(&[2, 0]).holds(9, 8), "more tokens than the table's blocks");
        assert!(!blocks(&[3]).holds(1, 8), "a block past the end of the memory");
        let q = Tensor::zeros(&[1, 1, 8]);
        let shape = AttnShape::new(1, 1, 8);
        let err = be.attention(&q, &[0], Kv::PagedDevice(blocks(&[2])), &[0], shape, false);
        assert!(err.unwrap_err().to_string().contains("device memory"));
    }
}
