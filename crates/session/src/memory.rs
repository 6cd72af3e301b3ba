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
//! - On a GPU ([`ModelMemory::with_device`]), a second manager holds device memory under the
//!   same tags: the device copies of the weights (the CUDA backend's weight cache, in chunks
//!   of [`WEIGHT_CHUNK`]; discarded by a sleep and written again from the host weights at
//!   their next use, at the same addresses) and the KV caches themselves (one device
//!   allocation per sequence, read in place by attention). Receipts count both, and say which
//!   bytes were device memory.
//!
//! Access to this memory is unchecked (plain slices and device addresses, as kernels need):
//! the engine's gate guarantees that no step runs while it is released.

use crate::sleep::{MemoryError, Probe, RankMemory, Refusal, TagReceipt, VmmMemory};
use layers::kernels::Backend;
use layers::model::WeightForm;
use layers::parallel::{LoadOptions, ParallelCache, ParallelModel, Placement};
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
    /// Its name in receipts and configs.
    pub fn name(self) -> &'static str {
        match self {
            Restore::Discard => "discard",
            Restore::Zero => "zero",
            Restore::Backup => "backup",
            Restore::Reload => "reload",
        }
    }

    /// Whether a wakeup brings the contents back.
    pub fn keeps_contents(self) -> bool {
        matches!(self, Restore::Backup | Restore::Reload)
    }

    /// The vmm policy, except for [`Restore::Reload`] (`None`), which needs its source.
    fn policy(self) -> Option<vmm::Policy> {
        match self {
            Restore::Discard => Some(vmm::Policy::Discard),
            Restore::Zero => Some(vmm::Policy::Zero),
            Restore::Backup => Some(vmm::Policy::Backup(vmm::BackupStore::Spill)),
            Restore::Reload => None,
        }
    }
}

/// The size of the device allocations that hold the weights' device copies (a weight larger
/// than this gets an allocation of its own size).
pub const WEIGHT_CHUNK: usize = 64 << 20;

/// The memory of one rank's model: the vmm manager (and, on a GPU, the device one) and the
/// restore policy per tag.
#[derive(Clone, Debug)]
pub struct ModelMemory {
    manager: Arc<vmm::Manager>,
    /// The CUDA device ordinal and its manager, on a GPU.
    device: Option<(usize, Arc<vmm::Manager>)>,
    weights: Restore,
    kv_cache: Restore,
    /// The policy of every KV-cache allocation.
    kv_policy: vmm::Policy,
    /// Tags whose contents a sleep at level 1 backs up (to host memory) whatever their
    /// policy.
    level_one: Vec<vmm::Tag>,
    /// Where the weights live and which checkpoint they are (shared by clones).
    live: Arc<Mutex<LiveWeights>>,
}

/// A rank's weights in tagged memory: their allocation, the checkpoint they came from, and
/// a weight update between its PREPARE and its COMMIT.
#[derive(Default)]
struct LiveWeights {
    arena: Option<Arc<VmmArena>>,
    origin: Option<ShardOrigin>,
    /// The weight buffers' lengths, in order, and the model's shape (its context length
    /// aside): what another checkpoint must match, on this rank and globally.
    layout: Vec<usize>,
    config: Option<layers::LlamaConfig>,
    /// A checkpoint loaded and checked by a PREPARE.
    staged: Option<(ShardOrigin, ParallelModel)>,
    /// The checkpoint the latest update replaced, for its rollback.
    previous: Option<ShardOrigin>,
}

impl std::fmt::Debug for LiveWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveWeights")
            .field("origin", &self.origin)
            .field("staged", &self.staged.as_ref().map(|(o, _)| o))
            .field("previous", &self.previous)
            .finish_non_exhaustive()
    }
}

/// Why tagged memory for a model could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The KV cache's restore policy is reload: there is nothing to reload it from.
    #[error("the KV cache cannot be reloaded: use discard, zero or backup")]
    KvCacheReload,
    /// A memory manager could not be built, or a tag defined in it.
    #[error("{what}: {source}")]
    Manager {
        /// Which manager (`memory manager (spill dir …)`, `device memory on cuda:N`).
        what: String,
        /// Why.
        #[source]
        source: vmm::Error,
    },
}

/// Why a model's weights or KV memory could not be placed in tagged allocations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlaceError {
    /// The tagged allocation could not be made or written.
    #[error("allocating {what}: {source}")]
    Allocate {
        /// What was allocated, with its size.
        what: String,
        /// The manager's error.
        #[source]
        source: vmm::Error,
    },
    /// The model could not move into the allocation, or build a cache or pool in it.
    #[error("{what}: {source}")]
    Model {
        /// What the model was doing.
        what: String,
        /// The model's error.
        #[source]
        source: Box<layers::Error>,
    },
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
    ) -> Result<ModelMemory, SetupError> {
        let kv_policy = kv_cache.policy().ok_or(SetupError::KvCacheReload)?;
        for tag in [vmm::Tag::WEIGHTS, vmm::Tag::KV_CACHE] {
            manager
                .define_tag(tag)
                .map_err(|source| SetupError::Manager { what: "memory manager".into(), source })?;
        }
        Ok(ModelMemory {
            manager,
            device: None,
            weights,
            kv_cache,
            kv_policy,
            level_one: Vec::new(),
            live: Arc::default(),
        })
    }

    /// Adds the device memory of CUDA device `ordinal`: models computing there keep their KV
    /// caches and their weights' device copies in it (see the module docs).
    ///
    /// # Errors
    /// The device manager cannot be built (no CUDA driver, no such device, a build without
    /// feature `cuda`).
    pub fn with_device(mut self, ordinal: usize) -> Result<ModelMemory, SetupError> {
        let what = || format!("device memory on cuda:{ordinal}");
        let manager = vmm::Manager::builder()
            .backend(vmm::BackendKind::Cuda { device: ordinal })
            .spill_dir(self.manager.spill_dir())
            .build()
            .map_err(|source| SetupError::Manager { what: what(), source })?;
        for tag in [vmm::Tag::WEIGHTS, vmm::Tag::KV_CACHE] {
            manager
                .define_tag(tag)
                .map_err(|source| SetupError::Manager { what: what(), source })?;
        }
        self.device = Some((ordinal, Arc::new(manager)));
        Ok(self)
    }

    /// The device manager when `backend` computes on the GPU it allocates on (a backend on
    /// another device, or the CPU, keeps host memory).
    fn device_for(&self, backend: &Backend) -> Option<&Arc<vmm::Manager>> {
        let (ordinal, manager) = self.device.as_ref()?;
        (backend.device() == layers::Device::Cuda(*ordinal)).then_some(manager)
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
    ) -> Result<ModelMemory, SetupError> {
        let dir = spill_dir.unwrap_or_else(vmm::default_spill_dir);
        let manager = vmm::Manager::builder().spill_dir(&dir).build().map_err(|source| {
            SetupError::Manager {
                what: format!("memory manager (spill dir {})", dir.display()),
                source,
            }
        })?;
        ModelMemory::new(Arc::new(manager), weights, kv_cache)
    }

    /// The manager.
    pub fn manager(&self) -> &Arc<vmm::Manager> {
        &self.manager
    }

    /// Whether a sleep at level 1 keeps the weights' contents (the manager's default store:
    /// a pinned host copy on a GPU, a spill file on the CPU), restored from there at the
    /// wakeup instead of per their policy, as vLLM's level 1 does. Off by default; the
    /// launcher turns it on unless the weights' restore policy is configured.
    pub fn with_level_one_weights(mut self, keep: bool) -> ModelMemory {
        self.level_one = if keep { vec![vmm::Tag::WEIGHTS] } else { Vec::new() };
        self
    }

    /// Loads this rank's shard of the checkpoint at `model` and checks that its weight
    /// buffers match the live ones one for one; keeps it for [`ModelMemory::update`].
    ///
    /// # Errors
    /// The weights are not in tagged memory, the checkpoint does not load, or its buffers
    /// differ (another architecture, other shapes, another quantization).
    pub fn prepare_update(&self, model: &str) -> Result<(), Refusal> {
        let (current, layout, config) = {
            let live = lock_live(&self.live);
            let current = live.origin.clone().ok_or(Refusal::WeightsUntagged)?;
            (current, live.layout.clone(), live.config.clone())
        };
        let origin = ShardOrigin { path: PathBuf::from(model), ..current };
        let loaded =
            ParallelModel::load(&origin.path, LoadOptions::new(origin.placement).form(origin.form))
                .map_err(|e| Refusal::Unloadable {
                    model: model.to_owned(),
                    reason: e.to_string(),
                })?;
        let misfit = |detail: String| Refusal::Misfit { model: model.to_owned(), detail };
        let shape = shape_of(loaded.config());
        if config.as_ref() != Some(&shape) {
            return Err(misfit(format!("its shape {shape:?} differs from the live {config:?}")));
        }
        let got: Vec<usize> = loaded.weight_buffers().iter().map(|b| b.len()).collect();
        if got != layout {
            let at = got.iter().zip(&layout).position(|(a, b)| a != b);
            let at = at.unwrap_or(got.len().min(layout.len()));
            return Err(misfit(format!(
                "{} weight buffers against {}, the first difference at buffer {at} ({} bytes against {})",
                got.len(),
                layout.len(),
                got.get(at).copied().unwrap_or(0),
                layout.get(at).copied().unwrap_or(0),
            )));
        }
        lock_live(&self.live).staged = Some((origin, loaded));
        Ok(())
    }

    /// Writes the staged checkpoint's weights over the live ones (released weights: only
    /// makes it what the wakeup reloads). Returns the bytes written.
    ///
    /// # Errors
    /// Nothing staged (changed nothing), or the allocation cannot be written.
    pub fn update(&self) -> Result<u64, MemoryError> {
        let mut live = lock_live(&self.live);
        let Some((origin, model)) = live.staged.take() else {
            let message = "no weight update is staged".to_owned();
            return Err(MemoryError { changed: false, message });
        };
        let written = live.write(&model.weight_buffers())?;
        live.previous = live.origin.replace(origin);
        Ok(written)
    }

    /// Puts back the checkpoint the latest update replaced (loaded again from its file).
    ///
    /// # Errors
    /// No update to revert, or the old checkpoint cannot be loaded or written.
    pub fn revert(&self) -> Result<u64, MemoryError> {
        let mut live = lock_live(&self.live);
        let Some(previous) = live.previous.take() else {
            let message = "no weight update to revert".to_owned();
            return Err(MemoryError { changed: false, message });
        };
        let model = ParallelModel::load(
            &previous.path,
            LoadOptions::new(previous.placement).form(previous.form),
        )
        .map_err(|e| MemoryError {
            changed: false,
            message: format!("reloading {}: {e}", previous.path.display()),
        })?;
        let written = live.write(&model.weight_buffers())?;
        live.origin = Some(previous);
        Ok(written)
    }

    /// Forgets a staged update.
    pub fn drop_update(&self) {
        lock_live(&self.live).staged = None;
    }

    /// The checkpoint the weights came from.
    pub fn checkpoint(&self) -> Option<PathBuf> {
        lock_live(&self.live).origin.as_ref().map(|o| o.path.clone())
    }

    /// The configured restore policy of `tag`.
    fn restore_of(&self, tag: &str) -> Option<Restore> {
        match tag {
            t if t == vmm::Tag::WEIGHTS.as_str() => Some(self.weights),
            t if t == vmm::Tag::KV_CACHE.as_str() => Some(self.kv_cache),
            _ => None,
        }
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
    ) -> Result<(), PlaceError> {
        let bytes = model.weight_bytes();
        if bytes == 0 {
            return Ok(());
        }
        let policy = self.weights.policy().unwrap_or_else(|| {
            // The checkpoint live at the wakeup: a weight update may have replaced it.
            let live = self.live.clone();
            vmm::Policy::Reload(vmm::Source::from_fn(move |buf| {
                let origin = lock_live(&live).origin.clone();
                let origin = origin.ok_or_else(|| std::io::Error::other("no live checkpoint"))?;
                origin.fill(buf).map_err(std::io::Error::other)
            }))
        });
        let allocate =
            |source| PlaceError::Allocate { what: format!("{bytes} bytes of weights"), source };
        let alloc = self.manager.allocate(vmm::Tag::WEIGHTS, bytes, policy).map_err(allocate)?;
        let arena = Arc::new(VmmArena::new(alloc).map_err(allocate)?);
        model.move_weights_to(&*arena).map_err(|source| PlaceError::Model {
            what: "moving the weights".into(),
            source: Box::new(source),
        })?;
        {
            let mut live = lock_live(&self.live);
            live.layout = model.weight_buffers().iter().map(|b| b.len()).collect();
            live.config = Some(shape_of(model.config()));
            live.origin = Some(origin.clone());
            live.arena = Some(arena);
        }
        // The heap copies are gone; give their pages back rather than keep them resident.
        vmm::trim_heap();
        if let (Some(device), Backend::Cuda(gpu)) =
            (self.device_for(model.backend()), model.backend())
        {
            // Derived from the host weights, so a wakeup need not restore them.
            gpu.keep_weights_in(Arc::new(VmmDeviceArena::new(
                device.clone(),
                vmm::Tag::WEIGHTS,
                vmm::Policy::Discard,
                WEIGHT_CHUNK,
            )));
        }
        Ok(())
    }

    /// Free bytes of the GPU `backend` computes on, as NVML reports them; `None` on the CPU or
    /// when NVML cannot say.
    pub fn device_free_bytes(&self, backend: &Backend) -> Option<u64> {
        let layers::Device::Cuda(ordinal) = backend.device() else { return None };
        let nvml = vmm::NvmlMemory::new().ok()?;
        nvml.device(nvml_index(ordinal)).ok().map(|usage| usage.free)
    }

    /// `model`'s paged KV pool of `blocks` blocks of `block_size` tokens, in one `kv_cache`
    /// allocation (on the model's GPU when it computes on one), committed now (resident memory is the pool's size from the start, and a
    /// sleep gives all of it back): a sleep releases it whole and a wakeup restores it by its
    /// policy.
    ///
    /// # Errors
    /// The allocation fails.
    pub fn new_pool(
        &self,
        model: &ParallelModel,
        block_size: usize,
        blocks: usize,
    ) -> Result<layers::model::KvPool, PlaceError> {
        use layers::memory::Arena;
        let elem = self.kv_elem(model);
        let bytes = model.pool_bytes(block_size, blocks, elem);
        let what = format!("a {bytes}-byte KV pool");
        let failed = |source| PlaceError::Model { what: what.clone(), source: Box::new(source) };
        if let Some(arena) = self.device_kv(model, bytes) {
            return model.pool_on_device(&arena, block_size, blocks, elem).map_err(|source| {
                PlaceError::Model {
                    what: format!("allocating {what} ({}) on the GPU", elem.name()),
                    source: Box::new(source),
                }
            });
        }
        let arena = self.committed_kv(bytes, "KV pool")?;
        let storage = layers::tensor::Storage::external(arena.alloc(bytes).map_err(failed)?)
            .map_err(failed)?;
        model.pool_in(storage, block_size).map_err(failed)
    }

    /// How [`ModelMemory::new_pool`] and [`ModelMemory::new_cache`] store `model`'s keys and
    /// values: as the model's [`ParallelModel::device_kv_elem`] (bf16 with half-precision
    /// weights) in device memory, f32 on the host.
    pub fn kv_elem(&self, model: &ParallelModel) -> layers::kernels::KvElem {
        match self.device_for(model.backend()) {
            Some(_) => model.device_kv_elem(),
            None => layers::kernels::KvElem::F32,
        }
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
    ) -> Result<ParallelCache, PlaceError> {
        let elem = self.kv_elem(model);
        let bytes = model.cache_bytes(capacity, elem);
        let failed = |source| PlaceError::Model {
            what: format!("a {bytes}-byte KV cache"),
            source: Box::new(source),
        };
        if let Some(arena) = self.device_kv(model, bytes) {
            return model.new_cache_on_device(capacity, elem, &arena).map_err(failed);
        }
        let arena = self.committed_kv(bytes, "KV cache")?;
        model.new_cache_in(capacity, &arena).map_err(failed)
    }

    /// One `kv_cache` allocation of exactly `bytes` on `model`'s GPU (allocated zeroed and
    /// mapped), as an arena; `None` when the model computes on the CPU.
    fn device_kv(&self, model: &ParallelModel, bytes: usize) -> Option<VmmDeviceArena> {
        let device = self.device_for(model.backend())?;
        Some(VmmDeviceArena::new(device.clone(), vmm::Tag::KV_CACHE, self.kv_policy.clone(), bytes))
    }

    /// One host `kv_cache` allocation of `bytes`, zeroed (so committed) now, as an arena;
    /// `what` names it in the error.
    fn committed_kv(&self, bytes: usize, what: &str) -> Result<VmmArena, PlaceError> {
        let failed =
            |source| PlaceError::Allocate { what: format!("a {bytes}-byte {what}"), source };
        let alloc = self
            .manager
            .allocate(vmm::Tag::KV_CACHE, bytes, self.kv_policy.clone())
            .map_err(failed)?;
        alloc.write().map_err(failed)?.fill(0);
        VmmArena::new(alloc).map_err(failed)
    }
}

/// `config` without what a checkpoint may change (its context length).
fn shape_of(config: &layers::LlamaConfig) -> layers::LlamaConfig {
    layers::LlamaConfig { context_length: 0, ..config.clone() }
}

fn lock_live(live: &Mutex<LiveWeights>) -> std::sync::MutexGuard<'_, LiveWeights> {
    live.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LiveWeights {
    /// Writes `buffers` over the live weights, laid out as [`ModelMemory::place_weights`]
    /// placed them; nothing when the weights are released (the wakeup reloads them).
    fn write(&self, buffers: &[&[u8]]) -> Result<u64, MemoryError> {
        let fail = |message: String| MemoryError { changed: false, message };
        let arena = self
            .arena
            .as_ref()
            .ok_or_else(|| fail("the weights are not in tagged memory".into()))?;
        let regions = arena.0.lock().unwrap_or_else(PoisonError::into_inner);
        let alloc = regions.allocation();
        if alloc.is_released() {
            return Ok(0);
        }
        let mut bytes = alloc.write().map_err(|e| fail(format!("writing the weights: {e}")))?;
        let mut offset = 0usize;
        for b in buffers {
            offset = offset.next_multiple_of(ALIGN);
            bytes[offset..offset + b.len()].copy_from_slice(b);
            offset += b.len();
        }
        Ok(offset as u64)
    }
}

/// The control plane's view of one rank's model memory ([`RankMemory`]): the tagged host
/// allocations and, on a GPU, the device ones, with NVML's reading of the device in the probes.
/// A sleep of `weights` also clears the CUDA backend's weight cache, so the device copies are
/// written again (from the restored host weights) at their next use.
pub struct ModelRankMemory {
    host: VmmMemory,
    device: Option<VmmMemory>,
    backend: Backend,
    memory: ModelMemory,
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
            layers::Device::Cuda(ordinal) => {
                let index = nvml_index(ordinal);
                (
                    VmmMemory::with_device(manager, index),
                    memory.device_for(&backend).map(|m| VmmMemory::new(m.clone(), Some(index))),
                )
            }
            _ => (VmmMemory::new(manager, None), None),
        };
        ModelRankMemory { host, device, backend, memory: memory.clone(), pending: Mutex::default() }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, Restore>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// NVML's index of the GPU that CUDA calls `ordinal` (see [`vmm::nvml_device_of_cuda_ordinal`]),
/// or the ordinal itself when NVML cannot say.
fn nvml_index(ordinal: usize) -> u32 {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let fallback = u32::try_from(ordinal).unwrap_or(u32::MAX);
    let Some(device) = vmm::nvml_device_of_cuda_ordinal(ordinal, visible.as_deref()) else {
        return fallback;
    };
    match &device {
        vmm::NvmlDevice::Index(index) => *index,
        vmm::NvmlDevice::Uuid(_) => {
            vmm::NvmlMemory::new().and_then(|nvml| nvml.index_of(&device)).unwrap_or(fallback)
        }
    }
}

/// `more` added into `into`, tag by tag (both list the same tags, in the same order).
fn merge(into: &mut [TagReceipt], more: Vec<TagReceipt>) {
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

impl RankMemory for ModelRankMemory {
    fn check(&self, tags: &[String]) -> Result<(), Refusal> {
        self.host.check(tags)
    }

    fn release(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        self.release_at(tags, None)
    }

    fn release_at(
        &self,
        tags: &[String],
        level: Option<u8>,
    ) -> Result<Vec<TagReceipt>, MemoryError> {
        if let Backend::Cuda(gpu) = &self.backend {
            if tags.iter().any(|t| t == vmm::Tag::WEIGHTS.as_str()) {
                gpu.clear_weight_cache();
            } else {
                // The step temporaries the driver's pool keeps go back to the device too.
                gpu.trim_pool();
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
        let mut receipts = self.host.release_with(tags, &backups)?;
        if let Some(device) = &self.device {
            // The host memory is released already: the caller undoes both.
            let more = device.release(tags).map_err(|e| MemoryError { changed: true, ..e })?;
            merge(&mut receipts, more);
        }
        let mut pending = self.pending();
        for r in &mut receipts {
            let backed_up = backups.iter().any(|(t, _)| t.as_str() == r.tag);
            let restore =
                if backed_up { Some(Restore::Backup) } else { self.memory.restore_of(&r.tag) };
            if let Some(restore) = restore {
                r.restore = restore.name().to_owned();
                pending.insert(r.tag.clone(), restore);
            }
        }
        Ok(receipts)
    }

    fn materialize(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        let mut receipts = self.host.materialize(tags)?;
        if let Some(device) = &self.device {
            let more = device.materialize(tags).map_err(|e| MemoryError { changed: true, ..e })?;
            merge(&mut receipts, more);
        }
        let mut pending = self.pending();
        for r in &mut receipts {
            let restore = pending.remove(&r.tag).or_else(|| self.memory.restore_of(&r.tag));
            r.restore = restore.map(|x| x.name().to_owned()).unwrap_or_default();
        }
        Ok(receipts)
    }

    fn prepare_update(&self, model: &str) -> Result<(), Refusal> {
        self.memory.prepare_update(model)
    }

    fn update(&self) -> Result<Vec<TagReceipt>, MemoryError> {
        let written = self.memory.update()?;
        Ok(vec![self.weights_written(written)])
    }

    fn revert(&self) -> Result<Vec<TagReceipt>, MemoryError> {
        let written = self.memory.revert()?;
        Ok(vec![self.weights_written(written)])
    }

    fn drop_update(&self) {
        self.memory.drop_update();
    }

    fn probe(&self) -> Probe {
        self.host.probe()
    }
}

impl ModelRankMemory {
    /// The receipt of weights replaced in place: `written` bytes copied (none while asleep);
    /// the GPU's copies of the old ones are dropped.
    fn weights_written(&self, written: u64) -> TagReceipt {
        if let Backend::Cuda(gpu) = &self.backend {
            gpu.clear_weight_cache();
        }
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

/// Where a shard's weights come from, to load them again for [`Restore::Reload`].
#[derive(Clone, Debug)]
pub struct ShardOrigin {
    /// The model: a GGUF file or a Hugging Face folder.
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
        let model =
            ParallelModel::load(&self.path, LoadOptions::new(self.placement).form(self.form))
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

/// A [`layers::DeviceArena`] over device allocations of one tag: regions are cut front to
/// back from the newest allocation, and a region that does not fit starts a new one of
/// `chunk` bytes (or its own size, when larger). The allocations live as long as their regions.
pub struct VmmDeviceArena {
    manager: Arc<vmm::Manager>,
    tag: vmm::Tag,
    policy: vmm::Policy,
    chunk: usize,
    /// The newest allocation and the offset of its first free byte.
    last: Mutex<Option<(Arc<vmm::Allocation>, usize)>>,
}

impl std::fmt::Debug for VmmDeviceArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmDeviceArena")
            .field("tag", &self.tag)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

impl VmmDeviceArena {
    /// An arena allocating `tag` memory with `policy` from `manager`, `chunk` bytes at a time.
    pub fn new(
        manager: Arc<vmm::Manager>,
        tag: vmm::Tag,
        policy: vmm::Policy,
        chunk: usize,
    ) -> VmmDeviceArena {
        VmmDeviceArena { manager, tag, policy, chunk, last: Mutex::new(None) }
    }
}

impl layers::DeviceArena for VmmDeviceArena {
    fn alloc_device(&self, bytes: usize) -> layers::Result<Box<dyn mesh::DeviceMemory>> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let fits = |(alloc, next): &(Arc<vmm::Allocation>, usize)| {
            let offset = next.next_multiple_of(ALIGN);
            (offset + bytes <= alloc.bytes()).then(|| (alloc.clone(), offset))
        };
        let (alloc, offset) = match last.as_ref().and_then(fits) {
            Some(found) => found,
            None => {
                let size = self.chunk.max(bytes).max(1);
                let alloc = self
                    .manager
                    .allocate(&self.tag, size, self.policy.clone())
                    .map_err(|e| layers::Error::Arena { bytes, source: Box::new(e) })?;
                (Arc::new(alloc), 0)
            }
        };
        *last = Some((alloc.clone(), offset + bytes));
        let slice = vmm::DeviceSlice::new(alloc, offset, bytes)
            .map_err(|e| layers::Error::Arena { bytes, source: Box::new(e) })?;
        Ok(Box::new(slice))
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
        let spec = RandomLlama {
            quantized: Some(layers::kernels::BlockFormat::Q8_0),
            hidden: 256,
            ffn: 512,
            ..Default::default()
        };
        spec.write(&path).unwrap();
        let placement = Placement::single();
        let form = WeightForm::Native;
        let memory =
            ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup).unwrap();
        let mut model = ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
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

    /// vLLM's levels through the control plane's view: level 1 keeps the weights' contents
    /// (copied out at the sleep, back at the wakeup), level 2 reloads them from the file, the
    /// KV cache keeps its policy at both, and the generation continues identically; with the
    /// weights' policy configured, level 1 keeps that policy.
    #[test]
    fn sleep_levels_choose_how_the_weights_come_back_and_receipts_say_so() {
        use crate::sleep::RankMemory;
        let dir = std::env::temp_dir().join(format!("tpctl-memory-l-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        RandomLlama { seed: 9, ..Default::default() }.write(&path).unwrap();
        let (placement, form) = (Placement::single(), WeightForm::Native);
        let origin = ShardOrigin { path: path.clone(), placement, form };
        for keep in [true, false] {
            let memory =
                ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup)
                    .unwrap()
                    .with_level_one_weights(keep);
            let mut model =
                ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
            memory.place_weights(&mut model, &origin).unwrap();
            let mut cache = memory.new_cache(&model, 64).unwrap();
            let heap = ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
            let mut heap_cache = heap.new_cache(64);
            let rank = ModelRankMemory::new(&memory, model.backend().clone());
            let mapped = model.weight_bytes().next_multiple_of(memory.manager().granularity());
            let mut next = vec![1, 2, 3];
            for level in [Some(1), Some(2), None] {
                let want = generate(&heap, &mut heap_cache, &next, 2);
                let tags = ["weights".to_owned(), "kv_cache".to_owned()];
                let slept = rank.release_at(&tags, level).unwrap();
                let woke = rank.materialize(&tags).unwrap();
                let kept = keep && level == Some(1);
                let (restore, copied_out) = if kept { ("backup", mapped) } else { ("reload", 0) };
                let what = format!("keep {keep}, level {level:?}");
                assert_eq!(
                    (slept[0].restore.as_str(), slept[0].copied_bytes),
                    (restore, copied_out as u64),
                    "{what}"
                );
                assert_eq!(woke[0].restore, restore, "{what}");
                assert!(woke[0].copied_bytes >= model.weight_bytes() as u64, "{what}");
                assert_eq!(
                    (slept[1].restore.as_str(), woke[1].restore.as_str()),
                    ("backup", "backup"),
                    "{what}"
                );
                let got = generate(&model, &mut cache, &next, 2);
                assert_eq!(got, want, "{what}");
                next = vec![crate::argmax(got.last().unwrap())];
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The device arena's bookkeeping, over a host manager (addresses are only computed, never
    /// read): regions are aligned and packed into the newest allocation, a region that does
    /// not fit starts a new chunk (its own size when larger), and a sleep of the tag releases
    /// every chunk.
    #[test]
    fn the_device_arena_packs_regions_into_chunks_of_its_tag() {
        use layers::DeviceArena;
        let dir = std::env::temp_dir().join(format!("tpctl-memory-d-{}", std::process::id()));
        let manager = Arc::new(vmm::Manager::builder().spill_dir(&dir).build().unwrap());
        let chunk = 1 << 20;
        let arena =
            VmmDeviceArena::new(manager.clone(), vmm::Tag::WEIGHTS, vmm::Policy::Discard, chunk);
        let a = arena.alloc_device(100).unwrap();
        let b = arena.alloc_device(200).unwrap();
        assert_eq!(b.device_ptr(), a.device_ptr() + 128, "packed at the next aligned byte");
        let big = arena.alloc_device(3 << 20).unwrap();
        let c = arena.alloc_device(10).unwrap();
        for r in [&a, &b, &big, &c] {
            assert_eq!(r.device_ptr() % ALIGN as u64, 0);
        }
        assert_eq!((a.size(), big.size(), c.size()), (100, 3 << 20, 10));
        let sizes: Vec<u64> = manager.allocations().iter().map(|i| i.bytes).collect();
        assert_eq!(
            sizes,
            [chunk, 3 << 20, chunk].map(|b| b as u64),
            "a chunk, the big one, a new one"
        );
        let receipts = manager.release(["weights"]).unwrap();
        assert_eq!(receipts[0].allocations, 3);
        manager.materialize(["weights"]).unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Host and device receipts of a tag add up, and device bytes stay counted apart.
    #[test]
    fn host_and_device_receipts_merge_tag_by_tag() {
        let receipt = |tag: &str, bytes, device_bytes| TagReceipt {
            tag: tag.into(),
            allocations: 1,
            bytes,
            device_bytes,
            copied_bytes: 0,
            elapsed_us: 10,
            restore: String::new(),
        };
        let mut host = vec![receipt("weights", 100, 0), receipt("kv_cache", 50, 0)];
        merge(&mut host, vec![receipt("kv_cache", 400, 400), receipt("weights", 700, 700)]);
        assert_eq!(
            host[0],
            TagReceipt { allocations: 2, elapsed_us: 20, ..receipt("weights", 800, 700) }
        );
        assert_eq!(
            host[1],
            TagReceipt { allocations: 2, elapsed_us: 20, ..receipt("kv_cache", 450, 400) }
        );
    }

    /// Without a GPU the device manager cannot be made, and says so.
    #[test]
    fn device_memory_without_a_gpu_is_a_clear_error() {
        if vmm::cuda_driver_present() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("tpctl-memory-g-{}", std::process::id()));
        let m = ModelMemory::host(Some(dir.clone()), Restore::Reload, Restore::Discard).unwrap();
        let err = m.with_device(0).unwrap_err().to_string();
        assert!(err.starts_with("device memory on cuda:0: "), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_kv_cache_cannot_be_reloaded_and_discard_is_lossy() {
        let dir = std::env::temp_dir().join(format!("tpctl-memory-p-{}", std::process::id()));
        let err = ModelMemory::host(Some(dir.clone()), Restore::Reload, Restore::Reload);
        assert!(err.unwrap_err().to_string().contains("KV cache cannot be reloaded"));
        let m = ModelMemory::host(Some(dir.clone()), Restore::Backup, Restore::Discard).unwrap();
        assert_eq!(m.lossy_tags(), vec!["kv_cache".to_string()]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
