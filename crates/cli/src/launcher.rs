//! The launcher: starts this node's rank processes with the torchrun environment, streams
//! their output, and supervises them.
//!
//! - Rank 0's standard output is the user's output (generated text) and passes through as is;
//!   every other stream is prefixed with `[rank i] ` line by line.
//! - Each rank runs in a process group of its own, so a terminal's Ctrl-C reaches only the
//!   launcher, which forwards one SIGINT to every rank, then SIGKILL after the grace period.
//! - The first rank to fail decides the outcome: the others get SIGTERM, then SIGKILL after
//!   the grace period, and the launcher reports that rank's exit code and last error lines.
//! - Ranks watch their parent (`TPCTL_LAUNCHER_PID`) and exit if the launcher disappears, so
//!   no rank outlives it even when the launcher itself is killed.

use crate::progress::{self, ProgressBars};
use anyhow::{Context, Result};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Lines of each rank's standard error kept for the failure report.
const KEPT_LINES: usize = 20;
/// The exit code a rank uses when its failure only follows another rank's: the launcher
/// reports an original failure in preference.
pub const SECONDARY_EXIT: i32 = 3;
/// How often the supervisor looks at its ranks.
const POLL: Duration = Duration::from_millis(10);

/// What to start.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The rank program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Ranks on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Host of rank 0 (the store).
    pub master_addr: String,
    /// Port of the store.
    pub master_port: u16,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Extra environment for global rank 0 alone (a secret only it needs: the API key).
    pub rank0_env: Vec<(String, String)>,
    /// Time ranks get to stop after SIGINT or SIGTERM before SIGKILL.
    pub grace: Duration,
}

/// How a rank failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank.
    pub rank: usize,
    /// The process's exit code, or 128 + signal when a signal ended it.
    pub code: i32,
    /// The last lines it wrote to standard error.
    pub stderr_tail: Vec<String>,
}

impl std::fmt::Display for RankFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} failed with exit code {}", self.rank, self.code)?;
        if let Some(last) = self.stderr_tail.iter().rev().find(|l| !l.trim().is_empty()) {
            write!(f, ": {}", last.trim())?;
        }
        Ok(())
    }
}

/// The end of a launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank exited with code 0.
    Success,
    /// The first rank to fail, and how.
    Failed(RankFailure),
    /// The user interrupted the job; every rank was stopped.
    Interrupted,
}

impl Outcome {
    /// The launcher's exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Success => 0,
            Outcome::Failed(f) => f.code,
            Outcome::Interrupted => 130,
        }
    }
}

fn code_of(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<JoinHandle<()>>,
}

impl Rank {
    /// Signals the rank's whole process group: whatever the rank started goes with it.
    fn signal(&self, sig: Signal) {
        // The group outlives its leader while members remain, so signal it even after the rank
        // itself exited; ESRCH (nobody left) is fine.
        let _ = killpg(Pid::from_raw(self.child.id() as i32), sig);
    }
}

/// Copies a rank's standard output: rank 0's as raw bytes (it may stream text without
/// newlines), every other rank's line by line with a prefix.
fn pump_stdout(rank: usize, out: impl Read + Send + 'static) -> JoinHandle<()> {
    std::thread::spawn(move || {
        if rank == 0 {
            let mut out = out;
            let mut buf = [0u8; 4096];
            let stdout = std::io::stdout();
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut lock = stdout.lock();
                let _ = lock.write_all(&buf[..n]);
                let _ = lock.flush();
            }
        } else {
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                println!("[rank {rank}] {line}");
            }
        }
    })
}

/// Copies a rank's standard error with a prefix, keeping its last lines; load-progress lines
/// go to the bar instead.
fn pump_stderr(
    (rank, local): (usize, usize),
    err: impl Read + Send + 'static,
    tail: Arc<Mutex<VecDeque<String>>>,
    bar: Arc<ProgressBars>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(|l| l.ok()) {
            if let Some((kind, done, total)) = progress::parse(&line) {
                bar.take(local, kind, done, total);
                continue;
            }
            bar.println(&format!("[rank {rank}] {line}"));
            let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() == KEPT_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    })
}

/// Starts the ranks and supervises them until all have exited.
///
/// `interrupted` is set by the caller's signal handler (Ctrl-C, SIGTERM).
///
/// # Errors
/// A rank process cannot be started (the ranks already started are stopped first).
pub fn launch(spec: &Launch, interrupted: &AtomicBool) -> Result<Outcome> {
    let world = spec.nproc_per_node * spec.nnodes;
    let mut ranks: Vec<Rank> = Vec::with_capacity(spec.nproc_per_node);
    let bar = Arc::new(ProgressBars::new(spec.nproc_per_node));
    for local in 0..spec.nproc_per_node {
        let rank = spec.node_rank * spec.nproc_per_node + local;
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc_per_node.to_string())
            .env("GROUP_RANK", spec.node_rank.to_string())
            .env("MASTER_ADDR", &spec.master_addr)
            .env("MASTER_PORT", spec.master_port.to_string())
            .env("TPCTL_LAUNCHER_PID", std::process::id().to_string())
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            // The launcher's own API key variable is not every rank's business.
            .env_remove(crate::spec::API_KEY_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        if rank == 0 {
            cmd.envs(spec.rank0_env.iter().map(|(k, v)| (k, v)));
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for r in &ranks {
                    r.signal(Signal::SIGKILL);
                }
                for r in &mut ranks {
                    let _ = r.child.wait();
                }
                return Err(e)
                    .with_context(|| format!("starting rank {rank}: {}", spec.program.display()));
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let mut pumps = Vec::new();
        if let Some(out) = child.stdout.take() {
            pumps.push(pump_stdout(rank, out));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump_stderr((rank, local), err, tail.clone(), bar.clone()));
        }
        ranks.push(Rank { rank, child, status: None, tail, pumps });
    }
    let outcome = supervise(ranks, spec.grace, interrupted);
    bar.clear();
    Ok(outcome)
}

fn supervise(mut ranks: Vec<Rank>, grace: Duration, interrupted: &AtomicBool) -> Outcome {
    let mut outcome: Option<Outcome> = None;
    // Failures in the order seen: the first original one is reported.
    let mut failures: Vec<(usize, i32)> = Vec::new();
    let mut kill_at: Option<Instant> = None;
    loop {
        for r in &mut ranks {
            if r.status.is_none() {
                if let Ok(Some(status)) = r.child.try_wait() {
                    r.status = Some(status);
                    if !status.success() {
                        failures.push((r.rank, code_of(status)));
                    }
                    if !status.success() && outcome.is_none() {
                        // Let the pump finish so the report has the rank's last words.
                        let code = code_of(status);
                        tracing::debug!(rank = r.rank, code, "rank failed; stopping the others");
                        outcome = Some(Outcome::Failed(RankFailure {
                            rank: r.rank,
                            code,
                            stderr_tail: Vec::new(),
                        }));
                    }
                }
            }
        }
        if outcome.is_none() && interrupted.load(Ordering::SeqCst) {
            outcome = Some(Outcome::Interrupted);
            for r in &ranks {
                r.signal(Signal::SIGINT);
            }
            kill_at = Some(Instant::now() + grace);
        }
        if let (Some(Outcome::Failed(_)), None) = (&outcome, kill_at) {
            for r in &ranks {
                r.signal(Signal::SIGTERM);
            }
            kill_at = Some(Instant::now() + grace);
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for r in &ranks {
                r.signal(Signal::SIGKILL);
            }
        }
        std::thread::sleep(POLL);
    }
    for r in &mut ranks {
        for pump in r.pumps.drain(..) {
            let _ = pump.join();
        }
    }
    // Ranks that failed because a peer did, or that the launcher stopped, say less than the
    // rank whose failure started it all.
    let stopped = |code: i32| code == SECONDARY_EXIT || code == 128 + 15 || code == 128 + 9;
    if let (Some(Outcome::Failed(f)), Some(&(rank, code))) =
        (&mut outcome, failures.iter().find(|(_, c)| !stopped(*c)))
    {
        f.rank = rank;
        f.code = code;
    }
    match outcome {
        Some(Outcome::Failed(mut f)) => {
            if let Some(r) = ranks.iter().find(|r| r.rank == f.rank) {
                f.stderr_tail =
                    r.tail.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
            }
            Outcome::Failed(f)
        }
        Some(other) => other,
        None => Outcome::Success,
    }
}

/// In a rank process: exits when the launcher that started it is gone, so a killed launcher
/// never leaves ranks behind. Does nothing outside a launcher.
pub fn watch_launcher() {
    let Some(launcher) =
        std::env::var("TPCTL_LAUNCHER_PID").ok().and_then(|p| p.parse::<u32>().ok())
    else {
        return;
    };
    std::thread::Builder::new()
        .name("launcher-watch".into())
        .spawn(move || loop {
            if std::os::unix::process::parent_id() != launcher {
                eprintln!("the launcher (pid {launcher}) is gone; this rank exits");
                std::process::exit(143);
            }
            std::thread::sleep(Duration::from_millis(200));
        })
        .map(drop)
        .unwrap_or_else(|e| tracing::warn!("cannot watch the launcher: {e}"));
}

#[cfg(test)]
mod tests;
