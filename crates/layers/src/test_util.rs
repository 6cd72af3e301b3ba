//! Helpers shared by the kernel tests: deterministic random data and tolerant comparison.

/// `n` pseudo-random values in [-1, 1) from a fixed seed (xorshift; no dependency needed).
pub(crate) fn random_vec(n: usize, seed: u64) -> Vec<f32> {
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

/// Asserts `got` and `want` agree element-wise within `tol` relative to max(1, |want|).
pub(crate) fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= tol * w.abs().max(1.0) || (g.is_infinite() && g == w);
        assert!(ok, "element {i}: got {g}, want {w}");
    }
}

/// A fresh path in the system temp folder, unique per process and call.
pub(crate) fn temp_path(stem: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("tpctl-layers-{}-{n}-{stem}", std::process::id()))
}

/// `a[m, k] · w[n, k]ᵀ` summed in f64: the reference the matrix products are checked against.
pub(crate) fn naive_matmul_nt(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
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
pub(crate) struct FakeDeviceMemory(pub(crate) usize);

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
