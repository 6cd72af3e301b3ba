//! Helpers for multi-process tests: launch a world of rank processes with the torchrun
//! environment, and collect what each printed, with a deadline on every wait.
#![forbid(unsafe_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
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
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (low, span) = (10_000, ephemeral.saturating_sub(10_000).max(1));
    let seed = std::process::id().wrapping_mul(2_654_435_761);
    for _ in 0..1000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = low + seed.wrapping_add(n.wrapping_mul(7919)) % span;
        if let Ok(port) = u16::try_from(port) {
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local address").port()
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
    let port = free_port();
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
