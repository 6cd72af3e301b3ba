//! Weight updates through the loader: a model loaded from an [`Overlay`] of a checkpoint and
//! buckets in the Hugging Face layout computes as the checkpoint the buckets' weights come
//! from, whatever the base's convention (interleaved llama Q/K rows, quantized, Qwen2's
//! biases, Gemma's norms, Phi-3's fused projections, Qwen3's per-head query/key norms).

use crate::model::random::RandomLlama;
use crate::model::{Linear, Logits, Model, WeightForm};
use crate::test_util::{assert_close, temp_path};
use checkpoint::safetensors::{write_safetensors, HfCheckpoint, StDType};
use checkpoint::{Bucket, Checkpoint, Overlay, WeightSource};
use tensor::kernels::cpu::quant::BlockFormat;
use tensor::kernels::{Backend, Weight};

/// For each base, a bucket holding every weight of another model of the same shape (the
/// `model.safetensors` of its Hugging Face folder, as a trainer would write it): the model
/// loaded from the overlay gives the logits of that other model's own GGUF file.
#[test]
fn a_model_loaded_through_an_overlay_computes_as_the_checkpoint_the_bucket_comes_from() {
    let llama = RandomLlama::default();
    let quantized = RandomLlama { quantized: Some(BlockFormat::Q8_0), ..llama.clone() };
    let qwen2 = RandomLlama { attn_bias: true, ..llama.clone() };
    let gemma = RandomLlama { gemma: true, ..llama.clone() };
    let phi3 = RandomLlama { fused: true, ..llama.clone() };
    let qwen3 = RandomLlama { qwen3: true, ..llama.clone() };
    let shapes = [llama.clone(), quantized, qwen2, gemma, phi3, qwen3];
    for (i, shape) in shapes.into_iter().enumerate() {
        let seed = 31 + 2 * i as u64;
        let base = RandomLlama { seed, ..shape.clone() };
        let update = RandomLlama { seed: seed + 1, quantized: None, ..shape };
        let (base_path, want_path) =
            (temp_path("overlay-base.gguf"), temp_path("overlay-want.gguf"));
        base.write(&base_path).unwrap();
        update.write(&want_path).unwrap();
        // A Phi-3 file computes as the llama file of its seed, whose folder is unfused.
        let hf_dir = temp_path("overlay-update");
        RandomLlama { fused: false, ..update.clone() }.write_hf(&hf_dir, false).unwrap();

        let ck = Checkpoint::open(&base_path).unwrap();
        let config = ck.config().unwrap();
        let weights = ck.weights(&config);
        let bucket = Bucket::open(hf_dir.join("model.safetensors"), &config, &*weights).unwrap();
        let overlay = Overlay::new(&*weights, vec![bucket]);
        let got =
            Model::from_source(&overlay, config, Backend::cpu(2).unwrap(), WeightForm::Native)
                .unwrap();
        let want = Model::load_with(&want_path, 2, WeightForm::F32).unwrap();
        let toks = [4, 8, 15, 16, 23, 42];
        let pos: Vec<usize> = (0..toks.len()).collect();
        let a = got.forward(&toks, &pos, &mut got.new_cache(8), Logits::All).unwrap();
        let b = want.forward(&toks, &pos, &mut want.new_cache(8), Logits::All).unwrap();
        assert_close(a.data(), b.data(), 1e-5);
        let unchanged = Model::load_with(&base_path, 2, WeightForm::F32).unwrap();
        let c = unchanged.forward(&toks, &pos, &mut unchanged.new_cache(8), Logits::All).unwrap();
        assert!(a.data().iter().zip(c.data()).any(|(x, y)| (x - y).abs() > 1e-3), "case {i}");
        std::fs::remove_file(base_path).unwrap();
        std::fs::remove_file(want_path).unwrap();
        std::fs::remove_dir_all(hf_dir).unwrap();
    }
}

fn values(linear: &Linear) -> Vec<f32> {
    match linear.weight() {
        Weight::F32(t) => t.data().to_vec(),
        Weight::Quant(_) => panic!("loaded as f32, found quantized"),
    }
}

/// A bucket with only layer 0's query and key projections (Hugging Face names and layout)
/// over a llama GGUF file, whose Q/K rows are interleaved: the loader's query and key rows of
/// any range of heads are the bucket's for layer 0 and the file's for layer 1.
#[test]
fn query_and_key_heads_load_from_a_partial_bucket_as_the_trainer_wrote_them() {
    let base = RandomLlama { seed: 41, ..RandomLlama::default() };
    let update = RandomLlama { seed: 42, ..base.clone() };
    let (base_path, want_path) = (temp_path("overlay-qk-base.gguf"), temp_path("overlay-qk.gguf"));
    base.write(&base_path).unwrap();
    update.write(&want_path).unwrap();
    let hf_dir = temp_path("overlay-qk-update");
    update.write_hf(&hf_dir, false).unwrap();
    let hf = HfCheckpoint::open(&hf_dir).unwrap();
    let names =
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"];
    let sent: Vec<(Vec<usize>, Vec<f32>)> = ["blk.0.attn_q.weight", "blk.0.attn_k.weight"]
        .iter()
        .map(|n| {
            let shape = hf.shape(n).unwrap();
            (shape.clone(), hf.rows(n, 0..shape[0]).unwrap())
        })
        .collect();
    let bucket_path = temp_path("overlay-qk.safetensors");
    let tensors: Vec<_> = names
        .iter()
        .zip(&sent)
        .map(|(n, (shape, values))| (*n, shape.as_slice(), StDType::F32, values.as_slice()))
        .collect();
    write_safetensors(&bucket_path, &tensors).unwrap();

    let ck = Checkpoint::open(&base_path).unwrap();
    let config = ck.config().unwrap();
    let weights = ck.weights(&config);
    assert!(weights.qk_interleaved());
    let overlay =
        Overlay::new(&*weights, vec![Bucket::open(&bucket_path, &config, &*weights).unwrap()]);
    let want = Checkpoint::open(&want_path).unwrap();
    let want = want.weights(&config);
    let d = config.head_dim;
    for (tensor, heads) in [("attn_q", config.n_heads), ("attn_k", config.n_kv_heads)] {
        for range in [0..heads, 0..1, heads - 1..heads] {
            let load = |src: &dyn WeightSource, layer: usize| {
                let name = format!("blk.{layer}.{tensor}.weight");
                values(&Linear::load_qk(src, &name, range.clone(), d, WeightForm::F32).unwrap())
            };
            assert_eq!(load(&overlay, 0), load(&*want, 0), "{tensor} heads {range:?}");
            assert_eq!(load(&overlay, 1), load(&*weights, 1), "{tensor} heads {range:?}");
            assert_ne!(load(&overlay, 0), load(&*weights, 0), "{tensor} heads {range:?}");
        }
    }
    let all_heads = 0..config.n_heads;
    let q = Linear::load_qk(&overlay, "blk.0.attn_q.weight", all_heads, d, WeightForm::F32);
    assert_eq!(values(&q.unwrap()), sent[0].1, "the query rows as sent");
    std::fs::remove_file(base_path).unwrap();
    std::fs::remove_file(want_path).unwrap();
    std::fs::remove_file(bucket_path).unwrap();
    std::fs::remove_dir_all(hf_dir).unwrap();
}
