//! Changes a sampler makes to logits before it picks (repetition, presence and frequency
//! penalties, a logit bias), as data: the host sampler applies them with
//! [`LogitEdit::apply`], and [`Backend::edit_rows`] applies the same edits where the logits
//! are (a GPU's), in the same order with the same operations, so the logits are the same bits
//! either way and a step whose samplers penalize or bias can still pick its tokens on the
//! device.

use super::{check, Backend};
use crate::error::Result;
use crate::tensor::Tensor;

/// What a [`LogitEdit`] does to its token's logit `l`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum EditKind {
    /// `l / value` when `l > 0`, else `l * value` (the Hugging Face / vLLM repetition
    /// penalty).
    Repetition = 0,
    /// `l - value` (OpenAI's presence and frequency penalties, summed per token).
    Subtract = 1,
    /// `l + value` (OpenAI's logit bias).
    Add = 2,
}

/// One change to one token's logit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitEdit {
    /// The token, in the model's vocabulary.
    pub token: u32,
    /// What is done.
    pub kind: EditKind,
    /// With what.
    pub value: f32,
}

impl LogitEdit {
    /// The logit `l` after this edit.
    pub fn apply(&self, l: f32) -> f32 {
        match self.kind {
            EditKind::Repetition if l > 0.0 => l / self.value,
            EditKind::Repetition => l * self.value,
            EditKind::Subtract => l - self.value,
            EditKind::Add => l + self.value,
        }
    }
}

/// Each row's edits, applied in order: row `i`'s are `edits[offsets[i]..offsets[i + 1]]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitEdits {
    offsets: Vec<usize>,
    edits: Vec<LogitEdit>,
}

impl LogitEdits {
    /// The edits of rows `rows`, in row order.
    pub fn from_rows<'a>(rows: impl IntoIterator<Item = &'a [LogitEdit]>) -> LogitEdits {
        let mut out = LogitEdits { offsets: vec![0], edits: Vec::new() };
        for row in rows {
            out.edits.extend_from_slice(row);
            out.offsets.push(out.edits.len());
        }
        out
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Row `i`'s edits.
    pub fn row(&self, i: usize) -> &[LogitEdit] {
        &self.edits[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Whether no row has an edit.
    pub fn is_empty(&self) -> bool {
        self.edits.is_empty()
    }

    /// The row offsets and the edits, as the kernels read them: `rows + 1` offsets, then
    /// three words per edit (token, kind, the value's bits).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn words(&self) -> (Vec<u32>, Vec<u32>) {
        let offsets = self.offsets.iter().map(|&o| o as u32).collect();
        let edits =
            self.edits.iter().flat_map(|e| [e.token, e.kind as u32, e.value.to_bits()]).collect();
        (offsets, edits)
    }
}

impl Backend {
    /// Applies `edits` to the rows of `x` in place, row `i`'s to row `i`, in order. `x`'s
    /// columns are the vocabulary's from `first` on (a TP rank's shard): an edit of a token
    /// outside them is skipped. Each logit ends as [`LogitEdit::apply`] leaves it, applied in
    /// the same order, on either backend.
    ///
    /// # Errors
    /// Another number of edited rows than `x` has; the CUDA kernel failed.
    pub fn edit_rows(&self, x: &mut Tensor, edits: &LogitEdits, first: usize) -> Result<()> {
        check("edit_rows", edits.rows() == x.rows(), || {
            format!("edits for {} rows, logits of {} rows", edits.rows(), x.rows())
        })?;
        if edits.is_empty() {
            return Ok(());
        }
        let cols = x.row_len();
        match self {
            Backend::Cuda(cuda) => cuda.edit_rows(x, edits, first),
            Backend::Cpu(cpu) => cpu.in_place(x, |data| {
                for (r, row) in data.chunks_exact_mut(cols.max(1)).enumerate() {
                    for e in edits.row(r) {
                        let Some(at) = (e.token as usize).checked_sub(first) else { continue };
                        if let Some(l) = row.get_mut(at) {
                            *l = e.apply(*l);
                        }
                    }
                }
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edits() -> LogitEdits {
        let row0 = [
            LogitEdit { token: 1, kind: EditKind::Repetition, value: 1.5 },
            LogitEdit { token: 2, kind: EditKind::Repetition, value: 1.5 },
            LogitEdit { token: 1, kind: EditKind::Subtract, value: 0.25 },
            LogitEdit { token: 3, kind: EditKind::Add, value: 1e-8 },
            LogitEdit { token: 3, kind: EditKind::Add, value: 2.0 },
            LogitEdit { token: 9, kind: EditKind::Add, value: 5.0 },
        ];
        LogitEdits::from_rows([&row0[..], &[]])
    }

    #[test]
    fn edits_apply_in_order_per_row_and_skip_tokens_outside_the_shard() {
        let be = Backend::cpu(1).unwrap();
        let base = vec![0.5f32, 3.0, -2.0, 1.0, 7.0, 0.0, 1.0, 2.0];
        let mut x = Tensor::from_vec(&[2, 4], base.clone()).unwrap();
        be.edit_rows(&mut x, &edits(), 0).unwrap();
        // Token 1: 3 / 1.5 - 0.25; token 2: -2 * 1.5; token 3: (1 + 1e-8) + 2 (in order: 1e-8
        // is lost first); token 9 is not a column here; row 1 has no edits.
        let want = [0.5, 3.0 / 1.5 - 0.25, -3.0, (1.0f32 + 1e-8) + 2.0, 7.0, 0.0, 1.0, 2.0];
        assert_eq!(x.data(), &want);
        // The shard of columns 2.. holds tokens 2 to 5.
        let mut shard = Tensor::from_vec(&[2, 4], base.clone()).unwrap();
        be.edit_rows(&mut shard, &edits(), 2).unwrap();
        assert_eq!(shard.data()[..4], [0.5f32 / 1.5, (3.0f32 + 1e-8) + 2.0, -2.0, 1.0]);
        let mut wrong = Tensor::from_vec(&[1, 8], base).unwrap();
        assert!(be.edit_rows(&mut wrong, &edits(), 0).is_err(), "2 rows of edits for 1 row");
    }

    #[test]
    fn the_kernels_words_are_the_offsets_then_three_per_edit() {
        let (offsets, words) = edits().words();
        assert_eq!(offsets, [0, 6, 6]);
        assert_eq!(words.len(), 18);
        assert_eq!(words[..3], [1, 0, 1.5f32.to_bits()]);
        assert_eq!(words[6..9], [1, 1, 0.25f32.to_bits()]);
        assert_eq!(words[15..], [9, 2, 5.0f32.to_bits()]);
    }
}
