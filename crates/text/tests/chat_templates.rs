//! Chat templates render as Hugging Face renders them: each template under
//! fixtures/chat_templates/ and conversation in fixtures/chat_templates.json, rendered by
//! jinja2 the way `apply_chat_template` does (scripts/chat_template_fixtures.py), must come
//! out the same here, character for character, refusals included.

use serde_json::Value;
use std::path::Path;
use text::tokenizer::chat::{render, ChatRequest};

fn fixtures() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures"))
}

#[test]
fn templates_render_as_hugging_face_renders_them() {
    let cases: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("chat_templates.json")).unwrap(),
    )
    .unwrap();
    assert!(cases.len() >= 12, "the fixture has {} renderings", cases.len());
    // The date the fixture was rendered with (`strftime_now`).
    let now = chrono::NaiveDate::from_ymd_opt(2026, 7, 26).unwrap().and_hms_opt(0, 0, 0).unwrap();
    let mut failures = Vec::new();
    for case in &cases {
        let name = case["template"].as_str().unwrap();
        let source =
            std::fs::read_to_string(fixtures().join(format!("chat_templates/{name}.jinja")))
                .unwrap();
        let mut context = case["context"].as_object().unwrap().clone();
        let take = |context: &mut serde_json::Map<String, Value>, key: &str| {
            context.remove(key).unwrap_or(Value::Null)
        };
        let messages = take(&mut context, "messages").as_array().unwrap().clone();
        let tools = Some(take(&mut context, "tools")).filter(|t| !t.is_null());
        let add_generation_prompt = take(&mut context, "add_generation_prompt") == true;
        let bos = take(&mut context, "bos_token");
        let eos = take(&mut context, "eos_token");
        let request = ChatRequest { messages, tools, add_generation_prompt, extra: context };
        let got = render(&source, &request, bos.as_str().unwrap(), eos.as_str().unwrap(), now);
        let what = format!("{name} / {}", case["case"]);
        match (&got, case.get("text"), case.get("error")) {
            (Ok(text), Some(want), _) if want == text.as_str() => {}
            (Err(e), None, Some(want)) if e.to_string().contains(want.as_str().unwrap()) => {}
            _ => failures.push(format!(
                "{what}:\n  got  {got:?}\n  want {:?}",
                case.get("text").or(case.get("error"))
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn an_extra_argument_cannot_replace_the_conversation() {
    let mut extra = serde_json::Map::new();
    extra.insert("messages".into(), Value::Array(Vec::new()));
    let request = ChatRequest { extra, ..ChatRequest::default() };
    let now = chrono::NaiveDate::from_ymd_opt(2026, 1, 1).unwrap().and_hms_opt(0, 0, 0).unwrap();
    let e = render("{{ messages }}", &request, "", "", now).unwrap_err().to_string();
    assert!(e.contains("`messages` would replace"), "{e}");
}
