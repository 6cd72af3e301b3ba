//! One rank of a multi-process session test: joins the world from the torchrun environment,
//! runs the session engine over the random model at `TPCTL_MODEL` in the scenario named by
//! `TPCTL_SCENARIO`, then prints machine-checkable lines:
//!
//! - `open session=E`, `step epoch=E step=S`, `closed session=E steps=N` (every rank);
//! - `out req=ID reason=R tokens=T,T,...` (rank 0 only: the output sink's content);
//! - `refused: MESSAGE` (a worker that was offered a sink);
//! - `threads=N` once every engine thread is gone (1 means none was left behind);
//! - last, `ok`, or `error: MESSAGE` with exit code 3.
#![forbid(unsafe_code)]

use collectives::{init_parallel, Collective, InitOptions, ReduceOp};
use mesh::{AxisBackends, CommBackend};
use session::replicated::LlamaFactory;
use session::sharded::{KvCacheConfig, ShardedFactory};
use session::{
    BoxError, Collect, Decision, EngineOptions, Event, Groups, KvLayout, MetricsSink, ModelFactory,
    Request, Role, SamplingParams, SessionConfig, SessionReport, Sinks, StepMetrics, StepModel,
    StepOutput, StepPlan, StopHandle,
};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let scenario = std::env::var("TPCTL_SCENARIO").unwrap_or_default();
    let rank = env_u64("RANK", 0) as usize;
    let (role, result) = run(&scenario, rank);
    if let Some(role) = &role {
        for e in role.events() {
            match e {
                Event::Opened { epoch } => println!("open session={epoch}"),
                Event::Step { epoch, step } => println!("step epoch={epoch} step={step}"),
                Event::Closed { epoch, steps } => println!("closed session={epoch} steps={steps}"),
            }
        }
    }
    let collected = OUTPUT.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(out) = collected {
        for f in out.finished() {
            let tokens: Vec<String> = f.tokens.iter().map(u32::to_string).collect();
            println!(
                "out req={} reason={} tokens={}",
                f.request,
                f.reason.name(),
                tokens.join(",")
            );
        }
    }
    if let Some(counts) = KV_COUNTS.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let (preemptions, hits) = *counts.0.lock().unwrap_or_else(|e| e.into_inner());
        println!("kv preemptions={preemptions} prefix_hits={hits}");
    }
    drop(role);
    println!("threads={}", settled_threads());
    match result {
        Ok(()) => println!("ok"),
        Err(e) => {
            println!("error: {e}");
            std::process::exit(3);
        }
    }
}

/// Rank 0's output sink, kept here so it can be printed after the engine is gone.
static OUTPUT: Mutex<Option<Collect>> = Mutex::new(None);

/// This process's thread count once helper threads (model pools) had a moment to exit.
fn settled_threads() -> usize {
    let count = || {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("Threads:").map(|n| n.trim().parse().ok()))
            })
            .flatten()
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut n = count();
    while n > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        n = count();
    }
    n
}

/// The replicated model, plus a plan check across the TP and CP groups in every step, and a
/// stop request right after a step's admission.
struct Probe {
    inner: Box<dyn StepModel>,
    stop_at: Option<u64>,
    stop: Arc<Mutex<Option<StopHandle>>>,
    sigkill_at: Option<u64>,
    /// Whether to check the plan on the TP and CP groups before the model's step (off: the
    /// model's own collectives are the step's first).
    check_plans: bool,
}

impl StepModel for Probe {
    fn prepare(&mut self, plan: &StepPlan) -> Result<(), BoxError> {
        // Between the admission and the confirmation of step `stop_at`.
        if self.stop_at == Some(plan.step) {
            if let Some(h) = self.stop.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                h.request_stop();
            }
        }
        self.inner.prepare(plan)
    }

    fn forward(
        &mut self,
        plan: &StepPlan,
        groups: &mut Groups<'_>,
    ) -> Result<Option<StepOutput>, BoxError> {
        if self.sigkill_at == Some(plan.step) {
            // A real SIGKILL from outside the process, in the middle of the step.
            let me = std::process::id().to_string();
            let _ = std::process::Command::new("kill").args(["-KILL", &me]).status();
            std::thread::sleep(Duration::from_secs(30));
        }
        if !self.check_plans {
            return self.inner.forward(plan, groups);
        }
        // Like a sharded model, meet the TP and CP peers inside the step, and check on the way
        // that every rank runs the same plan.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        format!("{plan:?}").hash(&mut hasher);
        let h = (hasher.finish() >> 1) as i64;
        for group in [&mut *groups.tp, &mut *groups.cp] {
            let mut v = [h, -h];
            group.all_reduce(&mut v, ReduceOp::Max)?;
            if v[0] != -v[1] {
                return Err(format!("ranks of group {} ran different plans", group.group()).into());
            }
        }
        self.inner.forward(plan, groups)
    }

    fn release(&mut self, seq: u64) {
        self.inner.release(seq);
    }

    fn context_len(&self) -> usize {
        self.inner.context_len()
    }

    fn kv_layout(&self) -> Option<KvLayout> {
        self.inner.kv_layout()
    }
}

/// Rank 0's count of KV preemptions and prefix-cache hits, printed at the end.
#[derive(Clone, Default)]
struct KvCounts(Arc<Mutex<(u64, u64)>>);

impl MetricsSink for KvCounts {
    fn step(&mut self, m: &StepMetrics) {
        let mut c = self.0.lock().unwrap_or_else(|e| e.into_inner());
        c.0 += m.preemptions;
        c.1 += m.prefix_hits;
    }
}

static KV_COUNTS: Mutex<Option<KvCounts>> = Mutex::new(None);

struct ProbeFactory {
    inner: Box<dyn ModelFactory>,
    stop_at: Option<u64>,
    stop: Arc<Mutex<Option<StopHandle>>>,
    sigkill_at: Option<u64>,
}

impl ModelFactory for ProbeFactory {
    fn build(
        &mut self,
        config: &SessionConfig,
        groups: &mut Groups<'_>,
    ) -> Result<Box<dyn StepModel>, BoxError> {
        let inner = self.inner.build(config, groups)?;
        Ok(Box::new(Probe {
            inner,
            stop_at: self.stop_at,
            stop: self.stop.clone(),
            sigkill_at: self.sigkill_at,
            // `TPCTL_PLAN_CHECK=0`: a failing peer is seen in the model's own collectives.
            check_plans: std::env::var("TPCTL_PLAN_CHECK").map_or(true, |v| v != "0"),
        }))
    }

    fn codec(
        &mut self,
        config: &SessionConfig,
    ) -> Result<Option<Box<dyn session::TextCodec>>, BoxError> {
        self.inner.codec(config)
    }
}

fn req(id: u64, prompt: &[u32], max_tokens: u32) -> Request {
    let params = SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::default() };
    Request::tokens(id, prompt.to_vec(), params)
}

fn batch() -> Vec<Request> {
    vec![req(1, &[1, 2, 3], 4), req(2, &[4, 5], 6), req(3, &[6, 7, 8, 9, 10], 3)]
}

type Outcome = Result<(), Box<dyn std::error::Error>>;

fn run(scenario: &str, rank: usize) -> (Option<Role>, Outcome) {
    let mut role = None;
    let result = scenario_main(scenario, rank, &mut role);
    (role, result)
}

fn scenario_main(scenario: &str, rank: usize, slot: &mut Option<Role>) -> Outcome {
    let world = env_u64("WORLD_SIZE", 1) as usize;
    let backend: CommBackend =
        std::env::var("TPCTL_BACKEND").unwrap_or_else(|_| "shm".into()).parse()?;
    let opts = InitOptions {
        tp: Some(env_u64("TPCTL_TP", world as u64) as usize),
        head_groups: world,
        backends: AxisBackends { tp: backend, cp: backend, control: backend },
        timeout: Duration::from_secs(20),
        ..InitOptions::default()
    };
    let ctx = init_parallel(&opts)?;
    let model = std::env::var("TPCTL_MODEL")?;
    let engine = EngineOptions {
        step_timeout: Duration::from_millis(env_u64("TPCTL_TIMEOUT_MS", 20_000)),
        transition_timeout: Duration::from_secs(30),
        tick: Duration::from_millis(env_u64("TPCTL_TICK_MS", 100)),
        shutdown_timeout: Duration::from_secs(20),
        ..EngineOptions::default()
    };
    let stop_rank = env_u64("TPCTL_STOP_RANK", 0) as usize;
    let stop_cell = Arc::new(Mutex::new(None));
    let stop_at = match scenario {
        "stop-after-admission" | "worker-early" if rank == stop_rank => {
            Some(env_u64("TPCTL_STOP_STEP", 3))
        }
        _ => None,
    };
    // `TPCTL_SIGKILL=RANK:STEP`: that rank is killed with SIGKILL inside that step.
    let sigkill_at = std::env::var("TPCTL_SIGKILL").ok().and_then(|v| {
        let (r, s) = v.split_once(':')?;
        (r.parse::<usize>().ok()? == rank).then(|| s.parse().ok()).flatten()
    });
    let factory = Box::new(ProbeFactory {
        // `TPCTL_SHARDED=1`: the TP/CP-sharded model instead of the replicated one.
        inner: if std::env::var("TPCTL_SHARDED").is_ok_and(|v| v == "1") {
            let factory = ShardedFactory::new(1);
            // `TPCTL_PAGED=1`: a paged KV pool with room for one 40-token sequence only.
            Box::new(if std::env::var("TPCTL_PAGED").is_ok_and(|v| v == "1") {
                factory.with_context(40).with_kv_cache(KvCacheConfig {
                    bytes: None,
                    cap_bytes: 0,
                    block_size: 4,
                    prefix_caching: true,
                    device_fraction: None,
                })
            } else {
                factory
            })
        } else {
            Box::new(LlamaFactory::new(1))
        },
        stop_at,
        stop: stop_cell.clone(),
        sigkill_at,
    });
    let collect = Collect::new();
    let counts = KvCounts::default();
    let sinks = || Sinks { output: Box::new(collect.clone()), metrics: Box::new(counts.clone()) };
    let role = slot.insert(Role::new(ctx, factory, engine, (rank == 0).then(sinks))?);
    *stop_cell.lock().unwrap_or_else(|e| e.into_inner()) = Some(role.stop_handle());
    if rank == 0 {
        *OUTPUT.lock().unwrap_or_else(|e| e.into_inner()) = Some(collect.clone());
        *KV_COUNTS.lock().unwrap_or_else(|e| e.into_inner()) = Some(counts.clone());
    }
    if scenario == "stop-before-start" && rank == stop_rank {
        role.stop_handle().request_stop();
    }
    let leader = match role {
        Role::Worker(w) => {
            // A worker asked to stop while the session idles (rank 0 waits for input).
            let stopper = (scenario == "stop-waiting" && rank == stop_rank).then(|| {
                let handle = w.stop_handle();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(400));
                    handle.request_stop();
                })
            });
            let result = w.run();
            if let Some(t) = stopper {
                t.join().map_err(|_| "the stopper thread panicked")?;
            }
            result?;
            return Ok(());
        }
        Role::Leader(l) => l,
    };
    let cfg = SessionConfig { token_budget: 4, max_batch: 8, ..SessionConfig::new(model.clone()) };
    let mut stop = |_: &SessionReport| Decision::Stop;
    match scenario {
        "natural" => {
            // One request samples (temperature, top-k, top-p, seeded) next to greedy ones.
            let params = SamplingParams {
                max_tokens: 5,
                temperature: 0.9,
                top_k: 8,
                top_p: 0.9,
                seed: 42,
                ignore_eos: true,
                ..SamplingParams::default()
            };
            let mut requests = batch();
            requests.push(Request::tokens(4, vec![11, 12], params));
            leader.run(cfg, requests, &mut stop)?;
        }
        "stop-before-start" | "stop-after-admission" | "worker-early" | "failure" => {
            leader.run(cfg, batch(), &mut stop)?;
        }
        "shared-prefix" => {
            // Four prompts that share their first 8 tokens, 16 greedy tokens each: more than
            // a 40-token paged pool holds at once.
            let requests = (0..4u32)
                .map(|i| {
                    let mut prompt: Vec<u32> = (5..13).collect();
                    prompt.extend([20 + i, 30 + i]);
                    req(u64::from(i) + 1, &prompt, 16)
                })
                .collect();
            leader.run(cfg, requests, &mut stop)?;
        }
        "bounded" => {
            leader.run(SessionConfig { max_steps: Some(3), ..cfg }, batch(), &mut stop)?;
        }
        "zero" => {
            leader.run(SessionConfig { max_steps: Some(0), ..cfg }, batch(), &mut stop)?;
        }
        "two-sessions" => {
            let next = SessionConfig { token_budget: 2, ..cfg.clone() };
            let mut decide = |r: &SessionReport| match r.epoch {
                0 => Decision::Replace(next.clone(), vec![req(10, &[11, 12], 3)]),
                _ => Decision::Stop,
            };
            leader.run(cfg, batch(), &mut decide)?;
        }
        "stop-waiting" => {
            let (_tx, rx) = std::sync::mpsc::channel();
            let handle = leader.stop_handle();
            let stopper = (stop_rank == 0).then(|| {
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(400));
                    handle.request_stop();
                })
            });
            let mut keep = |_: &SessionReport| Decision::KeepOpen;
            let result = leader.serve(cfg, &rx, &mut keep);
            if let Some(t) = stopper {
                t.join().map_err(|_| "the stopper thread panicked")?;
            }
            result?;
        }
        "serve" | "replace" => {
            let (tx, rx) = std::sync::mpsc::channel();
            for r in batch() {
                tx.send(r)?;
            }
            let feeder = std::thread::spawn(move || {
                // Joins while the first requests are decoding, then again after an idle spell.
                std::thread::sleep(Duration::from_millis(5));
                let _ = tx.send(req(4, &[20, 21, 22, 23], 5));
                std::thread::sleep(Duration::from_millis(500));
                let _ = tx.send(req(5, &[30], 2));
            });
            let replace = scenario == "replace";
            let next = SessionConfig { token_budget: 8, ..cfg.clone() };
            let mut decide = |r: &SessionReport| match (r.epoch, r.finished) {
                (0, n) if n >= 5 && replace => {
                    Decision::Replace(next.clone(), vec![req(9, &[40, 41], 2)])
                }
                (0, n) if n >= 5 => Decision::Stop,
                (1, n) if n >= 1 => Decision::Stop,
                _ => Decision::KeepOpen,
            };
            let result = leader.serve(cfg, &rx, &mut decide);
            feeder.join().map_err(|_| "the feeder thread panicked")?;
            result?;
        }
        other => return Err(format!("unknown scenario `{other}`").into()),
    }
    Ok(())
}
