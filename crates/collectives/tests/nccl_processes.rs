//! NCCL between real rank processes: this test binary re-runs itself as two ranks (torchrun
//! variables, `LOCAL_RANK` picking the GPU), each building its context with `init_parallel`
//! (TP over NCCL, control over shared memory) and checking every operation against its serial
//! definition. Needs two CUDA devices; skips with a note otherwise, and fails on a machine
//! without a usable GPU only when `TPCTL_REQUIRE_GPU=1`.

use collectives::{init_parallel, Collective, Error, InitOptions, ReduceOp};
use mesh::{AxisBackends, CommBackend, Device};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD: &str = "TPCTL_NCCL_TEST_CHILD";

fn value(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i * 3) % 23) as f32 - 11.0
}

#[test]
fn nccl_two_processes_match_serial() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let count = match collectives::nccl::device_count() {
        Ok(n) => n,
        Err(e) => {
            assert!(!require, "TPCTL_REQUIRE_GPU=1 but NCCL is unusable: {e}");
            eprintln!("note: nccl_two_processes_match_serial skipped: {e}");
            return;
        }
    };
    if count < 2 {
        assert!(count > 0 || !require, "TPCTL_REQUIRE_GPU=1 but no CUDA device is visible");
        eprintln!(
            "note: nccl_two_processes_match_serial skipped: needs 2 CUDA devices, has {count}"
        );
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", "nccl_process_rank", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("a rank was still running after 180 s; both killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains(&format!("nccl rank {rank} ok")),
            "rank {rank} failed ({:?}):\n{stdout}\n{stderr}",
            out.status
        );
    }
}

/// One rank of `nccl_two_processes_match_serial`; does nothing unless started by it.
#[test]
fn nccl_process_rank() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    let opts = InitOptions {
        tp: Some(2),
        head_groups: 2,
        backends: AxisBackends {
            tp: CommBackend::Nccl,
            cp: CommBackend::Shm,
            control: CommBackend::Shm,
        },
        device: Device::Cuda(rank),
        timeout: Duration::from_secs(60),
        shm: None,
    };
    let mut ctx = init_parallel(&opts).expect("init_parallel");
    assert_eq!(ctx.tp.backend(), "nccl");
    assert_eq!(ctx.control.backend(), "shm");
    let n = 2;
    for len in [0usize, 1, 1000, 100_000] {
        let xs: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let want: Vec<f32> = (0..len)
                .map(|i| {
                    let (a, b) = (value(0, i), value(1, i));
                    match op {
                        ReduceOp::Sum => a + b,
                        ReduceOp::Max => a.max(b),
                        ReduceOp::Min => a.min(b),
                    }
                })
                .collect();
            let mut got = xs.clone();
            ctx.tp.all_reduce(&mut got, op).unwrap();
            assert_eq!(got, want, "all_reduce {op:?} len {len}");
            // The control group (shared memory) agrees, in the same context.
            let mut got = xs.clone();
            ctx.control.all_reduce(&mut got, op).unwrap();
            assert_eq!(got, want, "control all_reduce {op:?} len {len}");
        }
        let sizes = [len, len + 3];
        let mine: Vec<f32> = (0..sizes[rank]).map(|i| value(rank, i)).collect();
        let mut all = vec![0f32; sizes[0] + sizes[1]];
        ctx.tp.all_gather_uneven(&mine, &mut all, &sizes).unwrap();
        let want: Vec<f32> = (0..n).flat_map(|q| (0..sizes[q]).map(move |i| value(q, i))).collect();
        assert_eq!(all, want, "all_gather_uneven len {len}");
        let big: Vec<f32> = (0..n * len).map(|i| value(rank, i)).collect();
        let mut part = vec![0f32; len];
        ctx.tp.reduce_scatter(&big, &mut part, ReduceOp::Sum).unwrap();
        let want: Vec<f32> =
            (0..len).map(|i| value(0, rank * len + i) + value(1, rank * len + i)).collect();
        assert_eq!(part, want, "reduce_scatter len {len}");
        let mut a2a = vec![0f32; n * len];
        ctx.tp.all_to_all(&big, &mut a2a).unwrap();
        let want: Vec<f32> =
            (0..n).flat_map(|s| (0..len).map(move |i| value(s, rank * len + i))).collect();
        assert_eq!(a2a, want, "all_to_all len {len}");
        let mut b = if rank == 1 { xs.clone() } else { vec![0f32; len] };
        ctx.tp.broadcast(&mut b, 1).unwrap();
        assert_eq!(b, (0..len).map(|i| value(1, i)).collect::<Vec<_>>(), "broadcast");
        let mut got = vec![0f32; len];
        if rank == 0 {
            ctx.tp.send(&xs, 1).unwrap();
            ctx.tp.recv(&mut got, 1).unwrap();
        } else {
            ctx.tp.recv(&mut got, 0).unwrap();
            ctx.tp.send(&xs, 0).unwrap();
        }
        assert_eq!(got, (0..len).map(|i| value(1 - rank, i)).collect::<Vec<_>>(), "send/recv");
        ctx.tp.barrier().unwrap();
    }
    // A rank that fails tells its peer, which stops waiting long before its deadline.
    ctx.control.barrier().unwrap();
    if rank == 1 {
        std::thread::sleep(Duration::from_millis(300));
        ctx.tp.fail("injected failure");
    } else {
        let start = Instant::now();
        let err = ctx.tp.all_reduce(&mut [1f32; 4], ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, Error::PeerFailed { peer: 1, .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    }
    ctx.control.barrier().unwrap();
    ctx.shutdown(Duration::from_secs(30)).unwrap();
    println!("nccl rank {rank} ok");
}
