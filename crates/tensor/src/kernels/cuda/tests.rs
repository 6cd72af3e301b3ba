//! The CUDA backend against the CPU backend: every `Backend` method on random inputs (whole
//! models on the GPU are checked in the layers crate). Without a usable GPU these tests print a note and return, unless
//! `TPCTL_REQUIRE_GPU=1`, when they fail; the error test runs everywhere.
//!
//! Tolerances: 1e-4 relative (to max(1, |want|)) for f32 ops; quantized products are checked
//! at 1e-4 against the CPU's f32 product on the dequantized matrix and against the CPU's
//! quantized kernels (the same arithmetic in another order).

use crate::error::Error;
use crate::kernels::cpu::quant::{quantize, BlockFormat};
use crate::kernels::{AttnShape, Backend, GemmDtype, Kv, Projected, QMatrix, Weight};
use crate::tensor::{Device, Tensor};
use crate::test_util::{assert_close, assert_rel, cuda_of, gpu, gpu_in, random_vec};

fn cpu() -> Backend {
    Backend::cpu(2).unwrap()
}

fn tensor(shape: &[usize], seed: u64) -> Tensor {
    Tensor::from_vec(shape, random_vec(shape.iter().product(), seed)).unwrap()
}

#[test]
fn cuda_backend_without_a_device_is_a_clear_error() {
    // No machine has this device, so this checks the error path everywhere.
    let err = Backend::cuda(4096).unwrap_err();
    let msg = err.to_string();
    match err {
        Error::NotCompiledWith { feature } => assert_eq!(feature, "cuda"),
        Error::BackendUnavailable { backend, reason } => {
            assert_eq!(backend, "cuda");
            assert!(reason.starts_with("device 4096: "), "{msg}");
        }
        other => panic!("unexpected error: {other}"),
    }
    assert!(msg.contains("cuda"), "{msg}");
    // Device 0 either works (on a GPU machine) or says why, without panicking.
    if let Some(be) = gpu() {
        assert_eq!(be.device(), Device::Cuda(0));
    }
}

#[test]
fn cuda_norm_rope_and_elementwise_ops_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    // RMSNorm: rows wider and narrower than a thread block.
    for (rows, d) in [(3, 64), (5, 576), (2, 1000)] {
        let x = tensor(&[rows, d], 1);
        let w = tensor(&[d], 2);
        let want = cpu.rms_norm(&x, &w, 1e-5).unwrap();
        let got = gpu.rms_norm(&x, &w, 1e-5).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert_close(got.host().unwrap(), want.host().unwrap(), 1e-4);
        // The residual add fused with the norm: close to the CPU's, and the same bits as the
        // GPU's two separate kernels.
        let y = tensor(&[rows, d], 3);
        let (mut xc, mut xg, mut apart) = (x.clone(), x.clone(), x.clone());
        let want = cpu.add_rms_norm(&mut xc, &y, &w, 1e-5).unwrap();
        let got = gpu.add_rms_norm(&mut xg, &y, &w, 1e-5).unwrap();
        assert_close(xg.host().unwrap(), xc.host().unwrap(), 1e-4);
        assert_close(got.host().unwrap(), want.host().unwrap(), 1e-4);
        gpu.add_assign(&mut apart, &y).unwrap();
        let two = gpu.rms_norm(&apart, &w, 1e-5).unwrap();
        assert_close(xg.host().unwrap(), apart.host().unwrap(), 0.0);
        assert_close(got.host().unwrap(), two.host().unwrap(), 0.0);
    }
    // RoPE, full and partial, at large positions.
    for (heads, head_dim, rot_dim) in [(4, 16, 16), (3, 64, 32), (2, 128, 128)] {
        let positions = [0usize, 1, 7, 1000, 8191];
        let mut a = tensor(&[positions.len(), heads * head_dim], 3);
        let mut b = a.clone();
        cpu.rope(&mut a, &positions, heads, head_dim, rot_dim, 10_000.0).unwrap();
        gpu.rope(&mut b, &positions, heads, head_dim, rot_dim, 10_000.0).unwrap();
        assert_close(b.host().unwrap(), a.host().unwrap(), 1e-4);
        // With per-pair frequency factors (Llama 3 scaling divides the low frequencies).
        let factors: Vec<f32> = (0..rot_dim / 2).map(|i| 1.0 + (i % 5) as f32 * 2.0).collect();
        let dims = (heads, head_dim, rot_dim);
        cpu.rope_scaled(&mut a, &positions, dims, 500_000.0, Some(&factors), 1.0).unwrap();
        gpu.rope_scaled(&mut b, &positions, dims, 500_000.0, Some(&factors), 1.0).unwrap();
        assert_close(b.host().unwrap(), a.host().unwrap(), 1e-4);
        // And longrope's attention factor on the cosines and sines.
        cpu.rope_scaled(&mut a, &positions, dims, 10_000.0, Some(&factors), 1.19).unwrap();
        gpu.rope_scaled(&mut b, &positions, dims, 10_000.0, Some(&factors), 1.19).unwrap();
        assert_close(b.host().unwrap(), a.host().unwrap(), 1e-4);
    }
    // SiLU-gated product, residual add, bias add.
    let (mut g1, up) = (tensor(&[7, 300], 4), tensor(&[7, 300], 5));
    let mut g2 = g1.clone();
    cpu.silu_mul(&mut g1, &up).unwrap();
    gpu.silu_mul(&mut g2, &up).unwrap();
    assert_close(g2.host().unwrap(), g1.host().unwrap(), 1e-4);
    let (mut x1, y) = (tensor(&[3, 1025], 6), tensor(&[3, 1025], 7));
    let mut x2 = x1.clone();
    cpu.add_assign(&mut x1, &y).unwrap();
    gpu.add_assign(&mut x2, &y).unwrap();
    assert_close(x2.host().unwrap(), x1.host().unwrap(), 1e-4);
    let bias = tensor(&[1025], 8);
    cpu.add_bias(&mut x1, &bias).unwrap();
    gpu.add_bias(&mut x2, &bias).unwrap();
    assert_close(x2.host().unwrap(), x1.host().unwrap(), 1e-4);
    // Shape errors are the same on both.
    let err = gpu.add_assign(&mut x2, &bias).unwrap_err();
    assert!(err.to_string().contains("add_assign"), "{err}");
}

#[test]
fn cuda_embedding_and_argmax_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    let (vocab, dim) = (50, 64);
    let dense = random_vec(vocab * dim, 9);
    let mut tables = vec![Weight::F32(Tensor::from_vec(&[vocab, dim], dense.clone()).unwrap())];
    for f in [BlockFormat::Q8_0, BlockFormat::Q4_0, BlockFormat::Q4_1] {
        let q = QMatrix::from_blocks(f, vocab, dim, &quantize(f, &dense)).unwrap();
        tables.push(Weight::Quant(q));
    }
    let ids = [3u32, 0, 49, 3, 17];
    for table in &tables {
        let want = cpu.embedding(table, &ids).unwrap();
        let got = gpu.embedding(table, &ids).unwrap();
        // A gather of exactly dequantized values: bit-identical.
        assert_eq!(got.host().unwrap(), want.host().unwrap());
        let err = gpu.embedding(table, &[1, 50]).unwrap_err();
        assert!(err.to_string().contains("token id 50 at index 1"), "{err}");
    }
    // Argmax: ties take the first, NaN never wins, rows wider than a block.
    let mut x = random_vec(4 * 3000, 10);
    x[5] = 7.0;
    x[2900] = 7.0;
    x[3000] = f32::NAN;
    x[5999] = 9.0;
    x[2 * 3000..3 * 3000].fill(f32::NAN);
    let x = Tensor::from_vec(&[4, 3000], x).unwrap();
    let want = cpu.argmax_rows(&x).unwrap();
    assert_eq!(want[0], 5);
    assert_eq!(want[2], 0);
    assert_eq!(gpu.argmax_rows(&x).unwrap(), want);
    let wide = tensor(&[2, 49152], 11);
    assert_eq!(gpu.argmax_rows(&wide).unwrap(), cpu.argmax_rows(&wide).unwrap());
}

/// The candidates of rows with ties, NaN and infinities, from 1 to 1024 per row over a
/// vocabulary-wide row: the CPU's, and only they come to the host (no logits row).
#[test]
fn cuda_top_k_rows_are_the_cpus_candidates() {
    let Some(gpu) = gpu() else { return };
    let cuda = cuda_of(&gpu);
    let cpu = cpu();
    let cols = 49152;
    let mut x: Vec<f32> = random_vec(3 * cols, 12).iter().map(|v| (v * 20.0).round()).collect();
    x[7] = f32::INFINITY;
    x[100] = f32::NAN;
    x[cols + 5] = f32::NEG_INFINITY;
    x[2 * cols..].fill(f32::NAN);
    x[2 * cols + 9] = 1.0;
    let x = Tensor::from_vec(&[3, cols], x).unwrap();
    for k in [1, 5, 50, 1024] {
        let want = cpu.top_k_rows(&x, k).unwrap();
        let before = cuda.counters();
        let got = gpu.top_k_rows(&x, k).unwrap();
        let moved = cuda.counters().since(&before);
        assert_eq!(got.ids(), want.ids(), "k {k}");
        for r in 0..3 {
            let (g, w): (Vec<_>, Vec<_>) = (got.row(r).collect(), want.row(r).collect());
            assert_eq!(g, w, "k {k}, row {r}");
        }
        assert_eq!((moved.launches, moved.downloads), (1, 2), "k {k}: {moved:?}");
    }
}

/// Tokens drawn on the GPU from whole rows are the CPU's draws, id for id (the same f64
/// arithmetic, see `kernels::sample`): greedy, temperatures with and without min-p and top-p,
/// a row of NaN, over a vocabulary-wide row; one launch and one download.
#[test]
fn cuda_sample_rows_draw_the_cpus_tokens() {
    use crate::kernels::Draw;
    let Some(gpu) = gpu() else { return };
    let cuda = cuda_of(&gpu);
    let cpu = cpu();
    let (rows, cols) = (24, 49152);
    let mut x: Vec<f32> = random_vec(rows * cols, 13).iter().map(|v| v * 12.0).collect();
    x[3 * cols..4 * cols].fill(f32::NAN);
    x[5 * cols + 77] = f32::NAN;
    let x = Tensor::from_vec(&[rows, cols], x).unwrap();
    let draws: Vec<Draw> = (0..rows)
        .map(|r| Draw {
            temperature: [0.0, 0.4, 1.0, 2.0][r % 4],
            min_p: [0.0, 0.1][r % 2],
            u: (r as f64 * 0.618_033_988_75).fract(),
            top_p: [1.0, 0.9, 0.3][r % 3],
        })
        .collect();
    let want = cpu.sample_rows(&x, &draws).unwrap();
    let before = cuda.counters();
    let got = gpu.sample_rows(&x, &draws).unwrap();
    let moved = cuda.counters().since(&before);
    assert_eq!(got, want);
    assert_eq!((moved.launches, moved.downloads), (1, 1), "{moved:?}");
}

/// Row normalizers and picked columns on the GPU are the CPU's, bit for bit (the same f64
/// arithmetic, see `kernels::logprob`), over vocabulary-wide rows with NaN and -inf; each one
/// launch, the normalizers two downloads (tops and sums).
#[test]
fn cuda_normalizers_and_columns_are_the_cpus() {
    let Some(gpu) = gpu() else { return };
    let cuda = cuda_of(&gpu);
    let cpu = cpu();
    let (rows, cols) = (9, 49152);
    let mut x: Vec<f32> = random_vec(rows * cols, 17).iter().map(|v| v * 12.0).collect();
    x[2 * cols..3 * cols].fill(f32::NAN);
    x[4 * cols + 5] = f32::NEG_INFINITY;
    x[6 * cols + 77] = f32::NAN;
    let x = Tensor::from_vec(&[rows, cols], x).unwrap();
    let want = cpu.normalizers(&x).unwrap();
    let before = cuda.counters();
    let got = gpu.normalizers(&x).unwrap();
    let moved = cuda.counters().since(&before);
    let bits = |n: &[crate::kernels::Normalizer]| -> Vec<(u32, u64)> {
        n.iter().map(|n| (n.top.to_bits(), n.sum.to_bits())).collect()
    };
    assert_eq!(bits(&got), bits(&want));
    assert_eq!((moved.launches, moved.downloads), (1, 2), "{moved:?}");
    let columns: Vec<u32> = (0..rows as u32).map(|r| r * 4099 % cols as u32).collect();
    let want = cpu.columns_at(&x, &columns).unwrap();
    let got = gpu.columns_at(&x, &columns).unwrap();
    let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|v| v.to_bits()).collect() };
    assert_eq!(bits(&got), bits(&want));
}

#[test]
fn cuda_linear_matches_cpu_for_f32_and_quantized_weights() {
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    for (n, k) in [(40, 64), (33, 96), (576, 1536)] {
        let wf = random_vec(n * k, 12);
        let dense = Weight::F32(Tensor::from_vec(&[n, k], wf.clone()).unwrap());
        for m in [1, 3, 17] {
            let x = tensor(&[m, k], 13);
            let want = cpu.linear(&x, &dense).unwrap();
            let got = gpu.linear(&x, &dense).unwrap();
            assert_eq!(got.shape(), &[m, n]);
            assert_close(got.host().unwrap(), want.host().unwrap(), 1e-4);
        }
        for f in [BlockFormat::Q8_0, BlockFormat::Q4_0, BlockFormat::Q4_1] {
            let q = QMatrix::from_blocks(f, n, k, &quantize(f, &wf)).unwrap();
            let deq = Weight::F32(Tensor::from_vec(&[n, k], q.dequantize()).unwrap());
            let quant = Weight::Quant(q);
            // Few rows read the packed weight (`qmatvec`, two blocks of rows at 12); many
            // (70) go through a dequantized copy and cuBLAS.
            for m in [1, 12, 70] {
                let x = tensor(&[m, k], 14);
                let got = gpu.linear(&x, &quant).unwrap();
                assert_close(
                    got.host().unwrap(),
                    cpu.linear(&x, &deq).unwrap().host().unwrap(),
                    1e-4,
                );
                // The CPU's quantized kernels multiply the same dequantized values in f32.
                assert_close(
                    got.host().unwrap(),
                    cpu.linear(&x, &quant).unwrap().host().unwrap(),
                    1e-4,
                );
            }
            // The next format's quants may land at these (Q4_0 and Q4_1 have the same
            // length): the free is announced, as a model's drop does.
            drop(quant);
            crate::memory::weights_changed();
        }
    }
    // A 3-d input keeps its leading shape.
    let w = Weight::F32(tensor(&[8, 32], 15));
    let x = tensor(&[2, 3, 32], 16);
    let got = gpu.linear(&x, &w).unwrap();
    assert_eq!(got.shape(), &[2, 3, 8]);
    assert_close(got.host().unwrap(), cpu.linear(&x, &w).unwrap().host().unwrap(), 1e-4);
}

/// The weight cache trusts a copy within one weights generation: a weight rewritten in place
/// and announced is uploaded again into the same device memory, and so is a new weight at a
/// freed one's address once the free is announced (as a model's drop announces it).
#[test]
fn cuda_weight_cache_uploads_once_and_again_after_a_generation_bump() {
    use crate::memory::weights_changed;
    let Some(gpu) = gpu() else { return };
    let Backend::Cuda(dev) = &gpu else { unreachable!("gpu() returns the cuda backend") };
    let cpu = cpu();
    let x = tensor(&[2, 64], 17);
    let before = dev.cached_weight_bytes();
    let mut w = Weight::F32(tensor(&[48, 64], 18));
    gpu.linear(&x, &w).unwrap();
    let after_one = dev.cached_weight_bytes();
    assert_eq!(after_one - before, 48 * 64 * 4);
    gpu.linear(&x, &w).unwrap();
    assert_eq!(dev.cached_weight_bytes(), after_one, "the second use hits the cache");
    // Rewritten in place (as a weight update writes), then announced.
    let Weight::F32(t) = &mut w else { unreachable!("an f32 weight") };
    t.data_mut().iter_mut().for_each(|v| *v = -*v);
    weights_changed();
    assert_close(
        gpu.linear(&x, &w).unwrap().host().unwrap(),
        cpu.linear(&x, &w).unwrap().host().unwrap(),
        1e-4,
    );
    assert_eq!(dev.cached_weight_bytes(), after_one, "uploaded again into the same slot");
    // Free it and make weights of the same size until one lands at the same address (the
    // allocator usually reuses it at once); each must give its own product.
    drop(w);
    for seed in 19..27 {
        weights_changed();
        let w = Weight::F32(tensor(&[48, 64], seed));
        assert_close(
            gpu.linear(&x, &w).unwrap().host().unwrap(),
            cpu.linear(&x, &w).unwrap().host().unwrap(),
            1e-4,
        );
    }
    dev.clear_weight_cache();
    assert_eq!(dev.cached_weight_bytes(), 0);
}

#[test]
fn cuda_attention_matches_cpu_with_log_sum_exp() {
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    // (q_heads, kv_heads, head_dim, queries, keys): GQA prefill, decode over many key tiles,
    // head_dim above the block size, and MHA.
    let cases = [(6, 2, 16, 9, 9), (9, 3, 64, 1, 300), (4, 2, 160, 5, 130), (2, 2, 128, 40, 40)];
    for (seed, &(q_heads, kv_heads, head_dim, n, t)) in cases.iter().enumerate() {
        let shape = AttnShape::new(q_heads, kv_heads, head_dim);
        let seed = 100 + 10 * seed as u64;
        let q = tensor(&[n, q_heads, head_dim], seed);
        let k = random_vec(t * kv_heads * head_dim, seed + 1);
        let v = random_vec(t * kv_heads * head_dim, seed + 2);
        // Prefill-like (queries are the last n keys) and scattered (a CP rank's view, where
        // some queries see no key).
        let layouts: [(Vec<usize>, Vec<usize>); 2] = [
            ((t - n..t).collect(), (0..t).collect()),
            ((0..n).map(|i| i * 3).collect(), (0..t).map(|j| (j * 37) % (t + 11) + 2).collect()),
        ];
        for (qp, kp) in &layouts {
            let (want, want_lse) =
                cpu.attention(&q, qp, Kv::Host { k: &k, v: &v }, kp, shape, true).unwrap();
            let (got, got_lse) =
                gpu.attention(&q, qp, Kv::Host { k: &k, v: &v }, kp, shape, true).unwrap();
            assert_eq!(got.shape(), want.shape());
            assert_close(got.host().unwrap(), want.host().unwrap(), 1e-4);
            assert_close(got_lse.unwrap().host().unwrap(), want_lse.unwrap().host().unwrap(), 1e-4);
            let (plain, none) =
                gpu.attention(&q, qp, Kv::Host { k: &k, v: &v }, kp, shape, false).unwrap();
            assert!(none.is_none());
            assert_eq!(plain.host().unwrap(), got.host().unwrap());
        }
    }
    // No keys at all: zeros and -inf.
    let shape = AttnShape::new(2, 1, 8);
    let (out, lse) = gpu
        .attention(&tensor(&[1, 2, 8], 1), &[4], Kv::Host { k: &[], v: &[] }, &[], shape, true)
        .unwrap();
    assert_eq!(out.host().unwrap(), &[0.0; 16]);
    assert_eq!(lse.unwrap().host().unwrap(), &[f32::NEG_INFINITY; 2]);
}

/// The key ranges of an attention launch cover every key of a token once, in whole tiles,
/// fill the GPU for a decode step when there are keys enough, and leave a prefill unsplit
/// (no GPU needed).
#[test]
fn attention_key_ranges_cover_the_keys_and_fill_the_gpu_for_decode() {
    use super::{attention_chunk, attention_most_splits, ATTN_TARGET_BLOCKS, ATTN_TILE};
    for rows in [1, 9, 32, 100, 511, 512, 4096] {
        let ranges = attention_most_splits(rows);
        assert!(rows * ranges >= ATTN_TARGET_BLOCKS, "{rows} rows: the grid is too small");
        assert!(rows * (ranges - 1) < ATTN_TARGET_BLOCKS, "{rows} rows: more ranges than needed");
        if rows >= ATTN_TARGET_BLOCKS {
            assert_eq!(ranges, 1, "{rows} rows");
        }
        for n_kv in [1, 2, 127, 128, 129, 255, 256, 300, 1000, 4096, 32_768, 131_072, 1 << 20] {
            let chunk = attention_chunk(ranges, n_kv);
            let used = n_kv.div_ceil(chunk);
            let at = format!("{rows} rows, {n_kv} keys: {used} of {ranges} ranges of {chunk}");
            assert!(chunk >= ATTN_TILE && chunk.is_multiple_of(ATTN_TILE), "{at}");
            assert!(used <= ranges && ranges * chunk >= n_kv, "{at}: not a cover");
            if n_kv >= ATTN_TILE * ranges {
                assert!(used + 1 >= ranges * 3 / 4, "{at}: the GPU is not filled");
            }
        }
    }
}

/// A device UUID reads as `nvidia-smi` and `CUDA_VISIBLE_DEVICES` write it.
#[test]
fn device_uuids_are_written_as_nvidia_smi_writes_them() {
    let bytes = [
        0x5d, 0x2c, 0x1e, 0x9a, 0x03, 0xf1, 0x4b, 0x7e, 0x8c, 0x00, 0xff, 0x12, 0x34, 0x56, 0x78,
        0x9a,
    ];
    assert_eq!(super::uuid_text(bytes), "GPU-5d2c1e9a-03f1-4b7e-8c00-ff123456789a");
}

/// An attention block serves up to four query heads of one KV head: grouped-query models need
/// one block per KV head (two for six heads), multi-head ones one per head.
#[test]
fn attention_blocks_group_the_query_heads_of_a_kv_head() {
    use super::attention_blocks;
    assert_eq!(attention_blocks(1, 9, 3), 3, "SmolLM2: 3 heads per KV head");
    assert_eq!(attention_blocks(1, 32, 8), 8, "Llama 3 8B: 4 per KV head");
    assert_eq!(attention_blocks(1, 12, 2), 4, "6 per KV head: slices of 4 and 2");
    assert_eq!(attention_blocks(5, 4, 4), 20, "multi-head: one block per head");
    assert_eq!(attention_blocks(0, 9, 3), 0);
}

/// Decode over thousands of keys splits them into many ranges and merges the partial results:
/// the same output and log-sum-exp as the CPU, also where some ranges see no key.
#[test]
fn cuda_attention_over_many_key_ranges_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    let shape = AttnShape::new(9, 3, 64);
    let t: usize = 3000;
    let ranges = super::attention_most_splits(3);
    assert!(t.div_ceil(super::attention_chunk(ranges, t)) > 4, "the case must split the keys");
    let q = tensor(&[1, 9, 64], 7);
    let k = random_vec(t * 3 * 64, 8);
    let v = random_vec(t * 3 * 64, 9);
    // Decode at the end; a query that sees only the first 200 keys (later ranges see none).
    for qp in [vec![t - 1], vec![199]] {
        let kp: Vec<usize> = (0..t).collect();
        let (want, want_lse) =
            cpu.attention(&q, &qp, Kv::Host { k: &k, v: &v }, &kp, shape, true).unwrap();
        let (got, got_lse) =
            gpu.attention(&q, &qp, Kv::Host { k: &k, v: &v }, &kp, shape, true).unwrap();
        assert_close(got.host().unwrap(), want.host().unwrap(), 1e-4);
        assert_close(got_lse.unwrap().host().unwrap(), want_lse.unwrap().host().unwrap(), 1e-4);
    }
}

/// Gemma 2's and 3's score rules (a query scale, soft-capped scores, a sliding window), each
/// alone and together, for a prefill and for a decode step over many key ranges (the older
/// ranges wholly outside the window): the CPU's output and log-sum-exp. Each ruled result
/// must differ from the plain one, so a kernel that ignored a rule would fail. Then the
/// final-logit soft-cap, and a cap the kernel cannot take refused by name.
#[test]
fn cuda_attention_score_rules_and_logit_soft_cap_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    let plain = AttnShape::new(6, 2, 32);
    let rules = [
        AttnShape { window: Some(4), ..plain },
        AttnShape { window: Some(1), ..plain },
        AttnShape { softcap: Some(0.3), ..plain },
        AttnShape { scale: Some(0.5), ..plain },
        AttnShape { scale: Some(1.0), softcap: Some(0.5), window: Some(4), ..plain },
    ];
    let t = 3000;
    let q_prefill = tensor(&[9, 6, 32], 40);
    let q_decode = tensor(&[1, 6, 32], 41);
    let k = random_vec(t * 2 * 32, 42);
    let v = random_vec(t * 2 * 32, 43);
    let kv = Kv::Host { k: &k, v: &v };
    let kp: Vec<usize> = (0..t).collect();
    let ranges = super::attention_most_splits(2);
    let used = t.div_ceil(super::attention_chunk(ranges, t));
    assert!(used > 4, "the decode case must split the keys");
    let prefill: (Vec<usize>, Vec<usize>) = ((0..9).collect(), (0..9).collect());
    let (k9, v9) = (&k[..9 * 2 * 32], &v[..9 * 2 * 32]);
    for shape in rules {
        let at = format!("{shape:?}");
        let cases = [
            (&q_prefill, &prefill.0, Kv::Host { k: k9, v: v9 }, &prefill.1),
            (&q_decode, &vec![t - 1], kv, &kp),
        ];
        for (q, qp, kv, kp) in cases {
            let (want, want_lse) = cpu.attention(q, qp, kv, kp, shape, true).unwrap();
            let (got, got_lse) = gpu.attention(q, qp, kv, kp, shape, true).unwrap();
            assert_close(got.host().unwrap(), want.host().unwrap(), 1e-4);
            assert_close(got_lse.unwrap().host().unwrap(), want_lse.unwrap().host().unwrap(), 1e-4);
            let (unruled, _) = cpu.attention(q, qp, kv, kp, plain, false).unwrap();
            let apart = unruled
                .host()
                .unwrap()
                .iter()
                .zip(want.host().unwrap())
                .any(|(a, b)| (a - b).abs() > 1e-3);
            assert!(apart, "{at}: the rules change nothing, so this case proves nothing");
        }
    }
    // Logits up to ±6 under a cap of 1.5.
    let mut want = tensor(&[3, 500], 44);
    cpu.scale(&mut want, 6.0).unwrap();
    let mut got = want.clone();
    cpu.soft_cap(&mut want, 1.5).unwrap();
    gpu.soft_cap(&mut got, 1.5).unwrap();
    assert_close(got.host().unwrap(), want.host().unwrap(), 1e-5);
    let bad = AttnShape { softcap: Some(0.0), ..plain };
    let one = Kv::Host { k: &k[..2 * 32], v: &v[..2 * 32] };
    let err = gpu.attention(&q_decode, &[0], one, &[0], bad, false).unwrap_err();
    assert!(err.to_string().contains("soft-cap 0 is not a positive finite number"), "{err}");
}

/// Half-precision products (weights and activations rounded to bf16 or f16, f32 accumulation)
/// against the CPU's f32 ones, within the rounding of the type: the largest error relative to
/// the largest output under 2% for bf16 (8-bit mantissa) and 0.3% for f16 (11-bit), for dense
/// and quantized weights; the dense device copy takes 2 bytes per element, the quantized
/// weight stays packed (its own bytes, and no dense copy).
#[test]
fn cuda_half_precision_linear_matches_cpu_within_rounding() {
    for (dtype, tol) in [(GemmDtype::Bf16, 2e-2), (GemmDtype::F16, 3e-3)] {
        let Some(gpu) = gpu_in(dtype) else { return };
        let cpu = cpu();
        let (n, k) = (96, 256);
        let wf = random_vec(n * k, 21);
        let dense = Weight::F32(Tensor::from_vec(&[n, k], wf.clone()).unwrap());
        let q = QMatrix::from_blocks(BlockFormat::Q8_0, n, k, &quantize(BlockFormat::Q8_0, &wf))
            .unwrap();
        let deq = Weight::F32(Tensor::from_vec(&[n, k], q.dequantize()).unwrap());
        let packed = q.nbytes();
        // One weight object for every product: the device cache is keyed by its address.
        let quant = Weight::Quant(q);
        for m in [1, 9, 80] {
            let x = tensor(&[m, k], 22);
            let got = gpu.linear(&x, &dense).unwrap();
            assert_rel(
                got.host().unwrap(),
                cpu.linear(&x, &dense).unwrap().host().unwrap(),
                tol,
                dtype.name(),
            );
            let got = gpu.linear(&x, &quant).unwrap();
            assert_rel(
                got.host().unwrap(),
                cpu.linear(&x, &deq).unwrap().host().unwrap(),
                tol,
                dtype.name(),
            );
        }
        assert_eq!(cuda_of(&gpu).gemm_dtype(), dtype);
        let cached = cuda_of(&gpu).cached_weight_bytes();
        let beyond_dense = cached - 2 * n * k;
        assert!(
            (packed..packed + 1024).contains(&beyond_dense),
            "{}: {cached} bytes cached for a dense copy of {} and a packed one of {packed}",
            dtype.name(),
            2 * n * k
        );
    }
}

/// Outputs stay on the device between kernels: a norm, a product, a split, a rotation and a
/// residual add chain on the GPU without a host copy, the result is the CPU's, and only a
/// host write moves it to the host. A shared output is copied, not overwritten, by an
/// in-place kernel.
#[test]
fn cuda_outputs_stay_on_the_device_until_the_host_reads_them() {
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    let x = tensor(&[3, 64], 31);
    let norm = tensor(&[64], 32);
    let w = Weight::F32(tensor(&[96, 64], 33));
    let run = |be: &Backend| {
        let h = be.rms_norm(&x, &norm, 1e-5).unwrap();
        let y = be.linear(&h, &w).unwrap();
        let mut parts = be.split_last(&y, &[64, 32]).unwrap().into_iter();
        let (mut a, b) = (parts.next().unwrap(), parts.next().unwrap());
        be.rope(&mut a, &[0, 1, 2], 2, 32, 32, 10_000.0).unwrap();
        let shared = a.clone();
        be.add_assign(&mut a, &x).unwrap();
        (a, b, shared)
    };
    let (a, b, shared) = run(&gpu);
    for t in [&a, &b, &shared] {
        assert_eq!(t.device(), Device::Cuda(0), "an output went to the host");
    }
    let (want_a, want_b, want_shared) = run(&cpu);
    assert_close(a.host().unwrap(), want_a.host().unwrap(), 1e-4);
    assert_close(b.host().unwrap(), want_b.host().unwrap(), 1e-4);
    assert_close(shared.host().unwrap(), want_shared.host().unwrap(), 1e-4);
    assert_eq!(a.device(), Device::Cuda(0), "reading keeps the device copy");
    let mut a = a;
    a.data_mut()[0] += 1.0;
    assert_eq!(a.device(), Device::Cpu);
}

/// A batch's rows are sliced per sequence and stacked again on the device: exactly the host's
/// slices and stack of the same values, and the results stay device tensors.
#[test]
fn cuda_row_slices_and_stacks_stay_on_the_device() {
    let Some(gpu) = gpu() else { return };
    let h = gpu.rms_norm(&tensor(&[5, 3, 8], 41), &tensor(&[8], 42), 1e-5).unwrap();
    let on_host = Tensor::from_vec(h.shape(), h.host().unwrap().to_vec()).unwrap();
    assert_eq!(h.device(), Device::Cuda(0), "reading keeps the device copy");
    let ranges = [0..2, 2..2, 2..5];
    let parts = ranges.clone().map(|r| gpu.slice_first(&h, r).unwrap());
    let want = ranges.map(|r| on_host.slice_first(r).unwrap());
    for (got, want) in parts.iter().zip(&want) {
        assert_eq!(got.shape(), want.shape());
        assert_eq!(got.host().unwrap(), want.host().unwrap(), "a slice copies the rows exactly");
    }
    assert_eq!(parts[0].device(), Device::Cuda(0), "a slice went to the host");
    let stacked = gpu.cat_first(&[parts[2].clone(), parts[0].clone()]).unwrap();
    let want_stacked = Tensor::cat_first(&[want[2].clone(), want[0].clone()]).unwrap();
    assert_eq!(stacked.device(), Device::Cuda(0), "a stack went to the host");
    assert_eq!(stacked.shape(), want_stacked.shape());
    assert_eq!(
        stacked.host().unwrap(),
        want_stacked.host().unwrap(),
        "a stack copies the rows exactly"
    );
    assert!(gpu.slice_first(&parts[2], 2..4).is_err(), "a range past the rows is refused");
}

/// The counters see each call of an op: RMSNorm of a host tensor with a new weight uploads
/// both (the weight into a zeroed cache slot, waited for), allocates the output and launches
/// once; again with the cached weight only the input moves; reading the result downloads it
/// after one wait. And the kernels are the device's own machine code, not the PTX fallback.
#[test]
fn cuda_counters_count_each_call_of_an_op() {
    use crate::kernels::cuda::Counters;
    let Some(gpu) = gpu() else { return };
    let cuda = cuda_of(&gpu);
    let image = cuda.kernel_image();
    assert!(image.is_cubin(), "kernels: {image}");
    let (x, w) = (tensor(&[3, 64], 1), tensor(&[64], 2));
    let start = cuda.counters();
    let generation = crate::memory::weights_generation();
    let y = gpu.rms_norm(&x, &w, 1e-5).unwrap();
    let first = cuda.counters();
    let want = Counters {
        launches: 1,
        device_copies: 1,
        allocations: 3,
        uploads: 2,
        downloads: 0,
        host_waits: 1,
        graph_launches: 0,
    };
    assert_eq!(first.since(&start), want, "first rms_norm");
    let z = gpu.rms_norm(&x, &w, 1e-5).unwrap();
    let second = cuda.counters();
    let want = Counters { launches: 1, allocations: 2, uploads: 1, ..Counters::default() };
    // Unless another test of the process bumped the weights generation meanwhile, which
    // makes the weight's copy stale.
    if crate::memory::weights_generation() == generation {
        assert_eq!(second.since(&first), want, "rms_norm with the weight cached");
    }
    assert_close(z.host().unwrap(), y.host().unwrap(), 0.0);
    let read = cuda.counters().since(&second);
    assert_eq!(read, Counters { downloads: 2, host_waits: 2, ..Counters::default() }, "reads");
    // The residual add and the norm are one launch (x, on the host, is uploaded for it).
    let (mut x, y) = (x, tensor(&[3, 64], 3));
    let before = cuda.counters();
    gpu.add_rms_norm(&mut x, &y, &w, 1e-5).unwrap();
    let fused = cuda.counters().since(&before);
    assert_eq!((fused.launches, fused.uploads), (1, 2), "add_rms_norm: {fused:?}");
}

/// The fused kernels against the CPU and against the GPU kernels they replace (the same bits),
/// each one launch.
#[test]
fn cuda_split_rope_and_gated_halves_match_the_ops_they_replace_in_one_launch() {
    use crate::kernels::Activation;
    let Some(gpu) = gpu() else { return };
    let (cpu, cuda) = (cpu(), cuda_of(&gpu));
    let bits = |t: &Tensor| t.host().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (q_heads, kv_heads, head_dim, rot, scaled) in
        [(6, 2, 64, 32, true), (4, 4, 128, 128, false)]
    {
        let positions = [0usize, 9, 4000];
        let width = (q_heads + 2 * kv_heads) * head_dim;
        let y = tensor(&[3, width], 11);
        let factors: Vec<f32> = (0..rot / 2).map(|i| 1.0 + (i % 5) as f32).collect();
        let (factors, attn) = if scaled { (Some(&factors[..]), 1.25) } else { (None, 1.0) };
        let dims = (q_heads, kv_heads, head_dim, rot);
        let before = cuda.counters();
        let rotation = (1e4, factors, attn);
        let got = gpu.split_rope(Projected::rows(&y), &positions, dims, rotation).unwrap();
        assert_eq!(cuda.counters().since(&before).launches, 1, "split_rope");
        let want = cpu.split_rope(Projected::rows(&y), &positions, dims, rotation).unwrap();
        // With the projection's bias, added in the same launch: the CPU's bits.
        let bias = tensor(&[width], 12);
        let biased = Projected { y: &y, bias: Some(&bias) };
        let before = cuda.counters();
        let got_b = gpu.split_rope(biased, &positions, dims, rotation).unwrap();
        assert_eq!(cuda.counters().since(&before).launches, 1, "split_rope with a bias");
        let want_b = cpu.split_rope(biased, &positions, dims, rotation).unwrap();
        for (g, w) in [(&got_b.0, &want_b.0), (&got_b.1, &want_b.1), (&got_b.2, &want_b.2)] {
            assert_eq!(bits(g), bits(w), "split_rope with a bias");
        }
        let (qw, kw) = (q_heads * head_dim, kv_heads * head_dim);
        let parts = gpu.split_last(&y, &[qw, kw, kw]).unwrap();
        let (mut q2, mut k2) = (parts[0].clone(), parts[1].clone());
        gpu.rope_scaled(&mut q2, &positions, (q_heads, head_dim, rot), 1e4, factors, attn).unwrap();
        gpu.rope_scaled(&mut k2, &positions, (kv_heads, head_dim, rot), 1e4, factors, attn)
            .unwrap();
        for (g, (w, apart)) in [&got.0, &got.1, &got.2].into_iter().zip([
            (&want.0, &q2),
            (&want.1, &k2),
            (&want.2, &parts[2]),
        ]) {
            assert_close(g.host().unwrap(), w.host().unwrap(), 1e-4);
            assert_eq!(bits(g), bits(apart));
        }
    }
    let x = tensor(&[5, 2 * 700], 12);
    for act in [Activation::Silu, Activation::GeluTanh] {
        let before = cuda.counters();
        let got = gpu.gated_halves(act, &x).unwrap();
        assert_eq!(cuda.counters().since(&before).launches, 1, "gated_halves");
        let want = cpu.gated_halves(act, &x).unwrap();
        assert_close(got.host().unwrap(), want.host().unwrap(), 1e-4);
        let parts = gpu.split_last(&x, &[700, 700]).unwrap();
        let mut g = parts[0].clone();
        gpu.gated(act, &mut g, &parts[1]).unwrap();
        assert_eq!(bits(&got), bits(&g), "{act:?}");
    }
}

/// A step's decode rows over one paged device pool are one attention launch (plus the merge of
/// its key ranges), and each row is the CPU's attention of its sequence alone; rows whose keys
/// are not all in one pool still work, one at a time.
#[test]
fn cuda_decode_rows_over_one_pool_attend_in_one_launch() {
    use crate::kernels::{DeviceBlocks, KvElem, PoolArena};
    use crate::memory::DeviceArena;
    let tensor_of = |shape: &[usize], v: &[f32]| Tensor::from_vec(shape, v.to_vec()).unwrap();
    let Some(gpu) = gpu() else { return };
    let (cpu, cuda) = (cpu(), cuda_of(&gpu));
    let shape = AttnShape::new(9, 3, 64);
    let (row, bs) = (3 * 64, 16);
    let lens = [5usize, 130, 700];
    let blocks: usize = lens.iter().map(|l| l.div_ceil(bs)).sum();
    let arena = PoolArena::new(cuda, 4 * blocks * 2 * bs * row).unwrap();
    let pool = arena.alloc_device(4 * blocks * 2 * bs * row).unwrap();
    // Blocks hold a layer's keys then its values; handed out scattered.
    let block_stride = 2 * bs * row;
    let (mut tables, mut handed) = (Vec::new(), 0);
    let keys: Vec<(Vec<f32>, Vec<f32>)> = lens
        .iter()
        .enumerate()
        .map(|(i, &t)| (random_vec(t * row, 20 + i as u64), random_vec(t * row, 30 + i as u64)))
        .collect();
    for (&t, (k, v)) in lens.iter().zip(&keys) {
        let table: Vec<u32> = (0..t.div_ceil(bs))
            .map(|_| {
                handed += 1;
                ((handed * 7) % blocks) as u32
            })
            .collect();
        for j in 0..t {
            let at = table[j / bs] as usize * block_stride + (j % bs) * row;
            let range = j * row..(j + 1) * row;
            gpu.write_device(&*pool, KvElem::F32, at, &k[range.clone()]).unwrap();
            gpu.write_device(&*pool, KvElem::F32, at + bs * row, &v[range]).unwrap();
        }
        tables.push(table);
    }
    let positions: Vec<Vec<usize>> = lens.iter().map(|&t| (0..t).collect()).collect();
    // A sequence's blocks of `memory` (its `table`): keys at the start of each block of
    // `bs` tokens, values after them.
    fn blocks_of<'a>(
        memory: &'a dyn mesh::DeviceMemory,
        table: &'a [u32],
        (bs, row): (usize, usize),
    ) -> DeviceBlocks<'a> {
        let (block_size, block_stride) = (bs, 2 * bs * row);
        let elem = KvElem::F32;
        DeviceBlocks { memory, elem, table, block_size, block_stride, keys: 0, values: bs * row }
    }
    let kv = |i: usize, f: &mut dyn FnMut(Kv<'_>, &[usize])| {
        f(Kv::PagedDevice(blocks_of(&*pool, &tables[i], (bs, row))), &positions[i]);
    };
    let q = tensor(&[3, 9, 64], 40);
    let q_pos: Vec<usize> = lens.iter().map(|&t| t - 1).collect();
    let before = cuda.counters();
    let got = gpu.attention_rows(&q, &q_pos, shape, &kv).unwrap();
    let launches = cuda.counters().since(&before).launches;
    assert!(launches <= 2, "{launches} launches for 3 rows");
    for (i, &p) in q_pos.iter().enumerate() {
        let (k, v) = &keys[i];
        let qi = q.host().unwrap()[i * 576..(i + 1) * 576].to_vec();
        let qi = Tensor::from_vec(&[1, 9, 64], qi).unwrap();
        let (want, _) =
            cpu.attention(&qi, &[p], Kv::Host { k, v }, &positions[i], shape, false).unwrap();
        let got = &got.host().unwrap()[i * 576..(i + 1) * 576];
        assert_close(got, want.host().unwrap(), 1e-4);
    }
    // The same pool written with one `write_rows` launch per sequence for its keys and one for
    // its values reads the same.
    let arena2 = PoolArena::new(cuda, 4 * blocks * 2 * bs * row).unwrap();
    let pool2 = arena2.alloc_device(4 * blocks * 2 * bs * row).unwrap();
    for ((&t, (k, v)), table) in lens.iter().zip(&keys).zip(&tables) {
        let moves: Vec<(usize, usize)> =
            (0..t).map(|j| (j, table[j / bs] as usize * block_stride + (j % bs) * row)).collect();
        let (kt, vt) = (tensor_of(&[t, row], k), tensor_of(&[t, row], v));
        let before = cuda.counters();
        gpu.write_rows(&*pool2, KvElem::F32, &kt, row, &moves, 0).unwrap();
        gpu.write_rows(&*pool2, KvElem::F32, &vt, row, &moves, bs * row).unwrap();
        assert_eq!(cuda.counters().since(&before).launches, 2, "write_rows");
    }
    let kv2 = |i: usize, f: &mut dyn FnMut(Kv<'_>, &[usize])| {
        f(Kv::PagedDevice(blocks_of(&*pool2, &tables[i], (bs, row))), &positions[i]);
    };
    let again = gpu.attention_rows(&q, &q_pos, shape, &kv2).unwrap();
    assert_eq!(again.host().unwrap(), got.host().unwrap());
    let one = tensor_of(&[1, row], &keys[0].0[..row]);
    let err = gpu.write_rows(&*pool2, KvElem::F32, &one, row, &[(1, 0)], 0);
    assert!(err.unwrap_err().to_string().contains("move 0: row 1 of 1 rows"));
    // A row with host keys: the rows run one at a time, with the same results.
    let mixed = |i: usize, f: &mut dyn FnMut(Kv<'_>, &[usize])| {
        if i == 1 {
            f(Kv::Host { k: &keys[1].0, v: &keys[1].1 }, &positions[1]);
        } else {
            kv(i, f);
        }
    };
    let apart = gpu.attention_rows(&q, &q_pos, shape, &mixed).unwrap();
    assert_close(apart.host().unwrap(), got.host().unwrap(), 1e-4);
}

/// On a bf16 backend the norms, the gated activation and attention also write their outputs
/// rounded to bf16, and a product of such an output takes that copy: one launch (no rounding
/// kernel), the same bits as the product of the same values uploaded from the host. An
/// in-place change of the output drops the copy, so the product then sees the new values.
#[test]
fn cuda_bf16_products_take_the_rounded_copy_their_input_kernel_wrote() {
    use crate::kernels::{Activation, GemmDtype};
    if gpu().is_none() {
        return;
    }
    let gpu = Backend::cuda_with(0, GemmDtype::Bf16).unwrap();
    let cuda = cuda_of(&gpu);
    let w = Weight::F32(tensor(&[48, 64], 1));
    let (x, nw) = (tensor(&[3, 64], 2), tensor(&[64], 3));
    let host_copy = |t: &Tensor| Tensor::from_vec(t.shape(), t.host().unwrap().to_vec()).unwrap();
    let bits = |t: &Tensor| t.host().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let normed = gpu.rms_norm(&x, &nw, 1e-5).unwrap();
    let mut summed = x.clone();
    let added = gpu.add_rms_norm(&mut summed, &tensor(&[3, 64], 4), &nw, 1e-5).unwrap();
    let gated = gpu.gated_halves(Activation::Silu, &tensor(&[3, 128], 5)).unwrap();
    // Attention over one key range and over several (its merge writes the copy).
    let shape = AttnShape::new(4, 2, 16);
    let (k, v) = (random_vec(600 * 32, 6), random_vec(600 * 32, 7));
    let kv = Kv::Host { k: &k, v: &v };
    let positions: Vec<usize> = (0..600).collect();
    let q = tensor(&[3, 4, 16], 8);
    let one = gpu.attention(&q, &[4, 5, 6], kv, &positions[..7], shape, false).unwrap().0;
    let (k, v) = (&k[..], &v[..]);
    let many = gpu.attention(&q, &[597, 598, 599], Kv::Host { k, v }, &positions, shape, false);
    let many = many.unwrap().0;
    let attended = [("attention", &one), ("attention over key ranges", &many)];
    let made = [("rms_norm", &normed), ("add_rms_norm", &added), ("gated_halves", &gated)];
    for (what, y) in made.into_iter().chain(attended) {
        gpu.linear(&y.clone(), &w).unwrap();
        let before = cuda.counters();
        let got = gpu.linear(y, &w).unwrap();
        let spent = cuda.counters().since(&before);
        assert_eq!((spent.launches, spent.allocations), (1, 1), "{what}: {spent:?}");
        let want = gpu.linear(&host_copy(y), &w).unwrap();
        assert_eq!(bits(&got), bits(&want), "{what}");
    }
    let mut scaled = normed;
    gpu.scale(&mut scaled, 2.0).unwrap();
    let got = gpu.linear(&scaled, &w).unwrap();
    let want = gpu.linear(&host_copy(&scaled), &w).unwrap();
    assert_eq!(bits(&got), bits(&want), "after an in-place change");
}

/// The projection's split, rotations and KV append in one launch write the pool as
/// `split_rope` then `write_rows` do (attention over either pool gives the same bits) and
/// return the same queries.
#[test]
fn cuda_split_rope_append_writes_what_split_rope_and_write_rows_write() {
    use crate::kernels::{DeviceBlocks, KvElem, PoolArena, PoolMemory, PoolRows};
    use crate::memory::DeviceArena;
    let Some(gpu) = gpu() else { return };
    let cuda = cuda_of(&gpu);
    let (dims, bs) = ((6, 2, 64, 32), 16);
    let (row, block_stride) = (2 * 64, 2 * bs * 2 * 64);
    let factors: Vec<f32> = (0..16).map(|i| 1.0 + (i % 3) as f32).collect();
    let rope = (1e4, Some(&factors[..]), 1.25);
    let bytes = 4 * 8 * block_stride;
    let (a, b) = (PoolArena::new(cuda, bytes).unwrap(), PoolArena::new(cuda, bytes).unwrap());
    let (a, b) = (a.alloc_device(bytes).unwrap(), b.alloc_device(bytes).unwrap());
    // Three sequences in blocks 5, 1 and 6: a first token written alike, then the second.
    let blocks = [5u32, 1, 6];
    let first = random_vec(row, 9);
    for pool in [&a, &b] {
        for &blk in &blocks {
            let at = blk as usize * block_stride;
            gpu.write_device(&**pool, KvElem::F32, at, &first).unwrap();
            gpu.write_device(&**pool, KvElem::F32, at + bs * row, &first).unwrap();
        }
    }
    let y = tensor(&[3, (6 + 4) * 64], 10);
    let positions = [1usize, 1, 1];
    let places: Vec<usize> = blocks.iter().map(|&b| b as usize * block_stride + row).collect();
    let before = cuda.counters();
    let memory = PoolMemory::Device(&*a, KvElem::F32);
    let dst = PoolRows { memory, places: &places, shift: 0, values: bs * row };
    let q = gpu.split_rope_append(Projected::rows(&y), &positions, dims, rope, dst).unwrap();
    assert_eq!(cuda.counters().since(&before).launches, 1, "split_rope_append");
    let (q2, k, v) = gpu.split_rope(Projected::rows(&y), &positions, dims, rope).unwrap();
    let moves: Vec<(usize, usize)> = places.iter().copied().enumerate().collect();
    gpu.write_rows(&*b, KvElem::F32, &k, row, &moves, 0).unwrap();
    gpu.write_rows(&*b, KvElem::F32, &v, row, &moves, bs * row).unwrap();
    assert_eq!(q.host().unwrap(), q2.host().unwrap());
    let shape = AttnShape::new(6, 2, 64);
    let attend = |pool: &dyn mesh::DeviceMemory| {
        let kv = |i: usize, f: &mut dyn FnMut(Kv<'_>, &[usize])| {
            let table = &blocks[i..=i];
            let (keys, values, elem) = (0, bs * row, KvElem::F32);
            let blocks = DeviceBlocks {
                memory: pool,
                elem,
                table,
                block_size: bs,
                block_stride,
                keys,
                values,
            };
            f(Kv::PagedDevice(blocks), &[0, 1]);
        };
        gpu.attention_rows(&q, &positions, shape, &kv).unwrap().host().unwrap().to_vec()
    };
    assert_eq!(attend(&*a), attend(&*b));
}

/// Logit edits (penalties, bias) on the device give the CPU's bits: rows of 1,000 logits, a
/// few hundred edits of every kind (repeated tokens among them) in a shard from column 300.
#[test]
fn cuda_edit_rows_give_the_cpus_bits() {
    use crate::kernels::{EditKind, LogitEdit, LogitEdits};
    let Some(gpu) = gpu() else { return };
    let cpu = cpu();
    let kinds = [EditKind::Repetition, EditKind::Subtract, EditKind::Add];
    let rows: Vec<Vec<LogitEdit>> = (0..3u32)
        .map(|r| {
            (0..200 * r)
                .map(|i| LogitEdit {
                    token: (i * 37 + r) % 1400,
                    kind: kinds[(i % 3) as usize],
                    value: 1.0 + 0.01 * i as f32,
                })
                .collect()
        })
        .collect();
    let edits = LogitEdits::from_rows(rows.iter().map(Vec::as_slice));
    let x = tensor(&[3, 1000], 41);
    let (mut on_gpu, mut on_cpu) = (x.clone(), x.clone());
    gpu.edit_rows(&mut on_gpu, &edits, 300).unwrap();
    cpu.edit_rows(&mut on_cpu, &edits, 300).unwrap();
    let (g, c) = (on_gpu.host().unwrap(), on_cpu.host().unwrap());
    assert_ne!(c, x.host().unwrap(), "the edits change something");
    for (i, (g, c)) in g.iter().zip(c).enumerate() {
        assert_eq!(g.to_bits(), c.to_bits(), "logit {i}: {g} on the GPU, {c} on the CPU");
    }
}
