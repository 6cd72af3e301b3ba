//! The model host: `tpctl serve` with several models (`--model NAME=PATH` repeated), each a
//! deployment of its own, behind one OpenAI endpoint that routes by the request's `model`, and
//! swapped by sleep/wakeup under a memory budget.
//!
//! - Each model runs as its own `tpctl serve` ([`child`]): its ranks, its control socket
//!   (deployment `HOST-NAME`, so `tpctl sleep/wakeup/status --deployment HOST-NAME` work on
//!   it), its API on a loopback port. The host forwards requests there ([`proxy`]), an SSE
//!   stream as it comes.
//! - The API and the host's control socket (deployment `HOST`: `tpctl status` shows the
//!   host's table, `tpctl restart --deployment HOST-NAME` starts a failed model again,
//!   [`socket`]) serve at once; the models then load one after another (`loading` in
//!   `/v1/models`, requests wait); each is measured awake, put to sleep and measured asleep,
//!   so the budget's arithmetic ([`table`]) runs on measured bytes, and a budget that cannot
//!   hold some model is refused at start with the numbers (the host then exits).
//! - A request for a sleeping model wakes it. When the wakeup would exceed the budget, the
//!   least recently used idle models sleep first (sleep, then wake: never both resident
//!   beyond the budget); a model with requests running stops admitting new ones and sleeps
//!   once they finished, or after `[server] drain_timeout` seconds with them paused (the
//!   sleep's `keep` mode): they continue where they were once it wakes again, which the host
//!   does as soon as that needs no other model's requests paused. Swaps are serialized (one
//!   at a time, in the order they were asked). A model sleeps at its level; at level 1 its
//!   weights' backup needs host memory, and when `MemAvailable` cannot hold it the model
//!   sleeps at level 2 instead (logged, and counted in `tpctl_host_level2_sleeps_total`).
//! - The host follows its models' deployments: a model put to sleep or woken by hand (`tpctl
//!   sleep/wakeup --deployment HOST-NAME`) is seen so within a second ([`Host::follow`]).
//!   Requests wait for their model at most `[server] asleep_wait_timeout` seconds, then get
//!   503 with `Retry-After`.
//! - Failures stay local: a failed sleep or wakeup leaves that model as its deployment
//!   reports it (rolled back, or failed) and its requests get a 503 naming the reason; a
//!   model whose deployment exited is marked failed, and the next request for it starts it
//!   again (once: a start that fails is final); the others keep serving.

pub mod child;
mod http;
pub mod launch;
mod metrics;
pub mod proxy;
mod socket;
mod start;
pub mod table;

use anyhow::{bail, Context, Result};
use child::{Child, ChildSpec};
use session::sleep::QuiesceMode;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use table::{Plan, State, Table};

/// How long a model may take to load and serve.
const START_TIMEOUT: Duration = Duration::from_secs(600);
/// How often a waiting request looks at its model again.
const POLL: Duration = Duration::from_millis(20);

/// One model of the host.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// Its name in the API.
    pub name: String,
    /// Its checkpoint, as `--model` takes it.
    pub model: String,
    /// Its launch flags (layout, threads, KV cache, config file).
    pub args: Vec<String>,
    /// Never put to sleep to make room.
    pub pinned: bool,
    /// The level it sleeps at to make room.
    pub sleep_level: u8,
    /// More environment for its deployment.
    pub env: Vec<(String, String)>,
}

/// What `tpctl serve` hands the host.
#[derive(Clone, Debug)]
pub struct HostSpec {
    /// The models, in the order given.
    pub models: Vec<ModelSpec>,
    /// The host's deployment name; each model's is this, a dash and its name.
    pub deployment: String,
    /// The address of the API.
    pub listen: String,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// The memory budget of the host's memory, bytes.
    pub budget: u64,
    /// The budget as given (a share or bytes), for each GPU the models turn out to use.
    pub budget_rule: table::MemoryBudget,
    /// How long a request waits for its model.
    pub wait: Duration,
    /// How long a model that must sleep waits for its running requests before it pauses them.
    pub drain: Duration,
    /// `-q` / `-v` for the models' deployments.
    pub verbosity: Vec<String>,
    /// Errors only: no summary of the models at start, no line at the stop.
    pub quiet: bool,
}

/// Reads `--model` values as `NAME=PATH` pairs; refuses a value without a name and two models
/// of one name.
///
/// # Errors
/// A message naming the value at fault.
pub fn parse_models(values: &[String]) -> Result<Vec<(String, String)>> {
    let mut models: Vec<(String, String)> = Vec::new();
    for value in values {
        let Some((name, path)) =
            value.split_once('=').filter(|(n, p)| !n.is_empty() && !p.is_empty())
        else {
            bail!("--model `{value}`: with several models each is NAME=PATH (a name for the API's `model` field, then the checkpoint)");
        };
        if models.iter().any(|(n, _)| n == name) {
            bail!("two models are named `{name}`: give each --model NAME=PATH its own name");
        }
        models.push((name.to_owned(), path.to_owned()));
    }
    Ok(models)
}

/// Counters of one model, for `/metrics`.
#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    swaps_in: AtomicU64,
    swaps_out: AtomicU64,
    swap_in_us: AtomicU64,
    swap_out_us: AtomicU64,
    failed_swaps: AtomicU64,
    restarts: AtomicU64,
    waiting: AtomicUsize,
    /// Requests paused by a sleep that did not wait for them (keep).
    kept: AtomicU64,
    /// Sleeps at level 2 instead of 1: host memory could not hold the backup.
    level2: AtomicU64,
}

/// The host's state, shared by the HTTP handlers.
pub struct Host {
    /// The host's deployment name (its control socket's).
    deployment: String,
    table: Mutex<Table>,
    /// Each model's running deployment (none until it started; replaced when it is started
    /// again).
    children: Vec<RwLock<Option<Arc<Child>>>>,
    /// What starts each model's deployment.
    specs: Vec<ChildSpec>,
    /// `-q` / `-v` for the models' deployments.
    verbosity: Vec<String>,
    /// Set when the host stops (a model starting then stops too).
    stop: Arc<AtomicBool>,
    counters: Vec<Counters>,
    /// Serializes swaps: one model sleeps or wakes at a time, in the order asked (tokio's
    /// mutex is fair).
    swap: tokio::sync::Mutex<()>,
    /// Each model's sleep level.
    levels: Vec<u8>,
    wait: Duration,
    drain: Duration,
    api_key: Option<String>,
    created: u64,
    /// Set while a task wakes the model for its paused requests.
    reviving: Vec<AtomicBool>,
    /// Why the models could not start, which ends the host.
    fatal: Mutex<Option<anyhow::Error>>,
}

/// A request waiting for its model, counted in the queue depth until dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request admitted to its model: counted in flight until dropped.
pub struct Admission {
    host: Arc<Host>,
    index: usize,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.host.lock().finish(self.index);
    }
}

/// Why a request cannot be served now: the message, and whether waiting may help (503 with
/// `Retry-After`) or not (503 alone).
pub struct Refusal {
    message: String,
    retry: bool,
}

impl Host {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Model `index`'s deployment now, once it started.
    fn child(&self, index: usize) -> Option<Arc<Child>> {
        self.children[index].read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Model `index`'s deployment, for a control call.
    fn running(&self, index: usize) -> Result<Arc<Child>, String> {
        self.child(index).ok_or_else(|| format!("model `{}` has not started", self.name(index)))
    }

    /// Model `index`'s name.
    fn name(&self, index: usize) -> &str {
        &self.specs[index].name
    }

    /// Admits a request for model `index`, waking it first (and putting others to sleep to
    /// make room) when it sleeps; waits at most the host's wait.
    ///
    /// # Errors
    /// The model failed, cannot fit, or did not become ready in time.
    pub async fn acquire(self: &Arc<Self>, index: usize) -> Result<Admission, Refusal> {
        let counters = &self.counters[index];
        counters.requests.fetch_add(1, Ordering::Relaxed);
        counters.waiting.fetch_add(1, Ordering::Relaxed);
        // Counted out however the wait ends, a client that went away included.
        let _waiting = Waiting(&counters.waiting);
        self.acquire_inner(index).await
    }

    async fn acquire_inner(self: &Arc<Self>, index: usize) -> Result<Admission, Refusal> {
        let deadline = tokio::time::Instant::now() + self.wait;
        loop {
            let plan = {
                let mut table = self.lock();
                if table.admit(index) {
                    return Ok(Admission { host: self.clone(), index });
                }
                table.plan(index)
            };
            match plan {
                Plan::Ready => continue,
                Plan::Unavailable(message) => return Err(Refusal { message, retry: false }),
                Plan::Wait(why) => {
                    if tokio::time::Instant::now() + POLL > deadline {
                        return Err(self.timed_out(&why));
                    }
                    tokio::time::sleep(POLL).await;
                }
                Plan::Swap { .. } | Plan::Drain { .. } | Plan::Restart { .. } => {
                    // A task of its own: a swap runs to its end (and leaves the table true to
                    // the deployments) even when the client that asked for it goes away.
                    let host = self.clone();
                    let swap = tokio::spawn(async move {
                        let Ok(_turn) = tokio::time::timeout_at(deadline, host.swap.lock()).await
                        else {
                            let name = host.name(index);
                            let why = format!("model `{name}` waits for other models' swaps");
                            return Err(host.timed_out(&why));
                        };
                        host.swap_in(index, deadline).await
                    });
                    match swap.await {
                        Ok(Ok(Some(admission))) => return Ok(admission),
                        Ok(Ok(None)) => {}
                        Ok(Err(refusal)) => return Err(refusal),
                        Err(e) => {
                            let name = self.name(index);
                            return Err(Refusal {
                                message: format!("the swap for model `{name}` stopped: {e}"),
                                retry: true,
                            });
                        }
                    }
                }
            }
        }
    }

    fn timed_out(&self, why: &str) -> Refusal {
        Refusal {
            message: format!(
                "{why}, still after {:.0} s ([server] asleep_wait_timeout): try again later",
                self.wait.as_secs_f64()
            ),
            retry: true,
        }
    }

    /// With the swap turn held: makes room and wakes model `index`, then admits the request
    /// before any other swap can put it to sleep again. `None`: plan again (it was ready).
    async fn swap_in(
        self: &Arc<Self>,
        index: usize,
        deadline: tokio::time::Instant,
    ) -> Result<Option<Admission>, Refusal> {
        let result = self.swap_in_turn(index, deadline).await;
        // Only the holder of the swap turn drains models: whatever happened, none is left
        // refusing requests for a swap that is over.
        for model in &mut self.lock().models {
            model.draining = false;
        }
        result
    }

    async fn swap_in_turn(
        self: &Arc<Self>,
        index: usize,
        deadline: tokio::time::Instant,
    ) -> Result<Option<Admission>, Refusal> {
        loop {
            let plan = self.lock().plan(index);
            let (evict, busy) = match plan {
                Plan::Ready => return Ok(None),
                Plan::Unavailable(message) => return Err(Refusal { message, retry: false }),
                Plan::Wait(why) => {
                    if tokio::time::Instant::now() + POLL > deadline {
                        return Err(self.timed_out(&why));
                    }
                    tokio::time::sleep(POLL).await;
                    continue;
                }
                Plan::Drain { evict } => {
                    // Drained (or still busy after the bound, their requests then paused),
                    // they admit nothing: they are the ones to sleep (planning again could
                    // pick others and leave these draining).
                    let busy = self.drain(&evict, deadline).await?;
                    (evict, busy)
                }
                Plan::Swap { evict } | Plan::Restart { evict } => (evict, Vec::new()),
            };
            for victim in evict {
                self.swap_out(victim, index, busy.contains(&victim)).await?;
            }
            if matches!(self.lock().models[index].state, State::Failed(_)) {
                self.restart(index).await?;
            } else {
                self.wake(index).await?;
            }
            let mut table = self.lock();
            if table.admit(index) {
                return Ok(Some(Admission { host: self.clone(), index }));
            }
        }
    }

    /// Stops admitting requests to `models` and waits until their running requests finished,
    /// at most the drain bound; returns the models still busy then (they sleep with their
    /// requests paused, and continue them once woken).
    async fn drain(
        &self,
        models: &[usize],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<usize>, Refusal> {
        {
            let mut table = self.lock();
            for &m in models {
                table.models[m].draining = true;
            }
        }
        let bound = tokio::time::Instant::now() + self.drain;
        loop {
            let busy: Vec<(usize, usize)> = {
                let table = self.lock();
                models
                    .iter()
                    .map(|&m| (m, table.models[m].in_flight))
                    .filter(|&(_, n)| n > 0)
                    .collect()
            };
            if busy.is_empty() {
                return Ok(Vec::new());
            }
            let now = tokio::time::Instant::now();
            if now >= bound {
                for &(m, n) in &busy {
                    let _ = writeln!(
                        std::io::stderr(),
                        "tpctl: model `{}` still runs {n} request(s) after {:.1} s ([server] drain_timeout): it sleeps with them paused (keep), to continue once it wakes",
                        self.name(m),
                        self.drain.as_secs_f64()
                    );
                }
                return Ok(busy.into_iter().map(|(m, _)| m).collect());
            }
            if now + POLL > deadline {
                let mut table = self.lock();
                for &m in models {
                    table.models[m].draining = false;
                }
                let names: Vec<&str> = busy.iter().map(|&(m, _)| self.name(m)).collect();
                return Err(self.timed_out(&format!(
                    "making room: model(s) {} still run requests",
                    names.join(", ")
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Puts model `victim` to sleep to make room for model `for_model`; with `keep`, its
    /// running requests are paused rather than waited for.
    async fn swap_out(
        self: &Arc<Self>,
        victim: usize,
        for_model: usize,
        keep: bool,
    ) -> Result<(), Refusal> {
        self.set_state(victim, State::Sleeping);
        let level = self.sleep_level(victim);
        let host = self.clone();
        let start = Instant::now();
        let mode = if keep { QuiesceMode::Keep } else { QuiesceMode::Wait };
        let result =
            blocking(move || host.running(victim)?.sleep(level, mode).map_err(|e| e.message)).await;
        let counters = &self.counters[victim];
        match result {
            Ok(op) => {
                counters.swaps_out.fetch_add(1, Ordering::Relaxed);
                counters.swap_out_us.fetch_add(micros(start), Ordering::Relaxed);
                let mut table = self.lock();
                let model = &mut table.models[victim];
                model.state = State::Asleep { level: Some(level) };
                model.draining = false;
                if keep {
                    model.kept = true;
                    counters.kept.fetch_add(model.in_flight as u64, Ordering::Relaxed);
                }
                model.asleep_bytes = child::resident(&op.ranks, true);
                model.measured = child::resident_by_device(&op.ranks, true);
                model.swap_bytes = model.swap_bytes.max(op.bytes);
                let (kept, moved) = child::gpu_bytes(&op.ranks);
                model.gpu_asleep = kept;
                for (gpu, bytes) in moved {
                    let slot = model.gpu_swap.entry(gpu).or_insert(0);
                    *slot = (*slot).max(bytes);
                }
                Ok(())
            }
            Err(message) => {
                counters.failed_swaps.fetch_add(1, Ordering::Relaxed);
                self.after_failure(victim).await;
                let (v, t) = (self.name(victim), self.name(for_model));
                Err(Refusal {
                    message: format!(
                        "making room for model `{t}`: model `{v}` could not sleep: {message}"
                    ),
                    retry: true,
                })
            }
        }
    }

    /// Wakes model `index` (room was made).
    async fn wake(self: &Arc<Self>, index: usize) -> Result<(), Refusal> {
        self.set_state(index, State::Waking);
        let host = self.clone();
        let start = Instant::now();
        let result = blocking(move || host.running(index)?.wakeup().map_err(|e| e.message)).await;
        let counters = &self.counters[index];
        match result {
            Ok(op) => {
                counters.swaps_in.fetch_add(1, Ordering::Relaxed);
                counters.swap_in_us.fetch_add(micros(start), Ordering::Relaxed);
                let mut table = self.lock();
                let model = &mut table.models[index];
                model.state = State::Awake;
                // The wakeup continued the requests a keep sleep paused.
                model.kept = false;
                model.measured = child::resident_by_device(&op.ranks, true);
                model.swap_bytes = model.swap_bytes.max(op.bytes);
                for (gpu, bytes) in child::gpu_bytes(&op.ranks).1 {
                    let slot = model.gpu_swap.entry(gpu).or_insert(0);
                    *slot = (*slot).max(bytes);
                }
                Ok(())
            }
            Err(message) => {
                counters.failed_swaps.fetch_add(1, Ordering::Relaxed);
                self.after_failure(index).await;
                let name = self.name(index);
                Err(Refusal {
                    message: format!("model `{name}` could not wake up: {message}"),
                    retry: true,
                })
            }
        }
    }

    /// After a failed swap: the model's state as its deployment reports it (rolled back:
    /// awake or asleep as before; else failed).
    async fn after_failure(self: &Arc<Self>, index: usize) {
        let host = self.clone();
        let status =
            blocking(move || host.running(index)?.status().map_err(|e| format!("{e:#}"))).await;
        let before = self.lock().models[index].state.clone();
        let state = match status {
            Ok(s) if s.state == "running" => State::Awake,
            // Rolled back to asleep: at the level it slept at before.
            Ok(s) if s.state == "sleeping" => match before {
                State::Asleep { level } => State::Asleep { level },
                _ => State::Asleep { level: Some(self.levels[index]) },
            },
            Ok(s) => {
                State::Failed(s.reason.unwrap_or_else(|| format!("its deployment is {}", s.state)))
            }
            Err(e) => State::Failed(format!("its control socket does not answer: {e}")),
        };
        let mut table = self.lock();
        table.models[index].draining = false;
        table.models[index].state = state;
    }

    fn set_state(&self, index: usize, state: State) {
        self.lock().models[index].state = state;
    }

    /// Starts the failed model `index` again (room was made): its old deployment is reaped,
    /// a new one loads, awake. A failed start is final for that model.
    async fn restart(self: &Arc<Self>, index: usize) -> Result<(), Refusal> {
        self.set_state(index, State::Loading);
        let name = self.name(index).to_owned();
        let _ = writeln!(std::io::stderr(), "tpctl: model `{name}` failed; starting it again");
        let host = self.clone();
        let result = blocking(move || {
            if let Some(old) = host.child(index) {
                old.stop();
            }
            let verbosity: Vec<&str> = host.verbosity.iter().map(String::as_str).collect();
            let spec = &host.specs[index];
            Child::start(spec, &verbosity, START_TIMEOUT, &host.stop).map_err(|e| format!("{e:#}"))
        })
        .await;
        match result {
            Ok(child) => {
                *self.children[index].write().unwrap_or_else(|e| e.into_inner()) =
                    Some(Arc::new(child));
                self.counters[index].restarts.fetch_add(1, Ordering::Relaxed);
                self.set_state(index, State::Awake);
                Ok(())
            }
            Err(why) => {
                let mut table = self.lock();
                table.models[index].state = State::Failed(format!("its restart failed: {why}"));
                table.models[index].restartable = false;
                Err(Refusal {
                    message: format!("model `{name}` failed and could not start again: {why}"),
                    retry: false,
                })
            }
        }
    }

    /// Marks failed every model whose deployment exited (not one being started again).
    fn check_children(&self) {
        for i in 0..self.children.len() {
            let Some(child) = self.child(i) else { continue };
            let Some(why) = child.exited() else { continue };
            let mut table = self.lock();
            let current = self.child(i).is_some_and(|c| Arc::ptr_eq(&child, &c));
            if current && !matches!(table.models[i].state, State::Failed(_) | State::Loading) {
                let _ = writeln!(std::io::stderr(), "error: model `{}`: {why}", child.name);
                table.models[i].state = State::Failed(why);
            }
        }
    }
}

/// Microseconds since `start`.
fn micros(start: Instant) -> u64 {
    start.elapsed().as_micros().min(u64::MAX as u128) as u64
}

/// Runs a blocking control call off the async workers; a panicked call reads as an error.
async fn blocking<T: Send + 'static>(
    call: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    match tokio::task::spawn_blocking(call).await {
        Ok(result) => result,
        Err(e) => Err(format!("the control call did not finish: {e}")),
    }
}

/// Runs the host: serves the API and the host's control socket at once, starts and measures
/// every model ([`start`]), serves until Ctrl-C, SIGTERM or `tpctl stop --deployment HOST`,
/// then stops every model. Returns the exit code.
///
/// # Errors
/// A model does not start, the budget cannot hold the models, or the API or the control
/// socket cannot serve.
pub fn run(spec: HostSpec) -> Result<i32> {
    let addr = crate::serve::check_listen(&spec.listen, spec.api_key.is_some())?;
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("binding the HTTP API to {addr}"))?;
    listener.set_nonblocking(true).context("configuring the HTTP listener")?;
    let local = listener.local_addr().context("reading the HTTP listener's address")?;
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .context("installing the Ctrl-C handler")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("host-http")
        .enable_io()
        .enable_time()
        .build()
        .context("starting the HTTP runtime")?;

    let host = Arc::new(Host::new(&spec, interrupted.clone()));
    let socket = crate::control::paths::socket_path(
        &crate::control::paths::runtime_dir(),
        &spec.deployment,
    )?;
    let flag = interrupted.clone();
    let control = crate::control::Server::start_with(
        &socket,
        socket::handler(host.clone(), runtime.handle().clone()),
        Arc::new(move || flag.store(true, Ordering::SeqCst)),
    )?;
    let names: Vec<&str> = spec.models.iter().map(|m| m.name.as_str()).collect();
    println!(
        "tpctl serve: {} models ({}) on http://{local} (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics)",
        names.len(),
        names.join(", ")
    );
    if !spec.quiet {
        eprintln!(
            "tpctl: model host {} (control socket {}): the models load",
            spec.deployment,
            socket.display()
        );
    }
    let starter = {
        let (host, spec, handle) = (host.clone(), spec.clone(), runtime.handle().clone());
        std::thread::Builder::new()
            .name("host-start".into())
            .spawn(move || {
                if let Err(e) = start::start_models(&host, &spec, &handle) {
                    *host.fatal.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    host.stop.store(true, Ordering::SeqCst);
                }
            })
            .context("starting the models' loader")?
    };
    let served = http::serve(&runtime, listener, host.clone(), interrupted.clone());
    // A failed API stops the loading too.
    interrupted.store(true, Ordering::SeqCst);
    let _ = starter.join();
    drop(control);
    let current: Vec<Arc<Child>> = (0..host.children.len()).filter_map(|i| host.child(i)).collect();
    stop_all(current.iter().map(|c| &**c));
    runtime.shutdown_timeout(Duration::from_secs(1));
    if let Some(e) = host.fatal.lock().unwrap_or_else(|e| e.into_inner()).take() {
        return Err(e);
    }
    served?;
    if !spec.quiet {
        eprintln!("stopped: every model's ranks are gone");
    }
    Ok(0)
}

impl Host {
    /// The host of `spec`'s models, every one loading.
    fn new(spec: &HostSpec, stop: Arc<AtomicBool>) -> Host {
        let entries = spec
            .models
            .iter()
            .map(|m| table::Entry {
                checkpoint: m.model.clone(),
                ..table::Entry::loading(&m.name, m.pinned)
            })
            .collect();
        let mut table = Table::new(spec.budget, entries);
        table.starting = true;
        Host {
            deployment: spec.deployment.clone(),
            counters: spec.models.iter().map(|_| Counters::default()).collect(),
            table: Mutex::new(table),
            children: spec.models.iter().map(|_| RwLock::new(None)).collect(),
            specs: spec.models.iter().map(|m| start::child_spec(spec, m)).collect(),
            verbosity: spec.verbosity.clone(),
            stop,
            swap: tokio::sync::Mutex::new(()),
            levels: spec.models.iter().map(|m| m.sleep_level).collect(),
            wait: spec.wait,
            drain: spec.drain,
            api_key: spec.api_key.clone(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            reviving: spec.models.iter().map(|_| AtomicBool::new(false)).collect(),
            fatal: Mutex::new(None),
        }
    }

    /// The level model `index` sleeps at now: its own, except that a level-1 sleep whose
    /// backup host memory cannot hold (or whose room cannot be read) is a level-2 one, said
    /// on standard error and counted.
    fn sleep_level(&self, index: usize) -> u8 {
        let configured = self.levels[index];
        let backup = self.lock().models[index].backup_bytes;
        let available = host_available_bytes().map_err(|e| format!("{e:#}"));
        let (level, why) = table::sleep_level(configured, backup, available);
        if let Some(why) = why {
            self.counters[index].level2.fetch_add(1, Ordering::Relaxed);
            let name = self.name(index);
            let _ = writeln!(std::io::stderr(), "tpctl: model `{name}` sleeps at level 2: {why}");
        }
        level
    }
}

/// Stops every model's deployment (in parallel: each has its grace period) and waits for them.
fn stop_all<'a>(children: impl Iterator<Item = &'a Child>) {
    std::thread::scope(|s| {
        for child in children {
            s.spawn(move || child.stop());
        }
    });
}

/// The host's memory available to new allocations (`MemAvailable` of `/proc/meminfo`),
/// bytes: where a level-1 sleep's backup goes.
///
/// # Errors
/// `/proc/meminfo` cannot be read or has no `MemAvailable` (or the failpoint
/// `host.mem_available` fires).
pub fn host_available_bytes() -> Result<u64> {
    mesh::failpoint::hit("host.mem_available")?;
    meminfo("MemAvailable")
}

/// A line of `/proc/meminfo`, bytes.
fn meminfo(key: &str) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let prefix = format!("{key}:");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .with_context(|| format!("/proc/meminfo has no {key}"))
}

/// The host's memory (`MemTotal` of `/proc/meminfo`), bytes: what a fraction of
/// `--memory-budget` is a share of.
///
/// # Errors
/// `/proc/meminfo` cannot be read or has no `MemTotal`.
pub fn host_total_bytes() -> Result<u64> {
    meminfo("MemTotal")
}
