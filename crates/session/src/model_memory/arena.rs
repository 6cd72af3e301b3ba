//! The arenas a model's buffers are cut from: [`VmmArena`] over one host vmm allocation,
//! [`VmmDeviceArena`] over device allocations of one tag.

use std::sync::{Arc, Mutex, PoisonError};
use tensor::memory::ALIGN;
use tensor::ExternalMemory;

/// A [`tensor::Arena`] over one vmm allocation, handing out its bytes front to back.
#[derive(Debug)]
pub struct VmmArena(pub(super) Mutex<vmm::Regions>);

impl VmmArena {
    /// Cuts `alloc` into buffers.
    ///
    /// # Errors
    /// The allocation is not host memory.
    pub fn new(alloc: vmm::Allocation) -> Result<VmmArena, vmm::Error> {
        Ok(VmmArena(Mutex::new(vmm::Regions::new(alloc)?)))
    }
}

impl VmmArena {
    /// Commits its allocation's pages on `threads` threads ([`vmm::Allocation::commit`]).
    pub(super) fn commit(&self, threads: usize) -> Result<(), vmm::Error> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).allocation().commit(threads)
    }

    /// Whether its allocation is released (asleep).
    pub(super) fn allocation_released(&self) -> bool {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).allocation().is_released()
    }
}

impl tensor::Arena for VmmArena {
    fn alloc(&self, bytes: usize) -> tensor::Result<Box<dyn ExternalMemory>> {
        let mut regions = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let region = regions
            .take(bytes, ALIGN)
            .map_err(|e| tensor::Error::Arena { bytes, source: Box::new(e) })?;
        Ok(Box::new(VmmBytes(region)))
    }
}

/// A vmm region as tensor storage.
#[derive(Debug)]
struct VmmBytes(vmm::Region);

impl ExternalMemory for VmmBytes {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}

/// A [`tensor::DeviceArena`] over device allocations of one tag: regions are cut front to
/// back from the newest allocation, and a region that does not fit starts a new one of
/// `chunk` bytes (or its own size, when larger). The allocations live as long as their regions.
pub struct VmmDeviceArena {
    manager: Arc<vmm::Manager>,
    tag: vmm::Tag,
    policy: vmm::Policy,
    chunk: usize,
    /// The newest allocation and the offset of its first free byte.
    last: Mutex<Option<(Arc<vmm::Allocation>, usize)>>,
}

impl std::fmt::Debug for VmmDeviceArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmDeviceArena")
            .field("tag", &self.tag)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

impl VmmDeviceArena {
    /// An arena allocating `tag` memory with `policy` from `manager`, `chunk` bytes at a time.
    pub fn new(
        manager: Arc<vmm::Manager>,
        tag: vmm::Tag,
        policy: vmm::Policy,
        chunk: usize,
    ) -> VmmDeviceArena {
        VmmDeviceArena { manager, tag, policy, chunk, last: Mutex::new(None) }
    }
}

impl tensor::DeviceArena for VmmDeviceArena {
    fn alloc_device(&self, bytes: usize) -> tensor::Result<Box<dyn mesh::DeviceMemory>> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let fits = |(alloc, next): &(Arc<vmm::Allocation>, usize)| {
            let offset = next.next_multiple_of(ALIGN);
            (offset + bytes <= alloc.bytes()).then(|| (alloc.clone(), offset))
        };
        let (alloc, offset) = match last.as_ref().and_then(fits) {
            Some(found) => found,
            None => {
                let size = self.chunk.max(bytes).max(1);
                let alloc = self
                    .manager
                    .allocate(&self.tag, size, self.policy.clone())
                    .map_err(|e| tensor::Error::Arena { bytes, source: Box::new(e) })?;
                (Arc::new(alloc), 0)
            }
        };
        *last = Some((alloc.clone(), offset + bytes));
        let slice = vmm::DeviceSlice::new(alloc, offset, bytes)
            .map_err(|e| tensor::Error::Arena { bytes, source: Box::new(e) })?;
        Ok(Box::new(slice))
    }
}
