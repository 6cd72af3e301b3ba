//! Collectives benchmark: latency and bandwidth of all_reduce, all_gather and broadcast on the
//! shm and tcp backends (and mpi, with the feature `mpi`), 2 and 4 ranks, 8 B to 16 MiB, with
//! nccl-tests' algbw/busbw formulas.
//!
//! Run through `cargo xtask bench collectives`, which also measures OpenMPI in the same run.
//! Without `RANK` (or OpenMPI's rank) in the environment this program is the launcher: it
//! starts the ranks (copies of itself; under `mpirun` for mpi) for each configuration and
//! prints one JSON object per measurement, or a table.

use collectives::{init_parallel, Collective, Communicator, InitOptions, ReduceOp};
use mesh::{AxisBackends, CommBackend};
use std::time::{Duration, Instant};

/// Message sizes in bytes (the OpenMPI anchor uses the same ones).
const SIZES: [usize; 7] = [8, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];
const OPS: [&str; 3] = ["all_reduce", "all_gather", "broadcast"];

fn main() {
    if std::env::var_os("RANK").is_some() || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some() {
        rank_main();
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let backends: Vec<String> = match args.iter().position(|a| a == "--backends") {
        Some(i) => args[i + 1].split(',').map(str::to_owned).collect(),
        None if cfg!(feature = "mpi") => vec!["shm".into(), "tcp".into(), "mpi".into()],
        None => vec!["shm".into(), "tcp".into()],
    };
    if !json {
        println!(
            "{:<8} {:>5} {:<11} {:>10} {:>12} {:>12} {:>12}",
            "backend", "ranks", "op", "bytes", "time_us", "algbw_GBps", "busbw_GBps"
        );
    }
    for backend in &backends {
        for world in [2usize, 4] {
            for line in launch(backend, world) {
                if json {
                    println!("{line}");
                } else {
                    print_row(&line);
                }
            }
        }
    }
}

fn print_row(json: &str) {
    // The rows are flat JSON written below; pick fields by name.
    let field = |k: &str| -> String {
        let key = format!("\"{k}\":");
        let start = json.find(&key).map(|i| i + key.len()).unwrap_or(0);
        let rest = &json[start..];
        let end = rest.find([',', '}']).unwrap_or(rest.len());
        rest[..end].trim_matches('"').to_owned()
    };
    println!(
        "{:<8} {:>5} {:<11} {:>10} {:>12} {:>12} {:>12}",
        field("backend"),
        field("ranks"),
        field("op"),
        field("bytes"),
        field("time_us"),
        field("algbw_GBps"),
        field("busbw_GBps")
    );
}

/// Starts `world` ranks on `backend` (the tests' launcher, with its port retry) and returns
/// rank 0's result lines.
fn launch(backend: &str, world: usize) -> Vec<String> {
    if backend == "mpi" {
        return launch_mpirun(world, Duration::from_secs(30 * 60));
    }
    let env = [("TPCTL_BENCH_BACKEND", backend.to_owned())];
    tpctl_tests::launch_self(backend, world, &env, Duration::from_secs(30 * 60))
}

/// Starts `world` ranks of this program under `mpirun` (one host) and returns rank 0's result
/// lines; kills the job past `deadline`.
fn launch_mpirun(world: usize, deadline: Duration) -> Vec<String> {
    use std::process::{Command, Stdio};
    let port = tpctl_tests::free_port();
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-n", &world.to_string()])
        .arg(std::env::current_exe().expect("this program's path"))
        .env("TPCTL_BENCH_BACKEND", "mpi")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("mpirun could not start: `cargo xtask install-mpi` installs OpenMPI");
    let until = Instant::now() + deadline;
    while child.try_wait().expect("mpirun's status").is_none() {
        if Instant::now() > until {
            let _ = child.kill();
            panic!("mpirun with {world} ranks ran past {deadline:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("mpirun's output");
    assert!(out.status.success(), "mpirun with {world} ranks failed: {}", out.status);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(str::to_owned)
        .collect()
}

fn iterations(bytes: usize) -> usize {
    match bytes {
        0..=16_384 => 2000,
        16_385..=262_144 => 200,
        _ => 20,
    }
}

fn rank_main() {
    let backend: CommBackend = std::env::var("TPCTL_BENCH_BACKEND")
        .unwrap_or_else(|_| "shm".into())
        .parse()
        .expect("backend");
    let world = mesh::Rendezvous::from_env().expect("the launcher's variables").world_size;
    let opts = InitOptions {
        tp: Some(world),
        head_groups: world,
        backends: AxisBackends { tp: backend, cp: backend, control: backend },
        timeout: Duration::from_secs(120),
        ..InitOptions::default()
    };
    let mut ctx = init_parallel(&opts).expect("init_parallel");
    let n = ctx.tp.size();
    for op in OPS {
        for bytes in SIZES {
            let floats = (bytes / 4).max(1);
            let iters = iterations(bytes);
            let mut buf = vec![1f32; floats];
            let mut gathered = vec![0f32; floats * n];
            let per_rank = (floats / n).max(1);
            let comm = &mut ctx.tp;
            let mut once = |comm: &mut Box<dyn Communicator>| match op {
                "all_reduce" => comm.all_reduce(&mut buf, ReduceOp::Sum),
                // all_gather moves `bytes` in total: each rank contributes bytes / n.
                "all_gather" => comm.all_gather(&buf[..per_rank], &mut gathered[..per_rank * n]),
                _ => comm.broadcast(&mut buf, 0),
            };
            for _ in 0..5 {
                once(comm).expect("warm-up");
            }
            comm.barrier().expect("barrier");
            let start = Instant::now();
            for _ in 0..iters {
                once(comm).expect("collective");
            }
            let t = start.elapsed().as_secs_f64() / iters as f64;
            let moved = match op {
                "all_gather" => per_rank * n * 4,
                _ => floats * 4,
            } as f64;
            let algbw = moved / t / 1e9;
            let factor = match op {
                "all_reduce" => 2.0 * (n as f64 - 1.0) / n as f64,
                "all_gather" => (n as f64 - 1.0) / n as f64,
                _ => 1.0,
            };
            if ctx.rank() == 0 {
                println!(
                    "{{\"backend\":\"{backend}\",\"ranks\":{n},\"op\":\"{op}\",\"bytes\":{},\"time_us\":{:.2},\"algbw_GBps\":{:.3},\"busbw_GBps\":{:.3}}}",
                    moved as usize,
                    t * 1e6,
                    algbw,
                    algbw * factor
                );
            }
        }
    }
    ctx.shutdown(Duration::from_secs(60)).expect("shutdown");
}
