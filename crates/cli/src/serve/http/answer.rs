//! Answers: the generation endpoints, each choice's events collected into one OpenAI
//! response or streamed as SSE chunks, stop strings cut from the text, log-probabilities
//! shaped per endpoint.

use super::super::bridge::{Event, Events};
use super::super::logprobs::Scored;
use super::super::tools::{call_grammar, ToolFormat, ToolText};
use super::request::{parse, ChatBody, CompletionBody, Job, Kind};
use super::structured::{self, ToolChoice};
use super::{unix_now, Api, ApiError, DEFAULT_COMPLETION_TOKENS};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use session::{FinishReason, RankedLogprobs, SamplingParams, TokenLogprobs};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

/// The OpenAI name of a finish reason.
pub(super) fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::StopToken => "stop",
        FinishReason::Cancelled | FinishReason::Aborted => "abort",
        FinishReason::Rejected => "rejected",
    }
}

pub(super) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

pub(super) async fn completions(
    State(api): State<Api>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Response, ApiError> {
    let arrival = Instant::now();
    let body: CompletionBody = parse(body)?;
    api.check_model(body.sampling.model.as_deref())?;
    let prompts = api.completion_prompts(body.prompt.as_ref())?;
    let max = body.sampling.max_tokens;
    let default_max = api.0.defaults.map_or(DEFAULT_COMPLETION_TOKENS, |d| d.max_tokens);
    let echo = match body.echo {
        Some(true) => Some(
            prompts
                .iter()
                .map(|(ids, text)| api.prompt_text(text.as_deref(), ids))
                .collect::<std::result::Result<Vec<_>, _>>()?,
        ),
        _ => None,
    };
    let prompts = prompts.into_iter().map(|(ids, _)| ids).collect();
    // `echo` with `max_tokens` 0 answers the prompt alone (lm-eval's loglikelihood asks so):
    // the engine generates one token, which the answer drops, as vLLM does.
    let prompt_only = echo.is_some() && max == Some(0);
    let max = if prompt_only { Some(1) } else { max };
    let mut job = api.job(Kind::Completion, prompts, &body.sampling, max, default_max.into())?;
    if echo.is_some() {
        // `echo` with `logprobs`: the prompt's tokens are scored too, in the same shape.
        job.echo_top = job.params.logprobs;
        job.params.prompt_logprobs = job.params.prompt_logprobs.max(job.echo_top);
    }
    job.prompt_only = prompt_only;
    job.echo = echo;
    generate(api, job, Kind::Completion, arrival).await
}

pub(super) async fn chat_completions(
    State(api): State<Api>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<Response, ApiError> {
    let arrival = Instant::now();
    let mut body: ChatBody = parse(body)?;
    api.check_model(body.sampling.model.as_deref())?;
    let tools = body.tools.as_deref().filter(|t| !t.is_empty());
    let choice = body.sampling.other.remove("tool_choice");
    let choice = structured::tool_choice(choice.as_ref(), tools.is_some())?;
    let prompt = api.chat_prompt(&body)?;
    let max = body.max_completion_tokens.or(body.sampling.max_tokens);
    // Without a limit a chat reply may fill the context (OpenAI's default).
    let room = api.0.context.saturating_sub(prompt.len()) as u64;
    let ignored = tools.is_some() && api.template_ignores_tools(&body, &prompt)?;
    let mut job = api.job(Kind::Chat, vec![prompt], &body.sampling, max, room)?;
    if ignored {
        let warning = "the model's chat template does not render `tools`: the prompt is the same \
                       without them, so the model does not see them (a call in its answer is \
                       still parsed)";
        tracing::warn!("a chat request's tools are left out of the prompt: {warning}");
        job.warning = Some(warning.to_owned());
    }
    let format = ToolFormat::of_template(api.0.tokenizer.chat_template());
    match (choice, tools) {
        (ToolChoice::Auto, Some(_)) => job.tool_calls = Some(format),
        (ToolChoice::Forced(name), Some(tools)) => {
            if job.params.constraint.is_some() {
                return Err(ApiError::invalid(
                    "invalid_tool_choice",
                    "`tool_choice` forces a tool call, which cannot be combined with a structured output",
                ));
            }
            let tokenizer = &api.0.tokenizer;
            let control =
                |marker: &str| tokenizer.token_id(marker).filter(|&id| tokenizer.is_control(id));
            let grammar = call_grammar(format, tools, name.as_deref(), control)
                .map_err(|e| ApiError::invalid("invalid_tool_choice", e))?;
            api.check_grammar("tool_choice", &grammar)?;
            job.params.constraint = Some(grammar);
            job.tool_calls = Some(format);
        }
        _ => {}
    }
    generate(api, job, Kind::Chat, arrival).await
}

/// Runs `job` and answers it; `arrival` (when its HTTP request came) starts the clock of its
/// metrics, so a wait for a wakeup counts in them.
pub(super) async fn generate(
    api: Api,
    mut job: Job,
    kind: Kind,
    arrival: Instant,
) -> std::result::Result<Response, ApiError> {
    api.wait_awake().await?;
    let prompt_tokens = job.prompts.iter().map(Vec::len).sum();
    let (stream, include_usage) = (job.stream, job.include_usage);
    let warning = job.warning.take();
    let scores = job.wants_logprobs() || job.params.prompt_logprobs.is_some();
    let scorer = scores.then(|| Scorer(api.0.tokenizer.clone()));
    // One sequence per prompt and choice, all in the batch together, in OpenAI's order
    // (choice `i` of prompt `p` is `p * n + i`); dropping them cancels the rest.
    let mut choices = Vec::with_capacity(job.prompts.len() * job.n);
    for (prompt, ids) in job.prompts.iter().enumerate() {
        for i in 0..job.n as u64 {
            let seed = job.params.seed.wrapping_add(i);
            let params = SamplingParams { seed, ..job.params.clone() };
            choices.push(Submitted {
                events: api.0.bridge.submit(ids.clone(), params, arrival)?,
                prompt,
            });
        }
    }
    let id = kind.id(choices[0].events.id);
    let created = unix_now();
    let model = api.0.model_name.clone();
    let answer = Answer {
        kind,
        stops: job.stop_text,
        scorer,
        echo: job.echo,
        tool_calls: job.tool_calls,
        prompts: Arc::new(job.prompts),
        prompt_top: job.prompt_top,
        echo_top: job.echo_top,
        prompt_only: job.prompt_only,
    };
    if stream {
        let version = api.0.bridge.weight_version().clone();
        let header = Header { id, created, model, prompt_tokens, include_usage, warning, version };
        let events = sse(choices, header, answer);
        return Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response());
    }
    let mut out = Vec::with_capacity(choices.len());
    let mut completion_tokens = 0;
    // A chat's prompt log-probabilities (vLLM's, at the top of the answer).
    let mut chat_prompt = Value::Null;
    // The version of the weights that computed the answer's last token (the live one when it
    // has none).
    let mut version = api.0.bridge.weight_version().get();
    for (index, choice) in choices.into_iter().enumerate() {
        let stops = StopText::new(answer.stops.clone());
        let mut c = collect(choice.events, stops, answer.scorer.clone()).await?;
        if answer.prompt_only {
            let (text, tokens, reason) = (String::new(), Vec::new(), FinishReason::Length);
            let (scored, prompt, versions) = (Some(Vec::new()), c.prompt, Versions::default());
            c = Collected { text, tokens, reason, scored, prompt, versions };
        }
        completion_tokens += c.tokens.len();
        let text = match answer.echo(choice.prompt) {
            Some(prompt) => format!("{prompt}{}", c.text),
            None => c.text,
        };
        let logprobs = match (kind, c.scored, answer.echo_top) {
            (Kind::Completion, scored, Some(top)) => {
                let prompt = answer.scored_prompt(choice.prompt, &c.prompt, top);
                let prompt: Vec<Scored> = prompt.into_iter().map(|(s, _)| s).collect();
                let first = answer.first_text(choice.prompt);
                super::super::logprobs::completion_echoed(
                    &first,
                    &prompt,
                    &scored.unwrap_or_default(),
                )
            }
            (_, None, _) => Value::Null,
            (Kind::Completion, Some(s), None) => super::super::logprobs::completion(&s, 0),
            (Kind::Chat, Some(s), _) => super::super::logprobs::chat(&s),
        };
        let prompt_logprobs = answer.prompt_top.map(|top| {
            let scored = answer.scored_prompt(choice.prompt, &c.prompt, top);
            super::super::logprobs::vllm_prompt(&answer.prompts[choice.prompt], &scored, top)
        });
        let (tokens, reason) = (c.tokens, c.reason);
        if let Some(v) = c.versions.last() {
            version = v.clone();
        }
        let changes = c.versions.changes();
        out.push(match kind {
            Kind::Completion => {
                let mut choice = json!({"index": index, "text": text, "token_ids": tokens, "logprobs": logprobs, "finish_reason": finish_name(reason)});
                if let Some(p) = prompt_logprobs {
                    choice["prompt_logprobs"] = p;
                }
                if let Some(changes) = changes {
                    choice["weight_versions"] = changes;
                }
                choice
            }
            Kind::Chat => {
                if let (Some(p), true) = (prompt_logprobs, chat_prompt.is_null()) {
                    chat_prompt = p;
                }
                let (message, finish) = chat_message(text, reason, answer.tool_calls, &id);
                let mut choice = json!({"index": index, "message": message, "token_ids": tokens, "logprobs": logprobs, "finish_reason": finish});
                if let Some(changes) = changes {
                    choice["weight_versions"] = changes;
                }
                choice
            }
        });
    }
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    let mut body = json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "system_fingerprint": &*version,
        "weight_version": &*version,
        "choices": out,
        "usage": usage(prompt_tokens, completion_tokens),
    });
    if !chat_prompt.is_null() {
        body["prompt_logprobs"] = chat_prompt;
    }
    if let Some(warning) = warning {
        body["warning"] = warning.into();
    }
    Ok(Json(body).into_response())
}

/// A chat answer's `message` and finish reason: with `tool_calls`, the answer's calls are
/// parsed out of its text ([`ToolText`]) and the reason is `tool_calls` when there are some.
fn chat_message(
    text: String,
    reason: FinishReason,
    tool_calls: Option<ToolFormat>,
    id: &str,
) -> (Value, &'static str) {
    let Some(format) = tool_calls else {
        return (json!({"role": "assistant", "content": text}), finish_name(reason));
    };
    let mut parsed = ToolText::new(format);
    let mut content = parsed.push(&text);
    let (rest, calls) = parsed.finish();
    content.push_str(&rest);
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": content}), finish_name(reason));
    }
    let calls: Vec<Value> = calls.iter().enumerate().map(|(i, c)| c.to_json(id, i)).collect();
    let content = (!content.trim().is_empty()).then_some(content);
    (json!({"role": "assistant", "content": content, "tool_calls": calls}), "tool_calls")
}

/// One choice's sequence in the engine: its events, and which of the request's prompts it
/// answers.
pub(super) struct Submitted {
    events: Events,
    prompt: usize,
}

/// How a request's choices are answered: the endpoint's shape, the stop strings, the
/// log-probabilities' token texts, the echoed prompts and whether to parse tool calls.
#[derive(Clone)]
pub(super) struct Answer {
    kind: Kind,
    stops: Vec<String>,
    scorer: Option<Scorer>,
    /// The text of each prompt, when `echo` repeats it.
    echo: Option<Vec<String>>,
    /// How the answer's tool calls are written, when they are parsed out of it.
    tool_calls: Option<ToolFormat>,
    /// The request's prompts.
    prompts: Arc<Vec<Vec<u32>>>,
    /// Alternatives per token of vLLM's `prompt_logprobs`, when asked for.
    prompt_top: Option<usize>,
    /// Alternatives per token of the echoed prompt's `logprobs`, when asked for.
    echo_top: Option<usize>,
    /// Answer the prompt alone (`echo` with `max_tokens` 0).
    prompt_only: bool,
}

impl Answer {
    /// The echoed text of prompt `prompt`, when the request asked for it.
    fn echo(&self, prompt: usize) -> Option<&str> {
        self.echo.as_ref().and_then(|e| e.get(prompt)).map(String::as_str)
    }

    /// The text of prompt `prompt`'s first token (decoded alone).
    fn first_text(&self, prompt: usize) -> String {
        let first = self.prompts[prompt].first().copied();
        match (&self.scorer, first) {
            (Some(s), Some(id)) => s.text(id),
            _ => String::new(),
        }
    }

    /// Prompt `prompt`'s tokens from the second on, scored by `ranked` (the engine's, one
    /// per token) with `top` alternatives each, and their ranks.
    fn scored_prompt(
        &self,
        prompt: usize,
        ranked: &[RankedLogprobs],
        top: usize,
    ) -> Vec<(Scored, u32)> {
        let Some(scorer) = &self.scorer else { return Vec::new() };
        let ids = self.prompts[prompt].iter().skip(1);
        ids.zip(ranked)
            .filter_map(|(&id, r)| {
                let mut lp = r.logprobs.clone();
                lp.top.truncate(top);
                scorer.score(id, Some(lp)).map(|s| (s, r.rank))
            })
            .collect()
    }
}

/// Token texts for log-probabilities: each token decoded alone.
#[derive(Clone)]
pub(super) struct Scorer(std::sync::Arc<text::Tokenizer>);

impl Scorer {
    /// A token's text, decoded alone.
    pub(super) fn text(&self, token: u32) -> String {
        self.0.decode(&[token], false).unwrap_or_default()
    }

    pub(super) fn score(&self, token: u32, logprobs: Option<TokenLogprobs>) -> Option<Scored> {
        let decode = |id: u32| self.0.decode(&[id], false).unwrap_or_default();
        let bytes = |id: u32| self.0.token_bytes(id).unwrap_or_default();
        logprobs.map(|lp| Scored::new(token, lp, decode, bytes))
    }
}

/// A request's answer: its text, tokens, finish reason, each token's log-probabilities and
/// its prompt's, when the request asked for them.
pub(super) struct Collected {
    text: String,
    tokens: Vec<u32>,
    reason: FinishReason,
    scored: Option<Vec<Scored>>,
    /// The prompt's tokens from the second on.
    prompt: Vec<RankedLogprobs>,
    /// The weights' versions that computed the tokens: the index of the first token of each.
    versions: Versions,
}

/// The versions of the weights that computed a choice's tokens, each with the index of its
/// first token: one entry unless a weight update ran in the middle (a pause with `keep`).
#[derive(Debug, Default)]
pub(super) struct Versions(Vec<(usize, Arc<str>)>);

impl Versions {
    /// Token `index` was computed by `version`.
    fn saw(&mut self, index: usize, version: &Arc<str>) {
        if self.0.last().is_none_or(|(_, v)| v != version) {
            self.0.push((index, version.clone()));
        }
    }

    /// The version of the last token, if any.
    fn last(&self) -> Option<&Arc<str>> {
        self.0.last().map(|(_, v)| v)
    }

    /// The changes as a choice shows them, when there was one:
    /// `[{"from_token": 0, "weight_version": "1"}, {"from_token": 7, "weight_version": "2"}]`.
    fn changes(&self) -> Option<Value> {
        (self.0.len() > 1).then(|| {
            self.0.iter().map(|(i, v)| json!({"from_token": i, "weight_version": &**v})).collect()
        })
    }
}

/// Waits for a request's end.
pub(super) async fn collect(
    mut rx: Events,
    mut stops: StopText,
    scorer: Option<Scorer>,
) -> std::result::Result<Collected, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let mut scored = scorer.as_ref().map(|_| Vec::new());
    let mut prompt = Vec::new();
    let mut versions = Versions::default();
    while let Some(event) = rx.recv().await {
        match event {
            Event::PromptLogprobs { tokens, .. } => prompt.extend(tokens),
            Event::Token { token, text: piece, logprobs, version } => {
                versions.saw(tokens.len(), &version);
                tokens.push(token);
                if let (Some(scorer), Some(all)) = (&scorer, &mut scored) {
                    all.extend(scorer.score(token, logprobs));
                }
                let (out, hit) = stops.push(&piece);
                text.push_str(&out);
                if hit {
                    // Dropping the events cancels the rest of the generation.
                    let reason = FinishReason::StopToken;
                    return Ok(Collected { text, tokens, reason, scored, prompt, versions });
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
                return Ok(Collected { text, tokens, reason, scored, prompt, versions });
            }
        }
    }
    Err(ApiError::engine_stopped())
}

/// Stop strings matched on a request's text as it comes: the text before the first match is
/// let through and the rest dropped (OpenAI's `stop`, the stop string not included). Text
/// that may be the beginning of a stop string is held back until the next piece decides.
#[derive(Debug, Default)]
pub(super) struct StopText {
    stops: Vec<String>,
    held: String,
}

impl StopText {
    pub(super) fn new(stops: Vec<String>) -> Self {
        StopText { stops, held: String::new() }
    }

    /// Takes the next piece: the text that can go out now, and whether a stop string ended
    /// the request.
    pub(super) fn push(&mut self, piece: &str) -> (String, bool) {
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
    pub(super) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// What every chunk of a stream repeats.
pub(super) struct Header {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) prompt_tokens: usize,
    pub(super) include_usage: bool,
    /// The request's warning ([`Job::warning`]), in every chunk.
    pub(super) warning: Option<String>,
    /// The live weights' version, for chunks that carry no token.
    pub(super) version: session::sleep::WeightVersion,
}

impl Header {
    /// A chunk of `choices`, whose tokens the weights of `version` computed.
    pub(super) fn chunk(&self, kind: Kind, choices: Value, version: &str) -> SseEvent {
        let object = match kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let mut value = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": version,
            "weight_version": version,
            "choices": choices,
        });
        if let Some(warning) = &self.warning {
            value["warning"] = warning.as_str().into();
        }
        SseEvent::default().data(value.to_string())
    }
}

/// The request's events as SSE chunks (every choice's, as they come), then the usage when
/// asked for, then `data: [DONE]`. A task per choice forwards them; they end early when the
/// client goes away, which cancels the requests (see [`Events`]).
pub(super) fn sse(
    choices: Vec<Submitted>,
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
            .map(|(index, submitted)| {
                let Submitted { events, prompt } = submitted;
                let choice =
                    Choice { index, prompt, header: header.clone(), answer: answer.clone() };
                tokio::spawn(choice.stream(events, tx.clone()))
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
                "system_fingerprint": &*header.version.get(),
                "weight_version": &*header.version.get(),
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
pub(super) struct Choice {
    index: usize,
    /// The request's prompt it answers.
    prompt: usize,
    header: Arc<Header>,
    answer: Answer,
}

impl Choice {
    /// Forwards this choice's events as chunks into `tx`; its completion tokens, or `None`
    /// when the client went away.
    pub(super) async fn stream(
        self,
        mut rx: Events,
        tx: tokio::sync::mpsc::Sender<std::result::Result<SseEvent, Infallible>>,
    ) -> Option<usize> {
        let Choice { index, prompt, header, answer } = self;
        let kind = answer.kind;
        // The version of the weights that computed this choice's latest token.
        let version = std::sync::Mutex::new(header.version.get());
        let version_now = || version.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let send = |choice: Value| {
            let tx = tx.clone();
            let chunk = header.chunk(kind, json!([choice]), &version_now());
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
        // Characters of the token texts so far (`text_offset`).
        let mut offset = 0;
        // With `echo` and `logprobs` the prompt's tokens are scored first: the engine sends
        // their log-probabilities before the first token.
        let mut early = None;
        let mut echoed = Value::Null;
        if let Some(top) = answer.echo_top {
            let mut ranked = Vec::new();
            while let Some(event) = rx.recv().await {
                match event {
                    Event::PromptLogprobs { tokens, .. } => ranked.extend(tokens),
                    other => {
                        early = Some(other);
                        break;
                    }
                }
            }
            let scored: Vec<Scored> =
                answer.scored_prompt(prompt, &ranked, top).into_iter().map(|(s, _)| s).collect();
            let first = answer.first_text(prompt);
            offset = first.chars().count()
                + scored.iter().map(|s| s.text.chars().count()).sum::<usize>();
            echoed = super::super::logprobs::completion_echoed(&first, &scored, &[]);
        }
        if let Some(text) = answer.echo(prompt) {
            if !send(piece(text, None, echoed)).await {
                return None;
            }
        }
        let mut stops = StopText::new(answer.stops.clone());
        // Content passes through; from a `<tool_call>` on, the text is held for the end.
        let mut tools = answer.tool_calls.map(ToolText::new);
        let mut completion_tokens = 0;
        let mut reason = None;
        loop {
            let event = match early.take() {
                Some(event) => event,
                None => match rx.recv().await {
                    Some(event) => event,
                    None => break,
                },
            };
            match event {
                Event::PromptLogprobs { .. } => {}
                // The prompt alone: the one generated token is not part of the answer.
                Event::Token { .. } if answer.prompt_only => {}
                Event::Token { token, text, logprobs, version: v } => {
                    let since = std::time::Instant::now();
                    *version.lock().unwrap_or_else(|e| e.into_inner()) = v;
                    completion_tokens += 1;
                    let scored = answer.scorer.as_ref().and_then(|s| s.score(token, logprobs));
                    let logprobs = match (kind, &scored) {
                        (_, None) => Value::Null,
                        (Kind::Completion, Some(s)) => {
                            let v =
                                super::super::logprobs::completion(std::slice::from_ref(s), offset);
                            offset += s.text.chars().count();
                            v
                        }
                        (Kind::Chat, Some(s)) => {
                            super::super::logprobs::chat(std::slice::from_ref(s))
                        }
                    };
                    let (mut text, hit) = stops.push(&text);
                    if let Some(tools) = &mut tools {
                        text = tools.push(&text);
                    }
                    // The chunk is made when `send` is called; its sending is not counted.
                    let sent = send(piece(&text, Some(token), logprobs));
                    rx.metrics().encoded(since.elapsed());
                    if !sent.await {
                        return None;
                    }
                    if hit {
                        reason = Some(FinishReason::StopToken);
                        break;
                    }
                }
                Event::Finished { reason: r, .. } => {
                    reason = Some(if answer.prompt_only { FinishReason::Length } else { r });
                    let mut rest = stops.finish();
                    if let Some(tools) = &mut tools {
                        rest = tools.push(&rest);
                    }
                    if !rest.is_empty() && !send(piece(&rest, None, Value::Null)).await {
                        return None;
                    }
                    break;
                }
            }
        }
        let Some(reason) = reason else {
            // The events ended without an end: the engine stopped. The choice ends with
            // `finish_reason: "error"` and the client hears why (an `error` event, as vLLM
            // sends) instead of a stream that ends like a normal one.
            let end = match kind {
                Kind::Completion => {
                    json!({"index": index, "text": "", "logprobs": null, "finish_reason": "error"})
                }
                Kind::Chat => {
                    json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": "error"})
                }
            };
            if send(end).await {
                let error = ApiError::engine_stopped().body().to_string();
                let _ = tx.send(Ok(SseEvent::default().data(error))).await;
            }
            return None;
        };
        let mut finish = finish_name(reason);
        if let Some(tools) = tools {
            let (rest, calls) = tools.finish();
            if !rest.is_empty() && !send(piece(&rest, None, Value::Null)).await {
                return None;
            }
            if !calls.is_empty() {
                let calls: Vec<Value> =
                    calls.iter().enumerate().map(|(i, c)| c.to_json(&header.id, i)).collect();
                let delta = json!({"index": index, "delta": {"tool_calls": calls}, "logprobs": null, "finish_reason": null});
                if !send(delta).await {
                    return None;
                }
                finish = "tool_calls";
            }
        }
        let last = match kind {
            Kind::Completion => {
                json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})
            }
        };
        send(last).await.then_some(completion_tokens)
    }
}
