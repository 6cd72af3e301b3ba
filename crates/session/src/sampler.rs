//! The model runner's sampling: greedy, or temperature with top-k, top-p and min-p from a
//! seeded generator, after penalties and a logit bias. A request's `i`-th token takes the
//! `i`-th draw of its generator, so a seeded request produces the same tokens on every run,
//! in any batch and after a recompute.
//!
//! A row weighed whole (no top-k cut; top-p keeps the tokens at or above a threshold) is drawn
//! by [`tensor::kernels::draw_columns`], the definition the backends' `sample_rows` share, so a
//! GPU can draw it without sending the row to the host and give the same token.
//!
//! [`Samplers`] is what a [`StepModel`](crate::StepModel) samples with where its logits are:
//! each sequence's sampler arrives with its first plan entry ([`SeqSampling`]), and every
//! sampled entry leaves the model as a [`SampledToken`], never as a logits row. A constrained
//! sequence's (structured outputs) disallowed tokens are masked out first.

use crate::model::{SampledToken, StepOutput};
use crate::plan::{PlanEntry, SeqId, SeqSampling, StepPlan};
use std::collections::HashMap;
use tensor::kernels::{
    candidate_order, draw_columns, row_numbers, Draw, EditKind, LogitEdit, Normalizer,
};
use text::{GrammarEngine, GrammarMatcher};

/// How a request picks its tokens and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// The most tokens to generate.
    pub max_tokens: u32,
    /// 0 is greedy (argmax); above 0 divides the logits before the softmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 keeps all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (among
    /// the `top_k` kept; without `top_k`, every token as likely as the least likely kept one
    /// is kept too).
    pub top_p: f32,
    /// Seed of the request's generator.
    pub seed: u64,
    /// Tokens that end the request (kept in its output); the tokenizer's end-of-sequence
    /// token is added unless `ignore_eos`.
    pub stop: Vec<u32>,
    /// Whether to keep going past the end-of-sequence token.
    pub ignore_eos: bool,
    /// Subtracted from the logit of every token the request generated at least once
    /// (OpenAI's `presence_penalty`).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the request generated it (OpenAI's
    /// `frequency_penalty`).
    pub frequency_penalty: f32,
    /// Divides the positive logits (multiplies the negative ones) of every token in the
    /// prompt or the output (the Hugging Face / vLLM `repetition_penalty`; 1 changes nothing).
    pub repetition_penalty: f32,
    /// Keeps only tokens at least this fraction as likely as the most likely one (vLLM's
    /// `min_p`; 0 keeps all). Applies when sampling, not to greedy decoding.
    pub min_p: f32,
    /// Added to the logits of these tokens (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Report each generated token's log-probability and those of the `n` most likely
    /// tokens at its position (OpenAI's `logprobs` / `top_logprobs`); `None` computes none.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability given the tokens before it, its rank and
    /// those of the `n` most likely tokens at its position (vLLM's `prompt_logprobs`, OpenAI's
    /// `echo` with `logprobs`); `None` computes none. The model runner then computes the
    /// logits of every prompt position, and the scheduler does not reuse a cached prefix.
    pub prompt_logprobs: Option<usize>,
    /// The grammar the output must follow (structured outputs): tokens it does not allow are
    /// masked out before penalties, bias and temperature, and once it is complete only an
    /// end-of-sequence token may follow, which ends the request even with `ignore_eos`.
    /// `None` leaves the output free.
    pub constraint: Option<text::Grammar>,
}

impl SamplingParams {
    /// Whether any parameter changes the logits before the choice (then the runner needs the
    /// tokens a request saw).
    pub(crate) fn adjusts_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop: Vec::new(),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
        }
    }
}

/// A generated token's log-probability and the most likely alternatives at its position,
/// from the model's own distribution (the log-softmax of its logits, before temperature,
/// penalties, bias or truncation: vLLM's default, the numbers llama.cpp reports).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The generated token's log-probability.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first (ties by the
    /// lower id); as many as asked for.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// The log-probabilities of `token` and of the `top` most likely tokens in `logits`.
    /// NaN logits count as impossible. The row's log-normalizer is [`Normalizer`]'s, so a
    /// runner that finds it where the logits are gets the same bits
    /// ([`TokenLogprobs::from_parts`]).
    pub fn of(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
        let mut best: Vec<(f32, u32)> = row_numbers(logits).collect();
        let top = top.min(best.len());
        if top > 0 && top < best.len() {
            best.select_nth_unstable_by(top - 1, candidate_order);
        }
        best.truncate(top);
        best.sort_unstable_by(candidate_order);
        let own = logits.get(token as usize).copied().unwrap_or(f32::NAN);
        TokenLogprobs::from_parts(&Normalizer::of(logits), own, best.into_iter(), top)
    }

    /// The log-probabilities of a token whose logit is `own` (NaN: impossible) and of the
    /// first `top` of `best`, a row's most likely tokens in [`candidate_order`] (those of
    /// `tensor::Backend::top_k_rows`), given the row's `normalizer`: what
    /// [`TokenLogprobs::of`] gives for the row, from numbers found where the row is.
    pub fn from_parts(
        normalizer: &Normalizer,
        own: f32,
        best: impl Iterator<Item = (f32, u32)>,
        top: usize,
    ) -> TokenLogprobs {
        TokenLogprobs {
            logprob: normalizer.logprob(own),
            top: best.take(top).map(|(l, id)| (id, normalizer.logprob(l))).collect(),
        }
    }
}

/// A prompt token's log-probabilities and its rank in the distribution at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct RankedLogprobs {
    /// The token's log-probability and the most likely alternatives.
    pub logprobs: TokenLogprobs,
    /// 1 for the most likely token: one more than the tokens with a higher logit (vLLM's
    /// `rank`; NaN logits count as impossible).
    pub rank: u32,
}

impl RankedLogprobs {
    /// The log-probabilities of `token` and of the `top` most likely tokens in `logits`,
    /// with the token's rank.
    pub fn of(logits: &[f32], token: u32, top: usize) -> RankedLogprobs {
        let own = logits.get(token as usize).copied().filter(|l| !l.is_nan());
        let above = own.map_or(logits.len(), |own| logits.iter().filter(|&&l| l > own).count());
        RankedLogprobs {
            logprobs: TokenLogprobs::of(logits, token, top),
            rank: u32::try_from(above + 1).unwrap_or(u32::MAX),
        }
    }
}

/// The log-probabilities of a run of one sequence's prompt tokens, from a step's logits
/// (vLLM's prompt logprobs): token `start + i` of the sequence given the tokens before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobs {
    /// The sequence.
    pub seq: SeqId,
    /// The position of the first token scored (at least 1: the first token has none).
    pub start: u32,
    /// One per token from `start` on.
    pub tokens: Vec<RankedLogprobs>,
}

/// A request's sampler: its parameters and its generator's state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
    scratch: Vec<(f32, u32)>,
    /// The adjusted logits of a step, when a penalty or a bias applies.
    adjusted: Vec<f32>,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Sampler::resumed(params, 0)
    }

    /// A sampler seeded from `params.seed` whose generator already made `drawn` draws: the
    /// one that picked a request's first `drawn` tokens continues as this one.
    pub fn resumed(params: SamplingParams, drawn: u64) -> Self {
        let state = (params.seed ^ GOLDEN).wrapping_add(drawn.wrapping_mul(GOLDEN));
        Sampler { params, state, scratch: Vec::new(), adjusted: Vec::new() }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// A uniform number in `[0, 1)` (SplitMix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(GOLDEN);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks the next token of a request from its logits row, after the penalties of the
    /// tokens it has seen (`prompt`, and `generated` so far) and the logit bias.
    pub fn sample_next(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> u32 {
        if !self.params.adjusts_logits() {
            return self.sample(logits);
        }
        let mut adjusted = std::mem::take(&mut self.adjusted);
        adjusted.clear();
        adjusted.extend_from_slice(logits);
        self.adjust(&mut adjusted, prompt, generated);
        let token = self.sample(&adjusted);
        self.adjusted = adjusted;
        token
    }

    /// Applies the repetition, frequency and presence penalties, then the logit bias (the
    /// edits of [`Sampler::edits`], in order).
    fn adjust(&self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        for e in self.edits(prompt, generated) {
            if let Some(l) = logits.get_mut(e.token as usize) {
                *l = e.apply(*l);
            }
        }
    }

    /// The changes the penalties and the bias make to the logits of the token after `prompt`
    /// and `generated`, in the order they are made: the repetition penalty of every token
    /// seen, then the presence and frequency penalties of each token generated, then the
    /// bias. A model runner applies the same edits where the logits are
    /// (`tensor::Backend::edit_rows`) and gets the same bits.
    pub fn edits(&self, prompt: &[u32], generated: &[u32]) -> Vec<LogitEdit> {
        let p = &self.params;
        let mut out = Vec::new();
        if p.repetition_penalty != 1.0 {
            let mut seen: Vec<u32> = prompt.iter().chain(generated).copied().collect();
            seen.sort_unstable();
            seen.dedup();
            out.extend(seen.into_iter().map(|token| LogitEdit {
                token,
                kind: EditKind::Repetition,
                value: p.repetition_penalty,
            }));
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: Vec<u32> = generated.to_vec();
            counts.sort_unstable();
            out.extend(counts.chunk_by(|a, b| a == b).map(|run| LogitEdit {
                token: run[0],
                kind: EditKind::Subtract,
                value: p.presence_penalty + p.frequency_penalty * run.len() as f32,
            }));
        }
        out.extend(p.logit_bias.iter().map(|&(token, value)| LogitEdit {
            token,
            kind: EditKind::Add,
            value,
        }));
        out
    }

    /// The log-probabilities the request asked for (see [`SamplingParams::logprobs`]) of
    /// `token`, chosen from the model's `logits`.
    pub fn logprobs(&self, logits: &[f32], token: u32) -> Option<TokenLogprobs> {
        self.params.logprobs.map(|top| TokenLogprobs::of(logits, token, top))
    }

    /// Picks a token from one logits row. NaN logits are never picked; an all-NaN or empty
    /// row gives token 0. Sampling (a temperature above 0) takes one draw per token, even
    /// from such a row, so a request's `i`-th token always takes its `i`-th draw.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut cand = std::mem::take(&mut self.scratch);
        cand.clear();
        cand.extend(row_numbers(logits));
        let k = self.params.top_k;
        let in_row_order = if k > 0 && k < cand.len() {
            // Only the k best need ordering: a full sort of a 150k vocabulary costs milliseconds.
            cand.select_nth_unstable_by(k - 1, candidate_order);
            cand.truncate(k);
            cand.sort_unstable_by(candidate_order);
            false
        } else {
            // The whole row, in its order: `draw_columns` (top-p by a threshold, no sort).
            true
        };
        self.draw(cand, in_row_order)
    }

    /// Picks a token from a logits row's candidates: its non-NaN logits and their ids in
    /// [`candidate_order`], the row's best `n` of them for an `n` above `top_k` (above 1 for
    /// greedy decoding), or all of them where the row holds no more (then fewer than `n`
    /// came, which says the row's every number is here). The token
    /// [`Sampler::sample`] picks from the whole row, after the same draw: a sampler that keeps
    /// the `top_k` most likely tokens needs the row's `top_k` best, not the row (see
    /// [`Samplers::candidates`]).
    pub fn sample_candidates(&mut self, candidates: impl Iterator<Item = (f32, u32)>) -> u32 {
        let mut candidates = candidates;
        if self.params.temperature <= 0.0 {
            // The first candidate is the argmax: -0 and +0 tie, and the lower id leads.
            return candidates.next().map_or(0, |c| c.1);
        }
        let mut cand = std::mem::take(&mut self.scratch);
        cand.clear();
        cand.extend(candidates);
        let k = self.params.top_k;
        let in_row_order = if k > 0 && k < cand.len() {
            // The row holds more than k numbers (more candidates than k came).
            cand.truncate(k);
            false
        } else {
            // No more than k came: the row's every number, which `sample` draws in the row's
            // order.
            cand.sort_unstable_by_key(|c| c.1);
            true
        };
        self.draw(cand, in_row_order)
    }

    /// The next token's draw when it weighs every token of its row (see
    /// [`Samplers::draws`]): greedy takes no number from the generator, sampling its next.
    fn next_draw(&mut self) -> Draw {
        let p = &self.params;
        let (temperature, min_p, top_p) = (p.temperature, p.min_p, p.top_p);
        let u = if temperature > 0.0 { self.uniform() } else { 0.0 };
        Draw { temperature, min_p, u, top_p }
    }

    /// The draw over the candidates of a row (`sample`'s, in the order it weighs them):
    /// temperature, min-p and top-p, then one uniform number. A whole row in its order
    /// (`in_row_order`: no top-k cut) is drawn by [`draw_columns`], the definition the
    /// backends' `sample_rows` share, so the token is the same where the row was drawn; top-k
    /// candidates (in [`candidate_order`]) keep the smallest most likely run holding `top_p`.
    fn draw(&mut self, cand: Vec<(f32, u32)>, in_row_order: bool) -> u32 {
        if in_row_order {
            let p = &self.params;
            let (temperature, min_p, top_p) = (p.temperature, p.min_p, p.top_p);
            let d = Draw { temperature, min_p, u: self.uniform(), top_p };
            let token = draw_columns(&cand, &d);
            self.scratch = cand;
            return token;
        }
        if cand.is_empty() {
            self.uniform();
            self.scratch = cand;
            return 0;
        }
        // Without top-p the order of the candidates does not matter, only their weights.
        let t = f64::from(self.params.temperature);
        let top = cand.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
        // Relative to the most likely token's (1); min_p drops those below its fraction.
        let floor = f64::from(self.params.min_p);
        let weights: Vec<f64> = cand
            .iter()
            .map(|(l, _)| ((f64::from(*l) - f64::from(top)) / t).exp())
            .map(|w| if w >= floor { w } else { 0.0 })
            .collect();
        let total: f64 = weights.iter().sum();
        let mut keep = weights.len();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, w) in weights.iter().enumerate() {
                acc += w / total;
                if acc >= f64::from(self.params.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept: f64 = weights[..keep].iter().sum();
        let mut u = self.uniform() * kept;
        // Rounding can leave `u` past the end: the last kept token with weight takes it.
        let last = weights[..keep].iter().rposition(|w| *w > 0.0).unwrap_or(0);
        let mut pick = cand[last].1;
        for (w, (_, id)) in weights[..keep].iter().zip(&cand) {
            if u < *w {
                pick = *id;
                break;
            }
            u -= w;
        }
        self.scratch = cand;
        pick
    }
}

/// SplitMix64's increment (the golden ratio's fraction).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Why a model runner could not sample a step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SampleError {
    /// The logits do not match the plan's sampled entries.
    #[error("the model produced {values} logits for {sampled} sampled entries of {vocab} tokens")]
    Logits {
        /// Logits produced.
        values: usize,
        /// Entries sampled in the plan.
        sampled: usize,
        /// The vocabulary (a row's length).
        vocab: usize,
    },
    /// The candidates do not match the plan's sampled entries.
    #[error(
        "the model found candidates or drawn tokens for {rows} rows, for {sampled} sampled entries"
    )]
    Candidates {
        /// Rows of candidates found.
        rows: usize,
        /// Entries sampled in the plan.
        sampled: usize,
    },
    /// A constrained sequence reached a runner that has no grammar engine.
    #[error(
        "sequence {seq} is constrained by a grammar, but this model runner has no grammar engine"
    )]
    NoGrammarEngine {
        /// The sequence.
        seq: SeqId,
    },
    /// A sampled entry's sequence never had its sampling parameters in a plan.
    #[error(
        "sequence {seq} is sampled in step {step}, but no plan carried its sampling parameters"
    )]
    Unknown {
        /// The sequence.
        seq: SeqId,
        /// The step.
        step: u64,
    },
}

/// The samplers of the sequences a model runner holds (see the module docs). A runner calls
/// [`Samplers::sample`] on every step where it holds the logits (or its three parts,
/// [`Samplers::admit`], [`Samplers::mask`] while the forward pass runs, and
/// [`Samplers::pick`]), and [`Samplers::release`] for every released sequence.
///
/// A sequence with a [`SamplingParams::constraint`] is masked by its grammar's matcher, which
/// the [`GrammarEngine`] given with [`Samplers::with_grammars`] builds on its first masked
/// step (replaying the tokens it generated before a recompute).
#[derive(Debug, Default)]
pub struct Samplers {
    seqs: HashMap<SeqId, SeqSampler>,
    grammars: Option<GrammarEngine>,
}

/// One sequence's sampler, the tokens its penalties count, where its prompt
/// log-probabilities stand, and its grammar's state.
#[derive(Debug)]
struct SeqSampler {
    sampler: Sampler,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    /// Alternatives per prompt token while the prompt's log-probabilities are wanted: from
    /// the first entry until the first sampled one (a sequence that generated before, a
    /// recompute, scored its prompt then).
    prompt_top: Option<usize>,
    /// The last logits row of a prompt chunk that did not sample: the distribution of the
    /// next entry's first token.
    pending: Option<Vec<f32>>,
    constraint: Option<Constrained>,
    /// Its last entry sampled a token, which its next entry starts with: the token joins
    /// `generated` then, on every rank alike (see [`Samplers::admit`]).
    sampled_last: bool,
}

/// A constrained sequence's matcher and the mask of its next token.
#[derive(Debug, Default)]
struct Constrained {
    /// Built on the first masked step; `None` before, or after the engine failed.
    matcher: Option<GrammarMatcher>,
    /// Tokens to replay through the matcher when it is built.
    replay: Vec<u32>,
    /// The engine failed for this sequence: only its stop tokens are allowed from now on.
    failed: bool,
    /// The allowed tokens of the next step (a bitset), when computed.
    mask: Option<Vec<u32>>,
    /// The masked logits of a step.
    masked: Vec<f32>,
}

impl Constrained {
    /// Computes the mask of the next token (building and replaying the matcher first).
    fn prepare(&mut self, engine: &GrammarEngine, grammar: &text::Grammar, seq: SeqId) {
        if self.failed || self.mask.is_some() {
            return;
        }
        let result = (|| -> text::Result<Vec<u32>> {
            if self.matcher.is_none() {
                let mut m = engine.matcher(grammar)?;
                for &t in &std::mem::take(&mut self.replay) {
                    m.accept(t)?;
                }
                self.matcher = Some(m);
            }
            let m = self.matcher.as_mut().expect("built above");
            Ok(m.allowed()?.to_vec())
        })();
        match result {
            Ok(mask) => self.mask = Some(mask),
            Err(e) => self.fail(seq, &e),
        }
    }

    /// Gives up on the grammar: the sequence is ended by its stop tokens.
    fn fail(&mut self, seq: SeqId, e: &text::Error) {
        tracing::warn!("sequence {seq}: its grammar failed ({e}); ending it");
        self.failed = true;
        self.matcher = None;
    }

    /// `row` with the tokens the grammar does not allow at `-inf` (only the `stop` tokens,
    /// the end ids and the request's own, when it failed or allows nothing), in `self.masked`.
    fn apply(&mut self, row: &[f32], stop: [&[u32]; 2], seq: SeqId) -> &[f32] {
        self.masked.clear();
        self.masked.resize(row.len(), f32::NEG_INFINITY);
        let mut any = false;
        if let Some(mask) = self.mask.as_ref().filter(|_| !self.failed) {
            for (i, (out, &l)) in self.masked.iter_mut().zip(row).enumerate() {
                if mask.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1) {
                    *out = l;
                    any = true;
                }
            }
        }
        if !any {
            if !self.failed {
                tracing::warn!("sequence {seq}: its grammar allows no token; ending it");
                self.failed = true;
            }
            for &t in stop.into_iter().flatten() {
                if let (Some(out), Some(&l)) =
                    (self.masked.get_mut(t as usize), row.get(t as usize))
                {
                    *out = l;
                }
            }
        }
        &self.masked
    }

    /// Moves the matcher past `token`, the step's pick.
    fn accept(&mut self, token: u32, seq: SeqId) {
        self.mask = None;
        let Some(m) = self.matcher.as_mut().filter(|m| !m.is_finished()) else { return };
        if let Err(e) = m.accept(token) {
            self.fail(seq, &e);
        }
    }
}

impl SeqSampler {
    /// Whether the sequence wants nothing of its logits but its sampled token, picked after
    /// its penalties and bias ([`SeqSampler::edits`], which the model runner applies): no
    /// log-probabilities or grammar, and no prompt scored.
    fn token_only(&self) -> bool {
        let p = self.sampler.params();
        p.logprobs.is_none() && p.constraint.is_none() && self.prompt_top.is_none()
    }

    /// The edits of its next token's logits (see [`Sampler::edits`]).
    fn edits(&self) -> Vec<LogitEdit> {
        if !self.sampler.params().adjusts_logits() {
            return Vec::new();
        }
        self.sampler.edits(&self.prompt, &self.generated)
    }

    fn new(s: &SeqSampling) -> Self {
        let constraint = s
            .params
            .constraint
            .as_ref()
            .map(|_| Constrained { replay: s.generated.clone(), ..Constrained::default() });
        SeqSampler {
            sampler: Sampler::resumed(s.params.clone(), u64::from(s.drawn)),
            prompt: s.prompt.clone(),
            generated: s.generated.clone(),
            prompt_top: s.params.prompt_logprobs.filter(|_| s.drawn == 0),
            pending: None,
            constraint,
            sampled_last: false,
        }
    }
}

impl Samplers {
    /// No sequences.
    pub fn new() -> Self {
        Samplers::default()
    }

    /// Masks constrained sequences with grammars compiled by `engine` (the rank that samples
    /// gets one; without it a constrained sequence cannot be sampled).
    pub fn with_grammars(mut self, engine: GrammarEngine) -> Self {
        self.grammars = Some(engine);
        self
    }

    /// Sequences held.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no sequence is held.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Forgets a released sequence.
    pub fn release(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }

    /// Takes the sampling of the sequences that begin in `plan`, and the tokens the last step
    /// sampled (each continuing sequence's entry starts with its own) into the history its
    /// penalties count; calling it again for the same plan changes nothing (a sequence id
    /// begins once: a recompute takes a new one).
    pub fn admit(&mut self, plan: &StepPlan) {
        for e in &plan.entries {
            if let Some(s) = &e.sampling {
                self.seqs.entry(e.seq).or_insert_with(|| SeqSampler::new(s));
            } else if let Some(s) = self.seqs.get_mut(&e.seq) {
                if std::mem::take(&mut s.sampled_last) && s.sampler.params().adjusts_logits() {
                    s.generated.extend(e.tokens.first());
                }
            }
        }
    }

    /// Each entry of `plan`'s changes to its logits before its token is picked (its
    /// penalties and bias, [`Sampler::edits`]; none for an entry that does not sample), in
    /// plan order, for a model runner that picks where the logits are (after
    /// [`Samplers::admit`] with `plan`). Every rank gives the same (each TP rank edits its
    /// share of the vocabulary).
    pub fn edits(&self, plan: &StepPlan) -> Vec<Vec<LogitEdit>> {
        plan.entries
            .iter()
            .map(|e| match self.seqs.get(&e.seq) {
                Some(s) if e.sample => s.edits(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// Whether the model runner computes the logits of every token of `e`, not only of a
    /// sampled entry's last: its sequence's prompt log-probabilities are wanted (after
    /// [`Samplers::admit`] with its plan). Every rank must answer the same (it decides a CP
    /// exchange): each calls [`Samplers::end_step`] after every step.
    pub fn every_row(&self, e: &PlanEntry) -> bool {
        self.seqs.get(&e.seq).is_some_and(|s| s.prompt_top.is_some())
    }

    /// Ends a step on any rank, where the logits are or not: the sequences `plan` sampled
    /// have their prompts scored, and their later entries are single rows.
    pub fn end_step(&mut self, plan: &StepPlan) {
        for e in plan.sampled() {
            if let Some(s) = self.seqs.get_mut(&e.seq) {
                s.prompt_top = None;
                s.sampled_last = true;
            }
        }
    }

    /// Takes the sampling of the sequences that begin in `plan`, then picks one token per
    /// sampled entry, in plan order, from `logits`: the rows `[sampled, vocab]` of the
    /// sampled entries' last positions, row-major. Each token comes with its
    /// log-probabilities when its request asked for them. [`Samplers::admit`], then
    /// [`Samplers::mask`], then [`Samplers::pick`].
    ///
    /// # Errors
    /// As [`Samplers::pick`].
    pub fn sample(
        &mut self,
        plan: &StepPlan,
        logits: &[f32],
        vocab: usize,
    ) -> Result<StepOutput, SampleError> {
        self.admit(plan);
        self.mask(plan);
        self.pick(plan, logits, vocab)
    }

    /// Whether [`Samplers::mask`] has work in `plan`: a sampled entry of a constrained
    /// sequence, on the rank with the grammar engine.
    pub fn masks(&self, plan: &StepPlan) -> bool {
        self.grammars.is_some()
            && plan.sampled().any(|e| self.seqs.get(&e.seq).is_some_and(|s| s.constraint.is_some()))
    }

    /// Computes the token masks of `plan`'s constrained sampled entries (their grammars'
    /// matchers are built on the first one): the work a runner does while its forward pass
    /// runs. A grammar that fails ends its sequence (a warning in the log).
    pub fn mask(&mut self, plan: &StepPlan) {
        let Some(engine) = &self.grammars else { return };
        for e in plan.sampled() {
            let Some(s) = self.seqs.get_mut(&e.seq) else { continue };
            if let (Some(c), Some(grammar)) = (&mut s.constraint, &s.sampler.params.constraint) {
                c.prepare(engine, grammar, e.seq);
            }
        }
    }

    /// Picks one token per sampled entry of `plan` (see [`Samplers::sample`]), after the
    /// masks of the constrained ones ([`Samplers::mask`], computed here if not yet).
    /// Log-probabilities are the model's own, before the mask.
    ///
    /// # Errors
    /// [`SampleError::Logits`] when `logits` holds another number of rows than the plan
    /// samples; [`SampleError::Unknown`] for a sampled sequence that never had parameters;
    /// [`SampleError::NoGrammarEngine`] for a constrained sequence on a runner without one.
    pub fn pick(
        &mut self,
        plan: &StepPlan,
        logits: &[f32],
        vocab: usize,
    ) -> Result<StepOutput, SampleError> {
        let sampled = plan.sampled().count();
        if logits.len() != sampled * vocab || (vocab == 0 && sampled > 0) {
            return Err(SampleError::Logits { values: logits.len(), sampled, vocab });
        }
        let mut out = Vec::with_capacity(sampled);
        for (e, row) in plan.sampled().zip(logits.chunks_exact(vocab.max(1))) {
            out.push(self.pick_one(e, plan.step, row)?);
        }
        Ok(out)
    }

    /// As [`Samplers::sample`], with `logits` holding every row of the entries for which
    /// [`Samplers::every_row`] holds and the last row of the other sampled ones, in plan
    /// order; also returns the prompt log-probabilities those rows give.
    ///
    /// # Errors
    /// As [`Samplers::sample`].
    pub fn sample_with_prompts(
        &mut self,
        plan: &StepPlan,
        logits: &[f32],
        vocab: usize,
    ) -> Result<(StepOutput, Vec<PromptLogprobs>), SampleError> {
        self.admit(plan);
        let rows = |e: &PlanEntry| match (self.every_row(e), e.sample) {
            (true, _) => e.tokens.len(),
            (false, true) => 1,
            (false, false) => 0,
        };
        let wanted: Vec<usize> = plan.entries.iter().map(rows).collect();
        let sampled = plan.sampled().count();
        let total: usize = wanted.iter().sum();
        if logits.len() != total * vocab || (vocab == 0 && total > 0) {
            return Err(SampleError::Logits { values: logits.len(), sampled, vocab });
        }
        let (mut out, mut prompts) = (Vec::with_capacity(sampled), Vec::new());
        let mut rows = logits.chunks_exact(vocab.max(1));
        for (e, n) in plan.entries.iter().zip(wanted) {
            let mine: Vec<&[f32]> = rows.by_ref().take(n).collect();
            if self.every_row(e) {
                prompts.extend(self.score_prompt(e, plan.step, &mine)?);
            }
            if e.sample {
                let last = mine.last().copied().unwrap_or_default();
                out.push(self.pick_one(e, plan.step, last)?);
            }
        }
        Ok((out, prompts))
    }

    /// The prompt log-probabilities that entry `e`'s rows give (every row of it), keeping
    /// the last row of a chunk that does not sample for the next one's first token.
    fn score_prompt(
        &mut self,
        e: &PlanEntry,
        step: u64,
        rows: &[&[f32]],
    ) -> Result<Option<PromptLogprobs>, SampleError> {
        let s = self.seqs.get_mut(&e.seq).ok_or(SampleError::Unknown { seq: e.seq, step })?;
        let Some(top) = s.prompt_top else { return Ok(None) };
        let mut tokens = Vec::with_capacity(rows.len());
        let start = match s.pending.take() {
            Some(before) => {
                tokens.extend(e.tokens.first().map(|&t| RankedLogprobs::of(&before, t, top)));
                e.start
            }
            None => e.start + 1,
        };
        for (row, &next) in rows.iter().zip(e.tokens.iter().skip(1)) {
            tokens.push(RankedLogprobs::of(row, next, top));
        }
        if e.sample {
            // The last row picks the first generated token: the prompt is scored.
            s.prompt_top = None;
        } else {
            s.pending = rows.last().map(|r| r.to_vec());
        }
        Ok((!tokens.is_empty()).then_some(PromptLogprobs { seq: e.seq, start, tokens }))
    }

    /// Picks entry `e`'s next token from its last logits `row`.
    /// A constrained sequence's token is picked from the tokens its grammar allows.
    fn pick_one(
        &mut self,
        e: &PlanEntry,
        step: u64,
        row: &[f32],
    ) -> Result<SampledToken, SampleError> {
        let s = self.seqs.get_mut(&e.seq).ok_or(SampleError::Unknown { seq: e.seq, step })?;
        let token = match (&mut s.constraint, &s.sampler.params.constraint) {
            (Some(c), Some(grammar)) => {
                let engine =
                    self.grammars.as_ref().ok_or(SampleError::NoGrammarEngine { seq: e.seq })?;
                c.prepare(engine, grammar, e.seq);
                let stop = [engine.end_ids(), &s.sampler.params.stop];
                let masked = c.apply(row, stop, e.seq);
                let token = s.sampler.sample_next(masked, &s.prompt, &s.generated);
                c.accept(token, e.seq);
                token
            }
            _ => s.sampler.sample_next(row, &s.prompt, &s.generated),
        };
        let logprobs = s.sampler.logprobs(row, token);
        s.sampled_last = true;
        Ok(SampledToken { token, logprobs })
    }
}

/// The index of the largest logit, the lowest index on ties; NaN is never picked.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_nan() && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

mod where_logits;
pub use where_logits::Scoring;

#[cfg(test)]
mod tests;
