//! Whole models on the CUDA backend against the CPU: a random model (single rank and on a
//! 2 x 2 thread mesh; also Gemma 2 and Gemma 3, with their caps, windows and local rotation)
//! and the default model giving the same greedy tokens and logits, device KV caches and paged
//! pools (a Gemma's windows read through a paged pool too), weights in a device arena, half
//! precision. Without a usable GPU
//! these tests print a note and return, unless `TPCTL_REQUIRE_GPU=1`, when they fail (the
//! kernels themselves are checked in the tensor crate).
//!
//! Tolerances: whole models at 1e-3 relative to the largest logit, since differences compound
//! over layers.

use crate::model::random::{Gemma2, Gemma3, RandomLlama};
use crate::model::{Logits, Model, WeightForm};
use crate::parallel::{Comms, LoadOptions, ParallelModel, Placement};
use crate::test_util::{assert_rel, cuda_of, gpu, gpu_in, gpu_required, temp_path};
use checkpoint::config::LlamaConfig;
use checkpoint::gguf::GgufFile;
use collectives::{local, Communicator, ShmOptions};
use std::time::Duration;
use tensor::kernels::{BlockFormat, GemmDtype, KvElem};
use tensor::{Backend, Tensor};

fn cpu() -> Backend {
    Backend::cpu(2).unwrap()
}

/// Prefill logits of `prompt` and 12 greedy tokens after it.
fn run_model(model: &Model, prompt: &[u32]) -> (Tensor, Vec<u32>) {
    let mut cache = model.new_cache(64);
    let positions: Vec<usize> = (0..prompt.len()).collect();
    let logits = model.forward(prompt, &positions, &mut cache, Logits::All).unwrap();
    let mut cache = model.new_cache(64);
    let tokens = model.generate(prompt, 12, &[], &mut cache, |_| {}).unwrap();
    (logits, tokens)
}

#[test]
fn cuda_random_model_gives_the_cpu_greedy_tokens_and_logits() {
    let Some(gpu) = gpu() else { return };
    let prompt = [3u32, 17, 5, 38, 0, 22, 9];
    let specs = [
        ("f32", RandomLlama::default()),
        (
            "q8_0",
            RandomLlama {
                quantized: Some(BlockFormat::Q8_0),
                untied_head: true,
                seed: 2,
                ..Default::default()
            },
        ),
        ("qwen2 biases", RandomLlama { attn_bias: true, seed: 3, ..Default::default() }),
        (
            "qwen3 per-head norms",
            RandomLlama { qwen3: true, head_dim: Some(24), seed: 4, ..Default::default() },
        ),
        (
            "longrope",
            RandomLlama {
                longrope: Some(checkpoint::config::LongRope {
                    short: vec![1.0; 8],
                    long: (0..8).map(|i| 1.0 + i as f32 * 3.0).collect(),
                    original_context: 64,
                    attn_factor: checkpoint::config::longrope_attn_factor(256, 64),
                }),
                seed: 5,
                ..Default::default()
            },
        ),
        ("gemma2", gemma2_spec()),
        ("gemma3", gemma3_spec()),
    ];
    for (name, spec) in specs {
        let path = temp_path("cuda-model.gguf");
        spec.write(&path).unwrap();
        let file = GgufFile::open(&path).unwrap();
        let config = LlamaConfig::from_gguf(&file).unwrap();
        // The CPU runs the dequantized weights: the arithmetic the CUDA backend does.
        let cpu =
            Model::from_source(&file, config.clone(), Backend::cpu(1).unwrap(), WeightForm::F32)
                .unwrap();
        let dev = Model::from_source(&file, config, gpu.clone(), WeightForm::Native).unwrap();
        let (want_logits, want_tokens) = run_model(&cpu, &prompt);
        let (got_logits, got_tokens) = run_model(&dev, &prompt);
        assert_rel(got_logits.host().unwrap(), want_logits.host().unwrap(), 1e-3, name);
        assert_eq!(got_tokens, want_tokens, "{name}");
        std::fs::remove_file(path).unwrap();
    }
}

/// The default model (SmolLM2-135M, Q4_1/Q8_0 weights) on the GPU: the CPU's greedy tokens and
/// logits within the same tolerance. Needs the model in the cache (`cargo xtask fetch-model`;
/// `cargo xtask gpu-test` fetches it).
#[test]
fn cuda_real_model_gives_the_cpu_greedy_tokens_and_logits() {
    let Some(gpu) = gpu() else { return };
    let Some(path) = checkpoint::cache::default_model_path() else {
        assert!(!gpu_required(), "TPCTL_REQUIRE_GPU=1 but the default model is not cached");
        eprintln!("note: default model not cached; skipping");
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let cpu = Model::from_source(&file, config.clone(), Backend::cpu(2).unwrap(), WeightForm::F32)
        .unwrap();
    let dev = Model::from_source(&file, config, gpu, WeightForm::Native).unwrap();
    // "The capital of France is" in SmolLM2's vocabulary.
    let tok = text::Tokenizer::from_gguf(&file).unwrap();
    let prompt = tok.encode("The capital of France is").unwrap();
    let (want_logits, want_tokens) = run_model(&cpu, &prompt);
    let (got_logits, got_tokens) = run_model(&dev, &prompt);
    assert_rel(got_logits.host().unwrap(), want_logits.host().unwrap(), 1e-3, "smollm2");
    assert_eq!(got_tokens, want_tokens);
}

/// Gemma 2 with its default constants (a window of 4 on the even layers, caps of 2 on the
/// scores and 1.5 on the logits, which random weights reach) over three layers.
fn gemma2_spec() -> RandomLlama {
    RandomLlama { gemma2: Some(Gemma2::default()), layers: 3, seed: 8, ..Default::default() }
}

/// Gemma 3 with six layers, so the last one is global (base 1e6, scaled by 4) and the others
/// local (a window of 4, base 1e4 unscaled), with its per-head query and key norms.
fn gemma3_spec() -> RandomLlama {
    RandomLlama { gemma3: Some(Gemma3::default()), layers: 6, seed: 9, ..Default::default() }
}

/// A Llama, a Gemma 2 and a Gemma 3 sharded over a 2 x 2 thread mesh on one GPU: the greedy
/// tokens of the single-rank CPU model (the Gemmas' windows and caps through TP heads, CP's
/// key exchange and its merged extends).
#[test]
fn cuda_parallel_model_on_a_tp2_cp2_mesh_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let llama = RandomLlama { layers: 2, heads: 4, kv_heads: 2, ..Default::default() };
    for spec in [llama, gemma2_spec(), gemma3_spec()] {
        parallel_model_matches_cpu(&gpu, &spec);
    }
}

fn parallel_model_matches_cpu(gpu: &Backend, spec: &RandomLlama) {
    let path = temp_path("cuda-parallel.gguf");
    spec.write(&path).unwrap();
    let prompt = [3u32, 17, 5, 38, 0, 22, 9];
    let cpu = Model::load_with(&path, 1, WeightForm::F32).unwrap();
    let (_, want) = run_model(&cpu, &prompt);
    let opts = ShmOptions { slot_bytes: 64 << 10, ring_bytes: 16 << 10 };
    let pairs = local::mesh(2, 2, opts).unwrap();
    // Four ranks on threads share the one GPU (and its backend, as clones).
    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .into_iter()
            .map(|(mut t, mut c)| {
                let (gpu, path) = (gpu.clone(), &path);
                s.spawn(move || {
                    t.set_timeout(Duration::from_secs(60));
                    c.set_timeout(Duration::from_secs(60));
                    let mut comms = Comms { tp: &mut t, cp: &mut c };
                    let placement = Placement::of(&comms);
                    let file = GgufFile::open(path).unwrap();
                    let config = LlamaConfig::from_gguf(&file).unwrap();
                    let model = ParallelModel::from_source(
                        &file,
                        config,
                        LoadOptions::new(placement).on(gpu).form(WeightForm::Native),
                    )
                    .unwrap();
                    let mut cache = model.new_cache(64);
                    model.generate(&mut comms, &prompt, 12, &[], &mut cache, |_| {}).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    });
    for (rank, tokens) in got.iter().enumerate() {
        assert_eq!(tokens, &want, "rank {rank} of {spec:?}");
    }
    std::fs::remove_file(path).unwrap();
}

/// Gemma 2 and Gemma 3 on one GPU rank with a paged device pool (blocks of 4 tokens, the
/// window's size, through a scrambled table, so windowed layers read keys across blocks and
/// skip whole blocks): each decode step's logits (soft-capped for Gemma 2) within 1e-3 of the
/// CPU model's with a host cache, and the same greedy tokens, well past the window.
#[test]
fn cuda_gemma_models_with_a_paged_device_pool_match_cpu() {
    let Some(gpu) = gpu() else { return };
    for (name, spec) in [("gemma2", gemma2_spec()), ("gemma3", gemma3_spec())] {
        let path = temp_path("cuda-gemma-paged.gguf");
        spec.write(&path).unwrap();
        let load = |be: Backend| {
            let opts = LoadOptions::new(Placement::single()).on(be).form(WeightForm::F32);
            ParallelModel::load(&path, opts).unwrap()
        };
        let (dev, host) = (load(gpu.clone()), load(cpu()));
        // 8 blocks of 4 tokens for each group of layers (see `KvGroups`), scrambled.
        let (block_size, blocks) = (4, 8 * dev.kv_groups().len());
        let bytes = dev.pool_bytes(block_size, blocks, KvElem::F32);
        let arena = tensor::kernels::PoolArena::new(cuda_of(&gpu), bytes).unwrap();
        let pool = dev.pool_on_device(&arena, block_size, blocks, KvElem::F32).unwrap();
        let mut paged = dev.new_paged_cache(&std::sync::Arc::new(pool)).unwrap();
        let table: Vec<u32> = (0..blocks).map(|i| ((blocks + 2 - i) % blocks) as u32).collect();
        paged.extend_table(&table).unwrap();
        let mut cache = host.new_cache(32);
        let prompt = [3u32, 17, 5, 38, 0, 22, 9];
        let got = decode(&dev, &mut paged, &prompt, 12);
        let want = decode(&host, &mut cache, &prompt, 12);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_rel(g, w, 1e-3, &format!("{name} step {step}"));
        }
        std::fs::remove_file(path).unwrap();
    }
}

/// `steps` greedy decode steps after `prompt`, returning every step's logits.
fn decode(
    model: &ParallelModel,
    cache: &mut crate::parallel::ParallelCache,
    prompt: &[u32],
    steps: usize,
) -> Vec<Vec<f32>> {
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let mut tokens = prompt.to_vec();
    let mut rows = Vec::new();
    for _ in 0..steps {
        let out = model.forward(&mut comms, &tokens, cache, Logits::Last).unwrap();
        let row = out.host_row(out.rows() - 1).unwrap().to_vec();
        let next = row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b });
        tokens = vec![next as u32];
        rows.push(row);
    }
    rows
}

/// A KV cache in device memory is appended to and read in place; the logits are bit for bit
/// those of a host cache (uploaded per call) on the same GPU, over prefill and decode.
#[test]
fn cuda_device_kv_cache_gives_the_host_cache_logits() {
    let Some(gpu) = gpu() else { return };
    let path = temp_path("cuda-device-kv.gguf");
    RandomLlama { quantized: Some(BlockFormat::Q8_0), seed: 5, ..Default::default() }
        .write(&path)
        .unwrap();
    let model = ParallelModel::load(
        &path,
        LoadOptions::new(Placement::single()).on(gpu.clone()).form(WeightForm::Native),
    )
    .unwrap();
    let bytes = model.cache_bytes(32, KvElem::F32);
    let arena = tensor::kernels::PoolArena::new(cuda_of(&gpu), bytes).unwrap();
    let mut device = model.new_cache_on_device(32, KvElem::F32, &arena).unwrap();
    let mut host = model.new_cache(32);
    let prompt = [3u32, 17, 5, 38, 0, 22, 9];
    assert_eq!(decode(&model, &mut device, &prompt, 8), decode(&model, &mut host, &prompt, 8));
    assert_eq!(device.len(), host.len());
    // Full means full on the device too, and the failed step leaves it usable.
    let err = model
        .forward(
            &mut Comms {
                tp: &mut collectives::Solo::new("tp"),
                cp: &mut collectives::Solo::new("cp"),
            },
            &[1u32; 32],
            &mut device,
            Logits::Last,
        )
        .unwrap_err();
    assert!(err.to_string().contains("kv cache full"), "{err}");
    std::fs::remove_file(path).unwrap();
}

/// A paged KV pool in device memory: two sequences write their tokens through scrambled block
/// tables (blocks of 4 tokens, so appends cross block boundaries) and attention reads them in
/// place through the tables; each sequence's logits are bit for bit those of a host cache of
/// its own, also when it goes on after the other one wrote its blocks.
#[test]
fn cuda_paged_device_pool_gives_the_host_cache_logits() {
    let Some(gpu) = gpu() else { return };
    let path = temp_path("cuda-paged-kv.gguf");
    RandomLlama { quantized: Some(BlockFormat::Q8_0), seed: 7, ..Default::default() }
        .write(&path)
        .unwrap();
    let model = ParallelModel::load(
        &path,
        LoadOptions::new(Placement::single()).on(gpu.clone()).form(WeightForm::Native),
    )
    .unwrap();
    let (block_size, blocks) = (4, 16);
    let f32 = KvElem::F32;
    let bytes = model.pool_bytes(block_size, blocks, f32);
    let arena = tensor::kernels::PoolArena::new(cuda_of(&gpu), bytes).unwrap();
    let pool = std::sync::Arc::new(model.pool_on_device(&arena, block_size, blocks, f32).unwrap());
    assert!(pool.is_on_device());
    let (mut a, mut b) =
        (model.new_paged_cache(&pool).unwrap(), model.new_paged_cache(&pool).unwrap());
    a.extend_table(&[13, 2, 7, 9, 0, 15, 4, 11]).unwrap();
    b.extend_table(&[1, 3, 5, 6, 8, 10, 12, 14]).unwrap();
    let (mut host_a, mut host_b) = (model.new_cache(32), model.new_cache(32));
    let (prompt_a, prompt_b) = ([3u32, 17, 5, 38, 0, 22, 9], [8u32, 1, 30, 2, 2]);
    assert_eq!(decode(&model, &mut a, &prompt_a, 6), decode(&model, &mut host_a, &prompt_a, 6));
    assert_eq!(decode(&model, &mut b, &prompt_b, 6), decode(&model, &mut host_b, &prompt_b, 6));
    assert_eq!(decode(&model, &mut a, &[4], 5), decode(&model, &mut host_a, &[4], 5));
    assert_eq!((a.len(), b.len()), (host_a.len(), host_b.len()));
    // A CPU model cannot use a device pool: a clear error, not a read of device memory.
    let cpu_model = ParallelModel::load(
        &path,
        LoadOptions::new(Placement::single()).on(cpu()).form(WeightForm::Native),
    )
    .unwrap();
    let err = cpu_model.new_paged_cache(&pool).unwrap_err();
    assert!(err.to_string().contains("device memory"), "{err}");
    std::fs::remove_file(path).unwrap();
}

/// Weights kept in a device arena: the logits match the CPU's; after the arena's memory is
/// overwritten (as a sleep loses it) a cleared cache writes every weight again into the same
/// regions (no new device memory) and the logits are bit for bit the first ones, while without
/// the clear they are wrong (so the overwrite did hit the weights).
#[test]
fn cuda_weights_in_an_arena_are_written_again_in_place_after_a_clear() {
    let Some(gpu) = gpu() else { return };
    let path = temp_path("cuda-arena-weights.gguf");
    RandomLlama { quantized: Some(BlockFormat::Q8_0), seed: 6, ..Default::default() }
        .write(&path)
        .unwrap();
    let cuda = cuda_of(&gpu).clone();
    let arena = std::sync::Arc::new(tensor::kernels::PoolArena::new(&cuda, 64 << 20).unwrap());
    cuda.keep_weights_in(arena.clone());
    let model = ParallelModel::load(
        &path,
        LoadOptions::new(Placement::single()).on(gpu.clone()).form(WeightForm::Native),
    )
    .unwrap();
    let cpu =
        ParallelModel::load(&path, LoadOptions::new(Placement::single()).form(WeightForm::F32))
            .unwrap();
    let prompt = [3u32, 17, 5, 38, 0, 22, 9];
    let first = decode(&model, &mut model.new_cache(32), &prompt, 4);
    let want = decode(&cpu, &mut cpu.new_cache(32), &prompt, 4);
    for (got, want) in first.iter().zip(&want) {
        assert_rel(got, want, 1e-3, "arena weights");
    }
    let held = cuda.cached_weight_bytes();
    assert!(held > 0);

    arena.scribble(&cuda, 0x7f);
    let generation = tensor::memory::weights_generation();
    let stale = decode(&model, &mut model.new_cache(32), &prompt, 1);
    // Unless a model of another test was dropped meanwhile: its drop bumps the weights
    // generation, which makes every copy stale and uploads it again.
    if tensor::memory::weights_generation() == generation {
        assert_ne!(stale[0], first[0], "overwriting the arena did not change the weights");
    }
    cuda.clear_weight_cache();
    assert_eq!(cuda.cached_weight_bytes(), held, "arena regions are kept by a clear");
    assert_eq!(decode(&model, &mut model.new_cache(32), &prompt, 4), first);
    assert_eq!(cuda.cached_weight_bytes(), held, "the weights went back into their regions");
    std::fs::remove_file(path).unwrap();
}

/// Whole models with half-precision weights: the random model's logits within 5% (bf16) and
/// 1% (f16) of the largest CPU logit; the default model in bf16 still says Paris.
#[test]
fn cuda_half_precision_models_stay_close_to_the_cpu() {
    let prompt = [3u32, 17, 5, 38, 0, 22, 9];
    let path = temp_path("cuda-half-model.gguf");
    RandomLlama { quantized: Some(BlockFormat::Q8_0), seed: 7, ..Default::default() }
        .write(&path)
        .unwrap();
    let cpu = Model::load_with(&path, 1, WeightForm::F32).unwrap();
    let (want, _) = run_model(&cpu, &prompt);
    for (dtype, tol) in [(GemmDtype::Bf16, 5e-2), (GemmDtype::F16, 1e-2)] {
        let Some(gpu) = gpu_in(dtype) else { return };
        let file = GgufFile::open(&path).unwrap();
        let config = LlamaConfig::from_gguf(&file).unwrap();
        let dev = Model::from_source(&file, config, gpu, WeightForm::Native).unwrap();
        let (got, _) = run_model(&dev, &prompt);
        assert_rel(got.host().unwrap(), want.host().unwrap(), tol, dtype.name());
    }
    std::fs::remove_file(path).unwrap();
    let Some(gpu) = gpu_in(GemmDtype::Bf16) else { return };
    let Some(path) = checkpoint::cache::default_model_path() else {
        assert!(!gpu_required(), "TPCTL_REQUIRE_GPU=1 but the default model is not cached");
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let tok = text::Tokenizer::from_gguf(&file).unwrap();
    let dev = Model::from_source(&file, config, gpu, WeightForm::Native).unwrap();
    let prompt = tok.encode("The capital of France is").unwrap();
    let tokens = dev.generate(&prompt, 8, &[], &mut dev.new_cache(32), |_| {}).unwrap();
    let text = tok.decode(&tokens, true).unwrap();
    assert!(text.contains("Paris"), "bf16 continuation: {text:?}");
}

/// Last-position logits of `steps` forward passes of fixed tokens (no sampling, so two caches
/// see the same inputs even when their logits differ).
fn forced(
    model: &ParallelModel,
    cache: &mut crate::parallel::ParallelCache,
    steps: &[&[u32]],
) -> Vec<f32> {
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let mut rows = Vec::new();
    for tokens in steps {
        let out = model.forward(&mut comms, tokens, cache, Logits::Last).unwrap();
        rows.extend_from_slice(out.host_row(out.rows() - 1).unwrap());
    }
    rows
}

/// A bf16 paged pool (what a half-precision GPU deployment gets) holds half the bytes of an
/// f32 one; keys and values are rounded on the device as they are appended, and the logits
/// stay within bf16 rounding of the f32 pool's.
#[test]
fn cuda_bf16_paged_pool_stays_close_to_the_f32_pool() {
    let Some(gpu) = gpu() else { return };
    let path = temp_path("cuda-bf16-kv.gguf");
    RandomLlama { seed: 11, ..Default::default() }.write(&path).unwrap();
    let model =
        ParallelModel::load(&path, LoadOptions::new(Placement::single()).on(gpu.clone())).unwrap();
    let (block_size, blocks) = (4, 8);
    let pool = |elem: KvElem| {
        let bytes = model.pool_bytes(block_size, blocks, elem);
        let arena = tensor::kernels::PoolArena::new(cuda_of(&gpu), bytes).unwrap();
        let pool = model.pool_on_device(&arena, block_size, blocks, elem).unwrap();
        assert_eq!(pool.elem(), elem);
        (std::sync::Arc::new(pool), bytes)
    };
    let ((full, full_bytes), (half, half_bytes)) = (pool(KvElem::F32), pool(KvElem::Bf16));
    assert_eq!(full_bytes, 2 * half_bytes);
    let steps: [&[u32]; 4] = [&[3, 17, 5, 38, 0, 22, 9], &[4], &[12], &[7]];
    let mut logits = Vec::new();
    for pool in [&full, &half] {
        let mut cache = model.new_paged_cache(pool).unwrap();
        cache.extend_table(&[6, 1, 3, 0]).unwrap();
        logits.push(forced(&model, &mut cache, &steps));
    }
    assert_ne!(logits[0], logits[1], "the bf16 pool computed in f32");
    assert_rel(&logits[1], &logits[0], 3e-2, "bf16 KV pool against f32");
    std::fs::remove_file(path).unwrap();
}

/// A bf16 contiguous device cache (what a half-precision GPU deployment gets without a paged
/// pool) holds half the bytes of an f32 one, and its logits stay within bf16 rounding of the
/// f32 cache's.
#[test]
fn cuda_bf16_device_cache_stays_close_to_the_f32_cache() {
    let Some(gpu) = gpu() else { return };
    let path = temp_path("cuda-bf16-cache.gguf");
    RandomLlama { seed: 13, ..Default::default() }.write(&path).unwrap();
    let model =
        ParallelModel::load(&path, LoadOptions::new(Placement::single()).on(gpu.clone())).unwrap();
    assert_eq!(model.cache_bytes(32, KvElem::F32), 2 * model.cache_bytes(32, KvElem::Bf16));
    let steps: [&[u32]; 4] = [&[3, 17, 5, 38, 0, 22, 9], &[4], &[12], &[7]];
    let mut logits = Vec::new();
    for elem in [KvElem::F32, KvElem::Bf16] {
        let bytes = model.cache_bytes(32, elem);
        let arena = tensor::kernels::PoolArena::new(cuda_of(&gpu), bytes).unwrap();
        let mut cache = model.new_cache_on_device(32, elem, &arena).unwrap();
        assert_eq!(cache.capacity(), 32);
        logits.push(forced(&model, &mut cache, &steps));
    }
    assert_ne!(logits[0], logits[1], "the bf16 cache computed in f32");
    assert_rel(&logits[1], &logits[0], 3e-2, "bf16 KV cache against f32");
    std::fs::remove_file(path).unwrap();
}

/// `ParallelModel::prepare_device` makes every device copy of a weight that a step reads: a
/// forward pass after it caches no more weight bytes, and gives the logits a model without it
/// gives. In f32 with a tied head, and in bf16 with Q8_0 weights, an untied head and Qwen3's
/// per-head norms; and Gemma 2's post-norms.
#[test]
fn cuda_prepared_weights_are_every_weight_a_step_reads() {
    let specs = [
        (GemmDtype::F32, RandomLlama { seed: 11, ..Default::default() }),
        (
            GemmDtype::Bf16,
            RandomLlama {
                quantized: Some(BlockFormat::Q8_0),
                untied_head: true,
                qwen3: true,
                head_dim: Some(24),
                seed: 12,
                ..Default::default()
            },
        ),
        (GemmDtype::F32, gemma2_spec()),
    ];
    let prompt = [3u32, 17, 5, 38, 0, 22, 9];
    for (i, (dtype, spec)) in specs.into_iter().enumerate() {
        let Some(gpu) = gpu_in(dtype) else { return };
        let path = temp_path(&format!("cuda-prepared-{i}.gguf"));
        spec.write(&path).unwrap();
        let load = |be: &Backend| {
            let opts = LoadOptions::new(Placement::single()).on(be.clone());
            ParallelModel::load(&path, opts.form(WeightForm::Native)).unwrap()
        };
        let model = load(&gpu);
        let cuda = cuda_of(&gpu);
        model.prepare_device().unwrap();
        let prepared = cuda.cached_weight_bytes();
        assert!(prepared > 0, "case {i}: nothing was prepared");
        let got = decode(&model, &mut model.new_cache(32), &prompt, 2);
        assert_eq!(
            cuda.cached_weight_bytes(),
            prepared,
            "case {i}: a step copied weights that prepare_device did not"
        );
        let plain = Backend::cuda_with(0, dtype).unwrap();
        let unprepared = load(&plain);
        assert_eq!(got, decode(&unprepared, &mut unprepared.new_cache(32), &prompt, 2), "case {i}");
        std::fs::remove_file(path).unwrap();
    }
}

/// A step's top-k candidates found on the GPU (only they come to the host) are those of the
/// step's logits brought to the host, bit for bit, and its tokens drawn on the GPU are those
/// the CPU draws from them: a Llama and a Gemma 2 (whose candidates and draws see the
/// soft-capped logits), two sequences, k from 1 to past the vocabulary, greedy and sampled
/// draws.
#[test]
fn cuda_top_k_candidates_and_draws_of_a_step_are_those_of_its_logits() {
    use crate::parallel::Sequence;
    use tensor::kernels::Draw;
    let Some(gpu) = gpu() else { return };
    let prompts: [&[u32]; 2] = [&[3, 17, 5, 38], &[0, 22, 9]];
    for (i, spec) in [RandomLlama::default(), gemma2_spec()].into_iter().enumerate() {
        let path = temp_path(&format!("cuda-top-k-{i}.gguf"));
        spec.write(&path).unwrap();
        let opts = LoadOptions::new(Placement::single()).on(gpu.clone());
        let model = ParallelModel::load(&path, opts.form(WeightForm::Native)).unwrap();
        let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
        let mut comms = Comms { tp: &mut tp, cp: &mut cp };
        let mut step = |pick: &mut dyn FnMut(&mut Comms<'_>, &mut [Sequence<'_>])| {
            let mut caches = [model.new_cache(16), model.new_cache(16)];
            let [a, b] = &mut caches;
            let mut seqs = [Sequence::sampled(prompts[0], a), Sequence::sampled(prompts[1], b)];
            pick(&mut comms, &mut seqs);
        };
        let mut logits = None;
        step(&mut |comms, seqs| logits = model.forward_batch(comms, seqs).unwrap());
        let logits = logits.unwrap();
        let vocab = logits.row_len();
        let host = Tensor::from_vec(&[2, vocab], logits.into_host_vec().unwrap()).unwrap();
        for k in [1, 7, vocab + 3] {
            let mut top = None;
            step(&mut |comms, seqs| top = model.forward_batch_top_k(comms, seqs, k).unwrap());
            let want = cpu().top_k_rows(&host, k).unwrap();
            assert_eq!(top.unwrap(), want, "case {i}, k {k}");
        }
        for (temperature, u) in [(0.0, 0.0), (0.8, 0.3), (1.5, 0.97)] {
            let draws = [
                Draw { temperature, min_p: 0.0, u, top_p: 1.0 },
                Draw { temperature, min_p: 0.05, u, top_p: 0.8 },
            ];
            let mut ids = None;
            step(&mut |comms, seqs| ids = model.forward_batch_sample(comms, seqs, &draws).unwrap());
            let want = cpu().sample_rows(&host, &draws).unwrap();
            assert_eq!(ids.unwrap(), want, "case {i}, temperature {temperature}");
        }
        std::fs::remove_file(path).unwrap();
    }
}

/// Warm decode steps on a GPU allocate nothing: after the prompt step and the first decode
/// step (recorded), every buffer their kernels write comes from the step shape's workspace
/// (`tensor::kernels::workspace`) and every small input (ids, positions, tables) is staged
/// through the fixed pinned and device buffers; the greedy ids are the CPU's (f32) at every
/// step, the context growing past a split of the attention's keys.
#[test]
fn cuda_warm_decode_steps_take_their_buffers_from_the_step_workspace() {
    for dtype in [GemmDtype::F32, GemmDtype::Bf16] {
        let Some(gpu) = gpu_in(dtype) else { return };
        let path = temp_path(&format!("cuda-workspace-{}.gguf", dtype.name()));
        RandomLlama { seed: 21, ..Default::default() }.write(&path).unwrap();
        let run = |be: &Backend| {
            decode_three_sequences(be, &path, 300, |be| {
                (be.workspace_stats(), be.device_counters())
            })
        };
        let on_gpu = run(&gpu);
        for (step, (_, (ws0, c0), (ws1, c1))) in on_gpu.iter().enumerate().skip(2) {
            let (ws0, ws1) = (ws0.unwrap(), ws1.unwrap());
            let c = c1.unwrap().since(&c0.unwrap());
            assert_eq!(
                ws1.fallbacks, ws0.fallbacks,
                "{dtype:?} step {step}: a buffer took the pool"
            );
            assert!(ws1.slots > ws0.slots, "{dtype:?} step {step}: no slot");
            assert_eq!(c.allocations, 0, "{dtype:?} step {step}: {c:?}");
        }
        if dtype == GemmDtype::F32 {
            let on_cpu = run(&cpu());
            for (step, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
                assert_eq!(g.0, c.0, "step {step}: the GPU's greedy ids are not the CPU's");
            }
        }
        std::fs::remove_file(path).unwrap();
    }
}

/// CUDA graphs of decode steps (`tensor::kernels::cuda::graph_book`): 300 decode steps of 3
/// sequences with graphs on give the ids of the same steps run eagerly (`set_graphs(false)`)
/// bit for bit, f32 and bf16 (and in f32 the CPU's). Once warm, most steps replay a graph:
/// one graph launch, no launch or upload outside it; the misses are the few steps whose
/// inputs outgrew their staging slots as the contexts grew. The device's time in the steps
/// (events around each) is some, and no more than the run's.
#[test]
fn cuda_decode_steps_replay_graphs_with_the_tokens_of_eager_steps() {
    for dtype in [GemmDtype::F32, GemmDtype::Bf16] {
        let (Some(graphed), Some(eager)) = (gpu_in(dtype), gpu_in(dtype)) else { return };
        eager.set_graphs(false);
        let path = temp_path(&format!("cuda-graphs-{}.gguf", dtype.name()));
        RandomLlama { seed: 23, ..Default::default() }.write(&path).unwrap();
        let run = |be: &Backend| {
            decode_three_sequences(be, &path, 300, Backend::device_counters)
                .into_iter()
                .map(|(ids, before, after)| {
                    let spent = after.zip(before).map(|(a, b)| a.since(&b));
                    (ids, spent.unwrap_or_default())
                })
                .collect::<Vec<_>>()
        };
        let started = std::time::Instant::now();
        let with_graphs = run(&graphed);
        let wall = started.elapsed();
        let without = run(&eager);
        // The device's time in the steps, from events around each: some, and within the run.
        let busy = graphed.device_busy().unwrap();
        assert!(busy > std::time::Duration::ZERO && busy <= wall, "{dtype:?}: busy {busy:?}");
        for (step, (g, e)) in with_graphs.iter().zip(&without).enumerate() {
            assert_eq!(g.0, e.0, "{dtype:?} step {step}: a replayed graph changed the ids");
            assert_eq!(e.1.graph_launches, 0, "{dtype:?} step {step}: eager steps launch no graph");
        }
        let stats = graphed.graph_stats().unwrap();
        let replayed: Vec<_> =
            with_graphs.iter().filter(|(_, c)| c.graph_launches == 1 && c.launches == 0).collect();
        assert!(stats.captures >= 1, "{dtype:?}: no graph captured: {stats:?}");
        assert_eq!(stats.failed_captures, 0, "{dtype:?}: {stats:?}");
        assert!(replayed.len() >= 200, "{dtype:?}: {} steps replayed: {stats:?}", replayed.len());
        for (_, c) in &replayed {
            assert_eq!((c.uploads, c.allocations), (0, 0), "{dtype:?}: a replayed step: {c:?}");
        }
        if dtype == GemmDtype::F32 {
            let on_cpu = run(&cpu());
            for (step, (g, c)) in with_graphs.iter().zip(&on_cpu).enumerate() {
                assert_eq!(g.0, c.0, "step {step}: the GPU's greedy ids are not the CPU's");
            }
        }
        std::fs::remove_file(path).unwrap();
    }
}

/// `steps` greedy steps of three sequences (prompts of 4, 3 and 2 tokens, then one token
/// each) of the model at `path` on `be`: each step's ids, with what `measure` reads of the
/// backend before and after it. On a GPU the sequences' keys and values are in a paged device
/// pool, as a serving engine's are (blocks of 16, scattered); on the CPU in host caches.
fn decode_three_sequences<T>(
    be: &Backend,
    path: &std::path::Path,
    steps: usize,
    measure: impl Fn(&Backend) -> T,
) -> Vec<(Vec<u32>, T, T)> {
    use crate::parallel::{ParallelCache, Sequence};
    const CONTEXT: usize = 400;
    let opts = LoadOptions::new(Placement::single()).on(be.clone());
    let model = ParallelModel::load(path, opts.form(WeightForm::Native)).unwrap();
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let (block_size, per_seq) = (16, CONTEXT.div_ceil(16));
    // Kept alive while the caches use the pool's memory.
    let mut _arena = None;
    let mut caches: [ParallelCache; 3] = if let Backend::Cuda(gpu) = be {
        let elem = model.device_kv_elem();
        let bytes = model.pool_bytes(block_size, 3 * per_seq, elem);
        let arena = _arena.insert(tensor::kernels::PoolArena::new(gpu, bytes).unwrap());
        let pool = model.pool_on_device(arena, block_size, 3 * per_seq, elem).unwrap();
        let pool = std::sync::Arc::new(pool);
        std::array::from_fn(|s| {
            let mut cache = model.new_paged_cache(&pool).unwrap();
            // Sequence s takes every third block, from block s: scattered in the pool.
            let blocks: Vec<u32> = (0..per_seq).map(|b| (3 * b + s) as u32).collect();
            cache.extend_table(&blocks).unwrap();
            cache
        })
    } else {
        std::array::from_fn(|_| model.new_cache(CONTEXT))
    };
    let mut next: Vec<Vec<u32>> = vec![vec![3, 17, 5, 38], vec![0, 22, 9], vec![1, 2]];
    let mut out = Vec::new();
    for _ in 0..steps {
        let before = measure(be);
        let [a, b, c] = &mut caches;
        let mut seqs = [
            Sequence::sampled(&next[0], a),
            Sequence::sampled(&next[1], b),
            Sequence::sampled(&next[2], c),
        ];
        let ids = model.forward_batch_argmax(&mut comms, &mut seqs).unwrap().unwrap();
        next = ids.iter().map(|&t| vec![t]).collect();
        out.push((ids, before, measure(be)));
    }
    out
}
