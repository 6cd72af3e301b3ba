//! The parallel modules against their serial definitions, on thread meshes (`local` groups):
//! each layer alone, the sequence collect and its adjoint, and the whole model in several
//! `tp × cp` layouts against the single-rank model (prefill and 16 decode steps), batched
//! steps against each sequence alone, SmolLM2's greedy ids across layouts, batches and
//! recompute (when cached), and the model with its weights and caches in arena memory
//! against the same model on the heap.

use super::*;
use crate::error::Error;
use crate::model::random::RandomLlama;
use crate::model::{KvCache, Linear, Logits, Model, WeightForm};
use crate::test_util::{random_vec, temp_path, FakeDeviceMemory};
use checkpoint::config::LlamaConfig;
use checkpoint::gguf::GgufFile;
use checkpoint::Shard;
use collectives::{local, Collective, Communicator, ShmOptions};
use mesh::TokenShard;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tensor::kernels::cpu::quant::BlockFormat;
use tensor::kernels::{Backend, KvElem, LogitEdit, LogitEdits};
use tensor::memory::Arena;
use tensor::Tensor;

/// TP and CP communicators for every rank of a `tp × cp` thread mesh (TP innermost).
fn mesh_comms(tp: usize, cp: usize) -> Vec<(Box<dyn Communicator>, Box<dyn Communicator>)> {
    let opts = ShmOptions { slot_bytes: 64 << 10, ring_bytes: 16 << 10 };
    local::mesh(tp, cp, opts)
        .unwrap()
        .into_iter()
        .map(|(mut t, mut c)| {
            t.set_timeout(Duration::from_secs(30));
            c.set_timeout(Duration::from_secs(30));
            (Box::new(t) as Box<dyn Communicator>, Box::new(c) as Box<dyn Communicator>)
        })
        .collect()
}

/// Runs `f` on every rank of a `tp × cp` mesh, each on its own thread.
fn on_mesh<R: Send>(
    tp: usize,
    cp: usize,
    f: impl Fn(Placement, &mut Comms<'_>) -> R + Sync,
) -> Vec<R> {
    let pairs = mesh_comms(tp, cp);
    std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .into_iter()
            .map(|(mut t, mut c)| {
                let f = &f;
                s.spawn(move || {
                    let mut comms = Comms { tp: &mut *t, cp: &mut *c };
                    let p = Placement::of(&comms);
                    f(p, &mut comms)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

fn write_model(spec: &RandomLlama, stem: &str) -> PathBuf {
    let p = temp_path(stem);
    spec.write(&p).unwrap();
    p
}

/// Max |a - b| relative to the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn aligned_ranges_keep_blocks_whole_when_they_can() {
    assert_eq!(aligned_ranges(1536, 2, 32), vec![0..768, 768..1536]);
    assert_eq!(
        aligned_ranges(1536, 5, 32),
        vec![0..320, 320..640, 640..960, 960..1248, 1248..1536]
    );
    // Not a whole number of blocks: plain balance.
    assert_eq!(aligned_ranges(10, 3, 32), vec![0..4, 4..7, 7..10]);
}

#[test]
fn linear_layers_embedding_and_head_match_the_full_layers() {
    let spec = RandomLlama {
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 80,
        vocab: 37,
        seed: 21,
        ..RandomLlama::default()
    };
    let path = write_model(&spec, "layers.gguf");
    let file = GgufFile::open(&path).unwrap();
    let be = Backend::cpu(1).unwrap();
    let x = Tensor::from_vec(&[3, 48], random_vec(3 * 48, 4)).unwrap();
    let full_up =
        Linear::load(&file, "blk.0.ffn_up.weight", &Shard::Full, WeightForm::F32).unwrap();
    let full_down =
        Linear::load(&file, "blk.0.ffn_down.weight", &Shard::Full, WeightForm::F32).unwrap();
    let up_want = full_up.forward(&be, &x).unwrap();
    let down_in = Tensor::from_vec(&[3, 80], random_vec(3 * 80, 5)).unwrap();
    let down_want = full_down.forward(&be, &down_in).unwrap();
    let table = Linear::load(&file, "token_embd.weight", &Shard::Full, WeightForm::F32).unwrap();
    let ids = [0u32, 36, 17, 5];
    let emb_want = be.embedding(table.weight(), &ids).unwrap();
    let logits_want = be.linear(&x, table.weight()).unwrap();
    for tp in 1..=4 {
        let got = on_mesh(tp, 1, |p, comms| {
            let be = Backend::cpu(1).unwrap();
            let ranges = mesh::balanced_ranges(80, tp);
            let up = ColumnParallelLinear::load(
                &file,
                "blk.0.ffn_up.weight",
                None,
                ranges.clone(),
                p.tp_rank,
                WeightForm::F32,
            )
            .unwrap();
            let up_all = up.forward_gathered(&be, comms.tp, &x).unwrap();
            let cols = ranges[p.tp_rank].clone();
            let down = RowParallelLinear::load(
                &file,
                "blk.0.ffn_down.weight",
                None,
                cols.clone(),
                p.tp_rank == 0,
                WeightForm::F32,
            )
            .unwrap();
            let local_in: Vec<f32> =
                (0..3).flat_map(|r| down_in.row(r)[cols.clone()].to_vec()).collect();
            let local_in = Tensor::from_vec(&[3, cols.len()], local_in).unwrap();
            let down_all = down.forward(&be, comms.tp, &local_in).unwrap();
            let vocab = mesh::balanced_ranges(37, tp);
            let emb = VocabParallelEmbedding::load(
                &file,
                "token_embd.weight",
                vocab[p.tp_rank].clone(),
                WeightForm::F32,
            )
            .unwrap();
            let e = emb.forward(&be, comms.tp, &ids).unwrap();
            let head = ParallelLmHead::new(emb.table().clone(), vocab, p.tp_rank);
            let logits = head.logits(&be, comms.tp, &x).unwrap();
            let argmax = head.argmax(&be, comms.tp, &x, None, None).unwrap();
            // A row without a number (all NaN): token 0, as the serial argmax gives.
            let nan = Tensor::from_vec(&[1, x.row_len()], vec![f32::NAN; x.row_len()]).unwrap();
            let nan_ids = head.argmax(&be, comms.tp, &nan, None, None).unwrap();
            (up_all, down_all, e, logits, (argmax, nan_ids))
        });
        let want_ids: Vec<u32> =
            be.argmax_rows(&logits_want).unwrap().into_iter().map(|i| i as u32).collect();
        for (up, down, e, logits, (argmax, nan_ids)) in got {
            assert_eq!(nan_ids, vec![0], "tp {tp} distributed argmax of a NaN row");
            assert!(rel_err(up.data(), up_want.data()) < 1e-5, "tp {tp} column-parallel");
            assert!(rel_err(down.data(), down_want.data()) < 1e-5, "tp {tp} row-parallel");
            assert_eq!(e.data(), emb_want.data(), "tp {tp} embedding");
            assert!(rel_err(logits.data(), logits_want.data()) < 1e-5, "tp {tp} lm head");
            assert_eq!(argmax, want_ids, "tp {tp} distributed argmax");
        }
    }
    let err = on_mesh(2, 1, |_, comms| {
        let emb = VocabParallelEmbedding::load(&file, "token_embd.weight", 0..19, WeightForm::F32)
            .unwrap();
        emb.forward(&Backend::cpu(1).unwrap(), comms.tp, &[37]).unwrap_err().to_string()
    });
    assert!(err[0].contains("37"), "{}", err[0]);
}

#[test]
fn parallel_rms_norm_matches_the_full_norm() {
    let be = Backend::cpu(1).unwrap();
    let (n, h) = (4, 30);
    let x = Tensor::from_vec(&[n, h], random_vec(n * h, 8)).unwrap();
    let w = Tensor::from_vec(&[h], random_vec(h, 9)).unwrap();
    let want = be.rms_norm(&x, &w, 1e-5).unwrap();
    for tp in [1, 2, 3, 4] {
        let got = on_mesh(tp, 1, |p, comms| {
            let cols = mesh::balanced_ranges(h, tp)[p.tp_rank].clone();
            let norm = ParallelRmsNorm::new(w.data()[cols.clone()].to_vec(), h, 1e-5);
            let local: Vec<f32> = (0..n).flat_map(|r| x.row(r)[cols.clone()].to_vec()).collect();
            let out = norm
                .forward(comms.tp, &Tensor::from_vec(&[n, cols.len()], local).unwrap())
                .unwrap();
            (cols, out)
        });
        for (cols, out) in got {
            let want_local: Vec<f32> =
                (0..n).flat_map(|r| want.row(r)[cols.clone()].to_vec()).collect();
            assert!(rel_err(out.data(), &want_local) < 1e-5, "tp {tp}");
        }
    }
}

#[test]
fn gather_tokens_and_its_adjoint_match_the_serial_definitions() {
    let (tokens, width) = (11, 3);
    for cp in 1..=4 {
        let got = on_mesh(1, cp, |p, comms| {
            let shard = TokenShard::new(tokens, cp, p.cp_rank).unwrap();
            let rows: Vec<f32> =
                shard.local().flat_map(|t| (0..width).map(move |c| (t * 10 + c) as f32)).collect();
            let local = Tensor::from_vec(&[shard.local().len(), width], rows).unwrap();
            let all = gather_tokens(comms.cp, &local, &shard).unwrap();
            // Each rank's gradient of the gathered rows differs; the adjoint sums them.
            let grad: Vec<f32> =
                (0..tokens * width).map(|i| (i * (p.cp_rank + 1)) as f32).collect();
            let grad = Tensor::from_vec(&[tokens, width], grad).unwrap();
            let back = gather_tokens_backward(comms.cp, &grad, &shard).unwrap();
            (shard, all, back)
        });
        let serial: Vec<f32> =
            (0..tokens).flat_map(|t| (0..width).map(move |c| (t * 10 + c) as f32)).collect();
        let factor: usize = (1..=cp).sum();
        for (shard, all, back) in got {
            assert_eq!(all.data(), &serial[..], "cp {cp} gather");
            let want: Vec<f32> = shard
                .local()
                .flat_map(|t| (0..width).map(move |c| ((t * width + c) * factor) as f32))
                .collect();
            assert_eq!(back.data(), &want[..], "cp {cp} adjoint");
        }
    }
}

/// The checkpoint at `path` loaded sharded in (1,1) (2,1) (1,2) (2,2) generates the single-rank
/// `reference`'s 12 greedy ids for `prompt` on every rank.
fn assert_greedy_in_layouts(reference: &Model, path: &std::path::Path, prompt: &[u32]) {
    let want = reference.generate(prompt, 12, &[], &mut reference.new_cache(64), |_| {}).unwrap();
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let model = ParallelModel::load(path, LoadOptions::new(p)).unwrap();
            let mut cache = model.new_cache(64);
            model.generate(comms, prompt, 12, &[], &mut cache, |_| {}).unwrap()
        });
        for (rank, g) in got.iter().enumerate() {
            assert_eq!(g, &want, "({tp},{cp}) rank {rank}");
        }
    }
}

/// Runs `spec` in every `(tp, cp)` of `layouts` and compares prefill logits and 16 decode
/// steps with the single-rank model (1e-4 relative); the CP ranks must share the tokens evenly.
fn check_layouts(spec: &RandomLlama, stem: &str, layouts: &[(usize, usize)]) {
    let path = write_model(spec, stem);
    let vocab = spec.vocab;
    let reference = Model::load_with(&path, 1, WeightForm::F32).unwrap();
    let prompt: Vec<u32> = [3u32, 17, 5, 38, 0, 22, 9].iter().map(|t| t % vocab as u32).collect();
    // The single-rank logits: the prompt, then 16 greedy steps.
    let mut cache = reference.new_cache(64);
    let positions: Vec<usize> = (0..prompt.len()).collect();
    let prefill = reference.forward(&prompt, &positions, &mut cache, Logits::All).unwrap();
    let last = prefill.row(prompt.len() - 1).to_vec();
    let mut next =
        reference.backend().argmax_rows(&Tensor::from_vec(&[1, vocab], last).unwrap()).unwrap()[0]
            as u32;
    let mut steps = Vec::new();
    for _ in 0..16 {
        let pos = cache.len();
        let logits = reference.forward(&[next], &[pos], &mut cache, Logits::Last).unwrap();
        steps.push((next, logits.clone()));
        next = reference.backend().argmax_rows(&logits).unwrap()[0] as u32;
    }
    for &(tp, cp) in layouts {
        let got = on_mesh(tp, cp, |p, comms| {
            let file = GgufFile::open(&path).unwrap();
            let config = LlamaConfig::from_gguf(&file).unwrap();
            let model = ParallelModel::from_source(
                &file,
                config,
                LoadOptions::new(p).on(Backend::cpu(1).unwrap()).form(WeightForm::F32),
            )
            .unwrap();
            let mut cache = model.new_cache(64);
            let pre = model.forward(comms, &prompt, &mut cache, Logits::All).unwrap();
            let mut decode = Vec::new();
            for (token, _) in &steps {
                decode.push(model.forward(comms, &[*token], &mut cache, Logits::Last).unwrap());
            }
            (pre, decode, cache.cp_lens().to_vec())
        });
        for (rank, (pre, decode, lens)) in got.iter().enumerate() {
            let e = rel_err(pre.data(), prefill.data());
            assert!(e < 1e-4, "{stem} ({tp},{cp}) rank {rank}: prefill logits off by {e}");
            for (i, (logits, (_, want))) in decode.iter().zip(&steps).enumerate() {
                let e = rel_err(logits.data(), want.data());
                assert!(e < 1e-4, "{stem} ({tp},{cp}) rank {rank}: decode step {i} off by {e}");
            }
            // Every token is held by exactly one CP rank, spread evenly.
            assert_eq!(lens.iter().sum::<usize>(), prompt.len() + 16);
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1, "{lens:?}");
        }
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn every_layout_matches_the_single_rank_model() {
    // Uneven heads (3 KV heads over TP=2 split 2 + 1) and uneven tokens over CP.
    let spec = batched_spec(33);
    let layouts = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (3, 2), (6, 1)];
    check_layouts(&spec, "layouts.gguf", &layouts);
}

#[test]
fn layouts_with_more_tp_ranks_than_kv_heads_match_the_single_rank_model() {
    // 2 KV heads of 4 query heads each: at TP=4 two ranks share each KV head and take 2 of
    // its query heads; at TP=8 every rank has one query head.
    let spec = RandomLlama {
        heads: 8,
        kv_heads: 2,
        hidden: 64,
        ffn: 64,
        vocab: 40,
        layers: 2,
        seed: 34,
        ..RandomLlama::default()
    };
    check_layouts(&spec, "replicated.gguf", &[(4, 1), (4, 2), (8, 1)]);
    // 3 query heads per KV head shared by 2 ranks: an uneven 2 + 1 split inside the group.
    let uneven = RandomLlama {
        heads: 6,
        kv_heads: 2,
        hidden: 48,
        ffn: 48,
        vocab: 40,
        layers: 1,
        seed: 35,
        ..RandomLlama::default()
    };
    check_layouts(&uneven, "replicated-uneven.gguf", &[(4, 1)]);
}

#[test]
fn qwen2_biases_are_sharded_with_their_heads() {
    // Column-parallel biases: each TP rank adds its heads' slice (at TP=4 two ranks share
    // each KV head, both adding its K/V bias).
    let spec = RandomLlama {
        heads: 4,
        kv_heads: 2,
        hidden: 48,
        ffn: 64,
        vocab: 40,
        seed: 36,
        attn_bias: true,
        ..RandomLlama::default()
    };
    check_layouts(&spec, "qwen2-layouts.gguf", &[(2, 1), (1, 2), (2, 2), (4, 1)]);
}

/// Qwen3: each TP rank normalizes the query and key heads it holds (no collective), CP
/// ranks normalize the keys of their own tokens. The logits of the prompt and 16 greedy
/// steps match the single-rank model in every layout: heads as wide as `hidden / heads`
/// (3 KV heads split 2 + 1 at TP=2; at TP=6 two ranks share a KV head and both normalize its
/// keys) and wider (with Q/K/V biases too). The greedy ids of the Hugging Face folder of the
/// same model, loaded sharded, are the single-rank GGUF model's.
#[test]
fn qwen3_per_head_norms_match_the_single_rank_model_in_every_layout() {
    let spec = RandomLlama {
        qwen3: true,
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 64,
        vocab: 40,
        seed: 54,
        ..RandomLlama::default()
    };
    let layouts = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (3, 2), (6, 1)];
    check_layouts(&spec, "qwen3-layouts.gguf", &layouts);
    let wide = RandomLlama { head_dim: Some(16), attn_bias: true, seed: 55, ..spec.clone() };
    check_layouts(&wide, "qwen3-wide-layouts.gguf", &[(2, 1), (1, 2), (2, 2)]);

    let path = write_model(&spec, "qwen3-generate.gguf");
    let dir = temp_path("qwen3-generate-hf");
    spec.write_hf(&dir, true).unwrap();
    let reference = Model::load(&path, 1).unwrap();
    let prompt = [1u32, 2, 3, 4, 5];
    assert_greedy_in_layouts(&reference, &dir, &prompt);
    std::fs::remove_file(path).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// Longrope (the long factors and the attention factor): the logits of the prompt and 16
/// greedy steps match the single-rank model in every layout, and the greedy ids of the
/// Phi-3 file (fused projections) loaded sharded are the single-rank model's. Every rank
/// rotates with the same factors, chosen once, so the keys each CP rank caches are those of
/// the single-rank model.
#[test]
fn phi3_longrope_matches_the_single_rank_model_in_every_layout() {
    let spec = RandomLlama {
        fused: true,
        longrope: Some(checkpoint::config::LongRope {
            short: (0..4).map(|i| 1.0 + i as f32 * 0.1).collect(),
            long: (0..4).map(|i| 1.0 + i as f32 * 5.0).collect(),
            original_context: 64,
            attn_factor: checkpoint::config::longrope_attn_factor(256, 64),
        }),
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 64,
        vocab: 40,
        seed: 62,
        ..RandomLlama::default()
    };
    let layouts = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)];
    // `check_layouts` reads the file's tensors as they are: the llama twin (same weights).
    let twin = RandomLlama { fused: false, ..spec.clone() };
    check_layouts(&twin, "phi3-longrope-layouts.gguf", &layouts);

    let path = write_model(&spec, "phi3-longrope-generate.gguf");
    let reference = Model::load(&path, 1).unwrap();
    let config = reference.config();
    assert_eq!(config.rope_freq_factors, spec.longrope.as_ref().map(|r| r.long.clone()));
    assert!(config.rope_attn_factor.is_some_and(|a| a > 1.0), "{config:?}");
    let prompt = [1u32, 2, 3, 4, 5];
    // Served within the original context, the model rotates with the short factors, and
    // keeps them when it adopts the weights of a load that chose the long ones.
    on_mesh(1, 1, |p, comms| {
        let mut model = ParallelModel::load(&path, LoadOptions::new(p).context(64)).unwrap();
        let short = spec.longrope.as_ref().map(|r| r.short.clone());
        assert_eq!(model.config().rope_freq_factors, short);
        let mut run = |model: &ParallelModel| {
            let mut cache = model.new_cache(16);
            model.forward(comms, &prompt, &mut cache, Logits::All).unwrap().data().to_vec()
        };
        let before = run(&model);
        let long = ParallelModel::load(&path, LoadOptions::new(p)).unwrap();
        assert!(rel_err(&run(&long), &before) > 1e-3, "the long factors rotate otherwise");
        model.adopt_weights(long).unwrap();
        assert_eq!(run(&model), before);
    });
    assert_greedy_in_layouts(&reference, &path, &prompt);
    std::fs::remove_file(path).unwrap();
}

/// A Gemma file: GELU-gated MLP and embeddings scaled by `sqrt(hidden)` (read from the
/// architecture), the same in every layout as on one rank, and not the llama model of the
/// same weights.
#[test]
fn gemma_files_gate_with_gelu_scale_embeddings_and_match_across_layouts() {
    let spec = RandomLlama { gemma: true, seed: 52, ..RandomLlama::default() };
    let path = write_model(&spec, "gemma.gguf");
    let config = LlamaConfig::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    assert_eq!(config.activation, checkpoint::Activation::GeluTanh);
    assert_eq!(config.embedding_scale, Some((spec.hidden as f32).sqrt()));
    let llama = write_model(&RandomLlama { gemma: false, ..spec.clone() }, "gemma-twin.gguf");
    let logits = |path: &std::path::Path| {
        let m = Model::load_with(path, 1, WeightForm::F32).unwrap();
        let mut cache = m.new_cache(8);
        m.forward(&[3, 17, 5], &[0, 1, 2], &mut cache, Logits::Last).unwrap().data().to_vec()
    };
    // The same weights (Q/K in the other rotary order) give other logits.
    assert!(rel_err(&logits(&path), &logits(&llama)) > 1e-2);
    check_layouts(&spec, "gemma-layouts.gguf", &[(2, 1), (1, 2), (2, 2)]);
    // Heads wider than hidden / heads (Gemma 7B's shape): queries 96 wide over a hidden 64.
    let wide = RandomLlama { head_dim: Some(24), seed: 53, ..spec };
    check_layouts(&wide, "gemma-wide-heads.gguf", &[(2, 1), (1, 2)]);
}

#[test]
fn head_shards_cover_every_query_head_once() {
    let cfg = |heads, kv| LlamaConfig {
        n_layers: 1,
        hidden: heads * 4,
        ffn: 8,
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: 4,
        rope_theta: 10_000.0,
        rope_dim: 4,
        rms_eps: 1e-5,
        vocab_size: 4,
        context_length: 8,
        tied_embeddings: true,
        rope_freq_factors: None,
        rope_attn_factor: None,
        longrope: None,
        activation: checkpoint::config::Activation::Silu,
        embedding_scale: None,
        qk_norm: false,
        attn_softcap: None,
        final_softcap: None,
        sliding_window: None,
        post_norms: false,
        query_scale: None,
        rope_local_theta: None,
    };
    type Shards = Vec<(Range<usize>, Range<usize>)>;
    let shards = |c: &LlamaConfig, tp| -> Shards {
        (0..tp).map(|r| head_shard(c, r, tp).map(|h| (h.kv, h.q)).unwrap()).collect::<Vec<_>>()
    };
    // (heads, kv heads, tp) -> (kv, q) per rank.
    let table: [((usize, usize, usize), Shards); 5] = [
        ((9, 3, 2), vec![(0..2, 0..6), (2..3, 6..9)]),
        ((8, 2, 2), vec![(0..1, 0..4), (1..2, 4..8)]),
        ((8, 2, 4), vec![(0..1, 0..2), (0..1, 2..4), (1..2, 4..6), (1..2, 6..8)]),
        ((6, 2, 4), vec![(0..1, 0..2), (0..1, 2..3), (1..2, 3..5), (1..2, 5..6)]),
        ((4, 1, 3), vec![(0..1, 0..2), (0..1, 2..3), (0..1, 3..4)]),
    ];
    for ((heads, kv, tp), want) in table {
        assert_eq!(shards(&cfg(heads, kv), tp), want, "heads {heads}, kv {kv}, tp {tp}");
    }
    // What callers give `plan_mesh`, and the early check of a requested tp.
    let c = cfg(8, 2);
    assert_eq!((mesh_head_groups(&c, None), mesh_head_groups(&c, Some(4))), (2, 8));
    let table = [(0, false), (1, true), (2, true), (3, false), (4, true), (5, false), (6, true)];
    for (tp, ok) in table.into_iter().chain([(8, true), (10, false)]) {
        assert_eq!(check_tp(&c, tp).is_ok(), ok, "tp {tp}");
        let planned = mesh::plan_mesh(tp.max(1) * 2, Some(tp), mesh_head_groups(&c, Some(tp)));
        assert_eq!(planned.is_ok(), (1..=8).contains(&tp), "plan_mesh with tp {tp}");
    }
    assert!(check_tp(&c, 16).unwrap_err().to_string().contains("tp=16 puts 8 ranks"));
    let err = |heads, kv, rank, tp| head_shard(&cfg(heads, kv), rank, tp).unwrap_err().to_string();
    let e = err(8, 2, 0, 3);
    assert!(e.contains("tp=3") && e.contains("2 KV heads") && e.contains("not a multiple"), "{e}");
    let e = err(4, 2, 0, 6);
    assert!(e.contains("3 ranks on each of the model's 2 KV heads"), "{e}");
    assert!(err(4, 2, 2, 2).contains("tp rank 2 of tp=2"));
}

#[test]
fn parallel_greedy_generation_equals_single_rank() {
    let spec = RandomLlama {
        heads: 4,
        kv_heads: 2,
        hidden: 64,
        ffn: 96,
        vocab: 48,
        seed: 44,
        quantized: Some(BlockFormat::Q8_0),
        ..RandomLlama::default()
    };
    let path = write_model(&spec, "generate.gguf");
    let reference = Model::load(&path, 1).unwrap();
    let prompt = [1u32, 2, 3, 4, 5];
    let mut cache = reference.new_cache(64);
    let want = reference.generate(&prompt, 12, &[], &mut cache, |_| {}).unwrap();
    let got = on_mesh(2, 2, |p, comms| {
        let model =
            ParallelModel::load(&path, LoadOptions::new(p).form(WeightForm::Native)).unwrap();
        let mut cache = model.new_cache(64);
        model.generate(comms, &prompt, 12, &[], &mut cache, |_| {}).unwrap()
    });
    for g in got {
        assert_eq!(g, want);
    }
}

#[test]
fn tp_beyond_the_kv_heads_but_not_a_multiple_is_a_clear_error() {
    let spec = RandomLlama { heads: 4, kv_heads: 2, seed: 45, ..RandomLlama::default() };
    let path = write_model(&spec, "toomany.gguf");
    let err = ParallelModel::load(
        &path,
        LoadOptions::new(Placement { tp_rank: 0, tp: 3, cp_rank: 0, cp: 1 }).form(WeightForm::F32),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("tp=3 exceeds the model's 2 KV heads"), "{msg}");
    assert!(msg.contains("not a multiple of them"), "{msg}");
}

/// One sequence's share of a batched step in [`batched_steps_match_each_sequence_alone`]:
/// (sequence, tokens, sample).
type Entry = (usize, Vec<u32>, bool);

/// Four steps of five sequences mixing prefills, prefill chunks (one step of nothing but a
/// chunk: nothing sampled), a one-token prompt and decodes of uneven lengths.
fn mixed_steps(vocab: u32) -> Vec<Vec<Entry>> {
    let ids = |seed: u32, n: u32| (0..n).map(|i| (seed * 7 + i * 13) % vocab).collect::<Vec<_>>();
    vec![
        vec![(0, ids(1, 7), true), (1, ids(2, 5), true), (2, ids(3, 4), false)],
        // Prompt chunks only: nothing is sampled.
        vec![(4, ids(13, 3), false)],
        vec![
            (0, ids(4, 1), true),
            (2, ids(5, 5), true),
            (1, ids(6, 1), true),
            (3, ids(7, 1), true),
        ],
        vec![
            (3, ids(8, 1), true),
            (4, ids(9, 5), true),
            (0, ids(10, 1), true),
            (1, ids(11, 1), false),
            (2, ids(12, 1), true),
        ],
        // Decode rows only (a paged pool then splits, rotates and appends in one pass), five
        // sequences and then one.
        (0..5).map(|s| (s as usize, ids(14 + s, 1), true)).collect(),
        vec![(2, ids(19, 1), true)],
    ]
}

/// The model at `path` on this rank of a mesh, f32 weights on a one-thread CPU backend.
fn f32_model_on(path: &std::path::Path, p: Placement) -> ParallelModel {
    let file = GgufFile::open(path).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let opts = LoadOptions::new(p).on(Backend::cpu(1).unwrap()).form(WeightForm::F32);
    ParallelModel::from_source(&file, config, opts).unwrap()
}

/// The small model of the batched-step tests (6 heads over 3 KV heads, a vocabulary of 40,
/// so TP splits it unevenly in three), with weights from `seed`.
fn batched_spec(seed: u64) -> RandomLlama {
    RandomLlama {
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 80,
        vocab: 40,
        layers: 2,
        seed,
        ..RandomLlama::default()
    }
}

/// A cache of 64 tokens for each of `mixed_steps`' five sequences.
fn five_caches(model: &ParallelModel) -> Vec<ParallelCache> {
    (0..5).map(|_| model.new_cache(64)).collect()
}

/// Runs `steps` (entries of sequence index, tokens, sample) as batched forward passes over
/// `caches`; each step's logits.
fn run_steps(
    model: &ParallelModel,
    comms: &mut Comms<'_>,
    steps: &[Vec<Entry>],
    caches: &mut [ParallelCache],
) -> Vec<Option<Tensor>> {
    run_steps_with(comms, steps, caches, |comms, seqs| model.forward_batch(comms, seqs).unwrap())
}

/// Runs `steps` over `caches` through `step` (one batched forward pass); what each gave.
fn run_steps_with<T>(
    comms: &mut Comms<'_>,
    steps: &[Vec<Entry>],
    caches: &mut [ParallelCache],
    step: impl FnMut(&mut Comms<'_>, &mut [Sequence<'_>]) -> T,
) -> Vec<T> {
    run_steps_edited(comms, steps, caches, &[], step)
}

/// [`run_steps_with`], sequence `i` with `edits[i]` (none past `edits`).
fn run_steps_edited<T>(
    comms: &mut Comms<'_>,
    steps: &[Vec<Entry>],
    caches: &mut [ParallelCache],
    edits: &[Vec<LogitEdit>],
    mut step: impl FnMut(&mut Comms<'_>, &mut [Sequence<'_>]) -> T,
) -> Vec<T> {
    let mut out = Vec::new();
    for entries in steps {
        let mut by_seq: Vec<Option<&mut ParallelCache>> = caches.iter_mut().map(Some).collect();
        let mut seqs: Vec<Sequence<'_>> = entries
            .iter()
            .map(|(seq, tokens, sample)| Sequence {
                tokens,
                cache: by_seq[*seq].take().unwrap(),
                sample: *sample,
                every_row: false,
                edits: edits.get(*seq).map_or(&[], Vec::as_slice),
            })
            .collect();
        out.push(step(comms, &mut seqs));
    }
    out
}

/// The single-rank model of the file at `path`, and the logits of the sampled rows of
/// `steps` with each sequence run alone on it, chunk by chunk as the steps feed it.
fn each_sequence_alone(path: &std::path::Path, steps: &[Vec<Entry>]) -> (Model, Vec<Vec<Tensor>>) {
    let reference = Model::load_with(path, 1, WeightForm::F32).unwrap();
    let mut caches: Vec<KvCache> = (0..5).map(|_| reference.new_cache(64)).collect();
    let want = steps
        .iter()
        .map(|step| {
            let mut rows = Vec::new();
            for (seq, tokens, sample) in step {
                let cache = &mut caches[*seq];
                let positions: Vec<usize> = (cache.len()..cache.len() + tokens.len()).collect();
                let logits = reference.forward(tokens, &positions, cache, Logits::Last).unwrap();
                if *sample {
                    rows.push(logits);
                }
            }
            rows
        })
        .collect();
    (reference, want)
}

#[test]
fn batched_steps_match_each_sequence_alone() {
    let spec = batched_spec(41);
    let path = write_model(&spec, "batched.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    let (reference, want) = each_sequence_alone(&path, &steps);
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let file = GgufFile::open(&path).unwrap();
            let config = LlamaConfig::from_gguf(&file).unwrap();
            let cpu = Backend::cpu(1).unwrap();
            let model = ParallelModel::from_source(
                &file,
                config,
                LoadOptions::new(p).on(cpu).form(WeightForm::F32),
            )
            .unwrap();
            let mut caches: Vec<ParallelCache> = (0..5).map(|_| model.new_cache(64)).collect();
            let out = run_steps(&model, comms, &steps, &mut caches);
            let lens: Vec<usize> = caches.iter().map(ParallelCache::len).collect();
            (p, out, lens)
        });
        for (p, out, lens) in got {
            assert_eq!(lens, [10, 8, 12, 3, 9], "({tp},{cp}) {p:?}: tokens per sequence");
            if (p.tp_rank, p.cp_rank) != (0, 0) {
                assert!(out.iter().all(Option::is_none), "({tp},{cp}) {p:?} got logits");
                continue;
            }
            for (i, (logits, want)) in out.iter().zip(&want).enumerate() {
                let logits = logits.as_ref().expect("rank 0 gets the logits");
                assert_eq!(logits.shape(), [want.len(), spec.vocab], "({tp},{cp}) step {i}");
                for (r, w) in want.iter().enumerate() {
                    let e = rel_err(logits.row(r), w.data());
                    assert!(e < 1e-4, "({tp},{cp}) step {i} row {r}: logits off by {e}");
                    let best = |x: &[f32]| {
                        reference
                            .backend()
                            .argmax_rows(&Tensor::from_vec(&[1, x.len()], x.to_vec()).unwrap())
                            .unwrap()[0]
                    };
                    assert_eq!(best(logits.row(r)), best(w.data()), "({tp},{cp}) step {i} row {r}");
                }
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// Greedy batched steps find the argmax of each sampled row without moving the logits: the
/// ids equal the serial argmax of the rows `forward_batch` gives in the same layout, on the
/// rank at TP 0 and CP 0 only, in every layout (a TP split of the vocabulary included).
#[test]
fn batched_argmax_picks_what_the_gathered_logits_pick_in_every_layout() {
    let spec = batched_spec(47);
    let path = write_model(&spec, "batched-argmax.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let model = f32_model_on(&path, p);
            let logits = run_steps(&model, comms, &steps, &mut five_caches(&model));
            let ids = run_steps_with(comms, &steps, &mut five_caches(&model), |comms, seqs| {
                model.forward_batch_argmax(comms, seqs).unwrap()
            });
            (p, logits, ids)
        });
        for (p, logits, ids) in got {
            if (p.tp_rank, p.cp_rank) != (0, 0) {
                assert!(ids.iter().all(Option::is_none), "({tp},{cp}) {p:?} got ids");
                continue;
            }
            for (i, (logits, ids)) in logits.iter().zip(&ids).enumerate() {
                let (logits, ids) = (logits.as_ref().unwrap(), ids.as_ref().unwrap());
                let want: Vec<u32> = (0..logits.rows()).map(|r| argmax(logits.row(r))).collect();
                assert_eq!(ids, &want, "({tp},{cp}) step {i}");
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// Edits (penalties, a bias) applied where the logits are: greedy ids and top-k candidates are
/// those of the rows `forward_batch` gives in the same layout with the edits applied on the
/// host, bit for bit, in every layout (each TP rank edits its share of the vocabulary; edits
/// in every shard, and a soft-capped model, whose logits are capped before they are edited).
#[test]
fn edits_where_the_logits_are_pick_what_the_edited_gathered_logits_pick_in_every_layout() {
    use tensor::kernels::EditKind;
    for gemma in [false, true] {
        let spec = RandomLlama {
            gemma2: gemma.then(crate::model::random::Gemma2::default),
            ..batched_spec(61)
        };
        let path = write_model(&spec, "batched-edits.gguf");
        let steps = mixed_steps(spec.vocab as u32);
        let kinds = [EditKind::Repetition, EditKind::Subtract, EditKind::Add];
        // Per sequence, edits that move its best tokens: every shard of a 3-way split is hit.
        let edits: Vec<Vec<LogitEdit>> = (0..5u32)
            .map(|s| {
                (0..12u32)
                    .map(|i| LogitEdit {
                        token: (s * 11 + i * 7) % 40,
                        kind: kinds[(i % 3) as usize],
                        value: [1.7, 3.0, 4.0][(i % 3) as usize] + 0.1 * s as f32,
                    })
                    .collect()
            })
            .collect();
        for (tp, cp) in [(1, 1), (2, 1), (1, 2), (3, 1)] {
            let got = on_mesh(tp, cp, |p, comms| {
                let model = f32_model_on(&path, p);
                let logits = run_steps(&model, comms, &steps, &mut five_caches(&model));
                let mut caches = five_caches(&model);
                let ids = run_steps_edited(comms, &steps, &mut caches, &edits, |comms, seqs| {
                    model.forward_batch_argmax(comms, seqs).unwrap()
                });
                let mut caches = five_caches(&model);
                let tops = run_steps_edited(comms, &steps, &mut caches, &edits, |comms, seqs| {
                    model.forward_batch_top_k(comms, seqs, 5).unwrap()
                });
                (p, logits, ids, tops)
            });
            let cpu = Backend::cpu(1).unwrap();
            let mut changed = false;
            for (p, logits, ids, tops) in got {
                if (p.tp_rank, p.cp_rank) != (0, 0) {
                    continue;
                }
                for (i, step) in steps.iter().enumerate() {
                    let logits = logits[i].as_ref().unwrap();
                    let sampled: Vec<usize> = step.iter().filter(|e| e.2).map(|e| e.0).collect();
                    let mut edited = logits.clone();
                    let rows = LogitEdits::from_rows(sampled.iter().map(|&s| &edits[s][..]));
                    cpu.edit_rows(&mut edited, &rows, 0).unwrap();
                    let want: Vec<u32> =
                        (0..edited.rows()).map(|r| argmax(edited.row(r))).collect();
                    let what = format!("({tp},{cp}) gemma {gemma} step {i}");
                    assert_eq!(ids[i].as_ref().unwrap(), &want, "{what}");
                    let plain: Vec<u32> =
                        (0..logits.rows()).map(|r| argmax(logits.row(r))).collect();
                    changed |= plain != want;
                    let top = tops[i].as_ref().unwrap();
                    let want = cpu.top_k_rows(&edited, 5).unwrap();
                    for r in 0..edited.rows() {
                        let (got, want): (Vec<_>, Vec<_>) =
                            (top.row(r).collect(), want.row(r).collect());
                        assert_eq!(got, want, "{what} row {r}");
                    }
                }
            }
            assert!(changed, "({tp},{cp}) gemma {gemma}: the edits change no pick");
        }
        std::fs::remove_file(path).unwrap();
    }
}

/// Steps scored where the logits are (samplers that want log-probabilities) find, of the rows
/// `forward_batch` gives in the same layout, bit for bit: each row's normalizer and most
/// likely tokens before the edits, the candidates and draws after them, and keep the logits
/// before the edits for the picked tokens' own, which `logits_at` reads; on the rank at TP 0
/// and CP 0 only, in every layout, with edits in every shard.
#[test]
fn scored_steps_find_what_the_gathered_logits_give_before_and_after_the_edits() {
    use tensor::kernels::{draw_columns, row_numbers, Draw, EditKind};
    let spec = batched_spec(67);
    let path = write_model(&spec, "batched-scored.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    let edits: Vec<Vec<LogitEdit>> = (0..5u32)
        .map(|s| {
            (0..9u32)
                .map(|i| LogitEdit {
                    token: (s * 13 + i * 5) % 40,
                    kind: [EditKind::Repetition, EditKind::Subtract, EditKind::Add]
                        [(i % 3) as usize],
                    value: [1.5, 2.5, 6.0][(i % 3) as usize],
                })
                .collect()
        })
        .collect();
    let draw = |step: usize, row: usize| Draw {
        temperature: [0.0, 0.6, 1.3][(step + row) % 3],
        min_p: 0.0,
        u: ((step * 5 + row) as f64 * 0.618_033_988_75).fract(),
        top_p: [1.0, 0.8][row % 2],
    };
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (3, 1)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let model = f32_model_on(&path, p);
            let logits = run_steps(&model, comms, &steps, &mut five_caches(&model));
            let mut caches = five_caches(&model);
            let mut step = 0;
            let scored = run_steps_edited(comms, &steps, &mut caches, &edits, |comms, seqs| {
                let rows = seqs.iter().filter(|s| s.sample).count();
                let draws: Vec<Draw> = (0..rows).map(|r| draw(step, r)).collect();
                step += 1;
                let scored = model.forward_batch_scored(comms, seqs, Some(4), &draws, 3).unwrap();
                scored.map(|s| {
                    let own = model.logits_at(&s.logits, &s.drawn).unwrap();
                    (s, own)
                })
            });
            (p, logits, scored)
        });
        let cpu = Backend::cpu(1).unwrap();
        let mut changed = false;
        for (p, logits, scored) in got {
            if (p.tp_rank, p.cp_rank) != (0, 0) {
                assert!(scored.iter().all(Option::is_none), "({tp},{cp}) {p:?} scored");
                continue;
            }
            for (i, step) in steps.iter().enumerate() {
                let what = format!("({tp},{cp}) step {i}");
                let logits = logits[i].as_ref().unwrap();
                let (s, own) = scored[i].as_ref().unwrap();
                let sampled: Vec<usize> = step.iter().filter(|e| e.2).map(|e| e.0).collect();
                let mut edited = logits.clone();
                let rows = LogitEdits::from_rows(sampled.iter().map(|&s| &edits[s][..]));
                cpu.edit_rows(&mut edited, &rows, 0).unwrap();
                assert_eq!(s.normalizers, cpu.normalizers(logits).unwrap(), "{what}");
                assert_eq!(s.best, cpu.top_k_rows(logits, 3).unwrap(), "{what}");
                assert_eq!(s.top.as_ref(), Some(&cpu.top_k_rows(&edited, 4).unwrap()), "{what}");
                let drawn: Vec<u32> = (0..edited.rows())
                    .map(|r| {
                        let pairs: Vec<(f32, u32)> = row_numbers(edited.row(r)).collect();
                        draw_columns(&pairs, &draw(i, r))
                    })
                    .collect();
                assert_eq!(s.drawn, drawn, "{what}");
                assert_eq!(s.logits.host().unwrap(), logits.host().unwrap(), "{what}");
                let want: Vec<f32> =
                    drawn.iter().enumerate().map(|(r, &t)| logits.row(r)[t as usize]).collect();
                assert_eq!(own, &want, "{what}: the picked tokens' logits before the edits");
                changed |= (0..edited.rows()).any(|r| edited.row(r)[drawn[r] as usize] != want[r]);
            }
        }
        assert!(changed, "({tp},{cp}): no picked token's logit was edited");
    }
    std::fs::remove_file(path).unwrap();
}

/// Batched steps for samplers that keep the k most likely tokens find them without moving the
/// logits: the candidates (logits and ids, in order) are those of the rows `forward_batch`
/// gives in the same layout, bit for bit, on the rank at TP 0 and CP 0 only, in every layout
/// (a TP split of the vocabulary into uneven shards included), for k from 1 to past the
/// vocabulary.
#[test]
fn batched_top_k_finds_the_gathered_logits_candidates_in_every_layout() {
    let spec = batched_spec(53);
    let path = write_model(&spec, "batched-top-k.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let model = f32_model_on(&path, p);
            let logits = run_steps(&model, comms, &steps, &mut five_caches(&model));
            let tops: Vec<_> = [1, 3, 40, 50]
                .into_iter()
                .map(|k| {
                    run_steps_with(comms, &steps, &mut five_caches(&model), |comms, seqs| {
                        model.forward_batch_top_k(comms, seqs, k).unwrap()
                    })
                })
                .collect();
            (p, logits, tops)
        });
        let cpu = Backend::cpu(1).unwrap();
        for (p, logits, tops) in got {
            if (p.tp_rank, p.cp_rank) != (0, 0) {
                assert!(tops.iter().flatten().all(Option::is_none), "({tp},{cp}) {p:?} got some");
                continue;
            }
            for (top, k) in tops.iter().zip([1, 3, 40, 50]) {
                for (i, (logits, top)) in logits.iter().zip(top).enumerate() {
                    let (logits, top) = (logits.as_ref().unwrap(), top.as_ref().unwrap());
                    let want = cpu.top_k_rows(logits, k).unwrap();
                    assert_eq!(top.per_row(), k.min(40), "({tp},{cp}) k {k} step {i}");
                    assert_eq!(top.rows(), logits.rows(), "({tp},{cp}) k {k} step {i}");
                    for r in 0..logits.rows() {
                        let (got, want): (Vec<_>, Vec<_>) =
                            (top.row(r).collect(), want.row(r).collect());
                        assert_eq!(got, want, "({tp},{cp}) k {k} step {i} row {r}");
                    }
                }
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// Batched steps drawn where the logits are give, row for row, the tokens
/// `draw_columns` draws from the rows `forward_batch` gives in the same layout, on the rank at
/// TP 0 and CP 0 only, in every layout.
#[test]
fn batched_draws_pick_what_the_gathered_logits_give_in_every_layout() {
    use tensor::kernels::{draw_columns, row_numbers, Draw};
    let spec = batched_spec(59);
    let path = write_model(&spec, "batched-draws.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    // Per step, a draw for each row it samples (the rows of `forward_batch`).
    let draw = |step: usize, row: usize| Draw {
        temperature: [0.0, 0.5, 1.0, 2.0][(step + row) % 4],
        min_p: [0.0, 0.1][row % 2],
        u: ((step * 7 + row) as f64 * 0.618_033_988_75).fract(),
        top_p: [1.0, 0.7][step % 2],
    };
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let model = f32_model_on(&path, p);
            let logits = run_steps(&model, comms, &steps, &mut five_caches(&model));
            let mut step = 0;
            let ids = run_steps_with(comms, &steps, &mut five_caches(&model), |comms, seqs| {
                let rows = seqs.iter().filter(|s| s.sample).count();
                let draws: Vec<Draw> = (0..rows).map(|r| draw(step, r)).collect();
                step += 1;
                model.forward_batch_sample(comms, seqs, &draws).unwrap()
            });
            // Candidates and draws of the same rows in one step (a step of mixed samplers).
            let mut step = 0;
            let both = run_steps_with(comms, &steps, &mut five_caches(&model), |comms, seqs| {
                let rows = seqs.iter().filter(|s| s.sample).count();
                let draws: Vec<Draw> = (0..rows).map(|r| draw(step, r)).collect();
                step += 1;
                model.forward_batch_top_k_and_sample(comms, seqs, 5, &draws).unwrap()
            });
            (p, logits, ids, both)
        });
        for (p, logits, ids, both) in got {
            if (p.tp_rank, p.cp_rank) != (0, 0) {
                assert!(ids.iter().all(Option::is_none), "({tp},{cp}) {p:?} got ids");
                assert!(both.iter().all(Option::is_none), "({tp},{cp}) {p:?} got candidates");
                continue;
            }
            for (i, ((logits, ids), both)) in logits.iter().zip(&ids).zip(&both).enumerate() {
                let (logits, ids) = (logits.as_ref().unwrap(), ids.as_ref().unwrap());
                let (top, drawn) = both.as_ref().unwrap();
                assert_eq!(drawn, ids, "({tp},{cp}) step {i}: mixed draws");
                let want_top = Backend::cpu(1).unwrap().top_k_rows(logits, 5).unwrap();
                assert_eq!(top, &want_top, "({tp},{cp}) step {i}: mixed candidates");
                let want: Vec<u32> = (0..logits.rows())
                    .map(|r| {
                        let pairs: Vec<(f32, u32)> = row_numbers(logits.row(r)).collect();
                        draw_columns(&pairs, &draw(i, r))
                    })
                    .collect();
                assert_eq!(ids, &want, "({tp},{cp}) step {i}");
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// A small Llama with Qwen2's attention biases and an untied head.
fn biased_untied_spec(seed: u64) -> RandomLlama {
    RandomLlama { attn_bias: true, untied_head: true, ..batched_spec(seed) }
}

/// The shard at `p` of the model file at `path`, in f32, on `be`.
fn load_f32_on(path: &std::path::Path, p: Placement, be: Backend) -> ParallelModel {
    let file = GgufFile::open(path).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let opts = LoadOptions::new(p).on(be).form(WeightForm::F32);
    ParallelModel::from_source(&file, config, opts).unwrap()
}

/// A step reads device outputs on the host only through explicit copies ([`Tensor::host`],
/// which can fail), never behind an infallible call: on a backend whose every output is
/// device data (any other read panics), single forward passes (all rows, last row),
/// generation, batched steps and batched greedy picks give the host backend's values bit for
/// bit in every layout, with Qwen2's biases and an untied head.
#[test]
fn steps_read_device_outputs_only_through_explicit_copies() {
    let spec = biased_untied_spec(49);
    let path = write_model(&spec, "device-outputs.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    let prompt: Vec<u32> = vec![3, 17, 5, 38, 0, 22, 9];
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let mut run = |be: Backend| {
                let model = load_f32_on(&path, p, be);
                let host = |t: Tensor| t.into_host_vec().unwrap();
                let mut cache = model.new_cache(64);
                let all = model.forward(comms, &prompt, &mut cache, Logits::All).unwrap();
                let last = model.forward(comms, &[4], &mut cache, Logits::Last).unwrap();
                let mut cache = model.new_cache(64);
                let generated = model.generate(comms, &prompt, 6, &[], &mut cache, |_| {});
                let mut caches: Vec<ParallelCache> = (0..5).map(|_| model.new_cache(64)).collect();
                let logits: Vec<Option<Vec<f32>>> = run_steps(&model, comms, &steps, &mut caches)
                    .into_iter()
                    .map(|l| l.map(host))
                    .collect();
                let mut caches: Vec<ParallelCache> = (0..5).map(|_| model.new_cache(64)).collect();
                let ids = run_steps_with(comms, &steps, &mut caches, |comms, seqs| {
                    model.forward_batch_argmax(comms, seqs).unwrap()
                });
                (host(all), host(last), generated.unwrap(), logits, ids)
            };
            let on_host = run(Backend::cpu(1).unwrap());
            let on_device = run(tensor::test_util::cpu_with_device_outputs(1));
            (p, on_host, on_device)
        });
        for (p, on_host, on_device) in got {
            assert!(on_device == on_host, "({tp},{cp}) {p:?}: device outputs changed a result");
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// The index of the largest value, the lowest on ties (the engine's serial argmax).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Sequences whose every row is wanted (prompt log-probabilities) get the logits of each of
/// their tokens, next to sequences sampled at their last token only, in every layout: a
/// prefill split over CP (gathered), an extend chunk, a one-token entry and a decode, each
/// equal to the single-rank model's logits of all its tokens.
#[test]
fn every_row_gives_the_logits_of_every_token_in_every_layout() {
    let spec = batched_spec(43);
    let path = write_model(&spec, "every-row.gguf");
    let ids = |from: u32, n: u32| (from..from + n).map(|t| t % spec.vocab as u32).collect();
    // (sequence, tokens, sample, every row)
    type Step = Vec<(usize, Vec<u32>, bool, bool)>;
    let steps: Vec<Step> = vec![
        vec![(0, ids(3, 7), false, true), (1, ids(11, 5), true, false), (2, ids(5, 1), true, true)],
        vec![(0, ids(20, 3), true, true), (1, ids(2, 1), true, false), (3, ids(30, 6), true, true)],
        vec![(0, ids(9, 1), true, true), (3, ids(1, 1), false, false), (2, ids(8, 2), true, false)],
    ];
    let reference = Model::load_with(&path, 1, WeightForm::F32).unwrap();
    let mut caches: Vec<KvCache> = (0..4).map(|_| reference.new_cache(64)).collect();
    let want: Vec<Vec<Vec<f32>>> = steps
        .iter()
        .map(|step| {
            let mut rows = Vec::new();
            for (seq, tokens, sample, every) in step {
                let cache = &mut caches[*seq];
                let positions: Vec<usize> = (cache.len()..cache.len() + tokens.len()).collect();
                let all = reference.forward(tokens, &positions, cache, Logits::All).unwrap();
                let from = if *every {
                    0
                } else if *sample {
                    tokens.len() - 1
                } else {
                    tokens.len()
                };
                rows.extend((from..tokens.len()).map(|r| all.row(r).to_vec()));
            }
            rows
        })
        .collect();
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let model =
                ParallelModel::load(&path, LoadOptions::new(p).form(WeightForm::F32)).unwrap();
            let mut caches: Vec<ParallelCache> = (0..4).map(|_| model.new_cache(64)).collect();
            let mut out = Vec::new();
            for step in &steps {
                let mut by_seq: Vec<Option<&mut ParallelCache>> =
                    caches.iter_mut().map(Some).collect();
                let mut seqs: Vec<Sequence<'_>> = step
                    .iter()
                    .map(|(seq, tokens, sample, every)| Sequence {
                        tokens,
                        cache: by_seq[*seq].take().unwrap(),
                        sample: *sample,
                        every_row: *every,
                        edits: &[],
                    })
                    .collect();
                out.push(model.forward_batch(comms, &mut seqs).unwrap());
            }
            (p, out)
        });
        for (p, out) in got {
            if (p.tp_rank, p.cp_rank) != (0, 0) {
                assert!(out.iter().all(Option::is_none), "({tp},{cp}) {p:?} got logits");
                continue;
            }
            for (i, (logits, want)) in out.iter().zip(&want).enumerate() {
                let logits = logits.as_ref().expect("rank 0 gets the logits");
                assert_eq!(logits.shape(), [want.len(), spec.vocab], "({tp},{cp}) step {i}");
                for (r, w) in want.iter().enumerate() {
                    let e = rel_err(logits.row(r), w);
                    assert!(e < 1e-4, "({tp},{cp}) step {i} row {r}: logits off by {e}");
                }
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// The mixed steps of [`mixed_steps`] give the same logits, bit for bit, with every
/// sequence's keys and values in scattered 4-token blocks of one shared pool as in buffers of
/// its own, in every layout; and a sequence that takes another's first block as its cached
/// prefix continues exactly as one that computed it.
#[test]
fn paged_caches_give_the_logits_of_own_buffers() {
    let spec = batched_spec(43);
    let path = write_model(&spec, "paged.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let file = GgufFile::open(&path).unwrap();
            let config = LlamaConfig::from_gguf(&file).unwrap();
            let cpu = Backend::cpu(1).unwrap();
            let model = ParallelModel::from_source(
                &file,
                config,
                LoadOptions::new(p).on(cpu).form(WeightForm::F32),
            )
            .unwrap();
            let pool = Arc::new(model.new_pool(4, 90).unwrap());
            let mut own: Vec<ParallelCache> = (0..5).map(|_| model.new_cache(64)).collect();
            let mut paged: Vec<ParallelCache> = (0..5u32)
                .map(|s| {
                    let mut c = model.new_paged_cache(&pool).unwrap();
                    let table: Vec<u32> = (0..16).map(|b| (s * 16 + b) * 7 % 80).collect();
                    c.extend_table(&table).unwrap();
                    c
                })
                .collect();
            let want = run_steps(&model, comms, &steps, &mut own);
            let got = run_steps(&model, comms, &steps, &mut paged);
            (p, want, got)
        });
        for (p, want, got) in got {
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                let (w, g) = (w.as_ref().map(Tensor::data), g.as_ref().map(Tensor::data));
                assert_eq!(w, g, "({tp},{cp}) {p:?} step {i}");
            }
        }
    }
    // Prefix reuse on one rank: B's first block is A's.
    let model =
        ParallelModel::load(&path, LoadOptions::new(Placement::single()).form(WeightForm::F32))
            .unwrap();
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let pool = Arc::new(model.new_pool(4, 8).unwrap());
    let (a_tokens, b_tokens) = ([3, 9, 4, 1, 7, 7], [3, 9, 4, 1, 2, 5, 8]);
    let mut a = model.new_paged_cache(&pool).unwrap();
    a.extend_table(&[5, 2]).unwrap();
    model.forward_batch(&mut comms, &mut [Sequence::sampled(&a_tokens, &mut a)]).unwrap();
    let mut fresh = model.new_paged_cache(&pool).unwrap();
    fresh.extend_table(&[0, 1]).unwrap();
    let want =
        model.forward_batch(&mut comms, &mut [Sequence::sampled(&b_tokens, &mut fresh)]).unwrap();
    let mut reused = model.new_paged_cache(&pool).unwrap();
    reused.extend_table(&[5, 3]).unwrap();
    reused.assume_prefix(4).unwrap();
    let got = model
        .forward_batch(&mut comms, &mut [Sequence::sampled(&b_tokens[4..], &mut reused)])
        .unwrap();
    assert_eq!(reused.len(), b_tokens.len());
    let e = rel_err(got.unwrap().data(), want.unwrap().data());
    assert!(e < 1e-5, "the reused prefix changed the logits by {e}");
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_batch_with_no_room_for_one_sequence_is_refused_before_it_runs() {
    let spec = RandomLlama { layers: 1, seed: 5, ..RandomLlama::default() };
    let path = write_model(&spec, "batched-full.gguf");
    let model =
        ParallelModel::load(&path, LoadOptions::new(Placement::single()).form(WeightForm::F32))
            .unwrap();
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let (mut roomy, mut small) = (model.new_cache(16), model.new_cache(2));
    let mut seqs = [
        Sequence { tokens: &[1, 2], cache: &mut roomy, sample: true, every_row: false, edits: &[] },
        Sequence {
            tokens: &[3, 4, 5],
            cache: &mut small,
            sample: true,
            every_row: false,
            edits: &[],
        },
    ];
    let err = model.forward_batch(&mut comms, &mut seqs).unwrap_err();
    assert!(matches!(err, Error::CacheFull { capacity: 2, requested: 3, .. }), "{err}");
    assert!(roomy.is_empty() && small.is_empty(), "a refused step changed a cache");
    assert!(model.check_room(&roomy, 16).is_ok() && model.check_room(&roomy, 17).is_err());
    std::fs::remove_file(path).unwrap();
}

/// One prompt's greedy continuation and, per token, the top-2 margin of the logits it was
/// picked from.
type Greedy = (Vec<u32>, Vec<f32>);

/// The largest value's index and its lead over the second largest.
fn argmax_margin(row: &[f32]) -> (u32, f32) {
    let (mut best, mut first, mut second) = (0, f32::NEG_INFINITY, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > first {
            (best, second, first) = (i, first, v);
        } else if v > second {
            second = v;
        }
    }
    (best as u32, first - second)
}

/// Greedy generation of `n` tokens for every prompt on a `tp × cp` mesh with batched steps:
/// the prompts run `group` at a time (one forward pass per step for the group); with
/// `recompute_at`, every sequence's cache is dropped after that many tokens and recomputed
/// from its tokens in one chunk (as a discarding sleep does). Rank 0 picks the tokens and
/// sends them to every rank.
fn greedy_batched(
    path: &std::path::Path,
    form: WeightForm,
    (tp, cp): (usize, usize),
    prompts: &[Vec<u32>],
    n: usize,
    group: usize,
    recompute_at: Option<usize>,
) -> Vec<Greedy> {
    let ranks = on_mesh(tp, cp, |p, comms| {
        let model = ParallelModel::load(path, LoadOptions::new(p).form(form)).unwrap();
        let mut out: Vec<Greedy> = Vec::new();
        for prompts in prompts.chunks(group) {
            let capacity = prompts.iter().map(Vec::len).max().unwrap_or(0) + n + 1;
            let mut caches: Vec<ParallelCache> =
                prompts.iter().map(|_| model.new_cache(capacity)).collect();
            let mut done: Vec<Greedy> = prompts.iter().map(|_| (Vec::new(), Vec::new())).collect();
            for step in 0..n {
                if recompute_at == Some(step) {
                    caches.iter_mut().for_each(ParallelCache::clear);
                    let contexts: Vec<Vec<u32>> = prompts
                        .iter()
                        .zip(&done)
                        .map(|(p, (ids, _))| [&p[..], &ids[..ids.len() - 1]].concat())
                        .collect();
                    let mut seqs: Vec<Sequence<'_>> = contexts
                        .iter()
                        .zip(caches.iter_mut())
                        .map(|(tokens, cache)| Sequence {
                            tokens,
                            cache,
                            sample: false,
                            every_row: false,
                            edits: &[],
                        })
                        .collect();
                    model.forward_batch(comms, &mut seqs).unwrap();
                }
                let fed: Vec<Vec<u32>> = if step == 0 {
                    prompts.to_vec()
                } else {
                    done.iter().map(|(ids, _)| vec![ids[ids.len() - 1]]).collect()
                };
                let mut seqs: Vec<Sequence<'_>> = fed
                    .iter()
                    .zip(caches.iter_mut())
                    .map(|(tokens, cache)| Sequence::sampled(tokens, cache))
                    .collect();
                let logits = model.forward_batch(comms, &mut seqs).unwrap();
                // Rank 0's picks, sent down its CP column, then along every TP row.
                let mut picks = vec![0i64; prompts.len()];
                if let Some(logits) = &logits {
                    for (i, (ids, margins)) in done.iter_mut().enumerate() {
                        let (id, margin) = argmax_margin(logits.row(i));
                        picks[i] = i64::from(id);
                        margins.push(margin);
                        ids.push(id);
                    }
                }
                if p.tp_rank == 0 {
                    comms.cp.broadcast(&mut picks, 0).unwrap();
                }
                comms.tp.broadcast(&mut picks, 0).unwrap();
                if logits.is_none() {
                    done.iter_mut().zip(&picks).for_each(|((ids, _), &t)| ids.push(t as u32));
                }
            }
            out.extend(done);
        }
        out
    });
    // Every rank generated the same ids; rank 0 also has the margins.
    assert!(ranks.iter().all(|r| r.iter().zip(&ranks[0]).all(|(a, b)| a.0 == b.0)));
    ranks.into_iter().next().unwrap()
}

/// Compares `got` with `want` prompt by prompt: returns how many match, and for each that
/// does not, the first differing token and the reference's top-2 margin there.
fn agreement(want: &[Greedy], got: &[Greedy]) -> (usize, Vec<(usize, usize, f32)>) {
    let mut differ = Vec::new();
    for (p, ((a, margins), (b, _))) in want.iter().zip(got).enumerate() {
        if let Some(at) = a.iter().zip(b).position(|(x, y)| x != y) {
            differ.push((p, at, margins[at]));
        }
    }
    (want.len() - differ.len(), differ)
}

/// The largest top-2 margin at which two f32 summation orders may pick different tokens.
const TIE: f32 = 1e-3;

#[test]
fn real_model_greedy_ids_agree_across_layouts_batches_and_recompute_when_cached() {
    let Some(path) = checkpoint::cache::default_model_path() else {
        eprintln!("note: default model not cached (run `cargo xtask fetch-model`); skipping");
        return;
    };
    let tokenizer = text::Tokenizer::load(&path).unwrap();
    let texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, a dragon",
        "The three primary colors are",
        "To make a cup of tea, first",
        "In 1969, astronauts",
        "The quick brown fox",
        "Photosynthesis is the process by which",
        "import numpy as np\n",
        "My favourite season is autumn because",
        "The square root of 144 is",
        "Dear hiring manager,",
        "The largest ocean on Earth is",
        "SELECT name FROM users WHERE",
        "A haiku about the sea:",
        "Water boils at",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tokenizer.encode(t).unwrap()).collect();
    let n = 64;
    // Quantized weights as stored (f32 products of the dequantized values), then f32 weights.
    for (form, runs) in [
        (WeightForm::Native, &[(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)][..]),
        (WeightForm::F32, &[(1, 1), (2, 2)][..]),
    ] {
        let reference = greedy_batched(&path, form, (1, 1), &prompts, n, 16, None);
        let mut cases: Vec<(String, Vec<Greedy>)> = Vec::new();
        let alone = greedy_batched(&path, form, (1, 1), &prompts[..8], n, 1, None);
        cases.push(("(1,1) alone vs in a batch".into(), alone));
        if form == WeightForm::Native {
            let batch8 = greedy_batched(&path, form, (1, 1), &prompts, n, 8, None);
            cases.push(("(1,1) in batches of 8".into(), batch8));
        }
        let recomputed = greedy_batched(&path, form, (1, 1), &prompts, n, 16, Some(n / 2));
        cases.push(("(1,1) cache recomputed halfway".into(), recomputed));
        let text = tokenizer.decode(&reference[0].0, true).unwrap();
        assert!(text.contains("Paris"), "{form:?}: {text:?}");
        for &layout in &runs[1..] {
            let got = greedy_batched(&path, form, layout, &prompts, n, 16, None);
            cases.push((format!("{layout:?}"), got));
        }
        for (name, got) in &cases {
            let (same, differ) = agreement(&reference[..got.len()], got);
            eprintln!(
                "{form:?} {name}: {same}/{} prompts x {n} tokens identical{}",
                got.len(),
                if differ.is_empty() { String::new() } else { format!("; differ at {differ:?}") }
            );
            for (p, at, margin) in differ {
                assert!(
                    margin < TIE,
                    "{form:?} {name}: prompt {:?} differs at token {at} where the top-2 margin \
                     is {margin} (more than a summation-order tie of {TIE})",
                    texts[p]
                );
            }
        }
    }
}

/// A heap arena that records every allocation: its size and the address it starts at.
#[derive(Default)]
struct CountingArena {
    allocs: std::sync::Mutex<Vec<(usize, usize)>>,
}

impl CountingArena {
    fn allocs(&self) -> Vec<(usize, usize)> {
        self.allocs.lock().unwrap().clone()
    }
}

impl Arena for CountingArena {
    fn alloc(&self, bytes: usize) -> tensor::Result<Box<dyn tensor::ExternalMemory>> {
        let mem = tensor::HeapArena.alloc(bytes)?;
        self.allocs.lock().unwrap().push((bytes, mem.bytes().as_ptr() as usize));
        Ok(mem)
    }
}

/// An arena that fails from its `fail_at`-th allocation on.
struct FailingArena {
    fail_at: usize,
    count: std::sync::atomic::AtomicUsize,
}

impl Arena for FailingArena {
    fn alloc(&self, bytes: usize) -> tensor::Result<Box<dyn tensor::ExternalMemory>> {
        let n = self.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n >= self.fail_at {
            return Err(tensor::Error::Arena { bytes, source: "the test arena is full".into() });
        }
        tensor::HeapArena.alloc(bytes)
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.data().iter().map(|x| x.to_bits()).collect()
}

/// Prefill (all rows) and `steps` greedy decode steps of `a` and `b` in lockstep, asserting
/// bit-identical logits; the tokens are `a`'s choices.
fn assert_same_logits(
    comms: &mut Comms<'_>,
    (a, a_cache): (&ParallelModel, &mut ParallelCache),
    (b, b_cache): (&ParallelModel, &mut ParallelCache),
    steps: usize,
    what: &str,
) {
    let vocab = a.config().vocab_size as u32;
    let mut tokens: Vec<u32> = [3u32, 17, 5, 38, 0, 22, 9].iter().map(|t| t % vocab).collect();
    for step in 0..=steps {
        let la = a.forward(comms, &tokens, a_cache, Logits::All).unwrap();
        let lb = b.forward(comms, &tokens, b_cache, Logits::All).unwrap();
        assert_eq!(bits(&la), bits(&lb), "{what}: step {step}");
        let last = Tensor::from_vec(&[1, la.row_len()], la.row(la.rows() - 1).to_vec()).unwrap();
        tokens = vec![a.backend.argmax_rows(&last).unwrap()[0] as u32];
    }
}

#[test]
fn weights_and_caches_in_arena_memory_give_bit_identical_logits() {
    let base = RandomLlama { seed: 46, ..RandomLlama::default() };
    let specs = [
        ("f32-tied", RandomLlama { ..base.clone() }),
        ("f32-untied-bias", RandomLlama { untied_head: true, attn_bias: true, ..base.clone() }),
        ("q8-tied", RandomLlama { quantized: Some(BlockFormat::Q8_0), ..base.clone() }),
        (
            "q8-untied",
            RandomLlama { quantized: Some(BlockFormat::Q8_0), untied_head: true, ..base.clone() },
        ),
    ];
    for (name, spec) in specs {
        let path = write_model(&spec, &format!("arena-{name}.gguf"));
        for (tp, cp) in [(1, 1), (2, 2)] {
            let what = format!("{name} ({tp},{cp})");
            on_mesh(tp, cp, |p, comms| {
                let what = format!("{what} rank {}/{}", p.tp_rank, p.cp_rank);
                let heap = ParallelModel::load(&path, LoadOptions::new(p).form(WeightForm::Native))
                    .unwrap();
                let mut moved = heap.clone();
                let arena = CountingArena::default();
                moved.move_weights_to(&arena).unwrap();

                // One allocation per listed buffer, of its exact size, in the listed order,
                // and the moved model's buffers are those allocations, holding the same bytes.
                let want = heap.weight_buffers();
                let allocs = arena.allocs();
                let sizes: Vec<usize> = want.iter().map(|b| b.len()).collect();
                assert_eq!(allocs.iter().map(|a| a.0).collect::<Vec<_>>(), sizes, "{what}");
                let got = moved.weight_buffers();
                let at: Vec<usize> = got.iter().map(|b| b.as_ptr() as usize).collect();
                assert_eq!(allocs.iter().map(|a| a.1).collect::<Vec<_>>(), at, "{what}");
                assert_eq!(got, want, "{what}: moved bytes differ");
                let padded: usize = sizes.iter().map(|s| s.div_ceil(64) * 64).sum();
                assert_eq!(moved.weight_bytes(), padded, "{what}");
                assert_eq!(heap.weight_bytes(), padded, "{what}");

                // Every matrix is one buffer (f32) or two (Q8_0 scales and quants); a tied
                // head shares the embedding's buffers, which are listed once.
                let m = if spec.quantized.is_some() { 2 } else { 1 };
                let bias = usize::from(spec.attn_bias);
                let head = if spec.untied_head { m } else { 0 };
                let per_layer = 2 + 4 * m + bias;
                assert_eq!(allocs.len(), m + spec.layers * per_layer + 1 + head, "{what}");
                assert_eq!(moved.lm_head.is_tied_to(&moved.embed), !spec.untied_head, "{what}");
                let shared = std::ptr::eq(moved.lm_head.weight(), moved.embed.table());
                assert_eq!(shared, !spec.untied_head, "{what}");

                // The cache: keys then values of each layer, each its exact size.
                let cache_arena = CountingArena::default();
                let mut cache_in = moved.new_cache_in(64, &cache_arena).unwrap();
                let kv = kv_head_range(heap.config(), p.tp_rank, p.tp).unwrap().len();
                let buffer = 64 * kv * heap.config().head_dim * 4;
                let cache_allocs = cache_arena.allocs();
                assert_eq!(cache_allocs.len(), 2 * spec.layers, "{what}");
                assert!(cache_allocs.iter().all(|a| a.0 == buffer), "{what}");
                let padded = |b: usize| 2 * spec.layers * b.div_ceil(64) * 64;
                assert_eq!(moved.cache_bytes(64, KvElem::F32), padded(buffer));
                assert_eq!(moved.cache_bytes(64, KvElem::Bf16), padded(buffer / 2));
                assert_eq!(cache_in.capacity(), 64, "{what}");

                let mut cache = heap.new_cache(64);
                assert_same_logits(comms, (&heap, &mut cache), (&moved, &mut cache_in), 6, &what);
                assert_eq!(cache.cp_lens(), cache_in.cp_lens(), "{what}");
                // Moving to the plain heap arena works the same way.
                let mut plain = heap.clone();
                plain.move_weights_to(&tensor::HeapArena).unwrap();
                assert_eq!(plain.weight_buffers(), want, "{what}");
                let (mut c1, mut c2) = (heap.new_cache(16), plain.new_cache(16));
                assert_same_logits(comms, (&heap, &mut c1), (&plain, &mut c2), 3, &what);
            });
        }
        std::fs::remove_file(path).unwrap();
    }
}

#[test]
fn a_failing_arena_is_an_error_and_leaves_a_working_model() {
    let spec =
        RandomLlama { seed: 47, quantized: Some(BlockFormat::Q8_0), ..RandomLlama::default() };
    let path = write_model(&spec, "arena-fail.gguf");
    on_mesh(1, 1, |p, comms| {
        let heap =
            ParallelModel::load(&path, LoadOptions::new(p).form(WeightForm::Native)).unwrap();
        let mut partly = heap.clone();
        let arena = FailingArena { fail_at: 5, count: Default::default() };
        let err = partly.move_weights_to(&arena).unwrap_err();
        assert!(err.to_string().starts_with("arena allocation of "), "{err}");
        assert!(err.to_string().ends_with(": the test arena is full"), "{err}");
        let err = heap.new_cache_in(8, &arena).unwrap_err();
        assert!(matches!(err, Error::Kernel(tensor::Error::Arena { .. })), "{err}");
        let (mut c1, mut c2) = (heap.new_cache(32), partly.new_cache(32));
        assert_same_logits(comms, (&heap, &mut c1), (&partly, &mut c2), 3, "partly moved");
    });
    std::fs::remove_file(path).unwrap();
}

/// Hands out device memory that is never dereferenced (the CPU backend must refuse it).
struct UnmappedArena;

impl tensor::memory::DeviceArena for UnmappedArena {
    fn alloc_device(&self, bytes: usize) -> tensor::Result<Box<dyn mesh::DeviceMemory>> {
        Ok(Box::new(FakeDeviceMemory(bytes)))
    }
}

/// A device KV cache is laid out like an arena one, and a model on the CPU backend refuses to
/// run on it with an error that says why, instead of touching device addresses.
#[test]
fn a_device_cache_on_the_cpu_backend_is_a_clear_error() {
    let path = temp_path("device-cache.gguf");
    RandomLlama::default().write(&path).unwrap();
    let model =
        ParallelModel::load(&path, LoadOptions::new(Placement::single()).form(WeightForm::F32))
            .unwrap();
    let mut cache = model.new_cache_on_device(16, KvElem::F32, &UnmappedArena).unwrap();
    assert_eq!(cache.capacity(), model.new_cache(16).capacity());
    let half = model.new_cache_on_device(16, KvElem::Bf16, &UnmappedArena).unwrap();
    assert_eq!(half.capacity(), 16);
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let err = model.forward(&mut comms, &[1, 2, 3], &mut cache, Logits::Last).unwrap_err();
    assert!(err.to_string().contains("device memory, which only the CUDA backend"), "{err}");
    std::fs::remove_file(path).unwrap();
}

/// A Phi-3 file (fused `attn_qkv` and gate/up `ffn_up`, rotate-half Q/K rows) of the same
/// weights as a llama file gives the llama file's logits bit for bit: on one rank with f32,
/// Q8_0 and Q4_1 matrices kept as stored, and sharded over TP and CP.
#[test]
fn phi3_fused_files_load_the_weights_of_their_llama_twins() {
    for quantized in [None, Some(BlockFormat::Q8_0), Some(BlockFormat::Q4_1)] {
        let spec = RandomLlama { quantized, seed: 23, ..RandomLlama::default() };
        let llama = write_model(&spec, "twin-llama.gguf");
        let phi3 = write_model(&RandomLlama { fused: true, ..spec.clone() }, "twin-phi3.gguf");
        assert!(GgufFile::open(&phi3).unwrap().has_fused_projections());
        let tokens = [3u32, 9, 4, 1, 7];
        let pos: Vec<usize> = (0..tokens.len()).collect();
        let logits = |path: &PathBuf| {
            let m = Model::load_with(path, 1, WeightForm::Native).unwrap();
            m.forward(&tokens, &pos, &mut m.new_cache(8), Logits::All).unwrap()
        };
        assert_eq!(logits(&phi3).data(), logits(&llama).data(), "{quantized:?}");
        if quantized.is_none() {
            for (tp, cp) in [(2, 1), (1, 2)] {
                let run = |path: &PathBuf| {
                    on_mesh(tp, cp, |p, comms| {
                        let model =
                            ParallelModel::load(path, LoadOptions::new(p).form(WeightForm::Native))
                                .unwrap();
                        let mut cache = model.new_cache(16);
                        model
                            .forward(comms, &tokens, &mut cache, Logits::Last)
                            .unwrap()
                            .data()
                            .to_vec()
                    })
                };
                assert_eq!(run(&phi3), run(&llama), "({tp},{cp})");
            }
        }
        std::fs::remove_file(llama).unwrap();
        std::fs::remove_file(phi3).unwrap();
    }
}

/// A shard takes another form of its weights (Q8_0 in place of f32, on every rank of a TP=2
/// mesh) and computes as a fresh load of that form does, bit for bit, with the caches it
/// had; weights of another model (a Q/K/V bias more) or of another shard are refused by
/// name, and the model keeps its own.
#[test]
fn a_shard_adopts_another_form_of_its_weights_and_refuses_other_weights() {
    let base = RandomLlama { seed: 47, untied_head: true, ..RandomLlama::default() };
    let f32_path = write_model(&base, "adopt-f32.gguf");
    let q8 = RandomLlama { quantized: Some(BlockFormat::Q8_0), ..base.clone() };
    let q8_path = write_model(&q8, "adopt-q8.gguf");
    let bias_path = write_model(&RandomLlama { attn_bias: true, ..base }, "adopt-bias.gguf");
    on_mesh(2, 1, |p, comms| {
        let load = |path: &PathBuf, p: Placement| {
            ParallelModel::load(path, LoadOptions::new(p).form(WeightForm::Native)).unwrap()
        };
        let mut model = load(&f32_path, p);
        let fresh = load(&q8_path, p);
        let before = model.weight_buffers().len();
        let err = model.adopt_weights(load(&bias_path, p)).unwrap_err().to_string();
        assert_eq!(
            err,
            "cannot take the new weights: layer 0 Q/K/V bias: the checkpoint has it; \
             the live model does not"
        );
        let other = Placement { tp_rank: 1 - p.tp_rank, ..p };
        let err = model.adopt_weights(load(&q8_path, other)).unwrap_err().to_string();
        assert!(err.contains("they are the shard of TP rank"), "{err}");
        assert_eq!(model.weight_buffers().len(), before, "refused weights change nothing");

        assert_eq!(model.weight_shapes(), fresh.weight_shapes());
        assert_ne!(model.weight_buffers().len(), fresh.weight_buffers().len());
        model.adopt_weights(load(&q8_path, p)).unwrap();
        assert_eq!(model.weight_buffers(), fresh.weight_buffers());
        let (mut a, mut b) = (model.new_cache(32), fresh.new_cache(32));
        let what = format!("rank {}", p.tp_rank);
        assert_same_logits(comms, (&model, &mut a), (&fresh, &mut b), 4, &what);
    });
    for path in [f32_path, q8_path, bias_path] {
        std::fs::remove_file(path).unwrap();
    }
}

/// A small Gemma 2: uneven heads, a window of 4 on its even layers, caps the random scores
/// and logits reach.
fn gemma2_spec(layers: usize, seed: u64) -> RandomLlama {
    RandomLlama {
        gemma2: Some(crate::model::random::Gemma2::default()),
        layers,
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 64,
        vocab: 40,
        seed,
        ..RandomLlama::default()
    }
}

/// Gemma 2 (attention and final soft-caps, a window of 4 on layers 0 and 2, post-norms): the
/// logits of a 7-token prompt and 16 greedy steps match the single-rank model in every layout
/// (so CP's key exchange and its extends, whose ranks may hold only keys outside a query's
/// window, mask as one rank does), and the greedy ids of its Hugging Face folder (norms as
/// `1 + w` under Gemma 2's names), loaded sharded, are the single-rank GGUF model's.
#[test]
fn gemma2_matches_the_single_rank_model_in_every_layout() {
    let spec = gemma2_spec(3, 71);
    let layouts = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (1, 3)];
    check_layouts(&spec, "gemma2-layouts.gguf", &layouts);

    let path = write_model(&spec, "gemma2-generate.gguf");
    let dir = temp_path("gemma2-generate-hf");
    spec.write_hf(&dir, true).unwrap();
    let reference = Model::load(&path, 1).unwrap();
    let c = reference.config();
    assert!(c.post_norms && c.sliding_window.is_some() && c.final_softcap == Some(1.5), "{c:?}");
    let prompt = [1u32, 2, 3, 4, 5, 6, 7, 8, 9];
    assert_greedy_in_layouts(&reference, &dir, &prompt);
    assert_greedy_in_layouts(&reference, &path, &prompt);
    std::fs::remove_file(path).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// The window at the model's level, in (1,1) (1,2) (2,2): in a one-layer Gemma 2 (its only
/// layer slides, window 4), the logits at positions 4 and on do not depend on the first token
/// (it is outside their window), and those before do; the same model without the window
/// (its config edited) depends on the first token everywhere. Fails when a layout ignores
/// the window.
#[test]
fn gemma2_sliding_window_hides_tokens_before_it_in_every_layout() {
    let spec = gemma2_spec(1, 72);
    let path = write_model(&spec, "gemma2-window.gguf");
    let (a, b) = ([3u32, 17, 5, 38, 0, 22, 9, 11], [30u32, 17, 5, 38, 0, 22, 9, 11]);
    let vocab = spec.vocab;
    for window in [true, false] {
        for (tp, cp) in [(1, 1), (1, 2), (2, 2)] {
            let got = on_mesh(tp, cp, |p, comms| {
                let file = GgufFile::open(&path).unwrap();
                let mut config = LlamaConfig::from_gguf(&file).unwrap();
                if !window {
                    config.sliding_window = None;
                }
                let opts = LoadOptions::new(p).form(WeightForm::F32);
                let model = ParallelModel::from_source(&file, config, opts).unwrap();
                let mut run = |prompt: &[u32]| {
                    let mut cache = model.new_cache(16);
                    model.forward(comms, prompt, &mut cache, Logits::All).unwrap()
                };
                (run(&a), run(&b))
            });
            let (la, lb) = &got[0];
            for pos in 0..a.len() {
                let row = |l: &Tensor| l.data()[pos * vocab..(pos + 1) * vocab].to_vec();
                let e = rel_err(&row(la), &row(lb));
                let hidden = window && pos >= 4;
                assert_eq!(
                    e < 1e-6,
                    hidden,
                    "({tp},{cp}) window {window}, position {pos}: difference {e}"
                );
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// Final logit soft-capping: every logit of the single-rank forward and of a batched step
/// (prompt log-probabilities, `every_row`) is `cap · tanh(l / cap)` of the model without the
/// cap; the batched greedy ids are the argmax of the capped logits.
#[test]
fn gemma2_final_logits_are_soft_capped_on_every_path() {
    let spec = gemma2_spec(2, 73);
    let path = write_model(&spec, "gemma2-cap.gguf");
    let file = GgufFile::open(&path).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let cap = config.final_softcap.unwrap();
    let load = |config: LlamaConfig| {
        let opts = LoadOptions::new(Placement::single()).form(WeightForm::F32);
        ParallelModel::from_source(&file, config, opts).unwrap()
    };
    let (capped, plain) =
        (load(config.clone()), load(LlamaConfig { final_softcap: None, ..config }));
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let prompt = [3u32, 17, 5, 38, 0, 22, 9];
    let mut run = |m: &ParallelModel| {
        let mut cache = m.new_cache(16);
        m.forward(&mut comms, &prompt, &mut cache, Logits::All).unwrap()
    };
    let (with, without) = (run(&capped), run(&plain));
    let want: Vec<f32> = without.data().iter().map(|&l| cap * (l / cap).tanh()).collect();
    assert!(rel_err(with.data(), &want) < 1e-6);
    assert!(without.data().iter().any(|l| l.abs() > cap), "the cap must bind somewhere");
    let mut cache = capped.new_cache(16);
    let mut seqs = [Sequence { every_row: true, ..Sequence::sampled(&prompt, &mut cache) }];
    let batched = capped.forward_batch(&mut comms, &mut seqs).unwrap().unwrap();
    assert!(rel_err(batched.data(), &want) < 1e-5);
    let mut cache = capped.new_cache(16);
    let mut seqs = [Sequence { every_row: true, ..Sequence::sampled(&prompt, &mut cache) }];
    let ids = capped.forward_batch_argmax(&mut comms, &mut seqs).unwrap().unwrap();
    let argmax = capped.backend().argmax_rows(&batched).unwrap();
    assert_eq!(ids.iter().map(|&i| i as usize).collect::<Vec<_>>(), argmax);
    // The candidates of a top-k sampler carry the capped logits.
    let mut cache = capped.new_cache(16);
    let mut seqs = [Sequence { every_row: true, ..Sequence::sampled(&prompt, &mut cache) }];
    let top = capped.forward_batch_top_k(&mut comms, &mut seqs, 5).unwrap().unwrap();
    let want = capped.backend().top_k_rows(&batched, 5).unwrap();
    assert_eq!(top, want);
    std::fs::remove_file(path).unwrap();
}

/// A decoded token's logits are the same bits alone and in a step of any size: the decode
/// rows of a step take the direct kernels even when the step's rows (40 decodes and a prompt
/// chunk of 20) are far past the size at which a product of that many rows is blocked, with
/// f32 and block-quantized weights.
#[test]
fn decode_rows_are_the_same_bits_alone_and_in_a_step_of_any_size() {
    for (quantized, name) in [(None, "f32"), (Some(BlockFormat::Q4_0), "q4_0")] {
        let spec = RandomLlama {
            heads: 4,
            kv_heads: 2,
            hidden: 64,
            ffn: 96,
            vocab: 64,
            layers: 2,
            quantized,
            seed: 47,
            ..RandomLlama::default()
        };
        let path = write_model(&spec, &format!("decode_bits_{name}.gguf"));
        let model = ParallelModel::load(
            &path,
            LoadOptions::new(Placement { tp_rank: 0, tp: 1, cp_rank: 0, cp: 1 })
                .on(Backend::cpu(2).unwrap())
                .form(WeightForm::Native),
        )
        .unwrap();
        let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
        let mut comms = Comms { tp: &mut tp, cp: &mut cp };
        let seqs = 41;
        let prompt = |s: usize| -> Vec<u32> {
            (0..3 + s % 4).map(|i| ((s * 5 + i * 3) % 64) as u32).collect()
        };
        // Two sets of caches, prefilled alike, one sequence at a time.
        let mut prefilled = || -> Vec<ParallelCache> {
            (0..seqs - 1)
                .map(|s| {
                    let mut cache = model.new_cache(64);
                    let tokens = prompt(s);
                    let mut one = [Sequence::sampled(&tokens, &mut cache)];
                    model.forward_batch(&mut comms, &mut one).unwrap();
                    cache
                })
                .collect()
        };
        let (mut alone, mut together) = (prefilled(), prefilled());
        let next = |s: usize| [((s * 11 + 1) % 64) as u32];
        let want: Vec<Vec<u32>> = alone
            .iter_mut()
            .enumerate()
            .map(|(s, cache)| {
                let tokens = next(s);
                let mut one = [Sequence::sampled(&tokens, cache)];
                let logits = model.forward_batch(&mut comms, &mut one).unwrap().unwrap();
                logits.data().iter().map(|x| x.to_bits()).collect()
            })
            .collect();
        // All 40 decodes in one step, then a new sequence's prompt chunk of 20 tokens.
        let tokens: Vec<[u32; 1]> = (0..seqs - 1).map(next).collect();
        let chunk: Vec<u32> = (0..20).map(|i| (i * 7 % 64) as u32).collect();
        let mut fresh = model.new_cache(64);
        let mut step: Vec<Sequence<'_>> = together
            .iter_mut()
            .zip(&tokens)
            .map(|(cache, t)| Sequence::sampled(t, cache))
            .collect();
        step.push(Sequence::sampled(&chunk, &mut fresh));
        let logits = model.forward_batch(&mut comms, &mut step).unwrap().unwrap();
        for (s, want) in want.iter().enumerate() {
            let got: Vec<u32> = logits.row(s).iter().map(|x| x.to_bits()).collect();
            assert!(&got == want, "{name}: sequence {s}'s decoded logits differ from alone");
        }
        std::fs::remove_file(path).unwrap();
    }
}

/// A small Gemma 3: uneven heads, 7 layers (layer 5 global, the others local with a window
/// of 4), query/key norms, post-norms, the global layers' rotation scaled by 4.
fn gemma3_spec(layers: usize, seed: u64) -> RandomLlama {
    RandomLlama {
        gemma3: Some(crate::model::random::Gemma3::default()),
        layers,
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 64,
        vocab: 40,
        seed,
        ..RandomLlama::default()
    }
}

/// Gemma 3 (a window of 4 on layers 0-4 and 6, layer 5 global with its own rotary base and
/// scaling, query/key norms, post-norms, no caps): the logits of a 7-token prompt and 16
/// greedy steps match the single-rank model in (1,1) (2,1) (1,2) (2,2) (3,1), and the greedy
/// ids of its GGUF file and of its Hugging Face folder (norms as `1 + w` under Gemma 3's
/// names), loaded sharded, are the single-rank GGUF model's.
#[test]
fn gemma3_matches_the_single_rank_model_in_every_layout() {
    let spec = gemma3_spec(7, 81);
    let layouts = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)];
    check_layouts(&spec, "gemma3-layouts.gguf", &layouts);

    let path = write_model(&spec, "gemma3-generate.gguf");
    let dir = temp_path("gemma3-generate-hf");
    spec.write_hf(&dir, true).unwrap();
    let reference = Model::load(&path, 1).unwrap();
    let c = reference.config();
    assert!(c.post_norms && c.qk_norm && c.final_softcap.is_none(), "{c:?}");
    assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, Some(1e4)));
    let hf = checkpoint::Checkpoint::open(&dir).unwrap().config().unwrap();
    assert_eq!(&hf, c, "the folder's config.json reads as the GGUF file's metadata");
    let prompt = [1u32, 2, 3, 4, 5, 6, 7, 8, 9];
    assert_greedy_in_layouts(&reference, &dir, &prompt);
    assert_greedy_in_layouts(&reference, &path, &prompt);
    std::fs::remove_file(path).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// Gemma 3 batched over one shared pool of scattered 4-token blocks: the mixed steps of
/// [`mixed_steps`] (sequences of up to 10 tokens, past the window of 4 of the local layers and
/// through the global layer 5) give in (1,1) (2,1) (1,2) (2,2) (3,1) the logits of each
/// sequence run alone on one rank (1e-4 relative), so batching, the paged pool and CP's
/// exchange rotate and window each layer as one rank does.
#[test]
fn gemma3_batched_steps_over_a_paged_pool_match_each_sequence_alone() {
    let spec = gemma3_spec(7, 82);
    let path = write_model(&spec, "gemma3-paged.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    let (_, want) = each_sequence_alone(&path, &steps);
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let opts = LoadOptions::new(p).form(WeightForm::F32);
            let model = ParallelModel::load(&path, opts).unwrap();
            // A block per group (the global layer's, and one per local layer) per 4 tokens.
            let g = model.kv_groups().len() as u32;
            assert_eq!(g, 7);
            let pool = Arc::new(model.new_pool(4, 90 * g as usize).unwrap());
            let mut paged: Vec<ParallelCache> = (0..5u32)
                .map(|s| {
                    let mut c = model.new_paged_cache(&pool).unwrap();
                    let table: Vec<u32> =
                        (0..16 * g).map(|b| (s * 16 * g + b) * 11 % (80 * g)).collect();
                    c.extend_table(&table).unwrap();
                    c
                })
                .collect();
            (p, run_steps(&model, comms, &steps, &mut paged))
        });
        for (p, out) in got {
            if (p.tp_rank, p.cp_rank) != (0, 0) {
                continue;
            }
            for (i, (logits, want)) in out.iter().zip(&want).enumerate() {
                let logits = logits.as_ref().expect("rank 0 gets the logits");
                for (r, w) in want.iter().enumerate() {
                    let e = rel_err(logits.row(r), w.data());
                    assert!(e < 1e-4, "({tp},{cp}) step {i} row {r}: logits off by {e}");
                }
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// Greedy decoding far past the window through a paged pool whose windowed groups give their
/// blocks back as rank 0 would ([`window_dead_blocks`]): each block given back is filled
/// with NaN (as another sequence's keys might overwrite it) and handed out again, this
/// sequence's later blocks included. Gemma 2 (4 layers: 2 windowed, 2 global; 2 groups) and
/// Gemma 3 (7 layers: 1 global; 7 groups), window 4, blocks of 4 tokens: a 6-token prompt and
/// 40 greedy steps give in (1,1) (2,1) (1,2) (2,2) the single-rank unpaged model's ids and
/// logits (1e-4), while each windowed group holds at most `ceil(4 / 4) + 1` blocks and the
/// global ones every block. Fails when a rank reads a block it gave back.
#[test]
fn windowed_groups_give_back_blocks_past_the_window_and_decode_as_before() {
    use crate::model::{window_dead_blocks, PagedCache};
    let (window, bs, steps) = (4usize, 4usize, 40usize);
    for (spec, name) in
        [(gemma2_spec(4, 91), "gemma2-freeing.gguf"), (gemma3_spec(7, 92), "gemma3-freeing.gguf")]
    {
        let path = write_model(&spec, name);
        let vocab = spec.vocab as u32;
        let prompt: Vec<u32> = (0..6).map(|i| (i * 7 + 3) % vocab).collect();
        let reference =
            ParallelModel::load(&path, LoadOptions::new(Placement::single()).form(WeightForm::F32))
                .unwrap();
        let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
        let mut comms = Comms { tp: &mut tp, cp: &mut cp };
        let mut cache = reference.new_cache(64);
        let mut tokens = prompt.clone();
        let mut want = Vec::new();
        for _ in 0..steps {
            let logits = reference.forward(&mut comms, &tokens, &mut cache, Logits::Last).unwrap();
            let next = reference.backend().argmax_rows(&logits).unwrap()[0] as u32;
            want.push((logits.data().to_vec(), next));
            tokens = vec![next];
        }
        for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
            let got = on_mesh(tp, cp, |p, comms| {
                let opts = LoadOptions::new(p).form(WeightForm::F32);
                let model = ParallelModel::load(&path, opts).unwrap();
                let groups = model.kv_groups();
                let windowed: Vec<usize> =
                    (0..groups.len()).filter(|&g| groups.windows()[g].is_some()).collect();
                assert!(!windowed.is_empty() && windowed.len() < groups.len(), "{groups:?}");
                let pool = Arc::new(model.new_pool(bs, 64).unwrap());
                // Rank 0's bookkeeping, done alike on every rank: free ids, the logical
                // blocks handed out, how many of them the windowed groups gave back.
                let mut free: Vec<u32> = (0..64).rev().collect();
                let (mut logical, mut dropped, mut most) = (0, 0, 0);
                let mut cache = model.new_paged_cache(&pool).unwrap();
                let mut tokens = prompt.clone();
                let mut out = Vec::new();
                for _ in 0..steps {
                    let next = cache.len();
                    let dead = window_dead_blocks(next, p.cp, window, bs).min(logical);
                    for b in dropped..dead {
                        for &g in &windowed {
                            let id = cache.tables()[g][b];
                            PagedCache::poison(&pool, id);
                            free.push(id);
                        }
                    }
                    dropped = dropped.max(dead);
                    let need = (next + tokens.len()).div_ceil(p.cp).div_ceil(bs);
                    while logical < need {
                        let ids: Vec<u32> =
                            (0..groups.len()).map(|_| free.pop().expect("a free block")).collect();
                        cache.extend_table(&ids).unwrap();
                        logical += 1;
                    }
                    most = most.max(logical - dropped);
                    let logits = model.forward(comms, &tokens, &mut cache, Logits::Last).unwrap();
                    let id = model.backend().argmax_rows(&logits).unwrap()[0] as u32;
                    out.push((logits.data().to_vec(), id));
                    tokens = vec![id];
                }
                (p, out, logical, most)
            });
            for (p, out, logical, most) in got {
                assert!(logical >= (6 + steps) / (cp * bs), "({tp},{cp}) global blocks grow");
                assert!(most <= window.div_ceil(bs) + 1, "({tp},{cp}) {p:?}: {most} blocks held");
                for (i, ((logits, id), (w, wid))) in out.iter().zip(&want).enumerate() {
                    assert_eq!(id, wid, "{name} ({tp},{cp}) {p:?} step {i}");
                    let e = rel_err(logits, w);
                    assert!(e < 1e-4, "{name} ({tp},{cp}) {p:?} step {i}: logits off by {e}");
                }
            }
        }
        std::fs::remove_file(path).unwrap();
    }
}

/// A communicator that records the bytes each all-gather sends, and passes every call on.
struct Counting {
    inner: Box<dyn Communicator>,
    gathers: Vec<usize>,
}

impl Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn group(&self) -> &str {
        self.inner.group()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
    fn abort_handle(&self) -> collectives::AbortHandle {
        self.inner.abort_handle()
    }
    fn fail(&mut self, reason: &str) {
        self.inner.fail(reason)
    }
    fn all_reduce_raw(
        &mut self,
        buf: &mut [u8],
        dtype: collectives::ElemType,
        op: collectives::ReduceOp,
    ) -> collectives::Result<()> {
        self.inner.all_reduce_raw(buf, dtype, op)
    }
    fn all_gather_uneven_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        dtype: collectives::ElemType,
    ) -> collectives::Result<()> {
        self.gathers.push(send.len());
        self.inner.all_gather_uneven_raw(send, recv, sizes, dtype)
    }
    fn reduce_scatter_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: collectives::ElemType,
        op: collectives::ReduceOp,
    ) -> collectives::Result<()> {
        self.inner.reduce_scatter_raw(send, recv, dtype, op)
    }
    fn broadcast_raw(
        &mut self,
        buf: &mut [u8],
        dtype: collectives::ElemType,
        root: usize,
    ) -> collectives::Result<()> {
        self.inner.broadcast_raw(buf, dtype, root)
    }
    fn send_raw(
        &mut self,
        buf: &[u8],
        dtype: collectives::ElemType,
        peer: usize,
    ) -> collectives::Result<()> {
        self.inner.send_raw(buf, dtype, peer)
    }
    fn recv_raw(
        &mut self,
        buf: &mut [u8],
        dtype: collectives::ElemType,
        peer: usize,
    ) -> collectives::Result<()> {
        self.inner.recv_raw(buf, dtype, peer)
    }
    fn all_to_all_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: collectives::ElemType,
    ) -> collectives::Result<()> {
        self.inner.all_to_all_raw(send, recv, dtype)
    }
    fn barrier(&mut self) -> collectives::Result<()> {
        self.inner.barrier()
    }
}

/// CP's prefill exchange carries of a windowed layer only the keys a later rank's queries
/// see: a Gemma 3 (7 layers, window 4, layer 5 global) prefills 24 tokens over CP 2 and 3,
/// and each rank's all-gather of a local layer sends the last 3 of its keys and values, of
/// the global layer all of them; every rank's logits of every position are the single-rank
/// model's (1e-4), so the keys left out were seen by no query.
#[test]
fn cp_prefill_sends_a_windowed_layer_only_the_keys_a_later_rank_sees() {
    let spec = gemma3_spec(7, 94);
    let path = write_model(&spec, "gemma3-exchange.gguf");
    let prompt: Vec<u32> = (0..24).map(|i| (i * 5 + 2) % spec.vocab as u32).collect();
    let single = |p| ParallelModel::load(&path, LoadOptions::new(p).form(WeightForm::F32));
    let reference = single(Placement::single()).unwrap();
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let mut cache = reference.new_cache(32);
    let want = reference.forward(&mut comms, &prompt, &mut cache, Logits::All).unwrap();
    // Keys and values of one token on a rank: 3 KV heads of 8 values, f32.
    let row_bytes = 2 * 3 * 8 * 4;
    for cp in [2, 3] {
        let got = std::thread::scope(|s| {
            let handles: Vec<_> = mesh_comms(1, cp)
                .into_iter()
                .map(|(mut t, c)| {
                    let (single, prompt) = (&single, &prompt);
                    s.spawn(move || {
                        let mut c = Counting { inner: c, gathers: Vec::new() };
                        let mut comms = Comms { tp: &mut *t, cp: &mut c };
                        let p = Placement::of(&comms);
                        let model = single(p).unwrap();
                        let mut cache = model.new_cache(32);
                        let logits =
                            model.forward(&mut comms, prompt, &mut cache, Logits::All).unwrap();
                        (p, logits, c.gathers)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        for (p, logits, gathers) in got {
            let shard = TokenShard::new(24, cp, p.cp_rank).unwrap().local().len();
            let layers: Vec<usize> =
                (0..7).map(|l| if l == 5 { shard } else { shard.min(3) } * row_bytes).collect();
            assert_eq!(gathers[..7], layers, "cp {cp} rank {}", p.cp_rank);
            let e = rel_err(logits.data(), want.data());
            assert!(e < 1e-4, "cp {cp} rank {}: logits off by {e}", p.cp_rank);
        }
    }
    std::fs::remove_file(path).unwrap();
}

/// Model steps whose kernels' buffers are placed as the CUDA backend's step workspace places
/// them (slots of one buffer per step shape, at offsets planned from the shape's first step:
/// `tensor::kernels::workspace`) give the plain backend's logits and greedy ids bit for bit
/// in every layout, and a warm decode step takes every buffer it frees from a slot. A plan
/// that handed out a slot over a tensor still in use would change that tensor's values.
#[test]
fn planned_step_buffers_change_no_result_and_serve_warm_decode_steps() {
    let spec = biased_untied_spec(53);
    let path = write_model(&spec, "planned-steps.gguf");
    let steps = mixed_steps(spec.vocab as u32);
    // Three prompts, then eight decode steps of the three sequences.
    let mut decode: Vec<Vec<Entry>> = vec![vec![
        (0, vec![3, 17, 5, 38, 0], true),
        (1, vec![22, 9, 4], true),
        (2, vec![1, 2, 3, 4], true),
    ]];
    for i in 0..8u32 {
        decode.push((0..3).map(|s| (s, vec![(i * 7 + s as u32 * 11) % 40], true)).collect());
    }
    for (tp, cp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let got = on_mesh(tp, cp, |p, comms| {
            let run = |be: Backend, comms: &mut Comms<'_>| {
                let model = load_f32_on(&path, p, be.clone());
                let host = |t: Option<Tensor>| t.map(|t| t.into_host_vec().unwrap());
                // The mixed steps twice, so that each shape is planned, then served.
                let mut logits = Vec::new();
                for _ in 0..2 {
                    let got = run_steps(&model, comms, &steps, &mut five_caches(&model));
                    logits.extend(got.into_iter().map(host));
                }
                let mut caches = five_caches(&model);
                let mut stats = Vec::new();
                let ids = run_steps_with(comms, &decode, &mut caches, |comms, seqs| {
                    let before = be.workspace_stats();
                    let ids = model.forward_batch_argmax(comms, seqs).unwrap();
                    stats.push(before.zip(be.workspace_stats()));
                    ids
                });
                (logits, ids, stats)
            };
            let plain = run(Backend::cpu(1).unwrap(), comms);
            let planned = run(tensor::test_util::cpu_with_planned_device_outputs(1), comms);
            (p, plain, planned)
        });
        let mut warm_slots = 0;
        for (p, plain, planned) in got {
            assert!(plain.0 == planned.0, "({tp},{cp}) {p:?}: planned buffers changed logits");
            assert_eq!(plain.1, planned.1, "({tp},{cp}) {p:?}: planned buffers changed ids");
            assert!(plain.2.iter().all(Option::is_none), "the plain backend plans nothing");
            // The prompt step and the first decode step are recorded; the rest are served.
            for (i, s) in planned.2.iter().enumerate().skip(2) {
                let (before, after) = s.unwrap();
                assert_eq!(after.fallbacks, before.fallbacks, "({tp},{cp}) {p:?} decode step {i}");
                assert_eq!(after.recordings, before.recordings, "({tp},{cp}) {p:?} step {i}");
                warm_slots += after.slots - before.slots;
            }
        }
        assert!(warm_slots > 0, "({tp},{cp}): no warm step took a slot");
    }
    std::fs::remove_file(path).unwrap();
}
