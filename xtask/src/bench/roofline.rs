//! The machine's limits measured in the bench's own run, and what a model file asks of them:
//! a memory-read bandwidth loop and an FMA peak loop on the bench's threads, and a GGUF
//! file's weight bytes and matmul parameters, read from its header.
//!
//! A decode step's ideal time is the larger of its two bounds ([`Cost::ideal_step`]):
//!
//! - bytes: every weight is read once per step (`bytes / bandwidth`), whatever the batch;
//! - FLOPs: each of the step's `N` tokens costs `2 x P + 4 x L x H x D x C` FLOPs, `P` the
//!   parameters of the matmuls (attention and MLP projections of every block, and the LM
//!   head), `L` layers, `H` query heads of `D` dimensions, `C` tokens of context (a
//!   multiply-add per weight; `QK^T` and the attention-weighted sum of `V`, a multiply-add
//!   per head dimension and context token each).
//!
//! What the bound leaves out: the KV cache's reads (they grow with `N x C`), the embedding
//! lookup (a row per token), norms and activations. A tied embedding table is counted once,
//! as the LM head that reads it whole every step.

use anyhow::{bail, ensure, Context, Result};
use pulp::{Arch, Simd, WithSimd};
use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::Path;
use std::time::Instant;

/// The bandwidth loop's buffer: far larger than any L3 cache.
const BUFFER_BYTES: usize = 1 << 30;
/// Passes of each loop (over the buffer; of the FMA rounds); the fastest counts.
const PASSES: usize = 5;
/// FMA rounds per thread in the peak loop, over all its passes (each a multiply-add on every
/// accumulator).
const FMA_ROUNDS: usize = 20_000_000;

/// The machine's limits on `threads` threads, measured now.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Machine {
    /// Memory read bandwidth, bytes per second.
    pub(crate) read_bytes_s: f64,
    /// Peak f32 FMA throughput, FLOPs per second (a multiply-add counts two).
    pub(crate) flops_s: f64,
    /// The SIMD width the loops ran with, in f32 lanes.
    pub(crate) lanes: usize,
}

impl Machine {
    /// Runs both loops on `threads` threads.
    pub(crate) fn measure(threads: usize) -> Machine {
        let (read_bytes_s, lanes) = read_bandwidth(threads);
        Machine { read_bytes_s, flops_s: fma_peak(threads), lanes }
    }
}

/// Sums a [`BUFFER_BYTES`] buffer of f32, a share per thread, with the widest SIMD the CPU
/// has; the fastest of [`PASSES`] passes, in bytes per second, and the lanes used.
fn read_bandwidth(threads: usize) -> (f64, usize) {
    let threads = threads.max(1);
    let mut buffer = vec![0f32; BUFFER_BYTES / 4];
    let chunk = buffer.len().div_ceil(threads);
    // Each thread writes its own share first, so its pages are faulted in before timing.
    std::thread::scope(|s| {
        for (i, part) in buffer.chunks_mut(chunk).enumerate() {
            s.spawn(move || part.iter_mut().enumerate().for_each(|(j, x)| *x = (i + j) as f32));
        }
    });
    let mut best = 0f64;
    let mut lanes = 1;
    for _ in 0..PASSES {
        let start = Instant::now();
        let sums: Vec<(f32, usize)> = std::thread::scope(|s| {
            let handles: Vec<_> = buffer
                .chunks(chunk)
                .map(|part| s.spawn(move || Arch::new().dispatch(Sum(part))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or((0.0, 1))).collect()
        });
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(sums.iter().map(|s| s.0).sum::<f32>());
        lanes = sums.first().map_or(1, |s| s.1);
        best = best.max(BUFFER_BYTES as f64 / secs);
    }
    (best, lanes)
}

/// The sum of a slice with four independent SIMD accumulators, and the lanes per vector.
struct Sum<'a>(&'a [f32]);

impl WithSimd for Sum<'_> {
    type Output = (f32, usize);

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> (f32, usize) {
        let (head, tail) = S::as_simd_f32s(self.0);
        let mut acc = [simd.splat_f32s(0.0); 4];
        let mut quads = head.chunks_exact(4);
        for q in &mut quads {
            for (a, &x) in acc.iter_mut().zip(q) {
                *a = simd.add_f32s(*a, x);
            }
        }
        for &x in quads.remainder() {
            acc[0] = simd.add_f32s(acc[0], x);
        }
        let total = simd.add_f32s(simd.add_f32s(acc[0], acc[1]), simd.add_f32s(acc[2], acc[3]));
        (simd.reduce_sum_f32s(total) + tail.iter().sum::<f32>(), S::F32_LANES)
    }
}

/// FLOPs per second of fused multiply-adds on independent accumulators (enough chains to keep
/// every FMA unit busy), on every thread at once: the fastest of [`PASSES`] passes of
/// [`FMA_ROUNDS`] / [`PASSES`] rounds per thread. One pass over all of them read half the
/// peak when a neighbour's burst on a shared machine fell in it, which put rows above 100%
/// of their roofline.
fn fma_peak(threads: usize) -> f64 {
    let threads = threads.max(1);
    let mut best = 0f64;
    for _ in 0..PASSES {
        let start = Instant::now();
        let flops: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| s.spawn(|| Arch::new().dispatch(Fma(FMA_ROUNDS / PASSES))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0.0)).collect()
        });
        best = best.max(flops.iter().sum::<f64>() / start.elapsed().as_secs_f64());
    }
    best
}

/// Chains of fused multiply-adds on [`Fma::CHAINS`] independent accumulators; the FLOPs done.
struct Fma(usize);

impl Fma {
    /// Independent chains: an FMA's latency (4 cycles) times two FMA units, with room.
    const CHAINS: usize = 12;
}

impl WithSimd for Fma {
    type Output = f64;

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) -> f64 {
        let a = simd.splat_f32s(std::hint::black_box(0.999_999));
        let b = simd.splat_f32s(std::hint::black_box(1e-7));
        let mut acc = [simd.splat_f32s(1.0); Fma::CHAINS];
        for _ in 0..self.0 {
            for x in &mut acc {
                *x = simd.mul_add_f32s(*x, a, b);
            }
        }
        let total = acc.iter().fold(simd.splat_f32s(0.0), |t, &x| simd.add_f32s(t, x));
        std::hint::black_box(simd.reduce_sum_f32s(total));
        (2 * S::F32_LANES * Fma::CHAINS * self.0) as f64
    }
}

/// What one decode step of a model file asks of the machine.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cost {
    /// Bytes of every tensor's data, as the file stores them (read once per step).
    pub(crate) weight_bytes: u64,
    /// Parameters of the matmuls: every block's 2-D weights and the LM head (the tied
    /// embedding table when the file has no `output.weight`).
    pub(crate) matmul_params: u64,
    pub(crate) layers: u64,
    pub(crate) heads: u64,
    pub(crate) head_dim: u64,
}

impl Cost {
    /// FLOPs of one token with `context` tokens before it (see the module docs).
    pub(crate) fn flops_per_token(&self, context: u64) -> f64 {
        (2 * self.matmul_params + 4 * self.layers * self.heads * self.head_dim * context) as f64
    }

    /// The ideal time of a step of `n` tokens at `context` on `machine`, seconds: the larger
    /// of reading every weight once and computing every token's FLOPs at peak.
    pub(crate) fn ideal_step(&self, machine: &Machine, n: usize, context: u64) -> f64 {
        let read = self.weight_bytes as f64 / machine.read_bytes_s;
        let compute = n as f64 * self.flops_per_token(context) / machine.flops_s;
        read.max(compute)
    }

    /// Reads a GGUF file's header: its tensors' sizes and shapes, and the model's layers,
    /// heads and head size.
    ///
    /// # Errors
    /// The file cannot be read or is not a GGUF file this reader knows (version 2 or 3).
    pub(crate) fn of_gguf(path: &Path) -> Result<Cost> {
        let file_len = std::fs::metadata(path)?.len();
        let file = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
        let mut r = Header { r: BufReader::new(file), at: 0 };
        ensure!(&r.bytes(4)? == b"GGUF", "{} is not a GGUF file", path.display());
        let version = r.u32()?;
        ensure!(matches!(version, 2 | 3), "GGUF version {version} (this reader knows 2 and 3)");
        let (tensors, kvs) = (r.u64()?, r.u64()?);
        let mut meta: HashMap<String, Meta> = HashMap::new();
        for _ in 0..kvs {
            let key = r.string()?;
            let kind = r.u32()?;
            meta.insert(key, r.value(kind)?);
        }
        let mut infos = Vec::new();
        for _ in 0..tensors {
            let name = r.string()?;
            let dims = r.u32()?;
            let shape = (0..dims).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
            let _kind = r.u32()?;
            infos.push((name, shape, r.u64()?));
        }
        let align = meta.get("general.alignment").and_then(Meta::int).unwrap_or(32);
        let data = r.at.div_ceil(align) * align;
        // A tensor's bytes run to the next tensor's offset (the last one's to the end of the
        // file): alignment padding, at most `align - 1` bytes a tensor, is counted with it.
        let mut offsets: Vec<u64> = infos.iter().map(|i| i.2).collect();
        offsets.sort_unstable();
        let weight_bytes = file_len.saturating_sub(data + offsets.first().copied().unwrap_or(0));
        let untied = infos.iter().any(|i| i.0 == "output.weight");
        let head = if untied { "output.weight" } else { "token_embd.weight" };
        let matmul_params = infos
            .iter()
            .filter(|(name, shape, _)| {
                (name.starts_with("blk.") && shape.len() >= 2) || name.as_str() == head
            })
            .map(|(_, shape, _)| shape.iter().product::<u64>())
            .sum();
        let arch = match meta.get("general.architecture") {
            Some(Meta::Text(a)) => a.clone(),
            _ => bail!("{}: no general.architecture", path.display()),
        };
        let int = |key: &str| {
            meta.get(&format!("{arch}.{key}"))
                .and_then(Meta::int)
                .with_context(|| format!("{}: no {arch}.{key}", path.display()))
        };
        let heads = int("attention.head_count")?;
        let head_dim = match int("attention.key_length") {
            Ok(d) => d,
            Err(_) => int("embedding_length")? / heads.max(1),
        };
        Ok(Cost { weight_bytes, matmul_params, layers: int("block_count")?, heads, head_dim })
    }
}

/// A metadata value this reader keeps: integers and strings (arrays and floats are skipped).
enum Meta {
    Int(u64),
    Text(String),
    Other,
}

impl Meta {
    fn int(&self) -> Option<u64> {
        match self {
            Meta::Int(v) => Some(*v),
            _ => None,
        }
    }
}

/// A GGUF header read in order, counting the bytes read.
struct Header<R> {
    r: R,
    at: u64,
}

impl<R: Read> Header<R> {
    fn bytes(&mut self, n: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0; n];
        self.r.read_exact(&mut buf).context("the GGUF header ends early")?;
        self.at += n as u64;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap_or_default()))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap_or_default()))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        ensure!(n < 1 << 24, "a GGUF string of {n} bytes");
        Ok(String::from_utf8_lossy(&self.bytes(n as usize)?).into_owned())
    }

    /// A value of GGUF type `kind`.
    fn value(&mut self, kind: u32) -> Result<Meta> {
        let int = |b: Vec<u8>| {
            let mut v = [0u8; 8];
            v[..b.len()].copy_from_slice(&b);
            Meta::Int(u64::from_le_bytes(v))
        };
        Ok(match kind {
            // u8, i8, bool; u16, i16; u32, i32; u64, i64 (a negative value is not used here).
            0 | 1 | 7 => int(self.bytes(1)?),
            2 | 3 => int(self.bytes(2)?),
            4 | 5 => int(self.bytes(4)?),
            10 | 11 => int(self.bytes(8)?),
            // f32, f64.
            6 | 12 => {
                self.bytes(if kind == 6 { 4 } else { 8 })?;
                Meta::Other
            }
            8 => Meta::Text(self.string()?),
            9 => {
                let (inner, n) = (self.u32()?, self.u64()?);
                for _ in 0..n {
                    self.value(inner)?;
                }
                Meta::Other
            }
            other => bail!("GGUF metadata of unknown type {other}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{Cost, Machine};

    /// A GGUF file of `tensors` (name, shape, f32 data), with a llama header of 2 blocks and
    /// 3 heads over 12 dimensions, and metadata the reader skips (a float, a string array).
    fn gguf(tensors: &[(&str, &[u64])]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        let string = |b: &mut Vec<u8>, s: &str| {
            b.extend((s.len() as u64).to_le_bytes());
            b.extend(s.as_bytes());
        };
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend(6u64.to_le_bytes());
        string(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        string(&mut b, "llama");
        for (key, v) in [("llama.block_count", 2u32), ("llama.attention.head_count", 3)] {
            string(&mut b, key);
            b.extend(4u32.to_le_bytes());
            b.extend(v.to_le_bytes());
        }
        string(&mut b, "llama.embedding_length");
        b.extend(10u32.to_le_bytes());
        b.extend(12u64.to_le_bytes());
        string(&mut b, "llama.rope.freq_base");
        b.extend(6u32.to_le_bytes());
        b.extend(1e4f32.to_le_bytes());
        string(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        string(&mut b, "a");
        string(&mut b, "bc");
        let mut offset = 0u64;
        for (name, shape) in tensors {
            string(&mut b, name);
            b.extend((shape.len() as u32).to_le_bytes());
            shape.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(0u32.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offset += (shape.iter().product::<u64>() * 4).div_ceil(32) * 32;
        }
        b.resize(b.len().div_ceil(32) * 32 + offset as usize, 0);
        b
    }

    #[test]
    fn a_gguf_header_gives_the_weight_bytes_and_the_matmul_parameters() {
        let tensors: [(&str, &[u64]); 4] = [
            ("token_embd.weight", &[12, 10]),
            ("blk.0.attn_norm.weight", &[12]),
            ("blk.0.attn_q.weight", &[12, 12]),
            ("blk.1.ffn_down.weight", &[12, 4]),
        ];
        let path = std::env::temp_dir().join(format!("xtask-roofline-{}.gguf", std::process::id()));
        std::fs::write(&path, gguf(&tensors)).unwrap();
        let cost = Cost::of_gguf(&path);
        let _ = std::fs::remove_file(&path);
        let cost = cost.unwrap();
        // f32 data, each tensor padded to 32 bytes: 480 + 64 + 576 + 192.
        assert_eq!(cost.weight_bytes, 1312);
        // The blocks' 2-D weights and the tied embedding table as the LM head; no norm.
        assert_eq!(cost.matmul_params, 120 + 144 + 48);
        assert_eq!((cost.layers, cost.heads, cost.head_dim), (2, 3, 4));
    }

    #[test]
    fn the_step_bound_is_the_larger_of_reading_and_computing() {
        let cost =
            Cost { weight_bytes: 1_000, matmul_params: 100, layers: 2, heads: 3, head_dim: 4 };
        // 2 x 100 + 4 x 2 x 3 x 4 x 10 = 1160 FLOPs a token at a context of 10.
        assert_eq!(cost.flops_per_token(10), 1160.0);
        let machine = Machine { read_bytes_s: 1e4, flops_s: 1160.0 * 100.0, lanes: 8 };
        // One token: reading 1000 bytes (0.1 s) outweighs its FLOPs (0.01 s).
        assert!((cost.ideal_step(&machine, 1, 10) - 0.1).abs() < 1e-12);
        // 64 tokens: 0.64 s of FLOPs outweigh the read.
        assert!((cost.ideal_step(&machine, 64, 10) - 0.64).abs() < 1e-12);
    }
}
