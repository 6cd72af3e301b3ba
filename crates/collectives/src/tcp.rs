//! TCP communicator: ranks on any hosts, one connection per pair of ranks.
//!
//! Large reductions and gathers run as rings (reduce-scatter, then all-gather: each link
//! carries `2 (n - 1) / n` of the message, the bandwidth optimum); small ones send every
//! rank's buffer to every other rank and reduce locally, one round trip instead of `2 (n - 1)`.
//! Every message carries a header with the operation, dtype, sequence number and sizes, which
//! the receiver checks, so ranks that disagree fail with a clear error. All sockets are
//! non-blocking and driven by `poll`, so a rank sends and receives at once (no deadlock when
//! both sides' buffers are full) and every wait observes the deadline and the abort handle.
//! A failing rank tells its peers with an abort frame, then shuts its connections down.

use crate::call::{GroupCore, Transport};
use crate::comm::{check, DEFAULT_TIMEOUT};
use crate::common::{blame_word, blamed, fnv, fnv_bytes, part, Descriptor};
use crate::dtype::{accumulate, reduce, ElemType, ReduceOp};
use crate::error::{Error, Op, Result, Site};
use mesh::Store;
use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Messages up to this many bytes in total (all ranks' buffers) go directly to every peer.
const DIRECT_BYTES: usize = 64 << 10;
/// Longest single `poll`, so the abort handle is noticed promptly.
const MAX_POLL: Duration = Duration::from_millis(10);
const MAGIC_MSG: u32 = u32::from_le_bytes(*b"tpcM");
const MAGIC_ABORT: u32 = u32::from_le_bytes(*b"tpcA");
const MAGIC_HELLO: u32 = u32::from_le_bytes(*b"tpcH");
const HDR: usize = 48;

/// What a message claims to be; the receiver compares it with what it expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    magic: u32,
    op: u32,
    dtype: u16,
    rop: u16,
    blame: u32,
    seq: u64,
    total: u64,
    aux: u64,
    len: u64,
}

impl Header {
    fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..8].copy_from_slice(&self.op.to_le_bytes());
        b[8..10].copy_from_slice(&self.dtype.to_le_bytes());
        b[10..12].copy_from_slice(&self.rop.to_le_bytes());
        b[12..16].copy_from_slice(&self.blame.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.total.to_le_bytes());
        b[32..40].copy_from_slice(&self.aux.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The fields every rank of the call must agree on.
    fn descriptor(&self) -> Descriptor {
        Descriptor {
            op: self.op,
            dtype: u32::from(self.dtype),
            rop: u32::from(self.rop),
            seq: self.seq,
            total: self.total,
            aux: self.aux,
        }
    }

    fn decode(b: &[u8; HDR]) -> Header {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u16_at = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().expect("2 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Header {
            magic: u32_at(0),
            op: u32_at(4),
            dtype: u16_at(8),
            rop: u16_at(10),
            blame: u32_at(12),
            seq: u64_at(16),
            total: u64_at(24),
            aux: u64_at(32),
            len: u64_at(40),
        }
    }
}

/// The parts of a header fixed for the whole call.
#[derive(Clone, Copy)]
struct Call {
    op: Op,
    dtype: ElemType,
    rop: Option<ReduceOp>,
    seq: u64,
    total: usize,
    aux: u64,
    aux_name: &'static str,
}

impl Call {
    /// A send and its matching receive: both say `send`, with no group-wide sequence number
    /// (point-to-point calls are not collective).
    fn point_to_point(dtype: ElemType, total: usize) -> Call {
        Call { op: Op::Send, dtype, rop: None, seq: 0, total, aux: 0, aux_name: "" }
    }

    fn header(&self, len: usize) -> Header {
        Header {
            magic: MAGIC_MSG,
            op: self.op.code(),
            dtype: self.dtype.code() as u16,
            rop: self.rop.map_or(0, ReduceOp::code) as u16,
            blame: 0,
            seq: self.seq,
            total: self.total as u64,
            aux: self.aux,
            len: len as u64,
        }
    }
}

/// One outgoing message of an exchange.
struct Out<'a> {
    peer: usize,
    head: [u8; HDR],
    data: &'a [u8],
    done: usize,
}

/// One incoming message of an exchange.
struct In<'a> {
    peer: usize,
    want: Header,
    head: [u8; HDR],
    data: &'a mut [u8],
    done: usize,
}

impl Out<'_> {
    fn finished(&self) -> bool {
        self.done == HDR + self.data.len()
    }
}

impl In<'_> {
    fn finished(&self) -> bool {
        self.done == HDR + self.data.len()
    }
}

/// A TCP communicator.
pub struct TcpComm {
    core: GroupCore,
    peers: Vec<Option<TcpStream>>,
    /// Peers we are in the middle of writing a message to (an abort frame would corrupt it).
    mid_write: Vec<bool>,
    /// Collective calls so far, carried in every header.
    seq: u64,
}

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpComm")
            .field("group", &self.core.group)
            .field("rank", &self.core.rank)
            .field("size", &self.core.size)
            .finish_non_exhaustive()
    }
}

fn is_would_block(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted)
}

impl TcpComm {
    /// Connects rank `rank` of a group of `size` to its peers, exchanging addresses through
    /// `store` under `key_prefix` (unique per group and generation). Listens on `host`.
    ///
    /// # Errors
    /// The store fails, a peer does not show up before `timeout`, or a socket call fails.
    pub fn connect(
        store: &Store,
        key_prefix: &str,
        group: &str,
        rank: usize,
        size: usize,
        host: IpAddr,
        timeout: Duration,
    ) -> Result<TcpComm> {
        let group: Arc<str> = group.into();
        let at = check::site(Op::Setup, &group, rank, size);
        check::rank(&at, "rank", rank)?;
        let deadline = Instant::now() + timeout;
        let listener = TcpListener::bind((host, 0))
            .map_err(|e| Error::io(format!("{at}: binding a listener on {host}"), e))?;
        let addr =
            listener.local_addr().map_err(|e| Error::io(format!("{at}: listener address"), e))?;
        store.set(&format!("{key_prefix}/{rank}"), addr.to_string().as_bytes())?;
        let tag = fnv(&[size]) ^ fnv_bytes(key_prefix.as_bytes());
        let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();

        // Lower ranks listen, higher ranks connect: every pair gets exactly one connection.
        for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
            let key = format!("{key_prefix}/{peer}");
            let value = store.wait(&[&key], remaining(deadline))?.remove(0);
            let text = String::from_utf8_lossy(&value).into_owned();
            let peer_addr: SocketAddr = text.parse().map_err(|_| {
                check::invalid(&at, format!("store key {key} holds `{text}`, not an address"))
            })?;
            let mut stream = connect_until(peer_addr, deadline).map_err(|e| {
                Error::io(format!("{at}: connecting to rank {peer} at {peer_addr}"), e)
            })?;
            let mut hello = [0u8; 16];
            hello[0..4].copy_from_slice(&MAGIC_HELLO.to_le_bytes());
            hello[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
            hello[8..16].copy_from_slice(&tag.to_le_bytes());
            stream
                .write_all(&hello)
                .map_err(|e| Error::io(format!("{at}: greeting rank {peer}"), e))?;
            *slot = Some(stream);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(format!("{at}: listener set-up"), e))?;
        let mut missing: Vec<usize> = (rank + 1..size).collect();
        while !missing.is_empty() {
            match listener.accept() {
                Ok((mut stream, from)) => {
                    stream.set_nonblocking(false).ok();
                    stream
                        .set_read_timeout(Some(remaining(deadline).max(Duration::from_millis(1))))
                        .ok();
                    let mut hello = [0u8; 16];
                    if stream.read_exact(&mut hello).is_err() {
                        tracing::warn!(%from, "{at}: dropped a connection that sent no greeting");
                        continue;
                    }
                    let magic = u32::from_le_bytes(hello[0..4].try_into().expect("4 bytes"));
                    let peer =
                        u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes")) as usize;
                    let their_tag = u64::from_le_bytes(hello[8..16].try_into().expect("8 bytes"));
                    if magic != MAGIC_HELLO || their_tag != tag || !missing.contains(&peer) {
                        tracing::warn!(%from, peer, "{at}: dropped a connection from another group");
                        continue;
                    }
                    missing.retain(|&m| m != peer);
                    peers[peer] = Some(stream);
                }
                Err(e) if is_would_block(&e) => {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout { at, elapsed: timeout, waiting_for: missing });
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(Error::io(format!("{at}: accepting peers"), e)),
            }
        }
        for stream in peers.iter().flatten() {
            stream.set_nodelay(true).map_err(|e| Error::io(format!("{at}: TCP_NODELAY"), e))?;
            stream
                .set_nonblocking(true)
                .map_err(|e| Error::io(format!("{at}: non-blocking"), e))?;
        }
        Ok(TcpComm {
            core: GroupCore::new(group, rank, size, DEFAULT_TIMEOUT),
            peers,
            mid_write: vec![false; size],
            seq: 0,
        })
    }

    fn failpoint(at: &Site, point: &str) -> Result<()> {
        mesh::failpoint::hit(point).map_err(|source| Error::Injected { at: at.clone(), source })
    }

    fn stream(&self, at: &Site, peer: usize) -> Result<&TcpStream> {
        self.peers[peer]
            .as_ref()
            .ok_or_else(|| check::invalid(at, format!("no connection to rank {peer}")))
    }

    /// Moves every message of one step at once, until all are complete.
    fn exchange(
        &mut self,
        at: &Site,
        deadline: Instant,
        call: &Call,
        outs: &mut [Out<'_>],
        ins: &mut [In<'_>],
    ) -> Result<()> {
        if !outs.is_empty() {
            Self::failpoint(at, "tcp.send")?;
        }
        if !ins.is_empty() {
            Self::failpoint(at, "tcp.recv")?;
        }
        let start = Instant::now();
        loop {
            let mut interest: Vec<(usize, i16)> = Vec::new();
            let closed =
                |peer| Error::PeerClosed { at: at.clone(), peer, elapsed: start.elapsed() };
            for o in outs.iter_mut().filter(|o| !o.finished()) {
                let mut stream = stream_of(&self.peers, at, o.peer)?;
                self.mid_write[o.peer] = true;
                loop {
                    let head = &o.head[o.done.min(HDR)..];
                    let body = &o.data[o.done.saturating_sub(HDR)..];
                    match stream.write_vectored(&[IoSlice::new(head), IoSlice::new(body)]) {
                        Ok(n) if n > 0 => {
                            o.done += n;
                            if o.finished() {
                                self.mid_write[o.peer] = false;
                                break;
                            }
                        }
                        Err(e) if is_would_block(&e) => {
                            interest.push((o.peer, libc::POLLOUT));
                            break;
                        }
                        // End of stream or a reset: the peer is gone or gave up.
                        _ => return Err(closed(o.peer)),
                    }
                }
            }
            for i in ins.iter_mut().filter(|i| !i.finished()) {
                let mut stream = self.stream(at, i.peer)?;
                loop {
                    let r = if i.done < HDR {
                        stream.read(&mut i.head[i.done..])
                    } else {
                        stream.read(&mut i.data[i.done - HDR..])
                    };
                    match r {
                        Ok(n) if n > 0 => {
                            let before = i.done;
                            i.done += n;
                            if before < HDR && i.done >= HDR {
                                self.check_header(at, call, i)?;
                            }
                            if i.finished() {
                                break;
                            }
                        }
                        Err(e) if is_would_block(&e) => {
                            interest.push((i.peer, libc::POLLIN));
                            break;
                        }
                        // End of stream or a reset: the peer is gone or gave up.
                        _ => return Err(closed(i.peer)),
                    }
                }
            }
            if interest.is_empty() {
                return Ok(());
            }
            if self.core.abort.is_aborted() {
                return Err(Error::Aborted { at: at.clone() });
            }
            let now = Instant::now();
            if now >= deadline {
                let mut waiting_for: Vec<usize> = interest.iter().map(|&(p, _)| p).collect();
                waiting_for.sort_unstable();
                waiting_for.dedup();
                return Err(Error::Timeout { at: at.clone(), elapsed: now - start, waiting_for });
            }
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(interest.len());
            for (peer, events) in interest {
                let fd = self.stream(at, peer)?.as_raw_fd();
                match fds.iter_mut().find(|p| p.fd == fd) {
                    Some(p) => p.events |= events,
                    None => fds.push(libc::pollfd { fd, events, revents: 0 }),
                }
            }
            let wait = MAX_POLL.min(deadline - now);
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for the call.
            let rc = unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    wait.as_millis().max(1) as i32,
                )
            };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if !is_would_block(&e) {
                    return Err(Error::io(format!("{at}: poll"), e));
                }
            }
        }
    }

    /// Checks a received header against what this rank expects.
    fn check_header(&self, at: &Site, call: &Call, i: &In<'_>) -> Result<()> {
        let got = Header::decode(&i.head);
        let want = i.want;
        let peer = i.peer;
        if got.magic == MAGIC_ABORT {
            return Err(blamed(got.blame, at, peer, |_| 0, Duration::ZERO)
                .unwrap_or(Error::PeerFailed { at: at.clone(), peer }));
        }
        let mismatch = |what, mine: String, theirs: String| {
            Err(Error::Mismatch { at: at.clone(), peer, what, mine, theirs })
        };
        if got.magic != MAGIC_MSG {
            return mismatch(
                "protocol",
                "a message header".into(),
                format!("bytes {:02x?}", &i.head[..8]),
            );
        }
        want.descriptor().agree(&got.descriptor(), at, peer, call.aux_name)?;
        if got.len != want.len {
            return mismatch("message bytes", want.len.to_string(), got.len.to_string());
        }
        Ok(())
    }

    fn next(&self) -> usize {
        (self.core.rank + 1) % self.core.size
    }

    fn prev(&self) -> usize {
        (self.core.rank + self.core.size - 1) % self.core.size
    }

    /// Sends `data` to every peer and receives every peer's `sizes[r]` bytes into `recv` at
    /// `starts[r]` (this rank's own part is left alone).
    fn direct_gather(
        &mut self,
        at: &Site,
        deadline: Instant,
        call: &Call,
        data: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
    ) -> Result<()> {
        let me = self.core.rank;
        let mut outs: Vec<Out<'_>> = (0..self.core.size)
            .filter(|&p| p != me)
            .map(|peer| Out { peer, head: call.header(data.len()).encode(), data, done: 0 })
            .collect();
        let mut ins: Vec<In<'_>> = Vec::with_capacity(self.core.size);
        let mut rest = recv;
        for (peer, &len) in sizes.iter().enumerate() {
            let (mine, tail) = rest.split_at_mut(len);
            rest = tail;
            if peer != me {
                ins.push(In { peer, want: call.header(len), head: [0; HDR], data: mine, done: 0 });
            }
        }
        self.exchange(at, deadline, call, &mut outs, &mut ins)
    }

    /// One ring step: send `send` to the next rank while receiving into `recv` from the
    /// previous one.
    fn ring_step(
        &mut self,
        at: &Site,
        deadline: Instant,
        call: &Call,
        send: &[u8],
        recv: &mut [u8],
    ) -> Result<()> {
        let (next, prev) = (self.next(), self.prev());
        let mut outs =
            [Out { peer: next, head: call.header(send.len()).encode(), data: send, done: 0 }];
        let want = call.header(recv.len());
        let mut ins = [In { peer: prev, want, head: [0; HDR], data: recv, done: 0 }];
        self.exchange(at, deadline, call, &mut outs, &mut ins)
    }

    /// Ring reduce-scatter over `buf` split into `chunks`; afterwards this rank holds the full
    /// reduction of chunk `(rank + shift) mod size`.
    fn ring_reduce_scatter(
        &mut self,
        at: &Site,
        deadline: Instant,
        call: &Call,
        buf: &mut [u8],
        chunks: &[std::ops::Range<usize>],
        shift: usize,
    ) -> Result<()> {
        let op = call.rop.expect("a reduction call carries its reduce op");
        let n = self.core.size;
        let mut tmp = vec![0u8; chunks.iter().map(|c| c.len()).max().unwrap_or(0)];
        for s in 0..n - 1 {
            // Send the chunk accumulated last step; receive the one to accumulate now.
            let send = chunks[(self.core.rank + shift + 2 * n - s - 1) % n].clone();
            let recv = chunks[(self.core.rank + shift + 2 * n - s - 2) % n].clone();
            let tmp = &mut tmp[..recv.len()];
            self.ring_step(at, deadline, call, &buf[send], tmp)?;
            accumulate(call.dtype, op, &mut buf[recv], tmp);
        }
        Ok(())
    }

    /// Ring all-gather of `chunks` of `buf`, where this rank holds chunk `(rank + shift) mod n`.
    fn ring_all_gather(
        &mut self,
        at: &Site,
        deadline: Instant,
        call: &Call,
        buf: &mut [u8],
        chunks: &[std::ops::Range<usize>],
        shift: usize,
    ) -> Result<()> {
        let n = self.core.size;
        for s in 0..n - 1 {
            let send = chunks[(self.core.rank + shift + n - s) % n].clone();
            let recv = chunks[(self.core.rank + shift + 2 * n - s - 1) % n].clone();
            let (send, recv) = disjoint(buf, send, recv);
            self.ring_step(at, deadline, call, send, recv)?;
        }
        Ok(())
    }
}

fn stream_of<'a>(peers: &'a [Option<TcpStream>], at: &Site, peer: usize) -> Result<&'a TcpStream> {
    peers[peer].as_ref().ok_or_else(|| check::invalid(at, format!("no connection to rank {peer}")))
}

/// Borrows two disjoint ranges of `buf`, one shared and one mutable.
fn disjoint(
    buf: &mut [u8],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[u8], &mut [u8]) {
    if a.start >= b.end {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    } else {
        assert!(a.end <= b.start, "ranges {a:?} and {b:?} overlap");
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Connects, retrying while the peer's listener is not there yet, until `deadline`.
fn connect_until(addr: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        let left = remaining(deadline);
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(e) if left > Duration::from_millis(20) => {
                tracing::debug!(%addr, error = %e, "peer not reachable yet, retrying");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
}

impl Transport for TcpComm {
    fn core(&self) -> &GroupCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        &mut self.core
    }
    fn backend(&self) -> &'static str {
        "tcp"
    }

    /// Once: an abort frame to every peer whose stream is between messages, then every
    /// connection shut down, so no peer waits for this rank.
    fn publish_failure(&mut self, error: &Error, first: bool) {
        if !first {
            return;
        }
        let frame = Header {
            magic: MAGIC_ABORT,
            op: 0,
            dtype: 0,
            rop: 0,
            blame: blame_word(error, self.core.rank),
            seq: self.seq,
            total: 0,
            aux: 0,
            len: 0,
        }
        .encode();
        for (peer, stream) in self.peers.iter_mut().enumerate() {
            if let Some(stream) = stream {
                if !self.mid_write[peer] {
                    // Best effort: a full socket buffer just means the peer sees EOF.
                    let _ = stream.write(&frame);
                }
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }

    /// Counts the collective calls; point-to-point ones carry no group-wide number.
    fn enter(&mut self, at: &Site) -> Result<()> {
        if !matches!(at.op, Op::Send | Op::Recv) {
            self.seq += 1;
        }
        Ok(())
    }

    fn all_reduce(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let call = Call {
            op: Op::AllReduce,
            dtype,
            rop: Some(op),
            seq: self.seq,
            total: buf.len(),
            aux: 0,
            aux_name: "",
        };
        if self.core.size == 1 {
            return Ok(());
        }
        let len = buf.len();
        if len * self.core.size <= DIRECT_BYTES {
            let mut all = vec![0u8; len * self.core.size];
            let sizes = vec![len; self.core.size];
            self.direct_gather(at, deadline, &call, buf, &mut all, &sizes)?;
            all[self.core.rank * len..(self.core.rank + 1) * len].copy_from_slice(buf);
            // Every rank reduces the same sources in rank order: identical bits everywhere.
            let srcs: Vec<&[u8]> = all.chunks(len.max(1)).take(self.core.size).collect();
            if len > 0 {
                reduce(dtype, op, buf, &srcs);
            }
            return Ok(());
        }
        let elems = len / dtype.size();
        let chunks: Vec<_> = (0..self.core.size)
            .map(|r| {
                let e = part(elems, self.core.size, r);
                e.start * dtype.size()..e.end * dtype.size()
            })
            .collect();
        self.ring_reduce_scatter(at, deadline, &call, buf, &chunks, 1)?;
        self.ring_all_gather(at, deadline, &call, buf, &chunks, 1)
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
        let call = Call {
            op: at.op,
            dtype,
            rop: None,
            seq: self.seq,
            total,
            aux: fnv(sizes),
            aux_name: "sizes",
        };
        let starts: Vec<usize> =
            sizes.iter().scan(0, |acc, &s| Some(std::mem::replace(acc, *acc + s))).collect();
        let chunks: Vec<_> = (0..self.core.size).map(|r| starts[r]..starts[r] + sizes[r]).collect();
        recv[chunks[self.core.rank].clone()].copy_from_slice(send);
        if self.core.size == 1 {
            return Ok(());
        }
        if total <= DIRECT_BYTES {
            return self.direct_gather(at, deadline, &call, send, recv, sizes);
        }
        self.ring_all_gather(at, deadline, &call, recv, &chunks, 0)
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
        let call = Call {
            op: Op::ReduceScatter,
            dtype,
            rop: Some(op),
            seq: self.seq,
            total: send.len(),
            aux: 0,
            aux_name: "",
        };
        let chunk = recv.len();
        let mut work = send.to_vec();
        let chunks: Vec<_> = (0..self.core.size).map(|r| r * chunk..(r + 1) * chunk).collect();
        if self.core.size > 1 {
            self.ring_reduce_scatter(at, deadline, &call, &mut work, &chunks, 0)?;
        }
        recv.copy_from_slice(&work[chunks[self.core.rank].clone()]);
        Ok(())
    }

    fn broadcast(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        root: usize,
    ) -> Result<()> {
        let call = Call {
            op: Op::Broadcast,
            dtype,
            rop: None,
            seq: self.seq,
            total: buf.len(),
            aux: root as u64,
            aux_name: "root",
        };
        if self.core.rank == root {
            let me = self.core.rank;
            let data: &[u8] = buf;
            let mut outs: Vec<Out<'_>> = (0..self.core.size)
                .filter(|&p| p != me)
                .map(|peer| Out { peer, head: call.header(data.len()).encode(), data, done: 0 })
                .collect();
            self.exchange(at, deadline, &call, &mut outs, &mut [])
        } else {
            let want = call.header(buf.len());
            let mut ins = [In { peer: root, want, head: [0; HDR], data: buf, done: 0 }];
            self.exchange(at, deadline, &call, &mut [], &mut ins)
        }
    }

    fn send(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &[u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        let call = Call::point_to_point(dtype, buf.len());
        let mut outs = [Out { peer, head: call.header(buf.len()).encode(), data: buf, done: 0 }];
        self.exchange(at, deadline, &call, &mut outs, &mut [])
    }

    fn recv(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        let call = Call::point_to_point(dtype, buf.len());
        let want = call.header(buf.len());
        let mut ins = [In { peer, want, head: [0; HDR], data: buf, done: 0 }];
        self.exchange(at, deadline, &call, &mut [], &mut ins)
    }

    fn all_to_all(
        &mut self,
        at: &Site,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
    ) -> Result<()> {
        let call = Call {
            op: Op::AllToAll,
            dtype,
            rop: None,
            seq: self.seq,
            total: send.len(),
            aux: 0,
            aux_name: "",
        };
        let chunk = send.len() / self.core.size;
        let (r, n) = (self.core.rank, self.core.size);
        recv[r * chunk..(r + 1) * chunk].copy_from_slice(&send[r * chunk..(r + 1) * chunk]);
        for k in 1..n {
            let to = (r + k) % n;
            let from = (r + n - k) % n;
            let mut outs = [Out {
                peer: to,
                head: call.header(chunk).encode(),
                data: &send[to * chunk..(to + 1) * chunk],
                done: 0,
            }];
            let want = call.header(chunk);
            let mut ins = [In {
                peer: from,
                want,
                head: [0; HDR],
                data: &mut recv[from * chunk..(from + 1) * chunk],
                done: 0,
            }];
            self.exchange(at, deadline, &call, &mut outs, &mut ins)?;
        }
        Ok(())
    }

    fn barrier(&mut self, at: &Site, deadline: Instant) -> Result<()> {
        if self.core.size == 1 {
            return Ok(());
        }
        let call = Call {
            op: Op::Barrier,
            dtype: ElemType::U8,
            rop: None,
            seq: self.seq,
            total: 0,
            aux: 0,
            aux_name: "",
        };
        let sizes = vec![0; self.core.size];
        self.direct_gather(at, deadline, &call, &[], &mut [], &sizes)
    }
}
