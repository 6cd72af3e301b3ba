//! Tests of the launcher environment parsing, each on a map rather than the real environment.

use super::*;
use std::collections::HashMap;

fn rv(vars: &[(&str, &str)]) -> Result<Rendezvous> {
    let map: HashMap<String, String> =
        vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    Rendezvous::from_lookup(move |name| map.get(name).cloned())
}

fn err(vars: &[(&str, &str)]) -> String {
    match rv(vars) {
        Ok(rv) => panic!("expected an error for {vars:?}, got {rv:?}"),
        Err(e) => e.to_string(),
    }
}

type Vars = Vec<(&'static str, &'static str)>;

const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];

fn with_master(vars: &[(&'static str, &'static str)]) -> Vars {
    vars.iter().copied().chain(MASTER).collect()
}

#[test]
fn nothing_set_is_a_single_rank() {
    assert_eq!(rv(&[]).unwrap(), Rendezvous::single());
    assert!(Rendezvous::single().single_host());
}

#[test]
fn local_rank_alone_picks_the_device_of_a_single_rank() {
    let got = rv(&[("LOCAL_RANK", "1")]).unwrap();
    assert_eq!((got.rank, got.world_size, got.local_rank), (0, 1, Some(1)));
}

#[test]
fn reads_each_launcher() {
    let cases: [(&str, Vars, Rendezvous); 4] = [
        (
            "torchrun",
            with_master(&[
                ("RANK", "3"),
                ("WORLD_SIZE", "8"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("GROUP_RANK", "1"),
            ]),
            Rendezvous {
                rank: 3,
                world_size: 8,
                local_rank: Some(1),
                local_world_size: Some(2),
                node_rank: Some(1),
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
            },
        ),
        (
            "slurm",
            with_master(&[
                ("SLURM_PROCID", "5"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_LOCALID", "1"),
                ("SLURM_TASKS_PER_NODE", "4(x2)"),
                ("SLURM_NODEID", "1"),
            ]),
            Rendezvous {
                rank: 5,
                world_size: 8,
                local_rank: Some(1),
                local_world_size: Some(4),
                node_rank: Some(1),
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
            },
        ),
        (
            "openmpi",
            with_master(&[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ]),
            Rendezvous {
                rank: 2,
                world_size: 4,
                local_rank: Some(2),
                local_world_size: Some(4),
                node_rank: None,
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
            },
        ),
        (
            "torchrun inside a slurm task: slurm ignored",
            with_master(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_NTASKS_PER_NODE", "2"),
            ]),
            Rendezvous {
                rank: 1,
                world_size: 2,
                local_rank: None,
                local_world_size: None,
                node_rank: None,
                master_addr: "10.0.0.1".into(),
                master_port: 29500,
            },
        ),
    ];
    for (name, vars, want) in cases {
        assert_eq!(rv(&vars).unwrap(), want, "{name}");
    }
}

#[test]
fn single_host_follows_the_local_world() {
    let two_hosts =
        rv(&with_master(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")])).unwrap();
    assert!(!two_hosts.single_host());
    let one_host =
        rv(&with_master(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4")])).unwrap();
    assert!(one_host.single_host());
}

#[test]
fn slurm_tasks_per_node_forms() {
    for (value, want) in [("4", Some(4)), ("2(x3)", Some(2)), ("2(x3),1", None)] {
        let got = rv(&with_master(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_TASKS_PER_NODE", value),
        ]))
        .unwrap();
        assert_eq!(got.local_world_size, want, "{value}");
    }
    let e = err(&with_master(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_TASKS_PER_NODE", "four"),
    ]));
    assert!(e.contains("SLURM_TASKS_PER_NODE=\"four\""), "{e}");
}

#[test]
fn errors_name_the_variable_and_value() {
    let cases: [(Vars, &[&str]); 11] = [
        (with_master(&[("RANK", "1")]), &["WORLD_SIZE is not set", "RANK=1"]),
        (with_master(&[("WORLD_SIZE", "2")]), &["RANK is not set", "WORLD_SIZE=2"]),
        (with_master(&[("RANK", "x"), ("WORLD_SIZE", "2")]), &["RANK=\"x\"", "whole number"]),
        (with_master(&[("RANK", "0"), ("WORLD_SIZE", "-2")]), &["WORLD_SIZE=\"-2\""]),
        (with_master(&[("RANK", "0"), ("WORLD_SIZE", "0")]), &["WORLD_SIZE=\"0\"", "at least one"]),
        (with_master(&[("RANK", "2"), ("WORLD_SIZE", "2")]), &["RANK=\"2\"", "WORLD_SIZE=2"]),
        (
            with_master(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "2"),
                ("LOCAL_WORLD_SIZE", "2"),
            ]),
            &["LOCAL_RANK=\"2\"", "LOCAL_WORLD_SIZE=2"],
        ),
        (
            with_master(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "3")]),
            &["LOCAL_WORLD_SIZE=\"3\"", "WORLD_SIZE=2"],
        ),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
            &["MASTER_PORT is not set", "2 ranks"],
        ),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
            &["MASTER_ADDR is not set", "2 ranks"],
        ),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "0")],
            &["MASTER_PORT=\"0\"", "cannot agree"],
        ),
    ];
    for (vars, needles) in cases {
        let e = err(&vars);
        for needle in needles {
            assert!(e.contains(needle), "{vars:?}: `{e}` lacks `{needle}`");
        }
    }
    let e = err(&[("MASTER_PORT", "70000")]);
    assert!(e.contains("MASTER_PORT=\"70000\""), "{e}");
}

#[test]
fn single_rank_defaults_the_store_address() {
    let got = rv(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
    assert_eq!((got.master_addr.as_str(), got.master_port), ("127.0.0.1", 0));
    assert_eq!(got.store_addr(), "127.0.0.1:0");
    let v6 = Rendezvous { master_addr: "::1".into(), master_port: 7, ..Rendezvous::single() };
    assert_eq!(v6.store_addr(), "[::1]:7");
}

#[test]
fn the_innermost_launcher_wins() {
    // torchrun under srun: Slurm describes the per-node launcher task, torchrun the rank.
    let r = rv(&with_master(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_LOCALID", "0"),
    ]))
    .unwrap();
    assert_eq!((r.rank, r.world_size, r.local_rank, r.local_world_size), (5, 8, Some(1), Some(4)));
    // mpirun inside a Slurm allocation: OpenMPI's variables describe the rank.
    let r = rv(&with_master(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
    ]))
    .unwrap();
    assert_eq!((r.rank, r.world_size), (3, 4));
}

#[test]
fn a_master_port_is_free_and_below_the_ephemeral_range() {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok());
    let (a, b) = (free_master_port().unwrap(), free_master_port().unwrap());
    assert_ne!(a, b, "successive picks differ");
    for port in [a, b] {
        assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(), "{port} is free");
        if let Some(low) = ephemeral {
            assert!(port < low, "{port} is below the ephemeral range from {low}");
        }
    }
}
