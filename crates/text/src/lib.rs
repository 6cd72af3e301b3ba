//! Text in and out of a model: the tokenizer a checkpoint carries (GGUF metadata giving
//! llama.cpp's ids, or a Hugging Face `tokenizer.json`), streaming detokenization, special
//! tokens, chat templates rendered as Hugging Face's `apply_chat_template` renders them, and
//! the grammars of structured outputs over the vocabulary (`grammar`).
#![forbid(unsafe_code)]

pub mod error;
pub mod grammar;
pub mod tokenizer;

pub use error::{Error, Result};
pub use grammar::{Grammar, GrammarEngine, GrammarMatcher};
pub use tokenizer::{chat, ChatMessage, TextStream, Tokenizer};
