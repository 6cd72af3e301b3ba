//! Waiting for the device: stream synchronizations, bounded by the deadline of a reduction
//! in flight, the host's time spent blocked, and the all-reduce queued on the stream.

use super::{unavailable, Count, CudaBackend, Inner, OrUnavailable};
use crate::error::Result;
use crate::tensor::Tensor;
use collectives::{Communicator, DeviceRange, DeviceStream, ElemType, ReduceOp};
use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

/// A reduction [`CudaBackend::all_reduce_sum`] queued on the stream: from when, within what
/// deadline, over which group. While one is in flight the backend's own waits for the stream
/// are bounded by its deadline, since a reduction whose peer died never completes.
#[derive(Debug)]
pub(super) struct InFlight {
    since: Instant,
    limit: Duration,
    group: String,
}

impl Inner {
    /// Waits until the work queued on the stream has completed. With a reduction in flight
    /// the wait polls until the reduction's deadline and then fails naming its group (the
    /// communicator's own wait, [`CudaBackend::wait_collectives`], also names a failed peer).
    pub(super) fn sync(&self, op: &str) -> Result<()> {
        self.blocking(|| self.wait_for_stream(op))
    }

    /// Runs `wait`, a wait for the device, counting its time as the host's time blocked on
    /// the device.
    pub(super) fn blocking<R>(&self, wait: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let result = wait();
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        result
    }

    fn wait_for_stream(&self, op: &str) -> Result<()> {
        self.count(Count::HostWait);
        // What the step's graph left undone (and why) is this wait's answer.
        self.graph_failure(op)?;
        let mut in_flight = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(pending) = in_flight.as_ref() else {
            return self
                .stream
                .synchronize()
                .or_unavailable(|| format!("{op}: waiting for the device"));
        };
        let done = self
            .stream
            .record_event(None)
            .or_unavailable(|| format!("{op}: marking the stream"))?;
        let deadline = pending.since + pending.limit;
        let mut nap = Duration::from_micros(20);
        loop {
            if done.try_is_complete().or_unavailable(|| format!("{op}: polling the stream"))? {
                *in_flight = None;
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                // Kept: every later wait fails as fast until the reduction ends (its
                // communicator's failure aborts it).
                return Err(unavailable(format!(
                    "cuda:{}: {op}: the device did not finish within {:?} of an all-reduce over \
                     the `{}` group queued before it; a rank of that group may have failed",
                    self.ordinal, pending.limit, pending.group
                )));
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

impl CudaBackend {
    pub(super) fn wait_for_frees(&self) {
        if let Err(e) = self.inner.sync("freeing") {
            tracing::warn!("cuda:{}: waiting for freed weights: {e}", self.inner.ordinal);
        }
    }

    /// The time the host has spent blocked waiting for this device since the backend was
    /// made: copies of results to the host, waits for uploads, and the waits of the
    /// reductions it queues. A step's wall time minus its share of this is the host's own
    /// time (queueing kernels, the CPU-side work); the rest the host waited for the GPU.
    pub fn device_wait(&self) -> Duration {
        Duration::from_nanos(self.inner.waited_ns.load(Ordering::Relaxed))
    }

    /// `t` summed over `comm`'s group in place on the device (`comm` works on this device:
    /// NCCL), queued on the backend's stream after the work that computed `t`: the kernels
    /// queued next read the sums, and the host does not wait. The communicator waits for it
    /// before its next call; [`CudaBackend::wait_collectives`] waits for it with the
    /// communicator's failure detection, and the backend's own waits meanwhile are bounded
    /// by its deadline.
    pub(crate) fn all_reduce_sum(&self, comm: &mut dyn Communicator, t: &mut Tensor) -> Result<()> {
        const OP: &str = "all_reduce";
        if t.is_empty() {
            return Ok(());
        }
        let ptr = self.writable(OP, t)?;
        let since = Instant::now();
        let ordinal = self.ordinal();
        let buf = DeviceRange { addr: ptr, bytes: 4 * t.len(), device: ordinal };
        let stream = DeviceStream { raw: self.stream().cu_stream() as usize, device: ordinal };
        // One reduction queued, after a wait for the one before it (the communicator's).
        self.count(Count::Launch);
        self.count(Count::HostWait);
        // SAFETY: `writable` made `ptr` t's own buffer of t.len() floats on this device (the
        // communicator's, checked by the caller); only work on this backend's stream touches
        // it (a host read waits for the stream first), and it is freed in stream order, after
        // the reduction. The stream, of the device's primary context, lives as long as the
        // backend, and a stream destroyed with work queued finishes that work first.
        self.inner.blocking(|| unsafe {
            comm.all_reduce_device_enqueue(buf, ElemType::F32, ReduceOp::Sum, stream)
        })?;
        // The enqueue waited for the reduction before it: this one is the only one in flight.
        let limit = comm.timeout();
        let group = comm.group().to_owned();
        *self.inner.in_flight.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(InFlight { since, limit, group });
        Ok(())
    }

    /// Waits, through `comm` (its deadline and failure detection), for the reduction
    /// [`CudaBackend::all_reduce_sum`] queued last over it, if any.
    ///
    /// # Errors
    /// The communicator's: a timeout or a failed peer, named.
    pub(crate) fn wait_collectives(&self, comm: &mut dyn Communicator) -> Result<()> {
        self.count(Count::HostWait);
        self.inner.blocking(|| comm.wait_device())?;
        let mut in_flight = self.inner.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        if in_flight.as_ref().is_some_and(|p| p.group == comm.group()) {
            *in_flight = None;
        }
        Ok(())
    }
}
