//! The numbers behind `GET /metrics`, in the Prometheus text format: HTTP requests by route
//! and status, prompt and generated tokens, request latency and time to first token
//! (histograms), finished requests by reason, running requests, and engine steps; with a
//! sleep/wakeup coordinator, the sleep state and what the latest operations did per rank
//! ([`render_sleep`]).

use crate::control::JournalSnapshot;
use session::sleep::DeploymentState;
use session::{FinishReason, MetricsSink, StepMetrics};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Upper bounds of the latency buckets, seconds.
const BUCKETS: [f64; 14] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

#[derive(Debug, Default, Clone)]
struct Histogram {
    /// Observations per bucket (not cumulative), the last one above every bound.
    counts: [u64; BUCKETS.len() + 1],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS.iter().position(|&b| s <= b).unwrap_or(BUCKETS.len());
        self.counts[i] += 1;
        self.sum += s;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, n) in BUCKETS.iter().zip(&self.counts) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Debug, Default)]
struct Inner {
    http: BTreeMap<(&'static str, u16), u64>,
    submitted: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
    finished: BTreeMap<&'static str, u64>,
    latency: Histogram,
    first_token: Histogram,
    steps: u64,
    step_seconds: f64,
    step_prefill_tokens: u64,
    step_decode_tokens: u64,
    /// Requests with tokens in the KV cache at the latest step.
    engine_running: usize,
    kv_usage: f64,
    prefix_queries: u64,
    prefix_hits: u64,
    preemptions: u64,
}

/// Shared counters; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Metrics(Arc<Mutex<Inner>>);

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An HTTP request on `route` was answered with `status`.
    pub fn http(&self, route: &'static str, status: u16) {
        *self.lock().http.entry((route, status)).or_default() += 1;
    }

    /// A request with `prompt_tokens` went to the engine.
    pub fn submitted(&self, prompt_tokens: usize) {
        let mut m = self.lock();
        m.submitted += 1;
        m.prompt_tokens += prompt_tokens as u64;
    }

    /// The engine produced `n` tokens.
    pub fn generated(&self, n: u64) {
        self.lock().generated_tokens += n;
    }

    /// A request's first token came `after` its submission.
    pub fn first_token(&self, after: Duration) {
        self.lock().first_token.observe(after);
    }

    /// A request ended for `reason`, `after` its submission.
    pub fn finished(&self, reason: FinishReason, after: Duration) {
        let mut m = self.lock();
        *m.finished.entry(reason.name()).or_default() += 1;
        m.latency.observe(after);
    }

    /// The engine's metrics sink, feeding the step counters; its first step sets `ready`.
    pub fn engine_sink(&self, ready: Arc<AtomicBool>) -> EngineMeter {
        EngineMeter { metrics: self.clone(), ready }
    }

    /// Everything, in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let m = self.lock();
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}");
        };
        counter(
            "tpctl_requests_total",
            "Generation requests handed to the engine.",
            m.submitted.to_string(),
        );
        counter(
            "tpctl_prompt_tokens_total",
            "Prompt tokens of the requests handed to the engine.",
            m.prompt_tokens.to_string(),
        );
        counter(
            "tpctl_generation_tokens_total",
            "Tokens generated.",
            m.generated_tokens.to_string(),
        );
        counter("tpctl_steps_total", "Engine steps run.", m.steps.to_string());
        counter(
            "tpctl_step_seconds_total",
            "Time in engine steps (agreement and model).",
            m.step_seconds.to_string(),
        );
        counter(
            "tpctl_step_prefill_tokens_total",
            "Prompt tokens processed in engine steps.",
            m.step_prefill_tokens.to_string(),
        );
        counter(
            "tpctl_step_decode_tokens_total",
            "Decode tokens processed in engine steps.",
            m.step_decode_tokens.to_string(),
        );
        counter(
            "tpctl_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            m.prefix_queries.to_string(),
        );
        counter(
            "tpctl_prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache (not computed again).",
            m.prefix_hits.to_string(),
        );
        counter(
            "tpctl_preemptions_total",
            "Requests preempted for KV cache room (recomputed later).",
            m.preemptions.to_string(),
        );
        let finished: u64 = m.finished.values().sum();
        let unfinished = m.submitted.saturating_sub(finished);
        let running = (m.engine_running as u64).min(unfinished);
        let mut gauge = |name: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}");
        };
        gauge(
            "tpctl_requests_running",
            "Generation requests with tokens in the KV cache.",
            running.to_string(),
        );
        gauge(
            "tpctl_requests_waiting",
            "Generation requests not finished and not running (queued, waiting for KV cache \
             room, or preempted).",
            (unfinished - running).to_string(),
        );
        gauge(
            "tpctl_kv_cache_usage_ratio",
            "Share of the KV pool's blocks held by requests (rank 0's view, the same on every \
             rank).",
            m.kv_usage.to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP tpctl_requests_finished_total Generation requests finished, by reason.\n# TYPE tpctl_requests_finished_total counter"
        );
        for (reason, n) in &m.finished {
            let _ = writeln!(out, "tpctl_requests_finished_total{{reason=\"{reason}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP tpctl_http_requests_total HTTP requests answered, by route and status.\n# TYPE tpctl_http_requests_total counter"
        );
        for ((route, status), n) in &m.http {
            let _ = writeln!(
                out,
                "tpctl_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        m.latency.render(
            &mut out,
            "tpctl_request_latency_seconds",
            "Time from submission to the end of a generation request.",
        );
        m.first_token.render(
            &mut out,
            "tpctl_time_to_first_token_seconds",
            "Time from submission to the first generated token.",
        );
        out
    }
}

/// The live checkpoint as an info gauge: `tpctl_weights_checkpoint_info{checkpoint="PATH"} 1`.
pub fn render_checkpoint(out: &mut String, checkpoint: &str) {
    let name = "tpctl_weights_checkpoint_info";
    let _ = writeln!(
        out,
        "# HELP {name} The checkpoint whose weights are live (the latest weight update's, or the one the deployment started with).\n# TYPE {name} gauge\n{name}{{checkpoint=\"{}\"}} 1",
        label_value(checkpoint)
    );
}

/// `value` escaped for a Prometheus label: backslash, double quote and newline.
fn label_value(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Appends the sleep metrics: `tpctl_sleeping` (1 while any tag is asleep or waking),
/// operations and failures by action, and from the latest operations, bytes per rank and tag
/// (released by a sleep, restored by a wakeup), resident bytes per rank and device bytes per
/// rank and device.
pub fn render_sleep(out: &mut String, state: &DeploymentState, journal: &JournalSnapshot) {
    let sleeping = matches!(state, DeploymentState::Sleeping(_) | DeploymentState::Waking(_));
    let failed = matches!(state, DeploymentState::Failed(_));
    let mut gauge = |name: &str, help: &str, value: u8| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}");
    };
    gauge(
        "tpctl_sleeping",
        "1 while some memory tag is asleep (or waking) on every rank.",
        sleeping.into(),
    );
    gauge(
        "tpctl_deployment_failed",
        "1 once the deployment failed (fail-stop or a lost rank).",
        failed.into(),
    );
    let _ = writeln!(
        out,
        "# HELP tpctl_sleep_ops_total Sleep, wakeup and weight-update operations that succeeded, by action.\n# TYPE tpctl_sleep_ops_total counter"
    );
    for action in ["sleep", "wakeup", "update_weights"] {
        let n = journal.ops.get(action).copied().unwrap_or(0);
        let _ = writeln!(out, "tpctl_sleep_ops_total{{action=\"{action}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP tpctl_sleep_op_failures_total Sleep, wakeup and weight-update operations that failed, by action.\n# TYPE tpctl_sleep_op_failures_total counter"
    );
    for action in ["sleep", "wakeup", "update_weights"] {
        let n = journal.failures.get(action).copied().unwrap_or(0);
        let _ = writeln!(out, "tpctl_sleep_op_failures_total{{action=\"{action}\"}} {n}");
    }
    for (name, help, figures) in [
        (
            "tpctl_memory_released_bytes",
            "Bytes of a memory tag on a rank that the latest sleep moving it released.",
            &journal.released,
        ),
        (
            "tpctl_memory_restored_bytes",
            "Bytes of a memory tag on a rank that the latest wakeup moving it restored.",
            &journal.restored,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for ((rank, tag), n) in figures {
            let _ = writeln!(out, "{name}{{rank=\"{rank}\",tag=\"{tag}\"}} {n}");
        }
    }
    let _ = writeln!(
        out,
        "# HELP tpctl_rank_resident_bytes Resident host bytes of a rank's process after the latest sleep or wakeup.\n# TYPE tpctl_rank_resident_bytes gauge"
    );
    for (rank, n) in &journal.resident {
        let _ = writeln!(out, "tpctl_rank_resident_bytes{{rank=\"{rank}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP tpctl_rank_device_bytes Device bytes of a rank's process after the latest sleep or wakeup.\n# TYPE tpctl_rank_device_bytes gauge"
    );
    for ((rank, device), n) in &journal.device {
        let _ = writeln!(
            out,
            "tpctl_rank_device_bytes{{rank=\"{rank}\",device=\"cuda:{device}\"}} {n}"
        );
    }
}

/// The engine's [`MetricsSink`]: step counts and times.
pub struct EngineMeter {
    metrics: Metrics,
    ready: Arc<AtomicBool>,
}

impl MetricsSink for EngineMeter {
    fn step(&mut self, s: &StepMetrics) {
        // A step ran, so the session is open (a busy engine may not idle for a while).
        self.ready.store(true, Ordering::Relaxed);
        let mut m = self.metrics.lock();
        m.steps += 1;
        m.step_seconds += (s.agreement + s.model).as_secs_f64();
        m.step_prefill_tokens += s.prefill_tokens as u64;
        m.step_decode_tokens += s.decode_tokens as u64;
        m.engine_running = s.running;
        m.kv_usage = s.kv_usage;
        m.prefix_queries += s.prefix_queries;
        m.prefix_hits += s.prefix_hits;
        m.preemptions += s.preemptions;
    }
}

#[cfg(test)]
mod tests;
