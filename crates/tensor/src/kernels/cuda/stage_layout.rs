//! Where a step's small inputs go in its staging buffers (`device/staging.rs`), and the size
//! the buffers grow to when a step runs out. Plain bookkeeping, tested without a GPU.
//!
//! A step's inputs go into slots: the n-th distinct array a step stages goes into its n-th
//! slot, each slot a power of two of bytes. The slots of a step shape ([`StepKey`]) are kept
//! from one of its steps to the next, so an input keeps its address while it fits its slot
//! (the key positions and block tables of a decode step grow with its context; each slot
//! doubles only when its array outgrows it). That is what lets a step's launches repeat
//! exactly, addresses included, from one step of a shape to the next (a CUDA graph's
//! replay). Steps of no shape start from no slots. The same values staged twice in a step
//! (every layer passes the same positions) are staged once.

use crate::kernels::workspace::StepKey;
use std::collections::HashMap;

/// Offsets of staged arrays, and the sizes of slots, are multiples of this many bytes.
const STAGE_ALIGN: usize = 16;

/// Where the bytes of a step's inputs go: the slots of each step shape, the slots of the
/// step in progress, and the arrays staged so far (by value) in it. Plain bookkeeping; the
/// buffers are `InputStaging`'s.
#[derive(Debug, Default)]
pub(crate) struct StageLayout {
    /// Bytes the buffers hold.
    capacity: usize,
    /// Each step shape's slot sizes, as its last step left them.
    shapes: HashMap<StepKey, Vec<usize>>,
    /// The step in progress: its shape, its slot sizes, and what it staged where.
    key: Option<StepKey>,
    slots: Vec<usize>,
    staged: Vec<(Vec<u8>, usize)>,
    /// The capacity the buffers should have (a step ran out).
    wanted: usize,
}

/// Where [`StageLayout::place`] puts an array.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Staged already in this step, at this offset.
    Again(usize),
    /// New, to be written at this offset.
    New(usize),
    /// No room left in this step's buffers.
    Full,
}

/// The size of a slot for `bytes` bytes.
fn slot_for(bytes: usize) -> usize {
    bytes.max(STAGE_ALIGN).next_power_of_two()
}

impl StageLayout {
    /// Bookkeeping for buffers of `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> StageLayout {
        StageLayout { capacity, wanted: capacity, ..StageLayout::default() }
    }

    /// The buffers now hold `capacity` bytes (they grew between two steps).
    pub(crate) fn resize(&mut self, capacity: usize) {
        debug_assert!(self.is_fresh(), "buffers grow between steps");
        self.capacity = capacity;
        self.wanted = self.wanted.max(capacity);
    }

    /// Starts a step of shape `key` (`None`: none), from that shape's slots.
    pub(crate) fn begin(&mut self, key: Option<StepKey>) {
        self.key = key;
        self.slots = key.and_then(|k| self.shapes.get(&k).cloned()).unwrap_or_default();
        self.staged.clear();
    }

    /// Where `bytes` go in this step.
    pub(crate) fn place(&mut self, bytes: &[u8]) -> Place {
        if let Some(&(_, at)) = self.staged.iter().find(|(b, _)| b == bytes) {
            return Place::Again(at);
        }
        let n = self.staged.len();
        let at: usize = self.slots.iter().take(n).sum();
        let slot = slot_for(bytes.len());
        let grown = match self.slots.get(n) {
            Some(&have) if have >= bytes.len() => have,
            // Outgrown: this slot doubles (the slots after it, filled later, move).
            Some(&have) => slot.max(2 * have),
            None => slot,
        };
        let end = at + grown;
        if end > self.capacity {
            self.wanted = self.wanted.max(2 * (end + self.slots.iter().skip(n + 1).sum::<usize>()));
            return Place::Full;
        }
        match self.slots.get_mut(n) {
            Some(s) => *s = grown,
            None => self.slots.push(grown),
        }
        self.staged.push((bytes.to_vec(), at));
        Place::New(at)
    }

    /// The size of the slot the last [`Place::New`] went into: what its copy copies, the
    /// same at every step of a shape while the input fits it.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn last_slot(&self) -> usize {
        self.slots.get(self.staged.len().wrapping_sub(1)).copied().unwrap_or(0)
    }

    /// Whether this step staged anything yet.
    pub(crate) fn is_fresh(&self) -> bool {
        self.staged.is_empty()
    }

    /// Ends the step: its shape keeps the slots it used. Returns the capacity the buffers
    /// should grow to, when this step ran out.
    pub(crate) fn next_step(&mut self) -> Option<usize> {
        if let Some(key) = self.key.take() {
            let slots = std::mem::take(&mut self.slots);
            if !slots.is_empty() {
                self.shapes.insert(key, slots);
            }
        }
        self.slots.clear();
        self.staged.clear();
        (self.wanted > self.capacity).then_some(self.wanted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seqs: usize) -> Option<StepKey> {
        StepKey::of(seqs, seqs)
    }

    #[test]
    fn inputs_take_slots_in_order_once_per_value_and_the_next_step_starts_over() {
        let mut l = StageLayout::new(128);
        l.begin(None);
        assert!(l.is_fresh());
        assert_eq!(l.place(&[1, 2, 3]), Place::New(0));
        assert_eq!(l.place(&[9; 20]), Place::New(16), "after a slot of 16");
        assert_eq!(l.last_slot(), 32);
        assert_eq!(l.place(&[1, 2, 3]), Place::Again(0), "the same values are staged once");
        assert_eq!(l.place(&[7; 16]), Place::New(48), "after a slot of 32");
        assert_eq!(l.place(&[5; 65]), Place::Full, "a slot of 128 at 64 is past the capacity");
        assert_eq!(l.next_step(), Some(2 * (64 + 128)), "the buffers grow for the next step");
        l.resize(384);
        l.begin(None);
        assert!(l.is_fresh());
        assert_eq!(l.place(&[9; 20]), Place::New(0), "a step of no shape starts from no slots");
        let mut fits = StageLayout::new(64);
        fits.begin(None);
        fits.place(&[1; 64]);
        assert_eq!(fits.next_step(), None);
    }

    #[test]
    fn a_shape_keeps_its_inputs_addresses_while_they_grow_within_their_slots() {
        let mut l = StageLayout::new(1 << 12);
        // A decode step: ids, positions, the key positions (growing), the block table.
        let step = |l: &mut StageLayout, k: Option<StepKey>, keys: usize| {
            l.begin(k);
            let at = [
                l.place(&[1; 4]),
                l.place(&[2; 8]),
                l.place(&vec![keys as u8; 8 * keys]),
                l.place(&[4; 12]),
            ];
            assert_eq!(l.next_step(), None);
            at
        };
        let first = step(&mut l, key(1), 5);
        assert_eq!(first, [Place::New(0), Place::New(16), Place::New(32), Place::New(96)]);
        for keys in 6..=8 {
            assert_eq!(step(&mut l, key(1), keys), first, "{keys} keys fit the slot of 64");
        }
        // Another shape has slots of its own, and leaves the first one's alone.
        assert_eq!(step(&mut l, key(4), 30)[3], Place::New(288));
        let grown = step(&mut l, key(1), 9);
        assert_eq!(grown[..3], first[..3], "the slots before the one outgrown stay");
        assert_eq!(grown[3], Place::New(160), "the key positions' slot doubled to 128");
        for keys in 10..=16 {
            assert_eq!(step(&mut l, key(1), keys), grown, "{keys} keys fit the slot of 128");
        }
    }
}
