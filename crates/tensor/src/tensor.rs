//! `Tensor`: a contiguous, row-major block of numbers with a shape, a dtype tag and a device.
//!
//! Compute is f32 on the CPU; F16/BF16 (and the GGUF block formats) are storage formats that
//! loaders convert to f32. The storage ([`Storage`], also used for quantized matrices and KV
//! caches) is a heap vector or external memory, such as a `vmm` allocation that can be released
//! and restored, without changing any code that only reads or writes the numbers. A backend's
//! output may also live on its device ([`DeviceData`]): it is copied to the host the first time
//! host code reads it, so model code runs unchanged while consecutive kernels pass their results
//! on the device.

use crate::error::{Error, Result};
use crate::memory::{alloc_exact, Arena, WeightBuffers};
use std::sync::{Arc, OnceLock};

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

/// Where a tensor's data lives: the mesh's device (one type for "which device" in every crate).
pub use mesh::Device;

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

/// Data a backend keeps on its device (a kernel's output), read by the host through a copy.
pub trait DeviceData: Send + Sync + std::fmt::Debug {
    /// The device it lives on.
    fn device(&self) -> Device;

    /// Its length in bytes.
    fn byte_len(&self) -> usize;

    /// Copies all of it into `out` (exactly [`DeviceData::byte_len`] bytes), after the work
    /// that produces it.
    ///
    /// # Errors
    /// The copy failed (the device is unusable), with the reason.
    fn download(&self, out: &mut [u8]) -> std::result::Result<(), String>;

    /// `self`, for the backend that made it to find its own type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Device data and, once host code has read it, its host copy.
#[derive(Debug)]
pub struct OnDevice<T> {
    data: Arc<dyn DeviceData>,
    host: OnceLock<Vec<T>>,
}

impl<T: bytemuck::Pod> OnDevice<T> {
    /// The host copy, made by the first call: a failed copy means the device is gone and the
    /// data with it, and says which device and why.
    fn fetch(&self) -> Result<&[T]> {
        if let Some(host) = self.host.get() {
            return Ok(host);
        }
        let mut v = vec![T::zeroed(); self.data.byte_len() / std::mem::size_of::<T>()];
        self.data
            .download(bytemuck::cast_slice_mut(&mut v))
            .map_err(|reason| Error::DeviceCopy { device: self.data.device(), reason })?;
        // Another thread may have copied it first: both copies hold the same bytes.
        Ok(self.host.get_or_init(|| v))
    }

    /// The host copy [`OnDevice::fetch`] made. Reading device data that no call fetched is a
    /// bug of the caller (host code must copy it with [`Tensor::host`], which can fail), not a
    /// device failure, so it panics saying so.
    fn fetched(&self) -> &[T] {
        match self.host.get() {
            Some(host) => host,
            None => panic!(
                "a tensor on {} was read on the host before Tensor::host copied it there",
                self.data.device()
            ),
        }
    }
}

/// The memory behind a tensor, a quantized matrix or a KV cache: a heap vector, external
/// memory viewed as elements of `T`, or a backend's device data. Callers use
/// [`Storage::as_slice`] and [`Storage::as_mut_slice`] and never match on the variant.
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
    /// A backend's device data, copied to the host on the first host access (reads keep the
    /// device data; a mutable access turns the storage into an owned host vector).
    Device(OnDevice<T>),
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

    /// Wraps a backend's device data.
    ///
    /// # Errors
    /// [`Error::Shape`] when its length is not a whole number of `T`s.
    pub fn device(data: Arc<dyn DeviceData>) -> Result<Self> {
        let size = std::mem::size_of::<T>();
        if !data.byte_len().is_multiple_of(size) {
            return Err(Error::shape(
                "Storage::device",
                format!("{} bytes are not whole {size}-byte values", data.byte_len()),
            ));
        }
        Ok(Storage::Device(OnDevice { data, host: OnceLock::new() }))
    }

    /// The device data, when the storage lives on a device.
    pub fn device_data(&self) -> Option<&Arc<dyn DeviceData>> {
        match self {
            Storage::Device(d) => Some(&d.data),
            _ => None,
        }
    }

    /// The device data for a backend about to overwrite it in place: `Some` only when the
    /// storage lives on a device and no clone shares the data. The host copy, if any, is
    /// dropped (it will be stale).
    pub fn device_data_for_write(&mut self) -> Option<&Arc<dyn DeviceData>> {
        let Storage::Device(d) = self else { return None };
        Arc::get_mut(&mut d.data)?;
        d.host = OnceLock::new();
        Some(&d.data)
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

    /// The elements. Device data must have been copied to the host first
    /// ([`Storage::host`]); reading it otherwise is a bug and panics.
    pub fn as_slice(&self) -> &[T] {
        match self {
            Storage::Owned(v) => v,
            Storage::External(m) => bytemuck::cast_slice(m.bytes()),
            Storage::Device(d) => d.fetched(),
        }
    }

    /// The elements, mutably. Device data that was copied to the host becomes an owned
    /// vector (its device data is let go); device data that was not is a bug, as in
    /// [`Storage::as_slice`].
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        if let Storage::Device(d) = self {
            d.fetched();
            let host = std::mem::take(&mut d.host).into_inner().unwrap_or_default();
            *self = Storage::Owned(host);
        }
        match self {
            Storage::Owned(v) => v,
            Storage::External(m) => bytemuck::cast_slice_mut(m.bytes_mut()),
            // Not reached: device data was turned into an owned vector just above.
            Storage::Device(d) => d.host.get_mut().map_or(&mut [], Vec::as_mut_slice),
        }
    }

    /// The elements on the host: device data is copied once, at the first call (later reads,
    /// [`Storage::as_slice`] included, use that copy, and the device data stays).
    ///
    /// # Errors
    /// [`Error::DeviceCopy`] when the copy from the device fails.
    pub fn host(&self) -> Result<&[T]> {
        match self {
            Storage::Device(d) => d.fetch(),
            host => Ok(host.as_slice()),
        }
    }

    /// The elements on the host, mutably: device data is copied and the storage becomes an
    /// owned host vector.
    ///
    /// # Errors
    /// As [`Storage::host`].
    pub fn host_mut(&mut self) -> Result<&mut [T]> {
        self.host()?;
        Ok(self.as_mut_slice())
    }

    /// The elements as bytes.
    pub fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice())
    }

    /// Number of elements (device data is not copied to find out).
    pub fn len(&self) -> usize {
        match self {
            Storage::Device(d) => d.data.byte_len() / std::mem::size_of::<T>(),
            other => other.as_slice().len(),
        }
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

/// Cloning copies the elements into an owned vector (external memory is not shared); device
/// data is shared (a backend writes in place only into data no clone shares).
impl<T: bytemuck::Pod> Clone for Storage<T> {
    fn clone(&self) -> Self {
        match self {
            Storage::Device(d) => {
                Storage::Device(OnDevice { data: d.data.clone(), host: d.host.clone() })
            }
            other => Storage::Owned(other.as_slice().to_vec()),
        }
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
        Ok(Tensor { shape: shape.to_vec(), dtype: DType::F32, storage: Storage::Owned(data) })
    }

    /// A tensor over a backend's device data with `shape`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the data does not hold exactly the shape's f32 elements.
    pub fn from_device(shape: &[usize], data: Arc<dyn DeviceData>) -> Result<Self> {
        Tensor::from_storage(shape, Storage::device(data)?)
    }

    /// The storage mutably, for a backend that writes device data in place (see
    /// [`Storage::device_data_for_write`]) or replaces it.
    pub fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    /// Replaces the data with a backend's device data of the same length.
    ///
    /// # Errors
    /// [`Error::Shape`] when the length differs.
    pub fn set_device_data(&mut self, data: Arc<dyn DeviceData>) -> Result<()> {
        let storage = Storage::device(data)?;
        if storage.len() != self.len() {
            return Err(Error::shape(
                "Tensor::set_device_data",
                format!("{} elements for a tensor of {}", storage.len(), self.len()),
            ));
        }
        self.storage = storage;
        Ok(())
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
        Ok(Tensor { shape: shape.to_vec(), dtype: DType::F32, storage })
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
            storage: self.storage.copy_to(arena)?,
        })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        let n = shape.iter().product();
        Tensor { shape: shape.to_vec(), dtype: DType::F32, storage: Storage::Owned(vec![0.0; n]) }
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

    /// Where the data lives: a device while a backend's output has not been written by the
    /// host, the host otherwise (reading keeps the device data; writing moves it to the host).
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Device(d) => d.data.device(),
            _ => Device::Cpu,
        }
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

    /// The elements in row-major order, of a tensor on the host. A device tensor's data
    /// reaches the host only through [`Tensor::host`], which can fail; reading one that was
    /// not copied is a bug and panics.
    pub fn data(&self) -> &[f32] {
        self.storage.as_slice()
    }

    /// The elements in row-major order, mutably, of a tensor on the host (device data that
    /// [`Tensor::host`] copied moves to the host; see [`Tensor::host_mut`]).
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.storage.as_mut_slice()
    }

    /// Row `i` of the tensor viewed as `[rows, row_len]`, on the host (as [`Tensor::data`]).
    pub fn row(&self, i: usize) -> &[f32] {
        let n = self.row_len();
        &self.data()[i * n..(i + 1) * n]
    }

    /// The elements on the host: a device tensor's data is copied once, at the first call,
    /// and kept beside the device data (so [`Tensor::data`] reads it from then on).
    ///
    /// # Errors
    /// [`Error::DeviceCopy`] when the copy from the device fails (the device is gone).
    pub fn host(&self) -> Result<&[f32]> {
        self.storage.host()
    }

    /// Row `i` on the host (see [`Tensor::host`]).
    ///
    /// # Errors
    /// As [`Tensor::host`].
    pub fn host_row(&self, i: usize) -> Result<&[f32]> {
        let n = self.row_len();
        Ok(&self.host()?[i * n..(i + 1) * n])
    }

    /// The elements on the host, mutably: a device tensor is copied and lives on the host
    /// from then on.
    ///
    /// # Errors
    /// As [`Tensor::host`].
    pub fn host_mut(&mut self) -> Result<&mut [f32]> {
        self.storage.host_mut()
    }

    /// The data, consumed (copied out of external memory or from the device).
    ///
    /// # Errors
    /// As [`Tensor::host`].
    pub fn into_host_vec(self) -> Result<Vec<f32>> {
        match self.storage {
            Storage::Owned(v) => Ok(v),
            other => Ok(other.host()?.to_vec()),
        }
    }

    /// The data, consumed (copied out of external memory), of a tensor on the host (as
    /// [`Tensor::data`]).
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

    /// Entries `range` of the first dimension (tokens, for `[tokens, ...]` activations), as a
    /// new host tensor keeping the other dimensions.
    ///
    /// # Errors
    /// [`Error::Shape`] for a scalar or a range past the first dimension.
    pub fn slice_first(&self, range: std::ops::Range<usize>) -> Result<Tensor> {
        let first = self.shape.first().copied().unwrap_or(0);
        if range.start > range.end || range.end > first {
            return Err(Error::shape(
                "Tensor::slice_first",
                format!("{range:?} of a first dimension of {first} ({:?})", self.shape),
            ));
        }
        let step = self.len() / first.max(1);
        let mut shape = self.shape.clone();
        shape[0] = range.len();
        Tensor::from_vec(&shape, self.data()[range.start * step..range.end * step].to_vec())
    }

    /// `parts` stacked along their first dimension (the inverse of
    /// [`Tensor::slice_first`]).
    ///
    /// # Errors
    /// [`Error::Shape`] when there are no parts or their other dimensions differ.
    pub fn cat_first(parts: &[Tensor]) -> Result<Tensor> {
        let Some(head) = parts.first() else {
            return Err(Error::shape("Tensor::cat_first", "no parts"));
        };
        let inner = &head.shape[1.min(head.shape.len())..];
        if let Some(odd) = parts.iter().find(|p| p.shape.is_empty() || &p.shape[1..] != inner) {
            return Err(Error::shape(
                "Tensor::cat_first",
                format!("parts of shapes {:?} and {:?}", head.shape, odd.shape),
            ));
        }
        let mut shape = head.shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        let mut data = Vec::with_capacity(parts.iter().map(Tensor::len).sum());
        parts.iter().for_each(|p| data.extend_from_slice(p.data()));
        Tensor::from_vec(&shape, data)
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

    #[test]
    fn slices_of_the_first_dimension_stack_back_to_the_whole() {
        let t = Tensor::from_vec(&[4, 2, 3], (0..24).map(|x| x as f32).collect()).unwrap();
        let (a, b) = (t.slice_first(0..1).unwrap(), t.slice_first(1..4).unwrap());
        assert_eq!((a.shape(), b.shape()), (&[1, 2, 3][..], &[3, 2, 3][..]));
        assert_eq!(b.data()[0], 6.0);
        let whole = Tensor::cat_first(&[a, b]).unwrap();
        assert_eq!((whole.shape(), whole.data()), (t.shape(), t.data()));
        assert!(t.slice_first(3..5).is_err());
        let odd = Tensor::zeros(&[1, 3, 2]);
        let err = Tensor::cat_first(&[t, odd]).unwrap_err();
        assert!(err.to_string().contains("[1, 3, 2]"), "{err}");
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

    /// "Device" data held on the host, counting the copies made from it.
    #[derive(Debug)]
    struct FakeDevice {
        values: Vec<f32>,
        downloads: Arc<std::sync::atomic::AtomicUsize>,
        fail: bool,
    }

    impl FakeDevice {
        fn new(values: Vec<f32>) -> Arc<FakeDevice> {
            Arc::new(FakeDevice { values, downloads: Default::default(), fail: false })
        }
    }

    impl DeviceData for FakeDevice {
        fn device(&self) -> Device {
            Device::Cuda(3)
        }
        fn byte_len(&self) -> usize {
            4 * self.values.len()
        }
        fn download(&self, out: &mut [u8]) -> std::result::Result<(), String> {
            if self.fail {
                return Err("device lost".into());
            }
            self.downloads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            out.copy_from_slice(bytemuck::cast_slice(&self.values));
            Ok(())
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    /// Device data is copied to the host once, by the first [`Tensor::host`]; shape queries
    /// never copy; clones share it (so it is not writable in place until they are gone); a
    /// write moves the tensor to the host.
    #[test]
    fn device_data_is_copied_to_the_host_once_by_the_first_host_call() {
        let dev = FakeDevice::new(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let counter = dev.downloads.clone();
        let downloads = || counter.load(std::sync::atomic::Ordering::SeqCst);
        let mut t = Tensor::from_device(&[2, 3], dev).unwrap();
        assert_eq!((t.len(), t.rows(), t.row_len(), t.device()), (6, 2, 3, Device::Cuda(3)));
        let t2 = t.clone().reshape(&[3, 2]).unwrap();
        assert_eq!(downloads(), 0, "shapes, clones and reshapes do not copy");
        assert!(t.storage_mut().device_data_for_write().is_none(), "a clone shares the data");
        drop(t2);
        assert!(t.storage_mut().device_data_for_write().is_some());
        assert_eq!(t.host_row(1).unwrap(), &[4.0, 5.0, 6.0]);
        assert_eq!(t.data(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "data() reads the copy");
        assert_eq!(t.host().unwrap(), t.data());
        assert_eq!(downloads(), 1);
        assert_eq!(t.device(), Device::Cuda(3), "reading keeps the device data");
        // Writing in place drops the host copy: the next read copies again.
        assert!(t.storage_mut().device_data_for_write().is_some());
        assert_eq!(t.host().unwrap()[0], 1.0);
        assert_eq!(downloads(), 2);
        t.data_mut()[0] = 9.0;
        assert_eq!(t.device(), Device::Cpu);
        assert_eq!(t.data(), &[9.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert!(t.storage().device_data().is_none());
        assert_eq!(downloads(), 2);

        let err = Tensor::from_device(&[4], FakeDevice::new(vec![0.0; 3])).unwrap_err();
        assert!(err.to_string().contains("needs 4 elements, storage has 3"), "{err}");
        let mut t = Tensor::zeros(&[3]);
        t.set_device_data(FakeDevice::new(vec![7.0; 3])).unwrap();
        assert_eq!((t.device(), t.host_mut().unwrap()), (Device::Cuda(3), &mut [7.0; 3][..]));
        assert_eq!(t.device(), Device::Cpu, "host_mut moves the tensor to the host");
        let err = t.set_device_data(FakeDevice::new(vec![7.0; 2])).unwrap_err();
        assert!(err.to_string().contains("2 elements for a tensor of 3"), "{err}");
        let t = Tensor::from_device(&[2], FakeDevice::new(vec![1.0, 2.0])).unwrap();
        assert_eq!(t.into_host_vec().unwrap(), vec![1.0, 2.0]);
    }

    /// Device data that no call copied is not read behind the caller's back: `data()` on it
    /// is a bug, named as one (not a download that could fail inside an infallible call).
    #[test]
    fn device_data_is_not_copied_implicitly() {
        let dev = FakeDevice::new(vec![1.0, 2.0]);
        let counter = dev.downloads.clone();
        let t = Tensor::from_device(&[2], dev).unwrap();
        let read = std::panic::AssertUnwindSafe(|| t.data().to_vec());
        let got = std::panic::catch_unwind(read).unwrap_err();
        let msg = got.downcast_ref::<String>().cloned().unwrap_or_default();
        assert_eq!(
            msg,
            "a tensor on cuda:3 was read on the host before Tensor::host copied it there"
        );
        assert_eq!(counter.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    /// A failed copy from the device is an error that says which device and why.
    #[test]
    fn a_lost_device_is_named_when_its_data_is_copied() {
        let dev = Arc::new(FakeDevice {
            values: vec![0.0; 2],
            downloads: Default::default(),
            fail: true,
        });
        let mut t = Tensor::from_device(&[2], dev).unwrap();
        let want = "copying a tensor from cuda:3 to the host failed: device lost";
        assert_eq!(t.host().unwrap_err().to_string(), want);
        assert_eq!(t.host_row(0).unwrap_err().to_string(), want);
        assert_eq!(t.host_mut().unwrap_err().to_string(), want);
        assert_eq!(t.device(), Device::Cuda(3), "a failed copy leaves the tensor as it was");
    }

    #[test]
    fn reshape_keeps_data_and_rejects_bad_sizes() {
        let t = Tensor::zeros(&[4, 3]);
        assert_eq!(t.clone().reshape(&[2, 6]).unwrap().shape(), &[2, 6]);
        assert!(t.reshape(&[5]).is_err());
    }
}
