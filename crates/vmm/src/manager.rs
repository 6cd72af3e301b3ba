//! The manager: tagged allocations with stable addresses, released and materialized by tag.

use crate::backend::{self, Backend, BackendKind, Init, Phys};
use crate::chunked;
use crate::error::{Error, Failure, Result};
use crate::fail;
use crate::policy::{BackupStore, Policy, SourceKind};
use crate::pool::{HostPool, Lease};
use crate::receipt::{Op, Receipt};
use crate::spill::{default_spill_dir, SpillFile, SpillStore};
use crate::tag::Tag;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{
    Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError,
};
use std::time::{Duration, Instant};

/// Configures and creates a [`Manager`].
#[derive(Clone, Debug, Default)]
pub struct ManagerBuilder {
    backend: BackendKind,
    spill_dir: Option<PathBuf>,
    spill_limit: Option<u64>,
    default_store: Option<BackupStore>,
    max_allocation: Option<u64>,
    preallocate: Vec<Tag>,
    /// The chunk of backups and restores (default [`chunked::CHUNK`]; tests cut small
    /// allocations into several).
    chunk: Option<usize>,
}

impl ManagerBuilder {
    /// The backend to drive (default [`BackendKind::Cpu`]).
    pub fn backend(mut self, kind: BackendKind) -> Self {
        self.backend = kind;
        self
    }

    /// The directory for spill files (default [`crate::default_spill_dir`]). It is created on
    /// the first spill.
    pub fn spill_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.spill_dir = Some(dir.into());
        self
    }

    /// A cap on the bytes all spill files hold together; a backup that would pass it fails
    /// with [`Error::SpillFull`] before anything is released.
    pub fn spill_limit(mut self, bytes: u64) -> Self {
        self.spill_limit = Some(bytes);
        self
    }

    /// What [`BackupStore::Default`] means for this manager.
    pub fn default_store(mut self, store: BackupStore) -> Self {
        self.default_store = Some(store);
        self
    }

    /// A cap on the size of one allocation, below the backend's own limit (physical memory).
    pub fn max_allocation(mut self, bytes: u64) -> Self {
        self.max_allocation = Some(bytes);
        self
    }

    /// Allocate the host memory that backups of `tags` into host memory take as their
    /// allocations are made, instead of at their first release; see
    /// [`Manager::preallocate_host_backups`].
    pub fn preallocate_host_backups(mut self, tags: impl IntoIterator<Item = Tag>) -> Self {
        self.preallocate.extend(tags);
        self
    }

    /// Creates the manager.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when the backend cannot run here (no CUDA driver or
    /// device), [`Error::NotCompiledWith`] for CUDA without the `cuda` feature.
    pub fn build(self) -> Result<Manager> {
        let backend = backend::create(self.backend)?;
        Ok(self.build_on(backend))
    }

    /// A manager of the test backend with `chunk`-byte copies, and the probe that watches it.
    #[cfg(test)]
    pub(crate) fn build_fake(
        mut self,
        chunk: usize,
    ) -> (Manager, std::sync::Arc<backend::fake::Probe>) {
        let (backend, probe) = backend::fake::create();
        self.chunk = Some(chunk);
        (self.build_on(backend), probe)
    }

    fn build_on(self, backend: Box<dyn Backend>) -> Manager {
        let mut default_store = self.default_store.unwrap_or(BackupStore::Default);
        if default_store == BackupStore::Default {
            default_store = backend.default_store();
        }
        let limit = backend.max_bytes();
        let max_allocation = self.max_allocation.map_or(limit, |m| m.min(limit));
        let spill =
            SpillStore::new(self.spill_dir.unwrap_or_else(default_spill_dir), self.spill_limit);
        let mut known: BTreeSet<Tag> = Tag::WELL_KNOWN.into_iter().collect();
        known.extend(self.preallocate.iter().cloned());
        let state = State {
            pool: HostPool::default(),
            preallocate: self.preallocate.into_iter().collect(),
            backend,
            allocs: BTreeMap::new(),
            next_id: 1,
            known,
            spill,
            default_store,
            max_allocation,
            chunk: self.chunk.unwrap_or(chunked::CHUNK),
        };
        Manager { inner: Arc::new(Inner { state: Mutex::new(state) }) }
    }
}

/// Owns every tagged allocation of a process and releases and materializes them by tag.
///
/// The intent is one manager per process (per device for CUDA): it is the single place that
/// knows what memory exists and in which state. Tests may create several. All operations take
/// one internal lock, so concurrent `release` and `materialize` calls are serialized and each
/// one sees and leaves a consistent state. A `Manager` is cheap to clone (it is a handle) and
/// is `Send + Sync`.
#[derive(Clone)]
pub struct Manager {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
}

struct State {
    /// The host memory of host backups. Declared before `backend` so that it is freed while
    /// the backend (for CUDA, its context) still lives.
    pool: HostPool,
    /// Tags whose host backups the pool is sized for as their allocations are made.
    preallocate: BTreeSet<Tag>,
    backend: Box<dyn Backend>,
    allocs: BTreeMap<u64, Arc<Shared>>,
    next_id: u64,
    known: BTreeSet<Tag>,
    spill: SpillStore,
    default_store: BackupStore,
    max_allocation: u64,
    /// The bytes of one chunk of a backup or restore in host memory.
    chunk: usize,
}

/// What a manager and an allocation handle share about one allocation.
struct Shared {
    id: u64,
    tag: Tag,
    bytes: usize,
    mapped: usize,
    base: u64,
    policy: Policy,
    store: BackupStore,
    backend: &'static str,
    device: mesh::Device,
    host_accessible: bool,
    slot: RwLock<Slot>,
    /// Mirrors `slot.phys.is_none()`, written with the slot's write lock held, so that state
    /// queries never wait on (or deadlock with) a guard.
    released: AtomicBool,
}

/// The mutable state of one allocation.
struct Slot {
    /// The physical memory while materialized; `None` while released.
    phys: Option<Phys>,
    /// The backup while released under [`Policy::Backup`] (or a level-1 style release).
    backup: Option<Backup>,
}

enum Backup {
    /// Bytes lent by the manager's host pool; given back, never dropped.
    Host(Lease),
    Spill(SpillFile),
}

impl Backup {
    fn bytes(&self) -> u64 {
        match self {
            Backup::Host(lease) => lease.len() as u64,
            Backup::Spill(file) => file.bytes,
        }
    }
}

/// A snapshot of one allocation, from [`Manager::allocations`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocationInfo {
    /// Allocation id, unique within the manager.
    pub id: u64,
    /// Its tag.
    pub tag: Tag,
    /// Bytes asked for.
    pub bytes: u64,
    /// Bytes reserved and mapped (rounded up to the backend's granularity).
    pub mapped_bytes: u64,
    /// Its base address.
    pub base: u64,
    /// Whether it is released.
    pub released: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while the lock was held leaves every slot in a state this code wrote whole
    // (slots change only after each backend step succeeds), so the data is still usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn try_write(shared: &Shared) -> Result<RwLockWriteGuard<'_, Slot>> {
    match shared.slot.try_write() {
        Ok(g) => Ok(g),
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => {
            Err(Error::Busy { id: shared.id, tag: shared.tag.clone() })
        }
    }
}

impl Shared {
    fn wrap(&self, source: Error) -> Error {
        Error::Allocation {
            id: self.id,
            tag: self.tag.clone(),
            bytes: self.bytes as u64,
            source: Box::new(source),
        }
    }
}

impl Manager {
    /// A manager for host memory with the default configuration.
    ///
    /// # Errors
    /// Does not fail today; kept fallible like [`ManagerBuilder::build`].
    pub fn cpu() -> Result<Manager> {
        Manager::builder().build()
    }

    /// A builder to configure a manager.
    pub fn builder() -> ManagerBuilder {
        ManagerBuilder::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.inner.state)
    }

    /// The backend's name (`cpu` or `cuda`).
    pub fn backend_name(&self) -> &'static str {
        self.state().backend.name()
    }

    /// The size every allocation is rounded up to a multiple of.
    pub fn granularity(&self) -> usize {
        self.state().backend.granularity()
    }

    /// The spill directory.
    pub fn spill_dir(&self) -> PathBuf {
        self.state().spill.dir().to_path_buf()
    }

    /// Bytes currently held in spill files.
    pub fn spilled_bytes(&self) -> u64 {
        self.state().spill.used()
    }

    /// Makes a user-defined tag known without allocating, so that releasing or materializing
    /// it is a no-op rather than [`Error::UnknownTag`].
    ///
    /// # Errors
    /// [`Error::InvalidTag`] for a malformed name.
    pub fn define_tag(&self, tag: impl AsRef<str>) -> Result<Tag> {
        let tag = Tag::new(tag.as_ref())?;
        self.state().known.insert(tag.clone());
        Ok(tag)
    }

    /// Every tag this manager knows: the well-known ones and each one used or defined since.
    pub fn known_tags(&self) -> Vec<Tag> {
        self.state().known.iter().cloned().collect()
    }

    /// A snapshot of every live allocation, by id.
    pub fn allocations(&self) -> Vec<AllocationInfo> {
        let state = self.state();
        state
            .allocs
            .values()
            .map(|s| AllocationInfo {
                id: s.id,
                tag: s.tag.clone(),
                bytes: s.bytes as u64,
                mapped_bytes: s.mapped as u64,
                base: s.base,
                released: s.released.load(Ordering::Acquire),
            })
            .collect()
    }

    /// Allocates `bytes` bytes (rounded up to the granularity) with `tag` and `policy`. The
    /// allocation starts materialized and zeroed, at an address it keeps until it is dropped.
    /// Dropping the [`Allocation`] frees it.
    ///
    /// # Errors
    /// [`Error::InvalidTag`], [`Error::ZeroSize`], [`Error::TooLarge`] (more than the physical
    /// memory of the backend or the manager's cap), [`Error::BadSource`] for a reload file
    /// shorter than the allocation, or [`Error::Allocation`] when reserving or mapping fails.
    pub fn allocate(
        &self,
        tag: impl AsRef<str>,
        bytes: usize,
        policy: Policy,
    ) -> Result<Allocation> {
        let tag = Tag::new(tag.as_ref())?;
        if bytes == 0 {
            return Err(Error::ZeroSize { tag });
        }
        let mut state = self.state();
        let gran = state.backend.granularity();
        let too_large =
            |limit: u64, why| Error::TooLarge { tag: tag.clone(), bytes: bytes as u64, limit, why };
        let mapped = bytes
            .checked_next_multiple_of(gran)
            .ok_or_else(|| too_large(state.max_allocation, "the size overflows when rounded up"))?;
        if mapped as u64 > state.max_allocation {
            let why = if state.max_allocation == state.backend.max_bytes() {
                "the backend's physical memory"
            } else {
                "the manager's max_allocation"
            };
            return Err(too_large(state.max_allocation, why));
        }
        if let Policy::Reload(source) = &policy {
            if let SourceKind::File { file, offset, .. } = &*source.0 {
                let len = file.metadata().map(|m| m.len()).unwrap_or(0);
                if len < offset.saturating_add(bytes as u64) {
                    return Err(Error::BadSource {
                        tag,
                        source_desc: source.describe(),
                        why: format!("the file has {len} bytes, the allocation needs {bytes} from offset {offset}"),
                    });
                }
            }
        }
        let store = match &policy {
            Policy::Backup(BackupStore::Default) => state.default_store,
            Policy::Backup(store) => *store,
            _ => BackupStore::Default,
        };
        let id = state.next_id;
        let wrap = |source| Error::Allocation {
            id,
            tag: tag.clone(),
            bytes: bytes as u64,
            source: Box::new(source),
        };
        if state.preallocates(&tag, store) {
            state.preallocate(Some(mapped)).map_err(wrap)?;
        }
        let base = state.backend.reserve(mapped).map_err(wrap)?;
        let phys = match state.backend.map(base, mapped, tag.as_str(), Init::Zero) {
            Ok(phys) => phys,
            Err(e) => {
                if let Err(undo) = state.backend.free(base, mapped, None) {
                    tracing::error!(error = %undo, "could not free a reservation after a failed map");
                }
                return Err(wrap(e));
            }
        };
        state.next_id += 1;
        let host_accessible = state.backend.host_ptr(base).is_some();
        let shared = Arc::new(Shared {
            id,
            tag: tag.clone(),
            bytes,
            mapped,
            base,
            policy,
            store,
            backend: state.backend.name(),
            device: state.backend.device(),
            host_accessible,
            slot: RwLock::new(Slot { phys: Some(phys), backup: None }),
            released: AtomicBool::new(false),
        });
        state.allocs.insert(id, Arc::clone(&shared));
        state.known.insert(tag);
        Ok(Allocation { shared, inner: Arc::clone(&self.inner) })
    }

    /// Resolves `tags` to known tags, in order, without duplicates.
    fn resolve<T: AsRef<str>>(
        state: &State,
        tags: impl IntoIterator<Item = T>,
    ) -> Result<Vec<Tag>> {
        let mut out: Vec<Tag> = Vec::new();
        for t in tags {
            let tag = Tag::new(t.as_ref())?;
            if !state.known.contains(&tag) {
                let known = state.known.iter().map(Tag::as_str).collect::<Vec<_>>().join(", ");
                return Err(Error::UnknownTag { tag: tag.as_str().to_owned(), known });
            }
            if !out.contains(&tag) {
                out.push(tag);
            }
        }
        Ok(out)
    }

    /// The allocations with one of `tags`, in tag order then id order.
    fn targets(state: &State, tags: &[Tag]) -> Vec<Arc<Shared>> {
        tags.iter()
            .flat_map(|t| state.allocs.values().filter(move |s| &s.tag == t).cloned())
            .collect()
    }

    /// Releases the physical memory of every allocation with one of `tags`, after backing up
    /// the contents of those with [`Policy::Backup`]. Addresses stay reserved. Allocations
    /// already released are left alone. Returns one receipt per distinct tag, in the order
    /// given.
    ///
    /// The release runs in two phases: first every backup is taken, and if one fails nothing
    /// has been released; then every allocation is unmapped.
    ///
    /// # Errors
    /// Before any change: [`Error::InvalidTag`], [`Error::UnknownTag`], or
    /// [`Error::ReleaseAborted`] (an allocation is borrowed by a guard, or a backup failed,
    /// for example [`Error::SpillFull`] or a spill directory that cannot be written).
    /// After some changes: [`Error::ReleasePartial`], which lists each allocation that could
    /// not be unmapped (it stays materialized, contents intact) and the receipts of the rest.
    pub fn release<T: AsRef<str>>(
        &self,
        tags: impl IntoIterator<Item = T>,
    ) -> Result<Vec<Receipt>> {
        self.release_with(tags, &[])
    }

    /// [`Manager::release`], with the contents of every allocation of a tag listed in
    /// `backups` copied to that store first, whatever its policy: the next materialize
    /// restores that copy instead of applying the policy. A caller's choice for one release,
    /// such as vLLM's sleep level 1, which keeps weights in host memory for a fast wakeup.
    ///
    /// # Errors
    /// As [`Manager::release`].
    pub fn release_with<T: AsRef<str>>(
        &self,
        tags: impl IntoIterator<Item = T>,
        backups: &[(Tag, BackupStore)],
    ) -> Result<Vec<Receipt>> {
        let mut state = self.state();
        let tags = Self::resolve(&state, tags)?;
        let targets = Self::targets(&state, &tags);
        let mut slots = Vec::with_capacity(targets.len());
        for s in &targets {
            slots.push(try_write(s).map_err(|e| Error::ReleaseAborted { source: Box::new(e) })?);
        }
        let mut receipts: Vec<Receipt> =
            tags.iter().map(|t| Receipt::zero(t.clone(), Op::Release)).collect();

        // Phase 1: backups. Nothing is released yet, so a failure just gives back what was
        // saved. The host pool grows first, at most once, if the host backups do not fit.
        let stores: Vec<Option<BackupStore>> = targets
            .iter()
            .zip(&slots)
            .map(|(s, slot)| {
                let asked = backups.iter().find(|(t, _)| *t == s.tag).map(|(_, store)| store);
                let store = match (&s.policy, asked) {
                    (_, Some(BackupStore::Default)) => state.default_store,
                    (_, Some(store)) => *store,
                    (Policy::Backup(_), None) => s.store,
                    _ => return None,
                };
                slot.phys.as_ref().map(|_| store)
            })
            .collect();
        let in_host: Vec<&Arc<Shared>> = (targets.iter().zip(&stores))
            .filter(|(_, store)| contents::in_host_memory(**store))
            .map(|(s, _)| s)
            .collect();
        let start = Instant::now();
        let st = &mut *state;
        st.pool
            .reserve(&*st.backend, &in_host.iter().map(|s| s.mapped).collect::<Vec<_>>())
            .map_err(|e| Error::ReleaseAborted { source: Box::new(e) })?;
        // Growing the pool counts in the receipt of the first tag that needed it.
        if let Some(first) = in_host.first() {
            let i = receipt_of(&receipts, &first.tag);
            receipts[i].elapsed += start.elapsed();
        }
        let mut saved: Vec<Option<Backup>> = Vec::with_capacity(targets.len());
        for (s, store) in targets.iter().zip(stores) {
            let Some(store) = store else {
                saved.push(None);
                continue;
            };
            let start = Instant::now();
            let backup = match contents::backup(&mut state, s, store) {
                Ok(backup) => backup,
                Err(e) => {
                    saved.into_iter().flatten().for_each(|b| state.give_back(b));
                    return Err(Error::ReleaseAborted { source: Box::new(s.wrap(e)) });
                }
            };
            let i = receipt_of(&receipts, &s.tag);
            receipts[i].copied_bytes += backup.bytes();
            receipts[i].elapsed += start.elapsed();
            saved.push(Some(backup));
        }

        // Phase 2: unmap. A failure leaves that allocation materialized and goes on.
        let mut failures = Vec::new();
        for ((s, slot), backup) in targets.iter().zip(&mut slots).zip(saved) {
            let Some(phys) = slot.phys.take() else { continue };
            let start = Instant::now();
            let unmapped = match fail::hit("vmm.unmap") {
                Ok(()) => state.backend.unmap(s.base, s.mapped, phys),
                Err(e) => Err((phys, e)),
            };
            let i = receipt_of(&receipts, &s.tag);
            match unmapped {
                Ok(()) => {
                    slot.backup = backup;
                    receipts[i].allocations += 1;
                    receipts[i].bytes += s.mapped as u64;
                }
                Err((phys, e)) => {
                    slot.phys = Some(phys);
                    if let Some(b) = backup {
                        receipts[i].copied_bytes -= b.bytes();
                        state.give_back(b);
                    }
                    failures.push(Failure { id: s.id, tag: s.tag.clone(), error: s.wrap(e) });
                }
            }
            receipts[i].elapsed += start.elapsed();
        }
        publish(&targets, &slots);
        drop(slots);
        drop(state);
        for r in &receipts {
            tracing::debug!(tag = %r.tag, allocations = r.allocations, bytes = r.bytes, copied = r.copied_bytes, elapsed = ?r.elapsed, "released");
        }
        if failures.is_empty() {
            Ok(receipts)
        } else {
            Err(Error::ReleasePartial { failures, receipts })
        }
    }

    /// Maps fresh physical memory behind every released allocation with one of `tags`, at
    /// its old address, and restores its contents per its policy. Allocations already
    /// materialized are left alone. Returns one receipt per distinct tag, in the order given.
    ///
    /// # Errors
    /// Before any change: [`Error::InvalidTag`], [`Error::UnknownTag`], [`Error::Busy`] (a
    /// guard on one of the allocations is alive). When an allocation
    /// fails to map or restore (out of memory, a reload source fails, a spill file cannot be
    /// read): [`Error::MaterializeRolledBack`], after every allocation mapped by this call was
    /// released again, with its backup kept, so the state is as before the call.
    pub fn materialize<T: AsRef<str>>(
        &self,
        tags: impl IntoIterator<Item = T>,
    ) -> Result<Vec<Receipt>> {
        let mut state = self.state();
        let tags = Self::resolve(&state, tags)?;
        let targets = Self::targets(&state, &tags);
        let mut slots = Vec::with_capacity(targets.len());
        for s in &targets {
            slots.push(try_write(s)?);
        }
        let mut receipts: Vec<Receipt> =
            tags.iter().map(|t| Receipt::zero(t.clone(), Op::Materialize)).collect();
        let mut done: Vec<usize> = Vec::new();
        let mut failed = None;
        for (k, (s, slot)) in targets.iter().zip(&mut slots).enumerate() {
            if slot.phys.is_some() {
                continue;
            }
            let start = Instant::now();
            match fail::hit("vmm.map").and_then(|()| contents::map_one(&mut state, s, slot)) {
                Ok(copied) => {
                    let i = receipt_of(&receipts, &s.tag);
                    receipts[i].allocations += 1;
                    receipts[i].bytes += s.mapped as u64;
                    receipts[i].copied_bytes += copied;
                    receipts[i].elapsed += start.elapsed();
                    done.push(k);
                }
                Err(e) => {
                    failed = Some(s.wrap(e));
                    break;
                }
            }
        }
        if let Some(error) = failed {
            let mut rolled_back = 0;
            for &k in &done {
                let (s, slot) = (&targets[k], &mut slots[k]);
                let Some(phys) = slot.phys.take() else { continue };
                match state.backend.unmap(s.base, s.mapped, phys) {
                    Ok(()) => rolled_back += 1,
                    Err((phys, e)) => {
                        // It stays materialized with its contents restored: consistent, and
                        // the backup is no longer needed.
                        tracing::error!(id = s.id, tag = %s.tag, error = %e, "rollback could not unmap; allocation stays materialized");
                        slot.phys = Some(phys);
                        if let Some(b) = slot.backup.take() {
                            state.give_back(b);
                        }
                    }
                }
            }
            publish(&targets, &slots);
            return Err(Error::MaterializeRolledBack { rolled_back, source: Box::new(error) });
        }
        // Commit: the restored allocations no longer need their backups; host memory goes
        // back to the pool.
        for &k in &done {
            if let Some(b) = slots[k].backup.take() {
                state.give_back(b);
            }
        }
        publish(&targets, &slots);
        drop(slots);
        drop(state);
        for r in &receipts {
            tracing::debug!(tag = %r.tag, allocations = r.allocations, bytes = r.bytes, copied = r.copied_bytes, elapsed = ?r.elapsed, "materialized");
        }
        Ok(receipts)
    }
}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("Manager")
            .field("backend", &state.backend.name())
            .field("allocations", &state.allocs.len())
            .field("spill_dir", &state.spill.dir())
            .finish()
    }
}

/// One tagged allocation. Its base address never changes; its memory is accessible only while
/// it is materialized. Dropping it frees the memory and the address range.
pub struct Allocation {
    shared: Arc<Shared>,
    inner: Arc<Inner>,
}

impl Allocation {
    /// Id, unique within its manager.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Its tag.
    pub fn tag(&self) -> &Tag {
        &self.shared.tag
    }

    /// Its restore policy.
    pub fn policy(&self) -> &Policy {
        &self.shared.policy
    }

    /// Bytes asked for.
    pub fn bytes(&self) -> usize {
        self.shared.bytes
    }

    /// Bytes reserved and mapped: [`Allocation::bytes`] rounded up to the granularity.
    pub fn mapped_bytes(&self) -> usize {
        self.shared.mapped
    }

    /// The base address, the same for the allocation's whole life. For the CUDA backend this
    /// is the device pointer (`CUdeviceptr`).
    pub fn base(&self) -> u64 {
        self.shared.base
    }

    /// Where the memory lives: [`mesh::Device::Cpu`] for the host backend, the CUDA device
    /// for the CUDA backend.
    pub fn device(&self) -> mesh::Device {
        self.shared.device
    }

    /// The base address as a host pointer; see [`Allocation::base`].
    ///
    /// The pointer stays the same across release and materialize, but dereferencing it is
    /// sound only while the allocation is materialized and no release can run concurrently
    /// (hold a guard from [`Allocation::read`] or [`Allocation::write`] for checked access).
    /// While released the range is mapped `PROT_NONE` (CPU): an access faults.
    pub fn as_ptr(&self) -> *mut u8 {
        self.shared.base as *mut u8
    }

    /// Whether the allocation is released. May change right after it returns when other
    /// threads release or materialize.
    pub fn is_released(&self) -> bool {
        self.shared.released.load(Ordering::Acquire)
    }

    /// Drops the backup a release took of this released allocation, so that the next
    /// materialize restores it by its policy instead (a [`Policy::Reload`] source reads what
    /// the contents should now be: new weights that replaced the backed-up ones while asleep).
    /// Returns whether there was one; nothing changes for a materialized allocation.
    pub fn discard_backup(&self) -> bool {
        let backup = {
            let mut slot = self.shared.slot.write().unwrap_or_else(PoisonError::into_inner);
            if slot.phys.is_some() {
                return false;
            }
            slot.backup.take()
        };
        // Not under the slot's lock: the manager's lock is taken before a slot's elsewhere.
        backup.map(|b| lock(&self.inner.state).give_back(b)).is_some()
    }

    fn check(&self, slot: &Slot) -> Result<()> {
        let s = &self.shared;
        if !s.host_accessible {
            return Err(Error::NotHostAccessible {
                id: s.id,
                tag: s.tag.clone(),
                backend: s.backend,
            });
        }
        if slot.phys.is_none() {
            return Err(Error::Released { id: s.id, tag: s.tag.clone(), bytes: s.bytes as u64 });
        }
        Ok(())
    }

    /// Commits the allocation's physical memory now, on `threads` threads, so that its first
    /// use does not fault its pages in one by one (a KV pool committed at start-up, not during
    /// the first request). Contents are unchanged. Host memory only; device memory is physical
    /// from its allocation, so there this does nothing. While it runs, a release or
    /// materialize of this allocation fails with [`Error::Busy`].
    ///
    /// # Errors
    /// [`Error::Released`] while released; [`Error::Os`] when the kernel cannot commit the
    /// pages (out of memory).
    pub fn commit(&self, threads: usize) -> Result<()> {
        let s = &self.shared;
        let slot = self.shared.slot.write().unwrap_or_else(PoisonError::into_inner);
        if slot.phys.is_none() {
            return Err(Error::Released { id: s.id, tag: s.tag.clone(), bytes: s.bytes as u64 });
        }
        if s.device != mesh::Device::Cpu {
            return Ok(());
        }
        crate::backend::cpu::commit(s.base, s.mapped, threads)
    }

    /// Shared access to the bytes. While the guard lives, a release or materialize of this
    /// allocation fails with [`Error::Busy`]; a guard requested while one runs waits for it.
    ///
    /// # Errors
    /// [`Error::Released`] while released; [`Error::NotHostAccessible`] for device memory.
    pub fn read(&self) -> Result<ReadGuard<'_>> {
        let slot = self.shared.slot.read().unwrap_or_else(PoisonError::into_inner);
        self.check(&slot)?;
        Ok(ReadGuard { _slot: slot, ptr: self.as_ptr(), len: self.shared.bytes })
    }

    /// Exclusive access to the bytes; see [`Allocation::read`].
    ///
    /// # Errors
    /// [`Error::Released`] while released; [`Error::NotHostAccessible`] for device memory.
    pub fn write(&self) -> Result<WriteGuard<'_>> {
        let slot = self.shared.slot.write().unwrap_or_else(PoisonError::into_inner);
        self.check(&slot)?;
        Ok(WriteGuard { _slot: slot, ptr: self.as_ptr(), len: self.shared.bytes })
    }
}

impl Allocation {
    fn copy_check(&self, slot: &Slot, offset: usize, len: usize) -> Result<()> {
        let s = &self.shared;
        if slot.phys.is_none() {
            return Err(Error::Released { id: s.id, tag: s.tag.clone(), bytes: s.bytes as u64 });
        }
        if offset.checked_add(len).is_none_or(|end| end > s.bytes) {
            return Err(Error::OutOfBounds {
                id: s.id,
                tag: s.tag.clone(),
                offset,
                len,
                bytes: s.bytes as u64,
            });
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` into `dst`; works for every backend (a device to
    /// host copy for CUDA).
    ///
    /// # Errors
    /// [`Error::Released`] while released, [`Error::OutOfBounds`] past the end,
    /// [`Error::Busy`] while a guard on this allocation is alive, or the backend's copy error.
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let state = lock(&self.inner.state);
        // Not a blocking lock: the caller may hold a guard on this allocation.
        let slot = try_write(&self.shared)?;
        self.copy_check(&slot, offset, dst.len())?;
        state.backend.copy_to_host(self.shared.base + offset as u64, dst)
    }

    /// Copies `src` to `offset`; works for every backend (a host to device copy for CUDA).
    ///
    /// # Errors
    /// [`Error::Released`] while released, [`Error::OutOfBounds`] past the end,
    /// [`Error::Busy`] while a guard on this allocation is alive, or the backend's copy error.
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<()> {
        let state = lock(&self.inner.state);
        // Not a blocking lock: the caller may hold a guard on this allocation.
        let slot = try_write(&self.shared)?;
        self.copy_check(&slot, offset, src.len())?;
        state.backend.copy_from_host(self.shared.base + offset as u64, src)
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("id", &self.shared.id)
            .field("tag", &self.shared.tag)
            .field("bytes", &self.shared.bytes)
            .field("base", &format_args!("{:#x}", self.shared.base))
            .field("policy", &self.shared.policy.name())
            .field("released", &self.is_released())
            .finish()
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let mut state = lock(&self.inner.state);
        state.allocs.remove(&self.shared.id);
        // No guard can be alive: guards borrow the handle being dropped.
        let mut slot = self.shared.slot.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(b) = slot.backup.take() {
            state.give_back(b);
        }
        let s = &self.shared;
        if let Err(e) = state.backend.free(s.base, s.mapped, slot.phys.take()) {
            tracing::error!(id = s.id, tag = %s.tag, error = %e, "freeing an allocation failed; its address range leaks");
        }
    }
}

/// Shared access to a materialized allocation's bytes, from [`Allocation::read`].
pub struct ReadGuard<'a> {
    _slot: RwLockReadGuard<'a, Slot>,
    ptr: *mut u8,
    len: usize,
}

impl fmt::Debug for ReadGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadGuard").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

impl std::ops::Deref for ReadGuard<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the guard holds the allocation's read lock, taken after checking that it is
        // materialized and host-addressable; release and materialize need the write lock, so
        // `ptr..ptr+len` stays mapped read-write and nobody writes to it while the guard lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Exclusive access to a materialized allocation's bytes, from [`Allocation::write`].
pub struct WriteGuard<'a> {
    _slot: RwLockWriteGuard<'a, Slot>,
    ptr: *mut u8,
    len: usize,
}

impl fmt::Debug for WriteGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteGuard").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

impl std::ops::Deref for WriteGuard<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: as for `ReadGuard`, with the write lock: the range is mapped and exclusive.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for WriteGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: the write lock makes this the only access to the mapped range, and `&mut self`
        // makes the returned slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Updates the lock-free `released` flags of `targets` from their locked slots.
fn publish(targets: &[Arc<Shared>], slots: &[RwLockWriteGuard<'_, Slot>]) {
    for (s, slot) in targets.iter().zip(slots) {
        s.released.store(slot.phys.is_none(), Ordering::Release);
    }
}

/// The index of `tag`'s receipt; every target's tag has one.
fn receipt_of(receipts: &[Receipt], tag: &Tag) -> usize {
    receipts.iter().position(|r| &r.tag == tag).unwrap_or(0)
}

/// Total time in a set of receipts.
pub fn total_elapsed(receipts: &[Receipt]) -> Duration {
    receipts.iter().map(|r| r.elapsed).sum()
}

mod contents;
#[cfg(test)]
mod device_tests;
#[cfg(test)]
mod tests;
