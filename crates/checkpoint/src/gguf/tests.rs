//! GGUF reader tests: round trips through [`GgufWriter`], hand-made quantized blocks, and
//! malformed files.

use super::*;
use crate::test_util::{assert_close, random_vec, temp_path};

fn write(w: &GgufWriter, stem: &str) -> PathBuf {
    let p = temp_path(stem);
    w.write(&p).unwrap();
    p
}

#[test]
fn metadata_of_every_type_round_trips() {
    let mut w = GgufWriter::new();
    let values = [
        ("a.u8", Value::U8(7)),
        ("a.i8", Value::I8(-7)),
        ("a.u16", Value::U16(700)),
        ("a.i16", Value::I16(-700)),
        ("a.u32", Value::U32(70_000)),
        ("a.i32", Value::I32(-70_000)),
        ("a.f32", Value::F32(1.5)),
        ("a.bool", Value::Bool(true)),
        ("a.str", Value::String("héllo".into())),
        ("a.arr", Value::Array(vec![Value::String("x".into()), Value::String("yz".into())])),
        ("a.ints", Value::Array(vec![Value::I32(1), Value::I32(-2)])),
        ("a.u64", Value::U64(1 << 40)),
        ("a.i64", Value::I64(-(1 << 40))),
        ("a.f64", Value::F64(0.25)),
    ];
    for (k, v) in &values {
        w.metadata(k, v.clone());
    }
    let p = write(&w, "meta.gguf");
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    for (k, v) in &values {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.get_u64("a.u16").unwrap(), 700);
    assert_eq!(f.get_f64("a.f32").unwrap(), 1.5);
    assert_eq!(f.get_str("a.str").unwrap(), "héllo");
    assert_eq!(f.get_array("a.ints").unwrap().len(), 2);
    let err = f.get_u64("a.i8").unwrap_err();
    assert!(err.to_string().contains("`a.i8`: expected an unsigned integer"), "{err}");
    let err = f.get_str("missing.key").unwrap_err();
    assert_eq!(err.to_string(), "metadata key `missing.key`: missing");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn tensors_of_every_type_round_trip_with_row_and_column_slices() {
    let (rows, cols) = (6, 64);
    let x = random_vec(rows * cols, 3);
    let mut w = GgufWriter::new();
    w.tensor_f32("f32", &[rows, cols], &x)
        .tensor_f16("f16", &[rows, cols], &x)
        .tensor_bf16("bf16", &[rows, cols], &x)
        .tensor_quantized("q8_0", &[rows, cols], BlockFormat::Q8_0, &x)
        .tensor_quantized("q4_0", &[rows, cols], BlockFormat::Q4_0, &x)
        .tensor_quantized("q4_1", &[rows, cols], BlockFormat::Q4_1, &x)
        .tensor_f32("vec", &[5], &[1.0, 2.0, 3.0, 4.0, 5.0]);
    let p = write(&w, "tensors.gguf");
    let f = GgufFile::open(&p).unwrap();
    for (name, tol, dtype) in [
        ("f32", 0.0, DType::F32),
        ("f16", 1e-3, DType::F16),
        ("bf16", 1e-2, DType::BF16),
        ("q8_0", 1e-2, DType::F32),
        ("q4_0", 0.15, DType::F32),
        ("q4_1", 0.08, DType::F32),
    ] {
        let info = f.tensor_info(name).unwrap();
        assert_eq!((info.rows(), info.row_len(), info.shape()), (rows, cols, vec![rows, cols]));
        let t = f.tensor(name).unwrap();
        assert_eq!(t.shape(), &[rows, cols]);
        assert_eq!(t.dtype(), dtype);
        for (a, b) in t.data().iter().zip(&x) {
            assert!((a - b).abs() <= tol, "{name}: {a} vs {b}");
        }
        let r = f.tensor_rows(name, 2..5).unwrap();
        assert_eq!(r, t.data()[2 * cols..5 * cols]);
        let c = f.tensor_cols(name, 32..48).unwrap();
        let want: Vec<f32> = (0..rows).flat_map(|i| t.row(i)[32..48].to_vec()).collect();
        assert_eq!(c, want);
    }
    assert_close(f.tensor("vec").unwrap().data(), &[1.0, 2.0, 3.0, 4.0, 5.0], 0.0);
    let err = f.tensor_rows("f32", 4..7).unwrap_err();
    assert!(err.to_string().contains("tensor `f32`: row range 4..7 outside its 6 rows"), "{err}");
    let err = f.tensor_cols("f32", 60..65).unwrap_err();
    assert!(err.to_string().contains("column range 60..65 outside its 64 columns"), "{err}");
    let err = f.tensor("nope").unwrap_err();
    assert!(err.to_string().starts_with("tensor `nope`: not found in"), "{err}");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn hand_made_quantized_blocks_decode_as_computed_by_hand() {
    // One Q8_0 row: d = 0.125, q = -16..16.
    let mut q8 = f16::from_f32(0.125).to_le_bytes().to_vec();
    q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
    // One Q4_1 row: d = 0.5, m = -2, byte j = (15 - j) << 4 | j.
    let mut q41 = f16::from_f32(0.5).to_le_bytes().to_vec();
    q41.extend(f16::from_f32(-2.0).to_le_bytes());
    q41.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    // One Q4_0 row: d = -1, every byte 0x9A (lo 10, hi 9).
    let mut q40 = f16::from_f32(-1.0).to_le_bytes().to_vec();
    q40.extend([0x9A; 16]);
    let mut w = GgufWriter::new();
    w.tensor_raw("q8", &[1, 32], GgmlType::Block(BlockFormat::Q8_0), q8)
        .tensor_raw("q41", &[1, 32], GgmlType::Block(BlockFormat::Q4_1), q41)
        .tensor_raw("q40", &[1, 32], GgmlType::Block(BlockFormat::Q4_0), q40);
    let p = write(&w, "blocks.gguf");
    let f = GgufFile::open(&p).unwrap();
    let q8 = f.tensor("q8").unwrap();
    assert_eq!(q8.data()[0], -2.0);
    assert_eq!(q8.data()[17], 0.125);
    let q41 = f.tensor("q41").unwrap();
    assert_eq!(q41.data()[3], 0.5 * 3.0 - 2.0);
    assert_eq!(q41.data()[16], 0.5 * 15.0 - 2.0);
    let q40 = f.tensor("q40").unwrap();
    assert_eq!(q40.data()[0], -(10.0 - 8.0));
    assert_eq!(q40.data()[31], -(9.0 - 8.0));
    std::fs::remove_file(p).unwrap();
}

#[test]
fn malformed_files_name_the_offset_key_or_tensor() {
    let bad_magic = temp_path("magic.gguf");
    std::fs::write(&bad_magic, b"GGML\x03\0\0\0").unwrap();
    let err = GgufFile::open(&bad_magic).unwrap_err().to_string();
    assert!(err.contains("at offset 0: not a gguf file"), "{err}");

    let mut w = GgufWriter::new();
    w.metadata("general.name", Value::String("truncated model".into()));
    let bytes = w.to_bytes();
    let truncated = temp_path("trunc.gguf");
    // Header 24 bytes, key 8 + 12, type 4: the string value's length sits at offset 48.
    std::fs::write(&truncated, &bytes[..60]).unwrap();
    let err = GgufFile::open(&truncated).unwrap_err().to_string();
    assert!(
        err.contains(
            "at offset 48: the value of `general.name` 15 is larger than the rest of the file"
        ),
        "{err}"
    );

    let mut w = GgufWriter::new();
    w.tensor_f32("w", &[4, 8], &[0.0; 32]);
    let bytes = w.to_bytes();
    let short = temp_path("short.gguf");
    std::fs::write(&short, &bytes[..bytes.len() - 64]).unwrap();
    let err = GgufFile::open(&short).unwrap_err().to_string();
    assert!(
        err.contains("tensor `w` (128 bytes at offset")
            && err.contains("runs past the end of the file"),
        "{err}"
    );

    let mut w = GgufWriter::new();
    w.tensor_raw("i_quant", &[1, 256], GgmlType::from_id(16), vec![0; 66]);
    let unsupported = write(&w, "unsupported.gguf");
    let f = GgufFile::open(&unsupported).unwrap();
    let err = f.tensor("i_quant").unwrap_err().to_string();
    assert!(
        err.contains("tensor `i_quant`: type IQ2_XXS (GGML type 16) is not supported"),
        "{err}"
    );

    let mut w = GgufWriter::new();
    w.metadata("general.alignment", Value::U32(3));
    let align = write(&w, "align.gguf");
    let err = GgufFile::open(&align).unwrap_err().to_string();
    assert!(err.contains("`general.alignment`") && err.contains("power of two"), "{err}");

    let missing = temp_path("does-not-exist.gguf");
    let err = GgufFile::open(&missing).unwrap_err().to_string();
    assert!(err.starts_with("opening ") && err.contains("does-not-exist.gguf"), "{err}");
    for p in [bad_magic, truncated, short, unsupported, align] {
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn impossible_dimensions_are_rejected_with_the_tensor_name() {
    let mut w = GgufWriter::new();
    w.tensor_raw("huge", &[1 << 40, 1 << 40], GgmlType::Unsupported(99), vec![0; 32]);
    let p = write(&w, "huge-dims.gguf");
    let err = GgufFile::open(&p).unwrap_err().to_string();
    assert!(err.contains("tensor `huge` has impossible dimensions"), "{err}");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn the_huge_counts_of_a_corrupt_header_are_rejected_before_allocating() {
    let mut bytes = MAGIC.to_le_bytes().to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(u64::MAX.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    let p = temp_path("huge.gguf");
    std::fs::write(&p, bytes).unwrap();
    let err = GgufFile::open(&p).unwrap_err().to_string();
    assert!(err.contains("at offset 8: the tensor count"), "{err}");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn a_split_model_reads_as_one_file_and_a_missing_or_wrong_part_is_named() {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()));
    let data: Vec<Vec<f32>> = (0..5).map(|i| random_vec(64, i)).collect();
    for (i, d) in data.iter().enumerate() {
        w.tensor_f32(&format!("t{i}"), &[4, 16], d);
    }
    let prefix = temp_path("split-model");
    let paths = w.write_split(&prefix, 3).unwrap();
    assert_eq!(paths.len(), 3);
    assert!(paths[0].to_string_lossy().ends_with("split-model-00001-of-00003.gguf"));
    let f = GgufFile::open(&paths[0]).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.tensor_infos().len(), 5);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(f.tensor(&format!("t{i}")).unwrap().data(), &d[..], "t{i}");
    }
    assert!(f.tensor_infos().iter().any(|t| t.part == 2));
    // Opening a later part names the first; a missing part is named.
    let later = GgufFile::open(&paths[1]).unwrap_err().to_string();
    assert!(later.contains("open the first"), "{later}");
    std::fs::remove_file(&paths[2]).unwrap();
    let missing = GgufFile::open(&paths[0]).unwrap_err().to_string();
    assert!(missing.contains("part 3 of 3") && missing.contains("00003-of-00003"), "{missing}");
    // A part that says it is another one.
    std::fs::copy(&paths[1], &paths[2]).unwrap();
    let wrong = GgufFile::open(&paths[0]).unwrap_err().to_string();
    assert!(
        wrong.contains("expected part 3 of 3") && wrong.contains("split.no = Some(1)"),
        "{wrong}"
    );
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn every_ggml_type_id_has_its_ggml_name() {
    let names: Vec<String> = [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 20, 23, 29, 30, 39]
        .into_iter()
        .map(|id| GgmlType::from_id(id).to_string())
        .collect();
    assert_eq!(
        names,
        [
            "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
            "Q6_K", "Q8_K", "IQ2_XXS", "IQ4_NL", "IQ4_XS", "IQ1_M", "BF16", "MXFP4"
        ]
    );
    assert_eq!(GgmlType::from_id(12), GgmlType::Quant(QuantFormat::Q4_K));
    assert_eq!(GgmlType::from_id(16), GgmlType::Unsupported(16));
    assert_eq!(GgmlType::from_id(1000).to_string(), "type 1000");
    for id in 0..64 {
        assert_eq!(GgmlType::from_id(id).id(), id);
    }
}

#[test]
fn check_types_names_the_first_unreadable_tensor_and_its_type() {
    let mut w = GgufWriter::new();
    w.tensor_f32("fine", &[1, 32], &[0.5; 32]).tensor_raw(
        "blk.0.attn_q.weight",
        &[2, 256],
        GgmlType::from_id(16),
        vec![0; 132],
    );
    let p = write(&w, "iq2.gguf");
    let err = GgufFile::open(&p).unwrap().check_types().unwrap_err().to_string();
    assert!(
        err.starts_with(
            "tensor `blk.0.attn_q.weight`: type IQ2_XXS (GGML type 16) is not supported"
        ) && err.contains("Q4_K")
            && err.contains("iq2.gguf"),
        "{err}"
    );

    // A K-quant whose rows are not whole super-blocks (llama.cpp never writes one).
    let mut w = GgufWriter::new();
    w.tensor_raw("short_rows", &[1, 128], GgmlType::Quant(QuantFormat::Q4_K), vec![0; 72]);
    let p2 = write(&w, "short-rows.gguf");
    let f = GgufFile::open(&p2).unwrap();
    let err = f.check_types().unwrap_err().to_string();
    assert!(
        err.contains(
            "tensor `short_rows`: type Q4_K needs rows of whole blocks of 256 elements, \
                      but its rows have 128"
        ),
        "{err}"
    );
    assert!(f.tensor("short_rows").unwrap_err().to_string().contains("type Q4_K needs rows"));
    for p in [p, p2] {
        std::fs::remove_file(p).unwrap();
    }
}

/// A streamed file is the file of the same tensors held in memory, byte for byte, however
/// many chunks a tensor takes (each asked for once, in order, at its offset); a tensor whose
/// elements are not whole blocks of its type is refused by name before anything is written.
#[test]
fn streamed_tensors_write_the_same_file_as_held_ones() {
    let pattern =
        |i: usize, at: usize| (at as u64).wrapping_mul(2654435761).wrapping_add(i as u64) as u8;
    let shapes = [vec![1, STREAM_CHUNK / 2 + 100], vec![3, 256], vec![7]];
    let types = [GgmlType::BF16, GgmlType::Quant(QuantFormat::Q4_K), GgmlType::F32];
    let mut head = GgufWriter::new();
    head.metadata("general.architecture", Value::String("llama".into())).tensor_f32(
        "norm",
        &[4],
        &[1.0, 2.0, 3.0, 4.0],
    );
    let mut held = head.clone();
    let mut streamed = Vec::new();
    for (i, (shape, ty)) in shapes.iter().zip(types).enumerate() {
        let len = ty.bytes_for(shape.iter().product()).unwrap();
        held.tensor_raw(&format!("t{i}"), shape, ty, (0..len).map(|at| pattern(i, at)).collect());
        streamed.push(StreamedTensor { name: format!("t{i}"), shape: shape.clone(), ty });
    }
    let p = temp_path("streamed.gguf");
    let mut asked = Vec::new();
    head.write_streamed(&p, &streamed, |i, offset, chunk| {
        asked.push((i, offset, chunk.len()));
        for (j, b) in chunk.iter_mut().enumerate() {
            *b = pattern(i, offset + j);
        }
    })
    .unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), held.to_bytes());
    let first = shapes[0].iter().product::<usize>() * 2;
    assert_eq!(
        asked[..2],
        [(0, 0, STREAM_CHUNK), (0, STREAM_CHUNK, first - STREAM_CHUNK)],
        "{asked:?}"
    );
    assert_eq!(asked.len(), 4);
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.tensor_info("t1").unwrap().shape(), vec![3, 256]);
    assert_close(f.tensor("norm").unwrap().data(), &[1.0, 2.0, 3.0, 4.0], 0.0);
    std::fs::remove_file(&p).unwrap();

    let odd = [StreamedTensor {
        name: "blk.0.ffn_up.weight".into(),
        shape: vec![2, 100],
        ty: GgmlType::Quant(QuantFormat::Q4_K),
    }];
    let err = head.write_streamed(&p, &odd, |_, _, _| unreachable!()).unwrap_err().to_string();
    assert_eq!(err, "tensor `blk.0.ffn_up.weight`: 200 elements are not whole blocks of Q4_K");
    assert!(!p.exists());
}
