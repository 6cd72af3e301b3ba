//! Where a rank's model lives: its weights and its KV caches in [`vmm`] allocations tagged
//! `weights` and `kv_cache`, so that a sleep can give their physical memory back and a wakeup
//! can map it again at the same addresses.
//!
//! - Weights: one allocation per model shard, sized by [`ParallelModel::weight_bytes`] and cut
//!   into the model's buffers in [`ParallelModel::weight_buffers`] order. Restored by
//!   [`Restore::Reload`] (the shard is loaded again from the checkpoint and written into the
//!   same bytes), [`Restore::Backup`] (a spill file) or, useless for weights but allowed,
//!   [`Restore::Discard`] / [`Restore::Zero`].
//! - KV cache: one allocation per sequence, sized by [`ParallelModel::cache_bytes`]. Its pages
//!   are committed when the sequence starts (as a GPU cache is preallocated), so the bytes a
//!   receipt reports are bytes the rank really held. [`Restore::Discard`] (the default) makes
//!   the engine recompute paused sequences after the wakeup (see [`crate::Gate`]).
//!
//! Access to this memory is unchecked (plain slices, as kernels need): the engine's gate
//! guarantees that no step runs while it is released.

use crate::sleep::{MemoryError, Probe, RankMemory, TagReceipt, VmmMemory};
use layers::model::WeightForm;
use layers::parallel::{ParallelCache, ParallelModel, Placement};
use layers::tensor::ExternalMemory;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use layers::memory::ALIGN;

/// How the contents of a tag come back after a wakeup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restore {
    /// Undefined (the KV cache: paused sequences are recomputed).
    Discard,
    /// Zeros.
    Zero,
    /// Copied to a spill file before the sleep and back after the wakeup.
    Backup,
    /// Loaded again from the model file (weights only).
    Reload,
}

impl Restore {
    /// Whether a wakeup brings the contents back.
    pub fn keeps_contents(self) -> bool {
        matches!(self, Restore::Backup | Restore::Reload)
    }

    /// The vmm policy, except for [`Restore::Reload`] (`None`), which needs its source.
    fn policy(self) -> Option<vmm::Policy> {
        match self {
            Restore::Discard => Some(vmm::Policy::Discard),
            Restore::Zero => Some(vmm::Policy::Zero),
            Restore::Backup => Some(vmm::Policy::Backup(vmm::Store::Spill)),
            Restore::Reload => None,
        }
    }
}

/// The memory of one rank's model: the vmm manager and the restore policy per tag.
#[derive(Clone, Debug)]
pub struct ModelMemory {
    manager: Arc<vmm::Manager>,
    weights: Restore,
    kv_cache: Restore,
    /// The policy of every KV-cache allocation.
    kv_policy: vmm::Policy,
}

impl ModelMemory {
    /// Weights and KV caches in allocations of `manager` (the tags are defined now, so a
    /// sleep of a tag with no allocation yet is valid and releases nothing).
    ///
    /// # Errors
    /// [`Restore::Reload`] for the KV cache (there is nothing to reload it from).
    pub fn new(
        manager: Arc<vmm::Manager>,
        weights: Restore,
        kv_cache: Restore,
    ) -> Result<ModelMemory, String> {
        let kv_policy = kv_cache.policy().ok_or_else(|| {
            "the KV cache cannot be reloaded: use discard, zero or backup".to_owned()
        })?;
        for tag in [vmm::Tag::WEIGHTS, vmm::Tag::KV_CACHE] {
            manager.define_tag(tag).map_err(|e| e.to_string())?;
        }
        Ok(ModelMemory { manager, weights, kv_cache, kv_policy })
    }

    /// Host memory (a CPU manager spilling backups to `spill_dir`, default
    /// [`vmm::default_spill_dir`]).
    ///
    /// # Errors
    /// The manager cannot be built, or see [`ModelMemory::new`].
    pub fn host(
        spill_dir: Option<PathBuf>,
        weights: Restore,
        kv_cache: Restore,
    ) -> Result<ModelMemory, String> {
        let dir = spill_dir.unwrap_or_else(vmm::default_spill_dir);
        let manager = vmm::Manager::builder()
            .spill_dir(&dir)
            .build()
            .map_err(|e| format!("memory manager (spill dir {}): {e}", dir.display()))?;
        ModelMemory::new(Arc::new(manager), weights, kv_cache)
    }

    /// The manager.
    pub fn manager(&self) -> &Arc<vmm::Manager> {
        &self.manager
    }

    /// The tags whose contents a wakeup does not bring back.
    pub fn lossy_tags(&self) -> Vec<String> {
        [(vmm::Tag::WEIGHTS, self.weights), (vmm::Tag::KV_CACHE, self.kv_cache)]
            .into_iter()
            .filter(|(_, r)| !r.keeps_contents())
            .map(|(t, _)| t.as_str().to_owned())
            .collect()
    }

    /// Moves `model`'s weights into one `weights` allocation. With [`Restore::Reload`] the
    /// shard described by `origin` is loaded again at wakeup.
    ///
    /// # Errors
    /// The allocation fails, or the model cannot be moved.
    pub fn place_weights(
        &self,
        model: &mut ParallelModel,
        origin: &ShardOrigin,
    ) -> Result<(), String> {
        let bytes = model.weight_bytes();
        if bytes == 0 {
            return Ok(());
        }
        let policy = self.weights.policy().unwrap_or_else(|| {
            let origin = origin.clone();
            vmm::Policy::Reload(vmm::Source::from_fn(move |buf| {
                origin.fill(buf).map_err(std::io::Error::other)
            }))
        });
        let alloc = self
            .manager
            .allocate(vmm::Tag::WEIGHTS, bytes, policy)
            .map_err(|e| format!("allocating {bytes} bytes of weights: {e}"))?;
        let arena = VmmArena::new(alloc).map_err(|e| e.to_string())?;
        model.move_weights_to(&arena).map_err(|e| format!("moving the weights: {e}"))?;
        // The heap copies are gone; give their pages back rather than keep them resident.
        vmm::trim_heap();
        Ok(())
    }

    /// A KV cache of `capacity` tokens for one sequence of `model`, in its own `kv_cache`
    /// allocation (committed now).
    ///
    /// # Errors
    /// The allocation fails.
    pub fn new_cache(
        &self,
        model: &ParallelModel,
        capacity: usize,
    ) -> Result<ParallelCache, String> {
        let bytes = model.cache_bytes(capacity);
        let alloc = self
            .manager
            .allocate(vmm::Tag::KV_CACHE, bytes, self.kv_policy.clone())
            .map_err(|e| format!("allocating a {bytes}-byte KV cache: {e}"))?;
        alloc.write().map_err(|e| e.to_string())?.fill(0);
        let arena = VmmArena::new(alloc).map_err(|e| e.to_string())?;
        model.new_cache_in(capacity, &arena).map_err(|e| e.to_string())
    }
}

/// The control plane's view of one rank's model memory ([`RankMemory`]): the tagged
/// allocations and, when the kernels run on a GPU, the device copies of the weights, dropped
/// with a sleep of `weights` (the backend uploads them again at first use after the wakeup)
/// and read through NVML in the probes.
pub struct ModelRankMemory {
    vmm: VmmMemory,
    backend: layers::kernels::Backend,
}

impl std::fmt::Debug for ModelRankMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRankMemory")
            .field("vmm", &self.vmm)
            .field("device", &self.backend.device())
            .finish()
    }
}

impl ModelRankMemory {
    /// The memory of `memory`'s allocations, for a model computing on `backend`.
    pub fn new(memory: &ModelMemory, backend: layers::kernels::Backend) -> ModelRankMemory {
        let manager = memory.manager().clone();
        let vmm = match backend.device() {
            layers::Device::Cuda(ordinal) => {
                VmmMemory::with_device(manager, u32::try_from(ordinal).unwrap_or(u32::MAX))
            }
            _ => VmmMemory::new(manager, None),
        };
        ModelRankMemory { vmm, backend }
    }
}

impl RankMemory for ModelRankMemory {
    fn check(&self, tags: &[String]) -> Result<(), String> {
        self.vmm.check(tags)
    }

    fn release(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        let receipts = self.vmm.release(tags)?;
        if tags.iter().any(|t| t == vmm::Tag::WEIGHTS.as_str()) {
            if let layers::kernels::Backend::Cuda(gpu) = &self.backend {
                gpu.clear_weight_cache();
            }
        }
        Ok(receipts)
    }

    fn materialize(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        self.vmm.materialize(tags)
    }

    fn probe(&self) -> Probe {
        self.vmm.probe()
    }
}

/// Where a shard's weights come from, to load them again for [`Restore::Reload`].
#[derive(Clone, Debug)]
pub struct ShardOrigin {
    /// The GGUF file.
    pub path: PathBuf,
    /// The shard.
    pub placement: Placement,
    /// The form the weights are kept in.
    pub form: WeightForm,
}

impl ShardOrigin {
    /// Loads the shard again and writes its weight buffers into `buf` exactly as
    /// [`ParallelModel::move_weights_to`] laid them out through a [`VmmArena`].
    fn fill(&self, buf: &mut [u8]) -> Result<(), String> {
        let model = ParallelModel::load(&self.path, self.placement, 1, self.form)
            .map_err(|e| format!("reloading the weights from {}: {e}", self.path.display()))?;
        let mut offset = 0usize;
        for b in model.weight_buffers() {
            offset = offset.next_multiple_of(ALIGN);
            let dst = buf.get_mut(offset..offset + b.len()).ok_or_else(|| {
                format!("the reloaded weights of {} outgrow their allocation", self.path.display())
            })?;
            dst.copy_from_slice(b);
            offset += b.len();
        }
        drop(model);
        vmm::trim_heap();
        Ok(())
    }
}

/// A [`layers::Arena`] over one vmm allocation, handing out its bytes front to back.
#[derive(Debug)]
pub struct VmmArena(Mutex<vmm::Regions>);

impl VmmArena {
    /// Cuts `alloc` into buffers.
    ///
    /// # Errors
    /// The allocation is not host memory.
    pub fn new(alloc: vmm::Allocation) -> Result<VmmArena, vmm::Error> {
        Ok(VmmArena(Mutex::new(vmm::Regions::new(alloc)?)))
    }
}

impl layers::Arena for VmmArena {
    fn alloc(&self, bytes: usize) -> layers::Result<Box<dyn ExternalMemory>> {
        let mut regions = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let region = regions
            .take(bytes, ALIGN)
            .map_err(|e| layers::Error::Arena { bytes, source: Box::new(e) })?;
        Ok(Box::new(VmmBytes(region)))
    }
}

/// A vmm region as tensor storage.
#[derive(Debug)]
struct VmmBytes(vmm::Region);

impl ExternalMemory for VmmBytes {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use layers::model::random::RandomLlama;
    use layers::parallel::Comms;

    /// Greedy tokens of `model` after `prompt`, one decode step at a time.
    fn generate(
        model: &ParallelModel,
        cache: &mut ParallelCache,
        first: &[u32],
        steps: usize,
    ) -> Vec<Vec<f32>> {
        let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
        let mut comms = Comms { tp: &mut tp, cp: &mut cp };
        let mut tokens = first.to_vec();
        let mut rows = Vec::new();
        for _ in 0..steps {
            let out = model.forward(&mut comms, &tokens, cache, layers::Logits::Last).unwrap();
            let row = out.row(out.rows() - 1).to_vec();
            tokens = vec![crate::argmax(&row)];
            rows.push(row);
        }
        rows
    }

    /// A model in vmm memory sleeps (weights and KV cache released: the resident memory drops
    /// by their size) and wakes with its weights reloaded from the file and its cache backed
    /// up: the generation continues bit for bit as if nothing happened.
    #[test]
    fn a_model_in_vmm_memory_sleeps_and_continues_identically() {
        let dir = std::env::temp_dir().join(format!("tpctl-memory-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        let spec = RandomLlama { quantized: true, hidden: 256, ffn: 512, ..Default::default() };
        spec.write(&path).unwrap();
        let placement = Placement::single();
        let form = WeightForm::Native;
        let memory =
            ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup).unwrap();
        let mut model = ParallelModel::load(&path, placement, 1, form).unwrap();
        let heap = model.clone();
        memory
            .place_weights(&mut model, &ShardOrigin { path: path.clone(), placement, form })
            .unwrap();
        let mut cache = memory.new_cache(&model, 64).unwrap();
        let mut heap_cache = heap.new_cache(64);

        let prompt = [1, 2, 3, 4, 5];
        let before = generate(&model, &mut cache, &prompt, 3);
        assert_eq!(before, generate(&heap, &mut heap_cache, &prompt, 3));

        let tags = ["weights", "kv_cache"];
        let released = memory.manager().release(tags).unwrap();
        let weights = released.iter().find(|r| r.tag.as_str() == "weights").unwrap();
        let granularity = memory.manager().granularity();
        assert_eq!(weights.bytes as usize, model.weight_bytes().next_multiple_of(granularity));
        assert_eq!(weights.copied_bytes, 0, "reloaded weights are not backed up");
        memory.manager().materialize(tags).unwrap();

        let next = [crate::argmax(before.last().unwrap())];
        let after = generate(&model, &mut cache, &next, 4);
        assert_eq!(after, generate(&heap, &mut heap_cache, &next, 4));
        assert_eq!(memory.lossy_tags(), Vec::<String>::new());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_kv_cache_cannot_be_reloaded_and_discard_is_lossy() {
        let dir = std::env::temp_dir().join(format!("tpctl-memory-p-{}", std::process::id()));
        let err = ModelMemory::host(Some(dir.clone()), Restore::Reload, Restore::Reload);
        assert!(err.unwrap_err().contains("KV cache cannot be reloaded"));
        let m = ModelMemory::host(Some(dir.clone()), Restore::Backup, Restore::Discard).unwrap();
        assert_eq!(m.lossy_tags(), vec!["kv_cache".to_string()]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
