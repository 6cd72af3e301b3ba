//! What a rank's runtime holds outside tagged memory, released under tags of their own:
//! `cuda_graph` (the CUDA graphs of decode steps, SGLang's name), `workspace` (the step
//! workspaces, the step inputs' staging buffers and the temporaries the driver's memory pool
//! keeps) and `nccl` (the NCCL communicators of the rank's groups: destroyed, and made again
//! through the store at the wakeup). None has contents to keep: a sleep destroys them and the
//! steps after the wakeup make graphs and workspaces again (captured, planned), while the
//! wakeup itself makes the communicators again (every rank of a group at once). A rank that
//! holds none of one (the CPU: no graphs, no workspaces, host communicators) reports it as
//! `none`: the tag is asleep like any other, with nothing released.

use crate::sleep::{MemoryError, TagReceipt};
use collectives::DeviceResources;
use std::sync::Arc;
use tensor::kernels::workspace::Released;
use tensor::kernels::Backend;

/// The CUDA graphs of decode steps.
pub const CUDA_GRAPH: &str = "cuda_graph";
/// The step workspaces, staging buffers and pooled temporaries of the compute backend.
pub const WORKSPACE: &str = "workspace";
/// The NCCL communicators of the rank's groups.
pub const NCCL: &str = "nccl";
/// The tags of what the runtime holds, in the order a sleep releases them (graphs before the
/// workspaces and the communicators their steps use).
pub const RUNTIME_TAGS: [&str; 3] = [CUDA_GRAPH, WORKSPACE, NCCL];

/// The `restore` of a runtime tag that held nothing on this rank.
pub const NOTHING_HELD: &str = "none";

/// Whether `tag` names what the runtime holds rather than tagged memory.
pub fn is_runtime(tag: &str) -> bool {
    RUNTIME_TAGS.contains(&tag)
}

/// How a runtime tag comes back: graphs and workspaces made again by the steps after the
/// wakeup, communicators by the wakeup.
fn restore_of(tag: &str) -> &'static str {
    match tag {
        CUDA_GRAPH => "recapture",
        NCCL => "reconnect",
        _ => "replan",
    }
}

/// What the runtime of one rank holds: its compute backend and its groups' device resources.
pub(super) struct Runtime<'a> {
    pub(super) backend: &'a Backend,
    pub(super) comms: &'a [Arc<dyn DeviceResources>],
}

impl Runtime<'_> {
    /// Releases runtime tag `tag`.
    ///
    /// # Errors
    /// A communicator that could not be released (those released before it stay released:
    /// the error says memory changed, and the undo restores them).
    pub(super) fn release(&self, tag: &str) -> Result<TagReceipt, MemoryError> {
        let started = std::time::Instant::now();
        let released = match tag {
            CUDA_GRAPH => self.backend.release_graphs(),
            NCCL => self.release_comms()?,
            _ => self.backend.release_workspace(),
        };
        Ok(receipt(tag, released, started))
    }

    /// Makes runtime tag `tag` again where the wakeup must (the communicators); graphs and
    /// workspaces are made by the next steps.
    ///
    /// # Errors
    /// A communicator that could not meet its group again.
    pub(super) fn materialize(&self, tag: &str) -> Result<TagReceipt, MemoryError> {
        let started = std::time::Instant::now();
        let (held, items) = match tag {
            CUDA_GRAPH => (!matches!(self.backend, Backend::Cpu(_)), 0),
            NCCL => {
                self.restore_comms()?;
                (!self.comms.is_empty(), self.comms.len())
            }
            _ => (self.backend.workspace_stats().is_some(), 0),
        };
        let released = held.then_some(Released { items, ..Released::default() });
        Ok(receipt(tag, released, started))
    }

    fn restore_comms(&self) -> Result<(), MemoryError> {
        for c in self.comms {
            c.restore().map_err(|e| MemoryError {
                changed: true,
                message: format!("making the {} communicator again: {e}", c.group()),
            })?;
        }
        Ok(())
    }

    fn release_comms(&self) -> Result<Option<Released>, MemoryError> {
        if self.comms.is_empty() {
            return Ok(None);
        }
        for (i, c) in self.comms.iter().enumerate() {
            c.release().map_err(|e| MemoryError {
                changed: i > 0,
                message: format!("releasing the {} communicator: {e}", c.group()),
            })?;
        }
        Ok(Some(Released { items: self.comms.len(), ..Released::default() }))
    }
}

fn receipt(tag: &str, released: Option<Released>, started: std::time::Instant) -> TagReceipt {
    let elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    match released {
        Some(r) => TagReceipt {
            tag: tag.to_owned(),
            allocations: r.items,
            bytes: r.device_bytes + r.host_bytes,
            device_bytes: r.device_bytes,
            restore: restore_of(tag).to_owned(),
            elapsed_us,
            ..TagReceipt::default()
        },
        None => TagReceipt {
            tag: tag.to_owned(),
            restore: NOTHING_HELD.to_owned(),
            elapsed_us,
            ..TagReceipt::default()
        },
    }
}
