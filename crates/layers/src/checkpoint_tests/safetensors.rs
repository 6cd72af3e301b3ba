//! A Hugging Face folder against the GGUF file of the same random model: the same logits,
//! sharded indexes, rope scaling from `config.json`.

use crate::model::random::RandomLlama;
use crate::model::{Logits, Model, WeightForm};
use crate::test_util::temp_path;
use checkpoint::safetensors::HfCheckpoint;
use std::path::PathBuf;

/// Writes `spec` as GGUF and as a Hugging Face folder ([`RandomLlama::write_hf`]); returns
/// both paths.
fn write_both(spec: &RandomLlama, stem: &str, shards: bool) -> (PathBuf, PathBuf) {
    let gguf = temp_path(&format!("{stem}.gguf"));
    spec.write(&gguf).unwrap();
    let dir = temp_path(stem);
    spec.write_hf(&dir, shards).unwrap();
    (gguf, dir)
}

#[test]
fn a_hugging_face_folder_and_its_gguf_give_the_same_logits() {
    for (spec, shards) in [
        (RandomLlama { seed: 21, ..RandomLlama::default() }, false),
        (RandomLlama { seed: 22, untied_head: true, kv_heads: 1, ..RandomLlama::default() }, true),
        (RandomLlama { seed: 23, attn_bias: true, ..RandomLlama::default() }, false),
        (RandomLlama { seed: 24, gemma: true, ..RandomLlama::default() }, false),
        (RandomLlama { seed: 25, qwen3: true, ..RandomLlama::default() }, true),
        (
            RandomLlama {
                seed: 27,
                longrope: Some(checkpoint::config::LongRope {
                    short: (0..8).map(|i| 1.0 + i as f32 * 0.1).collect(),
                    long: (0..8).map(|i| 1.0 + i as f32 * 3.0).collect(),
                    original_context: 64,
                    attn_factor: 1.2,
                }),
                ..RandomLlama::default()
            },
            false,
        ),
        (
            RandomLlama {
                seed: 26,
                qwen3: true,
                attn_bias: true,
                head_dim: Some(24),
                untied_head: true,
                ..RandomLlama::default()
            },
            false,
        ),
    ] {
        let (gguf, dir) = write_both(&spec, &format!("hf-{}", spec.seed), shards);
        let from_gguf = Model::load_with(&gguf, 2, WeightForm::F32).unwrap();
        let from_hf = Model::load_with(&dir, 2, WeightForm::F32).unwrap();
        assert_eq!(from_hf.config(), from_gguf.config());
        let toks = [4, 8, 15, 16, 23, 42];
        let pos: Vec<usize> = (0..toks.len()).collect();
        let a = from_gguf.forward(&toks, &pos, &mut from_gguf.new_cache(8), Logits::All).unwrap();
        let b = from_hf.forward(&toks, &pos, &mut from_hf.new_cache(8), Logits::All).unwrap();
        crate::test_util::assert_close(b.data(), a.data(), 1e-5);
        std::fs::remove_file(gguf).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// `rope_scaling` of kind llama3 gives Llama 3's frequency factors, linear one factor
/// everywhere, and another kind is refused by its key.
#[test]
fn rope_scaling_in_config_json_sets_the_frequency_factors() {
    let spec = RandomLlama::default();
    let (_, dir) = write_both(&spec, "rope-scaling", false);
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let head = spec.hidden / spec.heads;
    let cases = [
        (
            serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            Ok(Some(checkpoint::config::llama3_rope_factors(10_000.0, head, 8.0, 1.0, 4.0, 64.0))),
        ),
        (serde_json::json!({"type": "linear", "factor": 2.0}), Ok(Some(vec![2.0; head / 2]))),
        (serde_json::Value::Null, Ok(None)),
        (serde_json::json!({"rope_type": "yarn", "factor": 4.0}), Err("rope_scaling.rope_type")),
    ];
    for (scaling, want) in cases {
        json["rope_scaling"] = scaling.clone();
        std::fs::write(&config, json.to_string()).unwrap();
        let got = HfCheckpoint::open(&dir).and_then(|ck| ck.config());
        match want {
            Ok(factors) => assert_eq!(got.unwrap().rope_freq_factors, factors, "{scaling}"),
            Err(key) => {
                let err = got.unwrap_err().to_string();
                assert!(err.contains(key), "{scaling}: {err}");
            }
        }
    }
}

/// `rope_scaling` of type longrope: the long factors when `max_position_embeddings` exceeds
/// `original_max_position_embeddings` (beside `rope_scaling` or in it), else the short; the
/// attention factor from `attention_factor` or else `sqrt(1 + ln(s) / ln(original))`; factor
/// lists of another length than the rotated pairs (Phi-4-mini's `partial_rotary_factor`
/// counts) and a missing list or original context are refused by their key.
#[test]
fn longrope_in_config_json_picks_the_factors_by_the_context() {
    let spec = RandomLlama::default();
    let (_, dir) = write_both(&spec, "longrope-json", false);
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let short: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 * 0.1).collect();
    let long: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 * 2.0).collect();
    let read = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = base.clone();
        json["rope_scaling"] =
            serde_json::json!({"type": "longrope", "short_factor": short, "long_factor": long});
        json["original_max_position_embeddings"] = 64.into();
        edit(&mut json);
        std::fs::write(&config, json.to_string()).unwrap();
        HfCheckpoint::open(&dir).and_then(|ck| ck.config())
    };
    let c = read(&|_| {}).unwrap();
    assert_eq!(c.rope_freq_factors.as_deref(), Some(&long[..]));
    let want = (1.0 + 4f64.ln() / 64f64.ln()).sqrt() as f32;
    assert_eq!(c.rope_attn_factor, Some(want));
    assert_eq!(c.longrope.as_ref().map(|r| r.original_context), Some(64));
    assert_eq!(c.for_context(64).rope_freq_factors.as_deref(), Some(&short[..]));
    let c = read(&|j| {
        j["rope_scaling"]["rope_type"] = "longrope".into();
        j["rope_scaling"]["original_max_position_embeddings"] = 256.into();
        j["rope_scaling"]["attention_factor"] = 1.5.into();
    })
    .unwrap();
    assert_eq!(c.rope_freq_factors.as_deref(), Some(&short[..]));
    assert_eq!(c.rope_attn_factor, Some(1.5));
    let c = read(&|j| j["original_max_position_embeddings"] = 256.into()).unwrap();
    assert_eq!((c.rope_freq_factors.as_deref(), c.rope_attn_factor), (Some(&short[..]), None));
    // Half of each head rotated: 4 pairs.
    let c = read(&|j| {
        j["partial_rotary_factor"] = 0.5.into();
        j["rope_scaling"]["short_factor"] = serde_json::json!([1.0, 1.0, 1.0, 1.0]);
        j["rope_scaling"]["long_factor"] = serde_json::json!([1.0, 2.0, 3.0, 4.0]);
    })
    .unwrap();
    assert_eq!((c.rope_dim, c.rope_freq_factors), (8, Some(vec![1.0, 2.0, 3.0, 4.0])));

    let err = |edit: &dyn Fn(&mut serde_json::Value)| read(edit).unwrap_err().to_string();
    assert_eq!(
        err(&|j| j["rope_scaling"]["long_factor"] = serde_json::json!([1.0, 2.0, 3.0])),
        "metadata key `rope_scaling.long_factor`: 3 factors for 8 rotated pairs, all positive"
    );
    assert_eq!(
        err(&|j| j["partial_rotary_factor"] = 0.5.into()),
        "metadata key `rope_scaling.short_factor`: 8 factors for 4 rotated pairs, all positive"
    );
    let missing = err(&|j| {
        j["rope_scaling"].as_object_mut().unwrap().remove("short_factor");
    });
    assert!(missing.contains("`rope_scaling.short_factor`"), "{missing}");
    let no_original = err(&|j| {
        j.as_object_mut().unwrap().remove("original_max_position_embeddings");
    });
    assert!(no_original.contains("`original_max_position_embeddings`"), "{no_original}");
    std::fs::remove_dir_all(dir).unwrap();
}
