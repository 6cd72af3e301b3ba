//! Serving benchmark: a warm `tpctl serve` measured from an HTTP client, next to llama.cpp on
//! the same GGUF file and the same prompt ids, measured in the same run
//! (`shared/anchors/llamacpp_batch.py`, 2 threads).
//!
//! - Single stream: 128 prompt ids, 64 tokens (`ignore_eos`, greedy). Prefill tok/s is the
//!   prompt over the time to the first streamed token; decode tok/s the 63 later tokens over
//!   the time from the first to the last.
//! - 8 concurrent streams of 32 prompt ids, 64 tokens each: aggregate decode tok/s, 8 x 63
//!   tokens over the time from the last stream's first token to the last token, against
//!   llama.cpp decoding the same 8 prompts in one batch per step; and against our own single
//!   stream.
//!
//! - The same on llama.cpp's own Q4_K_M and Q6_K quantizations of the model (one rank).
//! - A long context: one stream of [`LONG_PROMPT`] prompt ids, 64 tokens, f32 and Q4_1 on one
//!   rank, where a decode step's attention reads hundreds of keys per layer.
//! - A chat workload: 8 clients at once, each a 400-token shared system prompt and 32 tokens
//!   of its own, with and without prefix caching: mean time to first token, aggregate tok/s,
//!   the prefix cache's hits and each rank's resident memory next to the KV pool's budget.
//!
//! - Then the concurrency curve ([`super::concurrency`]): 1 to 64 streams on f32 and Q4_1
//!   against llama.cpp batched, the same run's roofline and a per-step breakdown.
//!
//! Each figure is the best of [`ROUNDS`] rounds, so a burst of noise on a shared machine does
//! not decide a ratio.

use super::model::llamacpp_quantized;
use crate::util;
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Rounds of each measurement; the best counts.
const ROUNDS: usize = 3;
/// Tokens generated per request.
pub(crate) const DECODE: usize = 64;
/// Concurrent streams and their prompt length.
const STREAMS: usize = 8;
const STREAM_PROMPT: usize = 32;
/// The single stream's prompt length.
const SINGLE_PROMPT: usize = 128;
/// The long-context stream's prompt length (the reference's prompts reach about 640 ids).
const LONG_PROMPT: usize = 512;
/// How long a server may take to load before the benchmark gives up.
const LOAD_DEADLINE: Duration = Duration::from_secs(300);
/// How long one request may take.
const REQUEST_DEADLINE: Duration = Duration::from_secs(300);

/// What llama.cpp measured on one file, and the prompt ids it used.
pub(super) struct Reference {
    /// Prompt tokens per second (all prompts in one batch).
    pub(super) prefill: f64,
    /// Decoded tokens per second over all sequences (one batch per step).
    pub(super) decode: f64,
    pub(super) prompts: Vec<Vec<u32>>,
}

/// Runs `llamacpp_batch.py` for `seqs` sequences of `prompt` ids and [`DECODE`] tokens.
pub(super) fn reference(
    anchors: &Path,
    model: &Path,
    seqs: usize,
    prompt: usize,
) -> Result<Reference> {
    let out = util::output(
        Command::new("python3")
            .arg(anchors.join("llamacpp_batch.py"))
            .arg(model)
            .arg("2")
            .arg(seqs.to_string())
            .arg(prompt.to_string())
            .arg(DECODE.to_string()),
    )?;
    let line = out
        .lines()
        .rev()
        .find(|l| l.contains("prefill_tok_s"))
        .context("llama.cpp printed no result")?;
    let v: Value = serde_json::from_str(line).context("llama.cpp's result line")?;
    let num = |k: &str| v[k].as_f64().with_context(|| format!("llama.cpp's `{k}`"));
    let prompts: Vec<Vec<u32>> =
        serde_json::from_value(v["prompt_ids"].clone()).context("llama.cpp's `prompt_ids`")?;
    ensure!(
        prompts.len() == seqs && prompts.iter().all(|p| p.len() == prompt),
        "llama.cpp used other prompts: {line}"
    );
    Ok(Reference { prefill: num("prefill_tok_s")?, decode: num("decode_tok_s")?, prompts })
}

/// A `tpctl serve` deployment on a free local port, stopped (Ctrl-C, as a user would) when
/// dropped.
pub(super) struct Server {
    child: Child,
    /// The API's address, `http://127.0.0.1:PORT`.
    pub(super) base: String,
}

impl Server {
    /// Starts `tpctl serve` in a `tp` x `cp` layout with `threads` compute threads per rank and
    /// waits until `/health` answers.
    ///
    /// # Errors
    /// The server could not start, exited while loading, or was not ready within
    /// [`LOAD_DEADLINE`].
    pub(super) fn start(
        tpctl: &Path,
        model: &Path,
        (tp, cp, threads): (usize, usize, usize),
        extra: &[&str],
    ) -> Result<Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let base = format!("http://127.0.0.1:{port}");
        eprintln!(
            "$ tpctl serve --tp {tp} --cp {cp} --threads {threads} {} {}",
            extra.join(" "),
            model.display()
        );
        let child = Command::new(tpctl)
            .args(["serve", "--quiet", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--tp", &tp.to_string(), "--cp", &cp.to_string()])
            .args(["--threads", &threads.to_string()])
            .args(extra)
            .arg("--model")
            .arg(model)
            .stdout(Stdio::null())
            .spawn()
            .context("starting tpctl serve")?;
        let mut server = Server { child, base };
        let since = Instant::now();
        loop {
            if let Some(status) = server.child.try_wait()? {
                bail!("tpctl serve exited while loading: {status}");
            }
            if ureq::get(&format!("{}/health", server.base)).call().is_ok() {
                return Ok(server);
            }
            if since.elapsed() > LOAD_DEADLINE {
                bail!("tpctl serve was not ready within {LOAD_DEADLINE:?}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The process id of the `tpctl serve` launcher (its ranks are its children).
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        let since = Instant::now();
        while since.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// When one streamed request's tokens arrived, from a shared start.
#[derive(Clone)]
pub(crate) struct Arrivals {
    pub(crate) first: Duration,
    pub(crate) last: Duration,
    /// When each event that carried tokens arrived (one per token as the server streams).
    pub(crate) tokens: Vec<Duration>,
}

/// One greedy streamed completion of `prompt` ids, [`DECODE`] tokens with `ignore_eos`.
fn stream(base: &str, prompt: &[u32], start: Instant) -> Result<Arrivals> {
    stream_with(base, prompt, &Value::Null, start)
}

/// As [`stream`], with the fields of `extra` added to the request's body.
pub(crate) fn stream_with(
    base: &str,
    prompt: &[u32],
    extra: &Value,
    start: Instant,
) -> Result<Arrivals> {
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
    let (mut first, mut tokens, mut times) = (None, 0, Vec::with_capacity(DECODE));
    for line in reader.lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let event: Value = serde_json::from_str(data).context("a streamed event")?;
        let ids = event["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
        if ids > 0 {
            let now = start.elapsed();
            first.get_or_insert(now);
            times.push(now);
            tokens += ids;
        }
    }
    let last = start.elapsed();
    ensure!(tokens == DECODE, "the server streamed {tokens} tokens, {DECODE} were asked for");
    Ok(Arrivals { first: first.context("no token streamed")?, last, tokens: times })
}

/// Every prompt streamed at once, one client thread each, timed from one shared start.
pub(super) fn concurrently(base: &str, prompts: &[Vec<u32>]) -> Result<Vec<Arrivals>> {
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| stream(base, p, start))).collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?)
            .collect::<Result<Vec<_>>>()
    })
}

/// What tpctl measured in one layout.
#[derive(Default)]
struct Measured {
    prefill: f64,
    decode: f64,
    batch_decode: f64,
}

fn measure(server: &Server, single: &[u32], prompts: &[Vec<u32>]) -> Result<Measured> {
    // Warm up: the first request pays for lazily built state.
    stream(&server.base, &single[..8], Instant::now())?;
    let mut best = Measured::default();
    for _ in 0..ROUNDS {
        let a = stream(&server.base, single, Instant::now())?;
        best.prefill = best.prefill.max(single.len() as f64 / a.first.as_secs_f64());
        let decode = (DECODE - 1) as f64 / (a.last - a.first).as_secs_f64();
        best.decode = best.decode.max(decode);

        let all = concurrently(&server.base, prompts)?;
        let first = all.iter().map(|a| a.first).max().unwrap_or_default();
        let last = all.iter().map(|a| a.last).max().unwrap_or_default();
        let tokens = (prompts.len() * (DECODE - 1)) as f64;
        best.batch_decode = best.batch_decode.max(tokens / (last - first).as_secs_f64());
    }
    Ok(best)
}

/// The layouts measured: (tp, cp, threads per rank) on a 2-core machine.
const LAYOUTS: [(usize, usize, usize); 3] = [(1, 1, 2), (2, 1, 1), (2, 2, 1)];

pub(crate) fn run(json: bool) -> Result<()> {
    let super::model::Reference { anchors, q4, f32: f32_path } =
        super::model::Reference::prepare()?;
    let tpctl = super::model::release_tpctl()?;
    let q4_k_m = llamacpp_quantized(&f32_path, &anchors, "Q4_K_M")?;
    let q6_k = llamacpp_quantized(&f32_path, &anchors, "Q6_K")?;
    let models: [(&str, PathBuf); 4] =
        [("f32", f32_path), ("Q4_1", q4), ("Q4_K_M", q4_k_m), ("Q6_K", q6_k)];
    if !json {
        println!(
            "SmolLM2-135M-Instruct through `tpctl serve` (HTTP, streamed, greedy, ignore_eos) \
             next to llama.cpp (2 threads) on the same file and prompt ids"
        );
        println!(
            "{:<6} {:<6} {:>4} | {:>22} | {:>22} | {:>24} {:>8}",
            "file",
            "layout",
            "thr",
            "prefill 128 tok/s",
            "decode tok/s",
            "8 streams decode tok/s",
            "/ single"
        );
    }
    for (name, model) in &models {
        let single_ref = reference(&anchors, model, 1, SINGLE_PROMPT)?;
        let batch_ref = reference(&anchors, model, STREAMS, STREAM_PROMPT)?;
        // llama.cpp's K-quant files (Q4_K 4-bit in memory, Q6_K a byte per weight): one rank.
        let layouts = if name.contains("_K") { &LAYOUTS[..1] } else { &LAYOUTS[..] };
        for &(tp, cp, threads) in layouts {
            // The rounds repeat one prompt: no prefix reuse, so each round computes it all.
            let server = Server::start(&tpctl, model, (tp, cp, threads), &["--no-prefix-caching"])?;
            let m = measure(&server, &single_ref.prompts[0], &batch_ref.prompts)?;
            drop(server);
            let ratio = |ours: f64, theirs: f64| ours / theirs;
            if json {
                let row = json!({
                    "file": name, "tp": tp, "cp": cp, "threads_per_rank": threads,
                    "prefill_tok_s": round1(m.prefill), "llamacpp_prefill_tok_s": single_ref.prefill,
                    "decode_tok_s": round1(m.decode), "llamacpp_decode_tok_s": single_ref.decode,
                    "batch_decode_tok_s": round1(m.batch_decode),
                    "llamacpp_batch_decode_tok_s": batch_ref.decode,
                    "prefill_ratio": round2(ratio(m.prefill, single_ref.prefill)),
                    "decode_ratio": round2(ratio(m.decode, single_ref.decode)),
                    "batch_decode_ratio": round2(ratio(m.batch_decode, batch_ref.decode)),
                    "batch_over_single": round2(m.batch_decode / m.decode),
                });
                println!("{row}");
            } else {
                let cell = |ours: f64, theirs: f64| {
                    format!("{ours:.1} ({theirs:.1}) {:.2}x", ratio(ours, theirs))
                };
                println!(
                    "{:<6} {:<6} {:>4} | {:>22} | {:>22} | {:>24} {:>7.2}x",
                    name,
                    format!("{tp}x{cp}"),
                    threads,
                    cell(m.prefill, single_ref.prefill),
                    cell(m.decode, single_ref.decode),
                    cell(m.batch_decode, batch_ref.decode),
                    m.batch_decode / m.decode
                );
            }
        }
    }
    if !json {
        println!(
            "cells: ours (llama.cpp) ours/llama.cpp; llama.cpp 8 streams = the 8 prompts decoded in \
             one batch per step; / single = our 8-stream aggregate over our single-stream decode; \
             best of {ROUNDS} rounds each, same machine, same run"
        );
    }
    long_context(&tpctl, &anchors, &models[..2], json)?;
    let q4 = &models[1].1;
    let with = chat_workload(&tpctl, q4, &[])?;
    let without = chat_workload(&tpctl, q4, &["--no-prefix-caching"])?;
    if json {
        for (name, c) in [("prefix_caching", &with), ("no_prefix_caching", &without)] {
            let row = json!({
                "workload": "chat", "file": "Q4_1", "tp": 1, "cp": 1, "threads_per_rank": 2,
                "mode": name, "clients": STREAMS, "system_prompt": SYSTEM_PROMPT,
                "ttft_ms": round1(c.ttft_ms), "tok_s": round1(c.tok_s),
                "prefix_hit_tokens": c.hits, "rank_rss_mib": c.rss_mib, "pool_mib": POOL_MIB,
            });
            println!("{row}");
        }
    } else {
        println!(
            "\nchat workload: {STREAMS} clients, a {SYSTEM_PROMPT}-token shared system prompt + \
             {STREAM_PROMPT} own tokens, {DECODE} tokens each (Q4_1, 1x1, 2 threads, \
             --kv-cache-memory {POOL_MIB}MiB)"
        );
        println!(
            "{:<20} | {:>14} | {:>16} | {:>18} | {:>14}",
            "", "mean TTFT ms", "aggregate tok/s", "prefix hit tokens", "rank RSS MiB"
        );
        for (name, c) in [("prefix caching", &with), ("no prefix caching", &without)] {
            println!(
                "{name:<20} | {:>14.1} | {:>16.1} | {:>18} | {:>14}",
                c.ttft_ms,
                c.tok_s,
                c.hits,
                c.rss_mib.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
            );
        }
        println!(
            "with / without: TTFT {:.2}x, throughput {:.2}x; best of {ROUNDS} rounds; RSS after \
             the last round (weights, pool of {POOL_MIB} MiB, runtime)",
            without.ttft_ms / with.ttft_ms,
            with.tok_s / without.tok_s
        );
        println!();
    }
    super::concurrency::run(json)
}

/// One stream of [`LONG_PROMPT`] ids on each of `models` (one rank, 2 threads): prefill and
/// decode tok/s next to llama.cpp's on the same ids, best of [`ROUNDS`].
fn long_context(
    tpctl: &Path,
    anchors: &Path,
    models: &[(&str, PathBuf)],
    json: bool,
) -> Result<()> {
    if !json {
        println!(
            "\nlong context: one stream of {LONG_PROMPT} prompt ids, {DECODE} tokens (1x1, 2 \
             threads, no prefix caching)"
        );
        println!("{:<6} | {:>24} | {:>22}", "file", "prefill tok/s", "decode tok/s");
    }
    for (name, model) in models {
        let reference = reference(anchors, model, 1, LONG_PROMPT)?;
        let prompt = &reference.prompts[0];
        let server = Server::start(tpctl, model, (1, 1, 2), &["--no-prefix-caching"])?;
        stream(&server.base, &prompt[..8], Instant::now())?;
        let (mut prefill, mut decode) = (0.0f64, 0.0f64);
        for _ in 0..ROUNDS {
            let a = stream(&server.base, prompt, Instant::now())?;
            prefill = prefill.max(prompt.len() as f64 / a.first.as_secs_f64());
            decode = decode.max((DECODE - 1) as f64 / (a.last - a.first).as_secs_f64());
        }
        drop(server);
        if json {
            let row = json!({
                "workload": "long_context", "file": name, "tp": 1, "cp": 1,
                "threads_per_rank": 2, "prompt": LONG_PROMPT,
                "prefill_tok_s": round1(prefill), "llamacpp_prefill_tok_s": reference.prefill,
                "decode_tok_s": round1(decode), "llamacpp_decode_tok_s": reference.decode,
                "prefill_ratio": round2(prefill / reference.prefill),
                "decode_ratio": round2(decode / reference.decode),
            });
            println!("{row}");
        } else {
            let cell =
                |ours: f64, theirs: f64| format!("{ours:.1} ({theirs:.1}) {:.2}x", ours / theirs);
            println!(
                "{name:<6} | {:>24} | {:>22}",
                cell(prefill, reference.prefill),
                cell(decode, reference.decode)
            );
        }
    }
    Ok(())
}

/// The shared system prompt of the chat workload, in tokens.
const SYSTEM_PROMPT: usize = 400;
/// The KV pool of the chat workload's server.
const POOL_MIB: u64 = 256;

/// What the chat workload measured.
struct Chat {
    /// Mean time to the first token over the clients, ms.
    ttft_ms: f64,
    /// Tokens generated over the wall time of a round.
    tok_s: f64,
    /// Prompt tokens the server reused (its prefix cache's hits).
    hits: u64,
    /// Resident memory of each rank after the last round.
    rss_mib: Vec<u64>,
}

/// [`STREAMS`] clients at once, each a [`SYSTEM_PROMPT`]-token shared prefix and
/// [`STREAM_PROMPT`] tokens of its own, against a server started with `extra` flags; the shared
/// prompt is sent once first (a chat service's earlier traffic).
fn chat_workload(tpctl: &Path, model: &Path, extra: &[&str]) -> Result<Chat> {
    let pool = format!("{POOL_MIB}MiB");
    let mut flags = vec!["--kv-cache-memory", pool.as_str()];
    flags.extend(extra);
    let server = Server::start(tpctl, model, (1, 1, 2), &flags)?;
    // Ids of ordinary tokens, fixed: a deterministic walk over the vocabulary.
    let ids = |seed: u32, n: usize| -> Vec<u32> {
        (0..n as u32).map(|i| 200 + (seed.wrapping_mul(7919) + i * 104_729) % 40_000).collect()
    };
    let system = ids(1, SYSTEM_PROMPT);
    stream(&server.base, &system, Instant::now())?;
    let mut best = Chat { ttft_ms: f64::INFINITY, tok_s: 0.0, hits: 0, rss_mib: Vec::new() };
    for round in 0..ROUNDS {
        let prompts: Vec<Vec<u32>> = (0..STREAMS)
            .map(|c| {
                let mut p = system.clone();
                p.extend(ids(100 + (round * STREAMS + c) as u32, STREAM_PROMPT));
                p
            })
            .collect();
        let all = concurrently(&server.base, &prompts)?;
        let ttft = all.iter().map(|a| a.first.as_secs_f64()).sum::<f64>() / all.len() as f64;
        let last = all.iter().map(|a| a.last).max().unwrap_or_default();
        best.ttft_ms = best.ttft_ms.min(ttft * 1e3);
        best.tok_s = best.tok_s.max((STREAMS * DECODE) as f64 / last.as_secs_f64());
    }
    let metrics =
        ureq::get(&format!("{}/metrics", server.base)).call()?.into_body().read_to_string()?;
    best.hits = metrics
        .lines()
        .find_map(|l| l.strip_prefix("vllm:prefix_cache_hits_total{"))
        .and_then(|l| l.rsplit_once(' '))
        .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as u64;
    best.rss_mib = children_rss(server.pid()).into_iter().map(|b| b >> 20).collect();
    Ok(best)
}

/// Resident bytes of every child process of `parent` (a launcher's ranks), by pid.
fn children_rss(parent: u32) -> Vec<u64> {
    let mut out: Vec<(u32, u64)> = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { continue };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        };
        if field("PPid:") == Some(u64::from(parent)) {
            out.push((pid, field("VmRSS:").unwrap_or(0) * 1024));
        }
    }
    out.sort_unstable();
    out.into_iter().map(|(_, rss)| rss).collect()
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
