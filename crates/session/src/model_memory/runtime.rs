//! What a rank's compute backend holds outside tagged memory, released under tags of their
//! own: `cuda_graph` (the CUDA graphs of decode steps, SGLang's name) and `workspace` (the step
//! workspaces, the step inputs' staging buffers and the temporaries the driver's memory pool
//! keeps). Neither has contents to keep: a sleep destroys them and the steps after the wakeup
//! make them again (graphs are captured again, workspaces planned again), so a wakeup only
//! marks them awake. A backend that holds none of them (the CPU) reports each as `none`: the
//! tag is asleep like any other, with nothing released.

use crate::sleep::TagReceipt;
use tensor::kernels::workspace::Released;
use tensor::kernels::Backend;

/// The CUDA graphs of decode steps.
pub const CUDA_GRAPH: &str = "cuda_graph";
/// The step workspaces, staging buffers and pooled temporaries of the compute backend.
pub const WORKSPACE: &str = "workspace";
/// The tags of what the runtime holds, in the order a sleep releases them (graphs before the
/// workspaces their steps read).
pub const RUNTIME_TAGS: [&str; 2] = [CUDA_GRAPH, WORKSPACE];

/// The `restore` of a runtime tag that held nothing on this rank.
pub const NOTHING_HELD: &str = "none";

/// Whether `tag` names what the runtime holds rather than tagged memory.
pub fn is_runtime(tag: &str) -> bool {
    RUNTIME_TAGS.contains(&tag)
}

/// How a runtime tag comes back: made again by the steps after the wakeup.
fn restore_of(tag: &str) -> &'static str {
    if tag == CUDA_GRAPH {
        "recapture"
    } else {
        "replan"
    }
}

/// Releases runtime tag `tag` of `backend`.
pub(super) fn release(backend: &Backend, tag: &str) -> TagReceipt {
    let started = std::time::Instant::now();
    let released = match tag {
        CUDA_GRAPH => backend.release_graphs(),
        _ => backend.release_workspace(),
    };
    receipt(tag, released, started)
}

/// Wakes runtime tag `tag` of `backend`: nothing to map, the steps make it again.
pub(super) fn materialize(backend: &Backend, tag: &str) -> TagReceipt {
    let held = match tag {
        CUDA_GRAPH => !matches!(backend, Backend::Cpu(_)),
        _ => backend.workspace_stats().is_some(),
    };
    let released = held.then(Released::default);
    receipt(tag, released, std::time::Instant::now())
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
