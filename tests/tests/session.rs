//! The session engine between real rank processes (shm, CPU, the random Llama model), one
//! scenario per test on 2 ranks and a subset on 4 (tp = 2, cp = 2). Every scenario checks:
//! each opened session closed exactly once per rank, workers wrote no output, every rank saw
//! the same step indices, no thread left behind; `launch` kills every process at its deadline.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;
use tpctl_tests::{launch, RankOutput};

const RANK: &str = env!("CARGO_BIN_EXE_session-rank");
const DEADLINE: Duration = Duration::from_secs(90);

/// The random model every rank loads, written once per test process.
fn model() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        // Cargo's scratch folder for integration tests, inside the target directory.
        let path: PathBuf = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("tpctl-session-{}.gguf", std::process::id()));
        layers::model::random::RandomLlama::default().write(&path).expect("write the model");
        path.to_string_lossy().into_owned()
    })
}

fn start(world: usize, scenario: &str, extra: &[(&str, &str)]) -> Vec<RankOutput> {
    let mut vars: Vec<(String, String)> =
        vec![("TPCTL_SCENARIO".into(), scenario.into()), ("TPCTL_MODEL".into(), model().into())];
    if world == 4 {
        vars.push(("TPCTL_TP".into(), "2".into()));
    }
    vars.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let outs = launch(RANK, world, |_| vars.clone(), DEADLINE);
    // `launch` picks a free port before rank 0 binds it; a test running next to this one can
    // take it in between. That is the harness, not the engine: start again once.
    if outs.iter().any(|o| o.stdout.contains("Address already in use")) {
        return launch(RANK, world, |_| vars.clone(), DEADLINE);
    }
    outs
}

fn show(outs: &[RankOutput]) -> String {
    outs.iter()
        .map(|o| {
            format!("rank {} exit {:?}:\n{}\n{}", o.rank, o.code, o.stdout.trim(), o.stderr.trim())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn lines<'a>(o: &'a RankOutput, prefix: &str) -> Vec<&'a str> {
    o.stdout.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// The invariants of every scenario; `killed` ranks left no report.
fn invariants(outs: &[RankOutput], killed: &[usize]) {
    let all = show(outs);
    let alive: Vec<&RankOutput> = outs.iter().filter(|o| !killed.contains(&o.rank)).collect();
    for o in &alive {
        let opened = lines(o, "open session=");
        let closed: Vec<String> = lines(o, "closed session=")
            .iter()
            .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_owned())
            .collect();
        let opened: Vec<String> = opened.iter().map(|l| l[5..].to_owned()).collect();
        assert_eq!(
            opened, closed,
            "rank {}: every opened session closes exactly once\n{all}",
            o.rank
        );
        if o.rank != 0 {
            assert!(lines(o, "out ").is_empty(), "worker {} wrote output\n{all}", o.rank);
        }
        assert!(o.stdout.contains("threads=1\n"), "rank {} left threads behind\n{all}", o.rank);
    }
    let steps: Vec<Vec<&str>> = alive.iter().map(|o| lines(o, "step ")).collect();
    assert!(steps.windows(2).all(|w| w[0] == w[1]), "ranks saw different steps\n{all}");
}

fn all_ok(outs: &[RankOutput]) {
    assert!(outs.iter().all(|o| o.code == Some(0) && o.last_line() == "ok"), "{}", show(outs));
    invariants(outs, &[]);
}

fn outputs(o: &RankOutput) -> Vec<&str> {
    lines(o, "out ")
}

fn closed(o: &RankOutput) -> Vec<&str> {
    lines(o, "closed ")
}

#[test]
fn natural_end_on_2_and_4_ranks_gives_the_same_output() {
    let two = start(2, "natural", &[]);
    all_ok(&two);
    let four = start(4, "natural", &[]);
    all_ok(&four);
    assert_eq!(outputs(&two[0]), outputs(&four[0]));
    let out = outputs(&two[0]);
    assert_eq!(out.len(), 4, "{}", show(&two));
    for (req, n) in [(1, 4), (2, 6), (3, 3), (4, 5)] {
        let line = out.iter().find(|l| l.starts_with(&format!("out req={req} "))).unwrap();
        assert!(line.contains("reason=length"), "{line}");
        assert_eq!(line.rsplit('=').next().unwrap().split(',').count(), n, "{line}");
    }
    assert_eq!(closed(&two[1]), vec!["closed session=0 steps=9"], "{}", show(&two));
    let tcp = start(2, "natural", &[("TPCTL_BACKEND", "tcp")]);
    all_ok(&tcp);
    assert_eq!(outputs(&two[0]), outputs(&tcp[0]));
}

#[test]
fn the_sharded_model_gives_the_replicated_output_on_a_2x2_mesh() {
    let replicated = start(2, "natural", &[]);
    all_ok(&replicated);
    for (world, backend) in [(4, "shm"), (2, "shm"), (4, "tcp")] {
        let sharded =
            start(world, "natural", &[("TPCTL_SHARDED", "1"), ("TPCTL_BACKEND", backend)]);
        all_ok(&sharded);
        assert_eq!(outputs(&replicated[0]), outputs(&sharded[0]), "{world} ranks, {backend}");
    }
}

/// A paged KV pool with room for one 40-token sequence serves four 26-token requests that
/// share an 8-token prefix: they wait, preempt and recompute, and reuse the cached prefix
/// (one CP rank), and the greedy tokens are those of the replicated model with caches of its
/// own.
#[test]
fn a_tiny_paged_pool_preempts_and_reuses_prefixes_without_changing_the_output() {
    let replicated = start(2, "shared-prefix", &[]);
    all_ok(&replicated);
    assert_eq!(outputs(&replicated[0]).len(), 4, "{}", show(&replicated));
    for world in [2, 4] {
        let paged = start(world, "shared-prefix", &[("TPCTL_SHARDED", "1"), ("TPCTL_PAGED", "1")]);
        all_ok(&paged);
        assert_eq!(outputs(&replicated[0]), outputs(&paged[0]), "{world} ranks");
        let counts = lines(&paged[0], "kv ");
        assert_eq!(counts.len(), 1, "{}", show(&paged));
        let (preemptions, hits) = counts[0]
            .strip_prefix("kv preemptions=")
            .and_then(|c| c.split_once(" prefix_hits="))
            .map(|(p, h)| (p.parse::<u64>().unwrap(), h.parse::<u64>().unwrap()))
            .unwrap();
        assert!(preemptions > 0, "{world} ranks: the pool never ran full: {}", counts[0]);
        if world == 2 {
            assert!(hits > 0, "no prompt reused the shared prefix: {}", counts[0]);
        }
    }
}

#[test]
fn bounded_and_zero_steps() {
    for world in [2, 4] {
        let outs = start(world, "bounded", &[]);
        all_ok(&outs);
        assert_eq!(lines(&outs[1], "step ").len(), 3);
        let out = outputs(&outs[0]);
        assert!(out.iter().all(|l| l.contains("reason=cancelled")), "{}", show(&outs));
        let outs = start(world, "zero", &[]);
        all_ok(&outs);
        for o in &outs {
            assert!(lines(o, "step ").is_empty());
            assert_eq!(closed(o), vec!["closed session=0 steps=0"]);
        }
    }
}

#[test]
fn a_stop_before_start_on_either_rank_runs_nothing() {
    for (world, stop_rank) in [(2, "0"), (2, "1"), (4, "3")] {
        let outs = start(world, "stop-before-start", &[("TPCTL_STOP_RANK", stop_rank)]);
        all_ok(&outs);
        for o in &outs {
            assert!(lines(o, "step ").is_empty(), "{}", show(&outs));
            assert_eq!(closed(o), vec!["closed session=0 steps=0"]);
        }
    }
}

#[test]
fn a_stop_while_waiting_for_input_reaches_every_rank() {
    for (world, stop_rank) in [(2, "0"), (2, "1"), (4, "0"), (4, "2")] {
        let outs = start(world, "stop-waiting", &[("TPCTL_STOP_RANK", stop_rank)]);
        all_ok(&outs);
        assert!(lines(&outs[1], "step ").is_empty());
    }
}

#[test]
fn a_stop_right_after_admission_lets_the_admitted_step_run_everywhere() {
    for (world, stop_rank) in [(2, "0"), (2, "1"), (4, "3")] {
        let outs = start(world, "stop-after-admission", &[("TPCTL_STOP_RANK", stop_rank)]);
        all_ok(&outs);
        for o in &outs {
            assert_eq!(lines(o, "step ").last(), Some(&"step epoch=0 step=3"), "{}", show(&outs));
        }
    }
}

#[test]
fn a_worker_finishing_early_stops_every_rank_at_the_next_boundary() {
    for (world, rank) in [(2, "1"), (4, "2")] {
        let outs =
            start(world, "worker-early", &[("TPCTL_STOP_RANK", rank), ("TPCTL_STOP_STEP", "2")]);
        all_ok(&outs);
        assert_eq!(closed(&outs[0]), vec!["closed session=0 steps=2"]);
        let out = outputs(&outs[0]);
        assert!(out.iter().all(|l| l.contains("reason=cancelled")), "{}", show(&outs));
    }
}

#[test]
fn serve_batches_requests_that_join_while_others_run() {
    for world in [2, 4] {
        let outs = start(world, "serve", &[]);
        all_ok(&outs);
        assert_eq!(outputs(&outs[0]).len(), 5, "{}", show(&outs));
    }
}

#[test]
fn a_replacement_seen_only_by_rank_0_reaches_every_rank() {
    for world in [2, 4] {
        let outs = start(world, "replace", &[]);
        all_ok(&outs);
        for o in &outs {
            assert_eq!(
                lines(o, "open "),
                vec!["open session=0", "open session=1"],
                "{}",
                show(&outs)
            );
        }
        assert!(outputs(&outs[0]).iter().any(|l| l.starts_with("out req=9 ")), "{}", show(&outs));
    }
}

#[test]
fn two_sessions_in_a_row_survive_a_cleanup_past_the_step_deadline() {
    for world in [2, 4] {
        let outs = start(
            world,
            "two-sessions",
            &[("TPCTL_TIMEOUT_MS", "2000"), ("TPCTL_FAILPOINTS", "session.cleanup=delay(3500)@1")],
        );
        all_ok(&outs);
        for o in &outs {
            assert_eq!(closed(o).len(), 2, "{}", show(&outs));
        }
        let out = outputs(&outs[0]);
        assert!(out.iter().any(|l| l.starts_with("out req=10 ")), "{}", show(&outs));
    }
}

#[test]
fn a_rank_sigkilled_mid_step_is_named_by_its_peers() {
    for (world, victim) in [(2usize, 1usize), (4, 3)] {
        let spec = format!("{victim}:3");
        let outs = start(world, "failure", &[("TPCTL_SIGKILL", &spec)]);
        let all = show(&outs);
        assert_eq!(outs[victim].code, None, "killed by a signal\n{all}");
        for o in outs.iter().filter(|o| o.rank != victim) {
            assert_eq!(o.code, Some(3), "{all}");
            assert!(o.last_line().contains(&format!("rank {victim}")), "{}", o.last_line());
            assert!(o.elapsed < Duration::from_secs(10), "took {:?}", o.elapsed);
        }
        invariants(&outs, &[victim]);
    }
}

/// A rank SIGKILLed inside the sharded model's step: its peers fail in the model's own TP and
/// CP collectives (wrapped by the model), announce that they failed after a peer, and every
/// survivor names the dead rank by its global rank (rank 0, whose own peers only poisoned
/// their groups, used to name one of them).
#[test]
fn a_rank_sigkilled_inside_the_sharded_model_is_named_by_every_survivor() {
    let victim = 3;
    let vars = [("TPCTL_SIGKILL", "3:3"), ("TPCTL_SHARDED", "1"), ("TPCTL_PLAN_CHECK", "0")];
    let outs = start(4, "failure", &vars);
    let all = show(&outs);
    assert_eq!(outs[victim].code, None, "killed by a signal\n{all}");
    for o in outs.iter().filter(|o| o.rank != victim) {
        assert_eq!(o.code, Some(3), "{all}");
        let line = o.last_line();
        assert!(
            line.contains(&format!("peer rank {victim} died")),
            "rank {}: {line}\n{all}",
            o.rank
        );
    }
    invariants(&outs, &[victim]);
}

#[cfg(feature = "failpoints")]
mod faults {
    use super::*;

    /// Every rank fails; `rank` with the injected message, the others naming it.
    fn injected_failure(world: usize, point: &str, rank: usize, skip: u32) {
        let spec = format!("{point}=error@{rank}#{skip}");
        let outs = start(world, "failure", &[("TPCTL_FAILPOINTS", &spec)]);
        let all = show(&outs);
        for o in &outs {
            assert_eq!(o.code, Some(3), "{spec}\n{all}");
            let line = o.last_line();
            if o.rank == rank {
                assert!(
                    line.contains(&format!("injected failure at failpoint `{point}`")),
                    "{spec}: {line}"
                );
            } else {
                assert!(line.contains("another rank failed"), "{spec}: {line}");
                assert!(
                    line.contains(&format!("rank {rank} reported a failure")),
                    "{spec}: {line}"
                );
            }
        }
        invariants(&outs, &[]);
    }

    #[test]
    fn a_failure_in_prepare_step_or_init_on_either_rank_fails_every_rank() {
        for rank in [0, 1] {
            injected_failure(2, "session.prepare", rank, 1);
            injected_failure(2, "session.step", rank, 2);
            injected_failure(2, "session.init", rank, 0);
        }
        injected_failure(4, "session.step", 3, 1);
        injected_failure(4, "session.init", 2, 0);
    }

    /// Ranks that fail only because rank 0 did, inside the sharded model's own TP and CP
    /// collectives (their errors wrapped by the model), say so without claiming to be the
    /// origin, so every rank names rank 0 by its global rank (rank 3's CP peer is its group's
    /// rank 0 but global rank 1).
    #[test]
    fn failures_seen_inside_the_sharded_model_name_the_origin() {
        let spec = "session.step=error@0#2";
        let vars = [("TPCTL_FAILPOINTS", spec), ("TPCTL_SHARDED", "1"), ("TPCTL_PLAN_CHECK", "0")];
        let outs = start(4, "failure", &vars);
        let all = show(&outs);
        for o in &outs {
            assert_eq!(o.code, Some(3), "{all}");
            let line = o.last_line();
            if o.rank == 0 {
                assert!(line.contains("injected failure at failpoint `session.step`"), "{all}");
            } else {
                let origin = "another rank failed: rank 0 reported a failure";
                assert!(line.contains(origin), "rank {}: {line}\n{all}", o.rank);
            }
        }
        invariants(&outs, &[]);
    }

    /// The origin waits on nobody: rank 0 fails its third step while rank 1 is still in
    /// its own (delayed 3 s, outside any collective), and rank 0 leaves at once with its own
    /// error; rank 1 finds rank 0's failure when its step reaches a collective and names it.
    /// Before, rank 0 announced its failure at the next admission, which waited for rank 1.
    #[test]
    fn the_origin_leaves_without_waiting_for_a_peer_still_in_its_step() {
        let spec = "session.step=error@0#2;session.step=delay(3000)@1#2";
        let outs = start(2, "failure", &[("TPCTL_FAILPOINTS", spec)]);
        let all = show(&outs);
        assert!(
            outs[0].last_line().contains("injected failure at failpoint `session.step`"),
            "{all}"
        );
        assert!(outs[1].last_line().contains("another rank failed: rank 0 reported"), "{all}");
        assert!(
            outs[0].elapsed + Duration::from_millis(1500) < outs[1].elapsed,
            "rank 0 left after {:?}, rank 1 after {:?}\n{all}",
            outs[0].elapsed,
            outs[1].elapsed
        );
        invariants(&outs, &[]);
    }

    #[test]
    fn a_failure_in_rank_0s_output_sink_fails_every_rank() {
        injected_failure(2, "session.sink", 0, 1);
        injected_failure(4, "session.sink", 0, 2);
        // Workers own no sink: the same failpoint armed on a worker never fires.
        let outs = start(2, "failure", &[("TPCTL_FAILPOINTS", "session.sink=error@1")]);
        all_ok(&outs);
    }

    #[test]
    fn a_rank_killed_mid_step_is_named_by_its_peers() {
        for (world, victim) in [(2usize, 1usize), (4, 2)] {
            let spec = format!("session.step=kill@{victim}#2");
            let outs = start(
                world,
                "failure",
                &[("TPCTL_FAILPOINTS", &spec), ("TPCTL_TIMEOUT_MS", "10000")],
            );
            let all = show(&outs);
            assert_eq!(outs[victim].code, Some(137), "{all}");
            for o in outs.iter().filter(|o| o.rank != victim) {
                assert_eq!(o.code, Some(3), "{all}");
                assert!(o.last_line().contains(&format!("rank {victim}")), "{}", o.last_line());
                assert!(o.elapsed < Duration::from_secs(10), "took {:?}", o.elapsed);
            }
            invariants(&outs, &[victim]);
        }
    }

    #[test]
    fn a_panic_in_a_step_is_that_ranks_error_and_its_peer_is_told() {
        let outs = start(2, "failure", &[("TPCTL_FAILPOINTS", "session.step=panic@1#1")]);
        let all = show(&outs);
        assert!(outs.iter().all(|o| o.code == Some(3)), "{all}");
        let line = outs[1].last_line();
        assert!(
            line.contains(
                "step at epoch 0 step 2 (rank 1): panicked: failpoint `session.step` fired"
            ),
            "{line}"
        );
        assert!(outs[0].last_line().contains("another rank failed: rank 1 reported"), "{all}");
        invariants(&outs, &[]);
    }

    #[test]
    fn workers_notice_a_dead_rank_0_while_the_session_idles() {
        let outs = start(2, "stop-waiting", &[("TPCTL_FAILPOINTS", "session.idle=kill@0#1")]);
        let all = show(&outs);
        assert_eq!(outs[0].code, Some(137), "{all}");
        assert_eq!(outs[1].code, Some(3), "{all}");
        assert!(outs[1].last_line().contains("peer rank 0"), "{all}");
        assert!(outs[1].elapsed < Duration::from_secs(10), "took {:?}", outs[1].elapsed);
        invariants(&outs, &[0]);
    }

    #[test]
    fn a_rank_hanging_in_a_step_is_detected_and_named() {
        let outs = start(
            2,
            "failure",
            &[("TPCTL_FAILPOINTS", "session.step=delay(6000)@1#2"), ("TPCTL_TIMEOUT_MS", "2000")],
        );
        let all = show(&outs);
        assert_eq!(outs[0].code, Some(3), "{all}");
        let line = outs[0].last_line();
        assert!(line.contains("timed out") && line.contains("peer rank 1"), "{line}");
        assert_eq!(outs[1].code, Some(3), "{all}");
        invariants(&outs, &[]);
    }
}
