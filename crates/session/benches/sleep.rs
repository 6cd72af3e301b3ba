//! Sleep/wakeup benchmark: latency of the multi-rank control protocol alone (no tagged
//! memory), with `TPCTL_SLEEP_BENCH_MIB` MiB (default 256) of tagged memory per rank (backup to
//! a spill file), and with each rank's shard of the real default model in vmm memory as `tpctl`
//! holds it (weights reloaded from the file, one KV cache discarded), for 1, 2, 4 and 8 rank
//! processes, with a memcpy of the same bytes measured in the same run as the reference for
//! wakeup time per GiB.
//!
//! Run through `cargo xtask bench sleep`, which fetches the model first. Without `RANK` in the
//! environment this program is the launcher: it starts the ranks (copies of itself) for each
//! configuration and prints one JSON object per configuration.
//!
//! `sleep [--ranks 1,2,4,8] [--modes control,memory,model]`; the model is
//! `TPCTL_SLEEP_BENCH_MODEL`, else the default model in the cache. Without one the `model`
//! mode is skipped with a note.

use layers::model::WeightForm;
use layers::parallel::{LoadOptions, ParallelCache, ParallelModel, Placement};
use session::model_memory::{ModelMemory, Restore, ShardOrigin};
use session::sleep::transport::{tcp, CoordinatorLink, Incoming};
use session::sleep::{
    listener, Action, ControlPlane, Coordinator, CoordinatorOptions, Idle, Message, NoMemory,
    OpOptions, OpReceipt, Phase, RankMemory, VmmMemory,
};
use std::path::{Path, PathBuf};
mod common;
use common::{median, memcpy_time, weights_hash};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(120);
/// The modes, in the order they run.
const MODES: [&str; 3] = ["control", "memory", "model"];
/// The model the `model` mode loads (else the default model in the cache).
const MODEL_ENV: &str = "TPCTL_SLEEP_BENCH_MODEL";
/// Tokens of the one KV cache each rank of the `model` mode holds.
const CACHE_TOKENS: usize = 1024;

fn main() {
    if std::env::var_os("RANK").is_some() {
        rank_main();
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let list = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .map(|i| args.get(i + 1).unwrap_or_else(|| panic!("{name} needs a value")).split(','))
    };
    let worlds: Vec<usize> = match list("--ranks") {
        Some(v) => v.map(|s| s.parse().expect("a rank count")).collect(),
        None => vec![1, 2, 4, 8],
    };
    let modes: Vec<&str> = match list("--modes") {
        Some(v) => v
            .map(|m| *MODES.iter().find(|k| **k == m).unwrap_or_else(|| panic!("unknown mode {m}")))
            .collect(),
        None => MODES.to_vec(),
    };
    let model = std::env::var_os(MODEL_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(checkpoint::cache::default_model_path);
    for mode in modes {
        let mut env = Vec::new();
        if mode == "model" {
            let Some(path) = &model else {
                eprintln!(
                    "note: no model for the `model` mode (set {MODEL_ENV} or run `cargo xtask \
                     fetch-model`): skipping it"
                );
                continue;
            };
            env.push((MODEL_ENV, path.display().to_string()));
        }
        for &world in &worlds {
            let mut env = env.clone();
            if let Some(path) = model.as_ref().filter(|_| mode == "model") {
                let (tp, cp) = model_layout(path, world);
                env.push(("TPCTL_SLEEP_BENCH_TP", tp.to_string()));
                env.push(("TPCTL_SLEEP_BENCH_CP", cp.to_string()));
            }
            for line in launch(mode, world, &env) {
                println!("{line}");
            }
        }
    }
}

/// The `tp x cp` mesh of `world` ranks for the model at `path`: TP as wide as its attention
/// heads allow (every rank its own shard where they can be split `world` ways; SmolLM2's 3 KV
/// heads cannot be split 4 or 8 ways), the rest of the world CP (replicated shards).
fn model_layout(path: &Path, world: usize) -> (usize, usize) {
    let file = checkpoint::gguf::GgufFile::open(path).expect("open the model");
    let cfg = checkpoint::LlamaConfig::from_gguf(&file).expect("the model's config");
    let tp = (1..=world)
        .rev()
        .find(|&tp| world.is_multiple_of(tp) && layers::parallel::check_tp(&cfg, tp).is_ok())
        .expect("tp=1 always splits");
    (tp, world / tp)
}

/// Starts `world` ranks and returns rank 0's result lines.
fn launch(mode: &str, world: usize, env: &[(&str, String)]) -> Vec<String> {
    let mut env = env.to_vec();
    env.push(("TPCTL_SLEEP_BENCH_MODE", mode.to_owned()));
    common::launch_ranks(mode, world, &env)
}

/// Median time of one status round trip to every peer in turn (serially).
fn sequential_sweep(link: &tcp::TcpCoordinator) -> f64 {
    let peers = link.peers();
    if peers.is_empty() {
        return 0.0;
    }
    let msg = Message::request(0, Phase::Status, None, &[]);
    let mut v = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        for &p in &peers {
            link.send(p, &msg).expect("send");
            loop {
                match link.recv(Instant::now() + TIMEOUT) {
                    Some(Incoming::Frame { rank, msg })
                        if rank == p && msg.answers(0, Phase::Status) =>
                    {
                        break
                    }
                    Some(Incoming::Frame { .. }) => {}
                    other => panic!("no status ack from rank {p}: {other:?}"),
                }
            }
        }
        v.push(t.elapsed().as_secs_f64());
    }
    median(v)
}

/// One rank's shard of the model in vmm memory, held as `tpctl` holds it: weights reloaded
/// from the file at wakeup, one KV cache whose contents a wakeup discards.
struct ModelShard {
    memory: ModelMemory,
    placement: Placement,
    model: ParallelModel,
    /// Held so its pages are committed and released with the weights.
    _cache: ParallelCache,
    /// [`weights_hash`] before the first sleep.
    hash: u64,
}

impl ModelShard {
    /// Loads the shard of `placement` of the model at `path` into the memory of a host
    /// manager spilling to `spill`.
    fn load(path: &Path, placement: Placement, spill: &Path) -> ModelShard {
        let memory =
            ModelMemory::host(Some(spill.to_path_buf()), Restore::Reload, Restore::Discard)
                .expect("model memory");
        let form = WeightForm::Native;
        let mut model = ParallelModel::load(path, LoadOptions::new(placement).form(form))
            .expect("load the shard");
        let origin = ShardOrigin::checkpoint(path, placement, form);
        memory.place_weights(&mut model, &origin).expect("place the weights");
        let cache = memory.new_cache(&model, CACHE_TOKENS).expect("a KV cache");
        let hash = weights_hash(&model);
        ModelShard { memory, placement, model, _cache: cache, hash }
    }

    /// Fails the rank (a non-zero exit the launcher reports) unless the weights hash as they
    /// did before the first sleep.
    fn verify(&self, rank: usize) {
        let now = weights_hash(&self.model);
        if now != self.hash {
            eprintln!(
                "rank {rank}: the weights after the wakeup differ from those before the sleep \
                 (hash {now:016x}, was {:016x})",
                self.hash
            );
            std::process::exit(1);
        }
    }
}

/// What the cycles of one configuration measured on rank 0.
#[derive(Default)]
struct Cycles {
    sleeps: Vec<f64>,
    wakeups: Vec<f64>,
    /// Rank 0's own wakeup, per GiB of its bytes.
    rank0_wakeups_per_gib: Vec<f64>,
    /// Per sleep: the fewest bytes one rank released.
    min_bytes: Vec<u64>,
    /// Per sleep: the most bytes one rank released.
    max_bytes: Vec<u64>,
    /// Per sleep: the smallest drop of one rank's resident memory, as a fraction of the
    /// bytes that rank released.
    min_drop: Vec<f64>,
    /// The same for the first sleep (a warm-up one), when every byte had been written: a
    /// discarded KV cache comes back untouched, so later sleeps release pages that were not
    /// resident any more.
    first_drop: f64,
}

impl Cycles {
    fn record(&mut self, sleep: &OpReceipt, s: f64, wakeup: &OpReceipt, w: f64) {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        self.sleeps.push(s);
        self.wakeups.push(w);
        let r0 = &wakeup.ranks[0];
        self.rank0_wakeups_per_gib.push(r0.elapsed_us as f64 / 1e6 / gib(r0.bytes()).max(1e-12));
        let bytes = sleep.ranks.iter().map(|r| r.bytes());
        self.min_bytes.push(bytes.clone().min().unwrap_or(0));
        self.max_bytes.push(bytes.max().unwrap_or(0));
        self.min_drop.push(min_drop(sleep));
    }
}

/// The smallest drop of one rank's resident memory in `sleep`, as a fraction of the bytes
/// that rank released.
fn min_drop(sleep: &OpReceipt) -> f64 {
    sleep
        .ranks
        .iter()
        .map(|r| r.probe_delta(Action::Sleep) as f64 / r.bytes().max(1) as f64)
        .fold(f64::INFINITY, f64::min)
}

fn rank_main() {
    let mode = std::env::var("TPCTL_SLEEP_BENCH_MODE").unwrap_or_else(|_| "control".into());
    let mib: usize =
        std::env::var("TPCTL_SLEEP_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    let rv = mesh::Rendezvous::from_env().expect("rendezvous");
    let (_server, store) = mesh::rendezvous_store(&rv, TIMEOUT).expect("store");
    let spill = std::env::temp_dir().join(format!("tpctl-sleep-bench-{}", std::process::id()));
    let mut synthetic = None;
    let mut shard = None;
    let memory: Arc<dyn RankMemory> = match mode.as_str() {
        "memory" => {
            let manager =
                Arc::new(vmm::Manager::builder().spill_dir(&spill).build().expect("manager"));
            let a = manager
                .allocate(
                    vmm::Tag::WEIGHTS,
                    mib << 20,
                    vmm::Policy::Backup(vmm::BackupStore::Spill),
                )
                .expect("allocate");
            a.write().expect("write").fill(1);
            synthetic = Some(a);
            Arc::new(VmmMemory::new(manager, None))
        }
        "model" => {
            let path = PathBuf::from(std::env::var_os(MODEL_ENV).expect("the model's path"));
            let env = |k: &str| -> usize {
                std::env::var(k).ok().and_then(|v| v.parse().ok()).expect("the model's mesh")
            };
            let (tp, cp) = (env("TPCTL_SLEEP_BENCH_TP"), env("TPCTL_SLEEP_BENCH_CP"));
            // TP innermost, as in `mesh::DeviceMesh`: rank = cp_rank * tp + tp_rank.
            let placement = Placement { tp_rank: rv.rank % tp, tp, cp_rank: rv.rank / tp, cp };
            let s = ModelShard::load(&path, placement, &spill);
            let memory = Arc::new(VmmMemory::new(s.memory.manager().clone(), None));
            shard = Some(s);
            memory
        }
        _ => Arc::new(NoMemory),
    };
    let endpoint = tcp::connect(&store, rv.rank, rv.world_size, "127.0.0.1", TIMEOUT)
        .expect("control channel");
    let opts = CoordinatorOptions { ack_timeout: TIMEOUT };
    let plane = match endpoint {
        tcp::Endpoint::Coordinator(link) => {
            // The reference a serial fan-out would cost: one peer at a time, each round trip
            // waited for before the next request goes out.
            let seq = sequential_sweep(&link);
            let c = Coordinator::new(link, memory, Arc::new(Idle), opts);
            (ControlPlane::Coordinator(Box::new(c)), seq)
        }
        tcp::Endpoint::Peer(link) => (
            ControlPlane::Listener(
                listener::spawn(rv.rank, link, memory, Arc::new(Idle)).expect("listener"),
            ),
            0.0,
        ),
    };
    match plane {
        (ControlPlane::Coordinator(c), seq_sweep) => {
            let tags: Vec<String> = match mode.as_str() {
                "model" => vec!["weights".into(), "kv_cache".into()],
                _ => vec!["weights".into()],
            };
            // Each wakeup of the model reloads every shard from the file: a few are enough.
            let (warmup, iters) = match mode.as_str() {
                "memory" => (3, 5),
                "model" => (1, 5),
                _ => (3, 300),
            };
            let mut cycles = Cycles::default();
            for i in 0..warmup + iters {
                let t = Instant::now();
                let sleep = c.sleep(&tags, OpOptions::default()).expect("sleep");
                let s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let wakeup = c.wakeup(&tags, OpOptions::default()).expect("wakeup");
                let w = t.elapsed().as_secs_f64();
                if i == 0 {
                    cycles.first_drop = min_drop(&sleep);
                }
                if i >= warmup {
                    cycles.record(&sleep, s, &wakeup, w);
                }
            }
            let fanout = median(
                (0..if mode == "control" { 300 } else { 20 })
                    .map(|_| {
                        let t = Instant::now();
                        c.status().expect("status");
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            );
            let (s, w) = (median(cycles.sleeps), median(cycles.wakeups));
            let common = format!(
                "\"mode\":\"{mode}\",\"ranks\":{},\"status_fanout_us\":{:.1},\"status_serial_us\":{:.1},\"sleep_us\":{:.1},\"wakeup_us\":{:.1}",
                rv.world_size,
                fanout * 1e6,
                seq_sweep * 1e6,
                s * 1e6,
                w * 1e6
            );
            let line = match mode.as_str() {
                "control" => format!(
                    "{{{common},\"mib_per_rank\":0,\"wakeup_s_per_gib\":0.0000,\"rank0_wakeup_s_per_gib\":0.0000,\"memcpy_s_per_gib\":0.0000}}"
                ),
                _ => {
                    // Per GiB of the largest rank's bytes: ranks restore concurrently, so the
                    // largest one decides the wakeup.
                    let max = cycles.max_bytes.iter().copied().max().unwrap_or(0);
                    let min = cycles.min_bytes.iter().copied().min().unwrap_or(0);
                    let gib = max as f64 / f64::from(1u32 << 30);
                    let memcpy = memcpy_time(max as usize);
                    let mib_per_rank = if mode == "memory" {
                        mib.to_string()
                    } else {
                        format!("{:.1}", max as f64 / f64::from(1u32 << 20))
                    };
                    let layout = match &shard {
                        Some(s) => {
                            format!(",\"layout\":\"{}x{}\"", s.placement.tp, s.placement.cp)
                        }
                        None => String::new(),
                    };
                    format!(
                        "{{{common}{layout},\"mib_per_rank\":{mib_per_rank},\"min_mib_per_rank\":{:.1},\"resident_drop_pct\":{:.1},\"later_resident_drop_pct\":{:.1},\"wakeup_s_per_gib\":{:.4},\"rank0_wakeup_s_per_gib\":{:.4},\"memcpy_s_per_gib\":{:.4}}}",
                        min as f64 / f64::from(1u32 << 20),
                        cycles.first_drop * 100.0,
                        median(cycles.min_drop) * 100.0,
                        w / gib,
                        median(cycles.rank0_wakeups_per_gib),
                        memcpy / gib
                    )
                }
            };
            println!("{line}");
            c.shutdown().expect("shutdown");
            // After the shutdown, so the peers stop cleanly and check their own shards.
            if let Some(s) = &shard {
                s.verify(rv.rank);
            }
        }
        (ControlPlane::Listener(mut h), _) => {
            h.join(Duration::from_secs(600)).expect("listener");
            if let Some(s) = &shard {
                s.verify(rv.rank);
            }
        }
    }
    drop(synthetic);
    drop(shard);
    std::fs::remove_dir_all(&spill).ok();
}
