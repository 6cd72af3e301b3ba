//! Matrix multiplication through the `gemm` crate: `out[m, n] = a[m, k] · w[n, k]ᵀ`.
//!
//! This is the one module of the crate with `unsafe`: `gemm::gemm` is an `unsafe fn` taking raw
//! pointers and strides. The safe wrapper below checks every length before the call, so the
//! pointers it passes always cover the strided ranges gemm reads and writes.
#![allow(unsafe_code)]

use crate::error::{Error, Result};

/// `out[m, n] = a[m, k] · w[n, k]ᵀ` (weights stored row-major as `[out_features, in_features]`),
/// f32 accumulation, run on `threads` threads of the current rayon pool (1 = this thread only).
///
/// # Errors
/// [`Error::Shape`] when a slice length does not match `m`, `n`, `k`.
pub fn matmul_nt(
    a: &[f32],
    w: &[f32],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) -> Result<()> {
    if a.len() != m * k || w.len() != n * k || out.len() != m * n {
        return Err(Error::shape(
            "matmul",
            format!(
                "a {} (want {m}x{k}), w {} (want {n}x{k}), out {} (want {m}x{n})",
                a.len(),
                w.len(),
                out.len()
            ),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let parallelism =
        if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let (n_i, k_i) = (n as isize, k as isize);
    // SAFETY: the lengths were checked above: `a` holds m×k elements read with column stride 1
    // and row stride k; `w` holds n×k elements, read as the k×n matrix wᵀ (row stride 1, column
    // stride k); `out` holds m×n elements written with column stride 1 and row stride n. The
    // three slices are distinct borrows (out is `&mut`), so nothing aliases, and `read_dst` is
    // false so the prior contents of `out` are never read.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n_i,
            false,
            a.as_ptr(),
            1,
            k_i,
            w.as_ptr(),
            k_i,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_close, random_vec};

    fn naive(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * w[j * k + p]).sum();
            }
        }
        out
    }

    #[test]
    fn matches_naive_on_odd_shapes_and_thread_counts() {
        for &(m, n, k) in &[(1, 1, 1), (3, 5, 7), (17, 33, 65), (64, 48, 96)] {
            let a = random_vec(m * k, 1);
            let w = random_vec(n * k, 2);
            let want = naive(&a, &w, m, n, k);
            for threads in [1, 2] {
                let mut out = vec![f32::NAN; m * n];
                matmul_nt(&a, &w, &mut out, m, n, k, threads).unwrap();
                assert_close(&out, &want, 1e-4);
            }
        }
    }

    #[test]
    fn rejects_bad_lengths() {
        let err = matmul_nt(&[0.0; 6], &[0.0; 6], &mut [0.0; 5], 2, 2, 3, 1).unwrap_err();
        assert!(err.to_string().contains("want 2x2"), "{err}");
    }
}
