//! Sleep and wakeup between real rank processes: every rank gives back at least 90% of its
//! tagged bytes and gets identical bytes back, and a rank killed during PREPARE or COMMIT leaves
//! no survivor half asleep. Every wait has a deadline.

use std::time::Duration;
use tpctl_tests::{launch, RankOutput};

const RANK: &str = env!("CARGO_BIN_EXE_sleep-rank");
const DEADLINE: Duration = Duration::from_secs(120);
const TAGGED: u64 = 2 * (64 << 20);

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn show(outs: &[RankOutput]) -> String {
    outs.iter()
        .map(|o| {
            format!("rank {} exit {:?}:\n{}\n{}", o.rank, o.code, o.stdout.trim(), o.stderr.trim())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `(rank, action, bytes, before, after)` of each `receipt` line.
fn receipts(out: &RankOutput) -> Vec<(usize, String, u64, u64, u64)> {
    out.stdout
        .lines()
        .filter(|l| l.starts_with("receipt "))
        .map(|l| {
            let field = |k: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(&format!("{k}=")))
                    .unwrap_or_else(|| panic!("no {k} in `{l}`"))
                    .to_owned()
            };
            let num = |k: &str| field(k).parse::<u64>().expect("a number");
            (num("rank") as usize, field("action"), num("bytes"), num("before"), num("after"))
        })
        .collect()
}

#[test]
fn sleep_frees_every_ranks_tagged_memory_and_wakeup_restores_identical_bytes() {
    for world in [1, 3] {
        let outs = launch(RANK, world, |_| env(&[("TPCTL_SCENARIO", "cycle")]), DEADLINE);
        for o in &outs {
            assert_eq!(o.code, Some(0), "{}", show(&outs));
            assert_eq!(o.last_line(), "ok", "{}", show(&outs));
            assert!(o.stdout.contains("awake intact"), "{}", show(&outs));
        }
        let rs = receipts(&outs[0]);
        assert_eq!(rs.len(), 2 * world, "{}", show(&outs));
        for (rank, action, bytes, before, after) in rs {
            assert_eq!(bytes, TAGGED, "rank {rank} {action}: {}", show(&outs));
            if action == "sleep" {
                // Each rank on its own: another rank's release never hides a leak.
                assert!(
                    before.saturating_sub(after) >= TAGGED * 9 / 10,
                    "rank {rank} freed only {} of {TAGGED} bytes",
                    before.saturating_sub(after)
                );
            } else {
                assert!(
                    after >= before + TAGGED * 9 / 10,
                    "rank {rank} wakeup: {before} -> {after}"
                );
            }
        }
        assert!(outs[0].stdout.contains("again bytes=0"), "{}", show(&outs));
    }
}

#[cfg(feature = "failpoints")]
#[test]
fn a_rank_killed_during_prepare_or_commit_leaves_no_survivor_half_asleep() {
    for (point, victim, outcome) in
        [("sleep.prepare", 1, "Some(Aborted)"), ("sleep.commit", 2, "Some(RolledBack)")]
    {
        let spec = format!("{point}=kill@{victim}");
        let outs = launch(
            RANK,
            3,
            |_| env(&[("TPCTL_SCENARIO", "fail"), ("TPCTL_FAILPOINTS", &spec)]),
            DEADLINE,
        );
        assert_eq!(outs[victim].code, Some(137), "{spec}:\n{}", show(&outs));
        let error = outs[0]
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("error: "))
            .unwrap_or_else(|| panic!("{spec}: rank 0 reported no error:\n{}", show(&outs)));
        assert!(error.contains(&format!("rank {victim} is lost")), "{spec}: {error}");
        assert!(outs[0].stdout.contains(&format!("outcome={outcome}")), "{spec}:\n{}", show(&outs));
        assert!(
            outs[0].stdout.contains(&format!("state=Failed(\"rank {victim} is lost\")")),
            "{spec}:\n{}",
            show(&outs)
        );
        // Every survivor is awake with its bytes intact, none asleep.
        for o in outs.iter().filter(|o| o.rank != victim) {
            assert_eq!(o.code, Some(0), "{spec}:\n{}", show(&outs));
            assert!(o.stdout.contains("awake intact"), "{spec}:\n{}", show(&outs));
        }
    }
}
