//! The listen-address policy.

use super::check_listen;

#[test]
fn only_loopback_goes_without_a_key() {
    for (listen, key, ok) in [
        ("127.0.0.1:8000", false, true),
        ("[::1]:0", false, true),
        ("0.0.0.0:8000", false, false),
        ("192.168.1.4:8000", false, false),
        ("0.0.0.0:8000", true, true),
    ] {
        assert_eq!(check_listen(listen, key).is_ok(), ok, "{listen} key {key}");
    }
    let err = check_listen("0.0.0.0:80", false).unwrap_err().to_string();
    assert!(err.contains("give --api-key"), "{err}");
    let err = check_listen("localhost", false).unwrap_err().to_string();
    assert!(err.contains("expected an address like 127.0.0.1:8000"), "{err}");
}
