//! The client side of the control socket, as `tpctl sleep / wakeup / status / stop` use it.

use super::{Reply, Request};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The longest reply line a client reads, bytes (receipts of many ranks fit easily).
const MAX_REPLY: u64 = 16 << 20;

/// Sends `request` to the control socket at `socket` and reads the reply, waiting at most
/// `timeout` for each of the write and the reply.
///
/// # Errors
/// The socket cannot be reached, the reply does not come within `timeout`, or it is not a
/// control reply. A reply with `ok: false` is returned as is.
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Reply> {
    let stream = UnixStream::connect(socket)
        .with_context(|| format!("connecting to the control socket {}", socket.display()))?;
    stream.set_write_timeout(Some(timeout)).context("configuring the control connection")?;
    stream.set_read_timeout(Some(timeout)).context("configuring the control connection")?;
    let mut line = serde_json::to_vec(request).context("encoding the request")?;
    line.push(b'\n');
    (&stream)
        .write_all(&line)
        .with_context(|| format!("sending the request to {}", socket.display()))?;
    let mut reply = String::new();
    BufReader::new((&stream).take(MAX_REPLY)).read_line(&mut reply).map_err(|e| {
        let waited =
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                format!(" within {:.0} s (raise --timeout)", timeout.as_secs_f64())
            } else {
                String::new()
            };
        anyhow::anyhow!("no reply from {}{waited}: {e}", socket.display())
    })?;
    if reply.trim().is_empty() {
        bail!("{} closed the connection without a reply", socket.display());
    }
    serde_json::from_str(reply.trim()).with_context(|| {
        format!("{} answered something that is not a control reply", socket.display())
    })
}
