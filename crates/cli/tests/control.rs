//! The control socket end to end: rank 0's [`Server`] over a real multi-rank coordinator
//! (in-memory control channel, real listener threads, fake rank memory), driven by the
//! client library and by the `tpctl` binary (`sleep`, `wakeup`, `status`, `stop`). Every wait
//! has a deadline.

use session::sleep::transport::memory::{self, Faults};
use session::sleep::{
    listener, Coordinator, CoordinatorOptions, Idle, ListenerHandle, MemoryError, Probe,
    RankMemory, Refusal, TagReceipt,
};
use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tpctl::control::{
    client, paths, Controller, Reply, Request, Server, SleepArgs, UpdateArgs, WakeupArgs, ALL_TAGS,
};

/// The `tpctl` binary under test.
const TPCTL: &str = env!("CARGO_BIN_EXE_tpctl");
const MIB: u64 = 1 << 20;
const DEADLINE: Duration = Duration::from_secs(60);

/// The tags of memory in [`FakeMemory`]; the runtime's tags (graphs, workspaces) hold nothing.
const MEMORY_TAGS: [&str; 2] = ["weights", "kv_cache"];

/// Rank memory with 1 MiB per tag of memory ([`MEMORY_TAGS`]; every tag of [`ALL_TAGS`] is
/// accepted): resident is 10 MiB plus 1 MiB per
/// awake tag; a GPU rank also reports 100 MiB plus 1 MiB per awake tag on device `rank`.
struct FakeMemory {
    rank: usize,
    gpu: bool,
    asleep: Mutex<BTreeSet<String>>,
    fail_release: Mutex<Option<String>>,
}

impl FakeMemory {
    fn new(rank: usize, gpu: bool) -> Arc<FakeMemory> {
        Arc::new(FakeMemory { rank, gpu, asleep: Mutex::default(), fail_release: Mutex::default() })
    }
}

impl RankMemory for FakeMemory {
    fn check(&self, tags: &[String]) -> Result<(), Refusal> {
        match tags.iter().find(|t| !ALL_TAGS.contains(&t.as_str())) {
            Some(t) => Err(Refusal::UnknownTag {
                tag: t.clone(),
                known: ALL_TAGS.iter().map(|t| (*t).to_owned()).collect(),
            }),
            None => Ok(()),
        }
    }

    fn release(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        if let Some(message) = self.fail_release.lock().unwrap().take() {
            return Err(MemoryError { changed: false, message });
        }
        let mut asleep = self.asleep.lock().unwrap();
        Ok(tags
            .iter()
            .map(|t| {
                let moved = asleep.insert(t.clone()) && MEMORY_TAGS.contains(&t.as_str());
                TagReceipt {
                    tag: t.clone(),
                    allocations: usize::from(moved),
                    bytes: if moved { MIB } else { 0 },
                    device_bytes: if moved && self.gpu { MIB } else { 0 },
                    copied_bytes: 0,
                    elapsed_us: 250,
                    restore: "discard".into(),
                }
            })
            .collect())
    }

    fn materialize(&self, tags: &[String]) -> Result<Vec<TagReceipt>, MemoryError> {
        let mut asleep = self.asleep.lock().unwrap();
        Ok(tags
            .iter()
            .map(|t| {
                let moved = asleep.remove(t) && MEMORY_TAGS.contains(&t.as_str());
                TagReceipt {
                    tag: t.clone(),
                    allocations: usize::from(moved),
                    bytes: if moved { MIB } else { 0 },
                    device_bytes: if moved && self.gpu { MIB } else { 0 },
                    copied_bytes: 0,
                    elapsed_us: 1500,
                    restore: "discard".into(),
                }
            })
            .collect())
    }

    fn probe(&self) -> Probe {
        let asleep = self.asleep.lock().unwrap();
        let awake = MEMORY_TAGS.iter().filter(|t| !asleep.contains(**t)).count() as u64;
        let devices =
            if self.gpu { vec![(self.rank as u32, 100 * MIB + awake * MIB)] } else { Vec::new() };
        Probe {
            resident: 10 * MIB + awake * MIB,
            device_used: devices.clone(),
            devices,
            ..Probe::default()
        }
    }
}

/// A deployment of `n` ranks in this process: rank 0's coordinator and a listener thread per
/// peer. Odd ranks are "GPU" ranks.
struct World {
    coordinator: Arc<Coordinator>,
    memory: Vec<Arc<FakeMemory>>,
    listeners: Vec<ListenerHandle>,
}

impl World {
    fn new(n: usize) -> World {
        let (link, peers) = memory::world(n, Faults::default());
        let memory: Vec<Arc<FakeMemory>> = (0..n).map(|r| FakeMemory::new(r, r % 2 == 1)).collect();
        let listeners = peers
            .into_iter()
            .map(|p| {
                let r = p.rank();
                listener::spawn(r, p, memory[r].clone(), Arc::new(Idle)).expect("spawn a listener")
            })
            .collect();
        let opts = CoordinatorOptions { ack_timeout: Duration::from_secs(10) };
        let coordinator = Arc::new(Coordinator::new(link, memory[0].clone(), Arc::new(Idle), opts));
        World { coordinator, memory, listeners }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = self.coordinator.shutdown();
        for l in &mut self.listeners {
            let _ = l.join(Duration::from_secs(10));
        }
    }
}

/// A fresh runtime directory (as `$XDG_RUNTIME_DIR`), short enough for socket paths.
fn runtime() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "ctl-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the runtime dir");
    dir
}

/// `$XDG_RUNTIME_DIR/tpctl`, as the binary computes it for `runtime`.
fn sockets(runtime: &Path) -> PathBuf {
    runtime.join("tpctl")
}

fn nothing() -> Arc<dyn Fn() + Send + Sync> {
    Arc::new(|| {})
}

fn call(socket: &Path, request: &Request) -> Reply {
    client::call(socket, request, DEADLINE).expect("a reply")
}

/// Sends one raw request line and reads the reply.
fn call_line(socket: &Path, line: &str) -> Reply {
    use std::io::{BufRead, BufReader, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    stream.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply).unwrap();
    serde_json::from_str(&reply).unwrap()
}

fn sleep_of(tags: Vec<String>) -> Request {
    Request::Sleep(SleepArgs { tags, ..SleepArgs::default() })
}

fn tags(t: &[&str]) -> Vec<String> {
    t.iter().map(|s| (*s).to_owned()).collect()
}

/// Runs `tpctl ARGS` with `$XDG_RUNTIME_DIR` = `runtime`, with a deadline.
fn tpctl(runtime: &Path, args: &[&str]) -> Output {
    let mut child = Command::new(TPCTL)
        .args(args)
        .env("XDG_RUNTIME_DIR", runtime)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tpctl");
    let start = Instant::now();
    while child.try_wait().expect("wait for tpctl").is_none() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("tpctl {args:?} still running after {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().expect("collect output")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_socket_is_0600_in_a_0700_directory_and_goes_away_with_the_server() {
    let world = World::new(1);
    let rt = runtime();
    let dir = sockets(&rt).join("nested");
    let path = dir.join("a.sock");
    let server =
        Server::start(&path, Controller::new(world.coordinator.clone()), nothing()).expect("start");
    assert_eq!(server.path(), path);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&dir), 0o700);
    drop(server);
    assert!(!path.exists(), "the socket file outlived its server");

    // An existing directory of this user with a wider mode is narrowed.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _server =
        Server::start(&path, Controller::new(world.coordinator.clone()), nothing()).expect("start");
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(std::fs::metadata(&dir).unwrap().uid(), nix_uid());
}

fn nix_uid() -> u32 {
    std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0)
}

#[test]
fn sleep_status_wakeup_and_stop_round_trip() {
    let world = World::new(3);
    let path = sockets(&runtime()).join("rt.sock");
    let (stopped_tx, stopped) = mpsc::channel();
    let on_stop: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        let _ = stopped_tx.send(());
    });
    let _server =
        Server::start(&path, Controller::new(world.coordinator.clone()), on_stop).expect("start");

    let sleep = Request::Sleep(SleepArgs {
        tags: tags(&["kv_cache"]),
        level: Some(2),
        ..SleepArgs::default()
    });
    let reply = call(&path, &sleep);
    assert!(reply.ok, "{reply:?}");
    let op = reply.op.expect("a receipt");
    assert_eq!(op.action, "sleep");
    assert_eq!(op.tags, tags(&["kv_cache"]));
    assert_eq!(op.bytes, 3 * MIB);
    assert_eq!(op.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![0, 1, 2]);
    for r in &op.ranks {
        assert_eq!(r.before.resident - r.after.resident, MIB, "rank {}", r.rank);
    }
    for m in &world.memory {
        assert_eq!(*m.asleep.lock().unwrap(), BTreeSet::from(["kv_cache".to_owned()]));
    }

    let status = call(&path, &Request::Status).status.expect("a status");
    assert_eq!(status.state, "sleeping");
    assert_eq!(status.tags, tags(&["kv_cache"]));
    assert_eq!(status.ranks.len(), 3);
    assert!(status.ranks.iter().all(|r| r.asleep == tags(&["kv_cache"])), "{status:?}");
    assert!(status.failures.is_empty());

    // A wakeup without tags wakes what is asleep.
    let reply = call(&path, &Request::Wakeup(WakeupArgs::default()));
    let op = reply.op.expect("a receipt");
    assert_eq!(
        (op.action.as_str(), op.tags.clone(), op.bytes),
        ("wakeup", tags(&["kv_cache"]), 3 * MIB)
    );
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().is_empty()));
    assert_eq!(call(&path, &Request::Status).status.unwrap().state, "running");

    // A sleep without tags releases every tag: the weights, the KV cache, and what the
    // runtime holds (graphs, workspaces, communicators).
    let op = call(&path, &sleep_of(Vec::new())).op.expect("a receipt");
    assert_eq!(op.tags, tags(&["weights", "kv_cache", "cuda_graph", "workspace", "nccl"]));
    assert_eq!(op.bytes, 6 * MIB);

    let reply = call(&path, &Request::Stop);
    assert_eq!(reply, Reply { ok: true, stopping: Some(true), ..Reply::default() });
    stopped.recv_timeout(DEADLINE).expect("stop reached on_stop");
}

#[test]
fn unknown_methods_bad_options_and_garbage_are_refused_clearly() {
    let world = World::new(2);
    let path = sockets(&runtime()).join("bad.sock");
    let _server =
        Server::start(&path, Controller::new(world.coordinator.clone()), nothing()).expect("start");
    let line = |r: Request| serde_json::to_string(&r).unwrap();
    for (request, expect) in [
        (
            r#"{"method":"shutdown"}"#.to_owned(),
            "unknown control method `shutdown`: expected sleep, wakeup, update_weights, start_weight_update, weight_bucket, finish_weight_update, abort_weight_update, pause, resume, status, stop, restart",
        ),
        (
            line(Request::Sleep(SleepArgs { level: Some(3), ..SleepArgs::default() })),
            "sleep level 3: only 1 and 2",
        ),
        (line(sleep_of(tags(&["kv cache"]))), "`kv cache` is not a tag name"),
        (line(sleep_of(tags(&["bogus"]))), "unknown tag `bogus`"),
        (
            line(Request::UpdateWeights(UpdateArgs::default())),
            "update_weights needs the checkpoint: model=PATH",
        ),
    ] {
        let reply = call_line(&path, &request);
        assert!(!reply.ok);
        let e = reply.error.expect("an error");
        assert!(e.message.contains(expect), "{}", e.message);
        assert!(e.client_error);
    }
    // Nothing moved.
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().is_empty()));

    // A line that is not a request.
    let reply = call_line(&path, "sleep please");
    assert!(!reply.ok);
    let message = reply.error.unwrap().message;
    assert!(message.contains("not a JSON control request"), "{message}");
}

#[test]
fn a_failing_rank_is_named_in_the_reply_and_nothing_stays_asleep() {
    let world = World::new(3);
    *world.memory[2].fail_release.lock().unwrap() = Some("spill directory full".into());
    let path = sockets(&runtime()).join("fail.sock");
    let _server =
        Server::start(&path, Controller::new(world.coordinator.clone()), nothing()).expect("start");
    let reply = call(&path, &sleep_of(tags(&["weights"])));
    assert!(!reply.ok);
    let e = reply.error.expect("an error");
    assert_eq!(e.failures.iter().map(|f| f.rank).collect::<Vec<_>>(), vec![2]);
    assert!(e.message.contains("rank 2 (commit)"), "{}", e.message);
    assert!(e.message.contains("spill directory full"), "{}", e.message);
    assert_eq!(e.outcome.as_deref(), Some("rolled_back"));
    assert!(!e.client_error);
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().is_empty()));
    assert_eq!(call(&path, &Request::Status).status.unwrap().state, "running");
}

#[test]
fn a_live_socket_is_never_taken_over_and_a_stale_one_is_replaced() {
    let world = World::new(1);
    let path = sockets(&runtime()).join("dup.sock");
    let first =
        Server::start(&path, Controller::new(world.coordinator.clone()), nothing()).expect("start");
    let err = Server::start(&path, Controller::new(world.coordinator.clone()), nothing())
        .unwrap_err()
        .to_string();
    assert!(err.contains("already running"), "{err}");
    // The refused start left the first server's socket alone.
    assert!(call(&path, &Request::Status).ok);
    drop(first);

    // A socket whose server died without removing it.
    drop(UnixListener::bind(&path).expect("bind"));
    assert_eq!(paths::occupant(&path), paths::Occupant::Stale);
    let _second = Server::start(&path, Controller::new(world.coordinator.clone()), nothing())
        .expect("replace");
    assert_eq!(paths::occupant(&path), paths::Occupant::Live);
    assert!(call(&path, &Request::Status).ok);

    // Something that is not a socket is not replaced.
    let file = path.with_file_name("file.sock");
    std::fs::write(&file, b"keep me").unwrap();
    let err = Server::start(&file, Controller::new(world.coordinator.clone()), nothing())
        .unwrap_err()
        .to_string();
    assert!(err.contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
}

#[test]
fn discovery_finds_the_only_live_deployment_and_lists_several() {
    let world = World::new(1);
    let dir = sockets(&runtime());
    let err = paths::resolve(&dir, None, None).unwrap_err().to_string();
    assert!(err.contains("no running tpctl deployment"), "{err}");

    let a = Server::start(
        &dir.join("alpha.sock"),
        Controller::new(world.coordinator.clone()),
        nothing(),
    )
    .unwrap();
    // A stale socket does not count.
    drop(UnixListener::bind(dir.join("ghost.sock")).unwrap());
    assert_eq!(paths::resolve(&dir, None, None).unwrap(), dir.join("alpha.sock"));

    let _b = Server::start(
        &dir.join("beta.sock"),
        Controller::new(world.coordinator.clone()),
        nothing(),
    )
    .unwrap();
    let err = paths::resolve(&dir, None, None).unwrap_err().to_string();
    assert!(err.contains("2 deployments are running (alpha, beta)"), "{err}");
    assert!(err.contains("--deployment NAME"), "{err}");
    assert_eq!(paths::resolve(&dir, Some("beta"), None).unwrap(), dir.join("beta.sock"));
    let err = paths::resolve(&dir, Some("ghost"), None).unwrap_err().to_string();
    assert!(err.contains("deployment `ghost` is not running"), "{err}");
    let err = paths::resolve(&dir, Some("gamma"), None).unwrap_err().to_string();
    assert!(err.contains("no deployment `gamma`") && err.contains("running: alpha, beta"), "{err}");
    drop(a);
    assert_eq!(paths::resolve(&dir, None, None).unwrap(), dir.join("beta.sock"));
}

#[test]
fn the_binary_prints_receipts_status_and_failures() {
    let world = World::new(2);
    let rt = runtime();
    let path = sockets(&rt).join("chat.sock");
    let (stopped_tx, stopped) = mpsc::channel();
    let on_stop: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        let _ = stopped_tx.send(());
    });
    let _server =
        Server::start(&path, Controller::new(world.coordinator.clone()), on_stop).expect("start");

    let out =
        tpctl(&rt, &["sleep", "--deployment", "chat", "--tags", "kv_cache,weights", "--verify"]);
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    let cols: Vec<&str> = lines[0].split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
    let header = ["rank", "device", "tag", "bytes", "probe before -> after", "time", "restore"];
    assert_eq!(cols, header, "{text}");
    let row = |i: usize| lines[i].split_whitespace().collect::<Vec<_>>();
    // Rank 0 on CPU: resident 12 MiB -> 10 MiB; rank 1 on "GPU" 1: device bytes.
    assert_eq!(
        row(1),
        [
            "0", "cpu", "kv_cache", "1.0", "MiB", "12.0", "MiB", "->", "10.0", "MiB", "250", "us",
            "discard"
        ],
        "{text}"
    );
    assert_eq!(row(2), ["0", "cpu", "weights", "1.0", "MiB", "250", "us", "discard"], "{text}");
    assert_eq!(
        row(3),
        [
            "1", "cuda:1", "kv_cache", "1.0", "MiB", "(1.0", "MiB", "on", "device)", "102.0",
            "MiB", "->", "100.0", "MiB", "250", "us", "discard"
        ],
        "{text}"
    );
    assert!(
        lines[5].starts_with("total: sleep kv_cache,weights on 2 rank(s): 4.0 MiB released in "),
        "{text}"
    );

    // Without --deployment: the only live one.
    let out = tpctl(&rt, &["status"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("state: sleeping (kv_cache,weights)\n"), "{text}");
    assert!(
        text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
            == ["1", "cuda:1", "kv_cache,weights", "10.0", "MiB", "100.0", "MiB"]),
        "{text}"
    );

    let out = tpctl(&rt, &["wakeup", "--socket", path.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let reply: Reply = serde_json::from_str(stdout(&out).trim()).expect("one JSON line");
    assert_eq!(reply.op.unwrap().bytes, 4 * MIB);

    // A failing rank: exit 1, the rank named on stderr.
    *world.memory[1].fail_release.lock().unwrap() = Some("out of spill space".into());
    let out = tpctl(&rt, &["sleep", "--tags", "weights"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("rank 1 (commit)") && err.contains("out of spill space"), "{err}");

    // A second deployment: a name is needed.
    let _other = Server::start(
        &sockets(&rt).join("batch.sock"),
        Controller::new(world.coordinator.clone()),
        nothing(),
    )
    .unwrap();
    let out = tpctl(&rt, &["status"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("2 deployments are running (batch, chat)"), "{}", stderr(&out));

    let out = tpctl(&rt, &["stop", "--deployment", "chat"]);
    assert!(out.status.success(), "{}", stderr(&out));
    stopped.recv_timeout(DEADLINE).expect("stop reached on_stop");

    let out = tpctl(&rt, &["sleep", "--level", "3"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn a_launch_under_a_live_or_bad_name_is_refused_before_any_rank_starts() {
    let world = World::new(1);
    let rt = runtime();
    let _server = Server::start(
        &sockets(&rt).join("dup.sock"),
        Controller::new(world.coordinator.clone()),
        nothing(),
    )
    .expect("start");
    for cmd in ["run", "serve"] {
        let out = tpctl(&rt, &[cmd, "--deployment", "dup", "--model", "/nonexistent.gguf"]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        let err = stderr(&out);
        assert!(err.contains("deployment `dup` is already running"), "{cmd}: {err}");
        assert!(err.contains("tpctl stop --deployment dup"), "{cmd}: {err}");
    }
    let out = tpctl(&rt, &["run", "--deployment", ".hidden", "--model", "/nonexistent.gguf"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("`.hidden` is not a deployment name"), "{}", stderr(&out));
}

#[test]
fn every_control_command_has_an_example() {
    let rt = runtime();
    for cmd in ["sleep", "wakeup", "status", "stop", "serve", "run"] {
        let out = tpctl(&rt, &[cmd, "--help"]);
        assert!(out.status.success());
        let text = stdout(&out);
        assert!(text.contains(&format!("Example: tpctl {cmd}")), "{cmd}:\n{text}");
        assert!(text.contains("--deployment"), "{cmd}:\n{text}");
    }
}
