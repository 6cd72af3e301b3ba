//! The single-rank decoder the tests check the parallel model against: the blocks of this
//! module run one after another on one backend, with a plain [`KvCache`], no communicator and
//! no batching, so every layout of [`crate::parallel::ParallelModel`] must give its greedy
//! tokens. (Production code runs only the parallel model, on one rank too.)

use super::*;
use checkpoint::Checkpoint;
use std::path::Path;
use tensor::kernels::Weight;

/// One decoder block.
#[derive(Clone, Debug)]
pub struct Block {
    pub(super) attn_norm: Tensor,
    pub(super) attn: Attention,
    pub(super) ffn_norm: Tensor,
    pub(super) mlp: Mlp,
    /// Gemma 2's norms of the attention output and of the MLP output.
    pub(super) post_norms: Option<(Tensor, Tensor)>,
}

/// A single-rank Llama-family decoder.
#[derive(Clone, Debug)]
pub struct Model {
    pub(super) config: LlamaConfig,
    pub(super) backend: Backend,
    pub(super) embed: Weight,
    pub(super) blocks: Vec<Block>,
    pub(super) norm: Tensor,
    pub(super) lm_head: Option<Linear>,
    /// Says the weights are freed when the model drops them (after the fields above), so a
    /// backend's device copies found by their addresses are not reused for other weights.
    pub(super) _holder: tensor::memory::WeightsHolder,
}

impl Model {
    /// Loads a model onto the CPU backend with `threads` threads, keeping quantized weights
    /// quantized: a GGUF file, or a Hugging Face folder (`config.json` + safetensors).
    ///
    /// # Errors
    /// Any error of opening the file, reading the config or loading a weight.
    pub fn load(path: impl AsRef<Path>, threads: usize) -> Result<Self> {
        Model::load_with(path, threads, WeightForm::Native)
    }

    /// [`Model::load`] with a choice of weight form.
    ///
    /// # Errors
    /// As [`Model::load`].
    pub fn load_with(path: impl AsRef<Path>, threads: usize, form: WeightForm) -> Result<Self> {
        let ck = Checkpoint::open(path)?;
        let config = ck.config()?;
        let weights = ck.weights(&config);
        Model::from_source(&*weights, config, Backend::cpu(threads)?, form)
    }

    /// Builds the model from any weight source.
    ///
    /// # Errors
    /// [`Error::Tensor`] for missing or misshapen weights.
    pub fn from_source(
        src: &dyn WeightSource,
        config: LlamaConfig,
        backend: Backend,
        form: WeightForm,
    ) -> Result<Self> {
        if src.qk_interleaved() && config.rope_dim != config.head_dim {
            let message = "partial rotary with interleaved q/k weights is not supported";
            return Err(checkpoint::Error::metadata("rope.dimension_count", message).into());
        }
        let embed = Linear::load(src, "token_embd.weight", &Shard::Full, form)?;
        if embed.dims() != (config.vocab_size, config.hidden) {
            return Err(Error::tensor(
                "token_embd.weight",
                format!(
                    "shape {:?}, expected ({}, {})",
                    embed.dims(),
                    config.vocab_size,
                    config.hidden
                ),
            ));
        }
        let mut blocks = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            blocks.push(Block {
                attn_norm: load_vector(src, &format!("blk.{l}.attn_norm.weight"), config.hidden)?,
                attn: Attention::load(src, l, &config, 0..config.n_kv_heads, form)?,
                ffn_norm: load_vector(src, &format!("blk.{l}.ffn_norm.weight"), config.hidden)?,
                mlp: Mlp::load(src, l, 0..config.ffn, form)?.with_activation(config.activation),
                post_norms: if config.post_norms {
                    let norm =
                        |t: &str| load_vector(src, &format!("blk.{l}.{t}.weight"), config.hidden);
                    Some((norm("post_attention_norm")?, norm("post_ffw_norm")?))
                } else {
                    None
                },
            });
        }
        let norm = load_vector(src, "output_norm.weight", config.hidden)?;
        let lm_head = if config.tied_embeddings {
            None
        } else {
            Some(Linear::load(src, "output.weight", &Shard::Full, form)?)
        };
        let embed = embed.weight().clone();
        let _holder = tensor::memory::WeightsHolder::default();
        let model = Model { config, backend, embed, blocks, norm, lm_head, _holder };
        tracing::debug!(
            layers = model.config.n_layers,
            hidden = model.config.hidden,
            weight_bytes = model.weight_bytes(),
            "model loaded"
        );
        Ok(model)
    }

    /// Bytes held by the weights (quantized ones at their packed size).
    pub fn weight_bytes(&self) -> usize {
        let per_block = if self.config.post_norms { 4 } else { 2 };
        let norms = (per_block * self.blocks.len() + 1) * self.config.hidden * 4;
        let linears: usize = self
            .blocks
            .iter()
            .map(|b| {
                b.attn.qkv.weight().nbytes()
                    + b.attn.qkv_bias.as_ref().map_or(0, |t| t.len() * 4)
                    + b.attn.qk_norm.as_ref().map_or(0, |n| (n.q.len() + n.k.len()) * 4)
                    + b.attn.o.weight().nbytes()
                    + b.mlp.gate_up.weight().nbytes()
                    + b.mlp.down.weight().nbytes()
            })
            .sum();
        self.embed.nbytes()
            + linears
            + norms
            + self.lm_head.as_ref().map_or(0, |l| l.weight().nbytes())
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// An empty KV cache for `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(self.config.n_layers, self.config.n_kv_heads, self.config.head_dim, capacity)
    }

    /// Runs `tokens` at absolute `positions` through the decoder, appending their keys and
    /// values to `cache`, and returns logits `[rows, vocab]` (`rows` per `logits`). On error the
    /// cache is left as it was.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when `tokens` and `positions` differ in length or are empty,
    /// [`tensor::Error::TokenOutOfRange`], [`Error::CacheFull`].
    pub fn forward(
        &self,
        tokens: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        logits: Logits,
    ) -> Result<Tensor> {
        if tokens.len() != positions.len() || tokens.is_empty() {
            return Err(Error::shape(
                "Model::forward",
                format!("{} tokens with {} positions", tokens.len(), positions.len()),
            ));
        }
        let before = cache.len();
        let out = self.forward_inner(tokens, positions, cache, logits);
        if out.is_err() {
            cache.truncate(before);
        }
        out
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        logits: Logits,
    ) -> Result<Tensor> {
        let be = &self.backend;
        let c = &self.config;
        if cache.len() + tokens.len() > cache.capacity() {
            return Err(Error::CacheFull {
                len: cache.len(),
                capacity: cache.capacity(),
                requested: tokens.len(),
            });
        }
        let mut x = be.embedding(&self.embed, tokens)?;
        if let Some(s) = c.embedding_scale {
            be.scale(&mut x, s)?;
        }
        // Each residual add is fused with the norm that reads the sum (the FFN's, then the
        // next block's attention norm); the last block's sum is normed after the row choice.
        let mut normed = None;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = match normed.take() {
                Some(h) => h,
                None => be.rms_norm(&x, &b.attn_norm, c.rms_eps)?,
            };
            let mut a = b.attn.forward(be, &h, positions, cache.layer_mut(l))?;
            if let Some((post, _)) = &b.post_norms {
                a = be.rms_norm(&a, post, c.rms_eps)?;
            }
            let h = be.add_rms_norm(&mut x, &a, &b.ffn_norm, c.rms_eps)?;
            let mut m = b.mlp.forward(be, &h)?;
            if let Some((_, post)) = &b.post_norms {
                m = be.rms_norm(&m, post, c.rms_eps)?;
            }
            match self.blocks.get(l + 1) {
                Some(next) => {
                    normed = Some(be.add_rms_norm(&mut x, &m, &next.attn_norm, c.rms_eps)?)
                }
                None => be.add_assign(&mut x, &m)?,
            }
        }
        if logits == Logits::Last && tokens.len() > 1 {
            x = Tensor::from_vec(&[1, c.hidden], x.host_row(tokens.len() - 1)?.to_vec())?;
        }
        let x = be.rms_norm(&x, &self.norm, c.rms_eps)?;
        let logits = be.linear(&x, self.lm_head.as_ref().map_or(&self.embed, Linear::weight))?;
        match c.final_softcap {
            Some(cap) => {
                let capped = logits.host()?.iter().map(|&v| cap * (v / cap).tanh()).collect();
                Ok(Tensor::from_vec(logits.shape(), capped)?)
            }
            None => Ok(logits),
        }
    }

    /// Greedy decoding: prefills `prompt` after whatever `cache` holds, then appends the
    /// argmax token until `max_new` tokens, a token in `stop` (included in the result), or a
    /// full cache. `on_token` sees each new token as it is chosen.
    ///
    /// # Errors
    /// As [`Model::forward`] (a full cache ends generation without an error once at least the
    /// prompt fits).
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        stop: &[u32],
        cache: &mut KvCache,
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if max_new == 0 || prompt.is_empty() {
            return Ok(out);
        }
        let start = cache.len();
        let positions: Vec<usize> = (start..start + prompt.len()).collect();
        let mut logits = self.forward(prompt, &positions, cache, Logits::Last)?;
        loop {
            let next = self.backend.argmax_rows(&logits)?[0] as u32;
            out.push(next);
            on_token(next);
            if out.len() >= max_new || stop.contains(&next) || cache.len() >= cache.capacity() {
                return Ok(out);
            }
            let pos = cache.len();
            logits = self.forward(&[next], &[pos], cache, Logits::Last)?;
        }
    }
}
