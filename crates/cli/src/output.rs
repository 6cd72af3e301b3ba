//! Rank 0's sinks for `tpctl run`: generated text or JSON lines on standard output, and the
//! numbers behind the closing summary.

use crate::spec::OutputFormat;
use session::{BoxError, Detokenizer, FinishReason, MetricsSink, OutputSink, StepMetrics};
use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tensor::kernels::cuda::Counters;

/// What a prompt was, for the report.
#[derive(Debug, Clone)]
pub struct PromptInfo {
    /// The text as the user gave it.
    pub text: String,
    /// Its token ids (after the chat template, if any).
    pub ids: Vec<u32>,
}

#[derive(Debug, Default)]
struct Timing {
    first_token: Option<Duration>,
    finished: Option<Duration>,
}

/// When a run's engine was ready and its first token came.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunClock {
    /// From the printer's creation to the session's open: the model built (weights loaded and
    /// in place, the KV pool committed).
    pub startup: Option<Duration>,
    /// From the session's open (the requests' admission) to the first token of any request.
    pub first_token: Option<Duration>,
}

/// Prints results as they come.
pub struct Printer {
    format: OutputFormat,
    prompts: Vec<PromptInfo>,
    /// The printer's creation until the session opens, then the open: each request's times
    /// count from there.
    start: Instant,
    texts: HashMap<u64, String>,
    /// Decodes the engine's token ids.
    decoder: Detokenizer,
    timings: HashMap<u64, Timing>,
    stream: bool,
    clock: Arc<Mutex<RunClock>>,
    /// Tokens generated, or counted as done (a request that finished early), out of `budget`.
    generated: usize,
    budget: usize,
    max_tokens: usize,
}

impl Printer {
    /// A printer for `prompts` (request ids are their indices) decoding with `tokenizer`;
    /// `clock` receives the start-up time and the time to the first token of any request.
    pub fn new(
        format: OutputFormat,
        prompts: Vec<PromptInfo>,
        tokenizer: Arc<text::Tokenizer>,
        max_tokens: usize,
        clock: Arc<Mutex<RunClock>>,
    ) -> Self {
        let stream = format == OutputFormat::Text && prompts.len() == 1;
        Printer {
            generated: 0,
            budget: max_tokens * prompts.len(),
            max_tokens,
            format,
            prompts,
            start: Instant::now(),
            texts: HashMap::new(),
            decoder: Detokenizer::new(Box::new(session::TokenizerCodec(tokenizer))),
            timings: HashMap::new(),
            stream,
            clock,
        }
    }
}

fn out(text: &str) -> Result<(), BoxError> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

impl OutputSink for Printer {
    fn opened(&mut self) {
        let now = Instant::now();
        let mut clock = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        // A later session (a replacement) keeps the first start-up.
        if clock.startup.is_none() {
            clock.startup = Some(now - self.start);
        }
        self.start = now;
    }

    fn token(
        &mut self,
        request: u64,
        token: u32,
        last: bool,
        _logprobs: Option<&session::TokenLogprobs>,
    ) -> Result<(), BoxError> {
        let text = &self.decoder.piece(request, token, last)?;
        let now = self.start.elapsed();
        let t = self.timings.entry(request).or_default();
        if t.first_token.is_none() {
            t.first_token = Some(now);
            let mut clock = self.clock.lock().unwrap_or_else(|e| e.into_inner());
            clock.first_token.get_or_insert(now);
        }
        if self.stream {
            out(text)?;
        } else {
            self.texts.entry(request).or_default().push_str(text);
            // Nothing shows while the text is held back: a bar on the launcher says how far.
            self.generated += 1;
            crate::progress::report_generation(self.generated, self.budget);
        }
        Ok(())
    }

    fn finished(
        &mut self,
        request: u64,
        reason: FinishReason,
        tokens: &[u32],
    ) -> Result<(), BoxError> {
        self.decoder.forget(request);
        let now = self.start.elapsed();
        let timing = self.timings.entry(request).or_default();
        timing.finished = Some(now);
        if !self.stream {
            // What it did not generate is done too.
            self.generated += self.max_tokens.saturating_sub(tokens.len());
            crate::progress::report_generation(self.generated, self.budget);
        }
        let text = self.texts.remove(&request).unwrap_or_default();
        let prompt = self
            .prompts
            .get(request as usize)
            .cloned()
            .unwrap_or(PromptInfo { text: String::new(), ids: Vec::new() });
        match self.format {
            OutputFormat::Text if self.stream => out("\n"),
            OutputFormat::Text => out(&format!("=== prompt {request}: {}\n{text}\n", prompt.text)),
            OutputFormat::Jsonl => {
                let ttft = timing.first_token.map(|d| d.as_secs_f64() * 1e3);
                // The model's build before the admission, apart from the request's times.
                let startup = self.clock.lock().unwrap_or_else(|e| e.into_inner()).startup;
                let line = serde_json::json!({
                    "index": request,
                    "prompt": prompt.text,
                    "prompt_token_ids": prompt.ids,
                    "token_ids": tokens,
                    "text": text,
                    "finish_reason": reason.name(),
                    "time_to_first_token_ms": ttft,
                    "total_ms": now.as_secs_f64() * 1e3,
                    "startup_ms": startup.map(|d| d.as_secs_f64() * 1e3),
                });
                out(&format!("{line}\n"))
            }
        }
    }
}

/// Prefill and decode token counts and the step time they took.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    /// Prompt tokens.
    pub prefill_tokens: usize,
    /// Time in steps that had prompt tokens.
    pub prefill_time: Duration,
    /// Generated tokens in decode-only steps.
    pub decode_tokens: usize,
    /// Time in decode-only steps.
    pub decode_time: Duration,
    /// Decode-only steps.
    pub decode_steps: u64,
    /// Of `decode_time`, the time the host spent blocked waiting for the GPU; `None` on the
    /// CPU.
    pub decode_gpu_wait: Option<Duration>,
    /// Of `decode_time`, the time the GPU worked on the steps (events on its stream around
    /// each, read as the device passes them); `None` on the CPU.
    pub decode_gpu_busy: Option<Duration>,
    /// What decode-only steps asked of the GPU's driver (launches, allocations, copies, host
    /// waits); `None` on the CPU.
    pub decode_gpu_calls: Option<Counters>,
    /// What the GPU's step workspaces have done (see `tensor::kernels::workspace`); `None`
    /// on the CPU.
    pub workspaces: Option<tensor::kernels::workspace::WorkspaceStats>,
    /// What the GPU's step graphs have done; `None` on the CPU.
    pub graphs: Option<tensor::kernels::cuda::GraphStats>,
    /// Steps.
    pub steps: u64,
}

/// Collects [`Totals`] from every step, and with a GPU, the time each step waited for it.
#[derive(Debug, Clone, Default)]
pub struct Meter {
    /// What was collected so far.
    pub totals: Arc<Mutex<Totals>>,
    /// The kernels, read after each step for the host's time blocked on the GPU.
    gpu: Option<tensor::kernels::Backend>,
    /// The GPU wait the last step ended at.
    waited: Duration,
    /// The GPU's busy time the last step ended at.
    busy: Duration,
    /// The driver calls counted when the last step ended.
    calls: Counters,
}

impl Meter {
    /// A meter that also splits decode steps into host time and time waiting for the GPU,
    /// when `compute` runs on one.
    pub fn with_backend(compute: &tensor::kernels::Backend) -> Meter {
        let waited = compute.device_wait();
        Meter {
            gpu: waited.is_some().then(|| compute.clone()),
            waited: waited.unwrap_or_default(),
            busy: compute.device_busy().unwrap_or_default(),
            calls: compute.device_counters().unwrap_or_default(),
            ..Meter::default()
        }
    }
}

impl MetricsSink for Meter {
    fn step(&mut self, m: &StepMetrics) {
        let waited = self.gpu.as_ref().and_then(tensor::kernels::Backend::device_wait);
        let step_wait = waited.map(|w| w.saturating_sub(std::mem::replace(&mut self.waited, w)));
        // Read as the device passes the steps' ends: a step's share may land in a later one's.
        let busy = self.gpu.as_ref().and_then(tensor::kernels::Backend::device_busy);
        let step_busy = busy.map(|b| b.saturating_sub(std::mem::replace(&mut self.busy, b)));
        let counted = self.gpu.as_ref().and_then(tensor::kernels::Backend::device_counters);
        let step_calls = counted.map(|c| c.since(&std::mem::replace(&mut self.calls, c)));
        let workspaces = self.gpu.as_ref().and_then(tensor::kernels::Backend::workspace_stats);
        let graphs = self.gpu.as_ref().and_then(tensor::kernels::Backend::graph_stats);
        let mut t = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        let time = m.model + m.agreement;
        t.steps += 1;
        t.workspaces = workspaces;
        t.graphs = graphs;
        if m.prefill_tokens > 0 {
            t.prefill_tokens += m.prefill_tokens;
            t.prefill_time += time;
        } else {
            t.decode_tokens += m.decode_tokens;
            t.decode_time += time;
            t.decode_steps += 1;
            if let Some(w) = step_wait {
                // Waits outside the step's model time (none today) are not the step's.
                *t.decode_gpu_wait.get_or_insert_default() += w.min(time);
            }
            if let Some(b) = step_busy {
                *t.decode_gpu_busy.get_or_insert_default() += b;
            }
            if let Some(c) = step_calls {
                let total = t.decode_gpu_calls.get_or_insert_default();
                *total = total.plus(&c);
            }
        }
    }
}

/// The closing summary line: the start-up (model built), then what the requests took from
/// their admission.
pub fn summary(totals: &Totals, clock: &RunClock, wall: Duration) -> String {
    let rate = |n: usize, t: Duration| if t.is_zero() { 0.0 } else { n as f64 / t.as_secs_f64() };
    let first_token = clock.first_token;
    format!(
        "start-up {}, time to first token {}, prefill {:.1} tok/s ({} tokens), decode {:.1} tok/s ({} tokens), {} steps in {:.2} s",
        clock.startup.map_or("-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64())),
        first_token.map_or("-".to_owned(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3)),
        rate(totals.prefill_tokens, totals.prefill_time),
        totals.prefill_tokens,
        rate(totals.decode_tokens, totals.decode_time),
        totals.decode_tokens,
        totals.steps,
        wall.as_secs_f64()
    ) + &gpu_split(totals)
}

/// With a GPU, the mean decode step split into the host's own time (queueing kernels, the
/// scheduler, sampling) and the time it waited for the GPU: a step that is mostly host time
/// is bound by kernel launches, not by the GPU.
fn gpu_split(totals: &Totals) -> String {
    let (Some(wait), steps) = (totals.decode_gpu_wait, totals.decode_steps) else {
        return String::new();
    };
    if steps == 0 {
        return String::new();
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
    let step = ms(totals.decode_time);
    let waiting = ms(wait);
    let calls = totals
        .decode_gpu_calls
        .map_or(String::new(), |c| format!("; driver calls {}", c.per_step(steps)));
    let workspaces = totals.workspaces.map_or(String::new(), |w| {
        format!(
            "; step workspaces: {} ({:.1} MiB), {} of {} buffers from their slots",
            w.workspaces,
            w.planned_bytes as f64 / (1u64 << 20) as f64,
            w.slots,
            w.slots + w.fallbacks
        )
    });
    let busy = totals
        .decode_gpu_busy
        .map_or(String::new(), |b| format!(" (the GPU busy {:.2} ms of it)", ms(b)));
    let graphs = totals.graphs.map_or(String::new(), |g| {
        format!(
            "; graphs: {} captured ({:.1} ms), {} replayed, {} stopped matching, {} failed \
             captures",
            g.captures,
            g.capture_time.as_secs_f64() * 1e3,
            g.replays,
            g.misses,
            g.failed_captures
        )
    });
    format!(
        ", decode step {step:.2} ms{busy}: host {:.2} ms + waiting for the GPU {waiting:.2} ms{calls}{workspaces}{graphs}",
        (step - waiting).max(0.0)
    )
}

/// An error with its causes, each once: many errors already quote their cause in their own
/// message, so a cause whose text is already there is not repeated.
pub fn describe(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if !text.contains(&part) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&part);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(tokens: usize, ms: u64) -> StepMetrics {
        StepMetrics {
            decode_tokens: tokens,
            model: Duration::from_millis(ms),
            ..StepMetrics::default()
        }
    }

    #[test]
    fn the_summary_counts_prefill_and_decode_apart() {
        let mut meter = Meter::default();
        meter.step(&StepMetrics {
            prefill_tokens: 10,
            model: Duration::from_millis(100),
            ..StepMetrics::default()
        });
        meter.step(&decode(4, 20));
        meter.step(&decode(4, 20));
        let totals = *meter.totals.lock().unwrap();
        assert_eq!((totals.steps, totals.decode_steps, totals.decode_tokens), (3, 2, 8));
        let clock = RunClock {
            startup: Some(Duration::from_millis(1500)),
            first_token: Some(Duration::from_millis(120)),
        };
        let line = summary(&totals, &clock, Duration::from_secs(1));
        assert!(line.starts_with("start-up 1.50 s, time to first token 120 ms,"), "{line}");
        assert!(line.contains("prefill 100.0 tok/s (10 tokens)"), "{line}");
        assert!(line.contains("decode 200.0 tok/s (8 tokens)"), "{line}");
        // The CPU has no GPU wait to report.
        assert!(!line.contains("waiting for the GPU"), "{line}");
    }

    #[test]
    fn with_a_gpu_the_summary_splits_the_decode_step() {
        let totals = Totals {
            decode_tokens: 40,
            decode_time: Duration::from_millis(50),
            decode_steps: 10,
            decode_gpu_wait: Some(Duration::from_millis(15)),
            steps: 10,
            ..Totals::default()
        };
        let line = summary(&totals, &RunClock::default(), Duration::from_secs(1));
        assert!(
            line.ends_with("decode step 5.00 ms: host 3.50 ms + waiting for the GPU 1.50 ms"),
            "{line}"
        );
        // The GPU's own time, from events around the steps, beside the step's.
        let busy = Totals { decode_gpu_busy: Some(Duration::from_millis(32)), ..totals };
        let line = summary(&busy, &RunClock::default(), Duration::from_secs(1));
        assert!(
            line.ends_with(
                "decode step 5.00 ms (the GPU busy 3.20 ms of it): host 3.50 ms + waiting for \
                 the GPU 1.50 ms"
            ),
            "{line}"
        );
        // With the driver's calls counted, their mean per decode step follows.
        let calls =
            Counters { launches: 7200, allocations: 5210, downloads: 20, ..Counters::default() };
        let counted = Totals { decode_gpu_calls: Some(calls), ..totals };
        let line = summary(&counted, &RunClock::default(), Duration::from_secs(1));
        assert!(
            line.ends_with(
                "waiting for the GPU 1.50 ms; driver calls per step (10 steps): 720.0 launches, \
                 0.0 device copies, 521.0 allocations, 0.0 uploads, 2.0 downloads, 0.0 host \
                 waits, 0.0 graph launches"
            ),
            "{line}"
        );
        // And what the step workspaces served.
        let workspaces = tensor::kernels::workspace::WorkspaceStats {
            slots: 900,
            fallbacks: 100,
            recordings: 2,
            workspaces: 2,
            planned_bytes: 3 << 19,
        };
        let planned = Totals { workspaces: Some(workspaces), ..counted };
        let line = summary(&planned, &RunClock::default(), Duration::from_secs(1));
        assert!(
            line.ends_with(
                "0.0 graph launches; step workspaces: 2 (1.5 MiB), 900 of 1000 buffers from their \
                 slots"
            ),
            "{line}"
        );
        // And what the step graphs did.
        let graphs = tensor::kernels::cuda::GraphStats {
            captures: 3,
            replays: 590,
            misses: 2,
            capture_time: Duration::from_micros(4500),
            ..Default::default()
        };
        let graphed = Totals { graphs: Some(graphs), ..planned };
        let line = summary(&graphed, &RunClock::default(), Duration::from_secs(1));
        assert!(
            line.ends_with(
                "from their slots; graphs: 3 captured (4.5 ms), 590 replayed, 2 stopped matching, 0 \
                 failed captures"
            ),
            "{line}"
        );
    }
}
