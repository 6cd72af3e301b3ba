//! Between the HTTP handlers and the engine: requests go into the engine's inbox, and the
//! engine's output sink routes each token and each request's end to the channel its handler
//! registered. The sink passes token ids on; each handler decodes its own request's text as
//! it receives them ([`Events::recv`]), so detokenization runs on the HTTP runtime's threads,
//! never on the engine's.

use super::metrics::{Metrics, RequestTimes};
use session::sleep::WeightVersion;
use session::{
    BoxError, Cancel, FinishReason, OutputSink, RankedLogprobs, Request, SamplingParams,
    TokenLogprobs,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use text::tokenizer::TextStream;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// What the engine produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token and its decoded piece.
    Token {
        /// The token id.
        token: u32,
        /// Its text (may be empty for a partial character).
        text: String,
        /// Its log-probabilities, when the request asked for them.
        logprobs: Option<TokenLogprobs>,
        /// The version of the weights that computed it.
        version: Arc<str>,
    },
    /// Log-probabilities of the prompt's tokens from position `start` on (each given the
    /// tokens before it), when the request asked for them; they come before its first token.
    PromptLogprobs {
        /// The prompt position of the first.
        start: u32,
        /// One per token.
        tokens: Vec<RankedLogprobs>,
    },
    /// The request ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Every generated token.
        tokens: Vec<u32>,
    },
}

/// What the engine's sink sends a request's handler: [`Event`]s, with token ids not yet
/// decoded.
#[derive(Debug)]
enum Sent {
    /// A new token; `last`: the request's final one (its end follows).
    Token { token: u32, last: bool, logprobs: Option<TokenLogprobs>, version: Arc<str> },
    /// Anything else, as the handler gets it.
    Event(Event),
}

/// The events of one request, as [`Bridge::submit`] returns them.
pub struct Events {
    /// The request's id.
    pub id: u64,
    rx: UnboundedReceiver<Sent>,
    cancel: Cancel,
    finished: bool,
    /// Decodes the request's tokens.
    tokenizer: Arc<text::Tokenizer>,
    text: TextStream,
    /// Where the time spent decoding is counted.
    metrics: Metrics,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Events {
    /// The next event, a token with the text it adds (in whole characters; its final token
    /// flushes what is left); `None` once the request finished or the engine stopped.
    pub async fn recv(&mut self) -> Option<Event> {
        let event = match self.rx.recv().await {
            None => None,
            Some(Sent::Event(event)) => Some(event),
            Some(Sent::Token { token, last, logprobs, version }) => {
                // An id the tokenizer cannot decode (outside its vocabulary) adds no text.
                let since = Instant::now();
                let text =
                    self.tokenizer.decode_next(&mut self.text, token, last).unwrap_or_default();
                self.metrics.detokenized(since.elapsed());
                Some(Event::Token { token, text, logprobs, version })
            }
        };
        self.finished |= matches!(event, Some(Event::Finished { .. }) | None);
        event
    }

    /// The server's metrics, where a handler counts the time it spends on these events.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        if !self.finished {
            self.cancel.cancel();
        }
    }
}

/// The engine is gone (stopped or failed): nothing more is accepted.
#[derive(Debug, Clone, Copy)]
pub struct Closed;

struct Entry {
    tx: UnboundedSender<Sent>,
    /// When its HTTP request arrived: every interval the metrics take starts here.
    arrival: Instant,
    prompt_tokens: usize,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Entry {
    /// The request's times since its arrival, ending `now`.
    fn times(&self, now: Instant) -> RequestTimes {
        let since = |t: Option<Instant>| t.map(|t| t - self.arrival);
        RequestTimes {
            queued: since(self.scheduled),
            first_token: since(self.first_token),
            last_token: since(self.last_token),
            end: now - self.arrival,
        }
    }
}

/// Shared by every handler and the engine's output sink.
#[derive(Clone)]
pub struct Bridge {
    pending: Arc<Mutex<HashMap<u64, Entry>>>,
    next_id: Arc<AtomicU64>,
    inbox: Sender<Request>,
    metrics: Metrics,
    /// Set once the engine stopped: nothing more is taken, and `/health` says so.
    closed: Arc<AtomicBool>,
    /// The live weights' version, which every token is stamped with as the engine emits it
    /// (the coordinator changes it only while the engine is quiesced).
    version: WeightVersion,
    /// What each request's handler decodes its tokens with.
    tokenizer: Arc<text::Tokenizer>,
}

impl Bridge {
    /// A bridge that feeds `inbox` (the engine's) and records into `metrics`; handlers decode
    /// with `tokenizer`.
    pub fn new(inbox: Sender<Request>, metrics: Metrics, tokenizer: Arc<text::Tokenizer>) -> Self {
        let next_id = Arc::new(AtomicU64::new(0));
        Bridge {
            pending: Arc::default(),
            next_id,
            inbox,
            metrics,
            closed: Arc::default(),
            version: WeightVersion::default(),
            tokenizer,
        }
    }

    /// This bridge, stamping tokens with `version` (the coordinator's) instead of a version
    /// of its own that never changes.
    #[must_use]
    pub fn with_weight_version(mut self, version: WeightVersion) -> Self {
        self.version = version;
        self
    }

    /// The live weights' version.
    pub fn weight_version(&self) -> &WeightVersion {
        &self.version
    }

    /// Hands a checked request to the engine; its events arrive on the returned [`Events`],
    /// which end without [`Event::Finished`] only when the engine stops first. Dropping the
    /// `Events` before the end (the client went away) cancels the request. `arrival` (when its
    /// HTTP request came) starts the clock of its queue time, time to first token and latency.
    ///
    /// # Errors
    /// [`Closed`] when the engine no longer takes requests.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        arrival: Instant,
    ) -> Result<Events, Closed> {
        if self.is_closed() {
            return Err(Closed);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let prompt_tokens = prompt.len();
        let cancel = Cancel::default();
        // Registered before the engine can see the request, so no event is missed.
        let entry = Entry {
            tx,
            arrival,
            prompt_tokens,
            scheduled: None,
            first_token: None,
            last_token: None,
        };
        self.lock().insert(id, entry);
        let request = Request::tokens(id, prompt, params).with_cancel(cancel.clone());
        if self.inbox.send(request).is_err() {
            self.lock().remove(&id);
            return Err(Closed);
        }
        self.metrics.submitted(prompt_tokens);
        let tokenizer = self.tokenizer.clone();
        let metrics = self.metrics.clone();
        let text = TextStream::default();
        Ok(Events { id, rx, cancel, finished: false, tokenizer, text, metrics })
    }

    /// Closes every pending request's channel and takes no more (the engine stopped).
    pub fn close_all(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.lock().clear();
    }

    /// Whether the engine stopped ([`Bridge::close_all`]).
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// The engine's output sink.
    pub fn sink(&self) -> Sink {
        Sink(self.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Routes the engine's output to the handlers' channels.
pub struct Sink(Bridge);

impl OutputSink for Sink {
    fn token(
        &mut self,
        request: u64,
        token: u32,
        last: bool,
        logprobs: Option<&TokenLogprobs>,
    ) -> Result<(), BoxError> {
        let mut pending = self.0.lock();
        if let Some(entry) = pending.get_mut(&request) {
            let now = Instant::now();
            let previous = entry.last_token.replace(now);
            entry.first_token.get_or_insert(now);
            self.0.metrics.token(now - entry.arrival, previous.map(|p| now - p));
            // A client that went away still gets its request finished by the engine; its
            // tokens are dropped here.
            let logprobs = logprobs.cloned();
            let version = self.0.version.get();
            let _ = entry.tx.send(Sent::Token { token, last, logprobs, version });
        }
        Ok(())
    }

    fn scheduled(&mut self, request: u64) {
        if let Some(entry) = self.0.lock().get_mut(&request) {
            let now = Instant::now();
            entry.scheduled = Some(now);
            self.0.metrics.scheduled(now - entry.arrival);
        }
    }

    fn prompt_logprobs(
        &mut self,
        request: u64,
        start: u32,
        tokens: &[RankedLogprobs],
    ) -> Result<(), BoxError> {
        if let Some(entry) = self.0.lock().get(&request) {
            let tokens = tokens.to_vec();
            let _ = entry.tx.send(Sent::Event(Event::PromptLogprobs { start, tokens }));
        }
        Ok(())
    }

    fn finished(
        &mut self,
        request: u64,
        reason: FinishReason,
        tokens: &[u32],
    ) -> Result<(), BoxError> {
        let entry = self.0.lock().remove(&request);
        if let Some(entry) = entry {
            let times = entry.times(Instant::now());
            self.0.metrics.finished(reason, entry.prompt_tokens, tokens.len(), times);
            let tokens = tokens.to_vec();
            let _ = entry.tx.send(Sent::Event(Event::Finished { reason, tokens }));
        }
        Ok(())
    }
}
