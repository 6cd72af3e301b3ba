//! Tidy checks of the workspace's shape, run as tests (`cargo test -p xtask`, so `cargo xtask
//! ci` runs them): the crate graph is the one docs/architecture.md draws, nothing points up,
//! and no source file outgrows one reading.

#[cfg(test)]
mod tests {
    use crate::util::root;
    use std::collections::BTreeSet;

    /// The workspace crates each crate may depend on (normal dependencies), as
    /// docs/architecture.md draws them. A new arrow changes this table and that drawing together.
    const ALLOWED: [(&str, &[&str]); 9] = [
        ("mesh", &[]),
        ("collectives", &["mesh"]),
        ("vmm", &["mesh"]),
        ("tensor", &["mesh", "collectives"]),
        ("checkpoint", &["tensor"]),
        ("text", &["checkpoint"]),
        ("layers", &["mesh", "collectives", "tensor", "checkpoint", "text"]),
        ("session", &["mesh", "collectives", "vmm", "tensor", "checkpoint", "text", "layers"]),
        (
            "cli",
            &["mesh", "collectives", "vmm", "tensor", "checkpoint", "text", "layers", "session"],
        ),
    ];

    /// The workspace crates named in the `[dependencies]` of `manifest` (the keys are the
    /// crates' library names, `mesh.workspace = true`, as the workspace declares them).
    fn workspace_deps(manifest: &str, workspace: &BTreeSet<&str>) -> BTreeSet<String> {
        let mut deps = BTreeSet::new();
        let mut in_deps = false;
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                in_deps = line == "[dependencies]";
                continue;
            }
            let key = line.split(['.', '=', ' ']).next().unwrap_or("");
            if in_deps && workspace.contains(key) {
                deps.insert(key.to_owned());
            }
        }
        deps
    }

    #[test]
    fn crates_depend_only_on_the_crates_below_them() {
        let workspace: BTreeSet<&str> = ALLOWED.iter().map(|(c, _)| *c).collect();
        let dirs: BTreeSet<String> = std::fs::read_dir(root().join("crates"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            dirs,
            workspace.iter().map(|c| (*c).to_owned()).collect(),
            "crates/ and this table disagree: a new crate needs its row (and docs/architecture.md)"
        );
        for (krate, allowed) in ALLOWED {
            let path = root().join("crates").join(krate).join("Cargo.toml");
            let manifest = std::fs::read_to_string(&path).unwrap();
            let deps = workspace_deps(&manifest, &workspace);
            let extra: Vec<&String> =
                deps.iter().filter(|d| !allowed.contains(&d.as_str())).collect();
            assert!(
                extra.is_empty(),
                "{krate} depends on {extra:?}, which docs/architecture.md puts above or beside it"
            );
        }
    }

    /// The most lines a source file's non-test part may have: a longer file holds several
    /// concepts and is split by them.
    const MAX_LINES: usize = 1000;

    /// Lines of `text` before its inline test module (all of them when it has none).
    fn non_test_lines(text: &str) -> usize {
        let lines: Vec<&str> = text.lines().collect();
        lines
            .windows(2)
            .position(|w| {
                let (attr, item) = (w[0].trim(), w[1].trim());
                attr == "#[cfg(test)]" && item.starts_with("mod ") && item.ends_with('{')
            })
            .unwrap_or(lines.len())
    }

    /// Whether `path` (relative to the root) holds tests only: a `tests.rs`, a `*_tests.rs`,
    /// or a file in a crate's `tests/` folder (the `tests` crate's own sources are checked).
    fn is_test_file(path: &std::path::Path) -> bool {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        name == "tests.rs"
            || name.ends_with("_tests.rs")
            || path.components().skip(1).any(|c| c.as_os_str() == "tests")
    }

    fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.map(|e| e.unwrap().path()) {
            if e.is_dir() {
                rust_files(&e, out);
            } else if e.extension().is_some_and(|x| x == "rs") {
                out.push(e);
            }
        }
    }

    #[test]
    fn no_source_file_is_over_a_thousand_lines() {
        let mut files = Vec::new();
        for dir in ["crates", "xtask/src", "tests/src"] {
            rust_files(&root().join(dir), &mut files);
        }
        assert!(
            files.len() > 50,
            "found only {} source files under {}",
            files.len(),
            root().display()
        );
        let long: Vec<String> = files
            .iter()
            .filter(|f| !is_test_file(f.strip_prefix(root()).unwrap_or(f)))
            .filter_map(|f| {
                let n = non_test_lines(&std::fs::read_to_string(f).unwrap());
                (n > MAX_LINES).then(|| format!("{} ({n} lines)", f.display()))
            })
            .collect();
        assert!(long.is_empty(), "split these by concept: {long:?}");
    }

    #[test]
    fn the_line_count_stops_at_the_inline_tests() {
        assert_eq!(non_test_lines("a\nb\n#[cfg(test)]\nmod tests {\n}\n"), 2);
        assert_eq!(non_test_lines("a\n#[cfg(test)]\nfn helper() {}\n"), 3);
        // A test module in a file of its own is declared, not counted out.
        assert_eq!(non_test_lines("#[cfg(test)]\nmod tests;\nb\n"), 3);
        assert!(is_test_file(std::path::Path::new("crates/x/src/tests.rs")));
        assert!(is_test_file(std::path::Path::new("crates/cli/tests/cli.rs")));
        assert!(!is_test_file(std::path::Path::new("crates/x/src/protocol.rs")));
        assert!(!is_test_file(std::path::Path::new("tests/src/bin/session_rank.rs")));
    }

    #[test]
    fn the_reader_of_manifests_sees_workspace_dependencies_only() {
        let workspace: BTreeSet<&str> = ["mesh", "layers"].into();
        let manifest =
            "[package]\nname = \"x\"\n[dependencies]\nmesh.workspace = true\nserde = \"1\"\n\
                        layers = { workspace = true }\n[dev-dependencies]\nvmm.workspace = true\n";
        let deps = workspace_deps(manifest, &workspace);
        assert_eq!(deps, ["layers".to_owned(), "mesh".to_owned()].into());
    }

    /// The CUDA kernels, compiled with NVRTC only on a GPU machine, at least parse and
    /// type-check as C++ with the CUDA built-ins declared (`cuda/shim.h`): a typo must not
    /// cost a GPU run. Needs a C++ compiler (`c++`), which the Rust toolchain's linker
    /// usually brings.
    #[test]
    fn the_cuda_kernels_parse_as_cpp() {
        let shim = root().join("xtask/src/cuda/shim.h");
        let source = root().join("crates/tensor/src/kernels/cuda/kernels.cu");
        let out = std::process::Command::new("c++")
            .args(["-fsyntax-only", "-Wall", "-Werror", "-x", "c++", "-include"])
            .arg(&shim)
            .arg(&source)
            .output();
        let out = match out {
            Ok(out) => out,
            Err(e) => panic!("running `c++` to check {}: {e}", source.display()),
        };
        assert!(
            out.status.success(),
            "{} does not compile as C++ with the built-ins of {}:\n{}",
            source.display(),
            shim.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The CUDA kernels compute what they should: run on the CPU emulator of
    /// `cuda/emulator.h` (blocks one after another, a block's threads as real threads with a
    /// barrier per `__syncthreads`) and compared with plain references by
    /// `cuda/emulate_kernels.cpp` (attention over key ranges and their merge, staged keys and
    /// block tables in double precision, also with Gemma's query scale, soft-cap and sliding
    /// window; norms, rotary embedding, argmax, row normalizers, logit soft-capping,
    /// dequantization, bf16 rounding, embedding rows, column splits).
    #[test]
    fn the_cuda_kernels_compute_their_references_on_the_cpu_emulator() {
        let cuda = root().join("xtask/src/cuda");
        let source = root().join("crates/tensor/src/kernels/cuda/kernels.cu");
        let exe =
            std::env::temp_dir().join(format!("tpctl-emulate-attention-{}", std::process::id()));
        let built = std::process::Command::new("c++")
            .args(["-std=c++20", "-O1", "-pthread", "-include"])
            .arg(cuda.join("emulator.h"))
            .args(["-x", "c++"])
            .arg(&source)
            .args(["-x", "c++"])
            .arg(cuda.join("emulate_kernels.cpp"))
            .arg("-o")
            .arg(&exe)
            .output()
            .unwrap_or_else(|e| panic!("running `c++` to build the kernel emulator: {e}"));
        assert!(
            built.status.success(),
            "building the kernel emulator failed:\n{}",
            String::from_utf8_lossy(&built.stderr)
        );
        let ran = std::process::Command::new(&exe).output();
        let _ = std::fs::remove_file(&exe);
        let ran = ran.unwrap_or_else(|e| panic!("running {}: {e}", exe.display()));
        assert!(
            ran.status.success(),
            "a CUDA kernel differs from its reference on the emulator:\n{}{}",
            String::from_utf8_lossy(&ran.stdout),
            String::from_utf8_lossy(&ran.stderr)
        );
    }
}
