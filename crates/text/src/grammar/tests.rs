//! Grammar tests over a small byte-level vocabulary (every printable ASCII character, a few
//! longer pieces, an end token and a control token): each kind of grammar allows exactly the
//! tokens that continue it, ends with the end token only, and a grammar that does not compile
//! is refused with what is wrong.

use super::*;
use checkpoint::gguf::{GgufFile, GgufWriter, Value};
use tensor::test_util::temp_path;

const EOS: u32 = 0;
const CONTROL: u32 = 1;

/// `<|endoftext|>` (0, the end), `<|im_start|>` (1, control), the characters ' '..='~' from
/// id 2 on, then `{"`, `":` and `yes`.
fn vocabulary() -> Tokenizer {
    vocabulary_ending_also_at(None)
}

/// [`vocabulary`] with another end-of-turn id.
fn vocabulary_ending_also_at(eot: Option<u32>) -> Tokenizer {
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into()];
    // Byte-level BPE spells the space as U+0120.
    tokens.extend((b' '..=b'~').map(|b| {
        if b == b' ' {
            "Ġ".into()
        } else {
            char::from(b).to_string()
        }
    }));
    tokens.extend(["{\"", "\":", "yes"].map(String::from));
    let types: Vec<Value> =
        (0..tokens.len()).map(|i| Value::I32(if i < 2 { 3 } else { 1 })).collect();
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        )
        .metadata("tokenizer.ggml.token_type", Value::Array(types))
        .metadata("tokenizer.ggml.merges", Value::Array(Vec::new()))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(EOS));
    if let Some(eot) = eot {
        w.metadata("tokenizer.ggml.eot_token_id", Value::U32(eot));
    }
    let p = temp_path("grammar-vocab.gguf");
    w.write(&p).unwrap();
    let t = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
    std::fs::remove_file(p).unwrap();
    t
}

/// The id of a one-character token.
fn id(c: char) -> u32 {
    c as u32 - u32::from(b' ') + 2
}

fn engine() -> (Tokenizer, GrammarEngine) {
    let t = vocabulary();
    let e = GrammarEngine::new(&t).unwrap();
    (t, e)
}

/// The ids the matcher allows now.
fn allowed(m: &mut GrammarMatcher, vocab: usize) -> Vec<u32> {
    let words = m.allowed().unwrap().to_vec();
    (0..vocab as u32).filter(|&i| words[i as usize / 32] >> (i % 32) & 1 == 1).collect()
}

/// Feeds `text` one character at a time.
fn feed(m: &mut GrammarMatcher, text: &str) {
    for c in text.chars() {
        m.accept(id(c)).unwrap_or_else(|e| panic!("{c:?} of {text:?}: {e}"));
    }
}

/// Follows the lowest allowed id until only the end is allowed; the text on the way.
fn lowest_path(t: &Tokenizer, m: &mut GrammarMatcher, vocab: usize) -> String {
    let mut out = Vec::new();
    for _ in 0..200 {
        let ids = allowed(m, vocab);
        let next = ids.iter().copied().find(|&i| i != EOS);
        match next {
            Some(next) if !m.is_finished() => {
                out.extend(t.token_bytes(next).unwrap());
                m.accept(next).unwrap();
            }
            _ => {
                assert_eq!(ids, [EOS], "after {:?}", String::from_utf8_lossy(&out));
                return String::from_utf8(out).unwrap();
            }
        }
    }
    panic!("no end after 200 tokens: {:?}", String::from_utf8_lossy(&out));
}

#[test]
fn a_regex_allows_exactly_its_continuations_then_only_the_end() {
    let (t, e) = engine();
    let vocab = t.vocab_size();
    let mut m = e.matcher(&Grammar::Regex("[0-9]{2}x?".into())).unwrap();
    let digits: Vec<u32> = ('0'..='9').map(id).collect();
    assert_eq!(allowed(&mut m, vocab), digits);
    feed(&mut m, "42");
    // It may end here or take the optional `x`.
    assert_eq!(allowed(&mut m, vocab), [EOS, id('x')]);
    assert!(!m.is_finished());
    feed(&mut m, "x");
    assert_eq!(allowed(&mut m, vocab), [EOS]);
    assert!(m.is_finished());
    assert!(m.accept(id('y')).is_err() || allowed(&mut m, vocab) == [EOS]);
}

#[test]
fn a_choice_allows_its_strings_and_longer_pieces_of_them() {
    let (t, e) = engine();
    let vocab = t.vocab_size();
    let mut m = e.matcher(&Grammar::Choice(vec!["yes".into(), "no".into()])).unwrap();
    let yes = t.token_id("yes").unwrap();
    assert_eq!(allowed(&mut m, vocab), [id('n'), id('y'), yes]);
    m.accept(yes).unwrap();
    assert_eq!(allowed(&mut m, vocab), [EOS]);
    let err = e.matcher(&Grammar::Choice(Vec::new())).unwrap_err().to_string();
    assert_eq!(err, "invalid choice: the list of choices is empty");
}

#[test]
fn a_json_schema_is_followed_compactly_to_a_valid_value() {
    let (t, e) = engine();
    let vocab = t.vocab_size();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 3}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false,
    });
    let mut m = e.matcher(&Grammar::JsonSchema(schema.to_string())).unwrap();
    // Only the object's opening: no whitespace, no other value, never the control token.
    let open = t.token_id("{\"").unwrap();
    assert_eq!(allowed(&mut m, vocab), [id('{'), open]);
    // The lowest ids: spaces (the first characters) fill the string up to its length, the
    // number starts with its sign; no whitespace between the syntax's tokens.
    let text = lowest_path(&t, &mut m, vocab);
    assert_eq!(text, r#"{"name":"   ","age":-0}"#);
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(value["name"].is_string() && value["age"].is_number(), "{text}");

    let mut m = e.matcher(&Grammar::JsonObject).unwrap();
    feed(&mut m, "{\"a\":[1,true]}");
    assert_eq!(allowed(&mut m, vocab), [EOS]);
    assert!(!allowed(&mut e.matcher(&Grammar::JsonObject).unwrap(), vocab).contains(&CONTROL));
}

#[test]
fn a_lark_grammar_is_followed() {
    let (t, e) = engine();
    let vocab = t.vocab_size();
    let mut m = e.matcher(&Grammar::Lark("start: \"a\"+ \"b\"".into())).unwrap();
    assert_eq!(allowed(&mut m, vocab), [id('a')]);
    feed(&mut m, "aa");
    assert_eq!(allowed(&mut m, vocab), [id('a'), id('b')]);
    feed(&mut m, "b");
    assert_eq!(allowed(&mut m, vocab), [EOS]);
}

#[test]
fn grammars_that_do_not_compile_are_refused_with_the_problem() {
    let (_, e) = engine();
    let cases = [
        (Grammar::JsonSchema("{\"type\": ".into()), "invalid JSON schema: not JSON"),
        (Grammar::JsonSchema("{\"type\": \"nonsense\"}".into()), "invalid JSON schema: "),
        (Grammar::Regex("(ab".into()), "invalid regex: "),
        (Grammar::Lark("start: (".into()), "invalid grammar: "),
    ];
    for (grammar, start) in cases {
        let err = e.matcher(&grammar).unwrap_err().to_string();
        assert!(err.starts_with(start) && err.len() > start.len(), "{grammar:?}: {err}");
    }
}

#[test]
fn end_ids_past_the_vocabulary_are_not_tokens() {
    let t = vocabulary_ending_also_at(Some(99_999));
    assert_eq!(t.eos_ids(), [EOS, 99_999]);
    let e = GrammarEngine::new(&t).unwrap();
    assert_eq!(e.end_ids(), [EOS]);
    let t = vocabulary_ending_also_at(Some(CONTROL));
    let e = GrammarEngine::new(&t).unwrap();
    assert_eq!(e.end_ids(), [EOS, CONTROL]);
    let mut m = e.matcher(&Grammar::Regex("a".into())).unwrap();
    m.accept(id('a')).unwrap();
    assert_eq!(allowed(&mut m, t.vocab_size()), [EOS, CONTROL], "every end id ends it");
}
