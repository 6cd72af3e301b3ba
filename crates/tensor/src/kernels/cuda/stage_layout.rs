//! Where a step's small inputs go in its staging buffers (`device/staging.rs`): offsets front
//! to back within a step, the same values once, and the size the buffers grow to when a step
//! runs out. Plain bookkeeping, tested without a GPU.

/// Offsets of staged arrays are multiples of this many bytes.
const STAGE_ALIGN: usize = 16;

/// Where the bytes of a step's inputs go: offsets front to back, and the arrays staged so far
/// (by value) in this step. Plain bookkeeping; the buffers are [`InputStaging`]'s.
#[derive(Debug, Default)]
pub(crate) struct StageLayout {
    capacity: usize,
    used: usize,
    staged: Vec<(Vec<u8>, usize)>,
    /// The capacity the next step should have (a step ran out).
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

impl StageLayout {
    /// Bookkeeping for buffers of `capacity` bytes.
    pub(crate) fn new(capacity: usize) -> StageLayout {
        StageLayout { capacity, wanted: capacity, ..StageLayout::default() }
    }

    /// Where `bytes` go in this step.
    pub(crate) fn place(&mut self, bytes: &[u8]) -> Place {
        if let Some(&(_, at)) = self.staged.iter().find(|(b, _)| b == bytes) {
            return Place::Again(at);
        }
        let at = self.used.next_multiple_of(STAGE_ALIGN);
        let end = at + bytes.len();
        if end > self.capacity {
            self.wanted = self.wanted.max(2 * end);
            return Place::Full;
        }
        self.used = end;
        self.staged.push((bytes.to_vec(), at));
        Place::New(at)
    }

    /// Whether this step staged anything yet.
    pub(crate) fn is_fresh(&self) -> bool {
        self.used == 0
    }

    /// Starts the next step: offsets from the front again. Returns the capacity the buffers
    /// should grow to, when this step ran out.
    pub(crate) fn next_step(&mut self) -> Option<usize> {
        self.used = 0;
        self.staged.clear();
        (self.wanted > self.capacity).then_some(self.wanted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_placed_front_to_back_aligned_once_per_value_and_the_next_step_starts_over() {
        let mut l = StageLayout::new(64);
        assert!(l.is_fresh());
        assert_eq!(l.place(&[1, 2, 3]), Place::New(0));
        assert_eq!(l.place(&[9; 20]), Place::New(16));
        assert_eq!(l.place(&[1, 2, 3]), Place::Again(0), "the same values are staged once");
        assert_eq!(l.place(&[7; 16]), Place::New(48));
        assert_eq!(l.place(&[5; 1]), Place::Full, "past the capacity");
        assert_eq!(l.next_step(), Some(2 * 65), "the buffers grow for the next step");
        assert!(l.is_fresh());
        assert_eq!(l.place(&[9; 20]), Place::New(0), "offsets start over");
        let mut fits = StageLayout::new(64);
        fits.place(&[1; 64]);
        assert_eq!(fits.next_step(), None);
    }
}
