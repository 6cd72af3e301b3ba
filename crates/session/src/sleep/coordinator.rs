//! Rank 0's side: the [`Coordinator`] runs sleep and wakeup as a two-phase commit over the
//! control channel, with rollback, per-rank receipts and the deployment's state.

use super::error::{Error, Outcome, RankFailure, Result};
use super::lock::{Held, LocalLock, OpLock};
use super::memory::{execute, RankMemory, Refusal};
use super::message::{Action, Message, Phase, Probe, RankReceipt, Status, TagReceipt};
use super::quiesce::{Quiesce, QuiesceMode};
use super::transport::{CoordinatorLink, Incoming};
use super::version::{WeightUpdate, WeightVersion};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The fraction of its tagged bytes every rank must give back for a verified sleep.
pub const VERIFY_FRACTION: f64 = 0.9;

/// Bytes a probe may move on its own between two readings (other threads' allocations, the
/// CUDA driver's host bookkeeping: 130-150 KiB seen on an H200 rank): a verified sleep needs a
/// drop of [`VERIFY_FRACTION`] of the released bytes less this much, so a rank that released a
/// few kilobytes is not called leaking because its resident memory grew by a page or two.
pub const VERIFY_SLACK: u64 = 1 << 20;

/// The state of a deployment, as [`Coordinator::state`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeploymentState {
    /// Every tag is materialized; the engine runs.
    Running,
    /// These tags are released on every rank.
    Sleeping(Vec<String>),
    /// A wakeup of these tags is in progress.
    Waking(Vec<String>),
    /// The deployment failed (a rank was lost, or a rollback failed); nothing more runs.
    Failed(String),
}

/// Options of one sleep or wakeup call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpOptions {
    /// How to quiesce the engine (sleep).
    pub mode: QuiesceMode,
    /// Fail (and roll back) a sleep when any rank's memory probe dropped by less than
    /// [`VERIFY_FRACTION`] of the bytes it released.
    pub verify: bool,
    /// vLLM's sleep level (1 or 2; see [`RankMemory::release_at`]); `None` applies each
    /// tag's configured restore policy.
    pub level: Option<u8>,
}

/// Options of a [`Coordinator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoordinatorOptions {
    /// How long rank 0 waits for the ACKs of one phase (from all peers together).
    pub ack_timeout: Duration,
}

impl Default for CoordinatorOptions {
    fn default() -> Self {
        CoordinatorOptions { ack_timeout: Duration::from_secs(60) }
    }
}

/// What a successful sleep or wakeup did, per rank and per tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpReceipt {
    /// The operation's id (0 when nothing had to run).
    pub op_id: u64,
    /// The operation.
    pub action: Action,
    /// The tags asked for.
    pub tags: Vec<String>,
    /// One receipt per rank, in rank order.
    pub ranks: Vec<RankReceipt>,
    /// Wall time of the whole call, lock and quiesce included.
    pub elapsed: Duration,
    /// A weight update's: the version the weights took.
    pub weight_version: Option<String>,
}

impl OpReceipt {
    /// Bytes released or restored over every rank and tag.
    pub fn bytes(&self) -> u64 {
        self.ranks.iter().map(RankReceipt::bytes).sum()
    }
}

/// One answer of a [`Coordinator::status`] fan-out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeploymentStatus {
    /// The deployment's state.
    pub state: DeploymentState,
    /// Each rank's asleep tags and memory probe, in rank order (ranks that did not answer are
    /// missing).
    pub ranks: Vec<RankReceipt>,
    /// Ranks that did not answer, with why.
    pub failures: Vec<RankFailure>,
    /// The sleep or wakeup running when the status was asked (`"sleep [\"kv_cache\"]"`):
    /// the control channel is its, so only rank 0 answered, from what it knows.
    pub in_progress: Option<String>,
    /// Whether generation is paused ([`Coordinator::pause`]).
    pub paused: bool,
    /// The live weights' version.
    pub weight_version: String,
}

struct Inner {
    state: DeploymentState,
    asleep: BTreeSet<String>,
    next_op: u64,
    /// Whether rank 0's engine is quiesced.
    paused: bool,
    /// Whether a caller paused generation ([`Coordinator::pause`]): the engine stays quiesced
    /// after the operations that end while it holds, until [`Coordinator::resume`].
    held: bool,
    /// Weight updates committed so far (the default version of the next is one more).
    updates: u64,
    /// Peers whose connection closed.
    lost: BTreeSet<usize>,
    /// The operation that holds the sleep/wakeup lock, if any.
    running: Option<String>,
    /// The checkpoint the latest weight update loaded (`None`: the one the deployment
    /// started with).
    checkpoint: Option<String>,
    /// The tensors laid over it by the latest weight update (from memory).
    tensors: Vec<String>,
}

impl Inner {
    /// The next operation id: every message fanned out (an operation, a status, the shutdown)
    /// has its own, so an ACK answers only the request it was sent for.
    fn take_op_id(&mut self) -> u64 {
        let id = self.next_op;
        self.next_op += 1;
        id
    }

    /// The state an operation that ended without changing memory (or was undone) leaves: failed
    /// when a peer is lost, else sleeping while anything is asleep, else running.
    fn settle(&mut self) {
        self.state = if let Some(r) = self.lost.iter().next() {
            DeploymentState::Failed(format!("rank {r} is lost"))
        } else if self.asleep.is_empty() {
            DeploymentState::Running
        } else {
            DeploymentState::Sleeping(self.asleep.iter().cloned().collect())
        };
    }
}

/// Rank 0's coordinator of sleep and wakeup. `Sync`: callers on several threads are
/// serialized by the sleep/wakeup lock.
pub struct Coordinator {
    link: Box<dyn CoordinatorLink + Sync>,
    memory: Arc<dyn RankMemory>,
    engine: Arc<dyn Quiesce>,
    opts: CoordinatorOptions,
    op_lock: Arc<dyn OpLock>,
    inner: Mutex<Inner>,
    version: WeightVersion,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("peers", &self.link.peers()).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The answers of one drained phase.
struct Drained {
    /// Every matching ACK, by rank.
    acks: BTreeMap<usize, Message>,
    /// Ranks that answered nothing (deadline) or whose connection closed.
    silent: Vec<RankFailure>,
}

impl Drained {
    /// Failures: ACKs with a failure status, then the silent ranks.
    fn failures(&self) -> Vec<RankFailure> {
        let mut v: Vec<RankFailure> = self
            .acks
            .iter()
            .filter(|(_, m)| m.status != Status::Ok)
            .map(|(&rank, m)| RankFailure {
                rank,
                phase: m.phase,
                message: m.error.clone().unwrap_or_else(|| format!("{:?}", m.status)),
            })
            .collect();
        v.extend(self.silent.iter().cloned());
        v
    }
}

impl Coordinator {
    /// A coordinator over `link` (the control channel's rank 0 end), this rank's `memory` and
    /// `engine`. With no peers it is the single-rank path: same lock, same receipts.
    pub fn new(
        link: impl CoordinatorLink + Sync + 'static,
        memory: Arc<dyn RankMemory>,
        engine: Arc<dyn Quiesce>,
        opts: CoordinatorOptions,
    ) -> Coordinator {
        Coordinator {
            link: Box::new(link),
            memory,
            engine,
            opts,
            op_lock: Arc::new(LocalLock::default()),
            inner: Mutex::new(Inner {
                state: DeploymentState::Running,
                asleep: BTreeSet::new(),
                next_op: 1,
                paused: false,
                held: false,
                updates: 0,
                lost: BTreeSet::new(),
                running: None,
                checkpoint: None,
                tensors: Vec::new(),
            }),
            version: WeightVersion::default(),
        }
    }

    /// This coordinator with `lock` as its sleep/wakeup lock instead of a [`LocalLock`] (see
    /// [`super::lock`]).
    #[must_use]
    pub fn with_lock(mut self, lock: Arc<dyn OpLock>) -> Coordinator {
        self.op_lock = lock;
        self
    }

    /// The number of ranks, rank 0 included.
    pub fn world(&self) -> usize {
        self.link.peers().len() + 1
    }

    /// The deployment's state (no communication).
    pub fn state(&self) -> DeploymentState {
        lock(&self.inner).state.clone()
    }

    /// Releases `tags` on every rank. Tags already asleep give a zero receipt.
    ///
    /// # Errors
    /// [`Error::Failed`] listing every failing rank, with the [`Outcome`]: aborted with
    /// nothing changed, every changed rank rolled back, or fail-stop when a rollback failed;
    /// [`Error::Verify`] (rolled back) when `opts.verify` and a rank fell short;
    /// [`Error::Quiesce`] when rank 0's engine cannot be quiesced;
    /// [`Error::DeploymentFailed`] when the deployment failed earlier.
    pub fn sleep(&self, tags: &[String], opts: OpOptions) -> Result<OpReceipt> {
        self.run(Action::Sleep, tags, opts, None)
    }

    /// Materializes `tags` again on every rank and resumes the engine once nothing is asleep.
    /// Tags already awake give a zero receipt.
    ///
    /// # Errors
    /// As [`Coordinator::sleep`], without verification.
    pub fn wakeup(&self, tags: &[String], opts: OpOptions) -> Result<OpReceipt> {
        self.run(Action::Wakeup, tags, opts, None)
    }

    /// A wakeup of the tags `resolve` picks from the deployment's state once the operation
    /// holds the sleep/wakeup lock (a wakeup that names no tag wakes every tag asleep then,
    /// not those asleep when it was asked, which a sleep running meanwhile may have changed).
    ///
    /// # Errors
    /// As [`Coordinator::wakeup`].
    pub fn wakeup_resolved(
        &self,
        resolve: impl FnOnce(&DeploymentState) -> Vec<String>,
        opts: OpOptions,
    ) -> Result<OpReceipt> {
        let _guard = Held::acquire(&*self.op_lock);
        let tags = resolve(&self.state());
        self.run_held(Action::Wakeup, &tags, opts, None)
    }

    /// Wakes the weights from the checkpoint at `model` in one operation under one hold of the
    /// sleep/wakeup lock: the weights must be asleep, the checkpoint is staged on every rank
    /// as a weight update (two-phase), then the tags `resolve` picks are woken, so no other
    /// caller's operation runs between the two. Returns the update's receipt and the
    /// wakeup's.
    ///
    /// # Errors
    /// [`Error::WeightsAwake`] when the weights are not asleep (nothing runs), else the
    /// update's or the wakeup's error; a wakeup that fails after the update leaves the new
    /// checkpoint staged, still asleep, for the next wakeup.
    pub fn wakeup_from(
        &self,
        update: &WeightUpdate,
        resolve: impl FnOnce(&DeploymentState) -> Vec<String>,
        opts: OpOptions,
    ) -> Result<(OpReceipt, OpReceipt)> {
        let _guard = Held::acquire(&*self.op_lock);
        let weights = vmm::Tag::WEIGHTS.as_str();
        let state = self.state();
        let asleep = match &state {
            DeploymentState::Sleeping(t) | DeploymentState::Waking(t) => t.as_slice(),
            _ => &[],
        };
        if !asleep.iter().any(|t| t == weights) {
            return Err(Error::WeightsAwake { model: update.model.clone() });
        }
        let quiesce = OpOptions { mode: QuiesceMode::default(), ..OpOptions::default() };
        let updated =
            self.run_held(Action::Update, &[weights.to_owned()], quiesce, Some(update))?;
        let tags = resolve(&self.state());
        let woken = self.run_held(Action::Wakeup, &tags, opts, None)?;
        Ok((updated, woken))
    }

    /// Replaces the weights on every rank with those of the checkpoint `update.model` (a GGUF
    /// file or a Hugging Face folder of the same architecture and shapes), asleep or awake
    /// (awake: the engine quiesces per `opts.mode` first, and paused requests are computed
    /// again with the new weights). Two-phase like a sleep: every rank loads and checks its
    /// shard before any rank changes, and a failure puts the old weights back everywhere.
    /// Asleep, the new checkpoint is what the wakeup reloads. Once it committed, the weights'
    /// version ([`Coordinator::weight_version`]) is `update.version`, or the count of updates.
    ///
    /// # Errors
    /// As [`Coordinator::sleep`]; a checkpoint that does not fit fails in PREPARE on every
    /// rank, with nothing changed.
    pub fn update_weights(&self, update: &WeightUpdate, opts: OpOptions) -> Result<OpReceipt> {
        let tags = [vmm::Tag::WEIGHTS.as_str().to_owned()];
        self.run(Action::Update, &tags, opts, Some(update))
    }

    /// The live weights' version, as a cell that follows every update (for the output sink
    /// that stamps tokens with it).
    pub fn weight_version(&self) -> WeightVersion {
        self.version.clone()
    }

    /// Pauses generation (vLLM's `/pause`): the engine quiesces per `mode` (`wait` lets the
    /// running requests finish, `abort` ends them, `keep` freezes them with their KV cache)
    /// and admits nothing until [`Coordinator::resume`]; memory stays. Sleeps, wakeups and
    /// weight updates run while paused and leave it paused. Returns whether it was running
    /// (a second pause changes nothing).
    ///
    /// # Errors
    /// [`Error::Quiesce`] when the engine does not reach a step boundary in time (nothing
    /// paused); [`Error::DeploymentFailed`].
    pub fn pause(&self, mode: QuiesceMode) -> Result<bool> {
        let _guard = Held::acquire(&*self.op_lock);
        let quiesce = {
            let inner = lock(&self.inner);
            if let DeploymentState::Failed(reason) = &inner.state {
                let action = "pause".to_owned();
                return Err(Error::DeploymentFailed { action, reason: reason.clone() });
            }
            if inner.held {
                return Ok(false);
            }
            !inner.paused
        };
        // Only operations change `paused`, and they hold the sleep/wakeup lock.
        if quiesce {
            self.engine.quiesce(mode).map_err(|source| Error::Pause { source })?;
        }
        let mut inner = lock(&self.inner);
        inner.paused = true;
        inner.held = true;
        tracing::info!(?mode, "generation paused");
        Ok(true)
    }

    /// Resumes generation after [`Coordinator::pause`] (asleep, the engine runs again at the
    /// wakeup). Returns whether it was paused.
    pub fn resume(&self) -> bool {
        let _guard = Held::acquire(&*self.op_lock);
        let mut inner = lock(&self.inner);
        let was = std::mem::replace(&mut inner.held, false);
        if inner.paused && inner.asleep.is_empty() {
            self.engine.resume();
            inner.paused = false;
        }
        if was {
            tracing::info!("generation resumed");
        }
        was
    }

    /// Whether generation is paused ([`Coordinator::pause`]).
    pub fn is_paused(&self) -> bool {
        lock(&self.inner).held
    }

    /// The checkpoint the latest weight update loaded; `None` while the deployment runs the
    /// one it started with.
    pub fn checkpoint(&self) -> Option<String> {
        lock(&self.inner).checkpoint.clone()
    }

    /// The safetensors files the latest weight update laid over its checkpoint (empty for a
    /// checkpoint alone): an update from memory that changes a few tensors keeps these under
    /// its own.
    pub fn live_tensors(&self) -> Vec<String> {
        lock(&self.inner).tensors.clone()
    }

    /// Asks every rank for its asleep tags and memory probe (bounded by the ACK timeout).
    /// While a sleep or wakeup runs (its quiesce may take minutes) it does not wait: rank 0
    /// answers alone and [`DeploymentStatus::in_progress`] names the operation.
    ///
    /// # Errors
    /// None today: ranks that do not answer are listed in [`DeploymentStatus::failures`].
    pub fn status(&self) -> Result<DeploymentStatus> {
        let guard = Held::try_acquire(&*self.op_lock);
        let (state, asleep, running, paused) = {
            let inner = lock(&self.inner);
            let asleep = inner.asleep.iter().cloned().collect::<Vec<_>>();
            (inner.state.clone(), asleep, inner.running.clone(), inner.held)
        };
        let weight_version = self.version.get().to_string();
        let probe = self.memory.probe();
        let mut ranks = vec![RankReceipt {
            rank: 0,
            before: probe.clone(),
            after: probe,
            asleep,
            ..RankReceipt::default()
        }];
        if guard.is_none() {
            let in_progress = running.or_else(|| Some("an operation".into()));
            let failures = Vec::new();
            return Ok(DeploymentStatus {
                state,
                ranks,
                failures,
                in_progress,
                paused,
                weight_version,
            });
        }
        // Its own op id, so a late answer to an earlier status is not taken for this one's.
        let op_id = self.take_op_id();
        let msg = Message::request(op_id, Phase::Status, None, &[]);
        let (sent, mut failures) = self.fan_out(&msg, &self.live_peers(), false);
        let drained = self.drain(op_id, Phase::Status, &sent);
        failures.extend(drained.failures());
        ranks.extend(drained.acks.into_values().filter_map(|m| m.receipt));
        failures.sort_by_key(|f| f.rank);
        Ok(DeploymentStatus { state, ranks, failures, in_progress: None, paused, weight_version })
    }

    /// Sends the shutdown sentinel to every listener and drains their ACKs (bounded by the
    /// ACK timeout).
    ///
    /// # Errors
    /// [`Error::Channel`] naming every peer that did not acknowledge.
    pub fn shutdown(&self) -> Result<()> {
        let _guard = Held::acquire(&*self.op_lock);
        let op_id = self.take_op_id();
        let msg = Message::request(op_id, Phase::Shutdown, None, &[]);
        let (sent, mut failures) = self.fan_out(&msg, &self.live_peers(), false);
        failures.extend(self.drain(op_id, Phase::Shutdown, &sent).failures());
        if failures.is_empty() {
            Ok(())
        } else {
            failures.sort_by_key(|f| f.rank);
            let list: Vec<String> = failures.iter().map(ToString::to_string).collect();
            Err(Error::Channel { rank: 0, detail: format!("shutdown: {}", list.join("; ")) })
        }
    }

    /// The next operation id (see [`Inner::take_op_id`]).
    fn take_op_id(&self) -> u64 {
        lock(&self.inner).take_op_id()
    }

    fn live_peers(&self) -> Vec<usize> {
        let lost = lock(&self.inner).lost.clone();
        self.link.peers().into_iter().filter(|r| !lost.contains(r)).collect()
    }

    /// Sends `msg` to `ranks` in turn, every frame before any answer is awaited (so the
    /// round trips overlap). With `stop_on_failure`, the first failed send ends the fan-out.
    /// Returns the ranks reached and the failures.
    fn fan_out(
        &self,
        msg: &Message,
        ranks: &[usize],
        stop_on_failure: bool,
    ) -> (Vec<usize>, Vec<RankFailure>) {
        let mut sent = Vec::with_capacity(ranks.len());
        let mut failures = Vec::new();
        let lost = lock(&self.inner).lost.clone();
        for &rank in ranks {
            if lost.contains(&rank) {
                // Its connection closed earlier: nothing to send, nothing to wait for.
                failures.push(RankFailure {
                    rank,
                    phase: msg.phase,
                    message: format!("rank {rank} is lost (its control connection closed)"),
                });
                if stop_on_failure {
                    break;
                }
                continue;
            }
            match self.link.send(rank, msg) {
                Ok(()) => sent.push(rank),
                Err(e) => {
                    failures.push(RankFailure { rank, phase: msg.phase, message: e.to_string() });
                    if stop_on_failure {
                        break;
                    }
                }
            }
        }
        (sent, failures)
    }

    /// Collects the ACKs of `phase` for `op_id` from `from`, until all answered or the ACK
    /// timeout passed. Frames of another operation or phase are dropped, never kept for later.
    fn drain(&self, op_id: u64, phase: Phase, from: &[usize]) -> Drained {
        let deadline = Instant::now() + self.opts.ack_timeout;
        let mut waiting: BTreeSet<usize> = from.iter().copied().collect();
        let mut acks = BTreeMap::new();
        let mut silent = Vec::new();
        while !waiting.is_empty() {
            match self.link.recv(deadline) {
                None => break,
                Some(Incoming::Frame { rank, msg }) => {
                    if msg.answers(op_id, phase) && waiting.remove(&rank) {
                        acks.insert(rank, *msg);
                    } else {
                        tracing::warn!(
                            rank, op_id = msg.op_id, phase = %msg.phase, expected_op = op_id,
                            expected_phase = %phase, "dropped a stale or unexpected control frame"
                        );
                    }
                }
                Some(Incoming::Closed { rank, reason }) => {
                    lock(&self.inner).lost.insert(rank);
                    if waiting.remove(&rank) {
                        silent.push(RankFailure {
                            rank,
                            phase,
                            message: format!("rank {rank} is lost: {reason}"),
                        });
                    }
                }
            }
        }
        let secs = self.opts.ack_timeout.as_secs_f64();
        silent.extend(waiting.into_iter().map(|rank| RankFailure {
            rank,
            phase,
            message: format!("no {phase} ack from rank {rank} within {secs:.1} s"),
        }));
        Drained { acks, silent }
    }

    /// ABORT to `ranks` and drain their ACKs; failures other than of already failed ranks are
    /// added to `failures`.
    fn abort(&self, op_id: u64, ranks: &[usize], failures: &mut Vec<RankFailure>) {
        if ranks.is_empty() {
            return;
        }
        let msg = Message::request(op_id, Phase::Abort, None, &[]);
        let (sent, mut more) = self.fan_out(&msg, ranks, false);
        more.extend(self.drain(op_id, Phase::Abort, &sent).failures());
        for f in more {
            if !failures.iter().any(|g| g.rank == f.rank) {
                failures.push(f);
            }
        }
    }

    fn fail(
        &self,
        action: Action,
        tags: &[String],
        op_id: u64,
        mut failures: Vec<RankFailure>,
        outcome: Outcome,
    ) -> Error {
        failures.sort_by_key(|f| (f.rank, f.phase as u8));
        Error::Failed { action, tags: tags.to_vec(), op_id, failures, outcome }
    }

    /// Ends an operation that changed no memory: resume the engine when this call paused it,
    /// restore the state, record lost peers.
    fn end_unchanged(&self, paused_here: bool) {
        let mut inner = lock(&self.inner);
        if paused_here && inner.asleep.is_empty() && !inner.held {
            self.engine.resume();
            inner.paused = false;
        }
        inner.settle();
    }

    /// Stops every listener after a failed rollback and marks the deployment failed.
    fn fail_stop(&self, op_id: u64, why: &str) {
        let msg = Message::request(op_id, Phase::FailStop, None, &[]);
        let (sent, _) = self.fan_out(&msg, &self.live_peers(), false);
        let _ = self.drain(op_id, Phase::FailStop, &sent);
        lock(&self.inner).state =
            DeploymentState::Failed(format!("fail-stop in op {op_id}: {why}"));
    }

    fn run(
        &self,
        action: Action,
        tags: &[String],
        opts: OpOptions,
        update: Option<&WeightUpdate>,
    ) -> Result<OpReceipt> {
        let _guard = Held::acquire(&*self.op_lock);
        self.run_held(action, tags, opts, update)
    }

    /// [`Coordinator::run`] with the sleep/wakeup lock already held by the caller.
    fn run_held(
        &self,
        action: Action,
        tags: &[String],
        opts: OpOptions,
        update: Option<&WeightUpdate>,
    ) -> Result<OpReceipt> {
        let start = Instant::now();
        lock(&self.inner).running = Some(match update {
            Some(u) => format!("{action} {}", u.model),
            None => format!("{action} {tags:?}"),
        });
        let result = self.run_locked(action, tags, opts, update, start);
        lock(&self.inner).running = None;
        result
    }

    /// [`Coordinator::run`] under the sleep/wakeup lock. The state lock is only ever held
    /// for moments (never across the engine's quiesce or a phase's ACKs), so the state,
    /// status and metrics answer while an operation runs.
    fn run_locked(
        &self,
        action: Action,
        tags: &[String],
        opts: OpOptions,
        update: Option<&WeightUpdate>,
        start: Instant,
    ) -> Result<OpReceipt> {
        let model = update.map(|u| u.model.as_str());
        let (op_id, pause) = {
            let mut inner = lock(&self.inner);
            if let DeploymentState::Failed(reason) = &inner.state {
                return Err(Error::DeploymentFailed {
                    action: format!("{action} {tags:?}"),
                    reason: reason.clone(),
                });
            }
            let done = match action {
                Action::Sleep => tags.iter().all(|t| inner.asleep.contains(t)),
                Action::Wakeup => tags.iter().all(|t| !inner.asleep.contains(t)),
                Action::Update | Action::Revert => false,
            };
            if done {
                let asleep: Vec<String> = inner.asleep.iter().cloned().collect();
                return Ok(self.zero_receipt(action, tags, asleep, start));
            }
            (inner.take_op_id(), !inner.paused)
        };
        // Only operations change `paused`, and they hold the sleep/wakeup lock.
        if pause {
            self.engine.quiesce(opts.mode).map_err(|source| Error::Quiesce {
                action,
                rank: 0,
                source,
            })?;
        }
        let paused_here = pause;
        {
            let mut inner = lock(&self.inner);
            inner.paused = true;
            if action == Action::Wakeup {
                inner.state = DeploymentState::Waking(tags.to_vec());
            }
        }
        tracing::info!(op_id, %action, ?tags, "sleep/wakeup started");

        // Phase 1: PREPARE everywhere; nothing changes memory.
        let peers = self.live_peers();
        let mut prepare = Message::request(op_id, Phase::Prepare, Some(action), tags);
        prepare.mode = opts.mode;
        prepare.level = opts.level;
        prepare.model = model.map(str::to_owned);
        prepare.tensors = update.map(|u| u.tensors.clone()).unwrap_or_default();
        let (prepared, mut failures) = self.fan_out(&prepare, &peers, true);
        let checked = match (action, update) {
            (Action::Update, Some(update)) => self.memory.prepare_update_with(update),
            (Action::Update, None) => Err(Refusal::NoCheckpoint),
            _ => self.memory.check(tags),
        };
        if let Err(e) = checked {
            failures.push(RankFailure { rank: 0, phase: Phase::Prepare, message: e.to_string() });
        }
        if let Err(e) = mesh::failpoint::hit("sleep.prepare") {
            failures.push(RankFailure { rank: 0, phase: Phase::Prepare, message: e.to_string() });
        }
        // Drained even after a local or send failure, so every failing rank is reported and
        // no PREPARE ACK is left to be mistaken for a later answer.
        failures.extend(self.drain(op_id, Phase::Prepare, &prepared).failures());
        if !failures.is_empty() {
            if action == Action::Update {
                self.memory.drop_update();
            }
            self.abort(op_id, &prepared, &mut failures);
            self.end_unchanged(paused_here);
            return Err(self.fail(action, tags, op_id, failures, Outcome::Aborted));
        }

        // Phase 2: the local operation, then COMMIT to the prepared peers.
        let local = match mesh::failpoint::hit("sleep.commit") {
            Err(e) => Err((Status::Failed, e.to_string())),
            Ok(()) => execute(0, &*self.memory, action, tags, opts.level),
        };
        let local = match local {
            Ok(r) => {
                match action {
                    Action::Sleep => self.engine.released(tags),
                    Action::Update => self.engine.weights_changed(),
                    Action::Wakeup | Action::Revert => {}
                }
                r
            }
            Err((status, message)) => {
                failures.push(RankFailure { rank: 0, phase: Phase::Commit, message });
                self.abort(op_id, &prepared, &mut failures);
                if status == Status::Fatal {
                    self.fail_stop(op_id, "rank 0 could not undo its partial operation");
                    return Err(self.fail(action, tags, op_id, failures, Outcome::FailStop));
                }
                self.end_unchanged(paused_here);
                return Err(self.fail(action, tags, op_id, failures, Outcome::Aborted));
            }
        };
        let commit = Message::request(op_id, Phase::Commit, Some(action), tags);
        let (committed, send_failures) = self.fan_out(&commit, &prepared, true);
        let uncommitted: Vec<usize> = prepared[committed.len()..].to_vec();
        failures.extend(send_failures);
        let drained = self.drain(op_id, Phase::Commit, &committed);
        failures.extend(drained.failures());
        // Ranks not committed still hold a prepared request: ABORT releases it.
        self.abort(op_id, &uncommitted, &mut failures);

        let mut receipts = vec![local];
        receipts.extend(drained.acks.values().filter_map(|m| m.receipt.clone()));
        if failures.is_empty() && opts.verify && action == Action::Sleep {
            let short = Self::verify(&receipts);
            if !short.is_empty() {
                let (outcome, short) = self.roll_back(op_id, action, tags, &drained, short);
                return Err(Error::Verify {
                    action,
                    tags: tags.to_vec(),
                    op_id,
                    failures: short,
                    outcome,
                });
            }
        }
        if !failures.is_empty() {
            let (outcome, failures) = self.roll_back(op_id, action, tags, &drained, failures);
            return Err(self.fail(action, tags, op_id, failures, outcome));
        }

        // Success everywhere, recorded before the sleep/wakeup lock is given back, so the
        // next operation (and `/v1/models`) sees this one's result.
        let mut inner = lock(&self.inner);
        let mut weight_version = None;
        if let (Action::Update, Some(update)) = (action, update) {
            inner.checkpoint = Some(update.model.clone());
            inner.tensors.clone_from(&update.tensors);
            inner.updates += 1;
            // Set before the engine resumes: its next token is the new weights'.
            let version = update.version.clone().unwrap_or_else(|| inner.updates.to_string());
            self.version.set(&version);
            weight_version = Some(version);
        }
        for t in tags {
            match action {
                Action::Sleep => inner.asleep.insert(t.clone()),
                Action::Wakeup => inner.asleep.remove(t),
                Action::Update | Action::Revert => false,
            };
        }
        let asleep: Vec<String> = inner.asleep.iter().cloned().collect();
        receipts[0].asleep = asleep.clone();
        if asleep.is_empty() {
            if inner.paused && !inner.held {
                self.engine.resume();
                inner.paused = false;
            }
            inner.state = DeploymentState::Running;
        } else {
            inner.state = DeploymentState::Sleeping(asleep);
        }
        drop(inner);
        receipts.sort_by_key(|r| r.rank);
        tracing::info!(op_id, %action, ?tags, elapsed = ?start.elapsed(), "sleep/wakeup done");
        Ok(OpReceipt {
            op_id,
            action,
            tags: tags.to_vec(),
            ranks: receipts,
            elapsed: start.elapsed(),
            weight_version,
        })
    }

    /// The ranks whose memory did not drop by [`VERIFY_FRACTION`] of what they released
    /// (see `sleep::verify`: per rank, and per device for device-wide readings).
    pub(super) fn verify(receipts: &[RankReceipt]) -> Vec<RankFailure> {
        super::verify::verify(receipts)
    }

    /// Rolls back rank 0 and every peer that committed (or may have), then sets the state.
    /// Returns [`Outcome::RolledBack`], or [`Outcome::FailStop`] when any rollback failed or a
    /// committed peer's state is unknown, with `failures` plus those of the rollback.
    fn roll_back(
        &self,
        op_id: u64,
        action: Action,
        tags: &[String],
        drained: &Drained,
        mut failures: Vec<RankFailure>,
    ) -> (Outcome, Vec<RankFailure>) {
        let lost = lock(&self.inner).lost.clone();
        let mut fatal = drained.acks.values().any(|m| m.status == Status::Fatal);
        // Committed peers that answered OK, and those that did not answer but are alive (their
        // COMMIT may have run): both get ROLLBACK. A lost peer's memory went with its process.
        let mut targets: Vec<usize> =
            drained.acks.iter().filter(|(_, m)| m.status == Status::Ok).map(|(&r, _)| r).collect();
        let silent_alive: Vec<usize> =
            drained.silent.iter().map(|f| f.rank).filter(|r| !lost.contains(r)).collect();
        targets.extend(&silent_alive);
        let rollback = Message::request(op_id, Phase::Rollback, Some(action), tags);
        let (sent, send_failures) = self.fan_out(&rollback, &targets, false);
        if !send_failures.is_empty() {
            fatal = true;
        }
        failures.extend(send_failures);
        let undo = action.inverse();
        if undo == Action::Sleep {
            // A wakeup that is undone puts rank 0 back to sleep: quiesce again if it resumed
            // (without the state lock: a quiesce may take long).
            let paused = lock(&self.inner).paused;
            if !paused {
                if self.engine.quiesce(QuiesceMode::Keep).is_err() {
                    fatal = true;
                }
                lock(&self.inner).paused = true;
            }
        }
        match execute(0, &*self.memory, undo, tags, None) {
            Err((_, message)) => {
                failures.push(RankFailure { rank: 0, phase: Phase::Rollback, message });
                fatal = true;
            }
            Ok(_) if undo == Action::Revert => self.engine.weights_changed(),
            Ok(_) => {}
        }
        let answers = self.drain(op_id, Phase::Rollback, &sent);
        for (rank, m) in &answers.acks {
            if m.status != Status::Ok {
                // A silent peer that had not committed answers "not the last committed one":
                // its memory is unchanged, which is what a rollback wants.
                let untouched = silent_alive.contains(rank) && m.status == Status::Failed;
                if !untouched {
                    fatal = true;
                }
            }
        }
        if !answers.silent.is_empty() {
            fatal = true;
        }
        failures.extend(answers.failures());
        if fatal {
            self.fail_stop(op_id, "a rollback failed");
            return (Outcome::FailStop, failures);
        }
        let mut inner = lock(&self.inner);
        // Undone, a sleep or a weight update leaves nothing asleep (unless something was before):
        // the engine runs again, as after a success.
        if inner.asleep.is_empty() && inner.paused && !inner.held {
            self.engine.resume();
            inner.paused = false;
        }
        inner.settle();
        (Outcome::RolledBack, failures)
    }

    fn zero_receipt(
        &self,
        action: Action,
        tags: &[String],
        asleep: Vec<String>,
        start: Instant,
    ) -> OpReceipt {
        let ranks = (0..self.world())
            .map(|rank| RankReceipt {
                rank,
                tags: tags
                    .iter()
                    .map(|t| TagReceipt { tag: t.clone(), ..TagReceipt::default() })
                    .collect(),
                before: Probe::default(),
                after: Probe::default(),
                elapsed_us: 0,
                asleep: asleep.clone(),
            })
            .collect();
        let elapsed = start.elapsed();
        OpReceipt { op_id: 0, action, tags: tags.to_vec(), ranks, elapsed, weight_version: None }
    }
}
