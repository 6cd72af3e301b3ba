//! What the `layers` adapters share: the KV caches and samplers of a rank's sequences, and a
//! step's plan run as one batched forward pass of a [`ParallelModel`] over them, sampled where
//! the logits are.

use crate::error::BoxError;
use crate::model::{SampledToken, StepOutput};
use crate::plan::{PlanEntry, SeqId, StepPlan};
use crate::sampler::{PromptLogprobs, Samplers};
use layers::parallel::{Comms, ParallelCache, ParallelModel, Scored, Sequence};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tensor::kernels::TopK;

/// A model failure on one sequence; keeps the cause reachable through `source()`.
#[derive(Debug, thiserror::Error)]
#[error("sequence {seq}: {source}")]
pub(crate) struct SequenceError {
    seq: SeqId,
    source: BoxError,
}

/// A failure of a step's batched forward pass; keeps the cause (a collective that blames a
/// peer, say) reachable through `source()`.
#[derive(Debug, thiserror::Error)]
#[error("step {step} ({sequences} sequences, {tokens} tokens): {source}")]
pub(crate) struct StepError {
    step: u64,
    sequences: usize,
    tokens: usize,
    source: layers::Error,
}

/// The KV-cache shards of the sequences this rank holds, and their samplers where the logits
/// are.
#[derive(Debug, Default)]
pub(crate) struct Sequences {
    caches: HashMap<SeqId, ParallelCache>,
    samplers: Samplers,
    /// The prompt log-probabilities of the last step, until taken.
    prompt_logprobs: Vec<PromptLogprobs>,
    /// Time the last step spent in the samplers after its logits reached the host.
    sampling: Duration,
}

impl Sequences {
    /// Sequences held.
    pub(crate) fn len(&self) -> usize {
        self.caches.len()
    }

    /// The prompt log-probabilities the last [`Sequences::run`] computed, taken.
    pub(crate) fn take_prompt_logprobs(&mut self) -> Vec<PromptLogprobs> {
        std::mem::take(&mut self.prompt_logprobs)
    }

    /// Time the last [`Sequences::run`] spent sampling after its logits reached the host
    /// (zero for greedy steps: their argmax runs inside the forward pass).
    pub(crate) fn sampling_time(&self) -> Duration {
        self.sampling
    }

    /// Frees a sequence's cache and sampler.
    pub(crate) fn release(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
        self.samplers.release(seq);
    }

    /// Runs every entry of `plan` as one forward pass of `model`, each with its sequence's
    /// cache (made by `new_cache` for the sequence's first entry), after checking that the
    /// plan continues where each cache ends and that every entry fits. Returns the token of
    /// every entry that samples, in plan order, where the model delivers logits (TP 0, CP 0);
    /// there too, the prompt log-probabilities of the sequences that ask for them are kept
    /// for [`Sequences::take_prompt_logprobs`] (their entries' logits are computed for every
    /// token).
    pub(crate) fn run(
        &mut self,
        model: &ParallelModel,
        comms: &mut Comms<'_>,
        plan: &StepPlan,
        new_cache: impl FnMut(&PlanEntry) -> Result<ParallelCache, BoxError>,
    ) -> Result<Option<StepOutput>, BoxError> {
        let mut taken = Vec::with_capacity(plan.entries.len());
        self.samplers.admit(plan);
        let every: Vec<bool> = plan.entries.iter().map(|e| self.samplers.every_row(e)).collect();
        // Greedy picks only: the runner finds them where the logits are made, without moving
        // the logits (each TP rank sends its best value and id).
        let argmax = self.samplers.argmax_only(plan);
        // Else, samplers that keep a few tokens each: the runner finds the candidates where the
        // logits are made, and only those move (each TP rank sends its own best).
        let candidates = (!argmax).then(|| self.samplers.candidates(plan)).flatten();
        // Else, samplers that weigh every token: the runner draws where the logits are, with
        // each sequence's next number (taken here, on every rank alike).
        let vocab = model.config().vocab_size;
        let draws = if !argmax && candidates.is_none() && self.samplers.drawable(plan, vocab) {
            Some(self.samplers.draws(plan).map_err(BoxError::from)?)
        } else {
            None
        };
        // Else, a mix of the two: the runner finds every row's candidates and draws every row
        // where the logits are, and each row's token comes from its kind.
        let mixed = if !argmax && candidates.is_none() && draws.is_none() {
            match self.samplers.mixed(plan, vocab) {
                Some(k) => Some((k, self.samplers.draws(plan).map_err(BoxError::from)?)),
                None => None,
            }
        } else {
            None
        };
        // Else, samplers that want their tokens' log-probabilities (and draw as the two
        // kinds above do): the runner finds each row's normalizer and most likely tokens
        // before the edits, draws (and finds candidates) after them, and after the picks
        // reads each picked token's logit where the logits are.
        let picked_otherwise = argmax || candidates.is_some() || draws.is_some() || mixed.is_some();
        let scored = match self.samplers.scored(plan, vocab).filter(|_| !picked_otherwise) {
            Some(how) => Some((how, self.samplers.draws(plan).map_err(BoxError::from)?)),
            None => None,
        };
        // What each sampled entry's penalties and bias change in its logits, applied where
        // they are (every rank alike; the host path applies them itself).
        let edits = self.samplers.edits(plan);
        let took = self.take(model, plan, new_cache, &mut taken);
        let samplers = &mut self.samplers;
        let mut forward = |taken: &mut Vec<(SeqId, ParallelCache)>| {
            let mut seqs: Vec<Sequence<'_>> = taken
                .iter_mut()
                .zip(plan.entries.iter().zip(&every).zip(&edits))
                .map(|((_, cache), ((e, &every_row), edits))| Sequence {
                    tokens: &e.tokens,
                    cache,
                    sample: e.sample,
                    every_row,
                    edits,
                })
                .collect();
            let out = if argmax {
                model.forward_batch_argmax(comms, &mut seqs).map(|ids| ids.map(Picked::Ids))
            } else if let Some(k) = candidates {
                model.forward_batch_top_k(comms, &mut seqs, k).map(|top| top.map(Picked::Top))
            } else if let Some(draws) = &draws {
                model.forward_batch_sample(comms, &mut seqs, draws).map(|ids| ids.map(Picked::Ids))
            } else if let Some((k, draws)) = &mixed {
                model
                    .forward_batch_top_k_and_sample(comms, &mut seqs, *k, draws)
                    .map(|both| both.map(|(top, ids)| Picked::Mixed(top, ids)))
            } else if let Some((how, draws)) = &scored {
                model
                    .forward_batch_scored(comms, &mut seqs, how.candidates, draws, how.top)
                    .map(|scored| scored.map(Picked::Scored))
            } else {
                // The logits come to the host here, so a failed copy is this step's error.
                model.forward_batch(comms, &mut seqs).and_then(|logits| {
                    let host = logits.map(|l| l.into_host_vec().map(Picked::Logits));
                    Ok(host.transpose()?)
                })
            };
            out.map_err(|source| {
                let error = StepError {
                    step: plan.step,
                    sequences: plan.entries.len(),
                    tokens: plan.tokens(),
                    source,
                };
                BoxError::from(error)
            })
        };
        let out = took.and_then(|()| {
            if !samplers.masks(plan) {
                return forward(&mut taken);
            }
            // The grammars' token masks are computed while the forward pass runs, not after.
            std::thread::scope(|scope| {
                let masking = scope.spawn(|| samplers.mask(plan));
                let out = forward(&mut taken);
                masking.join().map_err(|_| BoxError::from("computing the token masks panicked"))?;
                out
            })
        });
        self.caches.extend(taken);
        let out = out?;
        let samplers = &mut self.samplers;
        let since = Instant::now();
        let sampled = out.map(|picked| -> Result<_, BoxError> {
            match picked {
                Picked::Logits(logits) => {
                    let vocab = model.config().vocab_size;
                    Ok(samplers.sample_with_prompts(plan, &logits, vocab)?)
                }
                Picked::Top(top) => Ok((samplers.pick_candidates(plan, &top)?, Vec::new())),
                Picked::Ids(ids) => {
                    let tokens =
                        ids.into_iter().map(|token| SampledToken { token, logprobs: None });
                    Ok((tokens.collect(), Vec::new()))
                }
                Picked::Mixed(top, ids) => Ok((samplers.pick_mixed(plan, &top, &ids)?, Vec::new())),
                Picked::Scored(scored) => {
                    let mut tokens =
                        samplers.pick_scored(plan, scored.top.as_ref(), &scored.drawn)?;
                    let picked: Vec<u32> = tokens.iter().map(|t| t.token).collect();
                    let own = model.logits_at(&scored.logits, &picked)?;
                    let (normalizers, best) = (&scored.normalizers, &scored.best);
                    samplers.score_picks(plan, &mut tokens, normalizers, best, &own)?;
                    Ok((tokens, Vec::new()))
                }
            }
        });
        self.samplers.end_step(plan);
        self.sampling = since.elapsed();
        let Some((tokens, prompts)) = sampled.transpose()? else { return Ok(None) };
        self.prompt_logprobs = prompts;
        Ok(Some(tokens))
    }

    /// Masks constrained sequences with grammars compiled by `engine` (given on the rank
    /// that samples).
    pub(crate) fn with_grammars(mut self, engine: text::GrammarEngine) -> Self {
        self.samplers = std::mem::take(&mut self.samplers).with_grammars(engine);
        self
    }

    /// Moves the caches of `plan`'s sequences into `taken`, in plan order, checking each.
    fn take(
        &mut self,
        model: &ParallelModel,
        plan: &StepPlan,
        mut new_cache: impl FnMut(&PlanEntry) -> Result<ParallelCache, BoxError>,
        taken: &mut Vec<(SeqId, ParallelCache)>,
    ) -> Result<(), BoxError> {
        for e in &plan.entries {
            let fail = |source: BoxError| SequenceError { seq: e.seq, source };
            if taken.iter().any(|(seq, _)| *seq == e.seq) {
                return Err(fail(format!("appears twice in step {}", plan.step).into()).into());
            }
            let (mut cache, new) = match self.caches.remove(&e.seq) {
                Some(cache) => (cache, false),
                None => (new_cache(e)?, true),
            };
            let grown = cache.extend_table(&e.blocks).and_then(|()| {
                // A new sequence that starts later begins with a cached prompt prefix.
                if new && e.start > 0 {
                    cache.assume_prefix(e.start as usize)
                } else {
                    Ok(())
                }
            });
            let held = cache.len();
            taken.push((e.seq, cache));
            grown.map_err(|err| fail(err.into()))?;
            if held != e.start as usize {
                let msg =
                    format!("holds {held} tokens but the plan starts at position {}", e.start);
                return Err(fail(msg.into()).into());
            }
            let cache = &taken[taken.len() - 1].1;
            model.check_room(cache, e.tokens.len()).map_err(|err| fail(err.into()))?;
        }
        Ok(())
    }
}

/// What a step's forward pass hands back on the rank that samples.
enum Picked {
    /// The logits of the wanted rows, on the host for the samplers.
    Logits(Vec<f32>),
    /// The tokens of the sampled entries, picked where the logits are (greedy, or drawn with
    /// each sequence's next number).
    Ids(Vec<u32>),
    /// The most likely tokens of each sampled entry's row, for samplers that keep a few.
    Top(TopK),
    /// Both, for a step that mixes those samplers with ones drawn where the logits are.
    Mixed(TopK, Vec<u32>),
    /// What a step whose samplers want log-probabilities found where the logits are.
    Scored(Scored),
}
