//! The `local` backend: a group of threads in one process, for tests and single-process use.
//!
//! It is the shared-memory communicator over anonymous memory, so unit tests exercise the very
//! code that runs between processes.

use crate::error::{Error, Result};
use crate::shm::{Segment, ShmComm, ShmOptions};
use std::sync::Arc;

/// Creates a group of `size` communicators, one per thread, named `group`.
///
/// # Errors
/// `size` is zero or the shared memory cannot be mapped.
pub fn group(size: usize, group: &str, opts: ShmOptions) -> Result<Vec<ShmComm>> {
    if size == 0 || size > 64 {
        return Err(Error::BackendUnavailable {
            backend: "local",
            reason: format!("a group needs 1 to 64 ranks, got {size}"),
        });
    }
    let seg = Arc::new(
        Segment::anonymous(size, opts)
            .map_err(|e| Error::io(format!("mapping a local group of {size} ranks"), e))?,
    );
    (0..size)
        .map(|rank| {
            let mut comm = ShmComm::attach(seg.clone(), rank, group, "local")?;
            comm.assume_joined();
            Ok(comm)
        })
        .collect()
}

/// TP and CP communicators for every rank of a `tp × cp` mesh of threads, indexed by global
/// rank (`cp_rank * tp + tp_rank`, TP innermost): rows are TP groups named `tp[cp=j]`,
/// columns CP groups named `cp[tp=i]`.
///
/// # Errors
/// As [`group`].
pub fn mesh(tp: usize, cp: usize, opts: ShmOptions) -> Result<Vec<(ShmComm, ShmComm)>> {
    let mut tps: Vec<Option<ShmComm>> = (0..tp * cp).map(|_| None).collect();
    let mut cps: Vec<Option<ShmComm>> = (0..tp * cp).map(|_| None).collect();
    for c in 0..cp {
        for (t, comm) in group(tp, &format!("tp[cp={c}]"), opts)?.into_iter().enumerate() {
            tps[c * tp + t] = Some(comm);
        }
    }
    for t in 0..tp {
        for (c, comm) in group(cp, &format!("cp[tp={t}]"), opts)?.into_iter().enumerate() {
            cps[c * tp + t] = Some(comm);
        }
    }
    Ok(tps.into_iter().zip(cps).filter_map(|(t, c)| Some((t?, c?))).collect())
}
