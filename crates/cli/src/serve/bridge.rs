//! Between the HTTP handlers and the engine: requests go into the engine's inbox, and the
//! engine's output sink routes each token and each request's end to the channel its handler
//! registered.

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

/// The events of one request, as [`Bridge::submit`] returns them.
#[derive(Debug)]
pub struct Events {
    /// The request's id.
    pub id: u64,
    rx: UnboundedReceiver<Event>,
    cancel: Cancel,
    finished: bool,
}

impl Events {
    /// The next event; `None` once the request finished or the engine stopped.
    pub async fn recv(&mut self) -> Option<Event> {
        let event = self.rx.recv().await;
        self.finished |= matches!(event, Some(Event::Finished { .. }) | None);
        event
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
    tx: UnboundedSender<Event>,
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
}

impl Bridge {
    /// A bridge that feeds `inbox` (the engine's) and records into `metrics`.
    pub fn new(inbox: Sender<Request>, metrics: Metrics) -> Self {
        let next_id = Arc::new(AtomicU64::new(0));
        Bridge {
            pending: Arc::default(),
            next_id,
            inbox,
            metrics,
            closed: Arc::default(),
            version: WeightVersion::default(),
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
        Ok(Events { id, rx, cancel, finished: false })
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
        text: &str,
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
            let text = text.to_owned();
            let _ = entry.tx.send(Event::Token { token, text, logprobs, version });
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
            let _ = entry.tx.send(Event::PromptLogprobs { start, tokens: tokens.to_vec() });
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
            let _ = entry.tx.send(Event::Finished { reason, tokens: tokens.to_vec() });
        }
        Ok(())
    }
}
