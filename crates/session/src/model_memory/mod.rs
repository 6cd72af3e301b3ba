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
//! - Weight updates ([`ModelMemory::prepare_update`]): another checkpoint of the same model is
//!   written over the live buffers when its weights are stored in the same form, else moved
//!   into a new `weights` allocation that replaces the live one; the engine's model takes
//!   those weights ([`ModelMemory::take_new_weights`]) before its next step, and the old
//!   allocation is freed then.
//!
//! Access to this memory is unchecked (plain slices and device addresses, as kernels need):
//! the engine's gate guarantees that no step runs while it is released.

use crate::sleep::{MemoryError, Refusal};
use layers::model::provenance::WeightMap;
use layers::model::WeightForm;
use layers::parallel::{shape_difference, LoadOptions, ParallelCache, ParallelModel, Placement};
use rank::nvml_device;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use tensor::kernels::Backend;
use tensor::memory::ALIGN;

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
    /// Bytes of host memory available for new allocations (`None`: unknown); a weight
    /// update in another form checks it before it allocates.
    host_available: fn() -> Option<u64>,
    /// Threads a weight update written in place copies on, and new KV memory is committed on
    /// (the rank's compute threads).
    threads: usize,
    /// What a wakeup that restored the weights runs before its receipt ([`prepare`]).
    prepare: prepare::Preparation,
}

/// A rank's weights in tagged memory: their allocation and the checkpoint they came from, a
/// weight update between its PREPARE and its COMMIT, and weights in new buffers that a COMMIT
/// swapped in until the engine takes them.
#[derive(Default)]
struct LiveWeights {
    /// The allocation the weights live in (the one a wakeup restores them into), and what
    /// they are.
    current: Option<Placed>,
    /// A checkpoint loaded and checked by a PREPARE.
    staged: Option<Staged>,
    /// The checkpoint the latest update replaced, for its rollback.
    previous: Option<ShardOrigin>,
    /// Weights in other buffers than those the engine's model reads, until it takes them.
    swap: Option<Swap>,
    /// The id of the next allocation placed.
    next_id: u64,
    /// The tensor shapes of the checkpoint an update was last written in place over (into the
    /// allocation of that id), to check the next one's buckets without opening it again.
    catalog: Option<(u64, PathBuf, Arc<checkpoint::ShapeCatalog>)>,
}

/// One `weights` allocation and the weights in it.
struct Placed {
    /// Tells the allocation's reload apart from the others'.
    id: u64,
    arena: Arc<VmmArena>,
    origin: ShardOrigin,
    /// The weight buffers' lengths, in order: what a checkpoint written over them must match.
    layout: Vec<usize>,
    /// Every weight's name and shape, and the model's config: what a checkpoint in any form
    /// must match.
    shapes: Vec<(String, Vec<usize>)>,
    config: checkpoint::LlamaConfig,
    /// Where each buffer's values come from: what an update written in place follows.
    map: WeightMap,
}

/// An update a PREPARE checked, for the COMMIT to make.
struct Staged {
    origin: ShardOrigin,
    change: Change,
}

/// What the COMMIT of a staged update does.
#[expect(clippy::large_enum_variant, reason = "one update is staged at a time")]
enum Change {
    /// Puts a shard loaded whole in place of the live one.
    Load {
        model: ParallelModel,
        /// Its own allocation, already holding its weights, when they are in another form
        /// than the live ones (`None`: they are written over the live buffers).
        placed: Option<Placed>,
    },
    /// Writes the tensors of new buckets over the live buffers, straight from the files
    /// ([`in_place`]).
    InPlace(Vec<checkpoint::Bucket>),
}

/// Weights a COMMIT put in new buffers, and the allocation the engine's model reads until it
/// takes them ([`ModelMemory::take_new_weights`]).
struct Swap {
    model: ParallelModel,
    retired: Placed,
}

impl LiveWeights {
    /// The checkpoint allocation `id` holds, while the engine may read it.
    fn origin_of(&self, id: u64) -> Option<ShardOrigin> {
        let placed = [
            self.current.as_ref(),
            self.swap.as_ref().map(|s| &s.retired),
            self.staged.as_ref().and_then(|s| match &s.change {
                Change::Load { placed, .. } => placed.as_ref(),
                Change::InPlace(_) => None,
            }),
        ];
        placed.into_iter().flatten().find(|p| p.id == id).map(|p| p.origin.clone())
    }
}

impl std::fmt::Debug for LiveWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveWeights")
            .field("origin", &self.current.as_ref().map(|p| &p.origin))
            .field("staged", &self.staged.as_ref().map(|s| &s.origin))
            .field("previous", &self.previous)
            .field("swap", &self.swap.as_ref().map(|s| &s.retired.origin))
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
            host_available: available_host_memory,
            threads: 1,
            prepare: prepare::Preparation::default(),
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
        (backend.device() == tensor::Device::Cuda(*ordinal)).then_some(manager)
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

    /// Copies the tensors of updates written in place, and commits new KV memory, on
    /// `threads` threads (at least one): the rank's compute threads, idle meanwhile.
    pub fn with_threads(mut self, threads: usize) -> ModelMemory {
        self.threads = threads.max(1);
        self
    }

    /// Loads this rank's shard of the checkpoint at `model` and checks that it holds the live
    /// model's weights (its config, and every weight's shape); keeps it for
    /// [`ModelMemory::update`]. Weights stored as the live ones are (their buffers match one
    /// for one) are written over them at the COMMIT; weights in another form (another
    /// quantization) are moved now into a new `weights` allocation, which the COMMIT swaps in.
    ///
    /// # Errors
    /// The weights are not in tagged memory, the checkpoint does not load or is another
    /// model (the refusal names what differs), or its weights are in another form and the
    /// live ones are asleep, or the host has too little memory for the new buffers, or they
    /// cannot be allocated.
    pub fn prepare_update(&self, model: &str) -> Result<(), Refusal> {
        self.prepare_update_with(model, &[])
    }

    /// [`ModelMemory::prepare_update`] of the checkpoint at `model` with the safetensors files
    /// `tensors` laid over it (an update from memory: [`checkpoint::Overlay`]).
    ///
    /// # Errors
    /// As [`ModelMemory::prepare_update`]; a bucket that does not fit the model is
    /// [`Refusal::Unloadable`], naming the file and the tensor.
    pub fn prepare_update_with(&self, model: &str, tensors: &[String]) -> Result<(), Refusal> {
        let (id, live_origin, origin, shapes, config, layout, map, asleep) = {
            let live = lock_live(&self.live);
            let current = live.current.as_ref().ok_or(Refusal::WeightsUntagged)?;
            let tensors = tensors.iter().map(PathBuf::from).collect();
            let origin =
                ShardOrigin { path: PathBuf::from(model), tensors, ..current.origin.clone() };
            let asleep = current.arena.allocation_released();
            let (shapes, config) = (current.shapes.clone(), current.config.clone());
            let (layout, map) = (current.layout.clone(), current.map.clone());
            (current.id, current.origin.clone(), origin, shapes, config, layout, map, asleep)
        };
        if let Some(buckets) = self.in_place(id, &live_origin, &origin, &map, &config) {
            let change = Change::InPlace(buckets);
            lock_live(&self.live).staged = Some(Staged { origin, change });
            return Ok(());
        }
        let unloadable = |reason: String| Refusal::Unloadable { model: model.to_owned(), reason };
        let mut loaded = origin.load().map_err(|e| unloadable(e.to_string()))?;
        let misfit = |detail: String| Refusal::Misfit { model: model.to_owned(), detail };
        let differences = loaded.config().differences(&config);
        if !differences.is_empty() {
            return Err(misfit(differences.join("; ")));
        }
        if let Some(difference) = shape_difference(&loaded.weight_shapes(), &shapes) {
            return Err(misfit(difference));
        }
        let fits = loaded.weight_buffers().iter().map(|b| b.len()).eq(layout.iter().copied());
        let placed = if fits {
            None
        } else {
            if asleep {
                return Err(Refusal::OtherFormAsleep { model: model.to_owned() });
            }
            let needed = loaded.weight_bytes().next_multiple_of(self.manager.granularity());
            let needed = needed as u64;
            if let Some(available) = (self.host_available)().filter(|&a| a < needed) {
                return Err(Refusal::NoRoom { model: model.to_owned(), needed, available });
            }
            let placed = self.place(&mut loaded, &origin).map_err(|e| unloadable(e.to_string()))?;
            vmm::trim_heap();
            Some(placed)
        };
        let change = Change::Load { model: loaded, placed };
        lock_live(&self.live).staged = Some(Staged { origin, change });
        Ok(())
    }

    /// The buckets of an update from `live` to `next` that can be written in place
    /// ([`in_place::new_buckets`]) into allocation `id`, with the checkpoint's catalog opened
    /// once per checkpoint and allocation.
    fn in_place(
        &self,
        id: u64,
        live: &ShardOrigin,
        next: &ShardOrigin,
        map: &WeightMap,
        config: &checkpoint::LlamaConfig,
    ) -> Option<Vec<checkpoint::Bucket>> {
        if next.tensors.is_empty() {
            return None;
        }
        let cached = lock_live(&self.live).catalog.clone();
        let catalog = match cached {
            Some((of, path, catalog)) if of == id && path == next.path => catalog,
            _ => {
                let catalog = in_place::catalog(&next.path, map)?;
                lock_live(&self.live).catalog = Some((id, next.path.clone(), catalog.clone()));
                catalog
            }
        };
        in_place::new_buckets(live, next, map, &catalog, config)
    }

    /// Puts the staged checkpoint's weights in place of the live ones: written over them when
    /// they are in the same form (released weights: only makes it what the wakeup reloads),
    /// else swapped in, their allocation becoming the live one; the engine's model takes them
    /// at its next step ([`ModelMemory::take_new_weights`]) and the old allocation is freed
    /// then. Returns the bytes written (the new buffers' bytes for a swap).
    ///
    /// # Errors
    /// Nothing staged (changed nothing), or the allocation cannot be written.
    pub fn update(&self) -> Result<u64, MemoryError> {
        let mut live = lock_live(&self.live);
        let Some(staged) = live.staged.take() else {
            let message = "no weight update is staged".to_owned();
            return Err(MemoryError { changed: false, message });
        };
        let Staged { origin, change } = staged;
        match change {
            Change::InPlace(buckets) => {
                let current = live.current.as_mut().ok_or_else(untagged)?;
                let written = current.write_in_place(&buckets, self.threads)?;
                live.previous = Some(std::mem::replace(&mut current.origin, origin));
                Ok(written)
            }
            Change::Load { model, placed: None } => {
                let current = live.current.as_mut().ok_or_else(untagged)?;
                let written = current.write(&model.weight_buffers())?;
                live.previous = Some(std::mem::replace(&mut current.origin, origin));
                Ok(written)
            }
            Change::Load { model, placed: Some(placed) } => {
                let written = model.weight_bytes() as u64;
                let replaced = live.current.as_ref().map(|c| c.origin.clone());
                live.swap_in(placed, model)?;
                live.previous = replaced;
                Ok(written)
            }
        }
    }

    /// Whether weights in new buffers wait for the engine's model to take them.
    pub(super) fn swap_pending(&self) -> bool {
        lock_live(&self.live).swap.is_some()
    }

    /// Puts back the checkpoint the latest update replaced (loaded again from its file):
    /// written over the live buffers when it is in their form, else swapped in as
    /// [`ModelMemory::update`] does (the allocation the engine still reads, when it has not
    /// taken the update's weights yet, or a new one).
    ///
    /// # Errors
    /// No update to revert, or the old checkpoint cannot be loaded, allocated or written.
    pub fn revert(&self) -> Result<u64, MemoryError> {
        let Some(previous) = lock_live(&self.live).previous.take() else {
            let message = "no weight update to revert".to_owned();
            return Err(MemoryError { changed: false, message });
        };
        let failed = |what: &str, e: &dyn std::fmt::Display| MemoryError {
            changed: false,
            message: format!("{what} {}: {e}", previous.path.display()),
        };
        let mut model = previous.load().map_err(|e| failed("reloading", &e))?;
        let layout: Vec<usize> = model.weight_buffers().iter().map(|b| b.len()).collect();
        {
            let mut live = lock_live(&self.live);
            let current = live.current.as_mut().ok_or_else(untagged)?;
            if current.layout == layout {
                let written = current.write(&model.weight_buffers())?;
                current.origin = previous;
                return Ok(written);
            }
            if let Some(swap) = live.swap.take_if(|s| s.retired.layout == layout) {
                // The engine still reads the buffers the update replaced: they come back.
                let Swap { model: new, mut retired } = swap;
                let written = match retired.write(&model.weight_buffers()) {
                    Ok(written) => written,
                    Err(e) => {
                        live.swap = Some(Swap { model: new, retired });
                        return Err(e);
                    }
                };
                retired.origin = previous;
                live.current = Some(retired);
                return Ok(written);
            }
        }
        let placed =
            self.place(&mut model, &previous).map_err(|e| failed("placing the weights of", &e))?;
        vmm::trim_heap();
        let written = model.weight_bytes() as u64;
        lock_live(&self.live).swap_in(placed, model)?;
        Ok(written)
    }

    /// Forgets a staged update (and frees the allocation it was given, if any).
    pub fn drop_update(&self) {
        let staged = lock_live(&self.live).staged.take();
        drop(staged);
    }

    /// Weights that a weight update put in new buffers, for the engine's model to take in
    /// place of its own ([`ParallelModel::adopt_weights`]) before it computes again; the
    /// buffers it read until then are freed once it drops them. `None` when there are none.
    pub fn take_new_weights(&self) -> Option<ParallelModel> {
        let swap = lock_live(&self.live).swap.take()?;
        Some(swap.model)
    }

    /// The checkpoint the weights came from.
    pub fn checkpoint(&self) -> Option<PathBuf> {
        lock_live(&self.live).current.as_ref().map(|p| p.origin.path.clone())
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
        if model.weight_bytes() == 0 {
            return Ok(());
        }
        let placed = self.place(model, origin)?;
        // The move wrote nearly every page; the commit holds the rest (alignment gaps) too,
        // so no page of the weights is faulted in during a request.
        placed.arena.commit(self.threads).map_err(|source| PlaceError::Allocate {
            what: format!("{} bytes of weights", model.weight_bytes()),
            source,
        })?;
        {
            let mut live = lock_live(&self.live);
            live.current = Some(placed);
            live.swap = None;
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

    /// Moves `model`'s weights into a new `weights` allocation restored by the weights'
    /// policy ([`Restore::Reload`]: from the checkpoint it holds when it is restored).
    fn place(&self, model: &mut ParallelModel, origin: &ShardOrigin) -> Result<Placed, PlaceError> {
        let bytes = model.weight_bytes();
        let id = {
            let mut live = lock_live(&self.live);
            live.next_id += 1;
            live.next_id
        };
        let policy = self.weights.policy().unwrap_or_else(|| {
            // Weak: the allocation lives inside what it points to.
            let live = Arc::downgrade(&self.live);
            vmm::Policy::Reload(vmm::Source::from_fn(move |buf| {
                let origin = live.upgrade().and_then(|live| lock_live(&live).origin_of(id));
                match origin {
                    Some(origin) => origin.fill(buf).map_err(std::io::Error::other),
                    // Replaced and read by no model any more: freed with its last weight.
                    None => Ok(()),
                }
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
        Ok(Placed {
            id,
            arena,
            origin: origin.clone(),
            layout: model.weight_buffers().iter().map(|b| b.len()).collect(),
            shapes: model.weight_shapes(),
            config: model.config().clone(),
            map: model.weight_map(),
        })
    }

    /// Free bytes of the GPU `backend` computes on, as NVML reports them; `None` on the CPU or
    /// when NVML cannot say.
    pub fn device_free_bytes(&self, backend: &Backend) -> Option<u64> {
        let tensor::Device::Cuda(ordinal) = backend.device() else { return None };
        let nvml = vmm::NvmlMemory::new().ok()?;
        nvml.usage(&nvml_device(ordinal, backend)).ok().map(|usage| usage.free)
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
        use tensor::memory::Arena;
        let elem = self.kv_elem(model);
        let bytes = model.pool_bytes(block_size, blocks, elem);
        let what = format!("a {bytes}-byte KV pool");
        let failed = |source: layers::Error| PlaceError::Model {
            what: what.clone(),
            source: Box::new(source),
        };
        if let Some(arena) = self.device_kv(model, bytes) {
            return model.pool_on_device(&arena, block_size, blocks, elem).map_err(|source| {
                PlaceError::Model {
                    what: format!("allocating {what} ({}) on the GPU", elem.name()),
                    source: Box::new(source),
                }
            });
        }
        let arena = self.committed_kv(bytes, "KV pool")?;
        let storage = arena.alloc(bytes).and_then(tensor::Storage::external);
        let storage = storage.map_err(|e| failed(e.into()))?;
        model.pool_in(storage, block_size).map_err(failed)
    }

    /// How [`ModelMemory::new_pool`] and [`ModelMemory::new_cache`] store `model`'s keys and
    /// values: as the model's [`ParallelModel::device_kv_elem`] (bf16 with half-precision
    /// weights) in device memory, f32 on the host.
    pub fn kv_elem(&self, model: &ParallelModel) -> tensor::kernels::KvElem {
        match self.device_for(model.backend()) {
            Some(_) => model.device_kv_elem(),
            None => tensor::kernels::KvElem::F32,
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

    /// One host `kv_cache` allocation of `bytes`, committed now on the rank's threads (its
    /// pages are zeros, faulted in before any request runs), as an arena; `what` names it in
    /// the error.
    fn committed_kv(&self, bytes: usize, what: &str) -> Result<VmmArena, PlaceError> {
        let failed =
            |source| PlaceError::Allocate { what: format!("a {bytes}-byte {what}"), source };
        let alloc = self
            .manager
            .allocate(vmm::Tag::KV_CACHE, bytes, self.kv_policy.clone())
            .map_err(failed)?;
        alloc.commit(self.threads).map_err(failed)?;
        VmmArena::new(alloc).map_err(failed)
    }
}

fn lock_live(live: &Mutex<LiveWeights>) -> std::sync::MutexGuard<'_, LiveWeights> {
    live.lock().unwrap_or_else(PoisonError::into_inner)
}

fn untagged() -> MemoryError {
    MemoryError { changed: false, message: "the weights are not in tagged memory".into() }
}

/// `MemAvailable` of /proc/meminfo, in bytes (`None` where there is none).
fn available_host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl LiveWeights {
    /// Makes `placed` (holding `model`'s weights) the live allocation; the engine's model
    /// takes `model` at its next step. The allocation it reads until then stays (the one
    /// replaced, or the one an earlier swap it has not taken yet replaced).
    fn swap_in(&mut self, placed: Placed, model: ParallelModel) -> Result<(), MemoryError> {
        let old = self.current.replace(placed);
        let retired = match self.swap.take() {
            // The engine never took the weights of `old`: nothing reads it any more.
            Some(swap) => swap.retired,
            None => old.ok_or_else(untagged)?,
        };
        self.swap = Some(Swap { model, retired });
        Ok(())
    }
}

impl Placed {
    /// Writes `buffers` over these weights, laid out as [`ModelMemory::place_weights`]
    /// placed them; nothing when the weights are released (the wakeup reloads them: a backup
    /// of the weights they replace is dropped).
    fn write(&self, buffers: &[&[u8]]) -> Result<u64, MemoryError> {
        let fail = |message: String| MemoryError { changed: false, message };
        let regions = self.arena.0.lock().unwrap_or_else(PoisonError::into_inner);
        let alloc = regions.allocation();
        if alloc.is_released() {
            alloc.discard_backup();
            return Ok(0);
        }
        let mut bytes = alloc.write().map_err(|e| fail(format!("writing the weights: {e}")))?;
        let mut offset = 0usize;
        for b in buffers {
            offset = offset.next_multiple_of(ALIGN);
            bytes[offset..offset + b.len()].copy_from_slice(b);
            offset += b.len();
        }
        // New bytes under the old addresses: a backend's device copies of them are stale.
        tensor::memory::weights_changed();
        Ok(offset as u64)
    }
}

impl Placed {
    /// Writes the tensors of `buckets` over these weights where its map places them
    /// ([`in_place::write`]); nothing when the weights are released (the wakeup reloads them,
    /// buckets included: a backup of the weights they replace is dropped).
    fn write_in_place(
        &self,
        buckets: &[checkpoint::Bucket],
        threads: usize,
    ) -> Result<u64, MemoryError> {
        let regions = self.arena.0.lock().unwrap_or_else(PoisonError::into_inner);
        let alloc = regions.allocation();
        if alloc.is_released() {
            alloc.discard_backup();
            return Ok(0);
        }
        let failed = |changed, e: &dyn std::fmt::Display| MemoryError {
            changed,
            message: format!("writing the updated weights: {e}"),
        };
        let mut bytes = alloc.write().map_err(|e| failed(false, &e))?;
        let written = in_place::write(&mut bytes, &self.layout, &self.map, buckets, threads);
        // New bytes under the old addresses (some, on a failure): device copies are stale.
        tensor::memory::weights_changed();
        written.map_err(|e| failed(true, &e))
    }
}

/// Where a shard's weights come from, to load them again for [`Restore::Reload`].
#[derive(Clone, Debug)]
pub struct ShardOrigin {
    /// The model: a GGUF file or a Hugging Face folder.
    pub path: PathBuf,
    /// Safetensors files laid over the model's tensors, a later one winning (the buckets of
    /// updates from memory).
    pub tensors: Vec<PathBuf>,
    /// The shard.
    pub placement: Placement,
    /// The form the weights are kept in.
    pub form: WeightForm,
}

impl ShardOrigin {
    /// The shard `placement` of the checkpoint at `path` alone (no tensors laid over it),
    /// kept in `form`.
    pub fn checkpoint(path: impl Into<PathBuf>, placement: Placement, form: WeightForm) -> Self {
        ShardOrigin { path: path.into(), tensors: Vec::new(), placement, form }
    }

    /// Loads the shard again and writes its weight buffers into `buf` exactly as
    /// [`ParallelModel::move_weights_to`] laid them out through a [`VmmArena`].
    fn fill(&self, buf: &mut [u8]) -> Result<(), String> {
        let model = self
            .load()
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

    /// Loads the shard: from the checkpoint, with [`ShardOrigin::tensors`] laid over it.
    ///
    /// # Errors
    /// The checkpoint or a bucket does not load, or a bucket does not fit the model.
    pub fn load(&self) -> layers::Result<ParallelModel> {
        let opts = LoadOptions::new(self.placement).form(self.form);
        if self.tensors.is_empty() {
            return ParallelModel::load(&self.path, opts);
        }
        let ck = checkpoint::Checkpoint::open(&self.path)?;
        let config = ck.config()?;
        let base = ck.weights(&config);
        let buckets = self
            .tensors
            .iter()
            .map(|p| checkpoint::Bucket::open(p, &config, &*base))
            .collect::<checkpoint::Result<Vec<_>>>()?;
        let overlay = checkpoint::Overlay::new(&*base, buckets);
        ParallelModel::from_source(&overlay, config, opts)
    }
}

mod arena;
mod in_place;
mod prepare;
mod rank;
pub mod runtime;

pub use arena::{VmmArena, VmmDeviceArena};
pub use prepare::Prepare;
pub use rank::ModelRankMemory;

#[cfg(test)]
mod tests;
