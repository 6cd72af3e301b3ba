//! Self-attention over a TP rank's heads, for prefill and extend steps, with the CP exchange
//! of keys and values (prefill) or partial outputs (extend).
//!
//! A prefill's queries on CP rank `r` are positions after every key of the ranks before it,
//! so in a sliding-window layer (Gemma 2 and 3) they see at most the last `window - 1` keys
//! of the ranks before: a rank sends only those of its shard, and attends to them and its
//! own keys.

use super::cache::ParallelCache;
use super::forward::{Part, Split};
use super::{head_shard, Comms};
use crate::error::{Error, Result};
use crate::model::{Attention, WeightForm};
use checkpoint::config::LlamaConfig;
use checkpoint::WeightSource;
use collectives::{Collective, Communicator};
use tensor::kernels::cpu::attention::merge_partial;
use tensor::kernels::{AttnShape, Backend, Kv};
use tensor::Tensor;

/// A rank's own keys and values of a windowed layer's prefill shard (it sends only its last
/// ones).
type OwnKv = (Vec<f32>, Vec<f32>);

/// Self-attention over this rank's KV heads, for both step kinds.
#[derive(Clone, Debug)]
pub struct ParallelAttention {
    pub(super) attn: Attention,
    shape: AttnShape,
}

impl ParallelAttention {
    /// Loads layer `layer`'s attention for TP rank `tp_rank` of `tp`.
    ///
    /// # Errors
    /// Missing weights, or a `tp` the heads cannot be split over (see [`head_shard`]).
    pub fn load(
        src: &dyn WeightSource,
        layer: usize,
        cfg: &LlamaConfig,
        tp_rank: usize,
        tp: usize,
        form: WeightForm,
    ) -> Result<Self> {
        let heads = head_shard(cfg, tp_rank, tp)?;
        let attn = Attention::load_heads(src, layer, cfg, heads.kv.clone(), heads.q.clone(), form)?;
        let shape = attn.shape();
        Ok(ParallelAttention { attn, shape })
    }

    /// Attention of layer `layer` for every sequence of a step: `h` holds this rank's rows of
    /// all of them, packed in `parts` order, and `caches` their caches in the same order.
    /// Q/K/V and the output projection are one product each over all rows; each sequence
    /// attends over its own keys and values; with CP, one collective per layer carries every
    /// prefill's key/value shards and every extend's partial outputs.
    pub(super) fn forward(
        &self,
        be: &Backend,
        comms: &mut Comms<'_>,
        h: &Tensor,
        parts: &[Part],
        layer: usize,
        caches: &mut [&mut ParallelCache],
    ) -> Result<Tensor> {
        let positions: Vec<usize> =
            parts.iter().flat_map(|p| p.positions.iter().copied()).collect();
        let cp = comms.cp.size();
        if cp == 1 {
            if let Some(out) = self.decode_in_one_pass(be, h, &positions, parts, layer, caches)? {
                return self.finish(be, comms, out);
            }
        }
        let (q, k, v) = self.attn.qkv(be, h, &positions)?;
        // A step of one sequence uses the projections as they are (on the device, say).
        let rows = |t: &Tensor, p: &Part| -> Result<Tensor> {
            if parts.len() == 1 {
                Ok(t.clone())
            } else {
                Ok(be.slice_first(t, p.rows.clone())?)
            }
        };
        let kv_width = self.shape.kv_heads * self.shape.head_dim;
        // Without CP, the leading one-row parts (a step's decode rows, as the scheduler packs
        // them) attend in one call after the loop (see `Backend::attention_rows`).
        let singles = if cp == 1 && parts.len() > 1 {
            parts.iter().enumerate().take_while(|(i, p)| p.rows == (*i..i + 1)).count()
        } else {
            0
        };
        let mut queries = Vec::with_capacity(parts.len());
        // Extend outputs (partial with CP); prefill outputs come after the exchange.
        let mut outs: Vec<Option<Tensor>> = Vec::with_capacity(parts.len());
        // A windowed layer's prefill keys and values of this rank, all of them (it sends
        // only the last few).
        let mut own: Vec<Option<OwnKv>> = Vec::with_capacity(parts.len());
        let mut mine = Vec::new();
        if singles > 0 {
            // The decode rows' keys and values in one write (their rows lead k and v).
            let at = &positions[..singles];
            ParallelCache::append_singles(be, layer, &mut caches[..singles], &k, &v, at)?;
        }
        for (i, (p, cache)) in parts.iter().zip(caches.iter_mut()).enumerate() {
            if i < singles {
                continue;
            }
            let (qe, ke, ve) = (rows(&q, p)?, rows(&k, p)?, rows(&v, p)?);
            match &p.split {
                Split::Prefill(_) => {
                    cache.append_tensors(be, layer, &ke, &ve, &p.positions)?;
                    let (kh, vh) = (ke.host()?, ve.host()?);
                    let rows = p.positions.len();
                    let from = (rows - self.prefill_rows_sent(rows)) * kv_width;
                    mine.extend_from_slice(&kh[from..]);
                    mine.extend_from_slice(&vh[from..]);
                    own.push(self.attn.window().map(|_| (kh.to_vec(), vh.to_vec())));
                    outs.push(None);
                }
                Split::Extend(_) if p.owned.iter().all(|&o| o) => {
                    // Every new token is this rank's (always without CP).
                    cache.append_tensors(be, layer, &ke, &ve, &p.positions)?;
                    own.push(None);
                }
                Split::Extend(_) => {
                    let (mut mk, mut mv, mut mp) = (Vec::new(), Vec::new(), Vec::new());
                    for (i, _) in p.owned.iter().enumerate().filter(|(_, &o)| o) {
                        mk.extend_from_slice(&ke.host()?[i * kv_width..(i + 1) * kv_width]);
                        mv.extend_from_slice(&ve.host()?[i * kv_width..(i + 1) * kv_width]);
                        mp.push(p.positions[i]);
                    }
                    cache.append(be, layer, &mk, &mv, &mp)?;
                    own.push(None);
                }
            }
            if let Split::Extend(_) = p.split {
                let (out, lse) = cache.with_kv(layer, |kv, kv_pos| {
                    be.attention(&qe, &p.positions, kv, kv_pos, self.shape, cp > 1)
                })?;
                if cp > 1 {
                    let lse = lse.ok_or_else(|| {
                        Error::shape("extend attention", "no log-sum-exp returned")
                    })?;
                    mine.extend_from_slice(out.host()?);
                    mine.extend_from_slice(lse.host()?);
                }
                outs.push(Some(out));
            }
            queries.push(qe);
        }
        if cp > 1 {
            self.exchange(be, comms.cp, &mine, parts, (&queries, &own), &mut outs)?;
        }
        if singles > 0 {
            let q = if singles == parts.len() { q } else { be.slice_first(&q, 0..singles)? };
            let positions: Vec<usize> = parts[..singles].iter().map(|p| p.positions[0]).collect();
            let caches = &caches[..singles];
            let out = be.attention_rows(&q, &positions, self.shape, &|i, f| {
                caches[i].with_kv(layer, |kv, kv_pos| f(kv, kv_pos));
            })?;
            outs.insert(0, Some(out));
        }
        let outs = outs
            .into_iter()
            .map(|o| o.ok_or_else(|| Error::shape("attention", "a sequence has no output")))
            .collect::<Result<Vec<_>>>()?;
        let out = match <[Tensor; 1]>::try_from(outs) {
            Ok([one]) => one,
            Err(outs) => be.cat_first(&outs)?,
        };
        self.finish(be, comms, out)
    }

    /// A decode step (one new token per sequence; the caller checked there is no CP) whose
    /// caches are blocks of one pool: the projection's split, both rotations and the KV append
    /// in one pass ([`ParallelCache::split_rope_append`]: one launch on a GPU), then every
    /// row's attention in one call (one sequence: its attention, over the CPU's threads).
    /// `None` for any other step (or a layer with Qwen3's q/k norms), before anything is
    /// computed.
    fn decode_in_one_pass(
        &self,
        be: &Backend,
        h: &Tensor,
        positions: &[usize],
        parts: &[Part],
        layer: usize,
        caches: &mut [&mut ParallelCache],
    ) -> Result<Option<Tensor>> {
        let decode = parts.iter().enumerate().all(|(i, p)| {
            p.rows == (i..i + 1)
                && matches!(p.split, Split::Extend(_))
                && p.owned.iter().all(|&o| o)
        });
        if !decode || !ParallelCache::in_one_pool(caches) {
            return Ok(None);
        }
        let Some(y) = self.attn.fused_projection(be, h)? else { return Ok(None) };
        let rope = (self.attn.split_dims(), self.attn.rotation());
        let y = self.attn.projected(&y);
        let Some(q) = ParallelCache::split_rope_append(be, layer, caches, y, positions, rope)?
        else {
            return Ok(None);
        };
        if let [cache] = caches {
            // One row: the attention of its own, whose heads share the CPU's threads
            // (`attention_rows` gives each row one thread).
            let (out, _) = cache.with_kv(layer, |kv, kv_pos| {
                be.attention(&q, positions, kv, kv_pos, self.shape, false)
            })?;
            return Ok(Some(out));
        }
        let out = be.attention_rows(&q, positions, self.shape, &|i, f| {
            caches[i].with_kv(layer, |kv, kv_pos| f(kv, kv_pos));
        })?;
        Ok(Some(out))
    }

    /// Rows of a prefill shard of `rows` tokens that a rank sends the others: all of them, or
    /// in a windowed layer the last `window - 1`, the only ones a later rank's queries see.
    fn prefill_rows_sent(&self, rows: usize) -> usize {
        match self.attn.window() {
            Some(w) => rows.min(w.saturating_sub(1)),
            None => rows,
        }
    }

    /// The CP exchange of one layer: every rank sends `mine` (per part, in order: a prefill's
    /// keys then values, those of a windowed layer cut to [`Self::prefill_rows_sent`], an
    /// extend's partial output then log-sum-exp); then each prefill attends to every rank's
    /// keys and values (a windowed layer's: the earlier ranks' it got and its own, `own`)
    /// and each extend merges the partial outputs in rank order, so every rank gets the same
    /// bits.
    fn exchange(
        &self,
        be: &Backend,
        cp: &mut dyn Communicator,
        mine: &[f32],
        parts: &[Part],
        (queries, own): (&[Tensor], &[Option<OwnKv>]),
        outs: &mut [Option<Tensor>],
    ) -> Result<()> {
        let ranks = cp.size();
        let AttnShape { q_heads, kv_heads, head_dim, .. } = self.shape;
        let piece = |p: &Part, r: usize| match &p.split {
            Split::Prefill(shard) => {
                2 * self.prefill_rows_sent(shard.sizes()[r]) * kv_heads * head_dim
            }
            Split::Extend(_) => p.positions.len() * q_heads * (head_dim + 1),
        };
        let sizes: Vec<usize> =
            (0..ranks).map(|r| parts.iter().map(|p| piece(p, r)).sum()).collect();
        let mut all = vec![0f32; sizes.iter().sum()];
        cp.all_gather_uneven(mine, &mut all, &sizes)?;
        // Where each part's piece starts in each rank's segment.
        let mut at: Vec<usize> =
            sizes.iter().scan(0, |end, s| Some(std::mem::replace(end, *end + s))).collect();
        let pieces: Vec<Vec<&[f32]>> = parts
            .iter()
            .map(|p| {
                (0..ranks)
                    .map(|r| {
                        let start = at[r];
                        at[r] += piece(p, r);
                        &all[start..at[r]]
                    })
                    .collect()
            })
            .collect();
        let parts_out = parts.iter().zip(queries).zip(own).zip(outs.iter_mut()).zip(&pieces);
        for ((((p, q), own), out), pieces) in parts_out {
            match (&p.split, own) {
                (Split::Prefill(shard), Some((k_own, v_own))) => {
                    // The last keys of the ranks before this one, then its own.
                    let (mut k_all, mut v_all, mut at) = (Vec::new(), Vec::new(), Vec::new());
                    for (both, range) in pieces.iter().zip(shard.ranges()).take(shard.rank()) {
                        let (ks, vs) = both.split_at(both.len() / 2);
                        k_all.extend_from_slice(ks);
                        v_all.extend_from_slice(vs);
                        let n = ks.len() / (kv_heads * head_dim);
                        at.extend_from_slice(&p.all_positions[range.end - n..range.end]);
                    }
                    k_all.extend_from_slice(k_own);
                    v_all.extend_from_slice(v_own);
                    at.extend_from_slice(&p.positions);
                    let kv = Kv::Host { k: &k_all, v: &v_all };
                    let (o, _) = be.attention(q, &p.positions, kv, &at, self.shape, false)?;
                    *out = Some(o);
                }
                (Split::Prefill(_), None) => {
                    let total = p.all_positions.len() * kv_heads * head_dim;
                    let (mut k_all, mut v_all) =
                        (Vec::with_capacity(total), Vec::with_capacity(total));
                    for both in pieces {
                        let (ks, vs) = both.split_at(both.len() / 2);
                        k_all.extend_from_slice(ks);
                        v_all.extend_from_slice(vs);
                    }
                    let kv = Kv::Host { k: &k_all, v: &v_all };
                    let (o, _) =
                        be.attention(q, &p.positions, kv, &p.all_positions, self.shape, false)?;
                    *out = Some(o);
                }
                (Split::Extend(_), _) => {
                    let width = p.positions.len() * q_heads * head_dim;
                    let (first_o, first_l) = pieces[0].split_at(width);
                    let (mut acc_o, mut acc_l) = (first_o.to_vec(), first_l.to_vec());
                    for rest in &pieces[1..] {
                        let (o, l) = rest.split_at(width);
                        merge_partial(&mut acc_o, &mut acc_l, o, l, head_dim);
                    }
                    *out = Some(Tensor::from_vec(&[p.positions.len(), q_heads, head_dim], acc_o)?);
                }
            }
        }
        Ok(())
    }

    /// Output projection of this rank's heads, all-reduced over TP.
    fn finish(&self, be: &Backend, comms: &mut Comms<'_>, attn: Tensor) -> Result<Tensor> {
        let mut y = self.attn.project_out(be, attn)?;
        be.all_reduce_sum(comms.tp, &mut y)?;
        Ok(y)
    }
}
