//! What the session benchmarks share: each is its own launcher, starting copies of itself as
//! the ranks of a one-host job with the torchrun environment.

use std::process::{Command, Stdio};

/// Starts `world` copies of this program as ranks (with `env` added), waits for every one of
/// them before raising any failure (so none is left running), and returns rank 0's standard
/// output lines. `what` names the configuration in a failure.
pub fn launch_ranks(what: &str, world: usize, env: &[(&str, String)]) -> Vec<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let exe = std::env::current_exe().expect("own path");
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .envs(env.iter().map(|(k, v)| (k, v)))
                .stdout(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    let outputs: Vec<_> =
        children.into_iter().map(|c| c.wait_with_output().expect("rank output")).collect();
    for (rank, out) in outputs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank} of {what} x{world} failed: {}", out.status);
    }
    String::from_utf8_lossy(&outputs[0].stdout).lines().map(str::to_owned).collect()
}
