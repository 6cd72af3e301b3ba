//! Rank 0's sinks for `tpctl run`: generated text or JSON lines on standard output, and the
//! numbers behind the closing summary.

use crate::spec::OutputFormat;
use session::{BoxError, FinishReason, MetricsSink, OutputSink, StepMetrics};
use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// Prints results as they come.
pub struct Printer {
    format: OutputFormat,
    prompts: Vec<PromptInfo>,
    start: Instant,
    texts: HashMap<u64, String>,
    timings: HashMap<u64, Timing>,
    stream: bool,
    first_token: Arc<Mutex<Option<Duration>>>,
    /// Tokens generated, or counted as done (a request that finished early), out of `budget`.
    generated: usize,
    budget: usize,
    max_tokens: usize,
}

impl Printer {
    /// A printer for `prompts` (request ids are their indices); `first_token` receives the
    /// time to the first token of any request.
    pub fn new(
        format: OutputFormat,
        prompts: Vec<PromptInfo>,
        max_tokens: usize,
        first_token: Arc<Mutex<Option<Duration>>>,
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
            timings: HashMap::new(),
            stream,
            first_token,
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
    fn token(
        &mut self,
        request: u64,
        _token: u32,
        text: &str,
        _logprobs: Option<&session::TokenLogprobs>,
    ) -> Result<(), BoxError> {
        let now = self.start.elapsed();
        let t = self.timings.entry(request).or_default();
        if t.first_token.is_none() {
            t.first_token = Some(now);
            let mut first = self.first_token.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(now);
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
                let line = serde_json::json!({
                    "index": request,
                    "prompt": prompt.text,
                    "prompt_token_ids": prompt.ids,
                    "token_ids": tokens,
                    "text": text,
                    "finish_reason": reason.name(),
                    "time_to_first_token_ms": ttft,
                    "total_ms": now.as_secs_f64() * 1e3,
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
    /// Steps.
    pub steps: u64,
}

/// Collects [`Totals`] from every step.
#[derive(Debug, Clone, Default)]
pub struct Meter(pub Arc<Mutex<Totals>>);

impl MetricsSink for Meter {
    fn step(&mut self, m: &StepMetrics) {
        let mut t = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let time = m.model + m.agreement;
        t.steps += 1;
        if m.prefill_tokens > 0 {
            t.prefill_tokens += m.prefill_tokens;
            t.prefill_time += time;
        } else {
            t.decode_tokens += m.decode_tokens;
            t.decode_time += time;
        }
    }
}

/// The closing summary line.
pub fn summary(totals: &Totals, first_token: Option<Duration>, wall: Duration) -> String {
    let rate = |n: usize, t: Duration| if t.is_zero() { 0.0 } else { n as f64 / t.as_secs_f64() };
    format!(
        "time to first token {}, prefill {:.1} tok/s ({} tokens), decode {:.1} tok/s ({} tokens), {} steps in {:.2} s",
        first_token.map_or("-".to_owned(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3)),
        rate(totals.prefill_tokens, totals.prefill_time),
        totals.prefill_tokens,
        rate(totals.decode_tokens, totals.decode_time),
        totals.decode_tokens,
        totals.steps,
        wall.as_secs_f64()
    )
}
