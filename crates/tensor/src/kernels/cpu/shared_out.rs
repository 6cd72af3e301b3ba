//! An output matrix written by parallel tasks that each own some of its columns, and
//! [`by_weight_rows`], which runs the direct kernels' tasks that way.
//!
//! One of the modules of the crate with `unsafe`: the tasks reach their columns through a raw
//! pointer into the output, which no slice can split by columns.
#![allow(unsafe_code)]

use rayon::prelude::*;
use std::marker::PhantomData;

/// `out` as rows of `n` values, shared by tasks that write disjoint columns of it.
pub(crate) struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    n: usize,
    _out: PhantomData<&'a mut [f32]>,
}

// SAFETY: the pointer comes from a `&mut [f32]` borrowed for `'a`, so nothing outside the
// tasks reads or writes `out` meanwhile, and the tasks write disjoint columns of it (`at` is
// unsafe, and its callers promise that).
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    pub(crate) fn new(out: &'a mut [f32], n: usize) -> Self {
        SharedOut { ptr: out.as_mut_ptr(), len: out.len(), n, _out: PhantomData }
    }

    /// A pointer to `out[i, j]`.
    ///
    /// # Safety
    /// `out[i, j ..]` holds as many values as the caller accesses through the pointer, and no
    /// other thread touches them meanwhile.
    pub(crate) unsafe fn at(&self, i: usize, j: usize) -> *mut f32 {
        debug_assert!(i * self.n + j < self.len);
        // SAFETY: inside `out`, by the caller's promise.
        unsafe { self.ptr.add(i * self.n + j) }
    }
}

/// `out` (`[m, rows]`: activation rows by weight rows) from tasks that each own `per_task`
/// consecutive weight rows: `task(first, block)` writes the products of weight rows
/// `first..first + block.len() / m` with every activation row as a `[rows of the task, m]`
/// block (weight rows by activation rows, the order in which the direct kernels compute).
/// With one activation row that block is the task's own part of `out`; with more it is a
/// buffer of the thread, which the task then copies into its columns of `out` (a line of 16
/// values per activation row with 16 rows a task) while it is in L1. Before, the tasks wrote
/// one `[rows, m]` block and a second parallel pass transposed it (7% of a 64-sequence step).
pub(crate) fn by_weight_rows(
    rows: usize,
    m: usize,
    per_task: usize,
    out: &mut [f32],
    task: impl Fn(usize, &mut [f32]) + Sync,
) {
    assert_eq!(out.len(), rows * m, "by_weight_rows: an output of {} for {m} x {rows}", out.len());
    if m == 1 {
        out.par_chunks_mut(per_task).enumerate().for_each(|(c, part)| task(c * per_task, part));
        return;
    }
    let shared = SharedOut::new(out, rows);
    (0..rows.div_ceil(per_task)).into_par_iter().for_each_init(Vec::new, |block, c| {
        let first = c * per_task;
        let n = per_task.min(rows - first);
        // Grown, never cleared: the task writes every value of its block.
        if block.len() < n * m {
            block.resize(n * m, 0.0);
        }
        let block = &mut block[..n * m];
        task(first, block);
        for t in 0..m {
            // SAFETY: `t < m` and `first + n <= rows`, so the `n` values lie in row `t` of
            // `out`; columns `first..first + n` are this task's alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(shared.at(t, first), n) };
            for (j, d) in dst.iter_mut().enumerate() {
                *d = block[j * m + t];
            }
        }
    });
}
