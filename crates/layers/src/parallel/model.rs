//! The sharded model: [`ParallelModel`], its decoder blocks, how a rank's shard is loaded
//! ([`LoadOptions`]), and its weight buffers.

use super::{
    aligned_ranges, ffn_range, ParallelAttention, ParallelLmHead, Placement, VocabParallelEmbedding,
};
use crate::error::Result;
use crate::model::provenance::{self, Span, WeightMap};
use crate::model::{load_vector, Linear, Mlp, WeightForm, WeightUses};
use checkpoint::{Checkpoint, LlamaConfig, Shard, WeightSource};
use std::path::Path;
use tensor::kernels::{Backend, WeightUse};
use tensor::memory::{padded, Arena, WeightBuffers};
use tensor::Tensor;

#[derive(Clone, Debug)]
pub(super) struct ParallelBlock {
    pub(super) attn_norm: Tensor,
    pub(super) attn: ParallelAttention,
    pub(super) ffn_norm: Tensor,
    pub(super) mlp: Mlp,
    /// Gemma 2's and Gemma 3's norms of the attention output and of the MLP output, before
    /// each is added to the residual stream.
    pub(super) post_norms: Option<PostNorms>,
}

/// A block's norms after attention and after the MLP (Gemma 2's `post_attention_norm`,
/// `post_ffw_norm`).
#[derive(Clone, Debug)]
pub(crate) struct PostNorms {
    pub(crate) attn: Tensor,
    pub(crate) ffn: Tensor,
}

impl PostNorms {
    /// Loads layer `layer`'s post-norms when `cfg` has them.
    ///
    /// # Errors
    /// [`crate::Error::Tensor`] when one is missing or misshapen.
    pub(crate) fn load(
        src: &dyn WeightSource,
        layer: usize,
        cfg: &LlamaConfig,
    ) -> Result<Option<Self>> {
        if !cfg.post_norms {
            return Ok(None);
        }
        let norm = |t: &str| load_vector(src, &format!("blk.{layer}.{t}.weight"), cfg.hidden);
        Ok(Some(PostNorms { attn: norm("post_attention_norm")?, ffn: norm("post_ffw_norm")? }))
    }
}

impl WeightUses for ParallelBlock {
    fn weight_uses<'a>(&'a self, out: &mut Vec<WeightUse<'a>>) {
        out.push(WeightUse::Norm(&self.attn_norm));
        self.attn.attn.weight_uses(out);
        out.push(WeightUse::Norm(&self.ffn_norm));
        self.mlp.weight_uses(out);
        if let Some(post) = &self.post_norms {
            out.extend([WeightUse::Norm(&post.attn), WeightUse::Norm(&post.ffn)]);
        }
    }
}

/// The buffers in the order attention norm, attention (see
/// [`Attention`](crate::model::Attention)'s order), post-attention norm (when the model has
/// one), MLP norm, MLP, post-MLP norm (when it has one).
impl WeightBuffers for ParallelBlock {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.attn_norm.buffers(out);
        self.attn.attn.buffers(out);
        if let Some(post) = &self.post_norms {
            post.attn.buffers(out);
        }
        self.ffn_norm.buffers(out);
        self.mlp.buffers(out);
        if let Some(post) = &self.post_norms {
            post.ffn.buffers(out);
        }
    }

    fn move_to(&mut self, arena: &dyn Arena) -> tensor::Result<()> {
        self.attn_norm.move_to(arena)?;
        self.attn.attn.move_to(arena)?;
        if let Some(post) = &mut self.post_norms {
            post.attn.move_to(arena)?;
        }
        self.ffn_norm.move_to(arena)?;
        self.mlp.move_to(arena)?;
        if let Some(post) = &mut self.post_norms {
            post.ffn.move_to(arena)?;
        }
        Ok(())
    }
}

/// How [`ParallelModel::load`] and [`ParallelModel::from_source`] build a rank's shard: its
/// place in the mesh, where it computes (the CPU with `threads` threads unless a backend is
/// given), the form of its weights, and who hears of the progress.
///
/// ```no_run
/// # use layers::parallel::{LoadOptions, ParallelModel, Placement};
/// # use layers::model::WeightForm;
/// let model = ParallelModel::load(
///     "model.gguf",
///     LoadOptions::new(Placement::single()).threads(4).form(WeightForm::F32),
/// )?;
/// # Ok::<(), layers::Error>(())
/// ```
pub struct LoadOptions<'a> {
    placement: Placement,
    backend: Option<Backend>,
    threads: usize,
    form: WeightForm,
    context: Option<usize>,
    progress: Option<&'a mut dyn FnMut(usize, usize)>,
}

impl LoadOptions<'static> {
    /// The shard at `placement`, on the CPU with one thread, weights in their native form,
    /// no progress reports.
    pub fn new(placement: Placement) -> LoadOptions<'static> {
        LoadOptions {
            placement,
            backend: None,
            threads: 1,
            form: WeightForm::default(),
            context: None,
            progress: None,
        }
    }
}

impl<'a> LoadOptions<'a> {
    /// Computes on the CPU with `threads` threads (ignored when a backend is given).
    #[must_use]
    pub fn threads(mut self, threads: usize) -> Self {
        self.threads = threads;
        self
    }

    /// Computes on `backend` (a GPU's, say).
    #[must_use]
    pub fn on(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Keeps the weights in `form`.
    #[must_use]
    pub fn form(mut self, form: WeightForm) -> Self {
        self.form = form;
        self
    }

    /// Runs the model with contexts of at most `tokens` (the checkpoint's context length when
    /// not given): longrope picks its factors by it ([`LlamaConfig::for_context`]).
    #[must_use]
    pub fn context(mut self, tokens: usize) -> Self {
        self.context = Some(tokens);
        self
    }

    /// Calls `progress(done, total)` as the shard loads: after the embedding, each layer and
    /// the head (`total` is the layer count plus 2).
    #[must_use]
    pub fn progress<'b>(self, progress: &'b mut dyn FnMut(usize, usize)) -> LoadOptions<'b> {
        let LoadOptions { placement, backend, threads, form, context, .. } = self;
        LoadOptions { placement, backend, threads, form, context, progress: Some(progress) }
    }
}

impl std::fmt::Debug for LoadOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("placement", &self.placement)
            .field("backend", &self.backend)
            .field("threads", &self.threads)
            .field("form", &self.form)
            .field("context", &self.context)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// The Llama-family decoder sharded over a `tp × cp` mesh.
#[derive(Clone, Debug)]
pub struct ParallelModel {
    pub(super) config: LlamaConfig,
    pub(super) backend: Backend,
    pub(super) placement: Placement,
    pub(super) embed: VocabParallelEmbedding,
    pub(super) blocks: Vec<ParallelBlock>,
    pub(super) norm: Tensor,
    pub(super) lm_head: ParallelLmHead,
    /// Says the weights are freed when the model drops them (after the fields above), so a
    /// backend's device copies found by their addresses are not reused for other weights.
    pub(super) _holder: tensor::memory::WeightsHolder,
}

impl ParallelModel {
    /// Loads this rank's shard of a model: a GGUF file, or a Hugging Face folder
    /// (`config.json` and safetensors); only the rank's slices of each tensor are read.
    ///
    /// # Errors
    /// Starting the CPU kernels, opening the file, reading the config, loading a weight, or a
    /// layout the model cannot be split into.
    pub fn load(path: impl AsRef<Path>, opts: LoadOptions<'_>) -> Result<Self> {
        let ck = Checkpoint::open(path)?;
        let config = ck.config()?;
        let weights = ck.weights(&config);
        ParallelModel::from_source(&*weights, config, opts)
    }

    /// Builds this rank's shard from any weight source.
    ///
    /// # Errors
    /// As [`ParallelModel::load`].
    pub fn from_source(
        src: &dyn WeightSource,
        config: LlamaConfig,
        opts: LoadOptions<'_>,
    ) -> Result<Self> {
        let LoadOptions { placement, backend, threads, form, context, progress } = opts;
        let config = match context {
            Some(tokens) => config.for_context(tokens),
            None => config,
        };
        let backend = match backend {
            Some(backend) => backend,
            None => Backend::cpu(threads)?,
        };
        let mut silent = |_: usize, _: usize| {};
        let progress: &mut dyn FnMut(usize, usize) = match progress {
            Some(progress) => progress,
            None => &mut silent,
        };
        let Placement { tp_rank, tp, .. } = placement;
        let total = config.n_layers + 2;
        let vocab = aligned_ranges(config.vocab_size, tp, 1);
        let embed =
            VocabParallelEmbedding::load(src, "token_embd.weight", vocab[tp_rank].clone(), form)?;
        progress(1, total);
        let mut blocks = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            blocks.push(ParallelBlock {
                attn_norm: load_vector(src, &format!("blk.{l}.attn_norm.weight"), config.hidden)?,
                attn: ParallelAttention::load(src, l, &config, tp_rank, tp, form)?,
                ffn_norm: load_vector(src, &format!("blk.{l}.ffn_norm.weight"), config.hidden)?,
                mlp: Mlp::load(src, l, ffn_range(&config, tp_rank, tp), form)?
                    .with_activation(config.activation),
                post_norms: PostNorms::load(src, l, &config)?,
            });
            progress(l + 2, total);
        }
        let norm = load_vector(src, "output_norm.weight", config.hidden)?;
        let lm_head = if config.tied_embeddings {
            ParallelLmHead::tied(&embed, vocab, tp_rank)
        } else {
            let rows = Shard::Rows(vocab[tp_rank].clone());
            let weight = Linear::load(src, "output.weight", &rows, form)?.weight().clone();
            ParallelLmHead::new(weight, vocab, tp_rank)
        };
        progress(total, total);
        let _holder = tensor::memory::WeightsHolder::default();
        Ok(ParallelModel { config, backend, placement, embed, blocks, norm, lm_head, _holder })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Where this rank sits.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The backend the model computes on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The bytes of every weight buffer this rank holds, in the order
    /// [`ParallelModel::move_weights_to`] allocates them:
    /// 1. the embedding table (this rank's vocabulary rows);
    /// 2. for each layer: the attention norm, the fused Q/K/V projection, the Q/K/V bias (when
    ///    the model has one), the output projection, the post-attention norm (Gemma 2), the
    ///    MLP norm, the fused gate/up projection, the down projection and the post-MLP norm
    ///    (Gemma 2);
    /// 3. the final norm;
    /// 4. the LM head, unless it is tied to the embedding (the shared table is listed once).
    ///
    /// A matrix is one buffer of f32 values, or, quantized, its scales, its minimums (4-bit
    /// formats only) and its quants. Empty buffers are left out.
    pub fn weight_buffers(&self) -> Vec<&[u8]> {
        let mut out = Vec::new();
        self.embed.buffers(&mut out);
        for b in &self.blocks {
            b.buffers(&mut out);
        }
        self.norm.buffers(&mut out);
        if !self.lm_head.is_tied_to(&self.embed) {
            self.lm_head.buffers(&mut out);
        }
        out
    }

    /// Makes the backend's device copies of every weight now, as their first uses would make
    /// them (nothing on the CPU): after a load, and after a wakeup brought the weights back,
    /// so the first request does not pay for the uploads ([`Backend::prepare_weights`]).
    ///
    /// # Errors
    /// The backend's.
    pub fn prepare_device(&self) -> Result<()> {
        let mut uses = Vec::new();
        self.embed.weight_uses(&mut uses);
        for b in &self.blocks {
            b.weight_uses(&mut uses);
        }
        uses.push(WeightUse::Norm(&self.norm));
        self.lm_head.weight_uses(&mut uses);
        Ok(self.backend.prepare_weights(&uses)?)
    }

    /// Where the values of each of [`ParallelModel::weight_buffers`] come from in the
    /// checkpoint, in the same order (see [`provenance`]): a weight update whose tensors fall
    /// in f32 buffers writes them there directly ([`WeightMap::write`]); a block-quantized
    /// buffer is [`BufferSource::Other`](provenance::BufferSource::Other).
    pub fn weight_map(&self) -> WeightMap {
        let mut out = Vec::new();
        let hidden = self.config.hidden;
        let vector = |name: &str| vec![Span::rows(name.to_owned(), 0..1, hidden, 0)];
        let table = vec![Span::rows("token_embd.weight".into(), self.embed.vocab(), hidden, 0)];
        provenance::weight_sources(self.embed.table(), table, &mut out);
        for (l, b) in self.blocks.iter().enumerate() {
            let norm = |t: &str| vector(&format!("blk.{l}.{t}.weight"));
            provenance::vector_source(&b.attn_norm, norm("attn_norm"), &mut out);
            b.attn.attn.weight_sources(l, &mut out);
            if let Some(post) = &b.post_norms {
                provenance::vector_source(&post.attn, norm("post_attention_norm"), &mut out);
            }
            provenance::vector_source(&b.ffn_norm, norm("ffn_norm"), &mut out);
            b.mlp.weight_sources(l, &mut out);
            if let Some(post) = &b.post_norms {
                provenance::vector_source(&post.ffn, norm("post_ffw_norm"), &mut out);
            }
        }
        provenance::vector_source(&self.norm, vector("output_norm.weight"), &mut out);
        if !self.lm_head.is_tied_to(&self.embed) {
            let head = vec![Span::rows("output.weight".into(), self.lm_head.vocab(), hidden, 0)];
            provenance::weight_sources(self.lm_head.weight(), head, &mut out);
        }
        WeightMap::checked(out, &self.weight_buffers())
    }

    /// Every weight tensor this rank holds, named ("layer 3 Q/K/V bias") with its logical
    /// shape (`[out, in]` for a matrix, whatever its storage), in the order of
    /// [`ParallelModel::weight_buffers`]. Two shards with the same list hold the same weights,
    /// perhaps stored in other forms (f32 and Q8_0, say).
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let dims = |w: &tensor::kernels::Weight| {
            let (rows, cols) = w.dims();
            vec![rows, cols]
        };
        let mut out = vec![("token embedding".to_owned(), dims(self.embed.table()))];
        for (l, b) in self.blocks.iter().enumerate() {
            out.push((format!("layer {l} attention norm"), b.attn_norm.shape().to_vec()));
            let attn = b.attn.attn.weight_shapes();
            out.extend(attn.into_iter().map(|(what, shape)| (format!("layer {l} {what}"), shape)));
            if let Some(post) = &b.post_norms {
                out.push((format!("layer {l} post-attention norm"), post.attn.shape().to_vec()));
            }
            out.push((format!("layer {l} feed-forward norm"), b.ffn_norm.shape().to_vec()));
            let mlp = b.mlp.weight_shapes();
            out.extend(mlp.into_iter().map(|(what, shape)| (format!("layer {l} {what}"), shape)));
            if let Some(post) = &b.post_norms {
                out.push((format!("layer {l} post-feed-forward norm"), post.ffn.shape().to_vec()));
            }
        }
        out.push(("output norm".to_owned(), self.norm.shape().to_vec()));
        if !self.lm_head.is_tied_to(&self.embed) {
            out.push(("output layer".to_owned(), dims(self.lm_head.weight())));
        }
        out
    }

    /// Takes `other`'s weights (another checkpoint's shard of the same model, perhaps stored in
    /// another form and in other memory) in place of its own, which are dropped; the backend,
    /// the placement, the config and the rotation (longrope's factors, picked for this
    /// model's context) stay, so caches and pools made for this model still fit.
    /// The old buffers are freed, which bumps the weights generation
    /// ([`tensor::memory::weights_changed`]): a backend's device copies of them are stale, and
    /// `CudaBackend::clear_weight_cache` gives their device memory back.
    ///
    /// # Errors
    /// [`crate::Error::Mismatch`] when `other` is another shard or holds other weights (see
    /// [`ParallelModel::weight_shapes`]); nothing changes then.
    pub fn adopt_weights(&mut self, other: ParallelModel) -> Result<()> {
        if other.placement != self.placement {
            let at = |p: Placement| {
                format!("TP rank {} of {}, CP rank {} of {}", p.tp_rank, p.tp, p.cp_rank, p.cp)
            };
            return Err(crate::Error::Mismatch(format!(
                "they are the shard of {}, this model that of {}",
                at(other.placement),
                at(self.placement)
            )));
        }
        let (ours, theirs) = (self.weight_shapes(), other.weight_shapes());
        if let Some(difference) = shape_difference(&theirs, &ours) {
            return Err(crate::Error::Mismatch(difference));
        }
        let ParallelModel { embed, mut blocks, norm, lm_head, .. } = other;
        // The rotation is the running model's (longrope's factors follow its context), not
        // the weights'.
        for (new, live) in blocks.iter_mut().zip(&self.blocks) {
            new.attn.attn.rotate_as(&live.attn.attn);
        }
        (self.embed, self.blocks, self.norm, self.lm_head) = (embed, blocks, norm, lm_head);
        // The old buffers are freed: device copies found by their addresses are stale.
        tensor::memory::weights_changed();
        Ok(())
    }

    /// The arena bytes [`ParallelModel::move_weights_to`] needs when its allocations are carved
    /// out of one region: each of [`ParallelModel::weight_buffers`] rounded up to
    /// [`tensor::memory::ALIGN`], summed.
    pub fn weight_bytes(&self) -> usize {
        self.weight_buffers().iter().map(|b| padded(b.len())).sum()
    }

    /// Moves every weight buffer into memory from `arena`: one allocation per buffer, of
    /// exactly its length, in the order of [`ParallelModel::weight_buffers`]. The values are
    /// copied bit for bit and the heap copies are freed; a tied LM head keeps sharing the
    /// embedding table.
    ///
    /// # Errors
    /// [`tensor::Error::Arena`] when an allocation fails or has the wrong size, [`tensor::Error::Shape`] when
    /// one is misaligned. The buffers moved until then stay in the arena and the rest on the
    /// heap: the model computes the same either way.
    pub fn move_weights_to(&mut self, arena: &dyn Arena) -> Result<()> {
        let moved = self.move_each_to(arena);
        // Heap copies were freed (on a failure too): device copies found by their addresses
        // are stale.
        tensor::memory::weights_changed();
        moved
    }

    /// [`ParallelModel::move_weights_to`] without the bump.
    fn move_each_to(&mut self, arena: &dyn Arena) -> Result<()> {
        let tied = self.lm_head.is_tied_to(&self.embed);
        self.embed.move_to(arena)?;
        if tied {
            self.lm_head.tie_to(&self.embed);
        }
        for b in &mut self.blocks {
            b.move_to(arena)?;
        }
        self.norm.move_to(arena)?;
        if !tied {
            self.lm_head.move_to(arena)?;
        }
        Ok(())
    }
}

/// The first difference between two lists of [`ParallelModel::weight_shapes`], `new` against
/// `live`, in words ("layer 0 Q/K/V bias: the checkpoint has it; the live model does not");
/// `None` when they are the same.
pub fn shape_difference(
    new: &[(String, Vec<usize>)],
    live: &[(String, Vec<usize>)],
) -> Option<String> {
    let shape = |s: &[usize]| s.iter().map(usize::to_string).collect::<Vec<_>>().join(" x ");
    for (i, (n, l)) in new.iter().zip(live).enumerate() {
        if n.0 != l.0 {
            // A tensor one has and the other lacks shifts the rest: name it.
            return Some(if live.iter().skip(i).any(|x| x.0 == n.0) {
                format!("{}: the live model has it; the checkpoint does not", l.0)
            } else {
                format!("{}: the checkpoint has it; the live model does not", n.0)
            });
        }
        if n.1 != l.1 {
            return Some(format!(
                "{} is {}; the live model's is {}",
                n.0,
                shape(&n.1),
                shape(&l.1)
            ));
        }
    }
    match new.len().cmp(&live.len()) {
        std::cmp::Ordering::Equal => None,
        std::cmp::Ordering::Greater => {
            Some(format!("{}: the checkpoint has it; the live model does not", new[live.len()].0))
        }
        std::cmp::Ordering::Less => {
            Some(format!("{}: the live model has it; the checkpoint does not", live[new.len()].0))
        }
    }
}
