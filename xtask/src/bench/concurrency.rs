//! The serving benchmark's concurrency curve (issue 36): a warm `tpctl serve` (one rank, 2
//! threads, `--no-prefix-caching --max-num-seqs 64`) streaming `N` = 1, 8, 32 and 64 requests
//! at once, on SmolLM2's f32 copy and its Q4_1 file, next to llama.cpp decoding the same
//! prompts in one batch per step (`shared/anchors/llamacpp_batch.py`, 2 threads, same file),
//! and next to the roofline of the machine measured in the same run ([`super::roofline`]).
//!
//! - Each request: [`PROMPT`] prompt ids (llama.cpp's), [`DECODE`] tokens (`ignore_eos`,
//!   greedy), streamed. Aggregate decode tok/s: `N x 63` tokens over the time from the last
//!   stream's first token to the last token. Time per output token: the gaps between
//!   consecutive streamed tokens of a request, over every request of the round (p50, p99).
//! - llama.cpp: its aggregate decode tok/s and its step time (decode time over steps, that is
//!   `N` over its aggregate).
//! - Roofline: [`Cost::ideal_step`] of a step of `N` tokens at the mean decode context
//!   ([`CONTEXT`]); roofline tok/s is `N` over it, and the fraction is ours over that.
//! - At `N` = 64, `/metrics` before and after the round gives rank 0's time per step in each
//!   engine phase (`tpctl_step_phase_seconds_total`) and the HTTP handlers' detokenization
//!   and chunk encoding, next to the wall time per step (the round's time over its steps).
//!
//! Each figure is the best of [`ROUNDS`] rounds (the latency percentiles and the breakdown
//! are the best round's), so a burst of noise on a shared machine does not decide a ratio.

use super::roofline::{Cost, Machine};
use super::serve::{concurrently, reference, Server, DECODE};
use anyhow::{Context, Result};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Concurrent streams of the curve.
const COUNTS: [usize; 4] = [1, 8, 32, 64];
/// Prompt ids per request.
const PROMPT: usize = 32;
/// Rounds per point; the best counts.
const ROUNDS: usize = 3;
/// Compute threads of the server, of llama.cpp and of the roofline's loops.
const THREADS: usize = 2;
/// The mean context of a decode step: the prompt and half the generated tokens.
const CONTEXT: u64 = (PROMPT + DECODE / 2) as u64;
/// The engine phases of `tpctl_step_phase_seconds_total`, in the order a step runs them.
const PHASES: [&str; 6] = ["schedule", "agree", "forward", "sample", "update", "emit"];

/// One point of the curve.
struct Point {
    tok_s: f64,
    /// Time per output token, ms: p50 and p99.
    tpot: (f64, f64),
    llama_tok_s: f64,
    roofline_tok_s: f64,
}

/// One round's figures.
struct Round {
    tok_s: f64,
    /// Every gap between consecutive tokens of a request, ms, sorted.
    gaps: Vec<f64>,
    /// From the round's start to its last token.
    wall: Duration,
}

/// `/metrics` differences over a round: rank 0's per-step time by phase.
struct Breakdown {
    steps: f64,
    wall: Duration,
    /// Seconds per phase over the round, in [`PHASES`] order.
    phases: Vec<f64>,
    detokenize: f64,
    encode: f64,
}

pub(crate) fn run(json: bool) -> Result<()> {
    let super::model::Reference { anchors, q4, f32 } = super::model::Reference::prepare()?;
    let tpctl = super::model::release_tpctl()?;
    let machine = Machine::measure(THREADS);
    let gbs = machine.read_bytes_s / 1e9;
    let gflops = machine.flops_s / 1e9;
    if json {
        let row = json!({
            "bench": "concurrency", "machine": true, "threads": THREADS,
            "read_gb_s": round1(gbs), "fma_gflop_s": round1(gflops), "f32_lanes": machine.lanes,
        });
        println!("{row}");
    } else {
        println!(
            "concurrency curve: SmolLM2-135M-Instruct through `tpctl serve` (1x1, {THREADS} \
             threads, --no-prefix-caching --max-num-seqs 64), N streams of {PROMPT} prompt ids \
             and {DECODE} tokens each (greedy, ignore_eos); llama.cpp decoding the same prompts \
             in one batch per step ({THREADS} threads, same file); best of {ROUNDS} rounds"
        );
        println!(
            "machine, same run, {THREADS} threads: memory read {gbs:.1} GB/s (1 GiB buffer), \
             FMA peak {gflops:.1} GFLOP/s ({} f32 lanes)",
            machine.lanes
        );
        println!(
            "{:<5} {:>3} | {:>9} {:>11} {:>6} | {:>17} {:>12} | {:>14} {:>9}",
            "file",
            "N",
            "tok/s",
            "llama tok/s",
            "ratio",
            "TPOT p50/p99 ms",
            "llama step ms",
            "roofline tok/s",
            "fraction"
        );
    }
    let mut breakdowns = Vec::new();
    for (name, model) in [("f32", &f32), ("Q4_1", &q4)] {
        let cost = Cost::of_gguf(model)?;
        let (points, breakdown) = curve(&tpctl, &anchors, model, &cost, &machine)?;
        for (n, p) in COUNTS.iter().zip(&points) {
            let step_ms = 1e3 * *n as f64 / p.llama_tok_s;
            if json {
                let row = json!({
                    "bench": "concurrency", "file": name, "streams": n,
                    "decode_tok_s": round1(p.tok_s), "llamacpp_decode_tok_s": p.llama_tok_s,
                    "ratio": round2(p.tok_s / p.llama_tok_s),
                    "tpot_p50_ms": round2(p.tpot.0), "tpot_p99_ms": round2(p.tpot.1),
                    "llamacpp_step_ms": round2(step_ms),
                    "weight_bytes": cost.weight_bytes,
                    "flops_per_token": cost.flops_per_token(CONTEXT),
                    "roofline_tok_s": round1(p.roofline_tok_s),
                    "roofline_fraction": round2(p.tok_s / p.roofline_tok_s),
                });
                println!("{row}");
            } else {
                println!(
                    "{:<5} {:>3} | {:>9.1} {:>11.1} {:>5.2}x | {:>17} {:>12.2} | {:>14.1} {:>8.1}%",
                    name,
                    n,
                    p.tok_s,
                    p.llama_tok_s,
                    p.tok_s / p.llama_tok_s,
                    format!("{:.2}/{:.2}", p.tpot.0, p.tpot.1),
                    step_ms,
                    p.roofline_tok_s,
                    100.0 * p.tok_s / p.roofline_tok_s
                );
            }
        }
        if !json {
            println!(
                "{name:<5} weights {:.1} MB read per step, {:.1} MFLOP per token at context \
                 {CONTEXT} ({} matmul parameters)",
                cost.weight_bytes as f64 / 1e6,
                cost.flops_per_token(CONTEXT) / 1e6,
                cost.matmul_params
            );
        }
        breakdowns.push((name, breakdown));
    }
    for (name, b) in &breakdowns {
        print_breakdown(name, b, json);
    }
    if !json {
        println!(
            "tok/s: aggregate decode, N x {} tokens from the last stream's first token to the last \
             token; TPOT: gaps between a request's consecutive streamed tokens, the best round's; \
             llama step ms: its decode time over its steps; roofline: N over max(weight bytes / \
             read bandwidth, N x FLOPs per token / FMA peak), KV cache reads not counted",
            DECODE - 1
        );
    }
    Ok(())
}

/// The curve of one file: llama.cpp at every `N` first (no server running), then one server
/// for every `N`; the breakdown of the last (largest) `N`.
fn curve(
    tpctl: &Path,
    anchors: &Path,
    model: &Path,
    cost: &Cost,
    machine: &Machine,
) -> Result<(Vec<Point>, Breakdown)> {
    let references =
        COUNTS.iter().map(|&n| reference(anchors, model, n, PROMPT)).collect::<Result<Vec<_>>>()?;
    let flags = ["--no-prefix-caching", "--max-num-seqs", "64"];
    let server = Server::start(tpctl, model, (1, 1, THREADS), &flags)?;
    // Warm up: the first requests pay for lazily built state.
    concurrently(&server.base, &references[1].prompts)?;
    let mut points = Vec::new();
    let mut breakdown = None;
    for (&n, r) in COUNTS.iter().zip(&references) {
        let mut best: Option<(Round, Option<Breakdown>)> = None;
        for _ in 0..ROUNDS {
            let before = scrape(&server.base)?;
            let round = round(&server.base, &r.prompts)?;
            let after = scrape(&server.base)?;
            if best.as_ref().is_none_or(|b| round.tok_s > b.0.tok_s) {
                let b = Breakdown::between(&before, &after, round.wall);
                best = Some((round, b));
            }
        }
        let (round, b) = best.context("no round ran")?;
        breakdown = b;
        let ideal = cost.ideal_step(machine, n, CONTEXT);
        points.push(Point {
            tok_s: round.tok_s,
            tpot: (percentile(&round.gaps, 0.50), percentile(&round.gaps, 0.99)),
            llama_tok_s: r.decode,
            roofline_tok_s: n as f64 / ideal,
        });
    }
    let breakdown = breakdown.context("/metrics has no tpctl_steps_total")?;
    Ok((points, breakdown))
}

/// Every prompt streamed at once.
fn round(base: &str, prompts: &[Vec<u32>]) -> Result<Round> {
    let start = Instant::now();
    let all = concurrently(base, prompts)?;
    let wall = start.elapsed();
    let first = all.iter().map(|a| a.first).max().unwrap_or_default();
    let last = all.iter().map(|a| a.last).max().unwrap_or_default();
    let tokens = (prompts.len() * (DECODE - 1)) as f64;
    let mut gaps: Vec<f64> = all
        .iter()
        .flat_map(|a| a.tokens.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3))
        .collect();
    gaps.sort_by(f64::total_cmp);
    Ok(Round { tok_s: tokens / (last - first).as_secs_f64(), gaps, wall })
}

/// The nearest-rank `p` quantile of sorted `values` (NaN when empty).
fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let rank = (p * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Every sample of the server's `/metrics`, by its name and labels.
fn scrape(base: &str) -> Result<HashMap<String, f64>> {
    let text = ureq::get(&format!("{base}/metrics")).call()?.into_body().read_to_string()?;
    Ok(samples(&text))
}

/// The samples of a Prometheus text exposition, by `name{labels}`.
fn samples(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_owned(), v.trim().parse().ok()?)))
        .collect()
}

impl Breakdown {
    /// What changed between two scrapes around a round of `wall`; `None` when the server
    /// reports no steps.
    fn between(
        before: &HashMap<String, f64>,
        after: &HashMap<String, f64>,
        wall: Duration,
    ) -> Option<Breakdown> {
        let delta = |key: &str| Some(after.get(key)? - before.get(key).copied().unwrap_or(0.0));
        let steps = delta("tpctl_steps_total")?;
        let phases = PHASES
            .iter()
            .map(|p| delta(&format!("tpctl_step_phase_seconds_total{{phase=\"{p}\"}}")))
            .collect::<Option<Vec<_>>>()?;
        Some(Breakdown {
            steps,
            wall,
            phases,
            detokenize: delta("tpctl_http_detokenize_seconds_total")?,
            encode: delta("tpctl_http_encode_seconds_total")?,
        })
    }
}

fn print_breakdown(name: &str, b: &Breakdown, json: bool) {
    let steps = b.steps.max(1.0);
    let wall_ms = b.wall.as_secs_f64() * 1e3 / steps;
    let per_step = |secs: f64| secs * 1e3 / steps;
    let engine: f64 = b.phases.iter().map(|&s| per_step(s)).sum();
    let other = wall_ms - engine;
    let n = COUNTS[COUNTS.len() - 1];
    if json {
        let mut row = json!({
            "bench": "concurrency", "breakdown": true, "file": name, "streams": n,
            "steps": b.steps, "wall_step_ms": round2(wall_ms), "other_idle_ms": round2(other),
            "http_detokenize_ms": round2(per_step(b.detokenize)),
            "http_encode_ms": round2(per_step(b.encode)),
        });
        for (p, &s) in PHASES.iter().zip(&b.phases) {
            row[format!("{p}_ms")] = json!(round2(per_step(s)));
        }
        println!("{row}");
        return;
    }
    println!(
        "\nper-step breakdown, {name}, N = {n} (best round: {} steps, wall {wall_ms:.2} ms a step \
         = round time / steps); rank 0's engine thread:",
        b.steps
    );
    let share = |ms: f64| 100.0 * ms / wall_ms;
    for (p, &s) in PHASES.iter().zip(&b.phases) {
        let ms = per_step(s);
        println!("  {p:<11} {ms:>8.3} ms {:>6.1}%", share(ms));
    }
    println!("  {:<11} {other:>8.3} ms {:>6.1}%", "other/idle", share(other));
    let (detok, encode) = (per_step(b.detokenize), per_step(b.encode));
    println!(
        "  HTTP runtime's threads, concurrent with the above (not in the wall's split): \
         detokenize {detok:.3} ms ({:.1}%), chunk encoding {encode:.3} ms ({:.1}%) a step",
        share(detok),
        share(encode)
    );
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::{percentile, samples, Breakdown, PHASES};
    use std::time::Duration;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((percentile(&v, 0.5), percentile(&v, 0.99)), (50.0, 99.0));
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn a_breakdown_is_the_difference_of_two_scrapes() {
        let scrape = |steps: u32, forward: f64| {
            let mut text = format!("# TYPE tpctl_steps_total counter\ntpctl_steps_total {steps}\n");
            for p in PHASES {
                let v = if p == "forward" { forward } else { 0.5 };
                text.push_str(&format!("tpctl_step_phase_seconds_total{{phase=\"{p}\"}} {v}\n"));
            }
            text.push_str("tpctl_http_detokenize_seconds_total 0.25\n");
            text.push_str("tpctl_http_encode_seconds_total 0.125\n");
            samples(&text)
        };
        let b = Breakdown::between(&scrape(10, 1.0), &scrape(74, 3.5), Duration::from_secs(4));
        let b = b.expect("every family present");
        assert_eq!(b.steps, 64.0);
        assert_eq!(b.phases[PHASES.iter().position(|p| *p == "forward").unwrap()], 2.5);
        assert_eq!((b.phases[0], b.detokenize, b.encode), (0.0, 0.0, 0.0));
        assert!(Breakdown::between(&scrape(1, 0.0), &samples(""), Duration::ZERO).is_none());
    }
}
