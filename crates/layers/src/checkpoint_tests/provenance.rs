//! The weight map against the loader: writing a bucket's tensors into a live shard's buffers
//! through [`ParallelModel::weight_map`] gives, bit for bit, the buffers of the shard loaded
//! from the checkpoint with the bucket laid over it, on every rank of every TP size (with
//! more ranks than KV heads too), for each architecture's conventions.

use crate::model::provenance::BufferSource;
use crate::model::random::RandomLlama;
use crate::model::WeightForm;
use crate::parallel::{LoadOptions, ParallelModel, Placement};
use crate::test_util::temp_path;
use checkpoint::safetensors::{write_safetensors, HfCheckpoint, StDType};
use checkpoint::{Bucket, Checkpoint, LlamaConfig, Overlay, WeightSource};
use std::path::Path;
use tensor::kernels::cpu::quant::BlockFormat;

fn floats(buffers: Vec<&[u8]>) -> Vec<Vec<u32>> {
    let bits = |b: &[u8]| -> Vec<u32> {
        b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    buffers.into_iter().map(bits).collect()
}

/// Layer 0's query, key and value projections of the Hugging Face folder `hf`, fused into
/// Phi-3's `qkv_proj` and negated (so they differ from the first bucket's), written to `out`.
fn fused_bucket(hf: &Path, out: &Path) {
    let file = HfCheckpoint::open(hf).unwrap();
    let mut values = Vec::new();
    let mut rows = 0;
    let mut cols = 0;
    for part in ["attn_q", "attn_k", "attn_v"] {
        let name = format!("blk.0.{part}.weight");
        let shape = file.shape(&name).unwrap();
        let all = file.rows(&name, 0..shape[0]).unwrap();
        values.extend(all.into_iter().map(|v| -v));
        (rows, cols) = (rows + shape[0], shape[1]);
    }
    let name = "model.layers.0.self_attn.qkv_proj.weight";
    write_safetensors(out, &[(name, &[rows, cols][..], StDType::F32, &values[..])]).unwrap();
}

fn open_buckets(paths: &[&Path], config: &LlamaConfig, base: &dyn WeightSource) -> Vec<Bucket> {
    paths.iter().map(|p| Bucket::open(p, config, base).unwrap()).collect()
}

#[test]
fn the_weight_map_writes_a_bucket_as_the_loader_loads_it_on_every_rank() {
    let llama = RandomLlama::default();
    let shapes = [
        ("llama", llama.clone()),
        ("untied head", RandomLlama { untied_head: true, ..llama.clone() }),
        ("qwen2 biases", RandomLlama { attn_bias: true, ..llama.clone() }),
        ("gemma", RandomLlama { gemma: true, ..llama.clone() }),
        ("phi3", RandomLlama { fused: true, ..llama.clone() }),
        ("qwen3", RandomLlama { qwen3: true, ..llama.clone() }),
    ];
    for (i, (case, shape)) in shapes.into_iter().enumerate() {
        let seed = 71 + 2 * i as u64;
        let base = RandomLlama { seed, ..shape.clone() };
        let update = RandomLlama { seed: seed + 1, fused: false, ..shape };
        let base_path = temp_path("map-base.gguf");
        base.write(&base_path).unwrap();
        let hf = temp_path("map-update");
        update.write_hf(&hf, false).unwrap();
        let fused = temp_path("map-fused.safetensors");
        fused_bucket(&hf, &fused);
        let bucket_paths = [hf.join("model.safetensors"), fused.clone()];
        let bucket_paths: Vec<&Path> = bucket_paths.iter().map(|p| p.as_path()).collect();

        let ck = Checkpoint::open(&base_path).unwrap();
        let config = ck.config().unwrap();
        let weights = ck.weights(&config);
        for tp in [1, 2, 4] {
            for tp_rank in 0..tp {
                let at = format!("{case}, TP rank {tp_rank} of {tp}");
                let placement = Placement { tp_rank, tp, cp_rank: 0, cp: 1 };
                let opts = || LoadOptions::new(placement).threads(1).form(WeightForm::F32);
                let live = ParallelModel::from_source(&*weights, config.clone(), opts()).unwrap();
                let map = live.weight_map();
                assert_eq!(map.buffers().len(), live.weight_buffers().len(), "{at}");
                assert!(map.buffers().iter().all(|b| matches!(b, BufferSource::F32(_))), "{at}");
                let buckets = open_buckets(&bucket_paths, &config, &*weights);
                for name in buckets.iter().flat_map(|b| b.names()) {
                    assert!(map.places(name), "{at}: {name} is not placed");
                }
                let mut got = floats(live.weight_buffers());
                let mut written = 0;
                for (index, bits) in got.iter_mut().enumerate() {
                    let mut values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
                    written += map.write(&buckets, index, &mut values).unwrap();
                    *bits = values.iter().map(|v| v.to_bits()).collect();
                }
                let overlay = Overlay::new(&*weights, buckets);
                let want = ParallelModel::from_source(&overlay, config.clone(), opts()).unwrap();
                assert_eq!(got, floats(want.weight_buffers()), "{at}");
                // Every value of the shard came from the bucket (it holds every tensor).
                let values = live.weight_buffers().iter().map(|b| b.len() / 4).sum::<usize>();
                assert_eq!(written, values, "{at}");
                let unchanged = floats(live.weight_buffers());
                assert_ne!(got, unchanged, "{at}: the bucket changed nothing");
            }
        }
        std::fs::remove_file(base_path).unwrap();
        std::fs::remove_file(fused).unwrap();
        std::fs::remove_dir_all(hf).unwrap();
    }
}

/// A shard that keeps its projections quantized places only its f32 buffers (norms): the
/// quantized ones are another form, which only a load rebuilds.
#[test]
fn a_quantized_shard_places_only_its_f32_buffers() {
    let base = RandomLlama { quantized: Some(BlockFormat::Q8_0), seed: 91, ..Default::default() };
    let path = temp_path("map-quantized.gguf");
    base.write(&path).unwrap();
    let opts = LoadOptions::new(Placement::single()).threads(1).form(WeightForm::Native);
    let live = ParallelModel::load(&path, opts).unwrap();
    let map = live.weight_map();
    assert!(map.places("blk.0.attn_norm.weight"));
    assert!(map.places("output_norm.weight"));
    for name in ["blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"] {
        assert!(!map.places(name), "{name}");
    }
    assert!(map.buffers().contains(&BufferSource::Other));
    std::fs::remove_file(path).unwrap();
}
