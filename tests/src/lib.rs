//! Helpers for multi-process tests and benchmarks: launch a world of rank processes with the
//! torchrun environment, and collect what each printed, with a deadline on every wait.
#![forbid(unsafe_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What one rank process left behind.
#[derive(Debug)]
pub struct RankOutput {
    /// The rank.
    pub rank: usize,
    /// Exit code (`None` when killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
    /// Time from launch to exit.
    pub elapsed: Duration,
}

impl RankOutput {
    /// The last line the rank printed on stdout.
    pub fn last_line(&self) -> &str {
        self.stdout.lines().last().unwrap_or("")
    }
}

/// A port nobody listens on right now, below the kernel's ephemeral range: outgoing
/// connections (other tests' ranks) draw their local ports from that range, so a port taken
/// from it could be in use again before rank 0 binds it.
pub fn free_port() -> u16 {
    mesh::rendezvous::free_master_port().expect("bind a loopback port")
}

/// Starts `world` copies of `program` as ranks 0..world of one job (torchrun variables on
/// one host), with `env(rank)` added, and waits for all of them at most `deadline`.
///
/// # Panics
/// When a rank is still running at the deadline (all are killed first), so a hang fails the
/// test instead of stalling it.
pub fn launch(
    program: &str,
    world: usize,
    env: impl Fn(usize) -> Vec<(String, String)>,
    deadline: Duration,
) -> Vec<RankOutput> {
    // A port free when it was picked can be taken before rank 0 binds it (by another test's
    // rank picking its own ports): that start, and only that, is retried on a new port.
    for _ in 1..PORT_ATTEMPTS {
        let port = free_port();
        let outs = launch_on(port, program, world, &env, deadline);
        let taken = format!("cannot listen on 127.0.0.1:{port}: Address already in use");
        if !outs.iter().any(|o| o.stderr.contains(&taken)) {
            return outs;
        }
        eprintln!("note: port {port} was taken before rank 0 could listen on it; starting again");
    }
    launch_on(free_port(), program, world, &env, deadline)
}

/// Starts `world` copies of the running program as the ranks of one job (a benchmark that is
/// its own launcher), with `env` added, through [`launch`]; returns rank 0's standard output
/// lines once every rank succeeded. `what` names the configuration in a failure.
///
/// # Panics
/// When a rank fails (its standard error is in the message) or is still running at
/// `deadline`.
pub fn launch_self(
    what: &str,
    world: usize,
    env: &[(&str, String)],
    deadline: Duration,
) -> Vec<String> {
    let exe = std::env::current_exe().expect("the path of the running program");
    let env: Vec<(String, String)> =
        env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
    let outs = launch(&exe.to_string_lossy(), world, |_| env.clone(), deadline);
    for o in &outs {
        assert!(
            o.code == Some(0),
            "rank {} of {what} x{world} failed ({:?}):\n{}",
            o.rank,
            o.code,
            o.stderr
        );
    }
    outs[0].stdout.lines().map(str::to_owned).collect()
}

/// Starts of a world whose rendezvous port another process took in the meantime.
const PORT_ATTEMPTS: usize = 3;

/// [`launch`] on rendezvous port `port`.
fn launch_on(
    port: u16,
    program: &str,
    world: usize,
    env: &impl Fn(usize) -> Vec<(String, String)>,
    deadline: Duration,
) -> Vec<RankOutput> {
    let start = Instant::now();
    let mut children: Vec<(usize, Child)> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(program);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env(rank) {
                cmd.env(k, v);
            }
            (rank, cmd.spawn().expect("spawn a rank process"))
        })
        .collect();
    let mut done: Vec<Option<(Option<i32>, Duration)>> = vec![None; world];
    while done.iter().any(Option::is_none) {
        for (rank, child) in &mut children {
            if done[*rank].is_none() {
                if let Some(status) = child.try_wait().expect("wait for a rank") {
                    done[*rank] = Some((status.code(), start.elapsed()));
                }
            }
        }
        if start.elapsed() > deadline {
            for (_, child) in &mut children {
                let _ = child.kill();
                let _ = child.wait();
            }
            let hung: Vec<usize> = (0..world).filter(|&r| done[r].is_none()).collect();
            panic!("ranks {hung:?} still running after {deadline:?}; all ranks killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    children
        .into_iter()
        .map(|(rank, child)| {
            let out = child.wait_with_output().expect("collect rank output");
            let (code, elapsed) = done[rank].expect("every rank finished");
            RankOutput {
                rank,
                code,
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
                elapsed,
            }
        })
        .collect()
}
