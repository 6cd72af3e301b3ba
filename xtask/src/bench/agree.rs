//! `cargo xtask bench agree`: tpctl's greedy tokens and log-probabilities next to llama.cpp's on
//! the same GGUF files and prompt ids, measured in the same run (`scripts/llamacpp_greedy.py`).
//! The files: the default Q4_1 model, its f32 copy, and that copy quantized by llama.cpp's own
//! quantizer to each of [`QUANTIZED`] (files nobody here wrote).
//!
//! - Greedy ids: [`PROMPTS`] prompts of [`PROMPT_TOKENS`] ids, [`DECODE`] tokens each (to an end
//!   token at most, as both stop there), through `tpctl run` in every layout of [`LAYOUTS`]: how
//!   many continuations equal llama.cpp's, and for each that does not, the step where it departs
//!   and llama.cpp's margin between its two best logits there (a near tie is the two
//!   implementations' rounding, not a bug).
//! - The exact answer: `scripts/f64_forward.py`, an f64 numpy forward over the file's weights
//!   as gguf-py dequantizes them, on the same prompts: how many continuations of tpctl (1x1)
//!   and of llama.cpp equal it, and the exact top-2 margin where one departs. This tells which
//!   side a departure above comes from (llama.cpp rounds activations to 8 bits for quantized
//!   products; tpctl multiplies in f32).
//! - Log-probabilities: the same prompts through `tpctl serve` (one rank) with `logprobs`: the
//!   largest difference from llama.cpp's log-probability of the same token, over every token
//!   both chose alike. llama.cpp runs without flash attention, whose CPU path is itself up to
//!   7e-3 away from an f64 forward on the f32 file (`scripts/f64_forward.py`).

use super::model::{llamacpp_quantized, release_tpctl, Reference};
use super::serve::Server;
use crate::util::{self, root};
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

/// Prompts, their length in ids, and tokens generated per prompt.
const PROMPTS: usize = 16;
const PROMPT_TOKENS: usize = 32;
const DECODE: usize = 32;
/// The layouts compared: (tp, cp).
const LAYOUTS: [(usize, usize); 3] = [(1, 1), (2, 2), (3, 1)];
/// The llama.cpp quantizations of the f32 copy compared besides it and the default file.
const QUANTIZED: [&str; 4] = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"];

/// llama.cpp's greedy continuations.
struct Greedy {
    prompts: Vec<Vec<u32>>,
    runs: Vec<Run>,
}

struct Run {
    ids: Vec<u32>,
    logprobs: Vec<f64>,
    margins: Vec<f64>,
}

fn reference(model: &Path) -> Result<Greedy> {
    let out =
        util::output(
            Command::new("python3")
                .arg(root().join("scripts/llamacpp_greedy.py"))
                .arg(model)
                .args(["2", &PROMPTS.to_string(), &PROMPT_TOKENS.to_string(), &DECODE.to_string()]),
        )?;
    let line =
        out.lines().rev().find(|l| l.starts_with('{')).context("llama.cpp printed nothing")?;
    let v: Value = serde_json::from_str(line).context("llama.cpp's result")?;
    let list = |v: &Value, key: &str| v[key].clone();
    let runs = v["runs"]
        .as_array()
        .context("llama.cpp's `runs`")?
        .iter()
        .map(|r| {
            Ok(Run {
                ids: serde_json::from_value(list(r, "ids"))?,
                logprobs: serde_json::from_value(list(r, "logprobs"))?,
                margins: serde_json::from_value(list(r, "margins"))?,
            })
        })
        .collect::<Result<_>>()?;
    let r = Greedy { prompts: serde_json::from_value(list(&v, "prompts"))?, runs };
    ensure!(r.prompts.len() == PROMPTS && r.runs.len() == PROMPTS, "llama.cpp ran other prompts");
    Ok(r)
}

/// The exact continuations of `prompts` (`scripts/f64_forward.py`), each with the top-2
/// margins of its steps.
fn exact(model: &Path, prompts: &[Vec<u32>]) -> Result<Vec<(Vec<u32>, Vec<f64>)>> {
    let dir = root().join("target/agree");
    std::fs::create_dir_all(&dir).context("creating target/agree")?;
    let file = dir.join("prompts.json");
    std::fs::write(&file, serde_json::to_vec(prompts)?).context("writing the prompts")?;
    let out = util::output(
        Command::new("python3")
            .arg(root().join("scripts/f64_forward.py"))
            .arg(model)
            .arg(&file)
            .arg(DECODE.to_string()),
    )?;
    let line =
        out.lines().rev().find(|l| l.starts_with('[')).context("f64_forward printed nothing")?;
    let runs: Vec<Value> = serde_json::from_str(line).context("f64_forward's result")?;
    runs.iter()
        .map(|r| {
            let ids = serde_json::from_value(r["ids"].clone()).context("exact ids")?;
            let margins = serde_json::from_value(r["margins"].clone()).context("exact margins")?;
            Ok((ids, margins))
        })
        .collect()
}

/// How many of `got` equal the exact continuations over their common length, and the largest
/// exact top-2 margin at a step where one departs.
fn against_exact(got: &[Vec<u32>], exact: &[(Vec<u32>, Vec<f64>)]) -> (usize, f64) {
    let departures: Vec<f64> = got
        .iter()
        .zip(exact)
        .filter_map(|(g, (ids, margins))| {
            g.iter().zip(ids).position(|(a, b)| a != b).map(|k| margins[k])
        })
        .collect();
    (got.len() - departures.len(), departures.into_iter().fold(0.0, f64::max))
}

/// `tpctl run`'s greedy ids for every prompt in one layout.
fn ours(
    tpctl: &Path,
    model: &Path,
    (tp, cp): (usize, usize),
    prompts: &[Vec<u32>],
) -> Result<Vec<Vec<u32>>> {
    let mut cmd = Command::new(tpctl);
    cmd.args(["run", "--tp", &tp.to_string(), "--cp", &cp.to_string(), "--model"])
        .arg(model)
        .args(["--max-tokens", &DECODE.to_string(), "--output", "jsonl"]);
    for p in prompts {
        let ids: Vec<String> = p.iter().map(u32::to_string).collect();
        cmd.args(["--prompt-ids", &ids.join(",")]);
    }
    eprintln!("$ tpctl run --tp {tp} --cp {cp} {} ({} prompts)", model.display(), prompts.len());
    let out = util::output(&mut cmd)?;
    let mut rows: Vec<(u64, Vec<u32>)> = out
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: Value = serde_json::from_str(l)?;
            let ids = serde_json::from_value(v["token_ids"].clone())?;
            Ok((v["index"].as_u64().unwrap_or(u64::MAX), ids))
        })
        .collect::<Result<_>>()?;
    rows.sort_by_key(|r| r.0);
    ensure!(
        rows.len() == prompts.len(),
        "tpctl run answered {} of {} prompts",
        rows.len(),
        prompts.len()
    );
    Ok(rows.into_iter().map(|r| r.1).collect())
}

/// Through `tpctl serve` on one rank: each prompt's greedy ids and their log-probabilities.
fn served_logprobs(
    tpctl: &Path,
    model: &Path,
    prompts: &[Vec<u32>],
) -> Result<Vec<(Vec<u32>, Vec<f64>)>> {
    let server = Server::start(tpctl, model, (1, 1, 2), &["--no-prefix-caching"])?;
    prompts
        .iter()
        .map(|p| {
            let body = json!({"prompt": p, "max_tokens": DECODE, "temperature": 0, "logprobs": 1});
            let reply: Value = ureq::post(&format!("{}/v1/completions", server.base))
                .send_json(&body)?
                .into_body()
                .read_json()?;
            let choice = &reply["choices"][0];
            let ids = serde_json::from_value(choice["token_ids"].clone()).context("token_ids")?;
            let lps = serde_json::from_value(choice["logprobs"]["token_logprobs"].clone())
                .context("token_logprobs")?;
            Ok((ids, lps))
        })
        .collect()
}

pub(crate) fn run(json: bool) -> Result<()> {
    let Reference { anchors, q4, f32: f32_path } = Reference::prepare()?;
    let tpctl = release_tpctl()?;
    let mut files = vec![("Q4_1", q4), ("f32", f32_path.clone())];
    for kind in QUANTIZED {
        files.push((kind, llamacpp_quantized(&f32_path, &anchors, kind)?));
    }
    for (name, model) in &files {
        let r = reference(model)?;
        let mut single = Vec::new();
        for layout in LAYOUTS {
            let got = ours(&tpctl, model, layout, &r.prompts)?;
            if layout == (1, 1) {
                single.clone_from(&got);
            }
            let mut departures = Vec::new();
            for (g, want) in got.iter().zip(&r.runs) {
                if let Some(k) = g.iter().zip(&want.ids).position(|(a, b)| a != b) {
                    departures.push((k, want.margins[k]));
                } else if g.len() != want.ids.len() {
                    departures.push((g.len().min(want.ids.len()), f64::NAN));
                }
            }
            let same = PROMPTS - departures.len();
            let worst = departures.iter().map(|d| d.1).fold(0.0f64, f64::max);
            if json {
                let row = json!({
                    "check": "greedy_ids", "file": name, "tp": layout.0, "cp": layout.1,
                    "prompts": PROMPTS, "same": same,
                    "departures": departures.iter().map(|d| json!({"step": d.0, "llamacpp_top2_margin": d.1})).collect::<Vec<_>>(),
                });
                println!("{row}");
            } else {
                let list: Vec<String> =
                    departures.iter().map(|(k, m)| format!("step {k} (margin {m:.3})")).collect();
                println!(
                    "{name:<6} {}x{}: {same} of {PROMPTS} continuations equal llama.cpp's; largest \
                     llama.cpp top-2 margin where one departs {worst:.3}{}{}",
                    layout.0,
                    layout.1,
                    if list.is_empty() { "" } else { ": " },
                    list.join(", ")
                );
            }
        }
        let exact = exact(model, &r.prompts)?;
        let (ours_same, ours_margin) = against_exact(&single, &exact);
        let theirs: Vec<Vec<u32>> = r.runs.iter().map(|run| run.ids.clone()).collect();
        let (theirs_same, theirs_margin) = against_exact(&theirs, &exact);
        if json {
            let row = json!({
                "check": "exact_f64", "file": name, "prompts": PROMPTS,
                "tpctl_same": ours_same, "tpctl_worst_margin": ours_margin,
                "llamacpp_same": theirs_same, "llamacpp_worst_margin": theirs_margin,
            });
            println!("{row}");
        } else {
            println!(
                "{name:<6} exact f64 forward: tpctl (1x1) equals it in {ours_same} of {PROMPTS} \
                 (largest exact top-2 margin where one departs {ours_margin:.3}), llama.cpp in \
                 {theirs_same} of {PROMPTS} ({theirs_margin:.3})"
            );
        }
        let served = served_logprobs(&tpctl, model, &r.prompts)?;
        let (mut worst, mut tokens) = (0.0f64, 0usize);
        for ((ids, lps), want) in served.iter().zip(&r.runs) {
            for ((a, lp), (b, want_lp)) in
                ids.iter().zip(lps).zip(want.ids.iter().zip(&want.logprobs))
            {
                if a != b {
                    break;
                }
                worst = worst.max((lp - want_lp).abs());
                tokens += 1;
            }
        }
        if json {
            println!(
                "{}",
                json!({"check": "logprobs", "file": name, "tokens": tokens, "max_abs_diff": worst})
            );
        } else {
            println!(
                "{name:<6} logprobs through tpctl serve (1x1): largest difference from llama.cpp's \
                 {worst:.2e} over {tokens} tokens chosen alike"
            );
        }
    }
    Ok(())
}
