//! The control channel between rank 0 and its peers, as two traits: [`CoordinatorLink`]
//! (rank 0's end: send to any peer, receive from all of them through one queue) and
//! [`PeerLink`] (a peer's end). [`tcp`] is the real transport; [`memory`] moves the same
//! frames over in-process channels, with fault injection, for tests of the protocol with real
//! threads.
//!
//! Both ends are separate from the data plane and from the step agreement: a missed ACK here
//! never poisons a communicator the model uses.

pub mod memory;
pub mod tcp;

use super::message::{Message, Phase, Received};
use std::time::Instant;

/// A failed use of the control channel, naming the other end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// No connection to that rank exists.
    #[error("no peer rank {rank}")]
    UnknownPeer {
        /// The rank asked for.
        rank: usize,
    },
    /// A frame could not be written.
    #[error("send {phase}{} to rank {rank}: {source}", if *ack { " ack" } else { "" })]
    Write {
        /// The phase of the frame.
        phase: Phase,
        /// Whether it was a peer's ACK (else rank 0's request).
        ack: bool,
        /// The receiving rank.
        rank: usize,
        /// The socket's error.
        source: std::io::Error,
    },
    /// The connection to `rank` closed or broke while reading.
    #[error("connection to rank {rank}: {source}")]
    Read {
        /// The other end.
        rank: usize,
        /// What the reader saw.
        source: ReadError,
    },
    /// The other end of an in-process channel is gone.
    #[error("rank {rank} closed the in-memory channel")]
    Closed {
        /// The other end.
        rank: usize,
    },
    /// A send failed by an injected fault (tests of the protocol).
    #[error("send of {phase} to rank {rank} failed (injected)")]
    Injected {
        /// The phase of the frame.
        phase: Phase,
        /// The receiving rank.
        rank: usize,
    },
}

/// Why reading frames from a connection stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The peer closed the connection.
    #[error("connection closed")]
    Closed,
    /// A length prefix beyond the largest frame: the stream is corrupt.
    #[error("frame of {len} bytes exceeds {max}: corrupt stream")]
    Oversized {
        /// The length read.
        len: usize,
        /// The largest frame.
        max: usize,
    },
    /// The socket failed.
    #[error("read failed: {0}")]
    Io(#[from] std::io::Error),
}

/// What rank 0 receives from its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A frame from `rank`.
    Frame {
        /// The sending peer.
        rank: usize,
        /// The frame (boxed: a receipt makes it far larger than the other variant).
        msg: Box<Message>,
    },
    /// The connection to `rank` closed or broke; nothing more will come from it.
    Closed {
        /// The peer.
        rank: usize,
        /// Why, as the transport saw it.
        reason: String,
    },
}

/// Rank 0's end of the control channel.
pub trait CoordinatorLink: Send {
    /// The peers (every rank but 0), in rank order.
    fn peers(&self) -> Vec<usize>;

    /// Sends `msg` to `rank` without waiting for an answer.
    ///
    /// # Errors
    /// A [`LinkError`] naming `rank` when the frame cannot be written (closed connection,
    /// write deadline passed, injected fault).
    fn send(&self, rank: usize, msg: &Message) -> Result<(), LinkError>;

    /// The next frame or closed connection from any peer, or `None` once `deadline` passed.
    fn recv(&self, deadline: Instant) -> Option<Incoming>;
}

/// A peer's end of the control channel.
pub trait PeerLink: Send {
    /// The next frame from rank 0 (decoded or not), or `Ok(None)` once `deadline` passed.
    ///
    /// # Errors
    /// A [`LinkError`] when the connection to rank 0 closed or broke.
    fn recv(&mut self, deadline: Instant) -> Result<Option<Received>, LinkError>;

    /// Sends an ACK to rank 0.
    ///
    /// # Errors
    /// A [`LinkError`] when the frame cannot be written.
    fn send(&mut self, msg: &Message) -> Result<(), LinkError>;
}
