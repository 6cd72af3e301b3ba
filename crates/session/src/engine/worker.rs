//! The engine of every rank but 0: it runs what rank 0's plans say.

use super::*;

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

    core_accessors!();

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
            self.core.retire_model(model, ended.is_ok());
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
