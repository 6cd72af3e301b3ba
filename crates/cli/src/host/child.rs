//! One model of the host: a `tpctl serve` deployment of its own (its launcher, ranks, control
//! socket and an HTTP API on a loopback port), started by the host, swapped through its
//! control socket and stopped with the host.
//!
//! The child runs in a process group of its own, so a terminal's Ctrl-C reaches only the host,
//! which stops its models in order; each child watches the host (`TPCTL_HOST_PID`) and stops
//! when the host is gone, so no rank outlives a killed host either.

use crate::control::{self, client, paths, ErrorWire, OpWire, StatusWire};
use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The variable that tells a child deployment which process is its host.
pub const HOST_PID_ENV: &str = "TPCTL_HOST_PID";
/// Lines of a child's standard error kept for the report of its failure.
const KEPT_LINES: usize = 12;
/// How long one sleep or wakeup of a model may take.
const SWAP_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a stopping model has to exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(20);

/// What starts a model's deployment.
#[derive(Clone, Debug)]
pub struct ChildSpec {
    /// The model's name in the API.
    pub name: String,
    /// Its checkpoint, as `--model` takes it.
    pub model: String,
    /// Its deployment's name (the host's, a dash, the model's).
    pub deployment: String,
    /// Its launch flags (layout, threads, KV cache, config file).
    pub args: Vec<String>,
    /// More environment for its processes.
    pub env: Vec<(String, String)>,
}

/// A running model deployment.
pub struct Child {
    /// The model's name in the API.
    pub name: String,
    /// Its checkpoint, as given.
    pub model: String,
    /// Its deployment's name, for `tpctl status --deployment NAME`.
    pub deployment: String,
    /// Its control socket.
    pub socket: PathBuf,
    /// Its HTTP API, on loopback.
    pub addr: String,
    process: Mutex<std::process::Child>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

impl Child {
    /// Starts `tpctl serve` for one model and waits until it serves (`/health` ok), or
    /// `interrupted` is set.
    ///
    /// # Errors
    /// The process cannot start, exits before it serves (its last error lines are in the
    /// message), does not serve within `timeout`, or the host was interrupted (the process
    /// is then stopped).
    pub fn start(
        spec: &ChildSpec,
        verbosity: &[&str],
        timeout: Duration,
        interrupted: &AtomicBool,
    ) -> Result<Child> {
        let socket = paths::socket_path(&paths::runtime_dir(), &spec.deployment)?;
        let program = std::env::current_exe().context("finding the tpctl executable")?;
        let mut process = Command::new(program)
            .args(verbosity)
            .args(["serve", "--model", &spec.model, "--served-model-name", &spec.name])
            .args(["--listen", "127.0.0.1:0", "--deployment", &spec.deployment])
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .env(HOST_PID_ENV, std::process::id().to_string())
            // The host checks the API key; a child listens on loopback only.
            .env_remove(crate::spec::API_KEY_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting the deployment of model `{}`", spec.name))?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (addr_tx, addr_rx) = mpsc::channel();
        pump(process.stdout.take(), &spec.name, None, Some(addr_tx));
        pump(process.stderr.take(), &spec.name, Some(tail.clone()), None);
        let child = Child {
            name: spec.name.clone(),
            model: spec.model.clone(),
            deployment: spec.deployment.clone(),
            socket,
            addr: String::new(),
            process: Mutex::new(process),
            tail,
        };
        let deadline = Instant::now() + timeout;
        let addr = loop {
            if let Some(why) = child.exited() {
                bail!("model `{}` ({}) did not start: {why}", child.name, child.model);
            }
            if interrupted.load(Ordering::SeqCst) {
                child.stop();
                bail!("interrupted while model `{}` started", child.name);
            }
            if Instant::now() > deadline {
                child.kill();
                bail!(
                    "model `{}` ({}) announced no address within {timeout:?}",
                    child.name,
                    child.model
                );
            }
            if let Ok(addr) = addr_rx.recv_timeout(Duration::from_millis(50)) {
                break addr;
            }
        };
        let child = Child { addr, ..child };
        loop {
            if let Some(why) = child.exited() {
                bail!("model `{}` ({}) did not start: {why}", child.name, child.model);
            }
            if interrupted.load(Ordering::SeqCst) {
                child.stop();
                bail!("interrupted while model `{}` started", child.name);
            }
            if health(&child.addr) == Some(200) {
                return Ok(child);
            }
            if Instant::now() > deadline {
                child.kill();
                bail!("model `{}` ({}) was not ready within {timeout:?}", child.name, child.model);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Why the deployment is gone (its exit and last error lines), or `None` while it runs.
    pub fn exited(&self) -> Option<String> {
        let status = self.process.lock().unwrap_or_else(|e| e.into_inner()).try_wait();
        let status = match status {
            Ok(Some(status)) => status,
            Ok(None) => return None,
            Err(e) => return Some(format!("cannot wait for its launcher: {e}")),
        };
        let how = match (status.code(), status.signal()) {
            (Some(code), _) => format!("its launcher exited with code {code}"),
            (None, Some(signal)) => format!("its launcher was killed by signal {signal}"),
            (None, None) => "its launcher exited".to_owned(),
        };
        let tail = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        let errors: Vec<&str> =
            tail.iter().map(String::as_str).filter(|l| l.contains("error")).collect();
        Some(match errors.last() {
            Some(line) => format!("{how}: {}", line.trim()),
            None => how,
        })
    }

    /// The deployment's status from its control socket.
    ///
    /// # Errors
    /// The socket does not answer, or answers an error.
    pub fn status(&self) -> Result<StatusWire> {
        self.status_within(SWAP_TIMEOUT)
    }

    /// [`Child::status`], waiting at most `timeout` for the reply.
    ///
    /// # Errors
    /// As [`Child::status`].
    pub fn status_within(&self, timeout: Duration) -> Result<StatusWire> {
        let reply = client::call(&self.socket, &control::Request::Status, timeout)?;
        match (reply.status, reply.error) {
            (Some(status), _) => Ok(status),
            (None, Some(e)) => bail!("{}", e.message),
            (None, None) => bail!("{} answered an empty status", self.socket.display()),
        }
    }

    /// Puts every tag of the model to sleep at `level`; running requests finish first
    /// (`Wait`) or are paused until the wakeup (`Keep`).
    ///
    /// # Errors
    /// The sleep failed (the deployment rolled back, or stopped): the reply's error.
    pub fn sleep(&self, level: u8, mode: session::sleep::QuiesceMode) -> Result<OpWire, ErrorWire> {
        let args = control::SleepArgs { tags: Vec::new(), level: Some(level), mode, verify: false };
        self.op(&control::Request::Sleep(args))
    }

    /// Wakes every tag asleep.
    ///
    /// # Errors
    /// The wakeup failed (the deployment rolled back, or stopped): the reply's error.
    pub fn wakeup(&self) -> Result<OpWire, ErrorWire> {
        self.op(&control::Request::Wakeup(control::WakeupArgs { tags: Vec::new(), model: None }))
    }

    fn op(&self, request: &control::Request) -> Result<OpWire, ErrorWire> {
        let reply = client::call(&self.socket, request, SWAP_TIMEOUT)
            .map_err(|e| ErrorWire { message: format!("{e:#}"), ..ErrorWire::default() })?;
        match (reply.ok, reply.op, reply.error) {
            (true, Some(op), _) => Ok(op),
            (_, _, Some(e)) => Err(e),
            _ => Err(ErrorWire {
                message: format!(
                    "{} answered neither a receipt nor an error",
                    self.socket.display()
                ),
                ..ErrorWire::default()
            }),
        }
    }

    /// Stops the deployment as Ctrl-C would (its launcher stops every rank), killing it after
    /// a grace period, and waits for it.
    pub fn stop(&self) {
        // A reaped launcher's pid may be another process's by now: signal only a live one.
        if self.exited().is_some() {
            return;
        }
        let _ = kill(self.pid(), Signal::SIGINT);
        let deadline = Instant::now() + STOP_GRACE;
        while self.exited().is_none() {
            if Instant::now() > deadline {
                self.kill();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the launcher (its ranks follow within moments: they watch it) and reaps it.
    fn kill(&self) {
        let mut process = self.process.lock().unwrap_or_else(|e| e.into_inner());
        let _ = process.kill();
        let _ = process.wait();
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.process.lock().unwrap_or_else(|e| e.into_inner()).id() as i32)
    }
}

/// Resident bytes of every rank of a status or receipt, as each rank's probe read them.
pub fn resident(ranks: &[session::sleep::RankReceipt], after: bool) -> u64 {
    ranks.iter().map(|r| if after { r.after.resident } else { r.before.resident }).sum()
}

/// Resident bytes of a deployment per device, as its ranks' probes read them (`after` each
/// receipt's operation, else before it): `host` for the ranks' processes together, then each
/// GPU by what the probe calls it (its UUID, else `HOST:nvmlINDEX`). A GPU the driver does not
/// list the processes of is read whole by each rank on it: the largest reading counts, not
/// their sum.
pub fn resident_by_device(
    ranks: &[session::sleep::RankReceipt],
    after: bool,
) -> std::collections::BTreeMap<String, u64> {
    let mut devices = std::collections::BTreeMap::new();
    devices.insert("host".to_owned(), resident(ranks, after));
    for r in ranks {
        let probe = if after { &r.after } else { &r.before };
        for &(index, bytes) in &probe.devices {
            let slot = devices.entry(probe.device_id(index)).or_insert(0);
            if probe.is_device_wide(index) {
                *slot = (*slot).max(bytes);
            } else {
                *slot += bytes;
            }
        }
    }
    devices
}

/// Per GPU (by the probes' id): the device bytes the ranks of a receipt kept after its
/// operation (each rank's own reading; a device-wide reading, which cannot tell the ranks
/// apart, counts nothing), and the device bytes its tags moved (released by a sleep, restored
/// by a wakeup) on each rank's GPU. Empty on the CPU, and where NVML cannot read the GPU.
pub fn gpu_bytes(
    ranks: &[session::sleep::RankReceipt],
) -> (std::collections::BTreeMap<String, u64>, std::collections::BTreeMap<String, u64>) {
    let (mut kept, mut moved) =
        (std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
    for r in ranks {
        let probe = &r.after;
        for &(index, bytes) in &probe.devices {
            let slot = kept.entry(probe.device_id(index)).or_insert(0);
            if !probe.is_device_wide(index) {
                *slot += bytes;
            }
        }
        if let Some(&(index, _)) = probe.devices.first() {
            let bytes: u64 = r.tags.iter().map(|t| t.device_bytes).sum();
            *moved.entry(probe.device_id(index)).or_insert(0) += bytes;
        }
    }
    (kept, moved)
}

/// Copies a child's stream to the host's standard error, each line prefixed with the model's
/// name; keeps the last lines in `tail`; sends the address the child announces to `addr`.
fn pump(
    stream: Option<impl Read + Send + 'static>,
    name: &str,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
    addr: Option<mpsc::Sender<String>>,
) {
    let Some(stream) = stream else { return };
    let name = name.to_owned();
    let thread_name = format!("model-{name}");
    let spawned = std::thread::Builder::new().name(thread_name).spawn(move || {
        let mut announced = false;
        for line in BufReader::new(stream).lines().map_while(|l| l.ok()) {
            if let (false, Some(tx)) = (announced, &addr) {
                if let Some((_, rest)) = line.split_once(" on http://") {
                    announced = true;
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_owned());
                    continue;
                }
            }
            eprintln!("[{name}] {line}");
            if let Some(tail) = &tail {
                let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                if tail.len() == KEPT_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot copy the output of a model: {e}");
    }
}

/// `GET /health` of a child: its status code, or `None` when it does not answer.
fn health(addr: &str) -> Option<u16> {
    let timeout = Duration::from_secs(2);
    let mut stream = std::net::TcpStream::connect_timeout(&addr.parse().ok()?, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.set_write_timeout(Some(timeout)).ok()?;
    let head = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).ok()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// In a model's `tpctl serve` started by a host: sets `stop` when the host is gone, so a
/// killed host leaves no deployment behind. Does nothing outside a host.
pub fn watch_host(stop: Arc<AtomicBool>) {
    let Some(host) = std::env::var(HOST_PID_ENV).ok().and_then(|p| p.parse::<u32>().ok()) else {
        return;
    };
    let spawned = std::thread::Builder::new().name("host-watch".into()).spawn(move || loop {
        if std::os::unix::process::parent_id() != host {
            // Stop first: the host held the other end of standard error, so writing to it
            // may fail now.
            stop.store(true, Ordering::SeqCst);
            let _ = writeln!(
                std::io::stderr(),
                "the model host (pid {host}) is gone; this deployment stops"
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    });
    if let Err(e) = spawned {
        tracing::warn!("cannot watch the model host: {e}");
    }
}
