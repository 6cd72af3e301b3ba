//! What a token's log-probability needs of a logits row, found where the row is
//! ([`Backend::normalizers`], [`Backend::columns_at`]): the row's log-normalizer
//! `ln Σ e^l` and the logits of the tokens picked, so a GPU sends two numbers per row (and
//! the candidates of [`Backend::top_k_rows`] for the most likely alternatives) instead of
//! its row of logits.
//!
//! The sum is defined as the draws' sums are ([`super::sample`]): each number's
//! `exp_det(l - top)` in f64, summed per chunk of [`DRAW_CHUNK`] columns in column order, the
//! chunk sums in chunk order; the logarithm is taken on the host ([`Normalizer::log_total`]).
//! So a row gives the same bits on the CPU, on a GPU, and in the host sampler.

use super::draw_grid::{largest, weight_lanes};
use super::sample::{DRAW_CHUNK, DRAW_MAX_COLUMNS};
use super::{check, Backend};
use crate::error::Result;
use crate::tensor::Tensor;
use rayon::prelude::*;

/// A logits row's largest number and the sum of `e^(l - top)` over its numbers (NaN left
/// out), from which its log-softmax follows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalizer {
    /// The largest number of the row (the first of equal ones); -inf for a row without one.
    pub top: f32,
    /// `Σ exp_det(l - top)` over the row's numbers, summed as the module docs say.
    pub sum: f64,
}

impl Normalizer {
    /// The normalizer of one row.
    pub fn of(row: &[f32]) -> Normalizer {
        pulp::Arch::new().dispatch(Normalize { row })
    }

    /// `ln Σ e^l` over the row's numbers: `top + ln(sum)` (-inf for a row without numbers).
    pub fn log_total(&self) -> f64 {
        f64::from(self.top) + self.sum.ln()
    }

    /// The log-probability of logit `l` of the row: `l - ln Σ e^l`, rounded to f32; -inf for
    /// NaN and for -inf.
    pub fn logprob(&self, l: f32) -> f32 {
        if l.is_nan() || l == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        (f64::from(l) - self.log_total()) as f32
    }
}

/// [`Normalizer::of`] on the widest SIMD the CPU has: each chunk's weights by
/// [`weight_lanes`] (`exp_det`'s operations without its branches, vectorized; 0 for NaN),
/// then summed in column order.
struct Normalize<'a> {
    row: &'a [f32],
}

impl pulp::WithSimd for Normalize<'_> {
    type Output = Normalizer;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, simd: S) -> Normalizer {
        let row = self.row;
        // Of equal numbers only zeros differ (-0 and +0): the first one is the top.
        let (largest, _) = largest(simd, row);
        let top = match largest {
            0.0 => row.iter().copied().find(|&l| l == 0.0).unwrap_or(largest),
            // No number above -inf: the first number, if any (-inf), else -inf.
            f32::NEG_INFINITY => f32::NEG_INFINITY,
            _ => largest,
        };
        let mut sum = 0.0;
        let mut weights = [0.0f64; DRAW_CHUNK];
        for chunk in row.chunks(DRAW_CHUNK) {
            let weights = &mut weights[..chunk.len()];
            for (w, &l) in weights.iter_mut().zip(chunk) {
                *w = weight_lanes(l, top, 1.0, 0.0);
            }
            let mut s = 0.0;
            for &w in weights.iter() {
                s += w;
            }
            sum += s;
        }
        Normalizer { top, sum }
    }
}

impl Backend {
    /// Each row's [`Normalizer`], found where the row is: only two numbers per row move.
    ///
    /// # Errors
    /// Rows over [`DRAW_MAX_COLUMNS`] on the GPU; the CUDA kernel failed, or the CPU backend
    /// could not copy a device tensor to the host.
    pub fn normalizers(&self, x: &Tensor) -> Result<Vec<Normalizer>> {
        match self {
            Backend::Cpu(cpu) => {
                x.host()?;
                Ok(cpu.install(|| {
                    (0..x.rows()).into_par_iter().map(|r| Normalizer::of(x.row(r))).collect()
                }))
            }
            Backend::Cuda(cuda) => {
                check("normalizers", x.row_len() <= DRAW_MAX_COLUMNS, || {
                    format!("rows of {} columns; at most {DRAW_MAX_COLUMNS}", x.row_len())
                })?;
                cuda.normalizers(x)
            }
        }
    }

    /// `x[r, columns[r]]` for each row `r` of `x` (NaN for a column past the row), read where
    /// the rows are: the logits of the tokens a step picked, for their log-probabilities.
    ///
    /// # Errors
    /// Another number of columns than rows; the CUDA kernel failed, or the CPU backend could
    /// not copy a device tensor to the host.
    pub fn columns_at(&self, x: &Tensor, columns: &[u32]) -> Result<Vec<f32>> {
        check("columns_at", columns.len() == x.rows(), || {
            format!("{} columns for {} rows", columns.len(), x.rows())
        })?;
        match self {
            Backend::Cpu(_) => {
                x.host()?;
                Ok(columns
                    .iter()
                    .enumerate()
                    .map(|(r, &c)| x.row(r).get(c as usize).copied().unwrap_or(f32::NAN))
                    .collect())
            }
            Backend::Cuda(cuda) => cuda.columns_at(x, columns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::sample::exp_det;

    /// The plain definition: the row's largest number, each number's weight in column order
    /// per chunk of 256, the chunk sums in order, without the CPU's fused instructions.
    fn reference(row: &[f32]) -> Normalizer {
        let nums: Vec<f32> = row.iter().copied().filter(|l| !l.is_nan()).collect();
        let top = nums.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for chunk in row.chunks(256) {
            let mut s = 0.0;
            for &l in chunk {
                if !l.is_nan() {
                    s += exp_det(f64::from(l) - f64::from(top));
                }
            }
            sum += s;
        }
        Normalizer { top, sum }
    }

    fn rows() -> Vec<Vec<f32>> {
        let long: Vec<f32> =
            (0..70_001).map(|i| ((i * 7919) % 20_011) as f32 * -0.0013 + 3.0).collect();
        vec![
            vec![1.0, 2.0, 3.0],
            vec![f32::NAN, -1.0, f32::NAN, 4.5, f32::NEG_INFINITY],
            vec![0.0, -0.0, 0.0],
            vec![f32::NAN; 4],
            vec![f32::NEG_INFINITY; 3],
            long,
        ]
    }

    /// Each row's normalizer on the backend is the plain definition's, bit for bit, and its
    /// log-softmax sums to one.
    #[test]
    fn normalizers_are_the_plain_sums_and_give_a_distribution() {
        let be = Backend::cpu(2).unwrap();
        for row in rows() {
            let x = Tensor::from_vec(&[1, row.len()], row.clone()).unwrap();
            let got = be.normalizers(&x).unwrap()[0];
            let want = reference(&row);
            assert_eq!(
                (got.top.to_bits(), got.sum.to_bits()),
                (want.top.to_bits(), want.sum.to_bits())
            );
            let mass: f64 = row.iter().map(|&l| f64::from(got.logprob(l)).exp()).sum();
            if row.iter().any(|l| l.is_finite()) {
                assert!((mass - 1.0).abs() < 1e-4, "{mass}");
            } else {
                assert_eq!(got.log_total(), f64::NEG_INFINITY);
                assert!(row.iter().all(|&l| got.logprob(l) == f32::NEG_INFINITY));
            }
        }
        let short = Normalizer::of(&[1.0, 2.0, 3.0]);
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((short.log_total() - lse).abs() < 1e-14);
        assert_eq!(short.logprob(f32::NAN), f32::NEG_INFINITY);
    }

    /// Many rows at once are each row alone.
    #[test]
    fn normalizers_of_rows_are_each_row_alone() {
        let be = Backend::cpu(2).unwrap();
        let data: Vec<f32> = (0..5 * 300).map(|i| ((i * 31) % 97) as f32 * 0.25 - 9.0).collect();
        let x = Tensor::from_vec(&[5, 300], data.clone()).unwrap();
        let got = be.normalizers(&x).unwrap();
        for (r, n) in got.iter().enumerate() {
            assert_eq!(*n, Normalizer::of(&data[r * 300..(r + 1) * 300]));
        }
    }

    #[test]
    fn columns_at_reads_one_column_per_row() {
        let be = Backend::cpu(1).unwrap();
        let x = Tensor::from_vec(&[3, 4], (0..12).map(|i| i as f32).collect()).unwrap();
        let got = be.columns_at(&x, &[2, 0, 4]).unwrap();
        assert_eq!((got[0], got[1]), (2.0, 4.0));
        assert!(got[2].is_nan(), "a column past the row");
        let err = be.columns_at(&x, &[0, 1]).unwrap_err().to_string();
        assert!(err.contains("2 columns for 3 rows"), "{err}");
    }
}
