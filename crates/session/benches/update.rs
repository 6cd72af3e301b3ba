//! Weight-update benchmark: an update of the whole default model from memory (one
//! safetensors bucket of every tensor in f32 under its Hugging Face name, in `/dev/shm`, as a
//! trainer would push it) into one rank's live weights held as `tpctl` holds them (f32, in a
//! vmm `weights` allocation), against a memcpy of the live bytes measured in the same run; and
//! a reload of the same weights from the checkpoint file for comparison.
//!
//! The rank's part is what this measures (PREPARE: the shard loaded through the overlay and
//! checked; COMMIT: written over the live buffers); the protocol's round trips around it are
//! the sleep benchmark's (tens of microseconds per phase on one host). The bucket holds the
//! model's own weights, so every update must leave the live bytes as they were: checked.
//!
//! Run through `cargo xtask bench update`, which fetches the model first; the model is
//! `TPCTL_UPDATE_BENCH_MODEL`, else the default model in the cache.

use checkpoint::safetensors::{hf_name, write_safetensors, StDType};
use checkpoint::WeightSource;
use layers::model::WeightForm;
use layers::parallel::{LoadOptions, ParallelModel, Placement};
use session::model_memory::{ModelMemory, Restore, ShardOrigin};
use std::path::{Path, PathBuf};
use std::time::Instant;

mod common;
use common::{median, memcpy_time, weights_hash};

/// The model (else the default model in the cache).
const MODEL_ENV: &str = "TPCTL_UPDATE_BENCH_MODEL";
/// Timed updates of each kind; the median counts.
const ROUNDS: usize = 3;
/// The rank's compute threads, which copy an update written in place (as `--threads 2`).
const THREADS: usize = 2;

/// Writes every tensor of the GGUF `model` to `out` as f32 under its Hugging Face name, in
/// the Hugging Face layout (query and key rows not interleaved): what a trainer holds.
/// Returns the file's tensor bytes.
fn write_bucket(model: &Path, out: &Path) -> usize {
    let file = checkpoint::gguf::GgufFile::open(model).expect("open the model");
    let config = checkpoint::Checkpoint::open(model).and_then(|c| c.config()).expect("config");
    let mut tensors = Vec::new();
    for info in file.tensor_infos() {
        let t = file.tensor(&info.name).expect("a tensor");
        let mut data = t.data().to_vec();
        let qk = info.name.ends_with("attn_q.weight") || info.name.ends_with("attn_k.weight");
        if qk && file.qk_interleaved() {
            data = layers::model::linear::unpermute_rows(&data, t.row_len(), config.head_dim);
        }
        let name = hf_name(&info.name).expect("a Hugging Face name");
        tensors.push((name, t.shape().to_vec(), data));
    }
    let refs: Vec<(&str, &[usize], StDType, &[f32])> = tensors
        .iter()
        .map(|(n, s, v)| (n.as_str(), s.as_slice(), StDType::F32, v.as_slice()))
        .collect();
    write_safetensors(out, &refs).expect("write the bucket");
    tensors.iter().map(|(_, _, v)| v.len() * 4).sum()
}

fn main() {
    let model: PathBuf = match std::env::var_os(MODEL_ENV).filter(|p| !p.is_empty()) {
        Some(p) => p.into(),
        None => match checkpoint::cache::default_model_path() {
            Some(p) if p.exists() => p,
            _ => {
                eprintln!("note: no model: set {MODEL_ENV} or run `cargo xtask fetch-model`");
                return;
            }
        },
    };
    let dir = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let bucket = dir.join(format!("tpctl-update-bench-{}.safetensors", std::process::id()));
    let spill =
        std::env::temp_dir().join(format!("tpctl-update-bench-spill-{}", std::process::id()));
    std::fs::create_dir_all(&spill).expect("spill dir");

    let bucket_bytes = write_bucket(&model, &bucket);
    let placement = Placement { tp_rank: 0, tp: 1, cp_rank: 0, cp: 1 };
    let form = WeightForm::F32;
    let memory = ModelMemory::host(Some(spill.clone()), Restore::Reload, Restore::Discard)
        .expect("model memory")
        .with_threads(THREADS);
    let mut live =
        ParallelModel::load(&model, LoadOptions::new(placement).form(form)).expect("load");
    let origin = ShardOrigin::checkpoint(model.clone(), placement, form);
    memory.place_weights(&mut live, &origin).expect("place the weights");
    let live_bytes = live.weight_bytes();
    let hash = weights_hash(&live);
    let path = model.to_string_lossy().into_owned();

    // Each update pushes the bucket under a name of its own, as the control plane keeps each
    // bucket it is given; the latest one replaces every tensor of the one before.
    let mut round = 0;
    let mut bucket_of_round = || {
        round += 1;
        let kept = dir.join(format!("tpctl-update-bench-{}-{round}", std::process::id()));
        std::fs::hard_link(&bucket, &kept).expect("link the bucket");
        kept
    };
    let mut live_bucket: Option<PathBuf> = None;
    let mut timed = |from_memory: bool| -> f64 {
        let v = (0..ROUNDS)
            .map(|_| {
                let kept = from_memory.then(&mut bucket_of_round);
                let tensors: Vec<String> =
                    kept.iter().map(|p| p.to_string_lossy().into_owned()).collect();
                let t = Instant::now();
                memory.prepare_update_with(&path, &tensors).expect("prepare the update");
                memory.update().expect("commit the update");
                let s = t.elapsed().as_secs_f64();
                if let Some(new) = memory.take_new_weights() {
                    live.adopt_weights(new).expect("adopt the weights");
                }
                assert_eq!(weights_hash(&live), hash, "the update changed the weights");
                // The bucket it replaced goes now, as the control plane settles an update.
                if let Some(old) = std::mem::replace(&mut live_bucket, kept) {
                    let _ = std::fs::remove_file(old);
                }
                s
            })
            .collect();
        median(v)
    };
    let from_memory = timed(true);
    let from_file = timed(false);
    let memcpy = memcpy_time(live_bytes);
    let _ = std::fs::remove_file(&bucket);
    if let Some(kept) = live_bucket {
        let _ = std::fs::remove_file(kept);
    }
    let _ = std::fs::remove_dir_all(&spill);
    let ms = |s: f64| (s * 1e4).round() / 10.0;
    println!(
        "{{\"mode\":\"update\",\"model\":\"{}\",\"live_bytes\":{live_bytes},\"bucket_bytes\":{bucket_bytes},\"from_memory_ms\":{},\"from_file_ms\":{},\"memcpy_ms\":{},\"ratio\":{:.2},\"file_ratio\":{:.2}}}",
        model.file_name().map(|f| f.to_string_lossy()).unwrap_or_default(),
        ms(from_memory),
        ms(from_file),
        ms(memcpy),
        from_memory / memcpy,
        from_file / memcpy,
    );
}
