//! The weights generation: a process-wide count of the times host weight bytes were rewritten
//! in place or freed, which tells a backend's device copies of weights (found by host address)
//! from stale ones without reading the weights.

use std::sync::atomic::{AtomicU64, Ordering};

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The current weights generation. A backend that copies host weight bytes to a device reads
/// it before it reads the bytes and keeps the copy only while the generation is the same.
pub fn weights_generation() -> u64 {
    // Acquire pairs with the bump's release: bytes written before a bump are seen by whoever
    // reads the new generation.
    GENERATION.load(Ordering::Acquire)
}

/// Says that host weight bytes changed under their address: call it after rewriting, in place,
/// a buffer that a backend may have copied (a weight update or revert written over the live
/// weights, a wakeup that restored them) and after freeing one while such a backend lives on
/// (a model dropped or given new weights, weights moved into an arena), so a later buffer at
/// the same address is not mistaken for the old one. The CUDA backend finds its copies of
/// weights by address and length and trusts them only within one generation; it never reads
/// the host bytes to check (that cost the decode step a hash of every weight). Cheap: one
/// atomic add. Calling it more often than needed costs only uploads.
pub fn weights_changed() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// Held by a model beside its weights: dropping it (the model, and with it its weight buffers)
/// calls [`weights_changed`], so a later model whose weights land at the same addresses is not
/// computed with the old one's device copies. A clone is a new holder (its weights are new
/// buffers). Declare it after the weights, so it is dropped after them.
#[derive(Debug, Default)]
pub struct WeightsHolder(());

impl Clone for WeightsHolder {
    fn clone(&self) -> Self {
        WeightsHolder::default()
    }
}

impl Drop for WeightsHolder {
    fn drop(&mut self) {
        weights_changed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_or_a_dropped_holder_moves_the_generation_on() {
        // Other tests in the process may bump it too: only increases are certain.
        let start = weights_generation();
        weights_changed();
        let after_change = weights_generation();
        assert!(after_change > start);
        let holder = WeightsHolder::default();
        let copy = holder.clone();
        drop(holder);
        let after_drop = weights_generation();
        assert!(after_drop > after_change);
        drop(copy);
        assert!(weights_generation() > after_drop);
    }
}
