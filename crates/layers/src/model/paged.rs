//! A paged KV cache (the layout of vLLM's PagedAttention): one pool of fixed-size blocks per
//! rank, shared by its sequences, and per sequence a block table naming the blocks that hold
//! its tokens in order.
//!
//! A block holds `block_size` tokens of every layer: block `b`'s keys of layer `l` are
//! `[block_size, kv_heads, head_dim]` at element `(b · layers + l) · 2 · block_size · row`,
//! its values right after them. Who holds which block is decided elsewhere (rank 0's
//! scheduler, which hands the same ids to every rank); the pool only stores, and a sequence
//! writes only the blocks its table names. Blocks of a shared prompt prefix are named by
//! several tables and only read.

use crate::error::{Error, Result};
use crate::kernels::cpu::attention::KvBlocks;
use crate::kernels::Kv;
use crate::tensor::Storage;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

/// One rank's KV blocks, in one buffer (a `kv_cache` allocation, say).
#[derive(Debug)]
pub struct KvPool {
    data: RwLock<Storage>,
    layers: usize,
    /// Values per token of one layer's keys (or values): `kv_heads × head_dim`.
    row: usize,
    block_size: usize,
    blocks: usize,
}

impl KvPool {
    /// A pool of `blocks` blocks in owned (heap) memory.
    ///
    /// # Errors
    /// [`Error::Shape`] when `block_size` is not a power of two.
    pub fn new(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        blocks: usize,
    ) -> Result<Self> {
        let floats = Self::bytes(layers, kv_heads, head_dim, block_size, blocks) / 4;
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
    /// [`Error::Shape`] when `block_size` is not a power of two, a token has no values, or
    /// the storage is not a whole number of blocks.
    pub fn with_storage(
        storage: Storage,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> Result<Self> {
        let row = kv_heads * head_dim;
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
        if !storage.len().is_multiple_of(block_floats) {
            return Err(Error::shape(
                "KvPool",
                format!("{} values are not whole blocks of {block_floats}", storage.len()),
            ));
        }
        let blocks = storage.len() / block_floats;
        Ok(KvPool { data: RwLock::new(storage), layers, row, block_size, blocks })
    }

    /// Bytes of a pool of `blocks` blocks.
    pub fn bytes(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        blocks: usize,
    ) -> usize {
        blocks * 2 * layers * block_size * kv_heads * head_dim * std::mem::size_of::<f32>()
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Layers per block.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Values per token of one layer's keys.
    pub fn row(&self) -> usize {
        self.row
    }

    /// Element offset of block `block`'s keys of `layer` (its values follow).
    fn offset(&self, block: u32, layer: usize) -> usize {
        (block as usize * self.layers + layer) * 2 * self.block_size * self.row
    }

    /// Checks that `table` names blocks of this pool.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the first id out of range.
    pub fn check_table(&self, table: &[u32]) -> Result<()> {
        match table.iter().find(|&&b| b as usize >= self.blocks) {
            Some(b) => Err(Error::shape(
                "kv block table",
                format!("block {b} of a pool of {} blocks", self.blocks),
            )),
            None => Ok(()),
        }
    }

    /// Writes the keys and values of tokens `at..at + n` of a sequence with block table
    /// `table` in `layer` (`n` from the lengths of `k` and `v`).
    fn write(&self, layer: usize, table: &[u32], at: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let (row, bs) = (self.row, self.block_size);
        let n = k.len() / row;
        if k.len() != v.len() || k.len() != n * row || layer >= self.layers {
            return Err(Error::shape(
                "kv pool write",
                format!(
                    "layer {layer} of {}, k {} v {} for rows of {row}",
                    self.layers,
                    k.len(),
                    v.len()
                ),
            ));
        }
        if at + n > table.len() * bs {
            return Err(Error::CacheFull { len: at, capacity: table.len() * bs, requested: n });
        }
        let mut data = self.data.write().unwrap_or_else(PoisonError::into_inner);
        let data = data.as_mut_slice();
        for (i, (kr, vr)) in k.chunks_exact(row).zip(v.chunks_exact(row)).enumerate() {
            let t = at + i;
            let start = self.offset(table[t / bs], layer) + (t % bs) * row;
            data[start..start + row].copy_from_slice(kr);
            data[start + bs * row..start + (bs + 1) * row].copy_from_slice(vr);
        }
        Ok(())
    }

    fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.data.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One sequence's tokens on this rank in a [`KvPool`]: its block table, and per layer how many
/// tokens are written (layers fill one after another within a forward pass).
#[derive(Debug)]
pub struct PagedCache {
    pool: Arc<KvPool>,
    table: Vec<u32>,
    positions: Vec<usize>,
    filled: Vec<usize>,
}

impl PagedCache {
    /// An empty cache with no blocks yet.
    pub fn new(pool: Arc<KvPool>) -> Self {
        let filled = vec![0; pool.layers];
        PagedCache { pool, table: Vec::new(), positions: Vec::new(), filled }
    }

    /// Appends `blocks` to the block table (room for more tokens).
    ///
    /// # Errors
    /// [`Error::Shape`] when a block is not in the pool; the table is unchanged.
    pub fn extend_table(&mut self, blocks: &[u32]) -> Result<()> {
        self.pool.check_table(blocks)?;
        self.table.extend_from_slice(blocks);
        Ok(())
    }

    /// Takes the first `tokens` tokens as already written at positions `0..tokens` in every
    /// layer (a prompt prefix whose blocks another sequence filled).
    ///
    /// # Errors
    /// [`Error::Shape`] when the cache is not empty, [`Error::CacheFull`] when the table does
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

    /// The block table.
    pub fn table(&self) -> &[u32] {
        &self.table
    }

    /// The pool.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Appends the keys and values of `positions.len()` tokens to `layer`.
    ///
    /// # Errors
    /// [`Error::CacheFull`] when the table has no room; [`Error::Shape`] when the lengths
    /// disagree. The cache is unchanged on error.
    pub fn append(
        &mut self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        positions: &[usize],
    ) -> Result<()> {
        let at = *self.filled.get(layer).ok_or_else(|| {
            Error::shape("kv cache append", format!("layer {layer} of {}", self.filled.len()))
        })?;
        if k.len() != positions.len() * self.pool.row {
            return Err(Error::shape(
                "kv cache append",
                format!(
                    "{} tokens need {} values, got {}",
                    positions.len(),
                    positions.len() * self.pool.row,
                    k.len()
                ),
            ));
        }
        self.pool.write(layer, &self.table, at, k, v)?;
        // The first layer to reach a token records its position.
        let known = self.positions.len().saturating_sub(at).min(positions.len());
        self.positions.extend_from_slice(&positions[known..]);
        self.filled[layer] += positions.len();
        Ok(())
    }

    /// Calls `f` with `layer`'s keys and values (blocks of the pool, read in place) and their
    /// positions.
    pub fn with_kv<R>(&self, layer: usize, f: impl FnOnce(Kv<'_>, &[usize]) -> R) -> R {
        let tokens = self.filled.get(layer).copied().unwrap_or(0);
        let (bs, row) = (self.pool.block_size, self.pool.row);
        let data = self.pool.read();
        let data = data.as_slice();
        let used = &self.table[..tokens.div_ceil(bs)];
        let k: Vec<&[f32]> =
            used.iter().map(|&b| &data[self.pool.offset(b, layer)..][..bs * row]).collect();
        let v: Vec<&[f32]> = used
            .iter()
            .map(|&b| &data[self.pool.offset(b, layer) + bs * row..][..bs * row])
            .collect();
        // The table's blocks were checked against the pool and the size is a power of two.
        let blocks = KvBlocks::new(&k, &v, bs).expect("a power-of-two block size");
        f(Kv::Paged(blocks), &self.positions[..tokens])
    }

    /// Tokens held (in the first layer, which every forward pass fills first).
    pub fn len(&self) -> usize {
        self.filled.first().copied().unwrap_or(0)
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens the block table has room for.
    pub fn capacity(&self) -> usize {
        self.table.len() * self.pool.block_size
    }

    /// Keeps the first `len` tokens (drops a failed step's partial appends); the block table
    /// stays.
    pub fn truncate(&mut self, len: usize) {
        self.positions.truncate(len);
        self.filled.iter_mut().for_each(|f| *f = (*f).min(len));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::attention::attention;
    use crate::kernels::{AttnShape, Backend};
    use crate::test_util::random_vec;
    use crate::Tensor;

    /// Tokens written through scattered, shared and partly filled blocks read back as the
    /// contiguous rows, and attention over them gives the contiguous result bit for bit,
    /// on the row path (one query) and the blocked path (many).
    #[test]
    fn attention_over_blocks_equals_attention_over_contiguous_rows() {
        let be = Backend::cpu(2).unwrap();
        let shape = AttnShape { q_heads: 6, kv_heads: 2, head_dim: 8 };
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
                cache.append(layer, &k[..cut * row], &v[..cut * row], &pos[..cut]).unwrap();
                cache.append(layer, &k[cut * row..], &v[cut * row..], &pos[cut..]).unwrap();
            }
            assert_eq!((cache.len(), cache.capacity()), (tokens, table.len() * bs));
            for n_q in [1, 9] {
                let q = random_vec(n_q * 6 * 8, 7);
                let qp: Vec<usize> = (tokens - n_q.min(tokens)..tokens).cycle().take(n_q).collect();
                let mut want = vec![0.0; n_q * 48];
                let mut want_lse = vec![0.0; n_q * 6];
                attention(&q, &qp, &k, &v, &pos, shape, &mut want, Some(&mut want_lse));
                let qt = Tensor::from_vec(&[n_q, 6, 8], q.clone()).unwrap();
                let (out, lse) =
                    cache.with_kv(1, |kv, kp| be.attention(&qt, &qp, kv, kp, shape, true)).unwrap();
                assert_eq!(
                    out.data(),
                    &want[..],
                    "block size {bs}, {tokens} tokens, {n_q} queries"
                );
                assert_eq!(lse.unwrap().data(), &want_lse[..]);
            }
        }
    }

    #[test]
    fn a_full_table_refuses_more_tokens_and_ids_outside_the_pool() {
        let pool = Arc::new(KvPool::new(1, 1, 2, 2, 3).unwrap());
        let mut cache = PagedCache::new(pool.clone());
        let err = cache.extend_table(&[1, 3]).unwrap_err();
        assert!(err.to_string().contains("block 3 of a pool of 3 blocks"), "{err}");
        assert!(cache.table().is_empty());
        cache.extend_table(&[2]).unwrap();
        let err = cache.append(0, &[0.0; 6], &[0.0; 6], &[0, 1, 2]).unwrap_err();
        assert!(matches!(err, Error::CacheFull { capacity: 2, requested: 3, .. }), "{err}");
        assert!(cache.is_empty());
        cache.append(0, &[1.0; 4], &[2.0; 4], &[0, 1]).unwrap();
        cache.truncate(1);
        assert_eq!(cache.len(), 1);
        let err = KvPool::new(1, 1, 2, 3, 1).unwrap_err();
        assert!(err.to_string().contains("power of two"), "{err}");
        let err = KvPool::with_storage(Storage::Owned(vec![0.0; 7]), 1, 1, 2, 2).unwrap_err();
        assert!(err.to_string().contains("whole blocks of 8"), "{err}");
        let mut reused = PagedCache::new(pool);
        reused.extend_table(&[2]).unwrap();
        reused.assume_prefix(1).unwrap();
        reused.with_kv(0, |_, positions| assert_eq!(positions, &[0]));
        assert!(reused.assume_prefix(1).is_err());
    }
}
