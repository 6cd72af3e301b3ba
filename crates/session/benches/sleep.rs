//! Sleep/wakeup benchmark: latency of the multi-rank control protocol alone (no tagged
//! memory) and with `TPCTL_SLEEP_BENCH_MIB` MiB (default 256) of tagged memory per rank
//! (backup to a spill file), for 1, 2, 4 and 8 rank processes, with a memcpy of the same bytes
//! measured in the same run as the reference for wakeup time per GiB.
//!
//! Run through `cargo xtask bench sleep`. Without `RANK` in the environment this program is
//! the launcher: it starts the ranks (copies of itself) for each configuration and prints one
//! JSON object per configuration.

use session::sleep::transport::{tcp, CoordinatorLink, Incoming};
use session::sleep::{
    listener, ControlPlane, Coordinator, CoordinatorOptions, Idle, Message, NoMemory, OpOptions,
    Phase, RankMemory, VmmMemory,
};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(120);

fn main() {
    if std::env::var_os("RANK").is_some() {
        rank_main();
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let worlds: Vec<usize> = match args.iter().position(|a| a == "--ranks") {
        Some(i) => args[i + 1].split(',').map(|s| s.parse().expect("a rank count")).collect(),
        None => vec![1, 2, 4, 8],
    };
    for mode in ["control", "memory"] {
        for &world in &worlds {
            for line in launch(mode, world) {
                println!("{line}");
            }
        }
    }
}

/// Starts `world` ranks and returns rank 0's result lines.
fn launch(mode: &str, world: usize) -> Vec<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let exe = std::env::current_exe().expect("own path");
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("TPCTL_SLEEP_BENCH_MODE", mode)
                .stdout(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    let mut lines = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().expect("rank output");
        assert!(out.status.success(), "rank {rank} of {mode} x{world} failed: {}", out.status);
        if rank == 0 {
            lines.extend(String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned));
        }
    }
    lines
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median time of one status round trip to every peer in turn (serially).
fn sequential_sweep(link: &tcp::TcpCoordinator) -> f64 {
    let peers = link.peers();
    if peers.is_empty() {
        return 0.0;
    }
    let msg = Message::request(0, Phase::Status, None, &[]);
    let mut v = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        for &p in &peers {
            link.send(p, &msg).expect("send");
            loop {
                match link.recv(Instant::now() + TIMEOUT) {
                    Some(Incoming::Frame { rank, msg })
                        if rank == p && msg.answers(0, Phase::Status) =>
                    {
                        break
                    }
                    Some(Incoming::Frame { .. }) => {}
                    other => panic!("no status ack from rank {p}: {other:?}"),
                }
            }
        }
        v.push(t.elapsed().as_secs_f64());
    }
    median(v)
}

fn rank_main() {
    let mode = std::env::var("TPCTL_SLEEP_BENCH_MODE").unwrap_or_else(|_| "control".into());
    let mib: usize =
        std::env::var("TPCTL_SLEEP_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    let rv = mesh::Rendezvous::from_env().expect("rendezvous");
    let (_server, store) = mesh::rendezvous_store(&rv, TIMEOUT).expect("store");
    let spill = std::env::temp_dir().join(format!("tpctl-sleep-bench-{}", std::process::id()));
    let manager = Arc::new(vmm::Manager::builder().spill_dir(&spill).build().expect("manager"));
    let mut keep = Vec::new();
    let memory: Arc<dyn RankMemory> = if mode == "memory" {
        let a = manager
            .allocate(vmm::Tag::WEIGHTS, mib << 20, vmm::Policy::Backup(vmm::Store::Spill))
            .expect("allocate");
        a.write().expect("write").fill(1);
        keep.push(a);
        Arc::new(VmmMemory::new(manager.clone(), None))
    } else {
        Arc::new(NoMemory)
    };
    let endpoint = tcp::connect(&store, rv.rank, rv.world_size, "127.0.0.1", TIMEOUT)
        .expect("control channel");
    let plane = match endpoint {
        tcp::Endpoint::Coordinator(link) => {
            // The reference a serial fan-out would cost: one peer at a time, each round trip
            // waited for before the next request goes out.
            let seq = sequential_sweep(&link);
            let c = Coordinator::new(link, memory, Arc::new(Idle), CoordinatorOptions::default());
            (ControlPlane::Coordinator(c), seq)
        }
        tcp::Endpoint::Peer(link) => (
            ControlPlane::Listener(
                listener::spawn(rv.rank, link, memory, Arc::new(Idle)).expect("listener"),
            ),
            0.0,
        ),
    };
    match plane {
        (ControlPlane::Coordinator(c), seq_sweep) => {
            let tags = vec!["weights".to_string()];
            let iters = if mode == "memory" { 5 } else { 300 };
            let (mut sleeps, mut wakeups, mut rank0_wakeups) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..iters + 3 {
                let t = Instant::now();
                c.sleep(&tags, OpOptions::default()).expect("sleep");
                let s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let r = c.wakeup(&tags, OpOptions::default()).expect("wakeup");
                let w = t.elapsed().as_secs_f64();
                if i >= 3 {
                    sleeps.push(s);
                    wakeups.push(w);
                    rank0_wakeups.push(r.ranks[0].elapsed_us as f64 / 1e6);
                }
            }
            let gib = mib as f64 / 1024.0;
            let memcpy_s = if mode == "memory" {
                let src = vec![1u8; mib << 20];
                let mut dst = vec![0u8; mib << 20];
                let mut v = Vec::new();
                for _ in 0..5 {
                    let t = Instant::now();
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&dst);
                    v.push(t.elapsed().as_secs_f64());
                }
                median(v)
            } else {
                0.0
            };
            let fanout = median(
                (0..if mode == "memory" { 20 } else { 300 })
                    .map(|_| {
                        let t = Instant::now();
                        c.status().expect("status");
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            );
            let (s, w, w0) = (median(sleeps), median(wakeups), median(rank0_wakeups));
            let mib_out = if mode == "memory" { mib } else { 0 };
            let per_gib = |x: f64| if mode == "memory" { x / gib } else { 0.0 };
            println!(
                "{{\"mode\":\"{mode}\",\"ranks\":{},\"mib_per_rank\":{mib_out},\"status_fanout_us\":{:.1},\"status_serial_us\":{:.1},\"sleep_us\":{:.1},\"wakeup_us\":{:.1},\"wakeup_s_per_gib\":{:.4},\"rank0_wakeup_s_per_gib\":{:.4},\"memcpy_s_per_gib\":{:.4}}}",
                rv.world_size,
                fanout * 1e6,
                seq_sweep * 1e6,
                s * 1e6,
                w * 1e6,
                per_gib(w),
                per_gib(w0),
                per_gib(memcpy_s)
            );
            c.shutdown().expect("shutdown");
        }
        (ControlPlane::Listener(mut h), _) => {
            h.join(Duration::from_secs(600)).expect("listener");
        }
    }
    drop(keep);
    std::fs::remove_dir_all(&spill).ok();
}
