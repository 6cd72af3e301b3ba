//! The device's own time in a backend's steps: an event recorded on the stream just before a
//! step's first work (its first call, or its graph's launch; as the step begins when it is
//! captured, outside the capture) and another as it ends, read back once the end has passed,
//! without waiting for it. With graphs and asynchronous copies the host's waits no longer
//! tell how long the GPU worked; these events do ([`CudaBackend::device_busy`]).

use super::{Count, CudaBackend, Inner};
use cudarc::driver::CudaEvent;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Steps whose end has not been read yet, past which the oldest is waited for.
const PENDING_MAX: usize = 64;

/// The events of the steps whose end the device has not passed yet, spare events, and the
/// time of the steps read so far.
#[derive(Default)]
pub(super) struct StepTimes {
    /// The step in progress's start.
    open: Option<CudaEvent>,
    pending: VecDeque<(CudaEvent, CudaEvent)>,
    spare: Vec<CudaEvent>,
    busy: Duration,
}

impl StepTimes {
    /// Adds the time of the pending steps whose end has passed, keeping their events for
    /// later steps.
    fn harvest(&mut self) {
        while let Some((start, end)) = self.pending.front() {
            if !end.is_complete() {
                return;
            }
            if let Ok(ms) = start.elapsed_ms(end) {
                self.busy += Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            }
            let (start, end) = self.pending.pop_front().expect("checked above");
            self.spare.extend([start, end]);
        }
    }
}

impl Inner {
    /// An event for timing, a spare one if there is.
    fn timing_event(&self, times: &mut StepTimes) -> Option<CudaEvent> {
        times.spare.pop().or_else(|| self.stream.context().new_event(None).ok())
    }

    /// The step's first work is about to be queued (not into a capture): its start event
    /// goes on the stream now. Nothing when the step has its start already, or no step is
    /// open.
    pub(super) fn work_starts(&self) {
        if !self.step_armed.swap(false, Ordering::Relaxed) {
            return;
        }
        let mut times = self.times.lock().unwrap_or_else(|e| e.into_inner());
        let start = self.timing_event(&mut times);
        times.open = start.filter(|e| e.record(&self.stream).is_ok());
    }
}

impl CudaBackend {
    /// Opens the timing of a step: its start is recorded with its first work
    /// ([`Inner::work_starts`]).
    pub(super) fn start_step_timing(&self) {
        let mut times = self.inner.times.lock().unwrap_or_else(|e| e.into_inner());
        times.harvest();
        if times.pending.len() >= PENDING_MAX {
            // The device is far behind: wait for the oldest step rather than keep more.
            if let Some((_, end)) = times.pending.front() {
                self.count(Count::HostWait);
                if let Err(e) = self.inner.blocking(|| end.synchronize()) {
                    tracing::debug!("cuda:{}: waiting for a step's end: {e}", self.inner.ordinal);
                }
            }
            times.harvest();
        }
        times.open = None;
        self.inner.step_armed.store(true, Ordering::Relaxed);
    }

    /// Marks the end of the step started last (after its graph is launched); a step that
    /// queued no work has no time.
    pub(super) fn end_step_timing(&self) {
        self.inner.step_armed.store(false, Ordering::Relaxed);
        let mut times = self.inner.times.lock().unwrap_or_else(|e| e.into_inner());
        let Some(start) = times.open.take() else { return };
        match self.inner.timing_event(&mut times) {
            Some(end) if end.record(self.stream()).is_ok() => times.pending.push_back((start, end)),
            _ => times.spare.push(start),
        }
    }

    /// The time the device spent in this backend's steps so far, from each step's first
    /// work queued to its end (events on the stream), as far as the device has got: a step
    /// still running counts once it ends. A decode step's wall time minus this is what the
    /// GPU did not work on it (host time, launch gaps).
    pub fn device_busy(&self) -> Duration {
        let mut times = self.inner.times.lock().unwrap_or_else(|e| e.into_inner());
        times.harvest();
        times.busy
    }
}
