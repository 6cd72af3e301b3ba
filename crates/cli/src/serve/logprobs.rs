//! Log-probabilities in the API: what a request asks for, and the OpenAI shapes of the answer.
//!
//! - `/v1/completions` takes `"logprobs": N` (0 to [`MAX_TOP`]) and answers, per choice,
//!   `{"tokens": [..], "token_logprobs": [..], "top_logprobs": [{token: logprob, ..}, ..],
//!   "text_offset": [..]}`.
//! - `/v1/chat/completions` takes `"logprobs": true` and `"top_logprobs": N` and answers
//!   `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
//!   "bytes"}, ..]}, ..]}`.
//!
//! Streamed chunks carry the same objects for their own tokens. The numbers are the model's
//! own distribution ([`TokenLogprobs`]: before temperature, penalties and bias), as vLLM
//! reports by default.
//!
//! Prompt log-probabilities (each prompt token given the tokens before it; the first has
//! none): a completion with `echo` and `logprobs` lists the prompt's tokens before the
//! generated ones in the completions shape (`null` first, as OpenAI); vLLM's
//! `"prompt_logprobs": N` (both endpoints, not streamed) answers `prompt_logprobs`: `null`,
//! then per token a map from token id to `{"logprob", "rank", "decoded_token"}` of the
//! prompt's token and the `N` most likely (in each completion choice; at the top of a chat
//! answer, as vLLM).

use super::http::ApiError;
use serde_json::{json, Map, Value};
use session::TokenLogprobs;

/// The most alternatives a token may list (vLLM's default limit; OpenAI allows 20 in chat).
pub(super) const MAX_TOP: u64 = 20;

/// How many alternatives a completion request asks for with `logprobs` (`None`: no
/// log-probabilities).
pub(super) fn completion_request(
    logprobs: Option<&Value>,
    top_logprobs: Option<&Value>,
) -> Result<Option<usize>, ApiError> {
    if top_logprobs.is_some_and(|v| !v.is_null() && v.as_u64() != Some(0)) {
        return Err(ApiError::invalid(
            "invalid_logprobs",
            "`top_logprobs` is a chat field: a completion asks with `logprobs`: N",
        ));
    }
    match logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(v) => count("logprobs", v).map(Some),
    }
}

/// How many alternatives a chat request asks for (`logprobs: true`, `top_logprobs: N`).
pub(super) fn chat_request(
    logprobs: Option<&Value>,
    top_logprobs: Option<&Value>,
) -> Result<Option<usize>, ApiError> {
    let on = match logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => {
            return Err(ApiError::invalid(
                "invalid_logprobs",
                format!("`logprobs` {v}: a chat request says true or false"),
            ))
        }
    };
    let top = match top_logprobs {
        None | Some(Value::Null) => None,
        Some(v) => Some(count("top_logprobs", v)?),
    };
    match (on, top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, None | Some(0)) => Ok(None),
        (false, Some(_)) => {
            Err(ApiError::invalid("invalid_logprobs", "`top_logprobs` needs `logprobs`: true"))
        }
    }
}

/// How many alternatives vLLM's `prompt_logprobs` asks for per prompt token (`None`: none).
pub(super) fn prompt_request(prompt_logprobs: Option<&Value>) -> Result<Option<usize>, ApiError> {
    match prompt_logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(v) => count("prompt_logprobs", v).map(Some),
    }
}

fn count(field: &str, v: &Value) -> Result<usize, ApiError> {
    match v.as_u64() {
        Some(n) if n <= MAX_TOP => Ok(n as usize),
        _ => Err(ApiError::invalid(
            "invalid_logprobs",
            format!("`{field}` {v}: expected an integer from 0 to {MAX_TOP}"),
        )),
    }
}

/// One generated token with what the answer shows of it.
#[derive(Clone, Debug)]
pub(super) struct Scored {
    /// The token's own text (decoded alone).
    pub text: String,
    /// Its log-probabilities.
    pub logprobs: TokenLogprobs,
    /// The alternatives' texts, in the order of `logprobs.top`.
    pub top_texts: Vec<String>,
    /// The token's own bytes (for a part of a multi-byte character, not U+FFFD's).
    pub bytes: Vec<u8>,
    /// The alternatives' bytes, in the order of `logprobs.top`.
    pub top_bytes: Vec<Vec<u8>>,
}

impl Scored {
    /// `logprobs` of a token, with texts from `decode` (one token id to its text) and bytes
    /// from `bytes` (one token id to its own bytes).
    pub fn new(
        token: u32,
        logprobs: TokenLogprobs,
        decode: impl Fn(u32) -> String,
        bytes: impl Fn(u32) -> Vec<u8>,
    ) -> Self {
        let top_texts = logprobs.top.iter().map(|&(id, _)| decode(id)).collect();
        let top_bytes = logprobs.top.iter().map(|&(id, _)| bytes(id)).collect();
        Scored { text: decode(token), logprobs, top_texts, bytes: bytes(token), top_bytes }
    }
}

/// A float as JSON (`-inf`, which JSON cannot write, as the lowest finite f32, as vLLM does).
fn num(x: f32) -> Value {
    json!(if x.is_finite() { x } else { f32::MIN })
}

/// The completions shape of `tokens`; `offset` is the text offset (in characters) of the first.
pub(super) fn completion(tokens: &[Scored], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.text.chars().count();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut m = Map::new();
            for (text, &(_, lp)) in t.top_texts.iter().zip(&t.logprobs.top) {
                m.entry(text.clone()).or_insert_with(|| num(lp));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| num(t.logprobs.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

/// The completions shape of an echoed prompt's tokens (`first`, the first one's text, then
/// `prompt`, scored) followed by `generated`: the first token has `null` for its
/// log-probability and its alternatives, as nothing comes before it.
pub(super) fn completion_echoed(first: &str, prompt: &[Scored], generated: &[Scored]) -> Value {
    let all: Vec<Scored> = prompt.iter().chain(generated).cloned().collect();
    let mut out = completion(&all, first.chars().count());
    let front = |v: &mut Value, x: Value| {
        if let Some(list) = v.as_array_mut() {
            list.insert(0, x);
        }
    };
    front(&mut out["tokens"], json!(first));
    front(&mut out["token_logprobs"], Value::Null);
    front(&mut out["top_logprobs"], Value::Null);
    front(&mut out["text_offset"], json!(0));
    out
}

/// vLLM's `prompt_logprobs` of a prompt: `null` for its first token, then for each of
/// `scored` (its tokens from the second on, with their ranks) a map from token id to
/// `{"logprob", "rank", "decoded_token"}` of the prompt's own token and the `top` most likely.
pub(super) fn vllm_prompt(prompt: &[u32], scored: &[(Scored, u32)], top: usize) -> Value {
    let entry = |lp: f32, rank: usize, text: &str| json!({"logprob": num(lp), "rank": rank, "decoded_token": text});
    let mut out = vec![Value::Null];
    for (&token, (s, rank)) in prompt.iter().skip(1).zip(scored) {
        let mut m = Map::new();
        m.insert(token.to_string(), entry(s.logprobs.logprob, *rank as usize, &s.text));
        for (i, (text, &(id, lp))) in s.top_texts.iter().zip(&s.logprobs.top).take(top).enumerate()
        {
            m.entry(id.to_string()).or_insert_with(|| entry(lp, i + 1, text));
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
}

/// The chat shape of `tokens`: `bytes` are each token's own, so a client joins them into the
/// text even where a token is part of a character (whose `token` text reads U+FFFD).
pub(super) fn chat(tokens: &[Scored]) -> Value {
    let entry = |text: &str, bytes: &[u8], lp: f32| json!({"token": text, "logprob": num(lp), "bytes": bytes});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.text, &t.bytes, t.logprobs.logprob);
            e["top_logprobs"] = t
                .top_texts
                .iter()
                .zip(&t.top_bytes)
                .zip(&t.logprobs.top)
                .map(|((text, bytes), &(_, lp))| entry(text, bytes, lp))
                .collect();
            e
        })
        .collect();
    json!({ "content": content })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scored(text: &str, logprob: f32, top: &[(&str, u32, f32)]) -> Scored {
        Scored {
            text: text.into(),
            logprobs: TokenLogprobs { logprob, top: top.iter().map(|t| (t.1, t.2)).collect() },
            top_texts: top.iter().map(|t| t.0.to_owned()).collect(),
            bytes: text.as_bytes().to_vec(),
            top_bytes: top.iter().map(|t| t.0.as_bytes().to_vec()).collect(),
        }
    }

    #[test]
    fn requests_are_checked_per_endpoint() {
        let v = |j: Value| Some(j);
        assert_eq!(completion_request(None, None).unwrap(), None);
        assert_eq!(completion_request(v(json!(3)).as_ref(), None).unwrap(), Some(3));
        assert_eq!(completion_request(v(json!(0)).as_ref(), None).unwrap(), Some(0));
        for bad in [json!(21), json!(-1), json!(true), json!("2")] {
            let e = completion_request(Some(&bad), None).unwrap_err();
            assert!(e.message_text().contains("expected an integer from 0 to 20"), "{bad}");
        }
        assert!(completion_request(None, v(json!(2)).as_ref()).is_err());
        assert_eq!(completion_request(None, v(json!(0)).as_ref()).unwrap(), None);
        assert_eq!(chat_request(v(json!(true)).as_ref(), None).unwrap(), Some(0));
        assert_eq!(chat_request(v(json!(true)).as_ref(), v(json!(5)).as_ref()).unwrap(), Some(5));
        assert_eq!(chat_request(v(json!(false)).as_ref(), v(json!(0)).as_ref()).unwrap(), None);
        let e = chat_request(None, v(json!(2)).as_ref()).unwrap_err();
        assert!(e.message_text().contains("needs `logprobs`: true"));
        assert!(chat_request(v(json!(1)).as_ref(), None).is_err());
    }

    #[test]
    fn shapes_are_openais() {
        let tokens = [
            scored(" Pa", -0.5, &[(" Pa", 7, -0.5), (" Lo", 9, -1.25)]),
            scored("ris", f32::NEG_INFINITY, &[]),
        ];
        let c = completion(&tokens, 4);
        assert_eq!(c["tokens"], json!([" Pa", "ris"]));
        assert_eq!(c["token_logprobs"], json!([-0.5, f32::MIN]));
        assert_eq!(c["top_logprobs"], json!([{" Pa": -0.5, " Lo": -1.25}, {}]));
        assert_eq!(c["text_offset"], json!([4, 7]));
        let ch = chat(&tokens[..1]);
        assert_eq!(
            ch,
            json!({"content": [{"token": " Pa", "logprob": -0.5, "bytes": [32, 80, 97],
                "top_logprobs": [
                    {"token": " Pa", "logprob": -0.5, "bytes": [32, 80, 97]},
                    {"token": " Lo", "logprob": -1.25, "bytes": [32, 76, 111]}]}]})
        );
        // Echoed: the prompt's first token has nothing before it; offsets run on.
        let e = completion_echoed("The", &tokens[..1], &tokens[1..]);
        assert_eq!(e["tokens"], json!(["The", " Pa", "ris"]));
        assert_eq!(e["token_logprobs"], json!([null, -0.5, f32::MIN]));
        assert_eq!(e["top_logprobs"], json!([null, {" Pa": -0.5, " Lo": -1.25}, {}]));
        assert_eq!(e["text_offset"], json!([0, 3, 6]));
        // vLLM's: the prompt's token with its rank, then the alternatives (here 1).
        let v = vllm_prompt(&[4, 8], &[(tokens[0].clone(), 2)], 1);
        assert_eq!(
            v,
            json!([null, {"8": {"logprob": -0.5, "rank": 2, "decoded_token": " Pa"},
                          "7": {"logprob": -0.5, "rank": 1, "decoded_token": " Pa"}}])
        );
        // Half of `é`: the text reads U+FFFD, the bytes are the token's own.
        let half = Scored { bytes: vec![0xC3], ..scored("\u{fffd}", -0.1, &[]) };
        assert_eq!(chat(&[half])["content"][0]["bytes"], json!([195]));
    }
}
