//! Matrix multiplication through the `gemm` crate: `out[m, n] = a[m, k] · w[n, k]ᵀ`.
//!
//! One of the two modules of the crate with `unsafe` (the other is `mmap`): `gemm::gemm` is an
//! `unsafe fn` taking raw pointers and strides. The safe wrappers below check every length and
//! stride before the call, so the pointers they pass always cover the ranges gemm reads and
//! writes.
#![allow(unsafe_code)]

use crate::error::{Error, Result};

/// A read-only matrix view into a slice: element `(r, c)` is
/// `data[offset + r * row_stride + c * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// The backing elements.
    pub data: &'a [f32],
    /// Index of element `(0, 0)`.
    pub offset: usize,
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major matrix with rows of `cols` elements.
    pub fn row_major(data: &'a [f32], cols: usize) -> Self {
        MatRef { data, offset: 0, row_stride: cols, col_stride: 1 }
    }

    /// Whether every element of a `rows × cols` view lies inside `data`.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows - 1)
            .checked_mul(self.row_stride)
            .and_then(|r| (cols - 1).checked_mul(self.col_stride).and_then(|c| r.checked_add(c)))
            .and_then(|rc| rc.checked_add(self.offset));
        last.is_some_and(|l| l < self.data.len())
            && isize::try_from(self.row_stride).is_ok()
            && isize::try_from(self.col_stride).is_ok()
    }
}

/// `out[m, n] = a[m, k] · b[k, n]` for strided views `a` and `b`, written row-major into `out`
/// with rows `out_row_stride` apart (at least `n`), f32 accumulation, on `threads` threads of
/// the current rayon pool (1 = this thread only).
///
/// # Errors
/// [`Error::Shape`] when a view or `out` does not cover its matrix.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided(
    a: MatRef<'_>,
    b: MatRef<'_>,
    out: &mut [f32],
    out_row_stride: usize,
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) -> Result<()> {
    let out_ok =
        m == 0 || n == 0 || (out_row_stride >= n && (m - 1) * out_row_stride + n <= out.len());
    if !a.covers(m, k) || !b.covers(k, n) || !out_ok || isize::try_from(out_row_stride).is_err() {
        let view = |v: &MatRef<'_>| {
            format!(
                "{} values from {} with strides ({}, {})",
                v.data.len(),
                v.offset,
                v.row_stride,
                v.col_stride
            )
        };
        return Err(Error::shape(
            "matmul",
            format!(
                "a ({}) as {m}x{k}, b ({}) as {k}x{n}, out {} values with row stride {out_row_stride} as {m}x{n}",
                view(&a),
                view(&b),
                out.len()
            ),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        for row in out.chunks_mut(out_row_stride).take(m) {
            row[..n].fill(0.0);
        }
        return Ok(());
    }
    let parallelism =
        if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // The casts cannot wrap: `covers` and the check above keep every stride within isize.
    let st = |x: usize| x as isize;
    // SAFETY: `covers` proved that every element gemm reads from `a` (m×k) and `b` (k×n) at
    // the given offsets and strides lies inside the respective slice, and the check on `out`
    // proved that rows of n elements, `out_row_stride` ≥ n apart, fit in `out`; rows do not
    // overlap, so concurrent gemm threads write disjoint elements. `out` is a `&mut` borrow
    // distinct from `a` and `b`, so nothing aliases, and `read_dst` is false so the prior
    // contents of `out` are never read.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            st(out_row_stride),
            false,
            a.data.as_ptr().add(a.offset),
            st(a.col_stride),
            st(a.row_stride),
            b.data.as_ptr().add(b.offset),
            st(b.col_stride),
            st(b.row_stride),
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
    // wᵀ as a k×n view: element (p, j) is w[j·k + p].
    let wt = MatRef { data: w, offset: 0, row_stride: 1, col_stride: k };
    gemm_strided(MatRef::row_major(a, k), wt, out, n, m, n, k, threads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{assert_close, naive_matmul_nt as naive, random_vec};

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
    fn strided_views_match_naive_and_are_bounds_checked() {
        // a: every other column of a 3x8 buffer; b: a 4x2 block in the middle of a 6x5 one.
        let abuf = random_vec(24, 7);
        let bbuf = random_vec(30, 8);
        let a = MatRef { data: &abuf, offset: 1, row_stride: 8, col_stride: 2 };
        let b = MatRef { data: &bbuf, offset: 6, row_stride: 5, col_stride: 1 };
        let mut out = vec![f32::NAN; 3 * 3];
        gemm_strided(a, b, &mut out, 3, 3, 2, 4, 1).unwrap();
        for i in 0..3 {
            for j in 0..2 {
                let want: f32 = (0..4).map(|p| abuf[1 + i * 8 + p * 2] * bbuf[6 + p * 5 + j]).sum();
                assert!((out[i * 3 + j] - want).abs() < 1e-5);
            }
            assert!(out[i * 3 + 2].is_nan(), "the gap between rows is left alone");
        }
        let past_end = MatRef { data: &bbuf, offset: 20, row_stride: 5, col_stride: 1 };
        assert!(gemm_strided(a, past_end, &mut out, 3, 3, 2, 4, 1).is_err());
        assert!(gemm_strided(a, b, &mut out, 1, 3, 2, 4, 1).is_err());
    }

    #[test]
    fn rejects_bad_lengths() {
        let err = matmul_nt(&[0.0; 6], &[0.0; 6], &mut [0.0; 5], 2, 2, 3, 1).unwrap_err();
        assert!(err.to_string().contains("want 2x2"), "{err}");
    }
}
