//! Text in and out of a model: the tokenizer a checkpoint carries (GGUF metadata giving
//! llama.cpp's ids, or a Hugging Face `tokenizer.json`), streaming detokenization, special
//! tokens, and chat templates rendered as Hugging Face's `apply_chat_template` renders them.
#![forbid(unsafe_code)]

pub mod error;
pub mod tokenizer;

pub use error::{Error, Result};
pub use tokenizer::{chat, ChatMessage, TextStream, Tokenizer};
