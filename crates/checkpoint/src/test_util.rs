//! Helpers shared by the tests: the tensor crate's and temporary paths.

pub(crate) use tensor::test_util::*;

/// A fresh path in the system temp folder, unique per process and call.
pub(crate) fn temp_path(stem: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("tpctl-checkpoint-{}-{n}-{stem}", std::process::id()))
}
