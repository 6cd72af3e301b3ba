//! Kernel micro-benchmark: decode-shaped matrix-vector products (f32 and quantized) and a
//! prefill-shaped matmul on the default model's shapes; prints the best of several runs.
//!
//! `cargo run -p tpctl-layers --example kernels -- [--threads N]`

use layers::kernels::cpu::quant::{quantize, BlockFormat};
use layers::kernels::{AttnShape, Backend, Kv, QMatrix, Weight};
use layers::Tensor;
use std::time::Instant;

fn best_of(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(2), |s| s.parse())?;
    let be = Backend::cpu(threads)?;
    println!("threads: {threads}");
    for (n, k) in [(576, 576), (1536, 576), (576, 1536), (49152, 576)] {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let x1 = Tensor::from_vec(&[1, k], (0..k).map(|i| (i % 13) as f32 / 13.0).collect())?;
        let dense = Weight::F32(Tensor::from_vec(&[n, k], w.clone())?);
        let t = best_of(20, || drop(be.linear(&x1, &dense)));
        println!(
            "matvec f32  {n:>5}x{k:<5} {:8.3} ms {:6.1} GB/s",
            t * 1e3,
            (n * k * 4) as f64 / t / 1e9
        );
        for f in [BlockFormat::Q8_0, BlockFormat::Q4_1] {
            let q = QMatrix::from_blocks(f, n, k, &quantize(f, &w)).ok_or("bad blocks")?;
            let bytes = q.nbytes();
            let qw = Weight::Quant(q);
            let t = best_of(20, || drop(be.linear(&x1, &qw)));
            println!(
                "matvec {f:?} {n:>5}x{k:<5} {:8.3} ms {:6.1} GB/s",
                t * 1e3,
                bytes as f64 / t / 1e9
            );
        }
        if n <= 1536 {
            let m = 128;
            let xm =
                Tensor::from_vec(&[m, k], (0..m * k).map(|i| (i % 13) as f32 / 13.0).collect())?;
            let t = best_of(5, || drop(be.linear(&xm, &dense)));
            println!(
                "matmul f32  {m}x{n}x{k} {:8.3} ms {:6.1} GFLOP/s",
                t * 1e3,
                (2 * m * n * k) as f64 / t / 1e9
            );
        }
    }
    // Attention over 1600 cached keys (9 query heads, 3 KV heads, head size 64).
    let (t, shape) = (1600, AttnShape { q_heads: 9, kv_heads: 3, head_dim: 64 });
    let kv: Vec<f32> = (0..t * 3 * 64).map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5).collect();
    let kv_pos: Vec<usize> = (0..t).collect();
    for n in [1, 64] {
        let q =
            Tensor::from_vec(&[n, 9, 64], (0..n * 9 * 64).map(|i| (i % 7) as f32 / 7.0).collect())?;
        let q_pos: Vec<usize> = (t - n..t).collect();
        let time = best_of(10, || {
            drop(be.attention(&q, &q_pos, Kv::Host { k: &kv, v: &kv }, &kv_pos, shape, false))
        });
        let flops = (n * 9 * t * 64 * 4) as f64;
        println!(
            "attention {n:>3} queries x {t} keys {:8.3} ms {:6.1} GFLOP/s",
            time * 1e3,
            flops / time / 1e9
        );
    }
    Ok(())
}
