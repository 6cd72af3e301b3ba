//! Helpers for the tests of this crate and of the crates above it: deterministic random data,
//! tolerant comparison, temporary paths, a reference matrix product, fake device memory and the GPU backend when
//! the machine has one. Nothing in production code calls them.

use crate::kernels::{Backend, CudaBackend, GemmDtype};

/// `n` pseudo-random values in [-1, 1) from a fixed seed (xorshift; no dependency needed).
pub fn random_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The CPU backend with `threads` threads handing every output out as device data, as the
/// CUDA backend does (see [`crate::kernels::cpu::CpuBackend::with_device_outputs`]): code
/// that reads an output on the host without [`crate::Tensor::host`] panics under it.
///
/// # Panics
/// When the threads cannot be spawned.
pub fn cpu_with_device_outputs(threads: usize) -> Backend {
    let cpu = crate::kernels::cpu::CpuBackend::with_device_outputs(threads);
    Backend::Cpu(cpu.expect("spawning the CPU backend's threads"))
}

/// [`cpu_with_device_outputs`] whose outputs inside a model step ([`Backend::step`]) are
/// placed in slots of one host buffer per step shape, at the offsets the CUDA backend's step
/// workspace plans (see [`crate::kernels::workspace`] and
/// [`crate::kernels::cpu::CpuBackend::with_planned_device_outputs`]): a plan that handed out a
/// slot over a tensor still in use would change that tensor's values.
///
/// # Panics
/// When the threads cannot be spawned.
pub fn cpu_with_planned_device_outputs(threads: usize) -> Backend {
    let cpu = crate::kernels::cpu::CpuBackend::with_planned_device_outputs(threads);
    Backend::Cpu(cpu.expect("spawning the CPU backend's threads"))
}

/// Asserts `got` and `want` agree element-wise within `tol` relative to max(1, |want|).
///
/// # Panics
/// When they differ in length or in any element.
pub fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= tol * w.abs().max(1.0) || (g.is_infinite() && g == w);
        assert!(ok, "element {i}: got {g}, want {w}");
    }
}

/// Asserts `|a - b|` is at most `tol` times the largest `|b|`, naming `what` when not.
///
/// # Panics
/// When they differ in length or by more.
pub fn assert_rel(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    assert!(err < tol, "{what}: off by {err} relative");
}

/// A fresh path in the system temp folder, unique per process and call.
pub fn temp_path(stem: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("tpctl-test-{}-{n}-{stem}", std::process::id()))
}

/// `a[m, k] · w[n, k]ᵀ` summed in f64: the reference the matrix products are checked against.
pub fn naive_matmul_nt(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|p| f64::from(a[i * k + p]) * f64::from(w[j * k + p]))
                .sum::<f64>() as f32;
        }
    }
    out
}

/// Device memory that is never touched: only its size matters to the checks that get it.
#[derive(Debug)]
pub struct FakeDeviceMemory(pub usize);

// SAFETY: it breaks the contract on purpose and is sound only in the tests that use it: they
// give it to the size and layout checks that run before any kernel, never to a backend that
// would copy into it or launch on it.
#[allow(unsafe_code)]
unsafe impl mesh::DeviceMemory for FakeDeviceMemory {
    fn device_ptr(&self) -> u64 {
        0x1000
    }
    fn size(&self) -> usize {
        self.0
    }
    fn device(&self) -> mesh::Device {
        mesh::Device::Cuda(0)
    }
}

/// Whether `TPCTL_REQUIRE_GPU=1` asks GPU tests to fail rather than skip without a GPU.
pub fn gpu_required() -> bool {
    std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The CUDA backend on device 0, or `None` (with a note) when there is no usable GPU.
///
/// # Panics
/// Without a usable GPU when [`gpu_required`].
pub fn gpu() -> Option<Backend> {
    match Backend::cuda(0) {
        Ok(be) => Some(be),
        Err(e) => {
            assert!(!gpu_required(), "TPCTL_REQUIRE_GPU=1 but the cuda backend is unusable: {e}");
            eprintln!("note: skipping a GPU test, the cuda backend is unusable: {e}");
            None
        }
    }
}

/// The CUDA backend on device 0 keeping weights in `dtype`, when there is a usable GPU.
///
/// # Panics
/// As [`gpu`], or when the backend is usable in f32 but not in `dtype`.
pub fn gpu_in(dtype: GemmDtype) -> Option<Backend> {
    gpu()?;
    Some(Backend::cuda_with(0, dtype).unwrap())
}

/// The CUDA backend of `be`.
///
/// # Panics
/// When `be` is not a CUDA backend.
pub fn cuda_of(be: &Backend) -> &CudaBackend {
    match be {
        Backend::Cuda(c) => c,
        Backend::Cpu(_) => panic!("not a cuda backend"),
    }
}
