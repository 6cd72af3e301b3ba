//! Chunked copies between an allocation and host memory: a backup (to the host) or a restore
//! (from the host) moves [`CHUNK`] bytes at a time, and the next chunk is queued before the
//! previous one is waited for, so that a backend that copies asynchronously (CUDA: a stream of
//! its own, an event per chunk) copies one chunk while the host prepares and queues the next.
//!
//! The order lives here, the same for every backend, so that it can be tested: a backend only
//! queues one chunk ([`Backend::start_to_host`], [`Backend::start_from_host`]) and waits for
//! one ([`Backend::wait_chunk`]). For `n` chunks the calls are `begin`, `start 0`, then for each
//! `i` in `1..n` `start i` and `wait i-1`, and last `wait n-1`. After a failure every queued
//! chunk is drained ([`Backend::drain_chunks`]) before the error is returned, so no copy can
//! touch the host memory once the borrow of it ends.

use crate::backend::Backend;
use crate::error::{Error, Result};

/// The bytes of one chunk of a backup or restore.
pub(crate) const CHUNK: usize = 64 << 20;

/// The most chunks a backend has queued and not yet waited for: the one copying and the one
/// queued behind it.
pub(crate) const IN_FLIGHT: usize = 2;

/// Which way a chunked copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// From the allocation to host memory (a backup).
    ToHost,
    /// From host memory to the allocation (a restore).
    FromHost,
}

impl Direction {
    /// What the copy is, in a message.
    fn what(self) -> &'static str {
        match self {
            Direction::ToHost => "backup to host memory",
            Direction::FromHost => "restore from host memory",
        }
    }
}

/// Copies `dst.len()` bytes at `addr` into `dst`, in chunks of `chunk` bytes.
///
/// # Errors
/// [`Error::Copy`], naming the chunk whose copy failed and why.
pub(crate) fn to_host(
    backend: &dyn Backend,
    addr: u64,
    dst: &mut [u8],
    chunk: usize,
) -> Result<()> {
    let base = dst.as_mut_ptr();
    run(backend, Direction::ToHost, dst.len(), chunk, |i, offset, len| {
        // SAFETY: `offset + len <= dst.len()` (`run` cuts `dst.len()` into chunks), so the
        // range lies in `dst`, which this function borrows mutably until `run` returns; `run`
        // waits for every queued chunk (or drains them) before it returns, and queues at most
        // `IN_FLIGHT` chunks.
        unsafe { backend.start_to_host(addr + offset as u64, base.add(offset), len, i) }
    })
}

/// Copies `src` to `addr`, in chunks of `chunk` bytes.
///
/// # Errors
/// [`Error::Copy`], naming the chunk whose copy failed and why.
pub(crate) fn from_host(backend: &dyn Backend, addr: u64, src: &[u8], chunk: usize) -> Result<()> {
    let base = src.as_ptr();
    run(backend, Direction::FromHost, src.len(), chunk, |i, offset, len| {
        // SAFETY: as in `to_host`: the range lies in `src`, borrowed (so not written by anyone)
        // until every queued chunk finished.
        unsafe { backend.start_from_host(addr + offset as u64, base.add(offset), len, i) }
    })
}

/// Cuts `len` bytes into chunks and drives `start(index, offset, len)` and the backend's waits
/// in the order the module docs give; drains the backend on any failure.
fn run(
    backend: &dyn Backend,
    direction: Direction,
    len: usize,
    chunk: usize,
    mut start: impl FnMut(usize, usize, usize) -> Result<()>,
) -> Result<()> {
    let chunk = chunk.max(1);
    let count = len.div_ceil(chunk);
    let range = |i: usize| (i * chunk, chunk.min(len - i * chunk));
    let failed = |i: usize, source: Error| {
        let (offset, n) = range(i);
        let what = format!(
            "{}, chunk {} of {count} ({n} bytes at offset {offset})",
            direction.what(),
            i + 1
        );
        Error::Copy { what, source: Box::new(source) }
    };
    let result = (|| {
        backend.begin_chunks(direction).map_err(|e| Error::Copy {
            what: format!("{} of {len} bytes, before its first chunk", direction.what()),
            source: Box::new(e),
        })?;
        for i in 0..count {
            let (offset, n) = range(i);
            start(i, offset, n).map_err(|e| failed(i, e))?;
            // With IN_FLIGHT queued, wait for the oldest before queueing another.
            if let Some(oldest) = (i + 1).checked_sub(IN_FLIGHT) {
                backend.wait_chunk(oldest).map_err(|e| failed(oldest, e))?;
            }
        }
        for i in count.saturating_sub(IN_FLIGHT - 1)..count {
            backend.wait_chunk(i).map_err(|e| failed(i, e))?;
        }
        Ok(())
    })();
    if result.is_err() {
        if let Err(e) = backend.drain_chunks() {
            tracing::error!(error = %e, what = direction.what(), "draining the copies queued before a failure failed");
        }
    }
    result
}

#[cfg(test)]
mod tests;
