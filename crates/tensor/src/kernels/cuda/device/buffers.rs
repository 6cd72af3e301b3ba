//! Tensors and device buffers: the buffers kernels write ([`StepBuf`]: from the driver's pool
//! or a step workspace's slot), a backend's outputs ([`DeviceBuf`]), the device address of an
//! input (read in place or uploaded), buffers written in place, and host copies.

use super::graphs::Call;
use super::{Count, CudaBackend, Inner, OrUnavailable};
use crate::error::{Error, Result};
use crate::kernels::workspace::{Placement, Slot, Tracked};
use crate::tensor::{DeviceData, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use mesh::DeviceMemory;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A buffer of `len` elements of `T` that kernels write, at device address `ptr`: the
/// backend's own allocation from the driver's pool, or a slot of the step's workspace (see
/// [`crate::kernels::workspace`]). Either is given back in stream order when dropped.
pub(super) struct StepBuf<T> {
    pub(super) ptr: u64,
    len: usize,
    _mem: StepMem<T>,
}

/// What keeps a [`StepBuf`]'s memory.
enum StepMem<T> {
    /// An allocation of the driver's pool, and the recording of the step it belongs to.
    Pool(#[allow(dead_code)] CudaSlice<T>, #[allow(dead_code)] Option<Tracked>),
    /// A slot of a step workspace.
    Slot(#[allow(dead_code)] Slot<CudaSlice<u8>>),
}

impl<T> StepBuf<T> {
    /// Elements.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// A device address for a kernel, with what keeps its memory alive while the caller queues its
/// work: an upload made for the call (`K`), or nothing (a buffer someone else holds, a staged
/// input at its fixed address).
pub(super) struct Input<K = CudaSlice<f32>> {
    pub(super) ptr: u64,
    _keep: Option<K>,
}

impl<K> Input<K> {
    /// An address whose memory someone else keeps.
    pub(super) fn at(ptr: u64) -> Input<K> {
        Input { ptr, _keep: None }
    }

    /// An address in `keep`, kept alive with it.
    pub(super) fn kept(ptr: u64, keep: K) -> Input<K> {
        Input { ptr, _keep: Some(keep) }
    }
}

/// An output of a [`CudaBackend`]: its buffer and the backend whose stream writes it, and
/// the same values rounded to bf16 when the kernel that wrote them also wrote those (the input
/// of a bf16 product, which then needs no rounding launch of its own); dropped when the buffer
/// is written in place.
struct DeviceBuf {
    buf: StepBuf<f32>,
    owner: Arc<Inner>,
    half: Mutex<Option<StepBuf<u16>>>,
}

impl fmt::Debug for DeviceBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuf")
            .field("ordinal", &self.owner.ordinal)
            .field("len", &self.buf.len())
            .finish()
    }
}

impl DeviceData for DeviceBuf {
    fn device(&self) -> crate::tensor::Device {
        crate::tensor::Device::Cuda(self.owner.ordinal)
    }

    fn byte_len(&self) -> usize {
        4 * self.buf.len()
    }

    fn download(&self, out: &mut [u8]) -> std::result::Result<(), String> {
        let stream = &self.owner.stream;
        stream.context().bind_to_thread().map_err(|e| e.to_string())?;
        let src = self.buf.ptr;
        let n = out.len().min(self.byte_len());
        self.owner.count(Count::Download);
        // SAFETY: `src` holds byte_len bytes of this stream's device; `out` is a live host
        // slice, and the stream is synchronized before it is returned to the caller.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out[..n], src, stream.cu_stream())
        }
        .map_err(|e| e.to_string())?;
        self.owner.sync("copying a tensor to the host").map_err(|e| e.to_string())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl CudaBackend {
    /// A device copy of `host`.
    pub(super) fn upload<T: DeviceRepr>(&self, op: &str, host: &[T]) -> Result<CudaSlice<T>> {
        self.count(Count::Allocation);
        self.count(Count::Upload);
        self.stream().clone_htod(host).or_unavailable(|| format!("{op}: copying to the device"))
    }

    /// A device buffer of `len` zeros.
    pub(super) fn zeros(&self, op: &str, len: usize) -> Result<CudaSlice<f32>> {
        self.count(Count::Allocation);
        self.count(Count::DeviceCopy);
        self.stream().alloc_zeros(len).or_unavailable(|| format!("{op}: allocating {len} floats"))
    }

    /// A device buffer of `len` floats for an output that the next kernel or cuBLAS call
    /// writes whole: no memset (one launch fewer per op). Its contents are unspecified until
    /// then; every caller says in its SAFETY note why each element is written.
    pub(super) fn output_buf(&self, op: &str, len: usize) -> Result<StepBuf<f32>> {
        self.step_buf(op, len)
    }

    /// A buffer of `len` elements of `T` that the caller's next launch writes whole, in a slot
    /// of the step's workspace when the step's plan has one for it, else from the driver's
    /// pool (see [`StepBuf`]). Its contents are unspecified until then; every caller says in
    /// its SAFETY note why each element is written.
    pub(super) fn step_buf<T: DeviceRepr>(&self, op: &str, len: usize) -> Result<StepBuf<T>> {
        let bytes = len * std::mem::size_of::<T>();
        let make = |bytes: usize| {
            self.count(Count::Allocation);
            // SAFETY: a workspace is only carved into slots, each handed to launches that
            // write it before any read (each caller of `step_buf`).
            unsafe { self.stream().alloc::<u8>(bytes) }
        };
        let placed = self.workspace().place(bytes, make);
        let tracked = match placed {
            Placement::Slot(slot) => {
                let ptr = self.addr(slot.workspace()) + slot.offset() as u64;
                return Ok(StepBuf { ptr, len, _mem: StepMem::Slot(slot) });
            }
            Placement::Own(tracked) => tracked,
        };
        self.count(Count::Allocation);
        // SAFETY: an unwritten device buffer is never read on the host: it is handed only to
        // the launch that writes it (each caller), in stream order before any read.
        let buf = unsafe { self.stream().alloc::<T>(len) }
            .or_unavailable(|| format!("{op}: allocating {len} elements"))?;
        Ok(StepBuf { ptr: self.addr(&buf), len, _mem: StepMem::Pool(buf, tracked) })
    }

    /// `buf`, an allocation made outside the step's plan (an upload), as a [`StepBuf`].
    fn unplanned<T>(&self, buf: CudaSlice<T>) -> StepBuf<T> {
        StepBuf { ptr: self.addr(&buf), len: buf.len(), _mem: StepMem::Pool(buf, None) }
    }

    /// Copies `host.len()` elements at device address `src` into `host` and waits for the
    /// stream.
    pub(super) fn download<T: DeviceRepr>(
        &self,
        op: &str,
        src: &StepBuf<T>,
        host: &mut [T],
    ) -> Result<()> {
        debug_assert!(host.len() <= src.len());
        self.bind(op)?;
        let stream = self.stream();
        self.count(Count::Download);
        // SAFETY: `src` holds at least host.len() elements of this stream's device, alive
        // while borrowed here; `host` is a live host slice, and the stream is synchronized
        // before it is returned to the caller.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, src.ptr, stream.cu_stream()) }
            .or_unavailable(|| format!("{op}: copying to the host"))?;
        self.inner.sync(op)
    }

    /// The device address of `s`, for raw calls on the backend's stream. The slice must
    /// outlive the work queued with the address; dropping it is enough, as a slice is freed in
    /// stream order, after the work queued before.
    pub(super) fn addr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(self.stream()).0
    }

    /// The address of memory someone else owns, checked to be of this backend's device (what
    /// [`DeviceMemory`] promises beyond that is its implementation's contract).
    pub(super) fn owned_addr(&self, op: &str, mem: &dyn DeviceMemory) -> Result<u64> {
        let want = mesh::Device::Cuda(self.inner.ordinal);
        if mem.device() != want {
            return Err(Error::WrongDevice { op: op.to_owned(), got: mem.device(), want });
        }
        Ok(mem.device_ptr())
    }

    /// Copies `src` to device address `dst` and waits for the copy.
    ///
    /// # Safety
    /// `dst..dst + 4·src.len()` is device memory of this backend's context that nothing else
    /// uses while the copy runs.
    pub(super) unsafe fn copy_to_addr<T: DeviceRepr>(
        &self,
        op: &str,
        dst: u64,
        src: &[T],
    ) -> Result<()> {
        self.bind(op)?;
        let stream = self.stream();
        self.count(Count::Upload);
        // SAFETY: the caller vouches for the destination; `src` is a live host slice and the
        // stream is synchronized before it can be dropped.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .or_unavailable(|| format!("{op}: copying {} values to the device", src.len()))?;
        self.inner.sync(op)
    }

    /// The device address of `t`'s elements for a kernel to read: its own device buffer when
    /// it is this backend's output (read in place), else a copy uploaded for the call (device
    /// data of another backend goes through the host). The returned [`Input`] keeps an upload
    /// alive; the caller keeps `t` borrowed while queuing the work.
    pub(super) fn input(&self, op: &str, t: &Tensor) -> Result<Input> {
        if let Some(buf) = self.own(t.storage().device_data()) {
            return Ok(Input::at(buf.ptr));
        }
        let staged = self.upload(op, t.host()?)?;
        Ok(Input::kept(self.addr(&staged), staged))
    }

    /// `data`'s buffer when it is an output of this backend (same stream, so no ordering to add).
    pub(super) fn own<'a>(
        &self,
        data: Option<&'a Arc<dyn DeviceData>>,
    ) -> Option<&'a StepBuf<f32>> {
        let buf = data?.as_any().downcast_ref::<DeviceBuf>()?;
        Arc::ptr_eq(&buf.owner, &self.inner).then_some(&buf.buf)
    }

    /// The device address of `t`'s elements for a kernel to overwrite in place: its own buffer
    /// when it is this backend's output and no clone shares it, else a fresh device copy that
    /// becomes `t`'s data. Either way `t` is device data whose host copy is gone.
    pub(super) fn writable(&self, op: &str, t: &mut Tensor) -> Result<u64> {
        let data = t.storage_mut().device_data_for_write();
        if let Some(buf) = self.own(data) {
            // The rounded copy would no longer be these values.
            if let Some(d) = data.and_then(|d| d.as_any().downcast_ref::<DeviceBuf>()) {
                d.half.lock().unwrap_or_else(|e| e.into_inner()).take();
            }
            return Ok(buf.ptr);
        }
        let buf = match self.own(t.storage().device_data()) {
            Some(shared) => {
                let copy = self.step_buf::<f32>(op, shared.len())?;
                self.bind(op)?;
                let call = Call::Copy { dst: copy.ptr, src: shared.ptr, bytes: 4 * shared.len() };
                // SAFETY: both are buffers of this stream's device of `shared.len()` floats,
                // alive while queued work uses them (stream-ordered frees); the copy is fresh,
                // so they do not overlap.
                unsafe { self.issue(op, call) }?;
                copy
            }
            None => self.unplanned(self.upload(op, t.host()?)?),
        };
        let ptr = buf.ptr;
        t.set_device_data(self.wrap(buf))?;
        Ok(ptr)
    }

    /// `buf` as tensor data that stays on the device until the host reads it.
    fn wrap(&self, buf: StepBuf<f32>) -> Arc<dyn DeviceData> {
        Arc::new(DeviceBuf { buf, owner: self.inner.clone(), half: Mutex::new(None) })
    }

    /// A tensor of `shape` over the output `buf`.
    pub(super) fn output(&self, shape: &[usize], buf: StepBuf<f32>) -> Result<Tensor> {
        Tensor::from_device(shape, self.wrap(buf))
    }

    /// A buffer for `len` outputs rounded to bf16 beside their f32 values, when this backend's
    /// products take bf16 (else none: the kernel is passed a null pointer).
    pub(super) fn half_buf(&self, op: &str, len: usize) -> Result<Option<StepBuf<u16>>> {
        if self.inner.dtype != crate::kernels::GemmDtype::Bf16 || len == 0 {
            return Ok(None);
        }
        // Handed only to the launch that writes every element of it (each caller), in stream
        // order before any read.
        Ok(Some(self.step_buf(op, len)?))
    }

    /// The device address of `half` for a kernel (0, a null pointer, for none).
    pub(super) fn half_addr(&self, half: &Option<StepBuf<u16>>) -> u64 {
        half.as_ref().map_or(0, |h| h.ptr)
    }

    /// A tensor of `shape` over the output `buf`, with `half`, its values rounded to bf16 by
    /// the same launch (see [`DeviceBuf`]).
    pub(super) fn output_with_half(
        &self,
        shape: &[usize],
        buf: StepBuf<f32>,
        half: Option<StepBuf<u16>>,
    ) -> Result<Tensor> {
        let data = DeviceBuf { buf, owner: self.inner.clone(), half: Mutex::new(half) };
        Tensor::from_device(shape, Arc::new(data))
    }

    /// Runs `f` with the device address of `t`'s values rounded to bf16 when an output of this
    /// backend carries them (see [`DeviceBuf`]), else with `None`; the rounded copy stays
    /// alive (and unchanged) while `f` queues work on it.
    pub(super) fn with_half<R>(&self, t: &Tensor, f: impl FnOnce(Option<u64>) -> R) -> R {
        let buf = t.storage().device_data().and_then(|d| d.as_any().downcast_ref::<DeviceBuf>());
        match buf.filter(|b| Arc::ptr_eq(&b.owner, &self.inner)) {
            Some(b) => {
                let half = b.half.lock().unwrap_or_else(|e| e.into_inner());
                f(half.as_ref().map(|h| h.ptr))
            }
            None => f(None),
        }
    }
}
