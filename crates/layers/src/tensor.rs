//! `Tensor`: a contiguous, row-major block of numbers with a shape, a dtype tag and a device.
//!
//! Compute is f32 on the CPU; F16/BF16 (and the GGUF block formats) are storage formats that
//! loaders convert to f32. The storage is an enum so that a later variant can place the data
//! inside a `vmm` allocation (tagged memory that can be released and restored) without
//! changing any code that only reads or writes the numbers.

use crate::error::{Error, Result};

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
    /// A CUDA device by ordinal (needs feature `cuda`; no kernels yet).
    Cuda(usize),
}

/// The memory behind a tensor.
///
/// Only the owned variant exists now. A `vmm`-backed variant will hold an allocation handle
/// exposing `&mut [u8]` and view it as `f32`; callers use [`Storage::as_slice`] and
/// [`Storage::as_mut_slice`] and never match on the variant.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Storage {
    /// A heap vector owned by the tensor.
    Owned(Vec<f32>),
}

impl Storage {
    /// The elements.
    pub fn as_slice(&self) -> &[f32] {
        match self {
            Storage::Owned(v) => v,
        }
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            Storage::Owned(v) => v,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    /// The data, consumed.
    pub fn into_vec(self) -> Vec<f32> {
        match self.storage {
            Storage::Owned(v) => v,
        }
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

    #[test]
    fn reshape_keeps_data_and_rejects_bad_sizes() {
        let t = Tensor::zeros(&[4, 3]);
        assert_eq!(t.clone().reshape(&[2, 6]).unwrap().shape(), &[2, 6]);
        assert!(t.reshape(&[5]).is_err());
    }
}
