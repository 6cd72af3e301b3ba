//! What a rank's memory looks like to the control plane: [`RankMemory`] releases and
//! materializes tags and probes the process, and [`VmmMemory`] implements it over a
//! [`vmm::Manager`]. [`execute`] runs one action on one rank and undoes a partial one, so a
//! rank's failure is always reported together with whether its memory is as before.

use super::message::{Action, Probe, RankReceipt, Status, TagReceipt};
use super::version::WeightUpdate;
use std::sync::Arc;
use std::time::Instant;

/// A failed memory operation on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryError {
    /// Whether some memory changed before the failure (a partial release).
    pub changed: bool,
    /// What failed.
    pub message: String,
}

/// Why a rank refuses an operation in its prepare phase, before any memory changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// A tag is not a valid name.
    #[error("invalid tag `{tag}`: {why}")]
    InvalidTag {
        /// The name.
        tag: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A tag names no memory of this rank.
    #[error("unknown tag `{tag}` (known tags: {})", known.join(", "))]
    UnknownTag {
        /// The name.
        tag: String,
        /// The tags this rank knows.
        known: Vec<String>,
    },
    /// A weight update names no checkpoint.
    #[error("a weight update names no checkpoint")]
    NoCheckpoint,
    /// This rank's memory cannot take new weights at all.
    #[error("this rank's memory cannot load new weights (asked for {model})")]
    CannotUpdate {
        /// The checkpoint asked for.
        model: String,
    },
    /// The live weights are not in tagged memory, so an update has nothing to write to.
    #[error("the weights are not in tagged memory")]
    WeightsUntagged,
    /// The checkpoint does not load.
    #[error("loading {model}: {reason}")]
    Unloadable {
        /// The checkpoint.
        model: String,
        /// The loader's error.
        reason: String,
    },
    /// The checkpoint loads but is not the live weights' architecture, shapes or layout.
    #[error("{model} does not fit the live weights: {detail}")]
    Misfit {
        /// The checkpoint.
        model: String,
        /// The first difference.
        detail: String,
    },
    /// The checkpoint stores the live weights in another form (another quantization), so
    /// it needs new buffers beside the live ones, and the host has too little memory left.
    #[error(
        "{model} stores the weights in another form, so it needs {needed} bytes ({} MiB) of \
         host memory beside the live weights until they are swapped, and {available} bytes \
         ({} MiB) are available",
        needed >> 20,
        available >> 20
    )]
    NoRoom {
        /// The checkpoint.
        model: String,
        /// Bytes of the new buffers.
        needed: u64,
        /// Bytes the host has available.
        available: u64,
    },
    /// The checkpoint stores the weights in another form while they are asleep: new buffers
    /// are made only for weights that are awake.
    #[error(
        "{model} stores the weights in another form than the live ones, and those are asleep: \
         wake them up first, then reload"
    )]
    OtherFormAsleep {
        /// The checkpoint.
        model: String,
    },
    /// The memory refuses for a reason of its own (a tag pinned or in use).
    #[error("{0}")]
    Busy(String),
}

impl From<vmm::Error> for Refusal {
    fn from(e: vmm::Error) -> Refusal {
        match e {
            vmm::Error::InvalidTag { tag, why } => Refusal::InvalidTag { tag, why },
            other => Refusal::Busy(other.to_string()),
        }
    }
}

/// The memory of one rank, as the control plane drives it.
pub trait RankMemory: Send + Sync {
    /// Checks that `tags` can be released or materialized, without changing anything.
    ///
    /// # Errors
    /// Why not: a [`Refusal`] (an unknown or malformed tag, a tag in use).
    fn check(&self, tags: &[String]) -> Result<(), Refusal>;

    /// Releases the physical memory of `tags`; one receipt per distinct tag, in order.
    ///
    /// # Errors
    /// [`MemoryError`], saying whether anything changed.
    fn release(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError>;

    /// Releases `tags` at vLLM's sleep `level`: 1 keeps the contents of the tags the memory
    /// marks for it (the weights, unless configured otherwise) in host memory for a fast
    /// wakeup; 2, or none, applies each tag's configured restore policy. The default ignores
    /// the level.
    ///
    /// # Errors
    /// As [`RankMemory::release`].
    fn release_at(
        &self,
        tags: &[String],
        level: Option<u8>,
    ) -> Result<Vec<TagReceipt>, MemoryError> {
        let _ = level;
        self.release(tags)
    }

    /// Stages a weight update from the checkpoint at `model` (a GGUF file or a Hugging Face
    /// folder): loads this rank's shard and checks that it fits the live weights exactly,
    /// changing nothing live. The default refuses.
    ///
    /// # Errors
    /// A [`Refusal`] saying why the checkpoint cannot replace the live weights (unreadable,
    /// another architecture or other shapes).
    fn prepare_update(&self, model: &str) -> Result<(), Refusal> {
        Err(Refusal::CannotUpdate { model: model.to_owned() })
    }

    /// Stages a weight update that may lay tensors over the checkpoint (see
    /// [`WeightUpdate::tensors`]). The default takes checkpoints alone, through
    /// [`RankMemory::prepare_update`].
    ///
    /// # Errors
    /// As [`RankMemory::prepare_update`]; tensors to lay over it when the memory cannot.
    fn prepare_update_with(&self, update: &WeightUpdate) -> Result<(), Refusal> {
        if update.tensors.is_empty() {
            self.prepare_update(&update.model)
        } else {
            Err(Refusal::CannotUpdate { model: update.model.clone() })
        }
    }

    /// Makes the staged checkpoint the live weights (asleep: the one the wakeup reloads).
    ///
    /// # Errors
    /// [`MemoryError`]; nothing staged is an error that changed nothing.
    fn update(&self) -> Result<Vec<TagReceipt>, MemoryError> {
        Err(MemoryError { changed: false, message: "no weight update is staged".into() })
    }

    /// Puts back the weights the last update replaced.
    ///
    /// # Errors
    /// [`MemoryError`].
    fn revert(&self) -> Result<Vec<TagReceipt>, MemoryError> {
        Err(MemoryError { changed: false, message: "no weight update to revert".into() })
    }

    /// Forgets a staged update (its operation was aborted).
    fn drop_update(&self) {}

    /// Maps the memory of `tags` again and restores it; one receipt per distinct tag.
    ///
    /// # Errors
    /// [`MemoryError`], saying whether anything changed.
    fn materialize(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError>;

    /// Reads the process's memory (host resident bytes; device bytes on GPU).
    fn probe(&self) -> Probe;
}

/// [`RankMemory`] over a [`vmm::Manager`]. On a CUDA manager the probe adds NVML's bytes of
/// this process on `device`.
#[derive(Clone)]
pub struct VmmMemory {
    manager: Arc<vmm::Manager>,
    device: Option<vmm::NvmlDevice>,
    nvml: Option<Arc<vmm::NvmlMemory>>,
}

impl std::fmt::Debug for VmmMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmMemory").field("device", &self.device).finish_non_exhaustive()
    }
}

impl VmmMemory {
    /// Wraps `manager`. `device` is NVML's name of the GPU a CUDA manager allocates on (its
    /// UUID, or its NVML index; ignored, and no NVML loaded, for a CPU manager).
    pub fn new(manager: Arc<vmm::Manager>, device: Option<vmm::NvmlDevice>) -> VmmMemory {
        let nvml = if manager.backend_name() == "cpu" {
            None
        } else {
            vmm::NvmlMemory::new().ok().map(Arc::new)
        };
        VmmMemory { manager, device, nvml }
    }

    /// Wraps a manager of any backend and adds NVML's reading of GPU `device` (by UUID or NVML
    /// index) to the probe, when NVML loads: for ranks whose kernels run on a GPU while their
    /// tagged memory is host memory.
    pub fn with_device(manager: Arc<vmm::Manager>, device: vmm::NvmlDevice) -> VmmMemory {
        let nvml = vmm::NvmlMemory::new().ok().map(Arc::new);
        VmmMemory { manager, device: Some(device), nvml }
    }

    /// The manager.
    pub fn manager(&self) -> &Arc<vmm::Manager> {
        &self.manager
    }

    /// Releases `tags`, backing up the contents of the tags in `backups` to their store
    /// whatever their policy (see [`vmm::Manager::release_with`]).
    ///
    /// # Errors
    /// As [`RankMemory::release`].
    pub fn release_with(
        &self,
        tags: &[String],
        backups: &[(vmm::Tag, vmm::BackupStore)],
    ) -> Result<Vec<TagReceipt>, MemoryError> {
        let device = self.on_device();
        self.manager.release_with(tags, backups).map(|r| receipts(r, device)).map_err(|e| {
            MemoryError {
                changed: matches!(e, vmm::Error::ReleasePartial { .. }),
                message: e.to_string(),
            }
        })
    }

    /// Whether the manager's allocations are device memory.
    fn on_device(&self) -> bool {
        self.manager.backend_name() != "cpu"
    }
}

/// The receipts of a manager, whose bytes are device memory when `device`.
fn receipts(rs: Vec<vmm::Receipt>, device: bool) -> Vec<TagReceipt> {
    rs.into_iter()
        .map(|r| TagReceipt {
            tag: r.tag.as_str().to_owned(),
            allocations: r.allocations,
            bytes: r.bytes,
            device_bytes: if device { r.bytes } else { 0 },
            copied_bytes: r.copied_bytes,
            elapsed_us: r.elapsed.as_micros() as u64,
            restore: String::new(),
        })
        .collect()
}

impl RankMemory for VmmMemory {
    fn check(&self, tags: &[String]) -> Result<(), Refusal> {
        let known = self.manager.known_tags();
        for t in tags {
            let tag = vmm::Tag::new(t.as_str())?;
            if !known.contains(&tag) {
                let known = known.iter().map(|k| k.as_str().to_owned()).collect();
                return Err(Refusal::UnknownTag { tag: t.clone(), known });
            }
        }
        Ok(())
    }

    fn release(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        self.release_with(tags, &[])
    }

    fn materialize(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        // A failed materialize unmaps again what it mapped (MaterializeRolledBack): unchanged.
        self.manager
            .materialize(tags)
            .map(|r| receipts(r, self.on_device()))
            .map_err(|e| MemoryError { changed: false, message: e.to_string() })
    }

    fn probe(&self) -> Probe {
        let resident = vmm::ProcessMemory::resident_now().unwrap_or(0);
        let mut probe = Probe { resident, ..Probe::default() };
        if let (Some(nvml), Some(device)) = (&self.nvml, &self.device) {
            if let Ok(usage) = nvml.usage(device) {
                let index = usage.index;
                // An unlisted process reads as the whole device, and says so.
                let bytes = usage.bytes_of(std::process::id()).unwrap_or_else(|| {
                    probe.device_wide.push(index);
                    usage.used
                });
                probe.devices.push((index, bytes));
                probe.device_used.push((index, usage.used));
                let id = usage.uuid.clone().unwrap_or_else(|| format!("{}:nvml{index}", host()));
                probe.device_ids.push((index, id));
            }
        }
        probe
    }
}

/// This machine's name (for devices NVML gives no UUID of).
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}

/// A rank without tagged memory: every tag is accepted and nothing moves (the control
/// protocol alone, as the benchmark measures it).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoMemory;

impl RankMemory for NoMemory {
    fn check(&self, _tags: &[String]) -> Result<(), Refusal> {
        Ok(())
    }
    fn release(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        Ok(tags.iter().map(|t| TagReceipt { tag: t.clone(), ..TagReceipt::default() }).collect())
    }
    fn materialize(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        self.release(tags)
    }
    fn probe(&self) -> Probe {
        Probe::default()
    }
}

/// Runs `action` on `tags` with probes around it. A failure that changed memory is undone
/// with the inverse action; the error's status is [`Status::Failed`] when the memory is as
/// before and [`Status::Fatal`] when the undo failed too.
pub(crate) fn execute(
    rank: usize,
    memory: &dyn RankMemory,
    action: Action,
    tags: &[String],
    level: Option<u8>,
) -> Result<RankReceipt, (Status, String)> {
    let before = memory.probe();
    let start = Instant::now();
    // A panic inside the memory layer is a failure that may have changed memory part way:
    // it is undone like one, so the protocol's ABORT, drain and rollback still run.
    let run = |a: Action| {
        let op = std::panic::AssertUnwindSafe(|| match a {
            Action::Sleep => memory.release_at(tags, level),
            Action::Wakeup => memory.materialize(tags),
            Action::Update => memory.update(),
            Action::Revert => memory.revert(),
        });
        std::panic::catch_unwind(op).unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".into());
            Err(MemoryError { changed: true, message: format!("panicked: {what}") })
        })
    };
    match run(action) {
        Ok(tag_receipts) => Ok(RankReceipt {
            rank,
            tags: tag_receipts,
            before,
            after: memory.probe(),
            elapsed_us: start.elapsed().as_micros() as u64,
            asleep: Vec::new(),
        }),
        Err(e) if !e.changed => Err((Status::Failed, format!("{action} {tags:?}: {}", e.message))),
        Err(e) => match run(action.inverse()) {
            Ok(_) => Err((
                Status::Failed,
                format!("{action} {tags:?}: {} (partial change undone)", e.message),
            )),
            Err(undo) => Err((
                Status::Fatal,
                format!(
                    "{action} {tags:?}: {}; undoing it with {} failed: {}",
                    e.message,
                    action.inverse(),
                    undo.message
                ),
            )),
        },
    }
}
