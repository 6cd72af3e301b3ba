//! GGUF tokenizers against llama.cpp: for every supported `tokenizer.ggml.pre` tag and for
//! SentencePiece, `Tokenizer::encode` must give the ids llama.cpp gave for a corpus of awkward
//! strings, recorded in `fixtures/tokenizer/ids.json` by `scripts/tokenizer_fixtures.py`.
//!
//! Each case names a vocabulary (a small GGUF in the fixture folder, or `default-model`, the
//! SmolLM2 file `cargo xtask fetch-model` caches; those cases are skipped when it is not there)
//! and metadata to override; the test writes that GGUF copy and builds its tokenizer.

use checkpoint::gguf::{GgufFile, GgufWriter, Value};
use std::path::{Path, PathBuf};
use text::Tokenizer;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fixtures").join("tokenizer")
}

fn fixture() -> serde_json::Value {
    let path = fixture_dir().join("ids.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).expect("ids.json is json")
}

fn temp_path(stem: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("tpctl-tok-{}-{n}-{stem}", std::process::id()))
}

/// The tokenizer of `vocab`'s metadata with `overrides` applied (strings and bools).
fn tokenizer(vocab: &Path, overrides: &serde_json::Map<String, serde_json::Value>) -> Tokenizer {
    let file = GgufFile::open(vocab).unwrap_or_else(|e| panic!("{vocab:?}: {e}"));
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        if key.starts_with("tokenizer.") && !overrides.contains_key(key) {
            w.metadata(key, value.clone());
        }
    }
    for (key, value) in overrides {
        let value = match value {
            serde_json::Value::String(s) => Value::String(s.clone()),
            serde_json::Value::Bool(b) => Value::Bool(*b),
            other => panic!("override {key}: {other} is neither a string nor a bool"),
        };
        w.metadata(key, value);
    }
    let path = temp_path("vocab.gguf");
    w.write(&path).unwrap();
    let t = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap());
    std::fs::remove_file(&path).unwrap();
    t.unwrap_or_else(|e| panic!("{vocab:?} with {overrides:?}: {e}"))
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn every_pre_tokenizer_and_sentencepiece_give_llama_cpp_ids() {
    let fixture = fixture();
    let corpus: Vec<&str> =
        fixture["corpus"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let default_model = checkpoint::cache::default_model_path();
    let (mut checked, mut skipped, mut failures) = (0, 0, Vec::new());
    for case in fixture["cases"].as_array().unwrap() {
        let vocab = case["vocab"].as_str().unwrap();
        let path = match vocab {
            "default-model" => match &default_model {
                Some(p) => p.clone(),
                None => {
                    skipped += 1;
                    continue;
                }
            },
            file => fixture_dir().join(file),
        };
        let overrides = case["metadata"].as_object().unwrap();
        let t = tokenizer(&path, overrides);
        let label = format!("{vocab} {}", serde_json::Value::Object(overrides.clone()));
        for (i, text) in corpus.iter().enumerate() {
            let want = ids(&case["ids"][i]);
            let got = t.encode(text).unwrap();
            if got != want {
                failures
                    .push(format!("{label}: {text:?}\n  llama.cpp {want:?}\n  ours      {got:?}"));
            }
            for (key, skip_special) in [("text", true), ("text_special", false)] {
                if let Some(want) = case.get(key).and_then(|t| t[i].as_str()) {
                    let got = t.decode(&ids(&case["ids"][i]), skip_special).unwrap();
                    if got != want {
                        failures.push(format!(
                            "{label}: decode({text:?}, skip_special={skip_special})\n  \
                             llama.cpp {want:?}\n  ours      {got:?}"
                        ));
                    }
                }
            }
            checked += 1;
        }
    }
    if skipped > 0 {
        eprintln!(
            "note: default model not cached (run `cargo xtask fetch-model`); skipped {skipped} \
             of its cases"
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // A guard against a truncated fixture: the cases that need no cached model cover them all.
    let tags: std::collections::HashSet<&str> = fixture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|case| case["metadata"]["tokenizer.ggml.pre"].as_str())
        .collect();
    assert!(tags.len() >= 25, "the fixture covers only {} pre-tokenizer tags", tags.len());
}

/// `Tokenizer::inner` of a SentencePiece GGUF is a BPE built the way Hugging Face converts
/// such vocabularies; on this corpus its ids are llama.cpp's too (the unit tests show where
/// they part).
#[test]
fn the_hugging_face_equivalent_of_sentencepiece_agrees_on_the_corpus() {
    let fixture = fixture();
    let corpus: Vec<&str> =
        fixture["corpus"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let cases = fixture["cases"].as_array().unwrap();
    let spm: Vec<_> = cases.iter().filter(|c| c["vocab"] == "spm-vocab.gguf").collect();
    assert_eq!(spm.len(), 2);
    for case in spm {
        let overrides = case["metadata"].as_object().unwrap();
        let t = tokenizer(&fixture_dir().join("spm-vocab.gguf"), overrides);
        for (i, text) in corpus.iter().enumerate() {
            let want = ids(&case["ids"][i]);
            let got = t.inner().encode_fast(*text, false).unwrap().get_ids().to_vec();
            assert_eq!(got[..], want[1..], "{overrides:?} {text:?} (llama.cpp's BOS left out)");
        }
    }
}
