//! The HTTP API (OpenAI-style): `POST /v1/completions`, `POST /v1/chat/completions` (both
//! with SSE streaming), `GET /v1/models`, `GET /health` and `GET /metrics`; vLLM-style
//! `POST /sleep?level=1&tags=kv_cache,weights&mode=wait&verify=false`,
//! `POST /wake_up?tags=weights` (`&model=PATH`: from another checkpoint, after a level-2
//! sleep), `POST /update_weights?model=PATH&mode=wait` and `GET /is_sleeping`
//! (`{"is_sleeping": bool}`).
//!
//! `/sleep` and `/wake_up` block until every rank is done and answer the receipt (the
//! control socket's `op` object); a failure is 400 (a bad parameter) or 500 with the
//! aggregate error and its failing ranks. Without a coordinator they answer 503.
//!
//! A completion's `prompt` may be a list of prompts, each answered with `n` choices;
//! `echo` with `logprobs` and vLLM's `prompt_logprobs` score the prompt
//! ([`super::logprobs`]).
//!
//! Every failure a client causes is a 4xx answer with an OpenAI-style body
//! `{"error": {"message", "type", "code", "param"}}`; the engine only ever sees checked
//! token-id prompts.

use super::bridge::{Bridge, Closed};
use super::metrics::Metrics;
use crate::control::Controller;
use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use session::sleep::DeploymentState;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The largest request body, bytes (larger ones get 413).
pub const BODY_LIMIT: usize = 1 << 20;

/// `max_tokens` of a completion that gives none (OpenAI's default).
const DEFAULT_COMPLETION_TOKENS: u32 = 16;

/// The most choices (`n`) one request may ask for: each is a sequence of the batch.
const MAX_CHOICES: u64 = 16;

/// What [`Api::new`] needs.
pub struct ApiParts {
    /// To the engine and back.
    pub bridge: Bridge,
    /// Counters for `/metrics`.
    pub metrics: Metrics,
    /// The model's tokenizer and chat template.
    pub tokenizer: std::sync::Arc<text::Tokenizer>,
    /// The model's name in the API.
    pub model_name: String,
    /// The checkpoint the deployment started with (its path), live until a weight update.
    pub checkpoint: String,
    /// Token ids must be below this.
    pub vocab: usize,
    /// Prompt and generated tokens of one request together fit in this.
    pub context: usize,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// Whether the engine's session is open.
    pub ready: Arc<AtomicBool>,
    /// The deployment's sleep/wakeup handle (`None`: `/sleep`, `/wake_up`, `/is_sleeping`
    /// answer 503).
    pub control: Option<Controller>,
    /// Answer completions with 503 while the deployment sleeps.
    pub refuse_while_asleep: bool,
    /// Otherwise how long a completion waits for the wakeup before it gets 503.
    pub asleep_wait: Duration,
    /// The sampling of fields a request leaves out (`None`: OpenAI's).
    pub defaults: Option<crate::spec::SamplingDefaults>,
    /// Compiles the grammars of structured outputs (`None`: they are refused).
    pub grammars: Option<text::GrammarEngine>,
}

/// The handlers' shared state.
#[derive(Clone)]
pub struct Api(Arc<Inner>);

struct Inner {
    bridge: Bridge,
    metrics: Metrics,
    tokenizer: std::sync::Arc<text::Tokenizer>,
    model_name: String,
    checkpoint: String,
    vocab: usize,
    context: usize,
    api_key: Option<String>,
    ready: Arc<AtomicBool>,
    control: Option<Controller>,
    refuse_while_asleep: bool,
    asleep_wait: Duration,
    defaults: Option<crate::spec::SamplingDefaults>,
    grammars: Option<text::GrammarEngine>,
    created: u64,
}

impl Api {
    /// The state of a server over `parts`.
    pub fn new(parts: ApiParts) -> Self {
        Api(Arc::new(Inner {
            bridge: parts.bridge,
            metrics: parts.metrics,
            tokenizer: parts.tokenizer,
            model_name: parts.model_name,
            checkpoint: parts.checkpoint,
            vocab: parts.vocab,
            context: parts.context,
            api_key: parts.api_key,
            ready: parts.ready,
            control: parts.control,
            refuse_while_asleep: parts.refuse_while_asleep,
            asleep_wait: parts.asleep_wait,
            defaults: parts.defaults,
            grammars: parts.grammars,
            created: unix_now(),
        }))
    }
}

/// Runs the server on `listener` until `shutdown` fires (or its sender is dropped).
///
/// # Errors
/// The runtime cannot start or the listener fails.
pub fn serve(
    listener: std::net::TcpListener,
    api: Api,
    shutdown: tokio::sync::oneshot::Receiver<()>,
) -> Result<()> {
    let bridge = api.0.bridge.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("http-worker")
        .enable_io()
        .enable_time()
        .build()
        .context("starting the HTTP runtime")?;
    let result = runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::from_std(listener).context("registering the listener")?;
        axum::serve(listener, router(api))
            .with_graceful_shutdown(async move {
                let _ = shutdown.await;
                // Requests the engine will never finish now get their answer (503).
                bridge.close_all();
            })
            .await
            .context("serving HTTP")
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// The routes, behind the API-key check and the body limit.
fn router(api: Api) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model_by_id))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/version", get(version))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/sleep", post(sleep))
        .route("/wake_up", post(wake_up))
        .route("/update_weights", post(update_weights))
        .route("/is_sleeping", get(is_sleeping))
        .route("/start_weight_update", post(start_weight_update))
        .route("/finish_weight_update", post(finish_weight_update))
        .route("/abort_weight_update", post(abort_weight_update))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/is_paused", get(is_paused))
        .route("/get_weight_version", get(get_weight_version))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(api.clone(), guard))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(api)
}

/// The route's name in the metrics: a known path, or `other` (so clients cannot grow the
/// label set).
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "/v1/completions",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/models" => "/v1/models",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/version" => "/version",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/sleep" => "/sleep",
        "/wake_up" => "/wake_up",
        "/update_weights" => "/update_weights",
        "/is_sleeping" => "/is_sleeping",
        _ => "other",
    }
}

/// Checks the API key (every route but `/health`) and counts the answer.
async fn guard(State(api): State<Api>, req: Request, next: Next) -> Response {
    let route = route_label(req.uri().path());
    let allowed = route == "/health"
        || api.0.api_key.as_deref().is_none_or(|key| bearer_matches(req.headers(), key));
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let response = if !allowed {
        unauthorized().into_response()
    } else if declared.is_some_and(|n| n > BODY_LIMIT as u64) {
        // Refused before reading: no point in receiving what will be thrown away.
        ApiError::too_large().into_response()
    } else {
        next.run(req).await
    };
    api.0.metrics.http(route, response.status().as_u16());
    response
}

fn unauthorized() -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "invalid_api_key",
        "missing or wrong API key: send `Authorization: Bearer KEY`",
    )
}

/// Whether the request carries `Authorization: Bearer key`, compared in constant time (the
/// model host checks its own key with it too).
pub(crate) fn bearer_matches(headers: &HeaderMap, key: &str) -> bool {
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// An OpenAI-style error answer.
#[derive(Debug)]
pub(super) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    message: String,
    /// Seconds for a `Retry-After` header (503s that will pass).
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError { status, kind, code, message: message.into(), retry_after: None }
    }

    /// A 503 for a deployment that is asleep.
    fn sleeping(message: String, retry_after: Option<u64>) -> Self {
        let e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "sleeping", message);
        ApiError { retry_after, ..e }
    }

    pub(super) fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", code, message)
    }

    /// What the answer says.
    #[cfg(test)]
    pub(super) fn message_text(&self) -> &str {
        &self.message
    }

    fn too_large() -> Self {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body exceeds {BODY_LIMIT} bytes"),
        )
    }

    fn stopping() -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "shutting_down",
            "the server is stopping and takes no more requests",
        )
    }

    /// The engine stopped (failed, or the deployment was stopped) before an answer it had
    /// begun was finished.
    pub(super) fn engine_stopped() -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "engine_stopped",
            "the engine stopped before this answer was finished (see the server's log)",
        )
    }

    /// The `{"error": ...}` object, as a response body or a streamed event.
    pub(super) fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "code": self.code,
            "param": null,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

impl From<Closed> for ApiError {
    fn from(_: Closed) -> Self {
        ApiError::stopping()
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        format!("no route {} {}", req.method(), req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// `GET /health`: 200 once the model is loaded, asleep or not (as vLLM's), saying which; 503
/// while loading, and from the engine's stop (a failure, or `tpctl stop`) until the process
/// is gone.
async fn health(State(api): State<Api>) -> Response {
    if api.0.bridge.is_closed() {
        let body =
            json!({"status": "stopped", "message": "the engine stopped; the server is exiting"});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    if !api.0.ready.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"})))
            .into_response();
    }
    match api.asleep() {
        Some(tags) => Json(json!({"status": "sleeping", "tags": tags})).into_response(),
        None => Json(json!({"status": "ok"})).into_response(),
    }
}

async fn metrics(State(api): State<Api>) -> Response {
    let mut text = api.0.metrics.render(&api.0.model_name);
    let version = api.0.bridge.weight_version().get();
    super::metrics::render_checkpoint(&mut text, &api.checkpoint(), &version);
    if let Some(c) = &api.0.control {
        super::metrics::render_paused(&mut text, c.coordinator().is_paused());
        super::metrics::render_sleep(&mut text, &c.coordinator().state(), &c.journal().snapshot());
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn models(State(api): State<Api>) -> Json<Value> {
    Json(json!({"object": "list", "data": [api.model_card()]}))
}

/// `GET /v1/models/{id}` (the OpenAI SDK's `models.retrieve`): the model, or 404.
async fn model_by_id(
    State(api): State<Api>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> std::result::Result<Json<Value>, ApiError> {
    api.check_model(Some(&id))?;
    Ok(Json(api.model_card()))
}

/// `GET /version`, as vLLM answers it.
async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Vec<ChatMessageBody>>,
    /// For `messages`: whether to open the assistant's turn (default true).
    add_generation_prompt: Option<bool>,
}

/// `POST /tokenize` (vLLM's): the token ids of a prompt, or of chat messages rendered by the
/// chat template, as a completion would see them.
async fn tokenize(
    State(api): State<Api>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Json<Value>, ApiError> {
    let body: TokenizeBody = parse(body)?;
    api.check_model(body.model.as_deref())?;
    let tokens = match (&body.prompt, &body.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("invalid_body", "give `prompt` or `messages`, not both"))
        }
        (_, Some(m)) => {
            let options = request::ChatOptions {
                add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
                ..request::ChatOptions::default()
            };
            api.chat_prompt_with(Some(m), &options)?
        }
        (p, None) => api.completion_prompt(p.as_ref())?,
    };
    Ok(Json(json!({"count": tokens.len(), "max_model_len": api.0.context, "tokens": tokens})))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<u64>,
}

/// `POST /detokenize` (vLLM's): the text of token ids.
async fn detokenize(
    State(api): State<Api>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Json<Value>, ApiError> {
    let body: DetokenizeBody = parse(body)?;
    api.check_model(body.model.as_deref())?;
    let ids = body
        .tokens
        .iter()
        .map(|&id| api.check_id("tokens", id))
        .collect::<std::result::Result<Vec<u32>, _>>()?;
    let text = api.0.tokenizer.decode(&ids, false).map_err(|e| {
        ApiError::invalid("invalid_tokens", format!("the tokens do not decode: {e}"))
    })?;
    Ok(Json(json!({"prompt": text})))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Api {
    /// The live checkpoint: the latest weight update's, or the one the deployment started with.
    fn checkpoint(&self) -> String {
        self.0
            .control
            .as_ref()
            .and_then(|c| c.coordinator().checkpoint())
            .unwrap_or_else(|| self.0.checkpoint.clone())
    }

    /// The model's entry in `/v1/models`.
    fn model_card(&self) -> Value {
        json!({
            "id": self.0.model_name,
            "object": "model",
            "created": self.0.created,
            "owned_by": "tpctl",
            "max_model_len": self.0.context,
            "sleeping": self.asleep().is_some(),
            "paused": self.0.control.as_ref().is_some_and(|c| c.coordinator().is_paused()),
            "checkpoint": self.checkpoint(),
            "weight_version": &*self.0.bridge.weight_version().get(),
        })
    }

    /// The tags asleep (or waking), if the deployment sleeps.
    fn asleep(&self) -> Option<Vec<String>> {
        self.0.control.as_ref().and_then(|c| asleep_tags(&c.coordinator().state()))
    }

    /// Returns once the deployment is awake: at once with `refuse_while_asleep`'s 503, or
    /// after at most `asleep_wait` with a 503 that asks to retry later.
    async fn wait_awake(&self) -> std::result::Result<(), ApiError> {
        let Some(tags) = self.asleep() else { return Ok(()) };
        if self.0.refuse_while_asleep {
            return Err(ApiError::sleeping(
                format!(
                    "the deployment is asleep ({}) and refuses requests until a wakeup (POST /wake_up or `tpctl wakeup`)",
                    tags.join(",")
                ),
                None,
            ));
        }
        let deadline = tokio::time::Instant::now() + self.0.asleep_wait;
        // Counted as waiting while it is held here.
        let _held = self.0.metrics.held();
        while let Some(tags) = self.asleep() {
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::sleeping(
                    format!(
                        "the deployment stayed asleep ({}) for {:.0} s, the limit of [server] asleep_wait_timeout; retry after a wakeup",
                        tags.join(","),
                        self.0.asleep_wait.as_secs_f64()
                    ),
                    Some(ASLEEP_RETRY_AFTER_S),
                ));
            }
            tokio::time::sleep(ASLEEP_POLL).await;
        }
        Ok(())
    }
}

/// How often a request that waits for a wakeup looks at the deployment's state.
const ASLEEP_POLL: Duration = Duration::from_millis(20);

/// The `Retry-After` of a request that waited for a wakeup in vain (seconds).
const ASLEEP_RETRY_AFTER_S: u64 = 5;

/// The tags of a sleeping (or waking) deployment; `None` while it runs or failed.
fn asleep_tags(state: &DeploymentState) -> Option<Vec<String>> {
    match state {
        DeploymentState::Sleeping(t) | DeploymentState::Waking(t) => Some(t.clone()),
        DeploymentState::Running | DeploymentState::Failed(_) => None,
    }
}

fn no_control() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "sleep_unavailable",
        "sleep/wakeup is not available",
    )
}

mod answer;
mod control;
mod request;
mod structured;

use answer::{chat_completions, completions};
use control::{
    abort_weight_update, finish_weight_update, get_weight_version, is_paused, is_sleeping, pause,
    resume, sleep, start_weight_update, update_weights, wake_up,
};
use request::{parse, ChatMessageBody};

#[cfg(test)]
mod sleep_tests;
#[cfg(test)]
mod tests;
