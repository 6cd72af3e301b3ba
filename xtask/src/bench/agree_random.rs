//! `cargo xtask bench agree-random`: tpctl's logits at every position of a prompt next to
//! llama.cpp's, on random-weight files of the architectures whose real checkpoints are too big
//! to fetch here (Gemma 2, Gemma 3, Qwen3, Phi-3 with longrope).
//! `crates/layers/examples/random_logits.rs` writes the file with `RandomLlama` and prints
//! tpctl's logits in a layout; `scripts/llamacpp_logits.py` prints llama.cpp's for the same file
//! and ids (f32 keys and values, no flash attention).
//!
//! Passes when, in every layout of [`LAYOUTS`], every logit is within [`TOLERANCE`] of
//! llama.cpp's and the argmax is the same at every position.

use crate::util::{self, root};
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::process::Command;

/// The architectures checked (each a case of the example).
const ARCHS: [&str; 4] = ["gemma2", "gemma3", "qwen3", "phi3"];
/// The layouts compared: (tp, cp).
const LAYOUTS: [(usize, usize); 3] = [(1, 1), (2, 2), (3, 1)];
/// 12 ids: three times the test window of 4 (Gemma 2's and Gemma 3's).
const PROMPT: [u32; 12] = [3, 17, 5, 38, 0, 22, 9, 11, 30, 2, 14, 27];
/// The largest difference of a logit from llama.cpp's.
const TOLERANCE: f64 = 2e-3;

fn logits(out: &str, who: &str) -> Result<Vec<Vec<f64>>> {
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .with_context(|| format!("{who} printed no logits"))?;
    let v: Value = serde_json::from_str(line).with_context(|| format!("{who}'s logits"))?;
    Ok(serde_json::from_value(v["logits"].clone())?)
}

fn argmax(row: &[f64]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

pub(crate) fn run(json: bool) -> Result<()> {
    util::run(util::cargo().args(["build", "-p", "tpctl-layers", "--example", "random_logits"]))?;
    let example = root().join("target/debug/examples/random_logits");
    let ids: Vec<String> = PROMPT.iter().map(u32::to_string).collect();
    let mut failures = Vec::new();
    for arch in ARCHS {
        let file = std::env::temp_dir().join(format!("tpctl-agree-random-{arch}.gguf"));
        let mut reference = None;
        for (tp, cp) in LAYOUTS {
            let out = util::output(
                Command::new(&example)
                    .arg(arch)
                    .arg(&file)
                    .args([tp.to_string(), cp.to_string()])
                    .args(&ids),
            )?;
            let ours = logits(&out, "tpctl")?;
            if reference.is_none() {
                let out = util::output(
                    Command::new("python3")
                        .arg(root().join("scripts/llamacpp_logits.py"))
                        .arg(&file)
                        .args(&ids),
                )?;
                reference = Some(logits(&out, "llama.cpp")?);
            }
            let theirs = reference.as_ref().context("llama.cpp's logits")?;
            ensure!(ours.len() == theirs.len(), "{arch}: positions differ");
            let diff = ours
                .iter()
                .flatten()
                .zip(theirs.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            let same: usize =
                ours.iter().zip(theirs).filter(|(a, b)| argmax(a) == argmax(b)).count();
            if json {
                let row = json!({ "arch": arch, "tp": tp, "cp": cp, "max_logit_diff": diff,
                    "same_argmax": same, "positions": ours.len() });
                println!("{row}");
            } else {
                println!(
                    "{arch} ({tp},{cp}): max |logit - llama.cpp| {diff:.2e}, same argmax at \
                     {same} of {} positions",
                    ours.len()
                );
            }
            if diff > TOLERANCE || same != ours.len() {
                failures.push(format!("{arch} ({tp},{cp})"));
            }
        }
        std::fs::remove_file(&file).ok();
    }
    ensure!(failures.is_empty(), "disagrees with llama.cpp: {}", failures.join(", "));
    Ok(())
}
