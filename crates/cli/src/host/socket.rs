//! The host's own control socket (deployment `HOST`) and what keeps its table true to the
//! models' deployments.
//!
//! - The socket answers `status` with the host's table ([`HostWire`]: each model's state,
//!   resident bytes, live checkpoint, requests in flight and queued), so `tpctl status` with
//!   no deployment shows it; `restart {deployment}` starts a failed model again (`tpctl
//!   restart --deployment HOST-NAME`); `stop` stops the host; every other method is refused,
//!   naming the models' deployments, whose own sockets take it.
//! - [`Host::follow`] reads each settled model's state from its deployment, so a model put to
//!   sleep or woken by hand (`tpctl sleep/wakeup --deployment HOST-NAME`) is booked as its
//!   deployment reports it, not as the host last left it.
//! - [`Host::revive_kept`] wakes a model whose requests a keep sleep paused, as soon as that
//!   needs no other model's requests paused.

use super::{child, Host, Plan, Refusal, State};
use crate::control::{ErrorWire, Handler, HostModelWire, HostWire, Reply, Request};
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How long the host waits for a model's status when it follows its deployment.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(5);

/// The requests of the host's control socket, served with `runtime` for the swaps.
pub(super) fn handler(host: Arc<Host>, runtime: tokio::runtime::Handle) -> Handler {
    Arc::new(move |request: &Request| {
        match request {
        Request::Status => Reply { ok: true, host: Some(host.wire()), ..Reply::default() },
        Request::Stop => Reply { ok: true, stopping: Some(true), ..Reply::default() },
        Request::Restart(args) => {
            let Some(index) = host
                .specs
                .iter()
                .position(|c| c.deployment == args.deployment || c.name == args.deployment)
            else {
                return Reply::refused(format!(
                    "model host `{}` has no model `{}`: its models are {}",
                    host.deployment,
                    args.deployment,
                    host.deployments()
                ));
            };
            match runtime.block_on(host.restart_by_hand(index)) {
                Ok(()) => Reply { ok: true, host: Some(host.wire()), ..Reply::default() },
                Err(e) => Reply { ok: false, error: Some(e), ..Reply::default() },
            }
        }
        other => Reply::refused(format!(
            "`{}` is a model host: `{}` goes to one of its models, --deployment {} (`tpctl status` with no deployment shows the host's table)",
            host.deployment,
            other.method(),
            host.deployments()
        )),
    }
    })
}

impl Host {
    /// The models' deployments, for messages: `h-a, h-b`.
    fn deployments(&self) -> String {
        self.specs.iter().map(|c| c.deployment.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// The host's table on the wire.
    pub(super) fn wire(&self) -> HostWire {
        let table = self.lock().clone();
        let models = table
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| HostModelWire {
                name: m.name.clone(),
                deployment: self.specs[i].deployment.clone(),
                state: m.state.name().to_owned(),
                sleep_level: match m.state {
                    State::Asleep { level } => level,
                    _ => None,
                },
                failure: match &m.state {
                    State::Failed(why) => Some(why.clone()),
                    _ => None,
                },
                resident_bytes: m.resident(),
                checkpoint: m.checkpoint.clone(),
                in_flight: m.in_flight,
                queued: self.counters[i].waiting.load(Ordering::Relaxed),
                pinned: m.pinned,
            })
            .collect();
        HostWire {
            deployment: self.deployment.clone(),
            memory_budget_bytes: table.budget,
            resident_bytes: table.resident(),
            models,
        }
    }

    /// `tpctl restart`: starts the failed model `index` again (making room as a wakeup does),
    /// even after a restart failed.
    ///
    /// # Errors
    /// The model has not failed (a client error), or its start failed.
    async fn restart_by_hand(self: &Arc<Self>, index: usize) -> Result<(), ErrorWire> {
        let name = self.name(index).to_owned();
        let deadline = tokio::time::Instant::now() + self.wait;
        let Ok(_turn) = tokio::time::timeout_at(deadline, self.swap.lock()).await else {
            return Err(ErrorWire {
                message: format!(
                    "model `{name}`: other models' swaps still run after {:.0} s: try again",
                    self.wait.as_secs_f64()
                ),
                ..ErrorWire::default()
            });
        };
        {
            let mut table = self.lock();
            let model = &mut table.models[index];
            if !matches!(model.state, State::Failed(_)) {
                return Err(ErrorWire::client(format!(
                    "model `{name}` is {}, not failed: `tpctl restart` starts a failed model again",
                    model.state
                )));
            }
            model.restartable = true;
        }
        match self.swap_in(index, deadline).await {
            Ok(_) => Ok(()),
            Err(Refusal { message, .. }) => Err(ErrorWire { message, ..ErrorWire::default() }),
        }
    }

    /// Books each settled model (not loading, failed or in a swap of the host's: those hold
    /// the swap turn, which this takes) as its deployment reports it: a model put to sleep or
    /// woken by hand is seen so. Blocking: a status call per model.
    pub(super) fn follow(&self) {
        let Ok(_turn) = self.swap.try_lock() else { return };
        if self.lock().starting {
            return;
        }
        for i in 0..self.children.len() {
            let Some(child) = self.child(i) else { continue };
            let before = self.lock().models[i].state.clone();
            if matches!(before, State::Loading | State::Failed(_)) {
                continue;
            }
            // A deployment that does not answer is left to `check_children`.
            let Ok(status) = child.status_within(FOLLOW_TIMEOUT) else { continue };
            let seen = match status.state.as_str() {
                "running" => State::Awake,
                "sleeping" => match before {
                    State::Asleep { level } => State::Asleep { level },
                    _ => State::Asleep { level: None },
                },
                "waking" => State::Waking,
                "failed" => State::Failed(status.reason.unwrap_or_default()),
                _ => continue,
            };
            let mut table = self.lock();
            if let Some(checkpoint) = status.checkpoint {
                table.models[i].checkpoint = checkpoint;
            }
            if !status.ranks.is_empty() && status.failures.is_empty() {
                table.models[i].measured = child::resident_by_device(&status.ranks, false);
            }
            if table.models[i].state.name() == seen.name() {
                continue;
            }
            let _ = writeln!(
                std::io::stderr(),
                "tpctl: model `{}` is {seen} by its deployment's account (booked {before}): following it",
                self.name(i)
            );
            if seen == State::Awake {
                // Woken by hand: the wakeup continued any requests a keep sleep paused.
                table.models[i].kept = false;
            }
            table.models[i].state = seen;
            if table.resident() > table.budget {
                let _ = writeln!(
                    std::io::stderr(),
                    "tpctl: warning: the models hold {} of the --memory-budget {}: a model was woken outside the host",
                    crate::control::render::bytes(table.resident()),
                    crate::control::render::bytes(table.budget)
                );
            }
        }
    }

    /// Wakes each model asleep with requests a keep sleep paused, when there is room for it
    /// without pausing another model's requests (a task each, in the swap order).
    pub(super) fn revive_kept(self: &Arc<Self>) {
        for i in 0..self.children.len() {
            let due = {
                let table = self.lock();
                let m = &table.models[i];
                m.kept
                    && matches!(m.state, State::Asleep { .. })
                    && matches!(table.plan(i), Plan::Swap { .. })
            };
            if !due || self.reviving[i].swap(true, Ordering::SeqCst) {
                continue;
            }
            let host = self.clone();
            tokio::spawn(async move {
                host.revive(i).await;
                host.reviving[i].store(false, Ordering::SeqCst);
            });
        }
    }

    async fn revive(self: &Arc<Self>, index: usize) {
        let deadline = tokio::time::Instant::now() + self.wait;
        let Ok(_turn) = tokio::time::timeout_at(deadline, self.swap.lock()).await else { return };
        let plan = self.lock().plan(index);
        let Plan::Swap { evict } = plan else { return };
        for victim in evict {
            if self.swap_out(victim, index, false).await.is_err() {
                return;
            }
        }
        // A failure is booked and counted by the wakeup; the next tick tries again.
        let _ = self.wake(index).await;
    }
}
