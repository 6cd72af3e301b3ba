//! `bench large`: a model of Llama 3 8B's shapes on the CPU next to llama.cpp, same file, same
//! run. SmolLM2 (the other benches' model) fits in the caches' reach; an 8B model does not:
//! each decoded token reads gigabytes of 4-bit weights, so this is where the quantized
//! kernels' streaming shows. The file is `layers`' `shaped_llama` example's (`Q4_K` matrices
//! from a fixed seed, a byte-level vocabulary), written to a temporary directory and removed
//! after; both engines get a 16-token prompt on 2 threads, interleaved rounds, the best of each.

use super::field;
use crate::util::{self, cargo, root};
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

/// Interleaved rounds of (ours, llama.cpp); each figure is its best round.
const ROUNDS: usize = 2;
/// Prompt tokens.
const PROMPT: usize = 16;
/// Tokens decoded.
const DECODE: usize = 32;

/// One engine's best figures: prefill and decode tok/s, start-up seconds.
#[derive(Default)]
struct Figures {
    prefill: f64,
    decode: f64,
    startup: f64,
}

impl Figures {
    fn keep_best(&mut self, prefill: f64, decode: f64, startup: f64) {
        self.prefill = self.prefill.max(prefill);
        self.decode = self.decode.max(decode);
        self.startup = if self.startup == 0.0 { startup } else { self.startup.min(startup) };
    }
}

/// `tpctl run` of the prompt (the text's bytes: the vocabulary's first 256 tokens are bytes):
/// prefill from its time to first token, decode from the tokens after it.
fn ours(tpctl: &Path, model: &Path) -> Result<(f64, f64, f64)> {
    let text = b"The quick brown fox jumps over the lazy dog. ";
    let ids: Vec<String> = text[..PROMPT].iter().map(u8::to_string).collect();
    let out = util::output(
        Command::new(tpctl)
            .args(["run", "--quiet", "--threads", "2", "--max-tokens", &DECODE.to_string()])
            .args(["--output", "jsonl", "--prompt-ids", &ids.join(","), "--model"])
            .arg(model),
    )?;
    let line = out.lines().find(|l| l.starts_with('{')).context("tpctl run printed no line")?;
    let v: Value = serde_json::from_str(line).context("tpctl run's JSON line")?;
    let ms = |k: &str| v[k].as_f64().with_context(|| format!("no `{k}` in {line}"));
    let (ttft, total, startup) =
        (ms("time_to_first_token_ms")?, ms("total_ms")?, ms("startup_ms")?);
    let tokens = v["token_ids"].as_array().map_or(0, Vec::len);
    ensure!(tokens > 1 && total > ttft, "tpctl run decoded {tokens} tokens: {line}");
    let decode = (tokens - 1) as f64 / ((total - ttft) / 1e3);
    Ok((PROMPT as f64 / (ttft / 1e3), decode, startup / 1e3))
}

/// `llamacpp_bench.py` on the same file: its best prefill and decode of its own rounds, and
/// the whole call's seconds less those (its load).
fn reference(anchors: &Path, model: &Path) -> Result<(f64, f64, f64)> {
    let start = std::time::Instant::now();
    let out = util::output(
        Command::new("python3").arg(anchors.join("llamacpp_bench.py")).arg(model).args([
            "2",
            &PROMPT.to_string(),
            &DECODE.to_string(),
        ]),
    )?;
    let took = start.elapsed().as_secs_f64();
    let line = out
        .lines()
        .rev()
        .find(|l| l.contains("decode_tok_s"))
        .context("llama.cpp printed no result")?;
    let get = |k| {
        field(line, k)
            .and_then(|v| v.parse::<f64>().ok())
            .with_context(|| format!("no `{k}` in {line}"))
    };
    let (prefill, decode) = (get("prefill_tok_s")?, get("decode_tok_s")?);
    // Three rounds of prefill and decode ran inside the call.
    let compute = 3.0 * (PROMPT as f64 / prefill + DECODE as f64 / decode);
    Ok((prefill, decode, (took - compute).max(0.0)))
}

pub(crate) fn run(json: bool) -> Result<()> {
    let anchors = root().join("../shared/anchors");
    super::model::ensure_python_packages(&["llama-cpp-python"], &["llama_cpp"])?;
    let tpctl = super::model::release_tpctl()?;
    util::run(
        cargo()
            .args(["build", "--release", "--quiet", "-p", "tpctl-layers"])
            .args(["--example", "shaped_llama"]),
    )?;
    let dir = std::env::temp_dir().join(format!("tpctl-bench-large-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let model = dir.join("llama3-8b-shaped.Q4_K.gguf");
    let written = util::output(
        Command::new(root().join("target/release/examples/shaped_llama"))
            .args(["q4_k", "7"])
            .arg(&model),
    );
    let result = written.and_then(|written| {
        let step_bytes = field(written.trim(), "step_weight_bytes")
            .and_then(|v| v.parse::<f64>().ok())
            .context("shaped_llama printed no step_weight_bytes")?;
        let (mut a, mut b) = (Figures::default(), Figures::default());
        for _ in 0..ROUNDS {
            let (pf, dc, su) = ours(&tpctl, &model)?;
            a.keep_best(pf, dc, su);
            let (pf, dc, su) = reference(&anchors, &model)?;
            b.keep_best(pf, dc, su);
        }
        Ok((step_bytes, a, b))
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (step_bytes, a, b) = result?;
    if json {
        let row = json!({
            "bench": "large", "model": "llama3-8b-shaped Q4_K", "threads": 2,
            "prompt_tokens": PROMPT, "decode_tokens": DECODE, "step_weight_bytes": step_bytes,
            "prefill_tok_s": a.prefill, "decode_tok_s": a.decode, "startup_s": a.startup,
            "llamacpp_prefill_tok_s": b.prefill, "llamacpp_decode_tok_s": b.decode,
            "llamacpp_load_s": b.startup,
            "prefill_ratio": a.prefill / b.prefill, "decode_ratio": a.decode / b.decode,
        });
        println!("{row}");
        return Ok(());
    }
    println!(
        "Llama 3 8B's shapes, Q4_K weights from a seed ({:.2} GB a decoded token in the file), \
         one rank, 2 threads, a {PROMPT}-token prompt, {DECODE} tokens; best of {ROUNDS} \
         interleaved rounds each, same file, same machine, same run",
        step_bytes / 1e9
    );
    println!("{:<10} {:>14} {:>13} {:>12}", "", "prefill tok/s", "decode tok/s", "start-up s");
    println!("{:<10} {:>14.1} {:>13.2} {:>12.1}", "tpctl", a.prefill, a.decode, a.startup);
    println!("{:<10} {:>14.1} {:>13.2} {:>12.1}", "llama.cpp", b.prefill, b.decode, b.startup);
    println!(
        "{:<10} {:>13.2}x {:>12.2}x {:>11.2}x",
        "ratio",
        a.prefill / b.prefill,
        a.decode / b.decode,
        a.startup / b.startup.max(1e-9)
    );
    println!(
        "decode reads {:.1} GB/s of the file's weights in tpctl, {:.1} in llama.cpp",
        step_bytes * a.decode / 1e9,
        step_bytes * b.decode / 1e9
    );
    Ok(())
}
