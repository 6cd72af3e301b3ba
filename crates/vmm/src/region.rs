//! [`Regions`]: an allocation cut into disjoint byte ranges that other code keeps as plain
//! slices (a model's weight buffers, a sequence's KV cache), without a guard per access.
//!
//! Unchecked access is what kernels need, so the contract moves to the owner of the memory:
//! a [`Region`] may be read or written only while its allocation is materialized, and nothing
//! may release the allocation while a slice of it is in use. Breaking it on the CPU backend
//! faults (the range is `PROT_NONE` while released); it never touches other memory.
//!
//! # Soundness: the gate
//!
//! [`Region::bytes`] and [`Region::bytes_mut`] are safe functions, so what makes them sound
//! is one gate, kept by the only code that releases these allocations (`tpctl`'s sleep path,
//! through the session crate):
//!
//! 1. The slices live only inside a model step (`session::StepModel::forward`, the KV cache
//!    appends of its `prepare`) or a model build; none is kept across a step boundary.
//! 2. A sleep's first phase closes every rank's `session::Gate` and waits until its engine is
//!    parked at a step boundary (no step and no model build running), before any
//!    [`Manager::release`](crate::Manager::release) on that rank; a step that arrives while the
//!    gate is closed is refused as a protocol error, never run.
//! 3. The gate opens again only after [`Manager::materialize`](crate::Manager::materialize) of
//!    every released tag has succeeded on that rank.
//!
//! Any other owner of a `Region` must keep the same order: release only while no slice of it
//! is alive, and read or write only after the materialize that follows.
//!
//! [`DeviceSlice`] is the same for memory the host cannot address (a CUDA allocation): a byte
//! range that kernels use in place, as a [`mesh::DeviceMemory`]. The same gate makes its
//! implementation of that `unsafe` trait sound: the session's kernels touch it only inside
//! steps, and no step runs between a release and the materialize that follows.

use crate::error::{Error, Result};
use crate::manager::Allocation;
use std::sync::Arc;

/// Hands out disjoint, aligned byte ranges of one host-accessible allocation, front to back.
#[derive(Debug)]
pub struct Regions {
    alloc: Arc<Allocation>,
    next: usize,
}

/// One byte range of an allocation, handed out once by [`Regions::take`] (ranges never
/// overlap). Keeps the allocation alive.
pub struct Region {
    alloc: Arc<Allocation>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("allocation", &self.alloc.id())
            .field("tag", self.alloc.tag())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Regions {
    /// Cuts `alloc` into regions.
    ///
    /// # Errors
    /// [`Error::NotHostAccessible`] for device memory.
    pub fn new(alloc: Allocation) -> Result<Regions> {
        // The read guard checks host access (and that the memory is there right now).
        drop(alloc.read()?);
        Ok(Regions { alloc: Arc::new(alloc), next: 0 })
    }

    /// The allocation.
    pub fn allocation(&self) -> &Allocation {
        &self.alloc
    }

    /// Bytes not handed out yet (after aligning the next region).
    pub fn remaining(&self) -> usize {
        self.alloc.bytes().saturating_sub(self.next)
    }

    /// The next `len` bytes, starting at a multiple of `align` (a power of two) from the
    /// allocation's base.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when they do not fit.
    pub fn take(&mut self, len: usize, align: usize) -> Result<Region> {
        let offset = self.next.next_multiple_of(align.max(1));
        let end = offset.checked_add(len).filter(|&e| e <= self.alloc.bytes());
        let Some(end) = end else {
            return Err(Error::OutOfBounds {
                id: self.alloc.id(),
                tag: self.alloc.tag().clone(),
                offset,
                len,
                bytes: self.alloc.bytes() as u64,
            });
        };
        self.next = end;
        Ok(Region { alloc: self.alloc.clone(), offset, len })
    }
}

impl Region {
    /// The bytes. Sound under the gate of the module docs (materialized, not being released).
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `offset..offset + len` lies inside the allocation (checked by `take`), whose
        // address range is reserved for the allocation's life (kept by the Arc); the range is
        // handed out once, so no `&mut` to it exists elsewhere while `&self` lives. The
        // memory is host-addressable (checked by `Regions::new`); that it is materialized is
        // the caller's contract (module docs).
        unsafe { std::slice::from_raw_parts(self.alloc.as_ptr().add(self.offset), self.len) }
    }

    /// The bytes, mutably. Sound under the gate of the module docs.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.as_ptr().add(self.offset), self.len) }
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation it belongs to.
    pub fn allocation(&self) -> &Allocation {
        &self.alloc
    }
}

/// A byte range of an allocation that kernels use in place (a weight buffer or a KV cache on
/// the device), as a [`mesh::DeviceMemory`]. Keeps the allocation alive.
pub struct DeviceSlice {
    alloc: Arc<Allocation>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for DeviceSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSlice")
            .field("allocation", &self.alloc.id())
            .field("device", &self.alloc.device())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceSlice {
    /// The `len` bytes of `alloc` from `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when they do not lie inside the allocation.
    pub fn new(alloc: Arc<Allocation>, offset: usize, len: usize) -> Result<DeviceSlice> {
        let fits = offset.checked_add(len).is_some_and(|end| end <= alloc.bytes());
        if !fits {
            return Err(Error::OutOfBounds {
                id: alloc.id(),
                tag: alloc.tag().clone(),
                offset,
                len,
                bytes: alloc.bytes() as u64,
            });
        }
        Ok(DeviceSlice { alloc, offset, len })
    }
}

// SAFETY: the values never change (the fields are private and set once, and an allocation's
// base address and device are fixed for its life). The range lies inside the allocation
// (checked by `new`), whose address reservation and backing stay this allocation's own until
// its last handle drops, and the `Arc` keeps one. That the range is mapped whenever a kernel
// may touch it is the gate of the module docs: the only code that releases these allocations
// quiesces every engine first and opens the gate after the materialize.
unsafe impl mesh::DeviceMemory for DeviceSlice {
    fn device_ptr(&self) -> u64 {
        self.alloc.base() + self.offset as u64
    }
    fn size(&self) -> usize {
        self.len
    }
    fn device(&self) -> mesh::Device {
        self.alloc.device()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BackupStore, Manager, Policy, Tag};

    #[test]
    fn regions_are_disjoint_aligned_and_survive_a_sleep() {
        let dir = std::env::temp_dir().join(format!("vmm-region-{}", std::process::id()));
        let m = Manager::builder().spill_dir(&dir).build().unwrap();
        let a = m.allocate(Tag::WEIGHTS, 10_000, Policy::Backup(BackupStore::Spill)).unwrap();
        let mut regions = Regions::new(a).unwrap();
        let mut r1 = regions.take(100, 64).unwrap();
        let mut r2 = regions.take(1000, 64).unwrap();
        assert_eq!(r2.offset, 128);
        assert_eq!(r2.bytes().as_ptr() as usize % 64, 0);
        r1.bytes_mut().fill(1);
        r2.bytes_mut().fill(2);
        assert!(r1.bytes().iter().all(|&b| b == 1) && r2.bytes().iter().all(|&b| b == 2));
        assert!(matches!(regions.take(9_000, 64), Err(Error::OutOfBounds { .. })));
        m.release(["weights"]).unwrap();
        m.materialize(["weights"]).unwrap();
        assert!(r1.bytes().iter().all(|&b| b == 1) && r2.bytes().iter().all(|&b| b == 2));
        drop(regions);
        drop(r1);
        drop(r2);
        assert!(m.allocations().is_empty(), "the last region frees the allocation");
        std::fs::remove_dir_all(&dir).ok();
    }
}
