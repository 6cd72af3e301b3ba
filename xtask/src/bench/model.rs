//! Model benchmark: SmolLM2 prefill and decode tokens/s in several layouts, next to llama.cpp
//! on the same f32 weights, measured in the same run (`shared/anchors/llamacpp_bench.py`).

use crate::util::{self, cargo, root};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Interleaved rounds of ours and the reference.
const ROUNDS: usize = 3;

fn field(json: &str, key: &str) -> Option<f64> {
    super::field(json, key)?.parse().ok()
}

/// An f32 copy of `model` (every tensor dequantized), made once next to it.
pub(crate) fn f32_model(model: &Path, anchors: &Path) -> Result<PathBuf> {
    let out = model.with_file_name(
        model
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model.gguf")
            .replace(".gguf", ".f32.gguf"),
    );
    if !out.exists() {
        ensure_python_packages(&["gguf", "numpy"], &["gguf", "numpy"])?;
        util::run(
            Command::new("python3").arg(anchors.join("dequant_gguf.py")).arg(model).arg(&out),
        )?;
    }
    Ok(out)
}

/// `f32` (a GGUF file) quantized by llama.cpp's own quantizer to `kind` (`Q4_K_M`, ...), next
/// to it in the cache; made once (needs llama-cpp-python).
pub(crate) fn llamacpp_quantized(f32: &Path, anchors: &Path, kind: &str) -> Result<PathBuf> {
    let name = f32.file_name().and_then(|n| n.to_str()).unwrap_or("model.f32.gguf");
    let out = f32.with_file_name(name.replace(".f32.gguf", &format!(".{kind}.gguf")));
    if !out.exists() {
        let scratch = out.with_extension("partial");
        util::run(
            Command::new("python3")
                .arg(anchors.join("quantize_gguf.py"))
                .arg(f32)
                .arg(&scratch)
                .arg(kind),
        )?;
        std::fs::rename(&scratch, &out).context("moving the quantized file into place")?;
    }
    Ok(out)
}

/// What a benchmark against llama.cpp starts from: the anchors folder, the default Q4_1 model
/// and its f32 copy, with llama-cpp-python installed.
pub(crate) struct Reference {
    pub(crate) anchors: PathBuf,
    pub(crate) q4: PathBuf,
    pub(crate) f32: PathBuf,
}

impl Reference {
    /// Fetches the model, makes its f32 copy and installs llama-cpp-python, once each.
    pub(crate) fn prepare() -> Result<Reference> {
        let anchors = root().join("../shared/anchors");
        let q4 = crate::fetch_model::fetch_default()?;
        let f32 = f32_model(&q4, &anchors)?;
        ensure_python_packages(&["llama-cpp-python"], &["llama_cpp"])
            .context("llama.cpp reference (builds for ~10 minutes on 2 cores)")?;
        Ok(Reference { anchors, q4, f32 })
    }
}

/// The release `tpctl` binary, built now.
pub(crate) fn release_tpctl() -> Result<PathBuf> {
    util::run(cargo().args(["build", "--release", "--quiet", "-p", "tpctl"]))?;
    Ok(root().join("target/release/tpctl"))
}

/// Installs `packages` with pip unless `modules` already import.
pub(crate) fn ensure_python_packages(packages: &[&str], modules: &[&str]) -> Result<()> {
    let check = format!("import {}", modules.join(", "));
    if Command::new("python3").args(["-c", &check]).output().is_ok_and(|o| o.status.success()) {
        return Ok(());
    }
    eprintln!("installing the reference's Python packages: {}", packages.join(" "));
    util::run(Command::new("python3").args(["-m", "pip", "install", "-q"]).args(packages))
}

pub(crate) fn run(json: bool) -> Result<()> {
    let Reference { anchors, f32: f32_path, .. } = Reference::prepare()?;
    // Interleaved rounds of (ours, llama.cpp); each figure is its best round, so a burst of
    // noise on a shared machine does not decide a ratio.
    let (mut ref_pf, mut ref_dc) = (0f64, 0f64);
    let mut best: Vec<(String, f64, f64)> = Vec::new();
    for _ in 0..ROUNDS {
        let ours = util::output(
            cargo()
                .args(["bench", "--quiet", "-p", "tpctl-layers", "--bench", "model", "--"])
                .arg("--json")
                .arg("--model")
                .arg(&f32_path),
        )?;
        for line in ours.lines().filter(|l| l.contains("prefill_tok_s")) {
            let get = |k| field(line, k).unwrap_or(f64::NAN);
            let (pf, dc) = (get("prefill_tok_s"), get("decode_tok_s"));
            let key = format!("{}x{} {}", get("tp"), get("cp"), get("threads_per_rank"));
            match best.iter_mut().find(|b| b.0 == key) {
                Some(b) => (b.1, b.2) = (b.1.max(pf), b.2.max(dc)),
                None => best.push((key, pf, dc)),
            }
        }
        let reference = util::output(
            Command::new("python3")
                .arg(anchors.join("llamacpp_bench.py"))
                .arg(&f32_path)
                .arg("2")
                .arg("128")
                .arg("64"),
        )?;
        let reference = reference
            .lines()
            .rev()
            .find(|l| l.contains("prefill_tok_s"))
            .context("llama.cpp printed no result")?
            .to_owned();
        ref_pf = ref_pf.max(field(&reference, "prefill_tok_s").context("llama.cpp prefill")?);
        ref_dc = ref_dc.max(field(&reference, "decode_tok_s").context("llama.cpp decode")?);
    }
    if !json {
        println!("SmolLM2-135M-Instruct, f32 weights, 128-token prompt, 64 decoded tokens");
        println!(
            "{:<7} {:>8} {:>14} {:>13} {:>16} {:>15}",
            "layout",
            "threads",
            "prefill tok/s",
            "decode tok/s",
            "prefill / llama",
            "decode / llama"
        );
        println!(
            "{:<7} {:>8} {:>14.1} {:>13.1} {:>16} {:>15}",
            "llama", 2, ref_pf, ref_dc, "1.00x", "1.00x"
        );
    }
    for (key, pf, dc) in &best {
        let (layout, threads) = key.split_once(' ').unwrap_or((key.as_str(), "?"));
        if json {
            println!("{{\"layout\":\"{layout}\",\"threads_per_rank\":{threads},\"prefill_tok_s\":{pf:.1},\"decode_tok_s\":{dc:.1},\"llamacpp_prefill_tok_s\":{ref_pf:.1},\"llamacpp_decode_tok_s\":{ref_dc:.1},\"prefill_ratio\":{:.2},\"decode_ratio\":{:.2}}}", pf / ref_pf, dc / ref_dc);
        } else {
            println!(
                "{:<7} {:>8} {:>14.1} {:>13.1} {:>15.2}x {:>14.2}x",
                layout,
                threads,
                pf,
                dc,
                pf / ref_pf,
                dc / ref_dc
            );
        }
    }
    if !json {
        println!(
            "ratios: ours / llama.cpp (2 threads), same weights, same machine, same run; \
             best of {ROUNDS} interleaved rounds each"
        );
    }
    Ok(())
}
