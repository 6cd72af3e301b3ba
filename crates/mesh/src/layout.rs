//! Mesh arithmetic every rank computes on its own and must get identical: the TP x CP shape,
//! rank coordinates, the process groups and the split of tokens across CP ranks.
//!
//! A disagreement between ranks here is not an error anybody sees but a hang, so every function
//! is pure, and groups are listed in the same order on every rank.

use std::ops::Range;

use crate::error::{Error, Result};

/// Splits `0..total` into `parts` contiguous ranges whose sizes differ by at most one, the
/// larger ones first: 10 over 3 gives `0..4, 4..7, 7..10`.
///
/// With more parts than items the last ranges are empty; with `parts == 0` the result is empty.
pub fn balanced_ranges(total: usize, parts: usize) -> Vec<Range<usize>> {
    if parts == 0 {
        return Vec::new();
    }
    let (base, extra) = (total / parts, total % parts);
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// Greatest common divisor; `gcd(n, 0) == n`.
fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Chooses the TP and CP sizes of a world of `world` ranks for a model with `head_groups` KV
/// head groups. Without `tp`, TP is as wide as both allow: `gcd(world, head_groups)`; the rest
/// of the world is CP.
///
/// # Errors
/// [`Error::InvalidMesh`] when `world`, `tp` or `head_groups` is zero, when `tp` does not divide
/// `world` (the mesh would not be rectangular) and when `tp` exceeds `head_groups` (a head group
/// cannot be split across ranks).
pub fn plan_mesh(world: usize, tp: Option<usize>, head_groups: usize) -> Result<MeshShape> {
    if world == 0 {
        return Err(Error::mesh("world size must be at least 1"));
    }
    if head_groups == 0 {
        return Err(Error::mesh("the model has 0 kv head groups: nothing to split across tp"));
    }
    let tp = tp.unwrap_or_else(|| gcd(world, head_groups));
    if tp == 0 {
        return Err(Error::mesh("tp=0: the tensor-parallel size must be at least 1"));
    }
    if !world.is_multiple_of(tp) {
        return Err(Error::mesh(format!("tp={tp} does not divide world size {world}")));
    }
    if tp > head_groups {
        return Err(Error::mesh(format!(
            "tp={tp} exceeds the {head_groups} kv head groups of the model: a head group cannot be split"
        )));
    }
    DeviceMesh::new(tp, world / tp)
}

/// The shape [`plan_mesh`] chooses: a [`DeviceMesh`].
pub type MeshShape = DeviceMesh;

/// A `tp x cp` grid of ranks with TP innermost: `rank = cp_rank * tp + tp_rank`, so the ranks
/// of one TP group are consecutive (and, with consecutive local ranks, on one host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceMesh {
    tp: usize,
    cp: usize,
}

impl DeviceMesh {
    /// A mesh of `tp` tensor-parallel by `cp` context-parallel ranks.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when either size is zero.
    pub fn new(tp: usize, cp: usize) -> Result<DeviceMesh> {
        if tp == 0 || cp == 0 {
            return Err(Error::mesh(format!(
                "mesh tp={tp} x cp={cp}: both sizes must be at least 1"
            )));
        }
        Ok(DeviceMesh { tp, cp })
    }

    /// Ranks per TP group.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// Ranks per CP group.
    pub fn cp(&self) -> usize {
        self.cp
    }

    /// Ranks in the mesh, `tp * cp`.
    pub fn world(&self) -> usize {
        self.tp * self.cp
    }

    /// `(tp_rank, cp_rank)` of `rank`.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when `rank` is not in the mesh.
    pub fn coords(&self, rank: usize) -> Result<(usize, usize)> {
        if rank >= self.world() {
            return Err(Error::mesh(format!("rank {rank} is outside the mesh {self}")));
        }
        Ok((rank % self.tp, rank / self.tp))
    }

    /// The rank at `(tp_rank, cp_rank)`.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when a coordinate is out of range.
    pub fn rank_of(&self, tp_rank: usize, cp_rank: usize) -> Result<usize> {
        self.check_tp_rank(tp_rank)?;
        self.check_cp_rank(cp_rank)?;
        Ok(cp_rank * self.tp + tp_rank)
    }

    /// The TP group of row `cp_rank`: the ranks that share its tokens and split its heads,
    /// ordered by TP rank.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when `cp_rank` is out of range.
    pub fn tp_group(&self, cp_rank: usize) -> Result<Vec<usize>> {
        self.check_cp_rank(cp_rank)?;
        Ok((0..self.tp).map(|t| cp_rank * self.tp + t).collect())
    }

    /// The CP group of column `tp_rank`: the ranks that hold the same heads and split the
    /// tokens, ordered by CP rank.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when `tp_rank` is out of range.
    pub fn cp_group(&self, tp_rank: usize) -> Result<Vec<usize>> {
        self.check_tp_rank(tp_rank)?;
        Ok((0..self.cp).map(|c| c * self.tp + tp_rank).collect())
    }

    /// The TP group `rank` belongs to.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when `rank` is not in the mesh.
    pub fn tp_group_of(&self, rank: usize) -> Result<Vec<usize>> {
        self.tp_group(self.coords(rank)?.1)
    }

    /// The CP group `rank` belongs to.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when `rank` is not in the mesh.
    pub fn cp_group_of(&self, rank: usize) -> Result<Vec<usize>> {
        self.cp_group(self.coords(rank)?.0)
    }

    /// Every TP group, by CP rank: the same list on every rank, so groups can be created in the
    /// same order everywhere.
    pub fn tp_groups(&self) -> Vec<Vec<usize>> {
        (0..self.cp).map(|c| (0..self.tp).map(|t| c * self.tp + t).collect()).collect()
    }

    /// Every CP group, by TP rank.
    pub fn cp_groups(&self) -> Vec<Vec<usize>> {
        (0..self.tp).map(|t| (0..self.cp).map(|c| c * self.tp + t).collect()).collect()
    }

    fn check_tp_rank(&self, tp_rank: usize) -> Result<()> {
        if tp_rank >= self.tp {
            return Err(Error::mesh(format!("tp rank {tp_rank} is outside the mesh {self}")));
        }
        Ok(())
    }

    fn check_cp_rank(&self, cp_rank: usize) -> Result<()> {
        if cp_rank >= self.cp {
            return Err(Error::mesh(format!("cp rank {cp_rank} is outside the mesh {self}")));
        }
        Ok(())
    }
}

impl std::fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp={} x cp={}", self.tp, self.cp)
    }
}

/// The split of a sequence's tokens across the CP ranks, seen from one of them: contiguous,
/// balanced ranges (uneven when the count does not divide), every rank at least one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenShard {
    ranges: Vec<Range<usize>>,
    rank: usize,
}

impl TokenShard {
    /// Splits `tokens` across `cp_size` ranks, seen from `cp_rank`.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when `cp_size` is zero, `cp_rank` is not below it, or there are
    /// more CP ranks than tokens (a rank without tokens has no keys to attend to).
    pub fn new(tokens: usize, cp_size: usize, cp_rank: usize) -> Result<TokenShard> {
        if cp_size == 0 {
            return Err(Error::mesh("token shard: cp size must be at least 1"));
        }
        if cp_rank >= cp_size {
            return Err(Error::mesh(format!(
                "token shard: cp rank {cp_rank} is not below the cp size {cp_size}"
            )));
        }
        if cp_size > tokens {
            return Err(Error::mesh(format!(
                "{cp_size} cp ranks for {tokens} tokens: every cp rank needs at least one token"
            )));
        }
        Ok(TokenShard { ranges: balanced_ranges(tokens, cp_size), rank: cp_rank })
    }

    /// This rank's tokens.
    pub fn local(&self) -> Range<usize> {
        self.ranges[self.rank].clone()
    }

    /// Every rank's tokens, by CP rank.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// This shard's CP rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Every rank's token count, by CP rank (the counts of an uneven all-gather).
    pub fn sizes(&self) -> Vec<usize> {
        self.ranges.iter().map(ExactSizeIterator::len).collect()
    }

    /// Tokens in the whole sequence.
    pub fn total(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }

    /// This rank's part of `all`, one item per token of the sequence.
    ///
    /// # Errors
    /// [`Error::InvalidMesh`] when `all` does not have one item per token.
    pub fn select<'a, T>(&self, all: &'a [T]) -> Result<&'a [T]> {
        if all.len() != self.total() {
            return Err(Error::mesh(format!(
                "token shard: {} items given for a sequence of {} tokens",
                all.len(),
                self.total()
            )));
        }
        Ok(&all[self.local()])
    }
}

#[cfg(test)]
mod tests;
