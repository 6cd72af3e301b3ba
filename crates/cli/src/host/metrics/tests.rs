//! Joining the models' metrics: one family once, every model's samples under it.

use super::merge;

#[test]
fn each_family_appears_once_with_every_models_samples() {
    let a = "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"a\"} 1\n# HELP vllm:e2e_request_latency_seconds Latency.\n# TYPE vllm:e2e_request_latency_seconds histogram\nvllm:e2e_request_latency_seconds_bucket{model_name=\"a\",le=\"1\"} 2\nvllm:e2e_request_latency_seconds_sum{model_name=\"a\"} 0.5\nvllm:e2e_request_latency_seconds_count{model_name=\"a\"} 2\ntpctl_steps_total 7\n";
    let b = a.replace("\"a\"", "\"b\"").replace("tpctl_steps_total 7", "tpctl_steps_total 9");
    let merged = merge(&[("a".to_owned(), a.to_owned()), ("b".to_owned(), b)]);
    assert_eq!(
        merged,
        "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{model_name=\"a\"} 1\nvllm:num_requests_running{model_name=\"b\"} 1\n\
         # HELP vllm:e2e_request_latency_seconds Latency.\n# TYPE vllm:e2e_request_latency_seconds histogram\n\
         vllm:e2e_request_latency_seconds_bucket{model_name=\"a\",le=\"1\"} 2\n\
         vllm:e2e_request_latency_seconds_sum{model_name=\"a\"} 0.5\n\
         vllm:e2e_request_latency_seconds_count{model_name=\"a\"} 2\n\
         vllm:e2e_request_latency_seconds_bucket{model_name=\"b\",le=\"1\"} 2\n\
         vllm:e2e_request_latency_seconds_sum{model_name=\"b\"} 0.5\n\
         vllm:e2e_request_latency_seconds_count{model_name=\"b\"} 2\n\
         tpctl_steps_total{model=\"a\"} 7\ntpctl_steps_total{model=\"b\"} 9\n"
    );
}

#[test]
fn samples_that_name_no_model_get_the_model_label() {
    let text = "x 1\ny{route=\"/v1\"} 2\nz{} 3\nw{model_name=\"m\"} 4\n";
    assert_eq!(
        merge(&[("m\"1".to_owned(), text.to_owned())]),
        "x{model=\"m\\\"1\"} 1\ny{model=\"m\\\"1\",route=\"/v1\"} 2\nz{model=\"m\\\"1\"} 3\nw{model_name=\"m\"} 4\n"
    );
}
