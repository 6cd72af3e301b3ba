//! [`MpiComm`] over the `mpi` crate: the agreement exchange, the data phase and its watchdog
//! described in the module docs of [`crate::mpi`].

use crate::call::{GroupCore, Transport};
use crate::comm::check;
use crate::common::{blame_word, blamed, fnv, fnv_bytes, Descriptor};
use crate::dtype::{reduce, ElemType, ReduceOp};
use crate::error::{Error, Op, Result, Site};
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, Group as _, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use mpi::Threading;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Tag of the call descriptors every rank sends each peer before the data moves.
const TAG_DESCRIPTOR: i32 = 1;
/// Tag of the failure word a failed rank sends each peer.
const TAG_FAILURE: i32 = 2;
/// Tag of the data of `send` / `recv`.
const TAG_DATA: i32 = 3;

/// The process's MPI environment: finalized when the process exits.
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);
/// The outcome of starting MPI (once per process): MPI's world rank and size, or why not.
static STARTED: OnceLock<std::result::Result<(usize, usize), String>> = OnceLock::new();

extern "C" fn finalize_at_exit() {
    // Dropping the universe calls `MPI_Finalize`, which `mpirun` expects of every rank that
    // exits normally (a rank that exits without it ends the job as a failure).
    let universe = UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(universe);
}

/// See [`crate::mpi::world`].
pub(super) fn world() -> Result<(usize, usize)> {
    let started = STARTED.get_or_init(|| {
        let Some((universe, level)) = mpi::initialize_with_threading(Threading::Multiple) else {
            return Err("MPI was already initialized outside tpctl".to_owned());
        };
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        *UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()) = Some(universe);
        // SAFETY: `finalize_at_exit` is a plain function that takes no arguments and only
        // locks a static mutex; registering it has no other precondition.
        let registered = unsafe { libc::atexit(finalize_at_exit) };
        if registered != 0 {
            return Err("could not register MPI_Finalize to run at exit".to_owned());
        }
        if level != Threading::Multiple {
            return Err(format!(
                "the MPI library offers thread level {level:?}, tpctl needs Multiple (its TP, \
                 CP and control groups may run on different threads); use an MPI built with \
                 thread support"
            ));
        }
        Ok((rank, size))
    });
    started.clone().map_err(|reason| Error::BackendUnavailable { backend: "mpi", reason })
}

/// Waits between polls: spins briefly (a message on one host arrives in microseconds), then
/// yields the core (ranks may outnumber cores) for the length of a large transfer, then
/// sleeps, so a long wait costs little. MPI moves data only inside its calls (no progress
/// thread), so the sleeps start late and are short.
struct Backoff {
    polls: u32,
    since: Instant,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff { polls: 0, since: Instant::now() }
    }
}

impl Backoff {
    fn pause(&mut self) {
        self.polls = self.polls.saturating_add(1);
        if self.polls < 64 {
            std::hint::spin_loop();
        } else if self.since.elapsed() < Duration::from_millis(100) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// A group of processes started by `mpirun`, connected through MPI: see [`crate::mpi`].
pub struct MpiComm {
    core: GroupCore,
    /// The group's MPI world ranks, by group rank.
    members: Vec<usize>,
    /// Where the data of the collectives moves; never freed (see `Drop`).
    coll: ManuallyDrop<SimpleCommunicator>,
    /// Where the descriptors, the failure words and the data of `send`/`recv` move.
    ctl: ManuallyDrop<SimpleCommunicator>,
    /// The posted receive of the first failure word a peer sends.
    failure: Option<Request<'static, [u32], StaticScope>>,
    /// Collective calls so far; a rank that skipped one is caught by its descriptor.
    seq: u64,
    /// The all-reduce's copy of its input, and the half types' exchanges (8-byte aligned).
    scratch: Vec<u64>,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("group", &self.core.group)
            .field("rank", &self.core.rank)
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

// SAFETY: the MPI handles inside (communicators, the posted receive) are plain handles that MPI
// lets any thread use, because `world` requires MPI_THREAD_MULTIPLE before any communicator
// exists; the communicator is used by one thread at a time (`&mut self`, no `Sync`), and the
// receive's buffer is leaked, so it outlives every thread.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Makes the group of MPI world ranks `members` (this process among them, every member in
    /// the same order), named `group`, with `timeout` per call. Groups that overlap and are
    /// made at the same time need different names or members. Only the members call it,
    /// all of them: `MPI_Comm_create_group` waits for them, without a deadline, so callers
    /// first meet at a barrier that has one (the group set-up does, through the store).
    ///
    /// # Errors
    /// MPI cannot start here ([`crate::mpi::world`]); this process is not a member; a member
    /// is not an MPI world rank.
    pub fn create(group: &str, members: &[usize], timeout: Duration) -> Result<MpiComm> {
        let (me, world_size) = world()?;
        start_watchdog()?;
        let unavailable = |reason: String| Error::BackendUnavailable { backend: "mpi", reason };
        let rank = members.iter().position(|&m| m == me).ok_or_else(|| {
            unavailable(format!("MPI rank {me} is not a member of group {group} {members:?}"))
        })?;
        if let Some(m) = members.iter().find(|&&m| m >= world_size) {
            return Err(unavailable(format!(
                "group {group} names rank {m}, but MPI started {world_size} ranks; start every \
                 rank with mpirun"
            )));
        }
        let world = mpi::topology::SimpleCommunicator::world();
        let ranks: Vec<i32> = members.iter().map(|&m| m as i32).collect();
        let subgroup = world.group().include(&ranks);
        // Members making different groups at the same time (a rank joining a larger group
        // while its peers still make a smaller one) must not read each other's set-up
        // messages: each group's set-up has its own tag (MPI guarantees tags up to 32767).
        let tag = (fnv_bytes(group.as_bytes()) ^ fnv(members)) % 32768;
        let make = || {
            world.split_by_subgroup_with_tag(&subgroup, tag as i32).ok_or_else(|| {
                unavailable(format!("MPI_Comm_create_group gave no communicator for {group}"))
            })
        };
        let coll = make()?;
        let ctl = coll.duplicate();
        // A word a peer will send when it fails: leaked, so the receive can stay posted for
        // the communicator's life and be abandoned safely.
        let word: &'static mut [u32] = Box::leak(Box::new([0u32; 1]));
        let failure =
            ctl.any_process().immediate_receive_into_with_tag(StaticScope, word, TAG_FAILURE);
        Ok(MpiComm {
            core: GroupCore::new(group.into(), rank, members.len(), timeout),
            members: members.to_vec(),
            coll: ManuallyDrop::new(coll),
            ctl: ManuallyDrop::new(ctl),
            failure: Some(failure),
            seq: 0,
            scratch: Vec::new(),
        })
    }

    /// The group's MPI world ranks, by group rank.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// The agreement: sends `mine` to each of `peers` and checks theirs against it, polling
    /// against `deadline`, the abort handle and the peers' failure words. Every buffer MPI
    /// holds here is this function's, so an unfinished exchange is cancelled and returns.
    fn agree(
        &mut self,
        at: &Site,
        deadline: Instant,
        peers: &[usize],
        mine: Descriptor,
        aux_name: &'static str,
    ) -> Result<()> {
        failpoint(at, "mpi.agree")?;
        let started = Instant::now();
        let out = words(&mine);
        let mut inbox = vec![[0u64; 6]; peers.len()];
        let ctl = &*self.ctl;
        let mut failure = self.failure.take();
        let abort = self.core.abort.clone();
        let outcome = mpi::request::scope(|scope| {
            let sends: Vec<_> = peers
                .iter()
                .map(|&p| {
                    ctl.process_at_rank(p as i32).immediate_send_with_tag(
                        scope,
                        &out[..],
                        TAG_DESCRIPTOR,
                    )
                })
                .collect();
            let mut recvs: Vec<_> = inbox
                .iter_mut()
                .zip(peers)
                .map(|(buf, &p)| {
                    Some(ctl.process_at_rank(p as i32).immediate_receive_into_with_tag(
                        scope,
                        &mut buf[..],
                        TAG_DESCRIPTOR,
                    ))
                })
                .collect();
            let mut backoff = Backoff::default();
            let mut failed = None;
            let outcome = loop {
                // A peer's failure word is looked for before its descriptor: MPI delivers one
                // sender's messages in order, so the descriptors tested next include every
                // one sent before that word, and a rank that disagrees is named as such.
                if let Some(request) = failure.take() {
                    match request.test_with_data() {
                        Ok((status, word)) => {
                            let reporter = status.source_rank() as usize;
                            failed = Some(
                                blamed(word[0], at, reporter, |_| 0, started.elapsed())
                                    .unwrap_or_else(|| Error::PeerFailed {
                                        at: at.clone(),
                                        peer: reporter,
                                    }),
                            );
                        }
                        Err(request) => failure = Some(request),
                    }
                }
                let mut disagreement = None;
                for (slot, &peer) in recvs.iter_mut().zip(peers) {
                    let Some(request) = slot.take() else { continue };
                    match request.test_with_data() {
                        Ok((_, theirs)) => {
                            if let Err(e) = mine.agree(&descriptor(theirs), at, peer, aux_name) {
                                disagreement.get_or_insert(e);
                            }
                        }
                        Err(request) => *slot = Some(request),
                    }
                }
                if let Some(e) = disagreement.or(failed.take()) {
                    break Err(e);
                }
                if recvs.iter().all(Option::is_none) {
                    break Ok(());
                }
                if abort.is_aborted() {
                    break Err(Error::Aborted { at: at.clone() });
                }
                if Instant::now() >= deadline {
                    let waiting_for = peers
                        .iter()
                        .zip(&recvs)
                        .filter(|(_, r)| r.is_some())
                        .map(|(&p, _)| p)
                        .collect();
                    break Err(Error::Timeout {
                        at: at.clone(),
                        elapsed: started.elapsed(),
                        waiting_for,
                    });
                }
                backoff.pause();
            };
            // A cancelled receive completes at once; the descriptors sent are a few bytes,
            // which MPI delivers eagerly, so their sends complete without the peer.
            for request in recvs.into_iter().flatten() {
                request.cancel();
                request.wait();
            }
            for request in sends {
                request.wait();
            }
            outcome
        });
        self.failure = failure;
        outcome?;
        // Where a rank can stall after agreeing, before the data moves (a test makes the
        // peers' data phase outlive its deadline here).
        failpoint(at, "mpi.data")
    }

    /// The agreement of a collective with every other rank of the group.
    fn agree_all(
        &mut self,
        at: &Site,
        deadline: Instant,
        dtype: ElemType,
        rop: Option<ReduceOp>,
        total: usize,
        aux: (u64, &'static str),
    ) -> Result<()> {
        self.seq += 1;
        let mine = Descriptor {
            op: at.op.code(),
            dtype: dtype.code(),
            rop: rop.map_or(0, ReduceOp::code),
            seq: self.seq,
            total: total as u64,
            aux: aux.0,
        };
        let peers: Vec<usize> = (0..at.size).filter(|&r| r != at.rank).collect();
        self.agree(at, deadline, &peers, mine, aux.1)
    }

    /// The agreement of a `send` or `recv` with its peer: both say `send`, with the bytes.
    fn agree_pair(
        &mut self,
        at: &Site,
        deadline: Instant,
        dtype: ElemType,
        total: usize,
        peer: usize,
    ) -> Result<()> {
        let mine = Descriptor {
            op: Op::Send.code(),
            dtype: dtype.code(),
            rop: 0,
            seq: 0,
            total: total as u64,
            aux: 0,
        };
        self.agree(at, deadline, &[peer], mine, "")
    }

    /// Reduces `dtype`s that MPI has no type for (f16, bf16): gathers every rank's `send`
    /// into scratch and reduces it in rank order, in f32, into `out` for the chunk at
    /// `range` of each rank's buffer.
    fn reduce_gathered(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        out: &mut [u8],
        range: std::ops::Range<usize>,
        (dtype, op): (ElemType, ReduceOp),
    ) {
        let (size, len) = (at.size, send.len());
        let coll = &*self.coll;
        let mut scratch = std::mem::take(&mut self.scratch);
        grow(&mut scratch, size * len);
        let all: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut scratch)[..size * len];
        watched(at, deadline, || coll.all_gather_into(send, &mut *all));
        let sources: Vec<&[u8]> =
            (0..size).map(|r| &all[r * len + range.start..r * len + range.end]).collect();
        reduce(dtype, op, out, &sources);
        self.scratch = scratch;
    }
}

/// Data phases in progress in this process: an id, the deadline, and where (for the log).
static WATCHED: Mutex<Vec<(u64, Instant, Site)>> = Mutex::new(Vec::new());
/// Ids of [`WATCHED`] entries.
static NEXT_WATCH: AtomicU64 = AtomicU64::new(0);
/// The watchdog thread, started with the first communicator (or why it could not be).
static WATCHDOG: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// Starts the process's watchdog thread once.
fn start_watchdog() -> Result<()> {
    WATCHDOG
        .get_or_init(|| {
            std::thread::Builder::new()
                .name("mpi-watchdog".into())
                .spawn(watchdog)
                .map(drop)
                .map_err(|e| format!("cannot start the data phases' watchdog thread: {e}"))
        })
        .clone()
        .map_err(|reason| Error::BackendUnavailable { backend: "mpi", reason })
}

/// Ends the job when a data phase outlives its deadline: MPI's blocking call cannot be
/// interrupted, and it still owns the caller's buffers, so the rank cannot return.
fn watchdog() {
    loop {
        std::thread::sleep(Duration::from_millis(5));
        let now = Instant::now();
        let late = {
            let watched = WATCHED.lock().unwrap_or_else(|e| e.into_inner());
            watched.iter().find(|(_, deadline, _)| now >= *deadline).map(|(_, _, at)| at.clone())
        };
        if let Some(at) = late {
            tracing::error!(
                "{at}: every rank agreed on the call, but its data did not move before the \
                 deadline; MPI cannot cancel it and still holds this rank's buffers, so the \
                 job ends here (MPI_Abort, error code {ABORT_CODE})"
            );
            SimpleCommunicator::world().abort(ABORT_CODE);
        }
    }
}

/// A data phase under the watchdog until dropped.
struct Watch(u64);

/// Runs `call`, an MPI data phase, under the watchdog (see [`watch`]).
fn watched<R>(at: &Site, deadline: Instant, call: impl FnOnce() -> R) -> R {
    let _watch = watch(at, deadline);
    call()
}

/// Puts the data phase of the call at `at` under the watchdog, with `deadline`.
fn watch(at: &Site, deadline: Instant) -> Watch {
    let id = NEXT_WATCH.fetch_add(1, Ordering::Relaxed);
    WATCHED.lock().unwrap_or_else(|e| e.into_inner()).push((id, deadline, at.clone()));
    Watch(id)
}

impl Drop for Watch {
    fn drop(&mut self) {
        WATCHED.lock().unwrap_or_else(|e| e.into_inner()).retain(|(id, ..)| *id != self.0);
    }
}

/// Passes through the failpoint `point` (feature `failpoints`): `mpi.agree` before the
/// descriptors are sent, `mpi.data` once every rank agreed, before the data moves.
fn failpoint(at: &Site, point: &str) -> Result<()> {
    mesh::failpoint::hit(point).map_err(|source| Error::Injected { at: at.clone(), source })
}

/// Makes `scratch` hold at least `bytes` bytes; what it held is overwritten by the caller, so
/// it is not cleared (a cleared buffer would be zeroed again on every call).
fn grow(scratch: &mut Vec<u64>, bytes: usize) {
    let words = bytes.div_ceil(8);
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
}

/// The exit code `MPI_Abort` gives `mpirun` when a data phase outlived its deadline.
const ABORT_CODE: i32 = 75;

fn words(d: &Descriptor) -> [u64; 6] {
    [u64::from(d.op), u64::from(d.dtype), u64::from(d.rop), d.seq, d.total, d.aux]
}

fn descriptor(w: &[u64]) -> Descriptor {
    Descriptor {
        op: w[0] as u32,
        dtype: w[1] as u32,
        rop: w[2] as u32,
        seq: w[3],
        total: w[4],
        aux: w[5],
    }
}

fn operation(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

/// MPI counts are C `int`s: refuses a buffer of more elements before anything is sent.
fn counted(at: &Site, bytes: usize, dtype: ElemType) -> Result<()> {
    let n = bytes / dtype.size();
    if i32::try_from(n).is_err() {
        return Err(check::invalid(
            at,
            format!("{n} {dtype} elements exceed what one MPI call can count (2^31 - 1)"),
        ));
    }
    Ok(())
}

/// Whether MPI reduces `dtype` with its own operators (the others are gathered and reduced
/// here).
fn reduced_by_mpi(dtype: ElemType) -> bool {
    matches!(dtype, ElemType::F32 | ElemType::I64 | ElemType::U8)
}

/// [`counted`] for a reduction of `bytes` per rank: in elements where MPI reduces the dtype,
/// in bytes gathered from every rank where it is reduced here.
fn counted_reduction(at: &Site, bytes: usize, dtype: ElemType) -> Result<()> {
    if reduced_by_mpi(dtype) {
        counted(at, bytes, dtype)
    } else {
        counted(at, bytes.saturating_mul(at.size), ElemType::U8)
    }
}

/// Runs `$body` with `$s` and `$r` as the typed views of `$send` and `$recv` for the dtypes
/// MPI reduces itself; evaluates to `false` for the others.
macro_rules! typed {
    ($dtype:expr, $send:expr, $recv:expr, |$s:ident, $r:ident| $body:expr) => {
        match $dtype {
            ElemType::F32 => {
                let ($s, $r): (&[f32], &mut [f32]) =
                    (bytemuck::cast_slice($send), bytemuck::cast_slice_mut($recv));
                $body;
                true
            }
            ElemType::I64 => {
                let ($s, $r): (&[i64], &mut [i64]) =
                    (bytemuck::cast_slice($send), bytemuck::cast_slice_mut($recv));
                $body;
                true
            }
            ElemType::U8 => {
                let ($s, $r): (&[u8], &mut [u8]) = ($send, $recv);
                $body;
                true
            }
            _ => false,
        }
    };
}

impl Transport for MpiComm {
    fn core(&self) -> &GroupCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        &mut self.core
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn publish_failure(&mut self, error: &Error, first: bool) {
        if !first {
            return;
        }
        let word: &'static [u32] = Box::leak(Box::new([blame_word(error, self.core.rank)]));
        let mut pending: Vec<_> = (0..self.core.size)
            .filter(|&r| r != self.core.rank)
            .map(|p| {
                self.ctl.process_at_rank(p as i32).immediate_send_with_tag(
                    StaticScope,
                    word,
                    TAG_FAILURE,
                )
            })
            .collect();
        // A word is delivered eagerly; give MPI a moment to push it out, then let go of the
        // requests (the buffer is leaked, so a late completion touches nothing freed).
        let until = Instant::now() + Duration::from_millis(100);
        while !pending.is_empty() && Instant::now() < until {
            pending = pending.into_iter().filter_map(|r| r.test().err()).collect();
            std::thread::yield_now();
        }
        for request in pending {
            std::mem::forget(request);
        }
    }

    fn all_reduce(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        counted_reduction(at, buf.len(), dtype)?;
        self.agree_all(at, deadline, dtype, Some(op), buf.len(), (0, ""))?;
        if !reduced_by_mpi(dtype) {
            let input = buf.to_vec();
            self.reduce_gathered(at, deadline, &input, buf, 0..input.len(), (dtype, op));
            return self.finish(at);
        }
        // MPI reduces from one buffer into another: the input is copied to scratch first.
        let mut input = std::mem::take(&mut self.scratch);
        grow(&mut input, buf.len());
        let send: &mut [u8] = &mut bytemuck::cast_slice_mut(&mut input)[..buf.len()];
        send.copy_from_slice(buf);
        let coll = &*self.coll;
        typed!(dtype, &*send, &mut *buf, |s, r| {
            watched(at, deadline, || coll.all_reduce_into(s, r, operation(op)));
        });
        self.scratch = input;
        self.finish(at)
    }

    fn all_gather(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        dtype: ElemType,
    ) -> Result<()> {
        counted(at, recv.len(), ElemType::U8)?;
        let even = sizes.iter().all(|&s| s == send.len());
        let aux = if at.op == Op::AllGatherUneven { fnv(sizes) } else { 0 };
        self.agree_all(at, deadline, dtype, None, recv.len(), (aux, "sizes"))?;
        let coll = &*self.coll;
        if even {
            watched(at, deadline, || coll.all_gather_into(send, recv));
            return self.finish(at);
        }
        let counts: Vec<i32> = sizes.iter().map(|&s| s as i32).collect();
        let displs: Vec<i32> = sizes
            .iter()
            .scan(0usize, |off, &s| {
                let start = *off;
                *off += s;
                Some(start as i32)
            })
            .collect();
        let mut partition = PartitionMut::new(recv, counts, displs);
        watched(at, deadline, || coll.all_gather_varcount_into(send, &mut partition));
        self.finish(at)
    }

    fn reduce_scatter(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        counted_reduction(at, send.len(), dtype)?;
        self.agree_all(at, deadline, dtype, Some(op), send.len(), (0, ""))?;
        let coll = &*self.coll;
        let native = typed!(dtype, send, &mut *recv, |s, r| {
            watched(at, deadline, || coll.reduce_scatter_block_into(s, r, operation(op)));
        });
        if !native {
            let chunk = recv.len();
            let range = at.rank * chunk..(at.rank + 1) * chunk;
            self.reduce_gathered(at, deadline, send, recv, range, (dtype, op));
        }
        self.finish(at)
    }

    fn broadcast(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        root: usize,
    ) -> Result<()> {
        counted(at, buf.len(), ElemType::U8)?;
        self.agree_all(at, deadline, dtype, None, buf.len(), (root as u64, "root"))?;
        let coll = &*self.coll;
        watched(at, deadline, || coll.process_at_rank(root as i32).broadcast_into(buf));
        self.finish(at)
    }

    fn send(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &[u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        counted(at, buf.len(), ElemType::U8)?;
        self.agree_pair(at, deadline, dtype, buf.len(), peer)?;
        let ctl = &*self.ctl;
        watched(at, deadline, || ctl.process_at_rank(peer as i32).send_with_tag(buf, TAG_DATA));
        self.finish(at)
    }

    fn recv(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        counted(at, buf.len(), ElemType::U8)?;
        self.agree_pair(at, deadline, dtype, buf.len(), peer)?;
        let ctl = &*self.ctl;
        watched(at, deadline, || {
            ctl.process_at_rank(peer as i32).receive_into_with_tag(buf, TAG_DATA)
        });
        self.finish(at)
    }

    fn all_to_all(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
    ) -> Result<()> {
        counted(at, send.len(), ElemType::U8)?;
        self.agree_all(at, deadline, dtype, None, send.len(), (0, ""))?;
        let coll = &*self.coll;
        watched(at, deadline, || coll.all_to_all_into(send, recv));
        self.finish(at)
    }

    fn barrier(&mut self, at: &Site, deadline: Instant) -> Result<()> {
        // Every rank's descriptor has arrived once the agreement is done: that is a barrier.
        self.agree_all(at, deadline, ElemType::U8, None, 0, (0, ""))
    }
}

impl MpiComm {
    /// The end of a data phase: an abort that came during it fails the call now.
    fn finish(&self, at: &Site) -> Result<()> {
        if self.core.abort.is_aborted() {
            return Err(Error::Aborted { at: at.clone() });
        }
        Ok(())
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        let Some(request) = self.failure.take() else { return };
        if mpi::environment::is_finalized() {
            // MPI is gone (the process is exiting), and its handles with it.
            std::mem::forget(request);
            return;
        }
        request.cancel();
        request.wait();
        // The communicators themselves are not freed (`coll` and `ctl` stay in their
        // `ManuallyDrop`): a peer's failure word or descriptor may still be on its way, and
        // a freed communicator's context id is reused by the next one, where OpenMPI would
        // deliver (or crash on) that stale message. A process makes a handful of groups.
    }
}
