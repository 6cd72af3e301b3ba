//! Fuzzing the GGUF header parser: random bytes, and valid small files (from the writer)
//! truncated, with bytes flipped in the header, metadata and tensor infos, and with huge counts
//! and lengths written over them. [`GgufFile::open`] must never panic and every error it
//! returns must name an offset inside the file; reading every tensor of a file that opens must
//! not panic either, and its errors must name the tensor.

use crate::model::random::RandomLlama;
use crate::test_util::{random_vec, temp_path};
use checkpoint::gguf::{GgmlType, GgufFile, GgufWriter, Value, MAGIC};
use checkpoint::{Error, LlamaConfig, Shard, WeightSource};
use proptest::prelude::*;
use std::path::Path;
use tensor::kernels::cpu::quant::{self, BlockFormat};

/// A file with metadata of every type and tensors of every type (one unsupported, one 1-d,
/// one 3-d), so mutations reach every branch of the parser.
fn every_type_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("a.u8", Value::U8(7))
        .metadata("a.i16", Value::I16(-700))
        .metadata("a.f32", Value::F32(1.5))
        .metadata("a.bool", Value::Bool(true))
        .metadata("a.u64", Value::U64(1 << 40))
        .metadata("a.f64", Value::F64(0.25))
        .metadata(
            "a.strs",
            Value::Array(vec![Value::String("x".into()), Value::String("yz".into())]),
        )
        .metadata("a.ints", Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)]));
    let x = random_vec(2 * 64, 1);
    w.tensor_f32("f32", &[2, 64], &x)
        .tensor_f16("f16", &[2, 64], &x)
        .tensor_bf16("bf16", &[2, 64], &x)
        .tensor_quantized("q8", &[2, 64], quant::BlockFormat::Q8_0, &x)
        .tensor_quantized("q4", &[2, 64], quant::BlockFormat::Q4_0, &x)
        .tensor_quantized("q41", &[2, 64], quant::BlockFormat::Q4_1, &x)
        .tensor_f32("vec", &[5], &x[..5])
        .tensor_f32("cube", &[2, 2, 3], &x[..12])
        .tensor_raw("odd", &[4], GgmlType::Unsupported(16), vec![0; 16]);
    w.to_bytes()
}

/// A complete tiny model (tokenizer arrays, every llama key), so the config reader and the
/// quantized loader see mutated real metadata too.
fn tiny_model_file() -> Vec<u8> {
    RandomLlama {
        layers: 1,
        hidden: 32,
        ffn: 32,
        heads: 2,
        kv_heads: 1,
        vocab: 6,
        quantized: Some(BlockFormat::Q8_0),
        ..RandomLlama::default()
    }
    .writer()
    .to_bytes()
}

/// The bytes before the first tensor's data: header, metadata and tensor infos.
fn header_len(bytes: &[u8], path: &Path) -> usize {
    std::fs::write(path, bytes).unwrap();
    let f = GgufFile::open(path).unwrap();
    f.tensor_infos().iter().map(|t| t.offset as usize).min().unwrap_or(bytes.len())
}

/// Opens `bytes` as a file and reads everything in it; `Err` says what went wrong.
fn check(bytes: &[u8], path: &Path) -> std::result::Result<(), String> {
    std::fs::write(path, bytes).unwrap();
    let file = match GgufFile::open(path) {
        Ok(f) => f,
        Err(Error::Gguf { offset, .. }) if offset <= bytes.len() as u64 => return Ok(()),
        Err(e) => return Err(format!("open failed without an offset in the file: {e}")),
    };
    for info in file.tensor_infos() {
        let name = &info.name;
        let named = |r: std::result::Result<(), Error>| match r {
            Err(e) if !e.to_string().contains(name.as_str()) => {
                Err(format!("reading `{name}` failed without naming it: {e}"))
            }
            _ => Ok(()),
        };
        named(file.tensor(name).map(drop))?;
        named(file.tensor_cols(name, 0..info.row_len().min(2)).map(drop))?;
        named(file.quantized(name, &Shard::Full).map(drop))?;
    }
    // The config reader only has to return, with or without an error.
    let _ = LlamaConfig::from_gguf(&file);
    Ok(())
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Cut the file at this length (modulo the length + 1).
    Truncate(usize),
    /// XOR a byte of the header region (the position modulo its length).
    Flip(usize, u8),
    /// Write a little-endian u64 over the header region (a count, length, dimension, offset).
    Huge(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let huge = prop_oneof![
        Just(u64::MAX),
        Just(1u64 << 63),
        Just(1u64 << 40),
        Just(u64::from(u32::MAX)),
        Just(0u64),
        any::<u64>(),
    ];
    prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Flip(i, x)),
        (any::<usize>(), huge).prop_map(|(i, v)| Mutation::Huge(i, v)),
    ]
}

fn mutate(mut bytes: Vec<u8>, header: usize, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let header = header.min(bytes.len());
        match m {
            Mutation::Truncate(i) => bytes.truncate(i % (bytes.len() + 1)),
            Mutation::Flip(i, x) if header > 0 => bytes[i % header] ^= x,
            Mutation::Huge(i, v) if header > 0 => {
                let at = i % header;
                let end = (at + 8).min(bytes.len());
                bytes[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            }
            Mutation::Flip(..) | Mutation::Huge(..) => {}
        }
    }
    bytes
}

#[test]
fn every_truncation_and_every_huge_field_of_the_header_is_an_error_or_a_file() {
    let path = temp_path("fuzz-sweep.gguf");
    for bytes in [every_type_file(), tiny_model_file()] {
        let header = header_len(&bytes, &path);
        for len in (0..=header + 8).chain([bytes.len() - 1]) {
            let r = check(&bytes[..len.min(bytes.len())], &path);
            assert_eq!(r, Ok(()), "truncated to {len} bytes");
        }
        for at in 0..header {
            for v in [u64::MAX, 1 << 40, u64::from(u32::MAX)] {
                let mutated = mutate(bytes.clone(), header, &[Mutation::Huge(at, v)]);
                assert_eq!(check(&mutated, &path), Ok(()), "{v:#x} written at {at}");
            }
        }
    }
    std::fs::remove_file(path).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_bytes_never_panic(
        tail in proptest::collection::vec(any::<u8>(), 0..256),
        prefix in 0..3usize,
        version in 0..5u32,
    ) {
        // Raw noise, or noise after a valid magic and version so the parser goes further.
        let mut bytes = Vec::new();
        if prefix > 0 {
            bytes.extend(MAGIC.to_le_bytes());
            bytes.extend(version.to_le_bytes());
        }
        bytes.extend(tail);
        let path = temp_path("fuzz-random.gguf");
        let r = check(&bytes, &path);
        std::fs::remove_file(&path).unwrap();
        prop_assert_eq!(r, Ok(()));
    }

    #[test]
    fn mutated_valid_files_never_panic(
        which in 0..2usize,
        mutations in proptest::collection::vec(mutation(), 1..5),
    ) {
        let bytes = if which == 0 { every_type_file() } else { tiny_model_file() };
        let path = temp_path("fuzz-mutated.gguf");
        let header = header_len(&bytes, &path);
        let mutated = mutate(bytes, header, &mutations);
        let r = check(&mutated, &path);
        std::fs::remove_file(&path).unwrap();
        prop_assert_eq!(r, Ok(()), "mutations {:?}", mutations);
    }
}
