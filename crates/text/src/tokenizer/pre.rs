//! llama.cpp's pre-tokenizers for byte-level BPE, by `tokenizer.ggml.pre` tag: the regexes
//! that cut text into words before the BPE merges, and each family's defaults.
//!
//! The regexes are the strings llama.cpp applies (its `llm_tokenizer_bpe` table), not always
//! the ones of the model's `tokenizer.json`: llama.cpp rewrote `(?i:'s|…)` as `'[sS]|…`, and
//! for Tekken and GPT-4o approximated `\p{Lu}`/`\p{Ll}` classes with lookaheads; the ids
//! follow what it runs. Each regex splits the pieces of the one before it, and both its matches
//! and the text between them become pieces, as `Split` with `Isolated` does. Non-ASCII
//! characters are written as `\u{…}` escapes so that no editor can normalize them (the
//! DeepSeek classes hold the Kelvin and Ohm signs, which NFC turns into `K` and `Ω`).

use crate::error::{Error, Result};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

/// One family of `tokenizer.ggml.pre` tags.
#[derive(Debug)]
pub(super) struct PreTokenizer {
    /// The tags, the family's usual one first.
    pub tags: &'static [&'static str],
    /// The regexes, applied one after another.
    pub regexes: &'static [&'static str],
    /// A word that is itself in the vocabulary is one token, whatever the merges would make.
    pub ignore_merges: bool,
    /// Whether BOS starts an encoding when `tokenizer.ggml.add_bos_token` does not say.
    pub add_bos: bool,
}

/// GPT-2's split: contractions, letters, digits, other symbols, each with one leading space.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's split: numbers by up to three digits, newlines kept with punctuation.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's split: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 3.5's split: Qwen 2's with combining marks kept in words.
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Tekken's (Mistral NeMo) split: words cut before an upper-case letter that follows lower-case.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o's (o200k) split: Tekken's with contractions and numbers by up to three digits.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// CJK ideographs, the Samaritan-to-CJK block range and Hangul, as DeepSeek's splits write them.
const DEEPSEEK_CJK: &str = "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+";

/// DeepSeek LLM's Latin, Greek, Cyrillic and other cased letters, with one leading space.
const DEEPSEEK_LETTERS: &str = "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+";

/// DeepSeek LLM's ASCII and full-width punctuation, quotes and CJK punctuation.
const DEEPSEEK_PUNCTUATION: &str =
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+";

/// Poro's and BLOOM's split: words up to whitespace or sentence punctuation.
const PORO: &str = " ?[^(\\s|.,!?\u{2026}\u{3002}\u{ff0c}\u{3001}\u{964}\u{6d4}\u{60c})]+";

/// The families llama.cpp knows that this crate supports; a tag appears once.
pub(super) static TABLE: &[PreTokenizer] = &[
    PreTokenizer {
        tags: &["default"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &[
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "gigachat",
            "a.x-4.0",
            "mellum",
        ],
        regexes: &[GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        regexes: &[r"\p{N}", GPT2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        regexes: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizer {
        tags: &["dbrx", "smaug-bpe", "chatglm-bpe", "glm4"],
        regexes: &[LLAMA3],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        regexes: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer { tags: &["qwen35"], regexes: &[QWEN35], ignore_merges: false, add_bos: false },
    PreTokenizer {
        tags: &["minicpm5"],
        regexes: &[
            r"\p{N}{1,3}",
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        ignore_merges: true,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["deepseek-llm"],
        regexes: &[
            r"[\r\n]",
            DEEPSEEK_LETTERS,
            DEEPSEEK_PUNCTUATION,
            r"\s+$",
            DEEPSEEK_CJK,
            r"\p{N}+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["deepseek-coder"],
        regexes: &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        regexes: &[
            r"\p{N}{1,3}",
            "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
            r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["falcon"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["poro-chat", "bloom", "gpt3-finnish"],
        regexes: &[PORO],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["viking"],
        regexes: &[PORO, r"\p{N}"],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer { tags: &["tekken"], regexes: &[TEKKEN], ignore_merges: true, add_bos: true },
    PreTokenizer {
        tags: &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        regexes: &[GPT4O],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["bailingmoe", "bailingmoe2", "llada-moe"],
        regexes: &[
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["seed-coder"],
        regexes: &[
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["exaone-moe"],
        regexes: &[
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["ufakzeka"],
        regexes: &[
            r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizer {
        tags: &["jais-2"],
        regexes: &[
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
        ],
        ignore_merges: false,
        add_bos: false,
    },
];

/// The family of `tag`.
///
/// # Errors
/// [`checkpoint::Error::Metadata`] on `tokenizer.ggml.pre` when no family has the tag.
pub(super) fn lookup(tag: &str) -> Result<&'static PreTokenizer> {
    TABLE.iter().find(|p| p.tags.contains(&tag)).ok_or_else(|| {
        let known: Vec<&str> = TABLE.iter().map(|p| p.tags[0]).collect();
        Error::metadata(
            "tokenizer.ggml.pre",
            format!(
                "unknown pre-tokenizer `{tag}` (known families: {}; see tokenizer/pre.rs \
                 for every alias)",
                known.join(", ")
            ),
        )
    })
}

impl PreTokenizer {
    /// The `tokenizers` pre-tokenizer: one isolating split per regex, then the byte-level
    /// alphabet (without GPT-2's own regex: the splits are done).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when a regex does not compile.
    pub(super) fn build(&self) -> Result<PreTokenizerWrapper> {
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(self.regexes.len() + 1);
        for regex in self.regexes {
            let split = Split::new(
                SplitPattern::Regex((*regex).to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| {
                Error::Tokenizer(format!("pre-tokenizer `{}`: regex {regex:?}: {e}", self.tags[0]))
            })?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, false, false).into());
        Ok(Sequence::new(steps).into())
    }
}
