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

use super::message::{Message, Received};
use std::time::Instant;

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
    /// A message naming `rank` when the frame cannot be written (closed connection, write
    /// deadline passed, injected fault).
    fn send(&self, rank: usize, msg: &Message) -> Result<(), String>;

    /// The next frame or closed connection from any peer, or `None` once `deadline` passed.
    fn recv(&self, deadline: Instant) -> Option<Incoming>;
}

/// A peer's end of the control channel.
pub trait PeerLink: Send {
    /// The next frame from rank 0 (decoded or not), or `Ok(None)` once `deadline` passed.
    ///
    /// # Errors
    /// A message when the connection to rank 0 closed or broke.
    fn recv(&mut self, deadline: Instant) -> Result<Option<Received>, String>;

    /// Sends an ACK to rank 0.
    ///
    /// # Errors
    /// A message when the frame cannot be written.
    fn send(&mut self, msg: &Message) -> Result<(), String>;
}
