//! Errors of the vmm crate.

use crate::receipt::Receipt;
use crate::tag::Tag;
use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tag that no allocation of this manager has used and that is not well known.
    #[error("unknown tag `{tag}` (known tags: {known})")]
    UnknownTag {
        /// The tag asked for.
        tag: String,
        /// The tags this manager knows, comma separated.
        known: String,
    },
    /// A tag name that is empty, too long or has characters outside `[A-Za-z0-9_.-]`.
    #[error("invalid tag `{tag}`: {why}")]
    InvalidTag {
        /// The rejected name.
        tag: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// An allocation of zero bytes.
    #[error("allocation with tag `{tag}` asks for 0 bytes")]
    ZeroSize {
        /// Tag of the rejected allocation.
        tag: Tag,
    },
    /// An allocation larger than the backend can ever back with physical memory.
    #[error("allocation with tag `{tag}` asks for {bytes} bytes, more than the limit of {limit} bytes ({why})")]
    TooLarge {
        /// Tag of the rejected allocation.
        tag: Tag,
        /// Bytes asked for.
        bytes: u64,
        /// The largest allocation allowed.
        limit: u64,
        /// Where the limit comes from.
        why: &'static str,
    },
    /// A reload source that cannot fill the allocation it is attached to.
    #[error("reload source {source_desc} for tag `{tag}` is unusable: {why}")]
    BadSource {
        /// Tag of the rejected allocation.
        tag: Tag,
        /// The source, for example a path and offset.
        source_desc: String,
        /// What is wrong.
        why: String,
    },
    /// The allocation is released; it has no memory to read or write.
    #[error("allocation {id} (tag `{tag}`, {bytes} bytes) is released: materialize its tag before using it")]
    Released {
        /// Allocation id.
        id: u64,
        /// Its tag.
        tag: Tag,
        /// Its size.
        bytes: u64,
    },
    /// The allocation is borrowed through a guard while a release or materialize wants it.
    #[error("allocation {id} (tag `{tag}`) is borrowed by a read or write guard: drop the guard before release or materialize")]
    Busy {
        /// Allocation id.
        id: u64,
        /// Its tag.
        tag: Tag,
    },
    /// A copy past the end of an allocation.
    #[error("allocation {id} (tag `{tag}`, {bytes} bytes): {len} bytes at offset {offset} are out of bounds")]
    OutOfBounds {
        /// Allocation id.
        id: u64,
        /// Its tag.
        tag: Tag,
        /// Offset asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// The allocation's size.
        bytes: u64,
    },
    /// The allocation lives in memory this process cannot address directly (device memory).
    #[error("allocation {id} (tag `{tag}`) lives in {backend} memory, which the host cannot address: use the device pointer")]
    NotHostAccessible {
        /// Allocation id.
        id: u64,
        /// Its tag.
        tag: Tag,
        /// The backend that owns it.
        backend: &'static str,
    },
    /// A step on one allocation failed; `source` says which step and why.
    #[error("allocation {id} (tag `{tag}`, {bytes} bytes): {source}")]
    Allocation {
        /// Allocation id.
        id: u64,
        /// Its tag.
        tag: Tag,
        /// Its size.
        bytes: u64,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// The call and its arguments, for example `mmap of 4096 bytes at 0x7f00`.
        op: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Writing or reading a spill file failed.
    #[error("spill file in {dir}: {op}: {source}")]
    Spill {
        /// The spill directory.
        dir: PathBuf,
        /// What was being done.
        op: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The spill store would grow past its configured cap.
    #[error(
        "spill store in {dir} is full: {needed} more bytes needed, {used} of {limit} bytes in use"
    )]
    SpillFull {
        /// The spill directory.
        dir: PathBuf,
        /// Bytes the backup needs.
        needed: u64,
        /// Bytes already spilled.
        used: u64,
        /// The cap.
        limit: u64,
    },
    /// A reload source failed to fill an allocation.
    #[error("reload from {source_desc}: {source}")]
    Reload {
        /// The source, for example a path and offset.
        source_desc: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A release stopped before changing anything (a backup failed, or an allocation was busy).
    #[error("release aborted before any allocation was released: {source}")]
    ReleaseAborted {
        /// The first failure.
        #[source]
        source: Box<Error>,
    },
    /// A release unmapped some allocations and failed on others; the failed ones are still
    /// materialized with their contents intact.
    #[error("release failed for {} allocation(s), the others were released: {}", failures.len(), Failures(failures))]
    ReleasePartial {
        /// Each allocation that stayed materialized, with its error.
        failures: Vec<Failure>,
        /// Receipts of what was released.
        receipts: Vec<Receipt>,
    },
    /// A materialize failed part way and unmapped again what it had mapped in that call.
    #[error(
        "materialize failed and rolled back {rolled_back} allocation(s) it had mapped: {source}"
    )]
    MaterializeRolledBack {
        /// How many allocations were mapped in this call and released again.
        rolled_back: usize,
        /// The failure.
        #[source]
        source: Box<Error>,
    },
    /// The host pool of backups could not grow.
    #[error("allocating {bytes} bytes of host memory for backups: {source}")]
    HostPool {
        /// The bytes it needed.
        bytes: u64,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// A chunked copy between an allocation and host memory (a backup or its restore) failed;
    /// `what` names the copy and the chunk.
    #[error("{what}: {source}")]
    Copy {
        /// The copy and the chunk, for example `restore from host memory, chunk 3 of 16
        /// (67108864 bytes at offset 134217728)`.
        what: String,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// The backend cannot run here (no driver, no device).
    #[error("{backend} backend is unavailable: {reason}")]
    BackendUnavailable {
        /// Backend name.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// The feature the call needs was not compiled in.
    #[error("tpctl-vmm was built without the `{feature}` feature")]
    NotCompiledWith {
        /// The missing cargo feature.
        feature: &'static str,
    },
    /// A CUDA driver call failed.
    #[error("cuda driver call {op} failed: {code}")]
    Cuda {
        /// The call, with its arguments.
        op: String,
        /// The `CUresult`, as the driver names it.
        code: String,
    },
    /// An NVML call failed.
    #[error("nvml {op}: {reason}")]
    Nvml {
        /// The call.
        op: String,
        /// NVML's message.
        reason: String,
    },
    /// A procfs file could not be read.
    #[error("reading {path}: {source}")]
    Procfs {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A procfs file lacks a field this crate needs.
    #[error("{path} has no `{field}` line")]
    ProcfsFormat {
        /// The file.
        path: PathBuf,
        /// The missing field.
        field: &'static str,
    },
    /// A failpoint (feature `failpoints`) fired.
    #[error("injected failure at failpoint `{point}`")]
    Injected {
        /// The failpoint.
        point: &'static str,
    },
}

/// A specialized `Result` for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One allocation that a release could not release.
#[derive(Debug)]
pub struct Failure {
    /// Allocation id.
    pub id: u64,
    /// Its tag.
    pub tag: Tag,
    /// Why it failed.
    pub error: Error,
}

struct Failures<'a>(&'a [Failure]);

impl fmt::Display for Failures<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, failure) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "allocation {} (tag `{}`): {}", failure.id, failure.tag, failure.error)?;
        }
        Ok(())
    }
}

impl Error {
    pub(crate) fn os(op: impl Into<String>) -> Self {
        Error::Os { op: op.into(), source: std::io::Error::last_os_error() }
    }

    pub(crate) fn os_with(op: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os { op: op.into(), source }
    }
}
