//! Tool calls in a chat answer, in the Hermes format that the chat templates of Qwen2.5,
//! Hermes and SmolLM3 ask models for (vLLM's `--tool-call-parser hermes`): each call is a JSON
//! object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`.
//!
//! [`ToolText`] takes the answer's text as it streams: text before the first `<tool_call>` is
//! content and passes through at once (a partial `<tool_c` at a piece's end is held back until
//! the next piece shows what it is); from the marker on, text is held, and at the end it is
//! parsed into calls. Text that does not parse as calls is given back as content, so an answer
//! is never lost.

use serde_json::{json, Value};

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

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
    /// Content not passed on yet: a suffix that may begin the marker.
    held: String,
    /// From the first marker on.
    calls: Option<String>,
}

impl ToolText {
    /// Takes the next piece of the answer; returns the text now known to be content.
    pub(crate) fn push(&mut self, piece: &str) -> String {
        if let Some(calls) = &mut self.calls {
            calls.push_str(piece);
            return String::new();
        }
        self.held.push_str(piece);
        if let Some(at) = self.held.find(START) {
            self.calls = Some(self.held[at..].to_owned());
            self.held.truncate(at);
            return std::mem::take(&mut self.held);
        }
        // Hold back the longest end of the text that could start the marker.
        let keep = (1..START.len())
            .rev()
            .find(|&n| {
                n <= self.held.len()
                    && self.held.is_char_boundary(self.held.len() - n)
                    && START.starts_with(&self.held[self.held.len() - n..])
            })
            .unwrap_or(0);
        let content = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        content
    }

    /// The end of the answer: the rest of the content, and the calls (none when the text
    /// from the marker on does not parse as calls: it is then content too).
    pub(crate) fn finish(self) -> (String, Vec<ToolCall>) {
        let Some(text) = self.calls else { return (self.held, Vec::new()) };
        match parse_calls(&text) {
            Some(calls) => (self.held, calls),
            None => (self.held + &text, Vec::new()),
        }
    }
}

/// The calls in `text` (which starts with the marker): every `<tool_call>` block, the last
/// one's closing tag optional (the answer may end there); `None` when a block is not a call
/// or other text sits between them.
fn parse_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim();
    while let Some(body) = rest.strip_prefix(START) {
        let (inside, after) = match body.find(END) {
            Some(end) => (&body[..end], &body[end + END.len()..]),
            None => (body, ""),
        };
        calls.push(parse_call(inside.trim())?);
        rest = after.trim_start();
    }
    (rest.is_empty() && !calls.is_empty()).then_some(calls)
}

/// `{"name": "f", "arguments": {...}}` (or `"parameters"`, or the arguments as a string).
fn parse_call(json: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json).ok()?;
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
        let whole = {
            let mut t = ToolText::default();
            let mut content = t.push(text);
            let (rest, calls) = t.finish();
            content.push_str(&rest);
            (content, calls)
        };
        let chars: Vec<char> = text.chars().collect();
        for size in 1..=5 {
            let mut t = ToolText::default();
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
}
