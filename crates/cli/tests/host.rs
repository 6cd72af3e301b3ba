//! `tpctl serve` with several models (the model host) end to end, through the binary: three
//! different tiny models behind one endpoint with a memory budget that holds one of them
//! awake, interleaved requests from several clients each answered as its model alone answers
//! it, the ranks' resident memory sampled against the budget, and the refusals of bad input.
//! Every wait has a deadline; no process is left behind.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::http::{ids, request, Reply};
use common::{kill_all, leftovers, marker};

const DEADLINE: Duration = Duration::from_secs(180);
const MIB: u64 = 1 << 20;

/// Each model's KV pool: large next to what a tiny model's ranks keep asleep, so a budget of
/// [`BUDGET_MIB`] holds one model awake and never two, whatever the machine's baseline.
const KV_MIB: u64 = 256;
/// Room for the models asleep (up to 248 MiB) and one awake, never for two awake.
const BUDGET_MIB: u64 = 504;

/// The three models: different weights, so an answer from the wrong model shows.
fn models() -> [(&'static str, &'static str); 3] {
    [("a", common::tiny_model()), ("b", common::tiny_q4_model()), ("c", common::lookup_model())]
}

/// A running model host; killed with everything it started if a test fails.
struct Host {
    child: Option<Child>,
    mark: String,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Host {
    /// Starts `tpctl serve ARGS --listen 127.0.0.1:0` and waits until its models loaded.
    fn start(args: &[&str]) -> Host {
        let host = Host::announced(args, &[]);
        host.loaded();
        host
    }

    /// Starts `tpctl serve ARGS --listen 127.0.0.1:0` with more environment and waits for
    /// its address (the models may still load).
    fn announced(args: &[&str], env: &[(&str, &str)]) -> Host {
        let mark = marker();
        let mut child = common::tpctl_command(&mark)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .envs(env.iter().copied())
            .spawn()
            .expect("start tpctl serve");
        let log = Arc::new(Mutex::new(String::new()));
        let (lines_tx, lines) = mpsc::channel();
        let out = child.stdout.take().expect("stdout");
        let err = child.stderr.take().expect("stderr");
        for (stream, tx) in [
            (Box::new(out) as Box<dyn Read + Send>, Some(lines_tx)),
            (Box::new(err) as Box<dyn Read + Send>, None),
        ] {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(|l| l.ok()) {
                    log.lock().unwrap().push_str(&format!("{line}\n"));
                    if let Some(tx) = &tx {
                        let _ = tx.send(line);
                    }
                }
            });
        }
        let mut host = Host { child: Some(child), mark, addr: String::new(), log };
        let start = Instant::now();
        while host.addr.is_empty() {
            match lines.recv_timeout(DEADLINE.saturating_sub(start.elapsed())) {
                Ok(line) => {
                    if let Some((_, rest)) = line.split_once(" on http://") {
                        host.addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    }
                }
                Err(_) => panic!("the model host announced no address\n{}", host.log()),
            }
        }
        host
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until no model is loading (`/health` answers 200).
    fn loaded(&self) {
        let start = Instant::now();
        loop {
            let health = self.get("/health");
            if health.status == 200 {
                return;
            }
            assert!(
                start.elapsed() < DEADLINE && health.json()["status"] == "loading",
                "the models never loaded: {health:?}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `/v1/models` satisfies `done`, and returns it.
    fn until(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let listed = self.get("/v1/models").json();
            if done(&listed) {
                return listed;
            }
            assert!(start.elapsed() < DEADLINE, "never {what}: {listed}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        request(&self.addr, "POST", path, &[], Some(body.to_string().as_bytes()))
    }

    fn get(&self, path: &str) -> Reply {
        request(&self.addr, "GET", path, &[], None)
    }

    /// Interrupts the host as a terminal's Ctrl-C would, and waits for it.
    fn interrupt(self) -> ExitStatus {
        let pid = self.child.as_ref().expect("running").id().to_string();
        assert!(Command::new("kill").args(["-INT", &pid]).status().is_ok_and(|s| s.success()));
        self.wait()
    }

    /// Waits for the host to exit and checks that no process of it is left.
    fn wait(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("wait for the host") {
                // The host reaped its models' launchers; their ranks exit with them.
                let settled = Instant::now();
                while !leftovers(&self.mark).is_empty() && settled.elapsed() < DEADLINE {
                    std::thread::sleep(Duration::from_millis(50));
                }
                assert_eq!(leftovers(&self.mark), Vec::<u32>::new(), "processes left behind");
                return status;
            }
            if start.elapsed() > DEADLINE {
                let _ = child.kill();
                kill_all(&self.mark);
                panic!("the model host still runs\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            kill_all(&self.mark);
        }
    }
}

fn prompt(p: &str) -> Value {
    json!(p.split(',').map(|t| t.parse::<u32>().unwrap()).collect::<Vec<_>>())
}

/// `tpctl run`'s greedy tokens of `model` served alone, for each prompt.
fn alone(model: &str, prompts: &[&str], max_tokens: u32) -> Vec<Vec<u64>> {
    let max = max_tokens.to_string();
    let mut args = vec!["run", "--model", model, "--threads", "1", "--max-tokens", &max];
    args.extend(["--temperature", "0", "--output", "jsonl"]);
    for p in prompts {
        args.extend(["--prompt-ids", p]);
    }
    let out = common::run_tpctl(&args, DEADLINE);
    assert!(out.status.success(), "{}", common::describe(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    prompts
        .iter()
        .map(|p| ids(&lines.iter().find(|l| l["prompt"] == *p).expect("a line")["token_ids"]))
        .collect()
}

/// The resident bytes of every rank process carrying `mark` (`VmRSS`, as the ranks' memory
/// probes read it).
fn ranks_resident(mark: &str) -> u64 {
    leftovers(mark)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == b"__rank"))
        })
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .filter_map(|s| {
            let kib = s.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
            kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok()
        })
        .map(|kib| kib * 1024)
        .sum()
}

#[test]
fn three_models_in_a_budget_for_one_answer_interleaved_requests_as_each_alone() {
    const MAX: u32 = 4;
    let prompts = ["1,2,3", "9,8", "5"];
    let expected: Vec<Vec<Vec<u64>>> =
        models().iter().map(|(_, path)| alone(path, &prompts, MAX)).collect();
    // The lookup model writes its cycle whatever the prompt: the three models differ.
    assert_ne!(expected[0], expected[2]);

    let specs: Vec<String> = models().iter().map(|(n, p)| format!("{n}={p}")).collect();
    let (kv, budget) = (format!("{KV_MIB}MiB"), format!("{BUDGET_MIB}MiB"));
    let mut args = vec!["--threads", "1", "--kv-cache-memory", &kv, "--memory-budget", &budget];
    for s in &specs {
        args.extend(["--model", s]);
    }
    let host = Arc::new(Host::start(&args));

    // Sample the ranks' resident memory every 100 ms while the clients run.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (done, peak, mark) = (done.clone(), peak.clone(), host.mark.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                peak.fetch_max(ranks_resident(&mark), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    // Six clients, five requests each, cycling over the models and the prompts.
    let clients: Vec<_> = (0..6)
        .map(|client| {
            let (host, expected) = (host.clone(), expected.clone());
            std::thread::spawn(move || {
                for j in 0..5 {
                    let (m, p) = ((client + j) % 3, (client * 5 + j) % 3);
                    let (name, _) = models()[m];
                    let body = json!({"model": name, "prompt": prompt(prompts[p]),
                                      "max_tokens": MAX, "temperature": 0});
                    let reply = host.post("/v1/completions", &body);
                    assert_eq!(reply.status, 200, "client {client} #{j} ({name}): {reply:?}");
                    let answer = reply.json();
                    assert_eq!(answer["model"], name);
                    assert_eq!(
                        ids(&answer["choices"][0]["token_ids"]),
                        expected[m][p],
                        "client {client} #{j}: model {name}, prompt {}",
                        prompts[p]
                    );
                }
            })
        })
        .collect();
    let start = Instant::now();
    for client in clients {
        while !client.is_finished() {
            assert!(start.elapsed() < DEADLINE, "clients still waiting\n{}", host.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        if client.join().is_err() {
            panic!("a client failed\n{}", host.log());
        }
    }
    done.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    let peak = peak.load(Ordering::SeqCst);
    assert!(peak > 0, "no rank was sampled");
    assert!(
        peak <= BUDGET_MIB * MIB,
        "the ranks held {peak} bytes together, over the budget of {BUDGET_MIB} MiB"
    );

    // A client that goes away while its model is being woken leaves no model stuck in the
    // middle of a swap, and no request counted as waiting.
    let asleep = host.get("/v1/models").json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["state"] == "asleep")
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .expect("an asleep model");
    {
        let body = json!({"model": asleep, "prompt": prompt("1"), "max_tokens": 2}).to_string();
        let mut stream = TcpStream::connect(&host.addr).unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(body.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    let start = Instant::now();
    loop {
        let listed = host.get("/v1/models").json();
        let moving = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["state"] == "waking" || c["state"] == "sleeping" || c["in_flight"] != 0);
        if !moving {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "a swap never ended: {listed}\n{}", host.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let reply = host
        .post("/v1/completions", &json!({"model": asleep, "prompt": prompt("1"), "max_tokens": 2}));
    assert_eq!(reply.status, 200, "{reply:?}");

    // A stream passes through event by event, from the model named.
    let stream = host.post(
        "/v1/completions",
        &json!({"model": "c", "prompt": prompt("1"), "max_tokens": 3, "stream": true,
                "temperature": 0}),
    );
    assert_eq!(stream.status, 200, "{stream:?}");
    assert!(stream.head.to_ascii_lowercase().contains("text/event-stream"), "{stream:?}");
    assert!(stream.body.trim_end().ends_with("data: [DONE]"), "{stream:?}");

    // Every model listed with its state; one awake at most, the budget held.
    let listed = host.get("/v1/models").json();
    let cards = listed["data"].as_array().expect("a list").clone();
    let names: Vec<&str> = cards.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    let awake = cards.iter().filter(|c| c["state"] == "awake").count();
    assert_eq!(awake, 1, "{listed}");
    for card in &cards {
        if card["state"] == "asleep" {
            assert_eq!(card["sleep_level"], 1, "{card}");
        }
        assert!(card["resident_bytes"].as_u64().is_some_and(|b| b > 0), "{card}");
    }
    // Each model's resident bytes per device, as its ranks last read them: on the CPU, the
    // host's alone, and the awake model holds more there than any asleep one.
    let host_bytes = |state: &str| -> Vec<u64> {
        cards
            .iter()
            .filter(|c| c["state"] == state)
            .map(|c| {
                let devices = c["resident_bytes_by_device"].as_object().expect("per device");
                assert_eq!(devices.keys().collect::<Vec<_>>(), ["host"], "{c}");
                devices["host"].as_u64().unwrap()
            })
            .collect()
    };
    let (awake_host, asleep_host) = (host_bytes("awake"), host_bytes("asleep"));
    assert!(asleep_host.iter().all(|&b| 0 < b && b < awake_host[0]), "{listed}");
    assert!(listed["resident_bytes"].as_u64().unwrap() <= BUDGET_MIB * MIB, "{listed}");
    let metrics = host.get("/metrics").body;
    let count = |family: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(family))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(count("tpctl_host_requests_total{"), 33.0, "{metrics}");
    assert_eq!(count("tpctl_host_queue_depth{"), 0.0, "{metrics}");
    assert!(count("tpctl_host_swaps_in_total{") >= 3.0, "{metrics}");
    assert!(metrics.contains("tpctl_host_swaps_out_total{model=\"a\"}"), "{metrics}");
    // The models' own metrics, each family once, every model's samples under it.
    for name in ["a", "b", "c"] {
        let sample = format!("vllm:prompt_tokens_total{{model_name=\"{name}\"}} ");
        assert!(metrics.contains(&sample), "{sample}\n{metrics}");
    }
    let headers = metrics.lines().filter(|l| l.starts_with("# TYPE vllm:prompt_tokens_total "));
    assert_eq!(headers.count(), 1, "{metrics}");

    // Bad requests: an unknown model is a 404 naming the models, a missing one a 400.
    let unknown = host.post("/v1/completions", &json!({"model": "zz", "prompt": "t1"}));
    assert_eq!(unknown.status, 404, "{unknown:?}");
    let error = &unknown.json()["error"];
    assert_eq!(error["code"], "model_not_found");
    assert_eq!(error["message"], "The model `zz` does not exist. Models: `a`, `b`, `c`");
    let missing = host.post("/v1/chat/completions", &json!({"messages": []}));
    assert_eq!(missing.status, 400, "{missing:?}");
    assert_eq!(missing.json()["error"]["code"], "missing_model");

    let host = Arc::into_inner(host).expect("the clients are done");
    let status = host.interrupt();
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_budget_that_cannot_hold_a_model_is_refused_at_start_with_the_numbers() {
    let spec = format!("a={}", common::tiny_model());
    let other = format!("b={}", common::tiny_q4_model());
    let kv = format!("{KV_MIB}MiB");
    let out = common::run_tpctl(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--kv-cache-memory",
            &kv,
            "--memory-budget",
            "200MiB",
            "--model",
            &spec,
            "--model",
            &other,
        ],
        DEADLINE,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", common::describe(&out));
    assert!(
        stderr.contains("error: --memory-budget 200.0 MiB cannot hold model `a` awake: it needs "),
        "{stderr}"
    );
    assert!(stderr.contains(" MiB to wake beside the "), "{stderr}");
    assert!(stderr.contains("give at least"), "{stderr}");
}

#[test]
fn bad_model_lists_are_refused_before_anything_starts() {
    let tiny = common::tiny_model();
    let (a, b) = (format!("a={tiny}"), format!("b={tiny}"));
    let twice = common::scratch("twice.toml");
    let table = format!("[[models]]\nname = \"a\"\nmodel = \"{tiny}\"\n");
    std::fs::write(&twice, format!("{table}\n{table}")).unwrap();
    let twice = twice.to_string_lossy().into_owned();
    for (args, message) in [
        (
            vec!["serve", "--model", &a, "--model", &a],
            "two models are named `a`: give each --model NAME=PATH its own name",
        ),
        (vec!["serve", "--model", &a, "--model", tiny], "with several models each is NAME=PATH"),
        (
            vec!["serve", "--model", tiny, "--memory-budget", "0.5"],
            "--memory-budget is for a server of several models",
        ),
        (
            vec!["serve", "--model", &a, "--model", &b, "--memory-budget", "2.5"],
            "not a memory budget",
        ),
        (vec!["run", "--model", &a, "--model", &b], "`tpctl run` runs one model"),
        (vec!["serve", &twice], "`models[1].name` `a` is the name of an earlier model"),
    ] {
        let out = common::run_tpctl(&args, DEADLINE);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{args:?}: {}", common::describe(&out));
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// The launcher of model `name` among the processes carrying `mark`.
fn model_launcher(mark: &str, name: &str) -> Option<u32> {
    leftovers(mark).into_iter().find(|pid| {
        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
            let args: Vec<&[u8]> = c.split(|&b| b == 0).collect();
            args.windows(2).any(|w| w[0] == b"--served-model-name" && w[1] == name.as_bytes())
        })
    })
}

/// The processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1));
        if ppid.and_then(|p| p.parse::<u32>().ok()) == Some(parent) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn config_models_pinned_and_at_level_2_and_a_rank_death_that_stays_local_and_restarts() {
    const MAX: u32 = 3;
    let expected: Vec<Vec<u64>> =
        models().iter().map(|(_, path)| alone(path, &["4,5"], MAX).remove(0)).collect();
    // `a` never sleeps; `b` sleeps at level 2 (its weights reloaded from the checkpoint); the
    // budget holds `a` and one other awake.
    let [(_, a), (_, b), (_, c)] = models();
    let config = common::scratch("host.toml");
    let text = format!(
        "[server]\nmemory_budget = \"{}MiB\"\n\n\
         [[models]]\nname = \"a\"\nmodel = \"{a}\"\npinned = true\n\n\
         [[models]]\nname = \"b\"\nmodel = \"{b}\"\nsleep_level = 2\n\n\
         [[models]]\nname = \"c\"\nmodel = \"{c}\"\n",
        BUDGET_MIB + KV_MIB
    );
    std::fs::write(&config, text).unwrap();
    let config = config.to_string_lossy().into_owned();
    let kv = format!("{KV_MIB}MiB");
    let host = Host::start(&[&config, "--threads", "1", "--kv-cache-memory", &kv]);
    let ask = |name: &str| {
        host.post(
            "/v1/completions",
            &json!({"model": name, "prompt": prompt("4,5"), "max_tokens": MAX, "temperature": 0}),
        )
    };
    let states = || -> Vec<(String, Value)> {
        let listed = host.get("/v1/models").json();
        let cards = listed["data"].as_array().expect("a list").clone();
        cards
            .iter()
            .map(|c| (c["state"].as_str().unwrap().to_owned(), c["sleep_level"].clone()))
            .collect()
    };
    let at = |state: &str, level: Value| (state.to_owned(), level);
    assert_eq!(
        states(),
        [at("awake", Value::Null), at("asleep", json!(2)), at("asleep", json!(1))]
    );
    for (i, name) in [(1, "b"), (2, "c"), (1, "b"), (0, "a")] {
        let reply = ask(name);
        assert_eq!(reply.status, 200, "{name}: {reply:?}\n{}", host.log());
        assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected[i], "{name}");
    }
    assert_eq!(
        states(),
        [at("awake", Value::Null), at("awake", Value::Null), at("asleep", json!(1))]
    );

    // Kill model b's rank as the OOM killer would.
    let launcher = model_launcher(&host.mark, "b").expect("model b's launcher");
    let ranks = children_of(launcher);
    assert_eq!(ranks.len(), 1, "one rank under model b's launcher: {ranks:?}");
    let rank = ranks[0].to_string();
    assert!(Command::new("kill").args(["-KILL", &rank]).status().is_ok_and(|s| s.success()));
    let start = Instant::now();
    loop {
        let listed = host.get("/v1/models").json();
        if listed["data"][1]["state"] == "failed" {
            assert!(listed["data"][1]["failure"].as_str().is_some_and(|f| !f.is_empty()));
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "model b never marked failed: {listed}\n{}",
            host.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // The next request for it starts it again (making room as a wakeup does) and is answered
    // as it alone answers; the other two answer as before.
    for (i, name) in [(1, "b"), (2, "c"), (0, "a"), (1, "b"), (2, "c")] {
        let reply = ask(name);
        assert_eq!(reply.status, 200, "{name}: {reply:?}\n{}", host.log());
        assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected[i], "{name}");
    }
    let metrics = host.get("/metrics").body;
    assert!(metrics.contains("tpctl_host_restarts_total{model=\"b\"} 1"), "{metrics}");
    assert!(host.log().contains("model `b` failed; starting it again"), "{}", host.log());
    assert_eq!(host.get("/health").status, 200);
    let status = host.interrupt();
    assert!(status.success(), "{status:?}");
}

/// A model whose wakeups fail (a failpoint in its deployment alone): its requests get a 503
/// naming the failure, it stays asleep, and the other two keep serving.
#[cfg(feature = "failpoints")]
#[test]
fn a_failing_wakeup_leaves_that_model_asleep_and_the_others_serving() {
    const MAX: u32 = 3;
    let expected: Vec<Vec<u64>> =
        models().iter().map(|(_, path)| alone(path, &["6"], MAX).remove(0)).collect();
    let [(_, a), (_, b), (_, c)] = models();
    let config = common::scratch("failing.toml");
    // The first prepare (the sleep at start) passes; every later one (a wakeup) fails.
    let text = format!(
        "[server]\nmemory_budget = \"{BUDGET_MIB}MiB\"\n\n\
         [[models]]\nname = \"a\"\nmodel = \"{a}\"\n\n\
         [[models]]\nname = \"b\"\nmodel = \"{b}\"\n\
         env = {{ TPCTL_FAILPOINTS = \"sleep.prepare=error#1\" }}\n\n\
         [[models]]\nname = \"c\"\nmodel = \"{c}\"\n"
    );
    std::fs::write(&config, text).unwrap();
    let config = config.to_string_lossy().into_owned();
    let kv = format!("{KV_MIB}MiB");
    let host = Host::start(&[&config, "--threads", "1", "--kv-cache-memory", &kv]);
    let ask = |name: &str| {
        host.post(
            "/v1/completions",
            &json!({"model": name, "prompt": prompt("6"), "max_tokens": MAX, "temperature": 0}),
        )
    };
    assert_eq!(ask("a").status, 200);
    for _ in 0..2 {
        let refused = ask("b");
        assert_eq!(refused.status, 503, "{refused:?}");
        assert!(refused.head.to_ascii_lowercase().contains("retry-after:"), "{refused:?}");
        let message = refused.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.starts_with("model `b` could not wake up: "), "{message}");
        assert!(message.contains("injected failure"), "{message}");
    }
    let listed = host.get("/v1/models").json();
    assert_eq!(listed["data"][1]["state"], "asleep", "{listed}");
    for (i, name) in [(2, "c"), (0, "a"), (2, "c")] {
        let reply = ask(name);
        assert_eq!(reply.status, 200, "{name}: {reply:?}\n{}", host.log());
        assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected[i], "{name}");
    }
    let metrics = host.get("/metrics").body;
    assert!(metrics.contains("tpctl_host_failed_swaps_total{model=\"b\"} 2"), "{metrics}");
    let status = host.interrupt();
    assert!(status.success(), "{status:?}");
}

/// A host killed outright (no chance to stop its models) leaves no process behind: each
/// model's deployment sees its host gone and stops its ranks.
#[test]
fn a_killed_host_leaves_no_rank_behind() {
    let specs: Vec<String> = models()[..2].iter().map(|(n, p)| format!("{n}={p}")).collect();
    let host = Host::start(&["--threads", "1", "--model", &specs[0], "--model", &specs[1]]);
    assert!(host.get("/v1/models").status == 200);
    let pid = host.child.as_ref().expect("running").id().to_string();
    assert!(Command::new("kill").args(["-KILL", &pid]).status().is_ok_and(|s| s.success()));
    let status = host.wait();
    assert_eq!(status.code(), None, "killed by a signal: {status:?}");
}

/// Runs `tpctl ARGS` against the deployments of the runtime folder `rt`, to its end (with a
/// deadline).
fn ctl(rt: &str, args: &[&str]) -> std::process::Output {
    let mark = marker();
    let mut child = common::tpctl_command(&mark)
        .env("XDG_RUNTIME_DIR", rt)
        .args(args)
        .spawn()
        .expect("start tpctl");
    let start = Instant::now();
    while child.try_wait().expect("wait for tpctl").is_none() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            kill_all(&mark);
            panic!("tpctl {args:?} still running after {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect output")
}

/// A completion of `max` greedy tokens of `prompt` from model `name`.
fn completion(name: &str, prompt_ids: &str, max: u32) -> Value {
    json!({"model": name, "prompt": prompt(prompt_ids), "max_tokens": max, "temperature": 0})
}

/// The host's own control socket: `tpctl status` with no deployment shows its table, other
/// methods are refused naming the models' deployments, `tpctl stop` stops it; and the host
/// books a model put to sleep or woken by hand (through its own deployment) as its
/// deployment reports it.
#[test]
fn the_host_has_a_control_socket_and_follows_models_slept_and_woken_by_hand() {
    const MAX: u32 = 3;
    let two = &models()[..2];
    let expected: Vec<Vec<u64>> =
        two.iter().map(|(_, path)| alone(path, &["7"], MAX).remove(0)).collect();
    let rt = common::scratch("rt-follow").to_string_lossy().into_owned();
    let specs: Vec<String> = two.iter().map(|(n, p)| format!("{n}={p}")).collect();
    let (kv, budget) = (format!("{KV_MIB}MiB"), format!("{BUDGET_MIB}MiB"));
    let mut args = vec!["--threads", "1", "--kv-cache-memory", &kv, "--memory-budget", &budget];
    args.extend(["--deployment", "h", "--model", &specs[0], "--model", &specs[1]]);
    let host = Host::announced(&args, &[("XDG_RUNTIME_DIR", rt.as_str())]);
    host.loaded();

    // With no deployment named, the host and its models are one deployment: its table.
    let out = ctl(&rt, &["status"]);
    assert_eq!(out.status.code(), Some(0), "{}", common::describe(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.starts_with("model host h: memory budget 504.0 MiB, "), "{stdout}");
    let rows: Vec<Vec<&str>> =
        stdout.lines().skip(2).map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows[0][..5], ["a", "h-a", "asleep", "(level", "1)"], "{stdout}");
    assert_eq!(rows[1][..5], ["b", "h-b", "asleep", "(level", "1)"], "{stdout}");
    assert_eq!(rows[0].last(), Some(&two[0].1), "{stdout}");

    let reply = host.post("/v1/completions", &completion("a", "7", MAX));
    assert_eq!(reply.status, 200, "{reply:?}");
    let out = ctl(&rt, &["status", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", common::describe(&out));
    let table: Value = serde_json::from_slice(&out.stdout).unwrap();
    let a = &table["host"]["models"][0];
    assert_eq!(
        (&a["state"], &a["in_flight"], &a["queued"]),
        (&json!("awake"), &json!(0), &json!(0))
    );
    assert_eq!(a["checkpoint"], two[0].1, "{table}");

    // Put to sleep by hand through its own deployment: booked asleep, at no level it knows.
    let out = ctl(&rt, &["sleep", "--deployment", "h-a"]);
    assert_eq!(out.status.code(), Some(0), "{}", common::describe(&out));
    let listed = host.until("a booked asleep", |l| l["data"][0]["state"] == "asleep");
    assert_eq!(listed["data"][0]["sleep_level"], Value::Null, "{listed}");
    // Woken by hand: booked awake.
    let out = ctl(&rt, &["wakeup", "--deployment", "h-b"]);
    assert_eq!(out.status.code(), Some(0), "{}", common::describe(&out));
    host.until("b booked awake", |l| l["data"][1]["state"] == "awake");
    // A request for `a` wakes it, `b` sleeping first to make room; both answer as alone.
    for (i, name) in [(0, "a"), (1, "b"), (0, "a")] {
        let reply = host.post("/v1/completions", &completion(name, "7", MAX));
        assert_eq!(reply.status, 200, "{name}: {reply:?}\n{}", host.log());
        assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected[i], "{name}");
    }
    let listed = host.get("/v1/models").json();
    assert_eq!(listed["data"][0]["state"], "awake", "{listed}");
    assert_eq!(listed["data"][1]["state"], "asleep", "{listed}");

    // The host's socket refuses what goes to a model, naming them.
    let out = ctl(&rt, &["sleep"]);
    assert_eq!(out.status.code(), Some(1), "{}", common::describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "`h` is a model host: `sleep` goes to one of its models, --deployment h-a, h-b"
        ),
        "{stderr}"
    );
    let out = ctl(&rt, &["stop"]);
    assert_eq!(out.status.code(), Some(0), "{}", common::describe(&out));
    let status = host.wait();
    assert!(status.success(), "{status:?}");
}

/// A model that must sleep to make room while a long request runs waits for it only up to
/// `[server] drain_timeout`, then sleeps with it paused (keep); the other model answers, and
/// the paused request continues once its model wakes again, with the tokens it has alone.
#[cfg(feature = "failpoints")]
#[test]
fn a_model_still_busy_after_the_drain_bound_sleeps_with_its_requests_paused_and_continues_them() {
    const LONG: u32 = 40;
    const MAX: u32 = 3;
    let [(_, a), (_, b), _] = models();
    let expected_a = alone(a, &["1,2"], LONG).remove(0);
    let expected_b = alone(b, &["6"], MAX).remove(0);
    let config = common::scratch("drain.toml");
    // Each step of `a` takes 100 ms more: its long request outlives the drain bound.
    let text = format!(
        "[server]\nmemory_budget = \"{BUDGET_MIB}MiB\"\ndrain_timeout = 0.2\n\n\
         [[models]]\nname = \"a\"\nmodel = \"{a}\"\n\
         env = {{ TPCTL_FAILPOINTS = \"session.step=delay(100)\" }}\n\n\
         [[models]]\nname = \"b\"\nmodel = \"{b}\"\n"
    );
    std::fs::write(&config, text).unwrap();
    let config = config.to_string_lossy().into_owned();
    let kv = format!("{KV_MIB}MiB");
    let host = Arc::new(Host::start(&[&config, "--threads", "1", "--kv-cache-memory", &kv]));
    let long = {
        let host = host.clone();
        std::thread::spawn(move || host.post("/v1/completions", &completion("a", "1,2", LONG)))
    };
    host.until("a runs the long request", |l| {
        l["data"][0]["state"] == "awake" && l["data"][0]["in_flight"] == 1
    });
    let reply = host.post("/v1/completions", &completion("b", "6", MAX));
    assert_eq!(reply.status, 200, "{reply:?}\n{}", host.log());
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected_b);
    let start = Instant::now();
    while !long.is_finished() {
        assert!(start.elapsed() < DEADLINE, "the paused request never ended\n{}", host.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let long = long.join().unwrap();
    assert_eq!(long.status, 200, "{long:?}\n{}", host.log());
    assert_eq!(ids(&long.json()["choices"][0]["token_ids"]), expected_a, "{}", host.log());
    let metrics = host.get("/metrics").body;
    assert!(metrics.contains("tpctl_host_kept_requests_total{model=\"a\"} 1"), "{metrics}");
    assert!(
        host.log().contains("model `a` still runs 1 request(s) after 0.2 s ([server] drain_timeout): it sleeps with them paused (keep)"),
        "{}",
        host.log()
    );
    let host = Arc::into_inner(host).expect("the client is done");
    assert!(host.interrupt().success());
}

/// The models show `loading` while they start (`/health` 503 meanwhile), and a model whose
/// ranks died starts again with `tpctl restart --deployment HOST-NAME`, with no request for
/// it; a model that has not failed, or one no host has, is refused.
#[cfg(feature = "failpoints")]
#[test]
fn models_show_loading_at_start_and_a_failed_model_restarts_by_hand() {
    const MAX: u32 = 3;
    let [(_, a), (_, b), _] = models();
    let expected_b = alone(b, &["6"], MAX).remove(0);
    let rt = common::scratch("rt-restart").to_string_lossy().into_owned();
    let config = common::scratch("restart.toml");
    // `b`'s engine starts 1.5 s late: it is still loading when the API first answers.
    let text = format!(
        "[server]\nmemory_budget = \"{BUDGET_MIB}MiB\"\n\n\
         [[models]]\nname = \"a\"\nmodel = \"{a}\"\n\n\
         [[models]]\nname = \"b\"\nmodel = \"{b}\"\n\
         env = {{ TPCTL_FAILPOINTS = \"session.init=delay(1500)\" }}\n"
    );
    std::fs::write(&config, text).unwrap();
    let config = config.to_string_lossy().into_owned();
    let kv = format!("{KV_MIB}MiB");
    let args = [&config, "--threads", "1", "--kv-cache-memory", &kv, "--deployment", "h"];
    let host = Host::announced(&args, &[("XDG_RUNTIME_DIR", rt.as_str())]);
    let health = host.get("/health");
    assert_eq!(health.status, 503, "{health:?}");
    assert_eq!(health.json()["status"], "loading", "{health:?}");
    let listed = host.get("/v1/models").json();
    assert_eq!(listed["data"][1]["state"], "loading", "{listed}");
    host.loaded();

    let reply = host.post("/v1/completions", &completion("b", "6", MAX));
    assert_eq!(reply.status, 200, "{reply:?}");
    let launcher = model_launcher(&host.mark, "b").expect("model b's launcher");
    let ranks = children_of(launcher);
    assert_eq!(ranks.len(), 1, "one rank under model b's launcher: {ranks:?}");
    assert!(Command::new("kill")
        .args(["-KILL", &ranks[0].to_string()])
        .status()
        .is_ok_and(|s| s.success()));
    host.until("b failed", |l| l["data"][1]["state"] == "failed");

    let out = ctl(&rt, &["restart", "--deployment", "h-b"]);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", common::describe(&out), host.log());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("model h-b started again\n"));
    let listed = host.get("/v1/models").json();
    assert_eq!(listed["data"][1]["state"], "awake", "{listed}");
    let metrics = host.get("/metrics").body;
    assert!(metrics.contains("tpctl_host_restarts_total{model=\"b\"} 1"), "{metrics}");
    let reply = host.post("/v1/completions", &completion("b", "6", MAX));
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected_b);

    for (deployment, message) in [
        ("h-a", "model `a` is asleep at level 1, not failed: `tpctl restart` starts a failed model again"),
        ("h-zz", "no running model host has a model with deployment `h-zz`"),
    ] {
        let out = ctl(&rt, &["restart", "--deployment", deployment]);
        assert_eq!(out.status.code(), Some(1), "{}", common::describe(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{stderr}");
    }
    assert!(host.interrupt().success());
}

/// A model answers as soon as it is measured, while the next still loads: the request for
/// `a`, sent while the host starts, is answered as `a` alone answers it while `b` (its engine
/// held 30 s by a failpoint) is still loading; then `a` is put to sleep for `b`'s load. Before,
/// every request waited until all the models had loaded.
#[test]
fn a_model_serves_before_the_others_have_loaded() {
    const MAX: u32 = 3;
    let [(_, a), (_, b), _] = models();
    let expected_a = alone(a, &["5,6"], MAX).remove(0);
    let config = common::scratch("early.toml");
    let text = format!(
        "[server]\nmemory_budget = \"{BUDGET_MIB}MiB\"\n\n\
         [[models]]\nname = \"a\"\nmodel = \"{a}\"\n\n\
         [[models]]\nname = \"b\"\nmodel = \"{b}\"\n\
         env = {{ TPCTL_FAILPOINTS = \"session.init=delay(30000)\" }}\n"
    );
    std::fs::write(&config, text).unwrap();
    let config = config.to_string_lossy().into_owned();
    let kv = format!("{KV_MIB}MiB");
    let host = Host::announced(&[&config, "--threads", "1", "--kv-cache-memory", &kv], &[]);

    let reply = host.post("/v1/completions", &completion("a", "5,6", MAX));
    assert_eq!(reply.status, 200, "{reply:?}\n{}", host.log());
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected_a);
    let listed = host.get("/v1/models").json();
    assert_eq!(listed["data"][1]["state"], "loading", "b is still loading\n{listed}");
    assert_eq!(host.get("/health").json()["status"], "loading");
    // `b`'s load starts with `a` asleep again: its size is not known before it is measured.
    let listed = host.until("a asleep", |l| l["data"][0]["state"] != "awake");
    assert_eq!(listed["data"][1]["state"], "loading", "{listed}");
    host.interrupt();
}

/// A level-1 sleep whose backup host memory cannot hold (here: `MemAvailable` cannot be
/// read, a failpoint) is a level-2 one, said in the log and counted; the model still answers
/// as alone after it.
#[cfg(feature = "failpoints")]
#[test]
fn a_level_1_sleep_without_host_memory_for_its_backup_is_a_level_2_one() {
    const MAX: u32 = 3;
    let two = &models()[..2];
    let expected: Vec<Vec<u64>> =
        two.iter().map(|(_, path)| alone(path, &["6"], MAX).remove(0)).collect();
    let specs: Vec<String> = two.iter().map(|(n, p)| format!("{n}={p}")).collect();
    let (kv, budget) = (format!("{KV_MIB}MiB"), format!("{BUDGET_MIB}MiB"));
    let mut args = vec!["--threads", "1", "--kv-cache-memory", &kv, "--memory-budget", &budget];
    args.extend(["--model", &specs[0], "--model", &specs[1]]);
    let host = Host::announced(&args, &[("TPCTL_FAILPOINTS", "host.mem_available=error")]);
    host.loaded();
    let listed = host.get("/v1/models").json();
    for card in listed["data"].as_array().unwrap() {
        assert_eq!((&card["state"], &card["sleep_level"]), (&json!("asleep"), &json!(2)), "{card}");
    }
    for (i, name) in [(0, "a"), (1, "b"), (0, "a")] {
        let reply = host.post("/v1/completions", &completion(name, "6", MAX));
        assert_eq!(reply.status, 200, "{name}: {reply:?}\n{}", host.log());
        assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected[i], "{name}");
    }
    let listed = host.get("/v1/models").json();
    assert_eq!(listed["data"][1]["sleep_level"], 2, "{listed}");
    let metrics = host.get("/metrics").body;
    assert!(metrics.contains("tpctl_host_level2_sleeps_total{model=\"a\"} 2"), "{metrics}");
    assert!(metrics.contains("tpctl_host_level2_sleeps_total{model=\"b\"} 2"), "{metrics}");
    assert!(
        host.log()
            .contains("model `a` sleeps at level 2: the host memory its level-1 backup needs"),
        "{}",
        host.log()
    );
    assert!(host.interrupt().success());
}
