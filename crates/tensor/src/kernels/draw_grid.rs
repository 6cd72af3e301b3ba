//! [`draw_columns`](super::draw_columns) on the CPU, with the row's weights laid out for SIMD:
//! the same token as the definition, bit for bit, in a fraction of its time.
//!
//! The definition sums weights per chunk of [`DRAW_CHUNK`] columns in column order and the
//! chunk sums in chunk order, and finds top-p's threshold by 32 such sums (one per bit of
//! the key). One chunk's sum is a chain of dependent additions, but the chunks are
//! independent: here each weight sits at a column of a grid whose chunks are side by side
//! in [`LANES`] lanes (chunk `c`'s column `i` at `((c / LANES) · DRAW_CHUNK + i) · LANES +
//! c % LANES`), so one pass adds a column of [`LANES`] chunks per vector operation, each lane
//! in its chunk's column order. A column without a number holds weight 0 and key 0, which
//! adds +0 to every sum and is never picked, as the definition leaves such columns out. The
//! weights themselves are [`weight_lanes`], [`exp_det`](super::exp_det)'s operations without
//! its branches, so the compiler vectorizes them too; a whole row without NaN
//! ([`draw_row`]) is weighed straight from the row, its largest number found lane by lane.

use super::sample::{order_key, Draw, DRAW_CHUNK};
use pulp::{Arch, Simd, WithSimd};
use std::cell::RefCell;

/// Chunks summed side by side.
const LANES: usize = 8;

/// A row's weights and order keys on the grid (see the module docs), and the same per
/// number in the row's order.
#[derive(Default)]
struct Grid {
    weights: Vec<f64>,
    keys: Vec<u64>,
    /// Chunks of the row (the grid holds them rounded up to [`LANES`]).
    chunks: usize,
    /// Per number of the row, in its order: its weight and key.
    row_weights: Vec<f64>,
    row_keys: Vec<u32>,
    /// Per chunk, its sum at the kept threshold.
    sums: Vec<f64>,
    /// Every column from this one on holds weight 0 and key 0.
    clear_from: usize,
}

thread_local! {
    /// Each thread's grid, kept between rows (a row of 150k columns is 1.8 MB of it).
    static GRID: RefCell<Grid> = RefCell::default();
}

/// Where column `col` sits on the grid.
#[inline(always)]
fn slot(col: usize) -> usize {
    let (c, i) = (col / DRAW_CHUNK, col % DRAW_CHUNK);
    ((c / LANES) * DRAW_CHUNK + i) * LANES + c % LANES
}

/// [`super::sample::weight`], by the same operations as [`super::exp_det`] without its
/// branches: the same bits, in a form the compiler vectorizes.
#[inline(always)]
pub(super) fn weight_lanes(l: f32, top: f32, t: f64, floor: f64) -> f64 {
    use super::sample::{INV_FACTORIAL, LN2_HI, LN2_LO};
    // 2^52 + 1023: `n` added to it leaves n + 1023 in the low bits of the sum.
    const EXPONENT: f64 = 4_503_599_627_371_519.0;
    let x = (f64::from(l) - f64::from(top)) / t;
    let inside = (-708.0..=0.0).contains(&x);
    let xc = if inside { x } else { 0.0 };
    let n = (xc * std::f64::consts::LOG2_E).round();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let mut p = INV_FACTORIAL[13];
    for c in INV_FACTORIAL[..13].iter().rev() {
        p = p.mul_add(r, *c);
    }
    // n is in -1022..=0: the exponent field n + 1023, nothing else.
    let e = p * f64::from_bits((n + EXPONENT).to_bits() << 52);
    let e = match (inside, x > 0.0) {
        (true, _) => e,
        (false, true) => f64::INFINITY,
        (false, false) => 0.0,
    };
    if e >= floor {
        e
    } else {
        0.0
    }
}

/// A row's numbers: a whole row without NaN, or `(logit, column)` pairs in column order.
#[derive(Clone, Copy)]
enum Numbers<'a> {
    Row(&'a [f32]),
    Pairs(&'a [(f32, u32)]),
}

impl Numbers<'_> {
    fn len(&self) -> usize {
        match self {
            Numbers::Row(row) => row.len(),
            Numbers::Pairs(pairs) => pairs.len(),
        }
    }

    /// The column of number `i`.
    fn column(&self, i: usize) -> usize {
        match self {
            Numbers::Row(_) => i,
            Numbers::Pairs(pairs) => pairs[i].1 as usize,
        }
    }
}

/// The largest number of `row` and whether it has no NaN, lane by lane (NaN never compares
/// larger) and then across the lanes: the value, which of equal ones aside (-0 or +0).
#[inline(always)]
pub(super) fn largest<S: Simd>(simd: S, row: &[f32]) -> (f32, bool) {
    let (head, tail) = S::as_simd_f32s(row);
    let mut lanes = simd.splat_f32s(f32::NEG_INFINITY);
    let mut numbers = simd.equal_f32s(lanes, lanes);
    for &x in head {
        lanes = simd.select_f32s(simd.greater_than_f32s(x, lanes), x, lanes);
        numbers = simd.and_m32s(numbers, simd.equal_f32s(x, x));
    }
    let numbers = simd.select_u32s(numbers, simd.splat_u32s(u32::MAX), simd.splat_u32s(0));
    let numbers: &[u32] = bytemuck::cast_slice(core::slice::from_ref(&numbers));
    let lanes: &[f32] = bytemuck::cast_slice(core::slice::from_ref(&lanes));
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    let no_nan = numbers.iter().all(|&m| m == u32::MAX) && !tail.iter().any(|l| l.is_nan());
    (max, no_nan)
}

/// [`largest`] on the widest SIMD the CPU has.
struct Largest<'a> {
    row: &'a [f32],
}

impl WithSimd for Largest<'_> {
    type Output = (f32, bool);

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> (f32, bool) {
        largest(simd, self.row)
    }
}

/// Each number's weight and key (in the numbers' order).
struct Weigh<'a> {
    numbers: Numbers<'a>,
    top: f32,
    t: f64,
    floor: f64,
    weights: &'a mut [f64],
    keys: &'a mut [u32],
}

impl WithSimd for Weigh<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, _simd: S) {
        let Weigh { numbers, top, t, floor, weights, keys } = self;
        #[inline(always)]
        fn weigh(
            logits: impl Iterator<Item = f32>,
            w: &mut [f64],
            k: &mut [u32],
            by: (f32, f64, f64),
        ) {
            for ((w, k), l) in w.iter_mut().zip(k.iter_mut()).zip(logits) {
                *w = weight_lanes(l, by.0, by.1, by.2);
                *k = order_key(l);
            }
        }
        match numbers {
            Numbers::Row(row) => weigh(row.iter().copied(), weights, keys, (top, t, floor)),
            Numbers::Pairs(p) => weigh(p.iter().map(|p| p.0), weights, keys, (top, t, floor)),
        }
    }
}

/// The grid's chunk sums of the weights whose key is at least `floor_key`: into `sums` (one
/// per chunk of the grid) when given, and their total in chunk order.
struct Mass<'a> {
    weights: &'a [f64],
    keys: &'a [u64],
    floor_key: u64,
    sums: Option<&'a mut [f64]>,
}

impl WithSimd for Mass<'_> {
    type Output = f64;

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> f64 {
        let Mass { weights, keys, floor_key, mut sums } = self;
        let group = DRAW_CHUNK * LANES;
        // A row of the grid is one register or more (fewer lanes than LANES): register `j`
        // of a row holds the chunks `j · per_row ..`, summed in accumulator `j`.
        let per_register = core::mem::size_of::<S::f64s>() / core::mem::size_of::<f64>();
        let registers = LANES / per_register;
        let (floor, zero) = (simd.splat_u64s(floor_key), simd.splat_f64s(0.0));
        let mut total = 0.0;
        for (g, (w, k)) in weights.chunks_exact(group).zip(keys.chunks_exact(group)).enumerate() {
            let (w, k) = (S::as_simd_f64s(w).0, S::as_simd_u64s(k).0);
            let mut acc = [zero; LANES];
            for (i, (&w, &k)) in w.iter().zip(k).enumerate() {
                let a = &mut acc[i % registers];
                let kept = simd.greater_than_or_equal_u64s(k, floor);
                *a = simd.add_f64s(*a, simd.select_f64s(kept, w, zero));
            }
            let mut lanes = [0.0f64; LANES];
            for (out, a) in lanes.chunks_exact_mut(per_register).zip(&acc) {
                out.copy_from_slice(bytemuck::cast_slice(core::slice::from_ref(a)));
            }
            if let Some(sums) = sums.as_deref_mut() {
                sums[g * LANES..(g + 1) * LANES].copy_from_slice(&lanes);
            }
            for a in lanes {
                total += a;
            }
        }
        total
    }
}

impl Grid {
    /// Lays out `pairs` (columns ascending, below `chunks · DRAW_CHUNK`) weighed by `top`,
    /// `t` and `floor`.
    fn fill(&mut self, arch: Arch, numbers: Numbers<'_>, (top, t, floor): (f32, f64, f64)) {
        let n = numbers.len();
        let last = if n == 0 { 0 } else { numbers.column(n - 1) };
        self.chunks = last / DRAW_CHUNK + 1;
        let len = self.chunks.next_multiple_of(LANES) * DRAW_CHUNK;
        // A row with every column up to its last (no NaN) writes every slot before it: the
        // grid needs clearing only where the last row left something past that.
        let dense = n == last + 1;
        if !(dense && self.weights.len() == len && self.clear_from <= n) {
            self.weights.clear();
            self.weights.resize(len, 0.0);
            self.keys.clear();
            self.keys.resize(len, 0);
        }
        self.clear_from = last + 1;
        self.row_weights.resize(n, 0.0);
        self.row_keys.resize(n, 0);
        let (weights, keys) = (&mut self.row_weights[..], &mut self.row_keys[..]);
        arch.dispatch(Weigh { numbers, top, t, floor, weights, keys });
        for i in 0..n {
            let at = slot(numbers.column(i));
            self.weights[at] = self.row_weights[i];
            self.keys[at] = u64::from(self.row_keys[i]);
        }
    }

    /// The grid's total weight at keys of at least `floor_key`, and its chunk sums when
    /// `keep` (into [`Grid::sums`]).
    fn mass(&mut self, arch: Arch, floor_key: u32, keep: bool) -> f64 {
        let sums = keep.then(|| {
            self.sums.resize(self.weights.len() / DRAW_CHUNK, 0.0);
            &mut self.sums[..]
        });
        arch.dispatch(Mass {
            weights: &self.weights,
            keys: &self.keys,
            floor_key: floor_key.into(),
            sums,
        })
    }

    /// The token `d` draws from `pairs` (not greedy), whose largest number is `top`; see
    /// [`super::draw_columns`].
    fn draw(&mut self, numbers: Numbers<'_>, d: &Draw, top: f32) -> u32 {
        let arch = Arch::new();
        self.fill(arch, numbers, (top, f64::from(d.temperature), f64::from(d.min_p)));
        let mut kept = 0u32;
        if d.top_p < 1.0 {
            let target = self.mass(arch, 0, false) * f64::from(d.top_p);
            for bit in (0..32).rev() {
                let trial = kept | (1 << bit);
                if self.mass(arch, trial, false) >= target {
                    kept = trial;
                }
            }
        }
        let total = self.mass(arch, kept, true);
        let live = |i: usize| self.row_weights[i] > 0.0 && self.row_keys[i] >= kept;
        let found = (0..numbers.len()).rev().find(|&i| live(i));
        let fallback = numbers.column(found.unwrap_or(0)) as u32;
        let mut u = d.u * total;
        for (c, &s) in self.sums[..self.chunks].iter().enumerate() {
            if u < s {
                for col in c * DRAW_CHUNK..(c + 1) * DRAW_CHUNK {
                    let at = slot(col);
                    let w = self.weights[at];
                    if w > 0.0 && self.keys[at] >= u64::from(kept) {
                        if u < w {
                            return col as u32;
                        }
                        u -= w;
                    }
                }
                return fallback;
            }
            u -= s;
        }
        fallback
    }
}

/// [`super::draw_columns`] for a row that is not greedy, whose largest number is `top`, on
/// this thread's grid; `None` when `pairs`' columns are too sparse for a grid of them (more
/// than four columns per number).
pub(super) fn draw(pairs: &[(f32, u32)], d: &Draw, top: f32) -> Option<u32> {
    let last = pairs.last()?.1 as usize;
    if last > 4 * pairs.len() + DRAW_CHUNK {
        return None;
    }
    Some(GRID.with(|g| g.borrow_mut().draw(Numbers::Pairs(pairs), d, top)))
}

/// [`super::draw_columns`] of a whole logits row (`row_numbers`' pairs of it), on this
/// thread's grid straight from the row where it has no NaN and is not drawn greedily.
pub(super) fn draw_row(row: &[f32], d: &Draw) -> u32 {
    if d.temperature > 0.0 && !row.is_empty() {
        // Only the largest number's value weighs (-0 and +0 give the same weights).
        if let (top, true) = Arch::new().dispatch(Largest { row }) {
            return GRID.with(|g| g.borrow_mut().draw(Numbers::Row(row), d, top));
        }
    }
    let pairs: Vec<(f32, u32)> = super::select::row_numbers(row).collect();
    super::draw_columns(&pairs, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::sample::{chunked_sum, draw_listed, order_key, weighed, weight};

    /// A generator of uniform numbers in [0, 1).
    fn uniforms(seed: u64) -> impl FnMut() -> f64 {
        let mut state = seed;
        move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    #[test]
    fn lane_weights_are_the_definitions_bits() {
        let mut next = uniforms(3);
        let mut logits: Vec<f32> = (0..50_000).map(|_| ((next() - 0.9) * 2000.0) as f32).collect();
        logits.extend([0.0, -0.0, f32::NEG_INFINITY, -1e-30, -707.9, -708.0, -708.1, 1.0]);
        for (t, floor) in [(1.0, 0.0), (0.7, 0.0), (0.05, 1e-3), (3.3, 0.5), (1.0, 1.0)] {
            for &l in &logits {
                let (want, got) = (weight(l, 0.0, t, floor), weight_lanes(l, 0.0, t, floor));
                assert_eq!(
                    want.to_bits(),
                    got.to_bits(),
                    "logit {l}, temperature {t}, floor {floor}"
                );
            }
        }
    }

    /// A whole row draws what its pairs draw: without NaN straight from the row, with NaN
    /// (in the vector part of the row or its tail) from its pairs; rows of -inf only, of
    /// zeros of both signs, and greedy draws too.
    #[test]
    fn whole_rows_draw_what_their_pairs_draw() {
        let mut next = uniforms(17);
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for cols in [49_152usize, 1_000, 37] {
            let row: Vec<f32> = (0..cols).map(|_| ((next() - 0.5) * 12.0) as f32).collect();
            let mut early_nan = row.clone();
            early_nan[3] = f32::NAN;
            let mut late_nan = row.clone();
            late_nan[cols - 1] = f32::NAN;
            rows.extend([row, early_nan, late_nan]);
        }
        rows.push(vec![f32::NEG_INFINITY; 40]);
        rows.push(vec![-0.0, 0.0, -1.0, -0.0, -3.0]);
        for row in &rows {
            let pairs: Vec<(f32, u32)> = crate::kernels::row_numbers(row).collect();
            let (top, no_nan) = Arch::new().dispatch(Largest { row });
            assert_eq!(no_nan, pairs.len() == row.len());
            assert_eq!(top, pairs.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.0)));
            for (temperature, top_p) in [(0.0, 1.0), (0.7, 1.0), (1.0, 0.9), (1.3, 0.5)] {
                for _ in 0..6 {
                    let d = Draw { temperature, min_p: 0.0, u: next(), top_p };
                    let want = crate::kernels::draw_columns(&pairs, &d);
                    assert_eq!(draw_row(row, &d), want, "{} columns, {d:?}", row.len());
                }
            }
        }
    }

    /// The grid's sums are the definition's, bit for bit, at every floor the top-p search
    /// tries (a token rarely shows a sum's last bit).
    #[test]
    fn the_grids_sums_are_the_definitions_bits() {
        let mut next = uniforms(5);
        let pairs: Vec<(f32, u32)> = (0..20_000u32)
            .filter_map(|c| {
                let l = ((next() - 0.5) * 30.0) as f32;
                (next() > 0.05).then_some((l, c))
            })
            .collect();
        let top = pairs.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.0));
        let mut grid = Grid::default();
        let arch = Arch::new();
        grid.fill(arch, Numbers::Pairs(&pairs), (top, 0.8, 0.0));
        let live = weighed(&pairs, top, 0.8, 0.0);
        let floors = pairs.iter().step_by(97).map(|p| order_key(p.0)).chain([0, u32::MAX]);
        for floor in floors {
            let want = chunked_sum(&live, floor);
            assert_eq!(grid.mass(arch, floor, false).to_bits(), want.to_bits(), "floor {floor:#x}");
        }
    }

    /// The grid draws the listed definition's token, over rows of a vocabulary's size and of
    /// a few chunks, with gaps (NaN left out) or without, -inf, ties and every kind of draw;
    /// one row after another on the thread's grid (a row without gaps after a longer one of
    /// as many chunks, two such rows of one length in turn).
    #[test]
    fn the_grid_draws_the_definitions_tokens() {
        let mut next = uniforms(11);
        let mut checked = 0;
        let rows = [(49_152usize, true), (49_152, false), (49_152, false), (3_000, false)];
        let rows = rows.into_iter().chain([(2_990, false), (300, true), (257, false), (40, true)]);
        let rows: Vec<(usize, bool)> = rows.collect();
        for (r, &(cols, gaps)) in rows.iter().cycle().take(3 * rows.len()).enumerate() {
            let pairs: Vec<(f32, u32)> = (0..cols as u32)
                .filter_map(|c| match (next() * 20.0) as u32 {
                    0 if gaps => None,
                    1 => Some((f32::NEG_INFINITY, c)),
                    2 => Some((3.0, c)),
                    _ => Some((((next() - 0.5) * 16.0) as f32, c)),
                })
                .collect();
            let top = pairs.iter().fold(f32::NEG_INFINITY, |m, p| m.max(p.0));
            for (temperature, min_p, top_p) in [
                (0.7, 0.0, 1.0),
                (0.7, 0.0, 0.9),
                (1.0, 0.05, 0.95),
                (2.5, 0.0, 0.3),
                (0.2, 0.5, 0.999),
            ] {
                for _ in 0..8 {
                    let d = Draw { temperature, min_p, u: next(), top_p };
                    let want = draw_listed(&pairs, &d, top);
                    assert_eq!(draw(&pairs, &d, top), Some(want), "row {r} of {cols}, {d:?}");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 3 * rows.len() * 5 * 8);
        // Columns too sparse for a grid are left to the list.
        let sparse = [(1.0, 0), (2.0, 5_000)];
        let d = Draw { temperature: 1.0, min_p: 0.0, u: 0.5, top_p: 1.0 };
        assert_eq!(draw(&sparse, &d, 2.0), None);
    }
}
