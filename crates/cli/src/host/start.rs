//! The host's start: its models load one after another while the API already answers. Each
//! is `loading` until it is measured (awake, then put to sleep and measured asleep), and the
//! budget is checked after each, so a budget that cannot hold some model ends the host with the
//! numbers. A measured model serves at once: between two loads, requests wake the models
//! measured so far as at any other time; each load holds the swap turn and starts with every
//! model that can sleep asleep, since its size is not known before it is measured.

use super::child::{self, Child, ChildSpec};
use super::table::{self, Plan, State};
use super::{Host, HostSpec, ModelSpec, POLL, START_TIMEOUT};
use anyhow::{anyhow, bail, Context, Result};
use session::sleep::QuiesceMode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Starts and measures every model of `spec` into `host`, one at a time, each load holding the
/// swap turn (so no request's wakeup runs beside it) with the models that can sleep asleep;
/// requests for the models measured so far are served between loads.
///
/// # Errors
/// A model does not start or its first sleep fails, a served model cannot sleep before the
/// next load, the host was stopped meanwhile, or the budget cannot hold the models measured so
/// far.
pub(super) fn start_models(
    host: &Arc<Host>,
    spec: &HostSpec,
    runtime: &tokio::runtime::Handle,
) -> Result<()> {
    let verbosity: Vec<&str> = spec.verbosity.iter().map(String::as_str).collect();
    for (i, m) in spec.models.iter().enumerate() {
        if host.stop.load(Ordering::SeqCst) {
            bail!("interrupted while the models started");
        }
        let name = &m.name;
        serve_waiting(host, i);
        // Held until this model is measured and asleep (the end of the iteration).
        let _turn = runtime.block_on(host.swap.lock());
        runtime.block_on(sleep_before_load(host, i))?;
        let child = Child::start(&child_spec(spec, m), &verbosity, START_TIMEOUT, &host.stop)?;
        let child = Arc::new(child);
        *host.children[i].write().unwrap_or_else(|e| e.into_inner()) = Some(child.clone());
        let status = child.status().with_context(|| format!("model `{name}`: its status"))?;
        let awake = child::resident(&status.ranks, false);
        if m.pinned {
            // It never sleeps: all it holds counts, awake.
            let mut table = host.lock();
            let entry = &mut table.models[i];
            entry.state = State::Awake;
            entry.swap_bytes = awake;
            entry.measured = child::resident_by_device(&status.ranks, false);
            // Awake for good: all it holds on each GPU counts, as on the host.
            entry.gpu_swap = child::gpu_bytes(&status.ranks).0;
        } else {
            // Its weights' bytes are what a level-1 backup holds; measured awake, before the
            // first sleep chooses its level.
            host.lock().models[i].backup_bytes = awake;
            let level = host.sleep_level(i);
            let op = child.sleep(level, QuiesceMode::Wait).map_err(|e| {
                anyhow::anyhow!("model `{name}`: the first sleep failed: {}", e.message)
            })?;
            let weights: u64 = op
                .ranks
                .iter()
                .flat_map(|r| &r.tags)
                .filter(|t| t.tag == vmm::Tag::WEIGHTS.as_str())
                .map(|t| t.bytes)
                .sum();
            let mut table = host.lock();
            let entry = &mut table.models[i];
            entry.state = State::Asleep { level: Some(level) };
            entry.asleep_bytes = child::resident(&op.ranks, true);
            entry.measured = child::resident_by_device(&op.ranks, true);
            entry.swap_bytes = op.bytes;
            entry.backup_bytes = weights;
            (entry.gpu_asleep, entry.gpu_swap) = child::gpu_bytes(&op.ranks);
        }
        let mut table = host.lock();
        let gpus: Vec<String> = table.models[i].gpu_swap.keys().cloned().collect();
        for gpu in gpus {
            if table.gpu_budgets.contains_key(&gpu) {
                continue;
            }
            match gpu_total(&gpu) {
                Some(total) => {
                    table.gpu_budgets.insert(gpu, spec.budget_rule.bytes(total));
                }
                None => eprintln!(
                    "tpctl: warning: NVML cannot read GPU {gpu}'s memory: model `{name}`'s memory there is not held to the budget"
                ),
            }
        }
        table::check_fits(spec.budget, &table.gpu_budgets, &table.models[..=i])
            .map_err(anyhow::Error::msg)?;
    }
    let mut table = host.lock();
    table.starting = false;
    if !spec.quiet {
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
        eprintln!(
            "tpctl: model host {}: memory budget {}; {}",
            spec.deployment,
            crate::control::render::bytes(spec.budget),
            summary.join(", ")
        );
    }
    Ok(())
}

/// Before model `next` loads: lets the requests waiting for a model measured so far that can
/// be admitted now take the swap turn first (for at most the drain bound), so that a request
/// waits for its own model's load and the one under way, not for every load after them.
fn serve_waiting(host: &Host, next: usize) {
    let until = Instant::now() + host.drain;
    while Instant::now() < until && !host.stop.load(Ordering::SeqCst) {
        let admissible = {
            let table = host.lock();
            (0..next).any(|j| {
                host.counters[j].waiting.load(Ordering::Relaxed) > 0
                    && !matches!(table.plan(j), Plan::Wait(_) | Plan::Unavailable(_))
            })
        };
        if !admissible {
            return;
        }
        std::thread::sleep(POLL);
    }
}

/// Puts every model a request woke (pinned ones aside) back to sleep before model `loading`
/// loads: running requests drain first, within the drain bound, then are paused (`keep`).
/// Called with the swap turn held.
async fn sleep_before_load(host: &Arc<Host>, loading: usize) -> Result<()> {
    let awake: Vec<usize> = {
        let table = host.lock();
        (0..table.models.len())
            .filter(|&j| !table.models[j].pinned && table.models[j].state == State::Awake)
            .collect()
    };
    if awake.is_empty() {
        return Ok(());
    }
    let deadline = tokio::time::Instant::now() + host.drain + START_TIMEOUT;
    let slept: Result<()> = async {
        let busy = host.drain(&awake, deadline).await.map_err(|r| anyhow!(r.message))?;
        for &j in &awake {
            let keep = busy.contains(&j);
            host.swap_out(j, loading, keep).await.map_err(|r| anyhow!(r.message))?;
        }
        Ok(())
    }
    .await;
    for model in &mut host.lock().models {
        model.draining = false;
    }
    slept.with_context(|| format!("before model `{}` loads", host.name(loading)))
}

/// What starts model `m`'s deployment.
pub(super) fn child_spec(spec: &HostSpec, m: &ModelSpec) -> ChildSpec {
    ChildSpec {
        name: m.name.clone(),
        model: m.model.clone(),
        deployment: format!("{}-{}", spec.deployment, m.name),
        args: m.args.clone(),
        env: m.env.clone(),
    }
}

/// The total memory of the GPU a probe calls `id` (its UUID, or `HOST:nvmlINDEX` where NVML
/// gave none), as NVML reads it; `None` where NVML cannot.
fn gpu_total(id: &str) -> Option<u64> {
    let device = match id.rsplit_once(":nvml") {
        Some((_, index)) => vmm::NvmlDevice::Index(index.parse().ok()?),
        None => vmm::NvmlDevice::Uuid(id.to_owned()),
    };
    vmm::NvmlMemory::new().ok()?.usage(&device).ok().map(|u| u.total)
}
