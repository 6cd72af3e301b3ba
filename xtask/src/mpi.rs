//! The system's OpenMPI, which the `mpi` backend links against and the benchmark's anchor is
//! built with: installed with the distribution's package manager where it is missing.

use crate::util;
use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;

/// The Debian packages the `mpi` feature builds with: OpenMPI's launcher and headers, and
/// libclang, which the `mpi` crate's bindings generator (bindgen) loads.
const PACKAGES: [&str; 3] = ["openmpi-bin", "libopenmpi-dev", "libclang-dev"];

/// Installs OpenMPI and libclang with apt-get when `mpicc` or libclang is missing (CI machines
/// and fresh machines are Debian, run as root); does nothing when both are there.
///
/// # Errors
/// A package is missing and apt-get cannot install it (no root, no package index).
pub(crate) fn ensure_openmpi() -> Result<()> {
    if has_mpicc() && has_libclang() {
        return Ok(());
    }
    eprintln!(
        "OpenMPI (mpicc) or libclang not found: installing {} with apt-get",
        PACKAGES.join(" ")
    );
    util::run(Command::new("apt-get").args(["update", "-qq"]))
        .context("apt-get update (needs root)")?;
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    anyhow::ensure!(has_mpicc(), "apt-get installed {} but mpicc still does not run", PACKAGES[1]);
    Ok(())
}

/// The arguments every `mpirun` of this project's tests and benchmarks starts with: CI runs as
/// root, and the ranks outnumber the cores.
pub(crate) const MPIRUN_ARGS: [&str; 2] = ["--allow-run-as-root", "--oversubscribe"];

fn has_mpicc() -> bool {
    Command::new("mpicc").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Whether a `libclang.so` bindgen can load is installed where Debian puts it (a versioned
/// LLVM directory), or where `LIBCLANG_PATH` points.
fn has_libclang() -> bool {
    if let Some(dir) = std::env::var_os("LIBCLANG_PATH") {
        if Path::new(&dir).join("libclang.so").exists() {
            return true;
        }
    }
    let Ok(entries) = std::fs::read_dir("/usr/lib") else { return false };
    entries.flatten().any(|e| {
        e.file_name().to_string_lossy().starts_with("llvm-")
            && ["libclang.so", "libclang.so.1"]
                .iter()
                .any(|f| e.path().join("lib").join(f).exists())
    })
}
