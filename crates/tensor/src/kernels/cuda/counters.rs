//! What a CUDA backend asks of the driver, counted: kernels and other work queued on its
//! stream, device allocations, copies each way, and host waits. A decode step's counts say
//! whether it is bound by host calls (hundreds of launches and allocations) before any timing
//! does; [`Counters::since`] gives a step's (or a run's) share and [`Counters::per_step`] its
//! mean.

use std::fmt;

/// Counts of what a [`super::CudaBackend`] asked of the driver since it opened
/// ([`super::CudaBackend::counters`]), failed calls included. Clones of a backend share them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Work queued on the stream that computes: kernel launches, cuBLAS products, NCCL
    /// reductions.
    pub launches: u64,
    /// Device-to-device copies and memsets queued on the stream (a zeroed allocation is one
    /// allocation and one memset).
    pub device_copies: u64,
    /// Device buffers allocated (stream-ordered, from the driver's memory pool).
    pub allocations: u64,
    /// Host-to-device copies.
    pub uploads: u64,
    /// Device-to-host copies.
    pub downloads: u64,
    /// Times the host blocked until the device caught up: stream synchronizations (every
    /// download ends with one), and waits for a queued reduction.
    pub host_waits: u64,
    /// CUDA graphs launched: each does the launches, products and copies of a step (or its
    /// part up to its first host read), which are not counted again.
    pub graph_launches: u64,
}

impl Counters {
    /// The counts since `earlier`, a snapshot of the same backend taken before this one (a
    /// field that went backwards, from snapshots given in the wrong order, reads 0).
    #[must_use]
    pub fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            launches: self.launches.saturating_sub(earlier.launches),
            device_copies: self.device_copies.saturating_sub(earlier.device_copies),
            allocations: self.allocations.saturating_sub(earlier.allocations),
            uploads: self.uploads.saturating_sub(earlier.uploads),
            downloads: self.downloads.saturating_sub(earlier.downloads),
            host_waits: self.host_waits.saturating_sub(earlier.host_waits),
            graph_launches: self.graph_launches.saturating_sub(earlier.graph_launches),
        }
    }

    /// These counts and `other`'s together (the counts of two spans of steps).
    #[must_use]
    pub fn plus(&self, other: &Counters) -> Counters {
        Counters {
            launches: self.launches + other.launches,
            device_copies: self.device_copies + other.device_copies,
            allocations: self.allocations + other.allocations,
            uploads: self.uploads + other.uploads,
            downloads: self.downloads + other.downloads,
            host_waits: self.host_waits + other.host_waits,
            graph_launches: self.graph_launches + other.graph_launches,
        }
    }

    /// These counts as a mean over `steps` steps, for a report.
    pub fn per_step(&self, steps: u64) -> PerStep {
        PerStep { total: *self, steps }
    }

    fn fields(&self) -> [(u64, &'static str); 7] {
        [
            (self.launches, "launches"),
            (self.device_copies, "device copies"),
            (self.allocations, "allocations"),
            (self.uploads, "uploads"),
            (self.downloads, "downloads"),
            (self.host_waits, "host waits"),
            (self.graph_launches, "graph launches"),
        ]
    }
}

impl fmt::Display for Counters {
    /// `720 launches, 8 device copies, 521 allocations, 5 uploads, 2 downloads, 2 host waits,
    /// 0 graph launches`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (n, what)) in self.fields().into_iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{n} {what}")?;
        }
        Ok(())
    }
}

/// [`Counters`] as a mean per step ([`Counters::per_step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerStep {
    /// The counts of all the steps together.
    pub total: Counters,
    /// How many steps.
    pub steps: u64,
}

impl PerStep {
    /// `count` (one of `total`'s fields) per step; 0 over no steps.
    pub fn mean(&self, count: u64) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            count as f64 / self.steps as f64
        }
    }
}

impl fmt::Display for PerStep {
    /// `per step (64 steps): 720.0 launches, 8.0 device copies, ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "per step ({} steps): ", self.steps)?;
        for (i, (n, what)) in self.total.fields().into_iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{:.1} {what}", self.mean(n))?;
        }
        Ok(())
    }
}

/// One thing a backend asks of the driver, for [`DeviceCounters::add`].
#[cfg(any(feature = "cuda", test))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Count {
    Launch,
    DeviceCopy,
    Allocation,
    Upload,
    Download,
    HostWait,
    GraphLaunch,
}

/// The live counts of one backend, shared by its clones and its output buffers.
#[cfg(any(feature = "cuda", test))]
#[derive(Debug, Default)]
pub(crate) struct DeviceCounters {
    launches: std::sync::atomic::AtomicU64,
    device_copies: std::sync::atomic::AtomicU64,
    allocations: std::sync::atomic::AtomicU64,
    uploads: std::sync::atomic::AtomicU64,
    downloads: std::sync::atomic::AtomicU64,
    host_waits: std::sync::atomic::AtomicU64,
    graph_launches: std::sync::atomic::AtomicU64,
}

#[cfg(any(feature = "cuda", test))]
impl DeviceCounters {
    /// Counts one `what`.
    pub(crate) fn add(&self, what: Count) {
        let counter = match what {
            Count::Launch => &self.launches,
            Count::DeviceCopy => &self.device_copies,
            Count::Allocation => &self.allocations,
            Count::Upload => &self.uploads,
            Count::Download => &self.downloads,
            Count::HostWait => &self.host_waits,
            Count::GraphLaunch => &self.graph_launches,
        };
        // Relaxed: each count stands alone; a snapshot taken while another thread counts may
        // hold that thread's latest calls or not.
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The counts now.
    pub(crate) fn snapshot(&self) -> Counters {
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        Counters {
            launches: load(&self.launches),
            device_copies: load(&self.device_copies),
            allocations: load(&self.allocations),
            uploads: load(&self.uploads),
            downloads: load(&self.downloads),
            host_waits: load(&self.host_waits),
            graph_launches: load(&self.graph_launches),
        }
    }
}

/// What a backend's graphs have done (the CUDA backend's step graphs, `graph_book`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured.
    pub captures: u64,
    /// Steps that replayed a graph.
    pub replays: u64,
    /// Replays that stopped matching their graph (the step went on eagerly).
    pub misses: u64,
    /// Captures that failed or were abandoned.
    pub failed_captures: u64,
    /// Shapes that stay eager (a capture failed, or too many misses).
    pub eager_shapes: u64,
    /// The host's time in the steps captured, from the capture's start to its graph made
    /// (the step's own work, queued into the capture, and the instantiation).
    pub capture_time: std::time::Duration,
}

#[cfg(test)]
mod tests;
