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
//!    every rank (failpoint `session.step`); rank 0 samples and writes to its sinks (failpoint
//!    `session.sink`). A stop asked for at any time is contributed at the next admission.
//! 3. **Close**: after the model work ends rank 0 decides ([`Decider`]); `KeepOpen` turns into
//!    idle ticks (one boundary per `tick`, so workers notice a dead rank 0; failpoint
//!    `session.idle` on rank 0), `Stop` and
//!    `Replace` close the session on every rank at the same boundary.
//! 4. **Cleanup**, no collective, in this order: failpoint `session.cleanup`; rank 0 reports
//!    the requests still scheduled as cancelled (success path only); every sequence's state
//!    and then the model are dropped; rank 0 drops the tokenizer and tells the metrics sink;
//!    the session is recorded as closed (exactly once, on success and failure alike).
//! 5. A replacement opens the next session (epoch + 1) at the next Open boundary, with the
//!    same process groups; its generous deadline absorbs a slow cleanup on any rank.
//!
//! # Failure
//!
//! Model code runs under `catch_unwind`: a panic is this rank's error, never an unwinding
//! across the rank boundary. A rank whose own part fails (init, prepare, step, sink) first
//! wakes any peer waiting for it inside a TP/CP collective (its data groups report its
//! failure), then contributes `failed` at the next control call it owes (the confirmation
//! when preparing, else the next admission), skips everything else and returns its original
//! error. Its peers raise [`Error::PeerFailed`] naming it; a peer whose own step failed only
//! because of it ([`Error::caused_by_peer`]) contributes "failed after a peer", which names no
//! origin, and then reports the origin too. A control-group failure (deadline, dead peer) is
//! already known to every rank through the communicator. After any failure the process groups
//! are dropped, which never blocks; after success they are shut down together
//! ([`ParallelContext::shutdown`]).

use crate::error::{BoxError, Error, Result};
use crate::model::{Groups, ModelFactory, StepModel};
use crate::plan::{SessionConfig, SessionDecision, StepPlan};
use crate::protocol::{self, Agreed, Agreement, Contribution, Message, State};
use crate::scheduler::{Emit, Request, Scheduler};
use crate::sink::{MetricsSink, OutputSink, StepMetrics, TextCodec, TextStream};
use crate::sleep::QuiesceMode;
use collectives::ParallelContext;
pub use gate::Gate;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-string payload".to_owned());
        Err(Error::Model { phase, rank, epoch, step, source: format!("panicked: {what}").into() })
    })
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
        let agreed = self.agreement.admit(ctx.control.as_mut(), c)?;
        self.check(&agreed, "admission", epoch, step)?;
        if agreed.state != State::Go || rank == 0 {
            // Rank 0 knows its own message.
            return Ok((agreed, None));
        }
        let bad = |reason: String| Error::Protocol { op: "admission", rank, epoch, step, reason };
        // The previous step's plan lends its buffers to this one.
        let mut m = self.recycled.take().unwrap_or(Message::Idle);
        let (e, s) = protocol::decode_into(self.agreement.message(), &mut m).map_err(bad)?;
        if e != epoch || (s != step && s != step + 1) {
            return Err(bad(format!("message is for epoch {e} step {s}")));
        }
        Ok((agreed, Some(m)))
    }

    fn confirm(&mut self, state: State, epoch: u64, step: u64) -> Result<Agreed> {
        let rank = self.rank;
        let ctx = self.ctx.as_mut().ok_or(Error::Finished { rank })?;
        let c = Contribution { state, epoch, step, message: None };
        let agreed = self.agreement.confirm(ctx.control.as_mut(), c)?;
        self.check(&agreed, "confirmation", epoch, step)?;
        Ok(agreed)
    }

    /// A failure reported by another rank becomes this rank's error.
    fn check(&self, agreed: &Agreed, op: &'static str, epoch: u64, step: u64) -> Result<()> {
        peer_failure(agreed, self.rank, op, epoch, step)
    }

    /// After a local failure: tells the peers at the control call this rank owes (best
    /// effort, within the step deadline), then returns the original error.
    ///
    /// A rank that failed only because a peer did (its model's data-group collective blamed
    /// the peer) says so without claiming to be the origin, and then reports what the control
    /// group tells it: the rank that failed on its own ([`Error::PeerFailed`]), or the
    /// control group's own error naming a dead or hung rank by its global rank.
    fn announce(&mut self, e: Error, owed: Owed, epoch: u64, step: u64) -> Error {
        if e.known_to_peers() {
            return e;
        }
        self.poison_data_groups();
        let follows = e.caused_by_peer();
        let state = if follows { State::FailedAfterPeer } else { State::Failed };
        let timeout = self.opts.step_timeout;
        let told = match owed {
            Owed::Admission => self.boundary(state, epoch, step, None, timeout).map(|_| ()),
            Owed::Confirmation => self.confirm(state, epoch, step).map(|_| ()),
        };
        match told {
            // What it blamed says more than "no rank was the origin".
            Err(Error::PeersFailed { .. }) => e,
            Err(other) if follows => other,
            _ => e,
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

    /// The exit path: coordinated shutdown after success, a non-blocking drop after failure.
    fn finish<T>(&mut self, result: Result<T>) -> Result<T> {
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
    ) -> Result<Option<crate::model::Logits>> {
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

    /// The model's part of cleanup, shared by both roles.
    fn cleanup_model(&mut self, model: Option<Box<dyn StepModel>>) {
        // A delay here stands for a slow teardown (freeing device memory); cleanup cannot
        // fail by design, so only the delay action has an effect.
        let _ = mesh::failpoint::hit("session.cleanup");
        drop(model);
    }
}

/// How a session's loop ended.
enum Ended {
    /// Every rank leaves the engine.
    Stop,
    /// A new session follows.
    Replace(SessionConfig, Vec<Request>),
}

/// Rank 0's engine: owns the scheduler, the tokenizer, the sampler, the output and metrics
/// sinks, and decides what every rank runs.
pub struct Leader {
    core: Core,
    output: Box<dyn OutputSink>,
    metrics: Box<dyn MetricsSink>,
}

impl Leader {
    /// The engine of rank 0.
    ///
    /// # Errors
    /// [`Error::WrongRole`] when `ctx` is not rank 0.
    pub fn new(
        ctx: ParallelContext,
        factory: Box<dyn ModelFactory>,
        output: Box<dyn OutputSink>,
        metrics: Box<dyn MetricsSink>,
        opts: EngineOptions,
    ) -> Result<Leader> {
        if ctx.rank() != 0 {
            return Err(Error::WrongRole { role: "leader", expected: "rank 0", rank: ctx.rank() });
        }
        Ok(Leader { core: Core::new(ctx, factory, opts), output, metrics })
    }

    /// The events of this rank so far.
    pub fn events(&self) -> &[Event] {
        &self.core.events
    }

    /// A handle that asks for a stop at the next boundary.
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

    /// Runs `requests` together in a session of `config`; when its model work ends (every
    /// request finished, or `max_steps`) `decider` says what follows. Consumes the process
    /// groups: shut down together on success, dropped on failure.
    ///
    /// # Errors
    /// This rank's own failure (model, sink, tokenizer, failpoint), a failure another rank
    /// reported ([`Error::PeerFailed`]), a control-group failure naming the peer at fault.
    pub fn run(
        &mut self,
        config: SessionConfig,
        requests: Vec<Request>,
        decider: &mut dyn Decider,
    ) -> Result<RunSummary> {
        let result = self.drive(config, requests, None, decider);
        self.core.finish(result)
    }

    /// Serves requests from `inbox` with continuous batching: they join at the next step
    /// boundary and leave when finished. While nothing runs, `decider` is asked once per tick
    /// (`KeepOpen` keeps serving).
    ///
    /// # Errors
    /// As [`Leader::run`].
    pub fn serve(
        &mut self,
        config: SessionConfig,
        inbox: &Receiver<Request>,
        decider: &mut dyn Decider,
    ) -> Result<RunSummary> {
        let result = self.drive(config, Vec::new(), Some(inbox), decider);
        self.core.finish(result)
    }

    fn drive(
        &mut self,
        mut config: SessionConfig,
        mut requests: Vec<Request>,
        inbox: Option<&Receiver<Request>>,
        decider: &mut dyn Decider,
    ) -> Result<RunSummary> {
        let mut summary = RunSummary::default();
        for epoch in 0u64.. {
            let timeout = self.core.opts.transition_timeout;
            let state = self.core.state();
            let open = Message::Open(config.clone());
            let (agreed, _) = self.core.boundary(state, epoch, 0, Some(&open), timeout)?;
            self.core.events.push(Event::Opened { epoch });
            summary.sessions += 1;
            let mut s = LeaderSession::new(epoch);
            let ended = if agreed.state == State::Stop {
                Ok(Ended::Stop)
            } else {
                self.session(&mut s, &config, std::mem::take(&mut requests), inbox, decider)
            };
            summary.steps += s.steps;
            self.cleanup(s, ended.is_ok());
            match ended? {
                Ended::Stop => return Ok(summary),
                Ended::Replace(c, r) => (config, requests) = (c, r),
            }
        }
        Ok(summary)
    }

    fn session(
        &mut self,
        s: &mut LeaderSession,
        config: &SessionConfig,
        requests: Vec<Request>,
        inbox: Option<&Receiver<Request>>,
        decider: &mut dyn Decider,
    ) -> Result<Ended> {
        let epoch = s.epoch;
        if let Err(e) = self.open_session(s, config, requests) {
            return Err(self.core.announce(e, Owed::Admission, epoch, 0));
        }
        let mut first = true;
        loop {
            let mut replacement = None;
            if self.core.gate.take_kv_lost() {
                // A sleep discarded the KV cache: paused sequences prefill again once the
                // engine runs (no step runs while it is parked).
                if let Some(sched) = s.sched.as_mut() {
                    sched.recompute_all();
                }
            }
            let msg = if self.core.stop.is_requested() {
                Message::Idle
            } else if let Some(mode) = self.core.gate.request() {
                self.quiesced_message(s, mode)
                    .map_err(|e| self.core.announce(e, Owed::Admission, epoch, s.steps))?
            } else {
                self.next_message(s, config, inbox, decider, &mut replacement)
                    .map_err(|e| self.core.announce(e, Owed::Admission, epoch, s.steps))?
            };
            let timeout =
                if first { self.core.opts.transition_timeout } else { self.core.opts.step_timeout };
            first = false;
            if matches!(msg, Message::Idle) {
                // Stands for rank 0 dying or stalling while the session idles.
                injected("idle tick", "session.idle", 0, epoch, s.steps)
                    .map_err(|e| self.core.announce(e, Owed::Admission, epoch, s.steps))?;
            }
            let state = self.core.state();
            let t0 = Instant::now();
            let (agreed, _) = self.core.boundary(state, epoch, s.steps, Some(&msg), timeout)?;
            if agreed.state == State::Stop {
                return Ok(Ended::Stop);
            }
            match msg {
                Message::Step(plan) => self.step(s, plan, t0)?,
                Message::Idle => s.idle_ticks += 1,
                Message::Close(SessionDecision::Replace(c)) => {
                    let reqs = replacement.unwrap_or_default();
                    return Ok(Ended::Replace(c, reqs));
                }
                Message::Close(_) | Message::Open(_) => return Ok(Ended::Stop),
            }
        }
    }

    /// Builds the model and tokenizer and admits the first requests.
    fn open_session(
        &mut self,
        s: &mut LeaderSession,
        config: &SessionConfig,
        requests: Vec<Request>,
    ) -> Result<()> {
        let epoch = s.epoch;
        let model = self.core.build(config, epoch)?;
        let codec = self.core.factory.codec(config).map_err(|source| Error::Model {
            phase: "session init",
            rank: 0,
            epoch,
            step: 0,
            source,
        })?;
        let eos = codec.as_ref().map(|c| c.eos_ids()).unwrap_or_default();
        s.text = Text { codec, streams: HashMap::new() };
        let sched = Scheduler::new(config.token_budget, config.max_batch, model.context_len(), eos);
        s.sched = Some(match model.kv_layout() {
            Some(layout) => sched.with_kv(layout),
            None => sched,
        });
        s.model = Some(model);
        for r in requests {
            self.admit(s, r)?;
        }
        Ok(())
    }

    fn admit(&mut self, s: &mut LeaderSession, r: Request) -> Result<()> {
        let Some(sched) = s.sched.as_mut() else { return Ok(()) };
        if let Some(done) = sched.add(r, s.text.codec(), s.epoch)? {
            s.finished += 1;
            emit(self.output.as_mut(), &mut s.text, &[done], s.epoch, s.steps)?;
        }
        Ok(())
    }

    /// What rank 0 sends at the next boundary.
    fn next_message(
        &mut self,
        s: &mut LeaderSession,
        config: &SessionConfig,
        inbox: Option<&Receiver<Request>>,
        decider: &mut dyn Decider,
        replacement: &mut Option<Vec<Request>>,
    ) -> Result<Message> {
        let limit = config.max_steps.is_some_and(|m| s.steps >= m);
        if let Some(sched) = s.sched.as_mut() {
            for e in sched.take_cancelled() {
                s.finished += 1;
                emit(self.output.as_mut(), &mut s.text, &[e], s.epoch, s.steps)?;
            }
        }
        if let Some(inbox) = inbox.filter(|_| !limit) {
            // Requests that arrived during the last step join now.
            while let Ok(r) = inbox.try_recv() {
                self.admit(s, r)?;
            }
            let idle = !s.sched.as_ref().is_some_and(Scheduler::has_work);
            if idle {
                match inbox.recv_timeout(self.core.opts.tick) {
                    Ok(r) => {
                        self.admit(s, r)?;
                        while let Ok(r) = inbox.try_recv() {
                            self.admit(s, r)?;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    // No sender left: nothing will arrive, but the ticks keep their pace.
                    Err(RecvTimeoutError::Disconnected) => std::thread::sleep(self.core.opts.tick),
                }
            }
        }
        if !limit {
            if let Some(plan) = s.sched.as_mut().and_then(|q| q.plan(s.epoch, s.steps + 1)) {
                return Ok(Message::Step(plan));
            }
        }
        let report = SessionReport {
            epoch: s.epoch,
            steps: s.steps,
            finished: s.finished,
            step_limit: limit,
            idle_ticks: s.idle_ticks,
        };
        Ok(match decider.decide(&report) {
            Decision::Stop => Message::Close(SessionDecision::Stop),
            Decision::KeepOpen => {
                if inbox.is_none() || limit {
                    // Nothing to wait on: pace the idle ticks here.
                    std::thread::sleep(self.core.opts.tick);
                }
                Message::Idle
            }
            Decision::Replace(cfg, reqs) => {
                *replacement = Some(reqs);
                Message::Close(SessionDecision::Replace(cfg))
            }
        })
    }

    /// What rank 0 sends while a sleep quiesces the engine (see [`gate`]): with `wait` the
    /// running requests go on (no new one is admitted), with `abort` they fail, with `keep`
    /// they pause; then the engine parks and only idle ticks run until the gate opens.
    fn quiesced_message(&mut self, s: &mut LeaderSession, mode: QuiesceMode) -> Result<Message> {
        // The gate's own state, never a copy: a wakeup and the next sleep may both land
        // between two boundaries.
        if self.core.gate.is_parked() {
            std::thread::sleep(self.core.opts.tick);
            return Ok(Message::Idle);
        }
        let Some(sched) = s.sched.as_mut() else {
            self.core.gate.park();
            return Ok(Message::Idle);
        };
        match mode {
            QuiesceMode::Wait => {
                if let Some(plan) = sched.plan(s.epoch, s.steps + 1) {
                    return Ok(Message::Step(plan));
                }
            }
            QuiesceMode::Abort => {
                for e in sched.abort_all() {
                    s.finished += 1;
                    emit(self.output.as_mut(), &mut s.text, &[e], s.epoch, s.steps)?;
                }
            }
            QuiesceMode::Keep => {}
        }
        self.core.gate.park();
        Ok(Message::Idle)
    }

    /// Runs an admitted step on rank 0: prepare, confirm, model, sample, sinks.
    fn step(&mut self, s: &mut LeaderSession, plan: StepPlan, t0: Instant) -> Result<()> {
        let epoch = s.epoch;
        let (Some(model), Some(sched)) = (s.model.as_mut(), s.sched.as_mut()) else {
            return Ok(());
        };
        if let Err(e) = self.core.prepare(model.as_mut(), &plan, epoch) {
            return Err(self.core.announce(e, Owed::Confirmation, epoch, s.steps));
        }
        self.core.confirm(State::Go, epoch, s.steps)?;
        let agreement = t0.elapsed();
        s.steps += 1;
        self.core.events.push(Event::Step { epoch, step: s.steps });
        let t1 = Instant::now();
        let result = self.core.forward(model.as_mut(), &plan).and_then(|logits| {
            let logits = logits.unwrap_or_default();
            sched.apply(&plan, &logits).map_err(|reason| Error::Model {
                phase: "step",
                rank: 0,
                epoch,
                step: plan.step,
                source: reason.into(),
            })
        });
        let model_time = t1.elapsed();
        let emitted = match result {
            Ok(e) => e,
            Err(e) => return Err(self.core.announce(e, Owed::Admission, epoch, s.steps)),
        };
        let sunk = injected("output sink", "session.sink", 0, epoch, plan.step).and_then(|()| {
            s.finished +=
                emitted.iter().filter(|e| matches!(e, Emit::Finished { .. })).count() as u64;
            emit(self.output.as_mut(), &mut s.text, &emitted, epoch, plan.step)
        });
        if let Err(e) = sunk {
            return Err(self.core.announce(e, Owed::Admission, epoch, s.steps));
        }
        let prefill = plan.entries.iter().filter(|e| !e.is_decode()).map(|e| e.tokens.len()).sum();
        let load = sched.take_load();
        self.metrics.step(&StepMetrics {
            epoch,
            step: plan.step,
            batch: plan.entries.len(),
            prefill_tokens: prefill,
            decode_tokens: plan.tokens() - prefill,
            agreement,
            model: model_time,
            running: load.running,
            waiting: load.waiting,
            kv_usage: load.kv_usage,
            prefix_queries: load.prefix_queries,
            prefix_hits: load.prefix_hits,
            preemptions: load.preemptions,
        });
        Ok(())
    }

    /// The fixed cleanup order (see the module docs); no collective.
    fn cleanup(&mut self, mut s: LeaderSession, success: bool) {
        let cancelled = s.sched.as_mut().map(Scheduler::cancel_all).unwrap_or_default();
        if success {
            // The session is over: a sink failure now has no step left to fail.
            let _ = emit(self.output.as_mut(), &mut s.text, &cancelled, s.epoch, s.steps);
        }
        let (epoch, steps) = (s.epoch, s.steps);
        let model = s.model.take();
        self.core.cleanup_model(model);
        drop(std::mem::take(&mut s.text));
        if success {
            self.metrics.session_closed(epoch, steps);
        }
        self.core.events.push(Event::Closed { epoch, steps });
    }
}

/// Rank 0's state of one session.
struct LeaderSession {
    epoch: u64,
    steps: u64,
    finished: u64,
    idle_ticks: u64,
    model: Option<Box<dyn StepModel>>,
    sched: Option<Scheduler>,
    text: Text,
}

impl LeaderSession {
    fn new(epoch: u64) -> Self {
        LeaderSession {
            epoch,
            steps: 0,
            finished: 0,
            idle_ticks: 0,
            model: None,
            sched: None,
            text: Text::default(),
        }
    }
}

/// Rank 0's tokenizer and the detokenization state of each request with tokens out.
#[derive(Default)]
struct Text {
    codec: Option<Box<dyn TextCodec>>,
    streams: HashMap<u64, TextStream>,
}

impl Text {
    fn codec(&self) -> Option<&dyn TextCodec> {
        self.codec.as_deref()
    }

    /// The text `token` adds to `request`, in whole characters (`last` flushes the rest).
    fn piece(&mut self, request: u64, token: u32, last: bool) -> Result<String, BoxError> {
        let Some(codec) = &self.codec else { return Ok(String::new()) };
        let stream = self.streams.entry(request).or_default();
        let text = codec.decode_next(stream, token, last);
        if last {
            self.streams.remove(&request);
        }
        text
    }
}

/// Hands `events` to the sink in order, with each token's text; a request's last token
/// (its `Finished` follows in the same events) flushes the characters still open.
fn emit(
    out: &mut dyn OutputSink,
    text: &mut Text,
    events: &[Emit],
    epoch: u64,
    step: u64,
) -> Result<()> {
    let sink = |source| Error::Sink { what: "output sink", epoch, step, source };
    for (i, e) in events.iter().enumerate() {
        match e {
            Emit::Token { request, token, logprobs } => {
                let last = events[i + 1..]
                    .iter()
                    .any(|f| matches!(f, Emit::Finished { request: r, .. } if r == request));
                let piece = text.piece(*request, *token, last).map_err(sink)?;
                out.token(*request, *token, &piece, logprobs.as_ref()).map_err(sink)?;
            }
            Emit::Finished { request, reason, tokens } => {
                text.streams.remove(request);
                out.finished(*request, *reason, tokens).map_err(sink)?;
            }
        }
    }
    Ok(())
}

/// The engine of a rank other than 0: runs what rank 0 sends, owns no sink, tokenizer or
/// scheduler, and never produces output.
pub struct Worker {
    core: Core,
}

impl Worker {
    /// The engine of a worker rank. It takes no sink: workers own none.
    ///
    /// # Errors
    /// [`Error::WrongRole`] on rank 0.
    pub fn new(
        ctx: ParallelContext,
        factory: Box<dyn ModelFactory>,
        opts: EngineOptions,
    ) -> Result<Worker> {
        if ctx.rank() == 0 {
            return Err(Error::WrongRole { role: "worker", expected: "ranks 1 and up", rank: 0 });
        }
        Ok(Worker { core: Core::new(ctx, factory, opts) })
    }

    /// The events of this rank so far.
    pub fn events(&self) -> &[Event] {
        &self.core.events
    }

    /// A handle that asks for a stop at the next boundary (a worker that must leave early:
    /// every rank stops together).
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

    /// Follows rank 0 session by session until it stops; consumes the process groups like
    /// [`Leader::run`].
    ///
    /// # Errors
    /// As [`Leader::run`].
    pub fn run(&mut self) -> Result<RunSummary> {
        let result = self.drive();
        self.core.finish(result)
    }

    fn drive(&mut self) -> Result<RunSummary> {
        let mut summary = RunSummary::default();
        let mut announced: Option<SessionConfig> = None;
        for epoch in 0u64.. {
            let timeout = self.core.opts.transition_timeout;
            let state = self.core.state();
            let (agreed, msg) = self.core.boundary(state, epoch, 0, None, timeout)?;
            let config = match msg {
                Some(Message::Open(cfg)) => Some(cfg),
                None if agreed.state == State::Stop => None,
                other => {
                    return Err(Error::Protocol {
                        op: "open",
                        rank: self.core.rank,
                        epoch,
                        step: 0,
                        reason: format!("expected a session to open, got {other:?}"),
                    })
                }
            };
            if let (Some(want), Some(got)) = (&announced, &config) {
                if want != got {
                    return Err(Error::Protocol {
                        op: "open",
                        rank: self.core.rank,
                        epoch,
                        step: 0,
                        reason: format!("opening {got:?}, but the replacement announced {want:?}"),
                    });
                }
            }
            self.core.events.push(Event::Opened { epoch });
            summary.sessions += 1;
            let mut steps = 0;
            let mut model = None;
            let ended = match config {
                None => Ok(None),
                Some(cfg) => self.session(epoch, &cfg, &mut model, &mut steps),
            };
            summary.steps += steps;
            self.core.cleanup_model(model);
            self.core.events.push(Event::Closed { epoch, steps });
            match ended? {
                None => return Ok(summary),
                Some(cfg) => announced = Some(cfg),
            }
        }
        Ok(summary)
    }

    /// Prepares, confirms and runs one admitted step.
    fn step(
        &mut self,
        model: &mut dyn StepModel,
        plan: &StepPlan,
        epoch: u64,
        steps: &mut u64,
    ) -> Result<()> {
        if let Err(e) = self.core.prepare(model, plan, epoch) {
            return Err(self.core.announce(e, Owed::Confirmation, epoch, *steps));
        }
        self.core.confirm(State::Go, epoch, *steps)?;
        *steps += 1;
        self.core.events.push(Event::Step { epoch, step: *steps });
        if let Err(e) = self.core.forward(model, plan) {
            return Err(self.core.announce(e, Owed::Admission, epoch, *steps));
        }
        Ok(())
    }

    /// One session; `Some(config)` when a replacement follows.
    fn session(
        &mut self,
        epoch: u64,
        cfg: &SessionConfig,
        model: &mut Option<Box<dyn StepModel>>,
        steps: &mut u64,
    ) -> Result<Option<SessionConfig>> {
        // The build writes the model's memory: a sleep that comes meanwhile waits for it.
        let built = match self.core.gate.enter_step() {
            Ok(()) => {
                let built = self.core.build(cfg, epoch);
                self.core.gate.leave_step();
                built
            }
            Err(reason) => {
                Err(Error::Protocol { op: "open", rank: self.core.rank, epoch, step: 0, reason })
            }
        };
        match built {
            Ok(m) => *model = Some(m),
            Err(e) => return Err(self.core.announce(e, Owed::Admission, epoch, 0)),
        }
        let Some(m) = model.as_mut() else { return Ok(None) };
        let mut first = true;
        loop {
            let timeout =
                if first { self.core.opts.transition_timeout } else { self.core.opts.step_timeout };
            first = false;
            let state = self.core.state();
            let (agreed, msg) = self.core.boundary(state, epoch, *steps, None, timeout)?;
            if agreed.state == State::Stop {
                return Ok(None);
            }
            match msg {
                Some(Message::Step(plan)) => {
                    if plan.step != *steps + 1 {
                        return Err(Error::Desync {
                            op: "plan",
                            rank: self.core.rank,
                            epoch,
                            step: *steps,
                            detail: format!("rank 0 planned step {}", plan.step),
                        });
                    }
                    if let Err(reason) = self.core.gate.enter_step() {
                        let e = Error::Protocol {
                            op: "plan",
                            rank: self.core.rank,
                            epoch,
                            step: *steps,
                            reason,
                        };
                        return Err(self.core.announce(e, Owed::Confirmation, epoch, *steps));
                    }
                    let ran = self.step(m.as_mut(), &plan, epoch, steps);
                    self.core.gate.leave_step();
                    ran?;
                    self.core.recycled = Some(Message::Step(plan));
                }
                Some(Message::Idle) => {}
                Some(Message::Close(SessionDecision::Replace(cfg))) => return Ok(Some(cfg)),
                Some(Message::Close(SessionDecision::Stop)) => return Ok(None),
                other => {
                    return Err(Error::Protocol {
                        op: "admission",
                        rank: self.core.rank,
                        epoch,
                        step: *steps,
                        reason: format!("unexpected message {other:?}"),
                    })
                }
            }
        }
    }
}

mod gate;
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
