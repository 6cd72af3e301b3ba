//! Sleep/wakeup cycles under load: a `tpctl serve` deployment sleeps and wakes up again and
//! again while 8 clients stream greedy completions, and every answer must equal the one the
//! same prompt got from the deployment before any sleep.
//!
//! Cycle `i` sleeps at level `1 + i % 2` in mode `wait` or `keep` (alternating every two
//! cycles, so each level meets each mode), then wakes everything up. Each sleep waits until a
//! client received a token after the previous wakeup, so that it meets requests in the
//! middle of their decoding (`keep` pauses them, `wait` lets them finish). The bench reports
//! cycles/s, the median sleep and wakeup per level (client wall time of the HTTP call), the
//! bytes a sleep released on the largest rank next to a plain copy of as many bytes measured in
//! the same run, and the resident memory of the deployment (the launcher and its ranks) after
//! warm-up and at the end. It fails when an answer differs, a request fails, or fewer than
//! [`CLIENTS`] answers completed while the cycles ran.
//!
//! `TPCTL_CYCLES` sets the number of cycles (default 100), `TPCTL_CYCLES_LAYOUT` the layout as
//! `TPxCP` (default `2x2`, one compute thread per rank).

use super::serve::Server;
use crate::util::{self, cargo, root};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Concurrent streaming clients, one prompt each.
const CLIENTS: usize = 8;
/// Prompt ids per prompt.
const PROMPT_LEN: usize = 24;
/// Tokens generated per request.
const MAX_TOKENS: usize = 32;
/// How long one HTTP call may take: a request sent while the deployment sleeps waits for the
/// wakeup, and a level 2 wakeup reloads the checkpoint.
const REQUEST_DEADLINE: Duration = Duration::from_secs(300);
/// How long the clients may take to stream a token after a wakeup before the bench fails.
const PROGRESS_DEADLINE: Duration = Duration::from_secs(120);
/// Rounds of the plain copy; the median counts.
const COPY_ROUNDS: usize = 5;
/// Mismatches and failed requests shown in full when the bench fails.
const SHOWN: usize = 3;

/// The `i`-th prompt: [`PROMPT_LEN`] ids in 1000..20000 from a fixed linear congruential
/// sequence, so every run (and every engine) sees the same prompts.
fn prompt(i: usize) -> Vec<u32> {
    let mut state = 0x9e37_79b9_u64.wrapping_mul(i as u64 + 1);
    (0..PROMPT_LEN)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            1000 + ((state >> 33) % 19_000) as u32
        })
        .collect()
}

/// One answer: the streamed ids and the finish reason.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Answer {
    ids: Vec<u32>,
    finish: String,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(REQUEST_DEADLINE))
        .http_status_as_error(false)
        .build()
        .into()
}

/// One greedy streamed completion of `prompt`: [`MAX_TOKENS`] tokens with `ignore_eos`;
/// counts each token into `streamed` as it arrives.
fn complete(
    agent: &ureq::Agent,
    base: &str,
    prompt: &[u32],
    streamed: &AtomicUsize,
) -> Result<Answer> {
    let body = json!({
        "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": true,
        "temperature": 0.0, "stream": true,
    });
    let response = agent.post(&format!("{base}/v1/completions")).send_json(&body)?;
    let status = response.status();
    if !status.is_success() {
        let text = response.into_body().read_to_string().unwrap_or_default();
        bail!("the completion answered {status}: {text}");
    }
    let reader = BufReader::new(response.into_body().into_reader());
    let mut answer = Answer { ids: Vec::new(), finish: String::new() };
    let mut done = false;
    for line in reader.lines() {
        let line = line.context("reading the stream")?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let event: Value = serde_json::from_str(data).context("a streamed event")?;
        let choice = &event["choices"][0];
        if let Some(ids) = choice["token_ids"].as_array() {
            for id in ids {
                answer.ids.push(id.as_u64().context("a streamed token id")? as u32);
                streamed.fetch_add(1, Ordering::Release);
            }
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            reason.clone_into(&mut answer.finish);
        }
    }
    ensure!(done, "the stream ended without `data: [DONE]` after {} tokens", answer.ids.len());
    Ok(answer)
}

/// Each prompt's answer, the prompts sent at once (one client thread each).
fn answer_all(base: &str, prompts: &[Vec<u32>]) -> Result<Vec<Answer>> {
    let streamed = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let streamed = &streamed;
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(move || complete(&agent(), base, p, streamed)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?)
            .collect()
    })
}

/// Resident bytes (VmRSS) of process `root` and all its descendants, from procfs.
fn resident_tree(root: u32) -> Result<u64> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").context("listing /proc")? {
        let Ok(pid) = entry?.file_name().to_string_lossy().parse::<u32>() else { continue };
        // A process may exit between the listing and the read.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so the fields
        // start after its last `)`.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let (mut total, mut todo) = (0, vec![root]);
    while let Some(pid) = todo.pop() {
        todo.extend(children.get(&pid).into_iter().flatten());
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { continue };
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0);
        total += kib * 1024;
    }
    ensure!(total > 0, "no resident memory found for process {root} and its children");
    Ok(total)
}

/// A `/sleep` or `/wake_up` call: its receipt and the client's wall time.
fn control(agent: &ureq::Agent, base: &str, path: &str) -> Result<(Value, Duration)> {
    let start = Instant::now();
    let response = agent.post(&format!("{base}{path}")).send_empty()?;
    let elapsed = start.elapsed();
    let status = response.status();
    let text = response.into_body().read_to_string().context("reading the receipt")?;
    if !status.is_success() {
        bail!("POST {path} answered {status}: {text}");
    }
    let receipt = serde_json::from_str(&text).with_context(|| format!("the receipt of {path}"))?;
    Ok((receipt, elapsed))
}

/// The bytes a sleep released on its largest rank (the sum over that rank's tags).
fn largest_rank_bytes(receipt: &Value) -> Result<u64> {
    let ranks = receipt["ranks"].as_array().context("a sleep receipt without `ranks`")?;
    ranks
        .iter()
        .map(|r| {
            let tags = r["tags"].as_array().context("a rank receipt without `tags`")?;
            tags.iter()
                .map(|t| t["bytes"].as_u64().context("a tag receipt without `bytes`"))
                .sum::<Result<u64>>()
        })
        .try_fold(0, |max, b| b.map(|b| max.max(b)))
}

/// The most `kv_cache` bytes and allocations one rank's receipt in `receipt` released: the KV
/// pool, one allocation per rank.
fn kv_pool(receipt: &Value) -> (u64, u64) {
    let tags =
        receipt["ranks"].as_array().into_iter().flatten().filter_map(|r| r["tags"].as_array());
    tags.flatten()
        .filter(|t| t["tag"] == "kv_cache")
        .map(|t| (t["bytes"].as_u64().unwrap_or(0), t["allocations"].as_u64().unwrap_or(0)))
        .fold((0, 0), |(b, a), (tb, ta)| (b.max(tb), a.max(ta)))
}

/// What one cycle measured.
struct Cycle {
    level: u8,
    mode: &'static str,
    sleep: Duration,
    wakeup: Duration,
    /// Bytes released on the largest rank.
    bytes: u64,
    /// `kv_cache` bytes and allocations released on the rank with the most.
    kv: (u64, u64),
    /// Resident bytes of the deployment after the wakeup.
    resident: u64,
}

/// An answer that differed from the reference, or a request that failed.
struct Fault {
    prompt: usize,
    /// Cycles begun when the request was sent and when it ended.
    cycles: (usize, usize),
    what: String,
}

/// Shared between the driver and the clients.
struct Load<'a> {
    base: &'a str,
    prompts: &'a [Vec<u32>],
    reference: &'a [Answer],
    stop: AtomicBool,
    /// Cycles begun: the driver counts one up before each sleep.
    begun: AtomicUsize,
    /// Tokens the clients received.
    streamed: AtomicUsize,
    /// Answers equal to their reference, and of them those that completed while the cycles
    /// ran and those whose request spanned the start of a sleep.
    checked: AtomicUsize,
    during: AtomicUsize,
    across: AtomicUsize,
    faults: Mutex<Vec<Fault>>,
}

impl Load<'_> {
    /// Client `c`: sends its prompt again and again until told to stop, checking each answer.
    fn client(&self, c: usize) {
        let agent = agent();
        while !self.stop.load(Ordering::Acquire) {
            let first = self.begun.load(Ordering::Acquire);
            let got = complete(&agent, self.base, &self.prompts[c], &self.streamed);
            let last = self.begun.load(Ordering::Acquire);
            let during = !self.stop.load(Ordering::Acquire);
            let what = match got {
                Ok(a) if a == self.reference[c] => {
                    self.checked.fetch_add(1, Ordering::Relaxed);
                    if during {
                        self.during.fetch_add(1, Ordering::Relaxed);
                    }
                    if last != first {
                        self.across.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                Ok(a) => format!(
                    "answered {:?} (finish {}), before any sleep {:?} (finish {})",
                    a.ids, a.finish, self.reference[c].ids, self.reference[c].finish
                ),
                Err(e) => format!("failed: {e:#}"),
            };
            let fault = Fault { prompt: c, cycles: (first, last), what };
            self.faults.lock().unwrap_or_else(|e| e.into_inner()).push(fault);
            // A server that went away fails every request at once: do not spin on it.
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs `n` cycles, sampling the resident memory of process `pid`'s tree after each
    /// wakeup. Each sleep waits until the clients streamed a token since the previous
    /// wakeup, so that it meets requests in the middle of their decoding.
    fn drive(&self, n: usize, pid: u32) -> Result<Vec<Cycle>> {
        let agent = agent();
        let mut cycles = Vec::with_capacity(n);
        let mut since = 0;
        for i in 0..n {
            let level = 1 + (i % 2) as u8;
            let mode = if (i / 2) % 2 == 0 { "wait" } else { "keep" };
            let waiting = Instant::now();
            while self.streamed.load(Ordering::Acquire) == since {
                ensure!(
                    waiting.elapsed() < PROGRESS_DEADLINE,
                    "cycle {i}: no client received a token within {PROGRESS_DEADLINE:?} of the \
                     previous wakeup"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            self.begun.store(i + 1, Ordering::Release);
            let path = format!("/sleep?level={level}&mode={mode}");
            let (receipt, sleep) = control(&agent, self.base, &path)
                .with_context(|| format!("cycle {i} (level {level}, mode {mode})"))?;
            let bytes = largest_rank_bytes(&receipt)
                .with_context(|| format!("cycle {i}'s sleep receipt: {receipt}"))?;
            let kv = kv_pool(&receipt);
            let (_, wakeup) = control(&agent, self.base, "/wake_up")
                .with_context(|| format!("cycle {i} (level {level}, mode {mode})"))?;
            since = self.streamed.load(Ordering::Acquire);
            let resident = resident_tree(pid)?;
            cycles.push(Cycle { level, mode, sleep, wakeup, bytes, kv, resident });
        }
        Ok(cycles)
    }
}

/// The median of `xs` (the mean of the middle two for an even count); 0 for none.
fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    if xs.len().is_multiple_of(2) {
        (xs[mid - 1] + xs[mid]) / 2.0
    } else {
        xs[mid]
    }
}

/// The median time of [`COPY_ROUNDS`] plain copies of `bytes` bytes between two buffers
/// already touched, in milliseconds.
fn plain_copy_ms(bytes: u64) -> Result<f64> {
    let len = usize::try_from(bytes).context("copy size")?;
    // Filled, not zeroed: zeroed memory may stay unmapped until written.
    let src = vec![0x5a_u8; len];
    let mut dst = vec![0xa5_u8; len];
    let times = (0..COPY_ROUNDS)
        .map(|_| {
            let start = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    Ok(median(times))
}

/// The layout from `TPCTL_CYCLES_LAYOUT`, as `TPxCP`.
fn layout() -> Result<(usize, usize)> {
    let Ok(text) = std::env::var("TPCTL_CYCLES_LAYOUT") else { return Ok((2, 2)) };
    let parsed = text
        .split_once(['x', 'X'])
        .and_then(|(tp, cp)| Some((tp.trim().parse().ok()?, cp.trim().parse().ok()?)))
        .filter(|&(tp, cp): &(usize, usize)| tp > 0 && cp > 0);
    parsed.with_context(|| format!("TPCTL_CYCLES_LAYOUT={text}: expected TPxCP, e.g. 2x2"))
}

/// The number of cycles from `TPCTL_CYCLES`.
fn cycle_count() -> Result<usize> {
    let Ok(text) = std::env::var("TPCTL_CYCLES") else { return Ok(100) };
    text.trim()
        .parse()
        .ok()
        .filter(|&n: &usize| n > 0)
        .with_context(|| format!("TPCTL_CYCLES={text}: expected a number of cycles, 1 or more"))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

pub(crate) fn run(json: bool) -> Result<()> {
    let n = cycle_count()?;
    let (tp, cp) = layout()?;
    let model = crate::fetch_model::fetch_default()?;
    util::run(cargo().args(["build", "--release", "--quiet", "-p", "tpctl"]))?;
    let tpctl = root().join("target/release/tpctl");
    let prompts: Vec<Vec<u32>> = (0..CLIENTS).map(prompt).collect();

    let server = Server::start(&tpctl, &model, (tp, cp, 1), &[])?;
    let reference = answer_all(&server.base, &prompts).context("the answers before any sleep")?;
    for (i, a) in reference.iter().enumerate() {
        ensure!(
            a.ids.len() == MAX_TOKENS,
            "prompt {i} streamed {} tokens before any sleep, {MAX_TOKENS} were asked for",
            a.ids.len()
        );
    }
    // The load outlives the server: its counts are read after the server stopped.
    let base = server.base.clone();
    let load = Load {
        base: &base,
        prompts: &prompts,
        reference: &reference,
        stop: AtomicBool::new(false),
        begun: AtomicUsize::new(0),
        streamed: AtomicUsize::new(0),
        checked: AtomicUsize::new(0),
        during: AtomicUsize::new(0),
        across: AtomicUsize::new(0),
        faults: Mutex::new(Vec::new()),
    };
    eprintln!("{n} sleep/wakeup cycles under {CLIENTS} streaming clients");
    let start = Instant::now();
    let driven = std::thread::scope(|s| -> Result<(Vec<Cycle>, Duration)> {
        let load = &load;
        let clients: Vec<_> = (0..CLIENTS).map(|c| s.spawn(move || load.client(c))).collect();
        let driven = load.drive(n, server.pid());
        let wall = start.elapsed();
        load.stop.store(true, Ordering::Release);
        if driven.is_err() {
            // Release the clients' requests waiting for a wakeup; the cycle's error stands.
            let _ = agent().post(&format!("{}/wake_up", server.base)).send_empty();
        }
        // A client's request in flight ends within REQUEST_DEADLINE.
        let panicked = clients.into_iter().map(|h| h.join()).filter(Result::is_err).count();
        let cycles = driven?;
        ensure!(panicked == 0, "{panicked} client threads panicked");
        Ok((cycles, wall))
    });
    drop(server);
    let (cycles, wall) = driven?;
    let faults = load.faults.into_inner().unwrap_or_else(|e| e.into_inner());
    let checked = load.checked.into_inner();
    let during = load.during.into_inner();
    let across = load.across.into_inner();

    // The plain copy runs with the deployment gone, so the two do not share the cores.
    let mut rows = Vec::new();
    for level in [1u8, 2] {
        let of: Vec<&Cycle> = cycles.iter().filter(|c| c.level == level).collect();
        if of.is_empty() {
            continue;
        }
        let bytes = of.iter().map(|c| c.bytes).max().unwrap_or(0);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let sleep_ms = median(of.iter().map(|c| ms(c.sleep)).collect());
        // A sleep in mode wait lets the running requests finish: its own median.
        let sleep_in = |mode: &str| {
            median(of.iter().filter(|c| c.mode == mode).map(|c| ms(c.sleep)).collect())
        };
        let wakeup_ms = median(of.iter().map(|c| c.wakeup.as_secs_f64() * 1e3).collect());
        let copy_ms = plain_copy_ms(bytes)?;
        rows.push(json!({
            "level": level, "layout": format!("{tp}x{cp}"), "cycles": of.len(),
            "sleep_ms_median": round2(sleep_ms),
            "sleep_ms_median_wait": round2(sleep_in("wait")),
            "sleep_ms_median_keep": round2(sleep_in("keep")),
            "wakeup_ms_median": round2(wakeup_ms),
            "released_mib_per_rank": round2(mib(bytes)), "copy_ms": round2(copy_ms),
            "wakeup_over_copy": round2(wakeup_ms / copy_ms),
        }));
    }
    // Warm-up: the first tenth of the cycles, at most 10.
    let warm = (n / 10).clamp(1, 10);
    let resident_warm = cycles[warm - 1].resident;
    let resident_end = cycles[n - 1].resident;
    let resident_max = cycles[warm - 1..].iter().map(|c| c.resident).max().unwrap_or(0);
    let growth = mib(resident_end) - mib(resident_warm);
    let kv_bytes = cycles.iter().map(|c| c.kv.0).max().unwrap_or(0);
    let kv_allocations = cycles.iter().map(|c| c.kv.1).max().unwrap_or(0);
    let summary = json!({
        "summary": true, "layout": format!("{tp}x{cp}"), "cycles": n,
        "cycles_per_s": round2(n as f64 / wall.as_secs_f64()), "wall_s": round2(wall.as_secs_f64()),
        "answers_checked": checked, "answers_during_cycles": during,
        "answers_across_sleep": across, "mismatches": faults.len(),
        "warmup_cycles": warm, "resident_mib_warm": round2(mib(resident_warm)),
        "resident_mib_end": round2(mib(resident_end)), "resident_mib_max": round2(mib(resident_max)),
        "resident_growth_mib": round2(growth),
        "kv_cache_mib_per_rank": round2(mib(kv_bytes)), "kv_cache_allocations_per_rank": kv_allocations,
    });

    if json {
        for row in &rows {
            println!("{row}");
        }
        println!("{summary}");
    } else {
        print_table(&rows, &summary, tp, cp);
    }

    if !faults.is_empty() {
        let shown: Vec<String> = faults
            .iter()
            .take(SHOWN)
            .map(|f| {
                format!(
                    "prompt {} (sent in cycle {}, ended in cycle {}) {}",
                    f.prompt, f.cycles.0, f.cycles.1, f.what
                )
            })
            .collect();
        bail!(
            "{} of {} answers differed from the answer before any sleep or failed (cycle 0: \
             before the first sleep); the first {}:\n{}",
            faults.len(),
            faults.len() + checked,
            shown.len(),
            shown.join("\n")
        );
    }
    ensure!(
        during >= CLIENTS,
        "only {during} answers completed while the cycles ran, fewer than the {CLIENTS} clients: \
         the deployment was not under load"
    );
    Ok(())
}

fn print_table(rows: &[Value], summary: &Value, tp: usize, cp: usize) {
    println!(
        "`tpctl serve` {tp}x{cp} (1 thread per rank) sleeping and waking under {CLIENTS} \
         streaming clients ({PROMPT_LEN} prompt ids, {MAX_TOKENS} tokens, greedy); \
         every answer checked against the same prompt's answer before any sleep"
    );
    println!(
        "{:<5} {:>6} | {:>8} {:>8} {:>8} | {:>9} | {:>17} {:>13} {:>14}",
        "level",
        "cycles",
        "sleep ms",
        "wait",
        "keep",
        "wakeup ms",
        "released MiB/rank",
        "plain copy ms",
        "wakeup / copy"
    );
    for r in rows {
        println!(
            "{:<5} {:>6} | {:>8.1} {:>8.1} {:>8.1} | {:>9.1} | {:>17.1} {:>13.1} {:>13.1}x",
            r["level"].as_u64().unwrap_or(0),
            r["cycles"].as_u64().unwrap_or(0),
            r["sleep_ms_median"].as_f64().unwrap_or(0.0),
            r["sleep_ms_median_wait"].as_f64().unwrap_or(0.0),
            r["sleep_ms_median_keep"].as_f64().unwrap_or(0.0),
            r["wakeup_ms_median"].as_f64().unwrap_or(0.0),
            r["released_mib_per_rank"].as_f64().unwrap_or(0.0),
            r["copy_ms"].as_f64().unwrap_or(0.0),
            r["wakeup_over_copy"].as_f64().unwrap_or(0.0),
        );
    }
    let f = |k: &str| summary[k].as_f64().unwrap_or(0.0);
    println!(
        "total: {} cycles in {:.1} s = {:.2} cycles/s; {} answers checked ({} while the cycles \
         ran, {} in flight when a sleep began), {} mismatches",
        summary["cycles"],
        f("wall_s"),
        f("cycles_per_s"),
        summary["answers_checked"],
        summary["answers_during_cycles"],
        summary["answers_across_sleep"],
        summary["mismatches"],
    );
    println!(
        "resident memory (launcher + ranks, after each wakeup): {:.1} MiB after warm-up \
         (cycle {}), {:.1} MiB at the end, {:.1} MiB at most after warm-up; growth {:+.1} MiB",
        f("resident_mib_warm"),
        summary["warmup_cycles"],
        f("resident_mib_end"),
        f("resident_mib_max"),
        f("resident_growth_mib"),
    );
    println!(
        "KV cache released by a sleep: {:.1} MiB in {} allocation(s) on the rank with the most",
        f("kv_cache_mib_per_rank"),
        summary["kv_cache_allocations_per_rank"],
    );
    println!(
        "medians; sleep/wakeup: client wall time of POST /sleep and POST /wake_up (every \
         tag), sleep also per mode (wait lets the running requests finish, keep pauses them); \
         each sleep waits until a client received a token after the previous wakeup; cycle i: \
         level 1 + i % 2, mode wait or keep every other pair; released MiB/rank: the largest \
         rank's bytes from the sleep receipts (per-rank figures); plain copy: copy_from_slice \
         of those bytes in this process, median of {COPY_ROUNDS}, after the deployment stopped"
    );
}
