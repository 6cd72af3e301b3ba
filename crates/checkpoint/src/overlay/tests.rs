//! Overlay tests: buckets over GGUF files (interleaved, quantized, Phi-3's fused) and Hugging
//! Face folders (Gemma's too) read as the base would with the bucket's values, the latest
//! bucket wins, and a bucket that does not fit the model is refused naming file and tensor.

use super::*;
use crate::fused::FusedSource;
use crate::gguf::{GgufFile, GgufWriter, Value};
use crate::safetensors::{hf_name, write_safetensors, HfCheckpoint, StDType};
use crate::test_util::{random_vec, temp_path};
use crate::Activation;
use std::path::PathBuf;
use tensor::kernels::cpu::quant::BlockFormat;

/// Two layers, two query heads of 16 over one KV head: every width a multiple of 32, so the
/// MLP can be stored as Q8_0.
fn config() -> LlamaConfig {
    LlamaConfig {
        n_layers: 2,
        hidden: 32,
        ffn: 32,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 16,
        rope_theta: 10_000.0,
        rope_dim: 16,
        rms_eps: 1e-5,
        vocab_size: 10,
        context_length: 64,
        tied_embeddings: false,
        rope_freq_factors: None,
        rope_attn_factor: None,
        longrope: None,
        activation: Activation::Silu,
        embedding_scale: None,
        qk_norm: false,
        attn_softcap: None,
        final_softcap: None,
        sliding_window: None,
        post_norms: false,
        query_scale: None,
        rope_local_theta: None,
    }
}

/// A tensor as a trainer holds it: its GGUF name, shape and values in the Hugging Face layout.
struct Weight {
    gguf: String,
    shape: Vec<usize>,
    values: Vec<f32>,
}

impl Weight {
    fn hf(&self) -> String {
        hf_name(&self.gguf).unwrap()
    }
}

/// Every tensor of a model of `config` (Q/K/V biases too), random from `seed`.
fn weights(config: &LlamaConfig, seed: u64) -> Vec<Weight> {
    let (h, f, v) = (config.hidden, config.ffn, config.vocab_size);
    let (q, kv) = (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim);
    let mut shapes = vec![
        ("token_embd.weight".to_owned(), vec![v, h]),
        ("output_norm.weight".to_owned(), vec![h]),
        ("output.weight".to_owned(), vec![v, h]),
    ];
    for l in 0..config.n_layers {
        for (tail, shape) in [
            ("attn_norm.weight", vec![h]),
            ("attn_q.weight", vec![q, h]),
            ("attn_k.weight", vec![kv, h]),
            ("attn_v.weight", vec![kv, h]),
            ("attn_q.bias", vec![q]),
            ("attn_k.bias", vec![kv]),
            ("attn_v.bias", vec![kv]),
            ("attn_output.weight", vec![h, q]),
            ("ffn_norm.weight", vec![h]),
            ("ffn_gate.weight", vec![f, h]),
            ("ffn_up.weight", vec![f, h]),
            ("ffn_down.weight", vec![h, f]),
        ] {
            shapes.push((format!("blk.{l}.{tail}"), shape));
        }
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (gguf, shape))| {
            let values = random_vec(shape.iter().product(), seed * 1000 + i as u64);
            Weight { gguf, shape, values }
        })
        .collect()
}

fn weight<'a>(weights: &'a [Weight], gguf: &str) -> &'a Weight {
    weights.iter().find(|w| w.gguf == gguf).unwrap()
}

/// `values` (rows of `cols`) with each head's rows in the interleaved order llama.cpp's
/// converter writes: viewed as `[heads, 2, head_dim/2, cols]`, the two middle axes swapped.
fn interleave(values: &[f32], cols: usize, head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; values.len()];
    for head in 0..values.len() / (head_dim * cols) {
        for (h, i) in (0..2).flat_map(|h| (0..half).map(move |i| (h, i))) {
            let from = (head * head_dim + h * half + i) * cols;
            let to = (head * head_dim + 2 * i + h) * cols;
            out[to..to + cols].copy_from_slice(&values[from..from + cols]);
        }
    }
    out
}

fn is_qk(gguf: &str) -> bool {
    ["attn_q.", "attn_k."].iter().any(|t| gguf.contains(t))
}

/// `w` as a llama GGUF file stores it: Q/K rows and biases interleaved.
fn as_gguf(w: &Weight, head_dim: usize) -> Vec<f32> {
    if !is_qk(&w.gguf) {
        return w.values.clone();
    }
    let cols = if w.shape.len() == 1 { 1 } else { w.shape[1] };
    interleave(&w.values, cols, head_dim)
}

/// Writes `weights` as a llama GGUF file (the MLP as Q8_0 when `quantized`).
fn write_gguf(weights: &[Weight], config: &LlamaConfig, quantized: bool, stem: &str) -> PathBuf {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()));
    for t in weights {
        let values = as_gguf(t, config.head_dim);
        if quantized && t.gguf.contains(".ffn_") && t.shape.len() == 2 {
            w.tensor_quantized(&t.gguf, &t.shape, BlockFormat::Q8_0, &values);
        } else {
            w.tensor_f32(&t.gguf, &t.shape, &values);
        }
    }
    let path = temp_path(stem);
    w.write(&path).unwrap();
    path
}

/// Writes `weights` as a Hugging Face folder of `model_type`.
fn write_hf(weights: &[Weight], model_type: &str, stem: &str) -> PathBuf {
    let dir = temp_path(stem);
    std::fs::create_dir_all(&dir).unwrap();
    let names: Vec<String> = weights.iter().map(Weight::hf).collect();
    let tensors: Vec<_> = weights
        .iter()
        .zip(&names)
        .map(|(w, n)| (n.as_str(), w.shape.as_slice(), StDType::F32, w.values.as_slice()))
        .collect();
    write_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    std::fs::write(dir.join("config.json"), format!(r#"{{"model_type": "{model_type}"}}"#))
        .unwrap();
    dir
}

/// A tensor of a bucket written in f32: its name in the file, shape and values.
type Stored<'a> = (&'a str, &'a [usize], &'a [f32]);

/// Writes a bucket of f32 tensors.
fn write_bucket(stem: &str, tensors: &[Stored<'_>]) -> PathBuf {
    let path = temp_path(stem);
    let tensors: Vec<_> = tensors.iter().map(|&(n, s, v)| (n, s, StDType::F32, v)).collect();
    write_safetensors(&path, &tensors).unwrap();
    path
}

/// Writes every tensor of `weights` as one bucket under Hugging Face names, in `dtype`.
fn bucket_of(weights: &[Weight], dtype: StDType, stem: &str) -> PathBuf {
    let path = temp_path(stem);
    let names: Vec<String> = weights.iter().map(Weight::hf).collect();
    let tensors: Vec<_> = weights
        .iter()
        .zip(&names)
        .map(|(w, n)| (n.as_str(), w.shape.as_slice(), dtype, w.values.as_slice()))
        .collect();
    write_safetensors(&path, &tensors).unwrap();
    path
}

/// Every read of every tensor of `overlay` and `base` agrees: shape, all rows, one head's rows
/// (or one row), a range of columns.
fn assert_reads_alike(overlay: &dyn WeightSource, base: &dyn WeightSource, names: &[&str]) {
    for &name in names {
        let shape = base.shape(name).unwrap();
        assert_eq!(overlay.shape(name).unwrap(), shape, "{name}");
        assert!(overlay.has(name), "{name}");
        let (n_rows, row_len) = match shape[..] {
            [len] => (1, len),
            [rows, cols] => (rows, cols),
            _ => unreachable!("{name}: {shape:?}"),
        };
        let some_rows = if n_rows >= 32 { 16..32 } else { n_rows - 1..n_rows };
        for rows in [0..n_rows, some_rows] {
            let (got, want) = (overlay.rows(name, rows.clone()), base.rows(name, rows.clone()));
            assert_eq!(got.unwrap(), want.unwrap(), "{name} rows {rows:?}");
        }
        let cols = 3..row_len - 2;
        let (got, want) = (overlay.cols(name, cols.clone()), base.cols(name, cols.clone()));
        assert_eq!(got.unwrap(), want.unwrap(), "{name} cols {cols:?}");
    }
}

/// A bucket holding the base's own weights, as a trainer has them (Hugging Face names and
/// layout), reads exactly as the base: over a llama GGUF file, whose Q/K rows and biases are
/// stored interleaved, the overlay interleaves the bucket's like llama.cpp's converter; over a
/// Hugging Face folder nothing moves; over a Gemma folder the norms get Gemma's one added.
#[test]
fn a_bucket_of_the_bases_own_weights_reads_as_the_base() {
    let config = config();
    let gemma = LlamaConfig { embedding_scale: Some(32f32.sqrt()), ..config.clone() };
    let ws = weights(&config, 1);
    let names: Vec<&str> = ws.iter().map(|w| w.gguf.as_str()).collect();
    let gguf_path = write_gguf(&ws, &config, false, "overlay-own.gguf");
    let gguf = GgufFile::open(&gguf_path).unwrap();
    assert!(gguf.qk_interleaved());
    let hf_dir = write_hf(&ws, "llama", "overlay-own-hf");
    let hf = HfCheckpoint::open(&hf_dir).unwrap();
    let gemma_dir = write_hf(&ws, "gemma", "overlay-own-gemma");
    let gemma_hf = HfCheckpoint::open(&gemma_dir).unwrap();
    assert_ne!(gemma_hf.rows("output_norm.weight", 0..1).unwrap(), ws[1].values);
    let bucket = bucket_of(&ws, StDType::F32, "overlay-own.safetensors");
    let bases: [(&dyn WeightSource, &LlamaConfig); 3] =
        [(&gguf, &config), (&hf, &config), (&gemma_hf, &gemma)];
    for (base, config) in bases {
        let overlay = Overlay::new(base, vec![Bucket::open(&bucket, config, base).unwrap()]);
        assert_eq!(overlay.buckets()[0].names().count(), ws.len());
        assert_reads_alike(&overlay, base, &names);
    }
    std::fs::remove_file(gguf_path).unwrap();
    std::fs::remove_dir_all(hf_dir).unwrap();
    std::fs::remove_dir_all(gemma_dir).unwrap();
    std::fs::remove_file(bucket).unwrap();
}

/// Over a GGUF file (Q8_0 MLP) and a Hugging Face folder: tensors of a bucket, named either
/// way, read as that bucket's values in the base's layout, a tensor in two buckets from the
/// later one, the others from the base; only the base's tensors are handed out quantized.
#[test]
fn overlaid_tensors_come_from_the_latest_bucket_and_the_rest_from_the_base() {
    let config = config();
    let (base_ws, first, second) = (weights(&config, 1), weights(&config, 2), weights(&config, 3));
    let gguf_path = write_gguf(&base_ws, &config, true, "overlay-latest.gguf");
    let gguf = GgufFile::open(&gguf_path).unwrap();
    let hf_dir = write_hf(&base_ws, "llama", "overlay-latest-hf");
    let hf = HfCheckpoint::open(&hf_dir).unwrap();
    let (q, up, norm, k_bias) = (
        weight(&first, "blk.0.attn_q.weight"),
        weight(&first, "blk.1.ffn_up.weight"),
        weight(&first, "output_norm.weight"),
        weight(&first, "blk.1.attn_k.bias"),
    );
    let later_q = weight(&second, "blk.0.attn_q.weight");
    let first_path = write_bucket(
        "overlay-latest-1.safetensors",
        &[
            (&q.hf(), &q.shape, &q.values),
            ("blk.1.ffn_up.weight", &up.shape, &up.values),
            (&norm.hf(), &norm.shape, &norm.values),
            ("blk.1.attn_k.bias", &k_bias.shape, &k_bias.values),
        ],
    );
    let second_path = write_bucket(
        "overlay-latest-2.safetensors",
        &[("blk.0.attn_q.weight", &later_q.shape, &later_q.values)],
    );
    let bases: [(&dyn WeightSource, bool); 2] = [(&gguf, true), (&hf, false)];
    for (base, stores_quantized) in bases {
        let mut overlay = Overlay::new(base, Vec::new());
        overlay.push(Bucket::open(&first_path, &config, base).unwrap());
        let only_first = overlay.rows("blk.0.attn_q.weight", 0..32).unwrap();
        overlay.push(Bucket::open(&second_path, &config, base).unwrap());
        let head = config.head_dim;
        let layout =
            |w: &Weight| if base.qk_interleaved() { as_gguf(w, head) } else { w.values.clone() };
        assert_eq!(only_first, layout(q));
        assert_eq!(overlay.rows("blk.0.attn_q.weight", 0..32).unwrap(), layout(later_q));
        assert_eq!(
            overlay.rows("blk.0.attn_q.weight", 16..32).unwrap(),
            layout(later_q)[16 * 32..]
        );
        assert_eq!(overlay.rows("blk.1.attn_k.bias", 0..1).unwrap(), layout(k_bias));
        assert_eq!(overlay.cols("blk.1.attn_k.bias", 2..5).unwrap(), layout(k_bias)[2..5]);
        assert_eq!(overlay.rows("blk.1.ffn_up.weight", 4..6).unwrap(), up.values[4 * 32..6 * 32]);
        let up_cols: Vec<f32> = up.values.chunks(32).flat_map(|row| row[8..16].to_vec()).collect();
        assert_eq!(overlay.cols("blk.1.ffn_up.weight", 8..16).unwrap(), up_cols);
        assert_eq!(overlay.rows("output_norm.weight", 0..1).unwrap(), norm.values);
        for untouched in ["blk.0.attn_k.weight", "blk.0.ffn_up.weight", "token_embd.weight"] {
            let rows = base.shape(untouched).unwrap()[0];
            assert_eq!(
                overlay.rows(untouched, 0..rows).unwrap(),
                base.rows(untouched, 0..rows).unwrap()
            );
        }
        assert!(!overlay.has("blk.2.attn_q.weight"));
        assert!(overlay.shape("blk.2.attn_q.weight").is_err());
        assert_eq!(overlay.qk_interleaved(), base.qk_interleaved());
        let up_stored = base.quantized("blk.1.ffn_up.weight", &Shard::Full).unwrap();
        assert_eq!(up_stored.is_some(), stores_quantized);
        assert!(overlay.quantized("blk.1.ffn_up.weight", &Shard::Full).unwrap().is_none());
        let down = overlay.quantized("blk.1.ffn_down.weight", &Shard::Rows(0..16)).unwrap();
        assert_eq!(down.is_some(), stores_quantized);
    }
    std::fs::remove_file(gguf_path).unwrap();
    std::fs::remove_dir_all(hf_dir).unwrap();
    std::fs::remove_file(first_path).unwrap();
    std::fs::remove_file(second_path).unwrap();
}

/// Phi-3's fused tensors (`qkv_proj`, `gate_up_proj`, GGUF's `attn_qkv`) update the parts the
/// model asks for: over a Phi-3 file seen through [`FusedSource`], and over a llama file,
/// where the query and key parts are interleaved like the unfused tensors.
#[test]
fn fused_tensors_update_their_parts() {
    let config = config();
    let ws = weights(&config, 4);
    // Layer `l`'s tensors `parts` one after another.
    let fuse = |l: usize, parts: &[&str]| -> Vec<f32> {
        parts
            .iter()
            .flat_map(|p| weight(&ws, &format!("blk.{l}.{p}.weight")).values.clone())
            .collect()
    };
    let qkv = |l| fuse(l, &["attn_q", "attn_k", "attn_v"]);
    let gate_up = |l| fuse(l, &["ffn_gate", "ffn_up"]);
    let fused_bucket = write_bucket(
        "overlay-fused.safetensors",
        &[
            ("model.layers.0.self_attn.qkv_proj.weight", &[64, 32], &qkv(0)),
            ("blk.1.attn_qkv.weight", &[64, 32], &qkv(1)),
            ("model.layers.1.mlp.gate_up_proj.weight", &[64, 32], &gate_up(1)),
        ],
    );
    let parts =
        [0, 1].map(|l| ["attn_q", "attn_k", "attn_v"].map(|p| format!("blk.{l}.{p}.weight")));
    let mut parts: Vec<&str> = parts.iter().flatten().map(String::as_str).collect();
    parts.extend(["blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"]);

    // A Phi-3 file of the same weights (no biases): Q/K/V and gate/up fused, rotate-half.
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("phi3".into()));
    let in_fused = ["attn_q.", "attn_k.", "attn_v.", "ffn_gate.", "ffn_up."];
    for t in ws.iter().filter(|t| !in_fused.iter().any(|f| t.gguf.contains(f))) {
        w.tensor_f32(&t.gguf, &t.shape, &t.values);
    }
    for l in 0..2 {
        w.tensor_f32(&format!("blk.{l}.attn_qkv.weight"), &[64, 32], &qkv(l));
        w.tensor_f32(&format!("blk.{l}.ffn_up.weight"), &[64, 32], &gate_up(l));
    }
    let phi3_path = temp_path("overlay-phi3.gguf");
    w.write(&phi3_path).unwrap();
    let phi3 = GgufFile::open(&phi3_path).unwrap();
    let fused_base = FusedSource::new(&phi3, &config);
    let zeroed: Vec<Weight> = ws
        .iter()
        .map(|w| Weight {
            gguf: w.gguf.clone(),
            shape: w.shape.clone(),
            values: vec![0.0; w.values.len()],
        })
        .collect();
    // Over a base of zeros, so a part read from the base would show.
    let zero_path = write_gguf(&zeroed, &config, false, "overlay-fused-zero.gguf");
    let zero = GgufFile::open(&zero_path).unwrap();
    let llama_path = write_gguf(&ws, &config, false, "overlay-fused-llama.gguf");
    let llama = GgufFile::open(&llama_path).unwrap();

    let over_phi3 =
        Overlay::new(&fused_base, vec![Bucket::open(&fused_bucket, &config, &fused_base).unwrap()]);
    assert_reads_alike(&over_phi3, &fused_base, &parts);
    let over_zero = Overlay::new(&zero, vec![Bucket::open(&fused_bucket, &config, &zero).unwrap()]);
    assert_reads_alike(&over_zero, &llama, &parts);
    std::fs::remove_file(fused_bucket).unwrap();
    std::fs::remove_file(phi3_path).unwrap();
    std::fs::remove_file(zero_path).unwrap();
    std::fs::remove_file(llama_path).unwrap();
}

/// Every way a bucket can fail to fit the model is refused with the file, the tensor and the
/// difference; bf16 and f16 buckets are read; a read outside an overlaid tensor names it.
#[test]
fn a_bucket_that_does_not_fit_the_model_is_refused_naming_file_and_tensor() {
    let config = config();
    let ws = weights(&config, 5);
    let gguf_path = write_gguf(&ws, &config, false, "overlay-errors.gguf");
    let base = GgufFile::open(&gguf_path).unwrap();
    let path = temp_path("overlay-errors.safetensors");
    let q = weight(&ws, "blk.0.attn_q.weight");
    let open = |tensors: &[Stored<'_>]| {
        let tensors: Vec<_> = tensors.iter().map(|&(n, s, v)| (n, s, StDType::F32, v)).collect();
        write_safetensors(&path, &tensors).unwrap();
        Bucket::open(&path, &config, &base).map(|_| ()).unwrap_err().to_string()
    };
    let p = path.display();
    let four = [0.0; 4];
    let cases: [(&[Stored<'_>], String); 6] = [
        (
            &[("model.layers.0.self_attn.rotary_emb.inv_freq", &[4], &four)],
            format!("bucket {p}: tensor model.layers.0.self_attn.rotary_emb.inv_freq is not one of the model's weights"),
        ),
        (
            &[("model.layers.7.mlp.up_proj.weight", &[32, 32], &q.values[..1024])],
            format!("bucket {p}: tensor model.layers.7.mlp.up_proj.weight (as blk.7.ffn_up.weight) is not one of the model's weights"),
        ),
        (
            &[("model.layers.0.self_attn.q_proj.weight", &[32, 16], &q.values[..512])],
            format!("bucket {p}: tensor model.layers.0.self_attn.q_proj.weight has shape [32, 16]; the model's is [32, 32]"),
        ),
        (
            &[("model.layers.0.self_attn.qkv_proj.weight", &[32, 32], &q.values)],
            format!("bucket {p}: tensor model.layers.0.self_attn.qkv_proj.weight has shape [32, 32]; the model's is [64, 32]"),
        ),
        (
            &[
                ("model.layers.0.self_attn.q_proj.weight", &[32, 32], &q.values),
                ("blk.0.attn_q.weight", &[32, 32], &q.values),
            ],
            format!("bucket {p}: tensors blk.0.attn_q.weight and model.layers.0.self_attn.q_proj.weight both hold the model's blk.0.attn_q.weight"),
        ),
        (
            &[
                ("model.layers.0.self_attn.k_proj.weight", &[16, 32], &q.values[..512]),
                ("model.layers.0.self_attn.qkv_proj.weight", &[64, 32], &[q.values.clone(), q.values.clone()].concat()),
            ],
            format!("bucket {p}: tensors model.layers.0.self_attn.k_proj.weight and model.layers.0.self_attn.qkv_proj.weight both hold the model's blk.0.attn_k.weight"),
        ),
    ];
    for (tensors, want) in cases {
        assert_eq!(open(tensors), want);
    }

    let header = br#"{"model.norm.weight":{"dtype":"I64","shape":[32],"data_offsets":[0,256]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend([0; 256]);
    std::fs::write(&path, &bytes).unwrap();
    let err = Bucket::open(&path, &config, &base).unwrap_err().to_string();
    assert_eq!(
        err,
        format!("safetensors {p} at offset 8: tensor `model.norm.weight`: dtype I64 is not one tpctl reads (F32, F16 and BF16 are)")
    );

    for dtype in [StDType::BF16, StDType::F16] {
        let halves = bucket_of(&ws[..3], dtype, "overlay-halves.safetensors");
        let overlay = Overlay::new(&base, vec![Bucket::open(&halves, &config, &base).unwrap()]);
        let got = overlay.rows("output.weight", 0..10).unwrap();
        crate::test_util::assert_close(&got, &ws[2].values, 1e-2);
        assert_ne!(got, ws[2].values, "{dtype:?} is rounded");
        let err = overlay.rows("output.weight", 0..11).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "tensor `output.weight`: row range 0..11 outside its 10 rows (from bucket {})",
                halves.display()
            )
        );
        let err = overlay.cols("output_norm.weight", 30..33).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "tensor `output_norm.weight`: column range 30..33 outside its 32 columns"
            ),
            "{err}"
        );
        std::fs::remove_file(halves).unwrap();
    }
    std::fs::remove_file(gguf_path).unwrap();
    std::fs::remove_file(path).unwrap();
}

/// A bucket every tensor of which later buckets hold is no longer live, under any of its
/// names (Hugging Face, GGUF, or fused parts); one that still gives a tensor stays, in order,
/// and so does one whose header cannot be read.
#[test]
fn buckets_that_later_ones_replace_are_not_live() {
    let v = [0.0f32; 4];
    let (q, k, v_) = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight");
    let q_hf = "model.layers.0.self_attn.q_proj.weight";
    let fused = "model.layers.0.self_attn.qkv_proj.weight";
    let first = write_bucket("live-1", &[(q_hf, &[2, 2], &v), ("model.norm.weight", &[4], &v)]);
    let second = write_bucket("live-2", &[(q, &[2, 2], &v)]);
    let third = write_bucket("live-3", &[("output_norm.weight", &[4], &v)]);
    let qkv = write_bucket("live-qkv", &[(fused, &[2, 2], &v)]);
    let broken = temp_path("live-broken");
    std::fs::write(&broken, b"not a safetensors file").unwrap();
    let names = bucket_tensor_names(&qkv).unwrap();
    assert_eq!(names.into_iter().collect::<Vec<_>>(), [k, q, v_]);

    let all = |ps: &[&PathBuf]| ps.iter().map(|p| (*p).clone()).collect::<Vec<_>>();
    // The first bucket's query projection is replaced, its norm not yet.
    assert_eq!(live_buckets(&all(&[&first, &second])), all(&[&first, &second]));
    assert_eq!(live_buckets(&all(&[&first, &second, &third])), all(&[&second, &third]));
    // A fused bucket replaces its parts; a later unreadable file replaces nothing.
    assert_eq!(live_buckets(&all(&[&second, &qkv, &broken])), all(&[&qkv, &broken]));
    assert_eq!(live_buckets(&all(&[&broken, &third])), all(&[&broken, &third]));
    for p in [first, second, third, qkv, broken] {
        std::fs::remove_file(p).unwrap();
    }
}

/// Gemma 2's Hugging Face block norms are its own tensors, not the llama names they share a
/// spelling with: in a Gemma 2 model `post_attention_layernorm` is `post_attention_norm` (in a
/// llama one, `ffn_norm`), and a bucket read without its model keeps such a name as stored,
/// so it is never taken for a GGUF bucket's `ffn_norm`. Gemma 3 (post-norms too) maps the
/// same way, its query/key norms included.
#[test]
fn gemma2_norm_names_map_to_gemma2_tensors() {
    let post = "model.layers.0.post_attention_layernorm.weight";
    let pre = "model.layers.1.pre_feedforward_layernorm.weight";
    assert_eq!(model_names(post, Names::Gemma2), ["blk.0.post_attention_norm.weight"]);
    assert_eq!(model_names(pre, Names::Gemma2), ["blk.1.ffn_norm.weight"]);
    assert_eq!(model_names(post, Names::Llama), ["blk.0.ffn_norm.weight"]);
    assert_eq!(model_names(post, Names::Unambiguous), [post]);
    let q = "model.layers.0.self_attn.q_proj.weight";
    for names in [Names::Llama, Names::Gemma2, Names::Unambiguous] {
        assert_eq!(model_names(q, names), ["blk.0.attn_q.weight"], "{names:?}");
    }
    // Gemma 3 has Gemma 2's names, and its query/key norms the llama table's.
    let q_norm = "model.layers.2.self_attn.q_norm.weight";
    assert_eq!(model_names(q_norm, Names::Gemma2), ["blk.2.attn_q_norm.weight"]);
    let mut gemma2 = config();
    gemma2.post_norms = true;
    assert_eq!(Names::of(&gemma2), Names::Gemma2);
    assert_eq!(Names::of(&config()), Names::Llama);

    let v = [0.0f32; 4];
    let hf = write_bucket("live-gemma2-hf", &[(post, &[4], &v)]);
    let gguf = write_bucket("live-gemma2-gguf", &[("blk.0.ffn_norm.weight", &[4], &v)]);
    let both = vec![hf.clone(), gguf.clone()];
    assert_eq!(live_buckets(&both), both, "a Gemma 2 post-attention norm is not ffn_norm");
    for p in [hf, gguf] {
        std::fs::remove_file(p).unwrap();
    }
}
