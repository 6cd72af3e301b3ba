//! Gemma 3's `config.json` brought to the keys the Hugging Face reader knows: the text model's
//! config (a multimodal folder's `text_config`), transformers' defaults for keys it leaves out,
//! the rope of each layer type and the pattern of sliding layers.
//!
//! Facts from transformers' `Gemma3TextConfig` and `modeling_gemma3`: layer `i` slides unless
//! `(i + 1) % sliding_window_pattern == 0` (`layer_types` spells it out in newer configs); the
//! global layers rotate with `rope_theta` and `rope_scaling`, the sliding ones with
//! `rope_local_base_freq` unscaled (newer configs: `rope_parameters.full_attention` and
//! `rope_parameters.sliding_attention`); queries are scaled by `query_pre_attn_scalar^-0.5`.

use crate::error::{Error, Result};
use serde_json::{json, Map, Value};

/// Transformers' `Gemma3TextConfig` defaults, for the keys a config may leave out (the
/// multimodal 4B, 12B and 27B folders give only a few in their `text_config`).
fn defaults() -> [(&'static str, Value); 14] {
    [
        ("vocab_size", json!(262_208)),
        ("hidden_size", json!(2304)),
        ("intermediate_size", json!(9216)),
        ("num_hidden_layers", json!(26)),
        ("num_attention_heads", json!(8)),
        ("num_key_value_heads", json!(4)),
        ("head_dim", json!(256)),
        ("max_position_embeddings", json!(131_072)),
        ("rms_norm_eps", json!(1e-6)),
        ("rope_theta", json!(1_000_000.0)),
        ("rope_local_base_freq", json!(10_000.0)),
        ("query_pre_attn_scalar", json!(256)),
        ("sliding_window", json!(4096)),
        ("sliding_window_pattern", json!(6)),
    ]
}

/// The text model's config of a Gemma 3 `config.json` (`model_type` `gemma3_text`, or
/// `gemma3` with a `text_config`; the vision tower's config is not read), with the defaults
/// filled in, `rope_parameters` spelled as `rope_theta`, `rope_scaling` and
/// `rope_local_base_freq`, and `layer_types` as `sliding_window_pattern`.
///
/// # Errors
/// [`Error::Metadata`] naming the key that is missing or not Gemma 3's: a multimodal config
/// without `text_config`, `layer_types` that are not a repeating pattern of sliding layers
/// ending in one full one, local rope scaling.
pub(super) fn text_config(raw: &Value, model_type: &str) -> Result<Value> {
    let text = if model_type == "gemma3" {
        raw.get("text_config").filter(|v| v.is_object()).ok_or_else(|| {
            Error::metadata("text_config", "missing, though model_type is gemma3 (multimodal)")
        })?
    } else {
        raw
    };
    let mut cfg: Map<String, Value> = text.as_object().cloned().unwrap_or_default();
    if model_type == "gemma3" {
        // A multimodal folder ties its head at the top level.
        if let Some(tie) = raw.get("tie_word_embeddings") {
            cfg.entry("tie_word_embeddings").or_insert_with(|| tie.clone());
        }
    }
    if let Some(params) = cfg.get("rope_parameters").filter(|v| !v.is_null()).cloned() {
        rope_parameters(&params, &mut cfg)?;
    }
    if cfg.get("sliding_window_pattern").is_none() {
        if let Some(p) = cfg.get("_sliding_window_pattern").cloned() {
            cfg.insert("sliding_window_pattern".into(), p);
        }
    }
    if let Some(types) = cfg.get("layer_types").filter(|v| !v.is_null()) {
        let pattern = pattern_of(types)?;
        cfg.insert("sliding_window_pattern".into(), json!(pattern));
    }
    for (key, value) in defaults() {
        if cfg.get(key).is_none_or(Value::is_null) {
            cfg.insert(key.into(), value);
        }
    }
    Ok(Value::Object(cfg))
}

/// Newer configs' per-layer-type rope (`rope_parameters.full_attention`,
/// `.sliding_attention`) as the older keys.
fn rope_parameters(params: &Value, cfg: &mut Map<String, Value>) -> Result<()> {
    let theta = |kind: &str| -> Result<Option<Value>> {
        match params.get(kind) {
            None => Ok(None),
            Some(p) => p.get("rope_theta").cloned().map(Some).ok_or_else(|| {
                Error::metadata(&format!("rope_parameters.{kind}.rope_theta"), "missing")
            }),
        }
    };
    if let Some(t) = theta("full_attention")? {
        cfg.insert("rope_theta".into(), t);
        let full = &params["full_attention"];
        let kind = full.get("rope_type").and_then(Value::as_str).unwrap_or("default");
        if kind != "default" {
            cfg.insert("rope_scaling".into(), full.clone());
        }
    }
    if let Some(t) = theta("sliding_attention")? {
        cfg.insert("rope_local_base_freq".into(), t);
        let local = &params["sliding_attention"];
        let kind = local.get("rope_type").and_then(Value::as_str).unwrap_or("default");
        if kind != "default" {
            return Err(Error::metadata(
                "rope_parameters.sliding_attention.rope_type",
                format!("`{kind}`: Gemma 3's local layers rotate unscaled"),
            ));
        }
    }
    Ok(())
}

/// The pattern `p` of `layer_types`: layer `i` is `full_attention` exactly when
/// `(i + 1) % p == 0`, every other layer `sliding_attention`.
fn pattern_of(types: &Value) -> Result<usize> {
    let key = "layer_types";
    let types: Vec<&str> = types
        .as_array()
        .and_then(|a| a.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
        .ok_or_else(|| Error::metadata(key, "not a list of layer types"))?;
    if let Some(other) =
        types.iter().find(|t| !matches!(**t, "sliding_attention" | "full_attention"))
    {
        return Err(Error::metadata(key, format!("unknown layer type `{other}`")));
    }
    let pattern = match types.iter().position(|t| *t == "full_attention") {
        Some(first) => first + 1,
        // No global layer among them: any pattern longer than the model says so.
        None => types.len() + 1,
    };
    let fits =
        types.iter().enumerate().all(|(i, t)| (*t == "full_attention") == ((i + 1) % pattern == 0));
    if !fits {
        return Err(Error::metadata(
            key,
            format!(
                "{types:?} is not a repeating pattern of sliding layers ending in one full \
                 layer, the one kind of layer mix supported"
            ),
        ));
    }
    Ok(pattern)
}
