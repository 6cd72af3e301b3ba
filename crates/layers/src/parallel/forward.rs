//! The forward pass of [`ParallelModel`]: how a step's tokens split over CP, the decoder
//! stack, and the logits, argmax and greedy generation built on it.

use super::{gather_tokens, Comms, ParallelCache, ParallelModel, Placement};
use crate::error::{Error, Result};
use crate::model::Logits;
use collectives::Collective;
use mesh::TokenShard;
use std::ops::Range;
use tensor::kernels::{Draw, LogitEdit, LogitEdits, Normalizer, TopK};
use tensor::{Backend, Tensor};

/// How one sequence's tokens of a step are split over CP.
pub(super) enum Split {
    Prefill(TokenShard),
    /// Which CP rank keeps each new token's keys and values.
    Extend(Vec<usize>),
}

/// One sequence's place in a step on this rank.
pub(super) struct Part {
    pub(super) split: Split,
    /// This rank's rows of the sequence in the step's packed activations.
    pub(super) rows: Range<usize>,
    /// Positions of all the sequence's tokens in the step.
    pub(super) all_positions: Vec<usize>,
    /// Positions of this rank's rows.
    pub(super) positions: Vec<usize>,
    /// Extend: which rows' keys and values this rank keeps.
    pub(super) owned: Vec<bool>,
}

impl Part {
    /// Tokens of the step each CP rank keeps.
    fn kept(&self, ranks: usize) -> Vec<usize> {
        match &self.split {
            Split::Prefill(shard) => shard.sizes().to_vec(),
            Split::Extend(owners) => {
                let mut kept = vec![0; ranks];
                owners.iter().for_each(|&o| kept[o] += 1);
                kept
            }
        }
    }
}

/// One sequence of a batched step (see [`ParallelModel::forward_batch`]).
#[derive(Debug)]
pub struct Sequence<'a> {
    /// The next token ids, continuing where `cache` ends.
    pub tokens: &'a [u32],
    /// The sequence's KV-cache shard on this rank.
    pub cache: &'a mut ParallelCache,
    /// Whether the logits of its last token are wanted.
    pub sample: bool,
    /// Whether the logits of every token are wanted (prompt log-probabilities), the last
    /// one's included.
    pub every_row: bool,
    /// What its sampler changes in its last row's logits before the token is picked there
    /// (penalties, a bias: [`LogitEdit`]), in order. The paths that pick where the logits
    /// are apply them ([`ParallelModel::forward_batch_argmax`] and the others);
    /// [`ParallelModel::forward_batch`] returns the logits unedited.
    pub edits: &'a [LogitEdit],
}

impl<'a> Sequence<'a> {
    /// `tokens` continuing `cache`, its last token's logits wanted (sampled), with no edits.
    pub fn sampled(tokens: &'a [u32], cache: &'a mut ParallelCache) -> Self {
        Sequence { tokens, cache, sample: true, every_row: false, edits: &[] }
    }
}

/// Where a batched step's final hidden rows are ([`ParallelModel::forward_batch`]).
enum FinalRows {
    /// No row is wanted (prompt chunks only); `root`: this is the rank at TP 0 and CP 0.
    None { root: bool },
    /// On CP rank 0: this rank has sent its part.
    Elsewhere,
    /// Here (CP rank 0), normed, in sequence order.
    Here(Tensor),
}

impl ParallelModel {
    /// How `n` more tokens of the sequence in `cache` split over CP: a prefill when the
    /// cache is empty and every CP rank gets a token (never with one CP rank: an extend keeps
    /// its keys and values where attention reads them), an extend otherwise.
    fn split(&self, cache: &ParallelCache, n: usize) -> Result<Split> {
        let cp = self.placement.cp;
        if cp > 1 && cache.is_empty() && n >= cp {
            return Ok(Split::Prefill(TokenShard::new(n, cp, self.placement.cp_rank)?));
        }
        let mut lens = cache.cp_lens.clone();
        let owners = (0..n)
            .map(|_| {
                let owner = (0..cp).min_by_key(|&r| (lens[r], r)).unwrap_or(0);
                lens[owner] += 1;
                owner
            })
            .collect();
        Ok(Split::Extend(owners))
    }

    /// Checks that `n` more tokens fit in `cache` on this rank.
    ///
    /// # Errors
    /// [`Error::CacheFull`] when they do not; [`tensor::Error::Shape`] for no tokens.
    pub fn check_room(&self, cache: &ParallelCache, n: usize) -> Result<()> {
        self.part_into(cache, &[], n, 0, &mut Vec::new()).map(drop)
    }

    /// The place of `n` tokens of the sequence in `cache` in a step whose rows before it
    /// number `at`; of `tokens` (empty when only checking), the rows this rank computes are
    /// appended to `local`.
    fn part_into(
        &self,
        cache: &ParallelCache,
        tokens: &[u32],
        n: usize,
        at: usize,
        local: &mut Vec<u32>,
    ) -> Result<Part> {
        if n == 0 {
            return Err(Error::shape("ParallelModel::forward", "a sequence with no tokens"));
        }
        let start = cache.len();
        let all_positions: Vec<usize> = (start..start + n).collect();
        let me = self.placement.cp_rank;
        let split = self.split(cache, n)?;
        let (positions, owned, needed) = match &split {
            Split::Prefill(shard) => {
                if !tokens.is_empty() {
                    local.extend_from_slice(shard.select(tokens)?);
                }
                let positions = shard.select(&all_positions)?.to_vec();
                let needed = positions.len();
                (positions, Vec::new(), needed)
            }
            Split::Extend(owners) => {
                local.extend_from_slice(tokens);
                let owned: Vec<bool> = owners.iter().map(|&o| o == me).collect();
                let needed = owned.iter().filter(|&&o| o).count();
                (all_positions.clone(), owned, needed)
            }
        };
        if cache.local_len() + needed > cache.capacity() {
            return Err(Error::CacheFull {
                len: cache.local_len(),
                capacity: cache.capacity(),
                requested: needed,
            });
        }
        Ok(Part { rows: at..at + positions.len(), split, all_positions, positions, owned })
    }

    /// Runs `tokens` (the next ones of the sequence in `cache`) and returns logits
    /// `[rows, vocab]`, identical on every rank. On error the cache may hold part of the
    /// step: clear it (the peers failed too).
    ///
    /// # Errors
    /// Empty input, an id outside the vocabulary, a full cache, a failed collective.
    pub fn forward(
        &self,
        comms: &mut Comms<'_>,
        tokens: &[u32],
        cache: &mut ParallelCache,
        logits: Logits,
    ) -> Result<Tensor> {
        self.backend.run(|| {
            let x = self.hidden(comms, tokens, cache, logits)?;
            let logits = self.lm_head.logits(&self.backend, comms.tp, &x)?;
            self.soft_capped(logits)
        })
    }

    /// Greedy next tokens (one per returned row) without gathering the logits.
    ///
    /// # Errors
    /// As [`ParallelModel::forward`].
    pub fn forward_argmax(
        &self,
        comms: &mut Comms<'_>,
        tokens: &[u32],
        cache: &mut ParallelCache,
        logits: Logits,
    ) -> Result<Vec<u32>> {
        self.backend.run(|| {
            let x = self.hidden(comms, tokens, cache, logits)?;
            self.lm_head.argmax(&self.backend, comms.tp, &x, None, None)
        })
    }

    /// One step of many sequences as one forward pass: their tokens packed into one
    /// activation matrix (every linear layer one product over all of them, one TP all-reduce
    /// per layer and, with CP, one exchange per layer), each sequence attending over its own
    /// cache. Returns logits `[rows, vocab]`, in sequence order: every token's of a sequence
    /// with `every_row` set, the last token's of one with only `sample` set; on the rank at
    /// TP 0 and CP 0 only (`None` elsewhere): the other ranks send it their share rather than
    /// gathering the vocabulary everywhere.
    ///
    /// A sequence's logits are those of [`ParallelModel::forward`] on it alone up to f32
    /// summation order: the kernels a linear layer picks depend on the step's row count.
    /// On error the caches may hold part of the step: clear them (the peers failed too).
    ///
    /// # Errors
    /// A sequence with no tokens or no room left ([`Error::CacheFull`]), an id outside the
    /// vocabulary, a failed collective.
    pub fn forward_batch(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
    ) -> Result<Option<Tensor>> {
        let _step = self.step(seqs);
        self.backend.run(|| match self.final_rows(comms, seqs)? {
            FinalRows::None { root } => {
                Ok(root.then(|| Tensor::zeros(&[0, self.config.vocab_size])))
            }
            FinalRows::Elsewhere => Ok(None),
            FinalRows::Here(x) => self
                .lm_head
                .logits_to(&self.final_backend(seqs), comms.tp, &x, 0)?
                .map(|logits| self.soft_capped(logits))
                .transpose(),
        })
    }

    /// `logits` soft-capped as the model's final logits are (Gemma 2's
    /// `final_logit_softcapping`); unchanged for other models. The greedy paths pick from
    /// uncapped logits: `tanh` is increasing, so the argmax is the same, but probabilities
    /// and log-probabilities come from the capped values this returns.
    fn soft_capped(&self, mut logits: Tensor) -> Result<Tensor> {
        if let Some(cap) = self.config.final_softcap {
            self.backend.soft_cap(&mut logits, cap)?;
        }
        Ok(logits)
    }

    /// [`ParallelModel::forward_batch`] for greedy picks: the argmax of each row it would
    /// return logits for, in the same order, on the rank at TP 0 and CP 0 (`None` elsewhere),
    /// found without moving the logits (each TP rank's best value and id are gathered: see
    /// [`ParallelLmHead::argmax`](super::ParallelLmHead::argmax)). The ids are those of the
    /// serial argmax of [`ParallelModel::forward_batch`]'s rows.
    ///
    /// # Errors
    /// As [`ParallelModel::forward_batch`].
    pub fn forward_batch_argmax(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
    ) -> Result<Option<Vec<u32>>> {
        let root = (self.placement.tp_rank, self.placement.cp_rank) == (0, 0);
        let edits = row_edits(seqs);
        let softcap = self.config.final_softcap;
        let _step = self.step(seqs);
        self.backend.run(|| match self.final_rows(comms, seqs)? {
            FinalRows::None { root } => Ok(root.then(Vec::new)),
            FinalRows::Elsewhere => Ok(None),
            FinalRows::Here(x) => {
                let be = self.final_backend(seqs);
                let ids = self.lm_head.argmax(&be, comms.tp, &x, edits.as_ref(), softcap)?;
                Ok(root.then_some(ids))
            }
        })
    }

    /// [`ParallelModel::forward_batch`] for samplers that keep at most `k` tokens (at most
    /// [`tensor::kernels::TOP_K_MAX`]): the `k` most likely tokens of each row it would return
    /// logits for, with their (soft-capped) logits, in the same order, on the rank at TP 0 and
    /// CP 0 (`None` elsewhere), found without moving the logits (see
    /// [`ParallelLmHead::top_k`](super::ParallelLmHead::top_k)). The candidates are those of
    /// [`Backend::top_k_rows`](tensor::Backend::top_k_rows) over
    /// [`ParallelModel::forward_batch`]'s rows.
    ///
    /// # Errors
    /// As [`ParallelModel::forward_batch`], and `k` too large.
    pub fn forward_batch_top_k(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
        k: usize,
    ) -> Result<Option<TopK>> {
        let root = (self.placement.tp_rank, self.placement.cp_rank) == (0, 0);
        let softcap = self.config.final_softcap;
        let edits = row_edits(seqs);
        let _step = self.step(seqs);
        self.backend.run(|| match self.final_rows(comms, seqs)? {
            FinalRows::None { root } => {
                let per_row = k.min(self.config.vocab_size);
                Ok(root.then(|| TopK::from_parts(per_row, Vec::new(), Vec::new())))
            }
            FinalRows::Elsewhere => Ok(None),
            FinalRows::Here(x) => {
                let be = self.final_backend(seqs);
                let top = self.lm_head.top_k(&be, comms.tp, &x, k, softcap, edits.as_ref())?;
                Ok(root.then_some(top))
            }
        })
    }

    /// [`ParallelModel::forward_batch`] for samplers that weigh every token of a row: one
    /// token per row it would return logits for, drawn by `draws` (one per row, in the same
    /// order; see [`Backend::sample_rows`]) where the logits are, on the rank at TP 0 and CP 0
    /// (`None` elsewhere, whose `draws` are not read): on a GPU of one TP rank the logits stay
    /// on the device and only the ids come to the host. The tokens
    /// [`tensor::kernels::draw_columns`] draws from [`ParallelModel::forward_batch`]'s rows.
    ///
    /// # Errors
    /// As [`ParallelModel::forward_batch`], and another number of draws than rows.
    pub fn forward_batch_sample(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
        draws: &[Draw],
    ) -> Result<Option<Vec<u32>>> {
        let _step = self.step(seqs);
        let Some(logits) = self.forward_batch(comms, seqs)? else { return Ok(None) };
        let logits = self.edited(logits, seqs)?;
        Ok(Some(self.backend.run(|| self.backend.sample_rows(&logits, draws))?))
    }

    /// [`ParallelModel::forward_batch`] for a step whose samplers mix those of
    /// [`ParallelModel::forward_batch_top_k`] and [`ParallelModel::forward_batch_sample`]:
    /// the `k` candidates of every row it would return logits for
    /// ([`Backend::top_k_rows`](tensor::Backend::top_k_rows)) and one token per row drawn by
    /// `draws` ([`Backend::sample_rows`]), both from the same logits where they are, on the
    /// rank at TP 0 and CP 0 (`None` elsewhere, whose `draws` are not read). On a GPU of one TP
    /// rank the logits never leave the device.
    ///
    /// # Errors
    /// As [`ParallelModel::forward_batch`], `k` too large, and another number of draws than
    /// rows.
    pub fn forward_batch_top_k_and_sample(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
        k: usize,
        draws: &[Draw],
    ) -> Result<Option<(TopK, Vec<u32>)>> {
        let _step = self.step(seqs);
        let Some(logits) = self.forward_batch(comms, seqs)? else { return Ok(None) };
        let logits = self.edited(logits, seqs)?;
        let be = &self.backend;
        Ok(Some(be.run(|| {
            Ok::<_, Error>((be.top_k_rows(&logits, k)?, be.sample_rows(&logits, draws)?))
        })?))
    }

    /// [`ParallelModel::forward_batch`] for a step whose samplers want their tokens'
    /// log-probabilities, picked where the logits are (session's `Samplers::scored`): of the
    /// rows it would return logits for, on the rank at TP 0 and CP 0 (`None` elsewhere, whose
    /// `draws` are not read), each row's [`Normalizer`] and `top` most likely tokens of the
    /// logits as they are ([`Backend::normalizers`], [`Backend::top_k_rows`]); then, after
    /// each sequence's edits, each row drawn by `draws` ([`Backend::sample_rows`]) and, with
    /// `candidates`, its candidates. The logits themselves stay in [`Scored::logits`] (on a
    /// GPU of one TP rank, on the device) for the picked tokens' logits
    /// ([`ParallelModel::logits_at`]).
    ///
    /// # Errors
    /// As [`ParallelModel::forward_batch`], a count of candidates or alternatives too large,
    /// and another number of draws than rows.
    pub fn forward_batch_scored(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
        candidates: Option<usize>,
        draws: &[Draw],
        top: usize,
    ) -> Result<Option<Scored>> {
        let _step = self.step(seqs);
        let Some(logits) = self.forward_batch(comms, seqs)? else { return Ok(None) };
        let be = &self.backend;
        let (normalizers, best) = be.run(|| {
            let best = match top {
                0 => Ok(TopK::from_parts(0, Vec::new(), Vec::new())),
                top => be.top_k_rows(&logits, top),
            };
            Ok::<_, Error>((be.normalizers(&logits)?, best?))
        })?;
        // The edits change a copy (on a GPU, a device copy made by the first edit); the
        // logits as they are stay for the picked tokens' own.
        let edited = match seqs.iter().any(|s| !s.edits.is_empty()) {
            true => Some(self.edited(logits.clone(), seqs)?),
            false => None,
        };
        let picks = edited.as_ref().unwrap_or(&logits);
        let (top, drawn) = be.run(|| {
            let top = candidates.map(|k| be.top_k_rows(picks, k)).transpose()?;
            Ok::<_, Error>((top, be.sample_rows(picks, draws)?))
        })?;
        Ok(Some(Scored { normalizers, best, top, drawn, logits }))
    }

    /// `logits[r, tokens[r]]` of a [`Scored`] step's logits (NaN past a row), read where
    /// they are: the picked tokens' own logits, for their log-probabilities.
    ///
    /// # Errors
    /// Another number of tokens than rows; the backend failed.
    pub fn logits_at(&self, logits: &Tensor, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(self.backend.run(|| self.backend.columns_at(logits, tokens))?)
    }

    /// `logits`, [`ParallelModel::forward_batch`]'s rows of `seqs` (the whole vocabulary),
    /// with each sequence's edits applied to its last row.
    fn edited(&self, mut logits: Tensor, seqs: &[Sequence<'_>]) -> Result<Tensor> {
        if let Some(edits) = row_edits(seqs) {
            self.backend.run(|| self.backend.edit_rows(&mut logits, &edits, 0))?;
        }
        Ok(logits)
    }

    /// Starts the backend's step over `seqs` (see [`Backend::step`]): until it is dropped, the
    /// buffers the kernels write are planned per step shape, so that on a GPU a warm step
    /// allocates nothing.
    fn step(&self, seqs: &[Sequence<'_>]) -> tensor::kernels::workspace::StepScope {
        let tokens = seqs.iter().map(|s| s.tokens.len()).sum();
        self.backend.step(tokens, seqs.len())
    }

    /// The backend for the LM head over `seqs`' final rows: those of sequences that want only
    /// their last row's logits come first, one row each, and take the same kernels in a step of
    /// any size (see [`Backend::for_step`]).
    fn final_backend(&self, seqs: &[Sequence<'_>]) -> Backend {
        self.backend.for_step(seqs.iter().take_while(|s| !s.every_row).filter(|s| s.sample).count())
    }

    /// Runs the layers over `seqs` and brings the hidden rows whose logits are wanted, normed,
    /// to CP rank 0 (every TP rank of it).
    fn final_rows(&self, comms: &mut Comms<'_>, seqs: &mut [Sequence<'_>]) -> Result<FinalRows> {
        let (x, parts) = self.layers(comms, seqs)?;
        let Placement { cp_rank, cp, .. } = self.placement;
        // Per sequence: whether its every row is wanted, or its last, or none.
        let wanted: Vec<(bool, bool, &Part)> =
            seqs.iter().zip(&parts).map(|(s, p)| (s.every_row, s.sample, p)).collect();
        let hidden = self.config.hidden;
        if wanted.iter().all(|&(every, sample, _)| !every && !sample) {
            // Nothing to sample (prompt chunks only): no rank moves anything.
            return Ok(FinalRows::None { root: (cp_rank, self.placement.tp_rank) == (0, 0) });
        }
        // Every row of a prefill split over CP: each CP rank's shard, gathered by all of them.
        let shards: Vec<&TokenShard> = wanted
            .iter()
            .filter(|w| w.0)
            .filter_map(|w| match &w.2.split {
                Split::Prefill(shard) => Some(shard),
                Split::Extend(_) => None,
            })
            .collect();
        let mut gathered = Vec::new();
        let mut offsets = vec![0; cp];
        if !shards.is_empty() {
            let sizes: Vec<usize> = (0..cp)
                .map(|r| shards.iter().map(|s| s.ranges()[r].len() * hidden).sum())
                .collect();
            let mut mine = Vec::with_capacity(sizes[cp_rank]);
            for (_, _, p) in wanted.iter().filter(|w| w.0 && matches!(w.2.split, Split::Prefill(_)))
            {
                mine.extend_from_slice(&x.host()?[p.rows.start * hidden..p.rows.end * hidden]);
            }
            gathered = vec![0f32; sizes.iter().sum()];
            comms.cp.all_gather_uneven(&mine, &mut gathered, &sizes)?;
            // Where each rank's part begins in `gathered`.
            let mut at = 0;
            for (offset, size) in offsets.iter_mut().zip(&sizes) {
                *offset = at;
                at += size;
            }
        }
        // The last row of a prefill ends on the last CP rank (shards ascend); it sends it to
        // CP rank 0.
        let holder = cp - 1;
        let from_holder: Vec<usize> = wanted
            .iter()
            .filter(|&&(every, sample, p)| !every && sample && matches!(p.split, Split::Prefill(_)))
            .map(|w| w.2.rows.end - 1)
            .collect();
        if cp_rank != 0 {
            if cp_rank == holder && !from_holder.is_empty() {
                let mut rows = Vec::with_capacity(from_holder.len() * hidden);
                for &r in &from_holder {
                    rows.extend_from_slice(x.host_row(r)?);
                }
                comms.cp.send(&rows, 0)?;
            }
            return Ok(FinalRows::Elsewhere);
        }
        let mut received = vec![0f32; from_holder.len() * hidden];
        if !from_holder.is_empty() {
            comms.cp.recv(&mut received, holder)?;
        }
        let mut received = received.chunks_exact(hidden);
        let mut rows = Vec::new();
        for &(every, sample, p) in &wanted {
            match (&p.split, every, sample) {
                (Split::Prefill(shard), true, _) => {
                    for (r, range) in shard.ranges().iter().enumerate() {
                        let n = range.len() * hidden;
                        rows.extend_from_slice(&gathered[offsets[r]..offsets[r] + n]);
                        offsets[r] += n;
                    }
                }
                (Split::Extend(_), true, _) => {
                    rows.extend_from_slice(&x.host()?[p.rows.start * hidden..p.rows.end * hidden]);
                }
                (Split::Prefill(_), false, true) => {
                    rows.extend_from_slice(received.next().unwrap_or_default());
                }
                (Split::Extend(_), false, true) => {
                    rows.extend_from_slice(x.host_row(p.rows.end - 1)?)
                }
                (_, false, false) => {}
            }
        }
        let x = Tensor::from_vec(&[rows.len() / hidden, hidden], rows)?;
        Ok(FinalRows::Here(self.backend.rms_norm(&x, &self.norm, self.config.rms_eps)?))
    }

    /// Greedy generation: `prompt`, then argmax tokens until `max_new`, a `stop` token or a
    /// full cache. Every rank returns the same tokens.
    ///
    /// # Errors
    /// As [`ParallelModel::forward`].
    pub fn generate(
        &self,
        comms: &mut Comms<'_>,
        prompt: &[u32],
        max_new: usize,
        stop: &[u32],
        cache: &mut ParallelCache,
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        if max_new == 0 || prompt.is_empty() {
            return Ok(out);
        }
        let mut next = self.forward_argmax(comms, prompt, cache, Logits::Last)?[0];
        loop {
            out.push(next);
            on_token(next);
            let full = cache.cp_lens.iter().min().copied().unwrap_or(0) >= cache.capacity();
            if out.len() >= max_new || stop.contains(&next) || full {
                return Ok(out);
            }
            next = self.forward_argmax(comms, &[next], cache, Logits::Last)?[0];
        }
    }

    /// The decoder stack over one step of `seqs`: returns this rank's rows of the last hidden
    /// states (before the final norm), packed in order, and each sequence's place.
    fn layers(
        &self,
        comms: &mut Comms<'_>,
        seqs: &mut [Sequence<'_>],
    ) -> Result<(Tensor, Vec<Part>)> {
        if seqs.is_empty() {
            return Err(Error::shape("ParallelModel::forward_batch", "no sequences"));
        }
        let mut tokens = Vec::new();
        let mut parts = Vec::with_capacity(seqs.len());
        for s in seqs.iter() {
            let at = tokens.len();
            parts.push(self.part_into(s.cache, s.tokens, s.tokens.len(), at, &mut tokens)?);
        }
        // Decode rows (a sequence's one new token, on this rank) lead a step as the scheduler
        // packs it; they take the same kernels in a step of any size.
        let single = parts.iter().take_while(|p| p.rows.len() == 1 && p.all_positions.len() == 1);
        let (be, c) = (&self.backend.for_step(single.count()), &self.config);
        let mut x = self.embed.forward(be, comms.tp, &tokens)?;
        if let Some(s) = c.embedding_scale {
            be.scale(&mut x, s)?;
        }
        // Each residual add is fused with the norm that reads the sum (the FFN's, then the
        // next block's attention norm): one kernel instead of two. The last block's sum is
        // normed by the caller, after the rows it needs are gathered.
        let mut normed = None;
        for (l, b) in self.blocks.iter().enumerate() {
            let h = match normed.take() {
                Some(h) => h,
                None => be.rms_norm(&x, &b.attn_norm, c.rms_eps)?,
            };
            let mut caches: Vec<&mut ParallelCache> =
                seqs.iter_mut().map(|s| &mut *s.cache).collect();
            let mut a = b.attn.forward(be, comms, &h, &parts, l, &mut caches)?;
            if let Some(post) = &b.post_norms {
                a = be.rms_norm(&a, &post.attn, c.rms_eps)?;
            }
            let h = be.add_rms_norm(&mut x, &a, &b.ffn_norm, c.rms_eps)?;
            let mut m = b.mlp.forward(be, &h)?;
            be.all_reduce_sum(comms.tp, &mut m)?;
            if let Some(post) = &b.post_norms {
                // After the all-reduce: the norm reads the whole row.
                m = be.rms_norm(&m, &post.ffn, c.rms_eps)?;
            }
            match self.blocks.get(l + 1) {
                Some(next) => {
                    normed = Some(be.add_rms_norm(&mut x, &m, &next.attn_norm, c.rms_eps)?)
                }
                None => be.add_assign(&mut x, &m)?,
            }
        }
        // The reductions above are queued on the device without host waits; the last one is
        // waited for here, where a failed peer is named.
        be.wait_collectives(comms.tp)?;
        for (s, p) in seqs.iter_mut().zip(&parts) {
            let kept = p.kept(self.placement.cp);
            s.cache.cp_lens.iter_mut().zip(kept).for_each(|(len, k)| *len += k);
        }
        Ok((x, parts))
    }

    /// The final normalized hidden states of the rows `logits` asks for, on every rank.
    fn hidden(
        &self,
        comms: &mut Comms<'_>,
        tokens: &[u32],
        cache: &mut ParallelCache,
        logits: Logits,
    ) -> Result<Tensor> {
        let c = &self.config;
        let mut seqs = [Sequence::sampled(tokens, cache)];
        let (x, mut parts) = self.layers(comms, &mut seqs)?;
        let part = parts.remove(0);
        // Bring the rows asked for onto every rank.
        let x = match (&part.split, logits) {
            (Split::Prefill(shard), Logits::All) => gather_tokens(comms.cp, &x, shard)?,
            (Split::Prefill(_), Logits::Last) => {
                // Shards ascend, so the last CP rank holds the last token.
                let holder = self.placement.cp - 1;
                let mut last = if self.placement.cp_rank == holder {
                    x.host_row(x.rows() - 1)?.to_vec()
                } else {
                    vec![0f32; c.hidden]
                };
                comms.cp.broadcast(&mut last, holder)?;
                Tensor::from_vec(&[1, c.hidden], last)?
            }
            (Split::Extend(_), Logits::All) => x,
            (Split::Extend(_), Logits::Last) => {
                Tensor::from_vec(&[1, c.hidden], x.host_row(x.rows() - 1)?.to_vec())?
            }
        };
        Ok(self.backend.rms_norm(&x, &self.norm, c.rms_eps)?)
    }
}

/// What [`ParallelModel::forward_batch_scored`] finds of a step's rows (one per sampled
/// entry, in plan order) where the logits are.
#[derive(Debug)]
pub struct Scored {
    /// Each row's normalizer, of the logits before the edits.
    pub normalizers: Vec<Normalizer>,
    /// Each row's most likely tokens before the edits (as many as asked; none for 0).
    pub best: TopK,
    /// Each row's candidates after the edits, when asked for.
    pub top: Option<TopK>,
    /// Each row's token drawn after the edits.
    pub drawn: Vec<u32>,
    /// The logits before the edits, where they are.
    pub logits: Tensor,
}

/// The edits of the rows [`ParallelModel::forward_batch`] returns for `seqs`: each sequence's
/// on its last row (the one its token is picked from), none on the others; `None` when no
/// sequence has any.
fn row_edits(seqs: &[Sequence<'_>]) -> Option<LogitEdits> {
    if seqs.iter().all(|s| s.edits.is_empty()) {
        return None;
    }
    let mut rows: Vec<&[LogitEdit]> = Vec::new();
    for s in seqs {
        if s.every_row {
            rows.extend(std::iter::repeat_n(&[][..], s.tokens.len().saturating_sub(1)));
            rows.push(s.edits);
        } else if s.sample {
            rows.push(s.edits);
        }
    }
    Some(LogitEdits::from_rows(rows))
}
