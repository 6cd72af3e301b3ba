//! Weight updates written in place: when an update only lays new buckets over the live
//! weights' checkpoint, and every tensor in them lives in f32 buffers, the COMMIT copies
//! those tensors from the mapped bucket files straight into the live buffers, where the
//! shard's [`WeightMap`] says each value lives. Nothing else is loaded, allocated or copied:
//! an update of the whole model costs about one pass over its bytes. Any other update (another
//! checkpoint, quantized tensors, buckets dropped that no new one replaces) loads the whole
//! shard as before.

use super::{ShardOrigin, ALIGN};
use checkpoint::{Bucket, Checkpoint, ShapeCatalog};
use layers::model::provenance::{BufferSource, Piece, WeightMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The shapes of the tensors a shard with `map` reads from the checkpoint at `path` (opened
/// once: a GGUF file's metadata takes tens of milliseconds to parse, as long as the copy of a
/// small model); `None` when it cannot be opened.
pub(super) fn catalog(path: &Path, map: &WeightMap) -> Option<Arc<ShapeCatalog>> {
    let ck = Checkpoint::open(path).ok()?;
    let config = ck.config().ok()?;
    let base = ck.weights(&config);
    ShapeCatalog::of(&*base, map.tensors()).ok().map(Arc::new)
}

/// The buckets `next` adds to `live` (the live weights' origin), opened and checked against
/// `base` (the catalog of their checkpoint) for the model of `config`, when the update from
/// `live` to `next` can be written in place; `None` when it needs a load. A bucket that
/// cannot be opened is left to the load too, which reports it.
pub(super) fn new_buckets(
    live: &ShardOrigin,
    next: &ShardOrigin,
    map: &WeightMap,
    base: &ShapeCatalog,
    config: &checkpoint::LlamaConfig,
) -> Option<Vec<Bucket>> {
    if live.path != next.path || live.placement != next.placement || live.form != next.form {
        return None;
    }
    // The buckets kept come first, in the live order (so each tensor they hold is still read
    // from the same one), then the new ones.
    let kept = next.tensors.iter().take_while(|p| live.tensors.contains(p)).count();
    let (kept, added) = next.tensors.split_at(kept);
    let in_order = live.tensors.iter().filter(|p| kept.contains(p)).eq(kept.iter());
    if added.is_empty() || !in_order || added.iter().any(|p| live.tensors.contains(p)) {
        return None;
    }
    let open = |p: &PathBuf| Bucket::open(p, config, base).ok();
    let buckets: Vec<Bucket> = added.iter().map(open).collect::<Option<_>>()?;
    if !buckets.iter().flat_map(Bucket::names).all(|name| map.places(name)) {
        return None;
    }
    // A live bucket the update drops must hold only tensors a new one replaces.
    let replaced = |name: &str| buckets.iter().any(|b| b.holds(name));
    for dropped in live.tensors.iter().filter(|p| !next.tensors.contains(p)) {
        let bucket = Bucket::open(dropped, config, base).ok()?;
        if !bucket.names().all(replaced) {
            return None;
        }
    }
    Some(buckets)
}

/// Values a thread writes at a time: whole rows of about a mebibyte.
const PIECE: usize = 1 << 18;

/// Writes the tensors of `buckets` into the weights in `bytes`, laid out as `layout` (one
/// buffer after another, each at an [`ALIGN`] boundary), through `map`, on `threads` threads
/// (the rank's compute threads, idle while an update commits: reading a bucket's pages costs
/// about as much again as copying them, and threads overlap both). Returns the bytes written.
///
/// # Errors
/// The layout does not fit `bytes`, a buffer is misaligned, or a bucket cannot give a value;
/// other values may have been written then.
pub(super) fn write(
    bytes: &mut [u8],
    layout: &[usize],
    map: &WeightMap,
    buckets: &[Bucket],
    threads: usize,
) -> Result<u64, String> {
    let mut pieces: Vec<Piece<'_>> = Vec::new();
    let mut rest = bytes;
    let mut offset = 0usize;
    for (index, (&len, source)) in layout.iter().zip(map.buffers()).enumerate() {
        let pad = offset.next_multiple_of(ALIGN) - offset;
        if rest.len() < pad + len {
            return Err(format!("weight buffer {index} lies outside the weights' memory"));
        }
        let (buffer, tail) = std::mem::take(&mut rest)[pad..].split_at_mut(len);
        rest = tail;
        offset += pad + len;
        if matches!(source, BufferSource::Other) {
            continue;
        }
        let values: &mut [f32] = bytemuck::try_cast_slice_mut(buffer)
            .map_err(|e| format!("weight buffer {index} is not f32 memory: {e}"))?;
        let cut = map.pieces(index, values, PIECE).map_err(|e| e.to_string())?;
        pieces.extend(cut.into_iter().filter(|p| buckets.iter().any(|b| b.holds(p.tensor))));
    }
    // Contiguous shares of about equal size, so each thread reads its part of the files in
    // order.
    let total: usize = pieces.iter().map(|p| p.dst.len()).sum();
    let share = total.div_ceil(threads.max(1)).max(1);
    let mut groups: Vec<Vec<Piece<'_>>> = Vec::new();
    let mut filled = share;
    for piece in pieces {
        if filled >= share {
            groups.push(Vec::new());
            filled = 0;
        }
        filled += piece.dst.len();
        groups.last_mut().expect("a group was pushed").push(piece);
    }
    let run = |group: Vec<Piece<'_>>| -> checkpoint::Result<usize> {
        group.into_iter().map(|p| p.write_from(buckets)).sum()
    };
    let results: Vec<checkpoint::Result<usize>> = std::thread::scope(|scope| {
        let mut groups = groups.into_iter();
        let first = groups.next();
        let spawned: Vec<_> = groups.map(|g| scope.spawn(move || run(g))).collect();
        let mut results = vec![first.map_or(Ok(0), run)];
        for handle in spawned {
            results.push(handle.join().unwrap_or_else(|_| {
                Err(checkpoint::Error::tensor("", "a thread writing the weights panicked"))
            }));
        }
        results
    });
    let mut written = 0u64;
    for result in results {
        written += 4 * result.map_err(|e| e.to_string())? as u64;
    }
    Ok(written)
}
