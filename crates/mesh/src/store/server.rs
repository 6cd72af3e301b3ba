//! The store server rank 0 hosts: a map behind a mutex, one thread per connection.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::protocol::{read_frame, write_frame, Reply, Request};
use crate::error::{Error, Result};

/// How often the accept loop looks for the stop flag. Accepting is non-blocking so that a stop
/// never depends on a wake-up connection reaching the listener.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// The store server: listens on a TCP address and serves every client on its own thread.
///
/// Dropping it (or [`StoreServer::shutdown`]) stops the accept loop, closes every client
/// connection (clients blocked in `wait` get an error at once) and joins the threads.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled whenever a key is written and on shutdown.
    changed: Condvar,
    conns: Mutex<Conns>,
}

#[derive(Debug, Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    closed: bool,
}

#[derive(Debug, Default)]
struct Conns {
    next_id: u64,
    streams: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

impl Shared {
    /// The map stays consistent under any panic (every update is a single insert), so a
    /// poisoned lock is taken over rather than propagated.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port, see [`StoreServer::local_addr`]) and starts
    /// the accept loop on a background thread.
    ///
    /// # Errors
    /// [`Error::StoreBind`] when the address does not resolve or cannot be bound (in use, not
    /// local).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<StoreServer> {
        let described = describe(&addr);
        let bind_err = |source| Error::StoreBind { addr: described.clone(), source };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let shared = Arc::new(Shared::default());
        let accept = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("store-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .map_err(bind_err)?
        };
        tracing::debug!(%local, "store server listening");
        Ok(StoreServer { addr: local, shared, accept: Some(accept) })
    }

    /// The address the server listens on, with the port chosen when `bind` was given port 0.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the server: see the type's documentation.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// Stops the server once every client has disconnected, or at `timeout`, whichever comes
    /// first. A job's last store calls are answered this way: stopping at once could close a
    /// client's connection between the server acting on its last request and the reply.
    pub fn drain(mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let open = self.shared.conns().streams.len();
            if open == 0 {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(open, addr = %self.addr, "store clients still connected at shutdown");
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.stop();
    }

    fn stop(&mut self) {
        let Some(accept) = self.accept.take() else { return };
        self.shared.state().closed = true;
        self.shared.changed.notify_all();
        // The accept loop sees the flag within one poll and accepts nothing after it.
        let _ = accept.join();
        let threads = {
            let mut conns = self.shared.conns();
            for stream in conns.streams.values() {
                let _ = stream.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut conns.threads)
        };
        // Every connection thread is now unblocked: readers see end of stream, writers an
        // error, waiters the `closed` flag.
        for thread in threads {
            let _ = thread.join();
        }
        tracing::debug!(addr = %self.addr, "store server stopped");
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A printable form of an address argument for error messages.
pub(super) fn describe(addr: &impl ToSocketAddrs) -> String {
    match addr.to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<String> = addrs.map(|a| a.to_string()).collect();
            if addrs.is_empty() {
                "an address that resolves to nothing".to_owned()
            } else {
                addrs.join(" or ")
            }
        }
        Err(e) => format!("an unresolvable address ({e})"),
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    loop {
        if shared.state().closed {
            return;
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                if let Err(e) = serve(stream, peer, shared) {
                    tracing::warn!(%peer, "store server dropped a connection: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors and similar: keep serving the existing clients.
                tracing::warn!("store server accept failed: {e}");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Registers the connection and starts its thread.
fn serve(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    let registered = stream.try_clone()?;
    let mut conns = shared.conns();
    conns.threads.retain(|t| !t.is_finished());
    let id = conns.next_id;
    conns.next_id += 1;
    // Registered before the thread starts, so its removal on exit cannot come first and leave
    // the clone (and with it the socket) open. The thread's removal waits for this lock.
    conns.streams.insert(id, registered);
    let spawned = {
        let shared = Arc::clone(shared);
        std::thread::Builder::new().name(format!("store-conn-{id}")).spawn(move || {
            connection(stream, peer, &shared);
            shared.conns().streams.remove(&id);
        })
    };
    match spawned {
        Ok(thread) => {
            conns.threads.push(thread);
            Ok(())
        }
        Err(e) => {
            conns.streams.remove(&id);
            Err(e)
        }
    }
}

fn connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    loop {
        let payload = match read_frame(&mut stream) {
            Ok(p) => p,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return,
            Err(e) => {
                tracing::debug!(%peer, "store connection closed: {e}");
                return;
            }
        };
        let reply = match Request::decode(&payload) {
            Ok(request) => match handle(request, shared) {
                Some(reply) => reply,
                // Shut down while waiting: closing the connection is the answer.
                None => return,
            },
            Err(why) => Reply::Refused(format!("malformed request: {why}")),
        };
        if let Err(e) = write_frame(&mut stream, &reply.encode()) {
            tracing::debug!(%peer, "store reply not delivered: {e}");
            return;
        }
    }
}

/// Answers one request; `None` when the server shut down during a `wait`.
fn handle(request: Request, shared: &Shared) -> Option<Reply> {
    let mut state = shared.state();
    let reply = match request {
        Request::Set { key, value } => {
            state.kv.insert(key, value);
            shared.changed.notify_all();
            Reply::Ok
        }
        Request::Get { key } => Reply::Value(state.kv.get(&key).cloned()),
        Request::Add { key, delta } => {
            let current = match state.kv.get(&key) {
                None => 0,
                Some(v) => match std::str::from_utf8(v).ok().and_then(|s| s.parse::<i64>().ok()) {
                    Some(n) => n,
                    None => {
                        return Some(Reply::Refused(format!(
                            "key `{key}` holds {} bytes that are not a decimal integer",
                            v.len()
                        )))
                    }
                },
            };
            let Some(new) = current.checked_add(delta) else {
                return Some(Reply::Refused(format!(
                    "key `{key}`: {current} + {delta} overflows a 64-bit integer"
                )));
            };
            state.kv.insert(key, new.to_string().into_bytes());
            shared.changed.notify_all();
            Reply::Int(new)
        }
        Request::Delete { key } => Reply::Bool(state.kv.remove(&key).is_some()),
        Request::Wait { keys, timeout_ms } => {
            let deadline = Instant::now() + Duration::from_millis(timeout_ms);
            loop {
                if state.closed {
                    return None;
                }
                let missing: Vec<&String> =
                    keys.iter().filter(|k| !state.kv.contains_key(*k)).collect();
                if missing.is_empty() {
                    break Reply::Values(keys.iter().map(|k| state.kv[k].clone()).collect());
                }
                let now = Instant::now();
                if now >= deadline {
                    break Reply::Missing(missing.into_iter().cloned().collect());
                }
                state = shared
                    .changed
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    };
    Some(reply)
}
