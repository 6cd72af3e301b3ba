//! The error type of the tensor crate.

/// Everything that can go wrong in a kernel, a tensor operation or an arena.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A collective call of a kernel (an all-reduce) failed.
    #[error(transparent)]
    Collective(#[from] collectives::Error),
    /// Shapes of kernel arguments do not agree.
    #[error("shape mismatch in {op}: {message}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What disagrees.
        message: String,
    },
    /// A token id is outside the vocabulary.
    #[error("token id {id} at index {index} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Its index in the input.
        index: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A thread pool could not be built.
    #[error("building a thread pool with {threads} threads: {message}")]
    ThreadPool {
        /// Requested threads.
        threads: usize,
        /// The error.
        message: String,
    },
    /// Copying a tensor from its device to the host failed: the device is unusable and the
    /// data is lost with it.
    #[error("copying a tensor from {device} to the host failed: {reason}")]
    DeviceCopy {
        /// The device the data lived on.
        device: mesh::Device,
        /// What the driver said.
        reason: String,
    },
    /// The backend is compiled in but cannot run here.
    #[error("{backend} backend unavailable: {reason}")]
    BackendUnavailable {
        /// The backend.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// Arena memory for weights or a KV cache could not be provided (see [`crate::Arena`]).
    #[error("arena allocation of {bytes} bytes: {source}")]
    Arena {
        /// The bytes asked for.
        bytes: usize,
        /// Why the arena could not provide them.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Memory of one device was given to the backend of another.
    #[error("{op}: memory of {got} given to the backend of {want}")]
    WrongDevice {
        /// The operation.
        op: String,
        /// Where the memory lives.
        got: mesh::Device,
        /// The backend's device.
        want: mesh::Device,
    },
    /// The requested backend is not compiled into this build.
    #[error("backend not compiled in: rebuild with feature `{feature}`")]
    NotCompiledWith {
        /// The cargo feature that enables it.
        feature: &'static str,
    },
}

/// The result type of the tensor crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A [`Error::Shape`] of `op`.
    pub fn shape(op: &'static str, message: impl Into<String>) -> Self {
        Error::Shape { op, message: message.into() }
    }
}
