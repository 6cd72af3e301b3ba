//! NCCL all-reduce bandwidth on device buffers, one rank per GPU (threads of this process, each
//! with its own communicator joined through a store), 1 MiB to 256 MiB, with nccl-tests'
//! formulas: `algbw = bytes / time` and `busbw = algbw · 2(n-1)/n`. Each call is timed to its
//! completion (the communicator waits for the stream under its watchdog), so small messages
//! include one synchronization.
//!
//! Run by `cargo xtask gpu-test` (feature `cuda`). Needs two or more GPUs (NCCL puts one rank
//! per device); prints why and exits successfully with fewer.

use collectives::nccl::{self, NcclCommunicator};
use collectives::{ElemType, ReduceOp};
use mesh::{Store, StoreServer};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

const SIZES: [usize; 5] = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20];

fn main() {
    let gpus = match nccl::available().and_then(|()| nccl::device_count()) {
        Ok(n) => n,
        Err(e) => {
            println!("nccl all_reduce: skipped ({e})");
            return;
        }
    };
    if gpus < 2 {
        println!("nccl all_reduce: skipped (needs 2 GPUs, this machine has {gpus})");
        return;
    }
    let server = StoreServer::bind((Ipv4Addr::LOCALHOST, 0)).expect("a store");
    let addr = server.local_addr();
    println!(
        "{:<8} {:>5} {:<11} {:>10} {:>12} {:>12} {:>12}",
        "backend", "ranks", "op", "bytes", "time_us", "algbw_GBps", "busbw_GBps"
    );
    let rows: Vec<Vec<(usize, f64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..gpus)
            .map(|rank| {
                s.spawn(move || {
                    let timeout = Duration::from_secs(120);
                    let store = Store::connect(addr, timeout).expect("store");
                    let mut comm = NcclCommunicator::connect(
                        &store,
                        "bench/nccl",
                        "tp",
                        rank,
                        gpus,
                        rank,
                        timeout,
                    )
                    .expect("nccl communicator");
                    SIZES.iter().map(|&bytes| (bytes, time_all_reduce(&mut comm, bytes))).collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    // Every rank waits for the slowest; report the slowest rank's time per size.
    for (i, &bytes) in SIZES.iter().enumerate() {
        let t = rows.iter().map(|r| r[i].1).fold(0f64, f64::max);
        let algbw = bytes as f64 / t / 1e9;
        let busbw = algbw * 2.0 * (gpus as f64 - 1.0) / gpus as f64;
        println!(
            "{:<8} {:>5} {:<11} {:>10} {:>12.2} {:>12.3} {:>12.3}",
            "nccl",
            gpus,
            "all_reduce",
            bytes,
            t * 1e6,
            algbw,
            busbw
        );
    }
}

/// Seconds per in-place f32 all-reduce of `bytes` on the communicator's device.
fn time_all_reduce(comm: &mut NcclCommunicator, bytes: usize) -> f64 {
    let stream = comm.stream().clone();
    let mut buf = stream.alloc_zeros::<u8>(bytes).expect("device buffer");
    let iters = if bytes >= 64 << 20 { 10 } else { 50 };
    for _ in 0..3 {
        comm.all_reduce_device(&mut buf, ElemType::F32, ReduceOp::Sum).expect("warm-up");
    }
    let start = Instant::now();
    for _ in 0..iters {
        comm.all_reduce_device(&mut buf, ElemType::F32, ReduceOp::Sum).expect("all_reduce");
    }
    start.elapsed().as_secs_f64() / iters as f64
}
