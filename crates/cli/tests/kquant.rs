//! `tpctl run` on GGUF files that llama.cpp's own quantizer wrote (Q4_K_M: Q4_K and Q6_K, and
//! Q5_0 and Q8_0 where rows are not whole super-blocks; see `scripts/kquant_fixtures.py`):
//! greedy ids equal those of the same weights dequantized to f32, in layouts (1,1), (2,1) and
//! (1,2); and a model of a type tpctl cannot read is refused before any rank starts, naming
//! the tensor and GGML's name of its type.

use checkpoint::gguf::{GgmlType, GgufFile, GgufWriter};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

mod common;

use common::describe as text;

use common::scratch;

const DEADLINE: Duration = Duration::from_secs(90);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../checkpoint/tests/fixtures/kquant").join(name)
}

fn tpctl(args: &[&str]) -> Output {
    common::run_tpctl(args, DEADLINE)
}

/// A copy of `src` with every tensor dequantized to f32 and the same metadata (what gguf-py's
/// `dequant_gguf.py` writes; `tpctl-layers`' `tests/kquant.rs` checks that these values are
/// gguf-py's bit for bit).
fn f32_copy(src: &Path, dst: &Path) {
    let file = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        if key != "general.alignment" {
            w.metadata(key, value.clone());
        }
    }
    for info in file.tensor_infos() {
        let t = file.tensor(&info.name).unwrap();
        w.tensor_f32(&info.name, t.shape(), t.data());
    }
    w.write(dst).unwrap();
}

/// Greedy ids of two prompts in layout `(tp, cp)`.
fn greedy(model: &Path, tp: &str, cp: &str) -> Vec<serde_json::Value> {
    let model = model.to_str().unwrap();
    let args = ["run", "--model", model, "--tp", tp, "--cp", cp, "--threads", "1"];
    let prompts = ["--prompt-ids", "1,2,3,4,5", "--prompt-ids", "7", "--max-tokens", "12"];
    let out = tpctl(&[&args[..], &prompts[..], &["--output", "jsonl"]].concat());
    assert!(out.status.success(), "{model} ({tp},{cp}): {}", text(&out));
    let mut ids: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            serde_json::json!([v["prompt"], v["token_ids"]])
        })
        .collect();
    ids.sort_by_key(|v| v.to_string());
    assert_eq!(ids.len(), 2, "{}", text(&out));
    ids
}

#[test]
fn q4_k_m_models_run_like_their_f32_copies_in_layouts_1_1_2_1_and_1_2() {
    for stem in ["tiny-Q4_K_M", "tiny-Q4_K_M-odd"] {
        let quantized = fixture(&format!("{stem}.gguf"));
        let copy = scratch(&format!("{stem}-f32.gguf"));
        f32_copy(&quantized, &copy);
        for (tp, cp) in [("1", "1"), ("2", "1"), ("1", "2")] {
            let want = greedy(&copy, tp, cp);
            assert_eq!(greedy(&quantized, tp, cp), want, "{stem} ({tp},{cp})");
            assert!(want.iter().all(|p| p[1].as_array().unwrap().len() == 12), "{want:?}");
        }
        std::fs::remove_file(copy).unwrap();
    }
}

#[test]
fn a_model_of_an_unsupported_type_is_refused_before_any_rank_starts() {
    let spec = layers::model::random::RandomLlama { hidden: 64, ..Default::default() };
    let mut w = spec.writer();
    // An IQ2_XXS matrix (66 bytes per 256 elements) among the llama tensors.
    w.tensor_raw("blk.0.extra.weight", &[4, 256], GgmlType::from_id(16), vec![0; 4 * 66]);
    let path = scratch("iq2_xxs.gguf");
    w.write(&path).unwrap();
    let out = tpctl(&["run", "--model", path.to_str().unwrap(), "--prompt-ids", "1"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    // No deployment was announced: the check ran before the launch.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .contains("tensor `blk.0.extra.weight`: type IQ2_XXS (GGML type 16) is not supported")
            && !stderr.contains("deployment"),
        "{}",
        text(&out)
    );
    std::fs::remove_file(path).unwrap();
}
