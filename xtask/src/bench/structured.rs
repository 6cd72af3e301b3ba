//! Structured-output benchmark: 8 concurrent streams that each follow a JSON schema against
//! 8 free streams, on a warm `tpctl serve` of the default model (Q4_1, one rank, 2 threads),
//! measured from an HTTP client. The schema (a long array of objects) cannot be complete within
//! the streams' tokens, so every step of every constrained stream computes a mask. The goal is
//! an aggregate decode rate of at least 0.9x the free streams' (the masks are computed while
//! the forward pass runs).
//!
//! Rounds alternate constrained and free; each figure is the best of [`ROUNDS`] rounds.

use super::serve::{stream_with, Server, DECODE};
use anyhow::Result;
use serde_json::{json, Value};
use std::time::Instant;

/// Rounds of each measurement; the best counts.
const ROUNDS: usize = 3;
/// Concurrent streams and their prompt length (each generates the serve benchmark's
/// [`DECODE`] tokens).
const STREAMS: usize = 8;
const PROMPT: usize = 32;
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

/// The aggregate decode rate of every prompt streamed at once: the tokens after each
/// stream's first over the time from the last stream's first token to the last token.
fn aggregate(base: &str, prompts: &[Vec<u32>], extra: &Value) -> Result<f64> {
    let start = Instant::now();
    let all = std::thread::scope(|s| {
        let handles: Vec<_> =
            prompts.iter().map(|p| s.spawn(|| stream_with(base, p, extra, start))).collect();
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
