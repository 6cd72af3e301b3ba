//! Rank 0's end of the control socket: a thread that accepts connections and serves each on
//! its own thread, one request and one reply, with read and write deadlines.

use super::paths::{self, Occupant};
use super::{Controller, Reply, Request};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest request line, bytes.
pub(crate) const MAX_REQUEST: u64 = 64 * 1024;

/// How long a client has to send its request, and the server to write its reply.
const IO_DEADLINE: Duration = Duration::from_secs(10);

/// How often the idle accept loop looks at its stop flag (a client is accepted as soon as it
/// connects).
const POLL: Duration = Duration::from_millis(25);

/// Connections served at once; more are answered "busy" at once.
const MAX_CONNECTIONS: usize = 32;

/// How long dropping a server waits for its accept thread.
const JOIN_DEADLINE: Duration = Duration::from_secs(5);

/// What answers the requests of a control socket: a deployment's [`Controller`], or a model
/// host's table.
pub type Handler = Arc<dyn Fn(&Request) -> Reply + Send + Sync>;

/// A running control socket. Dropping it stops accepting and removes the socket file
/// (requests being served finish on their own threads).
pub struct Server {
    path: PathBuf,
    /// Device and inode of the socket this server bound, so a drop never removes a socket
    /// another server put at the same path since.
    identity: (u64, u64),
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("path", &self.path).finish_non_exhaustive()
    }
}

impl Server {
    /// Serves the control socket at `path` on a new thread: sleep, wakeup and status go to
    /// `controller`; `stop` is answered, then `on_stop` is called (it should stop the
    /// deployment as a SIGTERM would). The socket's directory is created with mode 0700, the
    /// socket gets mode 0600; a stale socket at `path` is replaced.
    ///
    /// # Errors
    /// A live socket is already at `path` (another deployment of that name runs), something
    /// other than a socket is there, or the directory or socket cannot be set up.
    pub fn start(
        path: &Path,
        controller: Controller,
        on_stop: Arc<dyn Fn() + Send + Sync>,
    ) -> Result<Server> {
        Server::start_with(path, Arc::new(move |r| controller.execute(r)), on_stop)
    }

    /// [`Server::start`] with any `handler` of the requests (a model host's).
    ///
    /// # Errors
    /// As [`Server::start`].
    pub fn start_with(
        path: &Path,
        handler: Handler,
        on_stop: Arc<dyn Fn() + Send + Sync>,
    ) -> Result<Server> {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        paths::prepare_dir(dir)?;
        match paths::occupant(path) {
            Occupant::Free => {}
            Occupant::Live => bail!(
                "a deployment is already running with control socket {}: give another --deployment name or stop it with `tpctl stop --socket {}`",
                path.display(),
                path.display()
            ),
            Occupant::Stale => {
                tracing::info!(path = %path.display(), "replacing a stale control socket");
                std::fs::remove_file(path).with_context(|| {
                    format!("removing the stale control socket {}", path.display())
                })?;
            }
            Occupant::Other => {
                bail!("{} exists and is not a socket: not replacing it", path.display())
            }
        }
        let listener = UnixListener::bind(path)
            .with_context(|| format!("binding the control socket {}", path.display()))?;
        // The directory is 0700, so nobody else can reach the socket before this narrows it.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("setting mode 0600 on {}", path.display()))?;
        let meta = std::fs::symlink_metadata(path)
            .with_context(|| format!("reading {}", path.display()))?;
        listener.set_nonblocking(true).context("configuring the control socket")?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(listener, handler, on_stop, flag))
            .context("starting the control socket thread")?;
        Ok(Server {
            path: path.to_owned(),
            identity: (meta.dev(), meta.ino()),
            stop,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let start = Instant::now();
            while !thread.is_finished() && start.elapsed() < JOIN_DEADLINE {
                std::thread::sleep(POLL);
            }
            if thread.is_finished() {
                let _ = thread.join();
            } else {
                tracing::warn!("the control socket thread did not stop within {JOIN_DEADLINE:?}");
            }
        }
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| (m.dev(), m.ino()) == self.identity);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn accept_loop(
    listener: UnixListener,
    handler: Handler,
    on_stop: Arc<dyn Fn() + Send + Sync>,
    stop: Arc<AtomicBool>,
) {
    let active = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wait_for_client(&listener);
                continue;
            }
            Err(e) => {
                tracing::warn!("control socket: accept failed: {e}");
                std::thread::sleep(POLL);
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(IO_DEADLINE));
            let busy = Reply::refused(format!(
                "the control socket is busy ({MAX_CONNECTIONS} requests in progress): try again"
            ));
            let _ = write_reply(&stream, &busy);
            continue;
        }
        let (handler, on_stop, active) = (handler.clone(), on_stop.clone(), active.clone());
        let spawned = std::thread::Builder::new().name("control-conn".into()).spawn(move || {
            if let Err(e) = serve_connection(stream, &*handler, &*on_stop) {
                tracing::warn!("control socket: {e:#}");
            }
            active.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            tracing::warn!("control socket: cannot start a connection thread: {e}");
        }
    }
}

/// Waits until a client connects to `listener`, at most [`POLL`] (so the loop still looks at
/// its stop flag that often): a request is taken up at once, not at the next poll.
fn wait_for_client(listener: &UnixListener) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(POLL).unwrap_or(PollTimeout::MAX);
    if poll(&mut fds, timeout).is_err() {
        // Interrupted by a signal, or the descriptor is gone: pace the loop as before.
        std::thread::sleep(POLL);
    }
}

/// Reads one request line, answers it, and for `stop` calls `on_stop` once the reply is out.
fn serve_connection(
    stream: UnixStream,
    handler: &(dyn Fn(&Request) -> Reply + Send + Sync),
    on_stop: &(dyn Fn() + Send + Sync),
) -> Result<()> {
    stream.set_nonblocking(false).context("configuring a control connection")?;
    stream.set_read_timeout(Some(IO_DEADLINE)).context("configuring a control connection")?;
    stream.set_write_timeout(Some(IO_DEADLINE)).context("configuring a control connection")?;
    let mut line = String::new();
    let read = BufReader::new((&stream).take(MAX_REQUEST)).read_line(&mut line);
    let request = match read {
        Err(e) => {
            let reply =
                Reply::refused(format!("no complete request line within {IO_DEADLINE:?}: {e}"));
            return write_reply(&stream, &reply);
        }
        Ok(_) if !line.ends_with('\n') && line.len() as u64 >= MAX_REQUEST => {
            let reply =
                Reply::refused(format!("the request line is longer than {MAX_REQUEST} bytes"));
            return write_reply(&stream, &reply);
        }
        // A liveness probe (`tpctl` looking for deployments) connects and closes at once.
        Ok(0) => return Ok(()),
        Ok(_) => Request::parse(line.trim()),
    };
    let request = match request {
        Ok(r) => r,
        Err(e) => return write_reply(&stream, &Reply::refused(e)),
    };
    tracing::info!(method = request.method(), ?request, "control request");
    let reply = handler(&request);
    let written = write_reply(&stream, &reply);
    if request == Request::Stop {
        drop(stream);
        on_stop();
    }
    written
}

fn write_reply(mut stream: &UnixStream, reply: &Reply) -> Result<()> {
    let mut line = serde_json::to_vec(reply).context("encoding a control reply")?;
    line.push(b'\n');
    stream.write_all(&line).context("writing a control reply")?;
    stream.flush().context("writing a control reply")
}
