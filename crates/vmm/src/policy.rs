//! Restore policies: what an allocation holds after it is materialized again.

use crate::error::{Error, Result};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What an allocation's contents are after a release and a materialize.
#[derive(Clone, Debug)]
pub enum Policy {
    /// Contents are undefined after materialize (on CPU they happen to be zero; on CUDA they
    /// are whatever the driver hands out). Release copies nothing.
    Discard,
    /// Contents are zero after materialize.
    Zero,
    /// Contents are copied to a backing store before release and back on materialize.
    Backup(BackupStore),
    /// Contents are refilled from a source on materialize; release copies nothing.
    Reload(Source),
}

impl Policy {
    /// A short name for logs and benchmark tables.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Discard => "discard",
            Policy::Zero => "zero",
            Policy::Backup(BackupStore::Default) => "backup",
            Policy::Backup(BackupStore::Host) => "backup-host",
            Policy::Backup(BackupStore::Spill) => "backup-spill",
            Policy::Reload(_) => "reload",
        }
    }
}

/// Where [`Policy::Backup`] keeps the contents while the allocation is released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackupStore {
    /// The manager's default store ([`crate::ManagerBuilder::default_store`]; without one,
    /// `Spill` for the CPU backend and `Host` for CUDA).
    #[default]
    Default,
    /// A copy in host memory (heap memory for the CPU backend, pinned memory for CUDA).
    /// Fast, but the bytes stay resident in the process.
    Host,
    /// An unnamed file in the manager's spill directory, so the process's resident memory
    /// really drops. The file disappears when the allocation is materialized or dropped,
    /// and with the process.
    Spill,
}

/// Where [`Policy::Reload`] refills an allocation from.
#[derive(Clone)]
pub struct Source(pub(crate) Arc<SourceKind>);

pub(crate) enum SourceKind {
    File { file: File, path: PathBuf, offset: u64 },
    Fill(FillFn),
}

type FillFn = Box<dyn Fn(&mut [u8]) -> std::io::Result<()> + Send + Sync>;

impl Source {
    /// Refill from `path`, starting at byte `offset` (for example the model file the weights
    /// were loaded from). The file is opened now and kept open.
    ///
    /// # Errors
    /// [`Error::Reload`] when the file cannot be opened.
    pub fn file(path: impl AsRef<Path>, offset: u64) -> Result<Source> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| Error::Reload {
            source_desc: format!("{} at offset {offset}", path.display()),
            source,
        })?;
        Ok(Source(Arc::new(SourceKind::File { file, path, offset })))
    }

    /// Refill by calling `fill` with the allocation's bytes (its requested length; the
    /// rounding tail is zeroed). The closure runs under the manager's lock: it must not call
    /// back into the manager.
    pub fn from_fn(
        fill: impl Fn(&mut [u8]) -> std::io::Result<()> + Send + Sync + 'static,
    ) -> Source {
        Source(Arc::new(SourceKind::Fill(Box::new(fill))))
    }

    pub(crate) fn describe(&self) -> String {
        match &*self.0 {
            SourceKind::File { path, offset, .. } => {
                format!("{} at offset {offset}", path.display())
            }
            SourceKind::Fill(_) => "a fill function".to_owned(),
        }
    }
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Source({})", self.describe())
    }
}
