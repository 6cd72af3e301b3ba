//! Sequence collect over the context-parallel group, and its adjoint.
//!
//! `gather_tokens` concatenates every CP rank's rows (uneven shards) in token order. Its
//! adjoint, for training reuse, is a reduce-scatter: each rank's gradient of the gathered
//! tensor counts, so the gradient of a rank's shard is the sum over ranks of their gradients'
//! rows for that shard, not just a slice of its own.

use crate::error::Result;
use collectives::{Collective, Communicator, ReduceOp};
use mesh::TokenShard;
use tensor::Tensor;

/// Rows of every CP rank, in token order: `[shard.total(), width]`.
///
/// # Errors
/// `local` does not have this rank's row count, or a failed collective.
pub fn gather_tokens(
    cp: &mut dyn Communicator,
    local: &Tensor,
    shard: &TokenShard,
) -> Result<Tensor> {
    let width = local.row_len();
    let want = shard.local().len();
    if local.rows() != want {
        return Err(crate::Error::shape(
            "gather_tokens",
            format!("{} local rows, the shard has {want}", local.rows()),
        ));
    }
    let sizes: Vec<usize> = shard.sizes().iter().map(|s| s * width).collect();
    let mut out = vec![0f32; shard.total() * width];
    cp.all_gather_uneven(local.host()?, &mut out, &sizes)?;
    Ok(Tensor::from_vec(&[shard.total(), width], out)?)
}

/// The adjoint of [`gather_tokens`]: given this rank's gradient of the gathered rows
/// (`[shard.total(), width]`), the gradient of its own rows, summed over every CP rank.
///
/// # Errors
/// `grad` has the wrong row count, or a failed collective.
pub fn gather_tokens_backward(
    cp: &mut dyn Communicator,
    grad: &Tensor,
    shard: &TokenShard,
) -> Result<Tensor> {
    let width = grad.row_len();
    if grad.rows() != shard.total() {
        return Err(crate::Error::shape(
            "gather_tokens_backward",
            format!("{} gradient rows for {} tokens", grad.rows(), shard.total()),
        ));
    }
    // Pad every shard to the widest so an equal-chunk reduce-scatter fits uneven shards.
    let most = shard.sizes().into_iter().max().unwrap_or(0);
    let mut send = vec![0f32; shard.ranges().len() * most * width];
    for (r, range) in shard.ranges().iter().enumerate() {
        let src = &grad.host()?[range.start * width..range.end * width];
        send[r * most * width..r * most * width + src.len()].copy_from_slice(src);
    }
    let mut mine = vec![0f32; most * width];
    cp.reduce_scatter(&send, &mut mine, ReduceOp::Sum)?;
    mine.truncate(shard.local().len() * width);
    Ok(Tensor::from_vec(&[shard.local().len(), width], mine)?)
}
