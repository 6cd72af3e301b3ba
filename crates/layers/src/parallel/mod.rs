//! Tensor- and context-parallel modules and the sharded Llama-family model.
//!
//! A rank of a `tp × cp` mesh holds:
//! - attention for a range of whole KV heads (`balanced_ranges` over the KV heads, so 9 query
//!   heads in 3 KV groups on TP=2 split 6 + 3), or, with more TP ranks than KV heads, one KV
//!   head replicated on `tp / n_kv_heads` ranks that split its query heads ([`head_shard`]);
//!   the output projection row-parallel over the rank's query heads;
//! - the MLP for a range of inner units (aligned to quantized blocks), down-projection
//!   row-parallel;
//! - the embedding and LM head for a range of the vocabulary;
//! - its own tokens' keys and values, in its KV-cache shard.
//!
//! A step runs in one of two ways, the same on every rank:
//! - **Prefill** (the sequence's cache is empty and it has at least `cp` tokens): tokens are
//!   split over CP by [`TokenShard`](mesh::TokenShard); each rank projects its tokens, the
//!   keys and values are gathered over CP (`all_gather_uneven`), and each rank attends its
//!   queries to all of them with global positions, keeping only its own keys and values.
//! - **Extend** (decode, or more tokens after a prefill): every CP rank computes every new
//!   token; each new token's keys and values go to the CP rank holding the fewest; every rank
//!   attends to its cache shard and the partial outputs are merged by their log-sum-exp
//!   (an empty shard contributes `-inf`), in rank order so every rank gets the same bits.
//!
//! Row-parallel outputs (attention output, MLP down) are all-reduced over TP. Logits end up on
//! every rank: the last token's hidden state is broadcast over CP from the rank holding it,
//! and the vocabulary-parallel LM head gathers over TP (or picks the argmax without gathering).

mod attention;
mod cache;
mod forward;
mod layout;
mod linear;
mod model;
mod sequence;
#[cfg(test)]
mod tests;

pub use attention::ParallelAttention;
pub use cache::ParallelCache;
pub use forward::{Scored, Sequence};
pub use layout::{
    check_tp, ffn_range, head_shard, kv_block_bytes, kv_head_range, mesh_head_groups, Comms,
    HeadShard, Placement,
};
pub use linear::{
    aligned_ranges, gather_columns, ColumnParallelLinear, ParallelLmHead, ParallelRmsNorm,
    RowParallelLinear, VocabParallelEmbedding,
};
pub use model::{shape_difference, LoadOptions, ParallelModel};
pub use sequence::{gather_tokens, gather_tokens_backward};
