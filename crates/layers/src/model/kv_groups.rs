//! How a paged KV pool's blocks are shared by a model's layers (vLLM's KV cache groups, from
//! its hybrid allocator): layers that see the same tokens form groups of equal size, a block
//! holds `block_size` tokens of one group's layers, and a sequence has one block table per
//! group. A group of sliding-window layers (Gemma 2 and 3) needs only the blocks that hold its
//! last `window` tokens, so the blocks before them can go back to the pool as the sequence
//! advances ([`window_dead_blocks`]) while the global groups keep every token.
//!
//! A model without a window has one group of all its layers: its blocks are laid out as they
//! always were (block `b`'s layer `l` at `b · layers + l`).

use checkpoint::LlamaConfig;

/// The groups of a pool's layers: how many layers a block holds, where each layer lives, and
/// each group's window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroups {
    /// Layers a block holds (the largest group; a smaller one leaves slots unused).
    slots: usize,
    /// `(group, slot)` of each layer.
    place: Vec<(usize, usize)>,
    /// The window of each group's layers (`None`: global); the global groups come first.
    windows: Vec<Option<usize>>,
}

impl KvGroups {
    /// One group of `layers` layers, none windowed: every block holds every layer.
    pub fn single(layers: usize) -> Self {
        KvGroups {
            slots: layers,
            place: (0..layers).map(|l| (0, l)).collect(),
            windows: vec![None],
        }
    }

    /// The groups of a model whose layer `l` has window `windows[l]` (`None`: global).
    ///
    /// Layers of the same window (global first, then by window size) are cut, in layer order,
    /// into groups of as many layers as the rarest kind has, as vLLM's hybrid allocator does:
    /// Gemma 2's alternate layers make two groups of half the layers; a Gemma 3 of 26 layers
    /// (4 global) one global group of 4 and six windowed ones, the last with 2 of its 4 slots
    /// used. With one kind of layer it is one group.
    pub fn from_windows(windows: &[Option<usize>]) -> Self {
        let mut kinds: Vec<Option<usize>> = windows.to_vec();
        kinds.sort_unstable();
        kinds.dedup();
        if kinds.len() <= 1 {
            let mut g = KvGroups::single(windows.len());
            g.windows = vec![kinds.first().copied().flatten()];
            return g;
        }
        let count = |k: Option<usize>| windows.iter().filter(|&&w| w == k).count();
        let slots = kinds.iter().map(|&k| count(k)).min().unwrap_or(1).max(1);
        let mut place = vec![(0, 0); windows.len()];
        let mut groups = Vec::new();
        for &kind in &kinds {
            let layers = windows.iter().enumerate().filter(|(_, &w)| w == kind).map(|(l, _)| l);
            for (i, l) in layers.enumerate() {
                if i % slots == 0 {
                    groups.push(kind);
                }
                place[l] = (groups.len() - 1, i % slots);
            }
        }
        KvGroups { slots, place, windows: groups }
    }

    /// The groups of `config`'s layers (one group without a sliding window).
    pub fn of(config: &LlamaConfig) -> Self {
        let windows: Vec<Option<usize>> = (0..config.n_layers)
            .map(|l| config.sliding_window.filter(|w| w.slides(l)).map(|w| w.tokens))
            .collect();
        Self::from_windows(&windows)
    }

    /// Layers a block holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Layers of the model.
    pub fn layers(&self) -> usize {
        self.place.len()
    }

    /// Groups: block ids a sequence gets per `block_size` tokens.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// Whether there are no groups (never: a model without layers has one empty group).
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// The `(group, slot)` of layer `layer`.
    pub fn place(&self, layer: usize) -> Option<(usize, usize)> {
        self.place.get(layer).copied()
    }

    /// The window of each group (`None`: global), global groups first.
    pub fn windows(&self) -> &[Option<usize>] {
        &self.windows
    }
}

impl From<usize> for KvGroups {
    /// [`KvGroups::single`].
    fn from(layers: usize) -> Self {
        KvGroups::single(layers)
    }
}

/// The leading blocks of a windowed group's table that no query of a sequence's next step
/// (its first at position `next`) can see on any rank, so rank 0 may give them back to the
/// pool: those whose every token lies before `next - window + 1`.
///
/// A rank's table holds its own tokens in position order. With the tokens spread over
/// `spread` CP ranks a rank holds at least `next / spread` of the `next` tokens (prefill
/// shards and extends keep the ranks within one token of each other), and its `j`-th token of
/// `held` sits at most at position `next - held + j`; so block `b` is outside the window on
/// every rank when `(b + 1) · block_size <= next / spread - window + 1`. Without CP this is
/// exact. A rank skips at least these blocks when it reads the group (see
/// [`crate::model::PagedCache`]), so a block given back is never read again.
pub fn window_dead_blocks(next: usize, spread: usize, window: usize, block_size: usize) -> usize {
    let held = next / spread.max(1);
    (held + 1).saturating_sub(window.max(1)) / block_size.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_equal_in_size_global_first() {
        let single = KvGroups::from_windows(&[None, None, None]);
        assert_eq!(single, KvGroups::single(3));
        // Gemma 2: even layers slide.
        let g2 = KvGroups::from_windows(&[Some(4), None, Some(4), None]);
        assert_eq!((g2.slots(), g2.windows()), (2, &[None, Some(4)][..]));
        assert_eq!(
            (g2.place(0), g2.place(1), g2.place(2), g2.place(3)),
            (Some((1, 0)), Some((0, 0)), Some((1, 1)), Some((0, 1)))
        );
        // Gemma 3 of 13 layers: layers 5 and 11 global, 11 windowed: groups of 2, the last
        // windowed one half used.
        let w: Vec<Option<usize>> =
            (0..13).map(|l| if l % 6 == 5 { None } else { Some(8) }).collect();
        let g3 = KvGroups::from_windows(&w);
        assert_eq!(g3.slots(), 2);
        assert_eq!(g3.windows(), &[None, Some(8), Some(8), Some(8), Some(8), Some(8), Some(8)]);
        assert_eq!(
            (g3.place(5), g3.place(11), g3.place(12)),
            (Some((0, 0)), Some((0, 1)), Some((6, 0)))
        );
        // Every layer windowed: one group with the window.
        let all = KvGroups::from_windows(&[Some(4), Some(4)]);
        assert_eq!((all.slots(), all.windows()), (2, &[Some(4)][..]));
    }

    /// Table-driven: every rank must agree, and a block is dead only when every token of it
    /// on every rank is before the window of the next query.
    #[test]
    fn dead_blocks_lie_before_the_window_on_every_rank() {
        for (next, spread, window, bs, want) in [
            (0, 1, 4, 4, 0),
            (7, 1, 4, 4, 1),  // block 0 (tokens 0..=3) is before 7 - 4 + 1 = 4
            (6, 1, 4, 4, 0),  // token 3 is still seen
            (20, 1, 4, 4, 4), // blocks 0..=3 hold tokens 0..=15 < 17
            (20, 2, 4, 4, 1), // a rank holds 10 tokens, the first 4 surely before 17
            (21, 2, 4, 4, 1),
            (100, 3, 10, 8, 3), // 33 held: 24 <= 33 - 10 + 1
        ] {
            assert_eq!(window_dead_blocks(next, spread, window, bs), want, "{next} {spread}");
        }
        // Brute force against every rank's worst case of balanced shards.
        for spread in 1..4usize {
            for next in 0..60usize {
                for window in 1..12 {
                    let dead = window_dead_blocks(next, spread, window, 4);
                    for held in next / spread..=next.div_ceil(spread) {
                        let last_of_dead = (dead * 4).checked_sub(1).map(|j| next - held + j);
                        if let Some(p) = last_of_dead {
                            assert!(dead * 4 <= held && p + window <= next, "{next} {spread}");
                        }
                    }
                }
            }
        }
    }
}
