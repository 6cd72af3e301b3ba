//! How an allocation's contents are saved by a release and brought back by a materialize.

use super::{Backup, Shared, Slot, State};
use crate::backend::{HostBuf, Init, Phys};
use crate::chunked;
use crate::error::{Error, Result};
use crate::policy::{BackupStore, Policy, SourceKind};

/// Saves the contents of `s` (materialized) to `store`, into `spare` when it fits.
pub(super) fn backup(
    state: &State,
    s: &Shared,
    store: BackupStore,
    spare: Option<HostBuf>,
) -> Result<Backup> {
    match store {
        BackupStore::Host | BackupStore::Default => {
            let mut buf = match spare {
                Some(buf) if buf.as_slice().len() == s.mapped => buf,
                _ => state.backend.alloc_host(s.mapped)?,
            };
            chunked::to_host(&*state.backend, s.base, buf.as_mut_slice(), state.chunk)?;
            Ok(Backup::Host(buf))
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
        (_, Some(Backup::Host(buf))) => {
            (restore_host(state, s, buf.as_slice())?, buf.as_slice().len() as u64)
        }
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

/// Maps fresh memory behind `s` and copies `host` (its backup, as long as the mapping) into it
/// in chunks. On error nothing stays mapped and the backup is untouched.
fn restore_host(state: &mut State, s: &Shared, host: &[u8]) -> Result<Phys> {
    debug_assert_eq!(host.len(), s.mapped, "a host backup holds the whole mapping");
    let phys = state.backend.map(s.base, s.mapped, s.tag.as_str(), Init::Fresh)?;
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
