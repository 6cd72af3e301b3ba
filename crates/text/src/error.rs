//! The error type of the text crate.

/// Everything that can go wrong while loading a tokenizer, encoding, decoding or rendering a
/// chat template.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template is missing or failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A grammar of a structured output does not compile, or its engine failed.
    #[error("{0}")]
    Grammar(String),
    /// The checkpoint the tokenizer comes from could not be read (a file, a metadata key).
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::Error),
}

/// The result type of the text crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn metadata(key: &str, message: impl Into<String>) -> Self {
        Error::Checkpoint(checkpoint::Error::metadata(key, message))
    }

    pub(crate) fn io(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        Error::Checkpoint(checkpoint::Error::Io { what, path: path.to_owned(), source })
    }
}
