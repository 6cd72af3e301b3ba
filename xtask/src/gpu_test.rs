//! `cargo xtask gpu-test`: builds with `--features cuda` and runs the GPU tests with
//! `TPCTL_REQUIRE_GPU=1`, so a test that finds no usable GPU fails instead of skipping.
//!
//! The GPU tests are the ones whose names mention `cuda`, `gpu`, `nvml` or `nccl`. NCCL ships as
//! `libnccl.so.2` (for example in the Python package `nvidia-nccl-cu13`), a name cudarc does
//! not look for; when such a library is found, a folder with a `libnccl.so` link to it is put
//! on `LD_LIBRARY_PATH` first.

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
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--features", "cuda", "--"]).args(FILTERS);
    cmd.env("TPCTL_REQUIRE_GPU", "1");
    if let Some(dir) = nccl_link_dir()? {
        let old = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
        let mut paths = vec![dir];
        paths.extend(std::env::split_paths(&old));
        cmd.env("LD_LIBRARY_PATH", std::env::join_paths(paths)?);
    }
    util::run(&mut cmd)
}

/// A folder holding `libnccl.so -> .../libnccl.so.2`, when Python's NCCL package is installed.
fn nccl_link_dir() -> Result<Option<PathBuf>> {
    let Ok(out) = Command::new("python3")
        .args(["-c", "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))"])
        .output()
    else {
        return Ok(None);
    };
    if !out.status.success() {
        return Ok(None);
    }
    let package = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let lib = package.join("lib").join("libnccl.so.2");
    if !lib.is_file() {
        return Ok(None);
    }
    let dir = root().join("target/nccl-link");
    std::fs::create_dir_all(&dir)?;
    let link = dir.join("libnccl.so");
    if !link_points_to(&link, &lib) {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link)?;
    }
    eprintln!("NCCL: {} (linked as {})", lib.display(), link.display());
    Ok(Some(dir))
}

fn link_points_to(link: &Path, target: &Path) -> bool {
    std::fs::read_link(link).is_ok_and(|t| t == target)
}
