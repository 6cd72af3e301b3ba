//! Small helpers for running commands from the repository root.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

/// The repository root (the parent of the xtask crate).
pub(crate) fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().expect("xtask lives one level below the root").to_path_buf()
}

/// A `cargo` command run from the repository root, using the cargo that runs xtask.
pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// Runs `cmd`, echoing it first; fails when it exits non-zero.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("$ {}", show(cmd));
    let status = cmd.status().with_context(|| format!("could not start `{}`", show(cmd)))?;
    if !status.success() {
        bail!("`{}` failed: {status}", show(cmd));
    }
    Ok(())
}

/// Runs `cmd` and returns its standard output; fails when it exits non-zero.
pub(crate) fn output(cmd: &mut Command) -> Result<String> {
    eprintln!("$ {}", show(cmd));
    let out = cmd.output().with_context(|| format!("could not start `{}`", show(cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed: {}\n{}", show(cmd), out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

fn show(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}
