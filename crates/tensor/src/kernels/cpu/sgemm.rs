//! Single-precision `out[m, n] = a[m, k] · w[n, k]ᵀ` with AVX-512, for prefill: about twice
//! as fast as the `gemm` crate's AVX2 kernels on the model's shapes. Quantized weights come in
//! as a row function ([`matmul_nt_rows_avx512`]): each panel task dequantizes its own rows
//! into a buffer of its own before packing them, so the f32 matrix is never written whole.
//!
//! The layout follows BLIS. The columns of `out` are cut into panels of `NR` output
//! features, one rayon task each. A task copies its panel of `w`, `KC_MAX` values of `k` at
//! a time, into a buffer transposed to `[k][NR]`, so that one step of `k` is `NV` aligned
//! vectors; the buffer stays in L1 while a register-blocked microkernel sweeps every row of
//! `a` past it, `MR` rows at a time, holding an `MR × NR` tile of `out` in `MR · NV` of the
//! 32 zmm registers. Each step of `k` then costs `NV` loads and `MR` broadcasts for
//! `MR · NV` fused multiply-adds. `a` is read in place (it is small, and every task reads
//! it), and a tile of `out` is written once per block of `k`: stored by the first, added to
//! by the others.
//!
//! One of the modules of the crate with `unsafe`: the vector loads and stores take raw
//! pointers, and the tasks share `out`, each writing only its own columns of every row. Every
//! pointer comes from a slice whose bounds are checked before the loop that uses it.
//!
//! Needs Rust 1.89, where the AVX-512 intrinsics and target features became stable.
#![allow(unsafe_code)]

/// `out[m, n] = a[m, k] · w[n, k]ᵀ` (row-major, f32 accumulation) on the threads of the current
/// rayon pool, with AVX-512 kernels; returns false (touching nothing) when the CPU lacks
/// AVX-512F.
///
/// # Panics
/// When a slice length does not match `m`, `n`, `k`.
pub fn matmul_nt_avx512(
    a: &[f32],
    w: &[f32],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> bool {
    assert_eq!(a.len(), m * k, "sgemm: a has {} values, want {m}x{k}", a.len());
    assert_eq!(w.len(), n * k, "sgemm: w has {} values, want {n}x{k}", w.len());
    assert_eq!(out.len(), m * n, "sgemm: out has {} values, want {m}x{n}", out.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        x86::matmul_nt(a, w, out, m, n, k);
        return true;
    }
    false
}

/// [`matmul_nt_avx512`] with the rows of `w` given by `row(j, out)`, which writes row `j`
/// (`k` values) into `out`: each panel task asks for its own `NR` rows once, into a buffer of
/// its own, so a quantized matrix is dequantized by the tasks in parallel, a panel at a time,
/// without an f32 copy of the whole matrix. The result is the same bits as
/// [`matmul_nt_avx512`] on the matrix of those rows.
///
/// # Panics
/// When a slice length does not match `m`, `n`, `k`.
pub fn matmul_nt_rows_avx512(
    a: &[f32],
    row: &(dyn Fn(usize, &mut [f32]) + Sync),
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> bool {
    assert_eq!(a.len(), m * k, "sgemm: a has {} values, want {m}x{k}", a.len());
    assert_eq!(out.len(), m * n, "sgemm: out has {} values, want {m}x{n}", out.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        x86::matmul_nt_with(a, x86::Source::Rows(row), out, m, n, k);
        return true;
    }
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::kernels::cpu::shared_out::SharedOut;
    use core::arch::x86_64::*;
    use rayon::prelude::*;

    /// Rows of `a` per microkernel tile.
    const MR: usize = 8;
    /// 16-float vectors per tile row: with `MR`, 24 accumulators, 3 vectors of `w` and a
    /// broadcast of `a` in the 32 zmm registers.
    const NV: usize = 3;
    /// Columns of `out` per panel (and per tile); it divides every `n` of the model.
    const NR: usize = NV * 16;
    /// The most values of `k` packed at once: 256 × 48 floats is 48 KiB, the size of L1.
    const KC_MAX: usize = 256;

    /// Where the rows of `w` come from.
    #[derive(Clone, Copy)]
    pub(super) enum Source<'a> {
        /// `w` itself, `n × k` values.
        Dense(&'a [f32]),
        /// Row `j` written by the function (a quantized matrix dequantizing it).
        Rows(&'a (dyn Fn(usize, &mut [f32]) + Sync)),
    }

    /// The caller has checked the lengths and that the CPU has AVX-512F.
    pub(super) fn matmul_nt(a: &[f32], w: &[f32], out: &mut [f32], m: usize, n: usize, k: usize) {
        matmul_nt_with(a, Source::Dense(w), out, m, n, k);
    }

    /// As [`matmul_nt`], the rows of `w` from `w`.
    pub(super) fn matmul_nt_with(
        a: &[f32],
        w: Source<'_>,
        out: &mut [f32],
        m: usize,
        n: usize,
        k: usize,
    ) {
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            out.fill(0.0);
            return;
        }
        // Blocks of equal size, so that none is a sliver.
        let kc = k.div_ceil(k.div_ceil(KC_MAX));
        let job = Job { a, w, out: SharedOut::new(out, n), m, n, k, kc };
        (0..n.div_ceil(NR)).into_par_iter().for_each_init(Panel::new, |panel, p| {
            // SAFETY: `matmul_nt_avx512` checked that the CPU has AVX-512F, and panel `p`
            // (columns `p · NR ..`) is computed by this task only.
            unsafe { job.column_panel(panel, p) }
        });
    }

    /// One product, shared by the tasks that compute its column panels.
    struct Job<'a> {
        a: &'a [f32],
        w: Source<'a>,
        out: SharedOut<'a>,
        m: usize,
        n: usize,
        k: usize,
        /// Values of `k` per packed block.
        kc: usize,
    }

    /// A block of `w`, transposed: `data[q · NR + c]` is `w[j0 + c, p0 + q]` for `q < depth`,
    /// and zero for the columns `c >= cols` past the end of `w`.
    struct Panel {
        data: Box<Aligned>,
        /// The panel's rows of `w` (`NR × k`), when they come from a row function.
        rows: Vec<f32>,
        j0: usize,
        cols: usize,
        p0: usize,
        depth: usize,
    }

    /// On a cache line boundary, so that each vector of the panel is one aligned load.
    #[repr(C, align(64))]
    struct Aligned([f32; KC_MAX * NR]);

    impl Panel {
        fn new() -> Self {
            Panel {
                data: Box::new(Aligned([0.0; KC_MAX * NR])),
                rows: Vec::new(),
                j0: 0,
                cols: 0,
                p0: 0,
                depth: 0,
            }
        }
    }

    // One arm per row count below MR in `column_panel`.
    const _: () = assert!(MR == 8);

    impl Job<'_> {
        /// Computes columns `p · NR ..` of `out` (panel `p`).
        ///
        /// # Safety
        /// The CPU has AVX-512F, and no other thread touches this panel's columns of `out`.
        #[target_feature(enable = "avx512f")]
        unsafe fn column_panel(&self, panel: &mut Panel, p: usize) {
            panel.j0 = p * NR;
            panel.cols = NR.min(self.n - panel.j0);
            if let Source::Rows(row) = self.w {
                panel.rows.resize(panel.cols * self.k, 0.0);
                for (j, dst) in panel.rows.chunks_exact_mut(self.k).enumerate() {
                    row(panel.j0 + j, dst);
                }
            }
            for p0 in (0..self.k).step_by(self.kc) {
                panel.p0 = p0;
                panel.depth = self.kc.min(self.k - p0);
                self.pack(panel);
                for i0 in (0..self.m).step_by(MR) {
                    // SAFETY: each arm's tile has as many rows as are left from `i0`, and
                    // the caller owns the panel's columns.
                    unsafe {
                        match self.m - i0 {
                            1 => self.tile::<1>(panel, i0),
                            2 => self.tile::<2>(panel, i0),
                            3 => self.tile::<3>(panel, i0),
                            4 => self.tile::<4>(panel, i0),
                            5 => self.tile::<5>(panel, i0),
                            6 => self.tile::<6>(panel, i0),
                            7 => self.tile::<7>(panel, i0),
                            _ => self.tile::<MR>(panel, i0),
                        }
                    }
                }
            }
        }

        /// Fills `panel.data` from `w[j0 .. j0 + cols, p0 .. p0 + depth]`, transposing 16 × 16
        /// values at a time.
        #[target_feature(enable = "avx512f")]
        fn pack(&self, panel: &mut Panel) {
            let (j0, cols, p0, depth) = (panel.j0, panel.cols, panel.p0, panel.depth);
            // The panel's rows: in `w` from row j0, or in the panel's own buffer from row 0.
            let (w, first) = match self.w {
                Source::Dense(w) => (w, j0),
                Source::Rows(_) => (&panel.rows[..], 0),
            };
            for v in 0..NV {
                for q0 in (0..depth).step_by(16) {
                    let width = 16.min(depth - q0);
                    let rows: [__m512; 16] = core::array::from_fn(|r| {
                        let j = v * 16 + r;
                        if j < cols {
                            let start = (first + j) * self.k + p0 + q0;
                            load_prefix(&w[start..start + width])
                        } else {
                            _mm512_setzero_ps()
                        }
                    });
                    for (q, column) in transpose(rows).into_iter().take(width).enumerate() {
                        let at = (q0 + q) * NR + v * 16;
                        store(&mut panel.data.0[at..at + 16], column);
                    }
                }
            }
        }

        /// `out[i0 .. i0 + R, panel columns] (+)= a[i0 .. i0 + R, panel's k] · panel`, with
        /// `R × NV` accumulators: each step of `k` loads `NV` vectors of the panel and
        /// multiplies them by a broadcast value of each row of `a`.
        ///
        /// # Safety
        /// The CPU has AVX-512F, `i0 + R <= m`, and no other thread touches the panel's
        /// columns of `out`.
        #[target_feature(enable = "avx512f")]
        unsafe fn tile<const R: usize>(&self, panel: &Panel, i0: usize) {
            let depth = panel.depth;
            let w = &panel.data.0[..depth * NR];
            // The rows of `a` as pointers to `depth` values each (as slices, each row would
            // keep a bounds check in the loop).
            let a: [*const f32; R] = core::array::from_fn(|r| {
                let start = (i0 + r) * self.k + panel.p0;
                self.a[start..][..depth].as_ptr()
            });
            let mut acc = [[_mm512_setzero_ps(); NV]; R];
            for q in 0..depth {
                // SAFETY: `q < depth`, so the NR values from `q · NR` lie in `w`, on a
                // 64-byte boundary (the buffer is aligned and NR · 4 is a multiple of 64).
                let w: [__m512; NV] = core::array::from_fn(|v| unsafe {
                    _mm512_load_ps(w.as_ptr().add(q * NR + v * 16))
                });
                for (acc, a) in acc.iter_mut().zip(a) {
                    // SAFETY: `q < depth`, the length of the row.
                    let a = _mm512_set1_ps(unsafe { *a.add(q) });
                    for (acc, w) in acc.iter_mut().zip(w) {
                        *acc = _mm512_fmadd_ps(a, w, *acc);
                    }
                }
            }
            let accumulate = panel.p0 > 0;
            for (r, acc) in acc.into_iter().enumerate() {
                for (v, acc) in acc.into_iter().enumerate() {
                    let cols = panel.cols.saturating_sub(v * 16).min(16);
                    if cols == 0 {
                        break;
                    }
                    let mask = mask(cols);
                    // SAFETY: `i0 + r < m` and `j0 + v · 16 + cols <= j0 + panel.cols <= n`,
                    // and the caller owns these columns; masked lanes are not accessed.
                    unsafe {
                        let dst = self.out.at(i0 + r, panel.j0 + v * 16);
                        let sum = if accumulate {
                            _mm512_add_ps(acc, _mm512_maskz_loadu_ps(mask, dst))
                        } else {
                            acc
                        };
                        _mm512_mask_storeu_ps(dst, mask, sum);
                    }
                }
            }
        }
    }

    /// The first `lanes` (at most 16) lanes.
    fn mask(lanes: usize) -> __mmask16 {
        debug_assert!(lanes <= 16);
        ((1u32 << lanes) - 1) as __mmask16
    }

    /// `src` (at most 16 values) in the low lanes of a vector, zeros above.
    #[target_feature(enable = "avx512f")]
    fn load_prefix(src: &[f32]) -> __m512 {
        // SAFETY: the mask enables the first `src.len()` lanes only, so only `src` is read.
        unsafe { _mm512_maskz_loadu_ps(mask(src.len()), src.as_ptr()) }
    }

    /// Stores a vector into `dst`: 16 values on a 64-byte boundary.
    #[target_feature(enable = "avx512f")]
    fn store(dst: &mut [f32], v: __m512) {
        assert!(dst.len() == 16 && dst.as_ptr().cast::<__m512>().is_aligned());
        // SAFETY: checked just above.
        unsafe { _mm512_store_ps(dst.as_mut_ptr(), v) }
    }

    /// A 16 × 16 transpose: lane `c` of `r[i]` becomes lane `i` of the result's vector `c`.
    #[target_feature(enable = "avx512f")]
    fn transpose(r: [__m512; 16]) -> [__m512; 16] {
        // Interleave pairs of rows: t[2i] holds rows 2i, 2i + 1 of columns 0, 1 in its first
        // 128-bit lane (4, 5 in the second, and so on), t[2i + 1] those of columns 2, 3.
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // Then pairs of pairs: u[4g + c] holds rows 4g .. 4g + 4 of columns c, c + 4, c + 8,
        // c + 12, one column per 128-bit lane.
        let (pd, ps) = (_mm512_castps_pd, _mm512_castpd_ps);
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let [a, b, c, d] = [t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]];
            u[4 * g] = ps(_mm512_unpacklo_pd(pd(a), pd(c)));
            u[4 * g + 1] = ps(_mm512_unpackhi_pd(pd(a), pd(c)));
            u[4 * g + 2] = ps(_mm512_unpacklo_pd(pd(b), pd(d)));
            u[4 * g + 3] = ps(_mm512_unpackhi_pd(pd(b), pd(d)));
        }
        // Finally gather 128-bit lanes: column 4L + c is lane L of u[c], u[4 + c], u[8 + c]
        // and u[12 + c], in that order.
        const EVEN: i32 = 0b10_00_10_00;
        const ODD: i32 = 0b11_01_11_01;
        let mut out = [_mm512_setzero_ps(); 16];
        for c in 0..4 {
            let even01 = _mm512_shuffle_f32x4::<EVEN>(u[c], u[4 + c]);
            let odd01 = _mm512_shuffle_f32x4::<ODD>(u[c], u[4 + c]);
            let even23 = _mm512_shuffle_f32x4::<EVEN>(u[8 + c], u[12 + c]);
            let odd23 = _mm512_shuffle_f32x4::<ODD>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_f32x4::<EVEN>(even01, even23);
            out[4 + c] = _mm512_shuffle_f32x4::<EVEN>(odd01, odd23);
            out[8 + c] = _mm512_shuffle_f32x4::<ODD>(even01, even23);
            out[12 + c] = _mm512_shuffle_f32x4::<ODD>(odd01, odd23);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{naive_matmul_nt as naive, random_vec};

    fn has_avx512() -> bool {
        #[cfg(target_arch = "x86_64")]
        return std::is_x86_feature_detected!("avx512f");
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Checks every shape on pools of 1 and 2 threads.
    fn check(shapes: &[(usize, usize, usize)]) {
        if !has_avx512() {
            eprintln!("skipped: the CPU lacks AVX-512F");
            return;
        }
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for (seed, &(m, n, k)) in shapes.iter().enumerate() {
                let a = random_vec(m * k, 2 * seed as u64 + 1);
                let w = random_vec(n * k, 2 * seed as u64 + 2);
                let mut out = vec![f32::NAN; m * n];
                assert!(pool.install(|| matmul_nt_avx512(&a, &w, &mut out, m, n, k)));
                let want = naive(&a, &w, m, n, k);
                for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{m}x{n}x{k} on {threads} threads, out[{}, {}]: got {got}, want {want}",
                        i / n,
                        i % n
                    );
                }
            }
        }
    }

    /// Rows from a function (a quantized matrix's dequantization) give the dense product's
    /// bits: same packing, same summation order.
    #[test]
    fn rows_from_a_function_give_the_dense_bits() {
        if !has_avx512() {
            eprintln!("skipped: the CPU lacks AVX-512F");
            return;
        }
        for (seed, (m, n, k)) in
            [(33, 49, 17), (40, 97, 600), (128, 576, 1536), (35, 48, 256)].into_iter().enumerate()
        {
            let a = random_vec(m * k, 3 * seed as u64 + 1);
            let w = random_vec(n * k, 3 * seed as u64 + 2);
            let (mut dense, mut rows) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            assert!(matmul_nt_avx512(&a, &w, &mut dense, m, n, k));
            let row = |j: usize, dst: &mut [f32]| dst.copy_from_slice(&w[j * k..(j + 1) * k]);
            assert!(matmul_nt_rows_avx512(&a, &row, &mut rows, m, n, k));
            let same = dense.iter().zip(&rows).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{m}x{n}x{k}: rows from a function differ from the dense product");
        }
    }

    #[test]
    fn matches_naive_on_small_and_odd_shapes() {
        let mut s = 0x2545_f491_4f6c_dd1d_u64;
        let mut dim = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            1 + (s % 70) as usize
        };
        let mut shapes: Vec<_> = (0..200).map(|_| (dim(), dim(), dim())).collect();
        // Every row count up to a tile and past it, columns on and around the vector and
        // panel widths, and depths around a vector and a packed block.
        shapes.extend((1..=17).map(|m| (m, 49, 17)));
        shapes.extend([15, 16, 17, 32, 47, 48, 49, 96, 97].map(|n| (9, n, 33)));
        shapes.extend([1, 15, 16, 255, 256, 257, 513, 600].map(|k| (10, 50, k)));
        check(&shapes);
    }

    #[test]
    fn matches_naive_on_model_shapes() {
        check(&[
            (128, 1536, 576),
            (33, 576, 1536),
            (128, 576, 576),
            (71, 192, 576),
            (3, 49152, 576),
        ]);
    }

    #[test]
    fn empty_dimensions() {
        if !has_avx512() {
            eprintln!("skipped: the CPU lacks AVX-512F");
            return;
        }
        let mut out = vec![f32::NAN; 6];
        assert!(matmul_nt_avx512(&[], &[], &mut out, 2, 3, 0));
        assert_eq!(out, [0.0; 6]);
        assert!(matmul_nt_avx512(&[], &[1.0; 4], &mut [], 0, 2, 2));
        assert!(matmul_nt_avx512(&[1.0; 4], &[], &mut [], 2, 0, 2));
    }
}
