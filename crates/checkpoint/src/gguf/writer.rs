//! A small GGUF v3 writer: builds test models and fixtures (other crates' multi-rank tests
//! need a tiny model on disk as much as this crate's do).

use super::{GgmlType, Value, DEFAULT_ALIGNMENT, MAGIC};
use crate::error::{Error, Result};
use half::{bf16, f16};
use std::path::Path;
use tensor::kernels::cpu::quant::{self, BlockFormat};

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
        let align = DEFAULT_ALIGNMENT as usize;
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend(v.type_id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + bytes.len()).div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        for (_, _, _, bytes) in &self.tensors {
            out.extend(bytes);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        out
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
