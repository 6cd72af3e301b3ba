//! K-quants and the other dequantized GGML formats against independent references: blocks
//! quantized by llama.cpp's own quantizer, and the values gguf-py's `gguf.quants.dequantize`
//! gives for them, recorded by `scripts/kquant_fixtures.py` under `tests/fixtures/kquant`.
//! Every value must be the same bits; the 8-bit repackings must hold the same values.

use checkpoint::gguf::{kquant, GgmlType, GgufFile, QuantFormat};
use checkpoint::{Shard, WeightSource};
use std::path::PathBuf;
use tensor::kernels::QBits;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kquant").join(name)
}

fn blocks() -> GgufFile {
    GgufFile::open(fixture("blocks.gguf")).expect("open tests/fixtures/kquant/blocks.gguf")
}

/// Fixture tensor of `f`, its gguf-py values (`[rows, cols]`), rows and columns.
fn want(file: &GgufFile, f: QuantFormat) -> (String, Vec<f32>, usize, usize) {
    let name = f.name().to_lowercase();
    let info = file.tensor_info(&name).unwrap();
    let (rows, cols) = (info.rows(), info.row_len());
    let want = file.tensor(&format!("{name}.want")).unwrap();
    assert_eq!(want.shape(), &[rows, cols], "{name}.want");
    (name, want.data().to_vec(), rows, cols)
}

/// The stored bytes of every row of tensor `name`.
fn raw<'a>(file: &'a GgufFile, name: &str) -> &'a [u8] {
    let rows = file.tensor_info(name).unwrap().rows();
    file.raw_rows(name, 0..rows).unwrap().1
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: {g:e} vs gguf-py {w:e}");
    }
}

#[test]
fn every_format_dequantizes_to_gguf_py_values_bit_for_bit() {
    let file = blocks();
    for f in QuantFormat::ALL {
        let (name, want, rows, cols) = want(&file, f);
        assert_eq!(file.tensor_info(&name).unwrap().ggml_type, GgmlType::Quant(f));
        assert_same_bits(file.tensor(&name).unwrap().data(), &want, &name);
        assert_same_bits(&file.tensor_rows(&name, 1..3).unwrap(), &want[cols..3 * cols], &name);
        let cols_of = |c: std::ops::Range<usize>| -> Vec<f32> {
            (0..rows).flat_map(|r| want[r * cols..][c.clone()].to_vec()).collect()
        };
        assert_same_bits(&file.tensor_cols(&name, 40..200).unwrap(), &cols_of(40..200), &name);
    }
}

/// Q5_0, IQ4_NL and Q3_K load as 8-bit matrices, Q4_K as 4-bit ones, and Q5_1, Q2_K, Q5_K,
/// Q6_K and IQ4_XS as bytes with a scale per 16, holding exactly the dequantized values, for
/// every shard: no format is left to f32 loading.
#[test]
fn the_repackings_hold_the_dequantized_values() {
    let file = blocks();
    for f in QuantFormat::ALL {
        let (name, want, rows, cols) = want(&file, f);
        let shards = [Shard::Full, Shard::Rows(1..3), Shard::Cols(32..96), Shard::Cols(224..256)];
        for shard in shards {
            let q = file.quantized(&name, &shard).unwrap();
            let q = q.unwrap_or_else(|| panic!("{name} {shard:?} was not repacked"));
            let bits = match f {
                QuantFormat::Q4_K => QBits::Four,
                f if f.fits_q8_0() => QBits::Eight,
                _ => QBits::Eight16,
            };
            assert_eq!(q.bits(), bits, "{name}");
            let (r, c) = match &shard {
                Shard::Full => (0..rows, 0..cols),
                Shard::Rows(r) => (r.clone(), 0..cols),
                Shard::Cols(c) => (0..rows, c.clone()),
            };
            assert_eq!(q.dims(), (r.len(), c.len()), "{name} {shard:?}");
            let expect: Vec<f32> = r.flat_map(|i| want[i * cols..][c.clone()].to_vec()).collect();
            for (i, (g, w)) in q.dequantize().iter().zip(&expect).enumerate() {
                // A Q3_K block stored with a negated scale turns +0 into -0 (see `to_q8_0`).
                let zero_sign = f == QuantFormat::Q3_K && *g == 0.0 && *w == 0.0;
                assert!(
                    g.to_bits() == w.to_bits() || zero_sign,
                    "{name} {shard:?}: element {i}: {g:e} vs gguf-py {w:e}"
                );
            }
        }
    }
}

/// The negated-scale path of Q3_K is exercised: llama.cpp's quantizer gives the sub-block of
/// largest scale the stored scale 0 (that is −32), so blocks with the integer +128 are common.
#[test]
fn the_q3_k_fixture_has_blocks_stored_with_a_negated_scale() {
    let file = blocks();
    let bytes = raw(&file, "q3_k");
    let q8 = kquant::to_q8_0(QuantFormat::Q3_K, bytes).unwrap();
    let flipped = bytes
        .chunks_exact(110)
        .zip(q8.chunks_exact(8 * 34))
        .map(|(k, q)| {
            let d = u16::from_le_bytes([k[108], k[109]]);
            q.chunks_exact(34).filter(|b| u16::from_le_bytes([b[0], b[1]]) != d).count()
        })
        .sum::<usize>();
    assert!(flipped > 0, "no Q3_K block needed the negated scale");
}

#[test]
fn the_q4_k_four_bit_form_is_the_gguf_py_value_bit_for_bit() {
    let file = blocks();
    let (_, want, _, _) = want(&file, QuantFormat::Q4_K);
    let bytes = raw(&file, "q4_k");
    let four = kquant::q4_k_four_bit(bytes);
    let got: Vec<f32> = (0..want.len())
        .map(|e| {
            let (b, j) = (e / 32, e % 32);
            let byte = four.qs[16 * b + j % 16];
            let q = if j < 16 { byte & 0x0f } else { byte >> 4 };
            four.scales[b] * f32::from(q) + four.mins[b]
        })
        .collect();
    assert_same_bits(&got, &want, "q4_k four-bit form");
}

/// FNV-1a 64 of the little-endian bytes of `values`, as the fixture script hashes them.
fn fnv1a64(values: &[f32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in values.iter().flat_map(|v| v.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Every tensor of the two models llama.cpp quantized to Q4_K_M (Q4_K, Q6_K, and Q5_0 and Q8_0
/// where rows are not whole super-blocks) dequantizes to gguf-py's values.
#[test]
fn llama_cpp_q4_k_m_models_dequantize_to_gguf_py_values() {
    for stem in ["tiny-Q4_K_M", "tiny-Q4_K_M-odd"] {
        let file = GgufFile::open(fixture(&format!("{stem}.gguf"))).unwrap();
        let json = std::fs::read_to_string(fixture(&format!("{stem}.json"))).unwrap();
        let hashes: serde_json::Value = serde_json::from_str(&json).unwrap();
        let hashes = hashes.as_object().unwrap();
        assert_eq!(hashes.len(), file.tensor_infos().len(), "{stem}");
        file.check_types().unwrap();
        for info in file.tensor_infos() {
            let entry = &hashes[&info.name];
            assert_eq!(info.ggml_type.to_string(), entry["type"].as_str().unwrap(), "{stem}");
            let values = file.tensor(&info.name).unwrap();
            assert_eq!(fnv1a64(values.data()), entry["fnv1a64"].as_str().unwrap(), "{}", info.name);
        }
    }
}
