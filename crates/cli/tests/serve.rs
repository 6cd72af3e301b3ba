//! `tpctl serve` end to end, through the binary, on a tiny random model over loopback: the
//! same greedy tokens as `tpctl run`, SSE streaming, concurrent requests, the metrics, bad
//! requests answered with 4xx, the API key, and Ctrl-C leaving no process behind. Every wait
//! has a deadline.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

mod common;

use common::http::{dechunk, exchange, ids, request, Reply};
use common::{kill_all, leftovers, marker, scratch, scratch_root, tpctl_bin};

const DEADLINE: Duration = Duration::from_secs(120);

fn model() -> &'static str {
    common::tiny_model()
}

/// The tiny model with a chat template that wraps each message in `t1 … t2` and opens the
/// answer with `t3`.
fn chat_model() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        use checkpoint::gguf::Value;
        let path = scratch("tiny-chat.gguf");
        let spec = layers::model::random::RandomLlama {
            heads: 6,
            kv_heads: 3,
            hidden: 48,
            ffn: 64,
            seed: 7,
            ..Default::default()
        };
        let mut writer = spec.writer();
        writer
            .metadata(
                "tokenizer.ggml.token_type",
                Value::Array((0..spec.vocab).map(|_| Value::I32(3)).collect()),
            )
            .metadata("tokenizer.chat_template", Value::String(CHAT_TEMPLATE.into()));
        writer.write(&path).expect("write the tiny chat model");
        path.to_string_lossy().into_owned()
    })
}

/// `t1`, each message, `t2`; then `t3` to open the reply.
const CHAT_TEMPLATE: &str = "{% for m in messages %}t1{{ m.content }}t2{% endfor %}{% if add_generation_prompt %}t3{% endif %}";

fn tpctl(args: &[&str]) -> Output {
    common::run_tpctl(args, DEADLINE)
}

/// A running `tpctl serve`; killed with everything it started if a test fails.
struct Server {
    child: Option<Child>,
    mark: String,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `tpctl serve --model MODEL --listen 127.0.0.1:0 ARGS` and waits until
    /// `/health` says ok.
    fn start(model: &str, args: &[&str]) -> Server {
        Server::start_with(model, args, &[])
    }

    /// As [`Server::start`], with `env` in the environment of the launcher and the ranks.
    fn start_with(model: &str, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mark = marker();
        // `--host` / `--port` replace `--listen` (clap refuses both).
        let vllm_address = args.iter().any(|a| *a == "--host" || *a == "--port");
        let listen: &[&str] = if vllm_address { &[] } else { &["--listen", "127.0.0.1:0"] };
        let mut child = common::tpctl_command(&mark)
            .args(["serve", "--model", model, "--threads", "1"])
            .args(listen)
            .args(args)
            .envs(env.iter().copied())
            .spawn()
            .expect("start tpctl serve");
        let log = Arc::new(Mutex::new(String::new()));
        let (lines_tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        for (stream, tx) in [
            (Box::new(stdout) as Box<dyn Read + Send>, Some(lines_tx)),
            (Box::new(stderr) as Box<dyn Read + Send>, None),
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
        let mut server = Server { child: Some(child), mark, addr: String::new(), log };
        let start = Instant::now();
        while server.addr.is_empty() {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some((_, rest)) = line.split_once(" on http://") {
                        server.addr = rest.split_whitespace().next().unwrap_or("").to_owned();
                    }
                }
                Err(_) => panic!("tpctl serve announced no address\n{}", server.log()),
            }
        }
        loop {
            assert!(start.elapsed() < DEADLINE, "/health never ok\n{}", server.log());
            if request(&server.addr, "GET", "/health", &[], None).status == 200 {
                return server;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn get(&self, path: &str) -> Reply {
        request(&self.addr, "GET", path, &[], None)
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        request(&self.addr, "POST", path, &[], Some(body.to_string().as_bytes()))
    }

    /// Interrupts the launcher as a terminal's Ctrl-C would, and waits for it.
    fn interrupt(self) -> ExitStatus {
        let child = self.child.as_ref().expect("running");
        let status = Command::new("kill").arg("-INT").arg(child.id().to_string()).status();
        assert!(status.is_ok_and(|s| s.success()));
        self.wait()
    }

    /// Waits for the launcher to exit (stopped, or failed), and checks that no process of it
    /// is left.
    fn wait(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait().expect("wait for tpctl serve") {
                assert_eq!(leftovers(&self.mark), Vec::<u32>::new(), "processes left behind");
                return status;
            }
            if start.elapsed() > DEADLINE {
                let _ = child.kill();
                kill_all(&self.mark);
                panic!("tpctl serve still running\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            kill_all(&self.mark);
        }
    }
}

/// `tpctl run`'s greedy tokens for each prompt (comma-separated ids), with `--tp 2`.
fn reference(model: &str, prompts: &[&str], max_tokens: u32) -> Vec<Vec<u64>> {
    let max = max_tokens.to_string();
    let mut args = vec![
        "run",
        "--model",
        model,
        "--tp",
        "2",
        "--threads",
        "1",
        "--max-tokens",
        &max,
        "--temperature",
        "0",
        "--output",
        "jsonl",
    ];
    for p in prompts {
        args.extend(["--prompt-ids", p]);
    }
    let out = tpctl(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    prompts
        .iter()
        .map(|p| {
            let line = lines.iter().find(|l| l["prompt"] == *p).expect("a line per prompt");
            ids(&line["token_ids"])
        })
        .collect()
}

/// A completion of each prompt (comma-separated ids), each sent on its own thread: the
/// replies come from the joins.
fn completions_in_background(
    server: &Arc<Server>,
    prompts: &[&str],
    max_tokens: u32,
) -> Vec<std::thread::JoinHandle<Reply>> {
    prompts
        .iter()
        .map(|p| {
            let (server, body) = (server.clone(), completion(p, max_tokens));
            std::thread::spawn(move || server.post("/v1/completions", &body))
        })
        .collect()
}

/// A running server's greedy tokens for each prompt (comma-separated ids), one request each.
fn greedy_ids(server: &Server, prompts: &[&str], max_tokens: u32) -> Vec<Vec<u64>> {
    prompts
        .iter()
        .map(|p| {
            let reply = server.post("/v1/completions", &completion(p, max_tokens));
            assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
            ids(&reply.json()["choices"][0]["token_ids"])
        })
        .collect()
}

fn prompt_ids(p: &str) -> Value {
    json!(p.split(',').map(|t| t.parse::<u32>().unwrap()).collect::<Vec<_>>())
}

fn completion(p: &str, max_tokens: u32) -> Value {
    json!({"prompt": prompt_ids(p), "max_tokens": max_tokens, "temperature": 0})
}

/// `body` with the fields of `extra` set (added or replaced).
fn with(mut body: Value, extra: &Value) -> Value {
    for (k, v) in extra.as_object().expect("extra fields are an object") {
        body[k] = v.clone();
    }
    body
}

/// The value of the metric line `name` (with labels) in a Prometheus text body.
/// The value of the sample `name` in a `/metrics` text; vLLM's families (`vllm:...`) are
/// found by their name alone, whatever their `model_name` label.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(name)?;
            match rest.strip_prefix("{model_name=") {
                Some(labelled) => labelled.split_once("} ").map(|(_, v)| v),
                None => rest.strip_prefix(' '),
            }
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{name}` in\n{text}"))
}

fn assert_error(reply: &Reply, status: u16, code: &str) {
    assert_eq!(reply.status, status, "{reply:?}");
    let body = reply.json();
    let error = &body["error"];
    assert_eq!(error["code"], code, "{reply:?}");
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{reply:?}");
    assert!(error["type"].is_string(), "{reply:?}");
}

#[test]
fn serve_answers_like_run_and_stops_on_ctrl_c() {
    const MAX: u32 = 6;
    let prompts = ["1,2,3,4,5", "9", "7,8", "40,41,42"];
    let expected = reference(model(), &prompts, MAX);
    let server = Server::start(model(), &["--tp", "2"]);
    let log = || server.log();

    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], model(), "{models}");

    // Non-streaming: the same greedy tokens as `tpctl run`.
    let mut ok = 0;
    let mut generated = 0;
    let reply = server.post("/v1/completions", &completion(prompts[0], MAX));
    assert_eq!(reply.status, 200, "{reply:?}\n{}", log());
    let body = reply.json();
    assert_eq!(ids(&body["choices"][0]["token_ids"]), expected[0], "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["prompt_tokens"], 5);
    assert_eq!(body["usage"]["completion_tokens"], expected[0].len());
    assert!(body["choices"][0]["finish_reason"].is_string());
    ok += 1;
    generated += expected[0].len();

    // Streaming: chunks whose tokens add up to the same, then [DONE].
    let mut req = completion(prompts[0], MAX);
    req["stream"] = json!(true);
    let reply = server.post("/v1/completions", &req);
    assert_eq!(reply.status, 200, "{reply:?}");
    let events = reply.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{reply:?}");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let streamed: Vec<u64> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["token_ids"].as_array().cloned().unwrap_or_default())
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(streamed, expected[0], "{reply:?}");
    let text: String =
        chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap_or("")).collect();
    assert_eq!(text, body["choices"][0]["text"].as_str().unwrap());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        body["choices"][0]["finish_reason"]
    );
    ok += 1;
    generated += expected[0].len();

    // Concurrent requests share the batch and each gets its own answer.
    let addr = server.addr.clone();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (addr, req) = (addr.clone(), completion(p, MAX).to_string());
            std::thread::spawn(move || {
                request(&addr, "POST", "/v1/completions", &[], Some(req.as_bytes()))
            })
        })
        .collect();
    for (handle, want) in handles.into_iter().zip(&expected) {
        let reply = handle.join().expect("client thread");
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(&ids(&reply.json()["choices"][0]["token_ids"]), want, "{reply:?}");
        ok += 1;
        generated += want.len();
    }

    // The tiny model has no chat template: a clear 400, and the server keeps going.
    let chat = json!({"messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 3});
    let reply = server.post("/v1/chat/completions", &chat);
    assert_error(&reply, 400, "chat_template");
    assert!(reply.body.contains("chat template"), "{reply:?}");

    // Bad requests: 4xx with an OpenAI-style error, none reaches the engine.
    let mut bad = 0;
    let post_raw =
        |body: &str| request(&addr, "POST", "/v1/completions", &[], Some(body.as_bytes()));
    for (reply, status, code) in [
        (post_raw("{\"prompt\": [1, 2"), 400, "invalid_json"),
        (post_raw("{\"max_tokens\": \"many\", \"prompt\": [1]}"), 400, "invalid_json"),
        (server.post("/v1/completions", &json!({"max_tokens": 3})), 400, "missing_prompt"),
        (server.post("/v1/completions", &json!({"prompt": ""})), 400, "empty_prompt"),
        (server.post("/v1/completions", &json!({"prompt": []})), 400, "empty_prompt"),
        (
            server.post("/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 1_000_000})),
            400,
            "context_length_exceeded",
        ),
        (server.post("/v1/completions", &json!({"prompt": [1, 100000]})), 400, "invalid_token_id"),
        (server.post("/v1/completions", &json!({"prompt": [1, -3]})), 400, "invalid_token_id"),
        (
            server.post("/v1/completions", &json!({"prompt": [1], "max_tokens": 0})),
            400,
            "invalid_max_tokens",
        ),
        (server.post("/v1/completions", &json!({"prompt": [1], "top_p": 0})), 400, "invalid_top_p"),
        (
            server.post("/v1/completions", &json!({"prompt": [1], "stop_token_ids": [99999]})),
            400,
            "invalid_token_id",
        ),
        (
            server.post("/v1/completions", &json!({"prompt": [1], "model": "gpt-4"})),
            404,
            "model_not_found",
        ),
    ] {
        assert_error(&reply, status, code);
        bad += 1;
    }
    // A body over the 1 MiB limit is refused by its declared length, unread.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"prompt\": [",
        2 << 20
    );
    let reply = exchange(&addr, head.as_bytes());
    assert_error(&reply, 413, "body_too_large");
    assert_error(&server.get("/v1/nothing"), 404, "not_found");
    assert_error(&server.get("/v1/completions"), 405, "method_not_allowed");

    // The server still answers correctly after all that.
    let reply = server.post("/v1/completions", &completion(prompts[1], MAX));
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected[1], "{reply:?}");
    ok += 1;
    generated += expected[1].len();

    let metrics = server.get("/metrics");
    assert_eq!(metrics.status, 200, "{metrics:?}");
    let m = &metrics.body;
    let route = "tpctl_http_requests_total{route=\"/v1/completions\"";
    assert_eq!(metric(m, &format!("{route},status=\"200\"}}")), ok as f64, "{m}");
    assert_eq!(metric(m, &format!("{route},status=\"400\"}}")), (bad - 1) as f64, "{m}");
    assert_eq!(metric(m, &format!("{route},status=\"404\"}}")), 1.0, "{m}");
    assert_eq!(metric(m, &format!("{route},status=\"413\"}}")), 1.0, "{m}");
    assert_eq!(metric(m, "tpctl_requests_total"), ok as f64, "{m}");
    assert_eq!(metric(m, "vllm:generation_tokens_total"), generated as f64, "{m}");
    assert_eq!(metric(m, "vllm:e2e_request_latency_seconds_count"), ok as f64, "{m}");
    assert_eq!(metric(m, "vllm:num_requests_running"), 0.0, "{m}");
    assert!(metric(m, "tpctl_steps_total") >= MAX as f64, "{m}");

    let status = server.interrupt();
    assert_eq!(status.code(), Some(130), "{status:?}");
}

#[test]
fn an_api_key_guards_every_route_but_health() {
    let server = Server::start(model(), &["--api-key", "s3cret", "--tp", "2"]);
    // Only rank 0 holds the key: not the other rank, not the spec every rank reads.
    let environ = |pid: &u32| std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let holders: Vec<Vec<u8>> = common::leftovers(&server.mark)
        .iter()
        .map(environ)
        .filter(|env| env.split(|&b| b == 0).any(|kv| kv.starts_with(b"TPCTL_RANK_SPEC=")))
        .collect();
    assert_eq!(holders.len(), 2, "two rank processes");
    let has = |env: &Vec<u8>, what: &[u8]| env.windows(what.len()).any(|w| w == what);
    let keyed = holders.iter().filter(|env| has(env, b"TPCTL_RANK0_API_KEY=s3cret")).count();
    assert_eq!(keyed, 1, "the key reaches rank 0 alone");
    for env in &holders {
        let spec = env.split(|&b| b == 0).find(|kv| kv.starts_with(b"TPCTL_RANK_SPEC=")).unwrap();
        assert!(!has(&spec.to_vec(), b"s3cret"), "the key is in the rank spec");
    }
    let models =
        |headers: &[(&str, &str)]| request(&server.addr, "GET", "/v1/models", headers, None);
    assert_error(&models(&[]), 401, "invalid_api_key");
    assert_error(&models(&[("Authorization", "Bearer wrong")]), 401, "invalid_api_key");
    assert_eq!(models(&[("Authorization", "Bearer s3cret")]).status, 200);
    let body = completion("1,2", 2).to_string();
    let post = |headers: &[(&str, &str)]| {
        request(&server.addr, "POST", "/v1/completions", headers, Some(body.as_bytes()))
    };
    assert_error(&post(&[]), 401, "invalid_api_key");
    let reply = post(&[("Authorization", "Bearer s3cret")]);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["usage"]["completion_tokens"], 2, "{reply:?}");
    assert_error(&server.get("/metrics"), 401, "invalid_api_key");
    assert_eq!(server.get("/health").status, 200);
    assert_eq!(server.interrupt().code(), Some(130));
}

#[test]
fn serve_announces_its_deployment_and_its_control_socket() {
    let name = format!("e2e-{}", std::process::id());
    let server = Server::start(model(), &["--deployment", &name]);
    let want = format!("tpctl: deployment {name} (control socket ");
    let start = Instant::now();
    while !server.log().contains(&want) {
        assert!(start.elapsed() < DEADLINE, "`{want}` not announced\n{}", server.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let line = server.log().lines().find(|l| l.contains(&want)).unwrap_or_default().to_owned();
    assert!(line.ends_with(&format!("/{name}.sock)")), "{line}");
    assert_eq!(server.interrupt().code(), Some(130));
}

#[test]
fn listening_beyond_loopback_needs_an_api_key() {
    let out = tpctl(&["serve", "--model", model(), "--listen", "0.0.0.0:0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("give --api-key"), "{err}");
    let out = tpctl(&["serve", "--model", model(), "--listen", "localhost"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected an address like 127.0.0.1:8000"), "{err}");
}

#[test]
fn chat_completions_apply_the_chat_template() {
    const MAX: u32 = 5;
    // "t5t6" from the user becomes t1 t5 t6 t2 t3 through the template.
    let expected = &reference(chat_model(), &["1,5,6,2,3"], MAX)[0];
    let server = Server::start(chat_model(), &["--cp", "2"]);
    let messages = json!([{"role": "user", "content": "t5t6"}]);
    let reply = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": MAX, "temperature": 0}),
    );
    assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
    let body = reply.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(&ids(&body["choices"][0]["token_ids"]), expected, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 5);

    // Content as text parts, streamed, with the usage chunk asked for.
    let parts = json!([{"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "text", "text": "t6"}]}]);
    let reply = server.post(
        "/v1/chat/completions",
        &json!({"messages": parts, "max_tokens": MAX, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}}),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let events = reply.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{reply:?}");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "{reply:?}");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"), "{reply:?}");
    let streamed: Vec<u64> = chunks
        .iter()
        .flat_map(|c| c["choices"][0]["token_ids"].as_array().cloned().unwrap_or_default())
        .map(|t| t.as_u64().unwrap())
        .collect();
    assert_eq!(&streamed, expected, "{reply:?}");
    let (usage, finish) = (&chunks[chunks.len() - 1], &chunks[chunks.len() - 2]);
    assert_eq!(finish["choices"][0]["finish_reason"], body["choices"][0]["finish_reason"]);
    assert_eq!(usage["usage"]["completion_tokens"], expected.len(), "{reply:?}");

    // A text prompt goes through the tokenizer: the same tokens without the template.
    let reply = server.post(
        "/v1/completions",
        &json!({"prompt": "t1t5t6t2t3", "max_tokens": MAX, "temperature": 0}),
    );
    assert_eq!(&ids(&reply.json()["choices"][0]["token_ids"]), expected, "{reply:?}");

    let reply = server.post("/v1/chat/completions", &json!({"messages": []}));
    assert_error(&reply, 400, "empty_messages");
    let reply =
        server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": 7}]}));
    assert_error(&reply, 400, "invalid_message");

    // `tools` this template does not render: answered as without them, with a warning that
    // says so, whole and in every streamed chunk; without tools there is none.
    let tool = json!({"type": "function", "function": {"name": "get_weather", "parameters": {}}});
    let ask = |extra: Value| {
        let body = json!({"messages": [{"role": "user", "content": "t5t6"}], "max_tokens": MAX,
                          "temperature": 0});
        server.post("/v1/chat/completions", &with(body, &extra))
    };
    let plain = ask(json!({}));
    assert!(plain.json().get("warning").is_none(), "{plain:?}");
    let ignored = ask(json!({"tools": [tool]}));
    assert_eq!(ignored.status, 200, "{ignored:?}");
    let warning = ignored.json()["warning"].as_str().unwrap_or_default().to_owned();
    assert!(warning.contains("does not render `tools`"), "{ignored:?}");
    assert_eq!(ignored.json()["choices"][0]["token_ids"], plain.json()["choices"][0]["token_ids"]);
    let streamed = ask(json!({"tools": [tool], "stream": true}));
    let events = streamed.events();
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| serde_json::from_str::<Value>(e).unwrap()["warning"] == warning.as_str()),
        "{streamed:?}"
    );
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A runtime directory (`$XDG_RUNTIME_DIR`) of its own, short enough for socket paths.
fn runtime_dir(name: &str) -> String {
    let dir = scratch_root().join(format!("rt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the runtime dir");
    dir.to_string_lossy().into_owned()
}

/// `tpctl ARGS --json` against the deployments of `runtime`: exit code and the JSON reply.
fn control(runtime: &str, args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(tpctl_bin())
        .args(args)
        .arg("--json")
        .env("XDG_RUNTIME_DIR", runtime)
        .env_remove("RUST_LOG")
        .output()
        .expect("run tpctl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let reply = stdout.lines().last().map_or(Value::Null, |l| serde_json::from_str(l).unwrap());
    (out.status.code().unwrap_or(-1), reply, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The KV pool is committed during start-up, on every rank: once `/health` answers, each
/// rank's resident memory already holds its whole pool (here 96 MiB, far more than the tiny
/// model's weights), so no request pays for faulting it in.
#[test]
fn every_ranks_kv_pool_is_resident_when_the_deployment_is_ready() {
    let rt = runtime_dir("pool");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let args = ["--cp", "2", "--kv-cache-memory", "96MiB", "--deployment", "pool"];
    let server = Server::start_with(model(), &args, &env);
    let (code, status, err) = control(&rt, &["status"]);
    assert_eq!(code, 0, "{err}\n{status}\n{}", server.log());
    let ranks = status["status"]["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2, "{status}");
    for r in ranks {
        let resident = r["after"]["resident"].as_u64().unwrap_or_else(|| panic!("{r}"));
        assert!(resident >= 96 << 20, "rank {}: {resident} bytes resident, pool 96 MiB", r["rank"]);
    }
    let (code, reply, err) = control(&rt, &["stop"]);
    assert_eq!(code, 0, "{err}\n{reply}");
    assert!(server.wait().success());
}

/// The default model, when `cargo xtask fetch-model` (CI runs it) cached it.
fn default_model() -> Option<String> {
    let path = checkpoint::cache::default_model_path()?;
    Some(path.to_string_lossy().into_owned())
}

/// The greedy text of `prompt` from a running server.
fn greedy_text(server: &Server, prompt: &str, max_tokens: u32) -> String {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let reply = server.post("/v1/completions", &body);
    assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
    reply.json()["choices"][0]["text"].as_str().expect("text").to_owned()
}

/// The integration of issue "multi-rank sleep/wakeup": four real rank processes (tp 2, cp 2)
/// serving the real model. `tpctl sleep --verify` frees, on every rank on its own, at least 90%
/// of the rank's tagged bytes (weights and KV cache); `tpctl wakeup` restores them (weights
/// reloaded from the GGUF); the greedy text after the wakeup is the text before the sleep; and
/// `tpctl stop` ends the deployment with no process left.
#[test]
fn sleep_frees_every_ranks_memory_and_wakeup_gives_the_same_text() {
    let Some(model) = default_model() else {
        eprintln!("note: default model not cached (run `cargo xtask fetch-model`); skipping");
        return;
    };
    let rt = runtime_dir("real");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let server =
        Server::start_with(&model, &["--tp", "2", "--cp", "2", "--deployment", "real"], &env);
    let prompt = "The capital of France is";
    let before = greedy_text(&server, prompt, 16);
    assert!(before.contains("Paris"), "{before}");

    let (code, reply, err) = control(&rt, &["sleep", "--verify"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    let ranks = reply["op"]["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 4, "{reply}");
    for r in ranks {
        let tags: Vec<&str> =
            r["tags"].as_array().unwrap().iter().map(|t| t["tag"].as_str().unwrap()).collect();
        assert!(tags.contains(&"weights") && tags.contains(&"kv_cache"), "{r}");
        // What the runtime holds sleeps too; a CPU rank holds none of it, and says so.
        for held in ["cuda_graph", "workspace", "nccl"] {
            let t = r["tags"].as_array().unwrap().iter().find(|t| t["tag"] == held);
            let t = t.unwrap_or_else(|| panic!("no {held} in {r}"));
            assert_eq!(
                (t["restore"].as_str(), t["bytes"].as_u64()),
                (Some("none"), Some(0)),
                "{r}"
            );
        }
        // The KV cache is one pool per rank, released whole.
        let kv = r["tags"].as_array().unwrap().iter().find(|t| t["tag"] == "kv_cache").unwrap();
        assert_eq!(kv["allocations"], 1, "{r}");
        let bytes: u64 =
            r["tags"].as_array().unwrap().iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
        assert!(bytes > 20 << 20, "rank {} released only {bytes} bytes", r["rank"]);
        let freed = r["before"]["resident"]
            .as_u64()
            .unwrap()
            .saturating_sub(r["after"]["resident"].as_u64().unwrap());
        assert!(
            freed >= bytes * 9 / 10,
            "rank {}: resident memory dropped by {freed} of {bytes} bytes",
            r["rank"]
        );
    }
    assert_eq!(server.get("/is_sleeping").json()["is_sleeping"], true);
    let (code, status, err) = control(&rt, &["status"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(status["status"]["state"], "sleeping", "{status}");

    // Asleep again: nothing to do, a zero receipt.
    let (code, again, _) = control(&rt, &["sleep"]);
    assert_eq!((code, again["op"]["bytes"].as_u64()), (0, Some(0)), "{again}");

    let (code, reply, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}\n{reply}");
    assert_eq!(reply["op"]["ranks"].as_array().map(Vec::len), Some(4));
    assert_eq!(server.get("/is_sleeping").json()["is_sleeping"], false);
    // A second cycle right away: a sleep just after a wakeup quiesces again, and the memory the
    // wakeup brought back (the discarded KV cache too) is held again, so it verifies.
    for op in [&["sleep", "--verify"][..], &["wakeup"]] {
        let (code, reply, err) = control(&rt, op);
        assert_eq!(code, 0, "second {op:?}: {err}\n{reply}");
    }
    assert_eq!(greedy_text(&server, prompt, 16), before, "the same text after the wakeups");

    let (code, reply, err) = control(&rt, &["stop"]);
    assert_eq!(code, 0, "{err}\n{reply}");
    assert!(server.wait().success());
}

/// Generations (a batch of three, Q4_1 weights) that run while the deployment goes to sleep
/// with mode `keep` continue after the wakeup with exactly the tokens of an uninterrupted
/// run, whether the KV cache was discarded (recomputed from the tokens) or spilled; a request
/// sent while asleep waits for the wakeup; mode `abort` ends running requests with finish
/// reason `abort`.
#[test]
fn generations_survive_a_sleep_with_mode_keep_and_abort_ends_them() {
    const MAX: u32 = 200;
    // A batch of three on a Q4_1 model: the sleep lands in the middle of their steps.
    let model = common::tiny_q4_model();
    let prompts = ["1,2,3", "9,8", "20,21,22,23,24"];
    let expected = reference(model, &prompts, MAX);
    let prompt = prompts[0];
    for (name, config) in [("discard", "discard"), ("backup", "backup")] {
        let rt = runtime_dir(name);
        let toml = scratch(&format!("sleep-{name}.toml"));
        std::fs::write(&toml, format!("[sleep.kv_cache]\nrestore = \"{config}\"\n")).unwrap();
        let env = [("XDG_RUNTIME_DIR", rt.as_str())];
        let args = ["--tp", "2", "--cp", "2", "--deployment", name, toml.to_str().unwrap()];
        let server = Arc::new(Server::start_with(model, &args, &env));
        let running = completions_in_background(&server, &prompts, MAX);
        let (code, reply, err) = control(&rt, &["sleep", "--tags", "kv_cache", "--mode", "keep"]);
        assert_eq!(code, 0, "{name}: {err}\n{reply}\n{}", server.log());
        let waiting = {
            let server = server.clone();
            std::thread::spawn(move || server.post("/v1/completions", &completion("4,5", 3)))
        };
        let (code, _, err) = control(&rt, &["wakeup"]);
        assert_eq!(code, 0, "{name}: {err}");
        for (i, (done, expected)) in running.into_iter().zip(&expected).enumerate() {
            let done = done.join().unwrap();
            assert_eq!(done.status, 200, "{done:?}");
            let got = ids(&done.json()["choices"][0]["token_ids"]);
            assert_eq!(&got, expected, "{name}, prompt {i}: {}", server.log());
        }
        assert_eq!(waiting.join().unwrap().status, 200);
        let expected = &expected[0];

        let running = {
            let server = server.clone();
            std::thread::spawn(move || server.post("/v1/completions", &completion(prompt, MAX)))
        };
        // Let it start, then abort it.
        std::thread::sleep(Duration::from_millis(50));
        let (code, _, err) = control(&rt, &["sleep", "--mode", "abort"]);
        assert_eq!(code, 0, "{name}: {err}");
        let done = running.join().unwrap().json();
        let reason = done["choices"][0]["finish_reason"].as_str().unwrap().to_owned();
        // A request that finished before the sleep came is not aborted.
        let n = ids(&done["choices"][0]["token_ids"]).len();
        let aborted = reason == "abort" && n < expected.len();
        let finished_first = reason != "abort" && n == expected.len();
        assert!(aborted || finished_first, "{done}");
        let (code, _, err) = control(&rt, &["wakeup"]);
        assert_eq!(code, 0, "{name}: {err}");
        let (code, _, err) = control(&rt, &["stop"]);
        assert_eq!(code, 0, "{name}: {err}");
        let server = Arc::try_unwrap(server).ok().expect("the only handle");
        assert!(server.wait().success());
    }
}

/// A rank killed while it prepares or commits a sleep: the call fails naming it, and the
/// launcher stops the whole deployment (no rank is left running, let alone half asleep).
#[cfg(feature = "failpoints")]
#[test]
fn a_rank_killed_during_a_sleep_stops_the_deployment() {
    for (point, rank) in [("sleep.prepare", 2), ("sleep.commit", 3)] {
        let rt = runtime_dir(point);
        let fail = format!("{point}=kill@{rank}");
        let env = [("XDG_RUNTIME_DIR", rt.as_str()), ("TPCTL_FAILPOINTS", fail.as_str())];
        let server = Server::start_with(model(), &["--tp", "2", "--cp", "2"], &env);
        let (code, reply, err) = control(&rt, &["sleep"]);
        assert_ne!(code, 0, "{point}: {reply}");
        assert!(err.contains(&format!("rank {rank}")), "{point}: {err}\n{}", server.log());
        let status = server.wait();
        assert!(!status.success(), "{point}: the deployment fails");
    }
}

/// A sleep whose rollback fails on one rank (rank 3 refuses its commit, rank 1 cannot map its
/// memory back): the deployment is failed and stopped on every rank rather than left half
/// asleep, and the client hears `fail_stop`.
#[cfg(feature = "failpoints")]
#[test]
fn a_failed_rollback_stops_every_rank() {
    let rt = runtime_dir("failstop");
    let env = [
        ("XDG_RUNTIME_DIR", rt.as_str()),
        ("TPCTL_FAILPOINTS", "sleep.commit=error@3;vmm.map=error@1"),
    ];
    let server = Server::start_with(model(), &["--tp", "2", "--cp", "2"], &env);
    let (code, reply, err) = control(&rt, &["sleep"]);
    assert_ne!(code, 0, "{reply}");
    assert_eq!(reply["error"]["outcome"], "fail_stop", "{reply}\n{err}\n{}", server.log());
    assert!(err.contains("rank 3") && err.contains("rank 1"), "{err}");
    let log = server.log.clone();
    let status = server.wait();
    let log = log.lock().unwrap().clone();
    assert!(!status.success(), "the deployment fails\n{log}");
    assert!(log.contains("stopped by a failed sleep/wakeup"), "{log}");
}

/// A client that goes away mid-generation cancels its request: the engine stops generating
/// for it at the next step (steps are slowed down so the generation is surely running), and
/// the metrics count it as cancelled. Both a streaming and a plain request.
#[cfg(feature = "failpoints")]
#[test]
fn a_client_that_disconnects_cancels_its_request() {
    const MAX: u32 = 200;
    let env = [("TPCTL_FAILPOINTS", "session.step=delay(20)")];
    let server = Server::start_with(model(), &["--tp", "2"], &env);
    for (n, stream) in [(1.0, true), (2.0, false)] {
        // Greedy and past any stop token: only the disconnect can end it early.
        let body = json!({
            "prompt": prompt_ids("1,2,3"),
            "max_tokens": MAX,
            "temperature": 0,
            "ignore_eos": true,
            "stream": stream,
        });
        let body = body.to_string();
        let raw = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut conn = TcpStream::connect(&server.addr).unwrap();
        conn.set_read_timeout(Some(DEADLINE)).unwrap();
        conn.write_all(raw.as_bytes()).unwrap();
        if stream {
            // Two tokens arrive, then the client leaves.
            let mut seen = String::new();
            let mut buf = [0u8; 4096];
            while seen.matches("data:").count() < 2 {
                let k = conn.read(&mut buf).expect("streamed tokens");
                assert!(k > 0, "the stream ended early: {seen}");
                seen.push_str(&String::from_utf8_lossy(&buf[..k]));
            }
        } else {
            std::thread::sleep(Duration::from_millis(200));
        }
        drop(conn);
        let name = "tpctl_requests_finished_total{reason=\"cancelled\"}";
        let start = Instant::now();
        loop {
            let text = server.get("/metrics").body;
            if text.contains(name) && metric(&text, name) == n {
                let generated = metric(&text, "vllm:generation_tokens_total");
                assert!(generated < f64::from(MAX) * n, "{generated} tokens generated\n{text}");
                break;
            }
            assert!(start.elapsed() < DEADLINE, "never cancelled\n{text}\n{}", server.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert_eq!(server.interrupt().code(), Some(130));
}

/// The engine fails mid-answer (rank 1's 31st step): a streaming client hears it, the choice
/// ending with `finish_reason: "error"` and then an `error` event naming the engine's stop,
/// rather than a stream that ends like a normal one; the server then exits with the failure.
#[cfg(feature = "failpoints")]
#[test]
fn a_stream_the_failed_engine_left_unfinished_ends_with_an_error_event() {
    let env = [("TPCTL_FAILPOINTS", "session.step=error@1#30")];
    let server = Server::start_with(model(), &["--tp", "2"], &env);
    let body = json!({
        "prompt": prompt_ids("1,2,3"),
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string();
    let raw = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut conn = TcpStream::connect(&server.addr).unwrap();
    conn.set_read_timeout(Some(DEADLINE)).unwrap();
    conn.write_all(raw.as_bytes()).unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => seen.push_str(&String::from_utf8_lossy(&buf[..k])),
            Err(e) => panic!("reading the stream: {e}\n{seen}\n{}", server.log()),
        }
    }
    let events: Vec<&str> = seen.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert!(events.len() > 2, "tokens came before the failure: {seen}");
    let last: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "engine_stopped", "{seen}\n{}", server.log());
    let end: serde_json::Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(end["choices"][0]["finish_reason"], "error", "{seen}");
    assert!(!seen.contains("[DONE]"), "an unfinished answer is not done: {seen}");
    let log = server.log.clone();
    let status = server.wait();
    assert!(!status.success(), "the server fails with its engine\n{}", log.lock().unwrap());
}

/// Two launchers, as on two nodes (torchrun conventions, over loopback): node 0 serves, node
/// 1 runs the other half of the ranks; answers match `tpctl run`, and Ctrl-C on node 0 ends
/// node 1's ranks too.
#[test]
fn serve_spans_two_nodes() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let port = port.to_string();
    let nodes = |rank: &str| {
        vec![
            "--tp".to_owned(),
            "2".into(),
            "--nnodes".into(),
            "2".into(),
            "--node-rank".into(),
            rank.into(),
            "--master-port".into(),
            port.clone(),
        ]
    };
    let mark = marker();
    let mut node1 = Command::new(tpctl_bin())
        .args(["serve", "--model", model(), "--threads", "1", "--listen", "127.0.0.1:0"])
        .args(nodes("1"))
        .env("TPCTL_TEST_MARK", &mark)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start node 1");
    let args0 = nodes("0");
    let args0: Vec<&str> = args0.iter().map(String::as_str).collect();
    let server = Server::start(model(), &args0);
    let expected = reference(model(), &["1,2,3"], 6).remove(0);
    let reply = server.post("/v1/completions", &completion("1,2,3", 6));
    assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected);
    assert_eq!(server.interrupt().code(), Some(130));
    let start = Instant::now();
    loop {
        if node1.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > DEADLINE {
            let _ = node1.kill();
            kill_all(&mark);
            panic!("node 1 still runs after node 0 stopped");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(leftovers(&mark), Vec::<u32>::new(), "node 1 left processes behind");
}

/// The GPU path end to end (feature `cuda`; `cargo xtask gpu-test` runs it with
/// `TPCTL_REQUIRE_GPU=1`): two ranks on the GPU (sharing one when there is one) give the CPU's
/// greedy tokens; a sleep returns at least 95% of each rank's tagged device bytes (the weights'
/// device copies and KV caches in vmm CUDA allocations) to the device, as NVML shows in the
/// receipt's probes, and after the wakeup the tokens are the same.
#[cfg(feature = "cuda")]
#[test]
fn gpu_serve_gives_the_cpu_tokens_and_a_sleep_returns_device_memory() {
    if let Err(e) = tensor::kernels::Backend::cuda(0) {
        let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
        assert!(!require, "TPCTL_REQUIRE_GPU=1 but the GPU is unusable: {e}");
        eprintln!("note: no usable GPU ({e}); skipping");
        return;
    }
    let expected = reference(model(), &["1,2,3"], 8).remove(0);
    // One GPU: the two ranks share it over shared memory; two or more: also NCCL between them.
    let gpus = {
        use mesh::CudaProbe;
        mesh::DriverProbe.device_count().unwrap_or(0)
    };
    // With one GPU, NCCL's two ranks may share it when each looks like a host of its own
    // (`run.sh` sets the overrides and TPCTL_TEST_NCCL_ONE_GPU=1 for a second run).
    let one_gpu_nccl = std::env::var("TPCTL_TEST_NCCL_ONE_GPU").is_ok_and(|v| v == "1");
    let mut variants = vec![None];
    if gpus >= 2 || one_gpu_nccl {
        variants.push(Some("nccl"));
    }
    for backend in variants {
        gpu_sleep_cycle(&expected, backend);
    }
}

/// One deployment of [`gpu_serve_gives_the_cpu_tokens_and_a_sleep_returns_device_memory`].
#[cfg(feature = "cuda")]
fn gpu_sleep_cycle(expected: &[u64], backend: Option<&str>) {
    let rt = runtime_dir(&format!("gpu-{}", backend.unwrap_or("shm")));
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    // f32 weights, so the GPU's products are the CPU's up to summation order.
    let mut args = vec!["--tp", "2", "--device", "cuda", "--dtype", "f32", "--deployment", "gpu"];
    if let Some(b) = backend {
        args.extend(["--backend", b]);
    }
    let server = Server::start_with(model(), &args, &env);
    let tokens = |server: &Server| {
        let reply = server.post("/v1/completions", &completion("1,2,3", 8));
        assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
        ids(&reply.json()["choices"][0]["token_ids"])
    };
    assert_eq!(tokens(&server), expected, "the GPU ({backend:?}) gives the CPU's greedy tokens");
    // `--verify` fails the sleep when a rank's device memory drops by less than 90% of the
    // device bytes it released; the test asks for 95%.
    let (code, reply, err) = control(&rt, &["sleep", "--tags", "weights,kv_cache", "--verify"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    for r in reply["op"]["ranks"].as_array().expect("ranks") {
        let device = |probe: &Value| probe["devices"][0][1].as_u64().expect("an NVML reading");
        let (before, after) = (device(&r["before"]), device(&r["after"]));
        let tagged: u64 = r["tags"]
            .as_array()
            .expect("tags")
            .iter()
            .map(|t| t["device_bytes"].as_u64().unwrap_or(0))
            .sum();
        assert!(tagged > 0, "rank {}: no device memory was tagged: {r}", r["rank"]);
        let freed = before.saturating_sub(after);
        assert!(
            freed as f64 >= 0.95 * tagged as f64,
            "rank {}: released {tagged} device bytes, NVML shows {before} -> {after}",
            r["rank"]
        );
    }
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(tokens(&server), expected, "the same tokens after the wakeup ({backend:?})");
    // A sleep without tags releases what the runtime holds too: the step workspaces the
    // request above planned (their device bytes back from the driver's pool), the graphs (to
    // be captured again) and the NCCL communicators, and still verifies.
    let (code, reply, err) = control(&rt, &["sleep", "--verify"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    for r in reply["op"]["ranks"].as_array().expect("ranks") {
        let tag = |name: &str| {
            let tags = r["tags"].as_array().expect("tags");
            tags.iter().find(|t| t["tag"] == name).cloned().unwrap_or_else(|| panic!("{r}"))
        };
        let workspace = tag("workspace");
        assert_eq!(workspace["restore"], "replan", "{r}");
        assert!(workspace["allocations"].as_u64() >= Some(1), "no plan released: {r}");
        assert!(workspace["device_bytes"].as_u64() > Some(0), "no pool bytes released: {r}");
        assert_eq!(tag("cuda_graph")["restore"], "recapture", "{r}");
        // NCCL's communicators are destroyed and made again by the wakeup, which the tokens
        // after it then use; shared memory holds nothing on the device.
        let nccl = if backend == Some("nccl") { "reconnect" } else { "none" };
        assert_eq!(tag("nccl")["restore"], nccl, "{r}");
    }
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(tokens(&server), expected, "the same tokens after a full sleep ({backend:?})");
    let (code, _, err) = control(&rt, &["stop"]);
    assert_eq!(code, 0, "{err}");
    assert!(server.wait().success());
}

/// A sleep asked for as soon as the control socket exists, while rank 1 still builds its model
/// (slowed down), succeeds once every rank holds its weights (each releases some), and after
/// the wakeup the deployment answers like `tpctl run`.
#[cfg(feature = "failpoints")]
#[test]
fn a_sleep_during_start_up_waits_for_the_model_build() {
    let rt = runtime_dir("startup");
    let expected = reference(model(), &["1,2,3"], 6).remove(0);
    let env =
        [("XDG_RUNTIME_DIR", rt.as_str()), ("TPCTL_FAILPOINTS", "session.init=delay(1500)@1")];
    let mark = marker();
    let mut child = Command::new(tpctl_bin())
        .args(["serve", "--model", model(), "--threads", "1", "--listen", "127.0.0.1:0"])
        .args(["--tp", "2", "--deployment", "startup"])
        .envs(env.iter().copied())
        .env("TPCTL_TEST_MARK", &mark)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tpctl serve");
    let socket = std::path::PathBuf::from(&rt).join("tpctl").join("startup.sock");
    let start = Instant::now();
    while !socket.exists() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            kill_all(&mark);
            panic!("no control socket at {}", socket.display());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let (code, reply, err) = control(&rt, &["sleep", "--verify"]);
    let (wake, _, wake_err) = control(&rt, &["wakeup"]);
    // The address line, then a request.
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut addr = String::new();
    while addr.is_empty() && out.read_line(&mut line).unwrap_or(0) > 0 {
        if let Some((_, rest)) = line.split_once(" on http://") {
            addr = rest.split_whitespace().next().unwrap_or("").to_owned();
        }
        line.clear();
    }
    let body = completion("1,2,3", 6).to_string();
    let reply_http = request(&addr, "POST", "/v1/completions", &[], Some(body.as_bytes()));
    let _ = Command::new("kill").arg("-INT").arg(child.id().to_string()).status();
    let _ = child.wait();
    kill_all(&mark);
    assert_eq!(code, 0, "{err}\n{reply}");
    // Every rank released its weights: the slow one after its build.
    for r in reply["op"]["ranks"].as_array().expect("ranks") {
        let weights = r["tags"].as_array().unwrap().iter().find(|t| t["tag"] == "weights");
        let bytes = weights.and_then(|t| t["bytes"].as_u64()).unwrap_or(0);
        assert!(bytes > 0, "rank {} released no weights: {reply}", r["rank"]);
    }
    assert_eq!(wake, 0, "{wake_err}");
    assert_eq!(reply_http.status, 200, "{reply_http:?}");
    assert_eq!(ids(&reply_http.json()["choices"][0]["token_ids"]), expected);
}

#[test]
fn characters_split_over_tokens_come_out_whole_in_run_sse_and_answers() {
    // Nine tokens: "😀", "中", " ", "😀", "中", each character but the space in two tokens.
    const MAX: u32 = 9;
    let expected = common::LOOKUP_TEXT.repeat(2).trim_end().to_owned();
    let whole = |piece: &str| !piece.contains('\u{fffd}');

    // `tpctl run` on two ranks: the printed text and the jsonl line.
    let max = MAX.to_string();
    let args = ["run", "--model", common::lookup_model(), "--tp", "2", "--max-tokens", &max];
    let out = tpctl(&[&args[..], &["--prompt-ids", "1,2"]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(&expected) && whole(&stdout), "{stdout:?}");
    let out = tpctl(&[&args[..], &["--prompt-ids", "1,2", "--output", "jsonl"]].concat());
    let line: Value = serde_json::from_slice(&out.stdout).expect("one jsonl line");
    assert_eq!(line["text"], expected.as_str(), "{line}");

    let server = Server::start(common::lookup_model(), &[]);
    let mut req = completion("1,2", MAX);
    let reply = server.post("/v1/completions", &req);
    assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
    assert_eq!(reply.json()["choices"][0]["text"], expected.as_str(), "{reply:?}");

    // Streamed: no chunk carries half a character, and together they are the answer.
    req["stream"] = json!(true);
    let reply = server.post("/v1/completions", &req);
    let events = reply.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{reply:?}");
    let pieces: Vec<String> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(pieces.iter().all(|p| whole(p)), "{pieces:?}");
    assert_eq!(pieces.concat(), expected, "{pieces:?}");
    assert!(pieces.iter().any(|p| p == "😀"), "the emoji comes in one chunk: {pieces:?}");

    // Chat, streamed (the message is one token, the space): the same through the deltas.
    let reply = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": " "}], "max_tokens": MAX,
                "temperature": 0, "stream": true}),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let events = reply.events();
    let deltas: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(deltas, expected, "{reply:?}");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A weight update as an RL trainer drives it: the served model's weights replaced by another
/// checkpoint of the same shapes (awake, then asleep at level 2 with the wakeup loading it),
/// each time answering exactly as a fresh `tpctl run` on that checkpoint. A checkpoint of other
/// shapes, or none at the path, is the caller's mistake (400 over HTTP, naming what differs),
/// refused before any rank loads it; one of the same shapes but other tensors is refused in
/// PREPARE on every rank; the live weights stay.
#[test]
fn a_weight_update_serves_the_new_checkpoint_like_a_fresh_start() {
    const MAX: u32 = 12;
    let write = |name: &str, spec: layers::model::random::RandomLlama| {
        let path = scratch(name);
        spec.write(&path).expect("write a checkpoint");
        path.to_string_lossy().into_owned()
    };
    let first = common::tiny_model().to_owned();
    let second = write(
        "update-b.gguf",
        layers::model::random::RandomLlama { seed: 8, ..common::tiny_spec() },
    );
    let other_shapes = write(
        "update-c.gguf",
        layers::model::random::RandomLlama { ffn: 96, ..common::tiny_spec() },
    );
    let other_tensors = write(
        "update-d.gguf",
        layers::model::random::RandomLlama { attn_bias: true, ..common::tiny_spec() },
    );
    let prompts = ["1,2,3", "9,8"];
    let (want_first, want_second) =
        (reference(&first, &prompts, MAX), reference(&second, &prompts, MAX));
    assert_ne!(want_first, want_second, "the checkpoints must answer differently");
    let answers = |server: &Server| greedy_ids(server, &prompts, MAX);

    let rt = runtime_dir("update");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let server =
        Server::start_with(&first, &["--tp", "2", "--cp", "2", "--deployment", "rl"], &env);
    assert_eq!(answers(&server), want_first);
    let live = |path: &str| format!("tpctl_weights_checkpoint_info{{checkpoint=\"{path}\"}} 1");
    assert!(server.get("/metrics").body.contains(&live(&first)), "{}", server.get("/metrics").body);
    assert_eq!(server.get("/v1/models").json()["data"][0]["checkpoint"], first.as_str());

    // Awake: the engine quiesces, every rank loads its shard, and the answers change.
    let (code, reply, err) = control(&rt, &["reload", "--model", &second]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(reply["op"]["action"], "update_weights", "{reply}");
    assert_eq!(reply["op"]["ranks"].as_array().map(Vec::len), Some(4), "{reply}");
    assert_eq!(answers(&server), want_second);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["checkpoint"], second.as_str(), "{models}");
    assert!(server.get("/metrics").body.contains(&live(&second)));

    // Other shapes, or no checkpoint: the caller's mistake, refused before any rank loads.
    let (code, reply, err) = control(&rt, &["reload", "--model", &other_shapes]);
    assert_eq!(code, 1, "{reply}");
    assert!(err.contains("feed-forward size 96; the live model has 64"), "{err}");
    let reply = server.post(&format!("/update_weights?model={other_shapes}"), &json!({}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert_eq!(reply.json()["error"]["code"], "invalid_checkpoint", "{reply:?}");
    let reply = server.post("/update_weights?model=/nonexistent/model.gguf", &json!({}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.body.contains("cannot open the checkpoint"), "{reply:?}");
    // The same shapes, other tensors (attention biases): refused in PREPARE on every rank.
    let (code, reply, err) = control(&rt, &["reload", "--model", &other_tensors]);
    assert_eq!(code, 1, "{reply}");
    assert!(err.contains("does not fit the live weights"), "{err}");
    for rank in 0..4 {
        assert!(err.contains(&format!("rank {rank} (prepare)")), "rank {rank}: {err}");
    }
    assert_eq!(answers(&server), want_second);

    // Asleep at level 2 (weights discarded): the update makes the wakeup load the first again.
    let (code, _, err) = control(&rt, &["sleep", "--level", "2"]);
    assert_eq!(code, 0, "{err}");
    let reply = server.post(&format!("/update_weights?model={first}"), &json!({}));
    assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(answers(&server), want_first);

    // The wakeup itself may name the checkpoint, only while the weights are asleep.
    let reply = server.post(&format!("/wake_up?model={second}"), &json!({}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.body.contains("only while the weights are asleep"), "{reply:?}");
    let (code, _, err) = control(&rt, &["sleep", "--level", "2"]);
    assert_eq!(code, 0, "{err}");
    let (code, reply, err) = control(&rt, &["wakeup", "--model", &second]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(reply["op"]["action"], "wakeup", "{reply}");
    assert_eq!(answers(&server), want_second);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["checkpoint"], second.as_str(), "{models}");
    let metrics = server.get("/metrics").body;
    assert!(metrics.contains("tpctl_sleep_ops_total{action=\"update_weights\"} 3"), "{metrics}");
    assert!(metrics.contains("tpctl_sleep_op_failures_total{action=\"update_weights\"} 4"));
    // At level 1 the weights' bytes are backed up: an update while asleep drops that backup,
    // so the wakeup brings the new checkpoint, not the weights it replaced.
    let (code, _, err) = control(&rt, &["sleep", "--level", "1"]);
    assert_eq!(code, 0, "{err}");
    let (code, reply, err) = control(&rt, &["wakeup", "--model", &first]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(answers(&server), want_first, "the wakeup restored the replaced weights");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// The RL loop: `tpctl pause --mode keep` freezes the running requests, `tpctl reload
/// --weight-version` replaces the weights while paused (the pause holds), a request sent while
/// paused waits, and `tpctl resume` continues them all. Every answer names the version of the
/// weights that computed it; one that straddles the update says from which token on the new
/// version computed it, and its tokens before that are the old checkpoint's.
#[test]
fn a_trainer_pauses_updates_the_weights_and_resumes() {
    const MAX: u32 = 200;
    let first = common::tiny_q4_model();
    let second = scratch("rl-loop-b.gguf");
    let spec = layers::model::random::RandomLlama {
        quantized: Some(tensor::kernels::BlockFormat::Q4_1),
        seed: 12,
        ..Default::default()
    };
    spec.write(&second).expect("write the second checkpoint");
    let second = second.to_string_lossy().into_owned();
    let prompts = ["1,2,3", "9,8"];
    let (want_first, want_second) =
        (reference(first, &prompts, MAX), reference(&second, &prompts, MAX));
    assert_ne!(want_first, want_second, "the checkpoints must answer differently");

    let rt = runtime_dir("rl-loop");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let server = Arc::new(Server::start_with(first, &["--tp", "2", "--deployment", "rl"], &env));
    let running = completions_in_background(&server, &prompts, MAX);
    let (code, reply, err) = control(&rt, &["pause", "--mode", "keep"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(reply["paused"], json!({"paused": true, "changed": true}), "{reply}");
    let waiting = {
        let server = server.clone();
        std::thread::spawn(move || server.post("/v1/completions", &completion("4,5", 3)))
    };
    let (code, reply, err) =
        control(&rt, &["reload", "--model", &second, "--weight-version", "step-1"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(reply["op"]["weight_version"], "step-1", "{reply}");
    let (code, status, err) = control(&rt, &["status"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(status["status"]["paused"], true, "{status}");
    assert_eq!(status["status"]["weight_version"], "step-1", "{status}");
    assert_eq!(server.get("/is_paused").json(), json!({"is_paused": true}));
    let (code, reply, err) = control(&rt, &["resume"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(reply["paused"], json!({"paused": false, "changed": true}), "{reply}");

    for (i, done) in running.into_iter().enumerate() {
        let done = done.join().unwrap();
        assert_eq!(done.status, 200, "{done:?}");
        let body = done.json();
        let got = ids(&body["choices"][0]["token_ids"]);
        assert_eq!(body["weight_version"], "step-1", "prompt {i}: {body}");
        assert_eq!(body["system_fingerprint"], "step-1", "prompt {i}: {body}");
        match body["choices"][0]["weight_versions"].as_array() {
            // Paused in the middle: the old weights' tokens, then the new ones'.
            Some(changes) => {
                assert_eq!(changes.len(), 2, "prompt {i}: {body}");
                assert_eq!(changes[0], json!({"from_token": 0, "weight_version": "0"}));
                assert_eq!(changes[1]["weight_version"], "step-1", "prompt {i}: {body}");
                let at = changes[1]["from_token"].as_u64().unwrap() as usize;
                assert!(at > 0 && at < got.len(), "prompt {i}: {body}");
                assert_eq!(got[..at], want_first[i][..at], "prompt {i}: {body}");
            }
            // Paused before its first token: all the new weights'.
            None => assert_eq!(got, want_second[i], "prompt {i}: {body}"),
        }
    }
    let waited = waiting.join().unwrap().json();
    assert_eq!(waited["weight_version"], "step-1", "{waited}");
    assert_eq!(ids(&waited["choices"][0]["token_ids"]), reference(&second, &["4,5"], 3)[0]);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["weight_version"], "step-1", "{models}");
    assert_eq!(models["data"][0]["paused"], false, "{models}");
    let server = Arc::try_unwrap(server).ok().expect("the only handle");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// Runs `rl_trainer.py ARGS` (a trainer in Python's standard library) to its end: its
/// replies, one JSON value per line.
fn trainer(args: &[&str]) -> Vec<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/rl_trainer.py");
    let out = Command::new("python3").arg(script).args(args).output().expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// An update from memory, as an RL trainer pushes it (issue 33 item 3): a Python trainer
/// perturbs three tensors of a Hugging Face folder served with TP 2 and pushes them in two
/// safetensors buckets (deleting each file as soon as the server took it); the answers then
/// equal a fresh `tpctl run` on the perturbed checkpoint written to disk, with the trainer's
/// version. An update aborted after its first bucket, or with a bucket that does not fit,
/// leaves the old answers; a level-2 sleep reloads the updated weights, not the file's.
#[test]
fn a_trainer_pushes_tensors_from_memory_in_buckets() {
    const MAX: u32 = 12;
    let base = scratch("rl-mem-base");
    common::tiny_spec().write_hf(&base, false).expect("write the base folder");
    let buckets = scratch("rl-mem-buckets");
    std::fs::create_dir_all(&buckets).unwrap();
    let perturbed = scratch("rl-mem-perturbed");
    let (base_s, buckets_s, perturbed_s) = (
        base.to_string_lossy().into_owned(),
        buckets.to_string_lossy().into_owned(),
        perturbed.to_string_lossy().into_owned(),
    );
    let prompts = ["1,2,3", "9,8"];
    let want_base = reference(&base_s, &prompts, MAX);
    let answers = |server: &Server| greedy_ids(server, &prompts, MAX);

    let rt = runtime_dir("rl-mem");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let server = Server::start_with(&base_s, &["--tp", "2", "--deployment", "rl-mem"], &env);
    let url = format!("http://{}", server.addr);
    assert_eq!(answers(&server), want_base);

    // Aborted after the first bucket: nothing changes, no kept file is left.
    let replies = trainer(&["abort", &url, &base_s, &buckets_s]);
    assert_eq!(replies[1]["reply"], json!({"open": true, "buckets": 1, "tensors": 2}));
    assert_eq!(replies[2]["reply"], json!({"open": false, "buckets": 1, "tensors": 0}));
    assert_eq!(answers(&server), want_base);
    let kept = |dir: &std::path::Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(".tpctl-"))
            .count()
    };
    assert_eq!(kept(&buckets), 0);

    // A bucket that does not fit the model is the trainer's mistake, named; the open update
    // is then aborted by hand.
    let wrong = buckets.join("wrong.safetensors");
    checkpoint::safetensors::write_safetensors(
        &wrong,
        &[(
            "model.layers.0.self_attn.q_proj.weight",
            &[3, 3],
            checkpoint::safetensors::StDType::F32,
            &[0.0; 9],
        )],
    )
    .unwrap();
    assert_eq!(server.post("/start_weight_update", &json!({})).status, 200);
    let body = json!({"update_info": {"path": wrong.to_string_lossy()}});
    let reply = server.post("/update_weights", &body);
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(
        reply.body.contains("tensor model.layers.0.self_attn.q_proj.weight has shape [3, 3]"),
        "{reply:?}"
    );
    // Tensors as CUDA IPC handles: a malformed bucket is named before any device is touched,
    // and a build without CUDA says so (the update stays open through both).
    let handle = "AQ".repeat(42) + "AQ==";
    let ipc = json!({
        "names": ["model.layers.0.self_attn.q_proj.weight"],
        "dtype_names": ["float32"],
        "shapes": [[16, 16]],
        "ipc_handles": [{"device": "GPU-3a4b5c6d-0011-2233-4455-66778899aabb", "handle": handle}],
    });
    let mut partial = ipc.clone();
    partial.as_object_mut().unwrap().remove("shapes");
    let reply = server.post("/update_weights", &json!({"update_info": partial}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.body.contains("takes all of `names`, `dtype_names`, `shapes`"), "{reply:?}");
    let mut both = ipc.clone();
    both["path"] = json!(wrong.to_string_lossy());
    let reply = server.post("/update_weights", &json!({"update_info": both}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.body.contains("not both"), "{reply:?}");
    let mut twice = ipc.clone();
    twice["dtype_names"] = json!(["int4"]);
    let reply = server.post("/update_weights", &json!({"update_info": twice}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.body.contains("dtype `int4` is none of float32"), "{reply:?}");
    let reply = server.post("/update_weights", &json!({"update_info": ipc}));
    assert_eq!(reply.status, 400, "{reply:?}");
    #[cfg(not(feature = "cuda"))]
    assert!(reply.body.contains("built without CUDA"), "{reply:?}");
    let reply = server.post("/start_weight_update", &json!({}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.body.contains("a weight update is already open"), "{reply:?}");
    assert_eq!(server.post("/abort_weight_update", &json!({})).status, 200);
    let reply = server.post("/finish_weight_update", &json!({}));
    assert_eq!(reply.status, 400, "{reply:?}");
    assert!(reply.body.contains("no weight update is open"), "{reply:?}");

    // Pushed in two buckets and committed: the perturbed checkpoint's answers.
    let replies = trainer(&["push", &url, &base_s, &buckets_s, &perturbed_s, "step-1"]);
    let finish = &replies.last().unwrap()["reply"];
    assert_eq!(finish["weight_version"], "step-1", "{finish}");
    assert_eq!(finish["ranks"].as_array().map(Vec::len), Some(2), "{finish}");
    let want_perturbed = reference(&perturbed_s, &prompts, MAX);
    assert_ne!(want_perturbed, want_base, "the perturbation must change the answers");
    assert_eq!(answers(&server), want_perturbed);
    let reply = server.post("/v1/completions", &completion(prompts[0], 2));
    assert_eq!(reply.json()["weight_version"], "step-1");
    assert!(!buckets.join("bucket-1.safetensors").exists(), "the trainer deleted its files");
    assert_eq!(kept(&buckets), 2, "the two buckets are kept for the live weights");
    // The next step pushes the same tensors again: the buckets they replace are let go.
    let replies = trainer(&["push", &url, &base_s, &buckets_s, &perturbed_s, "step-2"]);
    assert_eq!(replies.last().unwrap()["reply"]["weight_version"], "step-2");
    assert_eq!(kept(&buckets), 2, "only the latest step's buckets are kept");
    assert_eq!(answers(&server), want_perturbed);

    // A level-2 sleep reloads the weights from the checkpoint and the kept buckets.
    let (code, _, err) = control(&rt, &["sleep", "--level", "2"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}\n{}", server.log());
    assert_eq!(answers(&server), want_perturbed);
    // A reload of the checkpoint alone drops them, and their kept files.
    let (code, reply, err) = control(&rt, &["reload", "--model", &base_s]);
    assert_eq!(code, 0, "{err}\n{reply}");
    assert_eq!(answers(&server), want_base);
    assert_eq!(kept(&buckets), 0);
    // The CLI pushes files the same way.
    let (code, reply, err) = control(
        &rt,
        &["reload", "--tensors", &perturbed.join("model.safetensors").to_string_lossy()],
    );
    assert_eq!(code, 0, "{err}\n{reply}");
    assert_eq!(answers(&server), want_perturbed);
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A weight update from the same weights in another storage form: a tiny f32 model served
/// with `--tp 2` reloaded from its Q4_1 quantization (other buffers on every rank) answers as
/// a fresh `tpctl run` of the Q4_1 file, still after a level-2 sleep (which reloads it into
/// the new buffers), and a reload of the f32 file brings its answers back.
#[test]
fn a_weight_update_in_another_storage_form_serves_it_like_a_fresh_start() {
    use layers::model::random::RandomLlama;
    const MAX: u32 = 12;
    let write = |name: &str, spec: RandomLlama| {
        let path = scratch(name);
        spec.write(&path).expect("write a checkpoint");
        path.to_string_lossy().into_owned()
    };
    let spec = RandomLlama { seed: 31, untied_head: true, ..RandomLlama::default() };
    let f32_file = write("form-f32.gguf", spec.clone());
    let q4_spec = RandomLlama { quantized: Some(tensor::kernels::BlockFormat::Q4_1), ..spec };
    let q4_file = write("form-q4.gguf", q4_spec);
    let prompts = ["1,2,3", "9,8", "40,41,5,6"];
    let (want_f32, want_q4) =
        (reference(&f32_file, &prompts, MAX), reference(&q4_file, &prompts, MAX));
    assert_ne!(want_f32, want_q4, "the two forms must answer differently");
    let answers = |server: &Server| greedy_ids(server, &prompts, MAX);

    let rt = runtime_dir("form");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let server = Server::start_with(&f32_file, &["--tp", "2", "--deployment", "rl"], &env);
    assert_eq!(answers(&server), want_f32);
    let (code, reply, err) = control(&rt, &["reload", "--model", &q4_file]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(reply["op"]["ranks"].as_array().map(Vec::len), Some(2), "{reply}");
    assert_eq!(answers(&server), want_q4, "{}", server.log());
    assert_eq!(server.get("/v1/models").json()["data"][0]["checkpoint"], q4_file.as_str());

    let (code, _, err) = control(&rt, &["sleep", "--level", "2"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(answers(&server), want_q4, "{}", server.log());

    let (code, reply, err) = control(&rt, &["reload", "--model", &f32_file]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(answers(&server), want_f32, "{}", server.log());
    assert_eq!(server.interrupt().code(), Some(130));
}

/// An update from memory into a quantized model: f32 tensors laid over Q4_1 weights do not fit
/// their buffers, so every rank loads the shard into new buffers and swaps them in. A bucket
/// of every tensor of another f32 checkpoint of the same shapes makes the served model that
/// checkpoint: the answers of a fresh `tpctl run` of it, also after a level-2 sleep.
#[test]
fn a_quantized_model_takes_f32_tensors_from_memory() {
    const MAX: u32 = 12;
    let q4 = common::tiny_q4_model();
    let f32_dir = scratch("mem-q4-f32");
    let spec = layers::model::random::RandomLlama { seed: 12, ..Default::default() };
    spec.write_hf(&f32_dir, false).expect("write the f32 folder");
    let f32_dir = f32_dir.to_string_lossy().into_owned();
    let prompts = ["1,2,3", "9,8"];
    let (want_q4, want_f32) = (reference(q4, &prompts, MAX), reference(&f32_dir, &prompts, MAX));
    assert_ne!(want_q4, want_f32, "the checkpoints must answer differently");
    let rt = runtime_dir("mem-q4");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let server = Server::start_with(q4, &["--tp", "2", "--deployment", "mem-q4"], &env);
    assert_eq!(greedy_ids(&server, &prompts, MAX), want_q4);
    let bucket = format!("{f32_dir}/model.safetensors");
    let (code, reply, err) = control(&rt, &["reload", "--tensors", &bucket]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(reply["op"]["weight_version"], "1", "{reply}");
    assert_eq!(greedy_ids(&server, &prompts, MAX), want_f32);
    let (code, _, err) = control(&rt, &["sleep", "--level", "2"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}\n{}", server.log());
    assert_eq!(greedy_ids(&server, &prompts, MAX), want_f32);
    let (code, reply, err) = control(&rt, &["reload", "--model", q4]);
    assert_eq!(code, 0, "{err}\n{reply}");
    assert_eq!(greedy_ids(&server, &prompts, MAX), want_q4);
    assert_eq!(server.interrupt().code(), Some(130));
}

/// OpenAI's sampling fields take effect, bad values are 400 naming the field, and a field this
/// server does not implement is refused unless it asks for nothing.
#[test]
fn sampling_fields_apply_and_unsupported_ones_are_refused() {
    let server = Server::start(model(), &[]);
    let ask = |extra: Value| server.post("/v1/completions", &with(completion("1,2", 4), &extra));
    // A large bias decides every greedy step; penalties and min_p are accepted.
    let reply = ask(json!({"logit_bias": {"7": 100}}));
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), vec![7; 4]);
    let reply = ask(json!({"logit_bias": {"7": 100}, "frequency_penalty": 2.0,
                           "presence_penalty": 2.0, "repetition_penalty": 1.3, "min_p": 0.05}));
    assert_eq!(reply.status, 200, "{reply:?}");
    // Fields that ask for nothing pass: what OpenAI SDKs send by default.
    let neutral = json!({"logprobs": null, "echo": false, "n": 1, "user": "u-1", "best_of": 1,
                         "response_format": {"type": "text"}, "top_logprobs": 0});
    assert_eq!(ask(neutral).status, 200);
    for (extra, code, says) in [
        (json!({"logprobs": 21}), "invalid_logprobs", "`logprobs` 21"),
        (json!({"logprobs": true}), "invalid_logprobs", "expected an integer"),
        (json!({"n": 17}), "invalid_n", "`n` 17: expected 1 to 16"),
        (
            json!({"response_format": {"type": "yaml"}}),
            "invalid_structured_output",
            "`response_format` type `yaml`",
        ),
        (
            json!({"guided_whitespace_pattern": " "}),
            "unsupported_parameter",
            "`guided_whitespace_pattern`",
        ),
        (json!({"presence_penalty": 3}), "invalid_sampling", "`presence_penalty` 3"),
        (json!({"repetition_penalty": 0}), "invalid_sampling", "`repetition_penalty`"),
        (json!({"min_p": 1.5}), "invalid_sampling", "`min_p`"),
        (json!({"logit_bias": {"x": 1}}), "invalid_logit_bias", "expected a token id"),
        (json!({"logit_bias": {"99999": 1}}), "invalid_token_id", "logit_bias"),
        (json!({"logit_bias": {"7": 500}}), "invalid_logit_bias", "outside -100 to 100"),
    ] {
        let reply = ask(extra.clone());
        assert_error(&reply, 400, code);
        assert!(reply.body.contains(says), "{extra}: {}", reply.body);
    }
    assert_eq!(server.interrupt().code(), Some(130));
}

/// Log-probabilities in every answer shape: the model's own distribution (normalized over a
/// 20-token vocabulary, the same before and after temperature), the chosen token's entry
/// consistent with the alternatives, streamed equal to answered, in OpenAI's completions and
/// chat shapes.
#[test]
fn logprobs_are_the_models_distribution_in_every_answer_shape() {
    const MAX: u32 = 5;
    let path = scratch("vocab20.gguf");
    let spec = layers::model::random::RandomLlama { vocab: 20, ..common::tiny_spec() };
    spec.write(&path).expect("write the model");
    let server = Server::start(path.to_str().unwrap(), &[]);
    let ask = |extra: Value| {
        let reply = server.post("/v1/completions", &with(completion("1,2,3", MAX), &extra));
        assert_eq!(reply.status, 200, "{reply:?}");
        reply
    };
    let greedy = ask(json!({"logprobs": 20})).json();
    let choice = &greedy["choices"][0];
    let lp = &choice["logprobs"];
    let f = |v: &Value| v.as_f64().unwrap();
    let token_ids = ids(&choice["token_ids"]);
    assert_eq!(token_ids.len(), MAX as usize);
    for (i, id) in token_ids.iter().enumerate() {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 20, "every token of the vocabulary: {top:?}");
        let total: f64 = top.values().map(|v| f(v).exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "token {i}: probabilities sum to {total}");
        // Greedy: the chosen token is the most likely one.
        let chosen = f(&lp["token_logprobs"][i]);
        let best = top.values().map(f).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(chosen, best, "token {i}");
        assert_eq!(lp["tokens"][i], format!("t{id}"));
        assert!(top.contains_key(&format!("t{id}")));
    }
    let offsets: Vec<u64> = ids(&lp["text_offset"]);
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");

    // Sampled at a high temperature, the first position's numbers are the same: they are the
    // model's, not the sampler's; the chosen token's entry is its own alternative's number.
    let hot = ask(json!({"logprobs": 20, "temperature": 3.0, "seed": 11})).json();
    let hot_lp = &hot["choices"][0]["logprobs"];
    assert_eq!(hot_lp["top_logprobs"][0], lp["top_logprobs"][0]);
    for i in 0..MAX as usize {
        let name = hot_lp["tokens"][i].as_str().unwrap();
        assert_eq!(hot_lp["token_logprobs"][i], hot_lp["top_logprobs"][i][name], "token {i}");
    }

    // Streamed: the same numbers, one token per chunk.
    let streamed = ask(json!({"logprobs": 3, "stream": true}));
    let chunks: Vec<Value> = streamed
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .filter(|c: &Value| !c["choices"][0]["logprobs"].is_null())
        .collect();
    assert_eq!(chunks.len(), MAX as usize);
    for (i, c) in chunks.iter().enumerate() {
        let l = &c["choices"][0]["logprobs"];
        assert_eq!(l["token_logprobs"][0], lp["token_logprobs"][i], "token {i}");
        assert_eq!(l["text_offset"][0], lp["text_offset"][i], "token {i}");
        assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 3);
    }
    // Without the field: null, as before.
    assert!(ask(json!({})).json()["choices"][0]["logprobs"].is_null());
    assert_eq!(server.interrupt().code(), Some(130));

    // Chat: `logprobs: true` and `top_logprobs`, in the chat shape.
    let server = Server::start(chat_model(), &[]);
    let body = json!({"messages": [{"role": "user", "content": "t5t6"}], "max_tokens": 3,
                      "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let reply = server.post("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{reply:?}");
    let content = reply.json()["choices"][0]["logprobs"]["content"].clone();
    let content = content.as_array().unwrap();
    assert_eq!(content.len(), 3);
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], e["token"], "greedy takes the most likely: {e}");
        assert_eq!(top[0]["logprob"], e["logprob"]);
        assert!(f(&top[0]["logprob"]) >= f(&top[1]["logprob"]));
        let bytes: Vec<u8> =
            e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(bytes, e["token"].as_str().unwrap().as_bytes());
    }
    let bad = json!({"messages": [{"role": "user", "content": "t5"}], "top_logprobs": 2});
    assert_error(&server.post("/v1/chat/completions", &bad), 400, "invalid_logprobs");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A Hugging Face folder's `generation_config.json`: its `eos_token_id` list ends a
/// generation, and its sampling is the server's default (here greedy).
#[test]
fn a_folders_generation_config_gives_end_ids_and_defaults() {
    const MAX: u32 = 8;
    let want = reference(model(), &["1,2,3"], MAX).remove(0);
    // The first generated token not seen before it (after the first, if there is one): the
    // generation must end right there.
    let end = (1..want.len()).find(|&i| !want[..i].contains(&want[i])).unwrap_or(0);
    let dir = scratch("tiny-hf-gencfg");
    common::tiny_spec().write_hf(&dir, true).expect("write the folder");
    let config = json!({"eos_token_id": [want[end], 99999], "temperature": 0.0, "top_p": 0.9});
    std::fs::write(dir.join("generation_config.json"), config.to_string()).unwrap();
    let server = Server::start(dir.to_str().unwrap(), &[]);
    let body = json!({"prompt": prompt_ids("1,2,3"), "max_tokens": MAX});
    let reply = server.post("/v1/completions", &body).json();
    assert_eq!(ids(&reply["choices"][0]["token_ids"]), want[..=end], "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    let body = json!({"prompt": prompt_ids("1,2,3"), "max_tokens": MAX, "ignore_eos": true});
    let reply = server.post("/v1/completions", &body).json();
    assert_eq!(ids(&reply["choices"][0]["token_ids"]), want, "{reply}");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A chat template from `--chat-template FILE`, rendered as Hugging Face renders templates:
/// Python string methods, `tools` (`tool_choice` "none" or "auto"), `chat_template_kwargs`, other
/// message fields, `add_generation_prompt`; a bad template file stops the launch.
#[test]
fn chat_templates_take_tools_arguments_and_python_methods() {
    let template = scratch("tools-template.jinja");
    let source = "{% if tools %}{% for t in tools %}t{{ t.function.name.split('_')[1] }}{% endfor %}{% endif %}\n\
        {% for m in messages %}\n    t1{{ m.content.strip() }}{% if m.name is defined %}t{{ m.name|length }}{% endif %}t2\n{% endfor %}\n\
        {% if flag %}t8{% endif %}{% if add_generation_prompt %}t3{% endif %}";
    std::fs::write(&template, source).unwrap();
    // The chat model's tokens are all special: `t5` in text is token 5.
    let server = Server::start(chat_model(), &["--chat-template", template.to_str().unwrap()]);
    let ids = |body: Value| {
        let reply = server.post("/tokenize", &body);
        assert_eq!(reply.status, 200, "{reply:?}");
        ids(&reply.json()["tokens"])
    };
    // `.strip()` and the whitespace control: exactly the tokens of the text.
    let plain = json!({"messages": [{"role": "user", "content": "  t5t6 "}]});
    assert_eq!(ids(plain), [1, 5, 6, 2, 3]);
    let named = json!({"messages": [{"role": "user", "content": "t5", "name": "abcd"}],
                       "add_generation_prompt": false});
    assert_eq!(ids(named), [1, 5, 4, 2]);
    // Through a chat completion: tools and template arguments reach the template.
    let prompt_tokens = |extra: Value| {
        let body = with(
            json!({"messages": [{"role": "user", "content": "t5"}], "max_tokens": 1, "temperature": 0}),
            &extra,
        );
        let reply = server.post("/v1/chat/completions", &body);
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let base = prompt_tokens(json!({}));
    assert_eq!(base, 4, "t1 t5 t2 t3");
    let tool = json!({"type": "function", "function": {"name": "get_7", "parameters": {}}});
    assert_eq!(prompt_tokens(json!({"tools": [tool], "tool_choice": "none"})), base + 1);
    assert_eq!(prompt_tokens(json!({"tools": [tool]})), base + 1);
    // This template renders the tools: no warning.
    let body = json!({"messages": [{"role": "user", "content": "t5"}], "max_tokens": 1,
                      "tools": [tool]});
    let reply = server.post("/v1/chat/completions", &body);
    assert!(reply.json().get("warning").is_none(), "{reply:?}");
    assert_eq!(prompt_tokens(json!({"chat_template_kwargs": {"flag": true}})), base + 1);
    let reply = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t5"}], "tools": [tool],
                "tool_choice": "sometimes"}),
    );
    assert_error(&reply, 400, "invalid_tool_choice");
    assert!(reply.body.contains("tool_choice"), "{}", reply.body);
    let reply = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "t5"}], "chat_template_kwargs": {"messages": []}}),
    );
    assert_error(&reply, 400, "chat_template");
    assert_eq!(server.interrupt().code(), Some(130));
    // A template that does not parse stops the launch, naming the file.
    std::fs::write(&template, "{% for m in messages %}").unwrap();
    let out =
        tpctl(&["serve", "--model", chat_model(), "--chat-template", template.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--chat-template") && err.contains("tools-template.jinja"), "{err}");
}

/// `n` choices are sequences of the batch with seeds `seed`, `seed + 1`, ... (each equal to
/// that seed's single answer), streamed interleaved by index; `echo` puts the prompt's text
/// first.
#[test]
fn n_choices_and_echo() {
    const MAX: u32 = 6;
    let server = Server::start(model(), &[]);
    let ask = |extra: Value| {
        let reply = server.post("/v1/completions", &with(completion("1,2,3", MAX), &extra));
        assert_eq!(reply.status, 200, "{reply:?}");
        reply
    };
    let sampled = json!({"temperature": 1.5, "seed": 5, "n": 3});
    let three = ask(sampled.clone()).json();
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    assert_eq!(three["usage"]["completion_tokens"], 3 * MAX);
    assert_eq!(three["usage"]["prompt_tokens"], 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let alone = ask(json!({"temperature": 1.5, "seed": 5 + i}));
        assert_eq!(c["token_ids"], alone.json()["choices"][0]["token_ids"], "choice {i}");
    }

    // Streamed: every choice's chunks carry its index and the same tokens.
    let mut streamed = sampled.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks: Vec<Value> = ask(streamed)
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for (i, c) in choices.iter().enumerate() {
        let of_i = |c: &&Value| c["choices"][0]["index"] == i;
        let tokens: Vec<u64> = chunks
            .iter()
            .filter(of_i)
            .filter(|c| c["choices"][0]["token_ids"].is_array())
            .flat_map(|c| ids(&c["choices"][0]["token_ids"]))
            .collect();
        assert_eq!(tokens, ids(&c["token_ids"]), "choice {i}");
        let finish =
            chunks.iter().filter(of_i).filter(|c| !c["choices"][0]["finish_reason"].is_null());
        assert_eq!(finish.count(), 1, "choice {i}");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 3 * MAX);

    // Echo: the prompt's text, then the completion, streamed the same way.
    let prompt = server.post("/detokenize", &json!({"tokens": [1, 2, 3]})).json()["prompt"].clone();
    let plain = ask(json!({})).json()["choices"][0]["text"].clone();
    let echoed = ask(json!({"echo": true})).json();
    let want = format!("{}{}", prompt.as_str().unwrap(), plain.as_str().unwrap());
    assert_eq!(echoed["choices"][0]["text"], want.as_str());
    assert_eq!(echoed["usage"]["completion_tokens"], MAX);
    let text: String = ask(json!({"echo": true, "stream": true}))
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(text, want);
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A list of prompts (strings and id lists) answers one choice per prompt and `n`, in
/// OpenAI's order (`index` = prompt * n + i), each the same as its prompt alone (greedy, and
/// seeded with `n` = 2), streamed the same; the usage sums the prompts; `echo` repeats each
/// choice's own prompt; a bad element is a 400 that names it, and so are too many choices.
#[test]
fn a_list_of_prompts_answers_each_as_it_would_alone() {
    const MAX: u32 = 4;
    let server = Server::start(chat_model(), &[]);
    let ask = |body: Value| {
        let reply = server.post("/v1/completions", &body);
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.json()
    };
    let prompts = [json!([1, 2, 3]), json!("t5t6t7"), json!([9])];
    let greedy = json!({"max_tokens": MAX, "temperature": 0});
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| ask(with(greedy.clone(), &json!({"prompt": p})))["choices"][0].clone())
        .collect();
    let batch = ask(with(greedy.clone(), &json!({"prompt": prompts})));
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (p, (c, a)) in choices.iter().zip(&alone).enumerate() {
        assert_eq!(c["index"], p);
        assert_eq!(c["token_ids"], a["token_ids"], "prompt {p}");
        assert_eq!(c["text"], a["text"], "prompt {p}");
    }
    let tokens = |p: &Value| {
        server.post("/tokenize", &json!({"prompt": p})).json()["count"].as_u64().unwrap()
    };
    let prompt_tokens: u64 = prompts.iter().map(tokens).sum();
    assert_eq!(batch["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(batch["usage"]["completion_tokens"], 3 * MAX);

    // `n` = 2, seeded: choice `p * 2 + i` is prompt `p` alone with seed `5 + i`.
    let sampled = json!({"max_tokens": MAX, "temperature": 1.5, "seed": 5});
    let two = ask(with(sampled.clone(), &json!({"prompt": prompts[..2], "n": 2})));
    let choices = two["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (index, c) in choices.iter().enumerate() {
        let (p, i) = (index / 2, index % 2);
        assert_eq!(c["index"], index);
        let one = ask(with(sampled.clone(), &json!({"prompt": prompts[p], "seed": 5 + i})));
        assert_eq!(c["token_ids"], one["choices"][0]["token_ids"], "prompt {p}, choice {i}");
    }

    // Streamed: each index carries its prompt's tokens; the usage sums the prompts.
    let streamed = server.post(
        "/v1/completions",
        &with(
            greedy.clone(),
            &json!({"prompt": prompts, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    let chunks: Vec<Value> = streamed
        .events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for (p, a) in alone.iter().enumerate() {
        let got: Vec<u64> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == p)
            .filter(|c| c["choices"][0]["token_ids"].is_array())
            .flat_map(|c| ids(&c["choices"][0]["token_ids"]))
            .collect();
        assert_eq!(got, ids(&a["token_ids"]), "prompt {p}");
    }
    assert_eq!(chunks.last().unwrap()["usage"]["prompt_tokens"], prompt_tokens);

    // Echo: each choice begins with its own prompt's text.
    let echoed = ask(with(greedy.clone(), &json!({"prompt": ["t5t6", "t7"], "echo": true})));
    for (p, text) in ["t5t6", "t7"].iter().enumerate() {
        let got = echoed["choices"][p]["text"].as_str().unwrap();
        assert!(got.starts_with(text), "prompt {p}: {got}");
    }

    // Bad elements are named; so is a request for more choices than one answers.
    let refuse = |prompt: Value, extra: Value, code: &str, says: &str| {
        let reply = server.post("/v1/completions", &with(json!({"prompt": prompt}), &extra));
        assert_error(&reply, 400, code);
        assert!(reply.body.contains(says), "{prompt}: {}", reply.body);
    };
    refuse(json!(["t5", [1, 2], {"a": 1}]), json!({}), "invalid_prompt", "prompt[2]");
    refuse(json!(["t5", [1, 99999]]), json!({}), "invalid_token_id", "prompt[1]");
    refuse(json!([[1], []]), json!({}), "empty_prompt", "prompt[1] is empty");
    refuse(json!(["t5", ""]), json!({}), "empty_prompt", "prompt[1]");
    refuse(json!([1, "t5"]), json!({}), "invalid_prompt", "not a token id");
    let nine = json!(["t5", "t5", "t5", "t5", "t5", "t5", "t5", "t5", "t5"]);
    refuse(nine, json!({"n": 2}), "too_many_choices", "18 choices");
    let long = json!([[1], (0..40).map(|_| 1).collect::<Vec<_>>()]);
    let reply = server.post("/v1/completions", &json!({"prompt": long, "max_tokens": 1_000_000}));
    assert_error(&reply, 400, "context_length_exceeded");
    assert!(reply.body.contains("prompt[0]"), "{}", reply.body);
    assert_eq!(server.interrupt().code(), Some(130));
}

/// Prompt log-probabilities in every shape, in the (1,1), TP=2 and CP=2 layouts: `echo`
/// with `logprobs` lists the prompt's tokens first (`null` for the first, as OpenAI), with
/// `max_tokens` 0 the prompt alone (lm-eval's loglikelihood requests, a list of prompts too),
/// streamed the same; vLLM's `prompt_logprobs` map with ranks (completions per choice, chat at
/// the top). Each prompt position's number equals the generated-token log-probability of the
/// prefix before it asked alone: an independent path through the same server. (llama.cpp
/// cannot run here; `cargo xtask bench agree` compares generated logprobs with it.)
#[test]
fn echo_with_logprobs_and_prompt_logprobs_score_the_prompt() {
    let path = scratch("vocab20-prompt.gguf");
    let spec = layers::model::random::RandomLlama { vocab: 20, ..common::tiny_spec() };
    spec.write(&path).expect("write the model");
    let prompt: Vec<u32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let f = |v: &Value| v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"));
    for layout in [&[][..], &["--tp", "2"], &["--cp", "2"]] {
        let server = Server::start(path.to_str().unwrap(), layout);
        let ask = |body: Value| {
            let reply = server.post("/v1/completions", &body);
            assert_eq!(reply.status, 200, "{layout:?}: {reply:?}");
            reply.json()
        };
        // The oracle: each prefix alone, its next token's distribution over all 20 tokens.
        let next: Vec<Value> = (1..prompt.len())
            .map(|p| {
                let body = json!({"prompt": prompt[..p], "max_tokens": 1, "logprobs": 20,
                                  "temperature": 0});
                ask(body)["choices"][0]["logprobs"]["top_logprobs"][0].clone()
            })
            .collect();
        let oracle = |p: usize| f(&next[p - 1][format!("t{}", prompt[p])]);

        // `echo` + `logprobs` + `max_tokens` 0: the prompt alone, scored.
        let body = json!({"prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2});
        let alone = ask(body.clone());
        let c = &alone["choices"][0];
        let text: String = prompt.iter().map(|t| format!("t{t}")).collect();
        assert_eq!(c["text"], text.as_str(), "{layout:?}");
        assert_eq!(c["token_ids"], json!([]), "{layout:?}");
        assert_eq!(c["finish_reason"], "length", "{layout:?}");
        assert_eq!(alone["usage"]["completion_tokens"], 0, "{layout:?}");
        let lp = &c["logprobs"];
        let names: Vec<String> = prompt.iter().map(|t| format!("t{t}")).collect();
        assert_eq!(lp["tokens"], json!(names), "{layout:?}");
        assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
        assert_eq!(lp["text_offset"][0], 0);
        for p in 1..prompt.len() {
            let got = f(&lp["token_logprobs"][p]);
            assert!(
                (got - oracle(p)).abs() < 1e-4,
                "{layout:?} position {p}: {got} vs {}",
                oracle(p)
            );
            let top = lp["top_logprobs"][p].as_object().unwrap();
            assert_eq!(top.len(), 2, "{layout:?} position {p}: {top:?}");
            for (name, v) in top {
                assert!((f(v) - f(&next[p - 1][name])).abs() < 1e-4, "{layout:?} {p} {name}");
            }
        }

        // `max_tokens` 1: the prompt's entries, then the generated token's, as without echo.
        let one = ask(with(body.clone(), &json!({"max_tokens": 1, "temperature": 0})));
        let plain =
            ask(json!({"prompt": prompt, "max_tokens": 1, "logprobs": 2, "temperature": 0}));
        let (lp1, plain) = (&one["choices"][0]["logprobs"], &plain["choices"][0]["logprobs"]);
        assert_eq!(lp1["tokens"].as_array().unwrap().len(), prompt.len() + 1);
        assert_eq!(lp1["token_logprobs"][prompt.len()], plain["token_logprobs"][0]);
        assert_eq!(lp1["top_logprobs"][prompt.len()], plain["top_logprobs"][0]);
        assert_eq!(lp1["token_logprobs"][1], lp["token_logprobs"][1]);
        assert_eq!(lp1["text_offset"][prompt.len()], text.chars().count());

        // Streamed: the echo chunk carries the prompt's numbers.
        let events = server.post("/v1/completions", &with(body.clone(), &json!({"stream": true})));
        let chunks: Vec<Value> = events
            .events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(chunks[0]["choices"][0]["text"], text.as_str(), "{layout:?}");
        assert_eq!(chunks[0]["choices"][0]["logprobs"], *lp, "{layout:?}");
        // The prompt alone: no generated token follows, and the end says `length`.
        let rest: Vec<&Value> = chunks[1..].iter().map(|c| &c["choices"][0]).collect();
        assert!(rest.iter().all(|c| c["text"] == "" && c["logprobs"].is_null()), "{rest:?}");
        assert_eq!(rest.last().unwrap()["finish_reason"], "length", "{layout:?}");

        // vLLM's `prompt_logprobs`: the prompt's token with its rank, and the 3 most likely.
        let vllm = ask(json!({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 3}));
        let list = vllm["choices"][0]["prompt_logprobs"].as_array().unwrap().clone();
        assert_eq!(list.len(), prompt.len(), "{layout:?}");
        assert!(list[0].is_null());
        for p in 1..prompt.len() {
            let own = &list[p][prompt[p].to_string()];
            assert!((f(&own["logprob"]) - oracle(p)).abs() < 1e-4, "{layout:?} position {p}");
            assert_eq!(own["decoded_token"], format!("t{}", prompt[p]));
            let above = next[p - 1].as_object().unwrap().values().filter(|v| f(v) > oracle(p));
            assert_eq!(own["rank"], above.count() + 1, "{layout:?} position {p}");
            let ranks: Vec<u64> = list[p]
                .as_object()
                .unwrap()
                .values()
                .map(|e| e["rank"].as_u64().unwrap())
                .collect();
            assert!((1..=3).all(|r| ranks.contains(&r)), "{layout:?} position {p}: {ranks:?}");
        }
        // Scoring the prompt changes nothing of what follows it.
        let greedy = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
        let scored = ask(with(greedy.clone(), &json!({"prompt_logprobs": 0})));
        let plain = ask(greedy);
        assert_eq!(
            scored["choices"][0]["token_ids"], plain["choices"][0]["token_ids"],
            "{layout:?}"
        );
        assert_eq!(server.interrupt().code(), Some(130));
    }

    // A list of prompts scored alone (lm-eval's batch): each choice its own prompt.
    let server = Server::start(path.to_str().unwrap(), &[]);
    let body = json!({"prompt": [[7, 8, 9], [3, 1, 4, 1]], "max_tokens": 0, "echo": true,
                      "logprobs": 1});
    let reply = server.post("/v1/completions", &body);
    assert_eq!(reply.status, 200, "{reply:?}");
    let both = reply.json();
    let single = server
        .post("/v1/completions", &with(body.clone(), &json!({"prompt": [3, 1, 4, 1]})))
        .json();
    assert_eq!(both["choices"][1]["logprobs"], single["choices"][0]["logprobs"]);
    assert_eq!(both["choices"][0]["logprobs"]["tokens"], json!(["t7", "t8", "t9"]));
    assert_eq!(both["usage"]["prompt_tokens"], 7);

    // Chat: vLLM puts the prompt's list at the top of the answer.
    server.interrupt();
    let server = Server::start(chat_model(), &[]);
    let chat = json!({"messages": [{"role": "user", "content": "t5t6"}], "max_tokens": 2,
                      "prompt_logprobs": 1});
    let reply = server.post("/v1/chat/completions", &chat);
    assert_eq!(reply.status, 200, "{reply:?}");
    let answer = reply.json();
    let list = answer["prompt_logprobs"].as_array().unwrap();
    assert_eq!(list.len() as u64, answer["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(list[0].is_null() && list[1].is_object());

    // Refused: streamed vLLM lists (as vLLM), too many alternatives, `max_tokens` 0 alone.
    let refuse = |path: &str, body: Value, says: &str| {
        let reply = server.post(path, &body);
        assert_error(
            &reply,
            400,
            if says.contains("max_tokens") { "invalid_max_tokens" } else { "invalid_logprobs" },
        );
        assert!(reply.body.contains(says), "{body}: {}", reply.body);
    };
    refuse("/v1/chat/completions", with(chat.clone(), &json!({"stream": true})), "not streamed");
    refuse(
        "/v1/completions",
        json!({"prompt": [1], "prompt_logprobs": 21}),
        "`prompt_logprobs` 21",
    );
    refuse("/v1/completions", json!({"prompt": [1], "max_tokens": 0}), "max_tokens");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// vLLM's `--host`, `--port` and `--max-model-len`: the address is theirs, and the context
/// of a request is the given length.
#[test]
fn vllms_host_port_and_max_model_len_flags() {
    let server =
        Server::start(model(), &["--host", "127.0.0.1", "--port", "0", "--max-model-len", "40"]);
    assert!(server.addr.starts_with("127.0.0.1:"), "{}", server.addr);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["max_model_len"], 40, "{models}");
    let reply = server.post("/v1/completions", &completion("1,2,3", 38));
    assert_error(&reply, 400, "context_length_exceeded");
    assert!(reply.body.contains("maximum context length is 40 tokens"), "{}", reply.body);
    assert_eq!(server.post("/v1/completions", &completion("1,2,3", 37)).status, 200);
    assert_eq!(server.interrupt().code(), Some(130));
    let out = tpctl(&["serve", "--model", model(), "--listen", "127.0.0.1:0", "--port", "9"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot be used with"), "{err}");
}

/// vLLM's utility routes and the OpenAI SDK's `models.retrieve`, under a served name with a
/// slash in it (as Hugging Face ids have).
#[test]
fn tokenize_detokenize_version_and_model_retrieval() {
    let server = Server::start(chat_model(), &["--served-model-name", "org/tiny-chat"]);
    let post = |path: &str, body: Value| server.post(path, &body);
    let reply = post("/tokenize", json!({"prompt": "t1t5"}));
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["tokens"], json!([1, 5]));
    assert_eq!(reply.json()["count"], 2);
    // Messages go through the chat template, with or without the assistant's turn.
    let messages = json!([{"role": "user", "content": "t5t6"}]);
    let reply = post("/tokenize", json!({"messages": messages}));
    assert_eq!(reply.json()["tokens"], json!([1, 5, 6, 2, 3]), "{reply:?}");
    let reply = post("/tokenize", json!({"messages": messages, "add_generation_prompt": false}));
    assert_eq!(reply.json()["tokens"], json!([1, 5, 6, 2]), "{reply:?}");
    let reply = post("/detokenize", json!({"tokens": [1, 5]}));
    assert_eq!(reply.json()["prompt"], "t1t5", "{reply:?}");
    assert_error(&post("/detokenize", json!({"tokens": [99999]})), 400, "invalid_token_id");
    assert_error(&post("/tokenize", json!({"prompt": "t1", "bogus": 1})), 400, "invalid_json");
    assert_error(
        &post("/tokenize", json!({"prompt": "t1", "model": "gpt-4"})),
        404,
        "model_not_found",
    );

    assert!(server.get("/version").json()["version"].is_string());
    let model = server.get("/v1/models/org/tiny-chat");
    assert_eq!(model.status, 200, "{model:?}");
    assert_eq!(model.json()["id"], "org/tiny-chat");
    assert_eq!(server.get("/v1/models").json()["data"][0]["id"], "org/tiny-chat");
    assert_error(&server.get("/v1/models/gpt-4"), 404, "model_not_found");
    let reply =
        post("/v1/completions", json!({"prompt": [1], "max_tokens": 1, "model": "org/tiny-chat"}));
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// Stop strings of any length, split over tokens, end the answer before them (streamed or
/// not), with finish reason `stop`.
#[test]
fn stop_strings_split_over_tokens_end_the_answer_before_them() {
    let server = Server::start(common::lookup_model(), &[]);
    // The model writes "😀中 😀中 ..."; "中 😀" spans four tokens.
    let mut req = completion("1", 12);
    req["stop"] = json!(["zzz", "中 😀"]);
    let reply = server.post("/v1/completions", &req);
    assert_eq!(reply.status, 200, "{reply:?}");
    let body = reply.json();
    assert_eq!(body["choices"][0]["text"], "😀", "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    req["stream"] = json!(true);
    let reply = server.post("/v1/completions", &req);
    let events = reply.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{reply:?}");
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let text: String =
        chunks.iter().map(|c| c["choices"][0]["text"].as_str().unwrap_or("")).collect();
    assert_eq!(text, "😀", "{reply:?}");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    // A stop string that never comes: the whole answer, the end held back for it included.
    let mut req = completion("1", 5);
    req["stop"] = json!(" 😀x");
    let body = server.post("/v1/completions", &req).json();
    assert_eq!(body["choices"][0]["text"], "😀中 ", "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_error(
        &server.post("/v1/completions", &json!({"prompt": [1], "stop": [""]})),
        400,
        "invalid_stop",
    );
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A config file's `[sampling]` gives the defaults of the fields a request leaves out.
#[test]
fn the_config_files_sampling_gives_the_servers_defaults() {
    let toml = scratch("sampling.toml");
    std::fs::write(&toml, "[sampling]\ntemperature = 0\nmax_tokens = 5\n").unwrap();
    let expected = reference(model(), &["3,4"], 5).remove(0);
    let server = Server::start(model(), &[toml.to_str().unwrap()]);
    let reply = server.post("/v1/completions", &json!({"prompt": prompt_ids("3,4")}));
    assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected, "greedy, 5 tokens");
    // A field given in the request wins.
    let reply =
        server.post("/v1/completions", &json!({"prompt": prompt_ids("3,4"), "max_tokens": 2}));
    assert_eq!(ids(&reply.json()["choices"][0]["token_ids"]), expected[..2]);
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A prompt that starts like an earlier one reuses the earlier one's KV blocks: the same
/// greedy tokens, and `/metrics` counts the reused tokens; with `--no-prefix-caching` nothing
/// is looked up. The pool's usage is a gauge.
#[test]
fn a_repeated_prompt_prefix_is_reused_and_counted() {
    let prompt: Vec<u32> = (0..40u32).map(|i| i * 7 % 40 + 1).collect();
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let mut answers = Vec::new();
    for flags in [&[][..], &["--no-prefix-caching"][..]] {
        let server = Server::start(model(), flags);
        for _ in 0..2 {
            let reply = server.post("/v1/completions", &body);
            assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
            answers.push(ids(&reply.json()["choices"][0]["token_ids"]));
        }
        let metrics = server.get("/metrics");
        let m = &metrics.body;
        // Two full 16-token blocks of the 40 (the last token is always computed).
        let (queries, hits) = if flags.is_empty() { (64.0, 32.0) } else { (0.0, 0.0) };
        assert_eq!(metric(m, "vllm:prefix_cache_queries_total"), queries, "{flags:?}\n{m}");
        assert_eq!(metric(m, "vllm:prefix_cache_hits_total"), hits, "{flags:?}\n{m}");
        let usage = metric(m, "vllm:kv_cache_usage_perc");
        assert!((0.0..=1.0).contains(&usage), "{m}");
        assert_eq!(metric(m, "vllm:num_requests_waiting"), 0.0, "{m}");
        let status = server.interrupt();
        assert_eq!(status.code(), Some(130), "{status:?}");
    }
    assert!(answers.iter().all(|a| *a == answers[0] && a.len() == 8), "{answers:?}");
}

/// With `[sleep.kv_cache] restore = "backup"` the prefix cache survives a sleep (the prompt
/// sent again right after the wakeup reuses its blocks); with `discard` it is emptied (no hit,
/// the blocks hold nothing any more). The answers are the same either way.
#[test]
fn the_prefix_cache_survives_a_backup_sleep_and_a_discard_empties_it() {
    let prompt: Vec<u32> = (0..40u32).map(|i| i * 11 % 40 + 2).collect();
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
    for (name, restore, hits) in [("pfx-backup", "backup", 32.0), ("pfx-discard", "discard", 0.0)] {
        let rt = runtime_dir(name);
        let toml = scratch(&format!("{name}.toml"));
        std::fs::write(&toml, format!("[sleep.kv_cache]\nrestore = \"{restore}\"\n")).unwrap();
        let env = [("XDG_RUNTIME_DIR", rt.as_str())];
        let args = ["--deployment", name, toml.to_str().unwrap()];
        let server = Server::start_with(model(), &args, &env);
        let before = server.post("/v1/completions", &body);
        assert_eq!(before.status, 200, "{before:?}\n{}", server.log());
        let (code, reply, err) = control(&rt, &["sleep", "--tags", "kv_cache"]);
        assert_eq!(code, 0, "{name} sleep: {err}\n{reply}");
        // `-q`: the wakeup succeeds without a word (no receipt table).
        let quiet = Command::new(tpctl_bin())
            .args(["-q", "wakeup"])
            .env("XDG_RUNTIME_DIR", &rt)
            .env_remove("RUST_LOG")
            .output()
            .expect("run tpctl");
        assert_eq!(quiet.status.code(), Some(0), "{name}: {quiet:?}");
        assert!(quiet.stdout.is_empty() && quiet.stderr.is_empty(), "{name}: {quiet:?}");
        let after = server.post("/v1/completions", &body);
        assert_eq!(after.status, 200, "{after:?}");
        let answer = |r: &Reply| ids(&r.json()["choices"][0]["token_ids"]);
        assert_eq!(answer(&after), answer(&before), "{name}");
        let m = server.get("/metrics").body;
        assert_eq!(metric(&m, "vllm:prefix_cache_queries_total"), 64.0, "{name}\n{m}");
        assert_eq!(metric(&m, "vllm:prefix_cache_hits_total"), hits, "{name}\n{m}");
        let status = server.interrupt();
        assert_eq!(status.code(), Some(130), "{status:?}");
    }
}

/// The prefix cache outlives what leaves the KV cache valid: a level-1 sleep of the weights
/// alone, and a pause; a weight update drops it (its blocks hold the old weights' keys and
/// values), and its receipt says so.
#[test]
fn the_prefix_cache_survives_a_weights_sleep_and_a_pause_but_not_an_update() {
    let prompt: Vec<u32> = (0..40u32).map(|i| i * 7 % 40 + 2).collect();
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let rt = runtime_dir("pfx-weights");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let server = Server::start_with(model(), &["--deployment", "pfx-weights"], &env);
    let hits = |server: &Server| {
        let reply = server.post("/v1/completions", &body);
        assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
        metric(&server.get("/metrics").body, "vllm:prefix_cache_hits_total")
    };
    assert_eq!(hits(&server), 0.0);
    let (code, reply, err) = control(&rt, &["sleep", "--tags", "weights", "--level", "1"]);
    assert_eq!(code, 0, "{err}\n{reply}");
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(hits(&server), 32.0, "the two full blocks, after the weights slept");
    let (code, _, err) = control(&rt, &["pause", "--mode", "wait"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = control(&rt, &["resume"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(hits(&server), 64.0, "again after a pause");
    let (code, reply, err) = control(&rt, &["reload", "--model", model()]);
    assert_eq!(code, 0, "{err}\n{reply}");
    assert_eq!(reply["op"]["kv_cache_dropped"], true, "{reply}");
    assert_eq!(hits(&server), 64.0, "none after a weight update");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A model whose greedy answer to any prompt is "Let me check. " and one Hermes-format tool
/// call, token by token, then its end token (a lookup table, see `common::lookup_model`).
fn tool_model() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        use layers::model::random::byte_level;
        let pieces = [
            "Let me check. ",
            "<tool_call>",
            "{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}",
            "</tool_call>",
            // A one-character token for prompts.
            "?",
        ];
        let mut spec = common::tiny_spec();
        spec.token_names = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (10 + i as u32, byte_level(p.as_bytes())))
            .collect();
        let mut next = vec![10; spec.vocab];
        next[10..16].copy_from_slice(&[11, 12, 13, 14, 0, 10]);
        spec.next_token = Some(next);
        let mut writer = spec.writer();
        let template = "{% for m in messages %}{{ m.content }}{% endfor %}";
        writer
            .metadata("tokenizer.chat_template", checkpoint::gguf::Value::String(template.into()));
        // The end token is a control token: it ends the answer without showing in its text.
        use checkpoint::gguf::Value as V;
        let types = (0..spec.vocab).map(|i| V::I32(if i == 0 { 3 } else { 1 })).collect();
        writer.metadata("tokenizer.ggml.token_type", V::Array(types));
        let path = scratch("tool-call.gguf");
        writer.write(&path).expect("write the tool-call model");
        path.to_string_lossy().into_owned()
    })
}

/// With `tools` (and `tool_choice` "auto", the default) an answer's `<tool_call>` blocks
/// become `tool_calls` with finish reason `tool_calls`, streamed or not; with "none", or
/// without tools, the answer is text.
#[test]
fn tool_calls_are_parsed_out_of_chat_answers() {
    let server = Server::start(tool_model(), &[]);
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let chat = |extra: Value| {
        let body = with(
            json!({"messages": [{"role": "user", "content": "?"}], "max_tokens": 10, "temperature": 0}),
            &extra,
        );
        let reply = server.post("/v1/chat/completions", &body);
        assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
        reply
    };
    let choice = chat(json!({"tools": [tool]})).json()["choices"][0].clone();
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    let message = &choice["message"];
    assert_eq!(message["content"], "Let me check. ", "{choice}");
    let call = &message["tool_calls"][0];
    assert_eq!(
        (&call["type"], &call["function"]["name"]),
        (&json!("function"), &json!("get_weather"))
    );
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    assert_eq!(message["tool_calls"].as_array().unwrap().len(), 1);

    let raw = "Let me check. <tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>";
    for extra in [json!({"tools": [tool], "tool_choice": "none"}), json!({})] {
        let choice = chat(extra.clone()).json()["choices"][0].clone();
        assert_eq!(choice["message"]["content"], raw, "{extra}: {choice}");
        assert_eq!(choice["finish_reason"], "stop", "{extra}");
        assert!(choice["message"].get("tool_calls").is_none(), "{extra}");
    }

    // Streamed: the content as deltas, then the calls, then the finish reason.
    let events = chat(json!({"tools": [tool], "stream": true})).events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
    assert_eq!(content, "Let me check. ", "{chunks:?}");
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(calls[0][0]["function"]["name"], "get_weather");
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls", "{last}");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A model that can write JSON: a lookup table (see `common::lookup_model`) over 128 tokens,
/// the end token 0 (a control token) and the characters ' '..='~' as tokens 1..=95. Its greedy
/// choice after a token is the successor below when the request allows it, else the allowed
/// token of the lowest id (ties at the same logit): after `"` it spells `Bob"`, after `:` it
/// writes `42}`, after anything else `}`.
fn json_model() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        use layers::model::random::byte_level;
        let id = |c: char| c as u32 - 31;
        let mut spec = layers::model::random::RandomLlama {
            heads: 4,
            kv_heads: 2,
            hidden: 128,
            ffn: 64,
            vocab: 128,
            seed: 5,
            ..Default::default()
        };
        spec.token_names = (b' '..=b'~').map(|b| (u32::from(b) - 31, byte_level(&[b]))).collect();
        let mut next = vec![id('}'); spec.vocab];
        for (a, b) in [('"', 'B'), ('B', 'o'), ('o', 'b'), ('b', '"'), (':', '4'), ('4', '2')] {
            next[id(a) as usize] = id(b);
        }
        spec.next_token = Some(next);
        let mut writer = spec.writer();
        let template = "{% for m in messages %}{{ m.content }}{% endfor %}";
        use checkpoint::gguf::Value as V;
        writer.metadata("tokenizer.chat_template", V::String(template.into()));
        let types = (0..spec.vocab).map(|i| V::I32(if i == 0 { 3 } else { 1 })).collect();
        writer.metadata("tokenizer.ggml.token_type", V::Array(types));
        let path = scratch("json.gguf");
        writer.write(&path).expect("write the JSON model");
        path.to_string_lossy().into_owned()
    })
}

/// The strict schema the OpenAI SDK's `client.chat.completions.parse` sends for the pydantic
/// model `class Person(BaseModel): name: str; age: int`.
fn person_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "Person", "strict": true, "schema": {
        "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
        "required": ["name", "age"], "title": "Person", "type": "object", "additionalProperties": false}}})
}

/// Every structured-output field constrains the answer to its grammar, whole or streamed, with
/// `n` and log-probabilities; a constrained request leaves the free one batched with it as it is
/// alone; a bad grammar, two at once, or a forced call without tools is a 400 naming it.
#[test]
fn structured_outputs_follow_their_grammar() {
    let server = Server::start(json_model(), &[]);
    let chat = |extra: Value| {
        let body = with(
            json!({"messages": [{"role": "user", "content": "?"}], "max_tokens": 40, "temperature": 0}),
            &extra,
        );
        server.post("/v1/chat/completions", &body)
    };
    let answer = |extra: Value| {
        let reply = chat(extra.clone());
        assert_eq!(reply.status, 200, "{extra}: {reply:?}\n{}", server.log());
        let choice = reply.json()["choices"][0].clone();
        assert_eq!(choice["finish_reason"], "stop", "{extra}: {choice}");
        choice["message"]["content"].as_str().unwrap().to_owned()
    };
    // Free, the model writes `}` over and over.
    let free = chat(json!({"max_tokens": 4})).json()["choices"][0].clone();
    assert_eq!(free["message"]["content"], "}}}}", "{free}");
    let person = answer(json!({"response_format": person_format()}));
    assert_eq!(person, r#"{"name":"Bob","age":42}"#);
    let parsed: Value = serde_json::from_str(&person).unwrap();
    assert_eq!(parsed, json!({"name": "Bob", "age": 42}));
    let schema = &person_format()["json_schema"]["schema"];
    for (extra, expected) in [
        (json!({"response_format": {"type": "json_object"}}), "{}"),
        (json!({"guided_json": schema}), r#"{"name":"Bob","age":42}"#),
        (json!({"guided_json": schema.to_string()}), r#"{"name":"Bob","age":42}"#),
        (json!({"guided_regex": "[0-9]{2}[a-z]"}), "00a"),
        (json!({"guided_choice": ["yes", "no"]}), "no"),
        (json!({"guided_grammar": "start: \"ab\"+ \"!\""}), "ab!"),
        (json!({"structured_outputs": {"choice": ["yes", "maybe"]}}), "maybe"),
        (
            json!({"structured_outputs": {"json": schema, "disable_any_whitespace": true},
                "guided_decoding_backend": "xgrammar"}),
            r#"{"name":"Bob","age":42}"#,
        ),
        (json!({"response_format": {"type": "text"}, "guided_regex": "x"}), "x"),
    ] {
        assert_eq!(answer(extra.clone()), expected, "{extra}");
    }
    // Completions too, with `n` and log-probabilities (the model's own: its choice is `}`).
    let body = json!({"prompt": "?", "max_tokens": 40, "temperature": 0, "n": 2, "logprobs": 1,
        "guided_regex": "[0-9]{2}[a-z]"});
    let reply = server.post("/v1/completions", &body);
    assert_eq!(reply.status, 200, "{reply:?}");
    let choices = reply.json()["choices"].clone();
    for choice in choices.as_array().unwrap() {
        assert_eq!(choice["text"], "00a", "{choice}");
        let top = &choice["logprobs"]["top_logprobs"][0];
        assert!(top.get("}").is_some(), "{choice}");
    }
    // Streamed, each of two choices.
    let reply = chat(json!({"response_format": person_format(), "stream": true, "n": 2}));
    assert_eq!(reply.status, 200, "{reply:?}");
    let events = reply.events();
    let mut texts = [String::new(), String::new()];
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e).unwrap();
        let choice = &chunk["choices"][0];
        if let Some(t) = choice["delta"]["content"].as_str() {
            texts[choice["index"].as_u64().unwrap() as usize].push_str(t);
        }
    }
    assert_eq!(texts, [r#"{"name":"Bob","age":42}"#; 2], "{events:?}");

    // A constrained and a free request in one batch: the free one as alone.
    let alone =
        server.post("/v1/completions", &json!({"prompt": "?", "max_tokens": 30, "temperature": 0}));
    let alone = alone.json()["choices"][0]["text"].clone();
    let addr = server.addr.clone();
    let constrained = std::thread::spawn(move || {
        let body = json!({"messages": [{"role": "user", "content": "?"}], "max_tokens": 40,
            "temperature": 0, "response_format": person_format()});
        request(&addr, "POST", "/v1/chat/completions", &[], Some(body.to_string().as_bytes()))
    });
    let free =
        server.post("/v1/completions", &json!({"prompt": "?", "max_tokens": 30, "temperature": 0}));
    let constrained = constrained.join().unwrap();
    assert_eq!(free.json()["choices"][0]["text"], alone);
    assert_eq!(
        constrained.json()["choices"][0]["message"]["content"],
        r#"{"name":"Bob","age":42}"#
    );

    // Mistakes are 400s that say what is wrong.
    let bad = |extra: Value, needle: &str| {
        let reply = chat(extra.clone());
        assert_error(&reply, 400, "invalid_structured_output");
        let message = reply.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains(needle), "{extra}: {message}");
    };
    let nonsense = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}});
    bad(
        json!({"response_format": nonsense}),
        "`response_format`: invalid JSON schema: Invalid type: nonsense",
    );
    bad(json!({"guided_regex": "(ab"}), "`guided_regex`: invalid regex");
    bad(json!({"guided_grammar": "start: ("}), "`guided_grammar`: invalid grammar");
    bad(json!({"guided_choice": []}), "the list of choices is empty");
    bad(json!({"guided_json": "{\"type\": "}), "not JSON");
    bad(json!({"guided_regex": "a", "guided_choice": ["a"]}), "`guided_regex` and `guided_choice`");
    bad(json!({"response_format": {"type": "yaml"}}), "`response_format` type `yaml`");
    bad(
        json!({"structured_outputs": {"structural_tag": "x"}}),
        "`structured_outputs.structural_tag`",
    );
    let reply = chat(json!({"tool_choice": "required"}));
    assert_error(&reply, 400, "invalid_tool_choice");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// `tool_choice` "required" or a named function makes the answer a call of the tools, with
/// their parameters' schema, answered as `tool_calls`.
#[test]
fn a_forced_tool_choice_answers_with_a_call() {
    let server = Server::start(json_model(), &[]);
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now"}},
    ]);
    let chat = |choice: Value, stream: bool| {
        let body = json!({"messages": [{"role": "user", "content": "?"}], "max_tokens": 60,
            "temperature": 0, "tools": tools, "tool_choice": choice, "stream": stream});
        server.post("/v1/chat/completions", &body)
    };
    for (choice, name, args) in [
        (json!("required"), "get_weather", json!({"city": "Bob"})),
        (json!({"type": "function", "function": {"name": "now"}}), "now", json!({})),
    ] {
        let reply = chat(choice.clone(), false);
        assert_eq!(reply.status, 200, "{reply:?}\n{}", server.log());
        let answer = &reply.json()["choices"][0];
        assert_eq!(answer["finish_reason"], "tool_calls", "{choice}: {answer}");
        let call = &answer["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], name, "{answer}");
        let parsed: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(parsed, args, "{answer}");

        let events = chat(choice.clone(), true).events();
        let chunks: Vec<Value> =
            events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let calls: Vec<&Value> =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"].get("tool_calls")).collect();
        assert_eq!(calls[0][0]["function"]["name"], name, "{chunks:?}");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    }
    let reply = chat(json!({"type": "function", "function": {"name": "fly"}}), false);
    assert_error(&reply, 400, "invalid_tool_choice");
    assert!(reply.body.contains("`fly`"), "{reply:?}");
    assert_eq!(server.interrupt().code(), Some(130));
}

/// A constrained answer whose KV cache a sleep discarded (mode `keep`) is recomputed under a
/// new id: its grammar is rebuilt and replays the output so far, so the answer continues
/// exactly as it would have without the sleep.
#[test]
fn a_recomputed_constrained_answer_continues_its_grammar() {
    let rt = runtime_dir("grammar");
    // Slow steps, so the sleep lands in the middle of the answer.
    let env = [("XDG_RUNTIME_DIR", rt.as_str()), ("TPCTL_FAILPOINTS", "session.step=delay(10)")];
    let server = Server::start_with(json_model(), &["--deployment", "grammar"], &env);
    let schema =
        json!({"type": "array", "minItems": 40, "maxItems": 40, "items": {"type": "integer"}});
    let body = json!({"prompt": "?", "max_tokens": 200, "temperature": 0, "guided_json": schema});
    let alone = server.post("/v1/completions", &body).json()["choices"][0].clone();
    assert_eq!(alone["finish_reason"], "stop", "{alone}");
    let expected = alone["text"].as_str().unwrap().to_owned();
    let items: Vec<f64> = serde_json::from_str(&expected).unwrap();
    assert_eq!(items, [0.0; 40], "the lowest ids: `-0` forty times");

    let body = with(body, &json!({"stream": true})).to_string();
    let raw = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut conn = TcpStream::connect(&server.addr).unwrap();
    conn.set_read_timeout(Some(DEADLINE)).unwrap();
    conn.write_all(raw.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("data:").count() < 10 {
        let k = conn.read(&mut buf).expect("streamed tokens");
        assert!(k > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..k]);
    }
    let (code, reply, err) = control(&rt, &["sleep", "--tags", "kv_cache", "--mode", "keep"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    let (code, _, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}");
    conn.read_to_end(&mut seen).expect("the rest of the stream");
    let text = String::from_utf8_lossy(&seen).into_owned();
    let (_, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    let reply = Reply { status: 200, head: String::new(), body: dechunk(body) };
    let events = reply.events();
    let mut streamed = String::new();
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e).unwrap();
        streamed.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
    }
    assert!(streamed.len() > 10, "{events:?}");
    assert_eq!(streamed, expected, "{}", server.log());
    let (code, _, err) = control(&rt, &["stop"]);
    assert_eq!(code, 0, "{err}");
    assert!(server.wait().success());
}

/// `tpctl serve --backend mpi`: the ranks start under one `mpirun`, answer with the greedy
/// tokens of `tpctl run` on shm, sleep and wake on every rank through the control socket
/// (the same tokens after), and Ctrl-C stops every process.
#[cfg(feature = "mpi")]
#[test]
fn serve_over_mpirun_answers_like_run_sleeps_and_stops_on_ctrl_c() {
    const MAX: u32 = 6;
    let prompts = ["1,2,3,4,5", "7,8"];
    let expected = reference(model(), &prompts, MAX);
    let rt = runtime_dir("mpi");
    let env = [("XDG_RUNTIME_DIR", rt.as_str())];
    let args = ["--tp", "2", "--backend", "mpi", "--deployment", "mpi"];
    let server = Server::start_with(model(), &args, &env);
    assert_eq!(greedy_ids(&server, &prompts, MAX), expected, "{}", server.log());

    let (code, reply, err) = control(&rt, &["sleep"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(reply["op"]["ranks"].as_array().map(Vec::len), Some(2), "{reply}");
    let (code, reply, err) = control(&rt, &["wakeup"]);
    assert_eq!(code, 0, "{err}\n{reply}\n{}", server.log());
    assert_eq!(greedy_ids(&server, &prompts, MAX), expected, "after the wakeup");

    let status = server.interrupt();
    assert_eq!(status.code(), Some(130), "{status:?}");
}
