//! Rank 0's continuous-batching scheduler: requests join at step boundaries, running sequences
//! decode one token per step next to prompt chunks of new ones, within a token budget.

use crate::error::{BoxError, Error, Result};
use crate::plan::{PlanEntry, SeqId, StepPlan};
use crate::sampler::{Sampler, SamplingParams, TokenLogprobs};
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
    sampler: Sampler,
    stop: Vec<u32>,
    cancel: Option<Cancel>,
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
        let limit = self.prompt.len() + self.sampler.params().max_tokens as usize;
        u32::try_from(limit.min(context)).unwrap_or(u32::MAX)
    }

    fn decoding(&self) -> bool {
        self.prefilled == self.context()
    }

    /// Token `i` of the sequence: the prompt, then the generated tokens.
    fn token(&self, i: usize) -> u32 {
        match i.checked_sub(self.prompt.len()) {
            None => self.prompt[i],
            Some(g) => self.generated[g],
        }
    }
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
        }
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
        if !req.params.ignore_eos {
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
            sampler: Sampler::new(req.params),
            stop,
            cancel: req.cancel,
        });
        Ok(None)
    }

    /// The next step: decode tokens of running sequences first, then prompt chunks of waiting
    /// ones, within the token budget and batch size. `None` when nothing can run.
    pub(crate) fn plan(&mut self, epoch: u64, step: u64) -> Option<StepPlan> {
        let mut budget = self.budget;
        let mut entries = Vec::new();
        for s in self.seqs.iter().filter(|s| s.decoding()) {
            if budget == 0 || entries.len() == self.max_batch {
                break;
            }
            let last = *s.generated.last()?;
            let (start, reserve) = (s.prefilled as u32, s.reserve(self.context));
            entries.push(PlanEntry { seq: s.id, start, tokens: vec![last], sample: true, reserve });
            budget -= 1;
        }
        for s in self.seqs.iter().filter(|s| !s.decoding()) {
            if budget == 0 || entries.len() == self.max_batch {
                break;
            }
            let chunk = (s.context() - s.prefilled).min(budget);
            let tokens = (s.prefilled..s.prefilled + chunk).map(|i| s.token(i)).collect();
            // A recomputed sequence already sampled its next token.
            let sample = s.prefilled + chunk == s.context() && s.generated.is_empty();
            let (start, reserve) = (s.prefilled as u32, s.reserve(self.context));
            entries.push(PlanEntry { seq: s.id, start, tokens, sample, reserve });
            budget -= chunk;
        }
        if entries.is_empty() {
            return None;
        }
        Some(StepPlan { epoch, step, entries, released: std::mem::take(&mut self.released) })
    }

    /// Takes the results of `plan` (one logits row per sampled entry): samples, and finishes
    /// the sequences that reached a limit or a stop token.
    pub(crate) fn apply(
        &mut self,
        plan: &StepPlan,
        logits: &[Vec<f32>],
    ) -> std::result::Result<Vec<Emit>, String> {
        let sampled = plan.sampled().count();
        if logits.len() != sampled {
            return Err(format!(
                "the model returned {} logits rows for {sampled} sampled entries",
                logits.len()
            ));
        }
        let mut rows = logits.iter();
        let mut out = Vec::new();
        for e in &plan.entries {
            let Some(i) = self.seqs.iter().position(|s| s.id == e.seq) else {
                return Err(format!("sequence {} of the plan is not scheduled", e.seq));
            };
            let s = &mut self.seqs[i];
            s.prefilled += e.tokens.len();
            if !e.sample {
                continue;
            }
            let row = rows.next().ok_or("fewer logits rows than sampled entries")?;
            let token = s.sampler.sample_next(row, &s.prompt, &s.generated);
            let logprobs = s.sampler.logprobs(row, token);
            s.generated.push(token);
            out.push(Emit::Token { request: s.request, token, logprobs });
            let reason = if s.stop.contains(&token) {
                Some(FinishReason::StopToken)
            } else if s.generated.len() >= s.sampler.params().max_tokens as usize
                || s.prompt.len() + s.generated.len() >= self.context
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                let s = self.seqs.remove(i);
                self.released.push(s.id);
                out.push(Emit::Finished { request: s.request, reason, tokens: s.generated });
            }
        }
        Ok(out)
    }

    /// Ends the sequences whose request was cancelled; their caches are released with the
    /// next plan.
    pub(crate) fn take_cancelled(&mut self) -> Vec<Emit> {
        let mut out = Vec::new();
        let released = &mut self.released;
        self.seqs.retain_mut(|s| {
            if !s.cancel.as_ref().is_some_and(Cancel::is_cancelled) {
                return true;
            }
            released.push(s.id);
            out.push(Emit::Finished {
                request: s.request,
                reason: FinishReason::Cancelled,
                tokens: std::mem::take(&mut s.generated),
            });
            false
        });
        out
    }

    /// Makes every sequence prefill again from its tokens (prompt and generated) under a new
    /// id, the old one released: the KV cache it had is gone (a discarded cache after a
    /// sleep). The continuation is the same as without the interruption.
    pub(crate) fn recompute_all(&mut self) {
        for s in self.seqs.iter_mut().filter(|s| s.prefilled > 0) {
            self.released.push(s.id);
            s.id = self.next_seq;
            self.next_seq += 1;
            s.prefilled = 0;
        }
    }

    /// Fails every running or waiting sequence: the deployment is going to sleep.
    pub(crate) fn abort_all(&mut self) -> Vec<Emit> {
        let mut out = Vec::with_capacity(self.seqs.len());
        for s in self.seqs.drain(..) {
            self.released.push(s.id);
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
