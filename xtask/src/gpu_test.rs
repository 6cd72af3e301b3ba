//! `cargo xtask gpu-test`: builds with `--features cuda` and runs the GPU tests with
//! `TPCTL_REQUIRE_GPU=1`, so a test that finds no usable GPU fails instead of skipping.
//!
//! The GPU tests are the ones whose names mention `cuda`, `gpu`, `nvml` or `nccl`. The PyPI CUDA
//! packages ship NCCL, cuBLAS and NVRTC under names cudarc does not look for (`libnccl.so.2`,
//! `libcublas.so.13`, `libnvrtc.so.13`: cudarc tries the unversioned name and its own CUDA
//! major); when such libraries are found under Python's `nvidia` packages, a folder with
//! unversioned links to them, and their own folders, are put on `LD_LIBRARY_PATH` first.
//!
//! After the tests, the benchmarks: the default model's prefill and decode tokens/s on the GPU
//! next to the CPU, one rank each, from `tpctl run`'s summary; and NCCL all-reduce bus
//! bandwidth on device buffers with nccl-tests' formula (the `nccl` bench of
//! `tpctl-collectives`, one rank per GPU; it says it skipped on a machine with one GPU).

use crate::util::{self, cargo, root};
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Test-name filters selecting the GPU tests.
const FILTERS: [&str; 4] = ["cuda", "gpu", "nvml", "nccl"];

pub(crate) fn run(_args: &[String]) -> Result<()> {
    // The real-model GPU test needs the default model; fetched once, then reused.
    let model = crate::fetch_model::fetch_default()?;
    println!("default model: {}", model.display());
    let library_path = library_path()?;
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--features", "cuda", "--"]).args(FILTERS);
    cmd.env("TPCTL_REQUIRE_GPU", "1");
    if let Some(paths) = &library_path {
        cmd.env("LD_LIBRARY_PATH", paths);
    }
    util::run(&mut cmd)?;
    benchmark_line(&model, library_path.as_deref())?;
    let mut bench = cargo();
    bench.args(["bench", "--quiet", "-p", "tpctl-collectives", "--features", "cuda"]);
    bench.args(["--bench", "nccl"]);
    if let Some(paths) = &library_path {
        bench.env("LD_LIBRARY_PATH", paths);
    }
    util::run(&mut bench)
}

/// Libraries cudarc loads at run time that the PyPI packages ship under other names.
const LIBRARIES: [&str; 3] = ["nccl", "cublas", "nvrtc"];

/// `LD_LIBRARY_PATH` with a folder of unversioned links to the `nvidia` Python packages'
/// NCCL, cuBLAS and NVRTC first, then those libraries' own folders (for the libraries they
/// load in turn: cublasLt, nvrtc-builtins), then the old value; `None` when none is found.
fn library_path() -> Result<Option<std::ffi::OsString>> {
    let Some(nvidia) = nvidia_packages() else { return Ok(None) };
    let links = root().join("target/gpu-libs");
    std::fs::create_dir_all(&links)?;
    let mut dirs = vec![links.clone()];
    for name in LIBRARIES {
        let Some(lib) = find_versioned(&nvidia, &format!("lib{name}.so."), 4) else { continue };
        let link = links.join(format!("lib{name}.so"));
        if !link_points_to(&link, &lib) {
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&lib, &link)?;
        }
        eprintln!("{name}: {} (linked as {})", lib.display(), link.display());
        if let Some(parent) = lib.parent().filter(|p| !dirs.iter().any(|d| d == p)) {
            dirs.push(parent.to_path_buf());
        }
    }
    if dirs.len() == 1 {
        return Ok(None);
    }
    let old = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    dirs.extend(std::env::split_paths(&old));
    Ok(Some(std::env::join_paths(dirs)?))
}

/// The folder of Python's `nvidia` namespace package, where the CUDA wheels install.
fn nvidia_packages() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import nvidia; print(list(nvidia.__path__)[0])"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    dir.is_dir().then_some(dir)
}

/// The first file under `dir` (at most `depth` folders down) named `PREFIX<version>`.
fn find_versioned(dir: &Path, prefix: &str, depth: usize) -> Option<PathBuf> {
    let mut entries: Vec<_> = std::fs::read_dir(dir).ok()?.flatten().map(|e| e.path()).collect();
    entries.sort();
    for path in &entries {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let version = name.strip_prefix(prefix);
        if path.is_file()
            && version.is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
        {
            return Some(path.clone());
        }
    }
    if depth == 0 {
        return None;
    }
    entries.iter().filter(|p| p.is_dir()).find_map(|p| find_versioned(p, prefix, depth - 1))
}

/// Prints the default model's tokens/s on the GPU (f32 and bf16 weights) next to the CPU
/// (`tpctl run`, one rank, 64 greedy tokens), from each run's summary line.
fn benchmark_line(model: &Path, library_path: Option<&std::ffi::OsStr>) -> Result<()> {
    let model = model.to_string_lossy();
    let mut summaries = Vec::new();
    for (device, dtype) in [("cpu", "f32"), ("cuda", "f32"), ("cuda", "bf16")] {
        let mut cmd = cargo();
        cmd.args(["run", "--quiet", "-p", "tpctl", "--features", "cuda", "--", "run"])
            .args(["--model", &model, "--device", device, "--dtype", dtype])
            .args(["--max-tokens", "64"])
            .args(["--temperature", "0", "--prompt", "The capital of France is"]);
        if let Some(paths) = library_path {
            cmd.env("LD_LIBRARY_PATH", paths);
        }
        let out = util::output(&mut cmd)?;
        let summary = out
            .lines()
            .find_map(|l| l.strip_prefix("-- "))
            .map(str::to_owned)
            .unwrap_or_else(|| format!("no summary line in:\n{out}"));
        summaries.push(format!("{device:>4} {dtype:>4}: {summary}"));
    }
    println!("GPU benchmark (SmolLM2-135M Q4_1, one rank, 64 tokens):");
    for s in summaries {
        println!("  {s}");
    }
    Ok(())
}

fn link_points_to(link: &Path, target: &Path) -> bool {
    std::fs::read_link(link).is_ok_and(|t| t == target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_libraries_are_found_in_nested_package_folders() {
        let dir = std::env::temp_dir().join(format!("xtask-gpu-libs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for file in [
            "nccl/lib/libnccl.so.2",
            "cu13/lib/libcublas.so.13.0.2.14",
            "cu13/lib/libcublasLt.so.13.0.2.14",
            "cuda_nvrtc/lib/libnvrtc-builtins.so.13.0",
            "cuda_nvrtc/lib/libnvrtc.so.13",
        ] {
            let path = dir.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, b"").unwrap();
        }
        let found = |prefix: &str| {
            find_versioned(&dir, prefix, 4).map(|p| p.strip_prefix(&dir).unwrap().to_path_buf())
        };
        assert_eq!(found("libnccl.so."), Some("nccl/lib/libnccl.so.2".into()));
        assert_eq!(found("libcublas.so."), Some("cu13/lib/libcublas.so.13.0.2.14".into()));
        assert_eq!(found("libnvrtc.so."), Some("cuda_nvrtc/lib/libnvrtc.so.13".into()));
        assert_eq!(find_versioned(&dir, "libnccl.so.", 1), None, "too deep");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
