//! The error type of the layers crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A catalog model could not be fetched or resolved.
    #[error("model `{name}`: {message}")]
    Fetch {
        /// The catalog name (or path) asked for.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// A kernel, a tensor operation or an arena failed.
    #[error(transparent)]
    Kernel(#[from] tensor::Error),
    /// A collective call of the parallel model failed.
    #[error(transparent)]
    Collective(#[from] collectives::Error),
    /// The mesh or a token shard does not fit.
    #[error(transparent)]
    Mesh(#[from] mesh::Error),
    /// A file could not be opened, mapped or read.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done (`opening`, `mapping`, ...).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A GGUF file is malformed.
    #[error("gguf {path} at offset {offset}: {message}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// The byte offset in the file where the problem was found.
        offset: u64,
        /// What is wrong.
        message: String,
    },
    /// A safetensors file is malformed.
    #[error("safetensors {path} at offset {offset}: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The byte offset in the file where the problem was found.
        offset: u64,
        /// What is wrong.
        message: String,
    },
    /// A metadata key is missing or has the wrong type.
    #[error("metadata key `{key}`: {message}")]
    Metadata {
        /// The key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor is missing, has an unexpected shape or an unsupported type.
    #[error("tensor `{name}`: {message}")]
    Tensor {
        /// The tensor name.
        name: String,
        /// What is wrong.
        message: String,
    },
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
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template is missing or failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
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
        Error::Tensor { name: name.to_owned(), message: message.into() }
    }

    pub(crate) fn metadata(key: &str, message: impl Into<String>) -> Self {
        Error::Metadata { key: key.to_owned(), message: message.into() }
    }
}
