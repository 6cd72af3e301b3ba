//! A minimal HTTP/1.1 client for the end-to-end tests: one exchange per connection
//! (`Connection: close`) over loopback, with a deadline on every read and write.

use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// How long a read or write of one exchange may block.
const DEADLINE: Duration = Duration::from_secs(180);

/// An HTTP answer.
#[derive(Debug)]
pub struct Reply {
    /// The status code (0 when the answer had none).
    pub status: u16,
    /// The status line and headers.
    pub head: String,
    /// The body, de-chunked.
    pub body: String,
}

impl Reply {
    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// The `data:` payloads of an SSE body.
    pub fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.trim().to_owned())
            .collect()
    }
}

/// One exchange: `method path` with `headers`, and `body` as JSON when posting.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Reply {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or_default();
    if method == "POST" {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    head.push_str("\r\n");
    let mut raw = head.into_bytes();
    raw.extend_from_slice(body);
    exchange(addr, &raw)
}

/// Sends `raw`, reads the answer until the server closes.
pub fn exchange(addr: &str, raw: &[u8]) -> Reply {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    stream.set_write_timeout(Some(DEADLINE)).unwrap();
    // A server that refuses early may close before reading everything: answer first.
    let _ = stream.write_all(raw);
    let mut bytes = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if bytes.is_empty() => panic!("reading from {addr}: {e}"),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) =
        text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked { dechunk(body) } else { body.to_owned() };
    Reply { status, head: head.to_owned(), body }
}

/// The payload of a chunked body.
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not token ids: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}
