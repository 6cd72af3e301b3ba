//! Writes a random-weight model of an architecture as GGUF and prints tpctl's logits at every
//! position of a prompt, for `cargo xtask bench agree --random` to compare with llama.cpp's on
//! the same file (`scripts/llamacpp_logits.py`).
//!
//! Usage: `random_logits ARCH OUT.gguf TP CP ID...` (ARCH: `gemma2`, `gemma3`, `qwen3`, `phi3`); prints one JSON line
//! `{"vocab": V, "logits": [[...] per position]}` from the rank at TP 0 and CP 0.

use checkpoint::config::{longrope_attn_factor, LongRope};
use layers::model::random::{Gemma2, Gemma3, RandomLlama};
use layers::model::WeightForm;
use layers::parallel::{Comms, LoadOptions, ParallelModel, Placement};
use layers::Logits;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [arch, out, tp, cp, ids @ ..] = &args[..] else {
        return Err("usage: random_logits ARCH OUT.gguf TP CP ID...".into());
    };
    let spec = match arch.as_str() {
        // Uneven heads, a window of 4 on layers 0 and 2 so a 12-token prompt leaves it, caps
        // the random scores and logits reach.
        "gemma2" => RandomLlama {
            gemma2: Some(Gemma2::default()),
            layers: 3,
            heads: 6,
            kv_heads: 3,
            hidden: 48,
            ffn: 64,
            vocab: 40,
            seed: 35,
            ..RandomLlama::default()
        },
        // Uneven heads, 7 layers so layer 5 is global (its rotary base 1e6, scaled by 4) among
        // local ones (base 1e4, a window of 4 that a 12-token prompt leaves), query/key norms.
        "gemma3" => RandomLlama {
            gemma3: Some(Gemma3 { window: 4, rope_scale: Some(4.0) }),
            layers: 7,
            heads: 6,
            kv_heads: 3,
            hidden: 48,
            ffn: 64,
            vocab: 40,
            seed: 36,
            ..RandomLlama::default()
        },
        // Uneven heads wider than hidden / heads (12 x 6 = 72 over a hidden size of 48, as
        // Qwen3's heads of 128 are wider than its hidden size over its heads), query/key norms.
        "qwen3" => RandomLlama {
            qwen3: true,
            layers: 3,
            heads: 6,
            kv_heads: 3,
            hidden: 48,
            head_dim: Some(12),
            ffn: 64,
            vocab: 40,
            seed: 37,
            ..RandomLlama::default()
        },
        // Fused QKV and gate/up, longrope past an original context of 32 (llama.cpp's context
        // of 64 and the file's of 256 both pick the long factors, far from 1).
        "phi3" => RandomLlama {
            fused: true,
            longrope: Some(LongRope {
                short: vec![1.0, 1.05, 1.1, 1.2],
                long: vec![1.0, 3.0, 7.0, 19.0],
                original_context: 32,
                attn_factor: longrope_attn_factor(256, 32),
            }),
            layers: 3,
            heads: 6,
            kv_heads: 3,
            hidden: 48,
            ffn: 64,
            vocab: 40,
            seed: 38,
            ..RandomLlama::default()
        },
        other => return Err(format!("no random model for architecture `{other}`").into()),
    };
    let path = PathBuf::from(out);
    spec.write(&path)?;
    let (tp, cp): (usize, usize) = (tp.parse()?, cp.parse()?);
    let prompt: Vec<u32> = ids.iter().map(|i| i.parse()).collect::<Result<_, _>>()?;
    let opts = collectives::ShmOptions { slot_bytes: 64 << 10, ring_bytes: 16 << 10 };
    let comms = collectives::local::mesh(tp, cp, opts)?;
    let logits = std::thread::scope(|s| {
        let runs: Vec<_> = comms
            .into_iter()
            .map(|(mut tpc, mut cpc)| {
                let (path, prompt) = (&path, &prompt);
                s.spawn(move || -> Result<Vec<f32>, layers::Error> {
                    let mut comms = Comms { tp: &mut tpc, cp: &mut cpc };
                    let placement = Placement::of(&comms);
                    let opts = LoadOptions::new(placement).form(WeightForm::F32);
                    let model = ParallelModel::load(path, opts)?;
                    let mut cache = model.new_cache(prompt.len());
                    let logits = model.forward(&mut comms, prompt, &mut cache, Logits::All)?;
                    Ok(logits.host()?.to_vec())
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().expect("a rank panicked")).next()
    });
    let logits = logits.ok_or("no ranks")??;
    let rows: Vec<&[f32]> = logits.chunks(spec.vocab).collect();
    let json = format!(
        "{{\"vocab\": {}, \"logits\": [{}]}}",
        spec.vocab,
        rows.iter()
            .map(|r| format!("[{}]", r.iter().map(f32::to_string).collect::<Vec<_>>().join(",")))
            .collect::<Vec<_>>()
            .join(",")
    );
    println!("{json}");
    Ok(())
}
