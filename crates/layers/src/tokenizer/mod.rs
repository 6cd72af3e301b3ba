//! The tokenizer stored in GGUF metadata: byte-level BPE (`tokenizer.ggml.model` = `gpt2`)
//! rebuilt with the `tokenizers` crate, plus the special ids and the chat template.
//!
//! The pre-tokenizer is `Sequence[Digits(individual_digits), ByteLevel(no prefix space,
//! GPT-2 regex)]` and the decoder is ByteLevel: with the `smollm` pre-tokenizer tag this gives
//! exactly llama.cpp's ids. Control and user-defined tokens (`token_type` 3 and 4) are added
//! as special tokens, so `<|im_start|>` in text encodes to its single id.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

/// GGUF `token_type` of control tokens (`<|im_start|>`, `<|endoftext|>`).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF `token_type` of user-defined tokens.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// One message of a chat, as chat templates see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.to_owned(), content: content.to_owned() }
    }
}

/// One sequence's incremental decoding state (see [`Tokenizer::decode_next`]): the ids
/// whose text is not settled yet and the text they decode to.
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

/// A byte-level BPE tokenizer with its special ids and chat template.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    /// Other ids that end a generation: GGUF's end-of-turn token, a Hugging Face folder's
    /// `generation_config.json` `eos_token_id` list.
    more_eos: Vec<u32>,
    add_bos: bool,
    /// Let the tokenizer's own post-processor add special tokens (Hugging Face
    /// `tokenizer.json`); GGUF tokenizers add BOS by `add_bos` instead.
    post_process: bool,
    chat_template: Option<String>,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    ///
    /// # Errors
    /// [`Error::Metadata`] when a key is missing or mistyped, or the model is not `gpt2`
    /// (byte-level BPE); [`Error::Tokenizer`] when the vocabulary and merges do not form a BPE.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::metadata(
                "tokenizer.ggml.model",
                format!("`{model}` is not supported (gpt2 byte-level BPE is)"),
            ));
        }
        let tokens = string_array(file, "tokenizer.ggml.tokens")?;
        let merges = string_array(file, "tokenizer.ggml.merges")?;
        let merges = merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())).ok_or_else(|| {
                    Error::metadata(
                        "tokenizer.ggml.merges",
                        format!("entry {i} `{m}` is not two tokens separated by a space"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let vocab: Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = file.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
        let byte_level = ByteLevel::new(false, false, true);
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            // SmolLM (and StarCoder-style) tokenizers split digits one by one first.
            "smollm" | "starcoder" | "refact" => {
                Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
            }
            other => {
                if other != "default" && other != "gpt2" {
                    tracing::warn!(
                        pre = other,
                        "unknown tokenizer.ggml.pre, using the gpt-2 byte-level split"
                    );
                }
                byte_level.into()
            }
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        if let Some(types) = file.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            let special: Vec<AddedToken> = types
                .iter()
                .zip(&tokens)
                .filter(|(t, _)| {
                    matches!(t.as_i64(), Some(TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
                })
                .map(|(_, tok)| AddedToken::from(tok.to_string(), true))
                .collect();
            inner.add_special_tokens(&special);
        }
        let id = |key: &str| -> Result<Option<u32>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|x| Some(x as u32))
                    .ok_or_else(|| Error::metadata(key, "expected a token id")),
            }
        };
        Ok(Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            more_eos: id("tokenizer.ggml.eot_token_id")?.into_iter().collect(),
            add_bos: file
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            post_process: false,
            chat_template: file
                .get("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
        })
    }

    /// The tokenizer of a model path: a GGUF file's metadata, or a Hugging Face folder.
    ///
    /// # Errors
    /// As [`Tokenizer::from_gguf`] and [`Tokenizer::from_hf_dir`].
    pub fn load(path: &std::path::Path) -> Result<Self> {
        if path.is_dir() {
            Tokenizer::from_hf_dir(path)
        } else {
            Tokenizer::from_gguf(&GgufFile::open(path)?)
        }
    }

    /// Loads a Hugging Face tokenizer folder: `tokenizer.json`, from `tokenizer_config.json`
    /// (when present) the BOS/EOS tokens and the chat template, and from
    /// `generation_config.json` (when present) the other ids that end a generation.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when `tokenizer.json` cannot be read; [`Error::Io`] or
    /// [`Error::Metadata`] when `tokenizer_config.json` exists but cannot be read or parsed.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Self> {
        let json = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&json)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", json.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|source| Error::Io {
                what: "reading",
                path: cfg_path.clone(),
                source,
            })?;
            serde_json::from_str(&text).map_err(|e| {
                Error::metadata(&cfg_path.display().to_string(), format!("not json: {e}"))
            })?
        } else {
            serde_json::Value::Null
        };
        // Special tokens are a string or an object with a `content` string.
        let special = |key: &str| -> Option<u32> {
            let v = cfg.get(key)?;
            let text = v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(text)
        };
        let chat_template = match cfg.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            // A list of named templates: take the default one.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        };
        let more_eos = crate::GenerationConfig::load(dir)?.map(|g| g.eos).unwrap_or_default();
        Ok(Tokenizer {
            bos: special("bos_token"),
            eos: special("eos_token"),
            more_eos,
            inner,
            add_bos: false,
            post_process: true,
            chat_template,
        })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`; special-token text (`<|im_start|>`) maps to its id. Prepends the
    /// BOS id when the model asks for it (`tokenizer.ggml.add_bos_token`).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when encoding fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, self.post_process).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The text of `ids`; special tokens are dropped when `skip_special`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when an id is unknown.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    /// The text `id` adds to a sequence whose earlier ids `stream` has seen, special tokens
    /// skipped: whole characters only, so a character whose bytes are split over several
    /// tokens comes out with the last of them (the `tokenizers` streaming decoder). With
    /// `flush` (the sequence's last token) an incomplete character left at the end comes out
    /// too, as U+FFFD, and the stream starts over.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the tokenizer's decoder fails.
    pub fn decode_next(&self, stream: &mut TextStream, id: u32, flush: bool) -> Result<String> {
        let TextStream { ids, prefix, prefix_index } = stream;
        let piece =
            tokenizers::step_decode_stream(&*self.inner, id, true, ids, prefix, prefix_index)
                .map_err(tok_err)?;
        let text = match piece {
            Some(text) => text,
            None if flush => {
                let all = self.inner.decode(ids, true).map_err(tok_err)?;
                all.strip_prefix(prefix.as_str()).unwrap_or_default().to_owned()
            }
            None => String::new(),
        };
        if flush {
            *stream = TextStream::default();
        }
        Ok(text)
    }

    /// The beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence id.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Every id that ends a generation: the end-of-sequence id first, then the model's other
    /// ones (GGUF `tokenizer.ggml.eot_token_id`, `generation_config.json`'s `eos_token_id`),
    /// each once.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eos.into_iter().collect();
        for &id in &self.more_eos {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// The id of a token's text form (`<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The Jinja chat template from `tokenizer.chat_template`, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the chat template (`tokenizer.chat_template`, Jinja) for `messages`, ending
    /// with the assistant's opening when `add_generation_prompt`. The template sees
    /// `messages` (each with `role` and `content`), `add_generation_prompt`, `bos_token` and
    /// `eos_token`, and may call `raise_exception(msg)`.
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] when the model has no template or it fails to render.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let source = self.chat_template.as_deref().ok_or_else(|| {
            Error::ChatTemplate("the model has no tokenizer.chat_template".into())
        })?;
        let mut env = minijinja::Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        let template = env
            .template_from_str(source)
            .map_err(|e| Error::ChatTemplate(format!("parsing: {e}")))?;
        let token =
            |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i)).unwrap_or_default();
        let messages: Vec<std::collections::BTreeMap<&str, &str>> = messages
            .iter()
            .map(|m| [("role", m.role.as_str()), ("content", m.content.as_str())].into())
            .collect();
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => token(self.bos),
                eos_token => token(self.eos),
            })
            .map_err(|e| Error::ChatTemplate(format!("rendering: {e}")))
    }

    /// The vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

fn string_array<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    file.get_array(key)?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str().ok_or_else(|| Error::metadata(key, format!("entry {i} is not a string")))
        })
        .collect()
}

#[cfg(test)]
mod tests;
