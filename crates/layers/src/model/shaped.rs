//! Llama files of any size with random weights, written as a stream: for measuring a model's
//! shape (Llama 3 8B's on a GPU, issue 29's roofline) where no checkpoint can be fetched and
//! the model would not fit in memory twice. The bytes of every matrix come from a seeded
//! generator chunk by chunk while the file is written ([`GgufWriter::write_streamed`]), in
//! bf16 or `Q4_K`, with magnitudes like a trained model's (bf16 values of about 0.004 to
//! 0.06 with random signs; `Q4_K` blocks whose scales and minimums give weights of mean about
//! zero), so activations stay finite through every layer. The text such a model writes means
//! nothing: it is for timing and memory, not for answers (see [`super::random::RandomLlama`]
//! for models whose logits are checked).
//!
//! The vocabulary's first 256 tokens are the bytes in byte-level BPE spelling, so any text
//! tokenizes (one token per byte, there are no merges); the others are named `t{id}`.

use super::random::byte_level;
use crate::error::Result;
use checkpoint::gguf::{GgmlType, GgufWriter, QuantFormat, StreamedTensor, Value};
use std::path::Path;

/// How a [`ShapedLlama`]'s matrices (the embedding and the head included) are stored; the norms
/// are f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShapedStorage {
    /// bfloat16, 2 bytes per weight.
    Bf16,
    /// llama.cpp's 4-bit K-quant, 144 bytes per 256 weights.
    Q4K,
}

impl ShapedStorage {
    /// The storage named `bf16` or `q4_k` (either case).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "bf16" => Some(ShapedStorage::Bf16),
            "q4_k" => Some(ShapedStorage::Q4K),
            _ => None,
        }
    }

    fn ggml(self) -> GgmlType {
        match self {
            ShapedStorage::Bf16 => GgmlType::BF16,
            ShapedStorage::Q4K => GgmlType::Quant(QuantFormat::Q4_K),
        }
    }
}

/// A Llama architecture of given dimensions, with an untied head.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapedLlama {
    /// Decoder blocks.
    pub layers: usize,
    /// Hidden size (a multiple of 256 for `Q4_K`).
    pub hidden: usize,
    /// MLP inner size (a multiple of 256 for `Q4_K`).
    pub ffn: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Vocabulary size (at least 256).
    pub vocab: usize,
    /// The context length written in the file.
    pub context: usize,
    /// How the matrices are stored.
    pub storage: ShapedStorage,
    /// Seed of the weights' bytes.
    pub seed: u64,
}

impl ShapedLlama {
    /// Llama 3 8B's dimensions: 32 blocks, hidden 4096, MLP 14336, 32 query and 8 key/value
    /// heads of 128, a vocabulary of 128256, context 8192 (the file's is 8192; a run may use
    /// less).
    pub fn llama3_8b(storage: ShapedStorage, seed: u64) -> Self {
        ShapedLlama {
            layers: 32,
            hidden: 4096,
            ffn: 14336,
            heads: 32,
            kv_heads: 8,
            vocab: 128_256,
            context: 8192,
            storage,
            seed,
        }
    }

    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// The matrices, in the file's order: name, rows, columns.
    fn matrices(&self) -> Vec<(String, usize, usize)> {
        let (h, d) = (self.hidden, self.head_dim());
        let mut all = vec![("token_embd.weight".to_owned(), self.vocab, h)];
        for l in 0..self.layers {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            all.extend([
                (n("attn_q"), self.heads * d, h),
                (n("attn_k"), self.kv_heads * d, h),
                (n("attn_v"), self.kv_heads * d, h),
                (n("attn_output"), h, self.heads * d),
                (n("ffn_gate"), self.ffn, h),
                (n("ffn_up"), self.ffn, h),
                (n("ffn_down"), h, self.ffn),
            ]);
        }
        all.push(("output.weight".to_owned(), self.vocab, h));
        all
    }

    /// The bytes a decode step reads from the weights: every matrix but the embedding table
    /// (of which a step reads one row per token), as stored in the file. A step's time at the
    /// memory roofline is this over the memory's bandwidth.
    pub fn step_weight_bytes(&self) -> u64 {
        let ty = self.storage.ggml();
        let bytes = |rows: usize, cols: usize| ty.bytes_for(rows * cols).unwrap_or(0) as u64;
        let norms = (2 * self.layers + 1) as u64 * self.hidden as u64 * 4;
        self.matrices().iter().skip(1).map(|(_, r, c)| bytes(*r, *c)).sum::<u64>() + norms
    }

    /// Writes the model to `path` (the file is about [`ShapedLlama::step_weight_bytes`] plus
    /// the embedding), streaming the matrices' bytes.
    ///
    /// # Errors
    /// A dimension that does not fit the storage's blocks (named by its tensor), or the file
    /// cannot be written.
    pub fn write(&self, path: &Path) -> Result<()> {
        let (h, d) = (self.hidden, self.head_dim());
        let u = |x: usize| Value::U32(x as u32);
        let tokens = (0..self.vocab)
            .map(|i| match u8::try_from(i) {
                Ok(b) => Value::String(byte_level(&[b])),
                Err(_) => Value::String(format!("t{i}")),
            })
            .collect();
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()))
            .metadata("general.name", Value::String("random weights in a Llama shape".into()))
            .metadata("llama.block_count", u(self.layers))
            .metadata("llama.embedding_length", u(h))
            .metadata("llama.feed_forward_length", u(self.ffn))
            .metadata("llama.attention.head_count", u(self.heads))
            .metadata("llama.attention.head_count_kv", u(self.kv_heads))
            .metadata("llama.rope.freq_base", Value::F32(500_000.0))
            .metadata("llama.rope.dimension_count", u(d))
            .metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
            .metadata("llama.context_length", u(self.context))
            .metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
            .metadata("tokenizer.ggml.tokens", Value::Array(tokens))
            .metadata("tokenizer.ggml.merges", Value::Array(Vec::new()))
            .metadata("tokenizer.ggml.eos_token_id", u(self.vocab - 1));
        for l in 0..self.layers {
            for t in ["attn_norm", "ffn_norm"] {
                w.tensor_f32(&format!("blk.{l}.{t}.weight"), &[h], &vec![1.0; h]);
            }
        }
        w.tensor_f32("output_norm.weight", &[h], &vec![1.0; h]);
        let ty = self.storage.ggml();
        let streamed: Vec<StreamedTensor> = self
            .matrices()
            .into_iter()
            .map(|(name, rows, cols)| StreamedTensor { name, shape: vec![rows, cols], ty })
            .collect();
        let storage = self.storage;
        let seed = self.seed;
        w.write_streamed(path, &streamed, |i, offset, chunk| {
            // Each chunk from its own stream, so the bytes depend on the seed and the place
            // alone, not on how the writer cuts the tensors.
            let mut rng = SplitMix(seed ^ ((i as u64) << 40) ^ offset as u64);
            match storage {
                ShapedStorage::Bf16 => fill_bf16(&mut rng, chunk),
                ShapedStorage::Q4K => fill_q4_k(&mut rng, chunk),
            }
        })?;
        Ok(())
    }
}

/// SplitMix64: a seedable generator whose every output is well mixed, even from close seeds.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// bf16 values `±2^e · 1.m` with `e` in -8..=-5 and a random 7-bit mantissa: four per draw.
fn fill_bf16(rng: &mut SplitMix, chunk: &mut [u8]) {
    for group in chunk.chunks_mut(8) {
        let r = rng.next();
        for (j, value) in group.chunks_exact_mut(2).enumerate() {
            let bits = (r >> (16 * j)) as u16;
            let (mantissa, exponent, sign) = (bits & 0x7F, 119 + ((bits >> 7) & 3), bits >> 15);
            value.copy_from_slice(&((sign << 15) | (exponent << 7) | mantissa).to_le_bytes());
        }
    }
}

/// `Q4_K` blocks (144 bytes: the scale `d` and minimum scale `dmin` as f16, twelve bytes of
/// 6-bit sub-block scales and minimums, 128 bytes of nibbles), all random but `d = 2^-14` and
/// `dmin = 7.5 · d`, so a weight `d·sc·q - dmin·m` (with `sc`, `m` in 0..64 and `q` in 0..16)
/// lies within ±0.06 with a mean of about zero.
fn fill_q4_k(rng: &mut SplitMix, chunk: &mut [u8]) {
    // f16 bits: 2^-14 is the smallest normal (exponent field 1, mantissa 0); 7.5 · 2^-14 is
    // 1.875 · 2^-12 (exponent field 3, mantissa 0.875 · 1024 = 896).
    let d: u16 = 1 << 10;
    let dmin: u16 = (3 << 10) | 896;
    for block in chunk.chunks_exact_mut(144) {
        for word in block[4..].chunks_exact_mut(20) {
            let (a, b, c) = (rng.next(), rng.next(), rng.next());
            let bytes = [a.to_le_bytes(), b.to_le_bytes(), c.to_le_bytes()].concat();
            word.copy_from_slice(&bytes[..word.len()]);
        }
        block[..2].copy_from_slice(&d.to_le_bytes());
        block[2..4].copy_from_slice(&dmin.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Logits, Model};
    use crate::test_util::temp_path;
    use checkpoint::gguf::GgufFile;

    /// A small model of each storage: the file lists every tensor in its type and shape, the
    /// step's weight bytes are the file's matrices but the embedding, the same seed writes
    /// the same bytes and another seed others, and the model loads and gives finite logits for
    /// any text (byte tokens).
    #[test]
    fn a_shaped_llama_writes_a_model_that_loads_and_runs() {
        for storage in [ShapedStorage::Bf16, ShapedStorage::Q4K] {
            let spec = ShapedLlama {
                layers: 2,
                hidden: 256,
                ffn: 512,
                heads: 4,
                kv_heads: 2,
                vocab: 300,
                context: 64,
                storage,
                seed: 5,
            };
            let p = temp_path(&format!("shaped-{storage:?}.gguf"));
            spec.write(&p).unwrap();
            let file = GgufFile::open(&p).unwrap();
            let up = file.tensor_info("blk.1.ffn_up.weight").unwrap();
            assert_eq!((up.shape(), up.ggml_type), (vec![512, 256], storage.ggml()));
            let nbytes = |name: &str| {
                let info = file.tensor_info(name).unwrap();
                info.ggml_type.bytes_for(info.rows() * info.row_len()).unwrap() as u64
            };
            let matrices: u64 = spec.matrices()[1..].iter().map(|(name, ..)| nbytes(name)).sum();
            assert_eq!(spec.step_weight_bytes(), matrices + 5 * 256 * 4);
            let again = temp_path(&format!("shaped-{storage:?}-again.gguf"));
            spec.write(&again).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&again).unwrap());
            ShapedLlama { seed: 6, ..spec.clone() }.write(&again).unwrap();
            assert_ne!(std::fs::read(&p).unwrap(), std::fs::read(&again).unwrap());

            let model = Model::load(&p, 2).unwrap();
            let ids = text::Tokenizer::from_gguf(&file).unwrap().encode("Any text, é").unwrap();
            assert_eq!(ids.len(), "Any text, é".len(), "one token per byte: {ids:?}");
            let mut cache = model.new_cache(16);
            let pos: Vec<usize> = (0..ids.len()).collect();
            let logits = model.forward(&ids, &pos, &mut cache, Logits::All).unwrap();
            assert_eq!(logits.shape(), &[ids.len(), 300]);
            assert!(logits.data().iter().all(|x| x.is_finite()), "{storage:?}");
            let spread = logits.row(0).iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(spread > 0.0, "{storage:?}: all-zero logits");
            for f in [p, again] {
                std::fs::remove_file(f).unwrap();
            }
        }
    }
}
