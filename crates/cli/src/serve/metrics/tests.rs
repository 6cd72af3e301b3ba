//! The Prometheus text of the counters and histograms.

use super::{Metrics, RequestTimes};
use session::FinishReason;
use std::time::Duration;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn has(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

#[test]
fn histogram_buckets_are_cumulative() {
    let m = Metrics::default();
    let end = |end| RequestTimes { end, ..RequestTimes::default() };
    m.finished(FinishReason::Length, 3, 1, end(ms(3)));
    m.finished(FinishReason::StopToken, 3, 1, end(Duration::from_secs(2)));
    m.http("/v1/completions", 200);
    let text = m.render("tiny");
    let e2e = "vllm:e2e_request_latency_seconds";
    for line in [
        format!("{e2e}_bucket{{le=\"0.005\",model_name=\"tiny\"}} 1"),
        format!("{e2e}_bucket{{le=\"1\",model_name=\"tiny\"}} 1"),
        format!("{e2e}_bucket{{le=\"2\",model_name=\"tiny\"}} 2"),
        format!("{e2e}_bucket{{le=\"+Inf\",model_name=\"tiny\"}} 2"),
        format!("{e2e}_count{{model_name=\"tiny\"}} 2"),
        "vllm:request_success_total{finished_reason=\"length\",model_name=\"tiny\"} 1".into(),
        "vllm:request_success_total{finished_reason=\"stop\",model_name=\"tiny\"} 1".into(),
        "tpctl_requests_finished_total{reason=\"length\"} 1".into(),
        "tpctl_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1".into(),
    ] {
        assert!(has(&text, &line), "`{line}` missing from\n{text}");
    }
}

/// One request's life as the bridge reports it: queue, prefill, decode and inference time,
/// time to first token, inter-token gaps and the per-request time per output token, every
/// one from the request's arrival; each family typed once, every vLLM sample labelled.
#[test]
fn a_request_s_intervals_land_in_vllm_s_histograms() {
    let m = Metrics::default();
    m.submitted(7);
    m.scheduled(ms(300));
    m.token(ms(400), None);
    m.token(ms(420), Some(ms(20)));
    m.token(ms(440), Some(ms(20)));
    let times = RequestTimes {
        queued: Some(ms(300)),
        first_token: Some(ms(400)),
        last_token: Some(ms(440)),
        end: ms(450),
    };
    m.finished(FinishReason::StopToken, 7, 3, times);
    let text = m.render("a \"quoted\" name");
    let label = "model_name=\"a \\\"quoted\\\" name\"";
    let sum = |name: &str| -> f64 {
        let prefix = format!("{name}_sum{{{label}}} ");
        let line = text.lines().find_map(|l| l.strip_prefix(&prefix));
        line.unwrap_or_else(|| panic!("no {name}_sum in\n{text}")).parse().unwrap()
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(sum("vllm:request_queue_time_seconds"), 0.3), "{text}");
    assert!(close(sum("vllm:time_to_first_token_seconds"), 0.4), "{text}");
    assert!(close(sum("vllm:request_prefill_time_seconds"), 0.1), "{text}");
    assert!(close(sum("vllm:request_decode_time_seconds"), 0.04), "{text}");
    assert!(close(sum("vllm:request_inference_time_seconds"), 0.14), "{text}");
    assert!(close(sum("vllm:inter_token_latency_seconds"), 0.04), "{text}");
    assert!(close(sum("vllm:time_per_output_token_seconds"), 0.04), "{text}");
    assert!(close(sum("vllm:request_time_per_output_token_seconds"), 0.02), "{text}");
    assert!(close(sum("vllm:e2e_request_latency_seconds"), 0.45), "{text}");
    assert!(close(sum("vllm:request_generation_tokens"), 3.0), "{text}");
    assert!(has(&text, &format!("vllm:generation_tokens_total{{{label}}} 3")), "{text}");
    assert!(has(&text, &format!("vllm:prompt_tokens_total{{{label}}} 7")), "{text}");
    assert!(has(&text, &format!("vllm:num_requests_waiting{{{label}}} 0")), "{text}");
    // Every family is declared once, and every sample belongs to a declared family.
    let mut declared = std::collections::BTreeSet::new();
    for l in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let name = l.split(' ').next().unwrap();
        assert!(declared.insert(name.to_owned()), "{name} declared twice");
    }
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let name = l.split(['{', ' ']).next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| declared.contains(*f)))
            .unwrap_or(name);
        assert!(declared.contains(family), "`{l}` has no TYPE line");
        if name.starts_with("vllm:") {
            assert!(l.contains(label), "`{l}` has no model_name label");
        }
    }
}

/// A request held until a wakeup counts as waiting while it is held.
#[test]
fn a_request_held_for_a_wakeup_counts_as_waiting() {
    let m = Metrics::default();
    let waiting = |m: &Metrics| {
        let text = m.render("m");
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("vllm:num_requests_waiting{model_name=\"m\"} "));
        line.unwrap().to_owned()
    };
    let held = m.held();
    assert_eq!(waiting(&m), "1");
    drop(held);
    assert_eq!(waiting(&m), "0");
}

/// What rank 0's CUDA graphs did is read after each step into the `tpctl_cuda_graph_*`
/// counters; without a GPU there are none.
#[test]
fn cuda_graph_counts_are_read_after_each_step() {
    use session::{MetricsSink, StepMetrics};
    let m = Metrics::default();
    let mut plain = m.engine_sink(std::sync::Arc::default());
    plain.step(&StepMetrics::default());
    assert!(!m.render("tiny").contains("tpctl_cuda_graph"), "no GPU, no graph counters");
    let stats = tensor::kernels::cuda::GraphStats {
        captures: 3,
        replays: 590,
        misses: 2,
        failed_captures: 1,
        eager_shapes: 1,
        capture_time: Duration::from_millis(250),
    };
    let mut engine = m.engine_sink(std::sync::Arc::default()).with_graphs(move || Some(stats));
    engine.step(&StepMetrics::default());
    let text = m.render("tiny");
    for line in [
        "tpctl_cuda_graph_captures_total 3",
        "tpctl_cuda_graph_replays_total 590",
        "tpctl_cuda_graph_misses_total 2",
        "tpctl_cuda_graph_failed_captures_total 1",
        "tpctl_cuda_graph_capture_seconds_total 0.25",
    ] {
        assert!(has(&text, line), "{line} in\n{text}");
    }
}

/// The engine's step phases add up per phase label, in the order a step runs them, next to
/// the step totals; the handlers' detokenization and chunk encoding are counted apart.
#[test]
fn step_phases_and_the_handlers_time_are_counted() {
    use session::{MetricsSink, StepMetrics, StepPhases};
    let m = Metrics::default();
    let mut engine = m.engine_sink(std::sync::Arc::default());
    let phases =
        StepPhases { schedule: ms(1), forward: ms(10), sample: ms(0), update: ms(3), emit: ms(4) };
    let step = StepMetrics { agreement: ms(2), model: ms(13), phases, ..StepMetrics::default() };
    engine.step(&step);
    engine.step(&step);
    m.detokenized(ms(5));
    m.detokenized(ms(5));
    m.encoded(ms(7));
    let text = m.render("tiny");
    let phase = |p: &str, v: &str| format!("tpctl_step_phase_seconds_total{{phase=\"{p}\"}} {v}");
    let expect = [
        phase("schedule", "0.002"),
        phase("agree", "0.004"),
        phase("forward", "0.02"),
        phase("sample", "0"),
        phase("update", "0.006"),
        phase("emit", "0.008"),
        "tpctl_steps_total 2".to_owned(),
        "tpctl_step_seconds_total 0.03".to_owned(),
        "tpctl_http_detokenize_seconds_total 0.01".to_owned(),
        "tpctl_http_encode_seconds_total 0.007".to_owned(),
    ];
    for line in &expect {
        assert!(has(&text, line), "`{line}` missing from\n{text}");
    }
    let order: Vec<usize> =
        expect[..6].iter().map(|l| text.find(l.as_str()).unwrap_or(usize::MAX)).collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "phases out of order:\n{text}");
    assert_eq!(text.matches("# TYPE tpctl_step_phase_seconds_total counter").count(), 1);
}
