//! NCCL backend tests. Without a usable GPU (every CI machine) the entry points must fail
//! cleanly; the GPU tests skip there with a note, unless `TPCTL_REQUIRE_GPU=1`, when they fail.
//! Two-rank tests need two CUDA devices (NCCL refuses two ranks of one communicator on one
//! device) and say so when they skip.

use crate::nccl::{self, NcclCommunicator, NcclId, ID_BYTES};
use crate::{local, Collective, Communicator, Error, ReduceOp, ShmOptions};
use half::{bf16, f16};
use mesh::{Store, StoreServer};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

fn require_gpu() -> bool {
    std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The number of CUDA devices NCCL can use here, or `None` (after a note) when the test should
/// skip. Fails when `TPCTL_REQUIRE_GPU=1` and there is none, or fewer than `need` when `strict`.
fn gpus(test: &str, need: usize) -> Option<usize> {
    let count = match nccl::available().and_then(|()| nccl::device_count()) {
        Ok(n) => n,
        Err(e) => {
            assert!(!require_gpu(), "TPCTL_REQUIRE_GPU=1 but NCCL is unusable: {e}");
            eprintln!("note: {test} skipped: {e}");
            return None;
        }
    };
    assert!(count > 0 || !require_gpu(), "TPCTL_REQUIRE_GPU=1 but no CUDA device is visible");
    if count < need {
        eprintln!("note: {test} skipped: needs {need} CUDA devices, this machine has {count}");
        return None;
    }
    Some(count)
}

#[test]
fn nccl_entry_points_fail_cleanly_without_a_gpu() {
    let Err(unusable) = nccl::available() else {
        return; // A GPU machine: the GPU tests cover it.
    };
    assert!(!require_gpu(), "TPCTL_REQUIRE_GPU=1 but NCCL is unusable: {unusable}");
    let expected =
        if cfg!(feature = "cuda") { "nccl backend unavailable" } else { "--features cuda" };
    let check = |what: &str, e: Error| {
        let kind_ok = if cfg!(feature = "cuda") {
            matches!(e, Error::BackendUnavailable { backend: "nccl", .. })
        } else {
            matches!(e, Error::NotCompiledWith { feature: "cuda" })
        };
        assert!(kind_ok && e.to_string().contains(expected), "{what}: {e:?}");
    };
    check("available", unusable);
    check("NcclId::new", NcclId::new().unwrap_err());
    check("device_count", nccl::device_count().unwrap_err());
    check("version", nccl::version().unwrap_err());
    let id = NcclId::from_bytes(&[7; ID_BYTES]).unwrap();
    check(
        "from_id",
        NcclCommunicator::from_id(&id, "tp", 0, 2, 0, Duration::from_secs(1)).unwrap_err(),
    );

    // Both sides of the store set-up fail at once, not at the deadline.
    let server = StoreServer::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let store = Store::connect(server.local_addr(), Duration::from_secs(5)).unwrap();
    let start = Instant::now();
    for rank in [1, 0] {
        let err = NcclCommunicator::connect(
            &store,
            "t/g0/tp",
            "tp",
            rank,
            2,
            rank,
            Duration::from_secs(30),
        )
        .unwrap_err();
        check("connect", err);
    }
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
}

#[test]
fn nccl_id_round_trips_through_bytes() {
    let bytes: Vec<u8> = (0..ID_BYTES).map(|i| i as u8).collect();
    let id = NcclId::from_bytes(&bytes).unwrap();
    assert_eq!(id.as_bytes().as_slice(), bytes.as_slice());
    assert!(NcclId::from_bytes(&bytes[1..]).is_none());
    assert!(format!("{id:?}").starts_with("NcclId("));
}

#[test]
fn nccl_communicator_is_send() {
    fn send<T: Send>() {}
    send::<NcclCommunicator>();
}

fn value(rank: usize, i: usize) -> f32 {
    // Small integers: sums are exact in any order and in every dtype.
    ((rank * 7 + i * 3) % 23) as f32 - 11.0
}

/// Runs `f` on every rank of an NCCL group of `size` (rank `r` on device `r`) and on a local
/// (shared-memory) group, each rank on its own thread; returns (nccl, local) results.
fn both<R: Send + PartialEq + std::fmt::Debug>(
    size: usize,
    f: impl Fn(&mut dyn Communicator) -> R + Sync,
) -> (Vec<R>, Vec<R>) {
    let id = NcclId::new().expect("nccl id");
    let f = &f;
    let gpu: Vec<R> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|r| {
                s.spawn(move || {
                    let mut c =
                        NcclCommunicator::from_id(&id, "test", r, size, r, Duration::from_secs(60))
                            .expect("nccl communicator");
                    f(&mut c)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let comms = local::group(size, "test", ShmOptions::for_group(size)).expect("local group");
    let cpu: Vec<R> = std::thread::scope(|s| {
        let handles: Vec<_> = comms.into_iter().map(|mut c| s.spawn(move || f(&mut c))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    (gpu, cpu)
}

/// Every operation, every dtype, with sizes that make the uneven gather pad; the outputs of
/// all ranks, concatenated as bytes.
fn every_op(c: &mut dyn Communicator) -> Vec<Vec<u8>> {
    let (r, n) = (c.rank(), c.size());
    let mut out = Vec::new();
    for len in [0usize, 1, 7, 1000, 70_000] {
        let xs: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let mut b = xs.clone();
            c.all_reduce(&mut b, op).unwrap();
            out.push(bytemuck::cast_slice(&b).to_vec());
            let mut h: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
            c.all_reduce(&mut h, op).unwrap();
            out.push(bytemuck::cast_slice(&h).to_vec());
            let mut bf: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
            c.all_reduce(&mut bf, op).unwrap();
            out.push(bytemuck::cast_slice(&bf).to_vec());
            let mut i: Vec<i64> = xs.iter().map(|&x| x as i64 * 1_000_000_007).collect();
            c.all_reduce(&mut i, op).unwrap();
            out.push(bytemuck::cast_slice(&i).to_vec());
            let mut u: Vec<u8> = xs.iter().map(|&x| (x as i32 + 11) as u8).collect();
            c.all_reduce(&mut u, op).unwrap();
            out.push(u);
        }
        // Uneven: rank q has len + 3q elements.
        let sizes: Vec<usize> = (0..n).map(|q| len + 3 * q).collect();
        let mine: Vec<f32> = (0..sizes[r]).map(|i| value(r, i)).collect();
        let mut all = vec![0f32; sizes.iter().sum()];
        c.all_gather_uneven(&mine, &mut all, &sizes).unwrap();
        out.push(bytemuck::cast_slice(&all).to_vec());
        let mut eq = vec![0f32; n * len];
        c.all_gather(&xs, &mut eq).unwrap();
        out.push(bytemuck::cast_slice(&eq).to_vec());
        let big: Vec<f32> = (0..n * len).map(|i| value(r, i)).collect();
        let mut part = vec![0f32; len];
        c.reduce_scatter(&big, &mut part, ReduceOp::Sum).unwrap();
        out.push(bytemuck::cast_slice(&part).to_vec());
        let mut a2a = vec![0f32; n * len];
        c.all_to_all(&big, &mut a2a).unwrap();
        out.push(bytemuck::cast_slice(&a2a).to_vec());
        for root in 0..n {
            let mut b = if r == root { xs.clone() } else { vec![0f32; len] };
            c.broadcast(&mut b, root).unwrap();
            out.push(bytemuck::cast_slice(&b).to_vec());
        }
        if n > 1 {
            // A ring: send to the next rank, receive from the previous; even ranks send first.
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let mut got = vec![0f32; len];
            if r % 2 == 0 {
                c.send(&xs, next).unwrap();
                c.recv(&mut got, prev).unwrap();
            } else {
                c.recv(&mut got, prev).unwrap();
                c.send(&xs, next).unwrap();
            }
            out.push(bytemuck::cast_slice(&got).to_vec());
        }
        c.barrier().unwrap();
    }
    out
}

#[test]
fn nccl_one_rank_matches_the_local_backend() {
    if gpus("nccl_one_rank_matches_the_local_backend", 1).is_none() {
        return;
    }
    let (gpu, cpu) = both(1, every_op);
    assert_eq!(gpu, cpu);
}

#[test]
fn nccl_two_ranks_match_the_local_backend() {
    if gpus("nccl_two_ranks_match_the_local_backend", 2).is_none() {
        return;
    }
    let (gpu, cpu) = both(2, every_op);
    for r in 0..2 {
        assert_eq!(gpu[r].len(), cpu[r].len());
        for (k, (g, c)) in gpu[r].iter().zip(&cpu[r]).enumerate() {
            assert_eq!(g, c, "rank {r} output {k}");
        }
    }
}

#[test]
fn nccl_bad_arguments_fail_here_and_poison() {
    if gpus("nccl_bad_arguments_fail_here_and_poison", 1).is_none() {
        return;
    }
    let id = NcclId::new().unwrap();
    let mut c =
        NcclCommunicator::from_id(&id, "tp[cp=0]", 0, 1, 0, Duration::from_secs(30)).unwrap();
    let err = c.all_gather(&[1f32, 2.0], &mut [0f32; 3]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("all_gather on tp[cp=0] group (rank 0 of 1): receive buffer has 12 bytes"),
        "{err}"
    );
    let err = c.barrier().unwrap_err();
    assert!(matches!(err, Error::Poisoned { .. }), "{err}");
}

#[cfg(feature = "cuda")]
#[test]
fn nccl_device_entry_points_work_on_one_rank() {
    if gpus("nccl_device_entry_points_work_on_one_rank", 1).is_none() {
        return;
    }
    let id = NcclId::new().unwrap();
    let mut c = NcclCommunicator::from_id(&id, "tp", 0, 1, 0, Duration::from_secs(30)).unwrap();
    let stream = c.stream().clone();
    let host: Vec<u8> = (0..64u8).collect();
    let mut buf = stream.clone_htod(&host).unwrap();
    c.all_reduce_device(&mut buf, crate::ElemType::F32, ReduceOp::Sum).unwrap();
    let mut gathered = stream.alloc_zeros::<u8>(64).unwrap();
    c.all_gather_device(&buf, &mut gathered, crate::ElemType::F32).unwrap();
    c.broadcast_device(&mut gathered, crate::ElemType::U8, 0).unwrap();
    let mut part = stream.alloc_zeros::<u8>(64).unwrap();
    c.reduce_scatter_device(&gathered, &mut part, crate::ElemType::F32, ReduceOp::Max).unwrap();
    assert_eq!(stream.clone_dtoh(&part).unwrap(), host);
    let err = c.all_reduce_device(&mut part.slice_mut(0..3), crate::ElemType::F32, ReduceOp::Sum);
    assert!(err.unwrap_err().to_string().contains("not a whole number of f32"));
}

#[test]
fn nccl_setup_times_out_when_a_peer_never_joins() {
    if gpus("nccl_setup_times_out_when_a_peer_never_joins", 1).is_none() {
        return;
    }
    let id = NcclId::new().unwrap();
    let start = Instant::now();
    let err =
        NcclCommunicator::from_id(&id, "tp[cp=0]", 0, 2, 0, Duration::from_secs(3)).unwrap_err();
    let elapsed = start.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        err.to_string().starts_with("setup on tp[cp=0] group (rank 0 of 2): timed out"),
        "{err}"
    );
    assert!(elapsed < Duration::from_secs(20), "the watchdog took {elapsed:?}");
}

/// Two ranks joined through a store, on devices 0 and 1.
fn pair(timeout: Duration) -> (NcclCommunicator, NcclCommunicator, StoreServer) {
    let server = StoreServer::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = server.local_addr();
    let mut comms = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|r| {
                s.spawn(move || {
                    let store = Store::connect(addr, Duration::from_secs(10)).unwrap();
                    NcclCommunicator::connect(&store, "t/g0/tp", "tp", r, 2, r, timeout).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    let b = comms.pop().unwrap();
    let a = comms.pop().unwrap();
    (a, b, server)
}

#[test]
fn nccl_watchdog_times_out_a_missing_peer_and_abort_unblocks() {
    if gpus("nccl_watchdog_times_out_a_missing_peer_and_abort_unblocks", 2).is_none() {
        return;
    }
    let (mut a, _b, _server) = pair(Duration::from_secs(2));
    let start = Instant::now();
    let err = a.recv(&mut [0f32; 16], 1).unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("recv on tp group (rank 0 of 2): timed out"), "{err}");
    assert_eq!(err.peer(), Some(1));
    assert!(start.elapsed() < Duration::from_secs(15));
    assert!(matches!(a.barrier().unwrap_err(), Error::Poisoned { .. }));

    let (mut a, _b, _server) = pair(Duration::from_secs(60));
    let handle = a.abort_handle();
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        handle.abort();
    });
    let start = Instant::now();
    let err = a.all_reduce(&mut [1f32; 8], ReduceOp::Sum).unwrap_err();
    aborter.join().unwrap();
    assert!(matches!(err, Error::Aborted { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn nccl_fail_tells_the_peers_through_the_store() {
    if gpus("nccl_fail_tells_the_peers_through_the_store", 2).is_none() {
        return;
    }
    let (mut a, mut b, _server) = pair(Duration::from_secs(60));
    let start = Instant::now();
    let failer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        b.fail("step failed");
        b
    });
    let err = a.all_reduce(&mut [1f32; 8], ReduceOp::Sum).unwrap_err();
    let _b = failer.join().unwrap();
    assert!(matches!(err, Error::PeerFailed { peer: 1, .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
}

/// The trait's device entry point on a one-rank NCCL group: it names its device, reduces a
/// device buffer in place (the identity for one rank) and checks the length.
#[cfg(feature = "cuda")]
#[test]
fn nccl_reduces_a_raw_device_buffer_through_the_trait() {
    if gpus("nccl_reduces_a_raw_device_buffer_through_the_trait", 1).is_none() {
        return;
    }
    use cudarc::driver::DevicePtr;
    let id = NcclId::new().unwrap();
    let mut c = NcclCommunicator::from_id(&id, "tp", 0, 1, 0, Duration::from_secs(30)).unwrap();
    assert_eq!(Communicator::cuda_device(&c), Some(0));
    let stream = c.stream().clone();
    let host: Vec<f32> = (0..16).map(|i| i as f32 - 3.5).collect();
    let buf = stream.clone_htod(&host).unwrap();
    let ptr = buf.device_ptr(&stream).0;
    stream.synchronize().unwrap();
    let range = |bytes| crate::DeviceRange { addr: ptr, bytes, device: 0 };
    // SAFETY: `buf` holds 64 bytes of device 0 and nothing else uses it during the call.
    unsafe { c.all_reduce_device_ptr(range(64), crate::ElemType::F32, ReduceOp::Sum) }.unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
    // SAFETY: as above; the call fails before touching the buffer.
    let err = unsafe { c.all_reduce_device_ptr(range(6), crate::ElemType::F32, ReduceOp::Sum) };
    assert!(err.unwrap_err().to_string().contains("not a whole number of f32"));
}

/// The enqueue entry point on a one-rank NCCL group: the reduction is queued on the caller's
/// own stream (work queued after it sees the result), waited for by `wait_device` or by the
/// next call; a stream of another device is refused.
#[cfg(feature = "cuda")]
#[test]
fn nccl_queues_a_reduction_on_the_callers_stream() {
    if gpus("nccl_queues_a_reduction_on_the_callers_stream", 1).is_none() {
        return;
    }
    use cudarc::driver::DevicePtr;
    let id = NcclId::new().unwrap();
    let mut c = NcclCommunicator::from_id(&id, "tp", 0, 1, 0, Duration::from_secs(30)).unwrap();
    let mine = c.stream().context().new_stream().unwrap();
    let host: Vec<f32> = (0..32).map(|i| i as f32 * 0.25).collect();
    let buf = mine.clone_htod(&host).unwrap();
    let ptr = buf.device_ptr(&mine).0;
    let range = crate::DeviceRange { addr: ptr, bytes: 128, device: 0 };
    let stream = crate::DeviceStream { raw: mine.cu_stream() as usize, device: 0 };
    let (f32_, sum) = (crate::ElemType::F32, ReduceOp::Sum);
    // SAFETY: `buf` holds 128 bytes of device 0 used only by work on `mine`, a live stream of
    // the device's primary context that outlives the communicator's use of it.
    unsafe { c.all_reduce_device_enqueue(range, f32_, sum, stream) }.unwrap();
    // SAFETY: as above; this one first waits for the previous reduction.
    unsafe { c.all_reduce_device_enqueue(range, f32_, sum, stream) }.unwrap();
    c.wait_device().unwrap();
    c.wait_device().unwrap();
    assert_eq!(mine.clone_dtoh(&buf).unwrap(), host);
    // A host call after an enqueue waits for it first.
    // SAFETY: as above.
    unsafe { c.all_reduce_device_enqueue(range, f32_, sum, stream) }.unwrap();
    let mut ones = [1f32; 4];
    c.all_reduce(&mut ones, ReduceOp::Sum).unwrap();
    assert_eq!(ones, [1.0; 4]);
    let elsewhere = crate::DeviceStream { device: 1, ..stream };
    // SAFETY: refused before NCCL sees the stream.
    let err = unsafe { c.all_reduce_device_enqueue(range, f32_, sum, elsewhere) }.unwrap_err();
    assert!(err.to_string().contains("the stream is on cuda:1"), "{err}");
}
