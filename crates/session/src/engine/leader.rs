//! Rank 0's engine: the scheduler, the tokenizer and the sinks, and the plan of every step all
//! ranks run.

use super::*;

/// How often an idle rank 0 looks at its gate and stop flag while it waits for a request.
const GATE_POLL: Duration = Duration::from_millis(2);

/// How a session's loop ended.
enum Ended {
    /// Every rank leaves the engine.
    Stop,
    /// A new session follows.
    Replace(SessionConfig, Vec<Request>),
}

/// Rank 0's engine: owns the scheduler, the tokenizer, the output and metrics sinks, and
/// decides what every rank runs (the model runner samples, where its logits are).
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

    core_accessors!();

    /// Runs `requests` together in a session of `config`; when its model work ends (every
    /// request finished, or `max_steps`) `decider` says what follows. Consumes the process
    /// groups: shut down together on success, dropped on failure. After a failure the failed
    /// session's model is torn down when the leader is dropped, not before the error returns.
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
                self.cancel_unopened(&mut s, std::mem::take(&mut requests));
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
                // A stop agreed where rank 0 closed the session for a replacement.
                if let Some(requests) = replacement.take() {
                    self.cancel_unopened(s, requests);
                }
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
        s.text = Text { codec };
        let sched = Scheduler::new(config.token_budget, config.max_batch, model.context_len(), eos);
        s.sched = Some(match model.kv_layout() {
            Some(layout) => sched.with_kv(layout),
            None => sched,
        });
        s.model = Some(model);
        self.output.opened();
        for r in requests {
            self.admit(s, r)?;
        }
        Ok(())
    }

    fn admit(&mut self, s: &mut LeaderSession, r: Request) -> Result<()> {
        let Some(sched) = s.sched.as_mut() else { return Ok(()) };
        if let Some(done) = sched.add(r, s.text.codec(), s.epoch)? {
            s.finished += 1;
            emit(self.output.as_mut(), &[done], s.epoch, s.steps)?;
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
        // The step's scheduling time: this call less its waits for a request to arrive.
        let started = Instant::now();
        let mut waited = Duration::ZERO;
        if let Some(sched) = s.sched.as_mut() {
            for e in sched.take_cancelled() {
                s.finished += 1;
                emit(self.output.as_mut(), &[e], s.epoch, s.steps)?;
            }
        }
        if let Some(inbox) = inbox.filter(|_| !limit) {
            // Requests that arrived during the last step join now.
            while let Ok(r) = inbox.try_recv() {
                self.admit(s, r)?;
            }
            let idle = !s.sched.as_ref().is_some_and(Scheduler::has_work);
            if idle {
                let since = Instant::now();
                let arrived = self.next_request(inbox);
                waited += since.elapsed();
                match arrived {
                    Ok(r) => {
                        self.admit(s, r)?;
                        while let Ok(r) = inbox.try_recv() {
                            self.admit(s, r)?;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    // No sender left: nothing will arrive, but the ticks keep their pace.
                    Err(RecvTimeoutError::Disconnected) => {
                        std::thread::sleep(self.core.opts.tick);
                        waited += self.core.opts.tick;
                    }
                }
            }
        }
        if !limit {
            if let Some(plan) = s.sched.as_mut().and_then(|q| q.plan(s.epoch, s.steps + 1)) {
                s.schedule = started.elapsed().saturating_sub(waited);
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

    /// The next request from `inbox`, waiting at most a tick while nothing runs. The wait
    /// looks at the gate and the stop flag every [`GATE_POLL`], so a sleep (or a stop) asked of
    /// an idle engine is taken up within that, not at the end of the tick.
    fn next_request(&self, inbox: &Receiver<Request>) -> Result<Request, RecvTimeoutError> {
        let deadline = Instant::now() + self.core.opts.tick;
        loop {
            let now = Instant::now();
            let slice = deadline.saturating_duration_since(now).min(GATE_POLL);
            match inbox.recv_timeout(slice) {
                Err(RecvTimeoutError::Timeout)
                    if Instant::now() < deadline
                        && self.core.gate.request().is_none()
                        && !self.core.stop.is_requested() => {}
                arrived => return arrived,
            }
        }
    }

    /// What rank 0 sends while a sleep quiesces the engine (see [`gate`]): with `wait` the
    /// running requests go on (no new one is admitted), with `abort` they fail, with `keep`
    /// they pause; then the engine parks and only idle ticks run until the gate opens.
    fn quiesced_message(&mut self, s: &mut LeaderSession, mode: QuiesceMode) -> Result<Message> {
        // The gate's own state, never a copy: a wakeup and the next sleep may both land
        // between two boundaries.
        if self.core.gate.is_parked() {
            // Until the tick ends, or at once when the gate opens: a wakeup's first request
            // does not wait for the rest of a tick.
            self.core.gate.wait_parked(self.core.opts.tick);
            return Ok(Message::Idle);
        }
        let Some(sched) = s.sched.as_mut() else {
            self.core.gate.park();
            return Ok(Message::Idle);
        };
        match mode {
            QuiesceMode::Wait => {
                let started = Instant::now();
                if let Some(plan) = sched.plan(s.epoch, s.steps + 1) {
                    s.schedule = started.elapsed();
                    return Ok(Message::Step(plan));
                }
            }
            QuiesceMode::Abort => {
                for e in sched.abort_all() {
                    s.finished += 1;
                    emit(self.output.as_mut(), &[e], s.epoch, s.steps)?;
                }
            }
            QuiesceMode::Keep => {}
        }
        self.core.gate.park();
        Ok(Message::Idle)
    }

    /// Runs an admitted step on rank 0: prepare, confirm, model (which samples), scheduler
    /// bookkeeping, sinks.
    fn step(&mut self, s: &mut LeaderSession, plan: StepPlan, t0: Instant) -> Result<()> {
        let epoch = s.epoch;
        let (Some(model), Some(sched)) = (s.model.as_mut(), s.sched.as_mut()) else {
            return Ok(());
        };
        if let Err(e) = self.core.prepare(model.as_mut(), &plan, epoch) {
            return Err(self.core.announce(e, Owed::Confirmation, epoch, s.steps));
        }
        self.core.confirm(State::Go, epoch, s.steps)?;
        for request in sched.take_started() {
            self.output.scheduled(request);
        }
        let agreement = t0.elapsed();
        s.steps += 1;
        self.core.events.push(Event::Step { epoch, step: s.steps });
        let t1 = Instant::now();
        let forwarded = self.core.forward(model.as_mut(), &plan);
        let forward = t1.elapsed();
        let sample = model.sampling_time().min(forward);
        let t2 = Instant::now();
        let result = forwarded.and_then(|sampled| {
            // A prompt's log-probabilities go out before its first token.
            let mut emitted = sched.prompt_logprobs(model.take_prompt_logprobs());
            let tokens = sched.apply(&plan, sampled.unwrap_or_default());
            emitted.extend(tokens.map_err(|reason| Error::Model {
                phase: "step",
                rank: 0,
                epoch,
                step: plan.step,
                source: reason.into(),
            })?);
            Ok(emitted)
        });
        let update = t2.elapsed();
        let model_time = t1.elapsed();
        let emitted = match result {
            Ok(e) => e,
            Err(e) => return Err(self.core.announce(e, Owed::Admission, epoch, s.steps)),
        };
        let t3 = Instant::now();
        let sunk = injected("output sink", "session.sink", 0, epoch, plan.step).and_then(|()| {
            s.finished +=
                emitted.iter().filter(|e| matches!(e, Emit::Finished { .. })).count() as u64;
            emit(self.output.as_mut(), &emitted, epoch, plan.step)
        });
        if let Err(e) = sunk {
            return Err(self.core.announce(e, Owed::Admission, epoch, s.steps));
        }
        let phases = StepPhases {
            schedule: std::mem::take(&mut s.schedule),
            forward: forward - sample,
            sample,
            update,
            emit: t3.elapsed(),
        };
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
            phases,
        });
        Ok(())
    }

    /// Ends the requests of a session that will not open (a stop was agreed at the boundary
    /// where rank 0 closed the session for its replacement, or at the replacement's open):
    /// each is reported cancelled, never dropped without a word.
    fn cancel_unopened(&mut self, s: &mut LeaderSession, requests: Vec<Request>) {
        let cancelled: Vec<Emit> = requests
            .into_iter()
            .map(|r| Emit::Finished {
                request: r.id,
                reason: FinishReason::Cancelled,
                tokens: Vec::new(),
            })
            .collect();
        s.finished += cancelled.len() as u64;
        // As at cleanup: the session never ran, so a sink failure has no step left to fail.
        let _ = emit(self.output.as_mut(), &cancelled, s.epoch, 0);
    }

    /// The fixed cleanup order (see the module docs); no collective.
    fn cleanup(&mut self, mut s: LeaderSession, success: bool) {
        let cancelled = s.sched.as_mut().map(Scheduler::cancel_all).unwrap_or_default();
        if success {
            // The session is over: a sink failure now has no step left to fail.
            let _ = emit(self.output.as_mut(), &cancelled, s.epoch, s.steps);
        }
        let (epoch, steps) = (s.epoch, s.steps);
        let model = s.model.take();
        self.core.retire_model(model, success);
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
    /// The scheduling time of the step about to run ([`StepPhases::schedule`]).
    schedule: Duration,
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
            schedule: Duration::ZERO,
            model: None,
            sched: None,
            text: Text::default(),
        }
    }
}

/// Rank 0's tokenizer: it encodes text prompts and names the stop tokens; the sink decodes
/// the output ([`OutputSink::token`]).
#[derive(Default)]
struct Text {
    codec: Option<Box<dyn TextCodec>>,
}

impl Text {
    fn codec(&self) -> Option<&dyn TextCodec> {
        self.codec.as_deref()
    }
}

/// Hands `events` to the sink in order, telling it which token is a request's last (its
/// `Finished` follows in the same events).
fn emit(out: &mut dyn OutputSink, events: &[Emit], epoch: u64, step: u64) -> Result<()> {
    let sink = |source| Error::Sink { what: "output sink", epoch, step, source };
    for (i, e) in events.iter().enumerate() {
        match e {
            Emit::Token { request, token, logprobs } => {
                let last = events[i + 1..]
                    .iter()
                    .any(|f| matches!(f, Emit::Finished { request: r, .. } if r == request));
                out.token(*request, *token, last, logprobs.as_ref()).map_err(sink)?;
            }
            Emit::PromptLogprobs { request, start, tokens } => {
                out.prompt_logprobs(*request, *start, tokens).map_err(sink)?;
            }
            Emit::Finished { request, reason, tokens } => {
                out.finished(*request, *reason, tokens).map_err(sink)?;
            }
        }
    }
    Ok(())
}
