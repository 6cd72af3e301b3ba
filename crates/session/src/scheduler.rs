//! Rank 0's continuous-batching scheduler: requests join at step boundaries, running sequences
//! decode one token per step next to prompt chunks of new ones, within a token budget. It is
//! bookkeeping only: the model runner samples (each sequence's parameters travel with its
//! first plan entry), and the scheduler takes the tokens it returns and ends the requests that
//! reached a stop token or a limit.
//!
//! With a paged KV pool ([`KvLayout`]) it also hands out the pool's blocks (the same ids on
//! every rank): a prompt chunk runs only when its blocks are free (requests wait in arrival
//! order, never fail), a running sequence that needs a block when none is free preempts the
//! most recently arrived sequence holding blocks (which recomputes later, with the same
//! tokens), and a new prompt starts after the longest cached prefix of full blocks.
//!
//! A model with sliding-window layers (Gemma 2 and 3) has its layers in groups
//! ([`KvLayout::groups`]): a sequence gets one block per group for each `block_size` tokens,
//! and before each plan the blocks of its windowed groups that no later query can see go
//! back to the pool (`layers::model::window_dead_blocks`, which the ranks follow when they
//! read), so a long sequence holds about `window / block_size` blocks of each windowed group.
//! Such a model caches no prefixes.

use crate::blocks::BlockManager;
use crate::error::{BoxError, Error, Result};
use crate::model::{KvLayout, SampledToken};
use crate::plan::{PlanEntry, SeqId, SeqSampling, StepPlan};
use crate::sampler::{PromptLogprobs, RankedLogprobs, SamplingParams, TokenLogprobs};
use crate::sink::{FinishReason, TextCodec};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A prompt as text (tokenized on rank 0) or as token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text, encoded by the session's tokenizer.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// One generation request, owned by rank 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The caller's id, echoed in the output sink.
    pub id: u64,
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling and stopping.
    pub params: SamplingParams,
    /// Set by the caller to end the request early (its client went away).
    pub cancel: Option<Cancel>,
}

impl Request {
    /// A request for `prompt` token ids with the given parameters.
    pub fn tokens(id: u64, prompt: Vec<u32>, params: SamplingParams) -> Self {
        Request { id, prompt: Prompt::Tokens(prompt), params, cancel: None }
    }

    /// Ends early, with [`FinishReason::Cancelled`], once `cancel` is set.
    pub fn with_cancel(mut self, cancel: Cancel) -> Self {
        self.cancel = Some(cancel);
        self
    }
}

/// Cancels a request: the engine drops it at its next step boundary (its KV cache is freed on
/// every rank) and reports it finished with [`FinishReason::Cancelled`].
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Asks for the cancellation.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether it was asked for.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl PartialEq for Cancel {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// What a step or an admission produced for the output sink.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Emit {
    Token { request: u64, token: u32, logprobs: Option<TokenLogprobs> },
    PromptLogprobs { request: u64, start: u32, tokens: Vec<RankedLogprobs> },
    Finished { request: u64, reason: FinishReason, tokens: Vec<u32> },
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    request: u64,
    prompt: Vec<u32>,
    /// Tokens in the model's KV cache (prompt first, then generated ones).
    prefilled: usize,
    generated: Vec<u32>,
    params: SamplingParams,
    /// Whether a plan carried the sampling of the current id to the runner.
    announced: bool,
    stop: Vec<u32>,
    cancel: Option<Cancel>,
    /// Blocks of the KV pool the sequence got, in table order: one per group for each
    /// `block_size` tokens (see [`KvLayout::groups`]).
    blocks: Vec<u32>,
    /// Leading table entries (`block_size` tokens each) whose windowed groups' blocks went
    /// back to the pool: `blocks` still names them, but the sequence no longer holds them.
    dropped: usize,
    /// How many of `blocks` the ranks were given already.
    sent: usize,
    /// Full blocks remembered for prefix reuse.
    registered: usize,
    /// Whether a plan ever gave the request a step (its queue time ended then).
    scheduled: bool,
    /// The next prompt position whose log-probabilities go out (when they are asked for;
    /// position 0 has none): a recompute that scores the same positions again sends each
    /// once.
    prompt_scored: usize,
}

impl Seq {
    /// Tokens to prefill before decoding: the prompt, and after a recompute every generated
    /// token but the last (which the next decode step feeds).
    fn context(&self) -> usize {
        self.prompt.len() + self.generated.len().saturating_sub(1)
    }

    /// The most tokens the sequence can hold in a model's cache of `context` tokens: its
    /// prompt and every token it may generate.
    fn reserve(&self, context: usize) -> u32 {
        let limit = self.prompt.len() + self.params.max_tokens as usize;
        u32::try_from(limit.min(context)).unwrap_or(u32::MAX)
    }

    fn decoding(&self) -> bool {
        self.prefilled == self.context()
    }

    /// The blocks the ranks have not been given yet; from now on they have.
    fn unsent(&mut self) -> Vec<u32> {
        let blocks = self.blocks[self.sent..].to_vec();
        self.sent = self.blocks.len();
        blocks
    }

    /// The sampling of the current id for the runner, the first time it is planned: the
    /// parameters, the generator's position, and the history when a penalty counts it.
    fn announce(&mut self) -> Option<Box<SeqSampling>> {
        if std::mem::replace(&mut self.announced, true) {
            return None;
        }
        let history = self.params.adjusts_logits();
        let seen = |tokens: &[u32]| if history { tokens.to_vec() } else { Vec::new() };
        // A constrained sequence replays its output through its grammar after a recompute.
        let replay = history || self.params.constraint.is_some();
        Some(Box::new(SeqSampling {
            params: self.params.clone(),
            drawn: u32::try_from(self.generated.len()).unwrap_or(u32::MAX),
            prompt: seen(&self.prompt),
            generated: if replay { self.generated.clone() } else { Vec::new() },
        }))
    }

    /// Token `i` of the sequence: the prompt, then the generated tokens.
    fn token(&self, i: usize) -> u32 {
        match i.checked_sub(self.prompt.len()) {
            None => self.prompt[i],
            Some(g) => self.generated[g],
        }
    }
}

/// The paged KV pool's bookkeeping.
#[derive(Debug)]
struct Pool {
    blocks: BlockManager,
    spread: usize,
    prefix_caching: bool,
    /// Blocks a new sequence leaves free for the running ones to grow into.
    watermark: usize,
    /// Block ids a sequence gets per `block_size` tokens (one per group).
    groups: usize,
    /// The last `windowed` groups hold sliding-window layers of this window.
    windowed: usize,
    window: usize,
}

impl Pool {
    /// Table entries of `s` (`block_size` tokens of every group each).
    fn entries(&self, s: &Seq) -> usize {
        s.blocks.len() / self.groups
    }

    /// Gives back the blocks of `s`'s windowed groups that no query of its next step (at
    /// `s.prefilled`) sees on any rank.
    fn give_back(&mut self, s: &mut Seq) {
        if self.windowed == 0 {
            return;
        }
        let (bs, g) = (self.blocks.block_size(), self.groups);
        let dead = layers::model::window_dead_blocks(s.prefilled, self.spread, self.window, bs)
            .min(self.entries(s));
        for entry in s.dropped..dead {
            self.blocks.release(&s.blocks[entry * g + g - self.windowed..(entry + 1) * g]);
        }
        s.dropped = s.dropped.max(dead);
    }

    /// Gives back every block `s` holds.
    fn release(&mut self, s: &Seq) {
        if s.dropped == 0 {
            self.blocks.release(&s.blocks);
            return;
        }
        let (g, kept) = (self.groups, self.groups - self.windowed);
        let held: Vec<u32> = s
            .blocks
            .chunks(g)
            .enumerate()
            .flat_map(|(entry, ids)| if entry < s.dropped { &ids[..kept] } else { ids })
            .copied()
            .collect();
        self.blocks.release(&held);
    }

    /// Blocks a rank needs for `tokens` tokens of one sequence.
    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.spread).div_ceil(self.blocks.block_size())
    }

    /// Tokens of one sequence that `blocks` blocks hold on every rank.
    fn tokens_in(&self, blocks: usize) -> usize {
        blocks * self.blocks.block_size() * self.spread
    }
}

/// How full the scheduler is, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Load {
    /// Sequences with tokens in the KV cache.
    pub(crate) running: usize,
    /// Sequences waiting for their first step (or to recompute after a preemption).
    pub(crate) waiting: usize,
    /// Share of the pool's blocks held by sequences (0 without a pool).
    pub(crate) kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache since the previous report.
    pub(crate) prefix_queries: u64,
    /// Prompt tokens found in the prefix cache since the previous report.
    pub(crate) prefix_hits: u64,
    /// Sequences preempted since the previous report.
    pub(crate) preemptions: u64,
}

/// Sequences of one session, in arrival order.
#[derive(Debug)]
pub(crate) struct Scheduler {
    budget: usize,
    max_batch: usize,
    context: usize,
    /// The ids that end a request unless it ignores them.
    eos: Vec<u32>,
    seqs: Vec<Seq>,
    released: Vec<SeqId>,
    next_seq: SeqId,
    pool: Option<Pool>,
    preemptions: u64,
    /// The counters at the previous [`Scheduler::take_load`]: queries, hits, preemptions.
    reported: (u64, u64, u64),
    /// Requests whose first step was planned since the previous [`Scheduler::take_started`].
    started: Vec<u64>,
}

impl Scheduler {
    pub(crate) fn new(budget: u32, max_batch: u32, context: usize, eos: Vec<u32>) -> Self {
        Scheduler {
            budget: (budget as usize).max(1),
            max_batch: (max_batch as usize).max(1),
            context,
            eos,
            seqs: Vec::new(),
            released: Vec::new(),
            next_seq: 1,
            pool: None,
            preemptions: 0,
            reported: (0, 0, 0),
            started: Vec::new(),
        }
    }

    /// Hands out the blocks of a paged KV pool of `layout` (see the module docs).
    pub(crate) fn with_kv(mut self, layout: KvLayout) -> Self {
        let spread = (layout.spread as usize).max(1);
        let groups = (layout.groups as usize).max(1);
        let windowed = (layout.windowed as usize).min(groups);
        // Prefix reuse needs a rank's blocks to hold the same tokens for every sequence, one
        // table per sequence, and every block of the prefix still held: a model with
        // sliding-window layers reuses nothing.
        let prefix_caching = layout.prefix_caching && spread == 1 && groups == 1 && windowed == 0;
        if layout.prefix_caching && (groups > 1 || windowed > 0) {
            tracing::info!(
                groups,
                windowed,
                "prefix caching is off: the model's sliding-window layers keep their KV blocks \
                 apart and give them back past the window"
            );
        }
        let blocks = BlockManager::new(layout.blocks, layout.block_size, prefix_caching);
        let watermark = (blocks.total() / 100).max(1);
        let window = (layout.window as usize).max(1);
        self.pool =
            Some(Pool { blocks, spread, prefix_caching, watermark, groups, windowed, window });
        self
    }

    /// How full the scheduler is, with the counters since the previous call.
    pub(crate) fn take_load(&mut self) -> Load {
        let paged = self.pool.is_some();
        let running =
            self.seqs.iter().filter(|s| if paged { s.sent > 0 } else { s.prefilled > 0 }).count();
        let (mut queries, mut hits, mut kv_usage) = (0, 0, 0.0);
        if let Some(p) = &self.pool {
            kv_usage = p.blocks.used() as f64 / p.blocks.total().max(1) as f64;
            (queries, hits) = (p.blocks.stats().queries, p.blocks.stats().hits);
        }
        let (q0, h0, p0) = std::mem::replace(&mut self.reported, (queries, hits, self.preemptions));
        Load {
            running,
            waiting: self.seqs.len() - running,
            kv_usage,
            prefix_queries: queries - q0,
            prefix_hits: hits - h0,
            preemptions: self.preemptions - p0,
        }
    }

    /// The requests whose first step was planned since the previous call, in plan order (a
    /// preempted request that prefills again is not among them).
    pub(crate) fn take_started(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.started)
    }

    /// Whether any sequence is waiting or running.
    pub(crate) fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Admits a request; a request that cannot run finishes at once (returned).
    pub(crate) fn add(
        &mut self,
        req: Request,
        codec: Option<&dyn TextCodec>,
        epoch: u64,
    ) -> Result<Option<Emit>> {
        let prompt = match req.prompt {
            Prompt::Tokens(t) => t,
            Prompt::Text(text) => match codec {
                Some(c) => c.encode(&text),
                None => Err(BoxError::from("a text prompt needs a tokenizer; send token ids")),
            }
            .map_err(|source| Error::Codec { epoch, request: req.id, source })?,
        };
        if prompt.is_empty() || prompt.len() >= self.context {
            return Ok(Some(Emit::Finished {
                request: req.id,
                reason: FinishReason::Rejected,
                tokens: Vec::new(),
            }));
        }
        if req.params.max_tokens == 0 {
            return Ok(Some(Emit::Finished {
                request: req.id,
                reason: FinishReason::Length,
                tokens: Vec::new(),
            }));
        }
        let mut stop = req.params.stop.clone();
        // A grammar allows an end id only where the answer may end: there it ends, even
        // with `ignore_eos`.
        if !req.params.ignore_eos || req.params.constraint.is_some() {
            stop.extend(self.eos.iter().filter(|id| !req.params.stop.contains(id)));
        }
        let id = self.next_seq;
        self.next_seq += 1;
        self.seqs.push(Seq {
            id,
            request: req.id,
            prompt,
            prefilled: 0,
            generated: Vec::new(),
            params: req.params,
            announced: false,
            stop,
            cancel: req.cancel,
            blocks: Vec::new(),
            dropped: 0,
            sent: 0,
            registered: 0,
            scheduled: false,
            prompt_scored: 1,
        });
        Ok(None)
    }

    /// The next step: decode tokens of running sequences first, then prompt chunks of waiting
    /// ones in arrival order, within the token budget, the batch size and the KV pool's free
    /// blocks. `None` when nothing can run.
    pub(crate) fn plan(&mut self, epoch: u64, step: u64) -> Option<StepPlan> {
        if let Some(pool) = self.pool.as_mut().filter(|p| p.windowed > 0) {
            self.seqs.iter_mut().for_each(|s| pool.give_back(s));
        }
        let mut budget = self.budget;
        let mut entries = Vec::new();
        let mut i = 0;
        while i < self.seqs.len() && budget > 0 && entries.len() < self.max_batch {
            if !self.seqs[i].decoding() {
                i += 1;
                continue;
            }
            if !self.grow(i) {
                // It preempted itself: it prefills again later.
                i += 1;
                continue;
            }
            let s = &mut self.seqs[i];
            let last = *s.generated.last()?;
            let (start, reserve) = (s.prefilled as u32, s.reserve(self.context));
            let (blocks, sampling) = (s.unsent(), s.announce());
            entries.push(PlanEntry {
                seq: s.id,
                start,
                tokens: vec![last],
                sample: true,
                reserve,
                blocks,
                sampling,
            });
            budget -= 1;
            i += 1;
        }
        for s in self.seqs.iter_mut().filter(|s| !s.decoding()) {
            if budget == 0 || entries.len() == self.max_batch {
                break;
            }
            let mut chunk = (s.context() - s.prefilled).min(budget);
            if let Some(pool) = &mut self.pool {
                chunk = Self::admit(pool, s, chunk);
                if chunk == 0 {
                    // First come, first served: later prompts wait too.
                    break;
                }
            }
            if !std::mem::replace(&mut s.scheduled, true) {
                self.started.push(s.request);
            }
            let tokens = (s.prefilled..s.prefilled + chunk).map(|i| s.token(i)).collect();
            // A recomputed sequence already sampled its next token.
            let sample = s.prefilled + chunk == s.context() && s.generated.is_empty();
            let (start, reserve) = (s.prefilled as u32, s.reserve(self.context));
            let (blocks, sampling) = (s.unsent(), s.announce());
            entries.push(PlanEntry { seq: s.id, start, tokens, sample, reserve, blocks, sampling });
            budget -= chunk;
        }
        if entries.is_empty() {
            return None;
        }
        Some(StepPlan { epoch, step, entries, released: std::mem::take(&mut self.released) })
    }

    /// Makes sure decoding sequence `i` has a block for its next token, preempting the most
    /// recently arrived sequence after it that holds blocks while none is free; returns false
    /// when `i` itself had to be preempted.
    fn grow(&mut self, i: usize) -> bool {
        let Some(need) = self.pool.as_ref().map(|p| p.blocks_for(self.seqs[i].prefilled + 1))
        else {
            return true;
        };
        let groups = self.pool.as_ref().map_or(1, |p| p.groups);
        loop {
            let missing = need.saturating_sub(self.seqs[i].blocks.len() / groups);
            if missing == 0 {
                return true;
            }
            if let Some(got) = self.pool.as_mut().and_then(|p| p.blocks.allocate(missing * groups))
            {
                self.seqs[i].blocks.extend(got);
                return true;
            }
            let victim = (i + 1..self.seqs.len())
                .rev()
                .find(|&j| !self.seqs[j].blocks.is_empty())
                .unwrap_or(i);
            self.preemptions += 1;
            self.requeue(victim);
            if victim == i {
                return false;
            }
        }
    }

    /// Frees sequence `i`'s blocks; it prefills again from its tokens under a new id (its
    /// full blocks stay cached for that, while nobody needs them).
    fn requeue(&mut self, i: usize) {
        let s = &mut self.seqs[i];
        if let Some(pool) = &mut self.pool {
            pool.release(s);
        }
        (s.blocks, s.dropped, s.sent, s.registered, s.prefilled) = (Vec::new(), 0, 0, 0, 0);
        s.announced = false;
        self.released.push(s.id);
        s.id = self.next_seq;
        self.next_seq += 1;
    }

    /// The tokens of `want` that `s`, about to prefill, gets blocks for now (0: it waits).
    /// A sequence that has none yet first takes the longest cached prefix of its tokens.
    fn admit(pool: &mut Pool, s: &mut Seq, want: usize) -> usize {
        let fresh = s.blocks.is_empty();
        // Prompt log-probabilities need the logits of every prompt position: no reuse.
        let scored = s.params.prompt_logprobs.is_some();
        if fresh && s.prefilled == 0 && pool.prefix_caching && !scored {
            let context = s.context();
            let tokens: Vec<u32> = (0..context).map(|i| s.token(i)).collect();
            // At least one token is computed, for its logits.
            let hits = pool.blocks.lookup(&tokens, (context - 1) / pool.blocks.block_size());
            s.prefilled = hits.len() * pool.blocks.block_size();
            s.registered = hits.len();
            s.blocks = hits;
        }
        let want = want.min(s.context() - s.prefilled);
        let spare = if fresh { pool.watermark } else { 0 };
        // Table entries it can have: each takes a block of every group (a windowed group's
        // old ones went back before the plan).
        let room = pool.entries(s) + pool.blocks.available().saturating_sub(spare) / pool.groups;
        let chunk = want.min(pool.tokens_in(room).saturating_sub(s.prefilled));
        let missing = pool.blocks_for(s.prefilled + chunk).saturating_sub(pool.entries(s));
        if chunk == 0 || missing == 0 {
            return chunk;
        }
        match pool.blocks.allocate(missing * pool.groups) {
            Some(got) => {
                s.blocks.extend(got);
                chunk
            }
            None => 0,
        }
    }

    /// Takes the prompt log-probabilities a step computed: each prompt position's go out
    /// once, in order (a recompute scores positions again).
    pub(crate) fn prompt_logprobs(&mut self, scored: Vec<PromptLogprobs>) -> Vec<Emit> {
        let mut out = Vec::new();
        for p in scored {
            let Some(s) = self.seqs.iter_mut().find(|s| s.id == p.seq) else { continue };
            let start = p.start as usize;
            let end = (start + p.tokens.len()).min(s.prompt.len());
            if start > s.prompt_scored || end <= s.prompt_scored {
                continue;
            }
            let tokens = p.tokens[s.prompt_scored - start..end - start].to_vec();
            out.push(Emit::PromptLogprobs {
                request: s.request,
                start: s.prompt_scored as u32,
                tokens,
            });
            s.prompt_scored = end;
        }
        out
    }

    /// Takes the results of `plan` (one token per sampled entry, from the model runner) and
    /// finishes the sequences that reached a limit or a stop token.
    pub(crate) fn apply(
        &mut self,
        plan: &StepPlan,
        sampled: Vec<SampledToken>,
    ) -> std::result::Result<Vec<Emit>, String> {
        let expected = plan.sampled().count();
        if sampled.len() != expected {
            return Err(format!(
                "the model returned {} tokens for {expected} sampled entries",
                sampled.len()
            ));
        }
        let mut sampled = sampled.into_iter();
        let mut out = Vec::new();
        for e in &plan.entries {
            let Some(i) = self.seqs.iter().position(|s| s.id == e.seq) else {
                return Err(format!("sequence {} of the plan is not scheduled", e.seq));
            };
            let s = &mut self.seqs[i];
            s.prefilled += e.tokens.len();
            if let Some(pool) = self.pool.as_mut().filter(|p| p.prefix_caching) {
                let full = s.prefilled / pool.blocks.block_size();
                if full > s.registered {
                    let tokens: Vec<u32> =
                        (0..full * pool.blocks.block_size()).map(|i| s.token(i)).collect();
                    pool.blocks.register(&s.blocks[..full], &tokens);
                    s.registered = full;
                }
            }
            if !e.sample {
                continue;
            }
            let SampledToken { token, logprobs } =
                sampled.next().ok_or("fewer tokens than sampled entries")?;
            s.generated.push(token);
            out.push(Emit::Token { request: s.request, token, logprobs });
            let reason = if s.stop.contains(&token) {
                Some(FinishReason::StopToken)
            } else if s.generated.len() >= s.params.max_tokens as usize
                || s.prompt.len() + s.generated.len() >= self.context
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                let s = self.seqs.remove(i);
                self.free(&s);
                out.push(Emit::Finished { request: s.request, reason, tokens: s.generated });
            }
        }
        Ok(out)
    }

    /// Ends the sequences whose request was cancelled; their caches are released with the
    /// next plan.
    pub(crate) fn take_cancelled(&mut self) -> Vec<Emit> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.seqs.len() {
            if !self.seqs[i].cancel.as_ref().is_some_and(Cancel::is_cancelled) {
                i += 1;
                continue;
            }
            let s = self.seqs.remove(i);
            self.free(&s);
            out.push(Emit::Finished {
                request: s.request,
                reason: FinishReason::Cancelled,
                tokens: s.generated,
            });
        }
        out
    }

    /// Releases a sequence that left the scheduler: its id on every rank, its blocks here.
    fn free(&mut self, s: &Seq) {
        self.released.push(s.id);
        if let Some(pool) = &mut self.pool {
            pool.release(s);
        }
    }

    /// Makes every sequence prefill again from its tokens (prompt and generated) under a new
    /// id, the old one released: the KV cache it had is gone (a discarded cache after a
    /// sleep). The continuation is the same as without the interruption.
    pub(crate) fn recompute_all(&mut self) {
        if let Some(pool) = &mut self.pool {
            let cached = pool.blocks.cached();
            pool.blocks.forget_cached();
            tracing::info!(
                cached_blocks = cached,
                sequences = self.seqs.iter().filter(|s| s.prefilled > 0).count(),
                "the KV cache's contents are gone: its prefix cache is emptied and running \
                 sequences recompute"
            );
        }
        for i in 0..self.seqs.len() {
            if self.seqs[i].prefilled > 0 || !self.seqs[i].blocks.is_empty() {
                self.requeue(i);
            }
        }
    }

    /// Fails every running or waiting sequence: the deployment is going to sleep.
    pub(crate) fn abort_all(&mut self) -> Vec<Emit> {
        let mut out = Vec::with_capacity(self.seqs.len());
        for s in std::mem::take(&mut self.seqs) {
            self.free(&s);
            out.push(Emit::Finished {
                request: s.request,
                reason: FinishReason::Aborted,
                tokens: s.generated,
            });
        }
        out
    }

    /// Ends every sequence still scheduled (the session closes under them).
    pub(crate) fn cancel_all(&mut self) -> Vec<Emit> {
        self.seqs
            .drain(..)
            .map(|s| Emit::Finished {
                request: s.request,
                reason: FinishReason::Cancelled,
                tokens: s.generated,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
