//! What the session benchmarks share: each is its own launcher, starting copies of itself as
//! the ranks of a one-host job with the torchrun environment (the tests' launcher,
//! [`tpctl_tests::launch_self`], with its port retry).

use std::time::{Duration, Instant};

/// The longest one benchmark configuration may run.
const DEADLINE: Duration = Duration::from_secs(30 * 60);

/// Starts `world` copies of this program as ranks (with `env` added), waits for every one of
/// them before raising any failure (so none is left running), and returns rank 0's standard
/// output lines. `what` names the configuration in a failure.
#[allow(dead_code)] // Not every bench launches ranks.
pub fn launch_ranks(what: &str, world: usize, env: &[(&str, String)]) -> Vec<String> {
    tpctl_tests::launch_self(what, world, env, DEADLINE)
}

/// The median of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A hash of every weight buffer of `model` (lengths and bytes): equal before and after an
/// operation that must leave the weights as they were.
#[allow(dead_code)] // Not every bench holds a model.
pub fn weights_hash(model: &layers::parallel::ParallelModel) -> u64 {
    use std::hash::{DefaultHasher, Hasher};
    let mut h = DefaultHasher::new();
    for b in model.weight_buffers() {
        h.write_usize(b.len());
        h.write(b);
    }
    h.finish()
}

/// Median seconds of a copy of `bytes` between two buffers already touched: the reference a
/// memory operation's time is put against.
#[allow(dead_code)] // Not every bench copies.
pub fn memcpy_time(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let v = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(v)
}
