//! Where a rank sits in the mesh and the communicators it uses, and which share of the model
//! a TP rank holds: its attention heads, its MLP units, the bytes of its KV blocks.

use super::aligned_ranges;
use crate::error::{Error, Result};
use crate::model::{KvGroups, KvPool};
use checkpoint::config::LlamaConfig;
use collectives::Communicator;
use std::ops::Range;
use tensor::kernels::KvElem;

/// The communicators a rank's forward pass uses.
pub struct Comms<'a> {
    /// Tensor-parallel group (this rank's row of the mesh).
    pub tp: &'a mut dyn Communicator,
    /// Context-parallel group (this rank's column).
    pub cp: &'a mut dyn Communicator,
}

/// Where a rank sits in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Rank in the TP group.
    pub tp_rank: usize,
    /// TP group size.
    pub tp: usize,
    /// Rank in the CP group.
    pub cp_rank: usize,
    /// CP group size.
    pub cp: usize,
}

impl Placement {
    /// The placement of the owner of `comms`.
    pub fn of(comms: &Comms<'_>) -> Placement {
        Placement {
            tp_rank: comms.tp.rank(),
            tp: comms.tp.size(),
            cp_rank: comms.cp.rank(),
            cp: comms.cp.size(),
        }
    }

    /// A single rank.
    pub fn single() -> Placement {
        Placement { tp_rank: 0, tp: 1, cp_rank: 0, cp: 1 }
    }
}

/// The attention heads one TP rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadShard {
    /// KV heads: whole heads, or a single head that other ranks hold too.
    pub kv: Range<usize>,
    /// Query heads: the groups of `kv`, or a share of the single KV head's group.
    pub q: Range<usize>,
}

/// The heads TP rank `rank` of `tp` holds.
///
/// With at most as many ranks as KV heads, each rank holds whole KV heads, balanced
/// (`balanced_ranges` over the KV heads, so 9 query heads in 3 KV groups on TP=2 split
/// 6 + 3), and their query heads. With more ranks than KV heads, `tp / n_kv_heads`
/// consecutive ranks share each KV head: each holds that head's keys and values (the K/V
/// projections and the cache are replicated) and a balanced share of its query heads.
///
/// # Errors
/// [`tensor::Error::Shape`] when `rank` is not below `tp`, when `tp` exceeds the KV heads without
/// being a multiple of them, or when more ranks share a KV head than it has query heads.
pub fn head_shard(cfg: &LlamaConfig, rank: usize, tp: usize) -> Result<HeadShard> {
    let (n_kv, g) = (cfg.n_kv_heads, cfg.group_size());
    if rank >= tp || n_kv == 0 {
        return Err(Error::shape(
            "tensor parallel attention",
            format!("tp rank {rank} of tp={tp} over {n_kv} KV heads"),
        ));
    }
    if tp <= n_kv {
        let kv = mesh::balanced_ranges(n_kv, tp)[rank].clone();
        return Ok(HeadShard { q: kv.start * g..kv.end * g, kv });
    }
    if !tp.is_multiple_of(n_kv) {
        return Err(Error::shape(
            "tensor parallel attention",
            format!(
                "tp={tp} exceeds the model's {n_kv} KV heads and is not a multiple of them; \
                 with more ranks than KV heads every KV head must be shared by the same number \
                 of ranks (use tp <= {n_kv} or a multiple of {n_kv})"
            ),
        ));
    }
    let sharing = tp / n_kv;
    if sharing > g {
        return Err(Error::shape(
            "tensor parallel attention",
            format!(
                "tp={tp} puts {sharing} ranks on each of the model's {n_kv} KV heads, more than \
                 the {g} query heads of a KV head (use tp <= {})",
                cfg.n_heads
            ),
        ));
    }
    let head = rank / sharing;
    let share = mesh::balanced_ranges(g, sharing)[rank % sharing].clone();
    Ok(HeadShard { kv: head..head + 1, q: head * g + share.start..head * g + share.end })
}

/// The KV heads TP rank `rank` of `tp` holds (see [`head_shard`]): whole KV heads, balanced,
/// or the one KV head it shares with other ranks when ranks outnumber KV heads.
///
/// # Errors
/// As [`head_shard`].
pub fn kv_head_range(cfg: &LlamaConfig, rank: usize, tp: usize) -> Result<Range<usize>> {
    Ok(head_shard(cfg, rank, tp)?.kv)
}

/// Bytes of one KV block of `block_size` tokens of one group of layers ([`KvGroups::of`])
/// stored as `elem` on the TP rank holding the most KV heads: a pool sized in bytes holds this
/// many fewer blocks, the same count on every rank (see [`KvPool`]).
///
/// # Errors
/// As [`head_shard`].
pub fn kv_block_bytes(
    cfg: &LlamaConfig,
    tp: usize,
    block_size: usize,
    elem: KvElem,
) -> Result<usize> {
    let mut most = 0;
    for rank in 0..tp.max(1) {
        most = most.max(kv_head_range(cfg, rank, tp.max(1))?.len());
    }
    let slots = KvGroups::of(cfg).slots();
    Ok(KvPool::bytes(elem, slots, most, cfg.head_dim, block_size, 1))
}

/// The `head_groups` to give `mesh::plan_mesh` (and `InitOptions::head_groups`) for this
/// model and a requested TP size. With `tp` unset, the KV heads, so the automatic choice
/// `gcd(world, n_kv_heads)` keeps whole KV heads per rank; with `tp` set, the query heads, so
/// a TP size above the KV heads reaches [`head_shard`], which checks it: a multiple of the KV
/// heads, at most the query heads (see [`check_tp`]).
pub fn mesh_head_groups(cfg: &LlamaConfig, tp: Option<usize>) -> usize {
    match tp {
        None => cfg.n_kv_heads,
        Some(_) => cfg.n_heads,
    }
}

/// Checks that attention can be split over `tp` ranks (see [`head_shard`]), before any rank
/// starts.
///
/// # Errors
/// As [`head_shard`], naming `tp` and the model's KV heads.
pub fn check_tp(cfg: &LlamaConfig, tp: usize) -> Result<()> {
    if tp == 0 {
        return Err(Error::shape("tensor parallel attention", "tp=0: at least one rank is needed"));
    }
    (0..tp).try_for_each(|rank| head_shard(cfg, rank, tp).map(drop))
}

/// Inner MLP units of TP rank `rank`: balanced, in multiples of 32 (a quantized block) when
/// the width allows.
pub fn ffn_range(cfg: &LlamaConfig, rank: usize, tp: usize) -> Range<usize> {
    aligned_ranges(cfg.ffn, tp, 32)[rank].clone()
}
