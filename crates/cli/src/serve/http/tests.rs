//! The API-key check, route labels and stop strings.

use super::answer::StopText;
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

#[test]
fn stop_strings_cut_the_text_and_hold_back_what_may_begin_one() {
    let mut s = StopText::new(vec!["\n\nUser:".into(), "END".into()]);
    // "Hello" goes out; "\n" may begin the first stop string and waits.
    assert_eq!(s.push("Hello\n"), ("Hello".to_owned(), false));
    // "\nUs" continues it: still held.
    assert_eq!(s.push("\nUs"), (String::new(), false));
    // "ok" breaks the match: all of it goes out.
    assert_eq!(s.push("ok"), ("\n\nUsok".to_owned(), false));
    // A stop split over three pieces, with text before it in the same piece.
    assert_eq!(s.push(" fine E"), (" fine ".to_owned(), false));
    assert_eq!(s.push("N"), (String::new(), false));
    assert_eq!(s.push("D and more"), (String::new(), true), "the stop string is dropped");
    // Without a stop, the held text comes out at the end.
    let mut s = StopText::new(vec!["END".into()]);
    assert_eq!(s.push("the E"), ("the ".to_owned(), false));
    assert_eq!(s.finish(), "E");
    // Multi-byte characters: prefixes are cut on character boundaries.
    let mut s = StopText::new(vec!["😀!".into()]);
    assert_eq!(s.push("a😀"), ("a".to_owned(), false));
    assert_eq!(s.push("!"), (String::new(), true));
    // No stop strings: everything passes at once.
    assert_eq!(StopText::new(Vec::new()).push("x\n"), ("x\n".to_owned(), false));
}
