//! The model host: `tpctl serve` with several models (`--model NAME=PATH` repeated), each a
//! deployment of its own, behind one OpenAI endpoint that routes by the request's `model`, and
//! swapped by sleep/wakeup under a memory budget.
//!
//! - Each model runs as its own `tpctl serve` ([`child`]): its ranks, its control socket
//!   (deployment `HOST-NAME`, so `tpctl sleep/wakeup/status --deployment HOST-NAME` work on
//!   it), its API on a loopback port. The host forwards requests there ([`proxy`]), an SSE
//!   stream as it comes.
//! - At start the models load one after another; each is measured awake, put to sleep and
//!   measured asleep, so the budget's arithmetic ([`table`]) runs on measured bytes, and a
//!   budget that cannot hold some model is refused at start with the numbers.
//! - A request for a sleeping model wakes it. When the wakeup would exceed the budget, the
//!   least recently used idle models sleep first (sleep, then wake: never both resident
//!   beyond the budget); a model with requests running stops admitting new ones and sleeps
//!   once they finished. Swaps are serialized (one at a time, in the order they were asked).
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
pub mod table;

use anyhow::{bail, Context, Result};
use child::{Child, ChildSpec};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use table::{Entry, Plan, State, Table};

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
    /// The memory budget, bytes.
    pub budget: u64,
    /// How long a request waits for its model.
    pub wait: Duration,
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
}

/// The host's state, shared by the HTTP handlers.
pub struct Host {
    table: Mutex<Table>,
    /// Each model's running deployment (replaced when it is started again).
    children: Vec<RwLock<Arc<Child>>>,
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
    api_key: Option<String>,
    created: u64,
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

    /// Model `index`'s deployment now.
    fn child(&self, index: usize) -> Arc<Child> {
        self.children[index].read().unwrap_or_else(|e| e.into_inner()).clone()
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
            let evict = match plan {
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
                    // Drained, they are idle and admit nothing: they are the ones to sleep
                    // (planning again could pick others and leave these draining).
                    self.drain(&evict, deadline).await?;
                    evict
                }
                Plan::Swap { evict } | Plan::Restart { evict } => evict,
            };
            for victim in evict {
                self.swap_out(victim, index).await?;
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

    /// Stops admitting requests to `models` and waits until their running requests finished.
    async fn drain(&self, models: &[usize], deadline: tokio::time::Instant) -> Result<(), Refusal> {
        {
            let mut table = self.lock();
            for &m in models {
                table.models[m].draining = true;
            }
        }
        loop {
            let busy: Vec<String> = {
                let table = self.lock();
                models
                    .iter()
                    .filter(|&&m| table.models[m].in_flight > 0)
                    .map(|&m| table.models[m].name.clone())
                    .collect()
            };
            if busy.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() + POLL > deadline {
                let mut table = self.lock();
                for &m in models {
                    table.models[m].draining = false;
                }
                return Err(self.timed_out(&format!(
                    "making room: model(s) {} still run requests",
                    busy.join(", ")
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Puts model `victim` to sleep to make room for model `for_model`.
    async fn swap_out(self: &Arc<Self>, victim: usize, for_model: usize) -> Result<(), Refusal> {
        self.set_state(victim, State::Sleeping);
        let host = self.clone();
        let level = self.levels[victim];
        let start = Instant::now();
        let result = blocking(move || host.child(victim).sleep(level).map_err(|e| e.message)).await;
        let counters = &self.counters[victim];
        match result {
            Ok(op) => {
                counters.swaps_out.fetch_add(1, Ordering::Relaxed);
                counters.swap_out_us.fetch_add(micros(start), Ordering::Relaxed);
                let mut table = self.lock();
                let model = &mut table.models[victim];
                model.state = State::Asleep { level };
                model.draining = false;
                model.asleep_bytes = child::resident(&op.ranks, true);
                model.swap_bytes = model.swap_bytes.max(op.bytes);
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
        let result = blocking(move || host.child(index).wakeup().map_err(|e| e.message)).await;
        let counters = &self.counters[index];
        match result {
            Ok(op) => {
                counters.swaps_in.fetch_add(1, Ordering::Relaxed);
                counters.swap_in_us.fetch_add(micros(start), Ordering::Relaxed);
                let mut table = self.lock();
                let model = &mut table.models[index];
                model.state = State::Awake;
                model.swap_bytes = model.swap_bytes.max(op.bytes);
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
            blocking(move || host.child(index).status().map_err(|e| format!("{e:#}"))).await;
        let level = self.levels[index];
        let state = match status {
            Ok(s) if s.state == "running" => State::Awake,
            Ok(s) if s.state == "sleeping" => State::Asleep { level },
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
            host.child(index).stop();
            let verbosity: Vec<&str> = host.verbosity.iter().map(String::as_str).collect();
            let spec = &host.specs[index];
            Child::start(spec, &verbosity, START_TIMEOUT, &host.stop).map_err(|e| format!("{e:#}"))
        })
        .await;
        match result {
            Ok(child) => {
                *self.children[index].write().unwrap_or_else(|e| e.into_inner()) = Arc::new(child);
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
            let child = self.child(i);
            let Some(why) = child.exited() else { continue };
            let mut table = self.lock();
            let current = Arc::ptr_eq(&child, &self.child(i));
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

/// Runs the host: starts and measures every model, serves the API until Ctrl-C or SIGTERM,
/// then stops every model. Returns the exit code.
///
/// # Errors
/// A model does not start, the budget cannot hold the models, or the API cannot serve.
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

    let verbosity: Vec<&str> = spec.verbosity.iter().map(String::as_str).collect();
    let mut children: Vec<Child> = Vec::new();
    let mut entries: Vec<Entry> = Vec::new();
    let started = start_models(&spec, &verbosity, &interrupted, &mut children, &mut entries);
    if let Err(e) = started {
        stop_all(children.iter());
        return Err(e);
    }
    let specs = spec.models.iter().map(|m| child_spec(&spec, m)).collect();
    let table = Table::new(spec.budget, entries);
    let summary: Vec<String> = table
        .models
        .iter()
        .map(|m| {
            format!(
                "{} ({} asleep, {} to wake)",
                m.name,
                crate::control::render::bytes(m.asleep_bytes),
                crate::control::render::bytes(m.swap_bytes)
            )
        })
        .collect();
    let names: Vec<&str> = table.models.iter().map(|m| m.name.as_str()).collect();
    let host = Arc::new(Host {
        counters: children.iter().map(|_| Counters::default()).collect(),
        table: Mutex::new(table.clone()),
        children: children.into_iter().map(|c| RwLock::new(Arc::new(c))).collect(),
        specs,
        verbosity: spec.verbosity.clone(),
        stop: interrupted.clone(),
        swap: tokio::sync::Mutex::new(()),
        levels: spec.models.iter().map(|m| m.sleep_level).collect(),
        wait: spec.wait,
        api_key: spec.api_key.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    if !spec.quiet {
        eprintln!(
            "tpctl: model host {}: memory budget {}; {}",
            spec.deployment,
            crate::control::render::bytes(spec.budget),
            summary.join(", ")
        );
    }
    println!(
        "tpctl serve: {} models ({}) on http://{local} (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics)",
        names.len(),
        names.join(", ")
    );
    let served = http::serve(listener, host.clone(), interrupted);
    let current: Vec<Arc<Child>> = (0..host.children.len()).map(|i| host.child(i)).collect();
    stop_all(current.iter().map(|c| &**c));
    served?;
    if !spec.quiet {
        eprintln!("stopped: every model's ranks are gone");
    }
    Ok(0)
}

/// Starts the models one after another: each loads, is measured awake, sleeps, and is
/// measured asleep; the budget is checked after each.
fn start_models(
    spec: &HostSpec,
    verbosity: &[&str],
    interrupted: &AtomicBool,
    children: &mut Vec<Child>,
    entries: &mut Vec<Entry>,
) -> Result<()> {
    for m in &spec.models {
        if interrupted.load(Ordering::SeqCst) {
            bail!("interrupted while the models started");
        }
        let name = &m.name;
        let child = Child::start(&child_spec(spec, m), verbosity, START_TIMEOUT, interrupted)?;
        children.push(child);
        let child = children.last().expect("just pushed");
        let mut entry = Entry::loading(name, m.pinned);
        if m.pinned {
            // It never sleeps: all it holds counts, awake.
            let status = child.status().with_context(|| format!("model `{name}`: its status"))?;
            entry.state = State::Awake;
            entry.swap_bytes = child::resident(&status.ranks, false);
        } else {
            let op = child.sleep(m.sleep_level).map_err(|e| {
                anyhow::anyhow!("model `{name}`: the first sleep failed: {}", e.message)
            })?;
            entry.state = State::Asleep { level: m.sleep_level };
            entry.asleep_bytes = child::resident(&op.ranks, true);
            entry.swap_bytes = op.bytes;
        }
        entries.push(entry);
        table::check_fits(spec.budget, entries).map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// What starts model `m`'s deployment.
fn child_spec(spec: &HostSpec, m: &ModelSpec) -> ChildSpec {
    ChildSpec {
        name: m.name.clone(),
        model: m.model.clone(),
        deployment: format!("{}-{}", spec.deployment, m.name),
        args: m.args.clone(),
        env: m.env.clone(),
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

/// The host's memory (`MemTotal` of `/proc/meminfo`), bytes: what a fraction of
/// `--memory-budget` is a share of.
///
/// # Errors
/// `/proc/meminfo` cannot be read or has no `MemTotal`.
pub fn host_total_bytes() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .context("/proc/meminfo has no MemTotal")
}
