//! `Tensor`: a contiguous, row-major block of numbers with a shape, a dtype tag and a device.
//!
//! Compute is f32 on the CPU; F16/BF16 (and the GGUF block formats) are storage formats that
//! loaders convert to f32. The storage ([`Storage`], also used for quantized matrices and KV
//! caches) is a heap vector or external memory, such as a `vmm` allocation that can be released
//! and restored, without changing any code that only reads or writes the numbers.

use crate::error::{Error, Result};
use crate::memory::{alloc_exact, Arena, WeightBuffers};

/// The element type a tensor was stored as. Compute tensors are always [`DType::F32`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
}

/// Where a tensor's data lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// A CUDA device by ordinal (needs feature `cuda`).
    Cuda(usize),
}

/// Memory that someone else owns and a tensor can live in, such as a `vmm` allocation whose
/// pages can be released and restored while the tensor object stays put.
///
/// Implementations return the same region on every call; its address must be aligned for the
/// element type viewed through it and its length a whole number of elements (checked by
/// [`Storage::external`]). Memory from an [`crate::Arena`] is aligned to 64 bytes, enough for
/// every element type.
pub trait ExternalMemory: Send + Sync + std::fmt::Debug {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, mutably.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// The memory behind a tensor, a quantized matrix or a KV cache: a heap vector, or external
/// memory viewed as elements of `T`. Callers use [`Storage::as_slice`] and
/// [`Storage::as_mut_slice`] and never match on the variant.
///
/// Build the external variant with [`Storage::external`] (or [`Storage::copy_to`]), which
/// check the alignment and size: a region built directly that does not hold whole, aligned
/// elements makes the accessors panic.
#[derive(Debug)]
#[non_exhaustive]
pub enum Storage<T: bytemuck::Pod = f32> {
    /// A heap vector owned by the storage.
    Owned(Vec<T>),
    /// Memory owned elsewhere (see [`ExternalMemory`]).
    External(Box<dyn ExternalMemory>),
}

impl<T: bytemuck::Pod> Storage<T> {
    /// Wraps external memory.
    ///
    /// # Errors
    /// [`Error::Shape`] when the region is not aligned for `T` or not a whole number of `T`s.
    pub fn external(mem: Box<dyn ExternalMemory>) -> Result<Self> {
        bytemuck::try_cast_slice::<u8, T>(mem.bytes()).map_err(|e| {
            Error::shape(
                "Storage::external",
                format!(
                    "{} bytes cannot hold {} values: {e:?}",
                    mem.bytes().len(),
                    std::any::type_name::<T>()
                ),
            )
        })?;
        Ok(Storage::External(mem))
    }

    /// A copy of the elements in memory from `arena` (one allocation of exactly their bytes),
    /// or an empty owned vector, without allocating, when there are none.
    ///
    /// # Errors
    /// [`Error::Arena`] when the arena fails or returns a region of another size, and
    /// [`Error::Shape`] when the region is not aligned for `T`.
    pub fn copy_to(&self, arena: &dyn Arena) -> Result<Self> {
        let src = self.bytes();
        if src.is_empty() {
            return Ok(Storage::Owned(Vec::new()));
        }
        let mut mem = alloc_exact(arena, src.len())?;
        mem.bytes_mut().copy_from_slice(src);
        Storage::external(mem)
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        match self {
            Storage::Owned(v) => v,
            Storage::External(m) => bytemuck::cast_slice(m.bytes()),
        }
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        match self {
            Storage::Owned(v) => v,
            Storage::External(m) => bytemuck::cast_slice_mut(m.bytes_mut()),
        }
    }

    /// The elements as bytes.
    pub fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice())
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the elements live in external memory.
    pub fn is_external(&self) -> bool {
        matches!(self, Storage::External(_))
    }
}

/// Cloning copies the elements into an owned vector (external memory is not shared).
impl<T: bytemuck::Pod> Clone for Storage<T> {
    fn clone(&self) -> Self {
        Storage::Owned(self.as_slice().to_vec())
    }
}

impl<T: bytemuck::Pod + PartialEq> PartialEq for Storage<T> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

/// A storage is one weight buffer (left out when empty).
impl<T: bytemuck::Pod> WeightBuffers for Storage<T> {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        if !self.is_empty() {
            out.push(self.bytes());
        }
    }

    fn move_to(&mut self, arena: &dyn Arena) -> Result<()> {
        *self = self.copy_to(arena)?;
        Ok(())
    }
}

/// A contiguous row-major f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    storage: Storage,
}

impl Tensor {
    /// A tensor over `data` with `shape`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the number of elements does not match the shape.
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::shape(
                "Tensor::from_vec",
                format!("shape {shape:?} needs {n} elements, got {}", data.len()),
            ));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            dtype: DType::F32,
            device: Device::Cpu,
            storage: Storage::Owned(data),
        })
    }

    /// A tensor over `storage` with `shape`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the number of elements does not match the shape.
    pub fn from_storage(shape: &[usize], storage: Storage) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != storage.len() {
            return Err(Error::shape(
                "Tensor::from_storage",
                format!("shape {shape:?} needs {n} elements, storage has {}", storage.len()),
            ));
        }
        Ok(Tensor { shape: shape.to_vec(), dtype: DType::F32, device: Device::Cpu, storage })
    }

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// A copy with the elements in memory from `arena` (see [`Storage::copy_to`]).
    ///
    /// # Errors
    /// As [`Storage::copy_to`].
    pub fn copy_to(&self, arena: &dyn Arena) -> Result<Tensor> {
        Ok(Tensor {
            shape: self.shape.clone(),
            dtype: self.dtype,
            device: self.device,
            storage: self.storage.copy_to(arena)?,
        })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape: shape.to_vec(),
            dtype: DType::F32,
            device: Device::Cpu,
            storage: Storage::Owned(vec![0.0; n]),
        }
    }

    /// The same data with the dtype tag it was stored as on disk (compute stays f32).
    pub fn with_source_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dtype tag.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.storage.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.storage.is_empty()
    }

    /// The size of the innermost dimension (1 for a scalar).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows: the product of all but the innermost dimension.
    pub fn rows(&self) -> usize {
        self.shape[..self.shape.len().saturating_sub(1)].iter().product()
    }

    /// The elements in row-major order.
    pub fn data(&self) -> &[f32] {
        self.storage.as_slice()
    }

    /// The elements in row-major order, mutably.
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.storage.as_mut_slice()
    }

    /// Row `i` of the tensor viewed as `[rows, row_len]`.
    pub fn row(&self, i: usize) -> &[f32] {
        let n = self.row_len();
        &self.data()[i * n..(i + 1) * n]
    }

    /// The data, consumed (copied out of external memory).
    pub fn into_vec(self) -> Vec<f32> {
        match self.storage {
            Storage::Owned(v) => v,
            other => other.as_slice().to_vec(),
        }
    }

    /// Splits the last dimension into consecutive parts of `sizes` elements (the outputs of
    /// fused projections), each keeping the leading shape.
    ///
    /// # Errors
    /// [`Error::Shape`] when the sizes do not add up to the last dimension.
    pub fn split_last(&self, sizes: &[usize]) -> Result<Vec<Tensor>> {
        let n = self.row_len();
        if sizes.iter().sum::<usize>() != n {
            return Err(Error::shape(
                "Tensor::split_last",
                format!("{sizes:?} of a last dimension of {n}"),
            ));
        }
        let lead = &self.shape[..self.shape.len().saturating_sub(1)];
        let mut parts: Vec<Vec<f32>> =
            sizes.iter().map(|&s| Vec::with_capacity(self.rows() * s)).collect();
        for row in self.data().chunks_exact(n.max(1)) {
            let mut at = 0;
            for (p, &s) in parts.iter_mut().zip(sizes) {
                p.extend_from_slice(&row[at..at + s]);
                at += s;
            }
        }
        parts
            .into_iter()
            .zip(sizes)
            .map(|(p, &s)| {
                let mut shape = lead.to_vec();
                shape.push(s);
                Tensor::from_vec(&shape, p)
            })
            .collect()
    }

    /// The same data with another shape.
    ///
    /// # Errors
    /// [`Error::Shape`] when the element counts differ.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != self.len() {
            return Err(Error::shape("Tensor::reshape", format!("{:?} -> {shape:?}", self.shape)));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }
}

/// A tensor is the one buffer of its storage.
impl WeightBuffers for Tensor {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.storage.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> Result<()> {
        self.storage.move_to(arena)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_vec_checks_the_element_count() {
        let err = Tensor::from_vec(&[2, 3], vec![0.0; 5]).unwrap_err();
        assert!(err.to_string().contains("needs 6 elements, got 5"), "{err}");
        let t = Tensor::from_vec(&[2, 3], (0..6).map(|x| x as f32).collect()).unwrap();
        assert_eq!((t.rows(), t.row_len()), (2, 3));
        assert_eq!(t.row(1), &[3.0, 4.0, 5.0]);
        assert_eq!(t.dtype(), DType::F32);
        assert_eq!(t.device(), Device::Cpu);
    }

    /// External memory backed by a `Vec<u32>` (4-byte aligned), optionally skipping a byte to
    /// make it misaligned.
    #[derive(Debug)]
    struct Words(Vec<u32>, usize);

    impl ExternalMemory for Words {
        fn bytes(&self) -> &[u8] {
            &bytemuck::cast_slice(&self.0)[self.1..]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut bytemuck::cast_slice_mut(&mut self.0)[self.1..]
        }
    }

    #[test]
    fn external_memory_is_viewed_as_f32_and_checked() {
        let storage = Storage::external(Box::new(Words(vec![0; 6], 0))).unwrap();
        let mut t = Tensor::from_storage(&[2, 3], storage).unwrap();
        t.data_mut()[4] = 2.5;
        assert_eq!(t.row(1), &[0.0, 2.5, 0.0]);
        let copy = t.clone();
        assert!(matches!(copy.storage(), Storage::Owned(_)));
        assert_eq!(copy, t);
        assert_eq!(t.into_vec(), vec![0.0, 0.0, 0.0, 0.0, 2.5, 0.0]);
        let err = Storage::<f32>::external(Box::new(Words(vec![0; 6], 1))).unwrap_err();
        assert!(err.to_string().contains("23 bytes cannot hold f32 values"), "{err}");
        let err = Tensor::from_storage(&[4], Storage::Owned(vec![0.0; 3])).unwrap_err();
        assert!(err.to_string().contains("needs 4 elements, storage has 3"), "{err}");
    }

    #[test]
    fn split_last_cuts_every_row() {
        let t = Tensor::from_vec(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let parts = t.split_last(&[1, 2]).unwrap();
        assert_eq!(parts[0].shape(), &[2, 1]);
        assert_eq!(parts[0].data(), &[1.0, 4.0]);
        assert_eq!(parts[1].data(), &[2.0, 3.0, 5.0, 6.0]);
        assert!(t.split_last(&[2, 2]).is_err());
    }

    #[test]
    fn reshape_keeps_data_and_rejects_bad_sizes() {
        let t = Tensor::zeros(&[4, 3]);
        assert_eq!(t.clone().reshape(&[2, 6]).unwrap().shape(), &[2, 6]);
        assert!(t.reshape(&[5]).is_err());
    }
}
