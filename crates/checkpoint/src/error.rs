//! The error type of the checkpoint crate.

use std::path::PathBuf;

/// Everything that can go wrong while finding, opening or reading a checkpoint.
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
    /// A bucket of a weight update does not fit the model it updates.
    #[error("bucket {path}: {message}")]
    Bucket {
        /// The bucket's file.
        path: PathBuf,
        /// What is wrong, naming the tensor.
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
    /// Building a tensor or a quantized matrix from the file's data failed.
    #[error(transparent)]
    Kernel(#[from] tensor::Error),
}

/// The result type of the checkpoint crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A [`Error::Tensor`] naming `name`.
    pub fn tensor(name: &str, message: impl Into<String>) -> Self {
        Error::Tensor { name: name.to_owned(), message: message.into() }
    }

    /// A [`Error::Metadata`] naming `key`.
    pub fn metadata(key: &str, message: impl Into<String>) -> Self {
        Error::Metadata { key: key.to_owned(), message: message.into() }
    }
}
