//! The KV cache: per layer, the keys and values of every token seen so far, with the absolute
//! position of each entry (a context-parallel rank holds an arbitrary subset of positions).

use crate::error::{Error, Result};
use crate::tensor::Storage;

/// Keys and values of one layer, `[capacity, kv_heads, head_dim]` each with the first `len`
/// tokens filled, plus their positions. The two buffers are [`Storage`], so a cache can live
/// in external (for example `vmm`) memory.
#[derive(Clone, Debug)]
pub struct LayerCache {
    k: Storage,
    v: Storage,
    positions: Vec<usize>,
    row: usize,
    capacity: usize,
}

impl LayerCache {
    /// An empty cache for `capacity` tokens of `kv_heads × head_dim` keys and values, in
    /// owned memory.
    pub fn new(kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        let n = capacity * kv_heads * head_dim;
        LayerCache {
            k: Storage::Owned(vec![0.0; n]),
            v: Storage::Owned(vec![0.0; n]),
            positions: Vec::with_capacity(capacity),
            row: kv_heads * head_dim,
            capacity,
        }
    }

    /// An empty cache over the given key and value buffers; the capacity is what they hold.
    ///
    /// # Errors
    /// [`Error::Shape`] when the buffers differ in size or are not whole rows.
    pub fn with_storage(k: Storage, v: Storage, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let row = kv_heads * head_dim;
        if row == 0 || k.len() != v.len() || k.len() % row != 0 {
            return Err(Error::shape(
                "LayerCache::with_storage",
                format!("k {} and v {} values for rows of {row}", k.len(), v.len()),
            ));
        }
        let capacity = k.len() / row;
        Ok(LayerCache { k, v, positions: Vec::with_capacity(capacity), row, capacity })
    }

    /// Appends the keys and values of `positions.len()` tokens.
    ///
    /// # Errors
    /// [`Error::CacheFull`] when they do not fit; [`Error::Shape`] when the lengths disagree.
    pub fn append(&mut self, k: &[f32], v: &[f32], positions: &[usize]) -> Result<()> {
        let n = positions.len();
        if k.len() != n * self.row || v.len() != n * self.row {
            return Err(Error::shape(
                "kv cache append",
                format!("{n} tokens need {} values, got k {} v {}", n * self.row, k.len(), v.len()),
            ));
        }
        let len = self.positions.len();
        if len + n > self.capacity {
            return Err(Error::CacheFull { len, capacity: self.capacity, requested: n });
        }
        let range = len * self.row..(len + n) * self.row;
        self.k.as_mut_slice()[range.clone()].copy_from_slice(k);
        self.v.as_mut_slice()[range].copy_from_slice(v);
        self.positions.extend_from_slice(positions);
        Ok(())
    }

    /// The cached keys, `[len, kv_heads, head_dim]`.
    pub fn k(&self) -> &[f32] {
        &self.k.as_slice()[..self.positions.len() * self.row]
    }

    /// The cached values, `[len, kv_heads, head_dim]`.
    pub fn v(&self) -> &[f32] {
        &self.v.as_slice()[..self.positions.len() * self.row]
    }

    /// The absolute position of each cached token.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// Cached tokens.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Tokens the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.positions.truncate(len);
    }
}

/// The caches of all layers of one sequence.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    capacity: usize,
}

impl KvCache {
    /// An empty cache of `n_layers` layers for `capacity` tokens.
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        KvCache {
            layers: (0..n_layers).map(|_| LayerCache::new(kv_heads, head_dim, capacity)).collect(),
            capacity,
        }
    }

    /// A cache made of per-layer caches (for example over external memory); the capacity is
    /// the smallest layer's.
    pub fn from_layers(layers: Vec<LayerCache>) -> Self {
        let capacity = layers.iter().map(LayerCache::capacity).min().unwrap_or(0);
        KvCache { layers, capacity }
    }

    /// Layer `i`'s cache.
    pub fn layer(&self, i: usize) -> &LayerCache {
        &self.layers[i]
    }

    /// Layer `i`'s cache, mutably.
    pub fn layer_mut(&mut self, i: usize) -> &mut LayerCache {
        &mut self.layers[i]
    }

    /// Cached tokens (the same in every layer between forward calls).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keeps the first `len` tokens in every layer (drops a failed step's partial appends).
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.layers {
            l.truncate(len);
        }
    }

    /// Empties the cache.
    pub fn clear(&mut self) {
        self.truncate(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_truncate_and_overflow() {
        let mut c = KvCache::new(2, 1, 2, 3);
        c.layer_mut(0).append(&[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0], &[0, 1]).unwrap();
        assert_eq!(c.layer(0).positions(), &[0, 1]);
        assert_eq!(c.layer(0).k(), &[1.0, 2.0, 3.0, 4.0]);
        let err = c.layer_mut(0).append(&[0.0; 4], &[0.0; 4], &[2, 3]).unwrap_err();
        assert_eq!(err.to_string(), "kv cache full: 2 of 3 positions used, 2 more requested");
        let err = c.layer_mut(0).append(&[0.0; 3], &[0.0; 2], &[2]).unwrap_err();
        assert!(err.to_string().contains("1 tokens need 2 values"), "{err}");
        c.truncate(1);
        assert_eq!(c.layer(0).v(), &[5.0, 6.0]);
        assert_eq!(c.layer(0).capacity(), 3);
        let err = LayerCache::with_storage(
            Storage::Owned(vec![0.0; 6]),
            Storage::Owned(vec![0.0; 4]),
            1,
            2,
        )
        .unwrap_err();
        assert!(err.to_string().contains("k 6 and v 4 values for rows of 2"), "{err}");
        assert_eq!(c.len(), 1);
        c.clear();
        assert!(c.is_empty());
    }
}
