//! Tests of the store with a real server and clients on threads.

use super::*;
use std::collections::BTreeSet;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;

/// Generous: only a broken store gets near it, and it keeps a broken test from hanging.
const LONG: Duration = Duration::from_secs(30);

fn server() -> (StoreServer, Store) {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let store = Store::connect(server.local_addr(), LONG).unwrap();
    (server, store)
}

/// Runs `f` on a thread and returns its result, failing the test instead of hanging when the
/// thread does not finish.
fn joined<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(LONG * 2).expect("store call neither returned nor failed")
}

/// The launcher's own choice of a free port (one helper in the workspace).
fn free_port() -> u16 {
    crate::rendezvous::free_master_port().expect("bind a loopback port")
}

#[test]
fn set_get_delete() {
    let (_server, store) = server();
    assert_eq!(store.get("a").unwrap(), None);
    store.set("a", b"1").unwrap();
    store.set("b", &[]).unwrap();
    assert_eq!(store.get("a").unwrap(), Some(b"1".to_vec()));
    assert_eq!(store.get("b").unwrap(), Some(vec![]));
    store.set("a", b"2").unwrap();
    assert_eq!(store.get("a").unwrap(), Some(b"2".to_vec()));
    assert!(store.delete("a").unwrap());
    assert!(!store.delete("a").unwrap());
    assert_eq!(store.get("a").unwrap(), None);
}

#[test]
fn wait_returns_values_set_later_by_other_clients() {
    let (server, store) = server();
    let addr = server.local_addr();
    let writers: Vec<_> = (0..4)
        .map(|i| {
            thread::spawn(move || {
                let store = Store::connect(addr, LONG).unwrap();
                store.set(&format!("k{i}"), format!("v{i}").as_bytes()).unwrap();
            })
        })
        .collect();
    let values = store.wait(&["k3", "k0", "k2", "k1"], LONG).unwrap();
    assert_eq!(values, [b"v3", b"v0", b"v2", b"v1"]);
    assert!(store.wait(&[], Duration::ZERO).unwrap().is_empty());
    for w in writers {
        w.join().unwrap();
    }
}

#[test]
fn a_long_wait_does_not_block_other_calls_on_the_same_client() {
    let (_server, store) = server();
    let store = Arc::new(store);
    let waiter = {
        let store = Arc::clone(&store);
        thread::spawn(move || store.wait(&["late"], LONG))
    };
    // Whether or not the wait holds the connection yet, the set gets through and releases it.
    thread::sleep(Duration::from_millis(20));
    store.set("late", b"here").unwrap();
    assert_eq!(store.get("late").unwrap(), Some(b"here".to_vec()));
    assert_eq!(joined(move || waiter.join().unwrap()).unwrap(), [b"here"]);
}

#[test]
fn wait_timeout_names_the_missing_keys() {
    let (server, store) = server();
    store.set("present", b"x").unwrap();
    let err = store.wait(&["present", "absent", "gone"], Duration::from_millis(50)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::StoreTimeout { .. }), "{msg}");
    assert!(msg.contains("keys `absent`, `gone` still missing"), "{msg}");
    assert!(!msg.contains("`present`"), "{msg}");
    assert!(msg.contains(&server.local_addr().to_string()), "{msg}");
    // The connection is still in step after a timeout.
    assert_eq!(store.get("present").unwrap(), Some(b"x".to_vec()));
}

#[test]
fn concurrent_adds_are_atomic() {
    const THREADS: i64 = 8;
    const ADDS: i64 = 50;
    let (server, store) = server();
    let store = Arc::new(store);
    let addr = server.local_addr();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let shared = Arc::clone(&store);
            thread::spawn(move || {
                // Half the threads share one client, half have their own connection.
                let own;
                let store = if t % 2 == 0 {
                    &*shared
                } else {
                    own = Store::connect(addr, LONG).unwrap();
                    &own
                };
                (0..ADDS).map(|_| store.add("n", 1).unwrap()).collect::<Vec<_>>()
            })
        })
        .collect();
    let seen: BTreeSet<i64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    assert_eq!(seen, (1..=THREADS * ADDS).collect());
    assert_eq!(store.add("n", -10).unwrap(), THREADS * ADDS - 10);
    assert_eq!(store.get("n").unwrap(), Some((THREADS * ADDS - 10).to_string().into_bytes()));
}

#[test]
fn add_refuses_values_that_are_not_integers() {
    let (_server, store) = server();
    store.set("s", b"abc").unwrap();
    let msg = store.add("s", 1).unwrap_err().to_string();
    assert!(msg.contains("add `s`") && msg.contains("not a decimal integer"), "{msg}");
    store.set("max", i64::MAX.to_string().as_bytes()).unwrap();
    let msg = store.add("max", 1).unwrap_err().to_string();
    assert!(msg.contains("overflows"), "{msg}");
    assert_eq!(store.add("s2", 5).unwrap(), 5);
}

#[test]
fn barriers_release_every_rank_and_can_follow_each_other() {
    const WORLD: usize = 4;
    let (server, _store) = server();
    let addr = server.local_addr();
    let ranks: Vec<_> = (0..WORLD)
        .map(|_| {
            thread::spawn(move || {
                let store = Store::connect(addr, LONG).unwrap();
                for round in 0..3 {
                    store.barrier(&format!("round{round}"), WORLD, LONG).unwrap();
                }
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap();
    }
}

#[test]
fn barrier_errors_say_who_is_missing() {
    let (_server, store) = server();
    let msg = store.barrier("lonely", 3, Duration::from_millis(50)).unwrap_err().to_string();
    assert!(
        msg.contains("barrier `lonely`") && msg.contains("2 of 3 ranks still missing"),
        "{msg}"
    );

    store.barrier("once", 1, LONG).unwrap();
    let msg = store.barrier("once", 1, LONG).unwrap_err().to_string();
    assert!(msg.contains("2 callers entered a barrier for 1 ranks"), "{msg}");

    let msg = store.barrier("empty", 0, LONG).unwrap_err().to_string();
    assert!(msg.contains("world size must be at least 1"), "{msg}");
}

#[test]
fn shutdown_while_waiting_fails_the_waiter() {
    let (server, store) = server();
    let addr = server.local_addr();
    let (started, is_started) = mpsc::channel();
    let waiter = thread::spawn(move || {
        started.send(()).unwrap();
        store.wait(&["never"], LONG * 10)
    });
    is_started.recv().unwrap();
    // Let the request reach the server; the outcome is the same if it does not.
    thread::sleep(Duration::from_millis(50));
    joined(move || server.shutdown());
    let err = joined(move || waiter.join().unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::StoreUnreachable { .. }), "{msg}");
    assert!(msg.contains("wait `never`") && msg.contains(&addr.to_string()), "{msg}");
}

#[test]
fn calls_after_the_server_is_gone_fail() {
    let (server, store) = server();
    store.set("k", b"v").unwrap();
    drop(server);
    for result in [store.get("k").map(drop), store.set("k", b"w"), store.add("n", 1).map(drop)] {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::StoreUnreachable { .. }), "{err}");
    }
}

#[test]
fn connect_to_a_closed_port_fails_after_the_timeout() {
    let port = free_port();
    let err = Store::connect(("127.0.0.1", port), Duration::from_millis(200)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::StoreConnect { .. }), "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
}

#[test]
fn connect_waits_for_a_server_that_starts_later() {
    let port = free_port();
    let client = thread::spawn(move || Store::connect(("127.0.0.1", port), LONG));
    thread::sleep(Duration::from_millis(100));
    let server = StoreServer::bind(("127.0.0.1", port)).unwrap();
    let store = joined(move || client.join().unwrap()).unwrap();
    store.set("late", b"ok").unwrap();
    assert_eq!(store.server_addr(), server.local_addr());
}

#[test]
fn bind_errors_name_the_address() {
    let (server, _store) = server();
    let addr = server.local_addr();
    let msg = StoreServer::bind(addr).unwrap_err().to_string();
    assert!(msg.contains(&addr.to_string()), "{msg}");
}

#[test]
fn rendezvous_store_serves_a_world_of_two() {
    let port = free_port();
    let rank =
        move |rank| Rendezvous { rank, world_size: 2, master_port: port, ..Rendezvous::single() };
    let rank1 = thread::spawn(move || {
        let (server, store) = rendezvous_store(&rank(1), LONG).unwrap();
        assert!(server.is_none());
        store.set("from1", b"hello").unwrap();
        store.barrier("done", 2, LONG).unwrap();
    });
    let (server, store) = rendezvous_store(&rank(0), LONG).unwrap();
    assert_eq!(server.as_ref().map(StoreServer::local_addr).map(|a| a.port()), Some(port));
    assert_eq!(store.wait(&["from1"], LONG).unwrap(), [b"hello"]);
    store.barrier("done", 2, LONG).unwrap();
    joined(move || rank1.join().unwrap());
}

#[test]
fn single_rank_store_binds_any_port() {
    let (server, store) = rendezvous_store(&Rendezvous::single(), LONG).unwrap();
    let server = server.unwrap();
    assert_ne!(server.local_addr().port(), 0);
    store.barrier("alone", 1, LONG).unwrap();
}

/// Environment variable that turns [`failpoint_child`] from a no-op into the real check.
#[cfg(feature = "failpoints")]
const CHILD: &str = "TPCTL_MESH_STORE_FAILPOINT_CHILD";

#[cfg(feature = "failpoints")]
#[test]
fn failpoint_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let (_server, store) = server();
    store.set("k", b"v").unwrap();
    let msg = store.get("k").unwrap_err().to_string();
    assert_eq!(msg, "injected failure at failpoint `store.get`");
    println!("failpoint-child-ok");
}

/// Failpoints are read once per process, so the check runs in a child process (this test
/// binary, running only [`failpoint_child`]).
#[cfg(feature = "failpoints")]
#[test]
fn store_get_failpoint_returns_an_error() {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "store::tests::failpoint_child", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env(failpoint::ENV, "store.get=error")
        .env_remove("RANK")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > LONG * 2 {
            let _ = child.kill();
            panic!("failpoint child did not exit");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(status.success() && out.contains("failpoint-child-ok"), "{status}: {out}");
}
