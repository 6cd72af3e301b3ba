//! The host's API: `POST /v1/completions` and `/v1/chat/completions` routed by the request's
//! `model` to that model's deployment (woken first when it sleeps), `GET /v1/models` (every
//! model with its state and resident bytes), `/v1/models/{id}`, `/health` and `/metrics`
//! (per model, label `model`).
//!
//! A request for a model the host does not serve is a 404 listing the models, as vLLM's;
//! one that names none is a 400; one whose model cannot be made ready is a 503 naming why
//! (with `Retry-After` when waiting may help).

use super::{proxy, Host, Refusal};
use crate::serve::bearer_matches;
use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the host looks for a stop request, for models whose deployment exited and for
/// paused requests to continue.
const TICK: Duration = Duration::from_millis(100);
/// Ticks between two readings of the models' states from their deployments.
const FOLLOW_TICKS: u32 = 10;
/// How long `/metrics` waits for one model's metrics (a model that does not answer in time
/// is left out of that scrape).
const METRICS_TIMEOUT: Duration = Duration::from_secs(2);

/// Serves the API on `listener` with `runtime` until `stop` is set.
///
/// # Errors
/// The listener fails.
pub fn serve(
    runtime: &tokio::runtime::Runtime,
    listener: std::net::TcpListener,
    host: Arc<Host>,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    let watched = host.clone();
    runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::from_std(listener).context("registering the listener")?;
        axum::serve(listener, router(host))
            .with_graceful_shutdown(async move {
                let mut ticks = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let host = watched.clone();
                    let follow = ticks.is_multiple_of(FOLLOW_TICKS);
                    let _ = tokio::task::spawn_blocking(move || {
                        host.check_children();
                        if follow {
                            host.follow();
                        }
                    })
                    .await;
                    watched.revive_kept();
                    ticks = ticks.wrapping_add(1);
                    tokio::time::sleep(TICK).await;
                }
            })
            .await
            .context("serving HTTP")
    })
}

fn router(host: Arc<Host>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model_by_id))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(host.clone(), guard))
        .layer(DefaultBodyLimit::max(crate::serve::BODY_LIMIT))
        .with_state(host)
}

/// An OpenAI-style error answer.
fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let kind = match status {
        StatusCode::NOT_FOUND => "NotFoundError",
        s if s.is_client_error() => "invalid_request_error",
        _ => "server_error",
    };
    let body = json!({"error": {
        "message": message.into(), "type": kind, "code": code, "param": null,
    }});
    (status, Json(body)).into_response()
}

/// Checks the API key on every route but `/health`.
async fn guard(State(host): State<Arc<Host>>, req: Request, next: Next) -> Response {
    let allowed = req.uri().path() == "/health"
        || host.api_key.as_deref().is_none_or(|key| bearer_matches(req.headers(), key));
    if allowed {
        next.run(req).await
    } else {
        error(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or wrong API key: send `Authorization: Bearer KEY`",
        )
    }
}

async fn not_found(req: Request) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        format!(
            "no route {} {}: the model host serves POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics (each model's own routes are on its deployment)",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn completions(State(host): State<Arc<Host>>, body: Bytes) -> Response {
    route(host, "/v1/completions", body).await
}

async fn chat_completions(State(host): State<Arc<Host>>, body: Bytes) -> Response {
    route(host, "/v1/chat/completions", body).await
}

/// The models' names, for messages.
fn names(host: &Host) -> String {
    host.specs.iter().map(|c| format!("`{}`", c.name)).collect::<Vec<_>>().join(", ")
}

/// Finds the request's model, admits the request (waking the model if need be) and forwards
/// it to the model's deployment.
async fn route(host: Arc<Host>, path: &str, body: Bytes) -> Response {
    let model = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(fields)) => fields.get("model").cloned(),
        Ok(_) => {
            return error(StatusCode::BAD_REQUEST, "invalid_json", "the body is not a JSON object")
        }
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("the body is not JSON: {e}"),
            )
        }
    };
    let Some(name) = model.as_ref().and_then(Value::as_str) else {
        return error(
            StatusCode::BAD_REQUEST,
            "missing_model",
            format!("this server serves several models: name one in `model` ({})", names(&host)),
        );
    };
    let Some(index) = host.specs.iter().position(|c| c.name == name) else {
        return error(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("The model `{name}` does not exist. Models: {}", names(&host)),
        );
    };
    let admission = match host.acquire(index).await {
        Ok(a) => a,
        Err(Refusal { message, retry }) => {
            let mut response = error(StatusCode::SERVICE_UNAVAILABLE, "model_unavailable", message);
            if retry {
                let seconds = host.wait.as_secs().clamp(1, 60).to_string();
                if let Ok(v) = header::HeaderValue::from_str(&seconds) {
                    response.headers_mut().insert(header::RETRY_AFTER, v);
                }
            }
            return response;
        }
    };
    let Some(child) = host.child(index) else {
        // Admitted models have started; this is a restart's gap.
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "model_unavailable",
            format!("model `{name}` has not started"),
        );
    };
    match proxy::forward(&child.addr, "POST", path, body, admission).await {
        Ok(response) => response,
        Err(e) => error(
            StatusCode::BAD_GATEWAY,
            "model_unreachable",
            format!("model `{name}`: its deployment did not answer: {e:#}"),
        ),
    }
}

/// One model as `/v1/models` lists it.
fn model_card(host: &Host, index: usize) -> Value {
    let table = host.lock();
    let entry = &table.models[index];
    let child = &host.specs[index];
    let mut card = json!({
        "id": entry.name,
        "object": "model",
        "created": host.created,
        "owned_by": "tpctl",
        "root": child.model,
        "state": entry.state.name(),
        "resident_bytes": entry.resident(),
        "in_flight": entry.in_flight,
        "queued": host.counters[index].waiting.load(Ordering::Relaxed),
        "checkpoint": entry.checkpoint,
        "deployment": child.deployment,
    });
    if !entry.measured.is_empty() {
        card["resident_bytes_by_device"] = json!(entry.measured);
    }
    match &entry.state {
        super::State::Asleep { level: Some(level) } => card["sleep_level"] = json!(level),
        super::State::Failed(why) => card["failure"] = json!(why),
        _ => {}
    }
    card
}

async fn models(State(host): State<Arc<Host>>) -> Response {
    let data: Vec<Value> = (0..host.children.len()).map(|i| model_card(&host, i)).collect();
    let (budget, resident, gpus) = {
        let table = host.lock();
        (table.budget, table.resident(), table.gpu_budgets.clone())
    };
    let mut listed = json!({
        "object": "list",
        "data": data,
        "memory_budget_bytes": budget,
        "resident_bytes": resident,
    });
    if !gpus.is_empty() {
        listed["gpu_memory_budget_bytes"] = json!(gpus);
    }
    Json(listed).into_response()
}

async fn model_by_id(State(host): State<Arc<Host>>, Path(id): Path<String>) -> Response {
    match host.specs.iter().position(|c| c.name == id) {
        Some(i) => Json(model_card(&host, i)).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("The model `{id}` does not exist. Models: {}", names(&host)),
        ),
    }
}

/// 200 while some model can serve (awake or asleep), 503 while the models load and when
/// every model failed.
async fn health(State(host): State<Arc<Host>>) -> Response {
    let table = host.lock();
    let states: serde_json::Map<String, Value> =
        table.models.iter().map(|m| (m.name.clone(), json!(m.state.name()))).collect();
    let alive = table.models.iter().any(|m| !matches!(m.state, super::State::Failed(_)));
    let (status, word) = if table.starting {
        (StatusCode::SERVICE_UNAVAILABLE, "loading")
    } else if alive {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "failed")
    };
    (status, Json(json!({"status": word, "models": states}))).into_response()
}

/// The host's metrics in the Prometheus text format, each labelled with its model, then the
/// models' own (vLLM's families labelled `model_name`), joined family by family.
async fn metrics(State(host): State<Arc<Host>>) -> Response {
    let mut own = Vec::new();
    for i in 0..host.children.len() {
        let Some(child) = host.child(i) else { continue };
        if matches!(host.lock().models[i].state, super::State::Failed(_)) {
            continue;
        }
        let fetch = proxy::forward(&child.addr, "GET", "/metrics", Bytes::new(), ());
        let Ok(Ok(answer)) = tokio::time::timeout(METRICS_TIMEOUT, fetch).await else {
            continue;
        };
        if answer.status() != StatusCode::OK {
            continue;
        }
        let body = axum::body::to_bytes(answer.into_body(), 16 << 20);
        if let Ok(Ok(body)) = tokio::time::timeout(METRICS_TIMEOUT, body).await {
            own.push((child.name.clone(), String::from_utf8_lossy(&body).into_owned()));
        }
    }
    let mut out = host_metrics(&host);
    out.push_str(&super::metrics::merge(&own));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// The host's own families: per model, requests, queue, swaps, bytes; and the budget.
fn host_metrics(host: &Host) -> String {
    let table = host.lock().clone();
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, value: &dyn Fn(usize) -> String| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, m) in table.models.iter().enumerate() {
            let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", m.name, value(i));
        }
    };
    let c = &host.counters;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    family("tpctl_host_requests_total", "counter", "Requests routed to the model.", &|i| {
        load(&c[i].requests).to_string()
    });
    family(
        "tpctl_host_queue_depth",
        "gauge",
        "Requests waiting for the model to be ready.",
        &|i| c[i].waiting.load(Ordering::Relaxed).to_string(),
    );
    family("tpctl_host_in_flight", "gauge", "Requests the model is answering.", &|i| {
        table.models[i].in_flight.to_string()
    });
    family(
        "tpctl_host_swaps_in_total",
        "counter",
        "Wakeups of the model to serve a request.",
        &|i| load(&c[i].swaps_in).to_string(),
    );
    family("tpctl_host_swaps_out_total", "counter", "Sleeps of the model to make room.", &|i| {
        load(&c[i].swaps_out).to_string()
    });
    family("tpctl_host_swap_in_seconds_total", "counter", "Time spent waking the model.", &|i| {
        format!("{:.6}", load(&c[i].swap_in_us) as f64 / 1e6)
    });
    family(
        "tpctl_host_swap_out_seconds_total",
        "counter",
        "Time spent putting the model to sleep.",
        &|i| format!("{:.6}", load(&c[i].swap_out_us) as f64 / 1e6),
    );
    family(
        "tpctl_host_restarts_total",
        "counter",
        "Starts of the model after its deployment failed.",
        &|i| load(&c[i].restarts).to_string(),
    );
    family(
        "tpctl_host_failed_swaps_total",
        "counter",
        "Sleeps and wakeups of the model that failed.",
        &|i| load(&c[i].failed_swaps).to_string(),
    );
    family(
        "tpctl_host_kept_requests_total",
        "counter",
        "Requests paused (keep) by a sleep that made room before they finished; they continue once the model wakes.",
        &|i| load(&c[i].kept).to_string(),
    );
    family(
        "tpctl_host_level2_sleeps_total",
        "counter",
        "Sleeps at level 2 instead of 1: host memory could not hold the level-1 backup.",
        &|i| load(&c[i].level2).to_string(),
    );
    family(
        "tpctl_host_resident_bytes",
        "gauge",
        "Bytes the model counts against the memory budget.",
        &|i| table.models[i].resident().to_string(),
    );
    family("tpctl_host_model_awake", "gauge", "1 while the model is awake.", &|i| {
        u8::from(table.models[i].state == super::State::Awake).to_string()
    });
    let _ = writeln!(
        out,
        "# HELP tpctl_host_memory_budget_bytes The memory budget the models share.\n# TYPE tpctl_host_memory_budget_bytes gauge\ntpctl_host_memory_budget_bytes {}",
        table.budget
    );
    out
}
