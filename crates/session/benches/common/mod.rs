//! What the session benchmarks share: each is its own launcher, starting copies of itself as
//! the ranks of a one-host job with the torchrun environment (the tests' launcher,
//! [`tpctl_tests::launch_self`], with its port retry).

use std::time::Duration;

/// The longest one benchmark configuration may run.
const DEADLINE: Duration = Duration::from_secs(30 * 60);

/// Starts `world` copies of this program as ranks (with `env` added), waits for every one of
/// them before raising any failure (so none is left running), and returns rank 0's standard
/// output lines. `what` names the configuration in a failure.
pub fn launch_ranks(what: &str, world: usize, env: &[(&str, String)]) -> Vec<String> {
    tpctl_tests::launch_self(what, world, env, DEADLINE)
}
