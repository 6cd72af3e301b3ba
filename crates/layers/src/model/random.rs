//! Small Llama models with random weights written as GGUF: fixtures for tests here and in the
//! crates above (multi-rank tests need a model file that loads in milliseconds).

use crate::error::Result;
use checkpoint::gguf::{GgufWriter, Value};
use std::path::Path;
use tensor::kernels::cpu::quant::BlockFormat;

/// The shape of a random Llama model. Weights are uniform in ±`scale`, norms near 1.
#[derive(Clone, Debug, PartialEq)]
pub struct RandomLlama {
    /// Decoder blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// MLP inner size.
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Vocabulary size (tokens are named `t0`, `t1`, ...).
    pub vocab: usize,
    /// Whether to write a separate `output.weight` (else the LM head is tied).
    pub untied_head: bool,
    /// Store the projection matrices (and the embedding) in this block format instead of f32
    /// (needs widths that are multiples of 32).
    pub quantized: Option<BlockFormat>,
    /// Seed of the weights.
    pub seed: u64,
    /// Write Q/K/V biases and call the architecture `qwen2` (whose Q/K rows are stored in the
    /// rotate-half order, unlike llama's); the other weights are the same as without biases.
    pub attn_bias: bool,
    /// Names replacing `t{id}` for some tokens, spelled the way byte-level BPE stores them
    /// (one character per byte, see [`byte_level`]), so a token can hold part of a multi-byte
    /// character.
    pub token_names: Vec<(u32, String)>,
    /// When set, the model is a lookup table instead of random: after token `i` its greedy
    /// choice is `next_token[i]`, whatever came before. Every block adds nothing to the
    /// residual stream (zero attention output and MLP down projections), the embedding is
    /// one-hot and the (untied) head maps each token to its successor; needs `hidden >= vocab`.
    /// For tests that need a known output through the whole stack.
    pub next_token: Option<Vec<u32>>,
    /// Write the same model as Phi-3's GGUF files store it (architecture `phi3`): Q, K and V
    /// in one `attn_qkv` tensor and the gate rows before the up rows in `ffn_up`, Q/K rows in
    /// the rotate-half order. Loads to the same weights as the llama file of the same seed.
    pub fused: bool,
    /// Write the model as a Gemma file (architecture `gemma`): GELU in the MLP, embeddings
    /// scaled by `sqrt(hidden)`, Q/K rows in the rotate-half order.
    pub gemma: bool,
    /// Elements per head when not `hidden / heads` (Gemma 7B's heads are wider: its queries
    /// are 4096 wide over a hidden size of 3072).
    pub head_dim: Option<usize>,
    /// Write the model as a Qwen3 file (architecture `qwen3`, Q/K rows in the rotate-half
    /// order): with per-head query and key norms (`attn_q_norm`, `attn_k_norm`, from their own
    /// random stream, so the other weights are those of the llama model of the same seed),
    /// and Q/K/V biases only when `attn_bias` is set too.
    pub qwen3: bool,
    /// Phi-3's longrope: the GGUF file gets both factor lists (`rope_factors_short.weight`,
    /// `rope_factors_long.weight`, `head_dim / 2` each), the original context and the
    /// attention factor under `rope.scaling.*`; the Hugging Face folder gets them in
    /// `config.json`'s `rope_scaling`. The written context length is 256.
    pub longrope: Option<checkpoint::config::LongRope>,
    /// Write the model as a Gemma 2 file (architecture `gemma2`, so Gemma's GELU, scaled
    /// embeddings and rotate-half Q/K rows): with post-attention and post-MLP norms (from
    /// their own random stream, so the other weights are those of the Gemma model of the same
    /// seed), these soft-caps and this sliding window on the even layers.
    pub gemma2: Option<Gemma2>,
    /// Write the model as a Gemma 3 file (architecture `gemma3`, so Gemma's GELU, scaled
    /// embeddings and rotate-half Q/K rows): with Gemma 2's post-norms (the same stream, so the
    /// other weights are those of the Gemma 2 model of the same seed), Qwen3's query and key
    /// norms (their stream), no caps, this window on five of every six layers, a global rotary
    /// base of 1e6 (the local one is 1e4) and this linear scaling of the global layers.
    pub gemma3: Option<Gemma3>,
}

/// Gemma 2's constants for [`RandomLlama::gemma2`]: small ones, so short prompts leave the
/// window and random scores reach the caps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemma2 {
    /// Positions a query of a sliding layer sees.
    pub window: usize,
    /// `attn_logit_softcapping`.
    pub attn_softcap: f32,
    /// `final_logit_softcapping`.
    pub final_softcap: f32,
}

/// Gemma 3's constants for [`RandomLlama::gemma3`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemma3 {
    /// Positions a query of a local layer sees.
    pub window: usize,
    /// The linear rope scaling factor of the global layers (`rope_scaling.factor`); `None`:
    /// unscaled.
    pub rope_scale: Option<f32>,
}

impl Default for Gemma3 {
    /// A window of 4, global layers' rotation scaled by 4.
    fn default() -> Self {
        Gemma3 { window: 4, rope_scale: Some(4.0) }
    }
}

impl Default for Gemma2 {
    /// A window of 4 and caps of 2 (attention scores) and 1.5 (logits).
    fn default() -> Self {
        Gemma2 { window: 4, attn_softcap: 2.0, final_softcap: 1.5 }
    }
}

impl Default for RandomLlama {
    fn default() -> Self {
        RandomLlama {
            layers: 2,
            hidden: 64,
            ffn: 96,
            heads: 4,
            kv_heads: 2,
            vocab: 48,
            untied_head: false,
            quantized: None,
            seed: 1,
            attn_bias: false,
            token_names: Vec::new(),
            next_token: None,
            fused: false,
            gemma: false,
            head_dim: None,
            qwen3: false,
            longrope: None,
            gemma2: None,
            gemma3: None,
        }
    }
}

/// `bytes` spelled the way byte-level BPE vocabularies (GPT-2's and those derived from it)
/// store tokens: printable Latin-1 bytes as themselves, the others as the characters from
/// U+0100 on, in byte order.
pub fn byte_level(bytes: &[u8]) -> String {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    bytes
        .iter()
        .map(|&b| {
            if printable(b) {
                char::from(b)
            } else {
                let n = (0..b).filter(|&c| !printable(c)).count() as u32;
                char::from_u32(0x100 + n).unwrap_or('?')
            }
        })
        .collect()
}

/// Overwrites a random matrix of the lookup-table model (see [`RandomLlama::next_token`]).
fn lookup_weights(name: &str, next: &[u32], cols: usize, data: &mut [f32]) {
    if name.ends_with("attn_output.weight") || name.ends_with("ffn_down.weight") {
        data.fill(0.0);
    } else if name == "token_embd.weight" {
        data.fill(0.0);
        (0..data.len() / cols).for_each(|i| data[i * cols + i] = 1.0);
    } else if name == "output.weight" {
        data.fill(0.0);
        for (i, &j) in next.iter().enumerate() {
            data[j as usize * cols + i] = 1.0;
        }
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

impl RandomLlama {
    /// The GGUF writer holding this model (add metadata before writing if needed).
    pub fn writer(&self) -> GgufWriter {
        let mut rng = Rng(self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let (h, d) = (self.hidden, self.head_dim());
        let mut w = GgufWriter::new();
        let u = |x: usize| Value::U32(x as u32);
        let arch = self.architecture();
        let k = |key: &str| format!("{arch}.{key}");
        w.metadata("general.architecture", Value::String(arch.into()))
            .metadata(&k("block_count"), u(self.layers))
            .metadata(&k("embedding_length"), u(h))
            .metadata(&k("feed_forward_length"), u(self.ffn))
            .metadata(&k("attention.head_count"), u(self.heads))
            .metadata(&k("attention.head_count_kv"), u(self.kv_heads))
            .metadata(&k("rope.freq_base"), Value::F32(self.rope_theta()))
            .metadata(&k("rope.dimension_count"), u(d))
            .metadata(&k("attention.key_length"), u(d))
            .metadata(&k("attention.value_length"), u(d))
            .metadata(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5))
            .metadata(&k("context_length"), u(256))
            .metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
            .metadata(
                "tokenizer.ggml.tokens",
                Value::Array((0..self.vocab).map(|i| Value::String(self.token_name(i))).collect()),
            )
            .metadata("tokenizer.ggml.merges", Value::Array(Vec::new()))
            .metadata("tokenizer.ggml.eos_token_id", u(0));
        let data = |rng: &mut Rng, name: &str, rows: usize, cols: usize| {
            let mut data = rng.vec(rows * cols, 1.0 / (cols as f32).sqrt() * 1.5);
            if let Some(next) = &self.next_token {
                lookup_weights(name, next, cols, &mut data);
            }
            data
        };
        let put = |w: &mut GgufWriter, name: &str, rows: usize, cols: usize, data: &[f32]| {
            if let Some(format) = self.quantized {
                w.tensor_quantized(name, &[rows, cols], format, data);
            } else {
                w.tensor_f32(name, &[rows, cols], data);
            }
        };
        let matrix = |w: &mut GgufWriter, rng: &mut Rng, name: &str, rows: usize, cols: usize| {
            put(w, name, rows, cols, &data(rng, name, rows, cols));
        };
        let norm = |w: &mut GgufWriter, rng: &mut Rng, name: &str| {
            let data: Vec<f32> = rng.vec(h, 0.2).iter().map(|x| 1.0 + x).collect();
            w.tensor_f32(name, &[h], &data);
        };
        matrix(&mut w, &mut rng, "token_embd.weight", self.vocab, h);
        let mut post_rng = Rng(self.seed.wrapping_mul(0xBF58_476D_1CE4_E5B9) | 1);
        let mut post_norm = |w: &mut GgufWriter, name: &str| {
            let data: Vec<f32> = post_rng.vec(h, 0.2).iter().map(|x| 1.0 + x).collect();
            w.tensor_f32(name, &[h], &data);
        };
        if let Some(g) = &self.gemma2 {
            w.metadata(&k("attn_logit_softcapping"), Value::F32(g.attn_softcap))
                .metadata(&k("final_logit_softcapping"), Value::F32(g.final_softcap))
                .metadata(&k("attention.sliding_window"), u(g.window));
        }
        if let Some(g) = &self.gemma3 {
            w.metadata(&k("attention.sliding_window"), u(g.window));
            if let Some(factor) = g.rope_scale {
                w.metadata(&k("rope.scaling.type"), Value::String("linear".into()))
                    .metadata(&k("rope.scaling.factor"), Value::F32(factor));
            }
        }
        let post_norms = self.gemma2.is_some() || self.gemma3.is_some();
        for l in 0..self.layers {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            norm(&mut w, &mut rng, &n("attn_norm"));
            if self.fused {
                // The llama file's Q/K rows are permuted for interleaved rotary; Phi-3's are not.
                let q = data(&mut rng, &n("attn_q"), self.heads * d, h);
                let k = data(&mut rng, &n("attn_k"), self.kv_heads * d, h);
                let v = data(&mut rng, &n("attn_v"), self.kv_heads * d, h);
                let mut qkv = super::linear::unpermute_rows(&q, h, d);
                qkv.extend(super::linear::unpermute_rows(&k, h, d));
                qkv.extend(v);
                put(&mut w, &n("attn_qkv"), (self.heads + 2 * self.kv_heads) * d, h, &qkv);
            } else {
                matrix(&mut w, &mut rng, &n("attn_q"), self.heads * d, h);
                matrix(&mut w, &mut rng, &n("attn_k"), self.kv_heads * d, h);
                matrix(&mut w, &mut rng, &n("attn_v"), self.kv_heads * d, h);
            }
            matrix(&mut w, &mut rng, &n("attn_output"), h, self.heads * d);
            if post_norms {
                post_norm(&mut w, &n("post_attention_norm"));
            }
            norm(&mut w, &mut rng, &n("ffn_norm"));
            if self.fused {
                let mut gate_up = data(&mut rng, &n("ffn_gate"), self.ffn, h);
                gate_up.extend(data(&mut rng, &n("ffn_up"), self.ffn, h));
                put(&mut w, &n("ffn_up"), 2 * self.ffn, h, &gate_up);
            } else {
                matrix(&mut w, &mut rng, &n("ffn_gate"), self.ffn, h);
                matrix(&mut w, &mut rng, &n("ffn_up"), self.ffn, h);
            }
            matrix(&mut w, &mut rng, &n("ffn_down"), h, self.ffn);
            if post_norms {
                post_norm(&mut w, &n("post_ffw_norm"));
            }
        }
        if self.attn_bias {
            // A separate stream, so the weights match the bias-free model of the same seed.
            let mut bias_rng = Rng(self.seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
            for l in 0..self.layers {
                for (t, rows) in
                    [("attn_q", self.heads), ("attn_k", self.kv_heads), ("attn_v", self.kv_heads)]
                {
                    w.tensor_f32(
                        &format!("blk.{l}.{t}.bias"),
                        &[rows * d],
                        &bias_rng.vec(rows * d, 0.5),
                    );
                }
            }
        }
        if self.qwen3 || self.gemma3.is_some() {
            let mut norm_rng = Rng(self.seed.wrapping_mul(0x94D0_49BB_1331_11EB) | 1);
            for l in 0..self.layers {
                for t in ["attn_q_norm", "attn_k_norm"] {
                    let data: Vec<f32> = norm_rng.vec(d, 0.5).iter().map(|x| 1.0 + x).collect();
                    w.tensor_f32(&format!("blk.{l}.{t}.weight"), &[d], &data);
                }
            }
        }
        if let Some(rope) = &self.longrope {
            w.metadata(&k("rope.scaling.original_context_length"), u(rope.original_context))
                .metadata(&k("rope.scaling.attn_factor"), Value::F32(rope.attn_factor))
                .tensor_f32("rope_factors_short.weight", &[rope.short.len()], &rope.short)
                .tensor_f32("rope_factors_long.weight", &[rope.long.len()], &rope.long);
        }
        norm(&mut w, &mut rng, "output_norm.weight");
        if self.untied_head || self.next_token.is_some() {
            matrix(&mut w, &mut rng, "output.weight", self.vocab, h);
        }
        w
    }

    /// The GGUF architecture name the file is written under.
    fn architecture(&self) -> &'static str {
        if self.gemma3.is_some() {
            return "gemma3";
        }
        if self.gemma2.is_some() {
            return "gemma2";
        }
        match (self.qwen3, self.attn_bias, self.fused, self.gemma) {
            (true, ..) => "qwen3",
            (false, true, _, _) => "qwen2",
            (false, false, true, _) => "phi3",
            (false, false, false, true) => "gemma",
            (false, false, false, false) => "llama",
        }
    }

    /// The rotary base written (Gemma 3's global one: its checkpoints' 1e6).
    fn rope_theta(&self) -> f32 {
        if self.gemma3.is_some() {
            1_000_000.0
        } else {
            10_000.0
        }
    }

    /// Whether the file is any Gemma's (GELU, scaled embeddings, norms stored as `1 + w`).
    fn any_gemma(&self) -> bool {
        self.gemma || self.gemma2.is_some() || self.gemma3.is_some()
    }

    /// Elements per head.
    fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads)
    }

    fn token_name(&self, id: usize) -> String {
        self.token_names
            .iter()
            .find(|(i, _)| *i as usize == id)
            .map_or_else(|| format!("t{id}"), |(_, name)| name.clone())
    }

    /// Writes the model to `path`.
    ///
    /// # Errors
    /// [`crate::Error::Io`] when the file cannot be written.
    pub fn write(&self, path: &Path) -> Result<()> {
        Ok(self.writer().write(path)?)
    }

    /// Writes the model as a Hugging Face folder `dir` (created if needed): `config.json`,
    /// the weights in f32 safetensors (in two shards with `model.safetensors.index.json` when
    /// `shards`, else `model.safetensors`), Q/K rows in the rotate-half layout Hugging Face
    /// stores, and `tokenizer.json` with `tokenizer_config.json` (its EOS token). The model
    /// computes the same as the GGUF file of [`RandomLlama::write`].
    ///
    /// # Errors
    /// [`crate::Error::Io`] when a file cannot be written.
    pub fn write_hf(&self, dir: &Path, shards: bool) -> Result<()> {
        use crate::Error;
        use checkpoint::safetensors::{hf_name, write_safetensors, StDType};
        use checkpoint::WeightSource;
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| Error::io("writing", &path, source)
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let gguf = dir.join("model.gguf.tmp");
        self.write(&gguf)?;
        let file = checkpoint::gguf::GgufFile::open(&gguf)?;
        let d = self.head_dim();
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        for info in file.tensor_infos() {
            if info.name.starts_with("rope_factors_") {
                continue; // config.json's rope_scaling holds them
            }
            let t = file.tensor(&info.name)?;
            let mut data = t.data().to_vec();
            let qk = info.name.ends_with("attn_q.weight") || info.name.ends_with("attn_k.weight");
            if qk && file.qk_interleaved() {
                data = super::linear::unpermute_rows(&data, t.row_len(), d);
            }
            if self.any_gemma() && info.name.ends_with("norm.weight") {
                // Hugging Face's Gemma norms scale by `1 + w`; its GGUF files store the sum.
                data.iter_mut().for_each(|v| *v -= 1.0);
            }
            let name = if self.gemma2.is_some() || self.gemma3.is_some() {
                checkpoint::safetensors::gemma2_hf_name(&info.name)
            } else {
                hf_name(&info.name)
            };
            let name = name
                .ok_or_else(|| Error::tensor(&info.name, "has no Hugging Face name".to_owned()))?;
            tensors.push((name, t.shape().to_vec(), data));
        }
        let tokenizer = text::Tokenizer::from_gguf(&file)?;
        drop(file);
        std::fs::remove_file(&gguf).map_err(io(&gguf))?;
        let write = |name: &str, ts: &[(String, Vec<usize>, Vec<f32>)]| {
            let refs: Vec<(&str, &[usize], StDType, &[f32])> = ts
                .iter()
                .map(|(n, s, v)| (n.as_str(), s.as_slice(), StDType::F32, v.as_slice()))
                .collect();
            write_safetensors(&dir.join(name), &refs)
        };
        let json = |name: &str, value: serde_json::Value| {
            let path = dir.join(name);
            std::fs::write(&path, value.to_string()).map_err(io(&path))
        };
        if shards {
            let (a, b) = tensors.split_at(tensors.len() / 2);
            let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
            let mut map = serde_json::Map::new();
            for (name, part) in names.into_iter().zip([a, b]) {
                write(name, part)?;
                for (n, _, _) in part {
                    map.insert(n.clone(), serde_json::Value::String(name.into()));
                }
            }
            json(
                "model.safetensors.index.json",
                serde_json::json!({ "metadata": {}, "weight_map": map }),
            )?;
        } else {
            write("model.safetensors", &tensors)?;
        }
        let mut config = serde_json::json!({
            "architectures": [match self.architecture() {
                "qwen3" => "Qwen3ForCausalLM",
                "qwen2" => "Qwen2ForCausalLM",
                "gemma" => "GemmaForCausalLM",
                "gemma2" => "Gemma2ForCausalLM",
                "gemma3" => "Gemma3ForCausalLM",
                _ => "LlamaForCausalLM",
            }],
            "model_type": match self.architecture() {
                arch @ ("qwen3" | "qwen2" | "gemma" | "gemma2") => arch,
                "gemma3" => "gemma3_text",
                _ => "llama",
            },
            "attention_bias": self.attn_bias,
            "hidden_activation": if self.any_gemma() {
                "gelu_pytorch_tanh"
            } else {
                "silu"
            },
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim(),
            "rope_theta": self.rope_theta(),
            "rms_norm_eps": 1e-5,
            "vocab_size": self.vocab,
            "max_position_embeddings": 256,
            "tie_word_embeddings": !(self.untied_head || self.next_token.is_some()),
        });
        if let Some(g) = &self.gemma2 {
            config["attn_logit_softcapping"] = g.attn_softcap.into();
            config["final_logit_softcapping"] = g.final_softcap.into();
            config["sliding_window"] = g.window.into();
            config["query_pre_attn_scalar"] = self.head_dim().into();
        }
        if let Some(g) = &self.gemma3 {
            // As transformers 4.50 writes Gemma 3's config (the reader's tests cover 5.x's).
            config["attn_logit_softcapping"] = serde_json::Value::Null;
            config["final_logit_softcapping"] = serde_json::Value::Null;
            config["sliding_window"] = g.window.into();
            config["sliding_window_pattern"] = 6.into();
            config["rope_local_base_freq"] = 10_000.0.into();
            config["query_pre_attn_scalar"] = self.head_dim().into();
            if let Some(factor) = g.rope_scale {
                config["rope_scaling"] =
                    serde_json::json!({ "rope_type": "linear", "factor": factor });
            }
        }
        if let Some(rope) = &self.longrope {
            config["original_max_position_embeddings"] = rope.original_context.into();
            config["rope_scaling"] = serde_json::json!({
                "type": "longrope",
                "short_factor": rope.short,
                "long_factor": rope.long,
                "attention_factor": rope.attn_factor,
            });
        }
        json("config.json", config)?;
        let path = dir.join("tokenizer.json");
        tokenizer
            .inner()
            .save(&path, false)
            .map_err(|e| text::Error::Tokenizer(format!("{}: {e}", path.display())))?;
        json("tokenizer_config.json", serde_json::json!({ "eos_token": "t0" }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_spells_bytes_as_gpt2_vocabularies_do() {
        assert_eq!(byte_level(b"a b"), "a\u{120}b"); // space is "Ġ"
        assert_eq!(byte_level("😀".as_bytes()), "ðŁĺĢ");
        assert_eq!(byte_level("中".as_bytes()), "ä¸Ń");
        assert_eq!(byte_level(b"\n"), "Ċ");
    }

    #[test]
    fn a_lookup_model_predicts_the_successor_of_every_token() {
        use crate::parallel::{Comms, LoadOptions, ParallelCache, ParallelModel};
        use crate::Logits;
        let next: Vec<u32> = (0..48).map(|i| (i * 7 + 3) % 48).collect();
        let spec = RandomLlama { next_token: Some(next.clone()), ..Default::default() };
        let path = crate::test_util::temp_path("lookup.gguf");
        spec.write(&path).unwrap();
        let (placement, form) =
            (crate::parallel::Placement::single(), crate::model::WeightForm::F32);
        let model = ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
        std::fs::remove_file(&path).unwrap();
        let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
        let mut comms = Comms { tp: &mut tp, cp: &mut cp };
        let mut cache: ParallelCache = model.new_cache(64);
        let prompt: Vec<u32> = (0..48).collect();
        let ids = model.forward_argmax(&mut comms, &prompt, &mut cache, Logits::All).unwrap();
        assert_eq!(ids, next);
    }
}
