//! The per-rank engine: the [`Leader`] on rank 0 and a [`Worker`] on every other rank, both
//! running the same sequence of step boundaries, session by session.
//!
//! # A session on every rank
//!
//! 1. **Open** boundary (deadline: `transition_timeout`): rank 0 sends the [`SessionConfig`];
//!    every rank records the session as opened and builds its model (failpoint
//!    `session.init`).
//! 2. **Steps**. Each boundary starts with the admission (see [`crate::protocol`]); rank 0's
//!    message is a step plan, an idle tick, or the close. For a plan every rank prepares (frees
//!    finished sequences, [`StepModel::prepare`]; failpoint `session.prepare`), then confirms; a confirmed step runs on
//!    every rank (failpoint `session.step`), and the model samples where its logits are (rank
//!    0); rank 0's scheduler takes the tokens and writes to its sinks (failpoint
//!    `session.sink`). A stop asked for at any time is contributed at the next admission.
//! 3. **Close**: after the model work ends rank 0 decides ([`Decider`]); `KeepOpen` turns into
//!    idle ticks (one boundary per `tick`, so workers notice a dead rank 0; failpoint
//!    `session.idle` on rank 0), `Stop` and
//!    `Replace` close the session on every rank at the same boundary.
//! 4. **Cleanup**, no collective, in this order: rank 0 reports the requests still scheduled
//!    as cancelled (success path only); every sequence's state is dropped, then the model
//!    (failpoint `session.cleanup`; after a failure the model is kept until the engine is
//!    dropped, see below); rank 0 drops the tokenizer and tells the metrics sink; the session
//!    is recorded as closed (exactly once, on success and failure alike).
//! 5. A replacement opens the next session (epoch + 1) at the next Open boundary, with the
//!    same process groups; its generous deadline absorbs a slow cleanup on any rank.
//!
//! # Failure
//!
//! Model code runs under `catch_unwind`: a panic is this rank's error, never an unwinding
//! across the rank boundary. A rank whose own part fails (init, prepare, step, sink) waits on
//! nobody: it poisons its control group and then its data groups (each tells the peers
//! without blocking: a peer waiting for it now, or at its next call, fails at once naming
//! it), skips everything else and returns its original error. Its peers raise
//! [`Error::PeerFailed`] naming it. A peer whose own step failed only because of it
//! ([`Error::caused_by_peer`]: a TP/CP collective of the model was poisoned, or timed out on
//! a dead or hung rank) poisons its data groups and contributes "failed after a peer" at the
//! control call it owes (the confirmation when preparing, else the next admission); that call
//! ends as soon as the origin's poison (or its death) is seen, so the peer reports the origin
//! by its global rank. A control-group failure (deadline, dead peer) is already known to every
//! rank through the communicator.
//!
//! After any failure the process groups are dropped, which never blocks, and the failed
//! session's model is not torn down: it stays with the engine until the engine is dropped, so
//! the error reaches the caller first. A process that exits on the error (the CLI's ranks do)
//! leaves that teardown to the OS. After success the groups are shut down together
//! ([`ParallelContext::shutdown`]).

use crate::error::{Error, Result};
use crate::model::{Groups, ModelFactory, StepModel};
use crate::plan::{SessionConfig, SessionDecision, StepPlan};
use crate::protocol::{self, Agreed, Agreement, Contribution, Message, State};
use crate::scheduler::{Emit, Request, Scheduler};
use crate::sink::{FinishReason, MetricsSink, OutputSink, StepMetrics, StepPhases, TextCodec};
use crate::sleep::QuiesceMode;
use collectives::ParallelContext;
pub use gate::Gate;
pub use leader::Leader;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
pub use worker::Worker;

/// Deadlines and pacing of the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// Deadline of every control collective inside a session: a rank that hangs in a step
    /// for longer is named by its peers.
    pub step_timeout: Duration,
    /// Deadline of a session's Open boundary and of its first step boundary: covers the
    /// previous session's cleanup and the model build on every rank.
    pub transition_timeout: Duration,
    /// How often an idle session's ranks meet (rank 0 polls its input and decider once per
    /// tick; workers detect a dead rank 0 within a tick plus the deadline).
    pub tick: Duration,
    /// Deadline of the coordinated shutdown after success.
    pub shutdown_timeout: Duration,
    /// How long a sleep waits for the engine to reach a step boundary (with mode `wait`,
    /// for the running requests to finish).
    pub quiesce_timeout: Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            step_timeout: Duration::from_secs(60),
            transition_timeout: Duration::from_secs(300),
            tick: Duration::from_millis(100),
            shutdown_timeout: Duration::from_secs(30),
            quiesce_timeout: Duration::from_secs(120),
        }
    }
}

/// Asks the engine to stop; the stop takes effect at the next step boundary, on every rank.
#[derive(Debug, Clone, Default)]
pub struct StopHandle(Arc<AtomicBool>);

impl StopHandle {
    /// Asks for a stop.
    pub fn request_stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether a stop was asked for.
    pub fn is_requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// What a rank went through, in order; identical step entries on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A session opened.
    Opened {
        /// The session.
        epoch: u64,
    },
    /// A confirmed step ran (started; the event is recorded before the model runs).
    Step {
        /// The session.
        epoch: u64,
        /// The step, from 1.
        step: u64,
    },
    /// A session closed.
    Closed {
        /// The session.
        epoch: u64,
        /// Steps it ran.
        steps: u64,
    },
}

/// The sessions a run went through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Sessions opened (and closed).
    pub sessions: u64,
    /// Steps over all sessions.
    pub steps: u64,
}

/// What rank 0's [`Decider`] sees when a session's model work has ended (and then at every
/// idle tick while it stays open).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionReport {
    /// The session.
    pub epoch: u64,
    /// Steps it ran so far.
    pub steps: u64,
    /// Requests finished in it so far.
    pub finished: u64,
    /// Whether it stopped because it reached `max_steps`.
    pub step_limit: bool,
    /// Idle ticks so far.
    pub idle_ticks: u64,
}

/// Rank 0's decision with what only rank 0 needs (the new session's requests).
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Stop the engine.
    Stop,
    /// Keep the session open and idle.
    KeepOpen,
    /// Replace the session with one of this config, running these requests.
    Replace(SessionConfig, Vec<Request>),
}

/// Rank 0's policy once a session's model work has ended.
pub trait Decider {
    /// What follows the session of `report`.
    fn decide(&mut self, report: &SessionReport) -> Decision;
}

impl<F: FnMut(&SessionReport) -> Decision> Decider for F {
    fn decide(&mut self, report: &SessionReport) -> Decision {
        self(report)
    }
}

/// Rank 0's sinks, handed to [`Role::new`] on rank 0 only.
pub struct Sinks {
    /// Where results go.
    pub output: Box<dyn OutputSink>,
    /// Where metrics go.
    pub metrics: Box<dyn MetricsSink>,
}

/// The engine of this rank, by rank.
pub enum Role {
    /// Rank 0.
    Leader(Leader),
    /// Any other rank.
    Worker(Worker),
}

impl Role {
    /// The engine for `ctx`'s rank: a [`Leader`] with `sinks` on rank 0, a [`Worker`] elsewhere.
    ///
    /// # Errors
    /// [`Error::WorkerOwnsNo`] when sinks are handed to a worker; [`Error::WrongRole`] when
    /// rank 0 gets none.
    pub fn new(
        ctx: ParallelContext,
        factory: Box<dyn ModelFactory>,
        opts: EngineOptions,
        sinks: Option<Sinks>,
    ) -> Result<Role> {
        match (ctx.rank(), sinks) {
            (0, Some(s)) => Ok(Role::Leader(Leader::new(ctx, factory, s.output, s.metrics, opts)?)),
            (0, None) => Err(Error::WrongRole {
                role: "leader without sinks",
                expected: "no rank (rank 0 needs an output and a metrics sink)",
                rank: 0,
            }),
            (rank, Some(_)) => Err(Error::WorkerOwnsNo { rank, what: "output sink" }),
            (_, None) => Ok(Role::Worker(Worker::new(ctx, factory, opts)?)),
        }
    }

    /// The events this rank went through so far.
    pub fn events(&self) -> &[Event] {
        match self {
            Role::Leader(l) => l.events(),
            Role::Worker(w) => w.events(),
        }
    }

    /// A handle that asks for a stop at the next boundary.
    pub fn stop_handle(&self) -> StopHandle {
        match self {
            Role::Leader(l) => l.stop_handle(),
            Role::Worker(w) => w.stop_handle(),
        }
    }

    /// The gate the sleep/wakeup control plane quiesces this rank's engine through.
    pub fn gate(&self) -> Arc<Gate> {
        match self {
            Role::Leader(l) => l.gate(),
            Role::Worker(w) => w.gate(),
        }
    }
}

/// What leader and worker share.
struct Core {
    ctx: Option<ParallelContext>,
    rank: usize,
    opts: EngineOptions,
    factory: Box<dyn ModelFactory>,
    agreement: Agreement,
    events: Vec<Event>,
    stop: StopHandle,
    gate: Arc<Gate>,
    buf: Vec<u8>,
    /// The last decoded plan, whose buffers the next one reuses.
    recycled: Option<Message>,
    /// The model of a session that failed, torn down when the engine is dropped.
    failed_model: Option<Box<dyn StepModel>>,
}

/// Where a local failure is announced.
#[derive(Clone, Copy)]
enum Owed {
    Admission,
    Confirmation,
}

/// Lends the data groups of `ctx` to the model, with the step deadline on every call.
fn groups(ctx: &mut ParallelContext, deadline: Duration) -> Groups<'_> {
    let (rank, mesh) = (ctx.rank(), *ctx.mesh());
    let ParallelContext { tp, cp, .. } = ctx;
    tp.set_timeout(deadline);
    cp.set_timeout(deadline);
    Groups { rank, mesh, tp: tp.as_mut(), cp: cp.as_mut() }
}

/// Runs model code so that a panic becomes this rank's error (announced to the peers like
/// any other) instead of unwinding across the rank boundary.
fn guarded<T>(
    phase: &'static str,
    rank: usize,
    epoch: u64,
    step: u64,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic_message(&*panic);
        Err(Error::Model { phase, rank, epoch, step, source: format!("panicked: {what}").into() })
    })
}

/// The message a panic was given (its payload as `panic!` makes it: a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".to_owned())
}

fn injected(phase: &'static str, point: &str, rank: usize, epoch: u64, step: u64) -> Result<()> {
    mesh::failpoint::hit(point).map_err(|source| Error::Injected {
        phase,
        rank,
        epoch,
        step,
        source,
    })
}

impl Core {
    fn new(ctx: ParallelContext, factory: Box<dyn ModelFactory>, opts: EngineOptions) -> Self {
        Core {
            gate: Arc::new(Gate::new(ctx.rank() == 0, opts.quiesce_timeout)),
            rank: ctx.rank(),
            ctx: Some(ctx),
            opts,
            factory,
            agreement: Agreement::new(),
            events: Vec::new(),
            stop: StopHandle::default(),
            buf: Vec::new(),
            recycled: None,
            failed_model: None,
        }
    }

    /// One admission; returns what was agreed and, when go, rank 0's message.
    fn boundary(
        &mut self,
        state: State,
        epoch: u64,
        step: u64,
        msg: Option<&Message>,
        timeout: Duration,
    ) -> Result<(Agreed, Option<Message>)> {
        let rank = self.rank;
        let ctx = self.ctx.as_mut().ok_or(Error::Finished { rank })?;
        ctx.control.set_timeout(timeout);
        if let Some(m) = msg {
            // A plan's header names the step it runs; other messages the boundary's step.
            let (e, s) = match m {
                Message::Step(plan) => (plan.epoch, plan.step),
                _ => (epoch, step),
            };
            protocol::encode(m, e, s, &mut self.buf);
        }
        let c = Contribution { state, epoch, step, message: msg.map(|_| &self.buf[..]) };
        let agreed = self.agreement.admit(ctx.control.as_mut(), c).map_err(told_by_peer)?;
        self.check(&agreed, "admission", epoch, step)?;
        if agreed.state != State::Go || rank == 0 {
            // Rank 0 knows its own message.
            return Ok((agreed, None));
        }
        let bad = |reason: String| Error::Protocol { op: "admission", rank, epoch, step, reason };
        // The previous step's plan lends its buffers to this one.
        let mut m = self.recycled.take().unwrap_or(Message::Idle);
        let (e, s) = protocol::decode_into(self.agreement.message(), &mut m)
            .map_err(|d| bad(d.to_string()))?;
        if e != epoch || (s != step && s != step + 1) {
            return Err(bad(format!("message is for epoch {e} step {s}")));
        }
        Ok((agreed, Some(m)))
    }

    fn confirm(&mut self, state: State, epoch: u64, step: u64) -> Result<Agreed> {
        let rank = self.rank;
        let ctx = self.ctx.as_mut().ok_or(Error::Finished { rank })?;
        let c = Contribution { state, epoch, step, message: None };
        let agreed = self.agreement.confirm(ctx.control.as_mut(), c).map_err(told_by_peer)?;
        self.check(&agreed, "confirmation", epoch, step)?;
        Ok(agreed)
    }

    /// A failure reported by another rank becomes this rank's error.
    fn check(&self, agreed: &Agreed, op: &'static str, epoch: u64, step: u64) -> Result<()> {
        peer_failure(agreed, self.rank, op, epoch, step)
    }

    /// After a local failure: makes it known to the peers, then returns the original error.
    ///
    /// A rank that failed on its own (the origin) waits on nobody: it poisons every group it
    /// belongs to, data and control, which tells each peer at once (one waiting for it now)
    /// or at its next call ([`Error::PeerFailed`] naming this rank), and returns.
    ///
    /// A rank that failed only because a peer did (its model's data-group collective blamed
    /// the peer) poisons its data groups, then asks the control group who the origin is, at
    /// the control call it owes, contributing "failed after a peer": the call ends as soon as
    /// the origin's poison or death is seen (at once when the origin poisoned the group before
    /// its data groups, as it does), with the origin named by its global rank. When every
    /// failing rank failed after a peer (a data-group collective timed out), the call meets
    /// them all and this rank reports whom its own collective blamed.
    fn announce(&mut self, e: Error, owed: Owed, epoch: u64, step: u64) -> Error {
        if e.known_to_peers() {
            return e;
        }
        if !e.caused_by_peer() {
            self.poison_groups();
            return e;
        }
        self.poison_data_groups();
        let state = State::FailedAfterPeer;
        let timeout = self.opts.step_timeout;
        let told = match owed {
            Owed::Admission => self.boundary(state, epoch, step, None, timeout).map(|_| ()),
            Owed::Confirmation => self.confirm(state, epoch, step).map(|_| ()),
        };
        match told {
            // What it blamed says more than "no rank was the origin".
            Err(Error::PeersFailed { .. }) | Ok(()) => e,
            Err(other) => other,
        }
    }

    /// Wakes peers that wait for this rank inside a data-group collective of the step: the
    /// groups are told this rank failed, so their pending and next calls fail at once.
    fn poison_data_groups(&mut self) {
        let Some(ctx) = self.ctx.as_mut() else { return };
        for comm in [ctx.tp.as_mut(), ctx.cp.as_mut()] {
            comm.fail("its step failed");
        }
    }

    /// Tells every group this rank belongs to that it failed, control group first: a peer
    /// that fails in a data group because of this rank then finds this rank's failure in the
    /// control group already, and names it as the origin.
    fn poison_groups(&mut self) {
        if let Some(ctx) = self.ctx.as_mut() {
            ctx.control.fail("this rank failed");
        }
        self.poison_data_groups();
    }

    /// The exit path: coordinated shutdown after success, a non-blocking drop after failure.
    fn finish<T>(&mut self, result: Result<T>) -> Result<T> {
        if result.as_ref().is_err_and(|e| !e.known_to_peers()) {
            // A failure no peer knows of yet (one raised without an announcement, such as a
            // malformed plan, or a follower's own error) is told the way an origin's is.
            self.poison_groups();
        }
        let Some(ctx) = self.ctx.take() else {
            return result.and(Err(Error::Finished { rank: self.rank }));
        };
        match result {
            Ok(v) => {
                let rank = self.rank;
                ctx.shutdown(self.opts.shutdown_timeout)
                    .map_err(|source| Error::Shutdown { rank, source: Box::new(source) })?;
                Ok(v)
            }
            Err(e) => {
                drop(ctx);
                Err(e)
            }
        }
    }

    fn state(&self) -> State {
        if self.stop.is_requested() {
            State::Stop
        } else {
            State::Go
        }
    }

    /// The model build of a session (failpoint `session.init`).
    fn build(&mut self, cfg: &SessionConfig, epoch: u64) -> Result<Box<dyn StepModel>> {
        let rank = self.rank;
        let ctx = self.ctx.as_mut().ok_or(Error::Finished { rank })?;
        let mut groups = groups(ctx, self.opts.step_timeout);
        let factory = &mut self.factory;
        guarded("session init", rank, epoch, 0, || {
            injected("session init", "session.init", rank, epoch, 0)?;
            factory.build(cfg, &mut groups).map_err(|source| Error::Model {
                phase: "session init",
                rank,
                epoch,
                step: 0,
                source,
            })
        })
    }

    /// Prepares an admitted step (failpoint `session.prepare`): frees finished sequences, then
    /// the model's own preparation.
    fn prepare(&mut self, model: &mut dyn StepModel, plan: &StepPlan, epoch: u64) -> Result<()> {
        let (rank, step) = (self.rank, plan.step);
        guarded("prepare", rank, epoch, step, || {
            injected("prepare", "session.prepare", rank, epoch, step)?;
            for seq in &plan.released {
                model.release(*seq);
            }
            model.prepare(plan).map_err(|source| Error::Model {
                phase: "prepare",
                rank,
                epoch,
                step,
                source,
            })
        })
    }

    /// Runs a confirmed step (failpoint `session.step`).
    fn forward(
        &mut self,
        model: &mut dyn StepModel,
        plan: &StepPlan,
    ) -> Result<Option<crate::model::StepOutput>> {
        let (rank, epoch, step) = (self.rank, plan.epoch, plan.step);
        let ctx = self.ctx.as_mut().ok_or(Error::Finished { rank })?;
        let mut groups = groups(ctx, self.opts.step_timeout);
        guarded("step", rank, epoch, step, || {
            injected("step", "session.step", rank, epoch, step)?;
            model.forward(plan, &mut groups).map_err(|source| Error::Model {
                phase: "step",
                rank,
                epoch,
                step,
                source,
            })
        })
    }

    /// The model's part of cleanup, shared by both roles: torn down now after success; after
    /// a failure kept until the engine is dropped, so the error reaches the caller before any
    /// teardown that can block (freeing device memory), and a process that exits on the error
    /// leaves that to the OS.
    fn retire_model(&mut self, model: Option<Box<dyn StepModel>>, success: bool) {
        if success {
            tear_down(model);
        } else if model.is_some() {
            self.failed_model = model;
        }
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        tear_down(self.failed_model.take());
    }
}

/// Drops a session's model (failpoint `session.cleanup`).
fn tear_down(model: Option<Box<dyn StepModel>>) {
    if model.is_none() {
        return;
    }
    // A delay here stands for a slow teardown (freeing device memory); cleanup cannot fail
    // by design, so only the delay action has an effect.
    let _ = mesh::failpoint::hit("session.cleanup");
    drop(model);
}

/// The accessors both engine roles ([`Leader`], [`Worker`]) have over their `core`.
macro_rules! core_accessors {
    () => {
        /// The events of this rank so far.
        pub fn events(&self) -> &[Event] {
            &self.core.events
        }

        /// A handle that asks for a stop at the next boundary (a worker that asks, because it
        /// must leave early, stops every rank together).
        pub fn stop_handle(&self) -> StopHandle {
            self.core.stop.clone()
        }

        /// The gate the sleep/wakeup control plane quiesces this engine through.
        pub fn gate(&self) -> Arc<Gate> {
            self.core.gate.clone()
        }

        /// Quiesces through `gate` (made with [`Gate::for_rank`] for this rank) instead.
        pub fn with_gate(mut self, gate: Arc<Gate>) -> Self {
            self.core.gate = gate;
            self
        }

        /// Stops when `stop` is asked (a handle made before the engine, say for a control
        /// socket), instead of a handle of its own.
        pub fn with_stop(mut self, stop: StopHandle) -> Self {
            self.core.stop = stop;
            self
        }
    };
}

mod gate;
mod leader;
mod worker;

/// A control call that failed because a peer published its failure (it poisoned the control
/// group) is that peer's failure, [`Error::PeerFailed`]: the control group holds every rank in
/// order, so its group rank is its global rank.
fn told_by_peer(e: Error) -> Error {
    match e {
        Error::Collective { op, rank, epoch, step, source } => match *source {
            collectives::Error::PeerFailed { peer, .. } => {
                Error::PeerFailed { op, rank, epoch, step, peer }
            }
            other => Error::Collective { op, rank, epoch, step, source: Box::new(other) },
        },
        other => other,
    }
}

/// The error an agreement in the failed state is for `rank`: the rank that failed on its own
/// when one did ([`Error::PeerFailed`]); [`Error::PeersFailed`] when every failing rank failed
/// after a peer (a data-group collective timed out or was poisoned on each of them); none when
/// the agreement did not fail or `rank` is the origin (its own error is the one to report).
fn peer_failure(
    agreed: &Agreed,
    rank: usize,
    op: &'static str,
    epoch: u64,
    step: u64,
) -> Result<()> {
    match (agreed.state, agreed.failed) {
        (State::Failed, Some(peer)) if peer != rank => {
            Err(Error::PeerFailed { op, rank, epoch, step, peer })
        }
        (State::Failed, None) => Err(Error::PeersFailed { op, rank, epoch, step }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
