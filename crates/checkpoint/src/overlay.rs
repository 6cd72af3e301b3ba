//! Weight updates from memory: a trainer writes new weights as safetensors files (under
//! `/dev/shm`, or a memfd's `/proc/PID/fd/N`), one [`Bucket`] each, and the model reloads them
//! from an [`Overlay`] of its checkpoint and the buckets, with no checkpoint written to disk.
//!
//! A bucket holds whole tensors, any subset of the model, named as Hugging Face names them
//! (what a torch trainer has: `model.layers.0.self_attn.q_proj.weight`, Phi-3's fused
//! `qkv_proj` and `gate_up_proj` too) or as the model asks for them (`blk.0.attn_q.weight`,
//! and `attn_qkv`). Whatever the names, the values are as a Hugging Face checkpoint stores
//! them: Q/K rows in the rotate-half order, Gemma's norm weights without Gemma's `1 +`. The
//! overlay presents them in the base's convention (Q/K rows permuted per head when the base
//! stores them interleaved, Gemma's norms with the one added), so the loader, which undoes the
//! base's convention, loads exactly the values the trainer sent.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::safetensors::{gemma2_gguf_name, gguf_name, SafetensorsFile};
use crate::source::{Shard, WeightSource};
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use tensor::kernels::QMatrix;

/// One safetensors file of a weight update, checked against the model it updates: every
/// tensor in it is one of the model's (or a fused tensor whose parts are), with the model's
/// shape.
#[derive(Debug)]
pub struct Bucket {
    file: SafetensorsFile,
    /// The model's names this bucket updates, and where each one's values are.
    tensors: BTreeMap<String, Part>,
}

/// Where the values of one of the model's tensors are in a bucket, and how they are presented.
#[derive(Debug)]
struct Part {
    /// The tensor's name in the file.
    stored: String,
    /// The row of the stored tensor it starts at: 0, or a part's first row in a fused tensor.
    first_row: usize,
    /// The model's shape of it (the base's).
    shape: Vec<usize>,
    /// Elements per head, when the rows (a 1-d tensor's elements) are presented in the base's
    /// interleaved order.
    interleave: Option<usize>,
    /// Added to every value as it is read (Gemma's norms: the base's values are `1 + w`).
    offset: f32,
}

impl Part {
    /// Elements per row of the model's tensor viewed as `[rows, row_len]` (a 1-d tensor is
    /// one row, as every [`WeightSource`] views it).
    fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    fn n_rows(&self) -> usize {
        self.shape.iter().rev().skip(1).product()
    }
}

/// The fused tensors of Phi-3, after `model.layers.N.` or `blk.N.`, and the model's tensors
/// they hold, in row order.
const FUSED: [(&str, &[&str]); 3] = [
    ("self_attn.qkv_proj.weight", &["attn_q.weight", "attn_k.weight", "attn_v.weight"]),
    ("attn_qkv.weight", &["attn_q.weight", "attn_k.weight", "attn_v.weight"]),
    ("mlp.gate_up_proj.weight", &["ffn_gate.weight", "ffn_up.weight"]),
];

/// Which names a bucket's Hugging Face tensors map to: the llama table, Gemma 2's (whose
/// block norms have their own names), or neither where the two disagree (a bucket read
/// without its model, whose name is then kept as stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Names {
    Llama,
    Gemma2,
    Unambiguous,
}

impl Names {
    /// The table of the model of `config`.
    fn of(config: &LlamaConfig) -> Names {
        if config.post_norms {
            Names::Gemma2
        } else {
            Names::Llama
        }
    }

    /// The GGUF name of Hugging Face tensor `hf`, if the table has one.
    fn gguf(self, hf: &str) -> Option<String> {
        match self {
            Names::Llama => gguf_name(hf),
            Names::Gemma2 => gemma2_gguf_name(hf),
            Names::Unambiguous => {
                gguf_name(hf).filter(|g| gemma2_gguf_name(hf).as_ref() == Some(g))
            }
        }
    }
}

/// The model's names of the tensor stored as `stored`: the parts of a fused tensor in row
/// order, else its GGUF name under `names`, else the name itself (already the model's, or
/// unknown).
fn model_names(stored: &str, names: Names) -> Vec<String> {
    let layer = stored
        .strip_prefix("model.layers.")
        .or_else(|| stored.strip_prefix("blk."))
        .and_then(|rest| rest.split_once('.'))
        .filter(|(layer, _)| layer.parse::<usize>().is_ok());
    if let Some((layer, tail)) = layer {
        if let Some((_, parts)) = FUSED.iter().find(|(fused, _)| *fused == tail) {
            return parts.iter().map(|part| format!("blk.{layer}.{part}")).collect();
        }
    }
    vec![names.gguf(stored).unwrap_or_else(|| stored.to_owned())]
}

/// Whether the model's tensor `name` holds query or key rows (or biases), which rotary
/// embedding reads in pairs.
fn is_rotary(name: &str) -> bool {
    ["attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias"]
        .iter()
        .any(|tail| name.strip_prefix("blk.").is_some_and(|rest| rest.ends_with(tail)))
}

/// The rotate-half row that interleaved row `row` holds, with `head_dim` rows per head:
/// within a head, interleaved row `2i + h` is rotate-half row `h · head_dim/2 + i` (the order
/// llama.cpp's converter writes, which the loader undoes).
fn rotate_half_row(row: usize, head_dim: usize) -> usize {
    let (head, within) = (row / head_dim, row % head_dim);
    head * head_dim + (within % 2) * (head_dim / 2) + within / 2
}

impl Bucket {
    /// Opens the safetensors file at `path` (mapped, not read) and checks it against `base`,
    /// the weights of the model of `config` that it updates.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::Safetensors`] when the file cannot be mapped or is malformed,
    /// a tensor of a dtype other than F32, F16 and BF16 included; [`Error::Bucket`] naming the
    /// file and the tensor when a tensor is not one of the model's, differs from the model's
    /// shape, or is given twice (under two names, or alone and inside a fused tensor).
    pub fn open(
        path: impl AsRef<Path>,
        config: &LlamaConfig,
        base: &dyn WeightSource,
    ) -> Result<Bucket> {
        let path = path.as_ref();
        let file = SafetensorsFile::open(path)?;
        let err = |message: String| Error::Bucket { path: path.to_owned(), message };
        // Gemma is the one architecture tpctl runs with scaled embeddings; its norms scale by
        // `1 + w`, which its checkpoints hand out summed and a trainer's tensors do not.
        let norm_offset = if config.embedding_scale.is_some() { 1.0 } else { 0.0 };
        let mut tensors: BTreeMap<String, Part> = BTreeMap::new();
        for stored in file.names() {
            let names = model_names(stored, Names::of(config));
            let mut shapes = Vec::with_capacity(names.len());
            for name in &names {
                if !base.has(name) {
                    let seen_as =
                        if name == stored { String::new() } else { format!(" (as {name})") };
                    return Err(err(format!(
                        "tensor {stored}{seen_as} is not one of the model's weights"
                    )));
                }
                shapes.push(base.shape(name)?);
            }
            let want = match shapes.as_slice() {
                [one] => one.clone(),
                parts => {
                    let cols = parts[0].get(1).copied().unwrap_or(0);
                    if parts.iter().any(|s| s.len() != 2 || s[1] != cols) {
                        return Err(err(format!(
                            "tensor {stored} fuses tensors of shapes {parts:?}, which the model \
                             does not read as one"
                        )));
                    }
                    vec![parts.iter().map(|s| s[0]).sum(), cols]
                }
            };
            let have = file.shape(stored)?;
            if have != want {
                return Err(err(format!(
                    "tensor {stored} has shape {have:?}; the model's is {want:?}"
                )));
            }
            let mut first_row = 0;
            for (name, shape) in names.into_iter().zip(shapes) {
                let interleave =
                    (base.qk_interleaved() && is_rotary(&name)).then_some(config.head_dim);
                if interleave.is_some()
                    && (!config.head_dim.is_multiple_of(2)
                        || !shape[0].is_multiple_of(config.head_dim))
                {
                    return Err(err(format!(
                        "tensor {stored} of shape {have:?} is not whole heads of {} rows, \
                         which interleaving needs",
                        config.head_dim
                    )));
                }
                let offset = if name.ends_with("norm.weight") { norm_offset } else { 0.0 };
                let part = Part { stored: stored.to_owned(), first_row, shape, interleave, offset };
                first_row += part.n_rows();
                match tensors.entry(name) {
                    Entry::Vacant(slot) => {
                        slot.insert(part);
                    }
                    Entry::Occupied(first) => {
                        return Err(err(format!(
                            "tensors {} and {stored} both hold the model's {}",
                            first.get().stored,
                            first.key()
                        )));
                    }
                }
            }
        }
        Ok(Bucket { file, tensors })
    }

    /// The bucket's file.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The model's names (GGUF llama names) of the tensors this bucket updates.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Whether it holds the model's tensor `name` (a GGUF llama name).
    pub fn holds(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Writes rows `rows` and columns `cols` of the model's tensor `name` (viewed as
    /// `[rows, row_len]`, a 1-d tensor as one row) into `dst`, row-major, as the loader ends up
    /// with them whatever the base's convention: the trainer's values in their own (Hugging
    /// Face) row order, with Gemma's norm offset added. The values go from the mapped file
    /// straight into `dst`, which is how an update writes them over live weights.
    ///
    /// # Errors
    /// [`Error::Bucket`] when the bucket does not hold `name`, the ranges fall outside it, or
    /// `dst` is not `rows.len() * cols.len()` long.
    pub fn read_into(
        &self,
        name: &str,
        rows: Range<usize>,
        cols: Range<usize>,
        dst: &mut [f32],
    ) -> Result<()> {
        let err = |message: String| Error::Bucket { path: self.path().to_owned(), message };
        let part =
            self.tensors.get(name).ok_or_else(|| err(format!("it holds no tensor {name}")))?;
        let (n_rows, row_len) = (part.n_rows(), part.row_len());
        if rows.start > rows.end || rows.end > n_rows || cols.start > cols.end || cols.end > row_len
        {
            return Err(err(format!(
                "rows {rows:?} and columns {cols:?} fall outside {name}, of {n_rows} rows of \
                 {row_len}"
            )));
        }
        if dst.len() != rows.len() * cols.len() {
            return Err(err(format!(
                "{} values asked for rows {rows:?} and columns {cols:?} of {name}",
                dst.len()
            )));
        }
        let stored = part.stored.as_str();
        let first = part.first_row;
        if cols == (0..row_len) {
            let flat = (first + rows.start) * row_len..(first + rows.end) * row_len;
            self.file.elements_into(stored, flat, dst)?;
        } else if !cols.is_empty() {
            for (row, out) in rows.zip(dst.chunks_exact_mut(cols.len())) {
                let at = (first + row) * row_len;
                self.file.elements_into(stored, at + cols.start..at + cols.end, out)?;
            }
        }
        if part.offset != 0.0 {
            dst.iter_mut().for_each(|v| *v += part.offset);
        }
        Ok(())
    }

    /// Rows `rows` and columns `cols` of `part` (in range), as the base presents them.
    fn read(&self, part: &Part, rows: Range<usize>, cols: Range<usize>) -> Result<Vec<f32>> {
        let row_len = part.row_len();
        let stored = part.stored.as_str();
        let mut values = match part.interleave {
            // A query or key bias: its elements are the rows of the heads.
            Some(d) if part.shape.len() == 1 => {
                let all = self.file.elements(stored, 0..row_len)?;
                rows.flat_map(|_| cols.clone().map(|c| all[rotate_half_row(c, d)])).collect()
            }
            None if cols == (0..row_len) => {
                let first = part.first_row + rows.start;
                self.file.elements(stored, first * row_len..(first + rows.len()) * row_len)?
            }
            interleave => {
                let mut out = Vec::with_capacity(rows.len() * cols.len());
                for row in rows {
                    let from = part.first_row + interleave.map_or(row, |d| rotate_half_row(row, d));
                    let at = from * row_len;
                    out.extend(self.file.elements(stored, at + cols.start..at + cols.end)?);
                }
                out
            }
        };
        if part.offset != 0.0 {
            values.iter_mut().for_each(|v| *v += part.offset);
        }
        Ok(values)
    }
}

/// The model's names of the tensors in the bucket file at `path` (the parts of a fused tensor
/// each), read from its header alone, unchecked against any model.
///
/// # Errors
/// The file cannot be mapped or its header is malformed.
///
/// A Hugging Face name that means different tensors in different architectures (Gemma 2's
/// `post_attention_layernorm` is not the llama `ffn_norm`) is kept as stored, so a bucket is
/// never taken for one that holds another tensor.
pub fn bucket_tensor_names(path: impl AsRef<Path>) -> Result<BTreeSet<String>> {
    let file = SafetensorsFile::open(path)?;
    Ok(file.names().flat_map(|n| model_names(n, Names::Unambiguous)).collect())
}

/// Of the bucket files `buckets`, laid over a checkpoint in this order, those that still give
/// a tensor: a bucket whose every tensor a later one holds is left out, so a trainer that
/// pushes the whole model at every step keeps one step's files, not all of them. A bucket
/// whose header cannot be read is kept (loading it reports why).
pub fn live_buckets(buckets: &[PathBuf]) -> Vec<PathBuf> {
    let names: Vec<Option<BTreeSet<String>>> =
        buckets.iter().map(|p| bucket_tensor_names(p).ok()).collect();
    let mut later: BTreeSet<&str> = BTreeSet::new();
    let mut live = Vec::new();
    for (path, names) in buckets.iter().zip(&names).rev() {
        let shadowed =
            names.as_ref().is_some_and(|names| names.iter().all(|n| later.contains(n.as_str())));
        if !shadowed {
            live.push(path.clone());
        }
        later.extend(names.iter().flatten().map(String::as_str));
    }
    live.reverse();
    live
}

/// A [`WeightSource`] that reads a tensor from the latest bucket holding it, and every other
/// tensor from the base: a model's checkpoint with the buckets of a weight update over it.
/// Each bucket must have been opened against this base ([`Bucket::open`]).
pub struct Overlay<B> {
    base: B,
    buckets: Vec<Bucket>,
}

impl<B: WeightSource> Overlay<B> {
    /// `buckets` over `base`, later buckets over earlier ones.
    pub fn new(base: B, buckets: Vec<Bucket>) -> Self {
        Overlay { base, buckets }
    }

    /// Adds `bucket` over every bucket so far.
    pub fn push(&mut self, bucket: Bucket) {
        self.buckets.push(bucket);
    }

    /// The buckets, in the order they apply.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The weights under the buckets.
    pub fn base(&self) -> &B {
        &self.base
    }

    /// The latest bucket holding the model's tensor `name`, and where it is in it.
    fn overlaid(&self, name: &str) -> Option<(&Bucket, &Part)> {
        self.buckets.iter().rev().find_map(|b| b.tensors.get(name).map(|part| (b, part)))
    }
}

impl<B: WeightSource> WeightSource for Overlay<B> {
    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        match self.overlaid(name) {
            Some((_, part)) => Ok(part.shape.clone()),
            None => self.base.shape(name),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.overlaid(name).is_some() || self.base.has(name)
    }

    fn rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        let Some((bucket, part)) = self.overlaid(name) else { return self.base.rows(name, rows) };
        if rows.start > rows.end || rows.end > part.n_rows() {
            return Err(Error::tensor(
                name,
                format!(
                    "row range {rows:?} outside its {} rows (from bucket {})",
                    part.n_rows(),
                    bucket.path().display()
                ),
            ));
        }
        bucket.read(part, rows, 0..part.row_len())
    }

    fn cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>> {
        let Some((bucket, part)) = self.overlaid(name) else { return self.base.cols(name, cols) };
        if cols.start > cols.end || cols.end > part.row_len() {
            return Err(Error::tensor(
                name,
                format!(
                    "column range {cols:?} outside its {} columns (from bucket {})",
                    part.row_len(),
                    bucket.path().display()
                ),
            ));
        }
        bucket.read(part, 0..part.n_rows(), cols)
    }

    /// `None` for a tensor from a bucket (its values are floats), the base's answer otherwise.
    fn quantized(&self, name: &str, shard: &Shard) -> Result<Option<QMatrix>> {
        match self.overlaid(name) {
            Some(_) => Ok(None),
            None => self.base.quantized(name, shard),
        }
    }

    fn qk_interleaved(&self) -> bool {
        self.base.qk_interleaved()
    }
}

#[cfg(test)]
mod tests;
