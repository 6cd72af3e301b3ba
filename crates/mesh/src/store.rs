//! The TCP key-value store rank 0 hosts, through which ranks exchange start-up information
//! (addresses, NCCL ids) and meet at barriers.
//!
//! Every call has a deadline: socket reads and writes time out, and a `wait` is bounded on the
//! server, which answers with the keys still missing. A client whose server died gets
//! [`Error::StoreUnreachable`], never a hang. After a failed call the connection is dropped
//! (a late reply must not answer the next request); the next call reconnects once.
//!
//! Keys are free-form strings; [`Store::barrier`] uses the keys `barrier/NAME/arrived` and
//! `barrier/NAME/done`.

mod protocol;
mod server;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

use protocol::{read_frame, write_frame, Reply, Request};
pub use server::StoreServer;

use crate::error::{Error, Result};
use crate::failpoint;
use crate::rendezvous::Rendezvous;

/// The per-call deadline of a new [`Store`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest pause between two connection attempts while the server is not up yet.
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// A client of the store, `Send + Sync`. Calls from several threads do not queue behind each
/// other: a call that finds the connection busy (say, with a long `wait`) opens a connection of
/// its own for its duration.
#[derive(Debug)]
pub struct Store {
    addr: SocketAddr,
    conn: Mutex<Option<TcpStream>>,
    timeout: Duration,
}

impl Store {
    /// Connects to the server at `addr`, retrying while nobody listens yet (the server's rank may
    /// start later) until `timeout` has passed.
    ///
    /// # Errors
    /// [`Error::StoreConnect`] with the last connection error when no attempt succeeded within
    /// `timeout`; [`Error::Injected`] from the failpoint `store.connect`.
    pub fn connect(addr: impl ToSocketAddrs, timeout: Duration) -> Result<Store> {
        failpoint::hit("store.connect")?;
        let start = Instant::now();
        let mut backoff = Duration::from_millis(10);
        loop {
            let last = match addr.to_socket_addrs() {
                Ok(addrs) => {
                    let mut last = io::Error::new(
                        io::ErrorKind::AddrNotAvailable,
                        "the address resolves to nothing",
                    );
                    for a in addrs {
                        let left =
                            timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
                        match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(5))) {
                            Ok(stream) => {
                                let stream =
                                    prepare(stream).map_err(|source| Error::StoreConnect {
                                        addr: a.to_string(),
                                        elapsed: start.elapsed(),
                                        source,
                                    })?;
                                tracing::debug!(addr = %a, elapsed = ?start.elapsed(), "store connected");
                                return Ok(Store {
                                    addr: a,
                                    conn: Mutex::new(Some(stream)),
                                    timeout: DEFAULT_TIMEOUT,
                                });
                            }
                            Err(e) => last = e,
                        }
                    }
                    last
                }
                // Host names may resolve only once the cluster's DNS has caught up: retry too.
                Err(e) => e,
            };
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Err(Error::StoreConnect {
                    addr: server::describe(&addr),
                    elapsed,
                    source: last,
                });
            }
            std::thread::sleep(backoff.min(timeout - elapsed));
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// Sets the deadline of each later call (a `wait` gets its own timeout plus this one, for
    /// the reply to travel).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The per-call deadline.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stores `value` under `key`, replacing any value, and wakes the clients waiting for it.
    ///
    /// # Errors
    /// [`Error::StoreUnreachable`] when the server does not answer within the deadline or closed
    /// the connection; [`Error::Injected`] from the failpoint `store.set`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        failpoint::hit("store.set")?;
        let op = format!("set `{key}`");
        match self.call(
            &op,
            &Request::Set { key: key.into(), value: value.into() },
            self.timeout,
        )? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected(&op, &other)),
        }
    }

    /// The value under `key`, `None` when it is not set.
    ///
    /// # Errors
    /// As [`Store::set`]; the failpoint is `store.get`.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        failpoint::hit("store.get")?;
        let op = format!("get `{key}`");
        match self.call(&op, &Request::Get { key: key.into() }, self.timeout)? {
            Reply::Value(v) => Ok(v),
            other => Err(self.unexpected(&op, &other)),
        }
    }

    /// Blocks until every key in `keys` is set and returns their values in the same order.
    /// The server does the waiting: nothing is polled over the network.
    ///
    /// # Errors
    /// [`Error::StoreTimeout`] naming the keys still missing after `timeout`;
    /// [`Error::StoreUnreachable`] when the server dies meanwhile or does not answer within
    /// `timeout` plus the per-call deadline; [`Error::Injected`] from the failpoint `store.wait`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        failpoint::hit("store.wait")?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let op = format!("wait {}", quote_keys(keys.iter().copied()));
        let start = Instant::now();
        let request = Request::Wait {
            keys: keys.iter().map(|&k| k.to_owned()).collect(),
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        };
        match self.call(&op, &request, timeout.saturating_add(self.timeout))? {
            Reply::Values(values) if values.len() == keys.len() => Ok(values),
            Reply::Missing(missing) => Err(Error::StoreTimeout {
                addr: self.addr,
                op: "wait".into(),
                missing: format!(
                    "{} {}",
                    if missing.len() == 1 { "key" } else { "keys" },
                    quote_keys(missing.iter().map(String::as_str))
                ),
                elapsed: start.elapsed(),
            }),
            other => Err(self.unexpected(&op, &other)),
        }
    }

    /// Adds `delta` to the integer under `key` (absent counts as 0) atomically and returns the
    /// new value. The value is stored as decimal text, so [`Store::get`] reads it back as such.
    ///
    /// # Errors
    /// [`Error::StoreProtocol`] when the key holds something other than a decimal integer or the
    /// sum overflows; otherwise as [`Store::set`], with the failpoint `store.add`.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        failpoint::hit("store.add")?;
        let op = format!("add `{key}`");
        match self.call(&op, &Request::Add { key: key.into(), delta }, self.timeout)? {
            Reply::Int(n) => Ok(n),
            other => Err(self.unexpected(&op, &other)),
        }
    }

    /// Removes `key`; whether it was set.
    ///
    /// # Errors
    /// As [`Store::set`]; the failpoint is `store.delete`.
    pub fn delete(&self, key: &str) -> Result<bool> {
        failpoint::hit("store.delete")?;
        let op = format!("delete `{key}`");
        match self.call(&op, &Request::Delete { key: key.into() }, self.timeout)? {
            Reply::Bool(b) => Ok(b),
            other => Err(self.unexpected(&op, &other)),
        }
    }

    /// Returns once `world` callers have entered the barrier `name`. Each barrier name can be
    /// used once; use a new name (for example with a counter) for the next barrier.
    ///
    /// # Errors
    /// [`Error::StoreTimeout`] saying how many ranks are missing after `timeout`;
    /// [`Error::StoreProtocol`] when more than `world` callers entered (a reused name);
    /// [`Error::InvalidMesh`] for `world == 0`; store errors as in [`Store::add`] and
    /// [`Store::wait`].
    pub fn barrier(&self, name: &str, world: usize, timeout: Duration) -> Result<()> {
        if world == 0 {
            return Err(Error::mesh(format!("barrier `{name}`: world size must be at least 1")));
        }
        let start = Instant::now();
        let arrived_key = format!("barrier/{name}/arrived");
        let done_key = format!("barrier/{name}/done");
        let arrived = self.add(&arrived_key, 1)?;
        let op = format!("barrier `{name}`");
        match usize::try_from(arrived) {
            Ok(n) if n == world => self.set(&done_key, b"")?,
            Ok(n) if n < world => {}
            _ => {
                return Err(Error::StoreProtocol {
                    addr: self.addr,
                    op,
                    reason: format!(
                        "{arrived} callers entered a barrier for {world} ranks: the name was reused"
                    ),
                })
            }
        }
        match self.wait(&[&done_key], timeout.saturating_sub(start.elapsed())) {
            Ok(_) => Ok(()),
            Err(Error::StoreTimeout { elapsed, .. }) => {
                let now = self
                    .get(&arrived_key)?
                    .and_then(|v| String::from_utf8(v).ok())
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(0);
                Err(Error::StoreTimeout {
                    addr: self.addr,
                    op,
                    missing: format!("{} of {world} ranks", world.saturating_sub(now)),
                    elapsed: elapsed.max(start.elapsed()),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Sends one request and reads its reply within `deadline`.
    fn call(&self, op: &str, request: &Request, deadline: Duration) -> Result<Reply> {
        let start = Instant::now();
        // A call in progress on another thread (a long `wait`) must not hold this one past its
        // deadline, so a concurrent call gets a connection of its own for its duration.
        let mut shared = match self.conn.try_lock() {
            Ok(guard) => Some(guard),
            // The guarded value is only ever replaced whole, so it is coherent after a panic.
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        let mut extra = None;
        let conn = match shared.as_mut() {
            Some(guard) => &mut **guard,
            None => &mut extra,
        };
        let result = self.exchange(conn, request, start, deadline);
        let payload = match result {
            Ok(payload) => payload,
            Err(source) => {
                // Whatever the stream holds now (half a reply, a late one) is unusable.
                *conn = None;
                return Err(Error::StoreUnreachable {
                    addr: self.addr,
                    op: op.to_owned(),
                    elapsed: start.elapsed(),
                    source,
                });
            }
        };
        match Reply::decode(&payload) {
            Ok(Reply::Refused(reason)) => {
                Err(Error::StoreProtocol { addr: self.addr, op: op.to_owned(), reason })
            }
            Ok(reply) => Ok(reply),
            Err(why) => {
                *conn = None;
                Err(Error::StoreProtocol {
                    addr: self.addr,
                    op: op.to_owned(),
                    reason: format!("malformed reply: {why}"),
                })
            }
        }
    }

    fn exchange(
        &self,
        conn: &mut Option<TcpStream>,
        request: &Request,
        start: Instant,
        deadline: Duration,
    ) -> io::Result<Vec<u8>> {
        let left = || {
            let left = deadline.saturating_sub(start.elapsed());
            if left.is_zero() {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no reply within {deadline:.1?}"),
                ))
            } else {
                Ok(left)
            }
        };
        let stream = match conn {
            Some(stream) => stream,
            None => {
                let stream = TcpStream::connect_timeout(&self.addr, left()?)
                    .map_err(|e| io::Error::new(e.kind(), format!("connecting: {e}")))?;
                conn.insert(prepare(stream)?)
            }
        };
        stream.set_write_timeout(Some(left()?))?;
        write_frame(stream, &request.encode()).map_err(|e| describe_io(e, deadline))?;
        stream.set_read_timeout(Some(left()?))?;
        read_frame(stream).map_err(|e| describe_io(e, deadline))
    }

    fn unexpected(&self, op: &str, reply: &Reply) -> Error {
        Error::StoreProtocol {
            addr: self.addr,
            op: op.to_owned(),
            reason: format!("unexpected reply {reply:?}"),
        }
    }
}

fn prepare(stream: TcpStream) -> io::Result<TcpStream> {
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Makes the two socket errors that mean "server gone" and "server silent" say so.
fn describe_io(e: io::Error, deadline: Duration) -> io::Error {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => {
            io::Error::new(io::ErrorKind::UnexpectedEof, "the server closed the connection")
        }
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            io::Error::new(io::ErrorKind::TimedOut, format!("no reply within {deadline:.1?}"))
        }
        _ => e,
    }
}

fn quote_keys<'a>(keys: impl Iterator<Item = &'a str>) -> String {
    keys.map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
}

/// Rank 0 starts the store server on `MASTER_ADDR:MASTER_PORT` and connects to it; every other
/// rank connects, retrying until `timeout` while rank 0 is not up yet. Keep the server alive as
/// long as any rank may use the store.
///
/// # Errors
/// [`Error::StoreBind`] on rank 0 when the address cannot be bound; [`Error::StoreConnect`]
/// when the server cannot be reached within `timeout`.
pub fn rendezvous_store(
    rv: &Rendezvous,
    timeout: Duration,
) -> Result<(Option<StoreServer>, Store)> {
    let host = rv.master_addr.trim_start_matches('[').trim_end_matches(']');
    if rv.rank == 0 {
        let server = StoreServer::bind((host, rv.master_port))?;
        let mut local = server.local_addr();
        // A server on every interface is reached through the loopback of the same family.
        if local.ip().is_unspecified() {
            local.set_ip(match local.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        let store = Store::connect(local, timeout)?;
        Ok((Some(server), store))
    } else {
        Ok((None, Store::connect((host, rv.master_port), timeout)?))
    }
}

#[cfg(test)]
mod tests;
