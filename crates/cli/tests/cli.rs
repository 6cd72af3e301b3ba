//! `tpctl` end to end, through the binary, on a tiny random model: identical greedy output in
//! every layout, JSON lines, config errors, a failing rank and Ctrl-C leaving no process
//! behind. Every wait has a deadline.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

mod common;

use common::describe as text;

use common::{leftovers, marker, scratch, tpctl_bin};

const DEADLINE: Duration = Duration::from_secs(90);

fn model() -> &'static str {
    common::tiny_model()
}

fn start(args: &[&str], extra_env: &[(&str, &str)], mark: &str) -> Child {
    let mut cmd = Command::new(tpctl_bin());
    cmd.args(args)
        .env("TPCTL_TEST_MARK", mark)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start tpctl")
}

fn wait(child: Child, mark: &str) -> Output {
    common::wait_within(child, mark, DEADLINE)
}

fn tpctl(args: &[&str], extra_env: &[(&str, &str)]) -> Output {
    let mark = marker();
    let out = wait(start(args, extra_env, &mark), &mark);
    assert_eq!(leftovers(&mark), Vec::<u32>::new(), "processes left behind");
    out
}

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}\n{}", text(out))))
        .collect()
}

#[test]
fn greedy_output_is_identical_in_every_layout() {
    let mut runs = Vec::new();
    // tp=6 shares each of the 3 KV heads between two ranks.
    for (tp, cp) in [("1", "1"), ("2", "1"), ("1", "2"), ("2", "2"), ("3", "1"), ("6", "1")] {
        let out = tpctl(
            &[
                "run",
                "--model",
                model(),
                "--tp",
                tp,
                "--cp",
                cp,
                "--threads",
                "1",
                "--prompt-ids",
                "1,2,3,4,5",
                "--prompt-ids",
                "9",
                "--max-tokens",
                "6",
                "--output",
                "jsonl",
            ],
            &[],
        );
        assert!(out.status.success(), "{}", text(&out));
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 2, "{}", text(&out));
        let mut ids: Vec<(String, Vec<u64>)> = lines
            .iter()
            .map(|l| {
                let ids = l["token_ids"]
                    .as_array()
                    .expect("token_ids")
                    .iter()
                    .map(|t| t.as_u64().unwrap())
                    .collect();
                (l["prompt"].as_str().unwrap().to_owned(), ids)
            })
            .collect();
        ids.sort();
        runs.push(((tp, cp), ids));
    }
    for (layout, ids) in &runs[1..] {
        assert_eq!(ids, &runs[0].1, "{layout:?} differs from (1,1)");
    }
    assert!(runs[0].1.iter().all(|(_, ids)| ids.len() == 6));
}

/// `common::tiny_spec` as a Hugging Face folder (config.json, two safetensors shards with
/// their index, tokenizer.json), written once per test process.
fn tiny_hf_model() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = scratch("tiny-hf");
        common::tiny_spec()
            .write_hf(&dir, true)
            .expect("write the tiny model as a Hugging Face folder");
        dir.to_string_lossy().into_owned()
    })
}

#[test]
fn a_hugging_face_folder_runs_like_its_gguf_in_every_layout() {
    let ids = |model: &str, tp: &str, cp: &str| {
        let args = ["run", "--model", model, "--tp", tp, "--cp", cp, "--threads", "1"];
        let rest = ["--prompt-ids", "1,2,3,4,5", "--max-tokens", "6", "--output", "jsonl"];
        let out = tpctl(&[&args[..], &rest[..]].concat(), &[]);
        assert!(out.status.success(), "{model} ({tp},{cp}): {}", text(&out));
        json_lines(&out)[0]["token_ids"].clone()
    };
    let want = ids(model(), "1", "1");
    for (tp, cp) in [("1", "1"), ("2", "2"), ("3", "1")] {
        assert_eq!(ids(tiny_hf_model(), tp, cp), want, "({tp},{cp})");
    }
}

/// A GGUF split in three files (as llama.cpp's `gguf-split` names them) runs like the one file.
#[test]
fn a_split_gguf_runs_like_the_single_file() {
    let parts = common::tiny_spec().writer().write_split(&scratch("tiny-split"), 3).unwrap();
    let ids = |model: &str| {
        let args = ["run", "--model", model, "--tp", "2", "--threads", "1", "--prompt-ids"];
        let out =
            tpctl(&[&args[..], &["1,2,3", "--max-tokens", "5", "--output", "jsonl"]].concat(), &[]);
        assert!(out.status.success(), "{model}: {}", text(&out));
        json_lines(&out)[0]["token_ids"].clone()
    };
    assert_eq!(ids(parts[0].to_str().unwrap()), ids(model()));
}

#[test]
fn jsonl_lines_have_every_field() {
    let out = tpctl(
        &[
            "run",
            "--model",
            model(),
            "--prompt-ids",
            "3,4",
            "--prompt-ids",
            "5",
            "--max-tokens",
            "3",
            "--output",
            "jsonl",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    // Lines come as prompts finish; `index` says which input each answers.
    let lines = json_lines(&out);
    let mut answered: Vec<(u64, serde_json::Value)> = lines
        .iter()
        .map(|l| (l["index"].as_u64().expect("index"), l["prompt_token_ids"].clone()))
        .collect();
    answered.sort_by_key(|(i, _)| *i);
    assert_eq!(answered, [(0, serde_json::json!([3, 4])), (1, serde_json::json!([5]))]);
    let line = &lines[0];
    for key in [
        "index",
        "prompt",
        "prompt_token_ids",
        "token_ids",
        "text",
        "finish_reason",
        "time_to_first_token_ms",
        "total_ms",
        "startup_ms",
    ] {
        assert!(line.get(key).is_some(), "missing {key}: {line}");
    }
    assert_eq!(line["finish_reason"], "length");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("decode"),
        "summary on stderr\n{}",
        text(&out)
    );
}

#[test]
fn text_output_streams_and_summarizes() {
    let out = tpctl(&["run", "--model", model(), "--prompt-ids", "1", "--max-tokens", "4"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.lines().last().is_some_and(|l| l.starts_with("-- start-up ")), "{}", text(&out));
}

/// `--preallocate-sleep-memory` is a flag of `run` and `serve`, explained in their help, and
/// ranks started with it (on the CPU, where a level-1 sleep writes a spill file and so nothing
/// is preallocated) generate what they generate without it.
#[test]
fn preallocating_sleep_memory_is_a_flag_of_run_and_serve() {
    for command in ["run", "serve"] {
        let out = tpctl(&[command, "--help"], &[]);
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", text(&out));
        assert!(help.contains("--preallocate-sleep-memory"), "tpctl {command} --help:\n{help}");
        assert!(help.contains("preallocate_sleep_memory"), "tpctl {command} --help:\n{help}");
        assert!(help.contains("--enforce-eager"), "tpctl {command} --help:\n{help}");
    }
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", model(), "--tp", "2", "--prompt-ids", "1,2"];
        args.extend(["--max-tokens", "4"]);
        args.extend(extra);
        let out = tpctl(&args, &[]);
        assert!(out.status.success(), "{}", text(&out));
        // The text, without the summary line and its times.
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        stdout.lines().filter(|l| !l.starts_with("-- ")).collect::<Vec<_>>().join("\n")
    };
    assert_eq!(run(&["--preallocate-sleep-memory"]), run(&[]));
}

/// Without a prompt anywhere, the demo runs and shows its prompt before the answer.
#[test]
fn the_demo_shows_its_prompt() {
    let out = tpctl(&["run", "--model", common::lookup_model(), "--max-tokens", "2"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("> Explain in two sentences"), "{err}");
    let quiet =
        tpctl(&["run", "--quiet", "--model", common::lookup_model(), "--max-tokens", "2"], &[]);
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("> Explain"));
}

#[test]
fn bad_configs_and_layouts_are_clear_errors() {
    let cfg = scratch("bad.toml");
    for (body, needles) in [
        ("[layout]\ntp = 2\ntpp = 1\n", &["line 3", "unknown field `tpp`"][..]),
        ("[sampling]\ntop_p = 2.0\n", &["`sampling.top_p` must be in (0, 1]"]),
    ] {
        std::fs::write(&cfg, body).unwrap();
        let out = tpctl(&["run", cfg.to_str().unwrap(), "--model", model(), "--prompt", "t1"], &[]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        for n in needles {
            assert!(err.contains(n), "`{err}` lacks `{n}`");
        }
    }
    // 6 query heads on 3 KV heads: tp=4 neither splits whole KV heads nor shares them evenly.
    let out = tpctl(&["run", "--model", model(), "--tp", "4", "--prompt", "t1"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tp 4 does not fit") && err.contains("tp=4"), "{}", text(&out));
    let out = tpctl(&["run", "--model", "no-such-model", "--prompt", "t1"], &[]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a catalog name"), "{}", text(&out));
    let out = tpctl(&["run", "--model", model(), "--prompt-ids", "1,x"], &[]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("expected comma-separated token ids"),
        "{}",
        text(&out)
    );
    let out = tpctl(&["run", "--model", model(), "--prompt-ids", "100000"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("outside the vocabulary"),
        "{}",
        text(&out)
    );
    let out = tpctl(&["run", "--model", model(), "--prompt", ""], &[]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("encodes to no tokens"),
        "{}",
        text(&out)
    );
}

/// Without CUDA compiled in, `--device cuda` is refused before any rank starts, saying how to
/// get a CUDA build.
#[cfg(not(feature = "cuda"))]
#[test]
fn device_cuda_needs_a_cuda_build() {
    let out = tpctl(&["run", "--model", model(), "--device", "cuda", "--prompt", "t1"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("built without CUDA") && err.contains("--features cuda"), "{err}");
    assert!(!err.contains("[rank"), "no rank started: {err}");
}

/// Half precision is a GPU setting: on the CPU it is refused before any rank starts.
#[test]
fn half_precision_needs_the_gpu() {
    let out = tpctl(&["run", "--model", model(), "--dtype", "bf16", "--prompt", "t1"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--dtype bf16") && err.contains("needs --device cuda"), "{err}");
    assert!(!err.contains("[rank"), "no rank started: {err}");
}

/// `run`'s time to first token counts from the requests' admission, not from the start-up
/// before it (the model's load, its weights put in place, the KV pool committed), which the
/// summary reports apart: a model build held 2 s (an injected delay) shows in the start-up,
/// and the time to first token stays below it. Before, the first token's time included it.
#[cfg(feature = "failpoints")]
#[test]
fn time_to_first_token_counts_from_admission_and_start_up_apart() {
    let args = ["run", "--model", model(), "--prompt-ids", "1,2,3", "--max-tokens", "4"];
    let out = tpctl(&args, &[("TPCTL_FAILPOINTS", "session.init=delay(2000)@0")]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let number = |after: &str, unit: &str| -> f64 {
        let rest = line.split_once(after).map(|(_, r)| r).unwrap_or_else(|| panic!("{line}"));
        rest.split_once(unit)
            .and_then(|(n, _)| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{line}"))
    };
    let startup_ms = number("-- start-up ", " s") * 1e3;
    let first_token_ms = number("time to first token ", " ms");
    assert!(startup_ms >= 2000.0, "the delayed build is start-up: {line}");
    assert!(first_token_ms < startup_ms, "the build is not in the time to first token: {line}");

    // The same in JSON lines: each prompt's times count from its admission, and `startup_ms`
    // says what came before.
    let args = [&args[..], &["--output", "jsonl"]].concat();
    let out = tpctl(&args, &[("TPCTL_FAILPOINTS", "session.init=delay(2000)@0")]);
    assert!(out.status.success(), "{}", text(&out));
    let line = &json_lines(&out)[0];
    let ms = |key: &str| line[key].as_f64().unwrap_or_else(|| panic!("no {key}: {line}"));
    assert!(ms("startup_ms") >= 2000.0, "the delayed build is start-up: {line}");
    assert!(ms("total_ms") < ms("startup_ms"), "the build is in no request's time: {line}");
}

#[cfg(feature = "failpoints")]
#[test]
fn a_failing_rank_stops_every_rank_with_its_own_error() {
    let out = tpctl(
        &[
            "run",
            "--model",
            model(),
            "--tp",
            "2",
            "--cp",
            "2",
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "8",
        ],
        &[("TPCTL_FAILPOINTS", "session.step=error@2#2")],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("error: rank 2 failed with exit code 1"), "{}", text(&out));
    assert!(err.contains("injected failure at failpoint `session.step`"), "{}", text(&out));
}

/// A panic outside the engine's model code (here in a rank's teardown) is reported with its
/// message, not with the last line of Rust's backtrace note.
#[cfg(feature = "failpoints")]
#[test]
fn a_rank_that_panics_is_named_with_its_panic() {
    let args = ["run", "--model", model(), "--tp", "2", "--prompt-ids", "1,2", "--max-tokens", "2"];
    let out = tpctl(&args, &[("TPCTL_FAILPOINTS", "session.cleanup=panic@1")]);
    assert_eq!(out.status.code(), Some(101), "the failed rank's code\n{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    let report = "error: rank 1 failed with exit code 101: error: panicked: failpoint \
                  `session.cleanup` fired";
    assert!(err.contains(report), "{}", text(&out));
}

/// The failing rank prints its own error the moment it fails and exits without its teardown
/// (rank 0's would take 8 s here), so the launcher reports rank 0's injected error and exits
/// at once, with no rank left. Before, rank 0 tore down first: its peer's "another rank
/// failed" exit made the launcher SIGTERM it, then SIGKILL it after the grace period, and the
/// report named the peer.
#[cfg(feature = "failpoints")]
#[test]
fn the_failing_ranks_own_error_is_reported_at_once() {
    use std::io::{BufRead, BufReader};
    let mark = marker();
    let mut child = start(
        &["run", "--model", model(), "--tp", "2", "--prompt-ids", "1,2", "--max-tokens", "8"],
        &[("TPCTL_FAILPOINTS", "session.step=error@0#2;session.cleanup=delay(8000)@0")],
        &mark,
    );
    let stderr = child.stderr.take().expect("piped stderr");
    let reader = std::thread::spawn(move || {
        let lines = BufReader::new(stderr).lines().map_while(Result::ok);
        lines.map(|l| (std::time::Instant::now(), l)).collect::<Vec<_>>()
    });
    let out = wait(child, &mark);
    let exited = std::time::Instant::now();
    let lines = reader.join().expect("stderr reader");
    let all: Vec<&str> = lines.iter().map(|(_, l)| l.as_str()).collect();
    let all = all.join("\n");
    assert_eq!(leftovers(&mark), Vec::<u32>::new(), "processes left behind\n{all}");
    assert_eq!(out.status.code(), Some(1), "{all}");
    let injected = "injected failure at failpoint `session.step`";
    // The failpoint logs when it fires: the moment of the fault.
    let (fault, _) = lines
        .iter()
        .find(|(_, l)| l.starts_with("[rank 0] ") && l.contains("point=\"session.step\""))
        .unwrap_or_else(|| panic!("the failpoint never fired\n{all}"));
    assert!(
        lines.iter().any(|(_, l)| l.starts_with("[rank 0] error: ") && l.contains(injected)),
        "rank 0 never printed its error\n{all}"
    );
    let report = format!(
        "error: rank 0 failed with exit code 1: error: step at epoch 0 step 3 (rank 0): {injected}"
    );
    assert!(all.contains(&report), "{all}");
    let after = exited.duration_since(*fault);
    assert!(after < Duration::from_secs(2), "the launcher exited {after:?} after the fault\n{all}");
}

#[cfg(feature = "failpoints")]
#[test]
fn ctrl_c_stops_every_rank() {
    let mark = marker();
    let child = start(
        &["run", "--model", model(), "--tp", "2", "--prompt-ids", "1", "--max-tokens", "200"],
        &[("TPCTL_FAILPOINTS", "session.step=delay(100)")],
        &mark,
    );
    // Wait until the ranks run, then interrupt the launcher as a terminal would.
    let start = std::time::Instant::now();
    while leftovers(&mark).len() < 3 && start.elapsed() < DEADLINE {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let status = Command::new("kill").arg("-INT").arg(child.id().to_string()).status().unwrap();
    assert!(status.success());
    let out = wait(child, &mark);
    assert_eq!(leftovers(&mark), Vec::<u32>::new(), "processes left behind");
    assert_eq!(out.status.code(), Some(130), "{}", text(&out));
}

/// `tpctl doctor` on a machine without a usable GPU (this build may lack the `cuda` feature,
/// or the machine the driver) exits 1 with the blocker named; with a GPU it exits 0.
#[test]
fn doctor_names_what_blocks_the_gpu_path() {
    let out = tpctl(&["doctor"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        assert!(stdout.contains("tpctl can compute on this machine's GPU"), "{}", text(&out));
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(stdout.contains("BLOCKER  cuda"), "{}", text(&out));
    assert!(stdout.contains("blocker(s): tpctl cannot compute on a GPU here"), "{}", text(&out));
}
