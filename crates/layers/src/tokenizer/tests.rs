//! Tokenizer tests: a tiny hand-made vocabulary, and the real default model when cached.

use super::*;
use crate::gguf::{GgufWriter, Value};
use crate::test_util::temp_path;

fn strings(v: &[&str]) -> Value {
    Value::Array(v.iter().map(|s| Value::String((*s).to_owned())).collect())
}

const TINY_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}\
{{ raise_exception('no bad roles') }}{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}\
{% if add_generation_prompt %}[assistant]{% endif %}";

fn tiny() -> Tokenizer {
    let tokens = ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġab", "1", "2", "12", "<|im_start|>", "Ċ"];
    let types: Vec<Value> =
        tokens.iter().map(|t| Value::I32(if t.starts_with("<|") { 3 } else { 1 })).collect();
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", Value::String("smollm".into()))
        .metadata("tokenizer.ggml.tokens", strings(&tokens))
        .metadata("tokenizer.ggml.token_type", Value::Array(types))
        .metadata("tokenizer.ggml.merges", strings(&["a b", "Ġ ab", "1 2"]))
        .metadata("tokenizer.ggml.bos_token_id", Value::U32(9))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(0))
        .metadata("tokenizer.chat_template", Value::String(TINY_TEMPLATE.into()));
    let p = temp_path("tok.gguf");
    w.write(&p).unwrap();
    let t = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
    std::fs::remove_file(p).unwrap();
    t
}

#[test]
fn tiny_vocabulary_merges_splits_digits_and_keeps_special_tokens_whole() {
    let t = tiny();
    // "12" is a merge, but digits are split one by one before BPE sees them.
    assert_eq!(t.encode("ab ab12").unwrap(), vec![3, 5, 6, 7]);
    assert_eq!(t.encode("<|im_start|>ab\n").unwrap(), vec![9, 3, 10]);
    assert_eq!(t.decode(&[9, 3, 5, 10], false).unwrap(), "<|im_start|>ab ab\n");
    assert_eq!(t.decode(&[9, 3, 5], true).unwrap(), "ab ab");
    assert_eq!((t.bos_id(), t.eos_id()), (Some(9), Some(0)));
    assert_eq!(t.chat_template(), Some(TINY_TEMPLATE));
    assert_eq!(t.token_id("Ġab"), Some(5));
    assert_eq!(t.vocab_size(), 11);
}

#[test]
fn chat_template_renders_messages_and_reports_failures() {
    let t = tiny();
    let msgs = [ChatMessage::new("system", "be brief"), ChatMessage::new("user", "ab")];
    assert_eq!(
        t.apply_chat_template(&msgs, true).unwrap(),
        "<|im_start|>[system]be brief[user]ab[assistant]"
    );
    assert_eq!(t.apply_chat_template(&msgs[1..], false).unwrap(), "<|im_start|>[user]ab");
    let err = t.apply_chat_template(&[ChatMessage::new("bad", "x")], true).unwrap_err();
    assert!(
        err.to_string().starts_with("chat template: rendering:")
            && err.to_string().contains("no bad roles"),
        "{err}"
    );
}

#[test]
fn a_hugging_face_tokenizer_folder_loads_ids_specials_and_template() {
    let t = tiny();
    let dir = temp_path("hf-tok");
    std::fs::create_dir_all(&dir).unwrap();
    t.inner().save(dir.join("tokenizer.json"), false).unwrap();
    let cfg = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": { "content": "<|endoftext|>" },
        "chat_template": TINY_TEMPLATE,
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let hf = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(
        hf.encode("<|im_start|>ab ab12\n").unwrap(),
        t.encode("<|im_start|>ab ab12\n").unwrap()
    );
    assert_eq!((hf.bos_id(), hf.eos_id()), (Some(9), Some(0)));
    let msgs = [ChatMessage::new("user", "ab")];
    assert_eq!(
        hf.apply_chat_template(&msgs, true).unwrap(),
        t.apply_chat_template(&msgs, true).unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let err = Tokenizer::from_hf_dir(&dir).unwrap_err().to_string();
    assert!(err.starts_with("tokenizer: ") && err.contains("tokenizer.json"), "{err}");
}

#[test]
fn non_bpe_models_and_bad_merges_are_rejected_with_the_key() {
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("llama".into()));
    let p = temp_path("tok-spm.gguf");
    w.write(&p).unwrap();
    let err = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "metadata key `tokenizer.ggml.model`: `llama` is not supported (gpt2 byte-level BPE is)"
    );
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.tokens", strings(&["a"]))
        .metadata("tokenizer.ggml.merges", strings(&["ab"]));
    w.write(&p).unwrap();
    let err = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap_err();
    assert!(err.to_string().contains("`tokenizer.ggml.merges`: entry 0 `ab`"), "{err}");
    std::fs::remove_file(p).unwrap();
}

#[test]
fn real_model_tokenizer_when_cached() {
    let Some(path) = crate::model::default_model_path() else {
        eprintln!("note: default model not cached (run `cargo xtask fetch-model`); skipping");
        return;
    };
    let t = Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap();
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!((t.bos_id(), t.eos_id()), (Some(1), Some(2)));
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_id("<|im_end|>"), Some(2));
    assert!(t.chat_template().is_some_and(|c| c.contains("<|im_start|>")));
    for s in
        ["The capital of France is", "12345 apples", "héllo wörld 🦀\tx\n\ny", "I'm you'll", ""]
    {
        let ids = t.encode(s).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), s);
    }
    // Digits are single tokens; special tokens in text are single ids.
    assert_eq!(t.encode("2024").unwrap().len(), 4);
    assert_eq!(t.encode("<|im_start|>user\nHi<|im_end|>").unwrap()[0], 1);
    assert_eq!(t.encode("The capital of France is").unwrap(), REFERENCE_IDS);
    let chat = t.apply_chat_template(&[ChatMessage::new("user", "Hi")], true).unwrap();
    assert_eq!(
        chat,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// The ids of "The capital of France is": one per word ("The", " capital", " of", " France",
/// " is"), as the SmolLM2 vocabulary numbers them.
const REFERENCE_IDS: &[u32] = &[504, 3575, 282, 4649, 314];

#[test]
fn streamed_decoding_keeps_split_characters_whole() {
    // Byte-level pieces: "é" is C3 A9 ("Ã©"), "🦀" F0 9F A6 80 ("ðŁ¦Ģ"), "猫" E7 8C AB ("çĮ«").
    let tokens = ["<|endoftext|>", "a", "Ġ", "Ã", "©", "ð", "Ł", "¦", "Ģ", "ç", "Į", "«"];
    let types: Vec<Value> =
        tokens.iter().map(|t| Value::I32(if t.starts_with("<|") { 3 } else { 1 })).collect();
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.tokens", strings(&tokens))
        .metadata("tokenizer.ggml.token_type", Value::Array(types))
        .metadata("tokenizer.ggml.merges", strings(&[]))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(0));
    let p = temp_path("tok-stream.gguf");
    w.write(&p).unwrap();
    let t = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
    std::fs::remove_file(p).unwrap();

    let text = "aé 🦀猫a";
    let ids = t.encode(text).unwrap();
    assert_eq!(ids.len(), 12, "every multi-byte character is split into byte tokens: {ids:?}");
    let mut stream = TextStream::default();
    let pieces: Vec<String> =
        ids.iter().map(|&id| t.decode_next(&mut stream, id, false).unwrap()).collect();
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
    assert_eq!(pieces[..5], ["a", "", "é", " ", ""], "a character comes out with its last byte");
    // Piece by piece, as before, the bytes of a character came out as replacement characters.
    assert!(t.decode(&ids[1..2], true).unwrap().contains('\u{fffd}'));
    // A sequence that ends inside a character flushes it as U+FFFD and starts over.
    let mut stream = TextStream::default();
    assert_eq!(t.decode_next(&mut stream, ids[0], false).unwrap(), "a");
    assert_eq!(t.decode_next(&mut stream, ids[4], false).unwrap(), "");
    assert_eq!(t.decode_next(&mut stream, ids[5], true).unwrap(), "\u{fffd}");
    assert_eq!(t.decode_next(&mut stream, ids[0], true).unwrap(), "a");
}
