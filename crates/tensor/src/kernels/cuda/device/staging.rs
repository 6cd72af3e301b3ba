//! A step's small inputs (token ids, positions, block tables, per-row offsets, sampling
//! numbers) at fixed addresses: written into one pinned host buffer and copied from there,
//! asynchronously, into one device buffer at the same offset, so an input costs no
//! allocation, no pageable copy and no host wait.
//!
//! Where each input goes is `stage_layout`'s: a slot per input, kept by the step's shape,
//! so an input has the same address at every step of a shape while it fits its slot; the
//! same values staged twice in a step (every layer passes the same positions) are staged
//! once. The host buffer is written again only after the copies of the step before it are
//! done (an event recorded at each step's end, waited for before the next step's first write,
//! usually long complete); the device buffer is written by copies queued on the stream after
//! the kernels of the step before, which read it. A step that outgrows the buffers stages the
//! rest the old way (an allocation and an upload each) and the buffers grow at the next step.

use super::buffers::Input;
use super::graphs::Call;
use super::{Count, CudaBackend, OrUnavailable};
use crate::error::Result;
use crate::kernels::cuda::stage_layout::{Place, StageLayout};
use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, PinnedHostSlice};
use std::sync::Arc;

/// The pinned host buffer and the device buffer of a backend's step inputs, the event that
/// marks the last step's copies done, and the layout of this step's inputs.
pub(super) struct InputStaging {
    host: PinnedHostSlice<u8>,
    dev: CudaSlice<u8>,
    copied: CudaEvent,
    layout: StageLayout,
    /// Whether copies were queued since `copied` was last recorded.
    pending: bool,
    /// The capacity the buffers grow to at the next step's first input (a step ran out).
    grow_to: Option<usize>,
}

/// The buffers' first size, in bytes.
const FIRST_CAPACITY: usize = 64 << 10;

/// A staged input's device address, and the upload behind it when it was not staged (outside
/// a step, or past the buffers).
pub(super) type Staged<T> = Input<Arc<CudaSlice<T>>>;

impl CudaBackend {
    /// Buffers of `capacity` bytes for the step inputs.
    fn new_staging(&self, op: &str, capacity: usize) -> Result<InputStaging> {
        let ctx = self.stream().context();
        self.count(Count::Allocation);
        // SAFETY: the bytes are only written (by `stage`) before a copy reads them.
        let host = unsafe { ctx.alloc_pinned::<u8>(capacity) }
            .or_unavailable(|| format!("{op}: allocating {capacity} bytes of pinned memory"))?;
        self.count(Count::Allocation);
        // SAFETY: only the ranges copied from the host buffer are read, by kernels queued
        // after those copies.
        let dev = unsafe { self.stream().alloc::<u8>(capacity) }
            .or_unavailable(|| format!("{op}: allocating {capacity} bytes"))?;
        let copied = ctx.new_event(None).or_unavailable(|| format!("{op}: creating an event"))?;
        let layout = StageLayout::new(capacity);
        Ok(InputStaging { host, dev, copied, layout, pending: false, grow_to: None })
    }

    /// `values` on the device for the kernels of this step: staged (see the module docs) in
    /// a step, else uploaded the old way by `otherwise`.
    pub(super) fn stage<T: DeviceRepr + bytemuck::Pod>(
        &self,
        op: &str,
        values: &[T],
        otherwise: impl FnOnce() -> Result<Arc<CudaSlice<T>>>,
    ) -> Result<Staged<T>> {
        let uploaded = |up: Arc<CudaSlice<T>>| Staged::kept(self.addr(&*up), up);
        if !self.workspace().in_step() || values.is_empty() {
            return otherwise().map(uploaded);
        }
        let bytes: &[u8] = bytemuck::cast_slice(values);
        let mut guard = self.inner.staging.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(self.new_staging(op, FIRST_CAPACITY.max(2 * bytes.len()))?);
        }
        let staging = guard.as_mut().expect("made above");
        let first = staging.layout.is_fresh();
        if first && staging.pending {
            // The copies of the step before must have read the host buffer (waited for at
            // the step's start, `ready_staging`, unless the buffers were made since).
            self.inner.counters.add(Count::HostWait);
            self.inner
                .blocking(|| staging.copied.synchronize())
                .or_unavailable(|| format!("{op}: waiting for the last step's inputs"))?;
            staging.pending = false;
        }
        if let Some(capacity) = staging.grow_to.filter(|_| first) {
            // Larger buffers; the old ones are unread now (the wait above). The shapes keep
            // their slots.
            let layout = std::mem::take(&mut staging.layout);
            *staging = self.new_staging(op, capacity)?;
            staging.layout = layout;
            staging.layout.resize(capacity);
        }
        if first {
            staging.layout.begin(self.workspace().key());
        }
        let at = match staging.layout.place(bytes) {
            Place::Again(at) => {
                return Ok(Staged::at(self.addr(&staging.dev) + at as u64));
            }
            Place::New(at) => at,
            Place::Full => {
                drop(guard);
                return otherwise().map(uploaded);
            }
        };
        // SAFETY: `at + bytes.len()` is within the host buffer (`place` checked the
        // capacity); no copy reads it now (the last step's are done, and this step's read
        // other offsets); the host buffer is only written here.
        let host = unsafe {
            let base =
                staging.host.as_mut_ptr().or_unavailable(|| format!("{op}: pinned memory"))?;
            std::slice::from_raw_parts_mut(base.add(at), bytes.len())
        };
        host.copy_from_slice(bytes);
        let dst = self.addr(&staging.dev) + at as u64;
        // The whole slot: the same copy at every step of the shape (a graph replays it).
        let bytes = staging.layout.last_slot();
        let src = host.as_ptr() as usize;
        self.bind(op)?;
        // SAFETY: `dst..dst + bytes` is inside the device buffer and `src..src + bytes`
        // inside the pinned host buffer (`place` checked the slot against the capacity); the
        // host bytes stay unwritten until the event recorded after this step's copies has
        // completed; kernels that read `dst` are queued after this copy on the same stream.
        unsafe { self.issue(op, Call::Upload { dst, src, bytes }) }?;
        staging.pending = true;
        Ok(Staged::at(dst))
    }

    /// Waits, at a step's start, until the copies of the step before have read the host
    /// buffer, so that no wait falls inside the step (where it would end the step's graph).
    pub(super) fn ready_staging(&self) {
        let mut guard = self.inner.staging.lock().unwrap_or_else(|e| e.into_inner());
        let Some(staging) = guard.as_mut().filter(|s| s.pending) else { return };
        self.inner.counters.add(Count::HostWait);
        match self.inner.blocking(|| staging.copied.synchronize()) {
            Ok(()) => staging.pending = false,
            Err(e) => {
                tracing::warn!(
                    "cuda:{}: waiting for the last step's inputs: {e}",
                    self.inner.ordinal
                );
            }
        }
    }

    /// Ends the step's inputs (the outermost step's end): marks their copies with the event
    /// the next step waits for, and has the buffers grow at the next step when this one ran
    /// out.
    pub(super) fn end_staging(&self) {
        let mut guard = self.inner.staging.lock().unwrap_or_else(|e| e.into_inner());
        let Some(staging) = guard.as_mut() else { return };
        if staging.pending {
            if let Err(e) = staging.copied.record(self.stream()) {
                tracing::warn!("cuda:{}: marking the step's inputs: {e}", self.inner.ordinal);
                // Without the mark the next step cannot tell the copies are done: wait for
                // them now, and start over.
                if self.inner.sync("staging the step's inputs").is_ok() {
                    *guard = None;
                }
                return;
            }
        }
        staging.grow_to = staging.layout.next_step();
    }

    /// Gives the step inputs' buffers back (a sleep), once the stream has been waited for;
    /// the bytes of the pinned host buffer and of the device buffer dropped.
    pub(super) fn drop_staging(&self) -> (u64, u64) {
        let dropped = self.inner.staging.lock().unwrap_or_else(|e| e.into_inner()).take();
        dropped.map_or((0, 0), |s| (s.host.len() as u64, s.dev.len() as u64))
    }
}
