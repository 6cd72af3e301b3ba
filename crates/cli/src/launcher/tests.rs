//! The supervisor against real processes (`sh` scripts as ranks).

use super::*;

fn spec(script: &str, nproc: usize) -> Launch {
    Launch {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        nproc_per_node: nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 29_500,
        env: vec![("EXTRA".into(), "yes".into())],
        rank0_env: Vec::new(),
        grace: Duration::from_millis(300),
        mpirun: false,
    }
}

/// Runs a launch on another thread with a deadline, so a hang fails the test.
fn launch_within(spec: Launch, interrupted: Arc<AtomicBool>) -> Result<Outcome> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(launch(&spec, &interrupted)));
    rx.recv_timeout(Duration::from_secs(30)).expect("the launch did not return within 30 s")
}

fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

#[test]
fn every_rank_succeeding_is_success() {
    let never = AtomicBool::new(false);
    let out =
        launch(&spec("test \"$EXTRA\" = yes && test \"$WORLD_SIZE\" = 3", 3), &never).unwrap();
    assert_eq!(out, Outcome::Success);
}

#[test]
fn the_first_failure_stops_the_others_and_decides_the_code() {
    let dir = std::env::temp_dir().join(format!("tpctl-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The others record their pids and would sleep for a minute; rank 1 fails once they have.
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then while [ ! -s {d}/0 ] || [ ! -s {d}/2 ]; do sleep 0.02; done; \
         echo 'boom: bad weights' >&2; exit 7; fi; echo $$ > {d}/$RANK.tmp; mv {d}/$RANK.tmp {d}/$RANK; sleep 60",
        d = dir.display()
    );
    let out = launch_within(spec(&script, 3), Arc::new(AtomicBool::new(false))).unwrap();
    let Outcome::Failed(f) = out else { panic!("expected a failure, got {out:?}") };
    assert_eq!((f.rank, f.code), (1, 7));
    assert!(f.to_string().contains("rank 1 failed with exit code 7: boom: bad weights"), "{f}");
    for r in ["0", "2"] {
        let pid = std::fs::read_to_string(dir.join(r)).unwrap();
        assert!(!alive(pid.trim()), "rank {r} (pid {pid}) outlived the launch");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_ignoring_sigterm_is_killed_after_the_grace_period() {
    let dir = std::env::temp_dir().join(format!("tpctl-stubborn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(
        "if [ \"$RANK\" = 0 ]; then while [ ! -s {d}/sleep ]; do sleep 0.05; done; exit 3; fi; \
         trap '' TERM; sleep 60 & echo $! > {d}/sleep.tmp; mv {d}/sleep.tmp {d}/sleep; wait",
        d = dir.display()
    );
    let out = launch_within(spec(&script, 2), Arc::new(AtomicBool::new(false))).unwrap();
    assert_eq!(out.exit_code(), 3);
    // The rank's own child went with it: the whole process group was killed.
    let pid = std::fs::read_to_string(dir.join("sleep")).unwrap_or_default();
    assert!(!pid.trim().is_empty() && !alive(pid.trim()), "the rank's child {pid} survived");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_interrupt_stops_every_rank() {
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        flag.store(true, Ordering::SeqCst);
    });
    let out = launch_within(spec("sleep 60", 2), interrupted).unwrap();
    setter.join().unwrap();
    assert_eq!(out, Outcome::Interrupted);
    assert_eq!(out.exit_code(), 130);
}

#[test]
fn a_program_that_cannot_start_is_an_error() {
    let mut s = spec("true", 2);
    s.program = "/nonexistent/tpctl-rank".into();
    let err = launch_within(s, Arc::new(AtomicBool::new(false))).unwrap_err();
    assert!(format!("{err:#}").contains("starting rank 0: /nonexistent/tpctl-rank"), "{err:#}");
}

/// A rank that failed only because of a peer (exit code 3) exits first; the origin is still
/// printing its error: it gets the grace period (it was SIGTERMed at once, and counted as
/// stopped, before), so the report is the origin's.
#[test]
fn the_origin_is_reported_when_a_secondary_failure_exits_first() {
    let script = "if [ \"$RANK\" = 1 ]; then echo 'another rank failed' >&2; exit 3; fi; \
                  sleep 0.5; echo 'boom: rank 0 broke' >&2; exit 1";
    let mut s = spec(script, 2);
    s.grace = Duration::from_secs(5);
    let out = launch_within(s, Arc::new(AtomicBool::new(false))).unwrap();
    let Outcome::Failed(f) = out else { panic!("expected a failure, got {out:?}") };
    assert_eq!((f.rank, f.code, f.signal), (0, 1, None), "{f}");
    assert!(f.to_string().contains("rank 0 failed with exit code 1: boom: rank 0 broke"), "{f}");
}

/// A SIGKILL the launcher did not send (the OOM killer, a crash) is the origin, and the
/// report says so; one the launcher sent after the grace period is not (see
/// `a_rank_ignoring_sigterm_is_killed_after_the_grace_period`).
#[test]
fn a_sigkill_from_elsewhere_is_the_origin() {
    let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 0.2; kill -9 $$";
    let mut s = spec(script, 2);
    s.grace = Duration::from_secs(5);
    let out = launch_within(s, Arc::new(AtomicBool::new(false))).unwrap();
    let Outcome::Failed(f) = out else { panic!("expected a failure, got {out:?}") };
    assert_eq!((f.rank, f.code, f.signal), (0, 137, Some(9)), "{f}");
    assert!(
        f.to_string().contains(
            "rank 0 was killed by signal 9 (SIGKILL) (exit code 137), not by the launcher"
        ),
        "{f}"
    );
}

#[test]
fn the_nccl_host_id_override_gives_each_rank_its_own_host() {
    assert_eq!(super::nccl_hostid(None, 1), None);
    assert_eq!(super::nccl_hostid(Some(""), 1), None);
    assert_eq!(super::nccl_hostid(Some("gpu-test"), 0), Some(("NCCL_HOSTID", "gpu-test-0".into())));
    assert_eq!(super::nccl_hostid(Some("gpu-test"), 1), Some(("NCCL_HOSTID", "gpu-test-1".into())));
}
