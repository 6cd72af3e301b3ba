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
    /// Shapes of kernel arguments do not agree.
    #[error("shape mismatch in {op}: {message}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What disagrees.
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
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template is missing or failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A thread pool could not be built.
    #[error("building a thread pool with {threads} threads: {message}")]
    ThreadPool {
        /// Requested threads.
        threads: usize,
        /// The error.
        message: String,
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

/// The result type of the layers crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn shape(op: &'static str, message: impl Into<String>) -> Self {
        Error::Shape { op, message: message.into() }
    }

    pub(crate) fn tensor(name: &str, message: impl Into<String>) -> Self {
        Error::Tensor { name: name.to_owned(), message: message.into() }
    }

    pub(crate) fn metadata(key: &str, message: impl Into<String>) -> Self {
        Error::Metadata { key: key.to_owned(), message: message.into() }
    }
}
