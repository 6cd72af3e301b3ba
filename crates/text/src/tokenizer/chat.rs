//! Chat templates rendered as Hugging Face's `apply_chat_template` renders them, so a prompt
//! is the same token for token as the one the model was trained with.
//!
//! Hugging Face renders with jinja2 (`trim_blocks` and `lstrip_blocks` on, loop controls), a
//! `tojson` filter that is Python's `json.dumps` (`", "` and `": "` separators, non-ASCII kept,
//! keys in their order, no HTML escaping), and the globals `raise_exception(message)` and
//! `strftime_now(format)`. The template sees `messages` (whole objects: `tool_calls`, lists of
//! content parts, any field a client sent), `tools`, `add_generation_prompt`, `bos_token`,
//! `eos_token` and any extra keyword argument. Here the same with minijinja and its
//! Python-compatibility methods (`.strip()`, `.split()`, `.startswith()`, `.items()`, ...).

use crate::error::{Error, Result};
use minijinja::value::{Kwargs, Value, ValueKind};
use std::fmt::Write;

/// What a chat template is rendered with.
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    /// The conversation: objects with at least `role` and `content`.
    pub messages: Vec<serde_json::Value>,
    /// Tool (function) definitions, if the request has any.
    pub tools: Option<serde_json::Value>,
    /// Whether to open the assistant's turn.
    pub add_generation_prompt: bool,
    /// Extra variables (vLLM's `chat_template_kwargs`: `enable_thinking`, ...). They cannot
    /// replace the variables above.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The variables the renderer sets itself; an extra argument may not shadow them.
const RESERVED: [&str; 5] =
    ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

/// Renders `source` for `request`, with the special tokens' texts and `now` (local time) for
/// `strftime_now`.
///
/// # Errors
/// [`Error::ChatTemplate`] when the template does not parse, raises, or fails to render, or an
/// extra argument would replace a variable the renderer sets.
pub fn render(
    source: &str,
    request: &ChatRequest,
    bos_token: &str,
    eos_token: &str,
    now: chrono::NaiveDateTime,
) -> Result<String> {
    if let Some(key) = request.extra.keys().find(|k| RESERVED.contains(&k.as_str())) {
        return Err(Error::ChatTemplate(format!(
            "the extra template argument `{key}` would replace the renderer's own"
        )));
    }
    let env = environment(now);
    let template =
        env.template_from_str(source).map_err(|e| Error::ChatTemplate(format!("parsing: {e}")))?;
    let mut context: serde_json::Map<String, serde_json::Value> = request.extra.clone();
    context.insert("messages".into(), serde_json::Value::Array(request.messages.clone()));
    context.insert("tools".into(), request.tools.clone().unwrap_or(serde_json::Value::Null));
    context.insert("add_generation_prompt".into(), request.add_generation_prompt.into());
    context.insert("bos_token".into(), bos_token.into());
    context.insert("eos_token".into(), eos_token.into());
    template
        .render(Value::from_serialize(&context))
        .map_err(|e| Error::ChatTemplate(format!("rendering: {e}")))
}

/// Checks that `source` parses as a chat template (before any rank starts).
///
/// # Errors
/// [`Error::ChatTemplate`] with the parser's message and line.
pub fn check(source: &str) -> Result<()> {
    let env = environment(chrono::NaiveDateTime::default());
    env.template_from_str(source)
        .map(|_| ())
        .map_err(|e| Error::ChatTemplate(format!("parsing: {e}")))
}

/// The environment Hugging Face renders in, with `now` for `strftime_now`.
fn environment(now: chrono::NaiveDateTime) -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, _> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", move |format: String| now.format(&format).to_string());
    env.add_filter("tojson", tojson);
    env
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, as Hugging Face's `tojson`.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn dump(
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    // Python's separators: ", " and ": " on one line; "," and a new line when indenting.
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = value.as_i64() {
                let _ = write!(out, "{i}");
            } else {
                let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float(x));
            }
        }
        ValueKind::String => quote(value.as_str().unwrap_or(""), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                dump(item, indent, sort_keys, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if sort_keys {
                keys.sort_by_key(ToString::to_string);
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                quote(&key.to_string(), out);
                out.push_str(": ");
                dump(&value.get_item(key)?, indent, sort_keys, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => quote(&value.to_string(), out),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn quote(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it (`1.0`, `0.5`, `1e-07`, `Infinity` in JSON).
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let plain = format!("{x:?}");
    // Rust's shortest round-trip form matches Python's except for exponents: Rust writes
    // `1e-7`, Python `1e-07`.
    match plain.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => plain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_and_strings_are_written_as_python_writes_them() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(1e-7), "1e-07");
        assert_eq!(python_float(2.5e20), "2.5e+20");
        let mut s = String::new();
        quote("a\"b\\c\nd\u{1}é", &mut s);
        assert_eq!(s, "\"a\\\"b\\\\c\\nd\\u0001é\"");
    }
}
