//! Memory that a model's weights and KV caches can live in instead of the heap.
//!
//! Sleep and wake-up release a rank's weights and caches and restore them at the same
//! addresses, so the caller (with `vmm`) provides the memory through an [`Arena`]; this crate
//! only copies into it and reads through [`ExternalMemory`]. [`HeapArena`] serves tests and
//! callers without `vmm`.
//!
//! A model moves its buffers one [`Arena::alloc`] each, in a fixed order, and reports the total
//! of their sizes rounded up to [`ALIGN`] ([`padded`]), so a caller can reserve one region of
//! that size and carve it by bumping a cursor in the same order.
//!
//! Whoever rewrites weight bytes in place or frees them while a backend may hold device
//! copies of them says so with [`weights_changed`]: device copies are trusted only within one
//! [`weights_generation`].

mod generation;

pub use generation::{weights_changed, weights_generation, WeightsHolder};

use crate::error::{Error, Result};
use crate::tensor::ExternalMemory;
use mesh::DeviceMemory;

/// The alignment, in bytes, of every region an [`Arena`] returns.
pub const ALIGN: usize = 64;

/// `bytes` rounded up to a multiple of [`ALIGN`]: the space a buffer takes when consecutive
/// buffers are carved out of one region.
pub fn padded(bytes: usize) -> usize {
    bytes.next_multiple_of(ALIGN)
}

/// A source of memory for weight and KV-cache buffers.
pub trait Arena {
    /// A region of exactly `bytes` bytes whose address is a multiple of [`ALIGN`]; its
    /// contents are unspecified (callers write before they read).
    ///
    /// # Errors
    /// [`Error::Arena`] when the memory cannot be provided.
    fn alloc(&self, bytes: usize) -> Result<Box<dyn ExternalMemory>>;
}

/// A source of device memory for the CUDA backend's weights and KV caches.
pub trait DeviceArena: Send + Sync {
    /// A region of exactly `bytes` bytes of device memory whose address is a multiple of
    /// [`ALIGN`]; its contents are unspecified.
    ///
    /// # Errors
    /// [`Error::Arena`] when the memory cannot be provided.
    fn alloc_device(&self, bytes: usize) -> Result<Box<dyn DeviceMemory>>;
}

/// `bytes` bytes of device memory from `arena`, checked to be exactly that many and aligned.
///
/// # Errors
/// [`Error::Arena`] when the arena fails or returns a region of another size or alignment.
pub fn alloc_device_exact(arena: &dyn DeviceArena, bytes: usize) -> Result<Box<dyn DeviceMemory>> {
    let mem = arena.alloc_device(bytes)?;
    let (got, at) = (mem.size(), mem.device_ptr());
    if got != bytes || at % ALIGN as u64 != 0 {
        return Err(Error::Arena {
            bytes,
            source: format!("the device arena returned {got} bytes at {at:#x}").into(),
        });
    }
    Ok(mem)
}

/// `bytes` bytes from `arena`, checked to be exactly that many (alignment is checked where
/// the region is viewed as elements, by [`crate::Storage::external`]).
///
/// # Errors
/// [`Error::Arena`] when the arena fails or returns a region of another size.
pub fn alloc_exact(arena: &dyn Arena, bytes: usize) -> Result<Box<dyn ExternalMemory>> {
    let mem = arena.alloc(bytes)?;
    let got = mem.bytes().len();
    if got != bytes {
        return Err(Error::Arena {
            bytes,
            source: format!("the arena returned a region of {got} bytes").into(),
        });
    }
    Ok(mem)
}

/// An [`Arena`] on the heap: every region is its own zeroed allocation.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeapArena;

impl Arena for HeapArena {
    fn alloc(&self, bytes: usize) -> Result<Box<dyn ExternalMemory>> {
        let mut buf = Vec::new();
        buf.try_reserve_exact(bytes + ALIGN - 1)
            .map_err(|e| Error::Arena { bytes, source: Box::new(e) })?;
        buf.resize(bytes + ALIGN - 1, 0);
        // The vector never grows, so its buffer, and the aligned start within it, stay put.
        let start = buf.as_ptr().align_offset(ALIGN);
        Ok(Box::new(HeapRegion { buf, start, len: bytes }))
    }
}

/// A region of a [`HeapArena`]: `len` bytes from `start`, the first aligned byte of `buf`.
struct HeapRegion {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl ExternalMemory for HeapRegion {
    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// Shows the size only: the bytes of a weight are no use in a debug print.
impl std::fmt::Debug for HeapRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapRegion").field("len", &self.len).finish()
    }
}

/// Something that holds weight buffers: it lists them and moves them into arena memory, both
/// in one fixed order. Each implementation visits its fields in the same order in both
/// methods; empty buffers are left out of both.
pub trait WeightBuffers {
    /// Appends the bytes of every non-empty buffer to `out`, in order.
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>);

    /// Copies every non-empty buffer into memory from `arena`, one allocation per buffer in
    /// the order of [`WeightBuffers::buffers`], and drops the old copy. On error the buffers
    /// moved so far stay moved; the values are the same either way.
    fn move_to(&mut self, arena: &dyn Arena) -> Result<()>;
}

/// An absent part (a bias the model does not have) holds no buffers.
impl<B: WeightBuffers> WeightBuffers for Option<B> {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        if let Some(b) = self {
            b.buffers(out);
        }
    }

    fn move_to(&mut self, arena: &dyn Arena) -> Result<()> {
        self.as_mut().map_or(Ok(()), |b| b.move_to(arena))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Storage;

    #[test]
    fn heap_regions_are_aligned_zeroed_and_exactly_sized() {
        for bytes in [0, 1, 63, 64, 100, 4096] {
            let mut mem = HeapArena.alloc(bytes).unwrap();
            assert_eq!(mem.bytes().len(), bytes);
            assert_eq!(mem.bytes().as_ptr() as usize % ALIGN, 0, "{bytes} bytes");
            assert!(mem.bytes().iter().all(|&b| b == 0));
            mem.bytes_mut().iter_mut().for_each(|b| *b = 7);
            assert!(mem.bytes().iter().all(|&b| b == 7));
        }
        assert_eq!(format!("{:?}", HeapArena.alloc(5).unwrap()), "HeapRegion { len: 5 }");
        assert_eq!([padded(0), padded(1), padded(64), padded(65)], [0, 64, 64, 128]);
    }

    /// An arena that hands out `extra` more bytes than asked for, starting `skew` bytes after
    /// an aligned address.
    struct Faulty {
        extra: usize,
        skew: usize,
    }

    impl Arena for Faulty {
        fn alloc(&self, bytes: usize) -> Result<Box<dyn ExternalMemory>> {
            let inner = HeapArena.alloc(bytes + self.extra + self.skew)?;
            Ok(Box::new(Skewed { inner, skew: self.skew }))
        }
    }

    /// A region seen from `skew` bytes into another.
    #[derive(Debug)]
    struct Skewed {
        inner: Box<dyn ExternalMemory>,
        skew: usize,
    }

    impl ExternalMemory for Skewed {
        fn bytes(&self) -> &[u8] {
            &self.inner.bytes()[self.skew..]
        }

        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.inner.bytes_mut()[self.skew..]
        }
    }

    #[test]
    fn copies_into_arena_memory_are_checked() {
        let floats = Storage::Owned(vec![1.5f32, -2.0, 3.25]);
        let moved = floats.copy_to(&HeapArena).unwrap();
        assert!(moved.is_external());
        assert_eq!(moved.as_slice(), floats.as_slice());
        assert_eq!(moved.bytes().as_ptr() as usize % ALIGN, 0);
        let empty = Storage::<u8>::Owned(Vec::new()).copy_to(&Faulty { extra: 1, skew: 0 });
        assert!(!empty.unwrap().is_external(), "an empty buffer needs no allocation");

        let err = floats.copy_to(&Faulty { extra: 4, skew: 0 }).unwrap_err();
        assert_eq!(
            err.to_string(),
            "arena allocation of 12 bytes: the arena returned a region of 16 bytes"
        );
        let err = floats.copy_to(&Faulty { extra: 0, skew: 1 }).unwrap_err();
        assert!(err.to_string().contains("12 bytes cannot hold f32 values"), "{err}");
        // Bytes need no alignment: the same skewed arena serves them.
        let bytes = Storage::Owned(vec![1u8, 2, 3]);
        let moved = bytes.copy_to(&Faulty { extra: 0, skew: 1 }).unwrap();
        assert_eq!(moved.as_slice(), &[1, 2, 3]);
        assert_eq!(moved.bytes().as_ptr() as usize % ALIGN, 1);
    }
}
