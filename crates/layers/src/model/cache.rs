//! The KV cache: per layer, the keys and values of every token seen so far, with the absolute
//! position of each entry (a context-parallel rank holds an arbitrary subset of positions).

use crate::error::{Error, Result};

/// Keys and values of one layer, `[len, kv_heads, head_dim]` each, plus positions.
#[derive(Clone, Debug)]
pub struct LayerCache {
    k: Vec<f32>,
    v: Vec<f32>,
    positions: Vec<usize>,
    row: usize,
    capacity: usize,
}

impl LayerCache {
    /// An empty cache for `capacity` tokens of `kv_heads × head_dim` keys and values.
    pub fn new(kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        let row = kv_heads * head_dim;
        LayerCache {
            k: Vec::with_capacity(capacity * row),
            v: Vec::with_capacity(capacity * row),
            positions: Vec::with_capacity(capacity),
            row,
            capacity,
        }
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
        if self.positions.len() + n > self.capacity {
            return Err(Error::CacheFull {
                len: self.positions.len(),
                capacity: self.capacity,
                requested: n,
            });
        }
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        self.positions.extend_from_slice(positions);
        Ok(())
    }

    /// The cached keys, `[len, kv_heads, head_dim]`.
    pub fn k(&self) -> &[f32] {
        &self.k
    }

    /// The cached values, `[len, kv_heads, head_dim]`.
    pub fn v(&self) -> &[f32] {
        &self.v
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

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.positions.truncate(len);
        self.k.truncate(len * self.row);
        self.v.truncate(len * self.row);
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
        assert_eq!(c.len(), 1);
        c.clear();
        assert!(c.is_empty());
    }
}
