//! Starting the ranks through one `mpirun` (the `mpi` backend), with the launcher's usual
//! output and supervision.
//!
//! MPI's world is the processes one `mpirun` started, so for the `mpi` backend the launcher
//! starts `mpirun -n WORLD tpctl __mpirun-rank __rank` instead of each rank. Under it:
//!
//! - Each process mpirun starts is a small shim ([`run_rank`]) that starts the real rank as
//!   its child, with the rank's standard output and error on FIFOs (`rank-N.out`,
//!   `rank-N.err`) in a private directory the launcher made and reads. So the user sees the
//!   same output as without mpirun: rank 0's standard output raw, the rest prefixed
//!   `[rank i]`, load progress on the bars. mpirun's own output goes to the launcher's
//!   standard error prefixed `[mpirun]`.
//! - A rank that fails leaves without its exit handlers ([`crate::exit::leave`]): one is
//!   `MPI_Finalize`, whose barrier would hold it until every peer finalized; it writes its exit
//!   code for the shim and ends itself with SIGKILL, so mpirun ends the job at once.
//! - The shim writes how its rank ended (exit code, signal, whether the signal was forwarded
//!   from mpirun or the launcher) to `rank-N.status`, which the launcher reads to name the
//!   rank whose failure was the origin and show its last error lines, as it does for ranks it
//!   started itself. A rank's crash (a signal nobody forwarded) is an origin too.
//! - What MPI guarantees when a rank dies: mpirun ends the whole job (SIGTERM, then SIGKILL, to
//!   every process it started) when one exits with a non-zero code or is killed, and exits
//!   non-zero itself. What tpctl adds: a rank that failed only because a peer did
//!   ([`super::SECONDARY_EXIT`]) keeps its shim for the grace period before the shim exits, so
//!   the origin prints its error before mpirun stops it; the launcher gives mpirun the grace
//!   period to end the job after a failure, then SIGTERM, then SIGKILL to mpirun's process
//!   group; the shim forwards its signals to its rank and the rank watches its shim (its
//!   `TPCTL_LAUNCHER_PID`), and the shim watches the launcher, so killing either leaves no
//!   rank behind; the launcher waits for every rank's process to be gone before it returns.
//! - Ctrl-C: mpirun runs in a process group of its own, and the launcher forwards one SIGINT
//!   to mpirun, which stops its processes; SIGKILL after the grace period.
//!
//! One host: the FIFOs are local files, so a job across hosts uses tcp (`--nnodes`).

use super::{
    code_of, pump_stderr, pump_stdout, Exit, Launch, Outcome, RankFailure, KEPT_LINES, POLL,
    SECONDARY_EXIT,
};
use crate::progress::ProgressBars;
use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

/// The launcher's private directory (FIFOs, status files), in the rank's environment.
pub const DIR_ENV: &str = "TPCTL_MPIRUN_DIR";
/// The grace period in milliseconds, in the rank's environment.
const GRACE_ENV: &str = "TPCTL_MPIRUN_GRACE_MS";
/// The variable OpenMPI gives each process its world rank in.
const OMPI_RANK: &str = "OMPI_COMM_WORLD_RANK";
/// The launcher's pid, which the shim watches (and sets to its own pid for its rank).
const LAUNCHER_PID_ENV: &str = "TPCTL_LAUNCHER_PID";
/// The file rank 0's extra environment (the API key) travels in, readable by the user alone.
const RANK0_ENV_FILE: &str = "rank0.env";

fn fifo(dir: &Path, rank: usize, stream: &str) -> PathBuf {
    dir.join(format!("rank-{rank}.{stream}"))
}

fn status_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.status"))
}

fn pid_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.pid"))
}

fn exit_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.exit"))
}

/// How a rank ended, as its shim wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RankEnd {
    /// Exit code, or 128 + signal.
    code: i32,
    /// The signal that ended it.
    signal: Option<i32>,
    /// Its shim forwarded a signal to it (from mpirun or the launcher) before it ended.
    forwarded: bool,
    /// When, in microseconds since the epoch (orders ranks found in one look).
    at_us: u128,
}

impl RankEnd {
    fn encode(&self) -> String {
        format!(
            "{} {} {} {}\n",
            self.code,
            self.signal.unwrap_or(0),
            u8::from(self.forwarded),
            self.at_us
        )
    }

    fn decode(text: &str) -> Option<RankEnd> {
        let mut f = text.split_whitespace();
        let code = f.next()?.parse().ok()?;
        let signal = f.next()?.parse::<i32>().ok().filter(|&s| s != 0);
        let forwarded = f.next()? == "1";
        let at_us = f.next()?.parse().ok()?;
        Some(RankEnd { code, signal, forwarded, at_us })
    }

    /// How this end bears on the outcome (see [`super::classify`]).
    fn exit(&self) -> Exit {
        if self.code == 0 {
            Exit::Success
        } else if self.forwarded
            && (self.signal.is_some() || self.code > 128 || self.code == SECONDARY_EXIT)
        {
            Exit::Stopped
        } else if self.code == SECONDARY_EXIT {
            Exit::Secondary
        } else {
            Exit::Origin
        }
    }
}

/// The private directory of one launch, removed when dropped.
struct RunDir(PathBuf);

impl RunDir {
    fn create(world: usize) -> Result<RunDir> {
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let path = std::env::temp_dir().join(format!(
            "tpctl-mpirun-{}-{}",
            std::process::id(),
            nanos.subsec_nanos()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("creating the launch directory {}", path.display()))?;
        let dir = RunDir(path);
        for rank in 0..world {
            for stream in ["out", "err"] {
                let p = fifo(&dir.0, rank, stream);
                nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU)
                    .with_context(|| format!("creating the FIFO {}", p.display()))?;
            }
        }
        Ok(dir)
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether `mpirun` runs here (`mpirun --version`).
fn check_mpirun() -> Result<()> {
    match Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Ok(()),
        _ => bail!(
            "the mpi backend starts its ranks with mpirun, which is not on PATH: install \
             OpenMPI (`cargo xtask install-mpi`, or the openmpi-bin package)"
        ),
    }
}

/// One pump that opens its FIFO first: the open waits for the rank to open the other end, so
/// [`Pumps::release`] ends the wait of a rank that never did.
fn pump_fifo(
    path: PathBuf,
    start: impl FnOnce(File) -> JoinHandle<()> + Send + 'static,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        if let Ok(f) = File::open(&path) {
            let _ = start(f).join();
        }
    })
}

/// Copies mpirun's own output to standard error, prefixed, keeping its last lines.
fn pump_mpirun(
    out: impl Read + Send + 'static,
    tail: Arc<Mutex<VecDeque<String>>>,
    bar: Arc<ProgressBars>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
            bar.println(&format!("[mpirun] {line}"));
            let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() == KEPT_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    })
}

/// Starts the ranks under one `mpirun` and supervises it until it has exited and no rank
/// process is left.
///
/// # Errors
/// A layout over several nodes, no `mpirun`, the launch directory or mpirun cannot be made or
/// started, or mpirun failed with no rank's failure to explain it (it names its own error).
pub fn launch(spec: &Launch, interrupted: &AtomicBool) -> Result<Outcome> {
    if spec.nnodes != 1 {
        bail!(
            "the mpi backend starts every rank from this host's mpirun: --nnodes {} needs tcp",
            spec.nnodes
        );
    }
    check_mpirun()?;
    let world = spec.nproc_per_node;
    let dir = RunDir::create(world)?;
    if !spec.rank0_env.is_empty() {
        let text: String = spec.rank0_env.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.0.join(RANK0_ENV_FILE))
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .context("writing rank 0's environment to the launch directory")?;
    }
    let bar = Arc::new(ProgressBars::new(world));
    let tails: Vec<Arc<Mutex<VecDeque<String>>>> =
        (0..world).map(|_| Arc::new(Mutex::new(VecDeque::new()))).collect();
    let mut pumps = Vec::new();
    for (rank, tail) in tails.iter().enumerate() {
        pumps.push(pump_fifo(fifo(&dir.0, rank, "out"), move |f| pump_stdout(rank, f)));
        let (tail, bar) = (tail.clone(), bar.clone());
        pumps.push(pump_fifo(fifo(&dir.0, rank, "err"), move |f| {
            pump_stderr((rank, rank), f, tail, bar)
        }));
    }
    let mut cmd = Command::new("mpirun");
    if nix::unistd::Uid::effective().is_root() {
        cmd.arg("--allow-run-as-root");
    }
    // Ranks often outnumber cores, and each rank places its own compute threads.
    cmd.args(["--oversubscribe", "--bind-to", "none", "-n", &world.to_string()]);
    let mut env: Vec<(OsString, OsString)> = vec![
        ("MASTER_ADDR".into(), spec.master_addr.clone().into()),
        ("MASTER_PORT".into(), spec.master_port.to_string().into()),
        (LAUNCHER_PID_ENV.into(), std::process::id().to_string().into()),
        (DIR_ENV.into(), dir.0.clone().into()),
        (GRACE_ENV.into(), spec.grace.as_millis().to_string().into()),
    ];
    env.extend(spec.env.iter().map(|(k, v)| (k.into(), v.into())));
    for (k, v) in &env {
        cmd.arg("-x").arg(k).env(k, v);
    }
    cmd.arg(&spec.program)
        .arg("__mpirun-rank")
        .args(&spec.args)
        // OpenMPI names each process's rank; torchrun's variables here would take precedence.
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("LOCAL_WORLD_SIZE")
        .env_remove("GROUP_RANK")
        // The launcher's own API key variable is not every rank's business.
        .env_remove(crate::spec::API_KEY_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut pumps = Pumps { dir: &dir.0, world, handles: pumps };
    let mut mpirun = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            pumps.release(Duration::from_secs(1));
            return Err(e).context("starting mpirun");
        }
    };
    let mpirun_tail = Arc::new(Mutex::new(VecDeque::new()));
    if let Some(out) = mpirun.stdout.take() {
        pumps.handles.push(pump_mpirun(out, mpirun_tail.clone(), bar.clone()));
    }
    if let Some(err) = mpirun.stderr.take() {
        pumps.handles.push(pump_mpirun(err, mpirun_tail.clone(), bar.clone()));
    }
    let (status, ends, interrupt) = supervise(&mut mpirun, &dir.0, world, spec.grace, interrupted);
    reap_ranks(&dir.0, world, spec.grace);
    pumps.release(spec.grace);
    bar.clear();
    if interrupt {
        return Ok(Outcome::Interrupted);
    }
    let reported = ends
        .iter()
        .find(|e| e.1.exit() == Exit::Origin)
        .or_else(|| ends.iter().find(|e| e.1.exit() == Exit::Secondary))
        .or_else(|| ends.iter().find(|e| e.1.exit() != Exit::Success));
    if let Some(&(rank, end)) = reported {
        let stderr_tail =
            tails[rank].lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
        let signal = end.signal.filter(|_| end.exit() == Exit::Origin);
        return Ok(Outcome::Failed(RankFailure { rank, code: end.code, signal, stderr_tail }));
    }
    if status.success() {
        return Ok(Outcome::Success);
    }
    let tail = mpirun_tail.lock().unwrap_or_else(|e| e.into_inner());
    let last = tail.iter().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim().to_owned());
    bail!(
        "mpirun failed with exit code {} before any rank reported how it ended{}",
        code_of(status),
        last.map(|l| format!(": {l}")).unwrap_or_default()
    )
}

/// The FIFO pumps of one launch.
struct Pumps<'a> {
    dir: &'a Path,
    world: usize,
    handles: Vec<JoinHandle<()>>,
}

impl Pumps<'_> {
    /// Lets every pump finish: a pump still waiting for its rank to open its FIFO (a rank that
    /// never started) gets a writer that closes at once, so it reads the end; waits `grace` at
    /// most, and leaves a pump stuck past it to the process's exit.
    fn release(&mut self, grace: Duration) {
        let until = Instant::now() + grace;
        while self.handles.iter().any(|h| !h.is_finished()) && Instant::now() < until {
            for rank in 0..self.world {
                for stream in ["out", "err"] {
                    // ENXIO (no reader) is fine: that pump has its FIFO open, or is done.
                    let _ = std::fs::OpenOptions::new()
                        .write(true)
                        .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
                        .open(fifo(self.dir, rank, stream));
                }
            }
            std::thread::sleep(POLL);
        }
        for h in self.handles.drain(..).filter(|h| h.is_finished()) {
            let _ = h.join();
        }
    }
}

/// Watches mpirun and the ranks' status files until mpirun has exited: returns mpirun's
/// status, the ranks that ended other than by success or not, in the order they ended, and
/// whether the user interrupted the job.
fn supervise(
    mpirun: &mut Child,
    dir: &Path,
    world: usize,
    grace: Duration,
    interrupted: &AtomicBool,
) -> (std::process::ExitStatus, Vec<(usize, RankEnd)>, bool) {
    let pid = Pid::from_raw(mpirun.id() as i32);
    let mut ends: Vec<(usize, RankEnd)> = Vec::new();
    let mut seen = vec![false; world];
    let mut interrupt = false;
    let mut term_at: Option<Instant> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        let exited = mpirun.try_wait().ok().flatten();
        let mut found = Vec::new();
        for (rank, seen) in seen.iter_mut().enumerate().filter(|(_, s)| !**s) {
            if let Some(end) = std::fs::read_to_string(status_file(dir, rank))
                .ok()
                .and_then(|t| RankEnd::decode(&t))
            {
                *seen = true;
                found.push((rank, end));
            }
        }
        found.sort_by_key(|(_, e)| e.at_us);
        for &(rank, end) in &found {
            tracing::debug!(rank, code = end.code, exit = ?end.exit(), "rank ended");
        }
        ends.extend(found);
        if let Some(status) = exited {
            return (status, ends, interrupt);
        }
        let failed = ends.iter().any(|e| e.1.exit() != Exit::Success);
        // After a failure the job is ending already: a Ctrl-C then changes nothing.
        if !interrupt && !failed && interrupted.load(Ordering::SeqCst) {
            interrupt = true;
            // OpenMPI stops every process it started when mpirun gets SIGINT.
            let _ = kill(pid, Signal::SIGINT);
            kill_at = Some(Instant::now() + grace);
        }
        if failed && term_at.is_none() && kill_at.is_none() {
            // mpirun ends the job itself when a rank fails; it gets the grace period to.
            term_at = Some(Instant::now() + grace);
        }
        if term_at.is_some_and(|t| Instant::now() >= t) && kill_at.is_none() {
            let _ = kill(pid, Signal::SIGTERM);
            kill_at = Some(Instant::now() + grace);
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            // The group: mpirun and whatever it started that stayed in it.
            let _ = killpg(pid, Signal::SIGKILL);
        }
        std::thread::sleep(POLL);
    }
}

/// Waits up to `grace` for every rank process (their shims wrote their pids) to be gone, then
/// kills those left. They watch their shims, so this is quick after mpirun is gone.
fn reap_ranks(dir: &Path, world: usize, grace: Duration) {
    // A pid is this launch's rank only while its environment names this rank's exit file: a
    // pid the system gave to another process since is left alone.
    let pids: Vec<(Pid, Vec<u8>)> = (0..world)
        .filter_map(|r| {
            let pid = std::fs::read_to_string(pid_file(dir, r)).ok()?.trim().parse().ok()?;
            let mut entry = format!("{}=", crate::exit::EXIT_FILE_ENV).into_bytes();
            entry.extend_from_slice(exit_file(dir, r).as_os_str().as_encoded_bytes());
            Some((Pid::from_raw(pid), entry))
        })
        .collect();
    let alive = |(p, entry): &(Pid, Vec<u8>)| {
        let running = std::fs::read_to_string(format!("/proc/{p}/stat"))
            .map(|s| !s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
            .unwrap_or(false);
        running
            && std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|kv| kv == entry.as_slice()))
    };
    let until = Instant::now() + grace;
    while pids.iter().any(alive) {
        if Instant::now() >= until {
            for (p, _) in pids.iter().filter(|p| alive(p)) {
                tracing::warn!(pid = %p, "a rank outlived mpirun; killing it");
                let _ = kill(*p, Signal::SIGKILL);
            }
            break;
        }
        std::thread::sleep(POLL);
    }
}

/// Opens a FIFO the launcher reads for writing; fails at once when nobody reads it (the
/// launcher is gone).
fn open_fifo(path: &Path) -> Result<File> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(OFlag::O_NONBLOCK.bits())
        .open(path)
        .with_context(|| format!("opening {} (is the launcher gone?)", path.display()))?;
    // The rank writes with blocking calls: a full pipe waits for the launcher to read.
    let flags = OFlag::from_bits_truncate(fcntl(&f, FcntlArg::F_GETFL)?);
    fcntl(&f, FcntlArg::F_SETFL(flags - OFlag::O_NONBLOCK))?;
    Ok(f)
}

/// In a process mpirun started (`tpctl __mpirun-rank ARGS`): runs `tpctl ARGS` as this
/// world rank with its output on the launcher's FIFOs, forwards signals to it, and writes how
/// it ended to its status file. Returns the exit code to leave with (the rank's).
///
/// # Errors
/// Not started by tpctl's mpirun launch (no launch directory or OpenMPI rank), the FIFOs
/// cannot be opened (the launcher is gone), or the rank cannot be started.
pub fn run_rank(args: &[OsString]) -> Result<i32> {
    let dir = PathBuf::from(std::env::var_os(DIR_ENV).with_context(|| {
        format!("{DIR_ENV} is not set: `tpctl __mpirun-rank` is started by `tpctl run` or `serve`")
    })?);
    let rank: usize = std::env::var(OMPI_RANK)
        .ok()
        .and_then(|r| r.parse().ok())
        .with_context(|| format!("{OMPI_RANK} is not set: start this under mpirun"))?;
    let launcher = std::env::var(LAUNCHER_PID_ENV).ok().and_then(|p| p.parse::<i32>().ok());
    let grace = std::env::var(GRACE_ENV)
        .ok()
        .and_then(|g| g.parse().ok())
        .map_or(Duration::from_secs(5), Duration::from_millis);
    let out = open_fifo(&fifo(&dir, rank, "out"))?;
    let err = open_fifo(&fifo(&dir, rank, "err"))?;
    let mut cmd = Command::new(std::env::current_exe().context("finding the tpctl executable")?);
    cmd.args(args)
        .env(LAUNCHER_PID_ENV, std::process::id().to_string())
        .env(crate::exit::EXIT_FILE_ENV, exit_file(&dir, rank))
        .env_remove(DIR_ENV)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    if rank == 0 {
        if let Ok(text) = std::fs::read_to_string(dir.join(RANK0_ENV_FILE)) {
            cmd.envs(text.lines().filter_map(|l| l.split_once('=')));
        }
    }
    let signalled = Arc::new(AtomicBool::new(false));
    let flag = signalled.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .context("installing the signal handler")?;
    let mut child = cmd.spawn().with_context(|| format!("starting rank {rank}"))?;
    let child_pid = Pid::from_raw(child.id() as i32);
    let _ = std::fs::write(pid_file(&dir, rank), format!("{child_pid}\n"));
    let launcher_alive = || launcher.is_none_or(|p| kill(Pid::from_raw(p), None).is_ok());
    let mut forwarded = false;
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status;
        }
        if signalled.load(Ordering::SeqCst) && !forwarded {
            forwarded = true;
            let _ = kill(child_pid, Signal::SIGTERM);
        }
        if !launcher_alive() {
            let _ = kill(child_pid, Signal::SIGKILL);
            let _ = child.wait();
            // Its launcher can no longer remove the directory.
            let _ = std::fs::remove_dir_all(&dir);
            return Ok(143);
        }
        std::thread::sleep(POLL);
    };
    // A rank that left through `exit::leave` killed itself after writing its code.
    let left = (status.signal() == Some(Signal::SIGKILL as i32))
        .then(|| std::fs::read_to_string(exit_file(&dir, rank)).ok()?.trim().parse::<i32>().ok())
        .flatten();
    let end = RankEnd {
        code: left.unwrap_or_else(|| code_of(status)),
        signal: status.signal().filter(|_| left.is_none()),
        forwarded,
        at_us: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros(),
    };
    let tmp = dir.join(format!("rank-{rank}.status.tmp"));
    std::fs::write(&tmp, end.encode())
        .and_then(|()| std::fs::rename(&tmp, status_file(&dir, rank)))
        .context("writing the rank's status for the launcher")?;
    if end.exit() == Exit::Secondary {
        // mpirun ends the job as soon as this exits non-zero: the origin gets the grace
        // period to print its error first.
        let until = Instant::now() + grace;
        while Instant::now() < until && !signalled.load(Ordering::SeqCst) && launcher_alive() {
            std::thread::sleep(POLL);
        }
    }
    Ok(end.code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_ends_round_trip_and_classify() {
        let end = |code, signal, forwarded| RankEnd { code, signal, forwarded, at_us: 7 };
        for e in [end(0, None, false), end(1, None, true), end(137, Some(9), false)] {
            assert_eq!(RankEnd::decode(&e.encode()), Some(e));
        }
        assert_eq!(end(0, None, false).exit(), Exit::Success);
        assert_eq!(end(1, None, false).exit(), Exit::Origin);
        assert_eq!(end(3, None, false).exit(), Exit::Secondary);
        assert_eq!(end(3, None, true).exit(), Exit::Stopped);
        assert_eq!(end(143, Some(15), true).exit(), Exit::Stopped);
        // A crash nobody forwarded a signal for is a failure of the rank's own.
        assert_eq!(end(139, Some(11), false).exit(), Exit::Origin);
    }
}
