//! Tokenizer tests: tiny hand-made vocabularies (byte-level BPE and SentencePiece), the
//! pre-tokenizer table, and the real default model when cached. The ids of every
//! pre-tokenizer against llama.cpp's are checked in `tests/gguf_tokenizers.rs`.

use super::*;
use checkpoint::gguf::{GgufWriter, Value};
use tensor::test_util::temp_path;

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

/// A folder whose `tokenizer.json` lists no `added_tokens` (older and converted folders):
/// the special tokens `tokenizer_config.json` names stay whole, with their vocabulary ids, as
/// Hugging Face's tokenizer keeps them; without the config they are split as text.
#[test]
fn special_tokens_of_tokenizer_config_stay_whole_without_added_tokens() {
    let t = tiny();
    let dir = temp_path("hf-tok-config");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    t.inner().save(&path, false).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["added_tokens"] = serde_json::json!([]);
    std::fs::write(&path, json.to_string()).unwrap();
    let text = "<|im_start|>ab<|endoftext|>";
    let bare = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_ne!(bare.encode(text).unwrap(), [9, 3, 0], "the test needs a folder that splits them");
    let cfg = serde_json::json!({
        "added_tokens_decoder": {"9": {"content": "<|im_start|>", "special": true}},
        "eos_token": {"content": "<|endoftext|>"},
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let hf = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(hf.encode(text).unwrap(), [9, 3, 0]);
    assert_eq!(hf.eos_id(), Some(0));
    assert_eq!(hf.decode(&[9, 3, 0], true).unwrap(), "ab", "special tokens are skippable");
    std::fs::remove_dir_all(&dir).unwrap();
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

fn write_and_load(w: &GgufWriter, stem: &str) -> Result<Tokenizer> {
    let p = temp_path(stem);
    w.write(&p).unwrap();
    let t = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap());
    std::fs::remove_file(p).unwrap();
    t
}

#[test]
fn unknown_models_pre_tokenizers_and_bad_merges_are_rejected_with_the_key() {
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("bert".into()))
        .metadata("tokenizer.ggml.tokens", strings(&["a"]));
    let err = write_and_load(&w, "tok-bert.gguf").unwrap_err();
    assert_eq!(
        err.to_string(),
        "metadata key `tokenizer.ggml.model`: `bert` is not supported (gpt2 byte-level BPE and \
         llama SentencePiece are)"
    );
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.tokens", strings(&["a"]))
        .metadata("tokenizer.ggml.merges", strings(&["ab"]));
    let err = write_and_load(&w, "tok-merges.gguf").unwrap_err();
    assert!(err.to_string().contains("`tokenizer.ggml.merges`: entry 0 `ab`"), "{err}");
    w.metadata("tokenizer.ggml.merges", strings(&[]))
        .metadata("tokenizer.ggml.pre", Value::String("no-such-tag".into()));
    let err = write_and_load(&w, "tok-pre.gguf").unwrap_err().to_string();
    assert!(
        err.starts_with(
            "metadata key `tokenizer.ggml.pre`: unknown pre-tokenizer `no-such-tag` (known \
             families: default, gpt-2, starcoder, llama-bpe,"
        ),
        "{err}"
    );
    w.metadata("tokenizer.ggml.pre", Value::U32(1));
    let err = write_and_load(&w, "tok-pre.gguf").unwrap_err().to_string();
    assert_eq!(err, "metadata key `tokenizer.ggml.pre`: expected a string");
    w.metadata("tokenizer.ggml.pre", Value::String("qwen2".into()))
        .metadata("tokenizer.ggml.token_type", Value::Array(vec![]));
    let err = write_and_load(&w, "tok-types.gguf").unwrap_err().to_string();
    assert_eq!(err, "metadata key `tokenizer.ggml.token_type`: 0 entries for 1 tokens");
}

#[test]
fn every_pre_tokenizer_tag_is_in_one_family_and_every_family_builds() {
    let mut seen = std::collections::HashSet::new();
    for family in pre::TABLE {
        family.build().unwrap_or_else(|e| panic!("{}: {e}", family.tags[0]));
        for tag in family.tags {
            assert!(seen.insert(*tag), "tag {tag} is in two families");
            assert!(std::ptr::eq(pre::lookup(tag).unwrap(), family), "{tag}");
        }
    }
    for tag in ["llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "falcon", "mpt", "gpt-4o"] {
        assert!(seen.contains(tag), "{tag}");
    }
}

/// The words a family's pre-tokenizer cuts `text` into (spaces shown as `Ġ`).
fn words(tag: &str, text: &str) -> Vec<String> {
    use tokenizers::PreTokenizer as _;
    let mut s = tokenizers::PreTokenizedString::from(text);
    pre::lookup(tag).unwrap().build().unwrap().pre_tokenize(&mut s).unwrap();
    s.get_splits(tokenizers::OffsetReferential::Original, tokenizers::OffsetType::Char)
        .into_iter()
        .map(|(w, _, _)| w.to_owned())
        .collect()
}

#[test]
fn pre_tokenizers_split_as_llama_cpp_does() {
    // Llama 3: numbers by three digits, case-insensitive contractions, a space or a symbol
    // joins the word after it, newlines stay with what precedes them.
    assert_eq!(words("llama-bpe", "12345 IT'S"), ["123", "45", "ĠIT", "'S"]);
    assert_eq!(words("llama-bpe", "a  \n\nb"), ["a", "ĠĠĊĊ", "b"]);
    // Qwen 2: single digits. StarCoder family: single digits, then GPT-2's split.
    assert_eq!(words("qwen2", "x=12"), ["x", "=", "1", "2"]);
    assert_eq!(words("smollm", "ab12 cd"), ["ab", "1", "2", "Ġcd"]);
    // GPT-2: lower-case contractions only, whitespace runs leave their last space to the word.
    assert_eq!(words("gpt-2", "IT'S it's   x"), ["IT", "'", "S", "Ġit", "'s", "ĠĠ", "Ġx"]);
    // Tekken: words break before an upper-case letter that follows a lower-case one.
    assert_eq!(words("tekken", "camelCase"), ["camel", "Case"]);
    // DeepSeek LLM: its letter class holds the Kelvin and Ohm signs as written (an editor's
    // normalization would turn them into `K` and `Ω`, and `K-ℭ` into a range from `K`).
    let letters = pre::lookup("deepseek-llm").unwrap().regexes[1];
    assert!(letters.contains("\u{2126}\u{2128}\u{212a}-\u{212d}"), "{letters}");
    // Its punctuation class spans ASCII letters too, so it cuts what the letters joined, and
    // its CJK class runs from U+0800 to U+4E00, so it isolates the Kelvin sign as well.
    assert_eq!(words("deepseek-llm", "caf\u{e9} \u{212a}"), ["caf", "Ã©", "Ġ", "âĦª"]);
}

/// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens (ids 3..=258),
/// then `▁` 259, `a` 260, `b` 261, `ba` 262 and `ab` 263 (equal scores), `▁é` 264 (though `é`
/// is no token) and the user-defined `<|x|>` 265.
fn tiny_spm(add_space_prefix: bool) -> Tokenizer {
    let mut pieces: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    pieces.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
    let mut kinds = vec![2, 3, 3];
    kinds.extend([6; 256]);
    let mut scores = vec![0.0; pieces.len()];
    for (piece, score, kind) in [
        ("\u{2581}", -1.0, 1),
        ("a", -2.0, 1),
        ("b", -3.0, 1),
        ("ba", -5.0, 1),
        ("ab", -5.0, 1),
        ("\u{2581}\u{e9}", -4.0, 1),
        ("<|x|>", 0.0, 4),
    ] {
        pieces.push(piece.to_owned());
        scores.push(score);
        kinds.push(kind);
    }
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("llama".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            Value::Array(pieces.into_iter().map(Value::String).collect()),
        )
        .metadata(
            "tokenizer.ggml.scores",
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(kinds.into_iter().map(Value::I32).collect()),
        )
        .metadata("tokenizer.ggml.add_space_prefix", Value::Bool(add_space_prefix));
    write_and_load(&w, "tok-spm.gguf").unwrap()
}

#[test]
fn sentencepiece_merges_the_best_score_leftmost_first_and_falls_back_to_bytes() {
    let t = tiny_spm(true);
    // Each expectation is what llama.cpp (llama-cpp-python 0.3.36, vocab_only) gives.
    for (text, ids) in [
        // `ab` and `ba` score alike: the leftmost pair merges first.
        ("aba", &[1, 259, 263, 260][..]),
        // `▁é` is a token though `é` is not: two symbols merge whenever their text is one.
        ("é", &[1, 264]),
        ("ab é", &[1, 259, 263, 264]),
        // A space goes in front of the text and after each special token.
        ("<|x|>ab", &[1, 265, 259, 263]),
        ("a<|x|>b", &[1, 259, 260, 265, 259, 261]),
        // A character that is no token is spelled with its UTF-8 bytes.
        ("éé", &[1, 264, 198, 172]),
        ("中", &[1, 259, 231, 187, 176]),
        ("", &[1]),
    ] {
        assert_eq!(t.encode(text).unwrap(), ids, "{text:?}");
    }
    // Hugging Face's conversion ranks merges by pair, so there `ba` (the lower id) wins the
    // tie, and `▁` + `é` cannot merge as `é` is not a token: hence the hand-written merger.
    let hf = |text: &str| t.inner().encode_fast(text, false).unwrap().get_ids().to_vec();
    assert_eq!(hf("aba"), [259, 260, 262]);
    assert_eq!(hf("é"), [259, 198, 172]);
    assert_eq!((t.bos_id(), t.eos_id(), t.vocab_size()), (Some(1), Some(2), 266));
    assert_eq!((t.token_id("ab"), t.token_id("<|x|>")), (Some(263), Some(265)));
    let t = tiny_spm(false);
    assert_eq!(t.encode("aba").unwrap(), [1, 263, 260]);
    assert_eq!(t.encode("a<|x|>b").unwrap(), [1, 260, 265, 261]);
}

#[test]
fn sentencepiece_decodes_as_llama_cpp_detokenizes() {
    let t = tiny_spm(true);
    let ids = [1, 259, 263, 264, 198, 172, 265, 2];
    // Skipping special tokens drops the BOS the model adds, and then keeps the space that
    // was put in front of the text; control tokens vanish, user-defined ones stay.
    assert_eq!(t.decode(&ids, true).unwrap(), " ab éé<|x|>");
    assert_eq!(t.decode(&ids, false).unwrap(), "<s> ab éé<|x|></s>");
    // Without a BOS first, the space put in front of the text goes.
    assert_eq!(t.decode(&ids[1..], true).unwrap(), "ab éé<|x|>");
    assert_eq!(t.decode(&[264, 198], true).unwrap(), "é\u{fffd}");
    let err = t.decode(&[266], true).unwrap_err().to_string();
    assert_eq!(err, "tokenizer: token id 266 is outside the vocabulary of 266");
    assert_eq!(tiny_spm(false).decode(&[259, 260], true).unwrap(), " a");
}

#[test]
fn sentencepiece_streams_whole_characters() {
    let t = tiny_spm(true);
    // " ab", then 中 (E4 B8 AD) in three byte tokens, then "a", then the control token </s>.
    let ids = [259, 263, 231, 187, 176, 260, 2];
    let mut stream = TextStream::default();
    let pieces: Vec<String> =
        ids.iter().map(|&id| t.decode_next(&mut stream, id, false).unwrap()).collect();
    assert_eq!(pieces, [" ", "ab", "", "", "中", "a", ""]);
    let mut stream = TextStream::default();
    assert_eq!(t.decode_next(&mut stream, 231, false).unwrap(), "");
    assert_eq!(t.decode_next(&mut stream, 187, true).unwrap(), "\u{fffd}");
    assert_eq!(t.decode_next(&mut stream, 260, true).unwrap(), "a");
    // A byte that starts no character comes out as U+FFFD at once.
    let mut stream = TextStream::default();
    assert_eq!(t.decode_next(&mut stream, 3 + 0xff, false).unwrap(), "\u{fffd}");
}

#[test]
fn special_tokens_are_cut_longest_first() {
    let s = special::Specials::new(vec![
        ("<a>".into(), 1),
        ("<a><b>".into(), 2),
        ("<b>".into(), 3),
        ("xy".into(), 4),
        ("yzw".into(), 5),
        (String::new(), 6),
    ]);
    use special::Fragment::{Text, Token};
    assert_eq!(s.split(""), []);
    assert_eq!(s.split("x"), [Text("x")]);
    assert_eq!(s.split("<a><b><b>x<a>"), [Token(2), Token(3), Text("x"), Token(1)]);
    // `yzw` is longer than `xy`, so it is cut first, though `xy` starts earlier (a
    // leftmost-first search, as Hugging Face's, would take `xy`).
    assert_eq!(s.split("xyzw xy"), [Text("x"), Token(5), Text(" "), Token(4)]);
}

#[test]
fn user_defined_tokens_stay_whole_and_show_when_special_ones_are_skipped() {
    let tokens = ["<|c|>", "<u>", "a", "b"];
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", Value::String("gpt-2".into()))
        .metadata("tokenizer.ggml.tokens", strings(&tokens))
        .metadata("tokenizer.ggml.token_type", Value::Array([3, 4, 1, 1].map(Value::I32).to_vec()))
        .metadata("tokenizer.ggml.merges", strings(&[]))
        .metadata("tokenizer.ggml.add_eos_token", Value::Bool(true))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(0));
    let t = write_and_load(&w, "tok-user.gguf").unwrap();
    assert_eq!(t.encode("a<u>b<|c|>").unwrap(), [2, 1, 3, 0, 0]);
    assert_eq!(t.decode(&[2, 1, 3, 0], true).unwrap(), "a<u>b");
    assert_eq!(t.decode(&[2, 1, 3, 0], false).unwrap(), "a<u>b<|c|>");
}

#[test]
fn real_model_tokenizer_when_cached() {
    let Some(path) = checkpoint::cache::default_model_path() else {
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

/// A token that is part of a multi-byte character gives its own bytes (they join into the
/// text), where decoding it alone gives U+FFFD: byte-level BPE (`é` as the two tokens `Ã` and
/// `©`), SentencePiece byte tokens (`中`), and Hugging Face's `tokenizer.json` of the same
/// vocabularies; special and user-defined tokens give their text.
#[test]
fn token_bytes_are_the_tokens_own_bytes_even_inside_a_character() {
    let tokens = ["<|endoftext|>", "\u{c3}", "\u{a9}", "\u{120}", "a", "<|im_start|>"];
    let types: Vec<Value> =
        tokens.iter().map(|t| Value::I32(if t.starts_with("<|") { 3 } else { 1 })).collect();
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", Value::String("smollm".into()))
        .metadata("tokenizer.ggml.tokens", strings(&tokens))
        .metadata("tokenizer.ggml.token_type", Value::Array(types))
        .metadata("tokenizer.ggml.merges", strings(&[]))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(0));
    let bpe = write_and_load(&w, "tok-bytes.gguf").unwrap();
    let ids = bpe.encode("\u{e9} a").unwrap();
    assert_eq!(ids, [1, 2, 3, 4]);
    assert_eq!(bpe.decode(&[1], false).unwrap(), "\u{fffd}", "alone, half a character");
    let joined: Vec<u8> = ids.iter().flat_map(|&id| bpe.token_bytes(id).unwrap()).collect();
    assert_eq!(joined, "\u{e9} a".as_bytes());
    assert_eq!(bpe.token_bytes(1).unwrap(), [0xC3]);
    assert_eq!(bpe.token_bytes(5).unwrap(), b"<|im_start|>");
    assert!(bpe.token_bytes(99).is_err(), "an id outside the vocabulary");

    let spm = tiny_spm(true);
    let ids = spm.encode("\u{4e2d}").unwrap();
    assert_eq!(ids, [1, 259, 231, 187, 176]);
    let joined: Vec<u8> = ids[1..].iter().flat_map(|&id| spm.token_bytes(id).unwrap()).collect();
    assert_eq!(joined, " \u{4e2d}".as_bytes());
    assert_eq!(spm.token_bytes(231).unwrap(), [0xE4]);
    assert_eq!(spm.token_bytes(265).unwrap(), b"<|x|>");

    // The same byte-level vocabulary as a Hugging Face folder.
    let dir = temp_path("hf-bytes");
    std::fs::create_dir_all(&dir).unwrap();
    bpe.inner().save(dir.join("tokenizer.json"), false).unwrap();
    let hf = Tokenizer::from_hf_dir(&dir).unwrap();
    let joined: Vec<u8> = [1, 2, 3, 4].iter().flat_map(|&id| hf.token_bytes(id).unwrap()).collect();
    assert_eq!(joined, "\u{e9} a".as_bytes());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn control_tokens_are_told_from_text_in_every_codec() {
    let t = tiny();
    let dir = temp_path("hf-control");
    std::fs::create_dir_all(&dir).unwrap();
    t.inner().save(dir.join("tokenizer.json"), false).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    let hf = Tokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    for t in [&t, &hf] {
        let control: Vec<u32> = (0..11).filter(|&id| t.is_control(id)).collect();
        assert_eq!(control, [0, 9], "<|endoftext|> and <|im_start|>");
    }
    let spm = tiny_spm(true);
    // <unk>, <s>, </s>: not the byte tokens, pieces or the user-defined <|x|>.
    let control: Vec<u32> = (0..266).filter(|&id| spm.is_control(id)).collect();
    assert_eq!(control, [0, 1, 2]);
}
