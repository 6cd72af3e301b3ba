//! Errors of every communicator, each naming the operation, the group, this rank and the peer.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Result of a collective call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The operation a communicator was running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// Group set-up (joining the segment, connecting peers).
    Setup,
    /// `all_reduce`.
    AllReduce,
    /// `all_gather`.
    AllGather,
    /// `all_gather_uneven`.
    AllGatherUneven,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `broadcast`.
    Broadcast,
    /// `send`.
    Send,
    /// `recv`.
    Recv,
    /// `all_to_all`.
    AllToAll,
    /// `barrier`.
    Barrier,
}

impl Op {
    /// The operation's name as users write it.
    pub const fn name(self) -> &'static str {
        match self {
            Op::Setup => "setup",
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::AllGatherUneven => "all_gather_uneven",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::Send => "send",
            Op::Recv => "recv",
            Op::AllToAll => "all_to_all",
            Op::Barrier => "barrier",
        }
    }

    pub(crate) const fn code(self) -> u32 {
        self as u32 + 1
    }

    pub(crate) fn from_code(code: u32) -> Option<Op> {
        const ALL: [Op; 10] = [
            Op::Setup,
            Op::AllReduce,
            Op::AllGather,
            Op::AllGatherUneven,
            Op::ReduceScatter,
            Op::Broadcast,
            Op::Send,
            Op::Recv,
            Op::AllToAll,
            Op::Barrier,
        ];
        ALL.into_iter().find(|op| op.code() == code)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where an error happened: operation, group and this rank's place in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// The operation.
    pub op: Op,
    /// The group's name, for example `tp[cp=0]`.
    pub group: Arc<str>,
    /// This rank within the group.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {} group (rank {} of {})", self.op, self.group, self.rank, self.size)
    }
}

/// Errors of the collectives crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The deadline passed while peers had not arrived.
    #[error("{at}: timed out after {elapsed:.1?} waiting for {}", ranks(waiting_for))]
    Timeout {
        /// Where.
        at: Site,
        /// Time spent in the call.
        elapsed: Duration,
        /// Group ranks that had not arrived.
        waiting_for: Vec<usize>,
    },
    /// A peer process is gone.
    #[error("{at}: peer rank {peer} died (process {pid} is gone) after {elapsed:.1?}")]
    PeerDied {
        /// Where.
        at: Site,
        /// The dead peer's group rank.
        peer: usize,
        /// Its process id.
        pid: u32,
        /// Time spent in the call.
        elapsed: Duration,
    },
    /// A peer reported its own failure; its error is the original one.
    #[error("{at}: another rank failed (peer rank {peer} reported a failure)")]
    PeerFailed {
        /// Where.
        at: Site,
        /// The failed peer's group rank.
        peer: usize,
    },
    /// A peer closed its connection.
    #[error("{at}: peer rank {peer} closed the connection after {elapsed:.1?}")]
    PeerClosed {
        /// Where.
        at: Site,
        /// The peer's group rank.
        peer: usize,
        /// Time spent in the call.
        elapsed: Duration,
    },
    /// Ranks called different operations or with different arguments.
    #[error("{at}: {what} mismatch: this rank has {mine}, peer rank {peer} has {theirs}")]
    Mismatch {
        /// Where.
        at: Site,
        /// The peer that disagrees.
        peer: usize,
        /// What differs (operation, dtype, bytes, root...).
        what: &'static str,
        /// This rank's value.
        mine: String,
        /// The peer's value.
        theirs: String,
    },
    /// The call's own arguments are wrong; nothing was sent.
    #[error("{at}: {reason}")]
    InvalidArgument {
        /// Where.
        at: Site,
        /// What is wrong.
        reason: String,
    },
    /// The call was aborted through an [`AbortHandle`](crate::AbortHandle).
    #[error("{at}: aborted")]
    Aborted {
        /// Where.
        at: Site,
    },
    /// The communicator's device resources are released for a sleep
    /// ([`DeviceResources`](crate::DeviceResources)); the call was refused before it touched
    /// them, and the communicator works again after their restore.
    #[error("{at}: the group's device resources are released for a sleep (wake it up first)")]
    Released {
        /// Where.
        at: Site,
    },
    /// An earlier call failed; a communicator is not reused after a failure.
    #[error("{at}: communicator is unusable after an earlier failure: {cause}")]
    Poisoned {
        /// Where.
        at: Site,
        /// The first failure.
        cause: String,
    },
    /// A failpoint fired.
    #[error("{at}: {source}")]
    Injected {
        /// Where.
        at: Site,
        /// The failpoint.
        source: mesh::failpoint::Injected,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The mesh, the launcher's environment or the key-value store failed during set-up
    /// (the message names which).
    #[error(transparent)]
    Store(#[from] mesh::Error),
    /// The backend cannot run on this machine.
    #[error("{backend} backend unavailable: {reason}")]
    BackendUnavailable {
        /// The backend.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// An NCCL call failed on this rank (NCCL's own description, and its last error message).
    /// The communicator was aborted.
    #[error("{at}: nccl {call} failed: {reason}")]
    Nccl {
        /// Where.
        at: Site,
        /// The NCCL function.
        call: &'static str,
        /// NCCL's error code and message.
        reason: String,
    },
    /// A CUDA driver call failed on this rank (device, stream, copies of the staging buffer).
    #[error("{at}: cuda {call} failed: {reason}")]
    Cuda {
        /// Where.
        at: Site,
        /// The CUDA call.
        call: &'static str,
        /// The driver's error.
        reason: String,
    },
    /// The backend needs a cargo feature this build lacks.
    #[error("this build has no `{feature}` support: rebuild with `--features {feature}`")]
    NotCompiledWith {
        /// The missing feature.
        feature: &'static str,
    },
}

impl Error {
    /// The peer group rank this error blames, if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Error::PeerDied { peer, .. }
            | Error::PeerFailed { peer, .. }
            | Error::PeerClosed { peer, .. }
            | Error::Mismatch { peer, .. } => Some(*peer),
            Error::Timeout { waiting_for, .. } => waiting_for.first().copied(),
            _ => None,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io { context: context.into(), source }
    }
}

fn ranks(r: &[usize]) -> String {
    match r {
        [one] => format!("peer rank {one}"),
        many => {
            let list: Vec<String> = many.iter().map(usize::to_string).collect();
            format!("peer ranks {}", list.join(", "))
        }
    }
}
