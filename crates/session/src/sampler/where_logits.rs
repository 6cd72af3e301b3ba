//! How a step's tokens are picked where its logits are made, without bringing them to the
//! host: the paths a model runner can take (greedy picks, a few candidates per row, draws
//! over whole rows, or a mix of the last two), each chosen alike on every rank, and the picks
//! from what the runner brings back. Each gives the tokens [`Samplers::pick`] picks from the
//! rows' logits.

use super::{SampleError, Samplers, SamplingParams, SeqSampler, TokenLogprobs};
use crate::model::{SampledToken, StepOutput};
use crate::plan::StepPlan;
use tensor::kernels::{Draw, Normalizer, TopK, DRAW_MAX_COLUMNS, TOP_K_MAX};

/// What a model runner finds where the logits are for a step whose samplers want their
/// tokens' log-probabilities ([`Samplers::scored`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scoring {
    /// The candidates per row to find for the samplers that keep a few tokens (as
    /// [`Samplers::mixed`] counts them); `None` when no sampled entry keeps a few.
    pub candidates: Option<usize>,
    /// The most likely tokens per row of the raw logits to find for the log-probabilities'
    /// alternatives: the most any sampled entry asks for (0: the token's own only).
    pub top: usize,
}

/// Whether a sampler draws from a few candidates of its row (a temperature and a top-k below
/// [`TOP_K_MAX`]) rather than from its whole row or greedily.
fn keeps_candidates(p: &SamplingParams) -> bool {
    p.temperature > 0.0 && (1..TOP_K_MAX).contains(&p.top_k)
}

impl Samplers {
    /// Whether every token `plan` samples is its logits row's argmax and nothing else is
    /// wanted of the logits (greedy, no log-probabilities or grammar, no prompt scored;
    /// penalties and a bias are edits the runner applies first, [`Samplers::edits`]): a
    /// model runner can then find the tokens without moving the logits. Every rank answers
    /// the same (after [`Samplers::admit`] with `plan`): it decides collectives.
    pub fn argmax_only(&self, plan: &StepPlan) -> bool {
        self.every_sampled(plan, |s| s.sampler.params().temperature <= 0.0)
    }

    /// Whether every entry of `plan` wants only its sampled token of the logits (no prompt
    /// scored) and every sampled one's sequence is [`SeqSampler::token_only`] and `ok`.
    fn every_sampled(&self, plan: &StepPlan, ok: impl Fn(&SeqSampler) -> bool) -> bool {
        plan.entries.iter().all(|e| {
            let s = self.seqs.get(&e.seq);
            !self.every_row(e) && (!e.sample || s.is_some_and(|s| s.token_only() && ok(s)))
        })
    }

    /// The candidates per row a model runner must find for [`Samplers::pick_candidates`] to
    /// pick every token `plan` samples, when that is enough: every sampled entry keeps fewer
    /// than [`TOP_K_MAX`] tokens (greedy keeps 1, sampling its `top_k`) and nothing else is
    /// wanted of the logits (no log-probabilities or grammar, no prompt scored; penalties and
    /// a bias are edits the runner applies first, [`Samplers::edits`]); `None` otherwise.
    /// One more than the most any entry keeps: a row that gives fewer has no more numbers,
    /// which changes the order its sampler weighs them in (see
    /// [`super::Sampler::sample_candidates`]). The runner then moves a few candidates per
    /// row, not the logits. Every rank answers the same (after [`Samplers::admit`] with `plan`): it decides
    /// collectives.
    pub fn candidates(&self, plan: &StepPlan) -> Option<usize> {
        let mut most = 1;
        for e in &plan.entries {
            if self.every_row(e) {
                return None;
            }
            if !e.sample {
                continue;
            }
            let s = self.seqs.get(&e.seq).filter(|s| s.token_only())?;
            let p = s.sampler.params();
            let keep = match (p.temperature <= 0.0, p.top_k) {
                (true, _) => 1,
                (false, k @ 1..TOP_K_MAX) => k,
                (false, _) => return None,
            };
            most = most.max(keep);
        }
        Some(most + 1)
    }

    /// Whether the model runner can draw every token `plan` samples where the logits are,
    /// from rows of `vocab` logits ([`Samplers::draws`]): every sampled entry is greedy or
    /// draws from its whole row (a temperature, perhaps min-p and top-p, no top-k) and
    /// nothing else is wanted of the logits (no log-probabilities or grammar, no prompt
    /// scored; penalties and a bias are edits the runner applies first,
    /// [`Samplers::edits`]). Every rank answers the same (after [`Samplers::admit`] with
    /// `plan`).
    pub fn drawable(&self, plan: &StepPlan, vocab: usize) -> bool {
        vocab <= DRAW_MAX_COLUMNS
            && self.every_sampled(plan, |s| {
                let p = s.sampler.params();
                p.temperature <= 0.0 || p.top_k == 0
            })
    }

    /// The draws of the tokens `plan` samples, in plan order, for the backend's
    /// `sample_rows` (when [`Samplers::drawable`] or [`Samplers::mixed`]): each sequence
    /// that weighs its whole row (or is greedy) takes its next number, as [`Samplers::pick`]
    /// would take it, so the tokens are those [`Samplers::pick`] picks from the same rows; one
    /// that keeps a few tokens (a mixed step's) gets a greedy draw that takes no number (its
    /// token comes from its candidates, after its own draw there).
    ///
    /// # Errors
    /// [`SampleError::Unknown`] for a sampled sequence that never had parameters.
    pub fn draws(&mut self, plan: &StepPlan) -> Result<Vec<Draw>, SampleError> {
        let step = plan.step;
        plan.sampled()
            .map(|e| {
                let s =
                    self.seqs.get_mut(&e.seq).ok_or(SampleError::Unknown { seq: e.seq, step })?;
                Ok(if keeps_candidates(s.sampler.params()) {
                    Draw { temperature: 0.0, min_p: 0.0, u: 0.0, top_p: 1.0 }
                } else {
                    s.sampler.next_draw()
                })
            })
            .collect()
    }

    /// For a step whose sampled entries mix the two kinds above (some keep a few tokens, the
    /// others weigh their whole row or are greedy), the candidates per row a model runner must
    /// find besides drawing every row where the logits are (from rows of `vocab` logits):
    /// one more than the most any entry keeps, when every sampled entry is one kind or the
    /// other and nothing else is wanted of the logits; `None` otherwise. The runner then finds
    /// the candidates of every row and draws every row with [`Samplers::draws`], and
    /// [`Samplers::pick_mixed`] takes each row's token from the kind it is. Every rank
    /// answers the same (after [`Samplers::admit`] with `plan`).
    pub fn mixed(&self, plan: &StepPlan, vocab: usize) -> Option<usize> {
        if vocab > DRAW_MAX_COLUMNS || !self.every_sampled(plan, |_| true) {
            return None;
        }
        let mut most = 1;
        for e in plan.sampled() {
            let p = self.seqs.get(&e.seq)?.sampler.params();
            if keeps_candidates(p) {
                most = most.max(p.top_k);
            } else if p.temperature > 0.0 && p.top_k != 0 {
                return None;
            }
        }
        Some(most + 1)
    }

    /// For a step where some sampled entries want their tokens' log-probabilities, what a
    /// model runner finds where the logits are so that only a few numbers per row move: each
    /// row's [`Normalizer`] and its [`Scoring::top`] most likely tokens, both of the logits
    /// before the edits (the log-probabilities are the model's own), then, from the edited
    /// logits, every row drawn with [`Samplers::draws`] and, when some entry keeps a few
    /// tokens, the [`Scoring::candidates`] of every row; after the picks
    /// ([`Samplers::pick_scored`]), each picked token's logit before the edits. `None` when
    /// no sampled entry wants log-probabilities, when an entry wants more than
    /// [`TOP_K_MAX`] alternatives or something else of the logits (a grammar, a scored
    /// prompt), when a sampler keeps a cut of its row other than a few tokens, or over
    /// [`DRAW_MAX_COLUMNS`] columns. Every rank answers the same (after [`Samplers::admit`]
    /// with `plan`).
    pub fn scored(&self, plan: &StepPlan, vocab: usize) -> Option<Scoring> {
        if vocab > DRAW_MAX_COLUMNS || plan.entries.iter().any(|e| self.every_row(e)) {
            return None;
        }
        let (mut top, mut candidates) = (None, None);
        for e in plan.sampled() {
            let s = self.seqs.get(&e.seq)?;
            let p = s.sampler.params();
            if p.constraint.is_some() || s.prompt_top.is_some() {
                return None;
            }
            if let Some(n) = p.logprobs {
                if n > TOP_K_MAX {
                    return None;
                }
                top = Some(top.map_or(n, |t: usize| t.max(n)));
            }
            if keeps_candidates(p) {
                candidates = Some(candidates.map_or(p.top_k, |k: usize| k.max(p.top_k)));
            } else if p.temperature > 0.0 && p.top_k != 0 {
                return None;
            }
        }
        top.map(|top| Scoring { candidates: candidates.map(|k| k + 1), top })
    }

    /// Picks one token per sampled entry of a step [`Samplers::scored`] allows, in plan
    /// order: from its row's candidates in `top` (found as [`Scoring::candidates`] asked) for
    /// an entry that keeps a few tokens, else the token drawn where the logits are (`drawn`,
    /// after [`Samplers::draws`]'s draws). The log-probabilities come after, with the picked
    /// tokens' logits ([`Samplers::score_picks`]).
    ///
    /// # Errors
    /// As [`Samplers::pick_mixed`].
    pub fn pick_scored(
        &mut self,
        plan: &StepPlan,
        top: Option<&TopK>,
        drawn: &[u32],
    ) -> Result<StepOutput, SampleError> {
        if let Some(top) = top {
            return self.pick_mixed(plan, top, drawn);
        }
        let sampled = plan.sampled().count();
        if drawn.len() != sampled {
            return Err(SampleError::Candidates { rows: drawn.len(), sampled });
        }
        Ok(drawn.iter().map(|&token| SampledToken { token, logprobs: None }).collect())
    }

    /// Gives each picked token of a [`Samplers::scored`] step whose request wants them its
    /// log-probabilities, from its row's `normalizers`, the row's most likely tokens in
    /// `best` (of the logits before the edits) and each picked token's logit before the edits
    /// (`own`, one per sampled entry): what [`Samplers::pick`] gives from the rows' logits.
    ///
    /// # Errors
    /// [`SampleError::Candidates`] when a part holds another number of rows than the plan
    /// samples; [`SampleError::Unknown`] for a sampled sequence that never had parameters.
    pub fn score_picks(
        &self,
        plan: &StepPlan,
        picked: &mut StepOutput,
        normalizers: &[Normalizer],
        best: &TopK,
        own: &[f32],
    ) -> Result<(), SampleError> {
        let sampled = plan.sampled().count();
        let best_rows = if best.per_row() == 0 { sampled } else { best.rows() };
        for rows in [picked.len(), normalizers.len(), best_rows, own.len()] {
            if rows != sampled {
                return Err(SampleError::Candidates { rows, sampled });
            }
        }
        for (r, e) in plan.sampled().enumerate() {
            let step = plan.step;
            let s = self.seqs.get(&e.seq).ok_or(SampleError::Unknown { seq: e.seq, step })?;
            if let Some(n) = s.sampler.params().logprobs {
                let best = best.row(r);
                picked[r].logprobs =
                    Some(TokenLogprobs::from_parts(&normalizers[r], own[r], best, n));
            }
        }
        Ok(())
    }

    /// Picks one token per sampled entry of a step [`Samplers::mixed`] allows, in plan order:
    /// from its row's candidates in `top` for an entry that keeps a few tokens, else the token
    /// drawn where the logits are (`drawn`, after [`Samplers::draws`]'s draws). The
    /// tokens [`Samplers::pick`] picks from the rows' logits.
    ///
    /// # Errors
    /// [`SampleError::Candidates`] when `top` or `drawn` holds another number of rows than
    /// the plan samples; [`SampleError::Unknown`] for a sampled sequence that never had
    /// parameters.
    pub fn pick_mixed(
        &mut self,
        plan: &StepPlan,
        top: &TopK,
        drawn: &[u32],
    ) -> Result<StepOutput, SampleError> {
        let sampled = plan.sampled().count();
        for rows in [top.rows(), drawn.len()] {
            if rows != sampled {
                return Err(SampleError::Candidates { rows, sampled });
            }
        }
        let mut out = Vec::with_capacity(sampled);
        for (r, e) in plan.sampled().enumerate() {
            let step = plan.step;
            let s = self.seqs.get_mut(&e.seq).ok_or(SampleError::Unknown { seq: e.seq, step })?;
            let token = if keeps_candidates(s.sampler.params()) {
                s.sampler.sample_candidates(top.row(r))
            } else {
                drawn[r]
            };
            out.push(SampledToken { token, logprobs: None });
        }
        Ok(out)
    }

    /// Picks one token per sampled entry of `plan`, in plan order, from each row's candidates
    /// in `top` (found as [`Samplers::candidates`] asked): the tokens [`Samplers::pick`] picks
    /// from the rows' logits, after the same draws.
    ///
    /// # Errors
    /// [`SampleError::Candidates`] when `top` holds another number of rows than the plan
    /// samples; [`SampleError::Unknown`] for a sampled sequence that never had parameters.
    pub fn pick_candidates(
        &mut self,
        plan: &StepPlan,
        top: &TopK,
    ) -> Result<StepOutput, SampleError> {
        let sampled = plan.sampled().count();
        if top.rows() != sampled {
            return Err(SampleError::Candidates { rows: top.rows(), sampled });
        }
        let mut out = Vec::with_capacity(sampled);
        for (r, e) in plan.sampled().enumerate() {
            let step = plan.step;
            let s = self.seqs.get_mut(&e.seq).ok_or(SampleError::Unknown { seq: e.seq, step })?;
            let token = s.sampler.sample_candidates(top.row(r));
            out.push(SampledToken { token, logprobs: None });
        }
        Ok(out)
    }
}
