//! The host pool: the host memory (pinned for CUDA, from [`Backend::alloc_host`]) that backups
//! to host memory are carved from.
//!
//! It is allocated when a release first needs it, or up front
//! ([`crate::Manager::preallocate_host_backups`]), and grown only when the backups of one
//! release do not fit in what is free, by one allocation of the bytes missing. A restore gives
//! its backup's bytes back to the pool without freeing them, so after the first cycle a sleep
//! and a wakeup allocate and free no host memory at all. Only dropping the manager, or
//! [`crate::Manager::free_host_pool`], frees it.

use crate::backend::{Backend, HostBuf};
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

/// Host memory of the kind a manager's backups live in (pinned for the CUDA backend, so that
/// copies to and from the device run at the copy engine's speed), from
/// [`crate::Manager::host_buffer`]: a benchmark's reference copy, or a staging buffer. Freed
/// when dropped; drop it before its manager.
pub struct HostBuffer(pub(crate) HostBuf);

impl std::ops::Deref for HostBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer").field("len", &self.len()).finish()
    }
}

/// Host memory in slabs, lent out in ranges.
#[derive(Default)]
pub(crate) struct HostPool {
    /// By id, in the order they were allocated: first fit tries the oldest first.
    slabs: BTreeMap<u64, Slab>,
    next_id: u64,
}

/// One host allocation of the pool.
struct Slab {
    buf: HostBuf,
    /// The ranges nothing is lent from, sorted and coalesced.
    free: Vec<Range<usize>>,
}

/// A range of the pool lent to one backup; [`HostPool::give`] takes it back.
#[derive(Debug)]
pub(crate) struct Lease {
    slab: u64,
    start: usize,
    len: usize,
}

impl Lease {
    /// Its bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Takes the first free range of `free` that holds `len` bytes; returns its start.
fn first_fit(free: &mut Vec<Range<usize>>, len: usize) -> Option<usize> {
    let i = free.iter().position(|r| r.len() >= len)?;
    let start = free[i].start;
    free[i].start += len;
    if free[i].is_empty() {
        free.remove(i);
    }
    Some(start)
}

impl HostPool {
    /// Bytes of host memory the pool holds, lent or free.
    pub(crate) fn capacity(&self) -> u64 {
        self.slabs.values().map(|s| s.buf.as_slice().len() as u64).sum()
    }

    /// Bytes lent to backups.
    pub(crate) fn lent(&self) -> u64 {
        let free: usize = self.slabs.values().flat_map(|s| &s.free).map(Range::len).sum();
        self.capacity() - free as u64
    }

    /// The bytes missing for `sizes` to be lent, in this order, from what is free now: the sum
    /// of the sizes that would not fit.
    fn shortfall(&self, sizes: &[usize]) -> usize {
        let mut free: Vec<Vec<Range<usize>>> =
            self.slabs.values().map(|s| s.free.clone()).collect();
        sizes.iter().filter(|&&len| !free.iter_mut().any(|f| first_fit(f, len).is_some())).sum()
    }

    /// Grows the pool, by one host allocation at most, so that `sizes` can be lent in this
    /// order ([`HostPool::take`]) without another.
    ///
    /// # Errors
    /// [`Error::HostPool`]: the backend cannot allocate the host memory missing.
    pub(crate) fn reserve(&mut self, backend: &dyn Backend, sizes: &[usize]) -> Result<()> {
        let missing = self.shortfall(sizes);
        if missing > 0 {
            let buf = backend
                .alloc_host(missing)
                .map_err(|e| Error::HostPool { bytes: missing as u64, source: Box::new(e) })?;
            self.slabs
                .insert(self.next_id, Slab { buf, free: std::iter::once(0..missing).collect() });
            self.next_id += 1;
        }
        Ok(())
    }

    /// Lends `len` bytes from the first free range that holds them; `None` when none does
    /// ([`HostPool::reserve`] first).
    pub(crate) fn take(&mut self, len: usize) -> Option<Lease> {
        self.slabs.iter_mut().find_map(|(&slab, s)| {
            first_fit(&mut s.free, len).map(|start| Lease { slab, start, len })
        })
    }

    /// Takes back what `lease` lent, keeping the memory.
    pub(crate) fn give(&mut self, lease: Lease) {
        let Some(slab) = self.slabs.get_mut(&lease.slab) else {
            debug_assert!(false, "a lease outlived its slab");
            return;
        };
        let range = lease.start..lease.start + lease.len;
        let i = slab.free.partition_point(|r| r.start < range.start);
        slab.free.insert(i, range);
        // Coalesce with the neighbours.
        if i + 1 < slab.free.len() && slab.free[i].end == slab.free[i + 1].start {
            slab.free[i].end = slab.free.remove(i + 1).end;
        }
        if i > 0 && slab.free[i - 1].end == slab.free[i].start {
            slab.free[i - 1].end = slab.free.remove(i).end;
        }
    }

    /// The bytes `lease` lent.
    pub(crate) fn bytes(&self, lease: &Lease) -> &[u8] {
        &self.slabs[&lease.slab].buf.as_slice()[lease.start..lease.start + lease.len]
    }

    /// The bytes `lease` lent, to write.
    pub(crate) fn bytes_mut(&mut self, lease: &Lease) -> &mut [u8] {
        let slab =
            self.slabs.get_mut(&lease.slab).expect("a slab that lends a range is never freed");
        &mut slab.buf.as_mut_slice()[lease.start..lease.start + lease.len]
    }

    /// Frees every slab that lends nothing; returns the bytes freed.
    pub(crate) fn free_unused(&mut self) -> u64 {
        let before = self.capacity();
        self.slabs.retain(|_, s| !(s.free.len() == 1 && s.free[0] == (0..s.buf.as_slice().len())));
        before - self.capacity()
    }
}

#[cfg(test)]
mod tests;
