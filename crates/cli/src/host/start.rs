//! The host's start: its models load one after another while the API already answers (each
//! `loading` until it is measured); each is measured awake, put to sleep and measured asleep,
//! and the budget is checked after each, so a budget that cannot hold some model ends the host
//! with the numbers.

use super::child::{self, Child, ChildSpec};
use super::table::{self, State};
use super::{Host, HostSpec, ModelSpec, START_TIMEOUT};
use anyhow::{bail, Context, Result};
use session::sleep::QuiesceMode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Starts and measures every model of `spec` into `host`, then opens the budget's arithmetic
/// to requests.
///
/// # Errors
/// A model does not start or its first sleep fails, the host was stopped meanwhile, or the
/// budget cannot hold the models measured so far.
pub(super) fn start_models(host: &Host, spec: &HostSpec) -> Result<()> {
    let verbosity: Vec<&str> = spec.verbosity.iter().map(String::as_str).collect();
    for (i, m) in spec.models.iter().enumerate() {
        if host.stop.load(Ordering::SeqCst) {
            bail!("interrupted while the models started");
        }
        let name = &m.name;
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
