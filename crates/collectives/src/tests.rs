//! The conformance suite: every operation against its serial definition on groups of 1 to 8
//! ranks (threads of this process), for the shared-memory backend (with small slots, so
//! messages run in several pieces) and the TCP backend (with messages past the direct-send
//! threshold, so rings run); plus the refusals and failure paths. Multi-process behaviour
//! (killed peers, the store) is tested in `tests/`.

use crate::{local, Collective, Communicator, Error, ReduceOp, ShmOptions, TcpComm};
use half::bf16;
use mesh::{Store, StoreServer};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Local,
    Tcp,
}

const KINDS: [Kind; 2] = [Kind::Local, Kind::Tcp];

fn tiny() -> ShmOptions {
    ShmOptions { slot_bytes: 4096, ring_bytes: 4096 }
}

fn make_group(
    kind: Kind,
    size: usize,
    opts: ShmOptions,
) -> (Vec<Box<dyn Communicator>>, Option<StoreServer>) {
    match kind {
        Kind::Local => {
            let comms = local::group(size, "test", opts).expect("local group");
            (comms.into_iter().map(|c| Box::new(c) as Box<dyn Communicator>).collect(), None)
        }
        Kind::Tcp => {
            static GROUPS: AtomicUsize = AtomicUsize::new(0);
            let id = GROUPS.fetch_add(1, Ordering::Relaxed);
            let server = StoreServer::bind((Ipv4Addr::LOCALHOST, 0)).expect("store server");
            let addr = server.local_addr();
            let comms = std::thread::scope(|s| {
                let handles: Vec<_> = (0..size)
                    .map(|rank| {
                        s.spawn(move || {
                            let store =
                                Store::connect(addr, Duration::from_secs(10)).expect("store");
                            let prefix = format!("tcp/test{id}");
                            TcpComm::connect(
                                &store,
                                &prefix,
                                "test",
                                rank,
                                size,
                                Ipv4Addr::LOCALHOST.into(),
                                Duration::from_secs(10),
                            )
                            .expect("tcp group")
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| Box::new(h.join().expect("connect thread")) as Box<dyn Communicator>)
                    .collect()
            });
            (comms, Some(server))
        }
    }
}

/// Runs `f` on every rank of a fresh group of `kind`, each on its own thread.
fn on_group<R: Send>(
    kind: Kind,
    size: usize,
    opts: ShmOptions,
    f: impl Fn(&mut dyn Communicator) -> R + Sync,
) -> Vec<R> {
    let (comms, _server) = make_group(kind, size, opts);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let f = &f;
                s.spawn(move || {
                    c.set_timeout(Duration::from_secs(20));
                    f(&mut *c)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

fn value(rank: usize, i: usize) -> f32 {
    // Small integers: sums are exact in any order.
    ((rank * 7 + i * 3) % 23) as f32 - 11.0
}

fn all_reduce_matches_serial_for_every_size_and_op(kind: Kind) {
    for size in 1..=8 {
        for len in [0usize, 1, 5, 1000, 3000, 20_000] {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let want: Vec<f32> = (0..len)
                    .map(|i| {
                        let vals = (0..size).map(|r| value(r, i));
                        match op {
                            ReduceOp::Sum => vals.sum(),
                            ReduceOp::Max => vals.fold(f32::MIN, f32::max),
                            ReduceOp::Min => vals.fold(f32::MAX, f32::min),
                        }
                    })
                    .collect();
                let got = on_group(kind, size, tiny(), |c| {
                    let mut buf: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                    c.all_reduce(&mut buf, op).unwrap();
                    buf
                });
                for (r, g) in got.iter().enumerate() {
                    assert_eq!(g, &want, "size {size} len {len} {op:?} rank {r}");
                }
            }
        }
    }
}

fn large_all_reduce_is_bit_identical_on_every_rank(kind: Kind) {
    // Non-integer values: the result depends on the order of additions, which must be the
    // same on every rank (tensor parallelism relies on identical bits).
    let opts = ShmOptions { slot_bytes: 64 << 10, ring_bytes: 4096 };
    let got = on_group(kind, 3, opts, |c| {
        let mut buf: Vec<f32> =
            (0..200_000).map(|i| (i as f32 * 0.37 + c.rank() as f32).sin()).collect();
        c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        buf
    });
    assert!(got
        .windows(2)
        .all(|w| w[0].iter().map(|x| x.to_bits()).eq(w[1].iter().map(|x| x.to_bits()))));
}

fn all_reduce_other_dtypes(kind: Kind) {
    let got = on_group(kind, 4, tiny(), |c| {
        let r = c.rank() as i64;
        let mut ints = vec![r, -r, r * r];
        c.all_reduce(&mut ints, ReduceOp::Max).unwrap();
        let mut halves = vec![bf16::from_f32(c.rank() as f32); 3000];
        c.all_reduce(&mut halves, ReduceOp::Sum).unwrap();
        (ints, halves[2999].to_f32())
    });
    for (ints, h) in got {
        assert_eq!(ints, vec![3, 0, 9]);
        assert_eq!(h, 6.0);
    }
}

fn all_gather_uneven_matches_serial(kind: Kind) {
    for size in 1..=8 {
        // Uneven and empty contributions, some longer than a slot (4096 bytes = 1024 f32).
        let sizes: Vec<usize> =
            (0..size).map(|r| [3usize, 0, 1500, 7, 2049, 1, 0, 64][r]).collect();
        let want: Vec<f32> =
            (0..size).flat_map(|r| (0..sizes[r]).map(move |i| value(r, i))).collect();
        let got = on_group(kind, size, tiny(), |c| {
            let send: Vec<f32> = (0..sizes[c.rank()]).map(|i| value(c.rank(), i)).collect();
            let mut recv = vec![0f32; want.len()];
            c.all_gather_uneven(&send, &mut recv, &sizes).unwrap();
            let mut even = vec![0f32; 5 * size];
            c.all_gather(&[c.rank() as f32; 5], &mut even).unwrap();
            (recv, even)
        });
        let even_want: Vec<f32> = (0..size).flat_map(|r| [r as f32; 5]).collect();
        for (recv, even) in got {
            assert_eq!(recv, want, "size {size}");
            assert_eq!(even, even_want);
        }
    }
}

fn reduce_scatter_and_all_to_all_match_serial(kind: Kind) {
    for size in 1..=8 {
        let chunk = 700; // with tiny slots: several pieces per chunk
        let got = on_group(kind, size, tiny(), |c| {
            let send: Vec<f32> = (0..size * chunk).map(|i| value(c.rank(), i)).collect();
            let mut reduced = vec![0f32; chunk];
            c.reduce_scatter(&send, &mut reduced, ReduceOp::Sum).unwrap();
            let mut swapped = vec![0f32; size * chunk];
            c.all_to_all(&send, &mut swapped).unwrap();
            (reduced, swapped)
        });
        for (r, (reduced, swapped)) in got.iter().enumerate() {
            let want: Vec<f32> =
                (0..chunk).map(|i| (0..size).map(|s| value(s, r * chunk + i)).sum()).collect();
            assert_eq!(reduced, &want, "reduce_scatter size {size} rank {r}");
            let want: Vec<f32> =
                (0..size).flat_map(|s| (0..chunk).map(move |i| value(s, r * chunk + i))).collect();
            assert_eq!(swapped, &want, "all_to_all size {size} rank {r}");
        }
    }
}

fn broadcast_from_every_root(kind: Kind) {
    for size in 1..=5 {
        for root in 0..size {
            let got = on_group(kind, size, tiny(), |c| {
                let mut buf: Vec<f32> = (0..2500).map(|i| value(c.rank(), i)).collect();
                c.broadcast(&mut buf, root).unwrap();
                buf
            });
            let want: Vec<f32> = (0..2500).map(|i| value(root, i)).collect();
            assert!(got.iter().all(|g| g == &want), "size {size} root {root}");
        }
    }
}

fn send_recv_in_a_ring_larger_than_the_ring_buffer(kind: Kind) {
    let size = 4;
    let got = on_group(kind, size, tiny(), |c| {
        let (r, n) = (c.rank(), c.size());
        let out: Vec<f32> = (0..5000).map(|i| value(r, i)).collect();
        let mut inc = vec![0f32; 5000];
        // Even ranks send first, odd ranks receive first: no cycle of blocked senders.
        if r % 2 == 0 {
            c.send(&out, (r + 1) % n).unwrap();
            c.recv(&mut inc, (r + n - 1) % n).unwrap();
        } else {
            c.recv(&mut inc, (r + n - 1) % n).unwrap();
            c.send(&out, (r + 1) % n).unwrap();
        }
        c.barrier().unwrap();
        inc
    });
    for (r, inc) in got.iter().enumerate() {
        let from = (r + size - 1) % size;
        assert!(inc.iter().enumerate().all(|(i, &x)| x == value(from, i)), "rank {r}");
    }
}

fn mismatched_lengths_fail_on_every_rank_and_poison(kind: Kind) {
    let got = on_group(kind, 3, tiny(), |c| {
        let mut buf = vec![1f32; if c.rank() == 1 { 9 } else { 8 }];
        let first = c.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        let later = c.barrier().unwrap_err();
        (first, later)
    });
    for (r, (first, later)) in got.iter().enumerate() {
        let msg = first.to_string();
        assert!(matches!(first, Error::Mismatch { what: "bytes", .. }), "rank {r}: {msg}");
        assert!(msg.contains("all_reduce on test group"), "{msg}");
        assert!(matches!(later, Error::Poisoned { .. }), "rank {r}: {later}");
    }
}

fn mismatched_dtype_or_op_is_named(kind: Kind) {
    let got = on_group(kind, 2, tiny(), |c| {
        if c.rank() == 0 {
            c.all_reduce(&mut [1f32, 2.0], ReduceOp::Sum).unwrap_err()
        } else {
            c.all_reduce(&mut [1i64], ReduceOp::Sum).unwrap_err()
        }
    });
    for e in &got {
        assert!(matches!(e, Error::Mismatch { what: "dtype", .. }), "{e}");
    }
    let got = on_group(kind, 2, tiny(), |c| {
        if c.rank() == 0 {
            c.barrier().unwrap_err()
        } else {
            c.broadcast(&mut [0u8; 4], 0).unwrap_err()
        }
    });
    // The rank that reads the other's message first names the mismatch; its peer may learn
    // of that failure before it reads anything.
    let ops = got.iter().filter(|e| matches!(e, Error::Mismatch { what: "operation", .. })).count();
    assert!(ops >= 1, "{got:?}");
    assert!(got.iter().all(|e| matches!(e, Error::Mismatch { .. } | Error::PeerFailed { .. })));
    let text = got.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
    assert!(text.contains("barrier") && text.contains("broadcast"), "{text}");
}

fn bad_arguments_fail_here_and_tell_the_peers(kind: Kind) {
    let got = on_group(kind, 2, tiny(), |c| {
        if c.rank() == 0 {
            let mut recv = vec![0f32; 3]; // should be 4
            c.all_gather(&[1f32, 2.0], &mut recv).unwrap_err()
        } else {
            let mut recv = vec![0f32; 4];
            c.all_gather(&[1f32, 2.0], &mut recv).unwrap_err()
        }
    });
    assert!(matches!(got[0], Error::InvalidArgument { .. }), "{}", got[0]);
    assert!(got[0].to_string().contains("receive buffer has 12 bytes"), "{}", got[0]);
    assert!(matches!(got[1], Error::PeerFailed { peer: 0, .. }), "{}", got[1]);
    let got = on_group(kind, 2, tiny(), |c| c.send(&[1f32], c.rank()).unwrap_err().to_string());
    assert!(got[0].contains("peer rank 0 is this rank"), "{}", got[0]);
}

fn timeout_names_the_missing_rank(kind: Kind) {
    let got = on_group(kind, 3, tiny(), |c| {
        c.set_timeout(Duration::from_millis(300));
        if c.rank() == 2 {
            // Never joins this barrier; waits out the others' failure instead.
            std::thread::sleep(Duration::from_millis(600));
            return None;
        }
        Some(c.barrier().unwrap_err())
    });
    for e in got.into_iter().flatten() {
        assert!(matches!(&e, Error::Timeout { waiting_for, .. } if waiting_for == &[2]), "{e}");
    }
}

fn abort_unblocks_a_waiting_rank(kind: Kind) {
    let (mut comms, _server) = make_group(kind, 2, tiny());
    let mut c0 = comms.remove(0);
    c0.set_timeout(Duration::from_secs(30));
    let handle = c0.abort_handle();
    let waiter = std::thread::spawn(move || c0.barrier().unwrap_err());
    std::thread::sleep(Duration::from_millis(50));
    handle.abort();
    let err = waiter.join().unwrap();
    assert!(matches!(err, Error::Aborted { .. }), "{err}");
    drop(comms);
}

fn fail_wakes_the_peers_waiting_for_this_rank(kind: Kind) {
    let got = on_group(kind, 3, tiny(), |c| {
        if c.rank() == 1 {
            c.fail("the model step failed");
            return c.barrier().unwrap_err();
        }
        c.all_reduce(&mut [1f32; 4], ReduceOp::Sum).unwrap_err()
    });
    assert!(matches!(got[1], Error::Poisoned { .. }), "{}", got[1]);
    assert!(got[1].to_string().contains("this rank failed: the model step failed"), "{}", got[1]);
    for r in [0, 2] {
        assert!(matches!(got[r], Error::PeerFailed { peer: 1, .. }), "rank {r}: {}", got[r]);
    }
}

fn recv_checks_the_message_size(kind: Kind) {
    let got = on_group(kind, 2, tiny(), |c| {
        if c.rank() == 0 {
            c.send(&[1f32, 2.0, 3.0], 1).map(|_| String::new()).unwrap_or_else(|e| e.to_string())
        } else {
            c.recv(&mut [0f32; 2], 0).unwrap_err().to_string()
        }
    });
    assert!(got[1].contains("mismatch: this rank has 8"), "{}", got[1]);
    assert!(got[1].contains("peer rank 0 has 12"), "{}", got[1]);
}

/// Runs each conformance test once per backend.
macro_rules! per_backend {
    ($($name:ident),* $(,)?) => {
        mod local_backend {
            $(#[test] fn $name() { super::$name(super::Kind::Local) })*
        }
        mod tcp_backend {
            $(#[test] fn $name() { super::$name(super::Kind::Tcp) })*
        }
    };
}

per_backend!(
    fail_wakes_the_peers_waiting_for_this_rank,
    all_reduce_matches_serial_for_every_size_and_op,
    large_all_reduce_is_bit_identical_on_every_rank,
    all_reduce_other_dtypes,
    all_gather_uneven_matches_serial,
    reduce_scatter_and_all_to_all_match_serial,
    broadcast_from_every_root,
    send_recv_in_a_ring_larger_than_the_ring_buffer,
    mismatched_lengths_fail_on_every_rank_and_poison,
    mismatched_dtype_or_op_is_named,
    bad_arguments_fail_here_and_tell_the_peers,
    timeout_names_the_missing_rank,
    abort_unblocks_a_waiting_rank,
    recv_checks_the_message_size
);

#[test]
fn kinds_cover_every_in_process_backend() {
    assert_eq!(KINDS.len(), 2);
}

#[test]
fn a_single_rank_context_is_inert() {
    use crate::{init_parallel_with, InitOptions};
    let mut ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    assert!(ctx.world().is_none() && !ctx.owns_world());
    assert_eq!((ctx.mesh().tp(), ctx.mesh().cp()), (1, 1));
    let mut x = [1.5f32, -2.0];
    ctx.tp.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, [1.5, -2.0]);
    let mut out = [0f32; 2];
    ctx.cp.all_gather(&x, &mut out).unwrap();
    assert_eq!(out, x);
    ctx.control.barrier().unwrap();
    // Arguments are still checked on one rank.
    let err = ctx.cp.all_gather(&x, &mut [0f32; 3]).unwrap_err();
    assert!(err.to_string().contains("receive buffer has 12 bytes"), "{err}");
    ctx.shutdown(Duration::from_secs(1)).unwrap();
}

#[test]
fn nccl_without_a_gpu_is_a_clear_error() {
    let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match crate::nccl::available() {
        // Only a build with `cuda` on a machine with CUDA and NCCL gets here.
        Ok(()) => {}
        Err(e) => {
            let err = e.to_string();
            let expected =
                if cfg!(feature = "cuda") { "nccl backend unavailable" } else { "--features cuda" };
            assert!(err.contains(expected), "{err}");
            assert!(!require, "TPCTL_REQUIRE_GPU=1 but NCCL is unusable: {err}");
        }
    }
}

/// Host backends have no device buffers: they say so instead of touching the address.
#[test]
fn host_backends_refuse_device_buffers() {
    let mut solo = crate::Solo::new("tp");
    assert_eq!(solo.cuda_device(), None);
    let range = crate::DeviceRange { addr: 0x1000, bytes: 16, device: 0 };
    // SAFETY: a host backend never dereferences the address (that is what is tested).
    let err = unsafe { solo.all_reduce_device_ptr(range, crate::ElemType::F32, ReduceOp::Sum) };
    let err = err.unwrap_err();
    assert!(matches!(err, Error::BackendUnavailable { .. }), "{err}");
    assert!(err.to_string().contains("the tp group reduces host memory"), "{err}");
    let stream = crate::DeviceStream { raw: 0x2000, device: 0 };
    // SAFETY: as above, for the address and the stream.
    let err = unsafe {
        solo.all_reduce_device_enqueue(range, crate::ElemType::F32, ReduceOp::Sum, stream)
    };
    assert!(matches!(err, Err(Error::BackendUnavailable { .. })), "{err:?}");
    // Nothing can be in flight on a host backend, and refusing did not poison it.
    solo.wait_device().unwrap();
    solo.all_reduce(&mut [1f32; 4], ReduceOp::Sum).unwrap();
}

/// Host backends hold nothing on a device: a sleep's `nccl` tag finds no resources in them.
#[test]
fn host_backends_have_no_device_resources() {
    for kind in KINDS {
        let (comms, _server) = make_group(kind, 2, tiny());
        assert!(comms.iter().all(|c| c.device_resources().is_none()), "{kind:?}");
    }
    assert!(crate::Solo::new("tp").device_resources().is_none());
}
