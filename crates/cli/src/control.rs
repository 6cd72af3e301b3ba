//! The control socket of a deployment: rank 0 serves it ([`Server`]), `tpctl sleep`,
//! `tpctl wakeup`, `tpctl status` and `tpctl stop` are its clients ([`client`]).
//!
//! # Where
//!
//! One Unix socket per deployment, `$XDG_RUNTIME_DIR/tpctl/NAME.sock` (else
//! `/tmp/tpctl-$UID/NAME.sock`), mode 0600 in a directory of mode 0700, so only the user who
//! launched the deployment can put it to sleep ([`paths`]).
//!
//! # Wire protocol
//!
//! A client connects, writes one JSON request on one line, and reads one JSON reply on one
//! line; then the server closes the connection. A request line is at most 64 KiB.
//!
//! ```text
//! -> {"method":"sleep","tags":["kv_cache"],"level":1,"mode":"wait","verify":false}
//! <- {"ok":true,"op":{"op_id":3,"action":"sleep","tags":["kv_cache"],"bytes":2097152,
//!     "elapsed_us":1830,"ranks":[{"rank":0,"tags":[{"tag":"kv_cache","allocations":1,
//!     "bytes":1048576,"copied_bytes":0,"elapsed_us":420}],"before":{"resident":...,
//!     "devices":[[0,...]]},"after":{...},"elapsed_us":510,"asleep":["kv_cache"]},...]}}
//! -> {"method":"wakeup","tags":[]}
//! -> {"method":"status"}
//! <- {"ok":true,"status":{"state":"sleeping","tags":["kv_cache"],"reason":null,
//!     "ranks":[...],"failures":[]}}
//! -> {"method":"stop"}
//! <- {"ok":true,"stopping":true}
//! <- {"ok":false,"error":{"message":"sleep [\"kv_cache\"] (op 4) failed on 1 rank(s), ...",
//!     "failures":[{"rank":1,"phase":"commit","message":"..."}],"outcome":"rolled_back"}}
//! ```
//!
//! Methods ([`Request`]):
//! - `sleep {tags, level, mode, verify}`: releases `tags` on every rank. Empty `tags` means
//!   every tag of a deployment ([`ALL_TAGS`]: `weights`, `kv_cache`, and what the runtime
//!   holds, `cuda_graph`, `workspace` and `nccl`). `level` is vLLM's: 1 keeps the weights'
//!   contents for a fast wakeup (a spill file of the host weights, on a GPU too), 2 discards
//!   them and reloads them from the checkpoint at the wakeup; the KV cache is discarded at
//!   both. A tag with its own `[sleep.TAG] restore` keeps it at every level; no level applies
//!   each tag's configured policy (by default: weights reloaded, KV cache discarded).
//!   `mode` (`wait`, `abort`, `keep`) says what happens to running requests; `verify` fails
//!   (and rolls back) a sleep whose memory probe on some rank did not drop.
//! - `wakeup {tags, model}`: materializes `tags` again; empty `tags` means every tag asleep.
//!   `model`, only while the weights are asleep, names the checkpoint they come back from
//!   (an `update_weights` first, then the wakeup: [`Controller::wakeup`]).
//! - `update_weights {model, mode, weight_version}`: every rank loads its shard of the
//!   checkpoint at `model` (same architecture and shapes) into its weights, asleep or awake
//!   (awake: quiesced per `mode` first), two-phase: a failure anywhere leaves the old weights
//!   everywhere. The weights then have version `weight_version` (else the count of updates),
//!   which every answer carries.
//! - `pause {mode}`: stops generation without releasing memory (vLLM's `/pause`): `abort`
//!   (the default) ends the running requests, `wait` lets them finish, `keep` freezes them
//!   with their KV cache; nothing is admitted until `resume`. Sleeps, wakeups and weight
//!   updates run while paused and leave it paused.
//! - `resume`: generation runs again (asleep: at the wakeup).
//! - `start_weight_update {weight_version}`, `weight_bucket {path}` (any number),
//!   `finish_weight_update {weight_version, mode}`, `abort_weight_update`: an update from
//!   memory ([`staging`]): each bucket is a safetensors file of named tensors (Hugging Face or
//!   GGUF names, the model's shapes, f32/f16/bf16) that rank 0 checks and keeps when it
//!   arrives; the finish lays every bucket over the live weights on every rank in one
//!   two-phase update, as `update_weights` does with a checkpoint.
//! - `status`: the deployment's state, whether it is paused, the weights' version, and each
//!   rank's asleep tags and memory probe.
//! - `stop`: answers, then stops the deployment (as Ctrl-C on the launcher would).
//! - `restart {deployment}`: only a model host's socket serves it (see [`crate::host`]): it
//!   starts its failed model `deployment` again. A deployment's own socket refuses it.
//!
//! A model host (`tpctl serve` with several models) has a socket of its own, named after the
//! host's deployment: `status` answers `host`, its table of models (state, resident bytes,
//! live checkpoint, requests in flight and queued), `restart` starts a failed model again,
//! `stop` stops the host, and the other methods are refused, naming the models' deployments
//! (each model's own socket takes them).
//!
//! Any other method is refused with an error reply naming the methods there are
//! ([`Request::parse`]). A failed operation replies `ok: false` with the aggregate error and
//! every failing rank.
//!
//! Rank 0 makes one [`Controller`] (its coordinator and the deployment's [`Journal`]); the
//! socket and the HTTP API of `tpctl serve` run every operation through a clone of it, so
//! both record into the journal `/metrics` reads.

pub mod client;
pub mod ipc_bucket;
pub mod paths;
pub mod render;
mod server;
pub mod staging;
mod wire;

pub use server::{Handler, Server};
pub use wire::{
    check_version, BucketArgs, ErrorWire, FailureWire, FinishUpdateArgs, HostModelWire, HostWire,
    OpWire, PauseArgs, PausedWire, Reply, Request, RestartArgs, SleepArgs, StagedWire,
    StartUpdateArgs, StatusWire, UpdateArgs, WakeupArgs, MAX_VERSION_CHARS,
};

use session::model_memory::runtime::{is_runtime, CUDA_GRAPH, NCCL, WORKSPACE};
use session::sleep::{Action, Coordinator, DeploymentState, OpOptions, OpReceipt, WeightUpdate};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use vmm::Tag;

/// The tags a sleep without tags releases: the weights, the KV cache, and what the runtime
/// holds on the device besides them (the CUDA graphs of decode steps, the step workspaces,
/// the NCCL communicators: [`session::model_memory::runtime`]; a rank that holds none of
/// them reports each as `none`).
pub const ALL_TAGS: [&str; 5] = ["weights", "kv_cache", CUDA_GRAPH, WORKSPACE, NCCL];

/// The most tags one request may name.
pub const MAX_TAGS: usize = 16;

/// Checks the tags of a request: names of letters, digits, `_` and `-`, each once, at most
/// [`MAX_TAGS`], and each one a tag a deployment has ([`ALL_TAGS`]): a misspelt tag is the
/// caller's mistake (HTTP 400), never a failed operation on the ranks.
///
/// # Errors
/// A message naming the bad tag.
pub fn check_tags(tags: &[String]) -> Result<(), String> {
    if tags.len() > MAX_TAGS {
        return Err(format!("{} tags given; at most {MAX_TAGS} are allowed", tags.len()));
    }
    for (i, t) in tags.iter().enumerate() {
        if t.is_empty()
            || t.len() > 64
            || !t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(format!("`{t}` is not a tag name (letters, digits, _ and -)"));
        }
        if tags[..i].contains(t) {
            return Err(format!("tag `{t}` is given twice"));
        }
        if !ALL_TAGS.contains(&t.as_str()) {
            let (last, first) = ALL_TAGS.split_last().unwrap_or((&"", &[]));
            return Err(format!(
                "unknown tag `{t}`: a deployment's memory is tagged {} and {last}",
                first.join(", ")
            ));
        }
    }
    Ok(())
}

/// The tags an operation runs on: `tags` as given, or when empty, [`ALL_TAGS`] for a sleep
/// and the tags asleep for a wakeup (all of them when the state names none). A wakeup of the
/// last tags of memory asleep wakes what the runtime holds with them (graphs, workspaces,
/// communicators): vLLM's clients wake `weights`, then `kv_cache`, and expect the engine
/// awake after that, as SGLang's name `cuda_graph` with the KV cache.
pub fn expand_tags(action: Action, tags: &[String], state: &DeploymentState) -> Vec<String> {
    if !tags.is_empty() {
        let mut tags = tags.to_vec();
        if let (
            Action::Wakeup,
            DeploymentState::Sleeping(asleep) | DeploymentState::Waking(asleep),
        ) = (action, state)
        {
            let rest: Vec<&String> = asleep.iter().filter(|t| !tags.contains(t)).collect();
            if rest.iter().all(|t| is_runtime(t)) {
                tags.extend(rest.into_iter().cloned());
            }
        }
        return tags;
    }
    match (action, state) {
        (Action::Wakeup, DeploymentState::Sleeping(t) | DeploymentState::Waking(t))
            if !t.is_empty() =>
        {
            t.clone()
        }
        _ => ALL_TAGS.iter().map(|t| (*t).to_owned()).collect(),
    }
}

/// Rank 0's handle on its deployment's sleep, wakeup and weight updates: the coordinator and
/// the journal of what it did. The control socket and the HTTP API hold clones of one handle,
/// so both record into the one journal `/metrics` reads.
#[derive(Clone, Debug)]
pub struct Controller {
    coordinator: Arc<Coordinator>,
    journal: Journal,
    /// The live model's shapes, which a weight update must match.
    live: Option<Arc<checkpoint::LlamaConfig>>,
    /// The checkpoint the deployment started with (live until a weight update).
    started_from: Option<Arc<str>>,
    /// The update from memory being pushed, and the buckets the live weights read.
    staging: staging::Staging,
}

impl Controller {
    /// The handle of `coordinator`'s deployment, with an empty journal.
    pub fn new(coordinator: Arc<Coordinator>) -> Controller {
        Controller {
            coordinator,
            journal: Journal::default(),
            live: None,
            started_from: None,
            staging: staging::Staging::default(),
        }
    }

    /// Names the checkpoint the deployment started with, which updates from memory lay their
    /// buckets over until a weight update replaces it.
    pub fn with_checkpoint(mut self, model: &str) -> Controller {
        self.started_from = Some(Arc::from(model));
        self
    }

    /// The live checkpoint (the latest update's, else the one the deployment started with).
    fn live_checkpoint(&self) -> Option<String> {
        self.coordinator.checkpoint().or_else(|| self.started_from.as_deref().map(str::to_owned))
    }

    /// Checks every weight update against `config` (the live model's) on rank 0 first, so a
    /// checkpoint that cannot be opened or has other shapes is refused as the caller's
    /// mistake, naming what differs, before any rank loads it.
    pub fn with_live_config(mut self, config: checkpoint::LlamaConfig) -> Controller {
        self.live = Some(Arc::new(config));
        self
    }

    /// The deployment's coordinator.
    pub fn coordinator(&self) -> &Arc<Coordinator> {
        &self.coordinator
    }

    /// What the deployment's operations did so far.
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Serves one request (blocking: up to the coordinator's ACK timeouts); `stop`, which only
    /// the caller can carry out, is answered as stopping.
    pub fn execute(&self, request: &Request) -> Reply {
        let answer = |op: Result<OpWire, ErrorWire>| match op {
            Ok(op) => Reply { ok: true, op: Some(op), ..Reply::default() },
            Err(e) => Reply { ok: false, error: Some(e), ..Reply::default() },
        };
        let staged = |s: Result<StagedWire, ErrorWire>| match s {
            Ok(s) => Reply { ok: true, staged: Some(s), ..Reply::default() },
            Err(e) => Reply { ok: false, error: Some(e), ..Reply::default() },
        };
        match request {
            Request::Sleep(args) => answer(self.sleep(args)),
            Request::Wakeup(args) => answer(self.wakeup(args)),
            Request::UpdateWeights(args) => answer(self.update_weights(args)),
            Request::StartWeightUpdate(args) => staged(self.start_weight_update(args)),
            Request::WeightBucket(args) => staged(self.weight_bucket(args)),
            Request::FinishWeightUpdate(args) => answer(self.finish_weight_update(args)),
            Request::AbortWeightUpdate => staged(self.abort_weight_update()),
            Request::Pause(args) => match self.pause(args) {
                Ok(changed) => Reply {
                    ok: true,
                    paused: Some(PausedWire { paused: true, changed }),
                    ..Reply::default()
                },
                Err(e) => Reply { ok: false, error: Some(e), ..Reply::default() },
            },
            Request::Resume => {
                let changed = self.coordinator.resume();
                let paused = Some(PausedWire { paused: false, changed });
                Reply { ok: true, paused, ..Reply::default() }
            }
            Request::Status => match self.coordinator.status() {
                Ok(s) => {
                    let status =
                        StatusWire { checkpoint: self.live_checkpoint(), ..StatusWire::from(&s) };
                    Reply { ok: true, status: Some(status), ..Reply::default() }
                }
                Err(e) => Reply { ok: false, error: Some(ErrorWire::from(&e)), ..Reply::default() },
            },
            Request::Stop => Reply { ok: true, stopping: Some(true), ..Reply::default() },
            Request::Restart(args) => Reply::refused(format!(
                "`restart` starts a failed model of a model host, and this deployment is not a model host: name the model's deployment, `tpctl restart --deployment HOST-NAME` (asked for `{}`)",
                args.deployment
            )),
        }
    }

    /// Releases `args.tags` on every rank (expanded per [`expand_tags`]) and records it.
    ///
    /// # Errors
    /// A bad level or tag ([`ErrorWire::client_error`]), or the operation failed: the
    /// aggregate error with every failing rank.
    pub fn sleep(&self, args: &SleepArgs) -> Result<OpWire, ErrorWire> {
        if let Some(level) = args.level.filter(|l| !(1..=2).contains(l)) {
            return Err(ErrorWire::client(format!(
                "sleep level {level}: only 1 and 2 are supported"
            )));
        }
        let opts = OpOptions { mode: args.mode, verify: args.verify, level: args.level };
        check_tags(&args.tags).map_err(ErrorWire::client)?;
        // A sleep's expansion does not depend on the state.
        let tags = expand_tags(Action::Sleep, &args.tags, &self.coordinator.state());
        record(&self.journal, Action::Sleep, self.coordinator.sleep(&tags, opts))
    }

    /// Wakes `args.tags` on every rank. With `args.model`, only while the weights are asleep
    /// (after a sleep that discarded them, level 2), the checkpoint is first staged on every
    /// rank as a weight update (two-phase, nothing changed on a failure), and the wakeup then
    /// loads it.
    ///
    /// # Errors
    /// `model` while the weights are awake (a client error: that is `update_weights`), or the
    /// update's or the wakeup's error. A wakeup that fails after the update leaves the new
    /// checkpoint staged, still asleep: the next wakeup loads it.
    pub fn wakeup(&self, args: &WakeupArgs) -> Result<OpWire, ErrorWire> {
        let tags = &args.tags;
        check_tags(tags).map_err(ErrorWire::client)?;
        let resolve = |state: &DeploymentState| expand_tags(Action::Wakeup, tags, state);
        let Some(model) = &args.model else {
            let result = self.coordinator.wakeup_resolved(resolve, OpOptions::default());
            return record(&self.journal, Action::Wakeup, result);
        };
        let weights = Tag::WEIGHTS.as_str();
        if !tags.is_empty() && !tags.iter().any(|t| t == weights) {
            return Err(ErrorWire::client(format!(
                "a wakeup that names a checkpoint (model={model}) must wake the weights"
            )));
        }
        // The update and the wakeup are one operation: no other caller runs between them.
        let update = WeightUpdate::from_checkpoint(model.clone());
        match self.coordinator.wakeup_from(&update, resolve, OpOptions::default()) {
            Ok((updated, woken)) => {
                record(&self.journal, Action::Update, Ok(updated))?;
                record(&self.journal, Action::Wakeup, Ok(woken))
            }
            // Refused before anything ran: nothing to record.
            Err(e @ session::sleep::Error::WeightsAwake { .. }) => Err(ErrorWire::from(&e)),
            Err(e) => record(&self.journal, e.action().unwrap_or(Action::Wakeup), Err(e)),
        }
    }

    /// Replaces the weights on every rank with those of the checkpoint at `args.model` (see
    /// [`Coordinator::update_weights`]) and records it.
    ///
    /// # Errors
    /// No checkpoint named (a client error), or the operation's error, on the wire.
    pub fn update_weights(&self, args: &UpdateArgs) -> Result<OpWire, ErrorWire> {
        if args.model.trim().is_empty() {
            return Err(ErrorWire::client("update_weights needs the checkpoint: model=PATH"));
        }
        if let Some(version) = &args.weight_version {
            check_version(version).map_err(ErrorWire::client)?;
        }
        if let Some(live) = &self.live {
            if let Err(e) = check_fits(&args.model, live) {
                self.journal.record_failure(Action::Update);
                return Err(e);
            }
        }
        let opts = OpOptions { mode: args.mode, ..OpOptions::default() };
        let update = WeightUpdate::from_checkpoint(args.model.clone())
            .versioned(args.weight_version.clone());
        let result = self.coordinator.update_weights(&update, opts);
        self.staging.settle(&[], result.is_ok(), &self.coordinator.live_tensors());
        record(&self.journal, Action::Update, result)
    }

    /// Opens an update from memory (see [`staging`]).
    ///
    /// # Errors
    /// An update is open already, or the version is malformed (client errors).
    pub fn start_weight_update(&self, args: &StartUpdateArgs) -> Result<StagedWire, ErrorWire> {
        if let Some(version) = &args.weight_version {
            check_version(version).map_err(ErrorWire::client)?;
        }
        if self.live_checkpoint().is_none() {
            return Err(ErrorWire::client("this deployment cannot take updates from memory"));
        }
        self.staging
            .start(args.weight_version.clone())
            .map_err(|e| ErrorWire::client(e.to_string()))?;
        Ok(StagedWire { open: true, buckets: 0, tensors: 0 })
    }

    /// Checks the bucket (the file at `args.path`, or the tensors behind `args.ipc`'s CUDA IPC
    /// handles, read into a file of this server's) against the live model and keeps it for
    /// the open update.
    ///
    /// # Errors
    /// No update is open, the arguments name no bucket or two, the tensors cannot be read, or
    /// the bucket does not fit the model (client errors naming the file and the tensor).
    pub fn weight_bucket(&self, args: &BucketArgs) -> Result<StagedWire, ErrorWire> {
        self.weight_bucket_with(args, vmm::ipc::read_exported)
    }

    /// [`Controller::weight_bucket`] reading IPC handles with `read`.
    fn weight_bucket_with(
        &self,
        args: &BucketArgs,
        read: impl FnOnce(&[vmm::ipc::ExportedSpan]) -> vmm::Result<Vec<Vec<u8>>>,
    ) -> Result<StagedWire, ErrorWire> {
        if !self.staging.is_open() {
            return Err(ErrorWire::client(staging::StagingError::NotOpen.to_string()));
        }
        let refuse = |why: String| ErrorWire::client(format!("weight_bucket: {why}"));
        match (&args.path, &args.ipc) {
            (Some(path), None) => self.stage_bucket(Path::new(path)),
            (None, Some(ipc)) => {
                let file = staging::scratch_file("ipc.safetensors");
                ipc_bucket::write_bucket(ipc, &file, read).map_err(|e| refuse(e.to_string()))?;
                let staged = self.stage_bucket(&file);
                let _ = std::fs::remove_file(&file);
                staged
            }
            (Some(_), Some(_)) => Err(refuse(
                "give the bucket as a file (`path`) or as CUDA IPC handles, not both".into(),
            )),
            (None, None) => Err(refuse(
                "no bucket: give a safetensors file (`path`) or the tensors' CUDA IPC handles"
                    .into(),
            )),
        }
    }

    /// Checks the bucket at `path` against the live model and keeps it for the open update.
    fn stage_bucket(&self, path: &Path) -> Result<StagedWire, ErrorWire> {
        let model = self.live_checkpoint().unwrap_or_default();
        let refuse = |why: String| ErrorWire::client(format!("weight_bucket: {why}"));
        let ck = checkpoint::Checkpoint::open(&model)
            .map_err(|e| refuse(format!("opening the live checkpoint {model}: {e}")))?;
        let config = ck.config().map_err(|e| refuse(e.to_string()))?;
        let base = ck.weights(&config);
        let bucket =
            checkpoint::Bucket::open(path, &config, &*base).map_err(|e| refuse(e.to_string()))?;
        let tensors = bucket.names().count();
        drop(bucket);
        let buckets = self.staging.add(path).map_err(|e| ErrorWire::client(e.to_string()))?;
        Ok(StagedWire { open: true, buckets, tensors })
    }

    /// Commits the open update on every rank: its buckets laid over the live weights (and
    /// over the buckets of the updates from memory before it), two-phase as
    /// [`Controller::update_weights`].
    ///
    /// # Errors
    /// No update is open or it has no bucket (client errors; the open update stays), or the
    /// operation's error (the update is then closed, the old weights live).
    pub fn finish_weight_update(&self, args: &FinishUpdateArgs) -> Result<OpWire, ErrorWire> {
        if let Some(version) = &args.weight_version {
            check_version(version).map_err(ErrorWire::client)?;
        }
        let (buckets, started_version) =
            self.staging.take().map_err(|e| ErrorWire::client(e.to_string()))?;
        if buckets.is_empty() {
            self.staging.settle(&buckets, false, &[]);
            return Err(ErrorWire::client(
                "finish_weight_update: the update has no bucket (it is closed; start again)",
            ));
        }
        // The live buckets the new ones replace whole are dropped (their kept files go when
        // the update settles), so a trainer pushing every step keeps one step's files.
        let mut files: Vec<std::path::PathBuf> =
            self.coordinator.live_tensors().iter().map(std::path::PathBuf::from).collect();
        files.extend(buckets.iter().cloned());
        let tensors =
            checkpoint::live_buckets(&files).iter().map(|p| p.display().to_string()).collect();
        let update = WeightUpdate {
            model: self.live_checkpoint().unwrap_or_default(),
            tensors,
            version: args.weight_version.clone().or(started_version),
        };
        let opts = OpOptions { mode: args.mode, ..OpOptions::default() };
        let result = self.coordinator.update_weights(&update, opts);
        self.staging.settle(&buckets, result.is_ok(), &self.coordinator.live_tensors());
        record(&self.journal, Action::Update, result)
    }

    /// Drops the open update and its buckets; nothing changed anywhere.
    ///
    /// # Errors
    /// No update is open (a client error).
    pub fn abort_weight_update(&self) -> Result<StagedWire, ErrorWire> {
        let buckets = self.staging.abort().map_err(|e| ErrorWire::client(e.to_string()))?;
        Ok(StagedWire { open: false, buckets, tensors: 0 })
    }

    /// Pauses generation on the deployment (see [`Coordinator::pause`]); whether it was
    /// running.
    ///
    /// # Errors
    /// The engine did not quiesce in time (nothing paused), or the deployment failed.
    pub fn pause(&self, args: &PauseArgs) -> Result<bool, ErrorWire> {
        self.coordinator.pause(args.mode).map_err(|e| ErrorWire::from(&e))
    }
}

/// Whether the checkpoint at `path` can replace weights of the shapes `live`: it opens, every
/// tensor is of a type tpctl reads, and its shapes are the live model's.
///
/// # Errors
/// A client error naming the problem in the model's terms ("the checkpoint has 29 layers;
/// the live model has 30").
fn check_fits(path: &str, live: &checkpoint::LlamaConfig) -> Result<(), ErrorWire> {
    let refuse = |why: String| ErrorWire::client(format!("update_weights: {why}"));
    let ck = checkpoint::Checkpoint::open(path)
        .map_err(|e| refuse(format!("cannot open the checkpoint: {e}")))?;
    ck.check_weights().map_err(|e| refuse(format!("{path}: {e}")))?;
    let new = ck.config().map_err(|e| refuse(format!("{path}: {e}")))?;
    let differences = new.differences(live);
    if !differences.is_empty() {
        return Err(refuse(format!(
            "the checkpoint {path} does not fit the live model: {}",
            differences.join("; ")
        )));
    }
    Ok(())
}

fn record(
    journal: &Journal,
    action: Action,
    result: session::sleep::Result<session::sleep::OpReceipt>,
) -> Result<OpWire, ErrorWire> {
    match result {
        Ok(receipt) => {
            journal.record_op(&receipt);
            Ok(OpWire::from(&receipt))
        }
        Err(e) => {
            journal.record_failure(action);
            Err(ErrorWire::from(&e))
        }
    }
}

/// What the journal keeps: counts of operations and failures, and the latest per-rank
/// numbers of the operations that ran.
#[derive(Debug, Default)]
struct Record {
    ops: BTreeMap<String, u64>,
    failures: BTreeMap<String, u64>,
    released: BTreeMap<(usize, String), u64>,
    restored: BTreeMap<(usize, String), u64>,
    resident: BTreeMap<usize, u64>,
    device: BTreeMap<(usize, u32), u64>,
}

/// The sleep/wakeup operations of one deployment, as `/metrics` shows them. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Journal(Arc<Mutex<Record>>);

/// What a [`Journal`] holds, read at once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JournalSnapshot {
    /// Operations that succeeded, by action (`sleep`, `wakeup`).
    pub ops: BTreeMap<String, u64>,
    /// Operations that failed, by action.
    pub failures: BTreeMap<String, u64>,
    /// Per (rank, tag): the bytes the latest sleep that moved the tag released.
    pub released: BTreeMap<(usize, String), u64>,
    /// Per (rank, tag): the bytes the latest wakeup that moved the tag restored.
    pub restored: BTreeMap<(usize, String), u64>,
    /// Per rank: resident host bytes after the latest operation.
    pub resident: BTreeMap<usize, u64>,
    /// Per (rank, device index): the process's device bytes after the latest operation.
    pub device: BTreeMap<(usize, u32), u64>,
}

impl Journal {
    fn lock(&self) -> MutexGuard<'_, Record> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a successful operation. One that had nothing to do (op id 0) only counts.
    pub fn record_op(&self, receipt: &OpReceipt) {
        let mut r = self.lock();
        *r.ops.entry(receipt.action.to_string()).or_default() += 1;
        if receipt.op_id == 0 {
            return;
        }
        for rank in &receipt.ranks {
            let mut moved = match receipt.action {
                Action::Sleep => Some(&mut r.released),
                Action::Wakeup => Some(&mut r.restored),
                Action::Update | Action::Revert => None,
            };
            // Only tags the operation moved: a tag already asleep (or awake) keeps its figure.
            for t in rank.tags.iter().filter(|t| t.allocations > 0 || t.bytes > 0) {
                if let Some(moved) = moved.as_deref_mut() {
                    moved.insert((rank.rank, t.tag.clone()), t.bytes);
                }
            }
            r.resident.insert(rank.rank, rank.after.resident);
            for &(index, bytes) in &rank.after.devices {
                r.device.insert((rank.rank, index), bytes);
            }
        }
    }

    /// Records a failed operation.
    pub fn record_failure(&self, action: Action) {
        *self.lock().failures.entry(action.to_string()).or_default() += 1;
    }

    /// Everything recorded so far.
    pub fn snapshot(&self) -> JournalSnapshot {
        let r = self.lock();
        JournalSnapshot {
            ops: r.ops.clone(),
            failures: r.failures.clone(),
            released: r.released.clone(),
            restored: r.restored.clone(),
            resident: r.resident.clone(),
            device: r.device.clone(),
        }
    }
}

#[cfg(test)]
mod tests;
