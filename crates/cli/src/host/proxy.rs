//! Forwards one request to a model's deployment over loopback and streams its answer back
//! unchanged (status, content type, body; an SSE stream event by event): a small HTTP/1.1
//! client (`Connection: close`, the body read to its length, its chunks, or the end).
//!
//! The answer's body is copied by a task of its own, which holds `guard` until the last byte
//! is sent or the client goes away; dropping the upstream connection then cancels the request
//! in the model's deployment, as a client's disconnect does.

use anyhow::{bail, Context, Result};
use axum::body::{Body, Bytes};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_stream::wrappers::ReceiverStream;

/// The longest answer head, bytes.
const MAX_HEAD: usize = 64 << 10;
/// How long to connect to a model's deployment.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest silence of a model's deployment: before the head of its answer (a plain
/// completion answers once it is complete) and between two reads of the body.
const READ_TIMEOUT: Duration = Duration::from_secs(600);

/// Sends `method path` with `body` (JSON) to `addr` and answers what it answers. `guard` is
/// dropped once the answer has been passed on (or the client went away).
///
/// # Errors
/// The deployment cannot be reached, or answers something that is not HTTP.
pub async fn forward<G: Send + 'static>(
    addr: &str,
    method: &str,
    path: &str,
    body: Bytes,
    guard: G,
) -> Result<Response> {
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| anyhow::anyhow!("connecting to {addr}: no answer within {CONNECT_TIMEOUT:?}"))?
        .with_context(|| format!("connecting to {addr}"))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.with_context(|| format!("sending to {addr}"))?;
    stream.write_all(&body).await.with_context(|| format!("sending to {addr}"))?;

    let mut buf = Vec::with_capacity(8192);
    let head_end = loop {
        if let Some(at) = find(&buf, b"\r\n\r\n") {
            break at;
        }
        if buf.len() > MAX_HEAD {
            bail!("{addr} answered a head longer than {MAX_HEAD} bytes");
        }
        if read_more(&mut stream, &mut buf).await? == 0 {
            bail!("{addr} closed the connection before answering");
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let rest = buf.split_off(head_end + 4);
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .with_context(|| format!("{addr} answered no HTTP status"))?;
    let mut response = Response::builder().status(status);
    let mut framing = Framing::UntilEnd;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        match name.as_str() {
            "transfer-encoding" if value.to_ascii_lowercase().contains("chunked") => {
                framing = Framing::Chunked;
            }
            "content-length" => {
                if let Ok(n) = value.parse() {
                    framing = Framing::Length(n);
                }
            }
            // Hop-by-hop: this server frames its own answer.
            "connection" | "transfer-encoding" | "keep-alive" | "date" => {}
            _ => {
                if let (Ok(n), Ok(v)) =
                    (HeaderName::try_from(name.as_str()), HeaderValue::from_str(value))
                {
                    response = response.header(n, v);
                }
            }
        }
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(16);
    tokio::spawn(async move {
        let _guard = guard;
        if let Err(e) = copy_body(stream, rest, framing, &tx).await {
            let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
        }
    });
    response
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .context("building the forwarded answer")
}

/// How an answer's body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    /// After this many bytes.
    Length(u64),
    /// At the chunk of size 0.
    Chunked,
    /// When the connection closes.
    UntilEnd,
}

/// Copies the body after the head (`buf` holds what was read past it) into `tx`, until it
/// ends or the receiver is gone.
async fn copy_body(
    mut stream: TcpStream,
    mut buf: Vec<u8>,
    framing: Framing,
    tx: &tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) -> Result<()> {
    let mut left = match framing {
        Framing::Chunked => return copy_chunked(stream, buf, tx).await,
        Framing::Length(n) => Some(n),
        Framing::UntilEnd => None,
    };
    loop {
        if !buf.is_empty() {
            let take = left.map_or(buf.len(), |l| buf.len().min(l as usize));
            let chunk: Vec<u8> = buf.drain(..take).collect();
            left = left.map(|l| l - take as u64);
            if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                return Ok(());
            }
        }
        if left == Some(0) {
            return Ok(());
        }
        if read_more(&mut stream, &mut buf).await? == 0 {
            if let Some(left) = left {
                bail!("the model's deployment closed the answer {left} bytes short");
            }
            return Ok(());
        }
    }
}

/// [`copy_body`] of a chunked answer.
async fn copy_chunked(
    mut stream: TcpStream,
    mut buf: Vec<u8>,
    tx: &tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) -> Result<()> {
    loop {
        // One chunk: its size in hex (extensions after `;`), CRLF, the data, CRLF.
        let line_end = loop {
            if let Some(at) = find(&buf, b"\r\n") {
                break at;
            }
            if read_more(&mut stream, &mut buf).await? == 0 {
                bail!("the model's deployment closed a chunked answer before its end");
            }
        };
        let size_text = String::from_utf8_lossy(&buf[..line_end]).into_owned();
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .with_context(|| format!("a chunk size `{size_text}` that is not hexadecimal"))?;
        if size == 0 {
            return Ok(());
        }
        while buf.len() < line_end + 2 + size + 2 {
            if read_more(&mut stream, &mut buf).await? == 0 {
                bail!("the model's deployment closed a chunked answer inside a chunk");
            }
        }
        let chunk = Bytes::copy_from_slice(&buf[line_end + 2..line_end + 2 + size]);
        buf.drain(..line_end + 2 + size + 2);
        if tx.send(Ok(chunk)).await.is_err() {
            return Ok(());
        }
    }
}

/// Reads what the stream has into `buf` (at most [`READ_TIMEOUT`] of waiting); 0 at its end.
async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Result<usize> {
    let mut chunk = [0u8; 16 << 10];
    let n = tokio::time::timeout(READ_TIMEOUT, stream.read(&mut chunk))
        .await
        .map_err(|_| anyhow::anyhow!("the model's deployment sent nothing for {READ_TIMEOUT:?}"))?
        .context("reading the model's answer")?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

/// Where `needle` first occurs in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
