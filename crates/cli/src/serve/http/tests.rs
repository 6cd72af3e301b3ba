//! The API-key check and route labels.

use super::{bearer_matches, route_label};
use axum::http::{header, HeaderMap, HeaderValue};

fn with_auth(value: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
    headers
}

#[test]
fn only_the_exact_bearer_key_passes() {
    assert!(bearer_matches(&with_auth("Bearer k3y"), "k3y"));
    for wrong in ["Bearer k3", "Bearer k3yy", "bearer k3y", "k3y", "Basic k3y", "Bearer "] {
        assert!(!bearer_matches(&with_auth(wrong), "k3y"), "{wrong}");
    }
    assert!(!bearer_matches(&HeaderMap::new(), "k3y"));
}

#[test]
fn unknown_paths_share_one_label() {
    assert_eq!(route_label("/v1/completions"), "/v1/completions");
    assert_eq!(route_label("/v1/completions/x"), "other");
    assert_eq!(route_label("/../etc/passwd"), "other");
}
