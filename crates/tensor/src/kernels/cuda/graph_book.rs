//! CUDA graphs of a backend's steps, as bookkeeping: which steps run eagerly, which are
//! captured, which replay a graph, and what a step does that stops matching its graph. Plain
//! Rust over the calls a step makes (`C`: a kernel launch, a product, a staged copy, with
//! every argument) and the graph type `G`, tested without a GPU; the CUDA backend
//! (`device/graphs.rs`) makes and launches the graphs.
//!
//! A step's calls go through [`GraphBook::call`] in order, up to its first host read (a
//! download, a wait) or its end, which [`GraphBook::flush`] marks; what follows a flush in
//! the same step is eager. For a shape (the step's tokens and sequences):
//! - Eager steps are recorded. When a recording equals the shape's last one (the same calls,
//!   addresses and sizes included), the next step of the shape is captured: its calls are
//!   issued into a graph, which is launched at the flush and kept.
//! - A step of a shape with a graph replays it: each call is compared with the graph's next
//!   one and not issued; at the flush, when all matched, the graph is launched instead. A
//!   step's calls are its inputs' addresses, its buffers' slots and its launch sizes, so a
//!   step that matches its graph does exactly what the graph does (the inputs' values are in
//!   the staging memory the graph copies from).
//! - A call that does not match, a flush before the graph's last call, or anything that is
//!   not a call (an allocation, a plain upload, a reduction): the step goes on eagerly after
//!   issuing the calls it skipped ([`Leave::Issue`]), and the graph is dropped. Inside a
//!   capture the capture ends, its graph is discarded and the calls captured are issued
//!   ([`Leave::AbortCapture`]). A shape that misses [`MISSES_MAX`] times, or whose capture
//!   fails, stays eager.

pub(crate) use super::counters::GraphStats;
use std::collections::HashMap;
use std::sync::Arc;

/// A step's shape for graphs: its tokens and its sequences, exactly.
pub(crate) type Shape = (usize, usize);

/// Graphs kept at most; past it the least recently used is dropped.
pub(crate) const GRAPHS_MAX: usize = 64;

/// Replays of a shape that may stop matching before it stays eager, when they are more
/// than one in [`REPLAYS_PER_MISS`] of its replays. A decode step misses now and then by
/// itself (an input outgrows its slot as the context grows, a few times in all); a shape
/// that misses at most replays is not worth its captures.
pub(crate) const MISSES_MAX: usize = 8;

/// See [`MISSES_MAX`].
pub(crate) const REPLAYS_PER_MISS: usize = 8;

/// What the backend does with a call (see [`GraphBook::call`]).
#[derive(Debug, PartialEq)]
pub(crate) enum OnCall<C> {
    /// Issue it (eagerly, or into the capture).
    Issue,
    /// Do not: the graph replayed at the flush does it.
    Skip,
    /// Issue these skipped calls first, then this one, and go on eagerly.
    Recover(Vec<C>),
}

/// What the backend does at a flush or before something that is not a call.
#[derive(Debug, PartialEq)]
pub(crate) enum Leave<'a, C, G> {
    /// Nothing to do.
    Nothing,
    /// End the capture; make the graph and launch it, then [`GraphBook::captured`] (or
    /// [`GraphBook::capture_failed`]).
    EndCapture,
    /// Launch this graph: the step matched it.
    Launch(&'a G),
    /// Issue these calls (skipped by a replay that stopped matching).
    Issue(Vec<C>),
    /// End the capture and discard its graph, then issue these calls (captured, so not done).
    AbortCapture(Vec<C>),
}

/// What a shape's steps have shown.
struct ShapeState<C, G> {
    /// The last eager step's calls, when it could be captured.
    last: Option<Vec<C>>,
    /// The last two eager steps made the same calls: capture the next one.
    ready: bool,
    graph: Option<(G, Arc<Vec<C>>)>,
    misses: usize,
    replays: usize,
    /// Eager for good.
    eager: bool,
    /// When a step of this shape last began.
    used: u64,
}

impl<C, G> Default for ShapeState<C, G> {
    fn default() -> Self {
        ShapeState {
            last: None,
            ready: false,
            graph: None,
            misses: 0,
            replays: 0,
            eager: false,
            used: 0,
        }
    }
}

/// The step in progress.
enum Step<C> {
    /// No step, a shape that stays eager, or past the flush: calls are issued, not recorded.
    Off,
    Record {
        shape: Shape,
        calls: Vec<C>,
    },
    Capture {
        shape: Shape,
        calls: Vec<C>,
    },
    Replay {
        shape: Shape,
        calls: Arc<Vec<C>>,
        at: usize,
    },
}

/// The graphs of one backend (see the module docs).
pub(crate) struct GraphBook<C, G> {
    enabled: bool,
    shapes: HashMap<Shape, ShapeState<C, G>>,
    step: Step<C>,
    /// A capture ended by [`GraphBook::flush`], waiting for its graph.
    pending: Option<(Shape, Vec<C>)>,
    /// The shape whose graph [`GraphBook::flush`] gave to launch last.
    launched: Option<Shape>,
    steps: u64,
    stats: GraphStats,
}

impl<C, G> std::fmt::Debug for GraphBook<C, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphBook")
            .field("enabled", &self.enabled)
            .field("shapes", &self.shapes.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl<C: Clone + PartialEq, G> GraphBook<C, G> {
    /// Bookkeeping for a backend with graphs `enabled` (else every step is eager).
    pub(crate) fn new(enabled: bool) -> Self {
        GraphBook {
            enabled,
            shapes: HashMap::new(),
            step: Step::Off,
            pending: None,
            launched: None,
            steps: 0,
            stats: GraphStats::default(),
        }
    }

    /// Turns graphs on or off for the steps that begin from now on (off drops them).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
        if !enabled {
            self.clear();
        }
    }

    /// Whether steps may be captured.
    #[cfg(test)]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Starts a step of `shape` (`None`: a step that is never captured, such as a long
    /// prefill). Returns whether it is captured: the backend begins the capture first.
    pub(crate) fn begin(&mut self, shape: Option<Shape>) -> bool {
        self.step = Step::Off;
        self.steps += 1;
        let Some(shape) = shape.filter(|_| self.enabled) else { return false };
        let st = self.shapes.entry(shape).or_default();
        st.used = self.steps;
        if st.eager {
            return false;
        }
        if let Some((_, calls)) = &st.graph {
            self.step = Step::Replay { shape, calls: calls.clone(), at: 0 };
            return false;
        }
        if std::mem::take(&mut st.ready) {
            self.step = Step::Capture { shape, calls: Vec::new() };
            return true;
        }
        self.step = Step::Record { shape, calls: Vec::new() };
        false
    }

    /// Whether the step in progress is recorded, captured or replayed (its calls up to its
    /// first host read go through [`GraphBook::call`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn in_graph(&self) -> bool {
        !matches!(self.step, Step::Off)
    }

    /// Whether the step in progress is being captured.
    pub(crate) fn capturing(&self) -> bool {
        matches!(self.step, Step::Capture { .. })
    }

    /// Whether the step in progress replays a graph (its calls so far were not issued).
    #[cfg(test)]
    pub(crate) fn replaying(&self) -> bool {
        matches!(self.step, Step::Replay { .. })
    }

    /// The step's next call.
    pub(crate) fn call(&mut self, call: &C) -> OnCall<C> {
        match &mut self.step {
            Step::Off => OnCall::Issue,
            Step::Record { calls, .. } | Step::Capture { calls, .. } => {
                calls.push(call.clone());
                OnCall::Issue
            }
            Step::Replay { calls, at, .. } => {
                if calls.get(*at) == Some(call) {
                    *at += 1;
                    return OnCall::Skip;
                }
                let skipped = self.miss();
                if let Step::Record { calls, .. } = &mut self.step {
                    calls.push(call.clone());
                }
                OnCall::Recover(skipped)
            }
        }
    }

    /// A replay stopped matching: its graph goes, the step goes on as a recording of what it
    /// did so far (the calls skipped, returned to be issued).
    fn miss(&mut self) -> Vec<C> {
        let Step::Replay { shape, calls, at } = std::mem::replace(&mut self.step, Step::Off) else {
            return Vec::new();
        };
        let skipped = calls[..at].to_vec();
        self.stats.misses += 1;
        if !self.missed(shape) {
            self.step = Step::Record { shape, calls: skipped.clone() };
        }
        skipped
    }

    /// `shape`'s graph (or capture) went; returns whether the shape now stays eager (see
    /// [`MISSES_MAX`]).
    fn missed(&mut self, shape: Shape) -> bool {
        let st = self.shapes.entry(shape).or_default();
        (st.graph, st.last) = (None, None);
        st.misses += 1;
        let eager = st.misses >= MISSES_MAX && st.misses * REPLAYS_PER_MISS > st.replays;
        if eager {
            self.stay_eager(shape);
        }
        eager
    }

    fn stay_eager(&mut self, shape: Shape) {
        let st = self.shapes.entry(shape).or_default();
        if !st.eager {
            st.eager = true;
            st.graph = None;
            st.last = None;
            self.stats.eager_shapes += 1;
        }
    }

    /// The end of the step's graph: its first host read, or its end.
    pub(crate) fn flush(&mut self) -> Leave<'_, C, G> {
        match std::mem::replace(&mut self.step, Step::Off) {
            Step::Off => Leave::Nothing,
            Step::Record { shape, calls } => {
                let st = self.shapes.entry(shape).or_default();
                st.ready = !calls.is_empty() && st.last.as_ref() == Some(&calls);
                st.last = Some(calls);
                Leave::Nothing
            }
            Step::Capture { shape, calls } => {
                self.pending = Some((shape, calls));
                Leave::EndCapture
            }
            Step::Replay { shape, calls, at } if at == calls.len() => {
                self.stats.replays += 1;
                let st = self.shapes.get_mut(&shape);
                match st.and_then(|st| {
                    st.replays += 1;
                    st.graph.as_ref()
                }) {
                    Some((g, _)) => {
                        self.launched = Some(shape);
                        Leave::Launch(g)
                    }
                    // Dropped while the step ran (a clear): what it skipped is still to do.
                    None => Leave::Issue(calls[..at].to_vec()),
                }
            }
            replay @ Step::Replay { .. } => {
                self.step = replay;
                let skipped = self.miss();
                self.step = Step::Off;
                Leave::Issue(skipped)
            }
        }
    }

    /// Something that is not a call is about to happen in the step (an allocation, a plain
    /// upload, a reduction): the step cannot be in a graph.
    pub(crate) fn other(&mut self) -> Leave<'_, C, G> {
        match std::mem::replace(&mut self.step, Step::Off) {
            Step::Off => Leave::Nothing,
            Step::Record { shape, .. } => {
                let st = self.shapes.entry(shape).or_default();
                (st.last, st.ready) = (None, false);
                Leave::Nothing
            }
            Step::Capture { shape, calls } => {
                self.stats.failed_captures += 1;
                self.missed(shape);
                Leave::AbortCapture(calls)
            }
            replay @ Step::Replay { .. } => {
                self.step = replay;
                let skipped = self.miss();
                self.step = Step::Off;
                Leave::Issue(skipped)
            }
        }
    }

    /// The graph of the capture [`GraphBook::flush`] ended, made and launched; the capture
    /// took `took` (see [`GraphStats::capture_time`]).
    pub(crate) fn captured(&mut self, graph: G, took: std::time::Duration) {
        let Some((shape, calls)) = self.pending.take() else { return };
        self.stats.captures += 1;
        self.stats.capture_time += took;
        let with_graphs = self.shapes.values().filter(|s| s.graph.is_some()).count();
        if with_graphs >= GRAPHS_MAX {
            let oldest = self
                .shapes
                .iter_mut()
                .filter(|(_, s)| s.graph.is_some())
                .min_by_key(|(_, s)| s.used);
            if let Some((_, s)) = oldest {
                s.graph = None;
            }
        }
        self.shapes.entry(shape).or_default().graph = Some((graph, Arc::new(calls)));
    }

    /// The capture [`GraphBook::flush`] ended made no graph: its shape stays eager. Returns
    /// the calls captured, which did not run.
    pub(crate) fn capture_failed(&mut self) -> Vec<C> {
        let Some((shape, calls)) = self.pending.take() else { return Vec::new() };
        self.stats.failed_captures += 1;
        self.stay_eager(shape);
        calls
    }

    /// The graph [`GraphBook::flush`] gave to launch could not be launched: its shape stays
    /// eager (the step's calls are lost with the launch: the caller reports the error).
    pub(crate) fn launch_failed(&mut self) {
        if let Some(shape) = self.launched.take() {
            self.stats.failed_captures += 1;
            self.stay_eager(shape);
        }
    }

    /// Drops every graph and what the shapes showed (a sleep: addresses change at the
    /// wakeup). Shapes that stayed eager may try again.
    pub(crate) fn clear(&mut self) {
        self.shapes.clear();
        self.pending = None;
    }

    /// What the graphs have done so far.
    pub(crate) fn stats(&self) -> GraphStats {
        self.stats
    }

    /// Graphs kept now.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn graphs(&self) -> usize {
        self.shapes.values().filter(|s| s.graph.is_some()).count()
    }
}

#[cfg(test)]
mod tests;
