//! The step workspace: the buffers a model step's kernels write, carved at planned offsets out
//! of one allocation per step shape, so that a warm step allocates nothing and every
//! intermediate buffer has the same address at every step of its shape (what a CUDA graph
//! replays).
//!
//! How a shape gets its plan:
//! - Steps are keyed by their shape ([`StepKey`]: the step's tokens and sequences, each rounded
//!   up to a power of two, as CUDA-graph engines bucket batch sizes). Steps of more than
//!   [`PLANNED_TOKENS_MAX`] tokens (long prefill chunks) are not planned.
//! - The first step of a shape runs on the backend's allocator and is recorded: each buffer's
//!   size, and when it was taken and given back, counted in allocations and frees. A buffer
//!   still held when the step ends (logits returned to the caller) is not planned.
//! - From the recording, [`plan`] places every buffer at an offset such that two buffers alive
//!   at the same time never overlap, packing the largest first into the lowest free gap
//!   (the arena planning of inference compilers); the workspace is the plan's extent.
//! - Later steps of the shape take their n-th buffer from the plan's n-th slot.
//!
//! Soundness does not rest on a step repeating its recording: a slot is handed out only when
//! no buffer that overlaps it is still held ([`Layout::conflicts`]), checked at every
//! hand-out against flags the buffers clear when dropped (a buffer of an earlier step that
//! someone kept counts). Anything else (a larger buffer than
//! planned, more buffers, a held overlap) takes the allocator, and a plan that proved too
//! small is recorded again (sizes kept at their largest, so a shape converges after a few
//! steps; at most [`RECORDINGS_MAX`] times). Work queued on one stream in order needs no more:
//! a buffer dropped on the host while a kernel still reads it is overwritten only by work
//! queued after that kernel.
//!
//! The bookkeeping is plain Rust over offsets, the same for the CUDA backend (a device buffer)
//! and the CPU test backend (host memory, see `test_util::cpu_with_planned_device_outputs`),
//! which runs whole model steps through it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

#[cfg(test)]
mod tests;

/// Offsets of slots are multiples of this many bytes (the CUDA allocator's alignment).
pub const SLOT_ALIGN: usize = 256;
/// Steps of more tokens than this are not planned: their temporaries come from the allocator.
pub const PLANNED_TOKENS_MAX: usize = 512;
/// How many times a shape is recorded before its plan is kept as it is.
pub const RECORDINGS_MAX: usize = 8;
/// The bytes the plans of one backend may hold together (a prefill chunk's workspace of a
/// large model is hundreds of MiB): past it the least recently used plans are dropped, and
/// their shapes are recorded again at their next step.
pub const WORKSPACE_BUDGET: usize = 1 << 30;

/// The shape a step's plan is keyed by: its tokens and its sequences, each rounded up to a
/// power of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepKey {
    /// Tokens of the step, rounded up.
    pub tokens: usize,
    /// Sequences of the step, rounded up.
    pub seqs: usize,
}

impl StepKey {
    /// The key of a step of `tokens` tokens over `seqs` sequences; `None` for a step that is
    /// not planned (no tokens, or more than [`PLANNED_TOKENS_MAX`]).
    pub fn of(tokens: usize, seqs: usize) -> Option<StepKey> {
        (1..=PLANNED_TOKENS_MAX).contains(&tokens).then(|| StepKey {
            tokens: tokens.next_power_of_two(),
            seqs: seqs.max(1).next_power_of_two(),
        })
    }
}

/// One buffer of a recorded step: its size, and the events (allocations and frees, counted
/// from the step's start) at which it was taken and given back; `end` is `None` for a buffer
/// still held when the step ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    /// Bytes.
    pub bytes: usize,
    /// The event that took it.
    pub start: usize,
    /// The event that gave it back.
    pub end: Option<usize>,
}

/// Where [`plan`] puts each buffer of a recorded step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Each buffer's offset in the workspace; `None` for one not planned (held past the step).
    pub offsets: Vec<Option<usize>>,
    /// Each buffer's bytes (the slot's size).
    pub bytes: Vec<usize>,
    /// For each planned buffer, the others whose bytes overlap its own (at other times): none
    /// of them may be held when it is handed out (one of an earlier step may still be).
    pub conflicts: Vec<Vec<u32>>,
    /// The workspace's size in bytes.
    pub total: usize,
}

/// Places the buffers of a recorded step (see the module docs): two whose lifetimes overlap
/// never share a byte; the largest are placed first, each at the lowest aligned offset free of
/// the buffers already placed that are alive at the same time as it.
pub fn plan(lifetimes: &[Lifetime]) -> Layout {
    let n = lifetimes.len();
    let mut order: Vec<usize> = (0..n).filter(|&i| lifetimes[i].end.is_some()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(lifetimes[i].bytes), lifetimes[i].start));
    let mut offsets = vec![None; n];
    let mut placed: Vec<usize> = Vec::with_capacity(order.len());
    let mut total = 0;
    for &i in &order {
        let me = lifetimes[i];
        let mut taken: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| overlap_in_time(&me, &lifetimes[j]))
            .filter_map(|&j| offsets[j].map(|o: usize| (o, o + lifetimes[j].bytes)))
            .collect();
        taken.sort_unstable();
        let mut at = 0;
        for (from, to) in taken {
            if at + me.bytes <= from {
                break;
            }
            at = at.max(to.next_multiple_of(SLOT_ALIGN));
        }
        offsets[i] = Some(at);
        total = total.max(at + me.bytes);
        placed.push(i);
    }
    let conflicts = (0..n)
        .map(|i| match offsets[i] {
            None => Vec::new(),
            Some(o) => (0..n)
                .filter(|&j| j != i)
                .filter(|&j| {
                    offsets[j]
                        .is_some_and(|p| p < o + lifetimes[i].bytes && o < p + lifetimes[j].bytes)
                })
                .map(|j| j as u32)
                .collect(),
        })
        .collect();
    Layout {
        offsets,
        bytes: lifetimes.iter().map(|l| l.bytes).collect(),
        conflicts,
        total: total.next_multiple_of(SLOT_ALIGN),
    }
}

/// Whether two buffers of one recording are held at the same time (one taken before the
/// other was given back); a buffer never given back overlaps everything after its start.
fn overlap_in_time(a: &Lifetime, b: &Lifetime) -> bool {
    let ends_after = |x: &Lifetime, t: usize| x.end.is_none_or(|e| e > t);
    ends_after(a, b.start) && ends_after(b, a.start)
}

/// What a [`StepMemory`] has done since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkspaceStats {
    /// Buffers handed out from a planned slot.
    pub slots: u64,
    /// Buffers of planned steps that took the allocator instead (a recording step's, a larger
    /// or extra buffer, a held overlap).
    pub fallbacks: u64,
    /// Steps recorded.
    pub recordings: u64,
    /// Workspaces (one per plan) made.
    pub workspaces: u64,
    /// Bytes of the workspaces planned now.
    pub planned_bytes: usize,
}

/// A plan of one step shape and its workspace, shared with the slots handed out from it.
struct Planned<B> {
    layout: Layout,
    /// The workspace, made at the plan's first use.
    buf: OnceLock<B>,
    /// Which slots are held.
    held: Box<[AtomicBool]>,
}

/// A buffer of a planned step: `bytes` at `offset` of `workspace()`. Dropping it gives the
/// slot back.
pub(crate) struct Slot<B> {
    planned: Arc<Planned<B>>,
    index: usize,
    offset: usize,
}

impl<B> Slot<B> {
    /// The workspace the slot lies in.
    pub(crate) fn workspace(&self) -> &B {
        self.planned.buf.get().expect("a slot is handed out only from a made workspace")
    }

    /// The slot's offset in its workspace, in bytes.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }
}

impl<B> Drop for Slot<B> {
    fn drop(&mut self) {
        self.planned.held[self.index].store(false, Ordering::Release);
    }
}

/// The recording of a step: its buffers, and the count of events so far.
#[derive(Default)]
struct Recording {
    lifetimes: Vec<Lifetime>,
    events: usize,
    open: bool,
}

/// A buffer of a recorded step, which the backend keeps beside its own allocation: dropping
/// it records the free (while the step lasts).
pub(crate) struct Tracked {
    recording: Arc<Mutex<Recording>>,
    index: usize,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let mut r = self.recording.lock().unwrap_or_else(|e| e.into_inner());
        if r.open {
            r.lifetimes[self.index].end = Some(r.events);
            r.events += 1;
        }
    }
}

/// Where a step's buffer comes from: a planned slot, or the backend's allocator (`Own`, with
/// the recording to tell of its free when the step is being recorded).
pub(crate) enum Placement<B> {
    /// A slot of the step's workspace.
    Slot(Slot<B>),
    /// The backend allocates it.
    Own(Option<Tracked>),
}

/// What the current step does with its buffers.
enum Mode<B> {
    /// Not planned, or outside a step: every buffer from the allocator.
    Off,
    /// Recorded for the plan of `key`.
    Record { key: StepKey, recording: Arc<Mutex<Recording>> },
    /// Served from `planned`; `next` is the next buffer's index, `outgrown` whether a buffer
    /// did not fit the plan.
    Replay { key: StepKey, planned: Arc<Planned<B>>, next: usize, outgrown: bool },
}

/// A shape's plan, or its recordings so far.
struct Shape<B> {
    planned: Option<Arc<Planned<B>>>,
    /// The sizes planned last, kept at their largest across recordings of the same length.
    sizes: Vec<usize>,
    recordings: usize,
    /// Record the next step of this shape (the plan proved too small).
    rerecord: bool,
    /// When a step of this shape last began (steps counted by the memory).
    used: u64,
}

/// The step workspaces of one backend: a plan per step shape, the step in progress, counts.
/// `B` is the workspace buffer (device memory for the CUDA backend).
pub(crate) struct StepMemory<B> {
    shapes: HashMap<StepKey, Shape<B>>,
    mode: Mode<B>,
    /// Nested [`StepMemory::begin`]s open now.
    depth: usize,
    /// Outermost steps begun so far.
    steps: u64,
    /// See [`WORKSPACE_BUDGET`].
    budget: usize,
    stats: WorkspaceStats,
}

impl<B> std::fmt::Debug for StepMemory<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepMemory")
            .field("shapes", &self.shapes.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl<B> Default for StepMemory<B> {
    fn default() -> Self {
        StepMemory::with_budget(WORKSPACE_BUDGET)
    }
}

impl<B> StepMemory<B> {
    /// A step memory whose plans hold at most `budget` bytes together (see
    /// [`WORKSPACE_BUDGET`]; a plan larger than that alone is kept while it is the only one).
    pub(crate) fn with_budget(budget: usize) -> Self {
        let stats = WorkspaceStats::default();
        StepMemory { shapes: HashMap::new(), mode: Mode::Off, depth: 0, steps: 0, budget, stats }
    }

    /// Starts a step of shape `key` (`None`: not planned). Steps nest: only the outermost
    /// one counts, so a step that calls another is one step. Returns whether this is the
    /// outermost.
    pub(crate) fn begin(&mut self, key: Option<StepKey>) -> bool {
        self.depth += 1;
        if self.depth > 1 {
            return false;
        }
        self.steps += 1;
        let Some(key) = key else {
            self.mode = Mode::Off;
            return true;
        };
        let shape = self.shapes.entry(key).or_insert_with(|| Shape {
            planned: None,
            sizes: Vec::new(),
            recordings: 0,
            rerecord: false,
            used: 0,
        });
        shape.used = self.steps;
        self.mode = match &shape.planned {
            Some(planned) if !shape.rerecord => {
                Mode::Replay { key, planned: planned.clone(), next: 0, outgrown: false }
            }
            _ => {
                let recording = Recording { open: true, ..Default::default() };
                Mode::Record { key, recording: Arc::new(Mutex::new(recording)) }
            }
        };
        true
    }

    /// Whether a step is in progress.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn in_step(&self) -> bool {
        self.depth > 0
    }

    /// The shape of the step in progress (`None`: not planned, or no step).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn key(&self) -> Option<StepKey> {
        match &self.mode {
            Mode::Off => None,
            Mode::Record { key, .. } | Mode::Replay { key, .. } => Some(*key),
        }
    }

    /// Ends the step [`StepMemory::begin`] started (the outermost one: a recording becomes
    /// its shape's plan). Returns whether that was the outermost step.
    pub(crate) fn end(&mut self) -> bool {
        self.depth = self.depth.saturating_sub(1);
        if self.depth > 0 {
            return false;
        }
        match std::mem::replace(&mut self.mode, Mode::Off) {
            Mode::Off => {}
            Mode::Record { key, recording } => {
                let lifetimes = {
                    let mut r = recording.lock().unwrap_or_else(|e| e.into_inner());
                    r.open = false;
                    std::mem::take(&mut r.lifetimes)
                };
                self.stats.recordings += 1;
                let Some(shape) = self.shapes.get_mut(&key) else { return true };
                let mut lifetimes = lifetimes;
                if shape.sizes.len() == lifetimes.len() {
                    for (l, &old) in lifetimes.iter_mut().zip(&shape.sizes) {
                        l.bytes = l.bytes.max(old);
                    }
                }
                shape.sizes = lifetimes.iter().map(|l| l.bytes).collect();
                shape.recordings += 1;
                shape.rerecord = false;
                let layout = plan(&lifetimes);
                let held = (0..lifetimes.len()).map(|_| AtomicBool::new(false)).collect();
                shape.planned = Some(Arc::new(Planned { layout, buf: OnceLock::new(), held }));
                self.keep_within_budget(key);
                self.stats.planned_bytes = self.planned_bytes();
            }
            Mode::Replay { key, outgrown, .. } => {
                if let Some(shape) = self.shapes.get_mut(&key) {
                    shape.rerecord = outgrown && shape.recordings < RECORDINGS_MAX;
                }
            }
        }
        true
    }

    /// Where the step's next buffer of `bytes` comes from. `make` makes a workspace of the
    /// bytes it is given, at a plan's first use; when it fails, the buffer takes the allocator
    /// (and the error is the allocator's to meet).
    pub(crate) fn place<E>(
        &mut self,
        bytes: usize,
        make: impl FnOnce(usize) -> Result<B, E>,
    ) -> Placement<B> {
        match &mut self.mode {
            Mode::Off => Placement::Own(None),
            Mode::Record { recording, .. } => {
                self.stats.fallbacks += 1;
                let mut r = recording.lock().unwrap_or_else(|e| e.into_inner());
                let index = r.lifetimes.len();
                let start = r.events;
                r.lifetimes.push(Lifetime { bytes, start, end: None });
                r.events += 1;
                Placement::Own(Some(Tracked { recording: recording.clone(), index }))
            }
            Mode::Replay { planned, next, outgrown, .. } => {
                let i = *next;
                *next += 1;
                let layout = &planned.layout;
                if i >= layout.offsets.len() || bytes > layout.bytes[i] {
                    *outgrown = true;
                    self.stats.fallbacks += 1;
                    return Placement::Own(None);
                }
                let Some(offset) = layout.offsets[i] else {
                    // Held past the step when recorded: the allocator's, as planned.
                    return Placement::Own(None);
                };
                let free = |j: usize| !planned.held[j].load(Ordering::Acquire);
                if !free(i) || !layout.conflicts[i].iter().all(|&j| free(j as usize)) {
                    self.stats.fallbacks += 1;
                    return Placement::Own(None);
                }
                if planned.buf.get().is_none() {
                    match make(layout.total) {
                        Ok(buf) => {
                            let _ = planned.buf.set(buf);
                            self.stats.workspaces += 1;
                        }
                        Err(_) => {
                            self.stats.fallbacks += 1;
                            return Placement::Own(None);
                        }
                    }
                }
                planned.held[i].store(true, Ordering::Release);
                self.stats.slots += 1;
                Placement::Slot(Slot { planned: planned.clone(), index: i, offset })
            }
        }
    }

    /// Forgets every plan (their workspaces go when the slots still held are dropped): for a
    /// sleep, which gives the device memory back. The next steps are recorded again.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn clear(&mut self) {
        self.shapes.clear();
        if let Mode::Replay { .. } = self.mode {
            self.mode = Mode::Off;
        }
        self.stats.planned_bytes = 0;
    }

    /// Forgets every plan, as [`StepMemory::clear`] does, and says what they held: the
    /// plans' count and their workspaces' bytes (gone once no slot of them is held).
    pub(crate) fn release(&mut self) -> Released {
        let plans = self.shapes.values().filter(|s| s.planned.is_some()).count();
        let bytes = self.planned_bytes() as u64;
        self.clear();
        Released { items: plans, device_bytes: bytes, host_bytes: 0 }
    }

    /// What this has done so far.
    pub(crate) fn stats(&self) -> WorkspaceStats {
        self.stats
    }

    /// Drops the least recently used plans (never `keep`'s) until the plans kept fit the
    /// budget.
    fn keep_within_budget(&mut self, keep: StepKey) {
        while self.planned_bytes() > self.budget {
            let oldest = self
                .shapes
                .iter()
                .filter(|(k, s)| **k != keep && s.planned.is_some())
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| *k);
            let Some(oldest) = oldest else { return };
            if let Some(shape) = self.shapes.get_mut(&oldest) {
                // Its workspace goes once the slots still held are dropped.
                shape.planned = None;
            }
        }
    }

    /// The bytes of the workspaces of every plan kept now.
    fn planned_bytes(&self) -> usize {
        self.shapes.values().filter_map(|s| s.planned.as_ref()).map(|p| p.layout.total).sum()
    }
}

/// What a backend gave back when a sleep released memory it holds outside tagged memory
/// (its step workspaces, its graphs: [`super::Backend::release_workspace`],
/// [`super::Backend::release_graphs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// The things released: workspace plans, graphs.
    pub items: usize,
    /// Device bytes given back (a backend that simulates device buffers counts its host
    /// buffers here).
    pub device_bytes: u64,
    /// Host bytes given back (pinned staging buffers).
    pub host_bytes: u64,
}

/// A step of a [`super::Backend`] in progress ([`super::Backend::step`]): the buffers its
/// kernels write come from the step shape's workspace; dropping it ends the step.
#[must_use = "the step ends when this is dropped"]
pub struct StepScope {
    backend: super::Backend,
}

impl Drop for StepScope {
    fn drop(&mut self) {
        self.backend.end_step();
    }
}

impl super::Backend {
    /// Starts a model step of `tokens` tokens over `seqs` sequences: until the returned scope
    /// is dropped, the buffers the kernels write are planned per step shape (see
    /// [`crate::kernels::workspace`]), so that a warm step allocates nothing and its buffers
    /// keep their addresses. Steps nest (the outermost counts). The CPU backend computes in
    /// place and plans nothing, except the test backend that simulates device buffers
    /// (`test_util::cpu_with_planned_device_outputs`).
    pub fn step(&self, tokens: usize, seqs: usize) -> StepScope {
        let key = StepKey::of(tokens, seqs);
        match self {
            super::Backend::Cpu(cpu) => {
                cpu.with_step_memory(|m| {
                    m.begin(key);
                });
            }
            super::Backend::Cuda(cuda) => cuda.begin_step(key, (tokens, seqs)),
        }
        StepScope { backend: self.clone() }
    }

    fn end_step(&self) {
        match self {
            super::Backend::Cpu(cpu) => {
                cpu.with_step_memory(StepMemory::end);
            }
            super::Backend::Cuda(cuda) => cuda.end_step(),
        }
    }

    /// What the step workspaces have done so far: slots handed out, buffers that took the
    /// allocator, recordings, workspaces made; `None` for a backend that plans none.
    pub fn workspace_stats(&self) -> Option<WorkspaceStats> {
        match self {
            super::Backend::Cpu(cpu) => cpu.with_step_memory(|m| m.stats()),
            super::Backend::Cuda(cuda) => Some(cuda.workspace_stats()),
        }
    }

    /// Turns CUDA graphs of steps on or off (on by default; vLLM's `--enforce-eager` turns
    /// them off): a GPU backend captures a step whose launches repeat those of the last two
    /// steps of its shape, and replays it with one graph launch. The CPU has none.
    pub fn set_graphs(&self, enabled: bool) {
        if let super::Backend::Cuda(cuda) = self {
            cuda.set_graphs(enabled);
        }
    }

    /// The time the GPU spent in this backend's steps so far, measured on the device (events
    /// around each step, [`super::CudaBackend::device_busy`]); `None` on the CPU.
    pub fn device_busy(&self) -> Option<std::time::Duration> {
        match self {
            super::Backend::Cpu(_) => None,
            super::Backend::Cuda(cuda) => Some(cuda.device_busy()),
        }
    }

    /// Gives back the memory of the step workspaces (see [`crate::kernels::workspace`]): the
    /// plans are forgotten and the next steps of each shape plan again. On a GPU the graphs
    /// go too (they name the workspaces' addresses), and so do the step inputs' staging
    /// buffers and the temporaries the driver's memory pool keeps, whose bytes are counted.
    /// `None` for a backend that holds no workspace (the CPU).
    pub fn release_workspace(&self) -> Option<Released> {
        match self {
            super::Backend::Cpu(cpu) => cpu.with_step_memory(StepMemory::release),
            super::Backend::Cuda(cuda) => Some(cuda.release_workspace()),
        }
    }

    /// Destroys the CUDA graphs of steps; each shape's next steps capture theirs again.
    /// `None` for a backend that has none (the CPU).
    pub fn release_graphs(&self) -> Option<Released> {
        match self {
            super::Backend::Cpu(_) => None,
            super::Backend::Cuda(cuda) => Some(cuda.release_graphs()),
        }
    }

    /// What the step graphs have done so far; `None` on the CPU.
    pub fn graph_stats(&self) -> Option<super::cuda::GraphStats> {
        match self {
            super::Backend::Cpu(_) => None,
            super::Backend::Cuda(cuda) => Some(cuda.graph_stats()),
        }
    }
}
