//! Errors of the sleep/wakeup control plane. A failed operation raises one aggregate error
//! that lists every failing rank with its phase and message, and says what state the
//! deployment was left in.

use super::message::{Action, Phase};
use super::quiesce::QuiesceError;
use super::transport::LinkError;
use std::fmt;

/// Result of a control-plane call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One rank's failure inside an operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// The phase it failed in.
    pub phase: Phase,
    /// What went wrong, in the rank's words.
    pub message: String,
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} ({}): {}", self.rank, self.phase, self.message)
    }
}

/// The state a failed operation left the deployment in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing changed anywhere: the operation was aborted before any memory moved.
    Aborted,
    /// Some ranks changed memory and all of them were rolled back to the previous state.
    RolledBack,
    /// A rollback failed (or a rank's state is unknown): the deployment is stopped.
    FailStop,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Aborted => "aborted before any memory changed",
            Outcome::RolledBack => "every changed rank rolled back",
            Outcome::FailStop => "rollback failed: deployment stopped (fail-stop)",
        })
    }
}

fn list(failures: &[RankFailure]) -> String {
    failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// Errors of the sleep/wakeup control plane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operation failed on one or more ranks; every failing rank is listed.
    #[error("{action} {tags:?} (op {op_id}) failed on {n} rank(s), {outcome}: {list}", n = failures.len(), list = list(failures))]
    Failed {
        /// The operation.
        action: Action,
        /// Its tags.
        tags: Vec<String>,
        /// Its id.
        op_id: u64,
        /// Every rank that failed, in rank order.
        failures: Vec<RankFailure>,
        /// What state the deployment is in now.
        outcome: Outcome,
    },
    /// With `verify`, a rank gave back less than 90% of its tagged bytes; the operation was
    /// rolled back.
    #[error("{action} {tags:?} (op {op_id}) failed verification, {outcome}: {list}", list = list(failures))]
    Verify {
        /// The operation.
        action: Action,
        /// Its tags.
        tags: Vec<String>,
        /// Its id.
        op_id: u64,
        /// Every rank that fell short, with the bytes expected and measured.
        failures: Vec<RankFailure>,
        /// What state the deployment is in now.
        outcome: Outcome,
    },
    /// The deployment failed earlier; no more operations run on it.
    #[error("the deployment is failed ({reason}): {action} refused")]
    DeploymentFailed {
        /// The refused call.
        action: String,
        /// Why it failed.
        reason: String,
    },
    /// A wakeup named a checkpoint while the weights are awake (a caller's mistake: an awake
    /// deployment replaces its weights with a weight update).
    #[error(
        "a wakeup names a checkpoint (model={model}) only while the weights are asleep; awake, \
         replace them with update_weights"
    )]
    WeightsAwake {
        /// The checkpoint named.
        model: String,
    },
    /// Setting up or using the control channel failed.
    #[error("control channel (rank {rank}): {detail}")]
    Channel {
        /// The rank reporting it.
        rank: usize,
        /// What failed, naming the peer.
        detail: String,
    },
    /// The control channel failed under a running listener or operation.
    #[error("control channel (rank {rank}): {source}")]
    Link {
        /// The rank reporting it.
        rank: usize,
        /// What failed, naming the other end.
        source: LinkError,
    },
    /// The engine could not be quiesced.
    #[error("{action} (rank {rank}): quiescing the engine failed: {source}")]
    Quiesce {
        /// The operation.
        action: Action,
        /// The rank.
        rank: usize,
        /// The engine's error.
        source: QuiesceError,
    },
    /// A pause could not quiesce the engine; nothing was paused.
    #[error("pause: quiescing the engine failed: {source}")]
    Pause {
        /// The engine's error.
        source: QuiesceError,
    },
    /// A listener thread or a shutdown did not finish in time.
    #[error("rank {rank}: {what} did not finish within {secs:.1} s")]
    Timeout {
        /// The rank.
        rank: usize,
        /// What was waited for.
        what: String,
        /// The bound.
        secs: f64,
    },
    /// The coordinator told this peer to stop after a failed rollback.
    #[error("rank {rank}: the deployment was stopped by rank 0 (fail-stop) during op {op_id}")]
    FailStop {
        /// This rank.
        rank: usize,
        /// The operation whose rollback failed.
        op_id: u64,
    },
}

impl Error {
    /// The failing ranks of an aggregate error (empty for other errors).
    pub fn failures(&self) -> &[RankFailure] {
        match self {
            Error::Failed { failures, .. } | Error::Verify { failures, .. } => failures,
            _ => &[],
        }
    }

    /// The memory operation that failed, when the error names one.
    pub fn action(&self) -> Option<Action> {
        match self {
            Error::Failed { action, .. }
            | Error::Verify { action, .. }
            | Error::Quiesce { action, .. } => Some(*action),
            _ => None,
        }
    }

    /// The outcome of an aggregate error.
    pub fn outcome(&self) -> Option<Outcome> {
        match self {
            Error::Failed { outcome, .. } | Error::Verify { outcome, .. } => Some(*outcome),
            _ => None,
        }
    }
}
