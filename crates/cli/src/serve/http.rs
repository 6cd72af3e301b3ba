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
//! Every failure a client causes is a 4xx answer with an OpenAI-style body
//! `{"error": {"message", "type", "code", "param"}}`; the engine only ever sees checked
//! token-id prompts.

use super::bridge::{Bridge, Closed, Event, Events};
use super::logprobs::Scored;
use super::metrics::Metrics;
use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use session::sleep::{Action, Coordinator, DeploymentState, OpOptions, QuiesceMode};
use session::{FinishReason, SamplingParams, TokenLogprobs};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_stream::wrappers::ReceiverStream;

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
    pub tokenizer: std::sync::Arc<layers::Tokenizer>,
    /// The model's name in the API.
    pub model_name: String,
    /// Token ids must be below this.
    pub vocab: usize,
    /// Prompt and generated tokens of one request together fit in this.
    pub context: usize,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// Whether the engine's session is open.
    pub ready: Arc<AtomicBool>,
    /// The sleep/wakeup coordinator (`None`: `/sleep`, `/wake_up`, `/is_sleeping` answer 503).
    pub control: Option<Arc<Coordinator>>,
    /// Answer completions with 503 while the deployment sleeps.
    pub refuse_while_asleep: bool,
    /// Otherwise how long a completion waits for the wakeup before it gets 503.
    pub asleep_wait: Duration,
    /// The sampling of fields a request leaves out (`None`: OpenAI's).
    pub defaults: Option<crate::spec::SamplingDefaults>,
}

/// The handlers' shared state.
#[derive(Clone)]
pub struct Api(Arc<Inner>);

struct Inner {
    bridge: Bridge,
    metrics: Metrics,
    tokenizer: std::sync::Arc<layers::Tokenizer>,
    model_name: String,
    vocab: usize,
    context: usize,
    api_key: Option<String>,
    ready: Arc<AtomicBool>,
    control: Option<Arc<Coordinator>>,
    refuse_while_asleep: bool,
    asleep_wait: Duration,
    defaults: Option<crate::spec::SamplingDefaults>,
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
            vocab: parts.vocab,
            context: parts.context,
            api_key: parts.api_key,
            ready: parts.ready,
            control: parts.control,
            refuse_while_asleep: parts.refuse_while_asleep,
            asleep_wait: parts.asleep_wait,
            defaults: parts.defaults,
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

/// Whether the request carries `Authorization: Bearer key`, compared in constant time.
fn bearer_matches(headers: &HeaderMap, key: &str) -> bool {
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
    pub(super) fn message(&self) -> &str {
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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "code": self.code,
            "param": null,
        }});
        let mut response = (self.status, Json(body)).into_response();
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

/// `GET /health`: 200 once the model is loaded, asleep or not (as vLLM's), saying which.
async fn health(State(api): State<Api>) -> Response {
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
    let mut text = api.0.metrics.render();
    if let Some(c) = &api.0.control {
        super::metrics::render_sleep(&mut text, &c.state(), &crate::control::journal(c).snapshot());
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
            api.chat_prompt_with(Some(m), body.add_generation_prompt.unwrap_or(true))?
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

/// Sampling fields shared by both generation endpoints.
#[derive(Debug, Default, Deserialize)]
struct SamplingBody {
    model: Option<String>,
    max_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    seed: Option<u64>,
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u64>>,
    ignore_eos: Option<bool>,
    n: Option<u64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    min_p: Option<f32>,
    /// Token id (as a string, OpenAI's form) to a bias added to its logit.
    logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Completions: the number of alternatives; chat: whether (see [`super::logprobs`]).
    logprobs: Option<Value>,
    /// Chat: the number of alternatives.
    top_logprobs: Option<Value>,
    /// Every other field: accepted only where it asks for nothing ([`check_unsupported`]).
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// Refuses the fields this server does not implement unless their value asks for nothing
/// (`"best_of": 1`, `"suffix": ""`, ...): a client never gets a silently
/// different answer. `user` is accepted and ignored, as it only labels the request.
fn check_unsupported(other: &serde_json::Map<String, Value>) -> std::result::Result<(), ApiError> {
    for (key, value) in other {
        let neutral = match key.as_str() {
            "user" | "parallel_tool_calls" => true,
            "best_of" => value.is_null() || value.as_u64() == Some(1),
            "suffix" => value.is_null() || value.as_str() == Some(""),
            "response_format" => value.is_null() || value["type"] == "text",
            "tools" | "functions" => value.is_null() || value.as_array().is_some_and(Vec::is_empty),
            "tool_choice" | "function_call" => value.is_null() || value == "none",
            _ => false,
        };
        if !neutral {
            return Err(ApiError::invalid(
                "unsupported_parameter",
                format!("`{key}` = {value} is not supported by this server"),
            ));
        }
    }
    Ok(())
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: Option<Value>,
    /// Answer the prompt's text before the completion.
    echo: Option<bool>,
    #[serde(flatten)]
    sampling: SamplingBody,
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Option<Vec<ChatMessageBody>>,
    max_completion_tokens: Option<u64>,
    #[serde(flatten)]
    sampling: SamplingBody,
}

#[derive(Debug, Deserialize)]
struct ChatMessageBody {
    role: String,
    content: Option<Value>,
}

/// The body as JSON of type `T`, or the 4xx that says why not.
fn parse<T: serde::de::DeserializeOwned>(
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<T, ApiError> {
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large()
        } else {
            ApiError::invalid("invalid_body", format!("cannot read the request body: {r}"))
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::invalid(
            "invalid_json",
            format!("the body is not valid JSON for this endpoint: {e}"),
        )
    })
}

/// A checked request, ready for the engine.
struct Job {
    prompt: Vec<u32>,
    params: SamplingParams,
    /// Choices: independent sequences of the same prompt (seeds `seed`, `seed + 1`, ...).
    n: usize,
    /// Text every choice begins with (`echo`: the prompt's).
    echo: Option<String>,
    /// Stop strings, matched on the generated text.
    stop_text: Vec<String>,
    stream: bool,
    include_usage: bool,
}

impl Job {
    fn wants_logprobs(&self) -> bool {
        self.params.logprobs.is_some()
    }
}

impl Api {
    fn check_model(&self, model: Option<&str>) -> std::result::Result<(), ApiError> {
        match model {
            Some(m) if m != self.0.model_name => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    self.0.model_name
                ),
            )),
            _ => Ok(()),
        }
    }

    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, ApiError> {
        if text.is_empty() {
            return Err(ApiError::invalid("empty_prompt", "the prompt is empty"));
        }
        let ids = self.0.tokenizer.encode(text).map_err(|e| {
            ApiError::invalid("invalid_prompt", format!("cannot tokenize the prompt: {e}"))
        })?;
        if ids.is_empty() {
            return Err(ApiError::invalid("empty_prompt", "the prompt encodes to no tokens"));
        }
        Ok(ids)
    }

    fn check_id(&self, what: &str, id: u64) -> std::result::Result<u32, ApiError> {
        if id >= self.0.vocab as u64 {
            return Err(ApiError::invalid(
                "invalid_token_id",
                format!("{what}: token id {id} is outside the vocabulary of {}", self.0.vocab),
            ));
        }
        Ok(id as u32)
    }

    /// The prompt of a completion: a string, token ids, or a one-element list of either.
    fn completion_prompt(&self, prompt: Option<&Value>) -> std::result::Result<Vec<u32>, ApiError> {
        let bad = || {
            ApiError::invalid(
                "invalid_prompt",
                "`prompt` must be a string or an array of token ids (one prompt per request)",
            )
        };
        match prompt {
            None | Some(Value::Null) => {
                Err(ApiError::invalid("missing_prompt", "`prompt` is required"))
            }
            Some(Value::String(s)) => self.encode(s),
            Some(Value::Array(items)) if items.is_empty() => {
                Err(ApiError::invalid("empty_prompt", "the prompt is empty"))
            }
            Some(Value::Array(items)) if items.len() == 1 && !items[0].is_number() => {
                self.completion_prompt(items.first())
            }
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v.as_u64() {
                    Some(id) => self.check_id("prompt", id),
                    None if v.is_number() => Err(ApiError::invalid(
                        "invalid_token_id",
                        format!("prompt: token id {v} is not a non-negative integer"),
                    )),
                    None => Err(bad()),
                })
                .collect(),
            Some(_) => Err(bad()),
        }
    }

    /// The prompt of a chat: its messages through the model's chat template.
    fn chat_prompt(
        &self,
        messages: Option<&[ChatMessageBody]>,
    ) -> std::result::Result<Vec<u32>, ApiError> {
        self.chat_prompt_with(messages, true)
    }

    /// The token ids of `messages` through the chat template, opening the assistant's turn
    /// when `add_generation_prompt`.
    fn chat_prompt_with(
        &self,
        messages: Option<&[ChatMessageBody]>,
        add_generation_prompt: bool,
    ) -> std::result::Result<Vec<u32>, ApiError> {
        let messages = match messages {
            None => return Err(ApiError::invalid("missing_messages", "`messages` is required")),
            Some([]) => return Err(ApiError::invalid("empty_messages", "`messages` is empty")),
            Some(m) => m,
        };
        let mut chat = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let content = match &m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        match (
                            part.get("type").and_then(Value::as_str),
                            part.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    "invalid_message",
                                    format!("messages[{i}]: only text content parts are supported"),
                                ))
                            }
                        }
                    }
                    text
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        "invalid_message",
                        format!("messages[{i}].content must be a string or a list of text parts"),
                    ))
                }
            };
            chat.push(layers::ChatMessage::new(&m.role, &content));
        }
        let text =
            self.0.tokenizer.apply_chat_template(&chat, add_generation_prompt).map_err(|e| {
                ApiError::invalid(
                    "chat_template",
                    format!("cannot apply the model's chat template: {e}"),
                )
            })?;
        self.encode(&text)
    }

    /// Checks the sampling fields against the prompt and the context.
    fn job(
        &self,
        kind: Kind,
        prompt: Vec<u32>,
        s: &SamplingBody,
        max_tokens: Option<u64>,
        default_max: u64,
    ) -> std::result::Result<Job, ApiError> {
        let context = self.0.context;
        let n = match s.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "invalid_n",
                    format!("`n` {n}: expected 1 to {MAX_CHOICES}"),
                ))
            }
        };
        check_unsupported(&s.other)?;
        let (lp, top_lp) = (s.logprobs.as_ref(), s.top_logprobs.as_ref());
        let logprobs = match kind {
            Kind::Completion => super::logprobs::completion_request(lp, top_lp)?,
            Kind::Chat => super::logprobs::chat_request(lp, top_lp)?,
        };
        let within = |name: &str, v: Option<f32>, ok: fn(f32) -> bool, range: &str| match v {
            Some(x) if !(x.is_finite() && ok(x)) => Err(ApiError::invalid(
                "invalid_sampling",
                format!("`{name}` {x}: expected {range}"),
            )),
            _ => Ok(()),
        };
        within("presence_penalty", s.presence_penalty, |x| x.abs() <= 2.0, "-2 to 2")?;
        within("frequency_penalty", s.frequency_penalty, |x| x.abs() <= 2.0, "-2 to 2")?;
        within("repetition_penalty", s.repetition_penalty, |x| x > 0.0, "above 0")?;
        within("min_p", s.min_p, |x| (0.0..=1.0).contains(&x), "0 to 1")?;
        let mut logit_bias = Vec::new();
        for (id, &bias) in s.logit_bias.iter().flatten() {
            let parsed = id.parse::<u64>().map_err(|_| {
                ApiError::invalid(
                    "invalid_logit_bias",
                    format!("`logit_bias` key {id:?}: expected a token id"),
                )
            })?;
            let id = self.check_id("logit_bias", parsed)?;
            if !(bias.is_finite() && bias.abs() <= 100.0) {
                return Err(ApiError::invalid(
                    "invalid_logit_bias",
                    format!("`logit_bias` of token {id}: {bias} is outside -100 to 100"),
                ));
            }
            logit_bias.push((id, bias));
        }
        // A default of 0 (a chat prompt that fills the context) fails the context check below.
        let max_tokens = max_tokens.unwrap_or(default_max.max(1));
        if max_tokens == 0 {
            return Err(ApiError::invalid("invalid_max_tokens", "`max_tokens` must be at least 1"));
        }
        if prompt.len() as u64 + max_tokens > context as u64 {
            return Err(ApiError::invalid(
                "context_length_exceeded",
                format!(
                    "this model's maximum context length is {context} tokens, but {} were requested ({} in the prompt, {max_tokens} for the completion)",
                    prompt.len() as u64 + max_tokens,
                    prompt.len()
                ),
            ));
        }
        let d = self.0.defaults;
        let temperature = s.temperature.unwrap_or(d.map_or(1.0, |d| d.temperature));
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(ApiError::invalid(
                "invalid_temperature",
                "`temperature` must be 0 or more",
            ));
        }
        let top_p = s.top_p.unwrap_or(d.map_or(1.0, |d| d.top_p));
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid("invalid_top_p", "`top_p` must be in (0, 1]"));
        }
        let top_k = match s.top_k.unwrap_or(d.map_or(0, |d| d.top_k as i64)) {
            -1 | 0 => 0,
            k if k > 0 => k as usize,
            k => {
                return Err(ApiError::invalid(
                    "invalid_top_k",
                    format!("`top_k` {k}: use -1 or 0 (all) or a positive count"),
                ))
            }
        };
        let mut stop = Vec::new();
        for &id in s.stop_token_ids.iter().flatten() {
            stop.push(self.check_id("stop_token_ids", id)?);
        }
        let stop_strings: Vec<&str> = match &s.stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_str().ok_or_else(|| {
                        ApiError::invalid(
                            "invalid_stop",
                            "`stop` must be a string or a list of strings",
                        )
                    })
                })
                .collect::<std::result::Result<_, _>>()?,
            Some(_) => {
                return Err(ApiError::invalid(
                    "invalid_stop",
                    "`stop` must be a string or a list of strings",
                ))
            }
        };
        if stop_strings.iter().any(|t| t.is_empty()) {
            return Err(ApiError::invalid("invalid_stop", "a stop string is empty"));
        }
        let stop_text: Vec<String> = stop_strings.iter().map(|t| (*t).to_owned()).collect();
        let seed = s.seed.unwrap_or_else(|| {
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
        });
        let params = SamplingParams {
            max_tokens: max_tokens as u32,
            temperature,
            top_k,
            top_p,
            seed,
            stop,
            ignore_eos: s.ignore_eos.unwrap_or(false),
            presence_penalty: s.presence_penalty.unwrap_or(0.0),
            frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: s
                .repetition_penalty
                .unwrap_or(d.map_or(1.0, |d| d.repetition_penalty)),
            min_p: s.min_p.unwrap_or(0.0),
            logit_bias,
            logprobs,
        };
        Ok(Job {
            prompt,
            params,
            n,
            echo: None,
            stop_text,
            stream: s.stream.unwrap_or(false),
            include_usage: s.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        })
    }
}

/// The OpenAI name of a finish reason.
fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::StopToken => "stop",
        FinishReason::Cancelled | FinishReason::Aborted => "abort",
        FinishReason::Rejected => "rejected",
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Which endpoint a response is for: the shape of its objects.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn id(self, n: u64) -> String {
        match self {
            Kind::Completion => format!("cmpl-{n}"),
            Kind::Chat => format!("chatcmpl-{n}"),
        }
    }
}

async fn completions(
    State(api): State<Api>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Response, ApiError> {
    let body: CompletionBody = parse(body)?;
    api.check_model(body.sampling.model.as_deref())?;
    let prompt = api.completion_prompt(body.prompt.as_ref())?;
    let max = body.sampling.max_tokens;
    let default_max = api.0.defaults.map_or(DEFAULT_COMPLETION_TOKENS, |d| d.max_tokens);
    let echo =
        if body.echo.unwrap_or(false) { Some(api.prompt_text(&body, &prompt)?) } else { None };
    let mut job = api.job(Kind::Completion, prompt, &body.sampling, max, default_max.into())?;
    if echo.is_some() && job.wants_logprobs() {
        return Err(ApiError::invalid(
            "unsupported_parameter",
            "`echo` with `logprobs` asks for the prompt's log-probabilities, which this server does not compute",
        ));
    }
    job.echo = echo;
    generate(api, job, Kind::Completion).await
}

async fn chat_completions(
    State(api): State<Api>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Response, ApiError> {
    let body: ChatBody = parse(body)?;
    api.check_model(body.sampling.model.as_deref())?;
    let prompt = api.chat_prompt(body.messages.as_deref())?;
    let max = body.max_completion_tokens.or(body.sampling.max_tokens);
    // Without a limit a chat reply may fill the context (OpenAI's default).
    let room = api.0.context.saturating_sub(prompt.len()) as u64;
    let job = api.job(Kind::Chat, prompt, &body.sampling, max, room)?;
    generate(api, job, Kind::Chat).await
}

async fn generate(api: Api, job: Job, kind: Kind) -> std::result::Result<Response, ApiError> {
    api.wait_awake().await?;
    let prompt_tokens = job.prompt.len();
    let (stream, include_usage) = (job.stream, job.include_usage);
    let scorer = job.wants_logprobs().then(|| Scorer(api.0.tokenizer.clone()));
    // One sequence per choice, all in the batch together; dropping them cancels the rest.
    let mut choices = Vec::with_capacity(job.n);
    for i in 0..job.n as u64 {
        let params = SamplingParams { seed: job.params.seed.wrapping_add(i), ..job.params.clone() };
        choices.push(api.0.bridge.submit(job.prompt.clone(), params)?);
    }
    let id = kind.id(choices[0].id);
    let created = unix_now();
    let model = api.0.model_name.clone();
    let answer = Answer { kind, stops: job.stop_text, scorer, echo: job.echo };
    if stream {
        let header = Header { id, created, model, prompt_tokens, include_usage };
        let events = sse(choices, header, answer);
        return Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response());
    }
    let mut out = Vec::with_capacity(choices.len());
    let mut completion_tokens = 0;
    for (index, rx) in choices.into_iter().enumerate() {
        let (body, tokens, reason, scored) =
            collect(rx, StopText::new(answer.stops.clone()), answer.scorer.clone()).await?;
        completion_tokens += tokens.len();
        let text = match &answer.echo {
            Some(prompt) => format!("{prompt}{body}"),
            None => body,
        };
        let logprobs = match (kind, scored) {
            (_, None) => Value::Null,
            (Kind::Completion, Some(s)) => super::logprobs::completion(&s, 0),
            (Kind::Chat, Some(s)) => super::logprobs::chat(&s),
        };
        out.push(match kind {
            Kind::Completion => {
                json!({"index": index, "text": text, "token_ids": tokens, "logprobs": logprobs, "finish_reason": finish_name(reason)})
            }
            Kind::Chat => {
                json!({"index": index, "message": {"role": "assistant", "content": text}, "token_ids": tokens, "logprobs": logprobs, "finish_reason": finish_name(reason)})
            }
        });
    }
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    Ok(Json(json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, completion_tokens),
    }))
    .into_response())
}

/// How a request's choices are answered: the endpoint's shape, the stop strings, the
/// log-probabilities' token texts and the echoed prompt.
#[derive(Clone)]
struct Answer {
    kind: Kind,
    stops: Vec<String>,
    scorer: Option<Scorer>,
    echo: Option<String>,
}

impl Api {
    /// The text `echo` repeats: the prompt as given, or its token ids decoded.
    fn prompt_text(
        &self,
        body: &CompletionBody,
        ids: &[u32],
    ) -> std::result::Result<String, ApiError> {
        match &body.prompt {
            Some(Value::String(s)) => return Ok(s.clone()),
            Some(Value::Array(items)) if items.len() == 1 => {
                if let Some(s) = items[0].as_str() {
                    return Ok(s.to_owned());
                }
            }
            _ => {}
        }
        self.0.tokenizer.decode(ids, false).map_err(|e| {
            ApiError::invalid("invalid_prompt", format!("the prompt ids do not decode: {e}"))
        })
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
            "checkpoint": self.0.control.as_ref().and_then(|c| c.checkpoint()),
        })
    }

    /// The tags asleep (or waking), if the deployment sleeps.
    fn asleep(&self) -> Option<Vec<String>> {
        self.0.control.as_ref().and_then(|c| asleep_tags(&c.state()))
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

/// The pairs of a query string, percent-decoded (`+` is a space).
fn query_pairs(query: Option<&str>) -> std::result::Result<Vec<(String, String)>, ApiError> {
    let decode = |s: &str| -> std::result::Result<String, ApiError> {
        let bad = || ApiError::invalid("invalid_query", format!("bad percent-encoding in `{s}`"));
        let mut out = Vec::with_capacity(s.len());
        let mut bytes = s.bytes();
        while let Some(b) = bytes.next() {
            match b {
                b'+' => out.push(b' '),
                b'%' => {
                    let hex = [bytes.next().ok_or_else(bad)?, bytes.next().ok_or_else(bad)?];
                    let hex = std::str::from_utf8(&hex).map_err(|_| bad())?;
                    out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                }
                b => out.push(b),
            }
        }
        String::from_utf8(out).map_err(|_| bad())
    };
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            Ok((decode(k)?, decode(v)?))
        })
        .collect()
}

/// What `/sleep` and `/wake_up` take from their query.
struct OpQuery {
    tags: Vec<String>,
    opts: OpOptions,
    /// The checkpoint of a weight update.
    model: Option<String>,
}

/// Parses `tags` (comma-separated and/or repeated), `level` (1 or 2), `mode` and `verify`;
/// `allowed` names the keys this route takes.
fn op_query(query: Option<&str>, allowed: &[&str]) -> std::result::Result<OpQuery, ApiError> {
    let mut out = OpQuery { tags: Vec::new(), opts: OpOptions::default(), model: None };
    for (key, value) in query_pairs(query)? {
        if !allowed.contains(&key.as_str()) {
            return Err(ApiError::invalid(
                "invalid_query",
                format!(
                    "unknown query parameter `{key}` (this route takes {})",
                    allowed.join(", ")
                ),
            ));
        }
        match key.as_str() {
            "model" => out.model = Some(value.clone()),
            "tags" => out.tags.extend(
                value.split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned),
            ),
            "level" => {
                out.opts.level = match value.as_str() {
                    "1" => Some(1),
                    "2" => Some(2),
                    _ => {
                        return Err(ApiError::invalid(
                            "invalid_level",
                            format!("sleep level `{value}`: only 1 and 2 are supported"),
                        ))
                    }
                }
            }
            "mode" => {
                out.opts.mode = match value.as_str() {
                    "wait" => QuiesceMode::Wait,
                    "abort" => QuiesceMode::Abort,
                    "keep" => QuiesceMode::Keep,
                    other => {
                        return Err(ApiError::invalid(
                            "invalid_mode",
                            format!("mode `{other}`: expected wait, abort or keep"),
                        ))
                    }
                }
            }
            "verify" => {
                out.opts.verify = match value.as_str() {
                    "" | "true" | "1" => true,
                    "false" | "0" => false,
                    other => {
                        return Err(ApiError::invalid(
                            "invalid_verify",
                            format!("verify `{other}`: expected true or false"),
                        ))
                    }
                }
            }
            _ => {}
        }
    }
    crate::control::check_tags(&out.tags).map_err(|e| ApiError::invalid("invalid_tags", e))?;
    Ok(out)
}

/// Runs a sleep or wakeup on a blocking thread and answers its receipt.
async fn control_op(api: Api, action: Action, query: Option<&str>) -> Response {
    let Some(coordinator) = api.0.control.clone() else {
        return no_control().into_response();
    };
    let allowed: &[&str] = match action {
        Action::Sleep => &["tags", "level", "mode", "verify"],
        Action::Wakeup => &["tags", "model"],
        Action::Update | Action::Revert => &["model", "mode"],
    };
    let q = match op_query(query, allowed) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let run = tokio::task::spawn_blocking(move || match action {
        Action::Update | Action::Revert => {
            crate::control::run_update(&coordinator, q.model.as_deref().unwrap_or_default(), q.opts)
        }
        Action::Wakeup => {
            crate::control::run_wakeup(&coordinator, &q.tags, q.model.as_deref(), q.opts)
        }
        Action::Sleep => crate::control::run_op(&coordinator, action, &q.tags, q.opts),
    })
    .await;
    match run {
        Ok(Ok(op)) => Json(op).into_response(),
        Ok(Err(e)) => {
            let (status, kind, code) = if e.client_error {
                (StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_tags")
            } else {
                let code = match action {
                    Action::Update | Action::Revert => "update_failed",
                    Action::Sleep | Action::Wakeup => "sleep_failed",
                };
                (StatusCode::INTERNAL_SERVER_ERROR, "server_error", code)
            };
            let body = json!({"error": {
                "message": e.message,
                "type": kind,
                "code": code,
                "param": null,
                "failures": e.failures,
                "outcome": e.outcome,
            }});
            (status, Json(body)).into_response()
        }
        Err(join) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "sleep_failed",
            format!("the {action} did not finish: {join}"),
        )
        .into_response(),
    }
}

async fn sleep(State(api): State<Api>, uri: axum::http::Uri) -> Response {
    control_op(api, Action::Sleep, uri.query()).await
}

async fn wake_up(State(api): State<Api>, uri: axum::http::Uri) -> Response {
    control_op(api, Action::Wakeup, uri.query()).await
}

/// `POST /update_weights?model=PATH&mode=wait`: every rank loads its shard of the checkpoint
/// into its live weights (SGLang's `/update_weights_from_disk`, vLLM's `reload_weights`).
async fn update_weights(State(api): State<Api>, uri: axum::http::Uri) -> Response {
    control_op(api, Action::Update, uri.query()).await
}

async fn is_sleeping(State(api): State<Api>) -> Response {
    match &api.0.control {
        None => no_control().into_response(),
        Some(c) => Json(json!({"is_sleeping": asleep_tags(&c.state()).is_some()})).into_response(),
    }
}

/// Token texts for log-probabilities: each token decoded alone.
#[derive(Clone)]
struct Scorer(std::sync::Arc<layers::Tokenizer>);

impl Scorer {
    fn score(&self, token: u32, logprobs: Option<TokenLogprobs>) -> Option<Scored> {
        let decode = |id: u32| self.0.decode(&[id], false).unwrap_or_default();
        logprobs.map(|lp| Scored::new(token, lp, decode))
    }
}

/// A request's answer: its text, tokens, finish reason, and each token's log-probabilities
/// when the request asked for them.
type Collected = (String, Vec<u32>, FinishReason, Option<Vec<Scored>>);

/// Waits for a request's end.
async fn collect(
    mut rx: Events,
    mut stops: StopText,
    scorer: Option<Scorer>,
) -> std::result::Result<Collected, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut scored = scorer.as_ref().map(|_| Vec::new());
    while let Some(event) = rx.recv().await {
        match event {
            Event::Token { token, text: piece, logprobs } => {
                tokens.push(token);
                if let (Some(scorer), Some(all)) = (&scorer, &mut scored) {
                    all.extend(scorer.score(token, logprobs));
                }
                let (out, hit) = stops.push(&piece);
                text.push_str(&out);
                if hit {
                    // Dropping the events cancels the rest of the generation.
                    return Ok((text, tokens, FinishReason::StopToken, scored));
                }
            }
            Event::Finished { reason: FinishReason::Rejected, .. } => {
                return Err(ApiError::invalid("rejected", "the engine refused the prompt"))
            }
            Event::Finished { reason: FinishReason::Cancelled, .. } => {
                return Err(ApiError::stopping())
            }
            Event::Finished { reason, tokens } => {
                text.push_str(&stops.finish());
                return Ok((text, tokens, reason, scored));
            }
        }
    }
    Err(ApiError::stopping())
}

/// Stop strings matched on a request's text as it comes: the text before the first match is
/// let through and the rest dropped (OpenAI's `stop`, the stop string not included). Text
/// that may be the beginning of a stop string is held back until the next piece decides.
#[derive(Debug, Default)]
struct StopText {
    stops: Vec<String>,
    held: String,
}

impl StopText {
    fn new(stops: Vec<String>) -> Self {
        StopText { stops, held: String::new() }
    }

    /// Takes the next piece: the text that can go out now, and whether a stop string ended
    /// the request.
    fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (piece.to_owned(), false);
        }
        self.held.push_str(piece);
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first {
            let out = self.held[..at].to_owned();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest end of the text that begins some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&n| s.is_char_boundary(n)).map(|n| &s[..n]))
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// The text still held back when the request ended without a stop string.
    fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// What every chunk of a stream repeats.
struct Header {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    include_usage: bool,
}

impl Header {
    fn chunk(&self, kind: Kind, choices: Value) -> SseEvent {
        let object = match kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let value = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        SseEvent::default().data(value.to_string())
    }
}

/// The request's events as SSE chunks (every choice's, as they come), then the usage when
/// asked for, then `data: [DONE]`. A task per choice forwards them; they end early when the
/// client goes away, which cancels the requests (see [`Events`]).
fn sse(
    choices: Vec<Events>,
    header: Header,
    answer: Answer,
) -> ReceiverStream<std::result::Result<SseEvent, Infallible>> {
    let (tx, out) = tokio::sync::mpsc::channel(64);
    let header = Arc::new(header);
    let kind = answer.kind;
    tokio::spawn(async move {
        let tasks: Vec<_> = choices
            .into_iter()
            .enumerate()
            .map(|(index, rx)| {
                let choice = Choice { index, header: header.clone(), answer: answer.clone() };
                tokio::spawn(choice.stream(rx, tx.clone()))
            })
            .collect();
        let mut completion_tokens = 0;
        for task in tasks {
            match task.await {
                Ok(Some(tokens)) => completion_tokens += tokens,
                // The client went away (or a task failed): nothing more to send.
                Ok(None) | Err(_) => return,
            }
        }
        let send = |e: SseEvent| {
            let tx = tx.clone();
            async move { tx.send(Ok(e)).await.is_ok() }
        };
        if header.include_usage {
            let value = json!({
                "id": header.id,
                "object": if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
                "created": header.created,
                "model": header.model,
                "choices": [],
                "usage": usage(header.prompt_tokens, completion_tokens),
            });
            if !send(SseEvent::default().data(value.to_string())).await {
                return;
            }
        }
        send(SseEvent::default().data("[DONE]")).await;
    });
    ReceiverStream::new(out)
}

/// One choice of a streamed answer.
struct Choice {
    index: usize,
    header: Arc<Header>,
    answer: Answer,
}

impl Choice {
    /// Forwards this choice's events as chunks into `tx`; its completion tokens, or `None`
    /// when the client went away.
    async fn stream(
        self,
        mut rx: Events,
        tx: tokio::sync::mpsc::Sender<std::result::Result<SseEvent, Infallible>>,
    ) -> Option<usize> {
        let Choice { index, header, answer } = self;
        let kind = answer.kind;
        let send = |choice: Value| {
            let tx = tx.clone();
            let chunk = header.chunk(kind, json!([choice]));
            async move { tx.send(Ok(chunk)).await.is_ok() }
        };
        // A piece of text (with its token and log-probabilities, when it has them).
        let piece = |text: &str, token: Option<u32>, logprobs: Value| match kind {
            Kind::Completion => json!({"index": index, "text": text,
                "token_ids": token.into_iter().collect::<Vec<_>>(), "logprobs": logprobs,
                "finish_reason": null}),
            Kind::Chat => json!({"index": index, "delta": {"content": text},
                "token_ids": token.into_iter().collect::<Vec<_>>(), "logprobs": logprobs,
                "finish_reason": null}),
        };
        if kind == Kind::Chat {
            let first = json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            if !send(first).await {
                return None;
            }
        }
        if let Some(prompt) = &answer.echo {
            if !send(piece(prompt, None, Value::Null)).await {
                return None;
            }
        }
        let mut stops = StopText::new(answer.stops.clone());
        let mut completion_tokens = 0;
        // Characters of the completion's token texts so far (`text_offset`).
        let mut offset = 0;
        let mut reason = FinishReason::Cancelled;
        while let Some(event) = rx.recv().await {
            match event {
                Event::Token { token, text, logprobs } => {
                    completion_tokens += 1;
                    let scored = answer.scorer.as_ref().and_then(|s| s.score(token, logprobs));
                    let logprobs = match (kind, &scored) {
                        (_, None) => Value::Null,
                        (Kind::Completion, Some(s)) => {
                            let v = super::logprobs::completion(std::slice::from_ref(s), offset);
                            offset += s.text.chars().count();
                            v
                        }
                        (Kind::Chat, Some(s)) => super::logprobs::chat(std::slice::from_ref(s)),
                    };
                    let (text, hit) = stops.push(&text);
                    if !send(piece(&text, Some(token), logprobs)).await {
                        return None;
                    }
                    if hit {
                        reason = FinishReason::StopToken;
                        break;
                    }
                }
                Event::Finished { reason: r, .. } => {
                    reason = r;
                    let rest = stops.finish();
                    if !rest.is_empty() && !send(piece(&rest, None, Value::Null)).await {
                        return None;
                    }
                    break;
                }
            }
        }
        let last = match kind {
            Kind::Completion => {
                json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish_name(reason)})
            }
            Kind::Chat => {
                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish_name(reason)})
            }
        };
        send(last).await.then_some(completion_tokens)
    }
}

#[cfg(test)]
mod sleep_tests;
#[cfg(test)]
mod tests;
