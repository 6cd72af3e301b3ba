//! What the `layers` adapters share: running a step plan entry by entry, each with its
//! sequence's KV cache, and keeping the logits of the entries that sample.

use crate::error::BoxError;
use crate::model::Logits;
use crate::plan::{PlanEntry, SeqId, StepPlan};
use std::collections::HashMap;

/// A model failure on one sequence; keeps the cause (a collective that blames a peer, say)
/// reachable through `source()`.
#[derive(Debug, thiserror::Error)]
#[error("sequence {seq}: {source}")]
pub(crate) struct SequenceError {
    seq: SeqId,
    source: layers::Error,
}

/// A KV cache of one sequence, as the adapters see it.
pub(crate) trait SequenceCache {
    /// Tokens it holds.
    fn tokens(&self) -> usize;
}

impl SequenceCache for layers::KvCache {
    fn tokens(&self) -> usize {
        self.len()
    }
}

impl SequenceCache for layers::parallel::ParallelCache {
    fn tokens(&self) -> usize {
        self.len()
    }
}

/// Runs every entry of `plan` with its sequence's cache (made by `new_cache` on first use),
/// checking that the plan continues where the cache ends, and returns the last logits row of
/// every entry that samples, in plan order.
pub(crate) fn run_entries<C: SequenceCache>(
    plan: &StepPlan,
    caches: &mut HashMap<SeqId, C>,
    mut new_cache: impl FnMut() -> Result<C, BoxError>,
    mut forward: impl FnMut(&PlanEntry, &mut C) -> Result<layers::Tensor, layers::Error>,
) -> Result<Logits, BoxError> {
    let mut rows = Vec::new();
    for e in &plan.entries {
        let cache = match caches.entry(e.seq) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(new_cache()?),
        };
        if cache.tokens() != e.start as usize {
            return Err(format!(
                "sequence {} holds {} tokens but the plan starts at position {}",
                e.seq,
                cache.tokens(),
                e.start
            )
            .into());
        }
        let out = forward(e, cache).map_err(|source| SequenceError { seq: e.seq, source })?;
        if e.sample {
            rows.push(out.row(out.rows() - 1).to_vec());
        }
    }
    Ok(rows)
}
