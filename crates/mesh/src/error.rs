//! The error type of the mesh crate: every failure names what was wrong and where.

use std::net::SocketAddr;
use std::time::Duration;

use crate::failpoint::Injected;

/// Everything that can go wrong while planning a mesh, reading the rendezvous environment,
/// talking to the store or choosing a device.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The requested mesh or token split cannot be built (`plan_mesh`, `TokenShard`, coordinates).
    #[error("{reason}")]
    InvalidMesh {
        /// What is wrong, with the numbers involved.
        reason: String,
    },

    /// A required environment variable is not set.
    #[error("environment variable {var} is not set: {why}")]
    MissingEnv {
        /// The variable.
        var: &'static str,
        /// Why it is needed.
        why: String,
    },

    /// An environment variable is set to a value that cannot be used.
    #[error("environment variable {var}={value:?}: {reason}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value, as set.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Two launchers' variables describe the same quantity differently.
    #[error(
        "conflicting launcher environment: {first}={first_value} but {second}={second_value}; \
         unset the variables of the launcher that is not in charge"
    )]
    EnvConflict {
        /// The variable that takes precedence.
        first: &'static str,
        /// Its value.
        first_value: usize,
        /// The variable that disagrees.
        second: &'static str,
        /// Its value.
        second_value: usize,
    },

    /// A string does not name a known backend or device.
    #[error("unknown {what} {value:?}: expected {expected}")]
    Parse {
        /// What was being parsed (`backend`, `device`).
        what: &'static str,
        /// The string given.
        value: String,
        /// The accepted forms.
        expected: &'static str,
    },

    /// A backend was chosen for an axis where it cannot work.
    #[error("{axis} axis: backend {backend} {reason}")]
    InvalidBackend {
        /// The axis (`tp`, `cp` or `control`).
        axis: &'static str,
        /// The backend chosen for it.
        backend: crate::CommBackend,
        /// Why it cannot work there.
        reason: String,
    },

    /// A backend or device exists in this build but cannot be used on this machine.
    #[error("{backend} is unavailable: {reason}")]
    BackendUnavailable {
        /// The backend or library (`cuda`, `nccl`).
        backend: &'static str,
        /// Why.
        reason: String,
    },

    /// The operation needs a cargo feature this build does not have.
    #[error("tpctl-mesh was built without the feature `{feature}`")]
    NotCompiledWith {
        /// The missing feature.
        feature: &'static str,
    },

    /// The requested device cannot be used.
    #[error("{reason}")]
    InvalidDevice {
        /// What is wrong, naming the device and where it came from.
        reason: String,
    },

    /// The store server could not listen on its address.
    #[error("store server cannot listen on {addr}: {source}")]
    StoreBind {
        /// The address asked for, as given.
        addr: String,
        /// The socket error.
        source: std::io::Error,
    },

    /// No store server answered at the address before the deadline.
    #[error("store at {addr} did not accept a connection within {elapsed:.1?}: {source}")]
    StoreConnect {
        /// The address tried, as given.
        addr: String,
        /// How long the client kept trying.
        elapsed: Duration,
        /// The last connection error.
        source: std::io::Error,
    },

    /// The connection to the store broke or the server stopped answering.
    #[error("store {op} at {addr} failed after {elapsed:.1?}: {source}")]
    StoreUnreachable {
        /// The server address.
        addr: SocketAddr,
        /// The call that failed, with its key.
        op: String,
        /// Time spent in the call.
        elapsed: Duration,
        /// The socket error (end of stream when the server closed the connection).
        source: std::io::Error,
    },

    /// `wait` or `barrier` gave up before every key existed.
    #[error("store {op} at {addr}: {missing} still missing after {elapsed:.1?}")]
    StoreTimeout {
        /// The server address.
        addr: SocketAddr,
        /// The call that timed out.
        op: String,
        /// What was still missing (keys, or ranks of a barrier).
        missing: String,
        /// Time spent waiting.
        elapsed: Duration,
    },

    /// The server refused a request, or a reply did not decode.
    #[error("store {op} at {addr}: {reason}")]
    StoreProtocol {
        /// The server address.
        addr: SocketAddr,
        /// The call, with its key.
        op: String,
        /// What the server said, or what did not decode.
        reason: String,
    },

    /// A failpoint fired (feature `failpoints`).
    #[error(transparent)]
    Injected(#[from] Injected),
}

/// The result type of the mesh crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Why a backend cannot be used, in words, for a crate that reports it under its own
    /// error (the reason of [`Error::BackendUnavailable`], else the whole message).
    pub fn reason(&self) -> String {
        match self {
            Error::BackendUnavailable { reason, .. } => reason.clone(),
            other => other.to_string(),
        }
    }

    pub(crate) fn mesh(reason: impl Into<String>) -> Self {
        Error::InvalidMesh { reason: reason.into() }
    }
}
