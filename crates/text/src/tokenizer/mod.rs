//! The tokenizer stored in GGUF metadata, giving llama.cpp's ids: byte-level BPE
//! (`tokenizer.ggml.model` = `gpt2`) rebuilt with the `tokenizers` crate behind the
//! pre-tokenizer llama.cpp runs for the file's `tokenizer.ggml.pre` tag (`pre`), or
//! SentencePiece (`llama`) merged by score as llama.cpp does (`spm`); or a Hugging Face
//! `tokenizer.json`. Plus the special ids and the chat template.
//!
//! Control, user-defined and unknown tokens (`token_type` 3, 4 and 2) written in text are
//! encoded as their single ids (`<|im_start|>`), found as llama.cpp finds them (`special`).

pub mod chat;
mod pre;
mod special;
mod spm;

use crate::error::{Error, Result};
use checkpoint::gguf::GgufFile;
use checkpoint::Format;
use special::{Fragment, Specials};
use spm::Spm;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::AddedToken;

/// What a GGUF `token_type` says of a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// 1: an ordinary piece.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<s>`, `<|im_start|>`).
    Control,
    /// 4: a user-defined token, kept whole in text and always shown.
    UserDefined,
    /// 5: an unused slot.
    Unused,
    /// 6: a byte token `<0xNN>` (SentencePiece's byte fallback).
    Byte,
    /// 0 or any other value.
    Undefined,
}

impl Kind {
    fn from_gguf(t: i64) -> Kind {
        match t {
            1 => Kind::Normal,
            2 => Kind::Unknown,
            3 => Kind::Control,
            4 => Kind::UserDefined,
            5 => Kind::Unused,
            6 => Kind::Byte,
            _ => Kind::Undefined,
        }
    }

    /// Whether llama.cpp keeps the token whole when it is written in text.
    fn is_special(self) -> bool {
        matches!(self, Kind::Control | Kind::UserDefined | Kind::Unknown)
    }
}

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
/// whose text is not settled yet and the text they decode to, or for SentencePiece the bytes
/// of an unfinished character.
#[derive(Clone, Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    bytes: Vec<u8>,
}

/// A tokenizer with its special ids and chat template.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    /// The `tokenizers` tokenizer: all of the work for a Hugging Face folder; for GGUF
    /// byte-level BPE the encoding of text between special tokens, and the decoding; for
    /// SentencePiece only [`Tokenizer::inner`] (Hugging Face's equivalent).
    inner: tokenizers::Tokenizer,
    codec: Codec,
    bos: Option<u32>,
    eos: Option<u32>,
    /// Other ids that end a generation: GGUF's end-of-turn token, a Hugging Face folder's
    /// `generation_config.json` `eos_token_id` list.
    more_eos: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// Let the tokenizer's own post-processor add special tokens (Hugging Face
    /// `tokenizer.json`); GGUF tokenizers add BOS by `add_bos` instead.
    post_process: bool,
    chat_template: Option<String>,
}

/// How text becomes ids and back.
#[derive(Clone, Debug)]
enum Codec {
    /// A Hugging Face `tokenizer.json`: `inner` does everything.
    HuggingFace,
    /// GGUF byte-level BPE: special tokens are cut out of the text, `inner` does the rest.
    Bpe(Specials),
    /// GGUF SentencePiece: special tokens are cut out of the text, [`Spm`] does the rest.
    Spm(Specials, Box<Spm>),
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata, to give the ids llama.cpp gives.
    ///
    /// `tokenizer.ggml.model` `gpt2` is byte-level BPE, split first by the regexes of
    /// `tokenizer.ggml.pre` (`default` when absent); `llama` is SentencePiece, with
    /// `tokenizer.ggml.scores`, byte fallback and `tokenizer.ggml.add_space_prefix` (default
    /// true). BOS is added when `tokenizer.ggml.add_bos_token` says so, by default for
    /// SentencePiece and the Llama 3 and Tekken pre-tokenizers; EOS when
    /// `tokenizer.ggml.add_eos_token` says so. SentencePiece's BOS and EOS ids default to 1
    /// and 2, as in llama.cpp.
    ///
    /// # Errors
    /// [`checkpoint::Error::Metadata`] when a key is missing or mistyped, the model is neither `gpt2` nor
    /// `llama`, or `tokenizer.ggml.pre` names no pre-tokenizer llama.cpp has (and this crate
    /// knows); [`Error::Tokenizer`] when the vocabulary and merges do not form a BPE.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.get_str("tokenizer.ggml.model")?;
        let tokens = string_array(file, "tokenizer.ggml.tokens")?;
        let kinds = token_kinds(file, tokens.len())?;
        let specials = Specials::new(
            tokens
                .iter()
                .zip(&kinds)
                .enumerate()
                .filter(|(_, (_, kind))| kind.is_special())
                .map(|(id, (token, _))| ((*token).to_owned(), id as u32))
                .collect(),
        );
        let flag = |key: &str| -> Result<Option<bool>> {
            file.get(key)
                .map(|v| v.as_bool().ok_or_else(|| Error::metadata(key, "expected a bool")))
                .transpose()
        };
        let (inner, codec, add_bos, default_ids) = match model {
            "gpt2" => {
                let tag = match file.get("tokenizer.ggml.pre") {
                    None => "default",
                    Some(v) => v.as_str().ok_or_else(|| {
                        Error::metadata("tokenizer.ggml.pre", "expected a string")
                    })?,
                };
                let pre = pre::lookup(tag)?;
                let inner = byte_level_bpe(file, &tokens, &kinds, pre)?;
                (inner, Codec::Bpe(specials), pre.add_bos, [None, None])
            }
            "llama" => {
                let scores = token_scores(file, tokens.len())?;
                let pieces = tokens.iter().map(|t| (*t).to_owned()).collect();
                let add_space_prefix = flag("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                let spm = Spm::new(pieces, scores, kinds, add_space_prefix);
                let inner = spm.hugging_face()?;
                let default = |id: u32| ((id as usize) < tokens.len()).then_some(id);
                (inner, Codec::Spm(specials, Box::new(spm)), true, [default(1), default(2)])
            }
            other => {
                return Err(Error::metadata(
                    "tokenizer.ggml.model",
                    format!(
                        "`{other}` is not supported (gpt2 byte-level BPE and llama \
                         SentencePiece are)"
                    ),
                ))
            }
        };
        let id = |key: &str| -> Result<Option<u32>> {
            match file.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|x| Some(x as u32))
                    .ok_or_else(|| Error::metadata(key, "expected a token id")),
            }
        };
        let [default_bos, default_eos] = default_ids;
        Ok(Tokenizer {
            inner,
            codec,
            bos: id("tokenizer.ggml.bos_token_id")?.or(default_bos),
            eos: id("tokenizer.ggml.eos_token_id")?.or(default_eos),
            more_eos: id("tokenizer.ggml.eot_token_id")?.into_iter().collect(),
            add_bos: flag("tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos),
            add_eos: flag("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
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
        match Format::of(path) {
            Format::HfFolder => Tokenizer::from_hf_dir(path),
            Format::Gguf => Tokenizer::from_gguf(&GgufFile::open(path)?),
        }
    }

    /// Loads a Hugging Face tokenizer folder: `tokenizer.json`, from `tokenizer_config.json`
    /// (when present) the BOS/EOS tokens and the chat template, and from
    /// `generation_config.json` (when present) the other ids that end a generation.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when `tokenizer.json` cannot be read; [`checkpoint::Error::Io`] or
    /// [`checkpoint::Error::Metadata`] when `tokenizer_config.json` exists but cannot be read or parsed.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Self> {
        let json = dir.join("tokenizer.json");
        let mut inner = tokenizers::Tokenizer::from_file(&json)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", json.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path)
                .map_err(|source| Error::io("reading", &cfg_path, source))?;
            serde_json::from_str(&text).map_err(|e| {
                Error::metadata(&cfg_path.display().to_string(), format!("not json: {e}"))
            })?
        } else {
            serde_json::Value::Null
        };
        register_config_tokens(&mut inner, &cfg);
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
        let more_eos = checkpoint::GenerationConfig::load(dir)?.map(|g| g.eos).unwrap_or_default();
        Ok(Tokenizer {
            bos: special("bos_token"),
            eos: special("eos_token"),
            more_eos,
            inner,
            codec: Codec::HuggingFace,
            add_bos: false,
            add_eos: false,
            post_process: true,
            chat_template,
        })
    }

    /// The underlying `tokenizers` tokenizer. For a SentencePiece GGUF it is a BPE built the
    /// way Hugging Face converts such vocabularies, whose ids can differ from
    /// [`Tokenizer::encode`]'s (llama.cpp's) where merge scores tie or a piece holds a
    /// character that is no token by itself.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text`; special-token text (`<|im_start|>`) maps to its id. Prepends the
    /// BOS id and appends the EOS id when the model asks for them
    /// (`tokenizer.ggml.add_bos_token`, `tokenizer.ggml.add_eos_token`).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when encoding fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        match &self.codec {
            Codec::HuggingFace => {
                let enc = self.inner.encode_fast(text, self.post_process).map_err(tok_err)?;
                ids.extend_from_slice(enc.get_ids());
            }
            Codec::Bpe(specials) => {
                for fragment in specials.split(text) {
                    match fragment {
                        Fragment::Text(text) => {
                            let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
                            ids.extend_from_slice(enc.get_ids());
                        }
                        Fragment::Token(id) => ids.push(id),
                    }
                }
            }
            Codec::Spm(specials, spm) => {
                // A space goes in front of the text and after every special token.
                let mut prefix = spm.add_space_prefix;
                for fragment in specials.split(text) {
                    match fragment {
                        Fragment::Text(text) => {
                            spm.encode(text, prefix, &mut ids)?;
                            prefix = false;
                        }
                        Fragment::Token(id) => {
                            ids.push(id);
                            prefix = spm.add_space_prefix;
                        }
                    }
                }
            }
        }
        if let (true, Some(eos)) = (self.add_eos, self.eos) {
            ids.push(eos);
        }
        Ok(ids)
    }

    /// The text of `ids`; special tokens are dropped when `skip_special`. For SentencePiece,
    /// as llama.cpp's `llama_detokenize`: the space put in front of the text is removed from
    /// the first token, and with `skip_special` a leading BOS the model adds (and its space
    /// kept) and a trailing EOS it adds are dropped.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when an id is unknown.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let Codec::Spm(_, spm) = &self.codec else {
            return self.inner.decode(ids, skip_special).map_err(tok_err);
        };
        let mut ids = ids;
        let mut strip_space = spm.add_space_prefix;
        if skip_special && self.add_bos && self.bos.is_some() && ids.first() == self.bos.as_ref() {
            ids = &ids[1..];
            strip_space = false;
        }
        if skip_special && self.add_eos && self.eos.is_some() && ids.last() == self.eos.as_ref() {
            ids = &ids[..ids.len() - 1];
        }
        let mut bytes = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = spm_bytes(spm, id, !skip_special)?;
            let piece = match piece.strip_prefix(b" ") {
                Some(rest) if i == 0 && strip_space => rest,
                _ => &piece,
            };
            bytes.extend_from_slice(piece);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The text `id` adds to a sequence whose earlier ids `stream` has seen, special tokens
    /// skipped: whole characters only, so a character whose bytes are split over several
    /// tokens comes out with the last of them (the `tokenizers` streaming decoder; for
    /// SentencePiece, the bytes of each token's piece as llama.cpp gives them). With
    /// `flush` (the sequence's last token) an incomplete character left at the end comes out
    /// too, as U+FFFD, and the stream starts over.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the tokenizer's decoder fails or the id is unknown.
    pub fn decode_next(&self, stream: &mut TextStream, id: u32, flush: bool) -> Result<String> {
        if let Codec::Spm(_, spm) = &self.codec {
            stream.bytes.extend_from_slice(&spm_bytes(spm, id, false)?);
            let text = settled_text(&mut stream.bytes, flush);
            if flush {
                *stream = TextStream::default();
            }
            return Ok(text);
        }
        let TextStream { ids, prefix, prefix_index, .. } = stream;
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
        match &self.codec {
            Codec::Spm(_, spm) => spm.id(token),
            _ => self.inner.token_to_id(token),
        }
    }

    /// The bytes token `id` stands for on its own (OpenAI's log-probability `bytes`): a token
    /// that is part of a multi-byte character gives its own bytes, not U+FFFD's, so the
    /// bytes of consecutive tokens join into the text; a special or added token gives its text.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        if let Codec::Spm(_, spm) = &self.codec {
            return Ok(spm_bytes(spm, id, true)?.into_owned());
        }
        let out_of_range = || {
            Error::Tokenizer(format!(
                "token id {id} is outside the vocabulary of {}",
                self.vocab_size()
            ))
        };
        if let Some(added) = self.inner.get_added_vocabulary().simple_id_to_token(id) {
            return Ok(added.into_bytes());
        }
        let piece = self.inner.id_to_token(id).ok_or_else(out_of_range)?;
        let byte_level =
            matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
        if byte_level {
            if let Some(bytes) = byte_level_bytes(&piece) {
                return Ok(bytes);
            }
        }
        if let Some(byte) = spm::parse_byte_token(&piece) {
            return Ok(vec![byte]);
        }
        Ok(self.decode(&[id], false)?.into_bytes())
    }

    /// Whether `id` is a control token, one that decoding skips (`<|im_start|>`, `</s>`),
    /// as opposed to text (user-defined tokens included).
    pub fn is_control(&self, id: u32) -> bool {
        match &self.codec {
            Codec::Spm(_, spm) => {
                spm.bytes(id, false).is_some_and(|b| b.is_empty())
                    && spm.bytes(id, true).is_some_and(|b| !b.is_empty())
            }
            _ => {
                let added = self.inner.get_added_vocabulary();
                added.simple_id_to_token(id).is_some_and(|t| added.is_special_token(&t))
            }
        }
    }

    /// The text form of a token id, as the vocabulary spells it.
    fn token_text(&self, id: u32) -> Option<String> {
        match &self.codec {
            Codec::Spm(_, spm) => spm.piece(id).map(str::to_owned),
            _ => self.inner.id_to_token(id),
        }
    }

    /// The Jinja chat template from `tokenizer.chat_template`, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Replaces the chat template (`--chat-template FILE`).
    #[must_use]
    pub fn with_chat_template(mut self, source: String) -> Self {
        self.chat_template = Some(source);
        self
    }

    /// Renders the chat template for `messages` (role and text each), ending with the
    /// assistant's opening when `add_generation_prompt`: [`Tokenizer::render_chat`] of plain
    /// messages.
    ///
    /// # Errors
    /// As [`Tokenizer::render_chat`].
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let messages = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.render_chat(&chat::ChatRequest {
            messages,
            add_generation_prompt,
            ..Default::default()
        })
    }

    /// Renders the chat template (`tokenizer.chat_template`, or the one given with
    /// [`Tokenizer::with_chat_template`]) for `request` as Hugging Face renders it (see
    /// [`chat`]), with this vocabulary's BOS and EOS texts and the local time.
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] when the model has no template or it fails to render (its
    /// `raise_exception` message included).
    pub fn render_chat(&self, request: &chat::ChatRequest) -> Result<String> {
        let source = self.chat_template.as_deref().ok_or_else(|| {
            Error::ChatTemplate("the model has no tokenizer.chat_template".into())
        })?;
        let token = |id: Option<u32>| id.and_then(|i| self.token_text(i)).unwrap_or_default();
        let now = chrono::Local::now().naive_local();
        chat::render(source, request, &token(self.bos), &token(self.eos), now)
    }

    /// The vocabulary size, special tokens included.
    pub fn vocab_size(&self) -> usize {
        match &self.codec {
            Codec::Spm(_, spm) => spm.len(),
            _ => self.inner.get_vocab_size(true),
        }
    }
}

/// The byte-level BPE of `tokens` and `tokenizer.ggml.merges` behind `pre`'s splits. Control
/// and unknown tokens are its special tokens (dropped when decoding skips them), user-defined
/// ones plain added tokens (always shown, as llama.cpp shows them).
fn byte_level_bpe(
    file: &GgufFile,
    tokens: &[&str],
    kinds: &[Kind],
    pre: &pre::PreTokenizer,
) -> Result<tokenizers::Tokenizer> {
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
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre.build()?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    let added = |special: fn(Kind) -> bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(kinds)
            .filter(|(_, kind)| special(**kind))
            .map(|(token, kind)| {
                let special = *kind != Kind::UserDefined;
                AddedToken::from(token.to_string(), special).normalized(false)
            })
            .collect()
    };
    inner.add_special_tokens(&added(|k| matches!(k, Kind::Control | Kind::Unknown)));
    inner.add_tokens(&added(|k| k == Kind::UserDefined));
    Ok(inner)
}

/// The kind of each of `n` tokens (`tokenizer.ggml.token_type`; all normal without it).
fn token_kinds(file: &GgufFile, n: usize) -> Result<Vec<Kind>> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(types) = file.get(KEY) else {
        return Ok(vec![Kind::Normal; n]);
    };
    let types = types.as_array().ok_or_else(|| Error::metadata(KEY, "expected an array"))?;
    if types.len() < n {
        return Err(Error::metadata(KEY, format!("{} entries for {n} tokens", types.len())));
    }
    types[..n]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_i64()
                .map(Kind::from_gguf)
                .ok_or_else(|| Error::metadata(KEY, format!("entry {i} is not an integer")))
        })
        .collect()
}

/// The score of each of `n` tokens (`tokenizer.ggml.scores`; all 0 without it).
fn token_scores(file: &GgufFile, n: usize) -> Result<Vec<f32>> {
    const KEY: &str = "tokenizer.ggml.scores";
    let Some(scores) = file.get(KEY) else {
        return Ok(vec![0.0; n]);
    };
    let scores = scores.as_array().ok_or_else(|| Error::metadata(KEY, "expected an array"))?;
    if scores.len() < n {
        return Err(Error::metadata(KEY, format!("{} entries for {n} tokens", scores.len())));
    }
    scores[..n]
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_f64()
                .map(|s| s as f32)
                .ok_or_else(|| Error::metadata(KEY, format!("entry {i} is not a number")))
        })
        .collect()
}

/// The bytes of SentencePiece token `id` (see [`Spm::bytes`]).
fn spm_bytes(spm: &Spm, id: u32, special: bool) -> Result<std::borrow::Cow<'_, [u8]>> {
    spm.bytes(id, special).ok_or_else(|| {
        Error::Tokenizer(format!("token id {id} is outside the vocabulary of {}", spm.len()))
    })
}

/// Registers the tokens `tokenizer_config.json` names, as Hugging Face's tokenizer does, so
/// they stay whole in text even when `tokenizer.json` lists no `added_tokens` (older and
/// converted folders): every entry of `added_tokens_decoder` (with its `special` flag), the
/// bos/eos/unk/pad/sep/cls/mask tokens and `additional_special_tokens` (special). A token the
/// vocabulary has keeps its id.
fn register_config_tokens(inner: &mut tokenizers::Tokenizer, cfg: &serde_json::Value) {
    // A token is a string or an object with a `content` string.
    let content = |v: &serde_json::Value| {
        v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str())).map(str::to_owned)
    };
    let (mut special, mut plain) = (Vec::new(), Vec::new());
    if let Some(decoder) = cfg.get("added_tokens_decoder").and_then(|d| d.as_object()) {
        for entry in decoder.values() {
            let Some(text) = content(entry) else { continue };
            let flag = |key: &str| entry.get(key).and_then(serde_json::Value::as_bool);
            let token = AddedToken::from(text, flag("special").unwrap_or(false))
                .lstrip(flag("lstrip").unwrap_or(false))
                .rstrip(flag("rstrip").unwrap_or(false))
                .single_word(flag("single_word").unwrap_or(false));
            let normalized = flag("normalized").unwrap_or(!token.special);
            let token = token.normalized(normalized);
            if token.special {
                special.push(token);
            } else {
                plain.push(token);
            }
        }
    }
    let named = [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ];
    let listed = cfg.get("additional_special_tokens").and_then(|l| l.as_array());
    let names = named.iter().filter_map(|k| cfg.get(*k));
    for text in names.chain(listed.into_iter().flatten()).filter_map(content) {
        if !special.iter().any(|t: &AddedToken| t.content == text) {
            special.push(AddedToken::from(text, true));
        }
    }
    inner.add_tokens(&plain);
    inner.add_special_tokens(&special);
}

/// The bytes a byte-level BPE piece spells (GPT-2's table: the printable bytes stand for
/// themselves, the other 68 for the characters from U+0100 on, in byte order), or `None` when
/// a character is not in the table.
fn byte_level_bytes(piece: &str) -> Option<Vec<u8>> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    piece
        .chars()
        .map(|c| {
            let code = u32::from(c);
            if let Ok(b) = u8::try_from(code) {
                return printable(b).then_some(b);
            }
            let nth = usize::try_from(code.checked_sub(0x100)?).ok()?;
            (0..=255u8).filter(|&b| !printable(b)).nth(nth)
        })
        .collect()
}

/// The text of the complete characters at the start of `bytes`, which keeps the bytes of an
/// unfinished character at its end (or, with `flush`, gives them as U+FFFD too). Bytes that
/// can start no character come out as U+FFFD.
fn settled_text(bytes: &mut Vec<u8>, flush: bool) -> String {
    let mut text = String::new();
    let mut rest: &[u8] = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                text.push_str(s);
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                text.push_str(&String::from_utf8_lossy(valid));
                match e.error_len() {
                    Some(bad) => {
                        text.push('\u{fffd}');
                        rest = &after[bad..];
                    }
                    None if flush => {
                        text.push('\u{fffd}');
                        rest = &[];
                        break;
                    }
                    None => {
                        rest = after;
                        break;
                    }
                }
            }
        }
    }
    let kept = rest.len();
    bytes.drain(..bytes.len() - kept);
    text
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
