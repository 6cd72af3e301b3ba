//! Unit tests of the sleep/wakeup protocol: a real coordinator and real listener threads over
//! the in-memory transport (with fault injection) or TCP, with fake rank memory and a
//! recording engine that prove what ran, where, and in which order.

use super::transport::memory::{self, Fault, Faults, MemoryPeer};
use super::transport::{CoordinatorLink, LinkError};
use super::*;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// Every event of every rank, in the order it happened.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, e: String) {
        self.0.lock().unwrap().push(e);
    }
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn of(&self, rank: usize) -> Vec<String> {
        let p = format!("r{rank} ");
        self.all().into_iter().filter(|e| e.starts_with(&p)).collect()
    }
    fn count(&self, rank: usize, what: &str) -> usize {
        self.of(rank).iter().filter(|e| e.contains(what)).count()
    }
}

#[derive(Default)]
struct FakeState {
    asleep: BTreeSet<String>,
    fail_check: Option<String>,
    fail_release: Option<MemoryError>,
    fail_materialize: Option<MemoryError>,
    /// The probe does not drop on release (memory kept somewhere).
    leak: bool,
    /// Time each release or materialize takes.
    work: Duration,
    /// The next release panics after releasing its first tag.
    panic_release: bool,
    /// The level of the latest release.
    level: Option<u8>,
    /// The live checkpoint, the staged one, the one an update replaced.
    weights: (String, Option<String>, Option<String>),
    /// The next weight update fails (after changing nothing).
    fail_update: bool,
}

/// Rank memory with 1 MiB per tag; resident = 10 MiB + 1 MiB per awake tag.
struct Fake {
    rank: usize,
    log: Log,
    st: Mutex<FakeState>,
}

impl Fake {
    fn set(&self, f: impl FnOnce(&mut FakeState)) {
        f(&mut self.st.lock().unwrap());
    }
    fn asleep(&self) -> Vec<String> {
        self.st.lock().unwrap().asleep.iter().cloned().collect()
    }
}

impl RankMemory for Fake {
    fn check(&self, tags: &[String]) -> std::result::Result<(), Refusal> {
        match &self.st.lock().unwrap().fail_check {
            Some(e) => Err(Refusal::Busy(e.clone())),
            None if tags.iter().any(|t| t == "bogus") => {
                Err(Refusal::UnknownTag { tag: "bogus".into(), known: vec!["weights".into()] })
            }
            None => Ok(()),
        }
    }

    fn prepare_update(&self, model: &str) -> std::result::Result<(), Refusal> {
        if model.contains("other-shapes") {
            let detail = "other shapes".into();
            return Err(Refusal::Misfit { model: model.to_owned(), detail });
        }
        self.st.lock().unwrap().weights.1 = Some(model.to_owned());
        Ok(())
    }

    fn update(&self) -> std::result::Result<Vec<TagReceipt>, MemoryError> {
        let mut st = self.st.lock().unwrap();
        if std::mem::take(&mut st.fail_update) {
            return Err(MemoryError { changed: false, message: "disk read error".into() });
        }
        let staged = st.weights.1.take().expect("a staged update");
        let old = std::mem::replace(&mut st.weights.0, staged);
        st.weights.2 = Some(old);
        Ok(vec![TagReceipt { tag: "weights".into(), bytes: MIB, ..TagReceipt::default() }])
    }

    fn revert(&self) -> std::result::Result<Vec<TagReceipt>, MemoryError> {
        let mut st = self.st.lock().unwrap();
        let old = st.weights.2.take().expect("an update to revert");
        st.weights.0 = old;
        Ok(vec![TagReceipt { tag: "weights".into(), bytes: MIB, ..TagReceipt::default() }])
    }

    fn drop_update(&self) {
        self.st.lock().unwrap().weights.1 = None;
    }

    fn release_at(
        &self,
        tags: &[String],
        level: Option<u8>,
    ) -> std::result::Result<Vec<TagReceipt>, MemoryError> {
        self.st.lock().unwrap().level = level;
        self.release(tags)
    }

    fn release(&self, tags: &[String]) -> std::result::Result<Vec<TagReceipt>, MemoryError> {
        self.log.push(format!("r{} release {}", self.rank, tags.join(",")));
        let work = self.st.lock().unwrap().work;
        std::thread::sleep(work);
        let mut st = self.st.lock().unwrap();
        if std::mem::take(&mut st.panic_release) {
            st.asleep.insert(tags[0].clone());
            drop(st);
            panic!("release of {} on rank {} hit a bug", tags[0], self.rank);
        }
        if let Some(e) = st.fail_release.take() {
            if e.changed {
                st.asleep.insert(tags[0].clone());
            }
            return Err(e);
        }
        let out = tags
            .iter()
            .map(|t| TagReceipt {
                tag: t.clone(),
                allocations: usize::from(st.asleep.insert(t.clone())),
                bytes: if st.asleep.contains(t) { MIB } else { 0 },
                ..TagReceipt::default()
            })
            .collect();
        self.log.push(format!("r{} released", self.rank));
        Ok(out)
    }

    fn materialize(&self, tags: &[String]) -> std::result::Result<Vec<TagReceipt>, MemoryError> {
        self.log.push(format!("r{} materialize {}", self.rank, tags.join(",")));
        let work = self.st.lock().unwrap().work;
        std::thread::sleep(work);
        let mut st = self.st.lock().unwrap();
        if let Some(e) = st.fail_materialize.take() {
            return Err(e);
        }
        let out = tags
            .iter()
            .map(|t| {
                let moved = st.asleep.remove(t);
                TagReceipt {
                    tag: t.clone(),
                    allocations: usize::from(moved),
                    bytes: if moved { MIB } else { 0 },
                    ..TagReceipt::default()
                }
            })
            .collect();
        self.log.push(format!("r{} materialized", self.rank));
        Ok(out)
    }

    fn probe(&self) -> Probe {
        let st = self.st.lock().unwrap();
        let awake = 4 - st.asleep.len() as u64;
        let resident = if st.leak { 14 * MIB } else { 10 * MIB + awake * MIB };
        Probe { resident, ..Probe::default() }
    }
}

/// An engine that records quiesce and resume, optionally slow or failing.
struct Engine {
    rank: usize,
    log: Log,
    slow_first: Mutex<Option<Duration>>,
    fail: Mutex<Option<String>>,
    /// When set, the next quiesce says it started, then waits to be released.
    hold: Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
}

impl Quiesce for Engine {
    fn quiesce(&self, mode: QuiesceMode) -> std::result::Result<(), QuiesceError> {
        if let Some(d) = self.slow_first.lock().unwrap().take() {
            std::thread::sleep(d);
        }
        if let Some((started, release)) = self.hold.lock().unwrap().take() {
            started.send(()).unwrap();
            release.recv_timeout(Duration::from_secs(30)).expect("the test releases the quiesce");
        }
        if let Some(e) = self.fail.lock().unwrap().take() {
            return Err(QuiesceError::Engine(e.into()));
        }
        self.log.push(format!("r{} quiesce {mode:?}", self.rank));
        Ok(())
    }
    fn resume(&self) {
        self.log.push(format!("r{} resume", self.rank));
    }
}

struct World {
    coord: Arc<Coordinator>,
    listeners: Vec<ListenerHandle>,
    mem: Vec<Arc<Fake>>,
    engines: Vec<Arc<Engine>>,
    log: Log,
    faults: Faults,
    /// See [`SpyLock`].
    linger: Arc<Mutex<Option<Duration>>>,
}

fn tags(t: &[&str]) -> Vec<String> {
    t.iter().map(|s| s.to_string()).collect()
}

fn parts(n: usize, log: &Log) -> (Vec<Arc<Fake>>, Vec<Arc<Engine>>) {
    let mem = (0..n)
        .map(|rank| Arc::new(Fake { rank, log: log.clone(), st: Mutex::default() }))
        .collect();
    let engines = (0..n)
        .map(|rank| {
            Arc::new(Engine {
                rank,
                log: log.clone(),
                slow_first: Mutex::new(None),
                fail: Mutex::new(None),
                hold: Mutex::new(None),
            })
        })
        .collect();
    (mem, engines)
}

/// A sleep/wakeup lock that logs when it is taken and given back; `linger` holds up the
/// next caller that gives it back, right after it did (the window between an operation's
/// end and its caller's return).
struct SpyLock {
    inner: LocalLock,
    log: Log,
    linger: Arc<Mutex<Option<Duration>>>,
}

impl OpLock for SpyLock {
    fn acquire(&self) {
        self.inner.acquire();
        self.log.push("lock taken".into());
    }
    fn try_acquire(&self) -> bool {
        let took = self.inner.try_acquire();
        if took {
            self.log.push("lock taken (try)".into());
        }
        took
    }
    fn release(&self) {
        self.log.push("lock given back".into());
        self.inner.release();
        let linger = self.linger.lock().unwrap().take();
        if let Some(d) = linger {
            std::thread::sleep(d);
        }
    }
}

/// Rank 0's end of the in-memory transport, logging every ACK it receives
/// (`"link got prepare ack 3 from r1"`) and every closed peer.
struct SpyLink {
    inner: memory::MemoryCoordinator,
    log: Log,
}

impl CoordinatorLink for SpyLink {
    fn peers(&self) -> Vec<usize> {
        self.inner.peers()
    }
    fn send(&self, rank: usize, msg: &Message) -> std::result::Result<(), LinkError> {
        self.inner.send(rank, msg)
    }
    fn recv(&self, deadline: Instant) -> Option<transport::Incoming> {
        let got = self.inner.recv(deadline);
        match &got {
            Some(transport::Incoming::Frame { rank, msg }) => {
                self.log.push(format!("link got {} ack {} from r{rank}", msg.phase, msg.op_id))
            }
            Some(transport::Incoming::Closed { rank, .. }) => {
                self.log.push(format!("link closed r{rank}"));
            }
            None => {}
        }
        got
    }
}

/// A world of `n` ranks over the in-memory transport; `serve` says which peers run a
/// listener (the others keep their end open and never answer).
fn world_with(n: usize, ack_timeout: Duration, serve: impl Fn(usize) -> bool) -> World {
    let log = Log::default();
    let faults = Faults::default();
    let (link, peers) = memory::world(n, faults.clone());
    let link = SpyLink { inner: link, log: log.clone() };
    let (mem, engines) = parts(n, &log);
    let mut listeners = Vec::new();
    let mut silent = Vec::new();
    for p in peers {
        let r = p.rank();
        if serve(r) {
            listeners
                .push(listener::spawn(r, p, mem[r].clone(), engines[r].clone()).expect("spawn"));
        } else {
            silent.push(p);
        }
    }
    // Silent peers stay connected for the test's life.
    std::mem::forget(silent);
    let linger = Arc::new(Mutex::new(None));
    let lock = SpyLock { inner: LocalLock::default(), log: log.clone(), linger: linger.clone() };
    let coord = Coordinator::new(
        link,
        mem[0].clone(),
        engines[0].clone(),
        CoordinatorOptions { ack_timeout },
    )
    .with_lock(Arc::new(lock));
    World { coord: Arc::new(coord), listeners, mem, engines, log, faults, linger }
}

fn world(n: usize) -> World {
    world_with(n, Duration::from_secs(10), |_| true)
}

impl World {
    fn shutdown(mut self) {
        self.coord.shutdown().expect("shutdown");
        for l in &mut self.listeners {
            assert_eq!(l.join(Duration::from_secs(10)).expect("join"), ListenerExit::Shutdown);
        }
    }
}

fn ranks_of(e: &Error) -> Vec<usize> {
    e.failures().iter().map(|f| f.rank).collect()
}

#[test]
fn sleep_then_wakeup_quiesces_first_and_resumes_last_on_every_rank() {
    let w = world(3);
    let r = w.coord.sleep(&tags(&["weights", "kv_cache"]), OpOptions::default()).unwrap();
    assert_eq!(r.ranks.len(), 3);
    for (rank, rr) in r.ranks.iter().enumerate() {
        assert_eq!(rr.rank, rank);
        assert_eq!(rr.bytes(), 2 * MIB);
        assert_eq!(rr.tags.len(), 2);
        assert_eq!(rr.before.resident - rr.after.resident, 2 * MIB);
    }
    assert_eq!(w.coord.state(), DeploymentState::Sleeping(tags(&["kv_cache", "weights"])));
    let r = w.coord.wakeup(&tags(&["weights", "kv_cache"]), OpOptions::default()).unwrap();
    assert_eq!(r.bytes(), 6 * MIB);
    assert_eq!(w.coord.state(), DeploymentState::Running);
    for rank in 0..3 {
        assert_eq!(
            w.log.of(rank),
            vec![
                format!("r{rank} quiesce Wait"),
                format!("r{rank} release weights,kv_cache"),
                format!("r{rank} released"),
                format!("r{rank} materialize weights,kv_cache"),
                format!("r{rank} materialized"),
                format!("r{rank} resume"),
            ]
        );
    }
    // Rank 0 quiesces before any peer hears of the operation, and releases only after every
    // peer prepared (quiesced).
    let all = w.log.all();
    let pos = |e: &str| all.iter().position(|x| x == e).unwrap();
    assert!(pos("r0 quiesce Wait") < pos("r1 quiesce Wait"));
    assert!(pos("r2 quiesce Wait") < pos("r0 release weights,kv_cache"));
    w.shutdown();
}

#[test]
fn two_concurrent_callers_are_serialized() {
    let w = world(2);
    for m in &w.mem {
        m.set(|s| s.work = Duration::from_millis(20));
    }
    let threads: Vec<_> = ["weights", "kv_cache"]
        .into_iter()
        .map(|t| {
            let c = w.coord.clone();
            std::thread::spawn(move || c.sleep(&tags(&[t]), OpOptions::default()))
        })
        .collect();
    let ids: BTreeSet<u64> =
        threads.into_iter().map(|t| t.join().unwrap().unwrap().op_id).collect();
    assert_eq!(ids, BTreeSet::from([1, 2]));
    // Each operation finished on every rank before the other began anywhere.
    let memory_events: Vec<String> =
        w.log.all().into_iter().filter(|e| e.contains("release")).collect();
    let first = if memory_events[0].ends_with("weights") { "weights" } else { "kv_cache" };
    let first_done = memory_events.iter().rposition(|e| e.ends_with(first)).unwrap();
    let second_begin =
        memory_events.iter().position(|e| !e.ends_with(first) && !e.ends_with("released")).unwrap();
    assert!(first_done < second_begin, "{memory_events:?}");
    assert_eq!(w.log.count(0, "quiesce"), 1);
    w.shutdown();
}

#[test]
fn one_peer_error_ack_surfaces_its_detail_and_nothing_changes() {
    let w = world(3);
    w.mem[2].set(|s| s.fail_check = Some("tag `weights` is pinned by a graph capture".into()));
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![2]);
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    let text = e.to_string();
    assert!(text.contains("rank 2 (prepare)"), "{text}");
    assert!(text.contains("pinned by a graph capture"), "{text}");
    assert!(w.log.all().iter().all(|e| !e.contains("release")));
    // The engines that were quiesced for it run again.
    for rank in [0, 1] {
        assert_eq!(w.log.of(rank).last().unwrap(), &format!("r{rank} resume"));
    }
    assert_eq!(w.coord.state(), DeploymentState::Running);
    w.shutdown();
}

#[test]
fn two_of_three_peers_failing_both_appear_and_the_rest_roll_back() {
    let w = world(4);
    for r in [1, 3] {
        w.mem[r].set(|s| {
            s.fail_release = Some(MemoryError {
                changed: false,
                message: format!("spill directory full on rank {r}"),
            })
        });
    }
    let e = w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![1, 3]);
    assert_eq!(e.outcome(), Some(Outcome::RolledBack));
    let text = e.to_string();
    assert!(text.contains("spill directory full on rank 1"), "{text}");
    assert!(text.contains("spill directory full on rank 3"), "{text}");
    for r in [0, 2] {
        assert_eq!(w.log.count(r, "materialize kv_cache"), 1, "{:?}", w.log.of(r));
    }
    for m in &w.mem {
        assert!(m.asleep().is_empty());
    }
    assert_eq!(w.coord.state(), DeploymentState::Running);
    w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    w.shutdown();
}

#[test]
fn a_prepare_send_failing_part_way_aborts_the_prepared_without_a_local_operation() {
    let w = world(4);
    w.faults.arm(Fault::FailSend { rank: 2, phase: Phase::Prepare });
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![2]);
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    assert!(e.to_string().contains("send of prepare to rank 2 failed"), "{e}");
    assert_eq!(w.log.count(0, "release"), 0);
    // Rank 1 was prepared and got the ABORT; ranks 2 and 3 never heard of the operation.
    assert_eq!(w.log.of(1), vec!["r1 quiesce Wait".to_string(), "r1 resume".to_string()]);
    assert!(w.log.of(2).is_empty() && w.log.of(3).is_empty());
    // Every ACK was drained: the next operation gets only its own.
    let r = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    assert_eq!(r.op_id, 2);
    assert_eq!(r.bytes(), 4 * MIB);
    w.shutdown();
}

#[test]
fn an_ack_that_never_arrives_is_bounded() {
    let w = world_with(3, Duration::from_secs(1), |_| true);
    w.faults.arm(Fault::DropAck { rank: 1, phase: Phase::Prepare });
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![1]);
    assert!(e.to_string().contains("no prepare ack from rank 1 within 1.0 s"), "{e}");
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    assert!(w.log.all().iter().all(|e| !e.contains("release")));
    w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    w.shutdown();
}

#[test]
fn a_commit_send_failure_aborts_the_uncommitted_and_rolls_back_the_committed() {
    let w = world(4);
    w.faults.arm(Fault::FailSend { rank: 2, phase: Phase::Commit });
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![2]);
    assert_eq!(e.outcome(), Some(Outcome::RolledBack));
    // Rank 0 and rank 1 released, then were rolled back.
    for r in [0, 1] {
        assert_eq!(w.log.count(r, "release weights"), 1);
        assert_eq!(w.log.count(r, "materialize weights"), 1);
    }
    // Ranks 2 (its COMMIT failed) and 3 (never sent) were aborted: no memory touched.
    for r in [2, 3] {
        assert_eq!(w.log.of(r), vec![format!("r{r} quiesce Wait"), format!("r{r} resume")]);
    }
    assert!(w.mem.iter().all(|m| m.asleep().is_empty()));
    assert_eq!(w.coord.state(), DeploymentState::Running);
    w.shutdown();
}

#[test]
fn a_failed_rollback_stops_the_deployment() {
    let mut w = world(3);
    w.mem[2].set(|s| {
        s.fail_release = Some(MemoryError { changed: false, message: "backup failed".into() })
    });
    w.mem[1].set(|s| {
        s.fail_materialize = Some(MemoryError { changed: false, message: "out of memory".into() })
    });
    let e = w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap_err();
    assert_eq!(e.outcome(), Some(Outcome::FailStop));
    let text = e.to_string();
    assert!(text.contains("rank 1 (rollback)") && text.contains("out of memory"), "{text}");
    assert!(text.contains("rank 2 (commit)") && text.contains("backup failed"), "{text}");
    assert!(matches!(w.coord.state(), DeploymentState::Failed(_)));
    let again = w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap_err();
    assert!(matches!(again, Error::DeploymentFailed { .. }), "{again}");
    for l in &mut w.listeners {
        let exit = l.join(Duration::from_secs(10)).unwrap_err();
        assert!(matches!(exit, Error::FailStop { .. }), "{exit}");
    }
}

#[test]
fn a_local_failure_on_rank_0_still_drains_the_peers() {
    let w = world(3);
    w.mem[0].set(|s| {
        s.fail_release = Some(MemoryError { changed: false, message: "rank 0 guard busy".into() })
    });
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![0]);
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    for r in [1, 2] {
        assert_eq!(w.log.of(r), vec![format!("r{r} quiesce Wait"), format!("r{r} resume")]);
    }
    let r = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    assert_eq!(r.op_id, 2);
    w.shutdown();
}

#[test]
fn a_partial_local_release_is_undone_before_the_abort() {
    let w = world(2);
    w.mem[0].set(|s| {
        s.fail_release = Some(MemoryError { changed: true, message: "unmap failed".into() })
    });
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    assert!(e.to_string().contains("partial change undone"), "{e}");
    assert!(w.mem[0].asleep().is_empty());
    assert_eq!(w.log.count(1, "release"), 0);
    w.shutdown();
}

#[test]
fn rank_0_and_a_peer_failing_together_are_both_reported() {
    let w = world(3);
    w.mem[0].set(|s| s.fail_check = Some("rank 0 says no".into()));
    w.mem[2].set(|s| s.fail_check = Some("rank 2 says no".into()));
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![0, 2]);
    let text = e.to_string();
    assert!(text.contains("rank 0 says no") && text.contains("rank 2 says no"), "{text}");
    w.shutdown();
}

#[test]
fn stale_acks_of_an_earlier_op_are_ignored() {
    let w = world_with(3, Duration::from_secs(2), |_| true);
    // Rank 1's PREPARE ACK of op 1 is held back until rank 0 gave up on it.
    w.faults.arm(Fault::HoldAck { rank: 1, phase: Phase::Prepare });
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![1]);
    assert!(e.to_string().contains("no prepare ack from rank 1"), "{e}");
    assert_eq!(w.faults.held(), 1);
    // The late ACK reaches rank 0 before anything of op 2, and a stale COMMIT ACK with op 1's
    // id comes right before rank 2's real one: op 2's drains see both first and must not count
    // them (the stale one says Failed and carries no receipt).
    assert_eq!(w.faults.deliver_held(), 1);
    w.faults.arm(Fault::StaleAck { rank: 2, phase: Phase::Commit, op_id: 1 });
    let r = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    assert_eq!(r.op_id, 2);
    assert_eq!(r.bytes(), 3 * MIB);
    assert!(w.mem.iter().all(|m| m.asleep() == tags(&["weights"])));
    let all = w.log.all();
    let pos = |e: &str| all.iter().position(|x| x == e).unwrap_or_else(|| panic!("{e}: {all:?}"));
    assert!(pos("link got prepare ack 1 from r1") < pos("link got prepare ack 2 from r1"));
    assert!(pos("link got commit ack 1 from r2") < pos("link got commit ack 2 from r2"));
    w.shutdown();
}

#[test]
fn an_ack_of_the_wrong_phase_is_dropped() {
    let w = world(3);
    // Rank 1 sends a failed "commit" ACK of op 1 while rank 0 waits for PREPARE ACKs, and
    // rank 2 a failed "prepare" ACK while it waits for COMMIT ACKs: neither is an answer.
    w.faults.arm(Fault::WrongPhaseAck { rank: 1, phase: Phase::Prepare, sent_as: Phase::Commit });
    w.faults.arm(Fault::WrongPhaseAck { rank: 2, phase: Phase::Commit, sent_as: Phase::Prepare });
    let r = w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    assert_eq!(r.ranks.len(), 3, "every rank's receipt: {r:?}");
    assert_eq!(r.bytes(), 3 * MIB);
    let all = w.log.all();
    let pos = |e: &str| all.iter().position(|x| x == e).unwrap_or_else(|| panic!("{e}: {all:?}"));
    // Both strays reached rank 0 before the real ACKs that followed them.
    assert!(pos("link got commit ack 1 from r1") < pos("link got prepare ack 1 from r1"));
    assert!(pos("link got prepare ack 1 from r2") < pos("link got commit ack 1 from r2"));
    assert!(w.mem.iter().all(|m| m.asleep() == tags(&["kv_cache"])));
    w.shutdown();
}

#[test]
fn every_prepare_and_abort_ack_is_received_before_the_error_is_raised() {
    let w = world(3);
    // Rank 1 refuses at once; rank 2 prepares slowly. The error must wait for rank 2's
    // PREPARE ACK and then for both ABORT ACKs, so no answer of this op is left in flight.
    w.mem[1].set(|s| s.fail_check = Some("tag `weights` is busy".into()));
    *w.engines[2].slow_first.lock().unwrap() = Some(Duration::from_millis(300));
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    w.log.push("error raised".into());
    assert_eq!(ranks_of(&e), vec![1]);
    assert_drained_before_the_error(&w);
    assert!(w.mem.iter().all(|m| m.asleep().is_empty()));
    w.shutdown();
}

/// Every PREPARE and ABORT ACK of op 1 from ranks 1 and 2 reached rank 0 before the test
/// logged "error raised", and the lock was given back only after the last one.
fn assert_drained_before_the_error(w: &World) {
    let all = w.log.all();
    let pos = |e: &str| all.iter().position(|x| x == e).unwrap_or_else(|| panic!("{e}: {all:?}"));
    let raised = pos("error raised");
    for ack in [
        "link got prepare ack 1 from r1",
        "link got prepare ack 1 from r2",
        "link got abort ack 1 from r1",
        "link got abort ack 1 from r2",
    ] {
        assert!(pos(ack) < raised, "{ack} came after the error: {all:?}");
    }
    assert!(pos("link got abort ack 1 from r2") < pos("lock given back"));
}

/// The same order when rank 0's own local operation fails after every peer prepared: the
/// error waits for every PREPARE ACK and then for the ABORT ACKs of the prepared peers.
#[test]
fn every_ack_is_received_before_rank_0s_own_failure_is_raised() {
    let w = world(3);
    *w.engines[2].slow_first.lock().unwrap() = Some(Duration::from_millis(300));
    w.mem[0].set(|s| {
        s.fail_release = Some(MemoryError { changed: false, message: "spill disk full".into() })
    });
    let e = w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap_err();
    w.log.push("error raised".into());
    assert_eq!(ranks_of(&e), vec![0]);
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    assert_drained_before_the_error(&w);
    assert!(w.mem.iter().all(|m| m.asleep().is_empty()));
    w.shutdown();
}

/// Two weight updates racing: the live checkpoint is the one of the update the lock let run
/// last. (It was recorded after the lock was given back, so an update that lingered there
/// overwrote the later one's.)
#[test]
fn racing_updates_leave_the_checkpoint_of_the_last_to_run() {
    let w = world(2);
    // The first update to finish lingers after giving the lock back; the other runs then.
    *w.linger.lock().unwrap() = Some(Duration::from_millis(300));
    let race: Vec<_> = ["a.gguf", "b.gguf"]
        .into_iter()
        .map(|m| {
            let coord = w.coord.clone();
            std::thread::spawn(move || {
                (m, coord.update_weights(&WeightUpdate::from_checkpoint(m), OpOptions::default()))
            })
        })
        .collect();
    let done: Vec<(&str, OpReceipt)> =
        race.into_iter().map(|t| t.join().unwrap()).map(|(m, r)| (m, r.unwrap())).collect();
    let last = done.iter().max_by_key(|(_, r)| r.op_id).unwrap().0;
    assert_eq!(w.coord.checkpoint().as_deref(), Some(last));
    w.shutdown();
}

/// Every tag asleep in `state`, or every tag when none is (the control socket's rule for a
/// wakeup that names none).
fn asleep_or_all(state: &DeploymentState) -> Vec<String> {
    match state {
        DeploymentState::Sleeping(t) | DeploymentState::Waking(t) if !t.is_empty() => t.clone(),
        _ => tags(&["weights", "kv_cache"]),
    }
}

/// Waits until the sleep/wakeup lock was taken `n` times.
fn lock_taken(w: &World, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while w.log.all().iter().filter(|e| *e == "lock taken").count() < n {
        assert!(Instant::now() < deadline, "the lock was not taken {n} times");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A wakeup that names no tag, asked while a sleep holds the lock, wakes what is asleep once
/// it runs: the sleep's tags too. (Resolved when asked, it woke only the tags asleep then and
/// reported success with the sleep's tags still asleep.)
#[test]
fn a_tagless_wakeup_racing_a_sleep_wakes_what_the_sleep_released() {
    let w = world(2);
    w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    w.mem.iter().for_each(|m| m.set(|s| s.work = Duration::from_millis(200)));
    let coord = w.coord.clone();
    let sleep = std::thread::spawn(move || coord.sleep(&tags(&["weights"]), OpOptions::default()));
    lock_taken(&w, 2);
    let woken = w.coord.wakeup_resolved(asleep_or_all, OpOptions::default()).unwrap();
    let slept = sleep.join().unwrap().unwrap();
    assert!(slept.op_id < woken.op_id, "the sleep held the lock first");
    assert_eq!(woken.tags, tags(&["kv_cache", "weights"]));
    assert_eq!(w.coord.state(), DeploymentState::Running);
    assert!(w.mem.iter().all(|m| m.asleep().is_empty()));
    w.shutdown();
}

/// A wakeup from a checkpoint is one operation: a sleep asked meanwhile runs before the
/// update or after the wakeup, never between them, and the state agrees with that order.
#[test]
fn a_wakeup_from_a_checkpoint_racing_a_sleep_is_one_operation() {
    let w = world(2);
    w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    w.mem.iter().for_each(|m| m.set(|s| s.work = Duration::from_millis(100)));
    // Whoever gives the lock back first lingers: with two lock holds, the sleep would run
    // between the update and the wakeup.
    *w.linger.lock().unwrap() = Some(Duration::from_millis(300));
    let coord = w.coord.clone();
    let wake = std::thread::spawn(move || {
        coord.wakeup_from(
            &WeightUpdate::from_checkpoint("new.gguf"),
            asleep_or_all,
            OpOptions::default(),
        )
    });
    lock_taken(&w, 2);
    let slept = w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    let (updated, woken) = wake.join().unwrap().unwrap();
    assert_eq!(woken.op_id, updated.op_id + 1, "nothing ran between the update and the wakeup");
    assert!(woken.op_id < slept.op_id);
    assert_eq!(w.coord.checkpoint().as_deref(), Some("new.gguf"));
    assert_eq!(w.coord.state(), DeploymentState::Sleeping(tags(&["kv_cache"])));
    // Refused while the weights are awake, before anything runs.
    let e = w
        .coord
        .wakeup_from(
            &WeightUpdate::from_checkpoint("other.gguf"),
            asleep_or_all,
            OpOptions::default(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::WeightsAwake { .. }), "{e}");
    assert_eq!(w.coord.checkpoint().as_deref(), Some("new.gguf"));
    w.shutdown();
}

/// The events of `log` that are not a peer's, in order: the lock's, rank 0's and the link's.
fn rank0_view(log: &Log) -> Vec<String> {
    log.all().into_iter().filter(|e| !e.starts_with('r') || e.starts_with("r0 ")).collect()
}

#[test]
fn the_lock_is_held_from_before_the_quiesce_until_after_the_last_ack() {
    let w = world(3);
    w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    // A failing operation gives it back too, after its ABORTs.
    w.mem[2].set(|s| s.fail_check = Some("no".into()));
    w.coord.wakeup(&tags(&["kv_cache"]), OpOptions::default()).unwrap_err();
    w.mem[2].set(|s| s.fail_check = None);
    w.coord.wakeup(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    let view = rank0_view(&w.log);
    let ack = |phase: &str, op: u64, rank: usize| format!("link got {phase} ack {op} from r{rank}");
    let mut want = vec!["lock taken".to_string(), "r0 quiesce Wait".into()];
    want.extend([ack("prepare", 1, 1), ack("prepare", 1, 2)]);
    want.extend(["r0 release kv_cache".into(), "r0 released".into()]);
    want.extend([ack("commit", 1, 1), ack("commit", 1, 2), "lock given back".into()]);
    // Op 2 fails in PREPARE on rank 2: ABORT to both, then the lock.
    want.push("lock taken".into());
    want.extend([ack("prepare", 2, 1), ack("prepare", 2, 2)]);
    want.extend([ack("abort", 2, 1), ack("abort", 2, 2), "lock given back".into()]);
    want.push("lock taken".into());
    want.extend([ack("prepare", 3, 1), ack("prepare", 3, 2)]);
    want.extend(["r0 materialize kv_cache".into(), "r0 materialized".into()]);
    want.extend([ack("commit", 3, 1), ack("commit", 3, 2), "r0 resume".into()]);
    want.push("lock given back".into());
    // Peers answer in any order: compare each phase's ACKs as a set.
    fn phase(e: &str) -> Option<&str> {
        e.strip_prefix("link got ").and_then(|e| e.split(" from").next())
    }
    let norm = |mut v: Vec<String>| {
        for acks in v.chunk_by_mut(|a, b| phase(a).is_some() && phase(a) == phase(b)) {
            acks.sort();
        }
        v
    };
    assert_eq!(norm(view), norm(want));
    w.shutdown();
}

#[test]
fn a_single_rank_takes_the_lock_for_sleep_and_for_wakeup() {
    let w = world(1);
    w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    w.coord.wakeup(&tags(&["weights"]), OpOptions::default()).unwrap();
    assert_eq!(
        w.log.all(),
        [
            "lock taken",
            "r0 quiesce Wait",
            "r0 release weights",
            "r0 released",
            "lock given back",
            "lock taken",
            "r0 materialize weights",
            "r0 materialized",
            "r0 resume",
            "lock given back",
        ]
    );
    w.shutdown();
}

#[test]
fn sleeping_tags_already_asleep_gives_a_zero_receipt() {
    let w = world(2);
    w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    let r = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    assert_eq!((r.op_id, r.bytes(), r.ranks.len()), (0, 0, 2));
    assert_eq!(w.log.count(1, "release weights"), 1);
    let r = w.coord.wakeup(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    assert_eq!(r.bytes(), 0);
    w.shutdown();
}

#[test]
fn verify_fails_when_one_rank_leaks_even_if_the_others_release() {
    let w = world(3);
    w.mem[2].set(|s| s.leak = true);
    let opts = OpOptions { verify: true, ..OpOptions::default() };
    let e = w.coord.sleep(&tags(&["weights", "kv_cache"]), opts).unwrap_err();
    assert!(matches!(e, Error::Verify { .. }), "{e}");
    assert_eq!(ranks_of(&e), vec![2]);
    assert!(
        e.to_string().contains(
            "released 2097152 tagged host bytes but its resident memory dropped by only 0 bytes"
        ),
        "{e}"
    );
    assert_eq!(e.outcome(), Some(Outcome::RolledBack));
    assert!(w.mem.iter().all(|m| m.asleep().is_empty()));
    w.mem[2].set(|s| s.leak = false);
    w.coord.sleep(&tags(&["weights"]), opts).unwrap();
    w.shutdown();
}

#[test]
fn a_status_reports_every_ranks_asleep_tags() {
    let w = world(2);
    w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    let s = w.coord.status().unwrap();
    assert_eq!(s.state, DeploymentState::Sleeping(tags(&["kv_cache"])));
    assert_eq!(
        s.ranks.iter().map(|r| r.asleep.clone()).collect::<Vec<_>>(),
        vec![tags(&["kv_cache"]); 2]
    );
    w.shutdown();
}

/// A status whose ACK came too late is not answered by it later: each status has its own op
/// id (all used 0, so the stale ACK, taken before the sleep, answered the next status).
#[test]
fn a_late_status_ack_does_not_answer_the_next_status() {
    let w = world_with(2, Duration::from_millis(300), |_| true);
    w.faults.arm(Fault::HoldAck { rank: 1, phase: Phase::Status });
    let first = w.coord.status().unwrap();
    assert_eq!(first.failures.iter().map(|f| f.rank).collect::<Vec<_>>(), vec![1]);
    w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    assert_eq!(w.faults.deliver_held(), 1, "rank 1's answer to the first status arrives now");
    let second = w.coord.status().unwrap();
    assert!(second.failures.is_empty(), "{:?}", second.failures);
    let rank_1 = second.ranks.iter().find(|r| r.rank == 1).unwrap();
    assert_eq!(rank_1.asleep, tags(&["kv_cache"]), "the answer to this status, not the stale one");
    w.shutdown();
}

#[test]
fn a_single_rank_runs_the_same_path() {
    let w = world(1);
    let r = w
        .coord
        .sleep(&tags(&["weights"]), OpOptions { verify: true, ..Default::default() })
        .unwrap();
    assert_eq!(r.ranks.len(), 1);
    w.coord.wakeup(&tags(&["weights"]), OpOptions::default()).unwrap();
    assert_eq!(w.log.of(0).first().unwrap(), "r0 quiesce Wait");
    w.shutdown();
}

#[test]
fn rank_0s_shutdown_drain_is_bounded() {
    let mut w = world_with(3, Duration::from_secs(1), |r| r != 2);
    let e = w.coord.shutdown().unwrap_err();
    assert!(e.to_string().contains("no shutdown ack from rank 2 within 1.0 s"), "{e}");
    assert_eq!(w.listeners[0].join(Duration::from_secs(10)).unwrap(), ListenerExit::Shutdown);
}

/// A peer driven by hand: rank 0's end of a 2-rank world and the listener of rank 1.
fn one_peer() -> (memory::MemoryCoordinator, ListenerHandle, Arc<Fake>, Log) {
    let log = Log::default();
    let (link, mut peers) = memory::world(2, Faults::default());
    let (mem, engines) = parts(2, &log);
    let peer: MemoryPeer = peers.remove(0);
    let h = listener::spawn(1, peer, mem[1].clone(), engines[1].clone()).unwrap();
    (link, h, mem[1].clone(), log)
}

fn ask(link: &memory::MemoryCoordinator, op_id: u64, phase: Phase) -> Message {
    let msg = Message::request(op_id, phase, Some(Action::Sleep), &tags(&["weights"]));
    link.send(1, &msg).unwrap();
    match link.recv(Instant::now() + Duration::from_secs(10)) {
        Some(transport::Incoming::Frame { msg, .. }) => *msg,
        other => panic!("no answer to {phase}: {other:?}"),
    }
}

#[test]
fn prepare_never_changes_memory() {
    let (link, mut h, mem, log) = one_peer();
    let before = mem.probe();
    let ack = ask(&link, 1, Phase::Prepare);
    assert!(ack.answers(1, Phase::Prepare) && ack.status == Status::Ok, "{ack:?}");
    assert_eq!(mem.probe(), before);
    assert_eq!(log.of(1), vec!["r1 quiesce Wait".to_string()]);
    assert_eq!(ask(&link, 0, Phase::Shutdown).status, Status::Ok);
    h.join(Duration::from_secs(10)).unwrap();
}

#[test]
fn abort_releases_only_the_matching_request() {
    let (link, mut h, mem, log) = one_peer();
    assert_eq!(ask(&link, 5, Phase::Prepare).status, Status::Ok);
    assert_eq!(ask(&link, 4, Phase::Abort).status, Status::Ok);
    assert_eq!(log.of(1), vec!["r1 quiesce Wait".to_string()]);
    assert_eq!(ask(&link, 5, Phase::Abort).status, Status::Ok);
    assert_eq!(log.of(1), vec!["r1 quiesce Wait".to_string(), "r1 resume".to_string()]);
    let ack = ask(&link, 5, Phase::Commit);
    assert_eq!(ack.status, Status::Failed);
    assert_eq!(ack.error.as_deref(), Some("commit of op 5: that op is not prepared on this rank"));
    assert!(mem.asleep().is_empty());
    ask(&link, 0, Phase::Shutdown);
    h.join(Duration::from_secs(10)).unwrap();
}

#[test]
fn an_early_abort_is_recorded_and_consumed() {
    let (link, mut h, _mem, log) = one_peer();
    assert_eq!(ask(&link, 7, Phase::Abort).status, Status::Ok);
    let ack = ask(&link, 7, Phase::Prepare);
    assert_eq!(ack.status, Status::Aborted);
    assert!(log.of(1).is_empty(), "the aborted prepare must not quiesce");
    // Consumed: it does not swallow a later request.
    assert_eq!(ask(&link, 8, Phase::Prepare).status, Status::Ok);
    assert_eq!(ask(&link, 8, Phase::Commit).status, Status::Ok);
    ask(&link, 0, Phase::Shutdown);
    h.join(Duration::from_secs(10)).unwrap();
}

#[test]
fn the_shutdown_ack_is_sent_before_the_listener_exits() {
    let (link, mut h, _mem, _log) = one_peer();
    let ack = ask(&link, 0, Phase::Shutdown);
    assert!(ack.answers(0, Phase::Shutdown));
    assert_eq!(h.join(Duration::from_secs(10)).unwrap(), ListenerExit::Shutdown);
    // After it exits, its end is closed.
    match link.recv(Instant::now() + Duration::from_secs(10)) {
        Some(transport::Incoming::Closed { rank: 1, .. }) => {}
        other => panic!("expected the closed end of rank 1, got {other:?}"),
    }
}

#[test]
fn a_listener_whose_coordinator_goes_away_names_rank_0() {
    let (link, mut h, _mem, _log) = one_peer();
    drop(link);
    let e = h.join(Duration::from_secs(10)).unwrap_err();
    assert_eq!(e.to_string(), "control channel (rank 1): rank 0 closed the in-memory channel");
}

#[test]
fn the_tcp_channel_runs_the_protocol_between_threads() {
    let server = mesh::StoreServer::bind(("127.0.0.1", 0)).unwrap();
    let addr = server.local_addr();
    let log = Log::default();
    let (mem, engines) = parts(3, &log);
    let peers: Vec<_> = (1..3)
        .map(|rank| {
            let (m, e): (Arc<dyn RankMemory>, Arc<dyn Quiesce>) =
                (mem[rank].clone(), engines[rank].clone());
            std::thread::spawn(move || {
                let store = mesh::Store::connect(addr, Duration::from_secs(10)).unwrap();
                match start(
                    &store,
                    rank,
                    3,
                    "127.0.0.1",
                    m,
                    e,
                    CoordinatorOptions::default(),
                    Duration::from_secs(10),
                )
                .unwrap()
                {
                    ControlPlane::Listener(mut h) => h.join(Duration::from_secs(30)),
                    ControlPlane::Coordinator(_) => unreachable!("rank {rank} is a peer"),
                }
            })
        })
        .collect();
    let store = mesh::Store::connect(addr, Duration::from_secs(10)).unwrap();
    let ControlPlane::Coordinator(c) = start(
        &store,
        0,
        3,
        "127.0.0.1",
        mem[0].clone(),
        engines[0].clone(),
        CoordinatorOptions::default(),
        Duration::from_secs(10),
    )
    .unwrap() else {
        unreachable!("rank 0 coordinates")
    };
    let r = c
        .sleep(&tags(&["weights", "kv_cache"]), OpOptions { verify: true, ..Default::default() })
        .unwrap();
    assert_eq!(r.bytes(), 6 * MIB);
    assert_eq!(r.ranks[2].asleep, tags(&["kv_cache", "weights"]));
    let e = c.sleep(&tags(&["bogus"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![0, 1, 2]);
    c.wakeup(&tags(&["weights", "kv_cache"]), OpOptions::default()).unwrap();
    assert_eq!(c.status().unwrap().ranks.len(), 3);
    c.shutdown().unwrap();
    for p in peers {
        assert_eq!(p.join().unwrap().unwrap(), ListenerExit::Shutdown);
    }
    assert!(mem.iter().all(|m| m.asleep().is_empty()));
}

/// A rank that released a few host pages (a GPU rank keeps most of its tagged bytes on the
/// device) is not called leaking because its resident memory grew by less than
/// [`VERIFY_SLACK`] meanwhile; a rank whose resident memory grew by more is.
#[test]
fn verify_tolerates_probe_noise_below_the_slack() {
    let receipt = |rank, grew: u64| RankReceipt {
        rank,
        tags: vec![TagReceipt { tag: "kv_cache".into(), bytes: 80 << 10, ..TagReceipt::default() }],
        before: Probe { resident: 50 * MIB, ..Probe::default() },
        after: Probe { resident: 50 * MIB + grew, ..Probe::default() },
        ..RankReceipt::default()
    };
    let failures = Coordinator::verify(&[receipt(0, 132 << 10), receipt(1, VERIFY_SLACK)]);
    let ranks: Vec<usize> = failures.iter().map(|f| f.rank).collect();
    assert_eq!(ranks, vec![1], "{failures:?}");
}

/// Verification weighs host and device memory apart: resident memory must drop by 90% of the
/// host bytes and the device reading by 90% of the device bytes; a rank that released device
/// memory it cannot read fails, naming why.
#[test]
fn verify_checks_host_and_device_bytes_separately() {
    let tag = |bytes, device_bytes| TagReceipt {
        tag: "weights".into(),
        bytes,
        device_bytes,
        ..TagReceipt::default()
    };
    let receipt = |rank, resident: (u64, u64), device: Option<(u64, u64)>| RankReceipt {
        rank,
        tags: vec![tag(100 * MIB, 60 * MIB)],
        before: Probe {
            resident: resident.0,
            devices: device.map(|d| vec![(0, d.0)]).unwrap_or_default(),
            ..Probe::default()
        },
        after: Probe {
            resident: resident.1,
            devices: device.map(|d| vec![(0, d.1)]).unwrap_or_default(),
            ..Probe::default()
        },
        ..RankReceipt::default()
    };
    let ranks = [
        // Host 40 MiB freed of 40, device 60 of 60: fine.
        receipt(0, (50 * MIB, 10 * MIB), Some((70 * MIB, 10 * MIB))),
        // The device kept its memory although the host freed 100 MiB (more than the total).
        receipt(1, (200 * MIB, 100 * MIB), Some((70 * MIB, 60 * MIB))),
        // The host kept its memory.
        receipt(2, (50 * MIB, 45 * MIB), Some((70 * MIB, 10 * MIB))),
        // No device reading.
        receipt(3, (50 * MIB, 10 * MIB), None),
    ];
    let failures = Coordinator::verify(&ranks);
    let by_rank: Vec<(usize, &str)> =
        failures.iter().map(|f| (f.rank, f.message.as_str())).collect();
    assert_eq!(by_rank.len(), 3, "{by_rank:?}");
    assert!(
        by_rank[0].0 == 1
            && by_rank[0].1.contains(
                "62914560 tagged device bytes but its device memory dropped by only 10485760"
            ),
        "{by_rank:?}"
    );
    assert!(
        by_rank[1].0 == 2
            && by_rank[1].1.contains(
                "41943040 tagged host bytes but its resident memory dropped by only 5242880"
            ),
        "{by_rank:?}"
    );
    assert!(
        by_rank[2].0 == 3 && by_rank[2].1.contains("cannot read its device memory"),
        "{by_rank:?}"
    );
}

#[test]
fn an_undecodable_request_is_answered_with_a_failure_and_the_listener_stays() {
    let w = world(3);
    w.faults.arm(Fault::Garble { rank: 2, phase: Phase::Prepare });
    let e = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap_err();
    assert_eq!(ranks_of(&e), vec![2]);
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    assert!(e.to_string().contains("rank 2 could not decode the request"), "{e}");
    assert!(w.log.all().iter().all(|e| !e.contains("release")));
    // Rank 2's listener is still there: the next operation runs on every rank.
    let r = w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
    assert_eq!(r.bytes(), 3 * MIB, "every rank released its weights");
    w.shutdown();
}

#[test]
fn a_frame_body_that_does_not_decode_still_names_its_request() {
    let msg = Message::request(9, Phase::Commit, Some(Action::Sleep), &tags(&["kv_cache"]));
    let body = &msg.encode()[4..];
    assert_eq!(Message::decode(body).unwrap(), msg);
    let mut v: serde_json::Value = serde_json::from_slice(body).unwrap();
    v["status"] = serde_json::json!("sideways");
    let bad = Message::decode(v.to_string().as_bytes()).unwrap_err();
    assert_eq!((bad.op_id, bad.phase), (Some(9), Some(Phase::Commit)));
    assert!(bad.reason.contains("undecodable frame"), "{}", bad.reason);
    let bad = Message::decode(b"{\"op_id\": 3, \"pha").unwrap_err();
    assert_eq!((bad.op_id, bad.phase), (None, None));
}

#[test]
fn state_and_status_answer_while_a_quiesce_holds_the_operation() {
    use std::sync::mpsc::channel;
    let w = world(3);
    let ((started_tx, started), (release, release_rx)) = (channel(), channel());
    *w.engines[0].hold.lock().unwrap() = Some((started_tx, release_rx));
    let coord = w.coord.clone();
    let op = std::thread::spawn(move || coord.sleep(&tags(&["kv_cache"]), OpOptions::default()));
    started.recv_timeout(Duration::from_secs(10)).expect("the quiesce started");
    // Asked while rank 0's engine is still quiescing: neither waits for it.
    let (coord, (tx, rx)) = (w.coord.clone(), channel());
    std::thread::spawn(move || tx.send((coord.state(), coord.status().unwrap())).unwrap());
    let (state, status) =
        rx.recv_timeout(Duration::from_secs(10)).expect("state and status answer mid-quiesce");
    assert_eq!(state, DeploymentState::Running);
    assert_eq!(status.in_progress.as_deref(), Some("sleep [\"kv_cache\"]"));
    assert_eq!(status.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![0]);
    release.send(()).unwrap();
    op.join().unwrap().unwrap();
    let status = w.coord.status().unwrap();
    assert_eq!((status.in_progress, status.ranks.len()), (None, 3));
    assert_eq!(status.state, DeploymentState::Sleeping(tags(&["kv_cache"])));
    w.shutdown();
}

#[test]
fn a_panic_in_a_ranks_memory_operation_is_undone_and_every_rank_goes_on() {
    for panicking in [0, 2] {
        let w = world(3);
        w.mem[panicking].set(|s| s.panic_release = true);
        let e = w.coord.sleep(&tags(&["weights", "kv_cache"]), OpOptions::default()).unwrap_err();
        assert_eq!(ranks_of(&e), vec![panicking], "{e}");
        assert!(e.to_string().contains("panicked: release of weights"), "{e}");
        assert!(e.to_string().contains("partial change undone"), "{e}");
        // Rank 0 fails before any peer commits (ABORT); a peer fails in its commit, after
        // the others committed (ROLLBACK).
        let outcome = if panicking == 0 { Outcome::Aborted } else { Outcome::RolledBack };
        assert_eq!(e.outcome(), Some(outcome));
        for (rank, m) in w.mem.iter().enumerate() {
            assert!(m.asleep().is_empty(), "rank {rank}: {:?}", m.asleep());
            assert_eq!(w.log.of(rank).last().unwrap(), &format!("r{rank} resume"));
        }
        assert_eq!(w.coord.state(), DeploymentState::Running);
        w.coord.sleep(&tags(&["weights"]), OpOptions::default()).unwrap();
        w.shutdown();
    }
}

#[test]
fn the_sleep_level_reaches_every_ranks_memory() {
    let w = world(3);
    for level in [Some(1), Some(2), None] {
        let opts = OpOptions { level, ..OpOptions::default() };
        w.coord.sleep(&tags(&["weights"]), opts).unwrap();
        for m in &w.mem {
            assert_eq!(m.st.lock().unwrap().level, level, "rank {}", m.rank);
        }
        w.coord.wakeup(&tags(&["weights"]), OpOptions::default()).unwrap();
    }
    w.shutdown();
}

#[test]
fn a_weight_update_reaches_every_rank_or_none() {
    let w = world(3);
    let live = |w: &World| -> Vec<String> {
        w.mem.iter().map(|m| m.st.lock().unwrap().weights.0.clone()).collect()
    };
    w.coord
        .update_weights(&WeightUpdate::from_checkpoint("step-100.gguf"), OpOptions::default())
        .unwrap();
    assert_eq!(live(&w), vec!["step-100.gguf"; 3]);
    assert_eq!(w.coord.checkpoint().as_deref(), Some("step-100.gguf"));
    // The engines were paused for it and run again.
    for rank in 0..3 {
        assert_eq!(
            w.log.of(rank),
            vec![format!("r{rank} quiesce Wait"), format!("r{rank} resume")]
        );
    }
    // Refused in PREPARE: nothing changes, nothing stays staged.
    let e = w
        .coord
        .update_weights(&WeightUpdate::from_checkpoint("other-shapes.gguf"), OpOptions::default())
        .unwrap_err();
    assert_eq!(ranks_of(&e), vec![0, 1, 2]);
    assert_eq!(e.outcome(), Some(Outcome::Aborted));
    assert!(w.mem.iter().all(|m| m.st.lock().unwrap().weights.1.is_none()));
    // Rank 2 fails its COMMIT after the others loaded: they put the old weights back.
    w.mem[2].set(|s| s.fail_update = true);
    let e = w
        .coord
        .update_weights(&WeightUpdate::from_checkpoint("step-200.gguf"), OpOptions::default())
        .unwrap_err();
    assert_eq!(ranks_of(&e), vec![2]);
    assert_eq!(e.outcome(), Some(Outcome::RolledBack));
    assert_eq!(live(&w), vec!["step-100.gguf"; 3]);
    assert_eq!(w.coord.checkpoint().as_deref(), Some("step-100.gguf"));
    assert_eq!(w.coord.state(), DeploymentState::Running);
    // ... and rank 0's engine runs again (a rolled-back update used to leave it quiesced).
    assert_eq!(engine_calls(&w.log, 0).last().map(String::as_str), Some("r0 resume"));
    w.shutdown();
}

/// What `rank`'s engine was told (quiesce, resume), in order.
fn engine_calls(log: &Log, rank: usize) -> Vec<String> {
    let quiesce = format!("r{rank} quiesce");
    let resume = format!("r{rank} resume");
    log.of(rank).into_iter().filter(|e| e.starts_with(&quiesce) || *e == resume).collect()
}

/// A pause quiesces rank 0's engine once and holds it through a weight update (no resume
/// until `resume`); the update's version is what answers are stamped with from then on.
#[test]
fn a_pause_holds_the_engine_through_an_update_until_resume() {
    let w = world(2);
    let version = w.coord.weight_version();
    assert_eq!(&*version.get(), WeightVersion::INITIAL);
    assert!(w.coord.pause(QuiesceMode::Keep).unwrap());
    assert!(w.coord.is_paused());
    assert!(!w.coord.pause(QuiesceMode::Abort).unwrap(), "a second pause changes nothing");
    let update = WeightUpdate::from_checkpoint("step-1.gguf").versioned(Some("step-1".into()));
    w.coord.update_weights(&update, OpOptions::default()).unwrap();
    assert_eq!(&*version.get(), "step-1");
    // A sleep and a wakeup while paused leave it paused.
    w.coord.sleep(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    w.coord.wakeup(&tags(&["kv_cache"]), OpOptions::default()).unwrap();
    assert!(w.coord.is_paused());
    assert_eq!(engine_calls(&w.log, 0), vec!["r0 quiesce Keep"], "rank 0 stays quiesced");
    let status = w.coord.status().unwrap();
    assert!(status.paused);
    assert_eq!(status.weight_version, "step-1");
    assert!(w.coord.resume());
    assert!(!w.coord.resume(), "a second resume changes nothing");
    assert!(!w.coord.is_paused());
    assert_eq!(engine_calls(&w.log, 0), vec!["r0 quiesce Keep", "r0 resume"]);
    // An update without a version takes the count of updates.
    w.coord.update_weights(&WeightUpdate::from_checkpoint("b.gguf"), OpOptions::default()).unwrap();
    assert_eq!(&*version.get(), "2");
    w.shutdown();
}

/// A failed update leaves the version as it was; a pause that cannot quiesce pauses nothing.
#[test]
fn a_failed_update_keeps_the_version_and_a_failed_pause_pauses_nothing() {
    let w = world(2);
    let version = w.coord.weight_version();
    w.mem[1].set(|s| s.fail_update = true);
    let update = WeightUpdate::from_checkpoint("step-9.gguf").versioned(Some("9".into()));
    w.coord.update_weights(&update, OpOptions::default()).unwrap_err();
    assert_eq!(&*version.get(), WeightVersion::INITIAL);
    *w.engines[0].fail.lock().unwrap() = Some("stuck in a step".into());
    let e = w.coord.pause(QuiesceMode::Wait).unwrap_err();
    assert!(e.to_string().contains("stuck in a step"), "{e}");
    assert!(!w.coord.is_paused());
    w.shutdown();
}

/// Four ranks on one device whose readings are the whole device's (the driver lists no
/// process): verified together, so a leak on rank 3 fails the sleep although ranks 0-2's own
/// before/after readings (taken while the others released) each show a big drop; without the
/// leak the same readings pass. Per-process readings stay verified per rank.
#[test]
fn device_wide_readings_are_verified_per_device() {
    const GIB: u64 = 1 << 30;
    let wide = |index: u32, bytes: u64| Probe {
        devices: vec![(index, bytes)],
        device_wide: vec![index],
        device_ids: vec![(index, "GPU-1234".into())],
        ..Probe::default()
    };
    let receipt = |rank, before, after| RankReceipt {
        rank,
        tags: vec![TagReceipt {
            tag: "kv_cache".into(),
            bytes: GIB,
            device_bytes: GIB,
            ..TagReceipt::default()
        }],
        // Each rank sees the device under its own NVML index order: the UUID matches them.
        before: wide(rank as u32 % 2, before),
        after: wide(rank as u32 % 2, after),
        ..RankReceipt::default()
    };
    // 5 GiB used: four 1 GiB caches and 1 GiB of contexts. Rank 3 leaks its cache: the device
    // ends at 2 GiB, though each of ranks 0-2 saw a drop of at least 1 GiB around its release.
    let leak = [
        receipt(0, 5 * GIB, 2 * GIB),
        receipt(1, 4 * GIB, 3 * GIB),
        receipt(2, 5 * GIB, 2 * GIB),
        receipt(3, 5 * GIB, 2 * GIB),
    ];
    let failures = Coordinator::verify(&leak);
    let ranks: Vec<usize> = failures.iter().map(|f| f.rank).collect();
    assert_eq!(ranks, vec![0, 1, 2, 3], "{failures:?}");
    assert!(
        failures[3].message.contains(
            "the ranks on device GPU-1234 (ranks 0, 1, 2, 3; the driver does not list their \
             processes"
        ) && failures[3].message.contains("released 4294967296 tagged device bytes together but the device's memory dropped by only 3221225472"),
        "{failures:?}"
    );
    // No leak: the device ends at the contexts' 1 GiB.
    let fine = [
        receipt(0, 5 * GIB, 2 * GIB),
        receipt(1, 4 * GIB, GIB),
        receipt(2, 5 * GIB, 3 * GIB),
        receipt(3, 3 * GIB, GIB),
    ];
    assert!(Coordinator::verify(&fine).is_empty());
    // Per-process readings of the same numbers: each rank on its own (rank 1's 1 GiB drop
    // passes, rank 2's 2 GiB passes; nothing is summed).
    let own = |r: RankReceipt| RankReceipt {
        before: Probe { device_wide: Vec::new(), ..r.before.clone() },
        after: Probe { device_wide: Vec::new(), ..r.after.clone() },
        ..r
    };
    let failures = Coordinator::verify(&leak.map(own));
    assert!(failures.is_empty(), "{failures:?}");
}
