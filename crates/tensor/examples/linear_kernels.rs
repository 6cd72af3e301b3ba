//! The CPU linear kernels on SmolLM2-135M's projection shapes, for a profiler or a quick
//! comparison: GFLOP/s of the batch-invariant row kernels (`matmul_rows`, `qmatmul`) and of
//! the blocked prefill GEMM, f32 and 4-bit weights, for several row counts. Each shape is
//! held in enough copies (at least [`RESIDENT`] bytes of f32) that a pass over them reads the
//! weights from memory, as a model's step does, not from the last level cache.
//!
//! `cargo run --release -p tpctl-tensor --example linear_kernels [THREADS] [ROWS...]`

use std::time::Instant;
use tensor::kernels::cpu::{matvec, qmatrix, sgemm};
use tensor::kernels::QMatrix;
use tensor::test_util::random_vec as random;

/// (name, out features, in features) of one layer of SmolLM2-135M, and its LM head.
const SHAPES: [(&str, usize, usize); 4] =
    [("qkv", 960, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576)];

/// Bytes of f32 weights per shape, cycled through: more than the last level cache.
const RESIDENT: usize = 256 << 20;

/// Best time of a few runs of `f`, in seconds.
fn best(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let threads = args.first().copied().unwrap_or(2);
    let rows: Vec<usize> =
        if args.len() > 1 { args[1..].to_vec() } else { vec![1, 8, 16, 32, 64, 128] };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
    println!("{threads} threads; GFLOP/s of out[m, n] = x[m, k] · w[n, k]ᵀ");
    println!(
        "{:<8} {:>4} | {:>9} {:>9} | {:>9} {:>9}",
        "shape", "m", "f32 rows", "f32 gemm", "q4 rows", "q4 gemm"
    );
    for (name, n, k) in SHAPES {
        let copies = (RESIDENT / (4 * n * k)).max(1);
        let ws: Vec<Vec<f32>> = (0..copies).map(|c| random(n * k, 1 + c as u64)).collect();
        let nb = n * k / 32;
        let q4s: Vec<QMatrix> = (0..copies)
            .map(|c| {
                let c = 8 * c as u64;
                QMatrix::four_bit(
                    n,
                    k,
                    random(nb, 2 + c).iter().map(|v| v * 0.01).collect(),
                    random(nb, 3 + c).iter().map(|v| v * 0.1).collect(),
                    random(nb * 16, 4 + c).iter().map(|v| ((v + 1.0) * 127.5) as u8).collect(),
                )
                .expect("a 4-bit matrix")
            })
            .collect();
        for &m in &rows {
            let x = random(m * k, 5);
            let mut out = vec![0f32; m * n];
            let flops = 2.0 * (copies * m * n * k) as f64 / 1e9;
            let mut time = |f: &mut (dyn FnMut(&mut [f32]) + Send)| {
                flops / pool.install(|| best(|| f(&mut out)))
            };
            let f32_rows = time(&mut |o| ws.iter().for_each(|w| matvec::matmul_rows(w, &x, m, o)));
            let f32_gemm = time(&mut |o| {
                ws.iter().for_each(|w| {
                    sgemm::matmul_nt_avx512(&x, w, o, m, n, k);
                })
            });
            let q4_rows = time(&mut |o| q4s.iter().for_each(|q| qmatrix::qmatmul(q, &x, m, o)));
            let q4_gemm = time(&mut |o| {
                q4s.iter().for_each(|q| {
                    let row = |j: usize, dst: &mut [f32]| q.dequantize_row(j, dst);
                    sgemm::matmul_nt_rows_avx512(&x, &row, o, m, n, k);
                })
            });
            println!(
                "{name:<8} {m:>4} | {f32_rows:>9.1} {f32_gemm:>9.1} | {q4_rows:>9.1} {q4_gemm:>9.1}"
            );
        }
    }
}
