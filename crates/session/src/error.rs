//! Errors of the session engine, each naming the rank, the epoch (session number), the step
//! and the phase or control operation it happened in.

/// Result of a session call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error type of user-supplied parts (models, factories, sinks, tokenizers).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the session crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A control collective failed (timeout, dead or failed peer, mismatch).
    #[error("{op} at epoch {epoch} step {step} (rank {rank}): {source}")]
    Collective {
        /// The control operation (`admission`, `confirmation`, `plan broadcast`...).
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The session number.
        epoch: u64,
        /// The step this rank was at.
        step: u64,
        /// The communicator's error, naming the peer at fault.
        #[source]
        source: Box<collectives::Error>,
    },
    /// Another rank reported a failure through the step agreement; its own error is the
    /// original one.
    #[error(
        "{op} at epoch {epoch} step {step} (rank {rank}): another rank failed: rank {peer} reported a failure"
    )]
    PeerFailed {
        /// The control operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The session number.
        epoch: u64,
        /// The step.
        step: u64,
        /// The rank that failed.
        peer: usize,
    },
    /// Ranks failed, each after a peer (a data-group collective timed out or was poisoned on
    /// every one of them), and none reported a failure of its own: the failing ranks' errors
    /// name whom they blamed.
    #[error(
        "{op} at epoch {epoch} step {step} (rank {rank}): other ranks failed, each on a collective with a peer; none reported a failure of its own (see their errors)"
    )]
    PeersFailed {
        /// The control operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The session number.
        epoch: u64,
        /// The step.
        step: u64,
    },
    /// Ranks disagree on the epoch or step: a desynchronized job, never silently continued.
    #[error("{op} at epoch {epoch} step {step} (rank {rank}): ranks disagree: {detail}")]
    Desync {
        /// The control operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// This rank's session number.
        epoch: u64,
        /// This rank's step.
        step: u64,
        /// What differs.
        detail: String,
    },
    /// A control message does not decode.
    #[error(
        "{op} at epoch {epoch} step {step} (rank {rank}): malformed control message: {reason}"
    )]
    Protocol {
        /// The control operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The session number.
        epoch: u64,
        /// The step.
        step: u64,
        /// What is wrong.
        reason: String,
    },
    /// The model failed (building it, preparing a step or running one).
    #[error("{phase} at epoch {epoch} step {step} (rank {rank}): {source}")]
    Model {
        /// `session init`, `prepare` or `step`.
        phase: &'static str,
        /// This rank.
        rank: usize,
        /// The session number.
        epoch: u64,
        /// The step.
        step: u64,
        /// The model's error.
        #[source]
        source: BoxError,
    },
    /// A failpoint fired (feature `failpoints`).
    #[error("{phase} at epoch {epoch} step {step} (rank {rank}): {source}")]
    Injected {
        /// The phase the failpoint sits in.
        phase: &'static str,
        /// This rank.
        rank: usize,
        /// The session number.
        epoch: u64,
        /// The step.
        step: u64,
        /// The failpoint.
        #[source]
        source: mesh::failpoint::Injected,
    },
    /// Rank 0's output or metrics sink failed.
    #[error("{what} at epoch {epoch} step {step} (rank 0): {source}")]
    Sink {
        /// `output sink` or `metrics sink`.
        what: &'static str,
        /// The session number.
        epoch: u64,
        /// The step.
        step: u64,
        /// The sink's error.
        #[source]
        source: BoxError,
    },
    /// Rank 0's tokenizer failed on a request.
    #[error("tokenizer at epoch {epoch} (rank 0), request {request}: {source}")]
    Codec {
        /// The session number.
        epoch: u64,
        /// The request.
        request: u64,
        /// The tokenizer's error.
        #[source]
        source: BoxError,
    },
    /// Something only rank 0 may own was handed to a worker.
    #[error("rank {rank} is a worker: workers own no {what}, only rank 0 does")]
    WorkerOwnsNo {
        /// This rank.
        rank: usize,
        /// What was offered (`output sink`, `metrics sink`, `tokenizer`).
        what: &'static str,
    },
    /// A role was built on the wrong rank.
    #[error("a {role} runs on {expected}, this is rank {rank}")]
    WrongRole {
        /// `leader` or `worker`.
        role: &'static str,
        /// Which ranks the role runs on.
        expected: &'static str,
        /// This rank.
        rank: usize,
    },
    /// The engine already ran; its process groups are shut down or dropped.
    #[error("the engine of rank {rank} already ran; its process groups are gone")]
    Finished {
        /// This rank.
        rank: usize,
    },
    /// Coordinated shutdown failed after a successful run.
    #[error("coordinated shutdown (rank {rank}): {source}")]
    Shutdown {
        /// This rank.
        rank: usize,
        /// The store barrier's error.
        #[source]
        source: Box<collectives::Error>,
    },
}

impl Error {
    /// Whether every peer already knows of this failure: it came through the control group
    /// itself (the communicator told the peers, or they saw the same disagreement), or it is
    /// another rank's failure. A rank announces only failures that are not known yet.
    pub fn known_to_peers(&self) -> bool {
        matches!(
            self,
            Error::Collective { .. }
                | Error::Desync { .. }
                | Error::PeerFailed { .. }
                | Error::PeersFailed { .. }
                | Error::Finished { .. }
        )
    }

    /// Whether this rank's failure is the consequence of another rank's: the model failed on
    /// a data-group collective that blames a peer (it failed, died, closed or hung).
    ///
    /// The collective's error is looked for along the model error's whole source chain: a
    /// sharded model wraps it (a step's error, then `layers::Error::Collective`).
    pub fn caused_by_peer(&self) -> bool {
        let Error::Model { source, .. } = self else { return false };
        collective_in(source.as_ref())
            .is_some_and(|e| e.peer().is_some() || matches!(e, collectives::Error::Poisoned { .. }))
    }
}

/// The first collectives error along `e`'s source chain, `e` included. The collective
/// variants of `layers::Error` and `tensor::Error` are transparent (their `source()` skips
/// the collectives error), so those are asked.
fn collective_in<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a collectives::Error> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(c) = e.downcast_ref::<collectives::Error>() {
            return Some(c);
        }
        if let Some(c) = e.downcast_ref::<layers::Error>().and_then(layers::Error::collective) {
            return Some(c);
        }
        if let Some(tensor::Error::Collective(c)) = e.downcast_ref::<tensor::Error>() {
            return Some(c);
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_error(source: BoxError) -> Error {
        Error::Model { phase: "step", rank: 1, epoch: 0, step: 2, source }
    }

    /// A sequence step's error around a layers error around a collectives error, as the
    /// sharded model reports a collective that failed inside its forward pass.
    #[derive(Debug, thiserror::Error)]
    #[error("step 2: {source}")]
    struct Wrapped {
        source: layers::Error,
    }

    #[test]
    fn a_peer_blamed_deep_in_the_model_errors_chain_makes_the_failure_secondary() {
        let at = collectives::Site {
            op: collectives::Op::AllReduce,
            group: "tp[cp=0]".into(),
            rank: 1,
            size: 2,
        };
        let dead = || collectives::Error::PeerDied {
            at: at.clone(),
            peer: 0,
            pid: 4242,
            elapsed: std::time::Duration::from_millis(30),
        };
        assert!(model_error(Box::new(dead())).caused_by_peer());
        assert!(model_error(Box::new(layers::Error::Collective(dead()))).caused_by_peer());
        let wrapped = Wrapped { source: layers::Error::Collective(dead()) };
        assert!(model_error(Box::new(wrapped)).caused_by_peer());
        // A kernel's all-reduce (the tensor crate's error inside the layers one).
        let kernel = Wrapped { source: tensor::Error::Collective(dead()).into() };
        assert!(model_error(Box::new(kernel)).caused_by_peer());
        // A failure of the model's own is the origin.
        assert!(!model_error("the counting model broke".into()).caused_by_peer());
        let own = Wrapped { source: tensor::Error::shape("forward", "no sequences").into() };
        assert!(!model_error(Box::new(own)).caused_by_peer());
    }
}
