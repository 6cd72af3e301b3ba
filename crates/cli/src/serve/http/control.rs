//! The sleep routes: `POST /sleep`, `/wake_up`, `/update_weights`, `/pause`, `/resume` and
//! `GET /is_sleeping`, `/is_paused`, `/get_weight_version`, and the update from memory
//! (`POST /start_weight_update`, `/update_weights` with a bucket, `/finish_weight_update`,
//! `/abort_weight_update`), run on the deployment's coordinator through the control module,
//! as the socket does.

use super::{asleep_tags, no_control, Api, ApiError};
use crate::control::ipc_bucket::{IpcBucket, IpcHandle};
use crate::control::{
    BucketArgs, ErrorWire, FinishUpdateArgs, PauseArgs, SleepArgs, StartUpdateArgs, UpdateArgs,
    WakeupArgs,
};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use session::sleep::{Action, OpOptions, QuiesceMode};

/// A route's query as its pairs in order (repeated keys kept), through axum's `Query`
/// (`serde_urlencoded`: `+` is a space, percent-escapes decoded); a query that does not
/// parse is a 400.
type Pairs = std::result::Result<Query<Vec<(String, String)>>, QueryRejection>;

/// What `/sleep` and `/wake_up` take from their query.
struct OpQuery {
    tags: Vec<String>,
    opts: OpOptions,
    /// The checkpoint of a weight update.
    model: Option<String>,
    /// The version a weight update gives the weights.
    version: Option<String>,
    /// Whether `mode` was given (a pause's default is `abort`, not a sleep's `wait`).
    mode_given: bool,
}

/// Parses `tags` (comma-separated and/or repeated), `level` (1 or 2), `mode` and `verify`;
/// `allowed` names the keys this route takes.
fn op_query(query: Pairs, allowed: &[&str]) -> std::result::Result<OpQuery, ApiError> {
    let Query(pairs) = query.map_err(|e| {
        ApiError::invalid("invalid_query", format!("the query does not parse: {}", e.body_text()))
    })?;
    let mut out = OpQuery {
        tags: Vec::new(),
        opts: OpOptions::default(),
        model: None,
        version: None,
        mode_given: false,
    };
    for (key, value) in pairs {
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
            "weight_version" => {
                crate::control::check_version(&value)
                    .map_err(|e| ApiError::invalid("invalid_weight_version", e))?;
                out.version = Some(value.clone());
            }
            // vLLM's older form of `mode=wait` (false: its default, abort).
            "wait_for_inflight_requests" => {
                out.mode_given = true;
                out.opts.mode = match value.as_str() {
                    "" | "true" | "1" => QuiesceMode::Wait,
                    "false" | "0" => QuiesceMode::Abort,
                    other => {
                        return Err(ApiError::invalid(
                            "invalid_query",
                            format!("wait_for_inflight_requests `{other}`: expected true or false"),
                        ))
                    }
                }
            }
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
                out.mode_given = true;
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
async fn control_op(api: Api, action: Action, query: Pairs) -> Response {
    let Some(controller) = api.0.control.clone() else {
        return no_control().into_response();
    };
    let allowed: &[&str] = match action {
        Action::Sleep => &["tags", "level", "mode", "verify"],
        Action::Wakeup => &["tags", "model"],
        Action::Update | Action::Revert => &["model", "mode", "weight_version"],
    };
    let q = match op_query(query, allowed) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let run = tokio::task::spawn_blocking(move || match action {
        Action::Update | Action::Revert => controller.update_weights(&UpdateArgs {
            model: q.model.unwrap_or_default(),
            mode: q.opts.mode,
            weight_version: q.version,
        }),
        Action::Wakeup => controller.wakeup(&WakeupArgs { tags: q.tags, model: q.model }),
        Action::Sleep => controller.sleep(&SleepArgs {
            tags: q.tags,
            level: q.opts.level,
            mode: q.opts.mode,
            verify: q.opts.verify,
        }),
    })
    .await;
    match run {
        Ok(Ok(op)) => Json(op).into_response(),
        Ok(Err(e)) => {
            let codes = match action {
                Action::Update | Action::Revert => ("invalid_checkpoint", "update_failed"),
                Action::Wakeup => ("invalid_request", "sleep_failed"),
                Action::Sleep => ("invalid_tags", "sleep_failed"),
            };
            failed(e, codes)
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

/// A failed operation as OpenAI-style JSON with every failing rank and the outcome: a 400
/// with the first code for the caller's mistake, else a 500 with the second.
fn failed(e: ErrorWire, (client, server): (&'static str, &'static str)) -> Response {
    let (status, kind, code) = if e.client_error {
        (StatusCode::BAD_REQUEST, "invalid_request_error", client)
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "server_error", server)
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

pub(super) async fn sleep(State(api): State<Api>, query: Pairs) -> Response {
    control_op(api, Action::Sleep, query).await
}

pub(super) async fn wake_up(State(api): State<Api>, query: Pairs) -> Response {
    control_op(api, Action::Wakeup, query).await
}

/// `POST /update_weights?model=PATH&mode=wait`: every rank loads its shard of the checkpoint
/// into its live weights (SGLang's `/update_weights_from_disk`, vLLM's `reload_weights`).
/// With a body `{"update_info": {"path": "/dev/shm/b0.safetensors"}}` instead (vLLM's weight
/// transfer), a bucket of the update from memory that `/start_weight_update` opened; or the
/// bucket's tensors as CUDA IPC handles of the trainer's GPU memory: `{"update_info": {"names":
/// [...], "dtype_names": [...], "shapes": [...], "ipc_handles": [{"device": UUID, "handle":
/// BASE64, "offset": BYTES}, ...]}}` (see [`crate::control::ipc_bucket`]).
pub(super) async fn update_weights(
    State(api): State<Api>,
    query: Pairs,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    // No body, or an empty object (what clients send with `json={}`): a checkpoint reload.
    let bucket = body.as_ref().map_or(true, |b| {
        let blank = b.iter().all(u8::is_ascii_whitespace);
        let empty = serde_json::from_slice::<Value>(b).is_ok_and(|v| v == json!({}));
        !blank && !empty
    });
    if !bucket {
        return control_op(api, Action::Update, query).await;
    }
    /// A file (`path`), or the tensors' CUDA IPC handles in vLLM's field names.
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Info {
        path: Option<String>,
        names: Option<Vec<String>>,
        dtype_names: Option<Vec<String>>,
        shapes: Option<Vec<Vec<usize>>>,
        ipc_handles: Option<Vec<IpcHandle>>,
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        update_info: Info,
    }
    if query.map_or(true, |Query(pairs)| !pairs.is_empty()) {
        let why = "update_weights takes a checkpoint (?model=PATH, no body) or a bucket of the \
                   open update from memory (a JSON body, no query), not both";
        return ApiError::invalid("invalid_query", why).into_response();
    }
    let body: Body = match super::request::parse(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let Info { path, names, dtype_names, shapes, ipc_handles } = body.update_info;
    let ipc = match (names, dtype_names, shapes, ipc_handles) {
        (None, None, None, None) => None,
        (Some(names), Some(dtype_names), Some(shapes), Some(ipc_handles)) => {
            Some(IpcBucket { names, dtype_names, shapes, ipc_handles })
        }
        _ => {
            let why = "update_info: a bucket of CUDA IPC handles takes all of `names`, \
                       `dtype_names`, `shapes` and `ipc_handles`";
            return ApiError::invalid("invalid_request_error", why).into_response();
        }
    };
    let args = BucketArgs { path, ipc };
    staging_op(api, move |c| c.weight_bucket(&args).map(|s| json!(s))).await
}

/// `POST /start_weight_update?weight_version=V`: opens an update from memory.
pub(super) async fn start_weight_update(State(api): State<Api>, query: Pairs) -> Response {
    let q = match op_query(query, &["weight_version"]) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let args = StartUpdateArgs { weight_version: q.version };
    staging_op(api, move |c| c.start_weight_update(&args).map(|s| json!(s))).await
}

/// `POST /finish_weight_update?weight_version=V&mode=wait`: commits the open update on every
/// rank (two-phase) and answers its receipt.
pub(super) async fn finish_weight_update(State(api): State<Api>, query: Pairs) -> Response {
    let q = match op_query(query, &["weight_version", "mode"]) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let args = FinishUpdateArgs { weight_version: q.version, mode: q.opts.mode };
    staging_op(api, move |c| c.finish_weight_update(&args).map(|op| json!(op))).await
}

/// `POST /abort_weight_update`: drops the open update; nothing changed.
pub(super) async fn abort_weight_update(State(api): State<Api>, query: Pairs) -> Response {
    if let Err(e) = op_query(query, &[]) {
        return e.into_response();
    }
    staging_op(api, |c| c.abort_weight_update().map(|s| json!(s))).await
}

/// Runs a step of an update from memory on a blocking thread: its answer, a 400 for the
/// caller's mistake, a 500 naming every failing rank for a failed commit.
async fn staging_op(
    api: Api,
    op: impl FnOnce(&crate::control::Controller) -> std::result::Result<Value, ErrorWire>
        + Send
        + 'static,
) -> Response {
    let Some(controller) = api.0.control.clone() else {
        return no_control().into_response();
    };
    match tokio::task::spawn_blocking(move || op(&controller)).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => failed(e, ("invalid_update", "update_failed")),
        Err(join) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "update_failed",
            format!("the weight update did not finish: {join}"),
        )
        .into_response(),
    }
}

pub(super) async fn is_sleeping(State(api): State<Api>) -> Response {
    match &api.0.control {
        None => no_control().into_response(),
        Some(c) => {
            let asleep = asleep_tags(&c.coordinator().state()).is_some();
            Json(json!({"is_sleeping": asleep})).into_response()
        }
    }
}

/// `POST /pause?mode=abort|wait|keep` (vLLM's; `wait_for_inflight_requests=true` is `wait`):
/// generation stops at a step boundary, memory stays, nothing is admitted until `/resume`.
pub(super) async fn pause(State(api): State<Api>, query: Pairs) -> Response {
    let Some(controller) = api.0.control.clone() else {
        return no_control().into_response();
    };
    let q = match op_query(query, &["mode", "wait_for_inflight_requests"]) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let args = if q.mode_given { PauseArgs { mode: q.opts.mode } } else { PauseArgs::default() };
    match tokio::task::spawn_blocking(move || controller.pause(&args)).await {
        Ok(Ok(changed)) => Json(json!({"paused": true, "changed": changed})).into_response(),
        Ok(Err(e)) => {
            let body = json!({"error": {
                "message": e.message, "type": "server_error", "code": "pause_failed", "param": null,
            }});
            (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response()
        }
        Err(join) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "pause_failed",
            format!("the pause did not finish: {join}"),
        )
        .into_response(),
    }
}

/// `POST /resume`: generation runs again after `/pause`.
pub(super) async fn resume(State(api): State<Api>, query: Pairs) -> Response {
    let Some(controller) = api.0.control.clone() else {
        return no_control().into_response();
    };
    if let Err(e) = op_query(query, &[]) {
        return e.into_response();
    }
    match tokio::task::spawn_blocking(move || controller.coordinator().resume()).await {
        Ok(changed) => Json(json!({"paused": false, "changed": changed})).into_response(),
        Err(join) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "resume_failed",
            format!("the resume did not finish: {join}"),
        )
        .into_response(),
    }
}

/// `GET /is_paused`.
pub(super) async fn is_paused(State(api): State<Api>) -> Response {
    match &api.0.control {
        None => no_control().into_response(),
        Some(c) => Json(json!({"is_paused": c.coordinator().is_paused()})).into_response(),
    }
}

/// `GET /get_weight_version` (SGLang's): the live weights' version.
pub(super) async fn get_weight_version(State(api): State<Api>) -> Response {
    Json(json!({"weight_version": &*api.0.bridge.weight_version().get()})).into_response()
}
