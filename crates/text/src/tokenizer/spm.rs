//! SentencePiece vocabularies (`tokenizer.ggml.model` = `llama`: Llama 1 and 2, Mistral,
//! TinyLlama…), encoded as llama.cpp encodes them.
//!
//! A text fragment (a space put in front when `add_space_prefix`, every space written `▁`)
//! starts as one symbol per character. Then, as long as two neighbouring symbols together spell
//! a vocabulary entry, the pair whose entry has the highest score is merged, the leftmost pair
//! first among equal scores. A symbol left at the end that is not in the vocabulary (an
//! unknown character) is spelled with the byte tokens `<0xNN>` of its UTF-8 bytes.
//!
//! The `tokenizers` crate has no model that does exactly this: its Unigram takes the best
//! segmentation by total score, and its BPE (what Hugging Face converts these vocabularies to,
//! see [`Spm::hugging_face`]) ranks merges by pair, so equal scores are broken by rank rather
//! than by position, and it cannot merge a character that is not a token by itself.

use super::{tok_err, Kind};
use crate::error::{Error, Result};
use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper};

/// How SentencePiece writes a space.
const SPACE: char = '\u{2581}';

/// A SentencePiece vocabulary: pieces, their scores and kinds.
#[derive(Clone)]
pub(super) struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<Kind>,
    /// Piece text to id (the first id of a text written twice).
    ids: HashMap<String, u32>,
    /// The `<0xNN>` token of each byte.
    bytes: [Option<u32>; 256],
    /// Whether a space is put in front of the text and after each special token.
    pub(super) add_space_prefix: bool,
}

impl std::fmt::Debug for Spm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spm")
            .field("pieces", &self.pieces.len())
            .field("add_space_prefix", &self.add_space_prefix)
            .finish_non_exhaustive()
    }
}

/// Two neighbouring symbols whose text is the vocabulary entry `score` belongs to.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the two together when queued: a symbol that changed since makes it stale.
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bigram {
    /// The greatest is the one merged first: the highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// A symbol: a byte range of the text, linked to its neighbours (`NONE` at the ends).
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

impl Spm {
    /// The vocabulary of `pieces` with their `scores` and `kinds` (of equal lengths).
    pub(super) fn new(
        pieces: Vec<String>,
        scores: Vec<f32>,
        kinds: Vec<Kind>,
        add_space_prefix: bool,
    ) -> Self {
        let mut ids = HashMap::with_capacity(pieces.len());
        for (i, piece) in pieces.iter().enumerate() {
            ids.entry(piece.clone()).or_insert(i as u32);
        }
        let mut bytes = [None; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied();
        }
        Spm { pieces, scores, kinds, ids, bytes, add_space_prefix }
    }

    /// The number of pieces.
    pub(super) fn len(&self) -> usize {
        self.pieces.len()
    }

    /// The id of a piece's text.
    pub(super) fn id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// The text of a piece as the vocabulary spells it (`▁` for a space).
    pub(super) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Appends the ids of one text fragment (no special tokens in it) to `out`, with a space
    /// in front when `prefix`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when a character is not in the vocabulary and one of its bytes has
    /// no byte token (llama.cpp fails there too).
    pub(super) fn encode(&self, text: &str, prefix: bool, out: &mut Vec<u32>) -> Result<()> {
        let mut escaped = String::with_capacity(text.len() + 3);
        if prefix {
            escaped.push(SPACE);
        }
        escaped.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let text = escaped.as_str();

        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .map(|(start, c)| Symbol { start, len: c.len_utf8(), prev: NONE, next: NONE })
            .collect();
        let n = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = if i == 0 { NONE } else { i - 1 };
            s.next = if i + 1 == n { NONE } else { i + 1 };
        }
        let mut queue = BinaryHeap::new();
        for i in 1..n {
            self.queue_pair(text, &symbols, i - 1, i, &mut queue);
        }
        while let Some(pair) = queue.pop() {
            let (left, right) = (symbols[pair.left], symbols[pair.right]);
            if left.len == 0 || right.len == 0 || left.len + right.len != pair.len {
                continue;
            }
            symbols[pair.left].len += right.len;
            symbols[pair.left].next = right.next;
            symbols[pair.right].len = 0;
            if right.next != NONE {
                symbols[right.next].prev = pair.left;
            }
            self.queue_pair(text, &symbols, left.prev, pair.left, &mut queue);
            self.queue_pair(text, &symbols, pair.left, right.next, &mut queue);
        }

        // Merges only make vocabulary entries, so a symbol that is not one is a single
        // character the vocabulary lacks.
        let mut i = if n == 0 { NONE } else { 0 };
        while i != NONE {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        out.push(self.byte_token(b).ok_or_else(|| {
                            Error::Tokenizer(format!(
                                "`{piece}` is not in the vocabulary and byte 0x{b:02X} has no \
                                 token <0x{b:02X}>"
                            ))
                        })?);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }

    /// Queues the pair `left`, `right` if together they spell a vocabulary entry.
    fn queue_pair(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        if left == NONE || right == NONE {
            return;
        }
        let (l, r) = (symbols[left], symbols[right]);
        let len = l.len + r.len;
        if let Some(&id) = self.ids.get(&text[l.start..l.start + len]) {
            queue.push(Bigram { score: self.scores[id as usize], left, right, len });
        }
    }

    /// The token of byte `b`: `<0xNN>`, else the byte itself as a piece (as llama.cpp looks
    /// it up).
    fn byte_token(&self, b: u8) -> Option<u32> {
        self.bytes[usize::from(b)].or_else(|| {
            let c = char::from(b);
            b.is_ascii().then(|| self.ids.get(c.encode_utf8(&mut [0; 4]) as &str).copied())?
        })
    }

    /// The bytes a token stands for (llama.cpp's `token_to_piece`): a normal piece with `▁`
    /// read as a space, a byte token's byte, a user-defined token's text; control and unknown
    /// tokens give their text only when `special`; unused and undefined tokens give nothing.
    /// `None` for an id outside the vocabulary.
    pub(super) fn bytes(&self, id: u32, special: bool) -> Option<Cow<'_, [u8]>> {
        let piece = self.pieces.get(id as usize)?;
        Some(match self.kinds[id as usize] {
            Kind::Normal => Cow::Owned(piece.replace(SPACE, " ").into_bytes()),
            Kind::UserDefined => Cow::Borrowed(piece.as_bytes()),
            Kind::Control | Kind::Unknown if special => Cow::Borrowed(piece.as_bytes()),
            Kind::Byte => match parse_byte_token(piece) {
                Some(b) => Cow::Owned(vec![b]),
                None => Cow::Borrowed(&[]),
            },
            _ => Cow::Borrowed(&[]),
        })
    }

    /// A `tokenizers` tokenizer built the way Hugging Face converts such a vocabulary (a BPE
    /// whose merges are every split of a piece into two pieces, ranked by the piece's score,
    /// with byte fallback), for [`super::Tokenizer::inner`]. Its ids agree with
    /// [`Spm::encode`] but in the rare cases this module's doc names.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the `tokenizers` BPE cannot be built.
    pub(super) fn hugging_face(&self) -> Result<tokenizers::Tokenizer> {
        let mut merges: Vec<(u32, u32, u32)> = Vec::new();
        for (id, piece) in self.pieces.iter().enumerate() {
            for (at, _) in piece.char_indices().skip(1) {
                let (a, b) = piece.split_at(at);
                if let (Some(&a), Some(&b)) = (self.ids.get(a), self.ids.get(b)) {
                    merges.push((id as u32, a, b));
                }
            }
        }
        let score = |id: u32| self.scores[id as usize];
        merges.sort_by(|x, y| {
            score(y.0).partial_cmp(&score(x.0)).unwrap_or(Ordering::Equal).then(x.cmp(y))
        });
        let text = |id: u32| self.pieces[id as usize].clone();
        let merges = merges.into_iter().map(|(_, a, b)| (text(a), text(b))).collect();
        let vocab: Vocab = self.ids.iter().map(|(t, &i)| (t.clone(), i)).collect();
        let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true);
        if let Some(unk) = self.kinds.iter().position(|k| *k == Kind::Unknown) {
            bpe = bpe.unk_token(self.pieces[unk].clone()).fuse_unk(true);
        }
        let mut inner = tokenizers::Tokenizer::new(bpe.build().map_err(tok_err)?);
        let space = SPACE.to_string();
        let replace = Replace::new(" ", space.as_str()).map_err(tok_err)?;
        let normalizer: NormalizerWrapper = if self.add_space_prefix {
            tokenizers::normalizers::Sequence::new(vec![
                Prepend::new(space.clone()).into(),
                replace.into(),
            ])
            .into()
        } else {
            replace.into()
        };
        inner.with_normalizer(Some(normalizer));
        let mut decoders: Vec<DecoderWrapper> = vec![
            Replace::new(space.as_str(), " ").map_err(tok_err)?.into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if self.add_space_prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        inner.with_decoder(Some(DecoderSequence::new(decoders)));
        let added: Vec<AddedToken> = self
            .pieces
            .iter()
            .zip(&self.kinds)
            .filter_map(|(piece, kind)| match kind {
                Kind::Control | Kind::Unknown => Some(AddedToken::from(piece.clone(), true)),
                Kind::UserDefined => Some(AddedToken::from(piece.clone(), false).normalized(false)),
                _ => None,
            })
            .collect();
        inner.add_special_tokens(&added);
        Ok(inner)
    }
}

/// The byte of a `<0xNN>` token.
pub(super) fn parse_byte_token(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
