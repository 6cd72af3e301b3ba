//! Rank 0's bookkeeping of the paged KV cache: which of the pool's blocks each sequence holds,
//! and which full blocks are remembered by content so a later prompt that starts the same way
//! reuses them (prefix caching, as in vLLM).
//!
//! Every rank's KV pool has `total` blocks of `block_size` tokens, addressed by the ids
//! `0..total`. The [`BlockManager`] only hands out ids; it never touches memory, and it knows
//! nothing of sequences beyond the block tables its callers pass in.
//!
//! A block is in exactly one of three states:
//! - **free**: nobody holds it and its contents are not remembered;
//! - **held**: at least one sequence holds it (a shared prefix has several holders), cached or not;
//! - **evictable**: nobody holds it, but it is cached, so a lookup may still hand it out.
//!
//! A sequence can get the free and the evictable blocks ([`BlockManager::available`]). Free ones
//! go first; when none is left the least recently released evictable block is evicted, and its
//! contents are forgotten.
//!
//! # Content hashes
//!
//! Full block `i` of a sequence is named by the chain hash `h_i = hash(h_{i-1}, tokens of block
//! i)`, with a fixed seed for `h_{-1}`, so one hash stands for the whole prefix up to the end of
//! its block. The hash is std's [`DefaultHasher`], which is deterministic within a build; it
//! never leaves rank 0, so no other rank has to agree on it. A cached block also keeps its
//! parent hash and its tokens, which a lookup compares: two different blocks with the same
//! hash can then never be confused. A wrong hit would need two different prefixes whose 64-bit
//! chain hashes agree at some earlier block and which both end in the same tokens; we accept that
//! risk.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// The parent hash of a sequence's first block.
const SEED: u64 = 0x7470_6374_6c5f_6b76;

/// Token counts of prefix-cache lookups (vLLM's `prefix_cache_queries` / `prefix_cache_hits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PrefixStats {
    /// Tokens looked up: the full blocks each lookup could have found, in tokens.
    pub(crate) queries: u64,
    /// Tokens found: the blocks each lookup returned, in tokens.
    pub(crate) hits: u64,
}

/// What the manager knows of one block.
#[derive(Clone, Copy, Debug, Default)]
struct Block {
    /// How many sequences hold it.
    refs: u32,
    /// The chain hash of its contents, once registered. A block whose hash already named
    /// another block keeps it too (so registering again is cheap) but is not cached.
    hash: Option<u64>,
    /// Whether the cache maps `hash` to this block.
    cached: bool,
    /// When it was last released while cached: its key in `evictable`.
    released_at: u64,
}

/// A cached block, under its chain hash.
#[derive(Debug)]
struct Cached {
    block: u32,
    /// The chain hash of the block before it, [`SEED`] for a first block.
    parent: u64,
    tokens: Box<[u32]>,
}

/// Which KV blocks each sequence holds, with an optional cache of full blocks by content.
///
/// All operations cost O(1) or O(log total) per block, plus hashing the tokens of the blocks
/// looked up or newly registered.
#[derive(Debug)]
pub(crate) struct BlockManager {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<Block>,
    /// Free blocks, taken from the end: initially in descending order, so lower ids go first.
    free: Vec<u32>,
    /// Evictable blocks by the tick of their release: the first one is evicted first.
    evictable: BTreeMap<u64, u32>,
    /// Cached blocks, held or evictable, by chain hash.
    cache: HashMap<u64, Cached>,
    /// Counts releases, to order `evictable`.
    tick: u64,
    stats: PrefixStats,
}

impl BlockManager {
    /// A pool of `total` free blocks of `block_size` tokens (at least 1). With
    /// `prefix_caching`, full blocks are remembered by content for reuse.
    pub(crate) fn new(total: u32, block_size: u32, prefix_caching: bool) -> Self {
        Self {
            block_size: block_size.max(1) as usize,
            prefix_caching,
            blocks: vec![Block::default(); total as usize],
            free: (0..total).rev().collect(),
            evictable: BTreeMap::new(),
            cache: HashMap::new(),
            tick: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Tokens per block.
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub(crate) fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks a sequence can get now: free ones plus cached ones nobody holds (evictable).
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks held by at least one sequence.
    pub(crate) fn used(&self) -> usize {
        self.total() - self.available()
    }

    /// Cached blocks, held or evictable.
    pub(crate) fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Token counts of the lookups so far.
    pub(crate) fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// `n` blocks, each held once, or `None` (and nothing taken) when fewer are available.
    /// Free blocks go first, lowest id first in a fresh pool; then the least recently released
    /// evictable block is evicted, which forgets its contents.
    pub(crate) fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.available() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = match self.free.pop() {
                Some(id) => id,
                None => self.evict_oldest(),
            };
            let block = &mut self.blocks[id as usize];
            debug_assert!(block.refs == 0 && !block.cached && block.hash.is_none());
            block.refs = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Drops one hold on each block (its sequence ended or was preempted). A block nobody holds
    /// any more becomes evictable if it is cached, else free.
    ///
    /// The blocks are released from the last to the first, so that when a whole block table is
    /// released its tail is evicted before its head: a later prompt is more likely to share the
    /// head, and a cached tail is useless without its head.
    ///
    /// Releasing a block nobody holds is a bug: it fails a debug assertion and is otherwise
    /// ignored.
    pub(crate) fn release(&mut self, blocks: &[u32]) {
        for &id in blocks.iter().rev() {
            let Some(block) = self.blocks.get_mut(id as usize) else {
                debug_assert!(false, "released block {id} of a pool of {}", self.blocks.len());
                continue;
            };
            if block.refs == 0 {
                debug_assert!(false, "released block {id}, which nobody holds");
                continue;
            }
            block.refs -= 1;
            if block.refs > 0 {
                continue;
            }
            if block.cached {
                self.tick += 1;
                block.released_at = self.tick;
                self.evictable.insert(self.tick, id);
            } else {
                block.hash = None;
                self.free.push(id);
            }
        }
    }

    /// The longest run of cached blocks, at most `max_blocks`, that holds the start of `tokens`,
    /// each held once more by the caller (an evictable one stops being evictable). Only full
    /// blocks count, and the run stops at the first block not cached.
    ///
    /// Adds the full blocks it could have found (at most `max_blocks`) to the queries of
    /// [`Self::stats`] and those it found to the hits, both in tokens. Without prefix caching it
    /// finds nothing and counts nothing.
    pub(crate) fn lookup(&mut self, tokens: &[u32], max_blocks: usize) -> Vec<u32> {
        if !self.prefix_caching {
            return Vec::new();
        }
        let bs = self.block_size;
        let wanted = max_blocks.min(tokens.len() / bs);
        let mut found = Vec::new();
        let mut parent = SEED;
        for chunk in tokens.chunks_exact(bs).take(wanted) {
            let hash = chain_hash(parent, chunk);
            match self.cache.get(&hash) {
                Some(c) if c.parent == parent && *c.tokens == *chunk => found.push(c.block),
                _ => break,
            }
            parent = hash;
        }
        for &id in &found {
            let block = &mut self.blocks[id as usize];
            if block.refs == 0 {
                self.evictable.remove(&block.released_at);
            }
            block.refs += 1;
        }
        self.stats.queries += (wanted * bs) as u64;
        self.stats.hits += (found.len() * bs) as u64;
        found
    }

    /// Remembers the full blocks of a sequence by content: `blocks` is its block table,
    /// `tokens` the tokens whose keys and values those blocks hold, from position 0. Each full
    /// block not registered yet is cached under its chain hash, unless that hash already names
    /// another block: then the existing block stays cached and this one does not.
    ///
    /// Blocks registered before are skipped without hashing, so calling this after every step
    /// costs little. It trusts the caller: a block keeps the hash of the tokens it was first
    /// registered with. Without prefix caching it does nothing.
    pub(crate) fn register(&mut self, blocks: &[u32], tokens: &[u32]) {
        if !self.prefix_caching {
            return;
        }
        let mut parent = SEED;
        for (&id, chunk) in blocks.iter().zip(tokens.chunks_exact(self.block_size)) {
            let Some(block) = self.blocks.get_mut(id as usize) else {
                debug_assert!(false, "registered block {id} of a pool of {}", self.blocks.len());
                return;
            };
            if let Some(hash) = block.hash {
                parent = hash;
                continue;
            }
            if block.refs == 0 {
                // Caching it would make a free block evictable behind the free list's back.
                debug_assert!(false, "registered block {id}, which nobody holds");
                return;
            }
            let hash = chain_hash(parent, chunk);
            block.hash = Some(hash);
            if let Entry::Vacant(entry) = self.cache.entry(hash) {
                entry.insert(Cached { block: id, parent, tokens: chunk.into() });
                block.cached = true;
            }
            parent = hash;
        }
    }

    /// Forgets every cached block, because their contents are gone (a sleep discarded the KV
    /// cache): evictable blocks become free, held ones stay held but are no longer cached. A
    /// held block can be registered again once its contents are recomputed.
    pub(crate) fn forget_cached(&mut self) {
        self.cache.clear();
        for block in &mut self.blocks {
            block.hash = None;
            block.cached = false;
        }
        // The most recently released go first into the stack, so the oldest are taken first.
        let evictable = std::mem::take(&mut self.evictable);
        self.free.extend(evictable.into_values().rev());
    }

    /// Takes the least recently released evictable block and forgets its contents.
    ///
    /// Only called when the free list is empty and a block is available, so one is evictable.
    fn evict_oldest(&mut self) -> u32 {
        let (_, id) = self.evictable.pop_first().expect("an evictable block when none is free");
        let block = &mut self.blocks[id as usize];
        if let Some(hash) = block.hash.take() {
            self.cache.remove(&hash);
        }
        block.cached = false;
        id
    }
}

/// The chain hash of a block with these tokens after the block whose hash is `parent`.
fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut hasher = DefaultHasher::new();
    parent.hash(&mut hasher);
    tokens.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens `start..start + n`.
    fn run(start: u32, n: u32) -> Vec<u32> {
        (start..start + n).collect()
    }

    /// A manager with prefix caching and blocks of 4 tokens.
    fn cache(total: u32) -> BlockManager {
        BlockManager::new(total, 4, true)
    }

    #[test]
    fn new_clamps_the_block_size_and_accepts_an_empty_pool() {
        let mut m = BlockManager::new(0, 0, true);
        assert_eq!((m.block_size(), m.total(), m.available(), m.used()), (1, 0, 0, 0));
        assert_eq!(m.allocate(0), Some(vec![]));
        assert_eq!(m.allocate(1), None);
    }

    #[test]
    fn allocate_is_all_or_nothing_lowest_ids_first() {
        let mut m = cache(5);
        assert_eq!(m.allocate(3), Some(vec![0, 1, 2]));
        assert_eq!(m.allocate(3), None);
        assert_eq!((m.used(), m.available()), (3, 2));
        assert_eq!(m.allocate(2), Some(vec![3, 4]));
        assert_eq!((m.used(), m.available()), (5, 0));
        assert_eq!(m.allocate(1), None);
    }

    #[test]
    fn release_returns_blocks() {
        let mut m = cache(4);
        let a = m.allocate(3).unwrap();
        m.release(&a);
        assert_eq!((m.used(), m.available()), (0, 4));
        let mut b = m.allocate(4).unwrap();
        b.sort_unstable();
        assert_eq!(b, [0, 1, 2, 3]);
    }

    #[test]
    fn a_shared_block_stays_used_until_its_last_holder_releases_it() {
        let mut m = cache(4);
        let tokens = run(0, 8);
        let a = m.allocate(2).unwrap();
        m.register(&a, &tokens);
        let b = m.lookup(&tokens, 2);
        assert_eq!(b, a);
        assert_eq!(m.used(), 2);
        m.release(&a);
        assert_eq!((m.used(), m.available()), (2, 2));
        // Still held by `b`: the two free blocks are all a sequence can get.
        assert_eq!(m.allocate(3), None);
        m.release(&b);
        assert_eq!((m.used(), m.available(), m.cached()), (0, 4, 2));
    }

    #[test]
    fn lookup_finds_the_longest_cached_prefix_of_full_blocks() {
        let mut m = cache(8);
        // Three full blocks and a partial one.
        let tokens = run(0, 14);
        let table = m.allocate(4).unwrap();
        m.register(&table, &tokens);
        assert_eq!(m.cached(), 3);
        m.release(&table);

        // The partial block is not cached, even for the same tokens.
        assert_eq!(m.lookup(&tokens, 10), table[..3]);
        assert_eq!(m.stats(), PrefixStats { queries: 12, hits: 12 });
        // At most `max_blocks`.
        assert_eq!(m.lookup(&tokens, 2), table[..2]);
        assert_eq!(m.stats(), PrefixStats { queries: 20, hits: 20 });
        // Only full blocks of the query count: 7 tokens are one block.
        assert_eq!(m.lookup(&tokens[..7], 10), table[..1]);
        assert_eq!(m.stats(), PrefixStats { queries: 24, hits: 24 });
        // Stops at the first miss: block 1 differs, block 2 is the same as cached.
        let mut other = tokens.clone();
        other[5] = 99;
        assert_eq!(m.lookup(&other, 10), table[..1]);
        assert_eq!(m.stats(), PrefixStats { queries: 36, hits: 28 });
        // Nothing of a short prompt is a full block.
        assert!(m.lookup(&tokens[..3], 10).is_empty());
        assert_eq!(m.stats(), PrefixStats { queries: 36, hits: 28 });
    }

    #[test]
    fn a_different_first_block_changes_every_later_hash() {
        let mut m = cache(8);
        let tokens = run(0, 8);
        let table = m.allocate(2).unwrap();
        m.register(&table, &tokens);
        m.release(&table);

        let mut other = tokens.clone();
        other[0] = 99;
        assert!(m.lookup(&other, 2).is_empty());
        assert_eq!(m.stats(), PrefixStats { queries: 8, hits: 0 });
        // Registering it caches both of its blocks besides the first sequence's.
        let b = m.allocate(2).unwrap();
        m.register(&b, &other);
        assert_eq!(m.cached(), 4);
    }

    #[test]
    fn a_hash_collision_is_not_a_hit() {
        let mut m = cache(4);
        let (x, y) = (run(0, 4), run(100, 4));
        let a = m.allocate(1).unwrap();
        m.register(&a, &x);
        // Pretend `x` hashes like `y`: the block is cached under `y`'s hash.
        let c = m.cache.remove(&chain_hash(SEED, &x)).unwrap();
        let collision = chain_hash(SEED, &y);
        m.cache.insert(collision, c);
        m.blocks[a[0] as usize].hash = Some(collision);
        assert!(m.lookup(&y, 1).is_empty());
        assert_eq!(m.stats(), PrefixStats { queries: 4, hits: 0 });
    }

    #[test]
    fn lookup_takes_a_hold_on_evictable_blocks() {
        let mut m = cache(3);
        let tokens = run(0, 8);
        let table = m.allocate(2).unwrap();
        m.register(&table, &tokens);
        m.release(&table);
        assert_eq!(m.available(), 3);
        let found = m.lookup(&tokens, 2);
        assert_eq!(found, table);
        assert_eq!((m.used(), m.available()), (2, 1));
        // Not evictable any more: only the free block can be allocated.
        assert_eq!(m.allocate(2), None);
        assert_eq!(m.allocate(1), Some(vec![2]));
    }

    #[test]
    fn register_keeps_the_first_block_for_a_hash() {
        let mut m = cache(4);
        let tokens = run(0, 4);
        let a = m.allocate(1).unwrap();
        let b = m.allocate(1).unwrap();
        m.register(&a, &tokens);
        m.register(&b, &tokens);
        assert_eq!(m.cached(), 1);
        assert_eq!(m.lookup(&tokens, 1), a);
        // The duplicate was not cached: released, it is free, not evictable.
        m.release(&b);
        assert_eq!(m.free, [3, 2, 1]);
        assert!(m.evictable.is_empty());
    }

    #[test]
    fn register_is_idempotent_and_extends_a_growing_sequence() {
        let mut m = cache(4);
        let mut tokens = run(0, 6);
        let table = m.allocate(2).unwrap();
        m.register(&table, &tokens);
        m.register(&table, &tokens);
        assert_eq!(m.cached(), 1);
        tokens.extend(run(6, 2));
        m.register(&table, &tokens);
        m.register(&table, &tokens);
        assert_eq!(m.cached(), 2);
        assert_eq!(m.lookup(&tokens, 2), table);
    }

    #[test]
    fn eviction_takes_free_blocks_first_then_the_least_recently_released() {
        let mut m = cache(6);
        let (x, y) = (run(0, 8), run(100, 8));
        let a = m.allocate(2).unwrap();
        let b = m.allocate(2).unwrap();
        m.register(&a, &x);
        m.register(&b, &y);
        m.release(&a);
        m.release(&b);
        assert_eq!((m.available(), m.cached()), (6, 4));

        // The two never-cached blocks go first.
        let mut c = m.allocate(2).unwrap();
        c.sort_unstable();
        assert_eq!(c, [4, 5]);
        assert_eq!(m.cached(), 4);
        // Then `a`, released first, tail before head.
        assert_eq!(m.allocate(1), Some(vec![a[1]]));
        assert_eq!(m.cached(), 3);
        assert_eq!(m.lookup(&x, 2), a[..1]);
        assert_eq!(m.allocate(1), Some(vec![b[1]]));
        // Forgotten: `y`'s second block misses now.
        assert_eq!(m.lookup(&y, 2), b[..1]);
        assert_eq!(m.cached(), 2);
        assert_eq!(m.available(), 0);
    }

    #[test]
    fn an_evicted_head_makes_the_rest_of_its_sequence_unreachable() {
        let mut m = cache(2);
        let tokens = run(0, 8);
        let table = m.allocate(2).unwrap();
        m.register(&table, &tokens);
        // Released separately, the head first: the head is evicted first.
        m.release(&table[..1]);
        m.release(&table[1..]);
        assert_eq!(m.allocate(1), Some(vec![table[0]]));
        assert!(m.lookup(&tokens, 2).is_empty());
        assert_eq!(m.cached(), 1);
    }

    #[test]
    fn forget_cached_frees_evictable_blocks_and_uncaches_held_ones() {
        let mut m = cache(4);
        let (x, y) = (run(0, 4), run(100, 4));
        let a = m.allocate(1).unwrap();
        let b = m.allocate(1).unwrap();
        m.register(&a, &x);
        m.register(&b, &y);
        m.release(&a);
        m.forget_cached();
        assert_eq!((m.cached(), m.used(), m.available()), (0, 1, 3));
        assert!(m.lookup(&x, 1).is_empty());
        assert!(m.lookup(&y, 1).is_empty());
        // Released now, the held block is free, not evictable.
        m.release(&b);
        assert!(m.evictable.is_empty());
        // Its contents recomputed, a block can be registered again.
        let c = m.allocate(1).unwrap();
        m.register(&c, &x);
        assert_eq!(m.cached(), 1);
    }

    #[test]
    fn without_prefix_caching_nothing_is_cached() {
        let mut m = BlockManager::new(4, 4, false);
        let tokens = run(0, 8);
        let table = m.allocate(2).unwrap();
        m.register(&table, &tokens);
        assert_eq!(m.cached(), 0);
        m.release(&table);
        assert!(m.evictable.is_empty());
        assert!(m.lookup(&tokens, 2).is_empty());
        assert_eq!(m.stats(), PrefixStats::default());
    }

    /// xorshift64*: deterministic, so a failure reproduces.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// A number in `0..n`.
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// A sequence of the model: its block table and the tokens its blocks hold.
    struct Seq {
        table: Vec<u32>,
        tokens: Vec<u32>,
    }

    /// Checks the manager's state against itself and against the sequences holding blocks.
    fn check(m: &BlockManager, seqs: &[Seq]) {
        let mut refs = vec![0u32; m.total()];
        for seq in seqs {
            for &b in &seq.table {
                refs[b as usize] += 1;
            }
        }
        let held = refs.iter().filter(|&&r| r > 0).count();
        assert_eq!(m.used() + m.available(), m.total());
        assert_eq!(m.used(), held);
        let mut seen = vec![false; m.total()];
        for (i, block) in m.blocks.iter().enumerate() {
            assert_eq!(block.refs, refs[i], "refs of block {i}");
            let cached =
                block.hash.and_then(|h| m.cache.get(&h)).is_some_and(|c| c.block as usize == i);
            assert_eq!(block.cached, cached, "block {i}: {block:?}");
        }
        for &b in &m.free {
            let block = &m.blocks[b as usize];
            assert!(!std::mem::replace(&mut seen[b as usize], true), "block {b} listed twice");
            assert!(block.refs == 0 && !block.cached, "free block {b}: {block:?}");
        }
        for (&tick, &b) in &m.evictable {
            let block = &m.blocks[b as usize];
            assert!(!std::mem::replace(&mut seen[b as usize], true), "block {b} listed twice");
            assert!(block.refs == 0 && block.cached && block.released_at == tick, "{block:?}");
        }
        for (i, block) in m.blocks.iter().enumerate() {
            assert_eq!(seen[i], block.refs == 0, "block {i} is neither held nor available");
        }
        for (&hash, c) in &m.cache {
            assert_eq!(m.blocks[c.block as usize].hash, Some(hash));
        }
    }

    #[test]
    fn random_operations_keep_the_invariants() {
        const TOTAL: u32 = 24;
        const BS: usize = 3;
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut m = BlockManager::new(TOTAL, BS as u32, true);
        let mut seqs: Vec<Seq> = Vec::new();
        // The prefix each block ends, as far as the model knows: set when its sequence
        // registers it, cleared when it is allocated afresh.
        let mut content: Vec<Option<Vec<u32>>> = vec![None; TOTAL as usize];
        // Prompts start with one of a few prefixes and use few token values, so they share
        // blocks often.
        let prefixes: [Vec<u32>; 3] = [run(0, 10), run(50, 7), vec![1; 12]];
        let mut expected = PrefixStats::default();
        for step in 0..5000 {
            match rng.below(10) {
                // A new sequence: look up its prompt, allocate the rest, register.
                0..=3 => {
                    let mut tokens = prefixes[rng.below(3)].clone();
                    tokens.truncate(rng.below(tokens.len() + 1));
                    for _ in 0..rng.below(8) {
                        tokens.push(rng.below(3) as u32);
                    }
                    let max_blocks = rng.below(6);
                    let found = m.lookup(&tokens, max_blocks);
                    expected.queries += (max_blocks.min(tokens.len() / BS) * BS) as u64;
                    expected.hits += (found.len() * BS) as u64;
                    assert_eq!(m.stats(), expected, "step {step}");
                    for (i, &b) in found.iter().enumerate() {
                        let prefix = &tokens[..(i + 1) * BS];
                        assert_eq!(content[b as usize].as_deref(), Some(prefix), "step {step}");
                    }
                    let need = tokens.len().div_ceil(BS).saturating_sub(found.len());
                    match m.allocate(need) {
                        Some(fresh) => {
                            for &b in &fresh {
                                content[b as usize] = None;
                            }
                            let mut table = found;
                            table.extend(fresh);
                            seqs.push(Seq { table, tokens });
                        }
                        None => {
                            assert!(need > m.available());
                            m.release(&found);
                        }
                    }
                }
                // A decode step: one more token, a new block when the last one is full.
                4..=5 if !seqs.is_empty() => {
                    let i = rng.below(seqs.len());
                    let seq = &mut seqs[i];
                    if seq.tokens.len() == seq.table.len() * BS {
                        match m.allocate(1) {
                            Some(fresh) => {
                                content[fresh[0] as usize] = None;
                                seq.table.extend(fresh);
                            }
                            None => continue,
                        }
                    }
                    seq.tokens.push(rng.below(3) as u32);
                }
                // Registering a sequence, maybe again.
                6..=7 if !seqs.is_empty() => {
                    let seq = &seqs[rng.below(seqs.len())];
                    m.register(&seq.table, &seq.tokens);
                    for (i, &b) in seq.table.iter().enumerate().take(seq.tokens.len() / BS) {
                        let prefix = seq.tokens[..(i + 1) * BS].to_vec();
                        let old = content[b as usize].replace(prefix.clone());
                        assert!(old.is_none_or(|old| old == prefix), "step {step}");
                    }
                }
                // A sequence ends.
                8 if !seqs.is_empty() => {
                    let seq = seqs.swap_remove(rng.below(seqs.len()));
                    m.release(&seq.table);
                }
                // Rarely, the KV cache is discarded.
                9 if rng.below(20) == 0 => m.forget_cached(),
                _ => {}
            }
            check(&m, &seqs);
        }
        assert!(expected.hits > 0 && expected.hits < expected.queries, "{expected:?}");
    }
}
