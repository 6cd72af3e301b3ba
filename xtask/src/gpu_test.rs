//! `cargo xtask gpu-test`: builds the GPU bundle (below) and runs its `run.sh` here, which runs
//! the GPU tests with `TPCTL_REQUIRE_GPU=1` (a test that finds no usable GPU fails instead of
//! skipping) and then the benchmarks, exactly as on a device machine.
//!
//! The GPU tests are the ones whose names mention `cuda`, `gpu`, `nvml` or `nccl`. The PyPI CUDA
//! packages ship NCCL, cuBLAS and NVRTC under names cudarc does not look for (`libnccl.so.2`,
//! `libcublas.so.13`, `libnvrtc.so.13`: cudarc tries the unversioned name and its own CUDA
//! major); when such libraries are found under Python's `nvidia` packages, a folder with
//! unversioned links to them, and their own folders, are put on `LD_LIBRARY_PATH` first.
//!
//! `cargo xtask gpu-test --bundle [DIR]` runs nothing: it builds the same tests and puts them,
//! stripped, with the `tpctl` binary, the NCCL and vmm benchmarks, `shaped-llama` (which writes
//! a Llama 3 8B-shaped file of random weights there), the default model (in parts
//! small enough for a device machine's 64 MiB transfers) and `run.sh` into DIR (default
//! `target/gpu-bundle`), for a GPU machine without Rust (see `docs/gpu.md`).
//!
//! The benchmarks `run.sh` prints: the default model's tokens/s with `tpctl run` (one rank, the
//! GPU in f32 and bf16 next to the CPU, with the GPU's decode step split into host time and
//! time waiting for the GPU), 1 and 8 concurrent streams through `tpctl serve` (the same three
//! configurations), sleep and wakeup of 1 GiB of device memory per policy next to plain copies
//! of the same bytes (the vmm bench), and NCCL all-reduce bus bandwidth with nccl-tests'
//! formula (one rank per GPU; it says it skipped on a machine with one GPU).

use crate::util::{self, cargo, root};
use anyhow::Result;
use std::path::{Path, PathBuf};
use std::process::Command;

pub(crate) fn run(args: &[String]) -> Result<()> {
    let dir = root().join("target/gpu-bundle");
    match args {
        [] => {}
        [flag] if flag == "--bundle" => return bundle(&dir),
        [flag, dir] if flag == "--bundle" => return bundle(Path::new(dir)),
        _ => anyhow::bail!("usage: cargo xtask gpu-test [--bundle [DIR]]"),
    }
    // Here as on a device machine: the bundle's own script runs the tests and benchmarks, so
    // both print the same. This machine's CUDA wheels go first on the loader path.
    bundle(&dir)?;
    let mut script = Command::new("bash");
    script.arg(dir.join("run.sh")).arg(dir.join("out"));
    if let Some(paths) = library_path()? {
        script.env("LD_LIBRARY_PATH", paths);
    }
    if std::env::var_os("TPCTL_GPU_BUDGET_S").is_none() {
        script.env("TPCTL_GPU_BUDGET_S", LOCAL_BUDGET_S.to_string());
    }
    util::run(&mut script)
}

/// The time `run.sh` gets on a developer's GPU machine (a device machine's is its own
/// window's, set by whoever runs it there).
const LOCAL_BUDGET_S: u32 = 1800;

/// Libraries cudarc loads at run time that the PyPI packages ship under other names.
const LIBRARIES: [&str; 3] = ["nccl", "cublas", "nvrtc"];

/// `LD_LIBRARY_PATH` with a folder of unversioned links to the `nvidia` Python packages'
/// NCCL, cuBLAS and NVRTC first, then those libraries' own folders (for the libraries they
/// load in turn: cublasLt, nvrtc-builtins), then the old value; `None` when none is found.
///
/// Every entry of `nvidia.__path__` is searched; a library in a `cuN` folder newer than the
/// driver's CUDA major is skipped (NVRTC newer than the driver writes PTX it cannot load).
fn library_path() -> Result<Option<std::ffi::OsString>> {
    let roots = nvidia_packages();
    if roots.is_empty() {
        return Ok(None);
    }
    let driver = driver_cuda_major();
    let links = root().join("target/gpu-libs");
    std::fs::create_dir_all(&links)?;
    let mut dirs = vec![links.clone()];
    for name in LIBRARIES {
        let prefix = format!("lib{name}.so.");
        let usable = |lib: &PathBuf| match (cuda_major_of(lib), driver) {
            (Some(major), Some(driver)) if major > driver => {
                eprintln!("{name}: skipping {} (CUDA {major} > driver's {driver})", lib.display());
                false
            }
            _ => true,
        };
        let found = roots.iter().flat_map(|r| find_all_versioned(r, &prefix, 4)).find(usable);
        let Some(lib) = found else { continue };
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

/// The folders of Python's `nvidia` namespace package (every entry of its `__path__`), where
/// the CUDA wheels install.
fn nvidia_packages() -> Vec<PathBuf> {
    let Some(out) = Command::new("python3")
        .args(["-c", "import nvidia; print('\\n'.join(nvidia.__path__))"])
        .output()
        .ok()
        .filter(|o| o.status.success())
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from).filter(|d| d.is_dir()).collect()
}

/// The CUDA major version the driver supports, from `nvidia-smi`'s banner.
fn driver_cuda_major() -> Option<u32> {
    let out = Command::new("nvidia-smi").output().ok().filter(|o| o.status.success())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rest = &text[text.find("CUDA Version:")? + "CUDA Version:".len()..];
    rest.trim_start().split('.').next()?.parse().ok()
}

/// The CUDA major a wheel's library was built for, from a `cuN` folder in its path
/// (`.../nvidia/cu13/lib/libcublas.so.13`); `None` when no folder names one.
fn cuda_major_of(lib: &Path) -> Option<u32> {
    lib.components().find_map(|c| c.as_os_str().to_str()?.strip_prefix("cu")?.parse().ok())
}

/// Every file under `dir` (at most `depth` folders down) named `PREFIX<version>`: a folder's
/// files in name order, then its subfolders' in name order.
fn find_all_versioned(dir: &Path, prefix: &str, depth: usize) -> Vec<PathBuf> {
    let Ok(read) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut entries: Vec<_> = read.flatten().map(|e| e.path()).collect();
    entries.sort();
    let mut found: Vec<PathBuf> = entries
        .iter()
        .filter(|path| {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            let version = name.as_deref().and_then(|n| n.strip_prefix(prefix));
            path.is_file()
                && version.is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
        })
        .cloned()
        .collect();
    if depth > 0 {
        for sub in entries.iter().filter(|p| p.is_dir()) {
            found.extend(find_all_versioned(sub, prefix, depth - 1));
        }
    }
    found
}

/// The script that runs a bundle on the GPU machine.
const RUN_SH: &str = include_str!("gpu_bundle/run.sh");

/// The largest model part: with the working tree and its git folder (about 13 MiB), one part
/// must fit one 64 MiB transfer, and the last one beside the binaries (about 23 MiB).
const MODEL_PART: u64 = 44 << 20;

/// Test targets with GPU tests (`package target`), as cargo names them.
const GPU_TEST_TARGETS: [&str; 8] = [
    "tpctl-mesh mesh",
    "tpctl-tensor tensor",
    "tpctl-layers layers",
    "tpctl-vmm vmm",
    "tpctl-collectives collectives",
    "tpctl-collectives nccl_processes",
    "tpctl-session session",
    "tpctl serve",
];

/// Builds the GPU bundle in `dir` (see the module docs).
fn bundle(dir: &Path) -> Result<()> {
    let model = crate::fetch_model::fetch_default()?;
    let bin = dir.join("bin");
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(&bin)?;
    let mut tests = cargo();
    tests.args(["test", "--workspace", "--features", "cuda", "--no-run", "--message-format=json"]);
    for (package, target, exe) in artifacts(&util::output(&mut tests)?) {
        let wanted = GPU_TEST_TARGETS.contains(&format!("{package} {target}").as_str());
        if wanted && exe.contains("/deps/") {
            copy_stripped(Path::new(&exe), &bin.join(format!("test-{target}")))?;
        } else if package == "tpctl" && target == "tpctl" && !exe.contains("/deps/") {
            copy_stripped(Path::new(&exe), &bin.join("tpctl"))?;
        } else if package == "tpctl-layers" && target == "shaped_llama" {
            copy_stripped(Path::new(&exe), &bin.join("shaped-llama"))?;
        }
    }
    let mut bench = cargo();
    bench.args(["test", "-p", "tpctl-collectives", "--features", "cuda", "--bench", "nccl"]);
    bench.args(["--no-run", "--message-format=json"]);
    for (_, target, exe) in artifacts(&util::output(&mut bench)?) {
        if target == "nccl" {
            copy_stripped(Path::new(&exe), &bin.join("nccl-bench"))?;
        }
    }
    let mut bench = cargo();
    bench.args(["test", "-p", "tpctl-vmm", "--features", "cuda", "--bench", "vmm"]);
    bench.args(["--no-run", "--message-format=json"]);
    for (_, target, exe) in artifacts(&util::output(&mut bench)?) {
        if target == "vmm" {
            copy_stripped(Path::new(&exe), &bin.join("vmm-bench"))?;
        }
    }
    // The test binaries, tpctl, the writer of the 8B-shaped model and the two benchmarks.
    let want = GPU_TEST_TARGETS.len() + 4;
    let found = std::fs::read_dir(&bin)?.count();
    if found != want {
        anyhow::bail!("expected {want} binaries in {}, found {found}", bin.display());
    }
    util::run(
        Command::new("tar").arg("-czf").arg(dir.join("bin.tar.gz")).arg("-C").arg(&bin).arg("."),
    )?;
    std::fs::remove_dir_all(&bin)?;
    let parts = split_file(&model, &dir.join("model"), MODEL_PART)?;
    let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    std::fs::write(dir.join("model/NAME"), name)?;
    std::fs::write(dir.join("model/PARTS"), parts.len().to_string())?;
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH)?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len() >> 20).unwrap_or(0);
    println!("GPU bundle in {}:", dir.display());
    println!("  bin.tar.gz  {} MiB", size(&dir.join("bin.tar.gz")));
    for p in &parts {
        println!(
            "  model/{}  {} MiB",
            p.file_name().unwrap_or_default().to_string_lossy(),
            size(p)
        );
    }
    println!("run it on the GPU machine with run.sh (docs/gpu.md: one transfer per model part)");
    Ok(())
}

/// `(package name, target name, executable)` of every artifact with an executable in cargo's
/// JSON messages (read by key: the lines are flat enough, and xtask has no JSON parser).
fn artifacts(messages: &str) -> Vec<(String, String, String)> {
    messages
        .lines()
        .filter(|l| l.contains(r#""reason":"compiler-artifact""#))
        .filter_map(|l| {
            let exe = json_str(l, "executable")?;
            // A package id ends in `#name@version` (or `#version` when the name is the folder's).
            let id = json_str(l, "package_id")?;
            let manifest = json_str(l, "manifest_path")?;
            let package = match id.rsplit_once('#').map(|(_, v)| v) {
                Some(v) if v.contains('@') => v.split('@').next().unwrap_or_default().to_owned(),
                _ => package_of(manifest)?,
            };
            Some((package, json_str(l, "name")?.to_owned(), exe.to_owned()))
        })
        .collect()
}

/// The package name in the manifest at `path`.
fn package_of(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("name = \""))
        .map(|rest| rest.trim_end_matches('"').to_owned())
}

/// The first string value of `key` in the flat JSON `line` (no escapes in the values read).
fn json_str<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(&format!("\"{key}\":\""))? + key.len() + 4;
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// Copies `from` to `to` and strips its symbols (when `strip` is installed).
fn copy_stripped(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)?;
    if Command::new("strip").arg(to).status().map(|s| !s.success()).unwrap_or(true) {
        eprintln!("note: could not strip {}; it stays as built", to.display());
    }
    Ok(())
}

/// Splits `file` into `dir/part-00`, `dir/part-01`, ... of at most `size` bytes each.
fn split_file(file: &Path, dir: &Path, size: u64) -> Result<Vec<PathBuf>> {
    use std::io::Read;
    std::fs::create_dir_all(dir)?;
    let mut input = std::fs::File::open(file)?;
    let mut parts = Vec::new();
    loop {
        let path = dir.join(format!("part-{:02}", parts.len()));
        let mut out = std::fs::File::create(&path)?;
        let copied = std::io::copy(&mut (&mut input).take(size), &mut out)?;
        if copied == 0 {
            std::fs::remove_file(&path)?;
            return Ok(parts);
        }
        parts.push(path);
    }
}

fn link_points_to(link: &Path, target: &Path) -> bool {
    std::fs::read_link(link).is_ok_and(|t| t == target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn artifacts_are_read_from_cargo_messages() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","package_id":"path+file:///r/crates/layers#tpctl-layers@0.1.0","manifest_path":"/r/crates/layers/Cargo.toml","target":{"kind":["lib"],"name":"layers"},"executable":"/r/target/debug/deps/layers-1a"}"#,
            "\n",
            r#"{"reason":"compiler-artifact","package_id":"path+file:///r/crates/mesh#tpctl-mesh@0.1.0","manifest_path":"/r/crates/mesh/Cargo.toml","target":{"kind":["lib"],"name":"mesh"},"executable":null}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
        );
        assert_eq!(
            artifacts(messages),
            vec![(
                "tpctl-layers".to_owned(),
                "layers".to_owned(),
                "/r/target/debug/deps/layers-1a".to_owned()
            )]
        );
    }

    #[test]
    fn a_file_splits_into_parts_that_join_back() {
        let dir = std::env::temp_dir().join(format!("xtask-split-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let data: Vec<u8> = (0..2500u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.join("model"), &data).unwrap();
        let parts = split_file(&dir.join("model"), &dir.join("parts"), 1000).unwrap();
        let sizes: Vec<u64> = parts.iter().map(|p| std::fs::metadata(p).unwrap().len()).collect();
        assert_eq!(sizes, vec![1000, 1000, 500]);
        let joined: Vec<u8> = parts.iter().flat_map(|p| std::fs::read(p).unwrap()).collect();
        assert_eq!(joined, data);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The first file under `dir` (at most `depth` folders down) named `PREFIX<version>`.
    fn find_versioned(dir: &Path, prefix: &str, depth: usize) -> Option<PathBuf> {
        find_all_versioned(dir, prefix, depth).into_iter().next()
    }

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
        // Every match, for a choice by the driver's CUDA version.
        std::fs::create_dir_all(dir.join("cu12/lib")).unwrap();
        std::fs::write(dir.join("cu12/lib/libcublas.so.12"), b"").unwrap();
        let all = find_all_versioned(&dir, "libcublas.so.", 4);
        assert_eq!(all.len(), 2, "{all:?}");
        let majors: Vec<Option<u32>> = all.iter().map(|p| cuda_major_of(p)).collect();
        assert_eq!(majors, vec![Some(12), Some(13)]);
        assert_eq!(cuda_major_of(&dir.join("nccl/lib/libnccl.so.2")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
