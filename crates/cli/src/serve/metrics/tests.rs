//! The Prometheus text of the counters and histograms.

use super::Metrics;
use session::FinishReason;
use std::time::Duration;

#[test]
fn histogram_buckets_are_cumulative() {
    let m = Metrics::default();
    m.finished(FinishReason::Length, Duration::from_millis(3));
    m.finished(FinishReason::StopToken, Duration::from_secs(2));
    m.http("/v1/completions", 200);
    let text = m.render();
    for line in [
        "tpctl_request_latency_seconds_bucket{le=\"0.005\"} 1",
        "tpctl_request_latency_seconds_bucket{le=\"1\"} 1",
        "tpctl_request_latency_seconds_bucket{le=\"2.5\"} 2",
        "tpctl_request_latency_seconds_bucket{le=\"+Inf\"} 2",
        "tpctl_request_latency_seconds_count 2",
        "tpctl_requests_finished_total{reason=\"length\"} 1",
        "tpctl_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "`{line}` missing from\n{text}");
    }
}
