//! The TCP control channel. Rank 0 listens on an ephemeral port and publishes its address in
//! the rendezvous [`mesh::Store`]; every other rank connects once, at start-up and before any
//! worker thread runs, and introduces itself with a hello frame. Frames are a 4-byte
//! little-endian length followed by JSON. Every read and write has a deadline; a closed
//! connection is reported with the peer's rank.

use super::{CoordinatorLink, Incoming, LinkError, PeerLink, ReadError};
use crate::sleep::error::{Error, Result};
use crate::sleep::message::{Message, Received};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The store key under which rank 0 publishes the control address.
pub const ADDR_KEY: &str = "sleep/control/addr";
/// Largest frame accepted; anything larger is a corrupt stream.
const MAX_FRAME: usize = 16 << 20;
/// How often blocked reads wake up to look at their deadline or stop flag.
const POLL: Duration = Duration::from_millis(50);
/// Deadline of one frame write.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accumulates bytes read with a short timeout until a whole frame is there, so a read that
/// times out in the middle of a frame loses nothing.
#[derive(Debug, Default)]
struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    /// Reads until a frame is complete or `deadline` passes.
    fn next(
        &mut self,
        stream: &mut TcpStream,
        deadline: Instant,
        stop: Option<&AtomicBool>,
    ) -> std::result::Result<Option<Received>, ReadError> {
        loop {
            if self.buf.len() >= 4 {
                let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                if len > MAX_FRAME {
                    return Err(ReadError::Oversized { len, max: MAX_FRAME });
                }
                if self.buf.len() >= 4 + len {
                    let frame = match Message::decode(&self.buf[4..4 + len]) {
                        Ok(msg) => Received::Frame(Box::new(msg)),
                        Err(bad) => Received::Undecodable(bad),
                    };
                    self.buf.drain(..4 + len);
                    return Ok(Some(frame));
                }
            }
            let now = Instant::now();
            if now >= deadline || stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return Ok(None);
            }
            let wait = (deadline - now).min(POLL).max(Duration::from_millis(1));
            stream.set_read_timeout(Some(wait))?;
            let mut chunk = [0u8; 8192];
            match stream.read(&mut chunk) {
                Ok(0) => return Err(ReadError::Closed),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }
}

fn write_frame(stream: &mut TcpStream, msg: &Message) -> std::io::Result<()> {
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    stream.write_all(&msg.encode())
}

fn channel_err(rank: usize, detail: String) -> Error {
    Error::Channel { rank, detail }
}

/// Rank 0's end: one writer per peer and one reader thread per peer feeding a single queue.
#[derive(Debug)]
pub struct TcpCoordinator {
    writers: HashMap<usize, Mutex<TcpStream>>,
    queue: Mutex<Receiver<Incoming>>,
    stop: Arc<AtomicBool>,
    readers: Vec<JoinHandle<()>>,
}

/// A peer's end: one connection to rank 0.
#[derive(Debug)]
pub struct TcpPeer {
    stream: TcpStream,
    reader: FrameReader,
}

/// Either end of the TCP control channel, as [`connect`] returns it.
#[derive(Debug)]
pub enum Endpoint {
    /// Rank 0.
    Coordinator(TcpCoordinator),
    /// Every other rank.
    Peer(TcpPeer),
}

/// Creates the control channel collectively: rank 0 binds `bind_host:0`, publishes the
/// address under [`ADDR_KEY`] and accepts `world - 1` peers; the others connect and say hello.
/// Call it on every rank at start-up, before worker threads run.
///
/// # Errors
/// [`Error::Channel`] when binding, publishing, connecting or the hellos fail, or when not
/// every peer arrived within `timeout` (naming the missing ranks).
pub fn connect(
    store: &mesh::Store,
    rank: usize,
    world: usize,
    bind_host: &str,
    timeout: Duration,
) -> Result<Endpoint> {
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        let listener = TcpListener::bind((bind_host, 0))
            .map_err(|e| channel_err(0, format!("bind {bind_host}:0: {e}")))?;
        let addr = listener.local_addr().map_err(|e| channel_err(0, e.to_string()))?;
        store
            .set(ADDR_KEY, addr.to_string().as_bytes())
            .map_err(|e| channel_err(0, format!("publish control address {addr}: {e}")))?;
        accept_peers(listener, world, deadline).map(Endpoint::Coordinator)
    } else {
        let addr = store
            .wait(&[ADDR_KEY], timeout)
            .map_err(|e| channel_err(rank, format!("wait for the control address: {e}")))?;
        let addr = String::from_utf8_lossy(&addr[0]).into_owned();
        let mut stream = loop {
            match TcpStream::connect(addr.as_str()) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(channel_err(rank, format!("connect to rank 0 at {addr}: {e}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream.set_nodelay(true).map_err(|e| channel_err(rank, e.to_string()))?;
        // The hello is a status request whose op id is the sender's rank.
        let hello = Message::request(rank as u64, super::super::message::Phase::Status, None, &[]);
        write_frame(&mut stream, &hello)
            .map_err(|e| channel_err(rank, format!("hello to rank 0 at {addr}: {e}")))?;
        Ok(Endpoint::Peer(TcpPeer { stream, reader: FrameReader::default() }))
    }
}

fn accept_peers(listener: TcpListener, world: usize, deadline: Instant) -> Result<TcpCoordinator> {
    listener.set_nonblocking(true).map_err(|e| channel_err(0, e.to_string()))?;
    let mut streams: HashMap<usize, TcpStream> = HashMap::new();
    while streams.len() + 1 < world {
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (1..world).filter(|r| !streams.contains_key(r)).collect();
            return Err(channel_err(0, format!("ranks {missing:?} did not connect in time")));
        }
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream.set_nonblocking(false).map_err(|e| channel_err(0, e.to_string()))?;
                stream.set_nodelay(true).map_err(|e| channel_err(0, e.to_string()))?;
                let hello = match FrameReader::default()
                    .next(&mut stream, deadline, None)
                    .map_err(|e| channel_err(0, format!("hello from {from}: {e}")))?
                {
                    Some(Received::Frame(hello)) => *hello,
                    Some(Received::Undecodable(bad)) => {
                        return Err(channel_err(0, format!("hello from {from}: {}", bad.reason)))
                    }
                    None => return Err(channel_err(0, format!("no hello from {from} in time"))),
                };
                let peer = hello.op_id as usize;
                if peer == 0 || peer >= world || streams.contains_key(&peer) {
                    return Err(channel_err(
                        0,
                        format!("{from} introduced itself as rank {peer}, which is out of range or taken (world {world})"),
                    ));
                }
                streams.insert(peer, stream);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => return Err(channel_err(0, format!("accept: {e}"))),
        }
    }
    let (tx, rx) = channel();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = HashMap::new();
    let mut readers = Vec::new();
    for (rank, stream) in streams {
        let reader = stream.try_clone().map_err(|e| channel_err(0, e.to_string()))?;
        writers.insert(rank, Mutex::new(stream));
        let (tx, stop) = (tx.clone(), stop.clone());
        let handle = std::thread::Builder::new()
            .name(format!("sleep-ctl-rx{rank}"))
            .spawn(move || pump(rank, reader, tx, &stop))
            .map_err(|e| channel_err(0, format!("spawn reader for rank {rank}: {e}")))?;
        readers.push(handle);
    }
    Ok(TcpCoordinator { writers, queue: Mutex::new(rx), stop, readers })
}

/// Reads frames from one peer into the queue until the connection closes or `stop` is set.
fn pump(rank: usize, mut stream: TcpStream, tx: Sender<Incoming>, stop: &AtomicBool) {
    let mut reader = FrameReader::default();
    loop {
        let deadline = Instant::now() + POLL;
        match reader.next(&mut stream, deadline, Some(stop)) {
            Ok(Some(Received::Frame(msg))) => {
                if tx.send(Incoming::Frame { rank, msg }).is_err() {
                    return;
                }
            }
            // An ACK that does not decode answers nothing: the coordinator's deadline for
            // that ACK names the peer.
            Ok(Some(Received::Undecodable(bad))) => {
                tracing::warn!(rank, reason = %bad.reason, "dropped an undecodable ack");
            }
            Ok(None) if stop.load(Ordering::Relaxed) => return,
            Ok(None) => {}
            Err(reason) => {
                let _ = tx.send(Incoming::Closed { rank, reason: reason.to_string() });
                return;
            }
        }
    }
}

impl Drop for TcpCoordinator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.writers.values() {
            let _ = w.lock().unwrap_or_else(|e| e.into_inner()).shutdown(Shutdown::Both);
        }
        // Each reader wakes within POLL and sees the stop flag or the shut socket.
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

impl CoordinatorLink for TcpCoordinator {
    fn peers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.writers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn send(&self, rank: usize, msg: &Message) -> std::result::Result<(), LinkError> {
        let w = self.writers.get(&rank).ok_or(LinkError::UnknownPeer { rank })?;
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut w, msg).map_err(|source| LinkError::Write {
            phase: msg.phase,
            ack: false,
            rank,
            source,
        })
    }

    fn recv(&self, deadline: Instant) -> Option<Incoming> {
        let rx = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        // A disconnected queue means every peer end is gone: nothing more will come.
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).ok()
    }
}

impl PeerLink for TcpPeer {
    fn recv(&mut self, deadline: Instant) -> std::result::Result<Option<Received>, LinkError> {
        self.reader
            .next(&mut self.stream, deadline, None)
            .map_err(|source| LinkError::Read { rank: 0, source })
    }

    fn send(&mut self, msg: &Message) -> std::result::Result<(), LinkError> {
        write_frame(&mut self.stream, msg).map_err(|source| LinkError::Write {
            phase: msg.phase,
            ack: true,
            rank: 0,
            source,
        })
    }
}
