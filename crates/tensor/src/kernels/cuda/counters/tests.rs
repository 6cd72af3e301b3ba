//! The counters' arithmetic, and a scan of the CUDA backend's sources that every call which
//! queues work, allocates, copies or waits is counted beside it (the backend itself runs only
//! on a GPU).

use super::*;

#[test]
fn each_kind_is_counted_apart() {
    let live = DeviceCounters::default();
    assert_eq!(live.snapshot(), Counters::default());
    let kinds = [
        (Count::Launch, 7),
        (Count::DeviceCopy, 1),
        (Count::Allocation, 5),
        (Count::Upload, 3),
        (Count::Download, 2),
        (Count::HostWait, 4),
        (Count::GraphLaunch, 6),
    ];
    for (kind, n) in kinds {
        for _ in 0..n {
            live.add(kind);
        }
    }
    let want = Counters {
        launches: 7,
        device_copies: 1,
        allocations: 5,
        uploads: 3,
        downloads: 2,
        host_waits: 4,
        graph_launches: 6,
    };
    assert_eq!(live.snapshot(), want);
}

#[test]
fn a_delta_is_what_was_counted_between_two_snapshots() {
    let live = DeviceCounters::default();
    live.add(Count::Launch);
    live.add(Count::Upload);
    let before = live.snapshot();
    for _ in 0..3 {
        live.add(Count::Launch);
        live.add(Count::Allocation);
    }
    live.add(Count::Download);
    live.add(Count::HostWait);
    let after = live.snapshot();
    let step = after.since(&before);
    assert_eq!(
        step,
        Counters {
            launches: 3,
            allocations: 3,
            downloads: 1,
            host_waits: 1,
            ..Counters::default()
        }
    );
    assert_eq!(after.since(&after), Counters::default());
    assert_eq!(after.since(&Counters::default()), after);
    // Snapshots in the wrong order read 0, not a wrapped count.
    assert_eq!(before.since(&after), Counters::default());
}

#[test]
fn counts_from_many_threads_add_up() {
    let live = DeviceCounters::default();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..1000 {
                    live.add(Count::Launch);
                    live.add(Count::HostWait);
                }
            });
        }
    });
    let got = live.snapshot();
    assert_eq!((got.launches, got.host_waits, got.uploads), (4000, 4000, 0));
}

#[test]
fn counts_read_as_totals_and_means_per_step() {
    let run = Counters {
        launches: 2880,
        device_copies: 4,
        allocations: 2084,
        uploads: 18,
        downloads: 8,
        host_waits: 9,
        graph_launches: 0,
    };
    assert_eq!(
        run.to_string(),
        "2880 launches, 4 device copies, 2084 allocations, 18 uploads, 8 downloads, 9 host \
         waits, 0 graph launches"
    );
    let per = run.per_step(4);
    assert_eq!(per.mean(run.launches), 720.0);
    assert_eq!(per.mean(run.host_waits), 2.25);
    assert_eq!(
        per.to_string(),
        "per step (4 steps): 720.0 launches, 1.0 device copies, 521.0 allocations, 4.5 uploads, \
         2.0 downloads, 2.2 host waits, 0.0 graph launches"
    );
    assert_eq!(run.per_step(0).mean(run.launches), 0.0);
}

/// What each driver call of the backend is counted as: the text that names the call in the
/// sources, and the counts it must have in the same function.
const CALLS: &[(&str, &[&str])] = &[
    ("launch_kernel(", &["Launch"]),
    ("0.launch()", &["GraphLaunch"]),
    ("graph.launch()", &["GraphLaunch"]),
    ("result::sgemm(", &["Launch"]),
    ("result::gemm_ex(", &["Launch"]),
    ("all_reduce_device_enqueue(", &["Launch", "HostWait"]),
    ("memcpy_dtod_async(", &["DeviceCopy"]),
    ("memset_d8_async(", &["DeviceCopy"]),
    ("clone_dtod(", &["DeviceCopy", "Allocation"]),
    ("alloc_zeros", &["Allocation", "DeviceCopy"]),
    (".alloc::<", &["Allocation"]),
    ("alloc_pinned", &["Allocation"]),
    ("clone_htod(", &["Upload", "Allocation"]),
    ("memcpy_htod", &["Upload"]),
    ("memcpy_dtoh", &["Download"]),
    (".synchronize()", &["HostWait"]),
    ("try_is_complete(", &["HostWait"]),
    ("wait_device()", &["HostWait"]),
];

/// The functions of `source`: each line that starts one, with the lines up to the next
/// (comment lines left out, so a SAFETY note that names a call does not count as one).
fn functions(source: &str) -> Vec<(String, Vec<&str>)> {
    let mut out: Vec<(String, Vec<&str>)> = Vec::new();
    for line in source.lines() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let head = code
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub ")
            .trim_start_matches("unsafe ");
        if head.starts_with("fn ") {
            out.push((head.to_owned(), Vec::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push(line);
        }
    }
    out
}

#[test]
fn every_driver_call_in_the_backend_is_counted() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels/cuda/device");
    let mut found = 0;
    let mut uncounted = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let source = std::fs::read_to_string(&path).unwrap();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        for (head, body) in functions(&source) {
            let text = body.join("\n");
            for (call, kinds) in CALLS {
                if !text.contains(call) {
                    continue;
                }
                found += 1;
                for kind in *kinds {
                    if !text.contains(&format!("Count::{kind})")) {
                        uncounted
                            .push(format!("{file}: `{head}` calls {call} without Count::{kind}"));
                    }
                }
            }
        }
    }
    // The scan finds the backend's calls at all (launches, copies, allocations, waits).
    assert!(found >= 25, "only {found} driver calls found under {}", dir.display());
    assert!(uncounted.is_empty(), "uncounted driver calls:\n{}", uncounted.join("\n"));
}
