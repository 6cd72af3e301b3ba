//! `tpctl serve` on rank 0: an OpenAI-style HTTP API over the session engine.
//!
//! The engine ([`session::Leader::serve`]) keeps rank 0's main thread, as in `tpctl run`; the
//! HTTP server runs on a small tokio runtime in other threads. The two meet in the
//! `bridge`: handlers check and tokenize a request, register a channel for its results and
//! push it into the engine's inbox; the engine's output sink routes every token and the end
//! of each request back to that channel. Requests join the running batch at the next step
//! boundary (continuous batching).
//!
//! Nothing a client sends reaches the engine unchecked: prompts are token ids inside the
//! vocabulary, shorter than the context together with `max_tokens`, so a request can fail
//! only with a 4xx answer, never the session. A stop (SIGINT or SIGTERM, forwarded by the
//! launcher) ends the session at the next step boundary on every rank.
//!
//! With a sleep/wakeup coordinator, vLLM-style `POST /sleep`, `POST /wake_up` and
//! `GET /is_sleeping` put every rank's memory to sleep and back ([`crate::control::Controller`],
//! the same operations as the control socket). While the deployment sleeps, completion
//! requests wait for the wakeup (at most `[server] asleep_wait_timeout`, then 503 with
//! `Retry-After`), or get 503 at once with `[server] refuse_while_asleep`.

mod bridge;
mod http;
mod logprobs;
mod metrics;
mod tools;

use crate::spec::ServeSpec;
use anyhow::{bail, Context, Result};
use collectives::ParallelContext;
use session::{Decision, EngineOptions, Leader, ModelFactory, SessionConfig, SessionReport};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a stopping server has to write the answers in flight before the process exits.
const HTTP_FLUSH: Duration = Duration::from_secs(2);

pub(crate) use http::bearer_matches;
pub use http::BODY_LIMIT;

/// What rank 0 brings to the server: its engine parts and the model it loaded.
pub struct Rank0<'a> {
    /// Rank 0's process groups.
    pub ctx: ParallelContext,
    /// Builds the model shard of each session.
    pub factory: Box<dyn ModelFactory>,
    /// The model's tokenizer and chat template (the factory decodes with the same one).
    pub tokenizer: Arc<text::Tokenizer>,
    /// Engine deadlines.
    pub engine: EngineOptions,
    /// The model path, as the factory reads it.
    pub model: String,
    /// The model's configuration (vocabulary and context).
    pub config: &'a checkpoint::LlamaConfig,
    /// KV-cache tokens per sequence: with the model's context, the longest sequence.
    pub context_tokens: usize,
    /// The most requests in one step.
    pub max_num_seqs: u32,
    /// The gate the control plane quiesces the engine through.
    pub gate: Arc<session::Gate>,
    /// Stops the engine (Ctrl-C, `tpctl stop`).
    pub stop: session::StopHandle,
    /// The deployment's sleep/wakeup coordinator, for `/sleep`, `/wake_up`, `/is_sleeping`
    /// and the sleep metrics (`None`: those routes answer 503).
    pub control: Option<crate::control::Controller>,
    /// The grammar engine of structured outputs, the one the factory samples with (`None`:
    /// requests for them are refused).
    pub grammars: Option<text::GrammarEngine>,
    /// Rank 0's kernels, for the metrics of its CUDA graphs (`None`: the factory's default).
    pub compute: Option<tensor::kernels::Backend>,
}

/// Refuses to expose an API without a key: a listener outside loopback needs one.
///
/// # Errors
/// `listen` is not an address, or is not a loopback one and there is no key.
pub fn check_listen(listen: &str, has_key: bool) -> Result<SocketAddr> {
    let addr: SocketAddr = listen
        .parse()
        .with_context(|| format!("--listen `{listen}`: expected an address like 127.0.0.1:8000"))?;
    if !addr.ip().is_loopback() && !has_key {
        bail!(
            "--listen {addr} is reachable from other machines: give --api-key (or [server] api_key) to serve beyond loopback"
        );
    }
    Ok(addr)
}

/// Serves the HTTP API on rank 0 until a stop is requested.
///
/// # Errors
/// The address cannot be bound, the tokenizer cannot be built, or the engine fails (its own
/// failure or a peer's).
pub fn run(rank0: Rank0<'_>, spec: &ServeSpec) -> Result<()> {
    let addr = check_listen(&spec.listen, spec.api_key.is_some())?;
    let tokenizer = rank0.tokenizer.clone();
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("binding the HTTP API to {addr}"))?;
    listener.set_nonblocking(true).context("configuring the HTTP listener")?;
    let local = listener.local_addr().context("reading the HTTP listener's address")?;

    let metrics = metrics::Metrics::default();
    let (inbox_tx, inbox) = std::sync::mpsc::channel();
    let mut bridge = bridge::Bridge::new(inbox_tx, metrics.clone(), tokenizer.clone());
    if let Some(control) = &rank0.control {
        bridge = bridge.with_weight_version(control.coordinator().weight_version());
    }
    let ready = Arc::new(AtomicBool::new(false));
    let context = rank0.config.context_length.min(rank0.context_tokens);
    let api = http::Api::new(http::ApiParts {
        bridge: bridge.clone(),
        metrics: metrics.clone(),
        tokenizer,
        model_name: spec.model_name.clone(),
        checkpoint: rank0.model.clone(),
        vocab: rank0.config.vocab_size,
        context,
        api_key: spec.api_key.clone(),
        ready: ready.clone(),
        control: rank0.control.clone(),
        refuse_while_asleep: spec.refuse_while_asleep,
        asleep_wait: Duration::from_millis(spec.asleep_wait_ms),
        defaults: spec.defaults,
        grammars: rank0.grammars.clone(),
    });

    let mut leader = Leader::new(
        rank0.ctx,
        rank0.factory,
        Box::new(bridge.sink()),
        Box::new({
            let compute = rank0.compute.clone();
            let graphs = move || compute.as_ref().and_then(tensor::kernels::Backend::graph_stats);
            metrics.engine_sink(ready.clone()).with_graphs(graphs)
        }),
        rank0.engine,
    )?
    .with_gate(rank0.gate)
    .with_stop(rank0.stop);
    let stop = leader.stop_handle();
    crate::exit::stop_on_signal(stop.clone());
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let server_stop = stop.clone();
    let http_thread = std::thread::Builder::new()
        .name("http".into())
        .spawn(move || {
            if let Err(e) = http::serve(listener, api, shutdown_rx) {
                // Without its API the engine has no work left: stop every rank.
                eprintln!("error: the HTTP server stopped: {e:#}");
                server_stop.request_stop();
            }
        })
        .context("starting the HTTP server thread")?;
    println!(
        "tpctl serve: {} on http://{local} (POST /v1/completions, /v1/chat/completions, /sleep, /wake_up; GET /v1/models, /is_sleeping, /health, /metrics)",
        spec.model_name
    );

    // The decider is first asked once the session is open (every rank built its shard), then
    // once per idle tick; the metrics sink also marks the session ready at its first step.
    let mut decider = |_: &SessionReport| {
        ready.store(true, Ordering::SeqCst);
        if stop.is_requested() {
            Decision::Stop
        } else {
            Decision::KeepOpen
        }
    };
    let session =
        SessionConfig { max_batch: rank0.max_num_seqs, ..SessionConfig::new(rank0.model) };
    let result = leader.serve(session, &inbox, &mut decider);
    ready.store(false, Ordering::SeqCst);
    let _ = shutdown_tx.send(());
    drop(inbox);
    bridge.close_all();
    // The answers in flight end now (an error event for a stream the engine left unfinished):
    // let the server write them before the process goes, but not for long.
    let flushed = Instant::now() + HTTP_FLUSH;
    while !http_thread.is_finished() && Instant::now() < flushed {
        std::thread::sleep(Duration::from_millis(10));
    }
    if result.is_err() {
        crate::exit::abandon(leader);
    }
    result.context("serving")?;
    Ok(())
}

#[cfg(test)]
mod tests;
