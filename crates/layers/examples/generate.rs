//! Greedy generation with the single-rank model, reporting prefill and decode speed.
//!
//! `cargo run -p tpctl-layers --example generate -- [--model GGUF-or-HF-DIR] [--threads N]
//! [--max-new N] [--chat] [--f32] PROMPT...` (the model defaults to the cached default model;
//! `--f32` dequantizes every weight at load instead of keeping the checkpoint's blocks).

use layers::model::{default_model_path, WeightForm};
use layers::{ChatMessage, Model, Tokenizer};
use std::io::Write;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (mut model, mut threads, mut max_new, mut chat) = (None, 2usize, 32usize, false);
    let mut form = WeightForm::Native;
    let mut prompt = Vec::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model = args.next(),
            "--threads" => threads = args.next().ok_or("--threads needs a value")?.parse()?,
            "--max-new" => max_new = args.next().ok_or("--max-new needs a value")?.parse()?,
            "--chat" => chat = true,
            "--f32" => form = WeightForm::F32,
            _ => prompt.push(a),
        }
    }
    let path = match model {
        Some(p) => p.into(),
        None => default_model_path().ok_or(
            "no --model and the default model is not cached: run `cargo xtask fetch-model`",
        )?,
    };
    let mut text =
        if prompt.is_empty() { "The capital of France is".to_owned() } else { prompt.join(" ") };
    let t0 = Instant::now();
    let model = Model::load_with(&path, threads, form)?;
    let tok = Tokenizer::load(&path)?;
    if chat {
        text = tok.apply_chat_template(&[ChatMessage::new("user", &text)], true)?;
    }
    eprintln!(
        "loaded {} in {:.2} s ({:.0} MB of weights, {threads} threads)",
        path.display(),
        t0.elapsed().as_secs_f64(),
        model.weight_bytes() as f64 / 1e6
    );
    let ids = tok.encode(&text)?;
    let mut cache = model.new_cache(ids.len() + max_new);
    let stop: Vec<u32> = tok.eos_id().into_iter().collect();
    let t_prefill = Instant::now();
    let mut first: Option<Instant> = None;
    let mut shown = String::new();
    let mut generated = Vec::new();
    print!("{text}");
    let out = model.generate(&ids, max_new, &stop, &mut cache, |id| {
        first.get_or_insert_with(Instant::now);
        generated.push(id);
        if let Ok(s) = tok.decode(&generated, true) {
            print!("{}", &s[shown.len().min(s.len())..]);
            let _ = std::io::stdout().flush();
            shown = s;
        }
    })?;
    let end = Instant::now();
    println!();
    let first = first.unwrap_or(end);
    let prefill_s = (first - t_prefill).as_secs_f64();
    let decode_s = (end - first).as_secs_f64();
    eprintln!(
        "prefill: {} tokens in {:.3} s = {:.1} tok/s",
        ids.len(),
        prefill_s,
        ids.len() as f64 / prefill_s
    );
    if out.len() > 1 {
        eprintln!(
            "decode: {} tokens in {:.3} s = {:.1} tok/s",
            out.len() - 1,
            decode_s,
            (out.len() - 1) as f64 / decode_s
        );
    }
    Ok(())
}
