//! How an allocation's contents are saved by a release and brought back by a materialize,
//! and the host pool that backups to host memory live in (`crate::pool`).

use super::{Backup, Manager, Shared, Slot, State};
use crate::backend::{Init, Phys};
use crate::chunked;
use crate::error::{Error, Result};
use crate::policy::{BackupStore, Policy, SourceKind};
use crate::pool::{HostBuffer, Lease};
use std::sync::atomic::Ordering;

/// Whether a backup to `store` lives in host memory (the pool).
pub(super) fn in_host_memory(store: Option<BackupStore>) -> bool {
    matches!(store, Some(BackupStore::Host | BackupStore::Default))
}

/// Saves the contents of `s` (materialized) to `store`; a host backup takes its bytes from
/// the pool, which the caller grew for it.
pub(super) fn backup(state: &mut State, s: &Shared, store: BackupStore) -> Result<Backup> {
    match store {
        BackupStore::Host | BackupStore::Default => {
            let lease = match state.pool.take(s.mapped) {
                Some(lease) => lease,
                None => {
                    state.pool.reserve(&*state.backend, &[s.mapped])?;
                    state.pool.take(s.mapped).expect("the pool just grew to hold it")
                }
            };
            let dst = state.pool.bytes_mut(&lease);
            match chunked::to_host(&*state.backend, s.base, dst, state.chunk) {
                Ok(()) => Ok(Backup::Host(lease)),
                Err(e) => {
                    state.pool.give(lease);
                    Err(e)
                }
            }
        }
        BackupStore::Spill => {
            let file = state.spill.create(s.mapped as u64)?;
            let mut offset = 0u64;
            state.backend.save(s.base, s.mapped, &mut |piece| {
                state.spill.write_at(&file, piece, offset)?;
                offset += piece.len() as u64;
                Ok(())
            })?;
            Ok(Backup::Spill(file))
        }
    }
}

/// Maps and restores one allocation; returns the bytes copied in.
pub(super) fn map_one(state: &mut State, s: &Shared, slot: &mut Slot) -> Result<u64> {
    let label = s.tag.as_str();
    // A backup taken by the release is the contents: restored whatever the policy.
    let (phys, copied) = match (&s.policy, &slot.backup) {
        (_, Some(Backup::Host(lease))) => (restore_host(state, s, lease)?, lease.len() as u64),
        (_, Some(Backup::Spill(file))) => {
            let what = format!("the spill file in {}", state.spill.dir().display());
            let len = usize::try_from(file.bytes).unwrap_or(usize::MAX);
            let init = Init::File { file: &file.file, offset: 0, len, what: &what };
            (state.backend.map(s.base, s.mapped, label, init)?, file.bytes)
        }
        (Policy::Discard, None) => (state.backend.map(s.base, s.mapped, label, Init::Fresh)?, 0),
        (Policy::Zero | Policy::Backup(_), None) => {
            (state.backend.map(s.base, s.mapped, label, Init::Zero)?, 0)
        }
        (Policy::Reload(source), None) => {
            let what = format!("reload source {}", source.describe());
            let init = match &*source.0 {
                SourceKind::File { file, offset, .. } => {
                    Init::File { file, offset: *offset, len: s.bytes, what: &what }
                }
                SourceKind::Fill(fill) => {
                    let phys = state.backend.map(
                        s.base,
                        s.mapped,
                        label,
                        Init::Fill {
                            len: s.bytes,
                            fill: &mut |dst| {
                                fill(dst).map_err(|e| Error::Reload {
                                    source_desc: source.describe(),
                                    source: e,
                                })
                            },
                        },
                    )?;
                    slot.phys = Some(phys);
                    return Ok(s.bytes as u64);
                }
            };
            (state.backend.map(s.base, s.mapped, label, init)?, s.bytes as u64)
        }
    };
    slot.phys = Some(phys);
    Ok(copied)
}

/// Maps fresh memory behind `s` and copies its host backup (`lease`, as long as the mapping)
/// into it in chunks. On error nothing stays mapped and the backup is untouched.
fn restore_host(state: &mut State, s: &Shared, lease: &Lease) -> Result<Phys> {
    debug_assert_eq!(lease.len(), s.mapped, "a host backup holds the whole mapping");
    let phys = state.backend.map(s.base, s.mapped, s.tag.as_str(), Init::Fresh)?;
    let host = state.pool.bytes(lease);
    match chunked::from_host(&*state.backend, s.base, host, state.chunk) {
        Ok(()) => Ok(phys),
        Err(e) => {
            if let Err((_, undo)) = state.backend.unmap(s.base, s.mapped, phys) {
                tracing::error!(id = s.id, tag = %s.tag, error = %undo, "could not unmap after a failed restore; its physical memory leaks");
            }
            Err(e)
        }
    }
}

impl State {
    /// Ends a backup: a host backup's bytes go back to the pool (kept, not freed); a spill
    /// file is closed.
    pub(super) fn give_back(&mut self, backup: Backup) {
        if let Backup::Host(lease) = backup {
            self.pool.give(lease);
        }
    }

    /// Whether a backup of an allocation with `store` ([`BackupStore::Default`] for one whose
    /// policy is not a backup: a level-1 sleep backs it up to the default store) lands in host
    /// memory.
    fn backs_up_to_host(&self, store: BackupStore) -> bool {
        let store = if store == BackupStore::Default { self.default_store } else { store };
        store == BackupStore::Host
    }

    /// Grows the pool so that every materialized allocation of a preallocated tag, and one
    /// more of `extra` bytes, can be backed up to host memory at once without another host
    /// allocation.
    pub(super) fn preallocate(&mut self, extra: Option<usize>) -> Result<()> {
        let sizes: Vec<usize> = self
            .allocs
            .values()
            .filter(|s| self.preallocate.contains(&s.tag) && self.backs_up_to_host(s.store))
            .filter(|s| !s.released.load(Ordering::Acquire))
            .map(|s| s.mapped)
            .chain(extra)
            .collect();
        self.pool.reserve(&*self.backend, &sizes)
    }

    /// Whether a new allocation of `tag` whose store is `store` grows the pool now.
    pub(super) fn preallocates(&self, tag: &crate::Tag, store: BackupStore) -> bool {
        self.preallocate.contains(tag) && self.backs_up_to_host(store)
    }
}

/// The host pool: host memory (pinned for CUDA) that backups to host memory are carved from,
/// kept across sleep cycles. A release grows it, by one host allocation, only when its host
/// backups do not fit in what is free, and a materialize gives their bytes back to it without
/// freeing them; so after the first cycle a release allocates no host memory and a materialize
/// frees none. It is freed when the manager is dropped (with its last allocation), or by
/// [`Manager::free_host_pool`].
impl Manager {
    /// Allocates the host pool now for a backup to host memory of every allocation of
    /// `tags`, and from now on grows it as allocations of those tags are made, so that their
    /// first release does not allocate it (vLLM's sleep-mode buffers, allocated at start).
    /// Returns the pool's bytes.
    ///
    /// Only allocations whose backups land in host memory count: those with
    /// [`Policy::Backup`] to [`BackupStore::Host`], and those of other policies when the
    /// manager's default store is host memory (the CUDA backend's: a level-1 sleep,
    /// [`Manager::release_with`] and [`BackupStore::Default`], copies them there). On a CPU
    /// manager, whose default store is a spill file, weights with a reload policy preallocate
    /// nothing.
    ///
    /// # Errors
    /// [`Error::InvalidTag`], [`Error::UnknownTag`], or [`Error::HostPool`] when the host
    /// memory cannot be allocated (the tags stay preallocated).
    pub fn preallocate_host_backups<T: AsRef<str>>(
        &self,
        tags: impl IntoIterator<Item = T>,
    ) -> Result<u64> {
        let mut state = self.state();
        let tags = Self::resolve(&state, tags)?;
        state.preallocate.extend(tags);
        state.preallocate(None)?;
        Ok(state.pool.capacity())
    }

    /// `bytes` of host memory of the kind this manager's backups live in: pinned for the
    /// CUDA backend, memory faulted in at once for the CPU one. Outside the pool.
    ///
    /// # Errors
    /// The backend cannot allocate it (out of memory, for CUDA a driver error).
    pub fn host_buffer(&self, bytes: usize) -> Result<HostBuffer> {
        Ok(HostBuffer(self.state().backend.alloc_host(bytes)?))
    }

    /// Bytes of host memory the pool holds: lent to backups now, or kept for the next ones.
    pub fn host_pool_bytes(&self) -> u64 {
        self.state().pool.capacity()
    }

    /// Bytes of the pool that backups hold now.
    pub fn host_pool_lent_bytes(&self) -> u64 {
        self.state().pool.lent()
    }

    /// Frees the host pool's memory that no backup holds now (each host allocation of it that
    /// lends nothing) and stops preallocating ([`Manager::preallocate_host_backups`]); the
    /// next release that backs up to host memory allocates again. Returns the bytes freed.
    pub fn free_host_pool(&self) -> u64 {
        let mut state = self.state();
        state.preallocate.clear();
        state.pool.free_unused()
    }
}
