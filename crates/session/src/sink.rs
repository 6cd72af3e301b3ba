//! Rank 0's presentation parts: the tokenizer seam, the output sink and the metrics sink.
//! Workers own none of these; their constructors take none.

use crate::error::BoxError;
use crate::sampler::{RankedLogprobs, TokenLogprobs};
use std::sync::{Arc, Mutex};
use std::time::Duration;
pub use text::tokenizer::TextStream;

/// Text to tokens and back (rank 0 only).
pub trait TextCodec: Send {
    /// Token ids of `text`.
    ///
    /// # Errors
    /// Text the tokenizer cannot encode.
    fn encode(&self, text: &str) -> Result<Vec<u32>, BoxError>;
    /// Text of `ids`.
    ///
    /// # Errors
    /// Ids outside the vocabulary.
    fn decode(&self, ids: &[u32]) -> Result<String, BoxError>;
    /// The text `token` adds to a request whose earlier tokens `stream` has seen, in whole
    /// characters: a character split over several tokens comes out with the last of them.
    /// `last` (the request's final token) flushes what is left. The default decodes each
    /// token alone.
    ///
    /// # Errors
    /// As [`TextCodec::decode`].
    fn decode_next(
        &self,
        stream: &mut TextStream,
        token: u32,
        last: bool,
    ) -> Result<String, BoxError> {
        let _ = (stream, last);
        self.decode(&[token])
    }
    /// The end-of-sequence token, if the model has one.
    fn eos(&self) -> Option<u32>;
    /// Every token that ends a generation (a request that does not ignore them stops at
    /// any): [`TextCodec::eos`] and the model's others (an end-of-turn token). The default
    /// is the end-of-sequence token alone.
    fn eos_ids(&self) -> Vec<u32> {
        self.eos().into_iter().collect()
    }
}

/// The model's tokenizer as a [`TextCodec`].
pub struct TokenizerCodec(pub Arc<text::Tokenizer>);

impl TextCodec for TokenizerCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, BoxError> {
        Ok(self.0.encode(text)?)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, BoxError> {
        Ok(self.0.decode(ids, true)?)
    }

    fn decode_next(
        &self,
        stream: &mut TextStream,
        token: u32,
        last: bool,
    ) -> Result<String, BoxError> {
        Ok(self.0.decode_next(stream, token, last)?)
    }

    fn eos(&self) -> Option<u32> {
        self.0.eos_id()
    }

    fn eos_ids(&self) -> Vec<u32> {
        self.0.eos_ids()
    }
}

/// The text of several requests' tokens as they come, in whole characters: what a sink that
/// shows text keeps beside the engine, which hands out token ids only.
pub struct Detokenizer {
    codec: Box<dyn TextCodec>,
    streams: std::collections::HashMap<u64, TextStream>,
}

impl Detokenizer {
    /// Decodes with `codec`.
    pub fn new(codec: Box<dyn TextCodec>) -> Self {
        Detokenizer { codec, streams: std::collections::HashMap::new() }
    }

    /// The text `token` adds to `request` ([`TextCodec::decode_next`]); `last` (its final
    /// token) flushes what is left and forgets the request.
    ///
    /// # Errors
    /// As [`TextCodec::decode_next`].
    pub fn piece(&mut self, request: u64, token: u32, last: bool) -> Result<String, BoxError> {
        let stream = self.streams.entry(request).or_default();
        let text = self.codec.decode_next(stream, token, last);
        if last {
            self.streams.remove(&request);
        }
        text
    }

    /// Forgets `request` (it ended without a last token: cancelled, say).
    pub fn forget(&mut self, request: u64) {
        self.streams.remove(&request);
    }
}

impl std::fmt::Debug for Detokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detokenizer").field("requests", &self.streams.len()).finish_non_exhaustive()
    }
}

/// Why a request stopped producing tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced `max_tokens` tokens or filled the model's context.
    Length,
    /// It produced a stop token.
    StopToken,
    /// The session stopped or closed before the request finished.
    Cancelled,
    /// The request was refused (an empty prompt).
    Rejected,
    /// A sleep with mode `abort` failed it: the deployment is going to sleep.
    Aborted,
}

impl FinishReason {
    /// A short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::StopToken => "stop",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Rejected => "rejected",
            FinishReason::Aborted => "abort",
        }
    }
}

/// Where rank 0 streams results. Only rank 0 owns one.
pub trait OutputSink: Send {
    /// A new token of request `request` (`last`: it is the request's final token, and
    /// [`OutputSink::finished`] follows; `logprobs`: when the request asked for them,
    /// [`SamplingParams::logprobs`]). The engine hands out ids only: a sink that shows text
    /// decodes them where it sends them ([`Detokenizer`]), so detokenization stays off the
    /// engine's thread when the sink passes tokens on (the server's does).
    ///
    /// # Errors
    /// The sink cannot take the token; the engine fails the step with this error.
    ///
    /// [`SamplingParams::logprobs`]: crate::SamplingParams::logprobs
    fn token(
        &mut self,
        request: u64,
        token: u32,
        last: bool,
        logprobs: Option<&TokenLogprobs>,
    ) -> Result<(), BoxError>;
    /// A session's model is built (weights loaded and in place, the KV pool committed) and
    /// its requests are about to be admitted: what a run measures per request (time to first
    /// token) starts here, not at the start-up before it. The default does nothing.
    fn opened(&mut self) {}
    /// Request `request`'s first step begins: it leaves the queue (vLLM's `SCHEDULED` event;
    /// the time from its arrival to here is its queue time). Called once per request, before
    /// its first token, and never for a request that finishes without a step. The default
    /// does nothing.
    fn scheduled(&mut self, request: u64) {
        let _ = request;
    }
    /// Log-probabilities of request `request`'s prompt tokens from position `start` on
    /// (each given the tokens before it; position 0 has none), when the request asked for
    /// them ([`SamplingParams::prompt_logprobs`]): every prompt position once, in order,
    /// before the request's first token. The default drops them.
    ///
    /// # Errors
    /// As [`OutputSink::token`].
    ///
    /// [`SamplingParams::prompt_logprobs`]: crate::SamplingParams::prompt_logprobs
    fn prompt_logprobs(
        &mut self,
        request: u64,
        start: u32,
        tokens: &[RankedLogprobs],
    ) -> Result<(), BoxError> {
        let _ = (request, start, tokens);
        Ok(())
    }
    /// Request `request` finished with all its `tokens`.
    ///
    /// # Errors
    /// As [`OutputSink::token`].
    fn finished(
        &mut self,
        request: u64,
        reason: FinishReason,
        tokens: &[u32],
    ) -> Result<(), BoxError>;
}

/// One step's numbers, from rank 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepMetrics {
    /// The session.
    pub epoch: u64,
    /// The step.
    pub step: u64,
    /// Sequences in the step.
    pub batch: usize,
    /// Prompt tokens in the step.
    pub prefill_tokens: usize,
    /// Decode tokens in the step.
    pub decode_tokens: usize,
    /// Time in the step agreement (admission, plan, confirmation).
    pub agreement: Duration,
    /// Time in the model.
    pub model: Duration,
    /// Requests with tokens in the KV cache after the step.
    pub running: usize,
    /// Requests waiting for room (or to recompute after a preemption) after the step.
    pub waiting: usize,
    /// Share of the paged KV pool's blocks held by requests (0 without a pool).
    pub kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache in this step.
    pub prefix_queries: u64,
    /// Prompt tokens found in the prefix cache (not computed again) in this step.
    pub prefix_hits: u64,
    /// Requests preempted in this step (their blocks freed; they recompute later).
    pub preemptions: u64,
    /// Where rank 0's time in the step went, phase by phase.
    pub phases: StepPhases,
}

/// Rank 0's time in one step by phase, in the order they run. `agreement` is
/// [`StepMetrics::agreement`] and `forward + sample + update` is [`StepMetrics::model`]; what
/// rank 0 does between steps besides `schedule` (idle waits for requests, the metrics sink)
/// is in none of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepPhases {
    /// Admitting the requests that arrived since the last step (encoding text prompts,
    /// queueing them) and the scheduler's plan of this step; waits for a request to arrive
    /// are not counted.
    pub schedule: Duration,
    /// The model's forward pass on rank 0 (its collectives included), less `sample`. A greedy
    /// step's argmax runs here, where the logits are made.
    pub forward: Duration,
    /// Sampling on the host after the logits came back ([`StepModel::sampling_time`]).
    ///
    /// [`StepModel::sampling_time`]: crate::StepModel::sampling_time
    pub sample: Duration,
    /// The scheduler taking the sampled tokens (stop tokens, lengths, finished requests,
    /// prompt log-probabilities).
    pub update: Duration,
    /// Handing the step's tokens and ends to the output sink.
    pub emit: Duration,
}

impl StepPhases {
    /// Each phase with its name (`schedule`, `forward`, `sample`, `update`, `emit`), in the
    /// order they run.
    pub fn named(&self) -> [(&'static str, Duration); 5] {
        [
            ("schedule", self.schedule),
            ("forward", self.forward),
            ("sample", self.sample),
            ("update", self.update),
            ("emit", self.emit),
        ]
    }
}

/// Where rank 0 records metrics. Only rank 0 owns one.
pub trait MetricsSink: Send {
    /// A step ran.
    fn step(&mut self, metrics: &StepMetrics);
    /// A session closed after `steps` steps.
    fn session_closed(&mut self, epoch: u64, steps: u64) {
        let _ = (epoch, steps);
    }
}

/// A metrics sink that drops everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoMetrics;

impl MetricsSink for NoMetrics {
    fn step(&mut self, _: &StepMetrics) {}
}

/// One finished request as [`Collect`] keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub request: u64,
    /// Why it finished.
    pub reason: FinishReason,
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// Their text, pieces concatenated.
    pub text: String,
}

/// Finished requests, and the text so far of running ones.
type Collected = (Vec<Finished>, std::collections::HashMap<u64, String>);

/// An output sink that keeps finished requests in memory, shared with whoever holds a clone.
#[derive(Debug, Default, Clone)]
pub struct Collect {
    inner: Arc<Mutex<Collected>>,
    /// Decodes their text (none: the text stays empty).
    text: Option<Arc<Mutex<Detokenizer>>>,
}

impl Collect {
    /// An empty collection, keeping no text.
    pub fn new() -> Self {
        Collect::default()
    }

    /// An empty collection that decodes each request's text with `codec`.
    pub fn decoding(codec: Box<dyn TextCodec>) -> Self {
        Collect { text: Some(Arc::new(Mutex::new(Detokenizer::new(codec)))), ..Collect::default() }
    }

    /// The requests finished so far, in finishing order.
    pub fn finished(&self) -> Vec<Finished> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0.clone()
    }
}

impl OutputSink for Collect {
    fn token(
        &mut self,
        request: u64,
        token: u32,
        last: bool,
        _logprobs: Option<&TokenLogprobs>,
    ) -> Result<(), BoxError> {
        let piece = match &self.text {
            Some(text) => {
                text.lock().unwrap_or_else(|e| e.into_inner()).piece(request, token, last)?
            }
            None => String::new(),
        };
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.1.entry(request).or_default().push_str(&piece);
        Ok(())
    }

    fn finished(
        &mut self,
        request: u64,
        reason: FinishReason,
        tokens: &[u32],
    ) -> Result<(), BoxError> {
        if let Some(text) = &self.text {
            text.lock().unwrap_or_else(|e| e.into_inner()).forget(request);
        }
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let text = g.1.remove(&request).unwrap_or_default();
        g.0.push(Finished { request, reason, tokens: tokens.to_vec(), text });
        Ok(())
    }
}
