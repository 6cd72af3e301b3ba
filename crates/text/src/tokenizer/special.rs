//! Special tokens in text, found the way llama.cpp finds them: longest token first, each one
//! cut out of every piece of text still left, so `<|im_start|>` in a prompt is one id.

/// A piece of text to encode: plain text, or the id of a special token written in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fragment<'a> {
    /// Text with no special token in it.
    Text(&'a str),
    /// A special token.
    Token(u32),
}

/// The tokens that stay whole in text (control, user-defined and unknown tokens).
#[derive(Clone, Debug, Default)]
pub(super) struct Specials {
    /// Text and id, longest text first (the lower id first among equally long ones).
    tokens: Vec<(String, u32)>,
    /// Indices into `tokens` by the first byte of their text: a scan of the text finds which
    /// tokens occur in it without a search per token (vocabularies hold thousands of them).
    by_first_byte: Vec<Vec<usize>>,
}

impl Specials {
    /// The special tokens `tokens` (text, id); empty texts are left out.
    pub(super) fn new(mut tokens: Vec<(String, u32)>) -> Self {
        tokens.retain(|(text, _)| !text.is_empty());
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut by_first_byte = vec![Vec::new(); 256];
        for (i, (text, _)) in tokens.iter().enumerate() {
            by_first_byte[usize::from(text.as_bytes()[0])].push(i);
        }
        Specials { tokens, by_first_byte }
    }

    /// `text` cut into plain text and special tokens. Each special token, longest first, is
    /// cut out of the text pieces left by the longer ones, as llama.cpp does; an empty text
    /// gives no fragment.
    pub(super) fn split<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        let mut fragments = if text.is_empty() { Vec::new() } else { vec![Fragment::Text(text)] };
        for i in self.present(text) {
            let (token, id) = (&self.tokens[i].0, self.tokens[i].1);
            let mut cut = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(mut rest) = fragment else {
                    cut.push(fragment);
                    continue;
                };
                while let Some(at) = rest.find(token.as_str()) {
                    if at > 0 {
                        cut.push(Fragment::Text(&rest[..at]));
                    }
                    cut.push(Fragment::Token(id));
                    rest = &rest[at + token.len()..];
                }
                if !rest.is_empty() {
                    cut.push(Fragment::Text(rest));
                }
            }
            fragments = cut;
        }
        fragments
    }

    /// Indices (in `tokens` order) of the special tokens that occur in `text`.
    fn present(&self, text: &str) -> Vec<usize> {
        if self.tokens.is_empty() {
            return Vec::new();
        }
        let mut seen = vec![false; self.tokens.len()];
        let bytes = text.as_bytes();
        for (at, &b) in bytes.iter().enumerate() {
            for &i in &self.by_first_byte[usize::from(b)] {
                if !seen[i] && bytes[at..].starts_with(self.tokens[i].0.as_bytes()) {
                    seen[i] = true;
                }
            }
        }
        (0..self.tokens.len()).filter(|&i| seen[i]).collect()
    }
}
