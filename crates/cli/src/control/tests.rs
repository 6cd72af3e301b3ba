//! Tags, names and the rendering of receipts and status, without a socket.

use super::paths::{check_name, socket_path};
use super::render::{bytes, micros, receipt, status};
use super::*;
use session::sleep::{Phase, Probe, QuiesceMode, RankReceipt, TagReceipt};
use std::path::Path;

fn strings(t: &[&str]) -> Vec<String> {
    t.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn bytes_and_times_use_the_unit_that_fits() {
    for (n, text) in [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 << 20, "5.0 MiB"),
        (3 << 30, "3.0 GiB"),
        ((1 << 40) + (1 << 39), "1.5 TiB"),
    ] {
        assert_eq!(bytes(n), text);
    }
    for (us, text) in [(0, "0 us"), (999, "999 us"), (1500, "1.5 ms"), (3_200_000, "3.20 s")] {
        assert_eq!(micros(us), text);
    }
}

fn rank(rank: usize, devices: Vec<(u32, u64)>, tags: &[(&str, u64)]) -> RankReceipt {
    RankReceipt {
        rank,
        tags: tags
            .iter()
            .map(|&(t, b)| TagReceipt {
                tag: t.into(),
                allocations: 1,
                bytes: b,
                device_bytes: if devices.is_empty() { 0 } else { b },
                copied_bytes: 0,
                elapsed_us: 2500,
                restore: "reload".into(),
            })
            .collect(),
        before: Probe { resident: 3 << 30, devices: devices.clone(), ..Probe::default() },
        after: Probe {
            resident: 1 << 30,
            devices: devices.iter().map(|&(i, b)| (i, b - (2 << 30))).collect(),
            ..Probe::default()
        },
        elapsed_us: 5000,
        asleep: strings(&["weights"]),
    }
}

#[test]
fn a_receipt_has_a_row_per_rank_and_tag_and_a_total() {
    let op = OpWire {
        op_id: 7,
        action: "sleep".into(),
        tags: strings(&["weights", "kv_cache"]),
        bytes: 4 << 30,
        elapsed_us: 1_250_000,
        ranks: vec![
            rank(0, Vec::new(), &[("weights", 1 << 30), ("kv_cache", 1 << 30)]),
            rank(1, vec![(3, 10 << 30)], &[("weights", 1 << 30), ("kv_cache", 1 << 30)]),
        ],
        weight_version: None,
        kv_cache_dropped: false,
    };
    let text = receipt(&op);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    // Columns line up: every cell of a column starts where its header does.
    let at = |h: &str| lines[0].find(h).unwrap();
    assert_eq!(lines[3].find("cuda:3"), Some(at("device")), "{text}");
    assert_eq!(lines[3].find("1.0 GiB (1.0 GiB on device)"), Some(at("bytes")), "{text}");
    assert!(!lines[1].contains("on device"), "{text}");
    assert_eq!(lines[3].find("10.0 GiB -> 8.0 GiB"), Some(at("probe")), "{text}");
    assert_eq!(lines[1].find("3.0 GiB -> 1.0 GiB"), Some(at("probe")), "{text}");
    assert_eq!(lines[1].find("2.5 ms"), Some(at("time")), "{text}");
    assert!(lines[1].starts_with("0     cpu     weights"), "{text}");
    assert_eq!(lines[1].find("reload"), Some(at("restore")), "{text}");
    // The probe is shown once per rank.
    assert!(!lines[2].contains("->"), "{text}");
    assert_eq!(
        lines[5],
        "total: sleep weights,kv_cache on 2 rank(s): 4.0 GiB released in 1.25 s (op 7)"
    );

    let update =
        OpWire { action: "update_weights".into(), weight_version: Some("7".into()), ..op.clone() };
    assert!(receipt(&update).ends_with("(op 7)\nweight version: 7\n"), "{}", receipt(&update));
    let nothing = OpWire { op_id: 0, action: "wakeup".into(), ..op };
    assert!(receipt(&nothing).ends_with("nothing to do (already awake)\n"));
}

/// A runtime tag a rank holds none of (graphs on a CPU) reads `nothing held`, not `none`.
#[test]
fn a_runtime_tag_a_rank_holds_none_of_reads_nothing_held() {
    let mut r = rank(0, Vec::new(), &[("cuda_graph", 0), ("workspace", 0)]);
    r.tags[0].restore = "none".into();
    r.tags[1].restore = "replan".into();
    let op = OpWire {
        op_id: 3,
        action: "sleep".into(),
        tags: strings(&["cuda_graph", "workspace"]),
        bytes: 0,
        elapsed_us: 10,
        ranks: vec![r],
        weight_version: None,
        kv_cache_dropped: false,
    };
    let text = receipt(&op);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[1].ends_with("nothing held"), "{text}");
    assert!(lines[2].ends_with("replan"), "{text}");
}

#[test]
fn a_status_shows_the_state_each_rank_and_who_did_not_answer() {
    let s = StatusWire {
        state: "sleeping".into(),
        tags: strings(&["weights"]),
        reason: None,
        ranks: vec![rank(0, Vec::new(), &[]), rank(1, vec![(1, 4 << 30)], &[])],
        failures: vec![FailureWire {
            rank: 2,
            phase: Phase::Status,
            message: "no status ack from rank 2 within 10.0 s".into(),
        }],
        in_progress: None,
        paused: false,
        weight_version: String::new(),
        checkpoint: None,
    };
    let text = status(&s);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "state: sleeping (weights)");
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        ["rank", "device", "asleep", "resident", "device", "memory"]
    );
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["0", "cpu", "weights", "1.0", "GiB", "-"]
    );
    assert_eq!(
        lines[3].split_whitespace().collect::<Vec<_>>(),
        ["1", "cuda:1", "weights", "1.0", "GiB", "2.0", "GiB"]
    );
    assert_eq!(lines[4], "rank 2 did not answer (status): no status ack from rank 2 within 10.0 s");
    let busy = StatusWire { in_progress: Some("sleep [\"weights\"]".into()), ..s.clone() };
    assert_eq!(
        status(&busy).lines().nth(1),
        Some("in progress: sleep [\"weights\"] (only rank 0 answered; ask again after it)")
    );
    let paused = StatusWire { paused: true, weight_version: "step-3".into(), ..s.clone() };
    let text = status(&paused);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[1..3],
        ["generation: paused (tpctl resume continues it)", "weight version: step-3"]
    );
    let failed = StatusWire { state: "failed".into(), reason: Some("rank 1 is lost".into()), ..s };
    assert!(status(&failed).starts_with("state: failed (rank 1 is lost)\n"));
}

#[test]
fn tags_are_the_deployments_each_given_once() {
    assert!(check_tags(&strings(&["weights", "kv_cache"])).is_ok());
    assert!(check_tags(&strings(&["kv_cache"])).is_ok());
    for (bad, why) in [
        (strings(&["weights", "lora-1"]), "unknown tag `lora-1`: a deployment's memory is tagged"),
        (strings(&[""]), "is not a tag name"),
        (strings(&["kv cache"]), "is not a tag name"),
        (strings(&["a/b"]), "is not a tag name"),
        (strings(&["weights", "weights"]), "given twice"),
        (vec!["t".to_owned(); MAX_TAGS + 1], "at most 16"),
    ] {
        let e = check_tags(&bad).unwrap_err();
        assert!(e.contains(why), "{bad:?}: {e}");
    }
}

#[test]
fn empty_tags_mean_all_for_a_sleep_and_the_asleep_ones_for_a_wakeup() {
    let all: Vec<String> = ALL_TAGS.iter().map(|t| (*t).to_owned()).collect();
    let running = DeploymentState::Running;
    let sleeping = DeploymentState::Sleeping(strings(&["kv_cache"]));
    assert_eq!(expand_tags(Action::Sleep, &[], &running), all);
    assert_eq!(expand_tags(Action::Sleep, &[], &sleeping), all);
    assert_eq!(expand_tags(Action::Wakeup, &[], &sleeping), strings(&["kv_cache"]));
    assert_eq!(expand_tags(Action::Wakeup, &[], &running), all);
    assert_eq!(
        expand_tags(Action::Wakeup, &strings(&["weights"]), &sleeping),
        strings(&["weights"])
    );
}

/// vLLM's RL clients sleep everything, wake `weights` (to load new ones), then `kv_cache`:
/// the last wakeup of memory wakes what the runtime holds too, so the engine is awake after
/// it; while memory is still asleep, the runtime's tags stay asleep with it.
#[test]
fn waking_the_last_memory_tags_wakes_the_runtimes_with_them() {
    let all: Vec<String> = ALL_TAGS.iter().map(|t| (*t).to_owned()).collect();
    let asleep = DeploymentState::Sleeping(all.clone());
    assert_eq!(expand_tags(Action::Wakeup, &strings(&["weights"]), &asleep), strings(&["weights"]));
    let kv_left =
        DeploymentState::Sleeping(strings(&["kv_cache", "cuda_graph", "workspace", "nccl"]));
    assert_eq!(
        expand_tags(Action::Wakeup, &strings(&["kv_cache"]), &kv_left),
        strings(&["kv_cache", "cuda_graph", "workspace", "nccl"])
    );
    // SGLang names `cuda_graph` itself; the rest comes along.
    assert_eq!(
        expand_tags(Action::Wakeup, &strings(&["kv_cache", "cuda_graph"]), &kv_left),
        strings(&["kv_cache", "cuda_graph", "workspace", "nccl"])
    );
    // A sleep is as asked.
    assert_eq!(
        expand_tags(Action::Sleep, &strings(&["kv_cache"]), &kv_left),
        strings(&["kv_cache"])
    );
}

#[test]
fn deployment_names_make_short_socket_paths() {
    for good in ["chat", "tpctl-1234", "a.b_c-9"] {
        assert!(check_name(good).is_ok(), "{good}");
    }
    for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(65)] {
        assert!(check_name(bad).is_err(), "{bad}");
    }
    assert_eq!(
        socket_path(Path::new("/run/user/1/tpctl"), "chat").unwrap(),
        Path::new("/run/user/1/tpctl/chat.sock")
    );
    let deep = format!("/{}", "d".repeat(90));
    let e = socket_path(Path::new(&deep), &"n".repeat(20)).unwrap_err().to_string();
    assert!(e.contains("longer than the 107 bytes"), "{e}");
}

#[test]
fn a_request_line_defaults_everything_but_the_method_and_refuses_unknown_fields() {
    let r = Request::parse(r#"{"method":"sleep"}"#).unwrap();
    assert_eq!(r, Request::Sleep(SleepArgs::default()));
    let r = Request::parse(
        r#"{"method":"sleep","tags":["weights"],"level":2,"mode":"keep","verify":true}"#,
    )
    .unwrap();
    let Request::Sleep(r) = r else { panic!("not a sleep: {r:?}") };
    assert_eq!((r.level, r.mode, r.verify), (Some(2), QuiesceMode::Keep, true));
    let e = Request::parse(r#"{"method":"sleep","tag":["weights"]}"#).unwrap_err();
    assert!(e.contains("unknown field `tag`"), "{e}");
}

#[test]
fn every_request_reads_back_as_written_and_an_unknown_method_is_named() {
    for r in [
        Request::Sleep(SleepArgs { tags: vec!["kv_cache".into()], ..SleepArgs::default() }),
        Request::Wakeup(WakeupArgs { tags: Vec::new(), model: Some("m.gguf".into()) }),
        Request::UpdateWeights(UpdateArgs {
            model: "m.gguf".into(),
            mode: QuiesceMode::Abort,
            weight_version: Some("step-1".into()),
        }),
        Request::Pause(PauseArgs { mode: QuiesceMode::Keep }),
        Request::Resume,
        Request::Status,
        Request::Stop,
    ] {
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.starts_with(&format!(r#"{{"method":"{}""#, r.method())), "{line}");
        assert_eq!(Request::parse(&line).unwrap(), r);
    }
    assert_eq!(
        Request::parse(r#"{"method":"wake_up"}"#).unwrap(),
        Request::Wakeup(WakeupArgs::default())
    );
    // A pause without a mode aborts, as vLLM's does.
    assert_eq!(
        Request::parse(r#"{"method":"pause"}"#).unwrap(),
        Request::Pause(PauseArgs::default())
    );
    assert_eq!(PauseArgs::default().mode, QuiesceMode::Abort);
    let e = Request::parse(r#"{"method":"hibernate"}"#).unwrap_err();
    assert!(e.contains("unknown control method `hibernate`: expected sleep, wakeup"), "{e}");
}

#[test]
fn a_model_hosts_status_is_its_table_of_models() {
    let model = |name: &str, state: &str, level: Option<u8>| HostModelWire {
        name: name.into(),
        deployment: format!("h-{name}"),
        state: state.into(),
        sleep_level: level,
        resident_bytes: 3 << 20,
        checkpoint: format!("/m/{name}.gguf"),
        in_flight: 1,
        queued: 2,
        ..HostModelWire::default()
    };
    let mut failed = model("d", "failed", None);
    failed.failure = Some("its launcher exited with code 1".into());
    let h = HostWire {
        deployment: "h".into(),
        memory_budget_bytes: 1 << 30,
        resident_bytes: 12 << 20,
        models: vec![
            model("a", "awake", None),
            model("b", "asleep", Some(2)),
            model("c", "asleep", None),
            failed,
        ],
    };
    let text = super::render::host(&h);
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(text.lines().next(), Some("model host h: memory budget 1.0 GiB, 12.0 MiB resident"));
    assert_eq!(
        lines[1],
        ["model", "deployment", "state", "resident", "in", "flight", "queued", "checkpoint"]
    );
    assert_eq!(lines[2], ["a", "h-a", "awake", "3.0", "MiB", "1", "2", "/m/a.gguf"]);
    assert_eq!(lines[3][..4], ["b", "h-b", "asleep", "(level"]);
    assert!(text.contains("asleep (put to sleep outside the host)"), "{text}");
    assert!(text.ends_with("model d failed: its launcher exited with code 1\n"), "{text}");
    // A host's status travels as `host` in the reply, and a deployment refuses `restart`.
    let line = r#"{"method":"restart","deployment":"h-d"}"#;
    let request = Request::parse(line).unwrap();
    assert_eq!(request, Request::Restart(RestartArgs { deployment: "h-d".into() }));
}
