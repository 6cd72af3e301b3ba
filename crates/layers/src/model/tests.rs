//! Model tests: a naive reference forward pass on the raw GGUF weights, KV-cache consistency,
//! shard sums, errors, and the real default model when cached.

use super::random::RandomLlama;
use super::*;
use crate::test_util::{assert_close, temp_path};
use checkpoint::gguf::GgufFile;
use std::path::PathBuf;
use tensor::kernels::cpu::quant::BlockFormat;
use tensor::kernels::Weight;
use text::tokenizer::Tokenizer;

fn write_model(spec: &RandomLlama, stem: &str) -> PathBuf {
    let p = temp_path(stem);
    spec.write(&p).unwrap();
    p
}

/// Straightforward f64 Llama forward over all tokens (positions 0..n), on the GGUF weights
/// (and Q/K/V biases, when present) as stored, with llama.cpp's rotary embedding for the
/// architecture: interleaved (adjacent pairs) for llama, an independent check of the
/// un-permute + rotate-half path; rotate-half (NEOX) for qwen2 and qwen3. Qwen3's per-head
/// query and key norms (`attn_q_norm`, `attn_k_norm`) are applied after the biases and
/// before the rotation, as llama.cpp and transformers do.
fn reference_logits(file: &GgufFile, tokens: &[u32]) -> Vec<f32> {
    let c = LlamaConfig::from_gguf(file).unwrap();
    let get = |name: &str| -> Vec<f64> {
        file.tensor(name).unwrap().data().iter().map(|&x| x as f64).collect()
    };
    let (n, h, d) = (tokens.len(), c.hidden, c.head_dim);
    let matvec = |w: &[f64], x: &[f64]| -> Vec<f64> {
        w.chunks(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
    };
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let s =
            1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + c.rms_eps as f64).sqrt();
        x.iter().zip(w).map(|(a, b)| a * s * b).collect()
    };
    let arch = file.get_str("general.architecture").unwrap();
    let neox = matches!(arch, "qwen2" | "qwen3");
    // Longrope as llama.cpp reads it: the long factors when the context exceeds the original
    // one, else the short; cosines and sines times the attention factor.
    let (factors, mscale) = if file.has_tensor("rope_factors_long.weight") {
        let key = |k: &str| format!("{arch}.{k}");
        let context = file.get_u64(&key("context_length")).unwrap();
        let original = file.get_u64(&key("rope.scaling.original_context_length")).unwrap();
        let long = context > original;
        let name = if long { "rope_factors_long.weight" } else { "rope_factors_short.weight" };
        (get(name), file.get_f64(&key("rope.scaling.attn_factor")).unwrap())
    } else {
        (vec![1.0; d / 2], 1.0)
    };
    let rope = |v: &mut [f64], pos: usize| {
        for head in v.chunks_mut(d) {
            for (i, factor) in factors.iter().enumerate() {
                let inv_freq = (c.rope_theta as f64).powf(-((2 * i) as f64) / d as f64);
                let a = pos as f64 * inv_freq / factor;
                let (cos, sin) = (a.cos() * mscale, a.sin() * mscale);
                let (i0, i1) = if neox { (i, i + d / 2) } else { (2 * i, 2 * i + 1) };
                let (x0, x1) = (head[i0], head[i1]);
                head[i0] = x0 * cos - x1 * sin;
                head[i1] = x1 * cos + x0 * sin;
            }
        }
    };
    let plus_bias = |mut y: Vec<f64>, name: &str| {
        if file.has_tensor(name) {
            y.iter_mut().zip(get(name)).for_each(|(a, b)| *a += b);
        }
        y
    };
    let embed = get("token_embd.weight");
    let mut x: Vec<Vec<f64>> =
        tokens.iter().map(|&t| embed[t as usize * h..][..h].to_vec()).collect();
    for l in 0..c.n_layers {
        let w = |t: &str| get(&format!("blk.{l}.{t}.weight"));
        let (wq, wk, wv, wo) = (w("attn_q"), w("attn_k"), w("attn_v"), w("attn_output"));
        let (an, fnorm, wg, wu, wd) =
            (w("attn_norm"), w("ffn_norm"), w("ffn_gate"), w("ffn_up"), w("ffn_down"));
        let hs: Vec<Vec<f64>> = x.iter().map(|r| rms(r, &an)).collect();
        let b = |t: &str| format!("blk.{l}.{t}.bias");
        let mut q: Vec<Vec<f64>> =
            hs.iter().map(|r| plus_bias(matvec(&wq, r), &b("attn_q"))).collect();
        let mut k: Vec<Vec<f64>> =
            hs.iter().map(|r| plus_bias(matvec(&wk, r), &b("attn_k"))).collect();
        let v: Vec<Vec<f64>> = hs.iter().map(|r| plus_bias(matvec(&wv, r), &b("attn_v"))).collect();
        if file.has_tensor(&format!("blk.{l}.attn_q_norm.weight")) {
            let (qn, kn) = (w("attn_q_norm"), w("attn_k_norm"));
            let per_head = |r: &Vec<f64>, norm: &[f64]| -> Vec<f64> {
                r.chunks(d).flat_map(|head| rms(head, norm)).collect()
            };
            q = q.iter().map(|r| per_head(r, &qn)).collect();
            k = k.iter().map(|r| per_head(r, &kn)).collect();
        }
        for t in 0..n {
            rope(&mut q[t], t);
            rope(&mut k[t], t);
        }
        for i in 0..n {
            let mut attn = vec![0.0; c.n_heads * d];
            for hd in 0..c.n_heads {
                let g = hd / c.group_size();
                let qv = &q[i][hd * d..][..d];
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        qv.iter().zip(&k[j][g * d..][..d]).map(|(a, b)| a * b).sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for (j, sv) in s.iter().enumerate() {
                    for e in 0..d {
                        attn[hd * d + e] += (sv - m).exp() / z * v[j][g * d + e];
                    }
                }
            }
            let o = matvec(&wo, &attn);
            x[i].iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let hh = rms(&x[i], &fnorm);
            let act: Vec<f64> = matvec(&wg, &hh)
                .iter()
                .zip(matvec(&wu, &hh))
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let m = matvec(&wd, &act);
            x[i].iter_mut().zip(&m).for_each(|(a, b)| *a += b);
        }
    }
    let head = if file.has_tensor("output.weight") { get("output.weight") } else { embed };
    let fnorm = get("output_norm.weight");
    x.iter().flat_map(|r| matvec(&head, &rms(r, &fnorm))).map(|v| v as f32).collect()
}

const PROMPT: [u32; 7] = [3, 17, 5, 40, 22, 9, 31];

#[test]
fn prefill_matches_the_naive_reference_with_interleaved_rope() {
    for (spec, stem) in [
        (RandomLlama::default(), "ref-tied.gguf"),
        (
            RandomLlama {
                untied_head: true,
                heads: 4,
                kv_heads: 1,
                seed: 7,
                ..RandomLlama::default()
            },
            "ref-untied.gguf",
        ),
    ] {
        let p = write_model(&spec, stem);
        let model = Model::load(&p, 2).unwrap();
        assert_eq!(model.config().tied_embeddings, !spec.untied_head);
        let mut cache = model.new_cache(16);
        let pos: Vec<usize> = (0..PROMPT.len()).collect();
        let got = model.forward(&PROMPT, &pos, &mut cache, Logits::All).unwrap();
        assert_eq!(got.shape(), &[PROMPT.len(), spec.vocab]);
        let want = reference_logits(&GgufFile::open(&p).unwrap(), &PROMPT);
        assert_close(got.data(), &want, 1e-4);
        std::fs::remove_file(p).unwrap();
    }
}

/// Longrope: the naive reference with each pair's angle divided by the long factors (the
/// written context 256 beyond the original 64) or the short ones (original 256), and the
/// rotation scaled by the attention factor. The two choices, and no scaling, differ; the
/// Phi-3 file (fused projections) of the same model gives the same logits.
#[test]
fn longrope_matches_the_naive_reference_with_either_factor_list() {
    let longrope = |original: usize| checkpoint::config::LongRope {
        short: (0..8).map(|i| 1.0 + i as f32 * 0.05).collect(),
        long: (0..8).map(|i| 1.0 + i as f32 * 4.0).collect(),
        original_context: original,
        attn_factor: checkpoint::config::longrope_attn_factor(256, original).max(1.1),
    };
    let plain = RandomLlama { seed: 61, untied_head: true, ..RandomLlama::default() };
    let pos: Vec<usize> = (0..PROMPT.len()).collect();
    let logits = |spec: &RandomLlama, stem: &str| {
        let p = write_model(spec, stem);
        let model = Model::load_with(&p, 2, WeightForm::F32).unwrap();
        let got = model.forward(&PROMPT, &pos, &mut model.new_cache(16), Logits::All).unwrap();
        let want = reference_logits(&GgufFile::open(&p).unwrap(), &PROMPT);
        assert_close(got.data(), &want, 1e-4);
        std::fs::remove_file(p).unwrap();
        got.data().to_vec()
    };
    let none = logits(&plain, "ref-no-longrope.gguf");
    let long_spec = RandomLlama { longrope: Some(longrope(64)), ..plain.clone() };
    let long = logits(&long_spec, "ref-longrope-long.gguf");
    let short_spec = RandomLlama { longrope: Some(longrope(256)), ..plain.clone() };
    let short = logits(&short_spec, "ref-longrope-short.gguf");
    let differ = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>();
    assert!(differ(&long, &short) > 1e-2 && differ(&short, &none) > 1e-2);

    let phi3 = write_model(&RandomLlama { fused: true, ..long_spec }, "ref-longrope-phi3.gguf");
    let model = Model::load_with(&phi3, 2, WeightForm::F32).unwrap();
    let got = model.forward(&PROMPT, &pos, &mut model.new_cache(16), Logits::All).unwrap();
    assert_eq!(got.data(), &long[..]);
    std::fs::remove_file(phi3).unwrap();
}

#[test]
fn attention_biases_match_the_naive_reference() {
    // Qwen2: biases on every projection, Q/K rows in rotate-half order.
    let qwen =
        RandomLlama { attn_bias: true, heads: 4, kv_heads: 2, seed: 8, ..Default::default() };
    let p = write_model(&qwen, "ref-qwen2.gguf");
    let file = GgufFile::open(&p).unwrap();
    assert_eq!(file.get_str("general.architecture").unwrap(), "qwen2");
    assert!(!file.qk_interleaved());
    let model = Model::load_with(&p, 2, WeightForm::F32).unwrap();
    let pos: Vec<usize> = (0..PROMPT.len()).collect();
    let got = model.forward(&PROMPT, &pos, &mut model.new_cache(16), Logits::All).unwrap();
    assert_close(got.data(), &reference_logits(&file, &PROMPT), 1e-4);
    // The biases matter: without them the logits differ.
    let plain_path = write_model(&RandomLlama { attn_bias: false, ..qwen }, "plain.gguf");
    let plain = Model::load(&plain_path, 1)
        .unwrap()
        .forward(&PROMPT, &pos, &mut model.new_cache(16), Logits::All)
        .unwrap();
    std::fs::remove_file(plain_path).unwrap();
    assert!(plain.data().iter().zip(got.data()).any(|(a, b)| (a - b).abs() > 1e-2));
    std::fs::remove_file(p).unwrap();

    // Llama with biases: the Q/K biases are stored permuted like their weight rows and must be
    // un-permuted the same way (one KV head, so the un-permutation of several heads shows).
    let spec = RandomLlama { heads: 4, kv_heads: 1, seed: 9, ..RandomLlama::default() };
    let d = spec.hidden / spec.heads;
    let mut w = spec.writer();
    for l in 0..spec.layers {
        for (t, rows, seed) in [("attn_q", 4, 1), ("attn_k", 1, 2), ("attn_v", 1, 3)] {
            let bias = crate::test_util::random_vec(rows * d, 100 * l as u64 + seed);
            w.tensor_f32(&format!("blk.{l}.{t}.bias"), &[rows * d], &bias);
        }
    }
    let p = temp_path("ref-llama-bias.gguf");
    w.write(&p).unwrap();
    let file = GgufFile::open(&p).unwrap();
    let model = Model::load(&p, 2).unwrap();
    assert!(model.blocks.iter().all(|b| b.attn.has_bias()));
    let got = model.forward(&PROMPT, &pos, &mut model.new_cache(16), Logits::All).unwrap();
    assert_close(got.data(), &reference_logits(&file, &PROMPT), 1e-4);
    std::fs::remove_file(p).unwrap();
}

/// A GGUF file with one tensor's rows `rows` multiplied by `factor` as they are read (a 1-d
/// tensor is one row). Only `rows` is edited: the tensors edited here are loaded by rows.
struct Scaled<'a> {
    file: &'a GgufFile,
    name: String,
    rows: std::ops::Range<usize>,
    factor: f32,
}

impl WeightSource for Scaled<'_> {
    fn shape(&self, name: &str) -> checkpoint::Result<Vec<usize>> {
        self.file.shape(name)
    }

    fn has(&self, name: &str) -> bool {
        self.file.has(name)
    }

    fn rows(&self, name: &str, rows: std::ops::Range<usize>) -> checkpoint::Result<Vec<f32>> {
        let mut values = self.file.rows(name, rows.clone())?;
        if name == self.name {
            let row_len = values.len() / rows.len().max(1);
            for (i, row) in values.chunks_mut(row_len).enumerate() {
                if self.rows.contains(&(rows.start + i)) {
                    row.iter_mut().for_each(|v| *v *= self.factor);
                }
            }
        }
        Ok(values)
    }

    fn cols(&self, name: &str, cols: std::ops::Range<usize>) -> checkpoint::Result<Vec<f32>> {
        assert_ne!(name, self.name, "only tensors loaded by rows are edited");
        self.file.cols(name, cols)
    }

    fn qk_interleaved(&self) -> bool {
        self.file.qk_interleaved()
    }
}

/// Qwen3: every query and key head is RMS-normalized with its shared weight after the
/// projection (and bias) and before the rotation, as the naive reference does, with heads
/// narrower or wider than `hidden / heads`. The norms are really applied: other norm weights
/// give other logits, and one head's projection rows scaled by 4 give the same logits (the
/// norm is that head's own), where the model without norms changes.
#[test]
fn qwen3_normalizes_each_query_and_key_head_before_rotary() {
    let base = RandomLlama { qwen3: true, heads: 4, kv_heads: 2, seed: 11, ..Default::default() };
    let wide = RandomLlama { head_dim: Some(24), attn_bias: true, seed: 12, ..base.clone() };
    for (spec, stem) in [(base.clone(), "ref-qwen3.gguf"), (wide, "ref-qwen3-wide.gguf")] {
        let p = write_model(&spec, stem);
        let file = GgufFile::open(&p).unwrap();
        assert_eq!(file.get_str("general.architecture").unwrap(), "qwen3");
        assert!(!file.qk_interleaved());
        let model = Model::load_with(&p, 2, WeightForm::F32).unwrap();
        assert!(model.config().qk_norm);
        assert!(model.blocks.iter().all(|b| b.attn.has_qk_norm()));
        assert_eq!(model.blocks[0].attn.has_bias(), spec.attn_bias);
        let pos: Vec<usize> = (0..PROMPT.len()).collect();
        let got = model.forward(&PROMPT, &pos, &mut model.new_cache(16), Logits::All).unwrap();
        assert_close(got.data(), &reference_logits(&file, &PROMPT), 1e-4);
        std::fs::remove_file(p).unwrap();
    }

    let logits = |src: &dyn WeightSource, config: &LlamaConfig| -> Vec<f32> {
        let be = Backend::cpu(1).unwrap();
        let model = Model::from_source(src, config.clone(), be, WeightForm::F32).unwrap();
        let pos: Vec<usize> = (0..PROMPT.len()).collect();
        let out = model.forward(&PROMPT, &pos, &mut model.new_cache(16), Logits::All).unwrap();
        out.data().to_vec()
    };
    let differ = |a: &[f32], b: &[f32]| a.iter().zip(b).any(|(x, y)| (x - y).abs() > 1e-2);
    let d = base.hidden / base.heads;
    let scaled =
        |file, name: &str, rows, factor| Scaled { file, name: name.to_owned(), rows, factor };
    let p = write_model(&base, "qwen3-edits.gguf");
    let file = GgufFile::open(&p).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let plain = logits(&file, &config);
    for t in ["attn_q_norm", "attn_k_norm"] {
        let edited = scaled(&file, &format!("blk.0.{t}.weight"), 0..1, 2.0);
        assert!(differ(&logits(&edited, &config), &plain), "{t} weights doubled");
    }
    for t in ["attn_q", "attn_k"] {
        let edited = scaled(&file, &format!("blk.0.{t}.weight"), d..2 * d, 4.0);
        assert_close(&logits(&edited, &config), &plain, 1e-4);
    }
    std::fs::remove_file(p).unwrap();
    // The same weights without the norms: the scaled head changes the logits.
    let p = write_model(&RandomLlama { qwen3: false, ..base }, "qwen3-edits-twin.gguf");
    let file = GgufFile::open(&p).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let edited = scaled(&file, "blk.0.attn_q.weight", d..2 * d, 4.0);
    assert!(differ(&logits(&edited, &config), &logits(&file, &config)));
    std::fs::remove_file(p).unwrap();
}

/// A model whose config asks for Qwen3's norms from a file without them is refused naming
/// the missing tensor, rather than run without the norms.
#[test]
fn a_missing_query_norm_is_named() {
    let p = write_model(&RandomLlama { seed: 13, ..RandomLlama::default() }, "no-qk-norm.gguf");
    let file = GgufFile::open(&p).unwrap();
    let config = LlamaConfig { qk_norm: true, ..LlamaConfig::from_gguf(&file).unwrap() };
    let be = Backend::cpu(1).unwrap();
    let err = Model::from_source(&file, config, be, WeightForm::F32).unwrap_err().to_string();
    assert!(err.contains("blk.0.attn_q_norm.weight"), "{err}");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn a_misshapen_bias_is_named() {
    let spec = RandomLlama { seed: 10, ..RandomLlama::default() };
    let mut w = spec.writer();
    w.tensor_f32("blk.1.attn_k.bias", &[3], &[0.0; 3]);
    let p = temp_path("bad-bias.gguf");
    w.write(&p).unwrap();
    let err = Model::load(&p, 1).unwrap_err().to_string();
    assert!(err.contains("blk.1.attn_k.bias") && err.contains("expected shape [32]"), "{err}");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn kv_cached_decode_and_chunked_prefill_match_one_full_prefill() {
    let p = write_model(&RandomLlama { seed: 3, ..RandomLlama::default() }, "decode.gguf");
    let model = Model::load(&p, 2).unwrap();
    let n = PROMPT.len();
    let pos: Vec<usize> = (0..n).collect();
    let full = model.forward(&PROMPT, &pos, &mut model.new_cache(n), Logits::All).unwrap();

    let mut cache = model.new_cache(n);
    for t in 0..n {
        let row = model.forward(&PROMPT[t..=t], &[t], &mut cache, Logits::All).unwrap();
        assert_close(row.data(), full.row(t), 1e-4);
    }
    assert_eq!(cache.len(), n);

    let mut cache = model.new_cache(n);
    model.forward(&PROMPT[..3], &pos[..3], &mut cache, Logits::All).unwrap();
    let rest = model.forward(&PROMPT[3..], &pos[3..], &mut cache, Logits::All).unwrap();
    assert_close(rest.data(), &full.data()[3 * full.row_len()..], 1e-4);
    let last = model.forward(&PROMPT, &pos, &mut model.new_cache(n), Logits::Last).unwrap();
    assert_eq!(last.shape(), &[1, full.row_len()]);
    assert_close(last.data(), full.row(n - 1), 1e-5);
    std::fs::remove_file(p).unwrap();
}

#[test]
fn greedy_generate_equals_argmax_of_recomputed_prefills() {
    let p = write_model(&RandomLlama { seed: 5, ..RandomLlama::default() }, "gen.gguf");
    let model = Model::load(&p, 1).unwrap();
    let mut seen = Vec::new();
    let out =
        model.generate(&PROMPT[..3], 5, &[], &mut model.new_cache(8), |t| seen.push(t)).unwrap();
    assert_eq!(out, seen);
    assert_eq!(out.len(), 5);
    let mut seq = PROMPT[..3].to_vec();
    for &tok in &out {
        let pos: Vec<usize> = (0..seq.len()).collect();
        let logits =
            model.forward(&seq, &pos, &mut model.new_cache(seq.len()), Logits::Last).unwrap();
        assert_eq!(model.backend().argmax_rows(&logits).unwrap()[0] as u32, tok);
        seq.push(tok);
    }
    // Stops at a stop token (included) and when the cache is full.
    let first_stop = out.iter().position(|&t| t == out[4]).unwrap();
    let stop = model.generate(&PROMPT[..3], 5, &[out[4]], &mut model.new_cache(8), |_| {}).unwrap();
    assert_eq!(stop, out[..=first_stop]);
    let short = model.generate(&PROMPT[..3], 5, &[], &mut model.new_cache(5), |_| {}).unwrap();
    assert_eq!(short, out[..3]);
    std::fs::remove_file(p).unwrap();
}

#[test]
fn head_and_inner_shards_sum_to_the_full_layer() {
    let spec =
        RandomLlama { heads: 6, kv_heads: 3, hidden: 48, seed: 11, ..RandomLlama::default() };
    let p = write_model(&spec, "shards.gguf");
    let file = GgufFile::open(&p).unwrap();
    let cfg = LlamaConfig::from_gguf(&file).unwrap();
    let be = Backend::cpu(2).unwrap();
    let x = Tensor::from_vec(&[4, 48], crate::test_util::random_vec(4 * 48, 2)).unwrap();
    let pos = [0, 1, 2, 3];
    let run = |kv: Range<usize>| {
        let attn = Attention::load(&file, 1, &cfg, kv.clone(), WeightForm::F32).unwrap();
        assert_eq!(attn.q_heads(), kv.start * 2..kv.end * 2);
        let mut cache = LayerCache::new(kv.len(), cfg.head_dim, 4);
        attn.forward(&be, &x, &pos, &mut cache).unwrap()
    };
    let full = run(0..3);
    let mut sum = run(0..1);
    be.add_assign(&mut sum, &run(1..3)).unwrap();
    assert_close(sum.data(), full.data(), 1e-5);

    let mlp_full =
        Mlp::load(&file, 0, 0..cfg.ffn, WeightForm::F32).unwrap().forward(&be, &x).unwrap();
    let mut mlp_sum =
        Mlp::load(&file, 0, 0..40, WeightForm::F32).unwrap().forward(&be, &x).unwrap();
    be.add_assign(
        &mut mlp_sum,
        &Mlp::load(&file, 0, 40..cfg.ffn, WeightForm::F32).unwrap().forward(&be, &x).unwrap(),
    )
    .unwrap();
    assert_close(mlp_sum.data(), mlp_full.data(), 1e-5);

    // One KV head shared by two shards, each with one of its two query heads.
    let run_heads = |q: Range<usize>| {
        let attn = Attention::load_heads(&file, 1, &cfg, 1..2, q.clone(), WeightForm::F32).unwrap();
        assert_eq!((attn.kv_heads(), attn.q_heads()), (1..2, q));
        let mut cache = LayerCache::new(1, cfg.head_dim, 4);
        attn.forward(&be, &x, &pos, &mut cache).unwrap()
    };
    let mut split = run_heads(2..3);
    be.add_assign(&mut split, &run_heads(3..4)).unwrap();
    assert_close(split.data(), run(1..2).data(), 1e-5);

    let err = Attention::load(&file, 0, &cfg, 2..4, WeightForm::F32).unwrap_err();
    assert!(err.to_string().contains("kv head range 2..4 of 3 heads"), "{err}");
    let err = Attention::load_heads(&file, 0, &cfg, 0..2, 1..3, WeightForm::F32).unwrap_err();
    assert!(err.to_string().contains("query heads 1..3 are neither"), "{err}");
    let err = Attention::load_heads(&file, 0, &cfg, 1..2, 1..3, WeightForm::F32).unwrap_err();
    assert!(err.to_string().contains("query heads 2..4 of kv heads 1..2"), "{err}");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn attention_split_over_two_caches_merges_by_log_sum_exp() {
    // Context parallelism in miniature: keys of positions 0..3 on one "rank", 3..6 on another.
    let p = write_model(&RandomLlama { seed: 13, ..RandomLlama::default() }, "cp.gguf");
    let file = GgufFile::open(&p).unwrap();
    let cfg = LlamaConfig::from_gguf(&file).unwrap();
    let be = Backend::cpu(1).unwrap();
    let attn = Attention::load(&file, 0, &cfg, 0..cfg.n_kv_heads, WeightForm::F32).unwrap();
    let x = Tensor::from_vec(&[6, 64], crate::test_util::random_vec(6 * 64, 4)).unwrap();
    let pos: Vec<usize> = (0..6).collect();
    let (q, k, v) = attn.qkv(&be, &x, &pos).unwrap();
    let row = cfg.n_kv_heads * cfg.head_dim;
    let mut all = LayerCache::new(cfg.n_kv_heads, cfg.head_dim, 6);
    all.append(&be, k.data(), v.data(), &pos).unwrap();
    let (mut a, mut b) = (
        LayerCache::new(cfg.n_kv_heads, cfg.head_dim, 3),
        LayerCache::new(cfg.n_kv_heads, cfg.head_dim, 3),
    );
    a.append(&be, &k.data()[..3 * row], &v.data()[..3 * row], &pos[..3]).unwrap();
    b.append(&be, &k.data()[3 * row..], &v.data()[3 * row..], &pos[3..]).unwrap();
    let (full, _) = attn.attend(&be, &q, &pos, &all, false).unwrap();
    let (mut oa, la) = attn.attend(&be, &q, &pos, &a, true).unwrap();
    let (ob, lb) = attn.attend(&be, &q, &pos, &b, true).unwrap();
    let mut la = la.unwrap();
    tensor::kernels::cpu::attention::merge_partial(
        oa.data_mut(),
        la.data_mut(),
        ob.data(),
        lb.unwrap().data(),
        cfg.head_dim,
    );
    assert_close(oa.data(), full.data(), 1e-5);
    std::fs::remove_file(p).unwrap();
}

#[test]
fn bad_inputs_are_errors_and_leave_the_cache_unchanged() {
    let p = write_model(
        &RandomLlama { quantized: Some(BlockFormat::Q8_0), ..RandomLlama::default() },
        "errors.gguf",
    );
    let model = Model::load(&p, 1).unwrap();
    let mut cache = model.new_cache(4);
    model.forward(&[1, 2], &[0, 1], &mut cache, Logits::Last).unwrap();
    let err = model.forward(&[1, 99], &[2, 3], &mut cache, Logits::Last).unwrap_err();
    assert_eq!(err.to_string(), "token id 99 at index 1 is outside the vocabulary of 48 tokens");
    let err = model.forward(&[1, 2, 3], &[2, 3, 4], &mut cache, Logits::Last).unwrap_err();
    assert_eq!(err.to_string(), "kv cache full: 2 of 4 positions used, 3 more requested");
    let err = model.forward(&[1], &[2, 3], &mut cache, Logits::Last).unwrap_err();
    assert!(err.to_string().contains("1 tokens with 2 positions"), "{err}");
    assert_eq!(cache.len(), 2);
    assert!(Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).is_ok());
    std::fs::remove_file(&p).unwrap();

    let mut w = RandomLlama::default().writer();
    w.tensor_f32("output_norm.weight", &[3], &[1.0; 3]);
    let bad = temp_path("bad-norm.gguf");
    w.write(&bad).unwrap();
    let err = GgufFile::open(&bad).unwrap_err();
    assert!(err.to_string().contains("tensor `output_norm.weight` appears twice"), "{err}");
    std::fs::remove_file(bad).unwrap();
}

#[test]
fn real_model_says_paris_when_cached() {
    let Some(path) = checkpoint::cache::default_model_path() else {
        eprintln!("note: default model not cached (run `cargo xtask fetch-model`); skipping");
        return;
    };
    let model = Model::load(&path, 2).unwrap();
    let c = model.config();
    assert_eq!(
        (c.n_layers, c.hidden, c.ffn, c.n_heads, c.n_kv_heads, c.head_dim),
        (30, 576, 1536, 9, 3, 64)
    );
    assert_eq!(
        (c.vocab_size, c.context_length, c.rope_theta, c.tied_embeddings),
        (49152, 8192, 100_000.0, true)
    );
    // 4-bit projections and an 8-bit embedding: about a fifth of the 540 MB f32 size.
    let mb = model.weight_bytes() / 1_000_000;
    assert!((90..160).contains(&mb), "{mb} MB of weights");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let eos: Vec<u32> = tok.eos_id().into_iter().collect();
    let prompt = tok.encode("The capital of France is").unwrap();
    let out = model.generate(&prompt, 8, &eos, &mut model.new_cache(32), |_| {}).unwrap();
    let text = tok.decode(&out, true).unwrap();
    assert!(text.contains("Paris"), "continuation: {text:?}");

    let chat =
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let prompt = tok.encode(chat).unwrap();
    let out = model.generate(&prompt, 16, &eos, &mut model.new_cache(64), |_| {}).unwrap();
    let text = tok.decode(&out, true).unwrap();
    assert!(text.contains("Paris"), "chat answer: {text:?}");
}

#[test]
fn quantized_weights_track_the_f32_model() {
    // Q8_0 projections: the native form keeps the blocks and dequantizes them in registers;
    // the f32 form dequantizes at load. Both multiply the same values.
    let spec =
        RandomLlama { quantized: Some(BlockFormat::Q8_0), seed: 17, ..RandomLlama::default() };
    let p = write_model(&spec, "quant.gguf");
    let native = Model::load_with(&p, 2, WeightForm::Native).unwrap();
    let dense = Model::load_with(&p, 2, WeightForm::F32).unwrap();
    let pos: Vec<usize> = (0..PROMPT.len()).collect();
    let want = dense.forward(&PROMPT, &pos, &mut dense.new_cache(8), Logits::All).unwrap();
    let scale = want.data().iter().fold(0.0f32, |m, v| m.max(v.abs()));
    // Decode one token at a time (quantized kernels) against the f32 prefill: the same
    // values multiplied in another order, so the logits agree to f32 rounding.
    let mut cache = native.new_cache(8);
    for (t, &tok) in PROMPT.iter().enumerate() {
        let got = native.forward(&[tok], &[t], &mut cache, Logits::All).unwrap();
        for (g, w) in got.data().iter().zip(want.row(t)) {
            assert!((g - w).abs() < 1e-4 * scale, "token {t}: {g} vs {w} (scale {scale})");
        }
    }
    std::fs::remove_file(p).unwrap();
}

#[test]
fn models_and_tokenizers_can_be_shared_across_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<Model>();
    shared::<KvCache>();
    shared::<Tokenizer>();
    shared::<GgufFile>();
}

#[test]
fn quantized_shards_stay_quantized_and_sum_to_the_full_layer() {
    // head_dim 16, groups of 2 query heads: one KV group is 32 columns of attn_output, a
    // whole Q8_0 block; inner ranges split at 64 are block-aligned too.
    let spec =
        RandomLlama { quantized: Some(BlockFormat::Q8_0), seed: 31, ..RandomLlama::default() };
    let p = write_model(&spec, "qshards.gguf");
    let file = GgufFile::open(&p).unwrap();
    let cfg = LlamaConfig::from_gguf(&file).unwrap();
    let be = Backend::cpu(2).unwrap();
    let x = Tensor::from_vec(&[1, 64], crate::test_util::random_vec(64, 8)).unwrap();
    let is_quant = |l: &Linear| matches!(l.weight(), Weight::Quant(_));
    let run = |kv: Range<usize>| {
        let attn = Attention::load(&file, 0, &cfg, kv.clone(), WeightForm::Native).unwrap();
        assert!(is_quant(&attn.qkv) && is_quant(&attn.o), "kv {kv:?}");
        let mut cache = LayerCache::new(kv.len(), cfg.head_dim, 1);
        attn.forward(&be, &x, &[0], &mut cache).unwrap()
    };
    let full = run(0..2);
    let mut sum = run(0..1);
    be.add_assign(&mut sum, &run(1..2)).unwrap();
    crate::test_util::assert_close(sum.data(), full.data(), 1e-4);

    let mlp = |r: Range<usize>| {
        let m = Mlp::load(&file, 1, r, WeightForm::Native).unwrap();
        assert!(is_quant(&m.gate_up) && is_quant(&m.down));
        m.forward(&be, &x).unwrap()
    };
    let full = mlp(0..96);
    let mut sum = mlp(0..64);
    be.add_assign(&mut sum, &mlp(64..96)).unwrap();
    crate::test_util::assert_close(sum.data(), full.data(), 1e-4);
    // An unaligned column shard falls back to f32 instead of failing.
    let m = Mlp::load(&file, 1, 0..40, WeightForm::Native).unwrap();
    assert!(is_quant(&m.gate_up) && !is_quant(&m.down));
    std::fs::remove_file(p).unwrap();
}

/// Gemma 3's layer types by an independent rule: layer `l` is global when `(l + 1) % 6 == 0`
/// (the file's rotary base 1e6 and its linear scaling, no window), else local (base 1e4
/// unscaled, a window of 3). Each of 13 layers loaded from a random Gemma 3 file attends as
/// the same layer loaded with a plain config of its type, and not as one of the other type,
/// over 8 positions: fails if the bases are swapped, the scaling goes to the local layers or
/// the pattern is off by one.
#[test]
fn gemma3_layers_rotate_and_window_by_their_type() {
    let g = random::Gemma3 { window: 3, rope_scale: Some(8.0) };
    let spec = RandomLlama { gemma3: Some(g), layers: 13, seed: 31, ..Default::default() };
    let p = write_model(&spec, "gemma3-layer-types.gguf");
    let file = GgufFile::open(&p).unwrap();
    let cfg = LlamaConfig::from_gguf(&file).unwrap();
    let be = Backend::cpu(1).unwrap();
    let n = 8;
    let x = Tensor::from_vec(&[n, cfg.hidden], crate::test_util::random_vec(n * cfg.hidden, 5))
        .unwrap();
    let pos: Vec<usize> = (0..n).collect();
    let attend = |layer: usize, config: &LlamaConfig| -> Vec<f32> {
        let attn =
            Attention::load(&file, layer, config, 0..config.n_kv_heads, WeightForm::F32).unwrap();
        let mut cache = LayerCache::new(config.n_kv_heads, config.head_dim, n);
        attn.forward(&be, &x, &pos, &mut cache).unwrap().data().to_vec()
    };
    let plain = |global: bool| LlamaConfig {
        rope_theta: if global { 1e6 } else { 1e4 },
        rope_freq_factors: global.then(|| vec![8.0; cfg.head_dim / 2]),
        rope_local_theta: None,
        // A pattern longer than the model: every layer slides.
        sliding_window: (!global)
            .then_some(checkpoint::config::SlidingWindow { tokens: 3, pattern: 64 }),
        ..cfg.clone()
    };
    for layer in 0..cfg.n_layers {
        let global = (layer + 1) % 6 == 0;
        let got = attend(layer, &cfg);
        assert_eq!(got, attend(layer, &plain(global)), "layer {layer} (global: {global})");
        let other = attend(layer, &plain(!global));
        assert!(got.iter().zip(&other).any(|(a, b)| (a - b).abs() > 1e-3), "layer {layer}");
    }
    std::fs::remove_file(p).unwrap();
}
