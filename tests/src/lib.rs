//! Cross-crate and multi-process integration tests live in `tests/tests/`.
#![forbid(unsafe_code)]
