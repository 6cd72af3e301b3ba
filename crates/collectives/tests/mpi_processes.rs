//! The `mpi` backend between real rank processes: this test binary runs itself under
//! `mpirun` (one host, `--oversubscribe`), and each rank runs the conformance suite of the
//! other backends (`src/tests.rs`) on MPI groups of 1 to 4 ranks: every operation against its
//! serial definition, then the refusals and failure paths (mismatches, bad arguments, a
//! missing rank's timeout, abort, a failed rank waking its peers), then a whole
//! `init_parallel` context over `mpi`. A second run kills a rank mid-job and checks that
//! `mpirun` ends the job instead of leaving its peers waiting. Every wait on `mpirun` has a
//! deadline, after which the job is killed and the test fails with its output.
//!
//! Without the feature `mpi` the backend's refusal is checked instead.

use collectives::{Collective, Communicator, Error, MpiComm, ReduceOp};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Set in the ranks' environment, so the parent tests know they are the parent.
const CHILD: &str = "TPCTL_MPI_TEST_CHILD";
/// Ranks of the conformance run.
const WORLD: usize = 4;

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs test `name` of this binary as `ranks` processes under `mpirun`, killing the job at
/// `deadline`; returns its output, or panics with what it printed when it ran past that.
fn mpirun(ranks: usize, name: &str, env: &[(&str, &str)], deadline: Duration) -> Output {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-n", &ranks.to_string()])
        .arg(&exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun could not start: install OpenMPI with `cargo xtask install-mpi`");
    let until = Instant::now() + deadline;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            // SIGTERM first: mpirun then stops its ranks too.
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "mpirun ran past {deadline:?}; killed:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn mpi_ranks_pass_the_conformance_suite() {
    if is_child() {
        return;
    }
    if !cfg!(feature = "mpi") {
        let e = MpiComm::create("tp", &[0], Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::NotCompiledWith { feature: "mpi" }), "{e}");
        assert!(e.to_string().contains("--features mpi"), "{e}");
        return;
    }
    let out = mpirun(WORLD, "mpi_rank_conformance", &[], Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "mpirun failed ({}):\n{stdout}\n{stderr}", out.status);
    for r in 0..WORLD {
        assert!(stdout.contains(&format!("mpi rank {r} passed")), "rank {r}:\n{stdout}\n{stderr}");
    }
}

#[test]
fn mpi_rank_that_dies_ends_the_job() {
    if is_child() || !cfg!(feature = "mpi") {
        return;
    }
    // The survivors wait far longer than this deadline: only mpirun can end them in time.
    let out = mpirun(3, "mpi_rank_dies", &[], Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // mpirun passes on the dead rank's signal (SIGABRT: 128 + 6) and names the rank.
    assert_eq!(out.status.code(), Some(134), "{stdout}\n{stderr}");
    assert!(stdout.contains("rank 1 dies now"), "{stdout}\n{stderr}");
    assert!(!stdout.contains("survived"), "a peer finished its barrier:\n{stdout}");
    assert!(stderr.contains("rank 1"), "mpirun does not name the dead rank:\n{stderr}");
}

#[test]
fn mpi_data_phase_past_its_deadline_ends_the_job() {
    if is_child() || !cfg!(feature = "mpi") || !mesh::failpoint::enabled() {
        return;
    }
    // Rank 1 agrees to an all-reduce, then stalls for 20 s before its data moves; rank 0's
    // data phase has a 3 s deadline and MPI holds its buffer: it ends the job.
    let env = [("TPCTL_FAILPOINTS", "mpi.data=delay(20000)@1#1")];
    let out = mpirun(2, "mpi_rank_stalls_in_data", &env, Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job succeeded:\n{stdout}\n{stderr}");
    assert!(stdout.contains("rank 0 agreed once"), "{stdout}\n{stderr}");
    assert!(!stdout.contains("returned"), "a rank returned from the stalled call:\n{stdout}");
    // mpirun exits with the code given to MPI_Abort (its "MPI_ABORT was invoked" notice is
    // not always delivered before the job ends, so it is not relied on).
    assert_eq!(
        out.status.code(),
        Some(75),
        "the job did not end by MPI_Abort from the data phase:\n{stdout}\n{stderr}"
    );
}

// ---- the ranks ----

/// This process's MPI world rank.
fn world_rank() -> usize {
    std::env::var("OMPI_COMM_WORLD_RANK").unwrap().parse().unwrap()
}

/// The group of world ranks `0..size`, named `test`, for those ranks; `None` for the others.
fn group(size: usize) -> Option<MpiComm> {
    let me = world_rank();
    let members: Vec<usize> = (0..size).collect();
    (me < size).then(|| MpiComm::create("test", &members, Duration::from_secs(60)).unwrap())
}

fn value(rank: usize, i: usize) -> f32 {
    // Small integers: sums are exact in any order.
    ((rank * 7 + i * 3) % 23) as f32 - 11.0
}

/// One rank of `mpi_ranks_pass_the_conformance_suite`; does nothing unless started by it.
#[test]
fn mpi_rank_conformance() {
    if !is_child() {
        return;
    }
    let me = world_rank();
    // A failed check ends this rank at once, without MPI_Finalize, so mpirun ends the job
    // (and the parent reports it) instead of the peers waiting for this rank.
    if std::panic::catch_unwind(suite).is_err() {
        eprintln!("mpi rank {me} failed a check; ending the job");
        std::process::abort();
    }
    println!("mpi rank {me} passed");
}

fn suite() {
    let checks: [(&str, fn()); 15] = [
        ("all_reduce_matches_serial", all_reduce_matches_serial),
        (
            "large_all_reduce_is_bit_identical_on_every_rank",
            large_all_reduce_is_bit_identical_on_every_rank,
        ),
        ("other_dtypes", other_dtypes),
        ("all_gather_uneven_matches_serial", all_gather_uneven_matches_serial),
        ("reduce_scatter_and_all_to_all_match_serial", reduce_scatter_and_all_to_all_match_serial),
        ("broadcast_from_every_root", broadcast_from_every_root),
        ("send_recv_in_a_ring", send_recv_in_a_ring),
        (
            "mismatched_lengths_fail_on_every_rank_and_poison",
            mismatched_lengths_fail_on_every_rank_and_poison,
        ),
        ("mismatched_dtype_or_operation_is_named", mismatched_dtype_or_operation_is_named),
        ("bad_arguments_fail_here_and_tell_the_peers", bad_arguments_fail_here_and_tell_the_peers),
        ("timeout_names_the_missing_rank", timeout_names_the_missing_rank),
        ("abort_unblocks_a_waiting_rank", abort_unblocks_a_waiting_rank),
        ("fail_wakes_the_peers_waiting_for_this_rank", fail_wakes_the_peers_waiting_for_this_rank),
        ("recv_checks_the_message_size", recv_checks_the_message_size),
        ("init_parallel_over_mpi", init_parallel_over_mpi),
    ];
    for (name, check) in checks {
        eprintln!("mpi rank {}: {name}", world_rank());
        check();
    }
}

fn all_reduce_matches_serial() {
    for size in 1..=WORLD {
        let Some(mut c) = group(size) else { continue };
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
                let mut buf: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                c.all_reduce(&mut buf, op).unwrap();
                assert_eq!(buf, want, "size {size} len {len} {op:?} rank {}", c.rank());
            }
        }
    }
}

fn large_all_reduce_is_bit_identical_on_every_rank() {
    let Some(mut c) = group(3) else { return };
    let mut buf: Vec<f32> =
        (0..200_000).map(|i| (i as f32 * 0.37 + c.rank() as f32).sin()).collect();
    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    // Every rank's bits, fingerprinted, gathered: all the same.
    let bits = buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3)
    });
    let mut all = [0u8; 24];
    c.all_gather(&bits.to_le_bytes(), &mut all).unwrap();
    assert!(all.chunks(8).all(|h| h == bits.to_le_bytes()), "ranks differ: {all:?}");
}

fn other_dtypes() {
    use half::{bf16, f16};
    let Some(mut c) = group(4) else { return };
    let r = c.rank() as i64;
    let mut ints = vec![r, -r, r * r];
    c.all_reduce(&mut ints, ReduceOp::Max).unwrap();
    assert_eq!(ints, vec![3, 0, 9]);
    let mut bytes = vec![c.rank() as u8; 5];
    c.all_reduce(&mut bytes, ReduceOp::Sum).unwrap();
    assert_eq!(bytes, vec![6u8; 5]);
    // Half types go through the exchange and an f32 sum here.
    let mut halves = vec![bf16::from_f32(c.rank() as f32); 3000];
    c.all_reduce(&mut halves, ReduceOp::Sum).unwrap();
    assert!(halves.iter().all(|h| h.to_f32() == 6.0), "{:?}", &halves[..4]);
    let send: Vec<f16> = (0..8).map(|i| f16::from_f32((i + c.rank()) as f32)).collect();
    let mut part = vec![f16::ZERO; 2];
    c.reduce_scatter(&send, &mut part, ReduceOp::Max).unwrap();
    let want: Vec<f32> = (0..2).map(|i| (2 * c.rank() + i + 3) as f32).collect();
    assert_eq!(part.iter().map(|h| h.to_f32()).collect::<Vec<_>>(), want);
}

fn all_gather_uneven_matches_serial() {
    for size in 1..=WORLD {
        let Some(mut c) = group(size) else { continue };
        let sizes: Vec<usize> = (0..size).map(|r| [3usize, 0, 1500, 2049][r]).collect();
        let want: Vec<f32> =
            (0..size).flat_map(|r| (0..sizes[r]).map(move |i| value(r, i))).collect();
        let send: Vec<f32> = (0..sizes[c.rank()]).map(|i| value(c.rank(), i)).collect();
        let mut recv = vec![0f32; want.len()];
        c.all_gather_uneven(&send, &mut recv, &sizes).unwrap();
        assert_eq!(recv, want, "size {size}");
        let mut even = vec![0f32; 5 * size];
        c.all_gather(&[c.rank() as f32; 5], &mut even).unwrap();
        let even_want: Vec<f32> = (0..size).flat_map(|r| [r as f32; 5]).collect();
        assert_eq!(even, even_want);
    }
}

fn reduce_scatter_and_all_to_all_match_serial() {
    for size in 1..=WORLD {
        let Some(mut c) = group(size) else { continue };
        let (r, chunk) = (c.rank(), 700);
        let send: Vec<f32> = (0..size * chunk).map(|i| value(r, i)).collect();
        let mut reduced = vec![0f32; chunk];
        c.reduce_scatter(&send, &mut reduced, ReduceOp::Sum).unwrap();
        let want: Vec<f32> =
            (0..chunk).map(|i| (0..size).map(|s| value(s, r * chunk + i)).sum()).collect();
        assert_eq!(reduced, want, "reduce_scatter size {size} rank {r}");
        let mut swapped = vec![0f32; size * chunk];
        c.all_to_all(&send, &mut swapped).unwrap();
        let want: Vec<f32> =
            (0..size).flat_map(|s| (0..chunk).map(move |i| value(s, r * chunk + i))).collect();
        assert_eq!(swapped, want, "all_to_all size {size} rank {r}");
    }
}

fn broadcast_from_every_root() {
    for size in 1..=WORLD {
        let Some(mut c) = group(size) else { continue };
        for root in 0..size {
            let mut buf: Vec<f32> = (0..2500).map(|i| value(c.rank(), i)).collect();
            c.broadcast(&mut buf, root).unwrap();
            let want: Vec<f32> = (0..2500).map(|i| value(root, i)).collect();
            assert_eq!(buf, want, "size {size} root {root}");
        }
    }
}

fn send_recv_in_a_ring() {
    let Some(mut c) = group(WORLD) else { return };
    let (r, n) = (c.rank(), c.size());
    // Small messages (sent eagerly) and large ones (sent once the receiver is there).
    for len in [5000usize, 1 << 20] {
        let out: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        let mut inc = vec![0f32; len];
        // Even ranks send first, odd ranks receive first: no cycle of blocked senders.
        if r % 2 == 0 {
            c.send(&out, (r + 1) % n).unwrap();
            c.recv(&mut inc, (r + n - 1) % n).unwrap();
        } else {
            c.recv(&mut inc, (r + n - 1) % n).unwrap();
            c.send(&out, (r + 1) % n).unwrap();
        }
        let from = (r + n - 1) % n;
        assert!(inc.iter().enumerate().all(|(i, &x)| x == value(from, i)), "rank {r} len {len}");
    }
    c.barrier().unwrap();
}

fn mismatched_lengths_fail_on_every_rank_and_poison() {
    let Some(mut c) = group(3) else { return };
    let mut buf = vec![1f32; if c.rank() == 1 { 9 } else { 8 }];
    let first = c.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
    let later = c.barrier().unwrap_err();
    let msg = first.to_string();
    // Rank 1 reads a peer's descriptor before any failure word, so it names the mismatch; a
    // peer may learn of another's failure before rank 1's descriptor reaches it.
    let named = matches!(first, Error::Mismatch { what: "bytes", .. });
    assert!(named || (c.rank() != 1 && matches!(first, Error::PeerFailed { .. })), "{msg}");
    assert!(msg.contains("all_reduce on test group"), "{msg}");
    assert!(matches!(later, Error::Poisoned { .. }), "{later}");
}

fn mismatched_dtype_or_operation_is_named() {
    if let Some(mut c) = group(2) {
        let e = if c.rank() == 0 {
            c.all_reduce(&mut [1f32, 2.0], ReduceOp::Sum).unwrap_err()
        } else {
            c.all_reduce(&mut [1i64], ReduceOp::Sum).unwrap_err()
        };
        assert!(matches!(e, Error::Mismatch { what: "dtype", .. }), "{e}");
    }
    if let Some(mut c) = group(2) {
        let e = if c.rank() == 0 {
            c.barrier().unwrap_err()
        } else {
            c.broadcast(&mut [0u8; 4], 0).unwrap_err()
        };
        // Both ranks read the other's descriptor, so both name the mismatch.
        assert!(matches!(e, Error::Mismatch { what: "operation", .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains("barrier") && text.contains("broadcast"), "{text}");
    }
}

fn bad_arguments_fail_here_and_tell_the_peers() {
    if let Some(mut c) = group(2) {
        if c.rank() == 0 {
            let mut recv = vec![0f32; 3]; // should be 4
            let e = c.all_gather(&[1f32, 2.0], &mut recv).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            assert!(e.to_string().contains("receive buffer has 12 bytes"), "{e}");
        } else {
            let mut recv = vec![0f32; 4];
            let e = c.all_gather(&[1f32, 2.0], &mut recv).unwrap_err();
            assert!(matches!(e, Error::PeerFailed { peer: 0, .. }), "{e}");
        }
    }
    if let Some(mut c) = group(2) {
        let e = c.send(&[1f32], c.rank()).unwrap_err().to_string();
        assert!(e.contains(&format!("peer rank {} is this rank", c.rank())), "{e}");
    }
}

fn timeout_names_the_missing_rank() {
    let Some(mut c) = group(3) else { return };
    // Generous next to scheduling delays: up to 9 rank processes share CI's 2 cores.
    c.set_timeout(Duration::from_secs(1));
    if c.rank() == 2 {
        // Never joins this barrier; waits out the others' failure instead.
        std::thread::sleep(Duration::from_millis(2500));
        return;
    }
    let e = c.barrier().unwrap_err();
    assert!(matches!(&e, Error::Timeout { waiting_for, .. } if waiting_for == &[2]), "{e}");
}

fn abort_unblocks_a_waiting_rank() {
    let Some(mut c) = group(2) else { return };
    if c.rank() == 1 {
        std::thread::sleep(Duration::from_millis(300));
        return;
    }
    c.set_timeout(Duration::from_secs(30));
    let handle = c.abort_handle();
    let e = std::thread::scope(|s| {
        let waiter = s.spawn(|| c.barrier().unwrap_err());
        std::thread::sleep(Duration::from_millis(50));
        handle.abort();
        waiter.join().unwrap()
    });
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
}

fn fail_wakes_the_peers_waiting_for_this_rank() {
    let Some(mut c) = group(3) else { return };
    if c.rank() == 1 {
        c.fail("the model step failed");
        let e = c.barrier().unwrap_err();
        assert!(matches!(e, Error::Poisoned { .. }), "{e}");
        assert!(e.to_string().contains("this rank failed: the model step failed"), "{e}");
        return;
    }
    let e = c.all_reduce(&mut [1f32; 4], ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::PeerFailed { peer: 1, .. }), "rank {}: {e}", c.rank());
}

fn recv_checks_the_message_size() {
    let Some(mut c) = group(2) else { return };
    if c.rank() == 0 {
        // The sender compares too: it may fail the same way, or learn of the receiver's failure.
        let _ = c.send(&[1f32, 2.0, 3.0], 1);
    } else {
        let e = c.recv(&mut [0f32; 2], 0).unwrap_err().to_string();
        assert!(e.contains("mismatch: this rank has 8"), "{e}");
        assert!(e.contains("peer rank 0 has 12"), "{e}");
    }
}

/// The groups of a whole context, built by `init_parallel` from OpenMPI's variables.
fn init_parallel_over_mpi() {
    use collectives::{init_parallel, InitOptions};
    use mesh::{AxisBackends, CommBackend};
    let opts = InitOptions {
        tp: Some(2),
        head_groups: 2,
        backends: AxisBackends {
            tp: CommBackend::Mpi,
            cp: CommBackend::Mpi,
            control: CommBackend::Mpi,
        },
        timeout: Duration::from_secs(60),
        ..InitOptions::default()
    };
    let mut ctx = init_parallel(&opts).expect("init_parallel over mpi");
    assert_eq!(ctx.rank(), world_rank());
    for c in [&ctx.tp, &ctx.cp, &ctx.control] {
        assert_eq!(c.backend(), "mpi");
    }
    let mut tp = vec![ctx.rank() as f32; 3];
    ctx.tp.all_reduce(&mut tp, ReduceOp::Sum).unwrap();
    // TP groups are rows of the 2 x 2 mesh: ranks {0, 1} and {2, 3}.
    let row = ctx.rank() / 2;
    assert_eq!(tp, vec![(4 * row + 1) as f32; 3], "rank {}", ctx.rank());
    let mut all = vec![1i64];
    ctx.control.all_reduce(&mut all, ReduceOp::Sum).unwrap();
    assert_eq!(all, vec![WORLD as i64]);
    ctx.shutdown(Duration::from_secs(60)).unwrap();
}

/// One rank of `mpi_rank_that_dies_ends_the_job`: rank 1 dies after a first barrier, the
/// others wait for it in a second one with a deadline far past the test's.
#[test]
fn mpi_rank_dies() {
    if !is_child() {
        return;
    }
    let Some(mut c) = group(3) else { return };
    c.barrier().unwrap();
    if c.rank() == 1 {
        println!("rank 1 dies now");
        // Exits without MPI_Finalize or unwinding, as a crash would.
        std::process::abort();
    }
    c.set_timeout(Duration::from_secs(600));
    let result = c.barrier();
    println!("rank {} survived the barrier: {result:?}", c.rank());
}

/// One rank of `mpi_data_phase_past_its_deadline_ends_the_job`: a first all-reduce passes (the
/// failpoint skips it), the second stalls on rank 1 after the agreement.
#[test]
fn mpi_rank_stalls_in_data() {
    if !is_child() {
        return;
    }
    let Some(mut c) = group(2) else { return };
    let mut buf = vec![1f32; 1 << 16];
    c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    println!("rank {} agreed once", c.rank());
    c.set_timeout(Duration::from_secs(3));
    let result = c.all_reduce(&mut buf, ReduceOp::Sum);
    println!("rank {} returned: {result:?}", c.rank());
}
