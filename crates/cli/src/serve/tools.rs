//! Tool calls in a chat answer, in the format the model's chat template asks for (as vLLM's
//! `--tool-call-parser`, chosen here from the template, [`ToolFormat::of_template`]):
//! - Hermes (Qwen2.5, Hermes, SmolLM3; vLLM's `hermes`): each call a JSON object
//!   `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`;
//! - Mistral (vLLM's `mistral`): `[TOOL_CALLS]` and then a JSON array of such objects;
//! - Llama 3.1+ (vLLM's `llama3_json`): the whole answer is a call `{"name": ...,
//!   "parameters": {...}}`, or several joined by `;`, maybe after `<|python_tag|>`.
//!
//! [`ToolText`] takes the answer's text as it streams: text before the format's marker is
//! content and passes through at once (a partial marker at a piece's end is held back until the
//! next piece shows what it is); from the marker on, text is held, and at the end it is parsed
//! into calls. Text that does not parse as calls is given back as content, so an answer is
//! never lost.

use serde_json::{json, Value};

const HERMES_START: &str = "<tool_call>";
const HERMES_END: &str = "</tool_call>";
const MISTRAL_START: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum ToolFormat {
    /// `<tool_call>{...}</tool_call>` blocks.
    #[default]
    Hermes,
    /// `[TOOL_CALLS][{...}, ...]`.
    Mistral,
    /// The answer is `{"name": ..., "parameters": ...}` (`;`-joined for several).
    Llama3Json,
}

impl ToolFormat {
    /// The format a chat template teaches: the marker it mentions (Hermes' tags win, since
    /// they are the most specific), Llama 3's `<|python_tag|>` or `ipython` role, else Hermes.
    pub(crate) fn of_template(template: Option<&str>) -> ToolFormat {
        let t = template.unwrap_or_default();
        if t.contains(HERMES_START) {
            ToolFormat::Hermes
        } else if t.contains(MISTRAL_START) {
            ToolFormat::Mistral
        } else if t.contains(PYTHON_TAG) || t.contains("ipython") {
            ToolFormat::Llama3Json
        } else {
            ToolFormat::Hermes
        }
    }
}

/// The grammar of an answer that is one call of `tools` (or of the one named `only`), in
/// `format`, for `tool_choice` `"required"` or a named function: the call's JSON is
/// constrained to the tool's name and its parameters' schema. `control` gives the id of a
/// marker that is a control token (written as that token, since no text produces it).
///
/// # Errors
/// A tool without a function name, or `only` naming no tool of the list.
pub(crate) fn call_grammar(
    format: ToolFormat,
    tools: &[Value],
    only: Option<&str>,
    control: impl Fn(&str) -> Option<u32>,
) -> Result<text::Grammar, String> {
    let arguments = match format {
        ToolFormat::Llama3Json => "parameters",
        ToolFormat::Hermes | ToolFormat::Mistral => "arguments",
    };
    let mut calls = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let function = &tool["function"];
        let name = function["name"]
            .as_str()
            .ok_or_else(|| format!("`tools[{i}].function.name` is missing"))?;
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let parameters = match &function["parameters"] {
            Value::Null => json!({"type": "object"}),
            p => p.clone(),
        };
        calls.push(json!({
            "type": "object",
            "properties": {"name": {"const": name}, arguments: parameters},
            "required": ["name", arguments],
            "additionalProperties": false,
        }));
    }
    if calls.is_empty() {
        let name = only.unwrap_or_default();
        return Err(format!("`tool_choice` names the function `{name}`, which is not in `tools`"));
    }
    let mut schema = if calls.len() == 1 { calls.remove(0) } else { json!({"anyOf": calls}) };
    schema["x-guidance"] = json!({"whitespace_flexible": false});
    let marker = |m: &str| match control(m) {
        Some(id) => format!("<[{id}]>"),
        None => Value::String(m.to_owned()).to_string(),
    };
    let start = match format {
        ToolFormat::Hermes => format!("{} call {}", marker(HERMES_START), marker(HERMES_END)),
        ToolFormat::Mistral => format!("{} \"[\" call \"]\"", marker(MISTRAL_START)),
        ToolFormat::Llama3Json => "call".to_owned(),
    };
    Ok(text::Grammar::Lark(format!("start: {start}\ncall: %json {schema}\n")))
}

/// One call: the function's name and its arguments as JSON text (OpenAI's form).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ToolCall {
    pub(crate) name: String,
    pub(crate) arguments: String,
}

impl ToolCall {
    /// OpenAI's `tool_calls[i]` object, with id `call_{request}_{i}`.
    pub(crate) fn to_json(&self, request: &str, i: usize) -> Value {
        json!({
            "index": i,
            "id": format!("call_{request}_{i}"),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

/// A chat answer's text on its way out, split into content and tool calls.
#[derive(Debug, Default)]
pub(crate) struct ToolText {
    format: ToolFormat,
    /// Content not passed on yet: a suffix that may begin the marker (for Llama 3, the
    /// answer's leading whitespace until its first character decides).
    held: String,
    /// From the first marker on.
    calls: Option<String>,
    /// Llama 3: the answer began as prose, so all of it is content.
    prose: bool,
}

impl ToolText {
    /// An answer whose calls are written in `format`.
    pub(crate) fn new(format: ToolFormat) -> ToolText {
        ToolText { format, ..ToolText::default() }
    }

    /// Takes the next piece of the answer; returns the text now known to be content.
    pub(crate) fn push(&mut self, piece: &str) -> String {
        if let Some(calls) = &mut self.calls {
            calls.push_str(piece);
            return String::new();
        }
        self.held.push_str(piece);
        let marker = match self.format {
            ToolFormat::Hermes => HERMES_START,
            ToolFormat::Mistral => MISTRAL_START,
            ToolFormat::Llama3Json => return self.push_llama3(),
        };
        if let Some(at) = self.held.find(marker) {
            self.calls = Some(self.held[at..].to_owned());
            self.held.truncate(at);
            return std::mem::take(&mut self.held);
        }
        // Hold back the longest end of the text that could start the marker.
        let keep = (1..marker.len())
            .rev()
            .find(|&n| {
                n <= self.held.len()
                    && self.held.is_char_boundary(self.held.len() - n)
                    && marker.starts_with(&self.held[self.held.len() - n..])
            })
            .unwrap_or(0);
        let content = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        content
    }

    /// Llama 3: a call is the whole answer, so its first character decides.
    fn push_llama3(&mut self) -> String {
        if self.prose {
            return std::mem::take(&mut self.held);
        }
        let start = self.held.trim_start();
        if start.is_empty() || (PYTHON_TAG.starts_with(start) && start != PYTHON_TAG) {
            return String::new();
        }
        if start.starts_with('{') || start.starts_with(PYTHON_TAG) {
            self.calls = Some(std::mem::take(&mut self.held));
            return String::new();
        }
        self.prose = true;
        std::mem::take(&mut self.held)
    }

    /// The end of the answer: the rest of the content, and the calls (none when the text
    /// from the marker on does not parse as calls: it is then content too).
    pub(crate) fn finish(self) -> (String, Vec<ToolCall>) {
        let Some(text) = self.calls else { return (self.held, Vec::new()) };
        let calls = match self.format {
            ToolFormat::Hermes => hermes_calls(&text),
            ToolFormat::Mistral => mistral_calls(&text),
            ToolFormat::Llama3Json => llama3_calls(&text),
        };
        match calls {
            Some(calls) => (self.held, calls),
            None => (self.held + &text, Vec::new()),
        }
    }
}

/// The calls in `text` (which starts with the marker): every `<tool_call>` block, the last
/// one's closing tag optional (the answer may end there); `None` when a block is not a call
/// or other text sits between them.
fn hermes_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim();
    while let Some(body) = rest.strip_prefix(HERMES_START) {
        let (inside, after) = match body.find(HERMES_END) {
            Some(end) => (&body[..end], &body[end + HERMES_END.len()..]),
            None => (body, ""),
        };
        calls.push(parse_call(&serde_json::from_str(inside.trim()).ok()?)?);
        rest = after.trim_start();
    }
    (rest.is_empty() && !calls.is_empty()).then_some(calls)
}

/// `[TOOL_CALLS]` and a JSON array of calls (or one call) filling the rest of the answer.
fn mistral_calls(text: &str) -> Option<Vec<ToolCall>> {
    let body = text.trim().strip_prefix(MISTRAL_START)?.trim();
    let calls = match serde_json::from_str(body).ok()? {
        Value::Array(items) => items.iter().map(parse_call).collect::<Option<Vec<_>>>()?,
        one => vec![parse_call(&one)?],
    };
    (!calls.is_empty()).then_some(calls)
}

/// The whole answer as calls: JSON objects joined by `;` (and whitespace), maybe after
/// `<|python_tag|>`.
fn llama3_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut rest = text.trim();
    rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest).trim_start();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = values.next()?.ok()?;
        calls.push(parse_call(&value)?);
        rest = rest[values.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": "f", "arguments": {...}}` (or `"parameters"`, or the arguments as a string).
fn parse_call(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_owned();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(args) => args.to_string(),
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer fed in pieces of every size gives the same content and calls as whole.
    fn split(text: &str) -> (String, Vec<ToolCall>) {
        split_as(ToolFormat::Hermes, text)
    }

    fn split_as(format: ToolFormat, text: &str) -> (String, Vec<ToolCall>) {
        let whole = {
            let mut t = ToolText::new(format);
            let mut content = t.push(text);
            let (rest, calls) = t.finish();
            content.push_str(&rest);
            (content, calls)
        };
        let chars: Vec<char> = text.chars().collect();
        for size in 1..=5 {
            let mut t = ToolText::new(format);
            let mut content = String::new();
            for piece in chars.chunks(size) {
                content.push_str(&t.push(&piece.iter().collect::<String>()));
            }
            let (rest, calls) = t.finish();
            content.push_str(&rest);
            assert_eq!((content, calls), whole, "pieces of {size}");
        }
        whole
    }

    #[test]
    fn calls_are_parsed_and_the_text_before_them_is_content() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"parameters\": null}</tool_call>";
        let (content, calls) = split(text);
        assert_eq!(content, "Let me look.\n");
        assert_eq!(
            calls,
            [
                ToolCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() },
                ToolCall { name: "now".into(), arguments: "{}".into() },
            ]
        );
        let j = calls[0].to_json("chatcmpl-7", 0);
        assert_eq!(j["id"], "call_chatcmpl-7_0");
        assert_eq!(j["function"]["arguments"], r#"{"city":"Paris"}"#);
        // The answer may end before the closing tag.
        let (_, calls) = split("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}");
        assert_eq!(calls, [ToolCall { name: "f".into(), arguments: r#"{"x": 1}"#.into() }]);
    }

    #[test]
    fn text_that_is_not_a_call_stays_content() {
        for text in [
            "No tools needed: 2 + 2 = 4. <tool_c is not a tag",
            "<tool_call>not json</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\"}</tool_call> and then prose",
            "ends with <tool",
            "multi-byte ✓ <tool_call>{\"name\": 3}",
        ] {
            let (content, calls) = split(text);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(content, text);
        }
    }

    #[test]
    fn mistral_and_llama3_calls_are_parsed_and_prose_stays_content() {
        let call = |name: &str, args: &str| ToolCall { name: name.into(), arguments: args.into() };
        let (content, calls) = split_as(
            ToolFormat::Mistral,
            "Sure. [TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}, {\"name\": \"now\", \"arguments\": {}}]",
        );
        assert_eq!(content, "Sure. ");
        assert_eq!(calls, [call("get_weather", r#"{"city":"Rome"}"#), call("now", "{}")]);
        let (content, calls) = split_as(
            ToolFormat::Llama3Json,
            "  <|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": \"1;2\"}}; {\"name\": \"b\", \"parameters\": {}}",
        );
        assert_eq!(content, "");
        assert_eq!(calls, [call("a", r#"{"x":"1;2"}"#), call("b", "{}")]);
        let (_, calls) =
            split_as(ToolFormat::Llama3Json, "{\"name\": \"c\", \"parameters\": {\"n\": 3}}");
        assert_eq!(calls, [call("c", r#"{"n":3}"#)]);
        for (format, text) in [
            (ToolFormat::Llama3Json, "The answer is {not a call}."),
            (ToolFormat::Llama3Json, "{\"no\": \"name\"}"),
            (ToolFormat::Llama3Json, "<|python_tag|>print(1)"),
            (ToolFormat::Mistral, "[TOOL_CALLS] nothing"),
            (ToolFormat::Mistral, "[TOOL_C and more"),
        ] {
            let (content, calls) = split_as(format, text);
            assert!(calls.is_empty(), "{format:?} {text}");
            assert_eq!(content, text, "{format:?}");
        }
    }

    #[test]
    fn the_format_follows_the_chat_template() {
        let of = |t: &str| ToolFormat::of_template(Some(t));
        assert_eq!(of("{{ '<tool_call>' }}{{ tool | tojson }}"), ToolFormat::Hermes);
        assert_eq!(of("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}"), ToolFormat::Mistral);
        assert_eq!(of("{%- if message.role == 'ipython' %}"), ToolFormat::Llama3Json);
        assert_eq!(of("plain"), ToolFormat::Hermes);
        assert_eq!(ToolFormat::of_template(None), ToolFormat::Hermes);
    }
}
