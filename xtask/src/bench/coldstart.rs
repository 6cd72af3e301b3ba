//! Cold-start benchmark: the time to first token `tpctl run` reports for a 128-token prompt
//! (counted from the request's admission, its start-up reported apart) next to a warm
//! `tpctl serve`'s for the same prompt ids (streamed `/v1/completions`, after one warm-up
//! request), in the same run, on SmolLM2's f32 copy, one rank, 2 threads. Goal: within
//! [`GOAL`]x. Each figure is the best of [`ROUNDS`].

use super::serve::{stream_with, Server};
use crate::util::{self, root};
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// Rounds of each measurement; the best counts.
const ROUNDS: usize = 3;
/// The prompt's length in tokens.
const PROMPT: usize = 128;
/// The ratio of run's time to first token to warm serve's that the goal allows.
const GOAL: f64 = 1.2;

/// Fixed ids of ordinary tokens: a deterministic walk over the vocabulary.
fn prompt() -> Vec<u32> {
    (0..PROMPT as u32).map(|i| 200 + (i * 104_729) % 40_000).collect()
}

/// Warm serve's best time to first token of `ids`, ms.
fn warm_serve(tpctl: &Path, model: &Path, ids: &[u32]) -> Result<f64> {
    let server = Server::start(tpctl, model, (1, 1, 2), &["--no-prefix-caching"])?;
    // The warm-up: whatever the first request pays once is not in the figure.
    stream_with(&server.base, ids, &Value::Null, Instant::now())?;
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        let a = stream_with(&server.base, ids, &Value::Null, Instant::now())?;
        best = best.min(a.first.as_secs_f64() * 1e3);
    }
    Ok(best)
}

/// `tpctl run`'s best reported time to first token of `ids` and its best start-up, ms.
fn cold_run(tpctl: &Path, model: &Path, ids: &[u32]) -> Result<(f64, f64)> {
    let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let (mut ttft, mut startup) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..ROUNDS {
        let out = util::output(
            Command::new(tpctl)
                .args(["run", "--quiet", "--threads", "2", "--max-tokens", "16"])
                .args(["--output", "jsonl", "--prompt-ids", &list, "--model"])
                .arg(model),
        )?;
        let line = out.lines().find(|l| l.starts_with('{')).context("tpctl run printed no line")?;
        let v: Value = serde_json::from_str(line).context("tpctl run's JSON line")?;
        let ms = |k: &str| v[k].as_f64().with_context(|| format!("no `{k}` in {line}"));
        ttft = ttft.min(ms("time_to_first_token_ms")?);
        startup = startup.min(ms("startup_ms")?);
    }
    Ok((ttft, startup))
}

pub(crate) fn run(json: bool) -> Result<()> {
    let q4 = crate::fetch_model::fetch_default()?;
    let model = super::model::f32_model(&q4, &root().join("../shared/anchors"))?;
    let tpctl = super::model::release_tpctl()?;
    let ids = prompt();
    let serve = warm_serve(&tpctl, &model, &ids)?;
    let (ttft, startup) = cold_run(&tpctl, &model, &ids)?;
    ensure!(serve > 0.0, "warm serve reported no time to first token");
    let ratio = ttft / serve;
    if json {
        let row = json!({
            "file": "f32", "tp": 1, "cp": 1, "threads_per_rank": 2, "prompt_tokens": PROMPT,
            "run_ttft_ms": round1(ttft), "serve_warm_ttft_ms": round1(serve),
            "ratio": (ratio * 100.0).round() / 100.0, "run_startup_ms": round1(startup),
        });
        println!("{row}");
    } else {
        println!(
            "cold start, SmolLM2 f32, one rank, 2 threads, a {PROMPT}-token prompt, best of \
             {ROUNDS}: tpctl run's time to first token {ttft:.0} ms (start-up {:.2} s apart) | \
             warm tpctl serve's {serve:.0} ms | {ratio:.2}x (goal <= {GOAL}x)",
            startup / 1e3
        );
    }
    if ratio > GOAL {
        eprintln!("warning: run's time to first token is {ratio:.2}x warm serve's, above {GOAL}x");
    }
    Ok(())
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
