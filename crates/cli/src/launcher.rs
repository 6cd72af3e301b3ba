//! The launcher: starts this node's rank processes with the torchrun environment, streams
//! their output, and supervises them.
//!
//! - Rank 0's standard output is the user's output (generated text) and passes through as is;
//!   every other stream is prefixed with `[rank i] ` line by line.
//! - Each rank runs in a process group of its own, so a terminal's Ctrl-C reaches only the
//!   launcher, which forwards one SIGINT to every rank, then SIGKILL after the grace period.
//! - The first rank to fail on its own (the origin) decides the outcome: the others get
//!   SIGTERM, then SIGKILL after the grace period, and the launcher reports the origin's exit
//!   code and last error lines. A rank that failed only because a peer did (exit code 3)
//!   does not decide it: when one exits first, the others get the grace period to exit on
//!   their own, so the origin (printing its error as it fails) is not stopped before it has.
//!   A rank ended by a signal the launcher did not send (a crash, the OOM killer) is an
//!   origin, reported as such; one ended by the launcher's own signal is not.
//! - Ranks watch their parent (`TPCTL_LAUNCHER_PID`) and exit if the launcher disappears, so
//!   no rank outlives it even when the launcher itself is killed.
//! - For the `mpi` backend the ranks are started by one `mpirun` instead ([`mpirun`]), with
//!   the same output and the same report of the failure's origin.

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
    /// Start the ranks through one `mpirun` (the `mpi` backend) rather than each one here.
    pub mpirun: bool,
}

/// How a rank failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank.
    pub rank: usize,
    /// The process's exit code, or 128 + signal when a signal ended it.
    pub code: i32,
    /// The signal that ended it when the launcher did not send it (a crash, the OOM killer).
    pub signal: Option<i32>,
    /// The last lines it wrote to standard error.
    pub stderr_tail: Vec<String>,
}

impl std::fmt::Display for RankFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.signal {
            Some(sig) => write!(
                f,
                "rank {} was killed by signal {sig}{} (exit code {}), not by the launcher",
                self.rank,
                signal_name(sig).map(|n| format!(" ({n})")).unwrap_or_default(),
                self.code
            )?,
            None => write!(f, "rank {} failed with exit code {}", self.rank, self.code)?,
        }
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

fn signal_name(sig: i32) -> Option<&'static str> {
    Signal::try_from(sig).ok().map(Signal::as_str)
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

/// A test override: with a prefix, each rank gets `NCCL_HOSTID=PREFIX-RANK`, so NCCL takes
/// ranks on one machine for ranks on different hosts (with `mesh::SHARE_DEVICE_ENV`, two
/// ranks on one GPU; see docs/gpu.md).
pub const NCCL_HOSTID_PER_RANK_ENV: &str = "TPCTL_NCCL_HOSTID_PER_RANK";

/// The `NCCL_HOSTID` of `rank` under the override `prefix` (see [`NCCL_HOSTID_PER_RANK_ENV`]).
fn nccl_hostid(prefix: Option<&str>, rank: usize) -> Option<(&'static str, String)> {
    prefix.filter(|p| !p.is_empty()).map(|p| ("NCCL_HOSTID", format!("{p}-{rank}")))
}

/// Starts the ranks and supervises them until all have exited.
///
/// `interrupted` is set by the caller's signal handler (Ctrl-C, SIGTERM).
///
/// # Errors
/// A rank process cannot be started (the ranks already started are stopped first); under
/// mpirun, see [`mpirun::launch`].
pub fn launch(spec: &Launch, interrupted: &AtomicBool) -> Result<Outcome> {
    if spec.mpirun {
        return mpirun::launch(spec, interrupted);
    }
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
            .envs(nccl_hostid(std::env::var(NCCL_HOSTID_PER_RANK_ENV).ok().as_deref(), rank))
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

/// How a rank's exit bears on the outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    /// Code 0.
    Success,
    /// The launcher's own signal ended it (or it left on that signal with "another rank
    /// failed"): it says nothing about what went wrong.
    Stopped,
    /// It failed only because another rank did ([`SECONDARY_EXIT`]).
    Secondary,
    /// A failure of its own: an error exit, or a signal the launcher did not send (a crash,
    /// the OOM killer).
    Origin,
}

fn classify(status: ExitStatus, signalled: bool) -> Exit {
    let code = code_of(status);
    if status.success() {
        Exit::Success
    } else if signalled && (status.signal().is_some() || code > 128 || code == SECONDARY_EXIT) {
        Exit::Stopped
    } else if code == SECONDARY_EXIT {
        Exit::Secondary
    } else {
        Exit::Origin
    }
}

/// Watches the ranks until every one has exited.
///
/// The first failure of a rank's own (an error exit other than [`SECONDARY_EXIT`], or a
/// signal the launcher did not send) is the origin: the others get SIGTERM at once, then
/// SIGKILL after `grace`. When a rank that failed only because of a peer exits first, the
/// origin is still busy reporting: the others get `grace` to exit on their own before the
/// SIGTERM, so the origin's error is what the report shows.
fn supervise(mut ranks: Vec<Rank>, grace: Duration, interrupted: &AtomicBool) -> Outcome {
    let mut interrupt = false;
    // Failures in the order seen: the first origin is reported, else the first failure.
    let mut failures: Vec<(usize, ExitStatus, Exit)> = Vec::new();
    // The launcher signalled each rank (its exit by that signal is no failure of its own).
    let mut signalled = vec![false; ranks.len()];
    let mut term_at: Option<Instant> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        for (i, r) in ranks.iter_mut().enumerate() {
            if r.status.is_some() {
                continue;
            }
            if let Ok(Some(status)) = r.child.try_wait() {
                r.status = Some(status);
                let exit = classify(status, signalled[i]);
                if exit != Exit::Success {
                    tracing::debug!(rank = r.rank, code = code_of(status), ?exit, "rank failed");
                    failures.push((r.rank, status, exit));
                }
            }
        }
        if !interrupt && failures.is_empty() && interrupted.load(Ordering::SeqCst) {
            interrupt = true;
            for (i, r) in ranks.iter().enumerate() {
                r.signal(Signal::SIGINT);
                signalled[i] = true;
            }
            kill_at = Some(Instant::now() + grace);
        }
        if !interrupt && kill_at.is_none() {
            let origin = failures.iter().any(|f| f.2 == Exit::Origin);
            if origin {
                term_at = Some(Instant::now());
            } else if term_at.is_none() && !failures.is_empty() {
                term_at = Some(Instant::now() + grace);
            }
            if term_at.is_some_and(|t| Instant::now() >= t) {
                for (i, r) in ranks.iter().enumerate() {
                    if r.status.is_none() {
                        r.signal(Signal::SIGTERM);
                        signalled[i] = true;
                    }
                }
                kill_at = Some(Instant::now() + grace);
            }
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (i, r) in ranks.iter().enumerate() {
                r.signal(Signal::SIGKILL);
                signalled[i] = true;
            }
        }
        std::thread::sleep(POLL);
    }
    for r in &mut ranks {
        for pump in r.pumps.drain(..) {
            let _ = pump.join();
        }
    }
    if interrupt {
        return Outcome::Interrupted;
    }
    let reported = failures
        .iter()
        .find(|f| f.2 == Exit::Origin)
        .or_else(|| failures.iter().find(|f| f.2 == Exit::Secondary))
        .or(failures.first());
    let Some(&(rank, status, exit)) = reported else { return Outcome::Success };
    let stderr_tail = ranks
        .iter()
        .find(|r| r.rank == rank)
        .map(|r| r.tail.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect())
        .unwrap_or_default();
    let signal = status.signal().filter(|_| exit == Exit::Origin);
    Outcome::Failed(RankFailure { rank, code: code_of(status), signal, stderr_tail })
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
                // The launcher read this rank's standard error: writing to it fails now, and
                // `eprintln!` would panic this thread instead of exiting.
                let _ = writeln!(
                    std::io::stderr(),
                    "the launcher (pid {launcher}) is gone; this rank exits"
                );
                crate::exit::leave(143);
            }
            std::thread::sleep(Duration::from_millis(200));
        })
        .map(drop)
        .unwrap_or_else(|e| tracing::warn!("cannot watch the launcher: {e}"));
}

pub mod mpirun;

#[cfg(test)]
mod tests;
