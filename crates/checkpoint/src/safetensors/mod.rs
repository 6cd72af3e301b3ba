//! Hugging Face checkpoints: `.safetensors` files (one, or several listed in
//! `model.safetensors.index.json`) plus `config.json`, as a [`WeightSource`].
//!
//! Weights keep their Hugging Face names on disk; [`HfCheckpoint`] maps the GGUF llama names
//! the model asks for (`blk.0.attn_q.weight`) onto them (`model.layers.0.self_attn.q_proj.weight`).
//! Hugging Face stores Q/K rows in the rotate-half layout, so nothing is un-permuted.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::source::WeightSource;
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

mod gemma3;

/// Element types a safetensors tensor can be read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StDType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
}

impl StDType {
    /// The element type a name gives: safetensors' (`F32`, `F16`, `BF16`) or PyTorch's
    /// (`float32`, `torch.bfloat16`, `half`, ...); `None` for any other.
    pub fn from_name(name: &str) -> Option<StDType> {
        let n = name.trim();
        match n.strip_prefix("torch.").unwrap_or(n).to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Some(StDType::F32),
            "f16" | "float16" | "half" => Some(StDType::F16),
            "bf16" | "bfloat16" => Some(StDType::BF16),
            _ => None,
        }
    }

    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            StDType::F32 => 4,
            StDType::F16 | StDType::BF16 => 2,
        }
    }

    /// The name safetensors headers give it.
    pub fn name(self) -> &'static str {
        match self {
            StDType::F32 => "F32",
            StDType::F16 => "F16",
            StDType::BF16 => "BF16",
        }
    }
}

#[derive(Clone, Debug)]
struct StInfo {
    dtype: StDType,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    bytes: Range<usize>,
}

/// A safetensors header's entries in file order, a name given twice kept twice (parsed as a
/// JSON map, the second would silently replace the first).
struct HeaderEntries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for HeaderEntries {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = HeaderEntries;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a json object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(HeaderEntries(entries))
            }
        }
        de.deserialize_map(Entries)
    }
}

/// One memory-mapped `.safetensors` file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    map: memmap2::Mmap,
    tensors: BTreeMap<String, StInfo>,
}

impl SafetensorsFile {
    /// Opens and indexes `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be mapped; [`Error::Safetensors`]
    /// with the offset when the header is malformed or a tensor lies outside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let map = crate::mmap::map(&path)?;
        let err = |offset: usize, message: String| Error::Safetensors {
            path: path.clone(),
            offset: offset as u64,
            message,
        };
        if map.len() < 8 {
            return Err(err(0, format!("file of {} bytes has no header length", map.len())));
        }
        let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
        if n > map.len() - 8 {
            return Err(err(0, format!("header of {n} bytes is larger than the file")));
        }
        let HeaderEntries(entries) = serde_json::from_slice(&map[8..8 + n])
            .map_err(|e| err(8, format!("header is not a json object: {e}")))?;
        let base = 8 + n;
        let mut tensors = BTreeMap::new();
        for (name, v) in &entries {
            if name == "__metadata__" {
                continue;
            }
            let bad = |what: &str| err(8, format!("tensor `{name}`: {what}"));
            let dtype = match v.get("dtype").and_then(|d| d.as_str()) {
                Some("F32") => StDType::F32,
                Some("F16") => StDType::F16,
                Some("BF16") => StDType::BF16,
                Some(other) => {
                    return Err(bad(&format!(
                        "dtype {other} is not one tpctl reads (F32, F16 and BF16 are)"
                    )))
                }
                None => return Err(bad("missing or bad dtype")),
            };
            let shape: Vec<usize> = v
                .get("shape")
                .and_then(|s| s.as_array())
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
                .ok_or_else(|| bad("missing or bad shape"))?;
            let offs: Vec<usize> = v
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
                .filter(|o: &Vec<usize>| o.len() == 2)
                .ok_or_else(|| bad("missing or bad data_offsets"))?;
            let want = shape.iter().try_fold(dtype.size(), |a, &d| a.checked_mul(d));
            let (start, end) = (base.saturating_add(offs[0]), base.saturating_add(offs[1]));
            let fits = |w: usize| offs[0] <= offs[1] && end <= map.len() && end - start == w;
            if !want.is_some_and(fits) {
                let want =
                    want.map_or_else(|| "an impossible number of".to_owned(), |w| w.to_string());
                return Err(bad(&format!(
                    "data {start}..{end} does not hold {want} bytes inside the file ({} bytes)",
                    map.len()
                )));
            }
            if tensors.insert(name.clone(), StInfo { dtype, shape, bytes: start..end }).is_some() {
                return Err(bad("appears twice in the header"));
            }
        }
        Ok(SafetensorsFile { path, map, tensors })
    }

    /// The tensor names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shape of tensor `name`, outermost first.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the file has no such tensor.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.info(name)?.shape)
    }

    fn info(&self, name: &str) -> Result<&StInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| Error::tensor(name, format!("not found in {}", self.path.display())))
    }

    /// Elements `range` (flat, row-major) of tensor `name`, as f32.
    pub(crate) fn elements(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>> {
        let mut out = vec![0.0; range.len()];
        self.elements_into(name, range, &mut out)?;
        Ok(out)
    }

    /// Elements `range` (flat, row-major, in bounds) of tensor `name`, converted to f32 into
    /// `dst` (of `range.len()` values) straight from the mapped file.
    pub(crate) fn elements_into(
        &self,
        name: &str,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<()> {
        let info = self.info(name)?;
        let sz = info.dtype.size();
        let bytes =
            &self.map[info.bytes.start + range.start * sz..info.bytes.start + range.end * sz];
        debug_assert_eq!(dst.len(), range.len());
        match info.dtype {
            // A plain loop over fixed-size chunks compiles to a vector copy; reading the
            // mapped pages beats `pread` into `dst` on the machines measured (a bucket in
            // `/dev/shm`: 2x a memcpy against 5x).
            StDType::F32 => {
                for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            StDType::F16 => {
                for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            StDType::BF16 => {
                for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
        Ok(())
    }
}

/// Whole-model tensors: (GGUF name, Hugging Face name).
const MODEL_NAMES: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// Tensors of a block, after `blk.N.` and `model.layers.N.`: (GGUF name, Hugging Face name).
const LAYER_NAMES: [(&str, &str); 14] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// Gemma 2's (and Gemma 3's) block norms whose Hugging Face names differ from the llama names
/// above (its `post_attention_layernorm` follows attention, and the MLP's pre-norm has its own
/// name).
const GEMMA2_LAYER_NAMES: [(&str, &str); 3] = [
    ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
];

/// Maps a name through one of the tables: `from` picks the side it is on, the other side is
/// returned; block tensors keep their layer number under the other prefix.
fn map_name(
    name: &str,
    (from_prefix, to_prefix): (&str, &str),
    side: impl Fn(&(&'static str, &'static str)) -> (&'static str, &'static str),
) -> Option<String> {
    if let Some((_, to)) = MODEL_NAMES.iter().map(&side).find(|(from, _)| *from == name) {
        return Some(to.to_owned());
    }
    let (layer, tail) = name.strip_prefix(from_prefix)?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, to) = LAYER_NAMES.iter().map(&side).find(|(from, _)| *from == tail)?;
    Some(format!("{to_prefix}{layer}.{to}"))
}

/// [`map_name`] for a Gemma 2 model: its own names of block norms first.
fn map_gemma2_name(
    name: &str,
    (from_prefix, to_prefix): (&str, &str),
    side: impl Fn(&(&'static str, &'static str)) -> (&'static str, &'static str) + Copy,
) -> Option<String> {
    let gemma2 = name.strip_prefix(from_prefix).and_then(|rest| {
        let (layer, tail) = rest.split_once('.')?;
        let (_, to) = GEMMA2_LAYER_NAMES.iter().map(side).find(|(from, _)| *from == tail)?;
        Some(format!("{to_prefix}{layer}.{to}"))
    });
    gemma2.or_else(|| map_name(name, (from_prefix, to_prefix), side))
}

/// Maps a GGUF Gemma 2 tensor name to its Hugging Face name (see [`hf_name`]; the block
/// norms are named as in Gemma 2's folders).
pub fn gemma2_hf_name(gguf: &str) -> Option<String> {
    map_gemma2_name(gguf, ("blk.", "model.layers."), |&(g, h)| (g, h))
}

/// Maps a Hugging Face Gemma 2 tensor name to the GGUF name the model asks for: the inverse of
/// [`gemma2_hf_name`] (its `post_attention_layernorm` is `post_attention_norm`, not the llama
/// `ffn_norm`).
pub fn gemma2_gguf_name(hf: &str) -> Option<String> {
    map_gemma2_name(hf, ("model.layers.", "blk."), |&(g, h)| (h, g))
}

/// Maps a GGUF llama tensor name to its Hugging Face name.
pub fn hf_name(gguf: &str) -> Option<String> {
    map_name(gguf, ("blk.", "model.layers."), |&(g, h)| (g, h))
}

/// Maps a Hugging Face tensor name to the GGUF llama name the model asks for: the inverse of
/// [`hf_name`] (Phi-3's fused `qkv_proj` and `gate_up_proj` have no single llama name).
pub fn gguf_name(hf: &str) -> Option<String> {
    map_name(hf, ("model.layers.", "blk."), |&(g, h)| (h, g))
}

/// A Hugging Face checkpoint folder: `config.json` and one or more `.safetensors` files.
#[derive(Debug)]
pub struct HfCheckpoint {
    dir: PathBuf,
    files: Vec<SafetensorsFile>,
    /// Hugging Face tensor name (of a text model) -> index into `files`.
    index: BTreeMap<String, usize>,
    /// Hugging Face names of a text model -> the names a multimodal Gemma 3 folder stores
    /// them under (`language_model.model.layers.0...` or `model.language_model.layers.0...`);
    /// empty for the others. Its vision tower's tensors are never read.
    stored: BTreeMap<String, String>,
    /// Added to every RMSNorm weight as it is read: Gemma's norms scale by `1 + w` (its GGUF
    /// files store the sum); 0 for the others.
    norm_offset: f32,
    /// Whether the folder is Gemma 2's or Gemma 3's, whose block norms have their own names.
    gemma2: bool,
}

/// The text model's name of tensor `stored` of a multimodal Gemma 3 folder, whichever of
/// transformers' two layouts saved it; `None` for the vision tower's and the projector's.
fn text_model_name(stored: &str) -> Option<String> {
    if let Some(rest) = stored
        .strip_prefix("language_model.model.")
        .or(stored.strip_prefix("model.language_model."))
    {
        return Some(format!("model.{rest}"));
    }
    // The head: `language_model.lm_head.weight` before transformers 4.52, `lm_head.weight` since.
    let head = stored.strip_prefix("language_model.").unwrap_or(stored);
    head.starts_with("lm_head.").then(|| head.to_owned())
}

/// Phi-3's longrope from `config.json` (`cfg`, its `rope_scaling` `rs`): both factor lists
/// (`rope_dim / 2` each), the original context (`original_max_position_embeddings`, in
/// `rope_scaling` or beside it) and the attention factor (`rope_scaling.attention_factor`,
/// else [`crate::config::longrope_attn_factor`] of `context` over the original).
fn longrope_of(
    cfg: &serde_json::Value,
    rs: &serde_json::Value,
    rope_dim: usize,
    context: usize,
) -> Result<crate::config::LongRope> {
    let factors = |k: &str| -> Result<Vec<f32>> {
        let key = format!("rope_scaling.{k}");
        let list = rs.get(k).and_then(|v| v.as_array()).ok_or_else(|| {
            Error::metadata(&key, "missing or not a list, though rope_type is longrope")
        })?;
        list.iter()
            .map(|v| v.as_f64().map(|f| f as f32))
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| Error::metadata(&key, "holds something other than numbers"))
    };
    let original_key = "original_max_position_embeddings";
    let original_context = rs
        .get(original_key)
        .or_else(|| cfg.get(original_key))
        .and_then(|v| v.as_u64())
        .ok_or_else(|| {
            Error::metadata(original_key, "missing or not an integer, though rope_type is longrope")
        })? as usize;
    let attn_factor = match rs.get("attention_factor").filter(|v| !v.is_null()) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| Error::metadata("rope_scaling.attention_factor", "not a number"))?
            as f32,
        None => crate::config::longrope_attn_factor(context, original_context),
    };
    let rope = crate::config::LongRope {
        short: factors("short_factor")?,
        long: factors("long_factor")?,
        original_context,
        attn_factor,
    };
    let keys = [
        "rope_scaling.short_factor",
        "rope_scaling.long_factor",
        original_key,
        "rope_scaling.attention_factor",
    ];
    crate::config::check_longrope(rope, rope_dim / 2, keys)
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        what: "reading",
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text)
        .map_err(|e| Error::metadata(&path.display().to_string(), format!("not json: {e}")))
}

impl HfCheckpoint {
    /// Opens `dir`: `model.safetensors`, or the files named by
    /// `model.safetensors.index.json`.
    ///
    /// # Errors
    /// [`Error::Io`] for missing files, [`Error::Safetensors`] for malformed ones.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        let index_path = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if index_path.is_file() {
            let index = read_json(&index_path)?;
            let map = index.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
                Error::metadata("weight_map", format!("missing in {}", index_path.display()))
            })?;
            let mut files: Vec<String> =
                map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".to_owned()]
        };
        let config = read_json(&dir.join("config.json")).ok();
        let model_type = config.as_ref().and_then(|c| c.get("model_type")?.as_str());
        let multimodal = model_type == Some("gemma3");
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        let mut stored = BTreeMap::new();
        for (i, name) in names.iter().enumerate() {
            let f = SafetensorsFile::open(dir.join(name))?;
            for t in f.names() {
                match multimodal.then(|| text_model_name(t)) {
                    Some(Some(text)) => {
                        index.insert(text.clone(), i);
                        stored.insert(text, t.to_owned());
                    }
                    Some(None) => {} // the vision tower's
                    None => {
                        index.insert(t.to_owned(), i);
                    }
                }
            }
            files.push(f);
        }
        let gemma2 = matches!(model_type, Some("gemma2" | "gemma3" | "gemma3_text"));
        let norm_offset = if model_type == Some("gemma") || gemma2 { 1.0 } else { 0.0 };
        Ok(HfCheckpoint { dir, files, index, stored, norm_offset, gemma2 })
    }

    /// `values` of tensor `name` (GGUF name) as the model uses them: Gemma's norm weights
    /// with their offset added.
    fn as_used(&self, name: &str, mut values: Vec<f32>) -> Vec<f32> {
        if self.norm_offset != 0.0 && name.ends_with("norm.weight") {
            values.iter_mut().for_each(|v| *v += self.norm_offset);
        }
        values
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads `config.json` into a [`LlamaConfig`]. A Gemma 3 folder's is read by
    /// `gemma3::text_config` first: a multimodal one's text model only.
    ///
    /// # Errors
    /// [`Error::Metadata`] naming the missing or mistyped key.
    pub fn config(&self) -> Result<LlamaConfig> {
        let path = self.dir.join("config.json");
        let raw = read_json(&path)?;
        let model_type = raw.get("model_type").and_then(|v| v.as_str()).unwrap_or("llama");
        let gemma3 = matches!(model_type, "gemma3" | "gemma3_text");
        let cfg = if gemma3 { gemma3::text_config(&raw, model_type)? } else { raw.clone() };
        let num = |k: &str| -> Result<usize> {
            cfg.get(k)
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| Error::metadata(k, "missing from config.json or not an integer"))
        };
        let float = |k: &str, default: f64| cfg.get(k).and_then(|v| v.as_f64()).unwrap_or(default);
        let (gemma2, qwen3) = (model_type == "gemma2", model_type == "qwen3");
        let gemma = model_type == "gemma" || gemma2 || gemma3;
        if model_type.starts_with("gemma") && !gemma {
            // Gemma 3n's per-layer embeddings and altered blocks, ...
            return Err(Error::metadata(
                "model_type",
                format!(
                    "`{model_type}` is not supported (gemma, gemma2, gemma3 and gemma3_text are)"
                ),
            ));
        }
        if model_type.starts_with("qwen3") && !qwen3 {
            // Mixture-of-experts MLPs (`qwen3_moe`), hybrid attention (`qwen3_next`), ...
            return Err(Error::metadata(
                "model_type",
                format!("`{model_type}` is not supported (qwen3 is)"),
            ));
        }
        if model_type.starts_with("qwen")
            && cfg.get("use_sliding_window").and_then(|v| v.as_bool()) == Some(true)
        {
            return Err(Error::metadata(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        // Biases are read when the folder has them; a config that promises them must keep
        // its word, so a missing tensor is named rather than run as zero.
        let bias = "model.layers.0.self_attn.q_proj.bias";
        if cfg.get("attention_bias").and_then(|v| v.as_bool()) == Some(true)
            && !self.index.contains_key(bias)
        {
            return Err(Error::tensor(
                bias,
                format!(
                    "missing from {}, though config.json sets attention_bias",
                    self.dir.display()
                ),
            ));
        }
        let hidden = num("hidden_size")?;
        let n_heads = num("num_attention_heads")?;
        let n_kv_heads = num("num_key_value_heads").unwrap_or(n_heads);
        if n_heads == 0 || hidden % n_heads != 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(Error::metadata(
                "num_attention_heads",
                format!("{n_heads} heads, {n_kv_heads} kv heads, hidden {hidden}"),
            ));
        }
        let head_dim = num("head_dim").unwrap_or(hidden / n_heads);
        let rope_theta = float("rope_theta", 10_000.0);
        // Phi-4-mini rotates three quarters of each head.
        let rope_dim = match cfg.get("partial_rotary_factor").and_then(|v| v.as_f64()) {
            Some(p) => {
                let dim = (head_dim as f64 * p).round() as usize;
                if !(p > 0.0 && p <= 1.0 && dim.is_multiple_of(2)) {
                    return Err(Error::metadata(
                        "partial_rotary_factor",
                        format!("{p} of a head of {head_dim} is not an even number of elements"),
                    ));
                }
                dim
            }
            None => head_dim,
        };
        let context_length = num("max_position_embeddings")?;
        let mut longrope = None;
        let rope_freq_factors = match cfg.get("rope_scaling").filter(|v| !v.is_null()) {
            None => None,
            Some(rs) => {
                let kind = rs.get("rope_type").or_else(|| rs.get("type")).and_then(|v| v.as_str());
                let field = |k: &str| {
                    rs.get(k).and_then(|v| v.as_f64()).ok_or_else(|| {
                        Error::metadata(&format!("rope_scaling.{k}"), "missing or not a number")
                    })
                };
                match kind {
                    Some("llama3") => Some(crate::config::llama3_rope_factors(
                        rope_theta,
                        rope_dim,
                        field("factor")?,
                        field("low_freq_factor")?,
                        field("high_freq_factor")?,
                        field("original_max_position_embeddings")?,
                    )),
                    Some("linear") => Some(vec![field("factor")? as f32; rope_dim / 2]),
                    Some("longrope") => {
                        let rope = longrope_of(&cfg, rs, rope_dim, context_length)?;
                        let factors = rope.pick(context_length).to_vec();
                        longrope = Some(rope);
                        Some(factors)
                    }
                    Some("default") => None,
                    other => {
                        return Err(Error::metadata(
                            "rope_scaling.rope_type",
                            format!(
                                "{other:?} rope scaling is not supported \
                                 (llama3, linear and longrope are)"
                            ),
                        ))
                    }
                }
            }
        };
        let (attn_softcap, final_softcap, sliding_window, query_scale) = if gemma2 || gemma3 {
            let positive = |k: &str| -> Result<Option<f64>> {
                match cfg.get(k).filter(|v| !v.is_null()) {
                    None => Ok(None),
                    Some(v) => match v.as_f64() {
                        Some(x) if x > 0.0 && x.is_finite() => Ok(Some(x)),
                        _ => Err(Error::metadata(k, format!("{v} is not a positive number"))),
                    },
                }
            };
            let tokens = num("sliding_window")?;
            if tokens == 0 {
                return Err(Error::metadata(
                    "sliding_window",
                    "a window must hold at least one position",
                ));
            }
            let pattern = if gemma3 { num("sliding_window_pattern")? } else { 2 };
            if pattern == 0 {
                return Err(Error::metadata("sliding_window_pattern", "must be at least 1"));
            }
            let scalar = positive("query_pre_attn_scalar")?;
            (
                positive("attn_logit_softcapping")?.map(|c| c as f32),
                positive("final_logit_softcapping")?.map(|c| c as f32),
                // Gemma 2's even layers; Gemma 3's five of every six.
                Some(crate::config::SlidingWindow { tokens, pattern }),
                // `query_pre_attn_scalar^-0.5`, unless it is the head size's own scale.
                scalar.filter(|&s| s != head_dim as f64).map(|s| (1.0 / s.sqrt()) as f32),
            )
        } else {
            (None, None, None, None)
        };
        let tied = cfg.get("tie_word_embeddings").and_then(|v| v.as_bool()).unwrap_or(false)
            || !self.index.contains_key("lm_head.weight");
        Ok(LlamaConfig {
            n_layers: num("num_hidden_layers")?,
            hidden,
            ffn: num("intermediate_size")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_theta: rope_theta as f32,
            rope_dim,
            rms_eps: float("rms_norm_eps", 1e-6) as f32,
            vocab_size: num("vocab_size")?,
            context_length,
            tied_embeddings: tied,
            rope_freq_factors,
            rope_attn_factor: longrope.as_ref().map(|r| r.attn_factor).filter(|&a| a != 1.0),
            longrope,
            // Gemma's `gelu_pytorch_tanh` MLP and `sqrt(hidden)`-scaled embeddings.
            activation: if gemma {
                crate::config::Activation::GeluTanh
            } else {
                crate::config::Activation::Silu
            },
            embedding_scale: gemma.then(|| (hidden as f32).sqrt()),
            qk_norm: qwen3 || gemma3,
            attn_softcap,
            final_softcap,
            sliding_window,
            post_norms: gemma2 || gemma3,
            query_scale,
            rope_local_theta: gemma3.then(|| float("rope_local_base_freq", 10_000.0) as f32),
        })
    }

    fn locate(&self, gguf: &str) -> Result<(&SafetensorsFile, String)> {
        let hf = if self.gemma2 { gemma2_hf_name(gguf) } else { hf_name(gguf) };
        let hf = hf.ok_or_else(|| Error::tensor(gguf, "has no Hugging Face name"))?;
        let i = *self
            .index
            .get(&hf)
            .ok_or_else(|| Error::tensor(&hf, format!("not found in {}", self.dir.display())))?;
        Ok((&self.files[i], self.stored.get(&hf).cloned().unwrap_or(hf)))
    }
}

impl WeightSource for HfCheckpoint {
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let (f, hf) = self.locate(name)?;
        Ok(f.info(&hf)?.shape.clone())
    }

    fn has(&self, name: &str) -> bool {
        self.locate(name).is_ok()
    }

    fn rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        let (f, hf) = self.locate(name)?;
        let info = f.info(&hf)?;
        let row_len = info.shape.last().copied().unwrap_or(1);
        let n_rows = info.shape.iter().rev().skip(1).product::<usize>();
        if rows.start > rows.end || rows.end > n_rows {
            return Err(Error::tensor(
                &hf,
                format!("row range {rows:?} outside its {n_rows} rows"),
            ));
        }
        Ok(self.as_used(name, f.elements(&hf, rows.start * row_len..rows.end * row_len)?))
    }

    fn cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>> {
        let (f, hf) = self.locate(name)?;
        let info = f.info(&hf)?;
        let row_len = info.shape.last().copied().unwrap_or(1);
        if cols.start > cols.end || cols.end > row_len {
            return Err(Error::tensor(
                &hf,
                format!("column range {cols:?} outside its {row_len} columns"),
            ));
        }
        let n_rows = info.shape.iter().rev().skip(1).product::<usize>();
        let mut out = Vec::with_capacity(n_rows * cols.len());
        for r in 0..n_rows {
            out.extend(f.elements(&hf, r * row_len + cols.start..r * row_len + cols.end)?);
        }
        Ok(self.as_used(name, out))
    }

    fn qk_interleaved(&self) -> bool {
        false
    }
}

/// Writes tensors (Hugging Face names, f32 values stored as `dtype`) as one `.safetensors`
/// file: a fixture writer for tests.
pub fn write_safetensors(path: &Path, tensors: &[(&str, &[usize], StDType, &[f32])]) -> Result<()> {
    let stored: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, dtype, values)| {
            values
                .iter()
                .flat_map(|&v| match dtype {
                    StDType::F32 => v.to_le_bytes().to_vec(),
                    StDType::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
                    StDType::BF16 => bf16::from_f32(v).to_le_bytes().to_vec(),
                })
                .collect()
        })
        .collect();
    let raw: Vec<RawTensor<'_>> = tensors
        .iter()
        .zip(&stored)
        .map(|((name, shape, dtype, _), bytes)| RawTensor { name, shape, dtype: *dtype, bytes })
        .collect();
    write_raw_safetensors(path, &raw)
}

/// A tensor as stored: little-endian elements of `dtype`, row-major in `shape`.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its shape.
    pub shape: &'a [usize],
    /// Its element type.
    pub dtype: StDType,
    /// Its bytes: the product of `shape` elements of `dtype`.
    pub bytes: &'a [u8],
}

/// Writes `tensors`, as they are stored, as one `.safetensors` file (a weight bucket made
/// from memory that was not a file, such as tensors read from a GPU).
///
/// # Errors
/// A tensor whose bytes are not its shape's elements (naming it), or the write's error.
pub fn write_raw_safetensors(path: &Path, tensors: &[RawTensor<'_>]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for t in tensors {
        let want = t.shape.iter().product::<usize>() * t.dtype.size();
        if t.bytes.len() != want {
            return Err(Error::tensor(
                t.name,
                format!(
                    "{} bytes for shape {:?} of {} ({want} bytes)",
                    t.bytes.len(),
                    t.shape,
                    t.dtype.name()
                ),
            ));
        }
        let start = data.len();
        data.extend_from_slice(t.bytes);
        header.insert(
            t.name.to_owned(),
            serde_json::json!({ "dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [start, data.len()] }),
        );
    }
    let mut head = serde_json::Value::Object(header).to_string().into_bytes();
    head.resize(head.len().div_ceil(8) * 8, b' ');
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend(head);
    out.extend(data);
    std::fs::write(path, out).map_err(|source| Error::Io {
        what: "writing",
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests;
