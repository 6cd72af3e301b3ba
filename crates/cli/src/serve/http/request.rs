//! Request bodies and their checks: the sampling fields both generation endpoints share,
//! the prompts (text, token ids, chat messages through the template) and the [`Job`] the
//! engine gets, every failure a 4xx naming the field.

use super::{Api, ApiError, MAX_CHOICES};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::Value;
use session::SamplingParams;
use std::time::{SystemTime, UNIX_EPOCH};

/// Which endpoint a request came to: the shape of its answer's objects.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    pub(super) fn id(self, n: u64) -> String {
        match self {
            Kind::Completion => format!("cmpl-{n}"),
            Kind::Chat => format!("chatcmpl-{n}"),
        }
    }
}

/// Sampling fields shared by both generation endpoints.
#[derive(Debug, Default, Deserialize)]
pub(super) struct SamplingBody {
    pub(super) model: Option<String>,
    pub(super) max_tokens: Option<u64>,
    pub(super) temperature: Option<f32>,
    pub(super) top_p: Option<f32>,
    pub(super) top_k: Option<i64>,
    pub(super) seed: Option<u64>,
    pub(super) stop: Option<Value>,
    pub(super) stop_token_ids: Option<Vec<u64>>,
    pub(super) ignore_eos: Option<bool>,
    pub(super) n: Option<u64>,
    pub(super) stream: Option<bool>,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) presence_penalty: Option<f32>,
    pub(super) frequency_penalty: Option<f32>,
    pub(super) repetition_penalty: Option<f32>,
    pub(super) min_p: Option<f32>,
    /// Token id (as a string, OpenAI's form) to a bias added to its logit.
    pub(super) logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// Completions: the number of alternatives; chat: whether (see [`super::logprobs`]).
    pub(super) logprobs: Option<Value>,
    /// Chat: the number of alternatives.
    pub(super) top_logprobs: Option<Value>,
    /// vLLM's: the number of alternatives per prompt token (see [`super::logprobs`]).
    pub(super) prompt_logprobs: Option<Value>,
    /// Structured outputs (see [`super::structured`]): OpenAI's `response_format`, vLLM's
    /// `guided_*` fields and `structured_outputs`.
    pub(super) response_format: Option<Value>,
    pub(super) guided_json: Option<Value>,
    pub(super) guided_regex: Option<Value>,
    pub(super) guided_choice: Option<Value>,
    pub(super) guided_grammar: Option<Value>,
    pub(super) structured_outputs: Option<Value>,
    /// Every other field: accepted only where it asks for nothing ([`check_unsupported`]).
    #[serde(flatten)]
    pub(super) other: serde_json::Map<String, Value>,
}

/// Refuses the fields this server does not implement unless their value asks for nothing
/// (`"best_of": 1`, `"suffix": ""`, ...): a client never gets a silently
/// different answer. `user` is accepted and ignored, as it only labels the request.
pub(super) fn check_unsupported(
    other: &serde_json::Map<String, Value>,
) -> std::result::Result<(), ApiError> {
    for (key, value) in other {
        let neutral = match key.as_str() {
            // vLLM's choice of grammar engine: there is one, and the output is constrained.
            "user" | "parallel_tool_calls" | "guided_decoding_backend" => true,
            "best_of" => value.is_null() || value.as_u64() == Some(1),
            "suffix" => value.is_null() || value.as_str() == Some(""),
            "tools" | "functions" => value.is_null() || value.as_array().is_some_and(Vec::is_empty),
            "function_call" => value.is_null() || value == "none",
            // With `tools`: answers are parsed for calls ("auto") or not ("none").
            "tool_choice" => value.is_null() || value == "none" || value == "auto",
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
pub(super) struct StreamOptions {
    pub(super) include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(super) struct CompletionBody {
    pub(super) prompt: Option<Value>,
    /// Answer the prompt's text before the completion.
    pub(super) echo: Option<bool>,
    #[serde(flatten)]
    pub(super) sampling: SamplingBody,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatBody {
    pub(super) messages: Option<Vec<ChatMessageBody>>,
    pub(super) max_completion_tokens: Option<u64>,
    /// Tool definitions, rendered into the prompt by the chat template; with `tool_choice`
    /// `"auto"` (the default) the answer's calls (in the format its chat template teaches:
    /// Hermes, Mistral or Llama 3 JSON) become `tool_calls` (`serve::tools`), with `"none"`
    /// it is left as text.
    pub(super) tools: Option<Vec<Value>>,
    /// Extra variables of the chat template (vLLM's field: `{"enable_thinking": false}`).
    pub(super) chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Open the assistant's turn (vLLM's field; default true).
    pub(super) add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    pub(super) sampling: SamplingBody,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatMessageBody {
    pub(super) role: String,
    pub(super) content: Option<Value>,
    /// Every other field (`tool_calls`, `tool_call_id`, `name`, ...), passed to the template.
    #[serde(flatten)]
    pub(super) other: serde_json::Map<String, Value>,
}

/// What a chat's template is rendered with besides its messages.
#[derive(Debug, Default)]
pub(super) struct ChatOptions<'a> {
    pub(super) add_generation_prompt: bool,
    pub(super) tools: Option<&'a [Value]>,
    pub(super) kwargs: Option<&'a serde_json::Map<String, Value>>,
}

/// The body as JSON of type `T`, or the 4xx that says why not.
pub(super) fn parse<T: serde::de::DeserializeOwned>(
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

/// A prompt's token ids, and its text when it came as text.
pub(super) type GivenPrompt = (Vec<u32>, Option<String>);

/// A checked request, ready for the engine.
pub(super) struct Job {
    /// The prompts: one, or a completion's list (each answered with `n` choices).
    pub(super) prompts: Vec<Vec<u32>>,
    pub(super) params: SamplingParams,
    /// Choices per prompt: independent sequences of it (seeds `seed`, `seed + 1`, ...).
    pub(super) n: usize,
    /// The text each prompt's choices begin with (`echo`: the prompt's), one per prompt.
    pub(super) echo: Option<Vec<String>>,
    /// Stop strings, matched on the generated text.
    pub(super) stop_text: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// Parse the answer for tool calls written in this format (a chat with `tools` and
    /// `tool_choice` `"auto"`).
    pub(super) tool_calls: Option<crate::serve::tools::ToolFormat>,
    /// Alternatives per prompt token in vLLM's `prompt_logprobs` list, when asked for.
    pub(super) prompt_top: Option<usize>,
    /// Alternatives per prompt token in the echoed prompt's `logprobs` (`echo` with
    /// `logprobs`), when asked for.
    pub(super) echo_top: Option<usize>,
    /// Answer the prompt alone (`echo` with `max_tokens` 0): the one token the engine
    /// generates is dropped.
    pub(super) prompt_only: bool,
    /// Said in the answer's `warning` field (and logged): the request asked for something the
    /// model cannot honour as asked (`tools` its chat template does not render).
    pub(super) warning: Option<String>,
}

impl Job {
    pub(super) fn wants_logprobs(&self) -> bool {
        self.params.logprobs.is_some()
    }
}

impl Api {
    pub(super) fn check_model(&self, model: Option<&str>) -> std::result::Result<(), ApiError> {
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

    pub(super) fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, ApiError> {
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

    pub(super) fn check_id(&self, what: &str, id: u64) -> std::result::Result<u32, ApiError> {
        if id >= self.0.vocab as u64 {
            return Err(ApiError::invalid(
                "invalid_token_id",
                format!("{what}: token id {id} is outside the vocabulary of {}", self.0.vocab),
            ));
        }
        Ok(id as u32)
    }

    /// The prompt of a request that takes one (`/tokenize`): a string, token ids, or a
    /// one-element list of either.
    pub(super) fn completion_prompt(
        &self,
        prompt: Option<&Value>,
    ) -> std::result::Result<Vec<u32>, ApiError> {
        let mut prompts = self.completion_prompts(prompt)?;
        if prompts.len() > 1 {
            return Err(ApiError::invalid(
                "invalid_prompt",
                format!("`prompt` holds {} prompts; this endpoint takes one", prompts.len()),
            ));
        }
        Ok(prompts.remove(0).0)
    }

    /// The prompts of a completion, each with its text when it came as one (OpenAI's forms):
    /// a string, a list of token ids (one prompt), or a list of prompts, each a string or a
    /// list of token ids. A bad element is named (`prompt[3]`).
    pub(super) fn completion_prompts(
        &self,
        prompt: Option<&Value>,
    ) -> std::result::Result<Vec<GivenPrompt>, ApiError> {
        match prompt {
            None | Some(Value::Null) => {
                Err(ApiError::invalid("missing_prompt", "`prompt` is required"))
            }
            Some(Value::String(s)) => Ok(vec![(self.encode(s)?, Some(s.clone()))]),
            Some(Value::Array(items)) if items.is_empty() => {
                Err(ApiError::invalid("empty_prompt", "the prompt is empty"))
            }
            Some(Value::Array(items)) if items.iter().any(Value::is_number) => {
                Ok(vec![(self.prompt_ids("prompt", items)?, None)])
            }
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    let name = format!("prompt[{i}]");
                    let named = |mut e: ApiError| {
                        e.message = format!("{name}: {}", e.message);
                        e
                    };
                    match item {
                        Value::String(s) => Ok((self.encode(s).map_err(named)?, Some(s.clone()))),
                        Value::Array(ids) if ids.is_empty() => {
                            Err(ApiError::invalid("empty_prompt", format!("{name} is empty")))
                        }
                        Value::Array(ids) => Ok((self.prompt_ids(&name, ids)?, None)),
                        _ => Err(ApiError::invalid(
                            "invalid_prompt",
                            format!("{name} must be a string or a list of token ids"),
                        )),
                    }
                })
                .collect(),
            Some(_) => Err(ApiError::invalid(
                "invalid_prompt",
                "`prompt` must be a string, a list of token ids, or a list of prompts",
            )),
        }
    }

    /// The token ids of one prompt given as ids (`name` says which in an error).
    fn prompt_ids(&self, name: &str, items: &[Value]) -> std::result::Result<Vec<u32>, ApiError> {
        items
            .iter()
            .map(|v| match v.as_u64() {
                Some(id) => self.check_id(name, id),
                None if v.is_number() => Err(ApiError::invalid(
                    "invalid_token_id",
                    format!("{name}: token id {v} is not a non-negative integer"),
                )),
                None => Err(ApiError::invalid(
                    "invalid_prompt",
                    format!("{name}: {v} is not a token id (a list of ids is one prompt)"),
                )),
            })
            .collect()
    }

    /// The prompt of a chat: its messages (and tools, template arguments) through the
    /// model's chat template.
    pub(super) fn chat_prompt(&self, body: &ChatBody) -> std::result::Result<Vec<u32>, ApiError> {
        let tools = body.tools.as_deref().filter(|t| !t.is_empty());
        let options = ChatOptions {
            add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
            tools,
            kwargs: body.chat_template_kwargs.as_ref(),
        };
        self.chat_prompt_with(body.messages.as_deref(), &options)
    }

    /// Whether the chat template leaves a request's `tools` out: `prompt` (rendered with them)
    /// is the same without them, so the model never sees them.
    pub(super) fn template_ignores_tools(
        &self,
        body: &ChatBody,
        prompt: &[u32],
    ) -> std::result::Result<bool, ApiError> {
        let options = ChatOptions {
            add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
            tools: None,
            kwargs: body.chat_template_kwargs.as_ref(),
        };
        Ok(self.chat_prompt_with(body.messages.as_deref(), &options)? == prompt)
    }

    /// The token ids of `messages` through the chat template with `options`.
    pub(super) fn chat_prompt_with(
        &self,
        messages: Option<&[ChatMessageBody]>,
        options: &ChatOptions<'_>,
    ) -> std::result::Result<Vec<u32>, ApiError> {
        let messages = match messages {
            None => return Err(ApiError::invalid("missing_messages", "`messages` is required")),
            Some([]) => return Err(ApiError::invalid("empty_messages", "`messages` is empty")),
            Some(m) => m,
        };
        let mut chat: Vec<Value> = Vec::with_capacity(messages.len());
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
            let mut message = m.other.clone();
            message.insert("role".into(), m.role.clone().into());
            message.insert("content".into(), content.into());
            chat.push(Value::Object(message));
        }
        let request = text::tokenizer::chat::ChatRequest {
            messages: chat,
            tools: options.tools.map(|t| Value::Array(t.to_vec())),
            add_generation_prompt: options.add_generation_prompt,
            extra: options.kwargs.cloned().unwrap_or_default(),
        };
        let text = self.0.tokenizer.render_chat(&request).map_err(|e| {
            ApiError::invalid(
                "chat_template",
                format!("cannot apply the model's chat template: {e}"),
            )
        })?;
        self.encode(&text)
    }

    /// Checks the sampling fields against the prompts and the context.
    pub(super) fn job(
        &self,
        kind: Kind,
        prompts: Vec<Vec<u32>>,
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
        if prompts.len() * n > MAX_CHOICES as usize {
            return Err(ApiError::invalid(
                "too_many_choices",
                format!(
                    "{} prompts with `n` {n} ask for {} choices; one request answers at most {MAX_CHOICES}",
                    prompts.len(),
                    prompts.len() * n
                ),
            ));
        }
        check_unsupported(&s.other)?;
        let constraint = match super::structured::requested(s)? {
            Some((field, grammar)) => {
                self.check_grammar(&field, &grammar)?;
                Some(grammar)
            }
            None => None,
        };
        let (lp, top_lp) = (s.logprobs.as_ref(), s.top_logprobs.as_ref());
        let logprobs = match kind {
            Kind::Completion => super::super::logprobs::completion_request(lp, top_lp)?,
            Kind::Chat => super::super::logprobs::chat_request(lp, top_lp)?,
        };
        let prompt_top = super::super::logprobs::prompt_request(s.prompt_logprobs.as_ref())?;
        if prompt_top.is_some() && s.stream == Some(true) {
            return Err(ApiError::invalid(
                "invalid_logprobs",
                "`prompt_logprobs` is not streamed: ask without `stream` (as vLLM)",
            ));
        }
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
            return Err(ApiError::invalid("invalid_max_tokens", "`max_tokens` must be at least 1 (a completion with `echo` may ask 0: the prompt alone)"));
        }
        for (i, prompt) in prompts.iter().enumerate() {
            if prompt.len() as u64 + max_tokens > context as u64 {
                let which =
                    if prompts.len() > 1 { format!("prompt[{i}]: ") } else { String::new() };
                return Err(ApiError::invalid(
                    "context_length_exceeded",
                    format!(
                        "{which}this model's maximum context length is {context} tokens, but {} were requested ({} in the prompt, {max_tokens} for the completion)",
                        prompt.len() as u64 + max_tokens,
                        prompt.len()
                    ),
                ));
            }
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
            prompt_logprobs: prompt_top,
            constraint,
        };
        Ok(Job {
            prompts,
            params,
            n,
            echo: None,
            stop_text,
            stream: s.stream.unwrap_or(false),
            include_usage: s.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
            tool_calls: None,
            prompt_top,
            echo_top: None,
            prompt_only: false,
            warning: None,
        })
    }
}

impl Api {
    /// The text `echo` repeats: the prompt as given, or its token ids decoded.
    pub(super) fn prompt_text(
        &self,
        given: Option<&str>,
        ids: &[u32],
    ) -> std::result::Result<String, ApiError> {
        if let Some(text) = given {
            return Ok(text.to_owned());
        }
        self.0.tokenizer.decode(ids, false).map_err(|e| {
            ApiError::invalid("invalid_prompt", format!("the prompt ids do not decode: {e}"))
        })
    }
}
