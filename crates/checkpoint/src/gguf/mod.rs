//! GGUF reader: header, metadata, tensor infos, and tensor data converted to f32.
//!
//! The file is memory-mapped; tensors are decoded only when asked for, and a row range or a
//! column range of a tensor can be read alone, so a rank loads just its shard. GGUF stores
//! dimensions innermost first (`ne[0]` is the row length); [`TensorInfo::shape`] reports them
//! outermost first like [`Tensor`]. A weight matrix `[out_features, in_features]` therefore has
//! `rows` = output features and a row length of input features.

pub mod kquant;
mod source;
#[cfg(test)]
mod tests;
mod writer;

pub use kquant::QuantFormat;
pub use writer::{GgufWriter, StreamedTensor, STREAM_CHUNK};

use crate::error::{Error, Result};
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use tensor::kernels::cpu::quant::{self, BlockFormat, BLOCK};
use tensor::{DType, Tensor};

/// `GGUF` in little-endian byte order.
pub const MAGIC: u32 = 0x4655_4747;
/// Alignment of the data section and tensor offsets when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8.
    String(String),
    /// Type 9: elements of one type.
    Array(Vec<Value>),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a float (or an integer).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF type id of this value.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
}

/// The element type of a tensor in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float (id 0).
    F32,
    /// 16-bit float (id 1).
    F16,
    /// bfloat16 (id 30).
    BF16,
    /// A block-quantized format that [`QMatrix`](tensor::kernels::QMatrix) keeps as stored
    /// (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8).
    Block(BlockFormat),
    /// A block-quantized format read by dequantizing: the K-quants, Q5_0, Q5_1, IQ4_NL and
    /// IQ4_XS (see [`kquant`]).
    Quant(QuantFormat),
    /// Any other id: listed, but reading it is an error.
    Unsupported(u32),
}

/// GGML's names of its type ids (`ggml.h`; ids 4, 5 and 31..=33, 36..=38 are retired).
const GGML_TYPE_NAMES: [&str; 42] = [
    "F32",
    "F16",
    "Q4_0",
    "Q4_1",
    "Q4_2",
    "Q4_3",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q8_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ3_XXS",
    "IQ1_S",
    "IQ4_NL",
    "IQ3_S",
    "IQ2_S",
    "IQ4_XS",
    "I8",
    "I16",
    "I32",
    "I64",
    "F64",
    "IQ1_M",
    "BF16",
    "Q4_0_4_4",
    "Q4_0_4_8",
    "Q4_0_8_8",
    "TQ1_0",
    "TQ2_0",
    "IQ4_NL_4_4",
    "IQ4_NL_4_8",
    "IQ4_NL_8_8",
    "MXFP4",
    "NVFP4",
    "Q1_0",
];

/// The types tpctl reads, as the "supported" part of its errors says them.
pub const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS";

impl GgmlType {
    /// The type for a GGUF type id.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Block(BlockFormat::Q4_0),
            3 => GgmlType::Block(BlockFormat::Q4_1),
            8 => GgmlType::Block(BlockFormat::Q8_0),
            30 => GgmlType::BF16,
            other => {
                QuantFormat::from_id(other).map_or(GgmlType::Unsupported(other), GgmlType::Quant)
            }
        }
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Block(BlockFormat::Q4_0) => 2,
            GgmlType::Block(BlockFormat::Q4_1) => 3,
            GgmlType::Block(BlockFormat::Q8_0) => 8,
            GgmlType::BF16 => 30,
            GgmlType::Quant(f) => f.id(),
            GgmlType::Unsupported(id) => id,
        }
    }

    /// GGML's name of the type (`Q4_K`, `IQ2_XXS`), or `None` for an id GGML never had.
    pub fn name(self) -> Option<&'static str> {
        GGML_TYPE_NAMES.get(self.id() as usize).copied()
    }

    /// Elements per block (1 for the float types, `None` for unsupported ones): a row's length
    /// must be a multiple of it.
    pub fn block_len(self) -> Option<usize> {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Some(1),
            GgmlType::Block(_) => Some(BLOCK),
            GgmlType::Quant(f) => Some(f.block_len()),
            GgmlType::Unsupported(_) => None,
        }
    }

    /// Bytes taken by `n` consecutive elements (`None` for unsupported types or when `n` is not
    /// a whole number of blocks).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        match self {
            GgmlType::F32 => Some(4 * n),
            GgmlType::F16 | GgmlType::BF16 => Some(2 * n),
            GgmlType::Block(f) => n.is_multiple_of(BLOCK).then(|| n / BLOCK * f.block_bytes()),
            GgmlType::Quant(f) => {
                n.is_multiple_of(f.block_len()).then(|| n / f.block_len() * f.block_bytes())
            }
            GgmlType::Unsupported(_) => None,
        }
    }

    /// The storage dtype tag a decoded tensor carries.
    fn dtype(self) -> DType {
        match self {
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            _ => DType::F32,
        }
    }
}

/// GGML's name (`Q4_K`), or `type N` for an id GGML never had.
impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "type {}", self.id()),
        }
    }
}

/// Where a tensor is and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Dimensions as stored, innermost (`ne[0]`) first.
    pub dims: Vec<u64>,
    /// The element type.
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in its file.
    pub offset: u64,
    /// Which file of a split model holds the data (0 for a model in one file).
    pub part: usize,
}

impl TensorInfo {
    /// The shape outermost first (the reverse of [`TensorInfo::dims`]).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Elements per row (`ne[0]`).
    pub fn row_len(&self) -> usize {
        self.dims.first().map_or(1, |&d| d as usize)
    }

    /// Number of rows (the product of the other dimensions).
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).map(|&d| d as usize).product()
    }
}

/// An open GGUF file, or the files of a split model (`NAME-00001-of-00003.gguf`, as
/// llama.cpp's `gguf-split` writes them: every part has `split.no` and `split.count`, the first
/// all the other metadata), read as one.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    /// One map per part; `TensorInfo::part` indexes it.
    maps: Vec<memmap2::Mmap>,
    version: u32,
    alignment: u64,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    index: BTreeMap<String, usize>,
}

/// A bounds-checked little-endian reader that knows its file offset for error messages.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, offset: usize, message: impl Into<String>) -> Error {
        Error::Gguf { path: self.path.to_owned(), offset: offset as u64, message: message.into() }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(
                self.pos,
                format!(
                    "file ends inside {what} ({n} bytes needed, {} left)",
                    self.bytes.len() - self.pos
                ),
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        Ok(s.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length or count that must fit in memory: rejects absurd values before allocating.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_item_bytes as u64) > left {
            return Err(self.err(
                at,
                format!("{what} {n} is larger than the rest of the file ({left} bytes)"),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let at = self.pos;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|e| self.err(at, format!("{what} is not utf-8: {e}")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = format!("the value of `{key}`");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(self.array::<1>(&what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => {
                let at = self.pos;
                match self.array::<1>(&what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(
                            self.err(at, format!("{what}: bool byte {b} is neither 0 nor 1"))
                        )
                    }
                }
            }
            8 => Value::String(self.string(&what)?),
            9 => {
                let at = self.pos;
                if depth > 0 {
                    return Err(self.err(at, format!("{what}: nested arrays are not supported")));
                }
                let elem = self.u32(&what)?;
                let n = self.count(&format!("the array length of `{key}`"), 1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            other => {
                return Err(self.err(self.pos - 4, format!("{what}: unknown value type {other}")))
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses `path` (header, metadata and tensor infos; no tensor data is read).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be mapped, [`Error::Gguf`] (with the byte offset)
    /// when it is not a well-formed GGUF v2/v3 file or a tensor lies outside it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let first = GgufFile::open_one(path.as_ref())?;
        match first.get("split.count").and_then(Value::as_u64) {
            Some(n) if n > 1 => GgufFile::open_split(first, n as usize),
            _ => Ok(first),
        }
    }

    /// The parts of a split model, from its first part: the siblings named
    /// `PREFIX-0000i-of-0000n.gguf`, each checked to say it is part `i` of `n`.
    fn open_split(first: GgufFile, count: usize) -> Result<Self> {
        let err = |path: &Path, message: String| Error::Gguf {
            path: path.to_owned(),
            offset: 0,
            message,
        };
        let name = first.path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        let suffix = format!("-00001-of-{count:05}.gguf");
        let Some(prefix) = name.strip_suffix(&suffix) else {
            return Err(err(
                &first.path,
                format!(
                    "part of a model split in {count} files (split.count): open the first, \
                     named PREFIX{suffix}"
                ),
            ));
        };
        let mut merged = first;
        merged.check_part(0, count)?;
        for no in 1..count {
            let path =
                merged.path.with_file_name(format!("{prefix}-{:05}-of-{count:05}.gguf", no + 1));
            if !path.is_file() {
                return Err(err(
                    &path,
                    format!("part {} of {count} of the split model is missing", no + 1),
                ));
            }
            let part = GgufFile::open_one(&path)?;
            part.check_part(no, count)?;
            let at = merged.maps.len();
            for mut info in part.tensors {
                info.part = at;
                if merged.index.insert(info.name.clone(), merged.tensors.len()).is_some() {
                    return Err(err(&path, format!("tensor `{}` appears in two parts", info.name)));
                }
                merged.tensors.push(info);
            }
            merged.maps.extend(part.maps);
        }
        if let Some(want) = merged.get("split.tensors.count").and_then(Value::as_u64) {
            if want != merged.tensors.len() as u64 {
                return Err(err(
                    &merged.path,
                    format!(
                        "split.tensors.count says {want} tensors, the {count} parts hold {}",
                        merged.tensors.len()
                    ),
                ));
            }
        }
        Ok(merged)
    }

    /// Checks that this file says it is part `no` (from 0) of `count`.
    fn check_part(&self, no: usize, count: usize) -> Result<()> {
        let says = |key: &str| self.get(key).and_then(Value::as_u64);
        if says("split.no") != Some(no as u64) || says("split.count") != Some(count as u64) {
            return Err(Error::Gguf {
                path: self.path.clone(),
                offset: 0,
                message: format!(
                    "expected part {} of {count} of a split model, but split.no = {:?}, \
                     split.count = {:?}",
                    no + 1,
                    says("split.no"),
                    says("split.count")
                ),
            });
        }
        Ok(())
    }

    /// Opens one file.
    fn open_one(path: &Path) -> Result<Self> {
        let path = path.to_owned();
        let map = crate::mmap::map(&path)?;
        let mut c = Cursor { bytes: &map, pos: 0, path: &path };
        let magic = c.u32("the magic number")?;
        if magic != MAGIC {
            return Err(c.err(0, format!("not a gguf file (magic {magic:#010x})")));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(c.err(4, format!("unsupported gguf version {version} (2 and 3 are)")));
        }
        let n_tensors = c.count("the tensor count", 24)?;
        let n_kv = c.count("the metadata count", 12)?;
        let mut metadata = BTreeMap::new();
        let mut alignment_at = 0;
        for _ in 0..n_kv {
            let at = c.pos;
            let key = c.string("a metadata key")?;
            if key == "general.alignment" {
                alignment_at = at;
            }
            let ty = c.u32(&format!("the type of `{key}`"))?;
            let value = c.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(c.err(
                        alignment_at,
                        format!("metadata key `general.alignment`: {v:?} is not a power of two"),
                    ))
                }
            },
        };
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let at = c.pos;
            let n_dims = c.u32(&format!("the rank of tensor `{name}`"))? as usize;
            if n_dims > 4 {
                return Err(
                    c.err(at, format!("tensor `{name}` has {n_dims} dimensions (at most 4)"))
                );
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&format!("the dimensions of tensor `{name}`"))?);
            }
            let ggml_type = GgmlType::from_id(c.u32(&format!("the type of tensor `{name}`"))?);
            let offset = c.u64(&format!("the offset of tensor `{name}`"))?;
            infos.push((at, TensorInfo { name, dims, ggml_type, offset, part: 0 }));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let file_len = map.len() as u64;
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut index = BTreeMap::new();
        for (at, mut info) in infos {
            if info.offset % alignment != 0 {
                return Err(c.err(
                    at,
                    format!(
                        "tensor `{}` data offset {} is not a multiple of the alignment {alignment}",
                        info.name, info.offset
                    ),
                ));
            }
            let Some(offset) = info.offset.checked_add(data_start) else {
                return Err(c.err(
                    at,
                    format!("tensor `{}` data offset {} is past any file", info.name, info.offset),
                ));
            };
            info.offset = offset;
            // Element counts beyond 2^48 cannot be real tensors; rejecting them keeps every
            // later product of dimensions far from overflow. Zero dimensions count as one here,
            // so the row count of an empty tensor is bounded too.
            let bounded = |one_for_zero: bool| {
                info.dims
                    .iter()
                    .map(|&d| if one_for_zero { d.max(1) } else { d })
                    .try_fold(1u64, |a, d| a.checked_mul(d))
                    .filter(|&n| n < 1 << 48)
            };
            let elems = bounded(true).and(bounded(false));
            let Some(elems) = elems else {
                return Err(c.err(
                    at,
                    format!("tensor `{}` has impossible dimensions {:?}", info.name, info.dims),
                ));
            };
            if let Some(size) = info.ggml_type.bytes_for(elems as usize) {
                if info.offset.checked_add(size as u64).is_none_or(|end| end > file_len) {
                    return Err(c.err(
                        at,
                        format!("tensor `{}` ({size} bytes at offset {}) runs past the end of the file ({file_len} bytes)", info.name, info.offset),
                    ));
                }
            }
            if index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(c.err(at, format!("tensor `{}` appears twice", info.name)));
            }
            tensors.push(info);
        }
        Ok(GgufFile { path, maps: vec![map], version, alignment, metadata, tensors, index })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required unsigned integer.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is missing or not a non-negative integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.metadata.get(key).ok_or_else(|| Error::metadata(key, "missing"))?;
        v.as_u64().ok_or_else(|| {
            Error::metadata(key, format!("expected an unsigned integer, found {}", describe(v)))
        })
    }

    /// A required number, as f64.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is missing or not a number.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.metadata.get(key).ok_or_else(|| Error::metadata(key, "missing"))?;
        v.as_f64().ok_or_else(|| {
            Error::metadata(key, format!("expected a number, found {}", describe(v)))
        })
    }

    /// A required string.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is missing or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.metadata.get(key).ok_or_else(|| Error::metadata(key, "missing"))?;
        v.as_str().ok_or_else(|| {
            Error::metadata(key, format!("expected a string, found {}", describe(v)))
        })
    }

    /// A required array.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is missing or not an array.
    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        let v = self.metadata.get(key).ok_or_else(|| Error::metadata(key, "missing"))?;
        v.as_array().ok_or_else(|| {
            Error::metadata(key, format!("expected an array, found {}", describe(v)))
        })
    }

    /// All tensor infos in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Whether the file has a tensor called `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The info of tensor `name`.
    ///
    /// # Errors
    /// [`Error::Tensor`] when there is no such tensor.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| Error::tensor(name, format!("not found in {}", self.path.display())))
    }

    /// Checks that every tensor's type can be read, so a model is refused before any rank
    /// loads it.
    ///
    /// # Errors
    /// [`Error::Tensor`] naming the first tensor of a type tpctl cannot read (with GGML's name
    /// of the type) or whose rows are not whole blocks of its type.
    pub fn check_types(&self) -> Result<()> {
        match self.tensors.iter().find(|t| t.ggml_type.bytes_for(t.row_len()).is_none()) {
            Some(info) => Err(Error::tensor(
                &info.name,
                format!("{} in {}", unreadable(info), self.path.display()),
            )),
            None => Ok(()),
        }
    }

    /// The raw bytes of rows `rows` of tensor `name`.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the tensor is missing, its type unsupported, or the range is out
    /// of bounds.
    pub fn raw_rows(&self, name: &str, rows: Range<usize>) -> Result<(&TensorInfo, &[u8])> {
        let info = self.tensor_info(name)?;
        if rows.start > rows.end || rows.end > info.rows() {
            return Err(Error::tensor(
                name,
                format!("row range {rows:?} outside its {} rows", info.rows()),
            ));
        }
        let row_bytes = info.ggml_type.bytes_for(info.row_len()).ok_or_else(|| {
            Error::tensor(name, format!("{} (data at offset {})", unreadable(info), info.offset))
        })?;
        let start = info.offset as usize + rows.start * row_bytes;
        Ok((info, &self.maps[info.part][start..start + rows.len() * row_bytes]))
    }

    /// The whole tensor `name`, converted to f32, shaped outermost first.
    ///
    /// # Errors
    /// As [`GgufFile::tensor_rows`].
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self.tensor_info(name)?;
        let data = self.tensor_rows(name, 0..info.rows())?;
        Ok(Tensor::from_vec(&info.shape(), data)?.with_source_dtype(info.ggml_type.dtype()))
    }

    /// Rows `rows` of tensor `name` (a tensor is `[rows, row_len]` for this purpose), converted
    /// to f32: `rows.len() * row_len` values.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the tensor is missing, its type unsupported, or the range is out
    /// of bounds.
    pub fn tensor_rows(&self, name: &str, rows: Range<usize>) -> Result<Vec<f32>> {
        let n = rows.len();
        let (info, bytes) = self.raw_rows(name, rows)?;
        let mut out = vec![0.0f32; n * info.row_len()];
        decode(info.ggml_type, bytes, &mut out);
        Ok(out)
    }

    /// Columns `cols` of every row of tensor `name`, converted to f32: `rows * cols.len()`
    /// values (the input-feature slice of a weight matrix).
    ///
    /// # Errors
    /// As [`GgufFile::tensor_rows`], and [`Error::Tensor`] when the column range is out of
    /// bounds.
    pub fn tensor_cols(&self, name: &str, cols: Range<usize>) -> Result<Vec<f32>> {
        let info = self.tensor_info(name)?;
        let n = info.row_len();
        if cols.start > cols.end || cols.end > n {
            return Err(Error::tensor(
                name,
                format!("column range {cols:?} outside its {n} columns"),
            ));
        }
        let (info, bytes) = self.raw_rows(name, 0..info.rows())?;
        if cols.is_empty() || info.rows() == 0 {
            // An empty tensor may still claim long rows, or many rows of nothing: there is
            // nothing to decode, and the row buffer below must not be sized by the claim.
            return Ok(Vec::new());
        }
        let row_bytes = bytes.len() / info.rows().max(1);
        let mut row = vec![0.0f32; n];
        let mut out = Vec::with_capacity(info.rows() * cols.len());
        for r in 0..info.rows() {
            decode(info.ggml_type, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut row);
            out.extend_from_slice(&row[cols.clone()]);
        }
        Ok(out)
    }
}

/// Decodes `bytes` of type `ty` (a supported type, whole rows) into `out`.
fn decode(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Block(f) => quant::dequantize(f, bytes, out),
        GgmlType::Quant(f) => kquant::dequantize(f, bytes, out),
        // `raw_rows` rejects unsupported types before any caller gets here.
        GgmlType::Unsupported(_) => {}
    }
}

/// Why the tensor of `info` cannot be read (its type or its row length).
fn unreadable(info: &TensorInfo) -> String {
    let ty = info.ggml_type;
    match ty.block_len() {
        None => format!(
            "type {ty} (GGML type {}) is not supported (supported: {SUPPORTED_TYPES})",
            ty.id()
        ),
        Some(block) => format!(
            "type {ty} needs rows of whole blocks of {block} elements, but its rows have {}",
            info.row_len()
        ),
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::String(s) if s.len() > 40 => format!("a string of {} bytes", s.len()),
        Value::Array(a) => format!("an array of {} values", a.len()),
        other => format!("{other:?}"),
    }
}
