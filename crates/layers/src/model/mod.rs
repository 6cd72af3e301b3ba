//! The Llama-family decoder's pieces: attention and MLP blocks that can be loaded as shards,
//! linear layers, KV caches and the paged pool, random test checkpoints (and, for the tests,
//! the single-rank reference decoder in `reference`).
//!
//! Rotary embedding uses the rotate-half convention throughout; GGUF Q/K weights are
//! un-permuted at load (see [`linear::unpermute_rows`]).
//!
//! How the pieces serve the parallel model (not built here):
//! - Tensor parallelism: a rank loads [`Attention::load`] for a range of whole KV heads
//!   (its query heads follow), or [`Attention::load_heads`] for one KV head and part of its
//!   query heads when ranks outnumber KV heads, and [`Mlp::load`] for a range of inner units;
//!   both outputs are then partial sums to all-reduce over the TP group. Inner ranges that
//!   are multiples of 32 keep `ffn_down`'s column shard in its quantized blocks. The embedding and LM head shard
//!   by vocabulary rows with [`Linear::load`] and [`Shard::Rows`].
//! - Context parallelism: a rank runs [`Attention::qkv`] for its tokens, appends the keys and
//!   values it owns to its [`LayerCache`] (which records absolute positions), and
//!   [`Attention::attend`] with `want_lse` gives partial outputs that
//!   `kernels::cpu::attention::merge_partial` combines exactly.

pub mod cache;
pub mod kv_groups;
pub mod linear;
pub mod paged;
pub mod provenance;
pub mod random;
#[cfg(test)]
mod reference;
pub mod shaped;
#[cfg(test)]
mod tests;

pub use cache::{KvCache, LayerCache};
pub use kv_groups::{window_dead_blocks, KvGroups};
pub use linear::{Linear, WeightForm};
pub use paged::{KvPool, PagedCache, SplitRope};
#[cfg(test)]
pub(crate) use reference::Model;

use crate::error::{Error, Result};
use checkpoint::{LlamaConfig, Shard, WeightSource};
use provenance::{BufferSource, Span};
use std::ops::Range;
use tensor::kernels::{AttnShape, Backend, Projected, WeightUse};
use tensor::memory::{Arena, WeightBuffers};
use tensor::Tensor;

/// Loads the 1-d tensor `name` (a norm weight) of `len` elements.
///
/// # Errors
/// [`Error::Tensor`] when it is missing or has another shape.
pub fn load_vector(src: &dyn WeightSource, name: &str, len: usize) -> Result<Tensor> {
    let shape = src.shape(name)?;
    if shape != [len] {
        return Err(Error::tensor(name, format!("expected shape [{len}], found {shape:?}")));
    }
    Ok(Tensor::from_vec(&[len], src.rows(name, 0..1)?)?)
}

/// The slice of heads `heads` (of `head_dim` rows each) of the optional 1-d bias `name`
/// of `n_heads` heads; zeros when the file has no such bias. Query and key biases
/// (`rotary`) are un-permuted like their weight rows when the source stores them interleaved.
fn load_bias(
    src: &dyn WeightSource,
    name: &str,
    heads: Range<usize>,
    n_heads: usize,
    head_dim: usize,
    rotary: bool,
) -> Result<Vec<f32>> {
    let rows = heads.start * head_dim..heads.end * head_dim;
    if !src.has(name) {
        return Ok(vec![0.0; rows.len()]);
    }
    let full = load_vector(src, name, n_heads * head_dim)?;
    let slice = &full.data()[rows];
    Ok(if rotary && src.qk_interleaved() {
        linear::unpermute_rows(slice, 1, head_dim)
    } else {
        slice.to_vec()
    })
}

/// Qwen3's RMSNorm of every query head and every key head, each with one weight of
/// `head_dim` elements that all heads share. A head is normalized over its own elements, so a
/// rank normalizes the heads it holds with no collective.
#[derive(Clone, Debug)]
struct QkNorm {
    q: Tensor,
    k: Tensor,
    eps: f32,
}

impl QkNorm {
    /// Loads layer `layer`'s `attn_q_norm` and `attn_k_norm` (their elements in the order of
    /// the Q/K rows the model uses: un-permuted when the source interleaves Q/K rows).
    fn load(src: &dyn WeightSource, layer: usize, cfg: &LlamaConfig) -> Result<Self> {
        let d = cfg.head_dim;
        let load = |t: &str| -> Result<Tensor> {
            let w = load_vector(src, &format!("blk.{layer}.{t}.weight"), d)?;
            if src.qk_interleaved() {
                Ok(Tensor::from_vec(&[d], linear::unpermute_rows(w.data(), 1, d))?)
            } else {
                Ok(w)
            }
        };
        Ok(QkNorm { q: load("attn_q_norm")?, k: load("attn_k_norm")?, eps: cfg.rms_eps })
    }

    /// Normalizes every head of `x` (`[n, heads · head_dim]`) over its `head_dim` elements.
    fn apply(be: &Backend, x: Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        let (shape, d) = (x.shape().to_vec(), weight.len());
        let heads = x.len() / d.max(1);
        let heads = x.reshape(&[heads, d])?;
        Ok(be.rms_norm(&heads, weight, eps)?.reshape(&shape)?)
    }
}

/// Something that holds weights a device backend copies at their first use: it lists each
/// as that use reads it ([`WeightUse`]), for [`Backend::prepare_weights`]. Biases are left
/// out (a device backend copies them with each call, like activations).
pub(crate) trait WeightUses {
    /// Appends each weight's use to `out`.
    fn weight_uses<'a>(&'a self, out: &mut Vec<WeightUse<'a>>);
}

impl WeightUses for QkNorm {
    fn weight_uses<'a>(&'a self, out: &mut Vec<WeightUse<'a>>) {
        out.extend([WeightUse::Norm(&self.q), WeightUse::Norm(&self.k)]);
    }
}

/// The query norm's buffer, then the key norm's.
impl WeightBuffers for QkNorm {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.q.buffers(out);
        self.k.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> tensor::Result<()> {
        self.q.move_to(arena)?;
        self.k.move_to(arena)
    }
}

/// Self-attention of one layer over a range of whole KV heads (and their query heads), or
/// over one KV head and part of its query heads.
#[derive(Clone, Debug)]
pub struct Attention {
    /// Q, K and V projections fused into one product (rows: queries, keys, values).
    qkv: Linear,
    /// Optional Q, K and V biases (Qwen2), in the same row order as `qkv`.
    qkv_bias: Option<Tensor>,
    /// Optional per-head query and key norms (Qwen3, Gemma 3), applied before the rotation.
    qk_norm: Option<QkNorm>,
    o: Linear,
    kv_heads: Range<usize>,
    q_heads: Range<usize>,
    head_dim: usize,
    rope_dim: usize,
    rope_theta: f32,
    rope_factors: Option<std::sync::Arc<[f32]>>,
    /// The factor on the rotation's cosines and sines (longrope's attention factor), else 1.
    rope_attn_factor: f32,
    /// The score rules of this layer: query scale, soft-cap, sliding window (Gemma 2 and 3).
    scores: (Option<f32>, Option<f32>, Option<usize>),
}

impl Attention {
    /// Loads layer `layer`'s attention for KV heads `kv_heads` (query heads follow by group);
    /// the output projection keeps the matching input columns, so with a partial head range
    /// [`Attention::project_out`] returns a partial sum to be all-reduced.
    ///
    /// # Errors
    /// [`Error::Tensor`] for missing or misshapen weights, [`tensor::Error::Shape`] for a head range
    /// outside the model.
    pub fn load(
        src: &dyn WeightSource,
        layer: usize,
        cfg: &LlamaConfig,
        kv_heads: Range<usize>,
        form: WeightForm,
    ) -> Result<Self> {
        let g = cfg.group_size();
        let q_heads = kv_heads.start * g..kv_heads.end * g;
        Attention::load_heads(src, layer, cfg, kv_heads, q_heads, form)
    }

    /// Loads layer `layer`'s attention for KV heads `kv_heads` and query heads `q_heads`:
    /// either exactly the query heads of those KV heads' groups (as [`Attention::load`]), or
    /// part of the group of a single KV head. The second form serves tensor parallelism with
    /// more ranks than KV heads: the ranks sharing a KV head each hold its keys and values
    /// and a share of its query heads. The output projection keeps the columns of `q_heads`,
    /// so [`Attention::project_out`] returns a partial sum to be all-reduced.
    ///
    /// # Errors
    /// [`Error::Tensor`] for missing or misshapen weights, [`tensor::Error::Shape`] for a head range
    /// outside the model or query heads that do not belong to `kv_heads` as described.
    pub fn load_heads(
        src: &dyn WeightSource,
        layer: usize,
        cfg: &LlamaConfig,
        kv_heads: Range<usize>,
        q_heads: Range<usize>,
        form: WeightForm,
    ) -> Result<Self> {
        if kv_heads.is_empty() || kv_heads.end > cfg.n_kv_heads {
            return Err(Error::shape(
                "Attention::load",
                format!("kv head range {kv_heads:?} of {} heads", cfg.n_kv_heads),
            ));
        }
        let g = cfg.group_size();
        let groups = kv_heads.start * g..kv_heads.end * g;
        let part_of_one = kv_heads.len() == 1
            && !q_heads.is_empty()
            && groups.start <= q_heads.start
            && q_heads.end <= groups.end;
        if q_heads != groups && !part_of_one {
            return Err(Error::shape(
                "Attention::load",
                format!(
                    "query heads {q_heads:?} are neither the query heads {groups:?} of kv heads \
                     {kv_heads:?} nor part of a single kv head's group of {g}"
                ),
            ));
        }
        let d = cfg.head_dim;
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let q = Linear::load_qk(src, &name("attn_q"), q_heads.clone(), d, form)?;
        let k = Linear::load_qk(src, &name("attn_k"), kv_heads.clone(), d, form)?;
        let v_rows = Shard::Rows(kv_heads.start * d..kv_heads.end * d);
        let v = Linear::load(src, &name("attn_v"), &v_rows, form)?;
        let o_cols = Shard::Cols(q_heads.start * d..q_heads.end * d);
        let o = Linear::load(src, &name("attn_output"), &o_cols, form)?;
        for (lin, t, want) in [
            (&q, "attn_q", q_heads.len() * d),
            (&k, "attn_k", kv_heads.len() * d),
            (&v, "attn_v", kv_heads.len() * d),
            (&o, "attn_output", cfg.hidden),
        ] {
            if lin.dims().0 != want || (t != "attn_output" && lin.dims().1 != cfg.hidden) {
                return Err(Error::tensor(
                    &name(t),
                    format!(
                        "shard has shape {:?}, expected {want} output rows of {} inputs",
                        lin.dims(),
                        cfg.hidden
                    ),
                ));
            }
        }
        let bias_name = |t: &str| format!("blk.{layer}.{t}.bias");
        let biases = [
            ("attn_q", q_heads.clone(), cfg.n_heads, true),
            ("attn_k", kv_heads.clone(), cfg.n_kv_heads, true),
            ("attn_v", kv_heads.clone(), cfg.n_kv_heads, false),
        ];
        let qkv_bias = if biases.iter().any(|(t, ..)| src.has(&bias_name(t))) {
            let mut all = Vec::with_capacity((q_heads.len() + 2 * kv_heads.len()) * d);
            for (t, heads, n, rotary) in biases {
                all.extend(load_bias(src, &bias_name(t), heads, n, d, rotary)?);
            }
            Some(Tensor::from_vec(&[all.len()], all)?)
        } else {
            None
        };
        let qk_norm = if cfg.qk_norm { Some(QkNorm::load(src, layer, cfg)?) } else { None };
        // Gemma 3's local layers have a rotary base of their own, unscaled.
        let (rope_theta, rope_factors) = cfg.rope_of(layer);
        Ok(Attention {
            qkv: Linear::concat(&[&q, &k, &v])?,
            qkv_bias,
            qk_norm,
            o,
            kv_heads,
            q_heads,
            head_dim: d,
            rope_dim: cfg.rope_dim,
            rope_theta,
            rope_factors: rope_factors.map(Into::into),
            rope_attn_factor: cfg.rope_attn_factor.unwrap_or(1.0),
            scores: (
                cfg.query_scale,
                cfg.attn_softcap,
                cfg.sliding_window.filter(|w| w.slides(layer)).map(|w| w.tokens),
            ),
        })
    }

    /// Rotates as `other` does (its frequency factors and attention factor): the rotation
    /// belongs to the running model (longrope's factors follow its context), not to weights
    /// it adopts.
    pub(crate) fn rotate_as(&mut self, other: &Attention) {
        self.rope_factors.clone_from(&other.rope_factors);
        self.rope_attn_factor = other.rope_attn_factor;
    }

    /// Whether the Q/K/V projections carry biases.
    pub fn has_bias(&self) -> bool {
        self.qkv_bias.is_some()
    }

    /// Whether each query and key head is RMS-normalized before the rotation (Qwen3).
    pub fn has_qk_norm(&self) -> bool {
        self.qk_norm.is_some()
    }

    /// The query heads this shard computes.
    pub fn q_heads(&self) -> Range<usize> {
        self.q_heads.clone()
    }

    /// The KV heads this shard holds.
    pub fn kv_heads(&self) -> Range<usize> {
        self.kv_heads.clone()
    }

    /// Its heads and score rules, as the attention kernel takes them.
    pub(crate) fn shape(&self) -> AttnShape {
        let (scale, softcap, window) = self.scores;
        AttnShape {
            q_heads: self.q_heads.len(),
            kv_heads: self.kv_heads.len(),
            head_dim: self.head_dim,
            scale,
            softcap,
            window,
        }
    }

    /// The sliding window of its queries, when this layer has one.
    pub fn window(&self) -> Option<usize> {
        self.scores.2
    }

    /// Projects normalized hidden states `x` (`[n, hidden]`) to rotated queries
    /// `[n, q_heads, d]` and rotated keys and values `[n, kv_heads, d]` (biases, when the
    /// model has them, are added before the rotation, and so are Qwen3's per-head query and
    /// key norms, after the biases).
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when `x` and `positions` disagree.
    pub fn qkv(
        &self,
        be: &Backend,
        x: &Tensor,
        positions: &[usize],
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let s = self.shape();
        let (qw, kvw) = (s.q_heads * s.head_dim, s.kv_heads * s.head_dim);
        let mut y = self.qkv.forward(be, x)?;
        let (theta, factors) = (self.rope_theta, self.rope_factors.as_deref());
        let (rot, scale) = (self.rope_dim, self.rope_attn_factor);
        if self.qk_norm.is_none() {
            // One pass (one kernel on a GPU): the bias, the split and both rotations.
            let p = self.projected(&y);
            return Ok(be.split_rope(p, positions, self.split_dims(), self.rotation())?);
        }
        if let Some(bias) = &self.qkv_bias {
            be.add_bias(&mut y, bias)?;
        }
        let mut parts = be.split_last(&y, &[qw, kvw, kvw])?.into_iter();
        let (Some(mut q), Some(mut k), Some(v)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(Error::shape("Attention::qkv", "split gave fewer than three parts"));
        };
        if let Some(norm) = &self.qk_norm {
            q = QkNorm::apply(be, q, &norm.q, norm.eps)?;
            k = QkNorm::apply(be, k, &norm.k, norm.eps)?;
        }
        be.rope_scaled(&mut q, positions, (s.q_heads, s.head_dim, rot), theta, factors, scale)?;
        be.rope_scaled(&mut k, positions, (s.kv_heads, s.head_dim, rot), theta, factors, scale)?;
        Ok((q, k, v))
    }

    /// The fused QKV projection of normalized hidden states `x`, without its bias (see
    /// [`Attention::projected`]), for [`Backend::split_rope`] (with [`Attention::split_dims`]
    /// and [`Attention::rotation`]), which adds it; `None` for a layer whose queries and keys
    /// are normed between the split and the rotation (Qwen3), which only [`Attention::qkv`]
    /// computes.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when `x` has the wrong width.
    pub fn fused_projection(&self, be: &Backend, x: &Tensor) -> Result<Option<Tensor>> {
        if self.qk_norm.is_some() {
            return Ok(None);
        }
        Ok(Some(self.qkv.forward(be, x)?))
    }

    /// The fused projection's rows `y` with this layer's bias, which [`Backend::split_rope`]
    /// adds in its pass.
    pub fn projected<'a>(&'a self, y: &'a Tensor) -> Projected<'a> {
        Projected { y, bias: self.qkv_bias.as_ref() }
    }

    /// Query heads, KV heads, head size and rotated size, as [`Backend::split_rope`] takes
    /// them.
    pub fn split_dims(&self) -> (usize, usize, usize, usize) {
        let s = self.shape();
        (s.q_heads, s.kv_heads, s.head_dim, self.rope_dim)
    }

    /// The rotation's base, frequency factors and attention factor, as
    /// [`Backend::split_rope_append`] takes them.
    pub fn rotation(&self) -> (f32, Option<&[f32]>, f32) {
        (self.rope_theta, self.rope_factors.as_deref(), self.rope_attn_factor)
    }

    /// Attention of rotated queries at `positions` over everything in `cache`; returns
    /// `[n, q_heads, d]` and, when `want_lse`, the log-sum-exp `[n, q_heads]`.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the sizes disagree.
    pub fn attend(
        &self,
        be: &Backend,
        q: &Tensor,
        positions: &[usize],
        cache: &LayerCache,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        Ok(be.attention(q, positions, cache.kv(), cache.positions(), self.shape(), want_lse)?)
    }

    /// The output projection of attention results `[n, q_heads, d]`: `[n, hidden]`.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when the sizes disagree.
    pub fn project_out(&self, be: &Backend, attn: Tensor) -> Result<Tensor> {
        let n = attn.shape()[0];
        let width = attn.len() / n.max(1);
        self.o.forward(be, &attn.reshape(&[n, width])?)
    }

    /// The whole layer on one rank: project, rotate, append to `cache`, attend, project out.
    ///
    /// # Errors
    /// [`Error::CacheFull`] when the cache has no room; [`tensor::Error::Shape`] on size mismatches.
    pub fn forward(
        &self,
        be: &Backend,
        x: &Tensor,
        positions: &[usize],
        cache: &mut LayerCache,
    ) -> Result<Tensor> {
        let (q, k, v) = self.qkv(be, x, positions)?;
        cache.append_tensors(be, &k, &v, positions)?;
        let (attn, _) = self.attend(be, &q, positions, cache, false)?;
        self.project_out(be, attn)
    }
}

impl Attention {
    /// Its weights' names and shapes (`[out, in]` for a matrix), in buffer order.
    pub(crate) fn weight_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        let mut out = vec![("Q/K/V projection", dims_of(&self.qkv))];
        if let Some(bias) = &self.qkv_bias {
            out.push(("Q/K/V bias", bias.shape().to_vec()));
        }
        if let Some(norm) = &self.qk_norm {
            out.push(("query norm", norm.q.shape().to_vec()));
            out.push(("key norm", norm.k.shape().to_vec()));
        }
        out.push(("attention output projection", dims_of(&self.o)));
        out
    }
}

impl Attention {
    /// Where its buffers' values come from in layer `layer`'s tensors, in buffer order (see
    /// [`provenance`]): the fused projection holds the rows of its query heads, then of its KV
    /// heads' keys and values; the bias the same elements of the three biases; each norm the
    /// whole shared weight; the output projection the columns of its query heads.
    pub(crate) fn weight_sources(&self, layer: usize, out: &mut Vec<BufferSource>) {
        let d = self.head_dim;
        let hidden = self.qkv.dims().1;
        let q = self.q_heads.start * d..self.q_heads.end * d;
        let kv = self.kv_heads.start * d..self.kv_heads.end * d;
        let name = |t: &str, kind: &str| format!("blk.{layer}.{t}.{kind}");
        let parts = [("attn_q", q.clone()), ("attn_k", kv.clone()), ("attn_v", kv)];
        let mut at = 0;
        let mut qkv = Vec::new();
        let mut bias = Vec::new();
        for (t, rows) in &parts {
            qkv.push(Span::rows(name(t, "weight"), rows.clone(), hidden, at * hidden));
            bias.push(Span { tensor: name(t, "bias"), rows: 0..1, cols: rows.clone(), at });
            at += rows.len();
        }
        provenance::weight_sources(self.qkv.weight(), qkv, out);
        if let Some(b) = &self.qkv_bias {
            provenance::vector_source(b, bias, out);
        }
        if let Some(norm) = &self.qk_norm {
            for (t, w) in [("attn_q_norm", &norm.q), ("attn_k_norm", &norm.k)] {
                provenance::vector_source(w, vec![Span::rows(name(t, "weight"), 0..1, d, 0)], out);
            }
        }
        let rows = self.o.dims().0;
        let o = Span { tensor: name("attn_output", "weight"), rows: 0..rows, cols: q, at: 0 };
        provenance::weight_sources(self.o.weight(), vec![o], out);
    }
}

/// A linear layer's `[out_features, in_features]`.
fn dims_of(l: &Linear) -> Vec<usize> {
    let (rows, cols) = l.dims();
    vec![rows, cols]
}

impl WeightUses for Attention {
    fn weight_uses<'a>(&'a self, out: &mut Vec<WeightUse<'a>>) {
        self.qkv.weight_uses(out);
        if let Some(norms) = &self.qk_norm {
            norms.weight_uses(out);
        }
        self.o.weight_uses(out);
    }
}

/// The buffers in the order fused Q/K/V projection, its bias (when the model has one), query
/// and key norms (when it has them), output projection.
impl WeightBuffers for Attention {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.qkv.buffers(out);
        self.qkv_bias.buffers(out);
        self.qk_norm.buffers(out);
        self.o.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> tensor::Result<()> {
        self.qkv.move_to(arena)?;
        self.qkv_bias.move_to(arena)?;
        self.qk_norm.move_to(arena)?;
        self.o.move_to(arena)
    }
}

/// The SiLU-gated MLP of one layer over a range of the inner (feed-forward) dimension.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Gate and up projections fused into one product (rows: gate, then up).
    gate_up: Linear,
    down: Linear,
    /// The inner units it holds.
    units: Range<usize>,
    /// The gate's activation.
    activation: checkpoint::Activation,
}

impl Mlp {
    /// Loads layer `layer`'s MLP for inner units `inner` (gate/up rows, down columns); with a
    /// partial range the output is a partial sum to be all-reduced.
    ///
    /// # Errors
    /// [`Error::Tensor`] for missing or misshapen weights.
    pub fn load(
        src: &dyn WeightSource,
        layer: usize,
        inner: Range<usize>,
        form: WeightForm,
    ) -> Result<Self> {
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let gate = Linear::load(src, &name("ffn_gate"), &Shard::Rows(inner.clone()), form)?;
        let up = Linear::load(src, &name("ffn_up"), &Shard::Rows(inner.clone()), form)?;
        let down = Linear::load(src, &name("ffn_down"), &Shard::Cols(inner.clone()), form)?;
        if gate.dims() != up.dims()
            || down.dims().1 != inner.len()
            || down.dims().0 != gate.dims().1
        {
            return Err(Error::tensor(
                &name("ffn_down"),
                format!(
                    "gate {:?}, up {:?} and down {:?} do not fit together",
                    gate.dims(),
                    up.dims(),
                    down.dims()
                ),
            ));
        }
        Ok(Mlp {
            gate_up: Linear::concat(&[&gate, &up])?,
            down,
            units: inner,
            activation: checkpoint::Activation::Silu,
        })
    }

    /// Its weights' names and shapes (`[out, in]`), in buffer order.
    pub(crate) fn weight_shapes(&self) -> Vec<(&'static str, Vec<usize>)> {
        vec![
            ("gate/up projection", dims_of(&self.gate_up)),
            ("down projection", dims_of(&self.down)),
        ]
    }

    /// Where its buffers' values come from in layer `layer`'s tensors, in buffer order (see
    /// [`provenance`]): the fused projection holds the gate's rows of its units, then the
    /// up projection's; the down projection their columns.
    pub(crate) fn weight_sources(&self, layer: usize, out: &mut Vec<BufferSource>) {
        let name = |t: &str| format!("blk.{layer}.{t}.weight");
        let hidden = self.gate_up.dims().1;
        let units = self.units.clone();
        let gate_up = vec![
            Span::rows(name("ffn_gate"), units.clone(), hidden, 0),
            Span::rows(name("ffn_up"), units.clone(), hidden, units.len() * hidden),
        ];
        provenance::weight_sources(self.gate_up.weight(), gate_up, out);
        let rows = self.down.dims().0;
        let down = Span { tensor: name("ffn_down"), rows: 0..rows, cols: units, at: 0 };
        provenance::weight_sources(self.down.weight(), vec![down], out);
    }

    /// The same MLP with `activation` on its gate (SiLU when loaded).
    pub fn with_activation(self, activation: checkpoint::Activation) -> Self {
        Mlp { activation, ..self }
    }

    /// `down(act(gate(x)) · up(x))`, `act` SiLU unless set otherwise.
    ///
    /// # Errors
    /// [`tensor::Error::Shape`] when `x` has the wrong width.
    pub fn forward(&self, be: &Backend, x: &Tensor) -> Result<Tensor> {
        // The gate and up halves read in place (one kernel on a GPU).
        let h = be.gated_halves(self.activation, &self.gate_up.forward(be, x)?)?;
        self.down.forward(be, &h)
    }
}

impl WeightUses for Mlp {
    fn weight_uses<'a>(&'a self, out: &mut Vec<WeightUse<'a>>) {
        self.gate_up.weight_uses(out);
        self.down.weight_uses(out);
    }
}

/// The buffers in the order fused gate/up projection, down projection.
impl WeightBuffers for Mlp {
    fn buffers<'a>(&'a self, out: &mut Vec<&'a [u8]>) {
        self.gate_up.buffers(out);
        self.down.buffers(out);
    }

    fn move_to(&mut self, arena: &dyn Arena) -> tensor::Result<()> {
        self.gate_up.move_to(arena)?;
        self.down.move_to(arena)
    }
}

/// Which rows of logits a forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// One row per input token.
    All,
    /// Only the last token's row (prefill before sampling).
    Last,
}
