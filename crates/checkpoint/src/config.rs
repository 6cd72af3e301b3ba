//! Llama-family hyper-parameters, read from GGUF metadata (a Hugging Face `config.json`
//! reader can fill the same struct later).

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// The shape and constants of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Decoder blocks.
    pub n_layers: usize,
    /// Hidden size (`embedding_length`).
    pub hidden: usize,
    /// MLP inner size (`feed_forward_length`).
    pub ffn: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (GQA groups).
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Rotary base.
    pub rope_theta: f32,
    /// Rotated elements per head (`rope.dimension_count`).
    pub rope_dim: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Trained context length.
    pub context_length: usize,
    /// Whether the LM head reuses the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// Rotary frequency factors, one per rotated pair: pair `i`'s angle is divided by
    /// `rope_freq_factors[i]` (Llama 3's rope scaling, GGUF's `rope_freqs.weight`; linear
    /// scaling is one factor everywhere; for longrope, the factors [`LongRope::pick`] chose).
    /// `None`: no scaling.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// A factor on the cosines and sines of the rotation, so on the rotated elements of
    /// queries and keys (longrope's attention factor). `None`: 1.
    pub rope_attn_factor: Option<f32>,
    /// Phi-3's long-context rope scaling, when the checkpoint has it: both factor lists and
    /// the context length that chooses between them.
    pub longrope: Option<LongRope>,
    /// The MLP's activation of the gate projection.
    pub activation: Activation,
    /// A factor on the token embeddings before the first block (Gemma: `sqrt(hidden)`).
    pub embedding_scale: Option<f32>,
    /// Whether each head's queries and keys are RMS-normalized after their projection and
    /// before rotary embedding, with one weight of `head_dim` elements shared by every head
    /// (Qwen3's `q_norm` / `k_norm`, GGUF's `attn_q_norm` / `attn_k_norm`).
    pub qk_norm: bool,
    /// Attention scores soft-capped as `cap · tanh(score / cap)` before the softmax, the
    /// score already scaled (Gemma 2's `attn_logit_softcapping`). `None`: not capped.
    pub attn_softcap: Option<f32>,
    /// Logits soft-capped the same way (Gemma 2's `final_logit_softcapping`). `None`: not
    /// capped.
    pub final_softcap: Option<f32>,
    /// Sliding-window attention on some layers (Gemma 2's even layers). `None`: every layer
    /// attends to its whole context.
    pub sliding_window: Option<SlidingWindow>,
    /// Whether each block normalizes the attention output and the MLP output before adding
    /// them to the residual stream (Gemma 2's `post_attention_norm` / `post_ffw_norm`).
    pub post_norms: bool,
    /// The factor on query-key products when not `1 / sqrt(head_dim)` (Gemma 2 27B's
    /// `query_pre_attn_scalar^-0.5`).
    pub query_scale: Option<f32>,
    /// The rotary base of the sliding layers, which rotate without `rope_freq_factors`
    /// (Gemma 3's `rope_local_base_freq`: its global layers use `rope_theta` and the linear
    /// scaling, its local ones base 10000 unscaled). `None`: every layer rotates alike.
    pub rope_local_theta: Option<f32>,
}

/// Sliding-window attention: on a sliding layer, a query at position `p` sees the keys at
/// positions `p - tokens + 1 ..= p` only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Positions a query sees, itself included.
    pub tokens: usize,
    /// Layer `l` slides when `l % pattern < pattern - 1`: with 2 (Gemma 2), the even layers
    /// slide and the odd ones attend globally; with 6 (Gemma 3), five local layers come before
    /// each global one (layers 5, 11, ... are global), as llama.cpp's `set_swa_pattern` and
    /// transformers' `layer_types` have it.
    pub pattern: usize,
}

impl SlidingWindow {
    /// Whether layer `layer` slides.
    pub fn slides(&self, layer: usize) -> bool {
        layer % self.pattern < self.pattern - 1
    }
}

/// Phi-3's "longrope" scaling (Phi-3 128k, Phi-3.5, Phi-4-mini): pair `i`'s angle is divided
/// by `long[i]` when the model runs with a context longer than `original_context`, else by
/// `short[i]`, and the rotation is scaled by `attn_factor`.
///
/// Transformers chooses per forward pass by the current sequence length; llama.cpp once, by
/// the context it is started with. tpctl does as llama.cpp: [`LlamaConfig`] picks once, by
/// its `context_length`, so every rank and every layout rotates every position alike and
/// keys already in the (paged) KV cache never need rotating again.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRope {
    /// Factors for contexts up to `original_context` (`short_factor`,
    /// `rope_factors_short.weight`).
    pub short: Vec<f32>,
    /// Factors for longer contexts (`long_factor`, `rope_factors_long.weight`).
    pub long: Vec<f32>,
    /// The context length the model was pre-trained with
    /// (`original_max_position_embeddings`, `rope.scaling.original_context_length`).
    pub original_context: usize,
    /// The factor on cosines and sines (see [`longrope_attn_factor`]).
    pub attn_factor: f32,
}

impl LongRope {
    /// The factors for a context of `context` tokens: long beyond the original context,
    /// short up to it.
    pub fn pick(&self, context: usize) -> &[f32] {
        if context > self.original_context {
            &self.long
        } else {
            &self.short
        }
    }
}

/// Longrope's default attention factor for a model extended from `original_context` to
/// `context` positions: `sqrt(1 + ln(s) / ln(original_context))` with `s = context /
/// original_context`, and 1 when `s <= 1` (as transformers and llama.cpp compute it).
pub fn longrope_attn_factor(context: usize, original_context: usize) -> f32 {
    let s = context as f64 / original_context as f64;
    if s <= 1.0 {
        return 1.0;
    }
    (1.0 + s.ln() / (original_context as f64).ln()).sqrt() as f32
}

/// Checks longrope's two factor lists (`pairs` positive entries each, the rotated pairs of
/// a head), the original context and the attention factor, naming the key (`short_key`,
/// `long_key`, `original_key`, `attn_key`) that is wrong.
pub(crate) fn check_longrope(
    rope: LongRope,
    pairs: usize,
    [short_key, long_key, original_key, attn_key]: [&str; 4],
) -> Result<LongRope> {
    for (key, factors) in [(short_key, &rope.short), (long_key, &rope.long)] {
        if factors.len() != pairs || !factors.iter().all(|&f| f > 0.0 && f.is_finite()) {
            return Err(Error::metadata(
                key,
                format!("{} factors for {pairs} rotated pairs, all positive", factors.len()),
            ));
        }
    }
    if rope.original_context == 0 {
        return Err(Error::metadata(original_key, "must be a positive context length"));
    }
    if !(rope.attn_factor > 0.0 && rope.attn_factor.is_finite()) {
        return Err(Error::metadata(
            attn_key,
            format!("{} is not a positive factor", rope.attn_factor),
        ));
    }
    Ok(rope)
}

/// The activation of an MLP's gate projection (a kernel choice, so the tensor crate's).
pub use tensor::kernels::Activation;

/// Llama 3's rope scaling (`rope_scaling` with `rope_type: "llama3"` in `config.json`): the
/// frequency factors of its `rot_dim / 2` rotated pairs for rotary base `theta`. Wavelengths
/// shorter than `original_context / high_freq_factor` are kept, longer than
/// `original_context / low_freq_factor` divided by `factor`, and those between interpolated.
pub fn llama3_rope_factors(
    theta: f64,
    rot_dim: usize,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_context: f64,
) -> Vec<f32> {
    let (low_wavelen, high_wavelen) =
        (original_context / low_freq_factor, original_context / high_freq_factor);
    (0..rot_dim / 2)
        .map(|i| {
            let inv_freq = theta.powf(-((2 * i) as f64) / rot_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
            let scaled = if wavelen < high_wavelen {
                inv_freq
            } else if wavelen > low_wavelen {
                inv_freq / factor
            } else {
                let smooth = (original_context / wavelen - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
            };
            (inv_freq / scaled) as f32
        })
        .collect()
}

impl LlamaConfig {
    /// Reads the config from `general.architecture`-prefixed keys (`llama.block_count`, ...;
    /// `llama`, `qwen2`, `qwen3`, `phi3`, `gemma`, `gemma2` and `gemma3` are read, and Qwen's
    /// and Gemma 3's rotary base defaults to 1e6 as in their checkpoints, the others' to 1e4;
    /// Gemma's MLP uses GELU and its embeddings are scaled by `sqrt(hidden)`; Qwen3 normalizes
    /// each head's queries and keys; Gemma 2 adds soft-capping (`attn_logit_softcapping`,
    /// `final_logit_softcapping`, 50 and 30 when absent, as llama.cpp has them), sliding
    /// windows of `attention.sliding_window` on its even layers and post-attention and
    /// post-MLP norms; Gemma 3 has Gemma 2's window and post-norms without caps, Qwen3's
    /// query/key norms, its window on five of every six layers, and a rotary base of 1e4 on
    /// those local layers, which llama.cpp fixes and which skip the file's rope scaling).
    /// Mixture-of-experts variants (`qwen3moe`, ...) are refused by name.
    /// The vocabulary size comes from `tokenizer.ggml.tokens` (else `<arch>.vocab_size`, else
    /// the embedding's rows); the LM head is tied when `output.weight` is absent.
    ///
    /// # Errors
    /// [`Error::Metadata`] naming the key that is missing, mistyped or inconsistent.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.get_str("general.architecture")?;
        let default_theta = match arch {
            "llama" | "phi3" | "gemma" | "gemma2" => 10_000.0,
            "qwen2" | "qwen3" | "gemma3" => 1_000_000.0,
            _ => {
                return Err(Error::metadata(
                    "general.architecture",
                    format!(
                        "`{arch}` is not supported \
                         (llama, qwen2, qwen3, phi3, gemma, gemma2 and gemma3 are)"
                    ),
                ))
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let usize_key = |k: &str| -> Result<usize> { Ok(file.get_u64(&key(k))? as usize) };
        let n_layers = usize_key("block_count")?;
        let hidden = usize_key("embedding_length")?;
        let ffn = usize_key("feed_forward_length")?;
        let n_heads = usize_key("attention.head_count")?;
        let n_kv_heads = if file.get(&key("attention.head_count_kv")).is_some() {
            usize_key("attention.head_count_kv")?
        } else {
            n_heads
        };
        if n_heads == 0 || hidden % n_heads != 0 {
            return Err(Error::metadata(
                &key("attention.head_count"),
                format!("{n_heads} heads do not divide the hidden size {hidden}"),
            ));
        }
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(Error::metadata(
                &key("attention.head_count_kv"),
                format!("{n_kv_heads} kv heads do not divide {n_heads} query heads"),
            ));
        }
        let head_dim = if file.get(&key("attention.key_length")).is_some() {
            usize_key("attention.key_length")?
        } else {
            hidden / n_heads
        };
        let rope_dim = if file.get(&key("rope.dimension_count")).is_some() {
            usize_key("rope.dimension_count")?
        } else {
            head_dim
        };
        if rope_dim % 2 != 0 || rope_dim > head_dim {
            return Err(Error::metadata(
                &key("rope.dimension_count"),
                format!("{rope_dim} must be even and at most the head size {head_dim}"),
            ));
        }
        let rope_theta = if file.get(&key("rope.freq_base")).is_some() {
            file.get_f64(&key("rope.freq_base"))? as f32
        } else {
            default_theta
        };
        let rms_eps = file.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32;
        let context_length = usize_key("context_length")?;
        let vocab_size = if let Ok(tokens) = file.get_array("tokenizer.ggml.tokens") {
            tokens.len()
        } else if file.get(&key("vocab_size")).is_some() {
            usize_key("vocab_size")?
        } else {
            file.tensor_info("token_embd.weight")?.rows()
        };
        // Phi-3's longrope: both factor lists as tensors (llama.cpp's converter writes them
        // for any architecture that has them, so any is read).
        let longrope = if file.has_tensor("rope_factors_long.weight")
            || file.has_tensor("rope_factors_short.weight")
        {
            let factors = |name: &str| -> Result<Vec<f32>> {
                if !file.has_tensor(name) {
                    return Err(Error::tensor(
                        name,
                        "missing, though the file has longrope's other factors",
                    ));
                }
                file.tensor_rows(name, 0..1)
            };
            let original_key = key("rope.scaling.original_context_length");
            let original_context = if file.get(&original_key).is_some() {
                usize_key("rope.scaling.original_context_length")?
            } else {
                return Err(Error::metadata(
                    &original_key,
                    "missing, though the file has longrope factors",
                ));
            };
            let attn_key = key("rope.scaling.attn_factor");
            let attn_factor = if file.get(&attn_key).is_some() {
                file.get_f64(&attn_key)? as f32
            } else {
                longrope_attn_factor(context_length, original_context)
            };
            let rope = LongRope {
                short: factors("rope_factors_short.weight")?,
                long: factors("rope_factors_long.weight")?,
                original_context,
                attn_factor,
            };
            let keys =
                ["rope_factors_short.weight", "rope_factors_long.weight", &original_key, &attn_key];
            Some(check_longrope(rope, rope_dim / 2, keys)?)
        } else {
            None
        };
        let rope_freq_factors = if file.has_tensor("rope_freqs.weight") {
            let factors = file.tensor_rows("rope_freqs.weight", 0..1)?;
            if factors.len() != rope_dim / 2 || !factors.iter().all(|&f| f > 0.0) {
                return Err(Error::metadata(
                    "rope_freqs.weight",
                    format!(
                        "{} factors for {} rotated pairs, all positive",
                        factors.len(),
                        rope_dim / 2
                    ),
                ));
            }
            Some(factors)
        } else if let Some(rope) = &longrope {
            Some(rope.pick(context_length).to_vec())
        } else {
            match file.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
                None | Some("none") => None,
                Some("longrope") => {
                    return Err(Error::tensor(
                        "rope_factors_long.weight",
                        "missing, though the file's rope scaling is longrope",
                    ))
                }
                Some("linear") => {
                    let factor = file.get_f64(&key("rope.scaling.factor"))? as f32;
                    Some(vec![factor; rope_dim / 2])
                }
                Some(other) => {
                    return Err(Error::metadata(
                        &key("rope.scaling.type"),
                        format!(
                            "`{other}` rope scaling is not supported (linear and Llama 3's are)"
                        ),
                    ))
                }
            }
        };
        let (gemma2, gemma3) = (arch == "gemma2", arch == "gemma3");
        let gemma = arch == "gemma" || gemma2 || gemma3;
        let window = |pattern: usize| -> Result<Option<SlidingWindow>> {
            let tokens = usize_key("attention.sliding_window")?;
            if tokens == 0 {
                return Err(Error::metadata(
                    &key("attention.sliding_window"),
                    "a window must hold at least one position",
                ));
            }
            Ok(Some(SlidingWindow { tokens, pattern }))
        };
        let (attn_softcap, final_softcap, sliding_window) = if gemma2 {
            // llama.cpp's defaults when a file lacks the caps: those of every Gemma 2 model.
            let cap = |k: &str, default: f64| -> Result<f32> {
                let cap =
                    if file.get(&key(k)).is_some() { file.get_f64(&key(k))? } else { default };
                if !(cap > 0.0 && cap.is_finite()) {
                    return Err(Error::metadata(&key(k), format!("{cap} is not a positive cap")));
                }
                Ok(cap as f32)
            };
            (
                Some(cap("attn_logit_softcapping", 50.0)?),
                Some(cap("final_logit_softcapping", 30.0)?),
                window(2)?,
            )
        } else if gemma3 {
            // Gemma 3 caps nothing; five local layers come before each global one (llama.cpp's
            // `set_swa_pattern(6)` for gemma3).
            (None, None, window(6)?)
        } else {
            (None, None, None)
        };
        // Gemma 2 27B and Gemma 3 27B scale queries by `(hidden / heads)^-0.5`, not by their
        // head size; their GGUF files do not say so, and llama.cpp knows each model by its
        // layers (46 and 62).
        let big = (gemma2 && n_layers == 46) || (gemma3 && n_layers == 62);
        let query_scale =
            (big && hidden / n_heads != head_dim).then(|| 1.0 / ((hidden / n_heads) as f32).sqrt());
        Ok(LlamaConfig {
            n_layers,
            hidden,
            ffn,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_theta,
            rope_dim,
            rms_eps,
            vocab_size,
            context_length,
            tied_embeddings: !file.has_tensor("output.weight"),
            rope_freq_factors,
            rope_attn_factor: longrope.as_ref().map(|r| r.attn_factor).filter(|&a| a != 1.0),
            longrope,
            // Gemma (its converter already adds Gemma's `1 +` to the norm weights, Gemma 3's
            // query and key norms included).
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            embedding_scale: gemma.then(|| (hidden as f32).sqrt()),
            qk_norm: arch == "qwen3" || gemma3,
            attn_softcap,
            final_softcap,
            sliding_window,
            post_norms: gemma2 || gemma3,
            query_scale,
            // llama.cpp's `rope_freq_base_train_swa` for gemma3: the file's `rope.freq_base`
            // and rope scaling are the global layers'.
            rope_local_theta: gemma3.then_some(10_000.0),
        })
    }

    /// The config for a model that runs with a context of `context` tokens: for longrope,
    /// the factors of that context (see [`LongRope`]); otherwise `self` unchanged. The
    /// context length itself is kept: it is the checkpoint's.
    #[must_use]
    pub fn for_context(mut self, context: usize) -> Self {
        if let Some(rope) = &self.longrope {
            self.rope_freq_factors = Some(rope.pick(context).to_vec());
        }
        self
    }

    /// The rotary base and frequency factors of layer `layer`: the local ones on a sliding
    /// layer of a model with [`LlamaConfig::rope_local_theta`], else the model's.
    pub fn rope_of(&self, layer: usize) -> (f32, Option<&[f32]>) {
        match (self.rope_local_theta, self.sliding_window) {
            (Some(theta), Some(window)) if window.slides(layer) => (theta, None),
            _ => (self.rope_theta, self.rope_freq_factors.as_deref()),
        }
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// What keeps weights of this config from replacing those of a `live` model, one line per
    /// field that differs, in the model's terms ("29 layers; the live model has 30"). The
    /// context length is left out: another one changes no weight. Empty when they fit.
    pub fn differences(&self, live: &LlamaConfig) -> Vec<String> {
        let mut out = Vec::new();
        let mut count = |what: &str, new: usize, old: usize, before: bool| {
            if new != old {
                out.push(if before {
                    format!("{new} {what}; the live model has {old}")
                } else {
                    format!("{what} {new}; the live model has {old}")
                });
            }
        };
        count("layers", self.n_layers, live.n_layers, true);
        count("hidden size", self.hidden, live.hidden, false);
        count("feed-forward size", self.ffn, live.ffn, false);
        count("attention heads", self.n_heads, live.n_heads, true);
        count("key/value heads", self.n_kv_heads, live.n_kv_heads, true);
        count("head size", self.head_dim, live.head_dim, false);
        count("rotated elements per head", self.rope_dim, live.rope_dim, true);
        count("vocabulary size", self.vocab_size, live.vocab_size, false);
        let mut real = |what: &str, new: f32, old: f32| {
            if new.to_bits() != old.to_bits() {
                out.push(format!("{what} {new}; the live model has {old}"));
            }
        };
        real("rope theta", self.rope_theta, live.rope_theta);
        real("RMS norm epsilon", self.rms_eps, live.rms_eps);
        if self.rope_local_theta.map(f32::to_bits) != live.rope_local_theta.map(f32::to_bits) {
            let local = |t: Option<f32>| match t {
                Some(t) => format!("local rope theta {t}"),
                None => "one rope theta".to_owned(),
            };
            out.push(format!(
                "{}; the live model has {}",
                local(self.rope_local_theta),
                local(live.rope_local_theta)
            ));
        }
        if self.tied_embeddings != live.tied_embeddings {
            out.push(if self.tied_embeddings {
                "an output layer tied to the embeddings; the live model has its own".into()
            } else {
                "its own output layer; the live model ties it to the embeddings".into()
            });
        }
        let scaling = |f: &Option<Vec<f32>>| match f {
            Some(f) => format!("{} rope frequency factors", f.len()),
            None => "no rope scaling".to_owned(),
        };
        let (new, old) = (&self.rope_freq_factors, &live.rope_freq_factors);
        if let (Some(new), Some(old)) = (&self.longrope, &live.longrope) {
            // Both lists are compared, not the one each picked: a live model may run with
            // the other for its context.
            let lists = |r: &LongRope| (r.short.clone(), r.long.clone(), r.original_context);
            if lists(new) != lists(old) {
                out.push("other longrope factors; the live model has its own".to_owned());
            }
        } else if new.as_ref().map(|f| f.len()) != old.as_ref().map(|f| f.len()) {
            out.push(format!("{}; the live model has {}", scaling(new), scaling(old)));
        } else if new != old {
            out.push(format!("other {}; the live model has its own", scaling(new)));
        }
        if self.rope_attn_factor.map(f32::to_bits) != live.rope_attn_factor.map(f32::to_bits) {
            let factor = |a: Option<f32>| match a {
                Some(a) => format!("rotation scaled by {a}"),
                None => "unscaled rotation".to_owned(),
            };
            out.push(format!(
                "{}; the live model has {}",
                factor(self.rope_attn_factor),
                factor(live.rope_attn_factor)
            ));
        }
        if self.activation != live.activation {
            let name = |a: Activation| match a {
                Activation::Silu => "SiLU",
                Activation::GeluTanh => "GELU (tanh)",
            };
            out.push(format!(
                "{} activation; the live model has {}",
                name(self.activation),
                name(live.activation)
            ));
        }
        if self.embedding_scale.map(f32::to_bits) != live.embedding_scale.map(f32::to_bits) {
            let scale = |s: Option<f32>| match s {
                Some(s) => format!("embeddings scaled by {s}"),
                None => "unscaled embeddings".to_owned(),
            };
            out.push(format!(
                "{}; the live model has {}",
                scale(self.embedding_scale),
                scale(live.embedding_scale)
            ));
        }
        if self.qk_norm != live.qk_norm {
            let norm =
                |on: bool| if on { "per-head query/key norms" } else { "no query/key norms" };
            out.push(format!("{}; the live model has {}", norm(self.qk_norm), norm(live.qk_norm)));
        }
        if self.post_norms != live.post_norms {
            let norm =
                |on: bool| if on { "post-attention and post-MLP norms" } else { "no post-norms" };
            out.push(format!(
                "{}; the live model has {}",
                norm(self.post_norms),
                norm(live.post_norms)
            ));
        }
        let attention = |c: &LlamaConfig| {
            (
                c.attn_softcap.map(f32::to_bits),
                c.final_softcap.map(f32::to_bits),
                c.sliding_window,
                c.query_scale.map(f32::to_bits),
            )
        };
        if attention(self) != attention(live) {
            // These change no weight, but weights trained for one do not serve the other.
            out.push(format!(
                "soft-caps {:?}/{:?}, sliding window {:?}, query scale {:?}; the live model has \
                 {:?}/{:?}, {:?}, {:?}",
                self.attn_softcap,
                self.final_softcap,
                self.sliding_window.map(|w| w.tokens),
                self.query_scale,
                live.attn_softcap,
                live.final_softcap,
                live.sliding_window.map(|w| w.tokens),
                live.query_scale
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, Value};
    use crate::test_util::temp_path;

    fn base() -> GgufWriter {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()))
            .metadata("llama.block_count", Value::U32(2))
            .metadata("llama.embedding_length", Value::U32(64))
            .metadata("llama.feed_forward_length", Value::U32(96))
            .metadata("llama.attention.head_count", Value::U32(4))
            .metadata("llama.attention.head_count_kv", Value::U32(2))
            .metadata("llama.rope.freq_base", Value::F32(100_000.0))
            .metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
            .metadata("llama.context_length", Value::U32(128))
            .metadata("tokenizer.ggml.tokens", Value::Array(vec![Value::String("a".into()); 5]));
        w
    }

    #[test]
    fn reads_every_field_and_defaults() {
        let p = temp_path("config.gguf");
        base().write(&p).unwrap();
        let c = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!(
            c,
            LlamaConfig {
                n_layers: 2,
                hidden: 64,
                ffn: 96,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 16,
                rope_theta: 100_000.0,
                rope_dim: 16,
                rms_eps: 1e-5,
                vocab_size: 5,
                context_length: 128,
                tied_embeddings: true,
                activation: Activation::Silu,
                embedding_scale: None,
                rope_freq_factors: None,
                rope_attn_factor: None,
                longrope: None,
                qk_norm: false,
                attn_softcap: None,
                final_softcap: None,
                sliding_window: None,
                post_norms: false,
                query_scale: None,
                rope_local_theta: None,
            }
        );
        assert_eq!(c.group_size(), 2);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn qwen2_reads_its_own_keys_and_defaults_the_rotary_base_to_a_million() {
        let p = temp_path("config-qwen2.gguf");
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("qwen2".into()))
            .metadata("qwen2.block_count", Value::U32(1))
            .metadata("qwen2.embedding_length", Value::U32(32))
            .metadata("qwen2.feed_forward_length", Value::U32(64))
            .metadata("qwen2.attention.head_count", Value::U32(4))
            .metadata("qwen2.attention.head_count_kv", Value::U32(1))
            .metadata("qwen2.attention.layer_norm_rms_epsilon", Value::F32(1e-6))
            .metadata("qwen2.context_length", Value::U32(64))
            .metadata("tokenizer.ggml.tokens", Value::Array(vec![Value::String("a".into()); 3]));
        w.write(&p).unwrap();
        let c = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!((c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim), (1, 4, 1, 8));
        assert_eq!(c.rope_theta, 1_000_000.0);
        std::fs::remove_file(p).unwrap();
        let p = temp_path("config-arch.gguf");
        let mut w = base();
        w.metadata("general.architecture", Value::String("gemma3n".into()));
        w.write(&p).unwrap();
        let err = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err();
        assert!(err.to_string().contains("`gemma3n` is not supported"), "{err}");
        std::fs::remove_file(p).unwrap();
    }

    /// Qwen3 (Qwen3-0.6B's shape, scaled down): heads wider than `hidden / heads` from
    /// `key_length`, the rotary base of the file, per-head query/key norms; its
    /// mixture-of-experts sibling is refused by name.
    #[test]
    fn qwen3_reads_its_head_size_and_norms_and_refuses_its_mixture_of_experts() {
        let p = temp_path("config-qwen3.gguf");
        let qwen3 = |arch: &str| {
            let mut w = GgufWriter::new();
            let k = |key: &str| format!("{arch}.{key}");
            w.metadata("general.architecture", Value::String(arch.into()))
                .metadata(&k("block_count"), Value::U32(2))
                .metadata(&k("embedding_length"), Value::U32(32))
                .metadata(&k("feed_forward_length"), Value::U32(96))
                .metadata(&k("attention.head_count"), Value::U32(4))
                .metadata(&k("attention.head_count_kv"), Value::U32(2))
                .metadata(&k("attention.key_length"), Value::U32(16))
                .metadata(&k("attention.value_length"), Value::U32(16))
                .metadata(&k("rope.freq_base"), Value::F32(1_000_000.0))
                .metadata(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6))
                .metadata(&k("context_length"), Value::U32(64))
                .metadata("tokenizer.ggml.tokens", Value::Array(vec![Value::String("a".into()); 3]))
                .tensor_f32("output.weight", &[3, 32], &[0.0; 96]);
            w
        };
        qwen3("qwen3").write(&p).unwrap();
        let c = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!((c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dim), (32, 4, 2, 16, 16));
        assert_eq!((c.rope_theta, c.rms_eps), (1_000_000.0, 1e-6));
        assert!(c.qk_norm && !c.tied_embeddings, "{c:?}");
        qwen3("qwen2").write(&p).unwrap();
        let qwen2 = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert!(!qwen2.qk_norm, "the same keys under qwen2 have no query/key norms");
        qwen3("qwen3moe").write(&p).unwrap();
        let err = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "metadata key `general.architecture`: `qwen3moe` is not supported \
             (llama, qwen2, qwen3, phi3, gemma, gemma2 and gemma3 are)"
        );
        std::fs::remove_file(p).unwrap();
    }

    /// Gemma 2 (its 2B's shape, scaled down): soft-caps from the file or llama.cpp's defaults,
    /// a window on the even layers, post-norms, GELU and scaled embeddings; the 27B's query
    /// scale from its 46 layers; a missing or empty window is refused by name.
    #[test]
    fn gemma2_reads_its_caps_window_and_post_norms() {
        let p = temp_path("config-gemma2.gguf");
        let gemma2 = |layers: u32, hidden: u32, caps: bool, window: Option<u32>| {
            let mut w = GgufWriter::new();
            let k = |key: &str| format!("gemma2.{key}");
            w.metadata("general.architecture", Value::String("gemma2".into()))
                .metadata(&k("block_count"), Value::U32(layers))
                .metadata(&k("embedding_length"), Value::U32(hidden))
                .metadata(&k("feed_forward_length"), Value::U32(96))
                .metadata(&k("attention.head_count"), Value::U32(4))
                .metadata(&k("attention.head_count_kv"), Value::U32(2))
                .metadata(&k("attention.key_length"), Value::U32(16))
                .metadata(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6))
                .metadata(&k("context_length"), Value::U32(64))
                .metadata(
                    "tokenizer.ggml.tokens",
                    Value::Array(vec![Value::String("a".into()); 3]),
                );
            if caps {
                w.metadata(&k("attn_logit_softcapping"), Value::F32(20.0))
                    .metadata(&k("final_logit_softcapping"), Value::F32(10.0));
            }
            if let Some(window) = window {
                w.metadata(&k("attention.sliding_window"), Value::U32(window));
            }
            w
        };
        let read = |w: GgufWriter| {
            w.write(&p).unwrap();
            LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap())
        };
        let c = read(gemma2(3, 64, true, Some(4))).unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap), (Some(20.0), Some(10.0)));
        let window = c.sliding_window.unwrap();
        assert_eq!(window.tokens, 4);
        assert_eq!(
            (0..4).map(|l| window.slides(l)).collect::<Vec<_>>(),
            [true, false, true, false]
        );
        assert!(c.post_norms && c.tied_embeddings, "{c:?}");
        assert_eq!((c.activation, c.embedding_scale), (Activation::GeluTanh, Some(8.0)));
        assert_eq!((c.rope_theta, c.query_scale), (10_000.0, None));
        assert_eq!(read(gemma2(46, 64, true, Some(4))).unwrap().query_scale, None);
        let c = read(gemma2(46, 36, false, Some(4))).unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(c.query_scale, Some(1.0 / 3.0), "27B: (36 / 4)^-0.5, not its head size's");
        let err = read(gemma2(3, 64, true, None)).unwrap_err();
        assert!(err.to_string().contains("gemma2.attention.sliding_window"), "{err}");
        let err = read(gemma2(3, 64, true, Some(0))).unwrap_err();
        assert!(err.to_string().contains("gemma2.attention.sliding_window"), "{err}");
        std::fs::remove_file(p).unwrap();
    }

    /// Gemma 3 (its 1B's shape, scaled down): no caps, a window on five of every six layers,
    /// query/key norms and post-norms, a global rotary base from the file with its linear
    /// scaling and a local one of 1e4 unscaled; the 27B's query scale from its 62 layers; a
    /// missing window is refused by name.
    #[test]
    fn gemma3_reads_its_window_pattern_and_two_rotary_bases() {
        let p = temp_path("config-gemma3.gguf");
        let gemma3 = |layers: u32, hidden: u32, window: Option<u32>| {
            let mut w = GgufWriter::new();
            let k = |key: &str| format!("gemma3.{key}");
            w.metadata("general.architecture", Value::String("gemma3".into()))
                .metadata(&k("block_count"), Value::U32(layers))
                .metadata(&k("embedding_length"), Value::U32(hidden))
                .metadata(&k("feed_forward_length"), Value::U32(96))
                .metadata(&k("attention.head_count"), Value::U32(4))
                .metadata(&k("attention.head_count_kv"), Value::U32(1))
                .metadata(&k("attention.key_length"), Value::U32(16))
                .metadata(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6))
                .metadata(&k("rope.freq_base"), Value::F32(1_000_000.0))
                .metadata(&k("rope.scaling.type"), Value::String("linear".into()))
                .metadata(&k("rope.scaling.factor"), Value::F32(8.0))
                .metadata(&k("context_length"), Value::U32(64))
                .metadata(
                    "tokenizer.ggml.tokens",
                    Value::Array(vec![Value::String("a".into()); 3]),
                );
            if let Some(window) = window {
                w.metadata(&k("attention.sliding_window"), Value::U32(window));
            }
            w
        };
        let read = |w: GgufWriter| {
            w.write(&p).unwrap();
            LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap())
        };
        let c = read(gemma3(13, 64, Some(4))).unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap, c.query_scale), (None, None, None));
        let window = c.sliding_window.unwrap();
        assert_eq!(window.tokens, 4);
        let global: Vec<usize> = (0..13).filter(|&l| !window.slides(l)).collect();
        assert_eq!(global, [5, 11], "layer i is global when (i + 1) % 6 == 0");
        assert!(c.qk_norm && c.post_norms && c.tied_embeddings, "{c:?}");
        assert_eq!((c.activation, c.embedding_scale), (Activation::GeluTanh, Some(8.0)));
        assert_eq!((c.rope_theta, c.rope_local_theta), (1_000_000.0, Some(10_000.0)));
        let eight = [8.0f32; 8];
        assert_eq!(c.rope_of(5), (1_000_000.0, Some(&eight[..])), "global: scaled");
        assert_eq!(c.rope_of(4), (10_000.0, None), "local: base 1e4, unscaled");
        let c = read(gemma3(62, 36, Some(4))).unwrap();
        assert_eq!(c.query_scale, Some(1.0 / 3.0), "27B: (36 / 4)^-0.5, not its head size's");
        let err = read(gemma3(3, 64, None)).unwrap_err();
        assert!(err.to_string().contains("gemma3.attention.sliding_window"), "{err}");
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn inconsistent_heads_name_the_key() {
        let p = temp_path("config-bad.gguf");
        let mut w = base();
        w.metadata("llama.attention.head_count_kv", Value::U32(3));
        w.write(&p).unwrap();
        let err = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "metadata key `llama.attention.head_count_kv`: 3 kv heads do not divide 4 query heads"
        );
        std::fs::remove_file(p).unwrap();
    }

    /// Llama 3's factors keep short wavelengths, divide long ones by `factor` and interpolate
    /// between; a GGUF file's `rope_freqs.weight` and linear scaling are read, other kinds are
    /// refused by name.
    #[test]
    fn rope_scaling_factors_come_from_llama3_rules_and_the_file() {
        // Llama 3.1 8B: theta 5e5, head 128, factor 8, low 1, high 4, trained on 8192.
        let f = llama3_rope_factors(500_000.0, 128, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0, "the highest frequency is kept");
        assert_eq!(f[63], 8.0, "the lowest is divided by the factor");
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
        let between: Vec<usize> = (0..64).filter(|&i| f[i] > 1.0 && f[i] < 8.0).collect();
        assert!(!between.is_empty(), "{f:?}");
        for i in between {
            let inv = 500_000f64.powf(-((2 * i) as f64) / 128.0);
            let wavelen = 2.0 * std::f64::consts::PI / inv;
            assert!((2048.0..=8192.0).contains(&wavelen), "pair {i}: wavelength {wavelen}");
            let smooth = (8192.0 / wavelen - 1.0) / 3.0;
            let want = 1.0 / ((1.0 - smooth) / 8.0 + smooth);
            assert!((f64::from(f[i]) - want).abs() < 1e-5, "pair {i}: {} vs {want}", f[i]);
        }

        let p = temp_path("rope-freqs.gguf");
        let factors: Vec<f32> = (0..8).map(|i| 1.0 + i as f32).collect();
        base().tensor_f32("rope_freqs.weight", &[8], &factors).write(&p).unwrap();
        let c = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!(c.rope_freq_factors.as_deref(), Some(&factors[..]));
        let mut linear = base();
        linear
            .metadata("llama.rope.scaling.type", Value::String("linear".into()))
            .metadata("llama.rope.scaling.factor", Value::F32(4.0));
        linear.write(&p).unwrap();
        let c = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!(c.rope_freq_factors, Some(vec![4.0; 8]));
        let mut yarn = base();
        yarn.metadata("llama.rope.scaling.type", Value::String("yarn".into()));
        yarn.write(&p).unwrap();
        let err = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err();
        assert!(err.to_string().contains("llama.rope.scaling.type"), "{err}");
        let short = base().tensor_f32("rope_freqs.weight", &[3], &[1.0; 3]).write(&p);
        short.unwrap();
        let err = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err();
        assert!(err.to_string().contains("3 factors for 8 rotated pairs"), "{err}");
        std::fs::remove_file(p).unwrap();
    }

    /// Longrope from a GGUF file: the short factors up to the original context, the long ones
    /// beyond it (by the file's context length, or [`LlamaConfig::for_context`]'s), the
    /// attention factor from the file or else from the context ratio; factor lists of the wrong
    /// length, a missing list or original context are refused by name.
    #[test]
    fn longrope_factors_are_chosen_by_the_context_and_checked() {
        let p = temp_path("longrope.gguf");
        let short: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 * 0.01).collect();
        let long: Vec<f32> = (0..8).map(|i| 1.0 + i as f32 * 3.0).collect();
        let phi = |original: u32| {
            let mut w = base();
            w.metadata("llama.rope.scaling.original_context_length", Value::U32(original))
                .tensor_f32("rope_factors_short.weight", &[8], &short)
                .tensor_f32("rope_factors_long.weight", &[8], &long);
            w
        };
        let read = |w: &GgufWriter| {
            w.write(&p).unwrap();
            LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap())
        };
        // Trained on 32 positions, extended to the file's 128: long factors, and
        // sqrt(1 + ln 4 / ln 32).
        let c = read(&phi(32)).unwrap();
        assert_eq!(c.rope_freq_factors.as_deref(), Some(&long[..]));
        let want = (1.0 + 4f64.ln() / 32f64.ln()).sqrt() as f32;
        assert_eq!(c.rope_attn_factor, Some(want));
        assert_eq!(
            longrope_attn_factor(131_072, 4096),
            (1.0 + 32f64.ln() / 4096f64.ln()).sqrt() as f32
        );
        assert!((longrope_attn_factor(131_072, 4096) - 1.190_238_4).abs() < 1e-6);
        let rope = c.longrope.clone().unwrap();
        assert_eq!(
            (rope.short, rope.long, rope.original_context),
            (short.clone(), long.clone(), 32)
        );
        // The same model run within its original context takes the short factors.
        let shorter = c.clone().for_context(32);
        assert_eq!(shorter.rope_freq_factors.as_deref(), Some(&short[..]));
        assert_eq!(shorter.rope_attn_factor, c.rope_attn_factor);
        assert_eq!(c.clone().for_context(33).rope_freq_factors, c.rope_freq_factors);
        // Original context = the file's: short factors, no attention factor.
        let c = read(&phi(128)).unwrap();
        assert_eq!(c.rope_freq_factors.as_deref(), Some(&short[..]));
        assert_eq!(c.rope_attn_factor, None);
        // The file's attention factor wins.
        let mut given = phi(32);
        given.metadata("llama.rope.scaling.attn_factor", Value::F32(1.5));
        assert_eq!(read(&given).unwrap().rope_attn_factor, Some(1.5));

        let mut bad = base();
        bad.metadata("llama.rope.scaling.original_context_length", Value::U32(32))
            .tensor_f32("rope_factors_short.weight", &[8], &short)
            .tensor_f32("rope_factors_long.weight", &[6], &[1.0; 6]);
        let err = read(&bad).unwrap_err();
        assert_eq!(
            err.to_string(),
            "metadata key `rope_factors_long.weight`: 6 factors for 8 rotated pairs, all positive"
        );
        let mut one = base();
        one.metadata("llama.rope.scaling.original_context_length", Value::U32(32)).tensor_f32(
            "rope_factors_long.weight",
            &[8],
            &long,
        );
        let err = read(&one).unwrap_err();
        assert!(err.to_string().contains("rope_factors_short.weight"), "{err}");
        let mut no_original = base();
        no_original.tensor_f32("rope_factors_short.weight", &[8], &short).tensor_f32(
            "rope_factors_long.weight",
            &[8],
            &long,
        );
        let err = read(&no_original).unwrap_err();
        assert!(err.to_string().contains("llama.rope.scaling.original_context_length"), "{err}");
        let mut no_tensors = base();
        no_tensors.metadata("llama.rope.scaling.type", Value::String("longrope".into()));
        let err = read(&no_tensors).unwrap_err();
        assert!(err.to_string().contains("rope_factors_long.weight"), "{err}");
        std::fs::remove_file(p).unwrap();
    }

    /// Every field that changes the weights is named in the model's terms, one line each,
    /// the checkpoint's value first; the context length alone is no difference.
    #[test]
    fn differences_name_each_field_in_the_models_terms() {
        let p = temp_path("config-diff.gguf");
        base().write(&p).unwrap();
        let live = LlamaConfig::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        assert_eq!(live.differences(&live), Vec::<String>::new());
        let longer = LlamaConfig { context_length: 4096, ..live.clone() };
        assert_eq!(longer.differences(&live), Vec::<String>::new());
        let cases: Vec<(LlamaConfig, &str)> = vec![
            (LlamaConfig { n_layers: 1, ..live.clone() }, "1 layers; the live model has 2"),
            (LlamaConfig { hidden: 32, ..live.clone() }, "hidden size 32; the live model has 64"),
            (
                LlamaConfig { ffn: 128, ..live.clone() },
                "feed-forward size 128; the live model has 96",
            ),
            (LlamaConfig { n_heads: 8, ..live.clone() }, "8 attention heads; the live model has 4"),
            (
                LlamaConfig { n_kv_heads: 4, ..live.clone() },
                "4 key/value heads; the live model has 2",
            ),
            (LlamaConfig { head_dim: 8, ..live.clone() }, "head size 8; the live model has 16"),
            (
                LlamaConfig { rope_dim: 8, ..live.clone() },
                "8 rotated elements per head; the live model has 16",
            ),
            (
                LlamaConfig { vocab_size: 6, ..live.clone() },
                "vocabulary size 6; the live model has 5",
            ),
            (
                LlamaConfig { rope_theta: 10_000.0, ..live.clone() },
                "rope theta 10000; the live model has 100000",
            ),
            (
                LlamaConfig { rms_eps: 1e-6, ..live.clone() },
                "RMS norm epsilon 0.000001; the live model has 0.00001",
            ),
            (
                LlamaConfig { tied_embeddings: false, ..live.clone() },
                "its own output layer; the live model ties it to the embeddings",
            ),
            (
                LlamaConfig { rope_freq_factors: Some(vec![1.0; 8]), ..live.clone() },
                "8 rope frequency factors; the live model has no rope scaling",
            ),
            (
                LlamaConfig { rope_attn_factor: Some(1.25), ..live.clone() },
                "rotation scaled by 1.25; the live model has unscaled rotation",
            ),
            (
                LlamaConfig { activation: Activation::GeluTanh, ..live.clone() },
                "GELU (tanh) activation; the live model has SiLU",
            ),
            (
                LlamaConfig { embedding_scale: Some(8.0), ..live.clone() },
                "embeddings scaled by 8; the live model has unscaled embeddings",
            ),
            (
                LlamaConfig { qk_norm: true, ..live.clone() },
                "per-head query/key norms; the live model has no query/key norms",
            ),
            (
                LlamaConfig { rope_local_theta: Some(10_000.0), ..live.clone() },
                "local rope theta 10000; the live model has one rope theta",
            ),
        ];
        for (new, want) in cases {
            assert_eq!(new.differences(&live), vec![want.to_owned()]);
        }
        let scaled = LlamaConfig { rope_freq_factors: Some(vec![1.0; 8]), ..live.clone() };
        let rescaled = LlamaConfig { rope_freq_factors: Some(vec![2.0; 8]), ..live.clone() };
        assert_eq!(
            rescaled.differences(&scaled),
            ["other 8 rope frequency factors; the live model has its own"]
        );
        let longrope = |long: f32| LongRope {
            short: vec![1.0; 8],
            long: vec![long; 8],
            original_context: 32,
            attn_factor: 1.1,
        };
        let phi = LlamaConfig { longrope: Some(longrope(4.0)), ..scaled.clone() };
        let within = LlamaConfig { rope_freq_factors: Some(vec![4.0; 8]), ..phi.clone() };
        assert_eq!(
            within.differences(&phi),
            Vec::<String>::new(),
            "the other pick is no difference"
        );
        let other = LlamaConfig { longrope: Some(longrope(5.0)), ..phi.clone() };
        assert_eq!(other.differences(&phi), ["other longrope factors; the live model has its own"]);
        let two = LlamaConfig { n_layers: 29, hidden: 32, ..live.clone() };
        let thirty = LlamaConfig { n_layers: 30, ..live };
        assert_eq!(
            two.differences(&thirty),
            ["29 layers; the live model has 30", "hidden size 32; the live model has 64"]
        );
    }
}
