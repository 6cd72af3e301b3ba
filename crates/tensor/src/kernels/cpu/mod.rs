//! CPU kernels on plain slices, and [`CpuBackend`], which runs them on a per-rank thread pool.
//!
//! The slice functions are the reference semantics of every op; the CUDA backend will
//! implement the same ops on device memory.

pub mod activation;
pub mod attention;
mod decode_attention;
pub mod matmul;
pub mod matvec;
pub mod norm;
#[cfg(target_arch = "x86_64")]
mod qdot_avx2;
#[cfg(target_arch = "x86_64")]
mod qdot_avx512;
pub mod qmatrix;
pub mod quant;
pub mod rope;
pub mod sgemm;
mod shared_out;

use super::workspace::{Placement, Slot, StepMemory, Tracked};
use super::Weight;
use crate::error::{Error, Result};
use crate::tensor::{Device, DeviceData, Tensor};
use std::sync::{Arc, Mutex};

/// Host memory standing for a step workspace on a device (see
/// [`CpuBackend::with_planned_device_outputs`]).
type HostWorkspace = Mutex<Vec<f32>>;

/// Runs CPU kernels on its own rayon pool of a fixed size, so each rank (or each test) decides
/// how many cores it uses regardless of what else runs in the process.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    /// Hand every output out as device data (see [`CpuBackend::with_device_outputs`]).
    device_outputs: bool,
    /// Place those outputs as a device backend's step workspace would (see
    /// [`CpuBackend::with_planned_device_outputs`]).
    planned: Option<Arc<Mutex<StepMemory<HostWorkspace>>>>,
    /// Leading activation rows that are each one sequence's single new token (see
    /// [`crate::Backend::for_step`]).
    pub(crate) single_rows: usize,
}

impl CpuBackend {
    /// A backend with `threads` worker threads (at least 1).
    ///
    /// # Errors
    /// [`Error::ThreadPool`] when the threads cannot be spawned.
    pub fn new(threads: usize) -> Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("layers-cpu-{i}"))
            .build()
            .map_err(|e| Error::ThreadPool { threads, message: e.to_string() })?;
        Ok(CpuBackend {
            pool: Arc::new(pool),
            threads,
            device_outputs: false,
            planned: None,
            single_rows: 0,
        })
    }

    /// A backend that computes on the CPU but hands every output out as device data, as the
    /// CUDA backend does: code above it that reads an output on the host without
    /// [`Tensor::host`] fails (a test aid; see `test_util::cpu_with_device_outputs`).
    ///
    /// # Errors
    /// As [`CpuBackend::new`].
    pub fn with_device_outputs(threads: usize) -> Result<Self> {
        Ok(CpuBackend { device_outputs: true, ..CpuBackend::new(threads)? })
    }

    /// [`CpuBackend::with_device_outputs`] whose outputs inside a step
    /// ([`crate::Backend::step`]) are placed as the CUDA backend places its buffers: in slots
    /// of one host buffer per step shape, at the offsets planned from the shape's first step
    /// (see [`crate::kernels::workspace`]). A slot handed out while a tensor in the bytes
    /// it overlaps is still read would change that tensor's values, so model steps on this
    /// backend check the plans with real data (a test aid; see
    /// `test_util::cpu_with_planned_device_outputs`).
    ///
    /// # Errors
    /// As [`CpuBackend::new`].
    pub fn with_planned_device_outputs(threads: usize) -> Result<Self> {
        let planned = Some(Arc::new(Mutex::new(StepMemory::default())));
        Ok(CpuBackend { planned, ..CpuBackend::with_device_outputs(threads)? })
    }

    /// Runs `f` on the step memory of a backend that plans its outputs (`None` for others).
    pub(crate) fn with_step_memory<R>(
        &self,
        f: impl FnOnce(&mut StepMemory<HostWorkspace>) -> R,
    ) -> Option<R> {
        let planned = self.planned.as_ref()?;
        Some(f(&mut planned.lock().unwrap_or_else(|e| e.into_inner())))
    }

    /// `t` as this backend hands its outputs out: as it is, or behind the device-data seam
    /// (in a planned slot, for a backend that plans them).
    pub(crate) fn output(&self, t: Tensor) -> Result<Tensor> {
        if !self.device_outputs {
            return Ok(t);
        }
        let shape = t.shape().to_vec();
        let values = t.into_host_vec()?;
        let bytes = std::mem::size_of_val(values.as_slice());
        let make = |bytes: usize| Ok::<_, ()>(Mutex::new(vec![0f32; bytes / 4]));
        let data = match self.with_step_memory(|m| m.place(bytes, make)) {
            Some(Placement::Slot(slot)) => {
                let at = slot.offset() / 4;
                let mut ws = slot.workspace().lock().unwrap_or_else(|e| e.into_inner());
                ws[at..at + values.len()].copy_from_slice(&values);
                drop(ws);
                HeldAsDevice::Slot { slot, len: values.len() }
            }
            Some(Placement::Own(tracked)) => HeldAsDevice::Own { values, _tracked: tracked },
            None => HeldAsDevice::Own { values, _tracked: None },
        };
        Tensor::from_device(&shape, Arc::new(data))
    }

    /// Runs `f` on `x`'s elements on the host, then hands `x` out as [`CpuBackend::output`].
    pub(crate) fn in_place<R>(&self, x: &mut Tensor, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
        let r = f(x.host_mut()?);
        if self.device_outputs {
            *x = self.output(std::mem::replace(x, Tensor::zeros(&[0])))?;
        }
        Ok(r)
    }

    /// This backend for a step whose first `single_rows` rows are decode rows (see
    /// [`crate::Backend::for_step`]).
    pub(crate) fn for_step(&self, single_rows: usize) -> Self {
        CpuBackend { single_rows, ..self.clone() }
    }

    /// The number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` inside this backend's pool (rayon calls in `f` use its threads).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

/// Products of up to this many rows (short prompt chunks) multiply the weights directly, as
/// the single rows of a step always do (see [`Backend::for_step`]): each weight row is read
/// once and used for every row of the batch, f32 weights as they are and quantized ones
/// dequantized in registers, and a row's result does not depend on the other rows. Larger
/// ones (prompt chunks) use a blocked product (quantized weights dequantized once per
/// panel): [`cpu::sgemm`] with AVX-512, the `gemm` crate without; its rows' results do not
/// depend on the other rows either, but differ from the direct kernels' in summation order.
pub(crate) const SMALL_BATCH_MAX_ROWS: usize = 32;

/// `out[m, n] = x[m, k] · wᵀ` on the current rayon pool: with the direct kernels when
/// `direct` or `m <= SMALL_BATCH_MAX_ROWS`, else with the blocked product.
pub(crate) fn linear_rows(
    w: &Weight,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    direct: bool,
    threads: usize,
) -> Result<()> {
    if m == 0 {
        return Ok(());
    }
    let (n, k) = w.dims();
    let direct = direct || m <= SMALL_BATCH_MAX_ROWS;
    match w {
        Weight::F32(wt) if direct => matvec::matmul_rows(wt.data(), x, m, out),
        Weight::F32(wt) => {
            if !sgemm::matmul_nt_avx512(x, wt.data(), out, m, n, k) {
                matmul::matmul_nt(x, wt.data(), out, m, n, k, threads)?;
            }
        }
        Weight::Quant(wq) if direct => qmatrix::qmatmul(wq, x, m, out),
        Weight::Quant(wq) => {
            // Each GEMM panel dequantizes its own rows: no f32 copy of the matrix.
            let row = |j: usize, dst: &mut [f32]| wq.dequantize_row(j, dst);
            if !sgemm::matmul_nt_rows_avx512(x, &row, out, m, n, k) {
                let wt = wq.dequantize();
                matmul::matmul_nt(x, &wt, out, m, n, k, threads)?;
            }
        }
    }
    Ok(())
}

/// Host memory behind the device-data seam: the outputs of
/// [`CpuBackend::with_device_outputs`], in their own vector or in a slot of a planned step
/// workspace.
enum HeldAsDevice {
    Own { values: Vec<f32>, _tracked: Option<Tracked> },
    Slot { slot: Slot<HostWorkspace>, len: usize },
}

impl std::fmt::Debug for HeldAsDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeldAsDevice::Own { values, .. } => write!(f, "HeldAsDevice({} floats)", values.len()),
            HeldAsDevice::Slot { slot, len } => {
                write!(f, "HeldAsDevice({len} floats at byte {} of a workspace)", slot.offset())
            }
        }
    }
}

impl DeviceData for HeldAsDevice {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn byte_len(&self) -> usize {
        4 * match self {
            HeldAsDevice::Own { values, .. } => values.len(),
            HeldAsDevice::Slot { len, .. } => *len,
        }
    }

    fn download(&self, out: &mut [u8]) -> std::result::Result<(), String> {
        match self {
            HeldAsDevice::Own { values, .. } => out.copy_from_slice(bytemuck::cast_slice(values)),
            HeldAsDevice::Slot { slot, len } => {
                let at = slot.offset() / 4;
                let ws = slot.workspace().lock().unwrap_or_else(|e| e.into_inner());
                out.copy_from_slice(bytemuck::cast_slice(&ws[at..at + len]));
            }
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
