//! Structured outputs: the request fields that constrain an answer to a grammar (OpenAI's
//! `response_format`, vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
//! and `structured_outputs`), and a chat's forced tool calls (`tool_choice` `"required"` or a
//! named function). Each grammar is compiled here before the request reaches the engine, so a
//! bad schema, regex or grammar is a 400 naming the problem.

use super::request::SamplingBody;
use super::{Api, ApiError};
use serde_json::Value;
use text::Grammar;

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid("invalid_structured_output", message)
}

/// A JSON schema given as an object (or as its JSON text, as vLLM also takes it).
fn schema(field: &str, value: &Value) -> Result<Grammar, ApiError> {
    match value {
        Value::String(text) => Ok(Grammar::JsonSchema(text.clone())),
        Value::Object(_) | Value::Bool(_) => Ok(Grammar::JsonSchema(value.to_string())),
        _ => Err(invalid(format!("`{field}` must be a JSON schema (an object)"))),
    }
}

fn string(field: &str, value: &Value) -> Result<String, ApiError> {
    value.as_str().map(str::to_owned).ok_or_else(|| invalid(format!("`{field}` must be a string")))
}

fn choices(field: &str, value: &Value) -> Result<Grammar, ApiError> {
    let items = value.as_array().ok_or_else(|| invalid(format!("`{field}` must be a list")))?;
    let strings = items
        .iter()
        .map(|v| v.as_str().map(str::to_owned))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| invalid(format!("`{field}` must be a list of strings")))?;
    Ok(Grammar::Choice(strings))
}

/// OpenAI's `response_format`: `text` (nothing), `json_object`, or `json_schema` with its
/// `schema` (`name` and `strict` accepted: the schema is always followed strictly).
fn response_format(value: &Value) -> Result<Option<Grammar>, ApiError> {
    match value.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            let inner = value.get("json_schema").ok_or_else(|| {
                invalid("`response_format` of type `json_schema` needs a `json_schema` object")
            })?;
            let schema_value = inner.get("schema").ok_or_else(|| {
                invalid(
                    "`response_format.json_schema.schema` is required: the JSON schema to follow",
                )
            })?;
            schema("response_format.json_schema.schema", schema_value).map(Some)
        }
        Some(other) => Err(invalid(format!(
            "`response_format` type `{other}`: expected `text`, `json_object` or `json_schema`"
        ))),
        None => Err(invalid("`response_format` needs a `type`")),
    }
}

/// vLLM's `structured_outputs` object: one of `json`, `regex`, `choice`, `grammar`,
/// `json_object`; its options that this engine's output already satisfies
/// (`disable_any_whitespace`: JSON is compact anyway; `disable_fallback`: there is one
/// engine) are accepted.
fn structured_outputs(value: &Value) -> Result<Vec<(String, Grammar)>, ApiError> {
    let object =
        value.as_object().ok_or_else(|| invalid("`structured_outputs` must be an object"))?;
    let mut found = Vec::new();
    for (key, v) in object {
        if v.is_null() {
            continue;
        }
        let field = format!("structured_outputs.{key}");
        let grammar = match key.as_str() {
            "json" => schema(&field, v)?,
            "regex" => Grammar::Regex(string(&field, v)?),
            "choice" => choices(&field, v)?,
            "grammar" => Grammar::Lark(string(&field, v)?),
            "json_object" if v == &Value::Bool(true) => Grammar::JsonObject,
            "json_object" if v == &Value::Bool(false) => continue,
            "disable_any_whitespace" | "disable_fallback" if v.is_boolean() => continue,
            _ => {
                return Err(invalid(format!(
                    "`{field}` is not supported: give one of `json`, `regex`, `choice`, `grammar`, `json_object`"
                )))
            }
        };
        found.push((field, grammar));
    }
    Ok(found)
}

/// The grammar a request's fields ask for, with the field that gave it.
///
/// # Errors
/// A 400 when a field is malformed or more than one asks for a grammar.
pub(super) fn requested(s: &SamplingBody) -> Result<Option<(String, Grammar)>, ApiError> {
    let mut found: Vec<(String, Grammar)> = Vec::new();
    if let Some(v) = s.response_format.as_ref().filter(|v| !v.is_null()) {
        if let Some(g) = response_format(v)? {
            found.push(("response_format".into(), g));
        }
    }
    if let Some(v) = s.guided_json.as_ref().filter(|v| !v.is_null()) {
        found.push(("guided_json".into(), schema("guided_json", v)?));
    }
    if let Some(v) = s.guided_regex.as_ref().filter(|v| !v.is_null()) {
        found.push(("guided_regex".into(), Grammar::Regex(string("guided_regex", v)?)));
    }
    if let Some(v) = s.guided_choice.as_ref().filter(|v| !v.is_null()) {
        found.push(("guided_choice".into(), choices("guided_choice", v)?));
    }
    if let Some(v) = s.guided_grammar.as_ref().filter(|v| !v.is_null()) {
        found.push(("guided_grammar".into(), Grammar::Lark(string("guided_grammar", v)?)));
    }
    if let Some(v) = s.structured_outputs.as_ref().filter(|v| !v.is_null()) {
        found.extend(structured_outputs(v)?);
    }
    if found.len() > 1 {
        let names: Vec<String> = found.iter().map(|(f, _)| format!("`{f}`")).collect();
        return Err(invalid(format!(
            "only one structured output may be asked for, but the request gives {}",
            names.join(" and ")
        )));
    }
    Ok(found.pop())
}

/// What a chat's `tool_choice` asks for.
pub(super) enum ToolChoice {
    /// `"none"`: the answer is text.
    None,
    /// `"auto"` (the default): calls in the answer are parsed out of it.
    Auto,
    /// `"required"` (`None`) or a named function: the answer is a call.
    Forced(Option<String>),
}

/// Reads `tool_choice`.
///
/// # Errors
/// A 400 for another value, or a forced call without `tools`.
pub(super) fn tool_choice(value: Option<&Value>, has_tools: bool) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::invalid(
            "invalid_tool_choice",
            "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    let choice = match value {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Forced(None),
            _ => return Err(bad()),
        },
        Some(v @ Value::Object(_)) => {
            let name = v["function"]["name"].as_str().ok_or_else(bad)?;
            ToolChoice::Forced(Some(name.to_owned()))
        }
        Some(_) => return Err(bad()),
    };
    if matches!(choice, ToolChoice::Forced(_)) && !has_tools {
        return Err(ApiError::invalid(
            "invalid_tool_choice",
            "`tool_choice` asks for a tool call, but the request has no `tools`",
        ));
    }
    Ok(choice)
}

impl Api {
    /// Compiles `grammar` as the engine will, so a bad one is the client's 400.
    ///
    /// # Errors
    /// A 400 naming `field` and what does not compile, or saying that this model's vocabulary
    /// has no grammar engine.
    pub(super) fn check_grammar(&self, field: &str, grammar: &Grammar) -> Result<(), ApiError> {
        let engine = self.0.grammars.as_ref().ok_or_else(|| {
            invalid(format!(
                "`{field}`: structured outputs are not available for this model (its tokenizer has no end-of-sequence token)"
            ))
        })?;
        engine.matcher(grammar).map(|_| ()).map_err(|e| invalid(format!("`{field}`: {e}")))
    }
}
