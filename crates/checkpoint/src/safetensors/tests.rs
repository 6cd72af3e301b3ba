//! Safetensors tests: half-precision tensors and slices, malformed files and missing keys.

use super::*;
use crate::test_util::temp_path;

#[test]
fn half_precision_tensors_and_slices_read_back() {
    let p = temp_path("half.safetensors");
    let x: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    write_safetensors(&p, &[("a", &[3, 4], StDType::BF16, &x), ("b", &[3, 4], StDType::F16, &x)])
        .unwrap();
    let f = SafetensorsFile::open(&p).unwrap();
    assert_eq!(f.names().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(f.elements("a", 0..12).unwrap(), x);
    assert_eq!(f.elements("b", 4..8).unwrap(), x[4..8]);
    std::fs::remove_file(p).unwrap();
}

#[test]
fn malformed_files_and_missing_keys_are_named() {
    let p = temp_path("bad.safetensors");
    std::fs::write(&p, 1000u64.to_le_bytes()).unwrap();
    let err = SafetensorsFile::open(&p).unwrap_err().to_string();
    assert!(err.contains("at offset 0: header of 1000 bytes is larger than the file"), "{err}");

    let header = br#"{"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend([0; 8]);
    std::fs::write(&p, &bytes).unwrap();
    let err = SafetensorsFile::open(&p).unwrap_err().to_string();
    assert!(
        err.contains("tensor `w`: dtype I64 is not one tpctl reads (F32, F16 and BF16 are)"),
        "{err}"
    );

    let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
        "w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend([0; 8]);
    std::fs::write(&p, &bytes).unwrap();
    let err = SafetensorsFile::open(&p).unwrap_err().to_string();
    assert!(err.ends_with("at offset 8: tensor `w`: appears twice in the header"), "{err}");

    std::fs::write(&p, [&8u64.to_le_bytes()[..], b"[1, 2]  "].concat()).unwrap();
    let err = SafetensorsFile::open(&p).unwrap_err().to_string();
    assert!(err.contains("at offset 8: header is not a json object"), "{err}");

    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header);
    bytes.extend([0; 8]);
    std::fs::write(&p, &bytes).unwrap();
    let err = SafetensorsFile::open(&p).unwrap_err().to_string();
    assert!(err.contains("tensor `w`: data") && err.contains("does not hold 16 bytes"), "{err}");
    std::fs::remove_file(&p).unwrap();

    let dir = temp_path("hf-missing");
    std::fs::create_dir_all(&dir).unwrap();
    write_safetensors(
        &dir.join("model.safetensors"),
        &[("model.norm.weight", &[2], StDType::F32, &[1.0, 1.0])],
    )
    .unwrap();
    std::fs::write(dir.join("config.json"), r#"{"hidden_size": 2}"#).unwrap();
    let ck = HfCheckpoint::open(&dir).unwrap();
    let err = ck.config().unwrap_err().to_string();
    assert_eq!(
        err,
        "metadata key `num_attention_heads`: missing from config.json or not an integer"
    );
    let err = ck.rows("blk.0.attn_q.weight", 0..1).unwrap_err().to_string();
    assert!(
        err.starts_with("tensor `model.layers.0.self_attn.q_proj.weight`: not found in"),
        "{err}"
    );
    assert_eq!(ck.rows("output_norm.weight", 0..1).unwrap(), vec![1.0, 1.0]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn every_llama_name_maps_to_its_hugging_face_name_and_back() {
    let mut names = vec!["token_embd.weight", "output_norm.weight", "output.weight"]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    for tail in ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"] {
        names.push(format!("blk.11.{tail}.weight"));
    }
    for tail in ["ffn_gate", "ffn_up", "ffn_down"] {
        names.push(format!("blk.0.{tail}.weight"));
    }
    for tail in ["attn_q", "attn_k", "attn_v"] {
        names.push(format!("blk.3.{tail}.bias"));
    }
    for tail in ["attn_q_norm", "attn_k_norm"] {
        names.push(format!("blk.5.{tail}.weight"));
    }
    for gguf in &names {
        let hf = hf_name(gguf).unwrap_or_else(|| panic!("{gguf} has no Hugging Face name"));
        assert_eq!(gguf_name(&hf).as_deref(), Some(gguf.as_str()), "{gguf} -> {hf}");
    }
    assert_eq!(hf_name("blk.11.attn_q.weight").unwrap(), "model.layers.11.self_attn.q_proj.weight");
    assert_eq!(gguf_name("lm_head.weight").unwrap(), "output.weight");
    assert_eq!(
        hf_name("blk.2.attn_k_norm.weight").unwrap(),
        "model.layers.2.self_attn.k_norm.weight"
    );
    for unknown in [
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.x.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj",
        "blk.0.attn_q.weight",
        "lm_head.bias",
    ] {
        assert_eq!(gguf_name(unknown), None, "{unknown}");
    }
}

/// A folder of Qwen3-0.6B's `config.json` (scaled down): heads wider than `hidden / heads`,
/// its rotary base, per-head query/key norms, the LM head tied as the file says; Qwen3's
/// mixture-of-experts, sliding windows and a promise of biases the folder lacks are refused
/// naming the key or tensor.
#[test]
fn qwen3_config_json_is_read_and_its_unsupported_variants_are_named() {
    let dir = temp_path("hf-qwen3-config");
    std::fs::create_dir_all(&dir).unwrap();
    write_safetensors(
        &dir.join("model.safetensors"),
        &[("model.norm.weight", &[2], StDType::F32, &[1.0, 1.0])],
    )
    .unwrap();
    let qwen3 = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": false,
        "head_dim": 16,
        "hidden_size": 32,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_scaling": null,
        "rope_theta": 1000000,
        "sliding_window": null,
        "use_sliding_window": false,
        "tie_word_embeddings": true,
        "vocab_size": 10
    });
    let config = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = qwen3.clone();
        edit(&mut json);
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
        HfCheckpoint::open(&dir).unwrap().config()
    };
    let c = config(&|_| {}).unwrap();
    assert_eq!((c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim), (32, 4, 2, 16, 16));
    assert_eq!((c.rope_theta, c.rms_eps), (1_000_000.0, 1e-6));
    assert!(c.qk_norm && c.tied_embeddings, "{c:?}");
    let qwen2 = config(&|j| j["model_type"] = "qwen2".into()).unwrap();
    assert!(!qwen2.qk_norm);
    let refusals = [
        (
            "model_type",
            serde_json::Value::from("qwen3_moe"),
            "metadata key `model_type`: `qwen3_moe` is not supported (qwen3 is)",
        ),
        (
            "use_sliding_window",
            true.into(),
            "metadata key `use_sliding_window`: sliding-window attention is not supported",
        ),
        (
            "attention_bias",
            true.into(),
            "tensor `model.layers.0.self_attn.q_proj.bias`: missing from",
        ),
    ];
    for (key, value, want) in refusals {
        let err = config(&|j| j[key] = value.clone()).unwrap_err().to_string();
        assert!(err.starts_with(want), "{key}: {err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A folder of Gemma 2 2B's `config.json` (scaled down): its soft-caps, a window on the even
/// layers, post-norms, GELU and scaled embeddings; its block norms read under Gemma 2's names
/// as `1 + w`; a query scale only where `query_pre_attn_scalar` is not the head size (27B);
/// Gemma 3n and a missing window refused by name.
#[test]
fn gemma2_config_json_and_norm_names_are_read() {
    let dir = temp_path("hf-gemma2-config");
    std::fs::create_dir_all(&dir).unwrap();
    let norms = [
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.0.post_feedforward_layernorm.weight",
    ];
    let values: Vec<[f32; 2]> = (0..4).map(|i| [i as f32, 0.5]).collect();
    let tensors: Vec<(&str, &[usize], StDType, &[f32])> =
        norms.iter().zip(&values).map(|(n, v)| (*n, &[2usize][..], StDType::F32, &v[..])).collect();
    write_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    let gemma2 = serde_json::json!({
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 36,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": 4,
        "vocab_size": 10
    });
    let config = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = gemma2.clone();
        edit(&mut json);
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
        HfCheckpoint::open(&dir).unwrap().config()
    };
    let c = config(&|_| {}).unwrap();
    assert_eq!((c.attn_softcap, c.final_softcap), (Some(50.0), Some(30.0)));
    let window = c.sliding_window.unwrap();
    assert_eq!(window.tokens, 4);
    assert!(window.slides(0) && !window.slides(1) && window.slides(2));
    assert!(c.post_norms && !c.qk_norm, "{c:?}");
    assert_eq!((c.activation, c.embedding_scale), (crate::Activation::GeluTanh, Some(6.0)));
    assert_eq!(c.query_scale, None, "query_pre_attn_scalar is the head size");
    let c = config(&|j| j["query_pre_attn_scalar"] = 9.into()).unwrap();
    assert_eq!(c.query_scale, Some(1.0 / 3.0));
    let ck = HfCheckpoint::open(&dir).unwrap();
    for (i, gguf) in
        ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"].into_iter().enumerate()
    {
        let read = ck.rows(&format!("blk.0.{gguf}.weight"), 0..1).unwrap();
        assert_eq!(read, [i as f32 + 1.0, 1.5], "{gguf} is {} plus one", norms[i]);
    }
    let err = config(&|j| j["model_type"] = "gemma3n".into()).unwrap_err().to_string();
    assert_eq!(
        err,
        "metadata key `model_type`: `gemma3n` is not supported \
         (gemma, gemma2, gemma3 and gemma3_text are)"
    );
    let err = config(&|j| j["sliding_window"] = serde_json::Value::Null).unwrap_err().to_string();
    assert!(err.contains("sliding_window"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Gemma 3 1B's `config.json` (scaled down), as transformers 4.50 writes it and as 5.x does
/// (`layer_types`, `rope_parameters`): no caps, a window on five of every six layers, the
/// global rotary base with its linear scaling and the local one, query/key norms read as
/// `1 + w`; a multimodal folder's text model (`text_config`, transformers' defaults for what
/// it leaves out, tensors under `language_model.model.` or `model.language_model.`, the vision
/// tower's left unread); layer types that are no such pattern, local rope scaling and a
/// multimodal config without `text_config` refused by name.
#[test]
fn gemma3_config_json_text_and_multimodal_are_read() {
    let dir = temp_path("hf-gemma3-config");
    std::fs::create_dir_all(&dir).unwrap();
    let write = |prefix: &str, lm_head: Option<&str>| {
        let mut names = vec![
            format!("{prefix}layers.0.self_attn.q_norm.weight"),
            format!("{prefix}layers.0.post_attention_layernorm.weight"),
            format!("{prefix}layers.0.pre_feedforward_layernorm.weight"),
            "vision_tower.vision_model.embeddings.patch_embedding.weight".to_owned(),
        ];
        names.extend(lm_head.map(str::to_owned));
        let v = [0.25f32, 0.5];
        let tensors: Vec<(&str, &[usize], StDType, &[f32])> =
            names.iter().map(|n| (n.as_str(), &[2usize][..], StDType::F32, &v[..])).collect();
        write_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    };
    write("model.", None);
    let text = serde_json::json!({
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attn_logit_softcapping": null,
        "final_logit_softcapping": null,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 13,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": { "factor": 8.0, "rope_type": "linear" },
        "rope_theta": 1000000.0,
        "sliding_window": 4,
        "sliding_window_pattern": 6,
        "vocab_size": 10
    });
    let config = |json: &serde_json::Value| {
        std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
        HfCheckpoint::open(&dir).unwrap().config()
    };
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = text.clone();
        edit(&mut json);
        config(&json)
    };
    let c = config(&text).unwrap();
    assert_eq!((c.attn_softcap, c.final_softcap, c.query_scale), (None, None, None));
    let window = c.sliding_window.unwrap();
    let global: Vec<usize> = (0..13).filter(|&l| !window.slides(l)).collect();
    assert_eq!((window.tokens, global), (4, vec![5, 11]));
    assert!(c.qk_norm && c.post_norms, "{c:?}");
    assert_eq!((c.activation, c.embedding_scale), (crate::Activation::GeluTanh, Some(8.0)));
    assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, Some(1e4)));
    let eight = [8.0f32; 8];
    assert_eq!((c.rope_of(5), c.rope_of(6)), ((1e6, Some(&eight[..])), (1e4, None)));
    let ck = HfCheckpoint::open(&dir).unwrap();
    assert_eq!(ck.rows("blk.0.attn_q_norm.weight", 0..1).unwrap(), [1.25, 1.5]);
    assert_eq!(ck.rows("blk.0.post_attention_norm.weight", 0..1).unwrap(), [1.25, 1.5]);
    assert_eq!(ck.rows("blk.0.ffn_norm.weight", 0..1).unwrap(), [1.25, 1.5]);

    // transformers 5's spelling of the same model.
    let types: Vec<&str> = (0..13)
        .map(|l| if (l + 1) % 6 == 0 { "full_attention" } else { "sliding_attention" })
        .collect();
    let v5 = edited(&|j| {
        let o = j.as_object_mut().unwrap();
        for k in ["rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"] {
            o.remove(k);
        }
        j["layer_types"] = serde_json::json!(types);
        j["rope_parameters"] = serde_json::json!({
            "full_attention": { "rope_theta": 1e6, "rope_type": "linear", "factor": 8.0 },
            "sliding_attention": { "rope_theta": 1e4, "rope_type": "default" }
        });
    })
    .unwrap();
    assert_eq!(v5, c);

    // The multimodal folder: its text model only, transformers' defaults for what its
    // text_config leaves out, either layout of tensor names.
    let multimodal = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 64, "intermediate_size": 96, "model_type": "gemma3_text",
            "num_hidden_layers": 13, "head_dim": 16, "vocab_size": 10,
            "rope_scaling": { "factor": 8.0, "rope_type": "linear" }, "sliding_window": 4
        },
        "vision_config": { "model_type": "siglip_vision_model" }
    });
    for (prefix, head) in [
        ("language_model.model.", Some("language_model.lm_head.weight")),
        ("model.language_model.", Some("lm_head.weight")),
        ("model.language_model.", None),
    ] {
        write(prefix, head);
        let lm_head = head.is_some();
        let m = config(&multimodal).unwrap();
        assert_eq!((m.n_heads, m.n_kv_heads, m.context_length), (8, 4, 131_072), "{prefix}");
        assert_eq!((m.rope_theta, m.rope_local_theta), (1e6, Some(1e4)));
        assert_eq!((m.sliding_window, m.tied_embeddings), (c.sliding_window, !lm_head));
        let ck = HfCheckpoint::open(&dir).unwrap();
        assert_eq!(ck.rows("blk.0.attn_q_norm.weight", 0..1).unwrap(), [1.25, 1.5]);
        assert_eq!(ck.has("output.weight"), lm_head, "{prefix}");
    }
    write("model.", None);

    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let refusals: [(Edit<'_>, &str); 3] = [
        (
            &|j| j["layer_types"] = serde_json::json!(["sliding_attention", "full_attention", "full_attention"]),
            "metadata key `layer_types`: [\"sliding_attention\", \"full_attention\", \"full_attention\"] is \
             not a repeating pattern",
        ),
        (
            &|j| {
                j["rope_parameters"] = serde_json::json!({
                    "sliding_attention": { "rope_theta": 1e4, "rope_type": "linear", "factor": 2.0 }
                })
            },
            "metadata key `rope_parameters.sliding_attention.rope_type`: `linear`",
        ),
        (
            &|j| *j = serde_json::json!({ "model_type": "gemma3" }),
            "metadata key `text_config`: missing, though model_type is gemma3",
        ),
    ];
    for (edit, want) in refusals {
        let err = edited(edit).unwrap_err().to_string();
        assert!(err.starts_with(want), "{err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
