//! Shared-memory communicator: ranks on one host exchange data through one mapped segment.
//!
//! Every collective stages a rank's contribution in its own slot, meets the others at a barrier,
//! and reads what it needs straight from their slots. Slots are double-buffered by operation
//! parity, so a rank can start the next operation while a slow peer still reads the previous
//! one, yet never two ahead (the next barrier waits for that peer). Large messages run in
//! pieces of one slot. Each operation first posts a descriptor (sequence, op, dtype, bytes,
//! root...) that every rank checks after the first barrier, so ranks that disagree all fail
//! with the same clear error instead of hanging or corrupting data.
//!
//! Waiting spins briefly, then yields, then sleeps on a futex: four ranks on two cores stay
//! fast because a waiting rank gives its core to the rank it waits for. A waiting rank also
//! watches its peers: a failure flag set by a peer, a peer process that is gone, the deadline
//! and the abort handle each end the wait with an error that names the peer.
//!
//! The same code serves the `local` backend: the segment is then anonymous memory shared by
//! threads of one process.

mod futex;
mod segment;

pub(crate) use segment::Segment;
pub use segment::ShmOptions;

use crate::call::{self, GroupCore, Transport};
use crate::comm::{check, DEFAULT_TIMEOUT};
use crate::common::{blame_word, blamed, fnv, part, pieces, Descriptor};
use crate::dtype::{reduce, ElemType, ReduceOp};
use crate::error::{Error, Op, Result, Site};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Messages of at most this many bytes per rank (times the group size) are reduced by every
/// rank from all slots after one barrier; larger ones are reduce-scattered, then gathered.
const SMALL_REDUCE_BYTES: usize = 128 << 10;
/// How often a long wait checks that the peers it waits for still exist.
const LIVENESS_EVERY: Duration = Duration::from_millis(20);
/// Longest single futex sleep, so deadlines and liveness are checked regularly.
const MAX_SLEEP: Duration = Duration::from_millis(10);

/// How long a waiter spins and yields before it sleeps.
#[derive(Debug, Clone, Copy)]
struct Patience {
    spin: Duration,
    yield_until: Duration,
}

impl Patience {
    fn for_group(size: usize) -> Patience {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        if size <= cores {
            Patience { spin: Duration::from_micros(50), yield_until: Duration::from_micros(200) }
        } else {
            // Oversubscribed: the rank we wait for may need this very core.
            Patience { spin: Duration::from_micros(2), yield_until: Duration::from_millis(2) }
        }
    }
}

/// A shared-memory communicator (`shm` across processes, `local` across threads).
pub struct ShmComm {
    core: GroupCore,
    seg: Arc<Segment>,
    backend: &'static str,
    /// Operations (pieces) issued; selects the slot parity.
    seq: u64,
    /// Barriers entered.
    epoch: u64,
    patience: Patience,
    /// Peer process ids, known once every rank joined.
    pids: Vec<u32>,
}

impl std::fmt::Debug for ShmComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmComm")
            .field("group", &self.core.group)
            .field("rank", &self.core.rank)
            .field("size", &self.core.size)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

/// Outcome of one look at the shared state during a wait.
enum Poll {
    Ready,
    /// Bit mask of the group ranks still awaited.
    Pending(u64),
}

fn mask_ranks(mask: u64) -> Vec<usize> {
    (0..64).filter(|r| mask & (1 << r) != 0).collect()
}

/// Whether process `pid` still runs (a zombie counts as gone: it will never arrive).
fn alive(pid: u32) -> bool {
    if pid == 0 || pid == std::process::id() {
        return true;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state =
                stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
            !matches!(state, Some('Z' | 'X' | 'x'))
        }
        Err(_) => false,
    }
}

impl ShmComm {
    /// Creates the group's segment at `path` (normally under `/dev/shm`) and joins it as `rank`.
    /// Call [`ShmComm::wait_for_peers`] once every rank has opened it.
    ///
    /// # Errors
    /// The file exists already or cannot be created and mapped.
    pub fn create(
        path: &Path,
        rank: usize,
        size: usize,
        group: &str,
        opts: ShmOptions,
    ) -> Result<ShmComm> {
        let seg = Segment::create(path, size, opts)
            .map_err(|e| Error::io(format!("creating shm segment {}", path.display()), e))?;
        Self::attach(Arc::new(seg), rank, group, "shm")
    }

    /// Opens the segment another rank created at `path` and joins it as `rank`.
    ///
    /// # Errors
    /// The file is missing or is not a segment of this version.
    pub fn open(path: &Path, rank: usize, group: &str) -> Result<ShmComm> {
        let seg = Segment::open(path)
            .map_err(|e| Error::io(format!("opening shm segment {}", path.display()), e))?;
        let size = seg.size();
        Self::attach(Arc::new(seg), rank, group, "shm").and_then(|c| {
            if rank < size {
                Ok(c)
            } else {
                Err(Error::InvalidArgument {
                    at: check::site(Op::Setup, &c.core.group, rank, size),
                    reason: format!("rank {rank} is not in a segment made for {size} ranks"),
                })
            }
        })
    }

    /// Joins `seg` as `rank` (records this process id) without waiting for the others.
    pub(crate) fn attach(
        seg: Arc<Segment>,
        rank: usize,
        group: &str,
        backend: &'static str,
    ) -> Result<ShmComm> {
        let size = seg.size();
        let group: Arc<str> = group.into();
        if rank >= size {
            return Err(check::invalid(
                &check::site(Op::Setup, &group, rank, size),
                format!("rank {rank} is not in a group of {size} ranks"),
            ));
        }
        seg.rank(rank).pid.store(std::process::id(), Ordering::Release);
        ring(&seg);
        let core = GroupCore::new(group, rank, size, DEFAULT_TIMEOUT);
        let waker = seg.clone();
        core.abort.on_abort(move || ring_always(&waker));
        Ok(ShmComm {
            core,
            patience: Patience::for_group(size),
            seg,
            backend,
            seq: 0,
            epoch: 0,
            pids: vec![0; size],
        })
    }

    /// Waits until every rank has joined the segment; afterwards the segment's file may be
    /// unlinked, and dead peers can be recognised by their process ids.
    ///
    /// # Errors
    /// Timeout naming the ranks that never joined, or abort.
    pub fn wait_for_peers(&mut self) -> Result<()> {
        let at = self.core.site(Op::Setup);
        let deadline = Instant::now() + self.core.timeout;
        let size = self.core.size;
        let result = self.wait(&at, deadline, |seg| {
            let pending = (0..size)
                .filter(|&r| seg.rank(r).pid.load(Ordering::Acquire) == 0)
                .fold(0u64, |m, r| m | 1 << r);
            if pending == 0 {
                Poll::Ready
            } else {
                Poll::Pending(pending)
            }
        });
        call::finish(self, result)?;
        self.pids = (0..size).map(|r| self.seg.rank(r).pid.load(Ordering::Acquire)).collect();
        Ok(())
    }

    /// Sets the process ids of all ranks (threads of this process).
    pub(crate) fn assume_joined(&mut self) {
        self.pids = vec![std::process::id(); self.core.size];
    }

    fn failpoint(at: &Site, point: &str) -> Result<()> {
        mesh::failpoint::hit(point).map_err(|source| Error::Injected { at: at.clone(), source })
    }

    /// Waits until `poll` is ready, watching peers, the deadline and the abort handle.
    fn wait(
        &self,
        at: &Site,
        deadline: Instant,
        mut poll: impl FnMut(&Segment) -> Poll,
    ) -> Result<()> {
        Self::failpoint(at, "shm.wait")?;
        let seg = &*self.seg;
        let (bell, sleepers) = seg.bell();
        let start = Instant::now();
        let mut last_liveness = start;
        let mut iter = 0u32;
        loop {
            let seen = bell.load(Ordering::SeqCst);
            let pending = match poll(seg) {
                Poll::Ready => return Ok(()),
                Poll::Pending(p) => p,
            };
            self.check_peers(at, start)?;
            iter = iter.wrapping_add(1);
            // Reading the clock costs ~20 ns; spinning checks it every 64 rounds.
            if !iter.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let waited = now - start;
            if waited < self.patience.spin {
                continue;
            }
            if now >= deadline {
                return Err(Error::Timeout {
                    at: at.clone(),
                    elapsed: waited,
                    waiting_for: mask_ranks(pending),
                });
            }
            if now - last_liveness >= LIVENESS_EVERY {
                last_liveness = now;
                for r in mask_ranks(pending) {
                    if !alive(self.pids[r]) {
                        return Err(Error::PeerDied {
                            at: at.clone(),
                            peer: r,
                            pid: self.pids[r],
                            elapsed: waited,
                        });
                    }
                }
            }
            if waited < self.patience.yield_until {
                std::thread::yield_now();
                continue;
            }
            sleepers.fetch_add(1, Ordering::SeqCst);
            if bell.load(Ordering::SeqCst) == seen {
                futex::wait(bell, seen, MAX_SLEEP.min(deadline - now));
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Fails when a peer reported a failure or this call was aborted.
    fn check_peers(&self, at: &Site, start: Instant) -> Result<()> {
        for r in (0..self.core.size).filter(|&r| r != self.core.rank) {
            let word = self.seg.rank(r).failed.load(Ordering::Acquire);
            let pid_of = |o: usize| self.pids.get(o).copied().unwrap_or(0);
            if let Some(e) = blamed(word, at, r, pid_of, start.elapsed()) {
                return Err(e);
            }
        }
        if self.core.abort.is_aborted() {
            return Err(Error::Aborted { at: at.clone() });
        }
        Ok(())
    }

    /// Posts this rank's descriptor for the next operation piece; returns the slot parity.
    fn post(
        &mut self,
        op: Op,
        dtype: ElemType,
        rop: Option<ReduceOp>,
        len: usize,
        aux: u64,
    ) -> usize {
        self.seq += 1;
        let parity = (self.seq & 1) as usize;
        let desc = &self.seg.rank(self.core.rank).desc[parity];
        let kind = u64::from(op.code()) << 32
            | u64::from(dtype.code()) << 16
            | u64::from(rop.map_or(0, ReduceOp::code));
        desc.seq.store(self.seq, Ordering::Relaxed);
        desc.kind.store(kind, Ordering::Relaxed);
        desc.len.store(len as u64, Ordering::Relaxed);
        desc.aux.store(aux, Ordering::Relaxed);
        parity
    }

    /// Compares every peer's descriptor with this rank's (after a barrier made them visible).
    fn check_descs(&self, at: &Site, parity: usize, aux_name: &'static str) -> Result<()> {
        let read = |r: usize| {
            let d = &self.seg.rank(r).desc[parity];
            let kind = d.kind.load(Ordering::Relaxed);
            Descriptor {
                op: (kind >> 32) as u32,
                dtype: (kind >> 16) as u32 & 0xffff,
                rop: kind as u32 & 0xffff,
                seq: d.seq.load(Ordering::Relaxed),
                total: d.len.load(Ordering::Relaxed),
                aux: d.aux.load(Ordering::Relaxed),
            }
        };
        let mine = read(self.core.rank);
        (0..self.core.size)
            .filter(|&r| r != self.core.rank)
            .try_for_each(|r| mine.agree(&read(r), at, r, aux_name))
    }

    /// Arrives at the next barrier and waits for every rank.
    fn barrier_wait(&mut self, at: &Site, deadline: Instant) -> Result<()> {
        self.epoch += 1;
        let epoch = self.epoch;
        self.seg.rank(self.core.rank).epoch.store(epoch, Ordering::Release);
        ring(&self.seg);
        let size = self.core.size;
        self.wait(at, deadline, |seg| {
            let pending = (0..size)
                .filter(|&r| seg.rank(r).epoch.load(Ordering::Acquire) < epoch)
                .fold(0u64, |m, r| m | 1 << r);
            if pending == 0 {
                Poll::Ready
            } else {
                Poll::Pending(pending)
            }
        })
    }

    /// Copies `src` into this rank's slot `parity` at `off`.
    fn stage(&self, parity: usize, off: usize, src: &[u8]) {
        assert!(off + src.len() <= self.seg.slot_bytes());
        // SAFETY: in bounds by the assert; only this rank writes its slot, and peers read it
        // only after the next barrier (double buffering keeps them off the other parity).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.seg.slot(self.core.rank, parity).add(off),
                src.len(),
            );
        }
    }

    /// Rank `r`'s slot `parity`, bytes `off..off + len`.
    fn peek(&self, r: usize, parity: usize, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.seg.slot_bytes());
        // SAFETY: in bounds by the assert; rank `r` wrote these bytes before the barrier this
        // rank passed and will not write this parity again before the next barrier, which
        // this rank has not entered while the slice lives.
        unsafe { std::slice::from_raw_parts(self.seg.slot(r, parity).add(off), len) }
    }

    /// This rank's own slot `parity`, bytes `off..off + len`, for writing a region no peer
    /// reads before the next barrier.
    #[allow(clippy::mut_from_ref)]
    fn own_slot_mut(&self, parity: usize, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.seg.slot_bytes());
        // SAFETY: in bounds by the assert; only this rank writes its slot, the caller writes a
        // region that peers read only after the next barrier, and no other slice of this
        // region exists while the returned one lives (the callers' other slices are of the
        // user buffer and of peers' slots).
        unsafe {
            std::slice::from_raw_parts_mut(self.seg.slot(self.core.rank, parity).add(off), len)
        }
    }

    /// Bytes per piece for element type `dtype` when `ways` sub-pieces share one slot.
    fn piece_cap(&self, dtype: ElemType, ways: usize) -> usize {
        let per = self.seg.slot_bytes() / ways;
        // Keep sub-pieces 64-byte aligned for the copy and reduce loops.
        let align = 64usize.max(dtype.size());
        (per / align * align).max(dtype.size())
    }

    /// Shared body of reduce_scatter (`op` set) and all_to_all (`op` none): every rank stages
    /// sub-piece `j` of its chunk `j` for all `j`, then takes sub-piece `rank` of every slot.
    #[allow(clippy::too_many_arguments)]
    fn exchange_chunks(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
        op: Option<ReduceOp>,
    ) -> Result<()> {
        let chunk = match op {
            Some(_) => recv.len(),
            None => recv.len() / self.core.size.max(1),
        };
        let cap = self.piece_cap(dtype, self.core.size);
        let what = if op.is_some() { Op::ReduceScatter } else { Op::AllToAll };
        for (off, len) in pieces(chunk, cap) {
            let p = self.post(what, dtype, op, send.len(), 0);
            Self::failpoint(at, "shm.send")?;
            for j in 0..self.core.size {
                self.stage(p, j * len, &send[j * chunk + off..j * chunk + off + len]);
            }
            self.barrier_wait(at, deadline)?;
            self.check_descs(at, p, "")?;
            Self::failpoint(at, "shm.recv")?;
            let me = self.core.rank;
            match op {
                Some(op) => {
                    let srcs: Vec<&[u8]> =
                        (0..self.core.size).map(|r| self.peek(r, p, me * len, len)).collect();
                    reduce(dtype, op, &mut recv[off..off + len], &srcs);
                }
                None => {
                    for s in 0..self.core.size {
                        recv[s * chunk + off..s * chunk + off + len].copy_from_slice(self.peek(
                            s,
                            p,
                            me * len,
                            len,
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes `data` into the ring to `peer`, waiting for space.
    fn stream_write(&self, at: &Site, deadline: Instant, peer: usize, data: &[u8]) -> Result<()> {
        let pair = self.seg.pair(self.core.rank, peer);
        let ring_buf = self.seg.ring(self.core.rank, peer);
        let cap = self.seg.ring_bytes() as u64;
        let mut done = 0;
        while done < data.len() {
            let written = pair.written.load(Ordering::Relaxed);
            self.wait(at, deadline, |_| {
                if written - pair.read.load(Ordering::Acquire) < cap {
                    Poll::Ready
                } else {
                    Poll::Pending(1 << peer)
                }
            })?;
            let free = cap - (written - pair.read.load(Ordering::Acquire));
            let pos = (written % cap) as usize;
            let n = (free as usize).min(data.len() - done).min(cap as usize - pos);
            // SAFETY: `pos + n <= cap`, inside this pair's ring; the reader does not touch
            // bytes between its read counter and our written counter plus free space.
            unsafe {
                std::ptr::copy_nonoverlapping(data[done..].as_ptr(), ring_buf.add(pos), n);
            }
            pair.written.store(written + n as u64, Ordering::Release);
            ring(&self.seg);
            done += n;
        }
        Ok(())
    }

    /// Reads `data.len()` bytes from the ring from `peer`.
    fn stream_read(
        &self,
        at: &Site,
        deadline: Instant,
        peer: usize,
        data: &mut [u8],
    ) -> Result<()> {
        let pair = self.seg.pair(peer, self.core.rank);
        let ring_buf = self.seg.ring(peer, self.core.rank);
        let cap = self.seg.ring_bytes() as u64;
        let mut done = 0;
        while done < data.len() {
            let read = pair.read.load(Ordering::Relaxed);
            self.wait(at, deadline, |_| {
                if pair.written.load(Ordering::Acquire) > read {
                    Poll::Ready
                } else {
                    Poll::Pending(1 << peer)
                }
            })?;
            let avail = pair.written.load(Ordering::Acquire) - read;
            let pos = (read % cap) as usize;
            let n = (avail as usize).min(data.len() - done).min(cap as usize - pos);
            // SAFETY: `pos + n <= cap`, inside this pair's ring; the writer published these
            // bytes with its release store of `written` and will not overwrite them until our
            // `read` store below.
            unsafe {
                std::ptr::copy_nonoverlapping(ring_buf.add(pos), data[done..].as_mut_ptr(), n);
            }
            pair.read.store(read + n as u64, Ordering::Release);
            ring(&self.seg);
            done += n;
        }
        Ok(())
    }
}

/// A point-to-point message header: payload bytes and dtype.
fn p2p_header(len: usize, dtype: ElemType) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&(len as u64).to_le_bytes());
    h[8..12].copy_from_slice(&dtype.code().to_le_bytes());
    h
}

/// Announces a change of shared state; wakes sleepers only when there are some.
fn ring(seg: &Segment) {
    let (bell, sleepers) = seg.bell();
    bell.fetch_add(1, Ordering::SeqCst);
    if sleepers.load(Ordering::SeqCst) > 0 {
        futex::wake_all(bell);
    }
}

fn ring_always(seg: &Segment) {
    let (bell, _) = seg.bell();
    bell.fetch_add(1, Ordering::SeqCst);
    futex::wake_all(bell);
}

impl Transport for ShmComm {
    fn core(&self) -> &GroupCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        &mut self.core
    }
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// Sets this rank's failure word (the first one stays) and wakes every waiter.
    fn publish_failure(&mut self, error: &Error, _first: bool) {
        let word = blame_word(error, self.core.rank);
        let ctrl = self.seg.rank(self.core.rank);
        let _ = ctrl.failed.compare_exchange(0, word, Ordering::AcqRel, Ordering::Acquire);
        ring_always(&self.seg);
    }

    fn all_reduce(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let total = buf.len();
        let cap = self.piece_cap(dtype, 1);
        let size = self.core.size;
        for (off, len) in pieces(total, cap) {
            let piece = &mut buf[off..off + len];
            let p = self.post(Op::AllReduce, dtype, Some(op), total, 0);
            let small = len * size <= SMALL_REDUCE_BYTES;
            let elems = len / dtype.size();
            let chunk = |r: usize| {
                let e = part(elems, size, r);
                e.start * dtype.size()..e.end * dtype.size()
            };
            let mine = chunk(self.core.rank);
            Self::failpoint(at, "shm.send")?;
            if small {
                self.stage(p, 0, piece);
            } else {
                // Peers read every chunk of this slot but this rank's own: leave that one out.
                self.stage(p, 0, &piece[..mine.start]);
                self.stage(p, mine.end, &piece[mine.end..]);
            }
            self.barrier_wait(at, deadline)?;
            self.check_descs(at, p, "")?;
            Self::failpoint(at, "shm.recv")?;
            if small {
                let srcs: Vec<&[u8]> = (0..size).map(|r| self.peek(r, p, 0, len)).collect();
                reduce(dtype, op, piece, &srcs);
                continue;
            }
            // Reduce-scatter: this rank reduces its chunk (its own data from the buffer, the
            // peers' from their slots) into its slot, where the peers gather it from.
            {
                let srcs: Vec<&[u8]> = (0..size)
                    .map(|r| {
                        if r == self.core.rank {
                            &piece[mine.clone()]
                        } else {
                            self.peek(r, p, mine.start, mine.len())
                        }
                    })
                    .collect();
                let out = self.own_slot_mut(p, mine.start, mine.len());
                reduce(dtype, op, out, &srcs);
            }
            piece[mine.clone()].copy_from_slice(self.peek(
                self.core.rank,
                p,
                mine.start,
                mine.len(),
            ));
            self.barrier_wait(at, deadline)?;
            for r in (0..size).filter(|&r| r != self.core.rank) {
                let c = chunk(r);
                piece[c.clone()].copy_from_slice(self.peek(r, p, c.start, c.len()));
            }
        }
        Ok(())
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
        let total: usize = sizes.iter().sum();
        let most = sizes.iter().copied().max().unwrap_or(0);
        let starts: Vec<usize> =
            sizes.iter().scan(0, |acc, &s| Some(std::mem::replace(acc, *acc + s))).collect();
        let sizes_tag = fnv(sizes);
        let cap = self.piece_cap(dtype, 1);
        for (off, _) in pieces(most, cap) {
            let span = |r: usize| {
                let lo = off.min(sizes[r]);
                lo..(off + cap).min(sizes[r])
            };
            let p = self.post(Op::AllGatherUneven, dtype, None, total, sizes_tag);
            Self::failpoint(at, "shm.send")?;
            self.stage(p, 0, &send[span(self.core.rank)]);
            self.barrier_wait(at, deadline)?;
            self.check_descs(at, p, "sizes")?;
            Self::failpoint(at, "shm.recv")?;
            for r in 0..self.core.size {
                let s = span(r);
                let dst = &mut recv[starts[r] + s.start..starts[r] + s.end];
                if r == self.core.rank {
                    dst.copy_from_slice(&send[s]);
                } else {
                    dst.copy_from_slice(self.peek(r, p, 0, s.len()));
                }
            }
        }
        Ok(())
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
        self.exchange_chunks(at, deadline, send, recv, dtype, Some(op))
    }

    fn broadcast(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        root: usize,
    ) -> Result<()> {
        let total = buf.len();
        for (off, len) in pieces(total, self.piece_cap(dtype, 1)) {
            let p = self.post(Op::Broadcast, dtype, None, total, root as u64);
            if self.core.rank == root {
                Self::failpoint(at, "shm.send")?;
                self.stage(p, 0, &buf[off..off + len]);
            }
            self.barrier_wait(at, deadline)?;
            self.check_descs(at, p, "root")?;
            if self.core.rank != root {
                Self::failpoint(at, "shm.recv")?;
                buf[off..off + len].copy_from_slice(self.peek(root, p, 0, len));
            }
        }
        Ok(())
    }

    fn send(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &[u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        Self::failpoint(at, "shm.send")?;
        self.stream_write(at, deadline, peer, &p2p_header(buf.len(), dtype))?;
        self.stream_write(at, deadline, peer, buf)
    }

    fn recv(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        Self::failpoint(at, "shm.recv")?;
        let mut header = [0u8; 16];
        self.stream_read(at, deadline, peer, &mut header)?;
        if header != p2p_header(buf.len(), dtype) {
            let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
            let code = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
            let theirs = ElemType::from_code(code).map_or("unknown".into(), |d| d.to_string());
            return Err(Error::Mismatch {
                at: at.clone(),
                peer,
                what: "message",
                mine: format!("{} bytes of {dtype}", buf.len()),
                theirs: format!("{len} bytes of {theirs}"),
            });
        }
        self.stream_read(at, deadline, peer, buf)
    }

    fn all_to_all(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
    ) -> Result<()> {
        self.exchange_chunks(at, deadline, send, recv, dtype, None)
    }

    fn barrier(&mut self, at: &Site, deadline: Instant) -> Result<()> {
        let p = self.post(Op::Barrier, ElemType::U8, None, 0, 0);
        self.barrier_wait(at, deadline)?;
        self.check_descs(at, p, "")
    }
}
