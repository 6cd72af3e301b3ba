//! The peer side: a listener thread on every non-zero rank that answers rank 0's requests.
//!
//! PREPARE quiesces the engine and checks the request without touching memory; COMMIT runs
//! the memory operation (a partial failure is undone on the spot); ROLLBACK runs the inverse
//! of the last committed operation; ABORT forgets a prepared request whose id matches. An
//! ABORT that arrives before its PREPARE is recorded, and the PREPARE is then answered
//! `aborted` without quiescing. SHUTDOWN and FAIL-STOP are acknowledged before the listener
//! exits.

use super::error::{Error, Result};
use super::memory::{execute, RankMemory, Refusal};
use super::message::{Action, Message, Phase, Probe, RankReceipt, Received, Status};
use super::quiesce::{Quiesce, QuiesceMode};
use super::transport::PeerLink;
use super::version::WeightUpdate;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often an idle listener wakes up to look for its connection.
const POLL: Duration = Duration::from_millis(200);

/// How a listener ended without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListenerExit {
    /// Rank 0 sent the shutdown sentinel.
    Shutdown,
}

/// A peer's control-plane state.
struct Peer {
    rank: usize,
    memory: Arc<dyn RankMemory>,
    engine: Arc<dyn Quiesce>,
    /// The request prepared and not yet committed or aborted.
    prepared: Option<Message>,
    /// The last committed operation: (op id, action, tags), for a rollback.
    committed: Option<(u64, Action, Vec<String>)>,
    /// Operation ids aborted before their PREPARE arrived.
    early_aborts: BTreeSet<u64>,
    /// The highest operation id prepared so far.
    last_prepared: u64,
    /// Tags asleep on this rank.
    asleep: BTreeSet<String>,
    /// Whether this rank's engine is quiesced.
    paused: bool,
}

/// Serves rank 0's requests on the current thread until SHUTDOWN (or FAIL-STOP, or a broken
/// connection).
///
/// # Errors
/// [`Error::FailStop`] when rank 0 stopped the deployment; [`Error::Link`] naming rank 0
/// when the connection closed or broke.
pub fn serve(
    rank: usize,
    mut link: impl PeerLink,
    memory: Arc<dyn RankMemory>,
    engine: Arc<dyn Quiesce>,
) -> Result<ListenerExit> {
    let mut peer = Peer {
        rank,
        memory,
        engine,
        prepared: None,
        committed: None,
        early_aborts: BTreeSet::new(),
        last_prepared: 0,
        asleep: BTreeSet::new(),
        paused: false,
    };
    loop {
        let msg = match link.recv(Instant::now() + POLL) {
            Ok(Some(Received::Frame(m))) => *m,
            Ok(Some(Received::Undecodable(bad))) => {
                // The connection is fine: answer the request it was, when that can be read,
                // so rank 0 fails the operation now instead of at its deadline.
                tracing::warn!(rank, reason = %bad.reason, "undecodable request");
                if let (Some(op_id), Some(phase)) = (bad.op_id, bad.phase) {
                    let mut ack = Message::request(op_id, phase, None, &[]).ack(Status::Failed);
                    ack.error =
                        Some(format!("rank {rank} could not decode the request: {}", bad.reason));
                    if let Err(source) = link.send(&ack) {
                        return Err(Error::Link { rank, source });
                    }
                }
                continue;
            }
            Ok(None) => continue,
            Err(source) => return Err(Error::Link { rank, source }),
        };
        if msg.status != Status::Request {
            tracing::warn!(rank, op_id = msg.op_id, phase = %msg.phase, "dropped a non-request frame");
            continue;
        }
        let ack = peer.handle(&msg);
        let sent = link.send(&ack);
        match msg.phase {
            Phase::Shutdown => return Ok(ListenerExit::Shutdown),
            Phase::FailStop => return Err(Error::FailStop { rank, op_id: msg.op_id }),
            _ => {}
        }
        if let Err(source) = sent {
            return Err(Error::Link { rank, source });
        }
    }
}

impl Peer {
    fn failed(&self, msg: &Message, status: Status, error: String) -> Message {
        let mut ack = msg.ack(status);
        ack.error = Some(error);
        ack
    }

    fn receipt(&self, mut r: RankReceipt) -> RankReceipt {
        r.asleep = self.asleep.iter().cloned().collect();
        r
    }

    fn handle(&mut self, msg: &Message) -> Message {
        match msg.phase {
            Phase::Prepare => self.prepare(msg),
            Phase::Abort => self.abort(msg),
            Phase::Commit => self.commit(msg),
            Phase::Rollback => self.rollback(msg),
            Phase::Status => {
                let probe: Probe = self.memory.probe();
                let mut ack = msg.ack(Status::Ok);
                ack.receipt = Some(self.receipt(RankReceipt {
                    rank: self.rank,
                    before: probe.clone(),
                    after: probe,
                    ..RankReceipt::default()
                }));
                ack
            }
            Phase::Shutdown | Phase::FailStop => msg.ack(Status::Ok),
        }
    }

    fn prepare(&mut self, msg: &Message) -> Message {
        if self.early_aborts.remove(&msg.op_id) {
            tracing::info!(
                rank = self.rank,
                op_id = msg.op_id,
                "prepare of an op aborted earlier: dropped"
            );
            return self.failed(
                msg,
                Status::Aborted,
                format!("op {} was aborted before its prepare arrived", msg.op_id),
            );
        }
        self.last_prepared = self.last_prepared.max(msg.op_id);
        self.early_aborts.retain(|&id| id > msg.op_id);
        if let Err(e) = mesh::failpoint::hit("sleep.prepare") {
            return self.failed(msg, Status::Failed, format!("prepare of op {}: {e}", msg.op_id));
        }
        let checked = match (msg.action, msg.model.as_deref()) {
            (Some(Action::Update), Some(model)) => {
                let update = WeightUpdate {
                    model: model.to_owned(),
                    tensors: msg.tensors.clone(),
                    version: None,
                };
                self.memory.prepare_update_with(&update)
            }
            (Some(Action::Update), None) => Err(Refusal::NoCheckpoint),
            _ => self.memory.check(&msg.tags),
        };
        if let Err(e) = checked {
            return self.failed(msg, Status::Failed, format!("prepare of op {}: {e}", msg.op_id));
        }
        if !self.paused {
            if let Err(e) = self.engine.quiesce(msg.mode) {
                return self.failed(
                    msg,
                    Status::Failed,
                    format!("prepare of op {}: quiescing the engine failed: {e}", msg.op_id),
                );
            }
            self.paused = true;
        }
        self.prepared = Some(msg.clone());
        msg.ack(Status::Ok)
    }

    /// Resumes the engine when nothing is asleep and nothing is prepared.
    fn resume_if_awake(&mut self) {
        if self.paused && self.asleep.is_empty() && self.prepared.is_none() {
            self.engine.resume();
            self.paused = false;
        }
    }

    fn abort(&mut self, msg: &Message) -> Message {
        match &self.prepared {
            Some(p) if p.op_id == msg.op_id => {
                if p.action == Some(Action::Update) {
                    self.memory.drop_update();
                }
                self.prepared = None;
                self.resume_if_awake();
            }
            _ if msg.op_id > self.last_prepared => {
                // Its PREPARE has not arrived yet: remember, so it is never acted on.
                self.early_aborts.insert(msg.op_id);
            }
            _ => {}
        }
        msg.ack(Status::Ok)
    }

    fn commit(&mut self, msg: &Message) -> Message {
        let prepared = match self.prepared.take() {
            Some(p) if p.op_id == msg.op_id => p,
            other => {
                self.prepared = other;
                return self.failed(
                    msg,
                    Status::Failed,
                    format!("commit of op {}: that op is not prepared on this rank", msg.op_id),
                );
            }
        };
        let action = prepared.action.unwrap_or(Action::Sleep);
        if let Err(e) = mesh::failpoint::hit("sleep.commit") {
            self.resume_if_awake();
            return self.failed(msg, Status::Failed, format!("commit of op {}: {e}", msg.op_id));
        }
        match execute(self.rank, &*self.memory, action, &prepared.tags, prepared.level) {
            Ok(r) => {
                match action {
                    Action::Sleep => self.engine.released(&prepared.tags),
                    Action::Update => self.engine.weights_changed(),
                    Action::Wakeup | Action::Revert => {}
                }
                self.apply(action, &prepared.tags);
                self.committed = Some((msg.op_id, action, prepared.tags.clone()));
                self.resume_if_awake();
                let mut ack = msg.ack(Status::Ok);
                ack.receipt = Some(self.receipt(r));
                ack
            }
            Err((status, e)) => {
                if status == Status::Failed {
                    self.resume_if_awake();
                }
                self.failed(msg, status, format!("commit of op {}: {e}", msg.op_id))
            }
        }
    }

    fn rollback(&mut self, msg: &Message) -> Message {
        let (action, tags) = match self.committed.take() {
            Some((id, action, tags)) if id == msg.op_id => (action, tags),
            other => {
                self.committed = other;
                return self.failed(
                    msg,
                    Status::Failed,
                    format!("rollback of op {}: that op is not the last committed one", msg.op_id),
                );
            }
        };
        let undo = action.inverse();
        if undo == Action::Sleep && !self.paused {
            // A wakeup resumed the engine; it must stop again before its memory goes.
            if let Err(e) = self.engine.quiesce(QuiesceMode::Keep) {
                return self.failed(
                    msg,
                    Status::Fatal,
                    format!("rollback of op {}: quiescing the engine failed: {e}", msg.op_id),
                );
            }
            self.paused = true;
        }
        match execute(self.rank, &*self.memory, undo, &tags, None) {
            Ok(r) => {
                if undo == Action::Revert {
                    self.engine.weights_changed();
                }
                self.apply(undo, &tags);
                self.resume_if_awake();
                let mut ack = msg.ack(Status::Ok);
                ack.receipt = Some(self.receipt(r));
                ack
            }
            // A rollback that fails leaves this rank different from the others.
            Err((_, e)) => {
                self.failed(msg, Status::Fatal, format!("rollback of op {}: {e}", msg.op_id))
            }
        }
    }

    fn apply(&mut self, action: Action, tags: &[String]) {
        for t in tags {
            match action {
                Action::Sleep => self.asleep.insert(t.clone()),
                Action::Wakeup => self.asleep.remove(t),
                Action::Update | Action::Revert => false,
            };
        }
    }
}

/// A listener running on its own thread.
#[derive(Debug)]
pub struct ListenerHandle {
    rank: usize,
    thread: Option<JoinHandle<Result<ListenerExit>>>,
}

/// Starts [`serve`] on a thread named `sleep-listener`.
///
/// # Errors
/// [`Error::Channel`] when the thread cannot be spawned.
pub fn spawn(
    rank: usize,
    link: impl PeerLink + 'static,
    memory: Arc<dyn RankMemory>,
    engine: Arc<dyn Quiesce>,
) -> Result<ListenerHandle> {
    let thread = std::thread::Builder::new()
        .name("sleep-listener".into())
        .spawn(move || serve(rank, link, memory, engine))
        .map_err(|e| Error::Channel { rank, detail: format!("spawn the listener thread: {e}") })?;
    Ok(ListenerHandle { rank, thread: Some(thread) })
}

impl ListenerHandle {
    /// Whether the listener thread has ended.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits at most `timeout` for the listener to end and returns how it ended.
    ///
    /// # Errors
    /// [`Error::Timeout`] when it is still running (it is left running);
    /// the listener's own error ([`Error::FailStop`], [`Error::Link`]); [`Error::Channel`]
    /// when it panicked.
    pub fn join(&mut self, timeout: Duration) -> Result<ListenerExit> {
        let deadline = Instant::now() + timeout;
        let rank = self.rank;
        while !self.is_finished() {
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    rank,
                    what: "the sleep listener thread".into(),
                    secs: timeout.as_secs_f64(),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(Error::Channel { rank, detail: "the sleep listener thread panicked".into() })
            }),
            None => {
                Err(Error::Channel { rank, detail: "the sleep listener was joined already".into() })
            }
        }
    }
}
