//! Which device copies of host weights are current, in plain Rust (tested without a GPU; the
//! CUDA weight cache in `device/cache.rs` keeps its slots here).
//!
//! A copy is found by the address and length of its host buffer and the element type it was
//! made in ([`WeightKey`]), and stamped with the weights generation
//! ([`crate::memory::weights_generation`]) read before the host bytes were. It is current
//! while the generation is the same and no clear marked it stale: whoever rewrites weight
//! bytes in place or frees them bumps the generation ([`crate::memory::weights_changed`]), so
//! a rewritten buffer, or another buffer at a reused address, is a miss without the host
//! bytes being read.

use crate::kernels::GemmDtype;
use std::collections::HashMap;

/// Where a cached weight came from (the address and length of its first host buffer) and the
/// form of its device copy: dense in an element type, or a quantized matrix's packed arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct WeightKey {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) dtype: GemmDtype,
    pub(crate) packed: bool,
}

/// A value and the generation its host bytes were read at; `None` once a clear marked it
/// stale (the value, a device slot, kept to be filled again).
struct Stamped<V> {
    generation: Option<u64>,
    value: V,
}

/// Values (device copies) by [`WeightKey`], each stamped with the generation it was made at.
pub(crate) struct WeightStamps<V> {
    entries: HashMap<WeightKey, Stamped<V>>,
}

impl<V> Default for WeightStamps<V> {
    fn default() -> Self {
        WeightStamps { entries: HashMap::new() }
    }
}

impl<V> WeightStamps<V> {
    /// The value of `key` when it was made at `generation` (the current one) and not marked
    /// stale since.
    pub(crate) fn current(&self, key: &WeightKey, generation: u64) -> Option<&V> {
        self.entries.get(key).filter(|e| e.generation == Some(generation)).map(|e| &e.value)
    }

    /// Takes `key`'s value out, current or not, to fill it again (a device slot keeps its
    /// address when it is reused).
    pub(crate) fn take(&mut self, key: &WeightKey) -> Option<V> {
        self.entries.remove(key).map(|e| e.value)
    }

    /// `value`, made from the host bytes of `key` read at `generation`.
    pub(crate) fn insert(&mut self, key: WeightKey, generation: u64, value: V) {
        self.entries.insert(key, Stamped { generation: Some(generation), value });
    }

    /// Marks every value stale: those `keep` accepts stay, to be filled again at their next
    /// use; the rest are dropped.
    pub(crate) fn mark_stale(&mut self, keep: impl Fn(&V) -> bool) {
        self.entries.retain(|_, e| keep(&e.value));
        self.entries.values_mut().for_each(|e| e.generation = None);
    }

    /// Drops every value.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }

    /// Every value, current or stale.
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.values().map(|e| &e.value)
    }

    /// The number of values, current or stale.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests;
