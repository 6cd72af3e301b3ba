//! The numbers behind `GET /metrics`, in the Prometheus text format.
//!
//! What vLLM's dashboards read comes under vLLM's names, each with a `model_name` label:
//! requests running and waiting, KV-cache usage, prefix-cache queries and hits, preemptions,
//! prompt and generated tokens, finished requests by reason, and the per-request histograms
//! (time to first token, inter-token latency, end-to-end latency, queue, prefill, decode and
//! inference time, prompt and generation lengths, tokens per engine step). A request's clock
//! starts when its HTTP request arrives, so the time it waits for a wakeup counts in its queue
//! time, time to first token and latency (as vLLM counts tokenization and queueing).
//!
//! What only tpctl has keeps a `tpctl_` name: requests handed to the engine, finished requests
//! by tpctl's finer reasons, HTTP requests by route and status, engine steps, the live
//! checkpoint ([`render_checkpoint`]) and, with a sleep/wakeup coordinator, the sleep state and
//! what the latest operations did per rank ([`render_sleep`]).

use crate::control::JournalSnapshot;
use session::sleep::DeploymentState;
use session::{FinishReason, MetricsSink, StepMetrics};
use std::collections::BTreeMap;
use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bucket bounds of the time to first token, seconds (vLLM's, from 1 ms).
const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Bucket bounds of the time between two tokens, seconds (vLLM's, with the milliseconds a small
/// model decodes in on a CPU).
const INTER_TOKEN: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
/// Bucket bounds of request-long intervals, seconds (vLLM's, with the shorter ones below).
const REQUEST: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];
/// Bucket bounds of token counts (1, 2, 5 per decade, as vLLM's).
const TOKENS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0, 200000.0, 500000.0, 1000000.0,
];

/// The `phase` labels of `tpctl_step_phase_seconds_total`, in the order a step runs them:
/// [`StepPhases`](session::StepPhases)' with the agreement between `schedule` and `forward`.
const STEP_PHASES: [&str; 6] = ["schedule", "agree", "forward", "sample", "update", "emit"];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative), the last one above every bound.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, value: f64) {
        let i = self.bounds.iter().position(|&b| value <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }

    fn observe_time(&mut self, d: Duration) {
        self.observe(d.as_secs_f64());
    }
}

/// One request's times, from its arrival at the HTTP server; every interval the histograms
/// take is measured on one monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestTimes {
    /// Arrival to its first step (vLLM's queue time; a wait for a wakeup included).
    pub queued: Option<Duration>,
    /// Arrival to its first token.
    pub first_token: Option<Duration>,
    /// Arrival to its last token.
    pub last_token: Option<Duration>,
    /// Arrival to its end.
    pub end: Duration,
}

/// Shared counters; cheap to clone.
#[derive(Debug, Clone)]
pub struct Metrics(Arc<Mutex<Inner>>);

#[derive(Debug)]
struct Inner {
    http: BTreeMap<(&'static str, u16), u64>,
    submitted: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
    /// By tpctl's reason ([`FinishReason::name`]).
    finished: BTreeMap<&'static str, u64>,
    /// By vLLM's `finished_reason` (stop, length, abort).
    success: BTreeMap<&'static str, u64>,
    /// Requests held by the HTTP server until the deployment wakes up.
    held: u64,
    e2e: Histogram,
    first_token: Histogram,
    inter_token: Histogram,
    per_output_token: Histogram,
    queue: Histogram,
    prefill: Histogram,
    decode: Histogram,
    inference: Histogram,
    request_prompt: Histogram,
    request_generation: Histogram,
    iteration_tokens: Histogram,
    steps: u64,
    step_seconds: f64,
    /// Rank 0's time per step phase, in the order they run ([`STEP_PHASES`]).
    phase_seconds: [f64; STEP_PHASES.len()],
    /// Time the handlers spent decoding token ids to text.
    detokenize_seconds: f64,
    /// Time the handlers spent turning tokens into streamed chunks (JSON).
    encode_seconds: f64,
    step_prefill_tokens: u64,
    step_decode_tokens: u64,
    /// Requests with tokens in the KV cache at the latest step.
    engine_running: usize,
    kv_usage: f64,
    prefix_queries: u64,
    prefix_hits: u64,
    preemptions: u64,
    /// What rank 0's CUDA graphs did, at the latest step (`None`: no GPU).
    graphs: Option<tensor::kernels::cuda::GraphStats>,
}

impl Default for Inner {
    fn default() -> Self {
        Inner {
            http: BTreeMap::new(),
            submitted: 0,
            prompt_tokens: 0,
            generated_tokens: 0,
            finished: BTreeMap::new(),
            success: BTreeMap::new(),
            held: 0,
            e2e: Histogram::new(REQUEST),
            first_token: Histogram::new(TTFT),
            inter_token: Histogram::new(INTER_TOKEN),
            per_output_token: Histogram::new(INTER_TOKEN),
            queue: Histogram::new(REQUEST),
            prefill: Histogram::new(REQUEST),
            decode: Histogram::new(REQUEST),
            inference: Histogram::new(REQUEST),
            request_prompt: Histogram::new(TOKENS),
            request_generation: Histogram::new(TOKENS),
            iteration_tokens: Histogram::new(TOKENS),
            steps: 0,
            step_seconds: 0.0,
            phase_seconds: [0.0; STEP_PHASES.len()],
            detokenize_seconds: 0.0,
            encode_seconds: 0.0,
            step_prefill_tokens: 0,
            step_decode_tokens: 0,
            engine_running: 0,
            kv_usage: 0.0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            graphs: None,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics(Arc::new(Mutex::new(Inner::default())))
    }
}

/// vLLM's `finished_reason` label of a finish reason.
fn vllm_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::StopToken => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled | FinishReason::Aborted | FinishReason::Rejected => "abort",
    }
}

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

    /// A request is held until the deployment wakes up; it counts as waiting until the
    /// returned guard is dropped.
    pub fn held(&self) -> Held {
        self.lock().held += 1;
        Held(self.clone())
    }

    /// A request's first step began `after` its arrival.
    pub fn scheduled(&self, after: Duration) {
        self.lock().queue.observe_time(after);
    }

    /// The engine produced a token of a request: its first `after` the request's arrival
    /// (`since_previous: None`), or `since_previous` after the one before.
    pub fn token(&self, after: Duration, since_previous: Option<Duration>) {
        let mut m = self.lock();
        m.generated_tokens += 1;
        match since_previous {
            None => m.first_token.observe_time(after),
            Some(gap) => m.inter_token.observe_time(gap),
        }
    }

    /// A request with `prompt_tokens` ended for `reason` after generating `generated`
    /// tokens, at the `times` since its arrival.
    pub fn finished(
        &self,
        reason: FinishReason,
        prompt_tokens: usize,
        generated: usize,
        times: RequestTimes,
    ) {
        let mut m = self.lock();
        *m.finished.entry(reason.name()).or_default() += 1;
        *m.success.entry(vllm_reason(reason)).or_default() += 1;
        m.e2e.observe_time(times.end);
        m.request_prompt.observe(prompt_tokens as f64);
        m.request_generation.observe(generated as f64);
        if let (Some(queued), Some(first), Some(last)) =
            (times.queued, times.first_token, times.last_token)
        {
            m.prefill.observe_time(first.saturating_sub(queued));
            m.decode.observe_time(last.saturating_sub(first));
            m.inference.observe_time(last.saturating_sub(queued));
            if generated > 1 {
                let per_token = last.saturating_sub(first) / (generated as u32 - 1);
                m.per_output_token.observe_time(per_token);
            }
        }
    }

    /// A handler spent `took` decoding a token id to text ([`Events::recv`]).
    ///
    /// [`Events::recv`]: super::bridge::Events::recv
    pub fn detokenized(&self, took: Duration) {
        self.lock().detokenize_seconds += took.as_secs_f64();
    }

    /// A handler spent `took` turning a token into a streamed chunk.
    pub fn encoded(&self, took: Duration) {
        self.lock().encode_seconds += took.as_secs_f64();
    }

    /// The engine's metrics sink, feeding the step counters; its first step sets `ready`.
    pub fn engine_sink(&self, ready: Arc<AtomicBool>) -> EngineMeter {
        EngineMeter { metrics: self.clone(), ready, graphs: None }
    }

    /// Everything, in the Prometheus text format (version 0.0.4), vLLM's names labelled with
    /// `model_name`.
    pub fn render(&self, model_name: &str) -> String {
        let m = self.lock();
        let mut out = Exposition::new(model_name);
        let finished: u64 = m.finished.values().sum();
        let unfinished = m.submitted.saturating_sub(finished);
        let running = (m.engine_running as u64).min(unfinished);
        out.gauge(
            "vllm:num_requests_running",
            "Requests with tokens in the KV cache (in model execution batches).",
            running,
        );
        out.gauge(
            "vllm:num_requests_waiting",
            "Requests waiting: queued, waiting for KV cache room, preempted, or held until the \
             deployment wakes up.",
            unfinished - running + m.held,
        );
        out.gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of the KV pool's blocks held by requests (0-1; rank 0's view, the same on \
             every rank).",
            m.kv_usage,
        );
        out.counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            m.prefix_queries,
        );
        out.counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not computed again).",
            m.prefix_hits,
        );
        out.counter(
            "vllm:num_preemptions",
            "Requests preempted for KV cache room (recomputed later).",
            m.preemptions,
        );
        out.counter(
            "vllm:prompt_tokens",
            "Prompt tokens of the requests handed to the engine.",
            m.prompt_tokens,
        );
        out.counter("vllm:generation_tokens", "Tokens generated.", m.generated_tokens);
        out.labelled(
            "vllm:request_success_total",
            "counter",
            "Finished requests, by finish reason (stop, length, abort).",
            m.success.iter().map(|(reason, n)| (vec![("finished_reason", *reason)], *n)),
        );
        for (name, help, h) in [
            (
                "vllm:time_to_first_token_seconds",
                "Time from a request's arrival to its first token.",
                &m.first_token,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Time between two successive tokens of a request.",
                &m.inter_token,
            ),
            (
                "vllm:time_per_output_token_seconds",
                "Time between two successive tokens of a request (the name older dashboards read).",
                &m.inter_token,
            ),
            (
                "vllm:request_time_per_output_token_seconds",
                "A request's decode time over its tokens after the first.",
                &m.per_output_token,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Time from a request's arrival to its end.",
                &m.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Time from a request's arrival to its first step (a wait for a wakeup included).",
                &m.queue,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Time from a request's first step to its first token.",
                &m.prefill,
            ),
            (
                "vllm:request_decode_time_seconds",
                "Time from a request's first token to its last.",
                &m.decode,
            ),
            (
                "vllm:request_inference_time_seconds",
                "Time from a request's first step to its last token.",
                &m.inference,
            ),
            ("vllm:request_prompt_tokens", "Prompt tokens per request.", &m.request_prompt),
            (
                "vllm:request_generation_tokens",
                "Generated tokens per request.",
                &m.request_generation,
            ),
            ("vllm:iteration_tokens_total", "Tokens per engine step.", &m.iteration_tokens),
        ] {
            out.histogram(name, help, h);
        }
        // tpctl's own, without the model label.
        out.model_label = None;
        out.counter(
            "tpctl_requests_total",
            "Generation requests handed to the engine.",
            m.submitted,
        );
        out.counter("tpctl_steps_total", "Engine steps run.", m.steps);
        if let Some(g) = m.graphs {
            for (name, help, n) in [
                ("captures", "CUDA graphs of decode steps captured on rank 0.", g.captures),
                ("replays", "Steps that replayed a CUDA graph on rank 0.", g.replays),
                (
                    "misses",
                    "Replays on rank 0 that stopped matching their graph (the step went on \
                     eagerly).",
                    g.misses,
                ),
                (
                    "failed_captures",
                    "Captures on rank 0 that failed or were abandoned (their shape's steps run \
                     eagerly).",
                    g.failed_captures,
                ),
            ] {
                out.counter(&format!("tpctl_cuda_graph_{name}_total"), help, n);
            }
            out.counter(
                "tpctl_cuda_graph_capture_seconds_total",
                "Rank 0's host time in the steps it captured as CUDA graphs, from the capture's \
                 start to the graph made.",
                g.capture_time.as_secs_f64(),
            );
        }
        out.counter(
            "tpctl_step_seconds_total",
            "Time in engine steps (agreement and model).",
            m.step_seconds,
        );
        let phases = STEP_PHASES.iter().zip(m.phase_seconds);
        out.labelled(
            "tpctl_step_phase_seconds_total",
            "counter",
            "Rank 0's time in engine steps by phase: schedule (admitting arrived requests and \
             planning the step, waits for a request not counted), agree (the ranks' step \
             agreement), forward (the model's forward pass, a greedy argmax included), sample \
             (host sampling after the forward pass), update (the scheduler taking the tokens), \
             emit (handing them to the HTTP handlers' channels).",
            phases.map(|(phase, secs)| (vec![("phase", *phase)], secs)),
        );
        out.counter(
            "tpctl_http_detokenize_seconds_total",
            "Time the HTTP handlers spent decoding generated token ids to text (on the HTTP \
             runtime's threads, not the engine's).",
            m.detokenize_seconds,
        );
        out.counter(
            "tpctl_http_encode_seconds_total",
            "Time the streaming HTTP handlers spent turning tokens into chunks (stop strings, \
             log-probabilities, JSON); the socket writes after that are not counted.",
            m.encode_seconds,
        );
        out.counter(
            "tpctl_step_prefill_tokens_total",
            "Prompt tokens processed in engine steps.",
            m.step_prefill_tokens,
        );
        out.counter(
            "tpctl_step_decode_tokens_total",
            "Decode tokens processed in engine steps.",
            m.step_decode_tokens,
        );
        out.labelled(
            "tpctl_requests_finished_total",
            "counter",
            "Generation requests finished, by reason (length, stop, cancelled by the client, \
             abort by a sleep, rejected).",
            m.finished.iter().map(|(reason, n)| (vec![("reason", *reason)], *n)),
        );
        let statuses: Vec<(&str, String, u64)> =
            m.http.iter().map(|((route, status), n)| (*route, status.to_string(), *n)).collect();
        out.labelled(
            "tpctl_http_requests_total",
            "counter",
            "HTTP requests answered, by route and status.",
            statuses.iter().map(|(route, status, n)| {
                (vec![("route", *route), ("status", status.as_str())], *n)
            }),
        );
        out.text
    }
}

/// A request held until the deployment wakes up ([`Metrics::held`]).
#[derive(Debug)]
pub struct Held(Metrics);

impl Drop for Held {
    fn drop(&mut self) {
        let mut m = self.0.lock();
        m.held = m.held.saturating_sub(1);
    }
}

/// Writes metric families in the Prometheus text format, every sample with the model label
/// while there is one.
struct Exposition {
    text: String,
    /// `model_name="..."`, escaped.
    model_label: Option<String>,
}

impl Exposition {
    fn new(model_name: &str) -> Self {
        Exposition {
            text: String::new(),
            model_label: Some(format!("model_name=\"{}\"", label_value(model_name))),
        }
    }

    /// Without the model label (the sleep and checkpoint families).
    fn unlabelled() -> Self {
        Exposition { text: String::new(), model_label: None }
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    /// One sample: `name{labels} value`, the model label last (as vLLM writes it).
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl Display) {
        let mut all: Vec<String> =
            labels.iter().map(|(k, v)| format!("{k}=\"{}\"", label_value(v))).collect();
        all.extend(self.model_label.clone());
        if all.is_empty() {
            let _ = writeln!(self.text, "{name} {value}");
        } else {
            let _ = writeln!(self.text, "{name}{{{}}} {value}", all.join(","));
        }
    }

    /// A counter, named with `_total` (the text format's convention; vLLM's
    /// `vllm:prompt_tokens` is `vllm:prompt_tokens_total` there).
    fn counter(&mut self, name: &str, help: &str, value: impl Display) {
        let total =
            if name.ends_with("_total") { name.to_owned() } else { format!("{name}_total") };
        self.header(&total, "counter", help);
        self.sample(&total, &[], value);
    }

    fn gauge(&mut self, name: &str, help: &str, value: impl Display) {
        self.header(name, "gauge", help);
        self.sample(name, &[], value);
    }

    /// A family with one sample per label set.
    fn labelled<'a, V: Display>(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        samples: impl Iterator<Item = (Vec<(&'a str, &'a str)>, V)>,
    ) {
        self.header(name, kind, help);
        for (labels, value) in samples {
            self.sample(name, &labels, value);
        }
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (bound, n) in h.bounds.iter().zip(&h.counts) {
            cumulative += n;
            self.sample(&bucket, &[("le", &bound.to_string())], cumulative);
        }
        self.sample(&bucket, &[("le", "+Inf")], h.count);
        self.sample(&format!("{name}_sum"), &[], h.sum);
        self.sample(&format!("{name}_count"), &[], h.count);
    }
}

/// The live weights as info gauges: `tpctl_weights_checkpoint_info{checkpoint="PATH"} 1` and
/// `tpctl_weight_version_info{weight_version="V"} 1`.
pub fn render_checkpoint(out: &mut String, checkpoint: &str, version: &str) {
    let mut e = Exposition::unlabelled();
    e.labelled(
        "tpctl_weights_checkpoint_info",
        "gauge",
        "The checkpoint whose weights are live (the latest weight update's, or the one the \
         deployment started with).",
        std::iter::once((vec![("checkpoint", checkpoint)], 1)),
    );
    e.labelled(
        "tpctl_weight_version_info",
        "gauge",
        "The live weights' version (the latest weight update's weight_version, else the count \
         of updates), which every answer carries.",
        std::iter::once((vec![("weight_version", version)], 1)),
    );
    out.push_str(&e.text);
}

/// `tpctl_paused`: 1 while generation is paused (`/pause`, `tpctl pause`).
pub fn render_paused(out: &mut String, paused: bool) {
    let mut e = Exposition::unlabelled();
    e.gauge(
        "tpctl_paused",
        "1 while generation is paused (/pause until /resume).",
        u8::from(paused),
    );
    out.push_str(&e.text);
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
    let mut e = Exposition::unlabelled();
    e.gauge(
        "tpctl_sleeping",
        "1 while some memory tag is asleep (or waking) on every rank.",
        u8::from(sleeping),
    );
    e.gauge(
        "tpctl_deployment_failed",
        "1 once the deployment failed (fail-stop or a lost rank).",
        u8::from(failed),
    );
    let actions = ["sleep", "wakeup", "update_weights"];
    for (name, help, counts) in [
        (
            "tpctl_sleep_ops_total",
            "Sleep, wakeup and weight-update operations that succeeded, by action.",
            &journal.ops,
        ),
        (
            "tpctl_sleep_op_failures_total",
            "Sleep, wakeup and weight-update operations that failed, by action.",
            &journal.failures,
        ),
    ] {
        let by_action =
            actions.iter().map(|a| (vec![("action", *a)], counts.get(*a).copied().unwrap_or(0)));
        e.labelled(name, "counter", help, by_action);
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
        let rows: Vec<(String, &str, u64)> =
            figures.iter().map(|((rank, tag), n)| (rank.to_string(), tag.as_str(), *n)).collect();
        e.labelled(
            name,
            "gauge",
            help,
            rows.iter().map(|(rank, tag, n)| (vec![("rank", rank.as_str()), ("tag", *tag)], *n)),
        );
    }
    let resident: Vec<(String, u64)> =
        journal.resident.iter().map(|(rank, n)| (rank.to_string(), *n)).collect();
    e.labelled(
        "tpctl_rank_resident_bytes",
        "gauge",
        "Resident host bytes of a rank's process after the latest sleep or wakeup.",
        resident.iter().map(|(rank, n)| (vec![("rank", rank.as_str())], *n)),
    );
    let device: Vec<(String, String, u64)> = journal
        .device
        .iter()
        .map(|((rank, device), n)| (rank.to_string(), format!("cuda:{device}"), *n))
        .collect();
    e.labelled(
        "tpctl_rank_device_bytes",
        "gauge",
        "Device bytes of a rank's process after the latest sleep or wakeup.",
        device.iter().map(|(rank, device, n)| {
            (vec![("rank", rank.as_str()), ("device", device.as_str())], *n)
        }),
    );
    out.push_str(&e.text);
}

/// The engine's [`MetricsSink`]: step counts and times.
pub struct EngineMeter {
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    /// Reads what rank 0's CUDA graphs did (see [`EngineMeter::with_graphs`]).
    graphs: Option<GraphReader>,
}

/// Reads a backend's graph counts.
type GraphReader = Box<dyn Fn() -> Option<tensor::kernels::cuda::GraphStats> + Send>;

impl EngineMeter {
    /// Also reads, after each step, what rank 0's CUDA graphs did (`Backend::graph_stats`),
    /// for the `tpctl_cuda_graph_*` counters.
    pub fn with_graphs(
        mut self,
        read: impl Fn() -> Option<tensor::kernels::cuda::GraphStats> + Send + 'static,
    ) -> Self {
        self.graphs = Some(Box::new(read));
        self
    }
}

impl MetricsSink for EngineMeter {
    fn step(&mut self, s: &StepMetrics) {
        // A step ran, so the session is open (a busy engine may not idle for a while).
        self.ready.store(true, Ordering::Relaxed);
        let mut m = self.metrics.lock();
        m.steps += 1;
        m.step_seconds += (s.agreement + s.model).as_secs_f64();
        let p = s.phases;
        let phases = [p.schedule, s.agreement, p.forward, p.sample, p.update, p.emit];
        for (total, took) in m.phase_seconds.iter_mut().zip(phases) {
            *total += took.as_secs_f64();
        }
        m.step_prefill_tokens += s.prefill_tokens as u64;
        m.step_decode_tokens += s.decode_tokens as u64;
        m.iteration_tokens.observe((s.prefill_tokens + s.decode_tokens) as f64);
        m.engine_running = s.running;
        m.kv_usage = s.kv_usage;
        m.prefix_queries += s.prefix_queries;
        m.prefix_hits += s.prefix_hits;
        m.preemptions += s.preemptions;
        if let Some(read) = &self.graphs {
            m.graphs = read();
        }
    }
}

#[cfg(test)]
mod tests;
