//! Helpers shared by the end-to-end tests: the tiny model, scratch paths, and finding the
//! processes an invocation left behind.

#![allow(dead_code)] // each test binary uses a part of these helpers

pub mod http;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The `tpctl` binary under test: `$TPCTL_BIN` when set (the tests run from a bundle on a
/// machine without the build tree, see `cargo xtask gpu-test --bundle`), else cargo's build.
pub fn tpctl_bin() -> String {
    std::env::var("TPCTL_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_tpctl").to_owned())
}

/// The scratch folder: `$TPCTL_TEST_TMPDIR` when set (as [`tpctl_bin`]), else cargo's.
pub fn scratch_root() -> PathBuf {
    std::env::var_os("TPCTL_TEST_TMPDIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")), PathBuf::from)
}

/// A path in the scratch folder, unique to this test process.
pub fn scratch(name: &str) -> PathBuf {
    scratch_root().join(format!("tpctl-e2e-{}-{name}", std::process::id()))
}

/// A small random Llama (6 query heads, 3 KV heads, context 256, tokens `t0`..`t47`, no chat
/// template).
pub fn tiny_spec() -> layers::model::random::RandomLlama {
    layers::model::random::RandomLlama {
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 64,
        seed: 7,
        ..Default::default()
    }
}

/// [`tiny_spec`] as GGUF, written once per test process.
pub fn tiny_model() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        let path = scratch("tiny.gguf");
        tiny_spec().write(&path).expect("write the tiny model");
        path.to_string_lossy().into_owned()
    })
}

/// A marker to put in the environment (`TPCTL_TEST_MARK`) of every process of one invocation.
pub fn marker() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("tpctl-test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Processes (not zombies) whose environment holds `mark`.
pub fn leftovers(mark: &str) -> Vec<u32> {
    let needle = format!("TPCTL_TEST_MARK={mark}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else { continue };
        let zombie = std::fs::read_to_string(entry.path().join("stat"))
            .map(|s| s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
            .unwrap_or(true);
        if !zombie && env.split(|&b| b == 0).any(|kv| kv == needle.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

/// Kills every process of an invocation (after a test failed its deadline).
pub fn kill_all(mark: &str) {
    for pid in leftovers(mark) {
        let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
    }
}

/// Text that [`lookup_model`] writes over and over: an emoji, a CJK character and a space,
/// each character but the space split over two tokens.
pub const LOOKUP_TEXT: &str = "😀中 ";

/// A model whose greedy output after any prompt is [`LOOKUP_TEXT`] repeated: a lookup table
/// ([`layers::model::random::RandomLlama::next_token`]) over the tiny model's shape, with
/// tokens 10..=14 holding "😀" (F0 9F | 98 80), "中" (E4 B8 | AD) and " ". Every other token
/// leads to token 10, so any prompt starts the cycle. Its chat template joins the messages.
pub fn lookup_model() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        use layers::model::random::byte_level;
        let (emoji, cjk) = ("😀".as_bytes(), "中".as_bytes());
        let pieces = [&emoji[..2], &emoji[2..], &cjk[..2], &cjk[2..], b" "];
        let mut spec = tiny_spec();
        spec.token_names =
            pieces.iter().enumerate().map(|(i, p)| (10 + i as u32, byte_level(p))).collect();
        let mut next = vec![10; spec.vocab];
        next[10..15].copy_from_slice(&[11, 12, 13, 14, 10]);
        spec.next_token = Some(next);
        let mut writer = spec.writer();
        let template = "{% for m in messages %}{{ m.content }}{% endfor %}";
        writer
            .metadata("tokenizer.chat_template", checkpoint::gguf::Value::String(template.into()));
        let path = scratch("lookup.gguf");
        writer.write(&path).expect("write the lookup model");
        path.to_string_lossy().into_owned()
    })
}

/// The default random model's shape (hidden 64, MLP 96, 4 query and 2 KV heads, tokens
/// `t0`..`t47`) with its matrices stored as Q4_1, as the default SmolLM2 file stores them.
pub fn tiny_q4_model() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        let spec = layers::model::random::RandomLlama {
            quantized: Some(tensor::kernels::BlockFormat::Q4_1),
            seed: 11,
            ..Default::default()
        };
        let path = scratch("tiny-q4_1.gguf");
        spec.write(&path).expect("write the Q4_1 model");
        path.to_string_lossy().into_owned()
    })
}

/// A `tpctl` command whose processes carry `mark` (see [`kill_all`]), without RUST_LOG or an
/// API key from the environment, stdin closed, stdout and stderr piped.
pub fn tpctl_command(mark: &str) -> Command {
    let mut cmd = Command::new(tpctl_bin());
    cmd.env("TPCTL_TEST_MARK", mark)
        .env_remove("RUST_LOG")
        .env_remove("TPCTL_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// An exited process's code, stdout and stderr, for assertion messages.
pub fn describe(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `tpctl ARGS` to its end (no RUST_LOG, no API key from the environment), killing it and
/// everything it started if it outlives `deadline`, and checking nothing is left behind.
pub fn run_tpctl(args: &[&str], deadline: std::time::Duration) -> Output {
    let mark = marker();
    let mut child = tpctl_command(&mark).args(args).spawn().expect("start tpctl");
    let start = std::time::Instant::now();
    while child.try_wait().expect("wait for tpctl").is_none() {
        if start.elapsed() > deadline {
            let _ = child.kill();
            kill_all(&mark);
            panic!("tpctl {args:?} still running after {deadline:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("collect output");
    assert_eq!(leftovers(&mark), Vec::<u32>::new(), "processes left behind");
    out
}

/// Waits for `child` (a tpctl started with marker `mark`) at most `deadline`; past it, kills it
/// and every process of the marker, and fails the test.
pub fn wait_within(mut child: Child, mark: &str, deadline: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait for tpctl").is_none() {
        if start.elapsed() > deadline {
            let _ = child.kill();
            kill_all(mark);
            panic!("tpctl still running after {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect output")
}
