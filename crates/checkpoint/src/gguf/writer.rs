//! A small GGUF v3 writer: builds test models and fixtures (other crates' multi-rank tests
//! need a tiny model on disk as much as this crate's do).

use super::{GgmlType, Value, DEFAULT_ALIGNMENT, MAGIC};
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::path::Path;
use tensor::kernels::cpu::quant::{self, BlockFormat};

/// The most bytes of a streamed tensor [`GgufWriter::write_streamed`] asks for at once: a
/// multiple of every block size of the formats one would stream (2-byte floats, 144-byte
/// `Q4_K` and 210-byte `Q6_K` blocks), so every chunk holds whole blocks.
pub const STREAM_CHUNK: usize = 144 * 210 * 2 * 64;

/// A tensor of [`GgufWriter::write_streamed`]: named and shaped here, its bytes made while the
/// file is written.
#[derive(Clone, Debug)]
pub struct StreamedTensor {
    /// The tensor's name in the file.
    pub name: String,
    /// Its shape, outermost first.
    pub shape: Vec<usize>,
    /// How it is stored.
    pub ty: GgmlType,
}

/// Collects metadata and tensors, then writes them as one GGUF v3 file.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            // An empty array's element type is unknowable; string, as llama.cpp requires of
            // the metadata arrays that are empty in practice (`tokenizer.ggml.merges`).
            out.extend(items.first().map_or(8, Value::type_id).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it);
            }
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry.
    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_owned(), value));
        self
    }

    /// Adds a tensor from already-encoded bytes; `shape` is outermost first.
    pub fn tensor_raw(
        &mut self,
        name: &str,
        shape: &[usize],
        ty: GgmlType,
        bytes: Vec<u8>,
    ) -> &mut Self {
        let dims = shape.iter().rev().map(|&d| d as u64).collect();
        self.tensors.push((name.to_owned(), dims, ty, bytes));
        self
    }

    /// Adds an f32 tensor.
    pub fn tensor_f32(&mut self, name: &str, shape: &[usize], data: &[f32]) -> &mut Self {
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensor_raw(name, shape, GgmlType::F32, bytes)
    }

    /// Adds a tensor stored as f16.
    pub fn tensor_f16(&mut self, name: &str, shape: &[usize], data: &[f32]) -> &mut Self {
        let bytes = data.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect();
        self.tensor_raw(name, shape, GgmlType::F16, bytes)
    }

    /// Adds a tensor stored as bf16.
    pub fn tensor_bf16(&mut self, name: &str, shape: &[usize], data: &[f32]) -> &mut Self {
        let bytes = data.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect();
        self.tensor_raw(name, shape, GgmlType::BF16, bytes)
    }

    /// Adds a tensor quantized to `format` (the row length must be a multiple of 32).
    pub fn tensor_quantized(
        &mut self,
        name: &str,
        shape: &[usize],
        format: BlockFormat,
        data: &[f32],
    ) -> &mut Self {
        let bytes = quant::quantize(format, data);
        self.tensor_raw(name, shape, GgmlType::Block(format), bytes)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.header(&[]);
        self.put_data(&mut out);
        out
    }

    /// The header, metadata and tensor list of the file: the tensors held, then `streamed`
    /// (name, dimensions innermost first, type, bytes), padded to the alignment where the data
    /// begins.
    fn header(&self, streamed: &[(&str, Vec<u64>, GgmlType, usize)]) -> Vec<u8> {
        let align = DEFAULT_ALIGNMENT as usize;
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend(((self.tensors.len() + streamed.len()) as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend(v.type_id().to_le_bytes());
            put_value(&mut out, v);
        }
        let held = self
            .tensors
            .iter()
            .map(|(name, dims, ty, bytes)| (name.as_str(), dims, *ty, bytes.len()));
        let streamed = streamed.iter().map(|(name, dims, ty, len)| (*name, dims, *ty, *len));
        let mut offset = 0usize;
        for (name, dims, ty, len) in held.chain(streamed) {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + len).div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        out
    }

    /// Appends the held tensors' bytes, each padded to the alignment.
    fn put_data(&self, out: &mut Vec<u8>) {
        let align = DEFAULT_ALIGNMENT as usize;
        for (_, _, _, bytes) in &self.tensors {
            out.extend(bytes);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
    }

    /// Writes the file with the tensors held and then `streamed`, whose bytes are made while
    /// the file is written, so a model far larger than memory can be: `fill(i, offset, chunk)`
    /// writes bytes `offset..offset + chunk.len()` of streamed tensor `i`, in order, in chunks of
    /// at most [`STREAM_CHUNK`] bytes (each chunk starts at a multiple of it).
    ///
    /// # Errors
    /// [`Error::Tensor`] when a streamed tensor's element count does not fit its type's
    /// blocks; [`Error::Io`] when the file cannot be written.
    pub fn write_streamed(
        &self,
        path: &Path,
        streamed: &[StreamedTensor],
        mut fill: impl FnMut(usize, usize, &mut [u8]),
    ) -> Result<()> {
        use std::io::Write;
        let mut list = Vec::with_capacity(streamed.len());
        for t in streamed {
            let n = t.shape.iter().product();
            let len = t.ty.bytes_for(n).ok_or_else(|| Error::Tensor {
                name: t.name.clone(),
                message: format!("{n} elements are not whole blocks of {}", t.ty),
            })?;
            let dims = t.shape.iter().rev().map(|&d| d as u64).collect();
            list.push((t.name.as_str(), dims, t.ty, len));
        }
        let io = |source| Error::Io { what: "writing", path: path.to_owned(), source };
        let mut out = self.header(&list);
        self.put_data(&mut out);
        let file = std::fs::File::create(path).map_err(io)?;
        let mut file = std::io::BufWriter::with_capacity(STREAM_CHUNK, file);
        file.write_all(&out).map_err(io)?;
        let align = DEFAULT_ALIGNMENT as usize;
        let mut chunk = vec![0u8; STREAM_CHUNK];
        for (i, (_, _, _, len)) in list.iter().enumerate() {
            for offset in (0..*len).step_by(STREAM_CHUNK) {
                let part = &mut chunk[..STREAM_CHUNK.min(len - offset)];
                fill(i, offset, part);
                file.write_all(part).map_err(io)?;
            }
            let pad = len.div_ceil(align) * align - len;
            file.write_all(&vec![0u8; pad]).map_err(io)?;
        }
        file.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
    }

    /// Writes the model split in `parts` files as llama.cpp's `gguf-split` does:
    /// `PREFIX-0000i-of-0000n.gguf` next to each other, each with `split.no`, `split.count` and
    /// `split.tensors.count`, the first with every other metadata entry, the tensors in order
    /// in chunks of about equal count. Returns the paths, the first first.
    ///
    /// # Errors
    /// [`Error::Io`] when a file cannot be written.
    pub fn write_split(&self, prefix: &Path, parts: usize) -> Result<Vec<std::path::PathBuf>> {
        let parts = parts.clamp(1, self.tensors.len().max(1));
        let per = self.tensors.len().div_ceil(parts);
        let name = prefix.file_name().and_then(|n| n.to_str()).unwrap_or("model");
        let mut paths = Vec::with_capacity(parts);
        for no in 0..parts {
            let mut part = GgufWriter::new();
            if no == 0 {
                part.metadata = self.metadata.clone();
            }
            part.metadata("split.no", Value::U16(no as u16))
                .metadata("split.count", Value::U16(parts as u16))
                .metadata("split.tensors.count", Value::I32(self.tensors.len() as i32));
            part.tensors = self.tensors.iter().skip(no * per).take(per).cloned().collect();
            let path = prefix.with_file_name(format!("{name}-{:05}-of-{parts:05}.gguf", no + 1));
            part.write(&path)?;
            paths.push(path);
        }
        Ok(paths)
    }

    /// Writes the file.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be written.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|source| Error::Io {
            what: "writing",
            path: path.to_owned(),
            source,
        })
    }
}
