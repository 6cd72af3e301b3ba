//! The error type of the layers crate.

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A kernel, a tensor operation or an arena failed.
    #[error(transparent)]
    Kernel(#[from] tensor::Error),
    /// A checkpoint could not be found, opened or read.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::Error),
    /// A collective call of the parallel model failed.
    #[error(transparent)]
    Collective(#[from] collectives::Error),
    /// The mesh or a token shard does not fit.
    #[error(transparent)]
    Mesh(#[from] mesh::Error),
    /// The KV cache has no room for more tokens.
    #[error("kv cache full: {len} of {capacity} positions used, {requested} more requested")]
    CacheFull {
        /// Positions in use.
        len: usize,
        /// Positions available.
        capacity: usize,
        /// Positions requested.
        requested: usize,
    },
    /// Weights offered to a model (`ParallelModel::adopt_weights`) are not another form of
    /// its own.
    #[error("cannot take the new weights: {0}")]
    Mismatch(String),
    /// A tokenizer could not be built or run.
    #[error(transparent)]
    Text(#[from] text::Error),
}

/// The result type of the layers crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The collectives error this is, directly or from a kernel (its variants are transparent,
    /// so `source()` skips it and a chain walk has to ask).
    pub fn collective(&self) -> Option<&collectives::Error> {
        match self {
            Error::Collective(e) | Error::Kernel(tensor::Error::Collective(e)) => Some(e),
            _ => None,
        }
    }

    pub(crate) fn shape(op: &'static str, message: impl Into<String>) -> Self {
        Error::Kernel(tensor::Error::shape(op, message))
    }

    pub(crate) fn tensor(name: &str, message: impl Into<String>) -> Self {
        Error::Checkpoint(checkpoint::Error::tensor(name, message))
    }

    pub(crate) fn io(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        Error::Checkpoint(checkpoint::Error::Io { what, path: path.to_owned(), source })
    }
}
