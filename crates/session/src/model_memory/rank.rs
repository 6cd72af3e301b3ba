//! The control plane's view of a rank's model memory: [`ModelRankMemory`] releases and
//! restores the host and device allocations of [`ModelMemory`] as the sleep protocol asks.

use super::{runtime, ModelMemory, Restore};
use crate::sleep::{MemoryError, Probe, RankMemory, Refusal, TagReceipt, VmmMemory};
use std::sync::{Arc, Mutex, PoisonError};
use tensor::kernels::Backend;

/// The control plane's view of one rank's model memory ([`RankMemory`]): the tagged host
/// allocations and, on a GPU, the device ones, with NVML's reading of the device in the probes,
/// and what the compute backend holds outside them under the tags of [`runtime`].
/// A sleep of `weights` also clears the CUDA backend's weight cache (its pool memory goes back
/// to the device, its arena regions lose their contents), and a wakeup that restores them says
/// the host bytes changed ([`tensor::memory::weights_changed`]), so the device copies are
/// written again from the restored host weights at their next use.
pub struct ModelRankMemory {
    host: VmmMemory,
    device: Option<VmmMemory>,
    backend: Backend,
    memory: ModelMemory,
    /// The device resources of the rank's groups (NCCL communicators), for the `nccl` tag.
    comms: Vec<Arc<dyn collectives::DeviceResources>>,
    /// Per tag, how its latest sleep left its contents to come back (for the wakeup's
    /// receipt).
    pending: Mutex<std::collections::BTreeMap<String, Restore>>,
}

impl std::fmt::Debug for ModelRankMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRankMemory")
            .field("host", &self.host)
            .field("device", &self.device)
            .field("backend", &self.backend.device())
            .finish()
    }
}

impl ModelRankMemory {
    /// The memory of `memory`'s allocations, for a model computing on `backend`.
    pub fn new(memory: &ModelMemory, backend: Backend) -> ModelRankMemory {
        let manager = memory.manager().clone();
        let (host, device) = match backend.device() {
            tensor::Device::Cuda(ordinal) => {
                let device = nvml_device(ordinal, &backend);
                (
                    VmmMemory::with_device(manager, device.clone()),
                    memory.device_for(&backend).map(|m| VmmMemory::new(m.clone(), Some(device))),
                )
            }
            _ => (VmmMemory::new(manager, None), None),
        };
        ModelRankMemory {
            host,
            device,
            backend,
            memory: memory.clone(),
            comms: Vec::new(),
            pending: Mutex::default(),
        }
    }

    /// Releases and restores `comms` (the device resources of the rank's groups:
    /// [`collectives::ParallelContext::device_resources`]) under the `nccl` tag.
    pub fn with_communicators(mut self, comms: Vec<Arc<dyn collectives::DeviceResources>>) -> Self {
        self.comms = comms;
        self
    }

    fn runtime(&self) -> runtime::Runtime<'_> {
        runtime::Runtime { backend: &self.backend, comms: &self.comms }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, Restore>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// NVML's name of the GPU that CUDA calls `ordinal`: its UUID as the driver reads it from
/// `backend` (so NVML finds it whatever the numbering, a MIG instance included), else the
/// ordinal through `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` ([`vmm::nvml_device_for`],
/// logged when that is a guess), else the ordinal as an NVML index.
pub(super) fn nvml_device(ordinal: usize, backend: &Backend) -> vmm::NvmlDevice {
    let uuid = match backend {
        Backend::Cuda(gpu) => gpu.describe().ok().map(|d| d.uuid),
        _ => None,
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let order = std::env::var("CUDA_DEVICE_ORDER").ok();
    let (device, warning) =
        vmm::nvml_device_for(ordinal, uuid.as_deref(), visible.as_deref(), order.as_deref());
    if let Some(warning) = warning {
        tracing::warn!("{warning}");
    }
    device.unwrap_or(vmm::NvmlDevice::Index(u32::try_from(ordinal).unwrap_or(u32::MAX)))
}

/// `more` added into `into`, tag by tag (both list the same tags, in the same order).
pub(super) fn merge(into: &mut [TagReceipt], more: Vec<TagReceipt>) {
    for m in more {
        if let Some(t) = into.iter_mut().find(|t| t.tag == m.tag) {
            t.allocations += m.allocations;
            t.bytes += m.bytes;
            t.device_bytes += m.device_bytes;
            t.copied_bytes += m.copied_bytes;
            t.elapsed_us += m.elapsed_us;
        }
    }
}

/// `tags` split into the runtime's (see [`runtime`]) and those of tagged memory.
fn split(tags: &[String]) -> (Vec<&str>, Vec<String>) {
    let runtime = tags.iter().map(String::as_str).filter(|t| runtime::is_runtime(t)).collect();
    let tagged = tags.iter().filter(|t| !runtime::is_runtime(t)).cloned().collect();
    (runtime, tagged)
}

/// `receipts` in the order of `tags` (one per distinct tag).
fn in_order(tags: &[String], mut receipts: Vec<TagReceipt>) -> Vec<TagReceipt> {
    let mut ordered = Vec::with_capacity(receipts.len());
    for t in tags {
        if let Some(i) = receipts.iter().position(|r| &r.tag == t) {
            ordered.push(receipts.swap_remove(i));
        }
    }
    ordered.extend(receipts);
    ordered
}

impl RankMemory for ModelRankMemory {
    fn check(&self, tags: &[String]) -> Result<(), Refusal> {
        self.host.check(&split(tags).1)
    }

    fn release(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        self.release_at(tags, None)
    }

    fn release_at(
        &self,
        tags: &[String],
        level: Option<u8>,
    ) -> Result<Vec<TagReceipt>, MemoryError> {
        let (asked, tagged) = split(tags);
        // What the runtime holds goes first, graphs before the workspaces they name: nothing
        // of it needs undoing when the rest fails (the steps make it again).
        let mut receipts = Vec::new();
        for t in runtime::RUNTIME_TAGS.into_iter().filter(|t| asked.contains(t)) {
            let released = self.runtime().release(t).map_err(|e| MemoryError {
                // What was released before it is a change the undo must see.
                changed: e.changed || !receipts.is_empty(),
                ..e
            })?;
            receipts.push(released);
        }
        if tagged.is_empty() {
            return Ok(in_order(tags, receipts));
        }
        if let Backend::Cuda(gpu) = &self.backend {
            if tagged.iter().any(|t| t == vmm::Tag::WEIGHTS.as_str()) {
                // The weights' device copies in pool memory are freed, and with them the
                // graphs and workspaces, which name them.
                gpu.clear_weight_cache();
            }
        }
        let backups: Vec<(vmm::Tag, vmm::BackupStore)> = match level {
            Some(1) => self
                .memory
                .level_one
                .iter()
                .map(|t| (t.clone(), vmm::BackupStore::Default))
                .collect(),
            _ => Vec::new(),
        };
        let mut released = self.host.release_with(&tagged, &backups).map_err(|e| MemoryError {
            // Released runtime memory is a change the undo must see too.
            changed: e.changed || !receipts.is_empty(),
            ..e
        })?;
        if let Some(device) = &self.device {
            // The host memory is released already: the caller undoes both.
            let more = device.release(&tagged).map_err(|e| MemoryError { changed: true, ..e })?;
            merge(&mut released, more);
        }
        let mut pending = self.pending();
        for r in &mut released {
            let backed_up = backups.iter().any(|(t, _)| t.as_str() == r.tag);
            let restore =
                if backed_up { Some(Restore::Backup) } else { self.memory.restore_of(&r.tag) };
            if let Some(restore) = restore {
                r.restore = restore.name().to_owned();
                pending.insert(r.tag.clone(), restore);
            }
        }
        receipts.extend(released);
        Ok(in_order(tags, receipts))
    }

    fn materialize(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        let (asked, tagged) = split(tags);
        let mut receipts =
            if tagged.is_empty() { Vec::new() } else { self.materialize_tagged(&tagged)? };
        for t in asked {
            let made = self.runtime().materialize(t);
            receipts.push(made.map_err(|e| MemoryError { changed: true, ..e })?);
        }
        Ok(in_order(tags, receipts))
    }

    fn prepare_update(&self, model: &str) -> Result<(), Refusal> {
        self.memory.prepare_update(model)
    }

    fn prepare_update_with(&self, update: &crate::sleep::WeightUpdate) -> Result<(), Refusal> {
        self.memory.prepare_update_with(&update.model, &update.tensors)
    }

    fn update(&self) -> Result<Vec<TagReceipt>, MemoryError> {
        let written = self.memory.update()?;
        // Weights replaced while asleep come back by reload, not from a level-1 backup.
        self.pending().remove(vmm::Tag::WEIGHTS.as_str());
        Ok(self.written_and_prepared("weight update", written))
    }

    fn revert(&self) -> Result<Vec<TagReceipt>, MemoryError> {
        let written = self.memory.revert()?;
        self.pending().remove(vmm::Tag::WEIGHTS.as_str());
        Ok(self.written_and_prepared("rollback", written))
    }

    fn drop_update(&self) {
        self.memory.drop_update();
    }

    fn probe(&self) -> Probe {
        self.host.probe()
    }
}

impl ModelRankMemory {
    /// Maps the tagged memory of `tags` again and restores it.
    fn materialize_tagged(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        let restored = self.host.materialize(tags);
        let weights = tags.iter().any(|t| t == vmm::Tag::WEIGHTS.as_str());
        if weights {
            // The weights' bytes were restored (reloaded, zeroed, read back) under their old
            // addresses, or partly so on a failure: no device copy of them is current.
            tensor::memory::weights_changed();
        }
        let mut receipts = restored?;
        if let Some(device) = &self.device {
            let more = device.materialize(tags).map_err(|e| MemoryError { changed: true, ..e })?;
            merge(&mut receipts, more);
        }
        if weights {
            self.prepare_device("wakeup", &mut receipts);
        }
        let mut pending = self.pending();
        for r in &mut receipts {
            let restore = pending.remove(&r.tag).or_else(|| self.memory.restore_of(&r.tag));
            r.restore = restore.map(|x| x.name().to_owned()).unwrap_or_default();
        }
        Ok(receipts)
    }

    /// Runs the registered device preparation (see [`ModelMemory::set_device_preparation`]),
    /// adding its time to the weights' receipt in `receipts`: the `what` (a wakeup, an update)
    /// ends when the model is usable, so the first request does not make the weights' device
    /// copies. A failure is logged; the first use then makes them.
    fn prepare_device(&self, what: &str, receipts: &mut [TagReceipt]) {
        let Some(prepare) = self.memory.device_preparation() else { return };
        let started = std::time::Instant::now();
        if let Err(e) = prepare() {
            tracing::warn!(
                "making the device copies of the weights after the {what}: {e} (the first \
                 request makes them)"
            );
        }
        let spent = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        if let Some(r) = receipts.iter_mut().find(|r| r.tag == vmm::Tag::WEIGHTS.as_str()) {
            r.elapsed_us = r.elapsed_us.saturating_add(spent);
        }
    }

    /// The receipt of an update or a rollback that wrote `written` bytes, after the device
    /// copies of weights written into the live buffers were made again (weights swapped into
    /// new buffers are the engine's to take at its next step; nothing is written while
    /// asleep).
    fn written_and_prepared(&self, what: &str, written: u64) -> Vec<TagReceipt> {
        let mut receipts = vec![self.weights_written(written)];
        if written > 0 && !self.memory.swap_pending() {
            self.prepare_device(what, &mut receipts);
        }
        receipts
    }

    /// The receipt of weights replaced in place: `written` bytes copied (none while asleep).
    /// The GPU's copies of the old ones need no clear: the write bumped the weights generation
    /// (`Placed::write`), so each is written again, into the same device memory, at its next
    /// use; weights swapped into new buffers are dropped with the model's old ones.
    fn weights_written(&self, written: u64) -> TagReceipt {
        TagReceipt {
            tag: vmm::Tag::WEIGHTS.as_str().to_owned(),
            allocations: usize::from(written > 0),
            bytes: written,
            copied_bytes: written,
            restore: "reload".into(),
            ..TagReceipt::default()
        }
    }
}
