//! The store's wire format: length-prefixed binary frames over TCP.
//!
//! A frame is a little-endian `u32` payload length followed by the payload. A request payload is
//! an op byte and its arguments; a reply payload is a reply byte and its values. Strings and byte
//! strings are a `u32` length and the bytes. One request is answered by exactly one reply, in
//! order, so a client needs no request ids.

use std::io::{self, Read, Write};

/// Frames larger than this are refused, so a corrupt length cannot make a peer allocate
/// gigabytes. Store values are small (addresses, ids, counters).
pub(crate) const MAX_FRAME: usize = 64 << 20;

/// A request from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    Set { key: String, value: Vec<u8> },
    Get { key: String },
    Wait { keys: Vec<String>, timeout_ms: u64 },
    Add { key: String, delta: i64 },
    Delete { key: String },
}

/// The server's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    Ok,
    Value(Option<Vec<u8>>),
    Values(Vec<Vec<u8>>),
    /// `wait` gave up; these keys were still missing.
    Missing(Vec<String>),
    Int(i64),
    Bool(bool),
    /// The server refused the request (for example `add` on a value that is not a number).
    Refused(String),
}

mod tag {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const WAIT: u8 = 3;
    pub const ADD: u8 = 4;
    pub const DELETE: u8 = 5;

    pub const OK: u8 = 100;
    pub const FOUND: u8 = 101;
    pub const NOT_FOUND: u8 = 102;
    pub const VALUES: u8 = 103;
    pub const MISSING: u8 = 104;
    pub const INT: u8 = 105;
    pub const BOOL: u8 = 106;
    pub const REFUSED: u8 = 107;
}

impl Request {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Request::Set { key, value } => {
                w.u8(tag::SET);
                w.bytes(key.as_bytes());
                w.bytes(value);
            }
            Request::Get { key } => {
                w.u8(tag::GET);
                w.bytes(key.as_bytes());
            }
            Request::Wait { keys, timeout_ms } => {
                w.u8(tag::WAIT);
                w.u64(*timeout_ms);
                w.len(keys.len());
                keys.iter().for_each(|k| w.bytes(k.as_bytes()));
            }
            Request::Add { key, delta } => {
                w.u8(tag::ADD);
                w.bytes(key.as_bytes());
                w.u64(*delta as u64);
            }
            Request::Delete { key } => {
                w.u8(tag::DELETE);
                w.bytes(key.as_bytes());
            }
        }
        w.0
    }

    pub(crate) fn decode(payload: &[u8]) -> Result<Request, String> {
        let mut r = Reader { buf: payload, pos: 0 };
        let request = match r.u8()? {
            tag::SET => Request::Set { key: r.string()?, value: r.bytes()?.to_vec() },
            tag::GET => Request::Get { key: r.string()? },
            tag::WAIT => {
                let timeout_ms = r.u64()?;
                let n = r.len()?;
                let keys = (0..n).map(|_| r.string()).collect::<Result<_, _>>()?;
                Request::Wait { keys, timeout_ms }
            }
            tag::ADD => Request::Add { key: r.string()?, delta: r.u64()? as i64 },
            tag::DELETE => Request::Delete { key: r.string()? },
            other => return Err(format!("unknown request tag {other}")),
        };
        r.end()?;
        Ok(request)
    }
}

impl Reply {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Reply::Ok => w.u8(tag::OK),
            Reply::Value(Some(v)) => {
                w.u8(tag::FOUND);
                w.bytes(v);
            }
            Reply::Value(None) => w.u8(tag::NOT_FOUND),
            Reply::Values(values) => {
                w.u8(tag::VALUES);
                w.len(values.len());
                values.iter().for_each(|v| w.bytes(v));
            }
            Reply::Missing(keys) => {
                w.u8(tag::MISSING);
                w.len(keys.len());
                keys.iter().for_each(|k| w.bytes(k.as_bytes()));
            }
            Reply::Int(n) => {
                w.u8(tag::INT);
                w.u64(*n as u64);
            }
            Reply::Bool(b) => {
                w.u8(tag::BOOL);
                w.u8(u8::from(*b));
            }
            Reply::Refused(why) => {
                w.u8(tag::REFUSED);
                w.bytes(why.as_bytes());
            }
        }
        w.0
    }

    pub(crate) fn decode(payload: &[u8]) -> Result<Reply, String> {
        let mut r = Reader { buf: payload, pos: 0 };
        let reply = match r.u8()? {
            tag::OK => Reply::Ok,
            tag::FOUND => Reply::Value(Some(r.bytes()?.to_vec())),
            tag::NOT_FOUND => Reply::Value(None),
            tag::VALUES => {
                let n = r.len()?;
                Reply::Values(
                    (0..n).map(|_| r.bytes().map(<[u8]>::to_vec)).collect::<Result<_, _>>()?,
                )
            }
            tag::MISSING => {
                let n = r.len()?;
                Reply::Missing((0..n).map(|_| r.string()).collect::<Result<_, _>>()?)
            }
            tag::INT => Reply::Int(r.u64()? as i64),
            tag::BOOL => Reply::Bool(r.u8()? != 0),
            tag::REFUSED => Reply::Refused(r.string()?),
            other => return Err(format!("unknown reply tag {other}")),
        };
        r.end()?;
        Ok(reply)
    }
}

/// Writes one frame.
pub(crate) fn write_frame(stream: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len()).ok().filter(|&n| n as usize <= MAX_FRAME).ok_or_else(
        || {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("message of {} bytes exceeds the limit of {MAX_FRAME}", payload.len()),
            )
        },
    )?;
    // One write for header and payload: with TCP_NODELAY two writes would be two packets.
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(payload);
    stream.write_all(&frame)
}

/// Reads one frame; end of stream before the first byte is `UnexpectedEof` too.
pub(crate) fn read_frame(stream: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("peer announced a message of {len} bytes, over the limit of {MAX_FRAME}"),
        ));
    }
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload)?;
    Ok(payload)
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        // Frames are capped far below 4 GiB, so every length fits.
        self.0.extend_from_slice(&(n as u32).to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.0.extend_from_slice(b);
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            format!(
                "message truncated: needed {n} bytes at offset {} of {}",
                self.pos,
                self.buf.len()
            )
        })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn len(&mut self) -> Result<usize, String> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b) as usize)
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.len()?;
        self.take(n)
    }
    fn string(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "key is not UTF-8".to_owned())
    }
    fn end(&self) -> Result<(), String> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(format!("{} unexpected bytes after the message", self.buf.len() - self.pos))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let requests = [
            Request::Set { key: "k".into(), value: vec![0, 1, 255] },
            Request::Get { key: "κλειδί".into() },
            Request::Wait { keys: vec!["a".into(), String::new()], timeout_ms: 1234 },
            Request::Wait { keys: vec![], timeout_ms: 0 },
            Request::Add { key: "n".into(), delta: -7 },
            Request::Delete { key: "d".into() },
        ];
        for request in requests {
            assert_eq!(Request::decode(&request.encode()), Ok(request.clone()));
        }
        let replies = [
            Reply::Ok,
            Reply::Value(Some(vec![])),
            Reply::Value(None),
            Reply::Values(vec![vec![1], vec![]]),
            Reply::Missing(vec!["x".into()]),
            Reply::Int(i64::MIN),
            Reply::Bool(true),
            Reply::Refused("no".into()),
        ];
        for reply in replies {
            assert_eq!(Reply::decode(&reply.encode()), Ok(reply.clone()));
        }
    }

    #[test]
    fn malformed_messages_are_refused_by_reason() {
        let set = Request::Set { key: "k".into(), value: vec![1, 2] }.encode();
        for (payload, needle) in [
            (vec![], "truncated"),
            (vec![99], "unknown request tag 99"),
            (set[..set.len() - 1].to_vec(), "truncated"),
            ([set.as_slice(), &[0]].concat(), "1 unexpected bytes"),
            (vec![tag::GET, 1, 0, 0, 0, 0xff], "not UTF-8"),
        ] {
            let err = Request::decode(&payload).unwrap_err();
            assert!(err.contains(needle), "{payload:?}: {err}");
        }
        assert!(Reply::decode(&[7]).unwrap_err().contains("unknown reply tag 7"));
    }

    #[test]
    fn frames_round_trip_and_refuse_oversized_lengths() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"hello").unwrap();
        write_frame(&mut wire, b"").unwrap();
        let mut cursor = io::Cursor::new(wire);
        assert_eq!(read_frame(&mut cursor).unwrap(), b"hello");
        assert_eq!(read_frame(&mut cursor).unwrap(), b"");
        assert_eq!(read_frame(&mut cursor).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);

        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        let err = read_frame(&mut io::Cursor::new(huge.to_vec())).unwrap_err();
        assert!(err.to_string().contains("over the limit"), "{err}");
    }
}
