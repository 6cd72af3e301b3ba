//! `/sleep`, `/wake_up`, `/is_sleeping`, the sleep metrics and `refuse_while_asleep`, over
//! real HTTP against a real multi-rank coordinator (in-memory control channel, listener
//! threads, fake rank memory). Every wait has a deadline.

use super::{serve, Api, ApiParts};
use crate::control::ALL_TAGS;
use crate::serve::bridge::Bridge;
use crate::serve::metrics::Metrics;
use serde_json::Value;
use session::sleep::transport::memory::{self, Faults};
use session::sleep::{
    listener, Coordinator, CoordinatorOptions, Idle, ListenerHandle, MemoryError, Probe,
    RankMemory, Refusal, TagReceipt,
};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const DEADLINE: Duration = Duration::from_secs(30);

/// The tags of memory in [`Fake`]; the runtime's tags (graphs, workspaces) hold nothing.
const MEMORY_TAGS: [&str; 2] = ["weights", "kv_cache"];

/// 1 MiB per tag of memory ([`MEMORY_TAGS`]), none for the runtime's; resident 10 MiB plus
/// 1 MiB per awake tag of memory.
#[derive(Default)]
struct Fake {
    asleep: Mutex<BTreeSet<String>>,
    fail_release: Mutex<Option<String>>,
}

impl RankMemory for Fake {
    fn check(&self, tags: &[String]) -> Result<(), Refusal> {
        match tags.iter().find(|t| !ALL_TAGS.contains(&t.as_str())) {
            Some(t) => {
                let known = ALL_TAGS.iter().map(|t| (*t).to_owned()).collect();
                Err(Refusal::UnknownTag { tag: t.clone(), known })
            }
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
                    bytes: if moved { MIB } else { 0 },
                    ..Default::default()
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
                    bytes: if moved { MIB } else { 0 },
                    ..Default::default()
                }
            })
            .collect())
    }
    fn prepare_update(&self, _model: &str) -> Result<(), Refusal> {
        Ok(())
    }
    fn update(&self) -> Result<Vec<TagReceipt>, MemoryError> {
        Ok(vec![TagReceipt { tag: "weights".into(), bytes: MIB, ..Default::default() }])
    }
    fn probe(&self) -> Probe {
        let asleep = self.asleep.lock().unwrap();
        let awake = MEMORY_TAGS.iter().filter(|t| !asleep.contains(**t)).count() as u64;
        Probe { resident: 10 * MIB + awake * MIB, ..Probe::default() }
    }
}

struct World {
    coordinator: Arc<Coordinator>,
    memory: Vec<Arc<Fake>>,
    listeners: Vec<ListenerHandle>,
}

impl World {
    fn new(n: usize) -> World {
        let (link, peers) = memory::world(n, Faults::default());
        let memory: Vec<Arc<Fake>> = (0..n).map(|_| Arc::new(Fake::default())).collect();
        let listeners = peers
            .into_iter()
            .map(|p| {
                let r = p.rank();
                listener::spawn(r, p, memory[r].clone(), Arc::new(Idle)).expect("spawn")
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

/// The tiny model's tokenizer (tokens `t0`..`t47`), written once per test process.
fn tokenizer() -> text::Tokenizer {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("tpctl-http-{}.gguf", std::process::id()));
        let spec = layers::model::random::RandomLlama {
            heads: 6,
            kv_heads: 3,
            hidden: 48,
            ffn: 64,
            seed: 7,
            ..Default::default()
        };
        spec.write(&path).expect("write the tiny model");
        path
    });
    let file = checkpoint::gguf::GgufFile::open(path).expect("open the tiny model");
    text::Tokenizer::from_gguf(&file).expect("its tokenizer")
}

/// A running HTTP API; the engine's inbox is the test's to read.
struct Http {
    addr: String,
    inbox: Receiver<session::Request>,
    bridge: Bridge,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Http {
    fn start(
        control: Option<Arc<Coordinator>>,
        refuse_while_asleep: bool,
        key: Option<&str>,
    ) -> Http {
        Http::start_with(control, refuse_while_asleep, key, Duration::from_secs(60))
    }

    /// As [`Http::start`], with completions waiting at most `asleep_wait` for a wakeup.
    fn start_with(
        control: Option<Arc<Coordinator>>,
        refuse_while_asleep: bool,
        key: Option<&str>,
        asleep_wait: Duration,
    ) -> Http {
        let metrics = Metrics::default();
        let (inbox_tx, inbox) = std::sync::mpsc::channel();
        let tokenizer: Arc<text::Tokenizer> = tokenizer().into();
        let mut bridge = Bridge::new(inbox_tx, metrics.clone(), tokenizer.clone());
        if let Some(c) = &control {
            bridge = bridge.with_weight_version(c.weight_version());
        }
        let api = Api::new(ApiParts {
            bridge: bridge.clone(),
            metrics,
            tokenizer,
            model_name: "tiny".into(),
            checkpoint: "tiny.gguf".into(),
            vocab: 48,
            context: 256,
            api_key: key.map(str::to_owned),
            ready: Arc::new(AtomicBool::new(true)),
            control: control.map(crate::control::Controller::new),
            refuse_while_asleep,
            asleep_wait,
            defaults: None,
            grammars: None,
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::spawn(move || serve(listener, api, rx).expect("serve"));
        Http { addr, inbox, bridge, shutdown: Some(tx), thread: Some(thread) }
    }

    /// One exchange (`Connection: close`): the status and the body.
    fn call(&self, method: &str, path: &str, headers: &[&str], body: &str) -> (u16, String) {
        let raw = self.raw(method, path, headers, body);
        let status = raw.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
        (status, body)
    }

    /// One exchange: the whole answer, status line and headers included.
    fn raw(&self, method: &str, path: &str, headers: &[&str], body: &str) -> String {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        s.set_write_timeout(Some(DEADLINE)).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for h in headers {
            head.push_str(&format!("{h}\r\n"));
        }
        s.write_all(format!("{head}\r\n{body}").as_bytes()).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("an answer within the deadline");
        raw
    }

    fn json(&self, method: &str, path: &str) -> (u16, Value) {
        let (status, body) = self.call(method, path, &[], "");
        (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
    }

    fn metric(&self, line_start: &str) -> String {
        let (status, text) = self.call("GET", "/metrics", &[], "");
        assert_eq!(status, 200);
        text.lines()
            .find_map(|l| l.strip_prefix(line_start).map(|v| v.trim().to_owned()))
            .unwrap_or_else(|| panic!("`{line_start}` missing from\n{text}"))
    }
}

impl Drop for Http {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let start = std::time::Instant::now();
            while !t.is_finished() && start.elapsed() < DEADLINE {
                std::thread::sleep(Duration::from_millis(10));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

fn message(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap_or_default()
}

#[test]
fn without_a_coordinator_the_sleep_routes_answer_503() {
    let http = Http::start(None, false, None);
    for (method, path) in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")] {
        let (status, v) = http.json(method, path);
        assert_eq!(status, 503, "{path}");
        assert_eq!(message(&v), "sleep/wakeup is not available", "{path}");
    }
}

#[test]
fn sleep_and_wake_up_reach_every_rank_and_show_in_the_metrics() {
    let world = World::new(2);
    let http = Http::start(Some(world.coordinator.clone()), true, None);
    assert_eq!(http.json("GET", "/is_sleeping"), (200, serde_json::json!({"is_sleeping": false})));
    assert_eq!(http.metric("tpctl_sleeping "), "0");

    let (status, op) = http.json("POST", "/sleep?level=1&tags=kv_cache&mode=wait");
    assert_eq!(status, 200, "{op}");
    assert_eq!(op["action"], "sleep");
    assert_eq!(op["bytes"], 2 * MIB);
    assert_eq!(op["ranks"].as_array().map(Vec::len), Some(2));
    assert_eq!(op["ranks"][1]["tags"][0]["tag"], "kv_cache");
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().contains("kv_cache")));
    assert_eq!(http.json("GET", "/is_sleeping"), (200, serde_json::json!({"is_sleeping": true})));
    assert_eq!(http.metric("tpctl_sleeping "), "1");
    assert_eq!(
        http.metric("tpctl_memory_released_bytes{rank=\"1\",tag=\"kv_cache\"} "),
        MIB.to_string()
    );
    assert_eq!(http.metric("tpctl_rank_resident_bytes{rank=\"0\"} "), (11 * MIB).to_string());
    assert_eq!(http.metric("tpctl_sleep_ops_total{action=\"sleep\"} "), "1");

    // refuse_while_asleep: completions get 503 and never reach the engine.
    let (status, body) =
        http.call("POST", "/v1/completions", &[], r#"{"prompt":[1,2,3],"max_tokens":2}"#);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("the deployment is asleep (kv_cache)"), "{body}");
    assert!(http.inbox.try_recv().is_err());

    // vLLM's repeated `tags` works as well as a list.
    let (status, op) = http.json("POST", "/wake_up?tags=kv_cache&tags=weights");
    assert_eq!(status, 200, "{op}");
    assert_eq!(op["tags"], serde_json::json!(["kv_cache", "weights"]));
    assert_eq!(op["bytes"], 2 * MIB);
    assert_eq!(http.json("GET", "/is_sleeping").1["is_sleeping"], false);
    assert_eq!(http.metric("tpctl_sleeping "), "0");
    assert_eq!(http.metric("tpctl_sleep_ops_total{action=\"wakeup\"} "), "1");
    assert_eq!(http.metric("tpctl_rank_resident_bytes{rank=\"1\"} "), (12 * MIB).to_string());
    // The sleep's figure stays next to the wakeup's (a wakeup may move fewer allocations).
    let released = http.metric("tpctl_memory_released_bytes{rank=\"0\",tag=\"kv_cache\"} ");
    assert_eq!(released, MIB.to_string());
    let restored = http.metric("tpctl_memory_restored_bytes{rank=\"0\",tag=\"kv_cache\"} ");
    assert_eq!(restored, MIB.to_string());
    assert_eq!(http.metric("tpctl_http_requests_total{route=\"/sleep\",status=\"200\"} "), "1");
}

/// vLLM's RL flow over HTTP: `/sleep` (every tag), `/wake_up?tags=weights` (still asleep:
/// the KV cache is), then `/wake_up?tags=kv_cache`: awake, the runtime's tags woken with it.
#[test]
fn waking_weights_then_the_kv_cache_leaves_the_deployment_awake() {
    let world = World::new(2);
    let http = Http::start(Some(world.coordinator.clone()), false, None);
    assert_eq!(http.json("POST", "/sleep").0, 200);
    let (status, op) = http.json("POST", "/wake_up?tags=weights");
    assert_eq!(status, 200, "{op}");
    assert_eq!(op["tags"], serde_json::json!(["weights"]));
    assert_eq!(http.json("GET", "/is_sleeping").1["is_sleeping"], true);
    let (status, op) = http.json("POST", "/wake_up?tags=kv_cache");
    assert_eq!(status, 200, "{op}");
    // The rest in the order the deployment lists what is asleep.
    assert_eq!(op["tags"], serde_json::json!(["kv_cache", "cuda_graph", "nccl", "workspace"]));
    assert_eq!(http.json("GET", "/is_sleeping").1["is_sleeping"], false);
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().is_empty()));
}

#[test]
fn while_asleep_completions_wait_for_the_wakeup_then_reach_the_engine() {
    let world = World::new(2);
    let http = Http::start(Some(world.coordinator.clone()), false, None);
    assert_eq!(http.json("POST", "/sleep").0, 200);
    let addr = http.addr.clone();
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let body = r#"{"prompt":[5,6],"max_tokens":1}"#;
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let _ = s.write_all(req.as_bytes());
        let _ = s.read_to_end(&mut Vec::new());
    });
    // Asleep: it waits in the server, not in the parked engine's queue. The 200 ms below
    // start once the server holds it (after its arrival), however late the client connects.
    let since = std::time::Instant::now();
    while http.metric("vllm:num_requests_waiting{model_name=\"tiny\"} ") != "1" {
        assert!(since.elapsed() < DEADLINE, "the request was never held");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(http.inbox.try_recv().is_err(), "reached the engine while asleep");
    assert_eq!(http.json("POST", "/wake_up").0, 200);
    let request = http.inbox.recv_timeout(DEADLINE).expect("the request reached the engine");
    assert_eq!(request.prompt, session::Prompt::Tokens(vec![5, 6]));
    // The engine runs it: the 200 ms it was held count in its queue time, time to first
    // token and latency (its clock starts at its arrival, not at the wakeup).
    use session::OutputSink;
    let mut engine = http.bridge.sink();
    engine.scheduled(request.id);
    engine.token(request.id, 7, true, None).unwrap();
    engine.finished(request.id, session::FinishReason::Length, &[7]).unwrap();
    for name in [
        "vllm:request_queue_time_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ] {
        let seconds: f64 =
            http.metric(&format!("{name}_sum{{model_name=\"tiny\"}} ")).parse().unwrap();
        assert!(seconds >= 0.2, "{name}: {seconds} s, without the wait for the wakeup");
    }
}

#[test]
fn a_request_that_waits_past_the_limit_gets_503_with_retry_after() {
    let world = World::new(2);
    let wait = Duration::from_millis(100);
    let http = Http::start_with(Some(world.coordinator.clone()), false, None, wait);
    assert_eq!(http.json("GET", "/health"), (200, serde_json::json!({"status": "ok"})));
    assert_eq!(http.json("GET", "/v1/models").1["data"][0]["sleeping"], false);
    assert_eq!(http.json("POST", "/sleep?tags=kv_cache").0, 200);
    // Health stays 200 while asleep (as vLLM's), and says so.
    let asleep = serde_json::json!({"status": "sleeping", "tags": ["kv_cache"]});
    assert_eq!(http.json("GET", "/health"), (200, asleep));
    assert_eq!(http.json("GET", "/v1/models").1["data"][0]["sleeping"], true);
    let raw = http.raw("POST", "/v1/completions", &[], r#"{"prompt":[1,2],"max_tokens":2}"#);
    assert!(raw.starts_with("HTTP/1.1 503"), "{raw}");
    assert!(raw.to_ascii_lowercase().contains("\r\nretry-after: 5\r\n"), "{raw}");
    assert!(
        raw.contains("stayed asleep (kv_cache)") && raw.contains("asleep_wait_timeout"),
        "{raw}"
    );
    assert!(http.inbox.try_recv().is_err());
}

/// Once the engine stopped (failed, or told to stop), `/health` is 503 saying so until the
/// process is gone, and a new completion is a 503 that never reaches the engine.
#[test]
fn health_is_503_once_the_engine_stopped() {
    let http = Http::start(None, false, None);
    assert_eq!(http.json("GET", "/health").0, 200);
    http.bridge.close_all();
    let (status, body) = http.json("GET", "/health");
    assert_eq!((status, &body["status"]), (503, &serde_json::json!("stopped")), "{body}");
    let (status, _) =
        http.call("POST", "/v1/completions", &[], r#"{"prompt":[1,2],"max_tokens":2}"#);
    assert_eq!(status, 503);
    assert!(http.inbox.try_recv().is_err(), "nothing reached the engine");
}

#[test]
fn bad_sleep_parameters_are_400_and_change_nothing() {
    let world = World::new(2);
    let http = Http::start(Some(world.coordinator.clone()), false, None);
    for (path, expect) in [
        ("/sleep?level=3", "sleep level `3`: only 1 and 2"),
        ("/sleep?mode=later", "mode `later`: expected wait, abort or keep"),
        ("/sleep?verify=maybe", "verify `maybe`"),
        ("/sleep?tags=kv%20cache", "`kv cache` is not a tag name"),
        ("/sleep?tags=kv_cache,kv_cache", "given twice"),
        (
            "/sleep?tags=bogus",
            "unknown tag `bogus`: a deployment's memory is tagged weights, kv_cache, cuda_graph, \
             workspace and nccl",
        ),
        ("/wake_up?tags=weights,bogus", "unknown tag `bogus`"),
        // A stray `%` is kept as it is (the URL standard), then refused as a tag.
        ("/sleep?tags=%zz", "`%zz` is not a tag name"),
        ("/wake_up?level=1", "unknown query parameter `level` (this route takes tags, model)"),
    ] {
        let (status, v) = http.json("POST", path);
        assert_eq!(status, 400, "{path}: {v}");
        assert!(message(&v).contains(expect), "{path}: {v}");
    }
    assert_eq!(http.json("GET", "/sleep").0, 405);
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().is_empty()));
    assert_eq!(http.metric("tpctl_sleep_ops_total{action=\"sleep\"} "), "0");
}

#[test]
fn a_failing_rank_is_a_500_naming_it_and_counts_as_a_failure() {
    let world = World::new(3);
    *world.memory[2].fail_release.lock().unwrap() = Some("spill directory full".into());
    let http = Http::start(Some(world.coordinator.clone()), false, None);
    let (status, v) = http.json("POST", "/sleep?tags=weights");
    assert_eq!(status, 500, "{v}");
    assert!(
        message(&v)
            .contains("rank 2 (commit): commit of op 1: sleep [\"weights\"]: spill directory full"),
        "{v}"
    );
    assert_eq!(v["error"]["failures"][0]["rank"], 2);
    assert_eq!(v["error"]["outcome"], "rolled_back");
    assert_eq!(http.metric("tpctl_sleep_op_failures_total{action=\"sleep\"} "), "1");
    assert_eq!(http.json("GET", "/is_sleeping").1["is_sleeping"], false);
}

#[test]
fn the_api_key_guards_the_sleep_routes() {
    let world = World::new(2);
    let http = Http::start(Some(world.coordinator.clone()), false, Some("k3y"));
    assert_eq!(http.call("POST", "/sleep", &[], "").0, 401);
    assert_eq!(http.call("GET", "/is_sleeping", &[], "").0, 401);
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().is_empty()));
    let (status, body) =
        http.call("POST", "/sleep?tags=weights", &["Authorization: Bearer k3y"], "");
    assert_eq!(status, 200, "{body}");
    assert!(world.memory.iter().all(|m| m.asleep.lock().unwrap().contains("weights")));
}

/// Sends `body` to `path` on a thread; the whole answer (status line, headers, body) comes back
/// from the join.
fn post_in_background(addr: &str, path: &str, body: &str) -> std::thread::JoinHandle<String> {
    let (addr, path, body) = (addr.to_owned(), path.to_owned(), body.to_owned());
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("an answer within the deadline");
        raw
    })
}

/// `/pause` and `/resume` (vLLM's) and `/is_paused`; the weights' version on every answer,
/// stamped per token as the engine emits it: a request whose tokens straddle a weight update
/// (`keep`) names the version of its last token and, per choice, from which token on each
/// version computed it, whole and streamed.
#[test]
fn a_paused_update_versions_the_tokens_after_it() {
    use serde_json::json;
    use session::OutputSink;
    let world = World::new(2);
    let http = Http::start(Some(world.coordinator.clone()), false, None);
    assert_eq!(http.json("GET", "/is_paused"), (200, json!({"is_paused": false})));
    assert_eq!(http.json("GET", "/get_weight_version").1, json!({"weight_version": "0"}));
    assert_eq!(http.metric("tpctl_paused "), "0");

    let whole =
        post_in_background(&http.addr, "/v1/completions", r#"{"prompt":[1],"max_tokens":2}"#);
    let streamed = post_in_background(
        &http.addr,
        "/v1/completions",
        r#"{"prompt":[2],"max_tokens":2,"stream":true}"#,
    );
    let mut engine = http.bridge.sink();
    let ids: Vec<u64> =
        (0..2).map(|_| http.inbox.recv_timeout(DEADLINE).expect("a request").id).collect();
    for &id in &ids {
        engine.token(id, 7, false, None).unwrap();
    }
    // The trainer's loop: pause keeping the requests, new weights, resume.
    assert_eq!(
        http.json("POST", "/pause?mode=keep"),
        (200, json!({"paused": true, "changed": true}))
    );
    assert_eq!(http.json("POST", "/pause").1["changed"], false);
    assert_eq!(http.json("GET", "/is_paused").1["is_paused"], true);
    assert_eq!(http.metric("tpctl_paused "), "1");
    assert_eq!(http.json("GET", "/v1/models").1["data"][0]["paused"], true);
    let (status, op) = http.json("POST", "/update_weights?model=step-7.gguf&weight_version=step-7");
    assert_eq!(status, 200, "{op}");
    assert_eq!(op["weight_version"], "step-7");
    assert_eq!(http.json("GET", "/is_paused").1["is_paused"], true, "an update keeps the pause");
    assert_eq!(http.json("POST", "/resume"), (200, json!({"paused": false, "changed": true})));
    assert_eq!(http.json("GET", "/is_paused").1["is_paused"], false);
    for &id in &ids {
        engine.token(id, 8, true, None).unwrap();
        engine.finished(id, session::FinishReason::Length, &[7, 8]).unwrap();
    }

    let raw = whole.join().unwrap();
    let body: Value = serde_json::from_str(raw.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(body["weight_version"], "step-7", "{body}");
    assert_eq!(body["system_fingerprint"], "step-7", "{body}");
    let changes = json!([
        {"from_token": 0, "weight_version": "0"},
        {"from_token": 1, "weight_version": "step-7"},
    ]);
    assert_eq!(body["choices"][0]["weight_versions"], changes, "{body}");

    let raw = streamed.join().unwrap();
    let chunks: Vec<Value> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let versions: Vec<(String, String)> = chunks
        .iter()
        .filter_map(|c| {
            let id = c["choices"][0]["token_ids"][0].as_u64()?;
            Some((id.to_string(), c["weight_version"].as_str()?.to_owned()))
        })
        .collect();
    let expect = [("7", "0"), ("8", "step-7")].map(|(a, b)| (a.to_owned(), b.to_owned()));
    assert_eq!(versions, expect, "{raw}");
    assert!(chunks.iter().all(|c| c["system_fingerprint"] == c["weight_version"]), "{raw}");

    assert_eq!(http.json("GET", "/get_weight_version").1["weight_version"], "step-7");
    assert_eq!(http.metric("tpctl_weight_version_info{weight_version=\"step-7\"} "), "1");
    // Without a version, an update takes the count of updates.
    assert_eq!(http.json("POST", "/update_weights?model=b.gguf").1["weight_version"], "2");
    for (path, expect) in [
        ("/pause?mode=later", "mode `later`"),
        (
            "/pause?tags=weights",
            "unknown query parameter `tags` (this route takes mode, wait_for_inflight_requests)",
        ),
        ("/resume?mode=keep", "unknown query parameter `mode`"),
        ("/update_weights?model=c.gguf&weight_version=", "weight_version ``: give 1 to 128"),
    ] {
        let (status, v) = http.json("POST", path);
        assert_eq!(status, 400, "{path}: {v}");
        assert!(message(&v).contains(expect), "{path}: {v}");
    }
    assert_eq!(http.json("GET", "/get_weight_version").1["weight_version"], "2");
}

/// A streamed answer's tokens are decoded and encoded on the HTTP runtime's threads, and
/// `/metrics` counts the time each took.
#[test]
fn the_handlers_time_on_tokens_shows_in_the_metrics() {
    use session::OutputSink;
    let http = Http::start(None, false, None);
    let seconds = |name: &str| -> f64 { http.metric(&format!("{name} ")).parse().unwrap() };
    assert_eq!(seconds("tpctl_http_detokenize_seconds_total"), 0.0);
    assert_eq!(seconds("tpctl_http_encode_seconds_total"), 0.0);
    let streamed = post_in_background(
        &http.addr,
        "/v1/completions",
        r#"{"prompt":[2],"max_tokens":2,"stream":true}"#,
    );
    let mut engine = http.bridge.sink();
    let id = http.inbox.recv_timeout(DEADLINE).expect("a request").id;
    engine.token(id, 7, false, None).unwrap();
    engine.token(id, 8, true, None).unwrap();
    engine.finished(id, session::FinishReason::Length, &[7, 8]).unwrap();
    let raw = streamed.join().unwrap();
    assert!(raw.contains("data: [DONE]"), "{raw}");
    assert!(seconds("tpctl_http_detokenize_seconds_total") > 0.0);
    assert!(seconds("tpctl_http_encode_seconds_total") > 0.0);
}
