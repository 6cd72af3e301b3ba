//! Collectives between real processes: every op against its serial definition for worlds of
//! 1 to 8 ranks on both backends, the mesh groups, and the failure paths (a killed peer, a
//! slow peer, mismatched arguments, the store's server dying). Every wait has a deadline.

use std::time::Duration;
use tpctl_tests::{launch, RankOutput};

const RANK: &str = env!("CARGO_BIN_EXE_collectives-rank");
const DEADLINE: Duration = Duration::from_secs(90);

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn show(outs: &[RankOutput]) -> String {
    outs.iter()
        .map(|o| {
            format!("rank {} exit {:?}: {}\n{}", o.rank, o.code, o.stdout.trim(), o.stderr.trim())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn all_ok(outs: &[RankOutput]) {
    assert!(outs.iter().all(|o| o.code == Some(0) && o.last_line() == "ok"), "{}", show(outs));
}

#[test]
fn every_op_matches_serial_on_shm_and_tcp_for_worlds_1_to_8() {
    for backend in ["shm", "tcp"] {
        for world in [1, 2, 3, 4, 5, 8] {
            let outs = launch(
                RANK,
                world,
                |_| env(&[("TPCTL_SCENARIO", "ops"), ("TPCTL_BACKEND", backend)]),
                DEADLINE,
            );
            all_ok(&outs);
        }
    }
}

#[test]
fn tp_rows_and_cp_columns_of_a_2x2_mesh() {
    for backend in ["shm", "tcp"] {
        let outs = launch(
            RANK,
            4,
            |_| env(&[("TPCTL_SCENARIO", "mesh"), ("TPCTL_BACKEND", backend)]),
            DEADLINE,
        );
        all_ok(&outs);
    }
}

#[test]
fn a_second_init_reuses_the_world_without_owning_it() {
    for backend in ["shm", "tcp"] {
        let outs = launch(
            RANK,
            3,
            |_| env(&[("TPCTL_SCENARIO", "reuse"), ("TPCTL_BACKEND", backend)]),
            DEADLINE,
        );
        all_ok(&outs);
    }
}

#[test]
fn mismatched_sizes_fail_on_every_rank() {
    for backend in ["shm", "tcp"] {
        let outs = launch(
            RANK,
            3,
            |_| env(&[("TPCTL_SCENARIO", "mismatch"), ("TPCTL_BACKEND", backend)]),
            DEADLINE,
        );
        for o in &outs {
            assert_eq!(o.code, Some(3), "{}", show(&outs));
            let line = o.last_line();
            assert!(line.contains("all_reduce on tp[cp=0] group"), "{line}");
            assert!(line.contains("mismatch") || line.contains("another rank failed"), "{line}");
        }
        assert!(outs.iter().any(|o| o.last_line().contains("bytes mismatch")), "{}", show(&outs));
    }
}

#[cfg(feature = "failpoints")]
mod faults {
    use super::*;

    #[test]
    fn a_killed_peer_is_named_by_the_survivors_within_the_deadline() {
        for backend in ["shm", "tcp"] {
            for world in [2, 4] {
                let point = if backend == "shm" { "shm.wait" } else { "tcp.send" };
                let spec = format!("{point}=kill@1#20");
                let outs = launch(
                    RANK,
                    world,
                    |_| {
                        env(&[
                            ("TPCTL_SCENARIO", "repeat"),
                            ("TPCTL_BACKEND", backend),
                            ("TPCTL_FAILPOINTS", &spec),
                            ("TPCTL_TIMEOUT_MS", "10000"),
                        ])
                    },
                    DEADLINE,
                );
                assert_eq!(outs[1].code, Some(137), "{}", show(&outs));
                for o in outs.iter().filter(|o| o.rank != 1) {
                    assert_eq!(o.code, Some(3), "{}", show(&outs));
                    let line = o.last_line();
                    assert!(line.contains("peer rank 1"), "{backend} world {world}: {line}");
                    assert!(o.elapsed < Duration::from_secs(10), "{backend}: took {:?}", o.elapsed);
                }
            }
        }
    }

    #[test]
    fn a_slow_peer_within_the_deadline_succeeds() {
        for backend in ["shm", "tcp"] {
            let point = if backend == "shm" { "shm.wait" } else { "tcp.send" };
            let spec = format!("{point}=delay(300)@1#10");
            let outs = launch(
                RANK,
                2,
                |_| {
                    env(&[
                        ("TPCTL_SCENARIO", "repeat"),
                        ("TPCTL_BACKEND", backend),
                        ("TPCTL_FAILPOINTS", &spec),
                    ])
                },
                DEADLINE,
            );
            all_ok(&outs);
        }
    }

    #[test]
    fn an_injected_error_reaches_every_rank() {
        let outs = launch(
            RANK,
            3,
            |_| {
                env(&[
                    ("TPCTL_SCENARIO", "repeat"),
                    ("TPCTL_BACKEND", "shm"),
                    ("TPCTL_FAILPOINTS", "shm.send=error@2#5"),
                ])
            },
            DEADLINE,
        );
        assert!(
            outs[2].last_line().contains("injected failure at failpoint `shm.send`"),
            "{}",
            show(&outs)
        );
        for o in &outs[..2] {
            assert!(o.last_line().contains("another rank failed (peer rank 2"), "{}", show(&outs));
        }
    }
}

#[test]
fn a_store_whose_server_died_is_an_error_not_a_hang() {
    let outs = launch(
        RANK,
        2,
        |_| env(&[("TPCTL_SCENARIO", "store-death"), ("TPCTL_WAIT_MS", "60000")]),
        DEADLINE,
    );
    assert_eq!(outs[0].code, Some(0), "{}", show(&outs));
    assert_eq!(outs[1].code, Some(3), "{}", show(&outs));
    assert!(outs[1].elapsed < Duration::from_secs(30), "took {:?}", outs[1].elapsed);
    assert!(outs[1].last_line().contains("store"), "{}", show(&outs));
}
