//! An in-process transport: the same frames as [`super::tcp`] over `std::sync::mpsc`
//! channels, with fault injection (failed sends, lost frames, closed peers), so the protocol
//! runs on real threads in unit tests.

use super::{CoordinatorLink, Incoming, LinkError, PeerLink};
use crate::sleep::message::{Message, Phase, Received, Status, Undecodable};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A fault armed on a [`Faults`] set. Each fires once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Sending a request of `phase` to `rank` fails.
    FailSend {
        /// The peer.
        rank: usize,
        /// The request's phase.
        phase: Phase,
    },
    /// The ACK `rank` sends for `phase` is lost.
    DropAck {
        /// The peer.
        rank: usize,
        /// The ACK's phase.
        phase: Phase,
    },
    /// Before its ACK for `phase`, `rank` sends an extra ACK of the same phase with this
    /// (stale) operation id.
    StaleAck {
        /// The peer.
        rank: usize,
        /// The ACK's phase.
        phase: Phase,
        /// The stale operation id.
        op_id: u64,
    },
    /// Before its ACK for `phase`, `rank` sends a failed ACK of the same operation that says
    /// it answers `sent_as`.
    WrongPhaseAck {
        /// The peer.
        rank: usize,
        /// The ACK's phase.
        phase: Phase,
        /// The phase the extra ACK claims.
        sent_as: Phase,
    },
    /// The ACK `rank` sends for `phase` is held back until [`Faults::deliver_held`].
    HoldAck {
        /// The peer.
        rank: usize,
        /// The ACK's phase.
        phase: Phase,
    },
    /// The request of `phase` reaches `rank` whole but undecodable (its op id and phase
    /// still readable).
    Garble {
        /// The peer.
        rank: usize,
        /// The request's phase.
        phase: Phase,
    },
}

impl Fault {
    /// The peer and phase of an ACK this fault acts on, if it acts on ACKs.
    fn ack(&self) -> Option<(usize, Phase)> {
        match *self {
            Fault::DropAck { rank, phase }
            | Fault::StaleAck { rank, phase, .. }
            | Fault::WrongPhaseAck { rank, phase, .. }
            | Fault::HoldAck { rank, phase } => Some((rank, phase)),
            Fault::FailSend { .. } | Fault::Garble { .. } => None,
        }
    }
}

/// An ACK held back by [`Fault::HoldAck`], with the queue it goes to.
type HeldAck = (Sender<Incoming>, Incoming);

/// The faults armed on one in-memory world, shared by both ends, and the ACKs held back.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    armed: Arc<Mutex<Vec<Fault>>>,
    held: Arc<Mutex<Vec<HeldAck>>>,
}

impl Faults {
    /// Arms `fault`.
    pub fn arm(&self, fault: Fault) {
        self.armed.lock().unwrap_or_else(|e| e.into_inner()).push(fault);
    }

    /// Delivers the ACKs [`Fault::HoldAck`] held back, in the order they were sent; how many.
    pub fn deliver_held(&self) -> usize {
        let held = std::mem::take(&mut *self.held.lock().unwrap_or_else(|e| e.into_inner()));
        let n = held.len();
        for (to, frame) in held {
            let _ = to.send(frame);
        }
        n
    }

    /// The number of ACKs held back now.
    pub fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn take(&self, pred: impl Fn(&Fault) -> bool) -> Option<Fault> {
        let mut v = self.armed.lock().unwrap_or_else(|e| e.into_inner());
        let i = v.iter().position(pred)?;
        Some(v.remove(i))
    }

    /// Takes the first armed fault that acts on this ACK of `rank` and is of `kind`.
    fn take_ack(&self, rank: usize, msg: &Message, kind: fn(&Fault) -> bool) -> Option<Fault> {
        if msg.status == Status::Request {
            return None;
        }
        self.take(|f| kind(f) && f.ack() == Some((rank, msg.phase)))
    }
}

/// Rank 0's end of an in-memory world.
#[derive(Debug)]
pub struct MemoryCoordinator {
    to_peer: HashMap<usize, Sender<Received>>,
    from_peers: Mutex<Receiver<Incoming>>,
    faults: Faults,
}

/// A peer's end of an in-memory world.
#[derive(Debug)]
pub struct MemoryPeer {
    rank: usize,
    from_coordinator: Receiver<Received>,
    to_coordinator: Sender<Incoming>,
    faults: Faults,
}

impl MemoryPeer {
    /// This peer's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl Drop for MemoryPeer {
    fn drop(&mut self) {
        // A peer that goes away closes its connection, as a dead process would.
        let _ = self.to_coordinator.send(Incoming::Closed {
            rank: self.rank,
            reason: "peer closed the in-memory channel".into(),
        });
    }
}

/// A world of `world` ranks: rank 0's end and one end per peer (ranks 1..world).
pub fn world(world: usize, faults: Faults) -> (MemoryCoordinator, Vec<MemoryPeer>) {
    let (up_tx, up_rx) = channel();
    let mut to_peer = HashMap::new();
    let mut peers = Vec::new();
    for rank in 1..world {
        let (tx, rx) = channel();
        to_peer.insert(rank, tx);
        peers.push(MemoryPeer {
            rank,
            from_coordinator: rx,
            to_coordinator: up_tx.clone(),
            faults: faults.clone(),
        });
    }
    (MemoryCoordinator { to_peer, from_peers: Mutex::new(up_rx), faults: faults.clone() }, peers)
}

impl CoordinatorLink for MemoryCoordinator {
    fn peers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.to_peer.keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn send(&self, rank: usize, msg: &Message) -> Result<(), LinkError> {
        if self
            .faults
            .take(|f| matches!(f, Fault::FailSend { rank: r, phase } if *r == rank && *phase == msg.phase))
            .is_some()
        {
            return Err(LinkError::Injected { phase: msg.phase, rank });
        }
        let garbled = self
            .faults
            .take(|f| matches!(f, Fault::Garble { rank: r, phase } if *r == rank && *phase == msg.phase))
            .is_some();
        let frame = if garbled {
            Received::Undecodable(Undecodable {
                op_id: Some(msg.op_id),
                phase: Some(msg.phase),
                reason: "undecodable frame (injected)".into(),
            })
        } else {
            Received::Frame(Box::new(msg.clone()))
        };
        let tx = self.to_peer.get(&rank).ok_or(LinkError::UnknownPeer { rank })?;
        tx.send(frame).map_err(|_| LinkError::Closed { rank })
    }

    fn recv(&self, deadline: Instant) -> Option<Incoming> {
        let rx = self.from_peers.lock().unwrap_or_else(|e| e.into_inner());
        let wait = deadline.saturating_duration_since(Instant::now());
        // A disconnected queue means every peer end is gone: nothing more will come.
        rx.recv_timeout(wait).ok()
    }
}

impl PeerLink for MemoryPeer {
    fn recv(&mut self, deadline: Instant) -> Result<Option<Received>, LinkError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.from_coordinator.recv_timeout(wait) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(LinkError::Closed { rank: 0 }),
        }
    }

    fn send(&mut self, msg: &Message) -> Result<(), LinkError> {
        let rank = self.rank;
        let faults = &self.faults;
        let extra = |mut m: Message, error: &str| {
            m.status = Status::Failed;
            m.receipt = None;
            m.error = Some(error.into());
            Incoming::Frame { rank, msg: Box::new(m) }
        };
        if let Some(Fault::StaleAck { op_id, .. }) =
            faults.take_ack(rank, msg, |f| matches!(f, Fault::StaleAck { .. }))
        {
            let mut stale = msg.clone();
            stale.op_id = op_id;
            let _ = self.to_coordinator.send(extra(stale, "stale ack"));
        }
        if let Some(Fault::WrongPhaseAck { sent_as, .. }) =
            faults.take_ack(rank, msg, |f| matches!(f, Fault::WrongPhaseAck { .. }))
        {
            let mut wrong = msg.clone();
            wrong.phase = sent_as;
            let _ = self.to_coordinator.send(extra(wrong, "an ack of the wrong phase"));
        }
        if faults.take_ack(rank, msg, |f| matches!(f, Fault::DropAck { .. })).is_some() {
            return Ok(());
        }
        let frame = Incoming::Frame { rank, msg: Box::new(msg.clone()) };
        if faults.take_ack(rank, msg, |f| matches!(f, Fault::HoldAck { .. })).is_some() {
            let held = (self.to_coordinator.clone(), frame);
            faults.held.lock().unwrap_or_else(|e| e.into_inner()).push(held);
            return Ok(());
        }
        self.to_coordinator.send(frame).map_err(|_| LinkError::Closed { rank: 0 })
    }
}
