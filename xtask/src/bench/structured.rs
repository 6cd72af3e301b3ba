//! Structured-output benchmark: 8 concurrent streams that each follow a JSON schema against
//! 8 free streams, on a warm `tpctl serve` of the default model (Q4_1, one rank, 2 threads),
//! measured from an HTTP client. The schema (a long array of objects) cannot be complete within
//! the streams' tokens, so every step of every constrained stream computes a mask. The goal is
//! an aggregate decode rate of at least 0.9x the free streams' (the masks are computed while
//! the forward pass runs).
//!
//! Rounds alternate constrained and free; each figure is the best of [`ROUNDS`] rounds.

use super::serve::Server;
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

/// Rounds of each measurement; the best counts.
const ROUNDS: usize = 3;
/// Concurrent streams, their prompt length and the tokens each generates.
const STREAMS: usize = 8;
const PROMPT: usize = 32;
const DECODE: usize = 64;
/// How long one request may take.
const REQUEST_DEADLINE: Duration = Duration::from_secs(300);
/// The ratio the constrained streams should reach.
const GOAL: f64 = 0.9;

/// The schema every constrained stream follows: at least 64 people, each a name and an age.
fn schema() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "people", "strict": true, "schema": {
        "type": "array", "minItems": 64,
        "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
            "required": ["name", "age"], "additionalProperties": false}}}})
}

/// When one streamed request's first and last tokens arrived, from a shared start.
struct Arrivals {
    first: Duration,
    last: Duration,
}

/// One greedy streamed completion of `prompt` ids with the fields of `extra`, [`DECODE`]
/// tokens with `ignore_eos`.
fn stream(base: &str, prompt: &[u32], extra: &Value, start: Instant) -> Result<Arrivals> {
    let agent: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(REQUEST_DEADLINE)).build().into();
    let mut body = json!({
        "prompt": prompt, "max_tokens": DECODE, "ignore_eos": true,
        "temperature": 0.0, "stream": true,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    let response = agent.post(&format!("{base}/v1/completions")).send_json(&body)?;
    let reader = BufReader::new(response.into_body().into_reader());
    let (mut first, mut tokens) = (None, 0);
    for line in reader.lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let event: Value = serde_json::from_str(data).context("a streamed event")?;
        let ids = event["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
        if ids > 0 {
            first.get_or_insert_with(|| start.elapsed());
            tokens += ids;
        }
    }
    let last = start.elapsed();
    ensure!(tokens == DECODE, "the server streamed {tokens} tokens, {DECODE} were asked for");
    Ok(Arrivals { first: first.context("no token streamed")?, last })
}

/// The aggregate decode rate of every prompt streamed at once: the tokens after each
/// stream's first over the time from the last stream's first token to the last token.
fn aggregate(base: &str, prompts: &[Vec<u32>], extra: &Value) -> Result<f64> {
    let start = Instant::now();
    let all = std::thread::scope(|s| {
        let handles: Vec<_> =
            prompts.iter().map(|p| s.spawn(|| stream(base, p, extra, start))).collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?)
            .collect::<Result<Vec<_>>>()
    })?;
    let first = all.iter().map(|a| a.first).max().unwrap_or_default();
    let last = all.iter().map(|a| a.last).max().unwrap_or_default();
    Ok((prompts.len() * (DECODE - 1)) as f64 / (last - first).as_secs_f64())
}

pub(crate) fn run(json: bool) -> Result<()> {
    let model = crate::fetch_model::fetch_default()?;
    let tpctl = super::model::release_tpctl()?;
    // The rounds repeat the prompts: no prefix reuse, so each round computes them all.
    let server = Server::start(&tpctl, &model, (1, 1, 2), &["--no-prefix-caching"])?;
    // Ids of ordinary tokens, fixed: a deterministic walk over the vocabulary.
    let prompts: Vec<Vec<u32>> = (0..STREAMS as u32)
        .map(|s| (0..PROMPT as u32).map(|i| 200 + (s * 7919 + i * 104_729) % 40_000).collect())
        .collect();
    let (free_extra, constrained_extra) = (json!({}), json!({"response_format": schema()}));
    // Warm up both paths: the first request pays for lazily built state.
    aggregate(&server.base, &prompts[..1], &free_extra)?;
    aggregate(&server.base, &prompts[..1], &constrained_extra)?;
    let (mut free, mut constrained) = (0f64, 0f64);
    for _ in 0..ROUNDS {
        free = free.max(aggregate(&server.base, &prompts, &free_extra)?);
        constrained = constrained.max(aggregate(&server.base, &prompts, &constrained_extra)?);
    }
    drop(server);
    let ratio = constrained / free;
    let round = |x: f64, places: i32| (x * 10f64.powi(places)).round() / 10f64.powi(places);
    if json {
        let row = json!({
            "workload": "structured_outputs", "file": "Q4_1", "tp": 1, "cp": 1,
            "threads_per_rank": 2, "streams": STREAMS, "tokens": DECODE,
            "free_tok_s": round(free, 1), "json_schema_tok_s": round(constrained, 1),
            "ratio": round(ratio, 2), "goal": GOAL,
        });
        println!("{row}");
    } else {
        println!(
            "structured outputs: {STREAMS} streams x {DECODE} tokens (Q4_1, 1x1, 2 threads), each \
             following a json_schema, against {STREAMS} free streams"
        );
        println!(
            "free {free:.1} tok/s | json_schema {constrained:.1} tok/s | {ratio:.2}x (goal >= \
             {GOAL}x); best of {ROUNDS} rounds each"
        );
    }
    if ratio < GOAL {
        eprintln!(
            "warning: the json_schema streams ran at {ratio:.2}x the free ones, below {GOAL}x"
        );
    }
    Ok(())
}
