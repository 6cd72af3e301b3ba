//! Structured outputs: a [`Grammar`] (a JSON schema, any JSON object, a regular expression, a
//! list of choices or a Lark grammar) compiled over a tokenizer's vocabulary by the llguidance
//! engine ([`GrammarEngine`]) into a per-sequence [`GrammarMatcher`] that says which tokens may
//! come next.
//!
//! The vocabulary is given to the engine as each token's own bytes ([`Tokenizer::token_bytes`]);
//! control tokens (those decoding skips) are marked special, so no grammar's text can produce
//! them, except the end-of-sequence tokens, which a matcher allows once its grammar is complete.
//! JSON is generated compact (no whitespace between tokens of the syntax) unless the schema
//! says otherwise in llguidance's `x-guidance` options: a model then cannot spend its tokens on
//! blank space.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{self, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// What a constrained generation must produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grammar {
    /// A JSON value valid under this JSON schema (its text).
    JsonSchema(String),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this context-free grammar in llguidance's Lark syntax (its `start` rule).
    Lark(String),
}

impl Grammar {
    /// What kind of grammar this is, in the words of the request field that gives it.
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonSchema(_) => "JSON schema",
            Grammar::JsonObject => "JSON object",
            Grammar::Regex(_) => "regex",
            Grammar::Choice(_) => "choice",
            Grammar::Lark(_) => "grammar",
        }
    }

    /// The grammar in llguidance's terms.
    fn top_level(&self) -> Result<TopLevelGrammar> {
        let bad = |msg: String| Error::Grammar(format!("invalid {}: {msg}", self.kind()));
        Ok(match self {
            Grammar::JsonSchema(text) => {
                let mut schema: serde_json::Value =
                    serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
                compact(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::JsonObject => {
                let mut schema = serde_json::json!({"type": "object"});
                compact(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Choice(choices) => {
                if choices.is_empty() {
                    return Err(bad("the list of choices is empty".into()));
                }
                // Lark reads its string literals as JSON strings.
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::Value::String(c.clone()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        })
    }
}

/// Asks for JSON without free whitespace, unless the schema sets llguidance's options itself.
fn compact(schema: &mut serde_json::Value) {
    if let Some(object) = schema.as_object_mut() {
        object
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
}

/// The grammar engine of one vocabulary: compiles [`Grammar`]s into [`GrammarMatcher`]s.
/// Built once per model (it indexes every token's bytes); cheap to share.
#[derive(Clone)]
pub struct GrammarEngine {
    factory: Arc<ParserFactory>,
    vocab: usize,
    eos: Vec<u32>,
}

impl std::fmt::Debug for GrammarEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEngine").field("vocab", &self.vocab).finish_non_exhaustive()
    }
}

/// The vocabulary as llguidance sees it. Forced tokens are found by greedy tokenization (the
/// engine is told that it is not the tokenizer's own).
struct Vocabulary {
    trie: TokTrie,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

impl GrammarEngine {
    /// The engine of `tokenizer`'s vocabulary.
    ///
    /// # Errors
    /// [`Error::Grammar`] when the tokenizer has no end-of-sequence token (a constrained
    /// generation could not end) or the engine refuses the vocabulary.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let vocab = tokenizer.vocab_size();
        // An end id past the vocabulary (a `generation_config.json` may list one) is no token.
        let eos: Vec<u32> =
            tokenizer.eos_ids().into_iter().filter(|&id| (id as usize) < vocab).collect();
        let first = *eos
            .first()
            .ok_or_else(|| Error::Grammar("the tokenizer has no end-of-sequence token".into()))?;
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                if eos.contains(&id) || tokenizer.is_control(id) {
                    // llguidance's mark of a special token: no text produces it.
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend(bytes);
                    marked
                } else {
                    bytes
                }
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, first);
        // The engine asserts what it expects of a vocabulary: a refusal is an error here, not
        // a panic of the rank that builds it.
        let built = std::panic::catch_unwind(|| {
            let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
            let env: TokEnv = Arc::new(Vocabulary { trie });
            ParserFactory::new_simple(&env)
        });
        let mut factory = built
            .map_err(|_| Error::Grammar("the grammar engine refused the vocabulary".into()))?
            .map_err(|e| Error::Grammar(format!("the grammar engine: {e}")))?;
        // Only the command prints: the engine's own logging stays off.
        factory.quiet();
        Ok(GrammarEngine { factory: Arc::new(factory), vocab, eos })
    }

    /// Tokens in the vocabulary (the mask's length).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The end-of-sequence ids, the tokens a complete grammar allows.
    pub fn end_ids(&self) -> &[u32] {
        &self.eos
    }

    /// A matcher at the start of `grammar`.
    ///
    /// # Errors
    /// [`Error::Grammar`] naming the problem when the grammar does not compile (a schema that
    /// is not JSON or uses what the engine does not support, a bad regex, a Lark syntax error,
    /// no choices).
    pub fn matcher(&self, grammar: &Grammar) -> Result<GrammarMatcher> {
        let parser = self.factory.create_parser(grammar.top_level()?).map_err(|e| {
            Error::Grammar(format!("invalid {}: {}", grammar.kind(), first_line(&e)))
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Grammar(format!("invalid {}: {e}", grammar.kind())));
        }
        Ok(GrammarMatcher { matcher, mask: SimpleVob::new() })
    }
}

/// An engine error's first line (the rest is the engine's trace).
fn first_line(e: &impl std::fmt::Display) -> String {
    let text = e.to_string();
    text.lines().next().unwrap_or_default().trim().to_owned()
}

/// One generation's place in its grammar.
pub struct GrammarMatcher {
    matcher: Matcher,
    mask: SimpleVob,
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher").field("finished", &self.is_finished()).finish()
    }
}

impl GrammarMatcher {
    /// Computes the tokens that may come next: a bitset over the vocabulary (bit `i % 32` of
    /// word `i / 32` for token `i`). Once the grammar is complete only the end-of-sequence
    /// tokens are allowed; where it may end or go on, they are allowed with the others.
    ///
    /// # Errors
    /// [`Error::Grammar`] when the engine fails (its step limits, an earlier rejected token).
    pub fn allowed(&mut self) -> Result<&[u32]> {
        self.mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| Error::Grammar(format!("computing the token mask: {}", first_line(&e))))?;
        Ok(self.mask.as_slice())
    }

    /// Moves past `token`.
    ///
    /// # Errors
    /// [`Error::Grammar`] when the grammar does not allow `token` here.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.matcher
            .consume_token(token)
            .map_err(|e| Error::Grammar(format!("token {token}: {}", first_line(&e))))
    }

    /// Whether the grammar is complete (only an end-of-sequence token may follow).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests;
