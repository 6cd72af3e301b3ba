//! The most likely entries of each logits row, found where the row is
//! ([`Backend::top_k_rows`]): a sampler that keeps only the `k` most likely tokens needs
//! those `k` values and ids, not the vocabulary, so a GPU sends `k` pairs to the host instead
//! of its row of logits, and tensor-parallel ranks exchange their shards' candidates instead of
//! gathering the vocabulary (the `k` best of the union of every shard's `k` best are the `k`
//! best of the row).

use super::{check, Backend};
use crate::error::Result;
use crate::tensor::Tensor;
use rayon::prelude::*;
use std::cmp::Ordering;

/// The most candidates [`Backend::top_k_rows`] finds per row (the CUDA kernel sorts them in
/// one block's shared memory).
pub const TOP_K_MAX: usize = 1024;

/// The id of a padding entry: a row with fewer numbers than the candidates asked for.
const NONE: u32 = u32::MAX;

/// The candidates of some rows: per row, `per_row` entries (value, column), the largest value
/// first and the lower column first among equal values; NaN is never a candidate, and a row
/// with fewer numbers than `per_row` ends in padding, which [`TopK::row`] skips.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    per_row: usize,
    values: Vec<f32>,
    ids: Vec<u32>,
}

impl TopK {
    /// Candidates from their flat parts (`rows · per_row` each; id `u32::MAX` is padding),
    /// as [`TopK::values`] and [`TopK::ids`] give them, each row already in order.
    ///
    /// # Panics
    /// When the lengths differ or are not a multiple of `per_row`.
    pub fn from_parts(per_row: usize, values: Vec<f32>, ids: Vec<u32>) -> Self {
        assert!(
            values.len() == ids.len() && values.len().is_multiple_of(per_row.max(1)),
            "TopK: {} values and {} ids for rows of {per_row}",
            values.len(),
            ids.len()
        );
        TopK { per_row, values, ids }
    }

    /// Entries per row, padding included.
    pub fn per_row(&self) -> usize {
        self.per_row
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.values.len().checked_div(self.per_row).unwrap_or(0)
    }

    /// Every row's values, padding included, row after row.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Every row's ids, `u32::MAX` for padding, row after row.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Row `r`'s candidates in order, without its padding.
    pub fn row(&self, r: usize) -> impl Iterator<Item = (f32, u32)> + '_ {
        let at = r * self.per_row..(r + 1) * self.per_row;
        self.values[at.clone()]
            .iter()
            .zip(&self.ids[at])
            .map(|(&v, &i)| (v, i))
            .filter(|c| c.1 != NONE)
    }

    /// The `per_row` best of each row of the union of `parts` (each part's rows the same
    /// rows, with ids already in one numbering): [`TopK`] of the whole row when each part
    /// holds its own columns' `per_row` best.
    pub fn merge(parts: &[TopK], per_row: usize) -> TopK {
        let rows = parts.first().map_or(0, TopK::rows);
        let mut values = Vec::with_capacity(rows * per_row);
        let mut ids = Vec::with_capacity(rows * per_row);
        let mut row = Vec::new();
        for r in 0..rows {
            row.clear();
            row.extend(parts.iter().flat_map(|p| p.row(r)));
            push_best(&mut row, per_row, &mut values, &mut ids);
        }
        TopK { per_row, values, ids }
    }
}

/// A row's numbers as (value, column) pairs in column order, NaN left out: what
/// [`Backend::top_k_rows`] chooses from and `draw_columns` draws from.
pub fn row_numbers(row: &[f32]) -> impl Iterator<Item = (f32, u32)> + '_ {
    row.iter().enumerate().filter(|(_, v)| !v.is_nan()).map(|(i, &v)| (v, i as u32))
}

/// The candidates' order: the larger value first, the lower id among equal values (-0 and
/// +0 are equal, as for an argmax, so the first candidate is the row's argmax). For values
/// that are not NaN.
pub fn candidate_order(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.partial_cmp(&a.0).unwrap_or(Ordering::Equal).then(a.1.cmp(&b.1))
}

/// Appends the `k` best of `row` (no NaN in it), in order, then padding up to `k`.
fn push_best(row: &mut Vec<(f32, u32)>, k: usize, values: &mut Vec<f32>, ids: &mut Vec<u32>) {
    if k == 0 {
        return;
    }
    if row.len() > k {
        row.select_nth_unstable_by(k - 1, candidate_order);
        row.truncate(k);
    }
    row.sort_unstable_by(candidate_order);
    values.extend(row.iter().map(|c| c.0));
    ids.extend(row.iter().map(|c| c.1));
    let pad = k - row.len();
    values.extend(std::iter::repeat_n(f32::NAN, pad));
    ids.extend(std::iter::repeat_n(NONE, pad));
}

impl Backend {
    /// The `min(k, columns)` largest values of each row of `x` and their columns, in the
    /// order of [`candidate_order`] (NaN never; padding where a row has fewer numbers): on
    /// the device the row is on, so only the candidates move (see the module docs). Equal
    /// values order by column on both backends, so the same row gives the same candidates.
    ///
    /// # Errors
    /// `k` above [`TOP_K_MAX`]; the CUDA kernel failed, or the CPU backend could not copy
    /// a device tensor to the host.
    pub fn top_k_rows(&self, x: &Tensor, k: usize) -> Result<TopK> {
        check("top_k_rows", k <= TOP_K_MAX, || {
            format!("{k} candidates per row; at most {TOP_K_MAX}")
        })?;
        let per_row = k.min(x.row_len());
        match self {
            Backend::Cpu(cpu) => {
                x.host()?;
                let (values, ids): (Vec<Vec<f32>>, Vec<Vec<u32>>) = cpu.install(|| {
                    (0..x.rows())
                        .into_par_iter()
                        .map(|r| {
                            let mut row: Vec<(f32, u32)> = row_numbers(x.row(r)).collect();
                            let (mut values, mut ids) = (Vec::new(), Vec::new());
                            push_best(&mut row, per_row, &mut values, &mut ids);
                            (values, ids)
                        })
                        .unzip()
                });
                let (values, ids) = (values.concat(), ids.concat());
                Ok(TopK { per_row, values, ids })
            }
            Backend::Cuda(cuda) => {
                let (values, ids) = cuda.top_k_rows(x, per_row)?;
                Ok(TopK { per_row, values, ids })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_rows_are_the_best_in_order_ties_by_column_without_nan() {
        let be = Backend::cpu(2).unwrap();
        let nan = f32::NAN;
        let x = Tensor::from_vec(
            &[3, 6],
            vec![
                1.0,
                5.0,
                5.0,
                -1.0,
                7.0,
                5.0, //
                nan,
                -0.0,
                2.0,
                0.0,
                f32::NEG_INFINITY,
                nan, //
                nan,
                nan,
                nan,
                nan,
                nan,
                nan,
            ],
        )
        .unwrap();
        let top = be.top_k_rows(&x, 3).unwrap();
        assert_eq!(top.per_row(), 3);
        assert_eq!(top.rows(), 3);
        assert_eq!(top.row(0).collect::<Vec<_>>(), [(7.0, 4), (5.0, 1), (5.0, 2)]);
        // -0 and +0 are equal (the lower column first).
        assert_eq!(top.row(1).map(|c| c.1).collect::<Vec<_>>(), [2, 1, 3]);
        assert_eq!(be.top_k_rows(&x, 4).unwrap().row(1).last(), Some((f32::NEG_INFINITY, 4)));
        // Fewer numbers than asked: padded, and the padding is not a candidate.
        assert_eq!(top.row(2).count(), 0);
        assert_eq!(&top.ids()[6..9], [u32::MAX; 3]);
        // More than the columns: all of them.
        assert_eq!(be.top_k_rows(&x, 10).unwrap().per_row(), 6);
        let err = be.top_k_rows(&x, TOP_K_MAX + 1).unwrap_err().to_string();
        assert!(err.contains("1025 candidates per row"), "{err}");
    }

    #[test]
    fn merged_shards_give_the_candidates_of_the_whole_row() {
        let be = Backend::cpu(1).unwrap();
        let cols = 40;
        // Few distinct values, so ties cross the shards' boundaries.
        let row: Vec<f32> = (0..2 * cols).map(|i| ((i * 7919) % 11) as f32).collect();
        let whole = Tensor::from_vec(&[2, cols], row.clone()).unwrap();
        for k in [1, 3, 8, 40] {
            let want = be.top_k_rows(&whole, k).unwrap();
            let parts: Vec<TopK> = [0..13, 13..29, 29..40]
                .into_iter()
                .map(|range| {
                    let shard: Vec<f32> =
                        row.chunks(cols).flat_map(|r| r[range.clone()].to_vec()).collect();
                    let shard = Tensor::from_vec(&[2, range.len()], shard).unwrap();
                    let top = be.top_k_rows(&shard, k).unwrap();
                    let ids =
                        top.ids()
                            .iter()
                            .map(|&i| if i == NONE { i } else { i + range.start as u32 });
                    let per_row = top.per_row();
                    TopK::from_parts(per_row, top.values().to_vec(), ids.collect())
                })
                .collect();
            let got = TopK::merge(&parts, want.per_row());
            for r in 0..2 {
                assert_eq!(
                    got.row(r).collect::<Vec<_>>(),
                    want.row(r).collect::<Vec<_>>(),
                    "k {k}"
                );
            }
        }
    }
}
