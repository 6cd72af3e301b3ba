//! `tpctl run --backend mpi` end to end: the ranks start under one `mpirun` (OpenMPI), give
//! the same greedy tokens as on shm, and a failing rank is named with its own error with no
//! process left behind. Every wait has a deadline.

#![cfg(feature = "mpi")]

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

mod common;

use common::describe as text;
use common::{leftovers, marker, tpctl_bin};

const DEADLINE: Duration = Duration::from_secs(120);

fn start(args: &[&str], extra_env: &[(&str, &str)], mark: &str) -> Child {
    Command::new(tpctl_bin())
        .args(args)
        .env("TPCTL_TEST_MARK", mark)
        .env_remove("RUST_LOG")
        .envs(extra_env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tpctl")
}

/// Waits for tpctl with a deadline, then checks that none of its processes (mpirun, its
/// shims, the ranks) is left.
fn finish(child: Child, mark: &str) -> Output {
    let out = common::wait_within(child, mark, DEADLINE);
    assert_eq!(leftovers(mark), Vec::<u32>::new(), "processes left behind\n{}", text(&out));
    out
}

fn tpctl(args: &[&str], extra_env: &[(&str, &str)]) -> Output {
    let mark = marker();
    finish(start(args, extra_env, &mark), &mark)
}

fn run_args<'a>(backend: &'a str, tp: &'a str, cp: &'a str) -> Vec<&'a str> {
    let model = common::tiny_model();
    vec![
        "run",
        "--model",
        model,
        "--backend",
        backend,
        "--tp",
        tp,
        "--cp",
        cp,
        "--threads",
        "1",
        "--prompt-ids",
        "1,2,3,4,5",
        "--max-tokens",
        "6",
        "--output",
        "jsonl",
    ]
}

fn token_ids(out: &Output) -> Vec<u64> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().next().unwrap_or_else(|| panic!("no output\n{}", text(out)));
    let json: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}\n{}", text(out)));
    json["token_ids"].as_array().expect("token_ids").iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn mpi_backend_under_mpirun_gives_the_same_tokens_as_shm() {
    let shm = tpctl(&run_args("shm", "2", "2"), &[]);
    assert!(shm.status.success(), "{}", text(&shm));
    let mpi = tpctl(&run_args("mpi", "2", "2"), &[]);
    assert!(mpi.status.success(), "{}", text(&mpi));
    assert_eq!(token_ids(&mpi), token_ids(&shm), "{}", text(&mpi));
    assert_eq!(token_ids(&mpi).len(), 6);
}

#[cfg(feature = "failpoints")]
#[test]
fn a_failing_rank_under_mpirun_is_named_with_its_own_error() {
    let out = tpctl(&run_args("mpi", "2", "1"), &[("TPCTL_FAILPOINTS", "session.step=error@1#2")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[rank 1] error: "), "rank 1's own line is not shown\n{}", text(&out));
    let report = "error: rank 1 failed with exit code 1: error: step at epoch 0 step 3 (rank 1): \
                  injected failure at failpoint `session.step`";
    assert!(err.contains(report), "{}", text(&out));
}

/// A rank that panics where no engine catches it (here in its teardown, after MPI started) is
/// the failure the user reads, at once. Before, its unwinding ran `MPI_Finalize`, which waited
/// for rank 0, itself waiting 30 s at the shutdown barrier for rank 1: the report was rank 0's
/// "1 of 2 ranks still missing".
#[cfg(feature = "failpoints")]
#[test]
fn a_rank_that_panics_under_mpirun_is_named_with_its_panic() {
    let out = tpctl(&run_args("mpi", "2", "1"), &[("TPCTL_FAILPOINTS", "session.cleanup=panic@1")]);
    assert_eq!(out.status.code(), Some(101), "the failed rank's code\n{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    let report = "error: rank 1 failed with exit code 101: error: panicked: failpoint \
                  `session.cleanup` fired";
    assert!(err.contains(report), "{}", text(&out));
    assert!(!err.contains("still missing"), "a peer's deadline was reached\n{}", text(&out));
}

/// Ctrl-C reaches the launcher alone; it forwards one SIGINT to mpirun, which stops its
/// processes, and every one of them is gone when tpctl exits with 130.
#[cfg(feature = "failpoints")]
#[test]
fn ctrl_c_under_mpirun_stops_every_rank() {
    use std::io::Read;
    let mark = marker();
    let mut args = run_args("mpi", "2", "1");
    let max = args.iter().position(|a| *a == "--max-tokens").unwrap() + 1;
    args[max] = "200";
    // Text output streams each token as it comes.
    let output = args.iter().position(|a| *a == "--output").unwrap();
    args.drain(output..output + 2);
    let mut child = start(&args, &[("TPCTL_FAILPOINTS", "session.step=delay(100)")], &mark);
    // The first generated output: the ranks run.
    let mut stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut first = [0u8; 1];
        let _ = tx.send(stdout.read(&mut first).map(|n| n > 0).unwrap_or(false));
        let _ = std::io::copy(&mut stdout, &mut std::io::sink());
    });
    let running = rx.recv_timeout(DEADLINE).unwrap_or(false);
    let status = Command::new("kill").arg("-INT").arg(child.id().to_string()).status().unwrap();
    assert!(status.success());
    let out = finish(child, &mark);
    assert!(running, "no output before the interrupt\n{}", text(&out));
    assert_eq!(out.status.code(), Some(130), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interrupted: every rank stopped"), "{}", text(&out));
}
