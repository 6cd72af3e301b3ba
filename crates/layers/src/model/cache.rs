//! The KV cache: per layer, the keys and values of every token seen so far, with the absolute
//! position of each entry (a context-parallel rank holds an arbitrary subset of positions).
//!
//! The keys and values live in host memory ([`Storage`]: the heap or an arena) or, for the
//! CUDA backend, in device memory ([`DeviceMemory`]), where attention reads them in place.

use crate::error::{Error, Result};
use mesh::DeviceMemory;
use tensor::kernels::{Backend, Kv, KvElem};
use tensor::Storage;

/// Where a layer's keys and values live.
#[derive(Debug)]
enum Buffers {
    Host { k: Storage, v: Storage },
    Device { k: Box<dyn DeviceMemory>, v: Box<dyn DeviceMemory>, elem: KvElem },
}

/// Keys and values of one layer, `[capacity, kv_heads, head_dim]` each with the first `len`
/// tokens filled, plus their positions. The buffers are host [`Storage`] (so a cache can live
/// in external, for example `vmm`, memory) or device memory for the CUDA backend.
#[derive(Debug)]
pub struct LayerCache {
    buffers: Buffers,
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
            buffers: Buffers::Host {
                k: Storage::Owned(vec![0.0; n]),
                v: Storage::Owned(vec![0.0; n]),
            },
            positions: Vec::with_capacity(capacity),
            row: kv_heads * head_dim,
            capacity,
        }
    }

    /// An empty cache over the given host key and value buffers; the capacity is what they
    /// hold.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the buffers differ in size or are not whole rows.
    pub fn with_storage(k: Storage, v: Storage, kv_heads: usize, head_dim: usize) -> Result<Self> {
        let row = kv_heads * head_dim;
        let values = Self::capacity_of("LayerCache::with_storage", k.len(), v.len(), row)?;
        Ok(Self::empty(Buffers::Host { k, v }, row, values))
    }

    /// An empty cache over key and value buffers in device memory holding `elem` values,
    /// read and written only by the CUDA backend of that device; the capacity is what they
    /// hold.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the buffers differ in size or are not whole rows of `elem`.
    pub fn on_device(
        k: Box<dyn DeviceMemory>,
        v: Box<dyn DeviceMemory>,
        elem: KvElem,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let row = kv_heads * head_dim;
        let values = |m: &dyn DeviceMemory| {
            if m.size().is_multiple_of(elem.size()) {
                Ok(m.size() / elem.size())
            } else {
                Err(Error::shape(
                    "LayerCache::on_device",
                    format!("{} bytes are not whole {} values", m.size(), elem.name()),
                ))
            }
        };
        let (kn, vn) = (values(k.as_ref())?, values(v.as_ref())?);
        let capacity = Self::capacity_of("LayerCache::on_device", kn, vn, row)?;
        Ok(Self::empty(Buffers::Device { k, v, elem }, row, capacity))
    }

    /// Tokens that buffers of `k` and `v` values hold in rows of `row`.
    fn capacity_of(op: &'static str, k: usize, v: usize, row: usize) -> Result<usize> {
        if row == 0 || k != v || !k.is_multiple_of(row) {
            return Err(Error::shape(op, format!("k {k} and v {v} values for rows of {row}")));
        }
        Ok(k / row)
    }

    fn empty(buffers: Buffers, row: usize, capacity: usize) -> Self {
        LayerCache { buffers, positions: Vec::with_capacity(capacity), row, capacity }
    }

    /// Appends the keys and values of `positions.len()` tokens; `be` writes them when the
    /// cache lives in device memory (it must then be the CUDA backend of that device).
    ///
    /// # Errors
    /// [`Error::CacheFull`] when they do not fit; [`tensor::Error::Shape`] when the lengths disagree;
    /// [`tensor::Error::BackendUnavailable`] when a device cache is given a CPU backend or the copy
    /// fails. The cache is unchanged on error.
    pub fn append(
        &mut self,
        be: &Backend,
        k: &[f32],
        v: &[f32],
        positions: &[usize],
    ) -> Result<()> {
        let (n, len) = (positions.len(), self.check_append(positions.len(), k.len(), v.len())?);
        match &mut self.buffers {
            Buffers::Host { k: kb, v: vb } => {
                let range = len * self.row..(len + n) * self.row;
                kb.as_mut_slice()[range.clone()].copy_from_slice(k);
                vb.as_mut_slice()[range].copy_from_slice(v);
            }
            Buffers::Device { k: kb, v: vb, elem } => {
                be.write_device(kb.as_ref(), *elem, len * self.row, k)?;
                be.write_device(vb.as_ref(), *elem, len * self.row, v)?;
            }
        }
        self.positions.extend_from_slice(positions);
        Ok(())
    }

    /// Appends the keys and values of `positions.len()` tokens from tensors: as
    /// [`LayerCache::append`], but a device cache takes a backend's device outputs with a
    /// copy on the device.
    ///
    /// # Errors
    /// As [`LayerCache::append`].
    pub fn append_tensors(
        &mut self,
        be: &Backend,
        k: &tensor::Tensor,
        v: &tensor::Tensor,
        positions: &[usize],
    ) -> Result<()> {
        let Buffers::Device { k: kb, v: vb, elem } = &self.buffers else {
            return self.append(be, k.host()?, v.host()?, positions);
        };
        let len = self.check_append(positions.len(), k.len(), v.len())?;
        be.write_tensor(kb.as_ref(), *elem, len * self.row, k, 0..k.len())?;
        be.write_tensor(vb.as_ref(), *elem, len * self.row, v, 0..v.len())?;
        self.positions.extend_from_slice(positions);
        Ok(())
    }

    /// Checks that `n` tokens of `k` and `v` values fit; returns the cached length.
    fn check_append(&self, n: usize, k: usize, v: usize) -> Result<usize> {
        if k != n * self.row || v != n * self.row {
            return Err(Error::shape(
                "kv cache append",
                format!("{n} tokens need {} values, got k {k} v {v}", n * self.row),
            ));
        }
        let len = self.positions.len();
        if len + n > self.capacity {
            return Err(Error::CacheFull { len, capacity: self.capacity, requested: n });
        }
        Ok(len)
    }

    /// The cached keys and values, `[len, kv_heads, head_dim]` each, where they live.
    pub fn kv(&self) -> Kv<'_> {
        let filled = self.positions.len() * self.row;
        match &self.buffers {
            Buffers::Host { k, v } => {
                Kv::Host { k: &k.as_slice()[..filled], v: &v.as_slice()[..filled] }
            }
            Buffers::Device { k, v, elem } => {
                Kv::Device { k: k.as_ref(), v: v.as_ref(), elem: *elem }
            }
        }
    }

    /// Whether the keys and values live in device memory.
    pub fn is_on_device(&self) -> bool {
        matches!(self.buffers, Buffers::Device { .. })
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
#[derive(Debug)]
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

    /// The host keys and values of a layer.
    fn host(c: &LayerCache) -> (&[f32], &[f32]) {
        match c.kv() {
            Kv::Host { k, v } => (k, v),
            Kv::Device { .. } | Kv::Paged(_) | Kv::PagedDevice(_) => {
                panic!("a host cache reported other memory")
            }
        }
    }

    use crate::test_util::FakeDeviceMemory as Fake;

    #[test]
    fn append_truncate_and_overflow() {
        let be = Backend::cpu(1).unwrap();
        let mut c = KvCache::new(2, 1, 2, 3);
        c.layer_mut(0).append(&be, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0], &[0, 1]).unwrap();
        assert_eq!(c.layer(0).positions(), &[0, 1]);
        assert_eq!(host(c.layer(0)).0, &[1.0, 2.0, 3.0, 4.0]);
        let err = c.layer_mut(0).append(&be, &[0.0; 4], &[0.0; 4], &[2, 3]).unwrap_err();
        assert_eq!(err.to_string(), "kv cache full: 2 of 3 positions used, 2 more requested");
        let err = c.layer_mut(0).append(&be, &[0.0; 3], &[0.0; 2], &[2]).unwrap_err();
        assert!(err.to_string().contains("1 tokens need 2 values"), "{err}");
        c.truncate(1);
        assert_eq!(host(c.layer(0)).1, &[5.0, 6.0]);
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
        assert!(!c.layer(0).is_on_device());
    }

    /// A device cache is sized from its buffers, and a CPU backend refuses to write it
    /// (leaving it unchanged) rather than touch device memory.
    #[test]
    fn a_device_cache_needs_a_device_backend() {
        let on_device =
            |k, v, elem| LayerCache::on_device(Box::new(Fake(k)), Box::new(Fake(v)), elem, 3, 2);
        let mut c = on_device(48, 48, KvElem::F32).unwrap();
        assert!(c.is_on_device());
        assert_eq!(c.capacity(), 2);
        let be = Backend::cpu(1).unwrap();
        let err = c.append(&be, &[0.0; 6], &[0.0; 6], &[0]).unwrap_err();
        assert!(err.to_string().contains("device memory"), "{err}");
        assert!(c.is_empty());
        assert!(matches!(c.kv(), Kv::Device { k, elem: KvElem::F32, .. } if k.size() == 48));
        let err = on_device(48, 24, KvElem::F32);
        assert!(err.unwrap_err().to_string().contains("k 12 and v 6 values"));
        let err = on_device(46, 46, KvElem::F32);
        assert!(err.unwrap_err().to_string().contains("46 bytes are not whole f32 values"));
        // bf16 values take two bytes: the same buffers hold twice the tokens.
        let c = on_device(48, 48, KvElem::Bf16).unwrap();
        assert_eq!(c.capacity(), 4);
        assert!(matches!(c.kv(), Kv::Device { elem: KvElem::Bf16, .. }));
        let err = on_device(47, 47, KvElem::Bf16);
        assert!(err.unwrap_err().to_string().contains("47 bytes are not whole bf16 values"));
    }
}
