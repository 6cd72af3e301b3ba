//! Receipts: what one release or materialize did to one tag.

use crate::tag::Tag;
use std::time::Duration;

/// Which operation a [`Receipt`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// [`crate::Manager::release`].
    Release,
    /// [`crate::Manager::materialize`].
    Materialize,
}

/// What one release or materialize did to the allocations of one tag.
///
/// A tag whose allocations were all already in the asked state gets a zero receipt
/// (`allocations == 0`, `bytes == 0`, `copied_bytes == 0`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    /// The tag.
    pub tag: Tag,
    /// The operation.
    pub op: Op,
    /// Allocations whose state changed.
    pub allocations: usize,
    /// Bytes unmapped (release) or mapped (materialize), rounded to the backend's granularity.
    pub bytes: u64,
    /// Bytes copied to a backup store (release), or restored from a backup or a reload source
    /// (materialize). Zeroing is not counted.
    pub copied_bytes: u64,
    /// Time spent on this tag's allocations.
    pub elapsed: Duration,
}

impl Receipt {
    pub(crate) fn zero(tag: Tag, op: Op) -> Receipt {
        Receipt { tag, op, allocations: 0, bytes: 0, copied_bytes: 0, elapsed: Duration::ZERO }
    }

    /// Whether this receipt records no change.
    pub fn is_noop(&self) -> bool {
        self.allocations == 0
    }
}
