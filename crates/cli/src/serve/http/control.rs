//! The sleep routes: `POST /sleep`, `/wake_up`, `/update_weights` and `GET /is_sleeping`,
//! run on the deployment's coordinator through the control module, as the socket does.

use super::{asleep_tags, no_control, Api, ApiError};
use crate::control::{SleepArgs, UpdateArgs, WakeupArgs};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
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
}

/// Parses `tags` (comma-separated and/or repeated), `level` (1 or 2), `mode` and `verify`;
/// `allowed` names the keys this route takes.
fn op_query(query: Pairs, allowed: &[&str]) -> std::result::Result<OpQuery, ApiError> {
    let Query(pairs) = query.map_err(|e| {
        ApiError::invalid("invalid_query", format!("the query does not parse: {}", e.body_text()))
    })?;
    let mut out = OpQuery { tags: Vec::new(), opts: OpOptions::default(), model: None };
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
async fn control_op(api: Api, action: Action, query: Pairs) -> Response {
    let Some(controller) = api.0.control.clone() else {
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
        Action::Update | Action::Revert => controller
            .update_weights(&UpdateArgs { model: q.model.unwrap_or_default(), mode: q.opts.mode }),
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
            let (status, kind, code) = if e.client_error {
                let code = match action {
                    Action::Update | Action::Revert => "invalid_checkpoint",
                    Action::Wakeup => "invalid_request",
                    Action::Sleep => "invalid_tags",
                };
                (StatusCode::BAD_REQUEST, "invalid_request_error", code)
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

pub(super) async fn sleep(State(api): State<Api>, query: Pairs) -> Response {
    control_op(api, Action::Sleep, query).await
}

pub(super) async fn wake_up(State(api): State<Api>, query: Pairs) -> Response {
    control_op(api, Action::Wakeup, query).await
}

/// `POST /update_weights?model=PATH&mode=wait`: every rank loads its shard of the checkpoint
/// into its live weights (SGLang's `/update_weights_from_disk`, vLLM's `reload_weights`).
pub(super) async fn update_weights(State(api): State<Api>, query: Pairs) -> Response {
    control_op(api, Action::Update, query).await
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
