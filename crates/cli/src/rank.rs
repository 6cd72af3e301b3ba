//! A rank process (`tpctl __rank`, started by the launcher): joins the world, loads its shard
//! and runs the session engine. Rank 0 tokenizes, prints and summarizes; workers print nothing
//! but their errors. With a serve spec rank 0 serves HTTP instead ([`crate::serve`]).

use crate::config::{ComputeDevice, RestoreMode};
use crate::exit::{abandon, exit_failed, stop_on_signal};
use crate::output::{summary, Meter, Printer, PromptInfo, RunClock};
use crate::spec::{OutputFormat, RankSpec};
use anyhow::{Context, Result};
use collectives::{init_parallel_with, InitOptions};
use layers::model::WeightForm;
use session::model_memory::{ModelMemory, ModelRankMemory, Restore};
use session::sharded::ShardedFactory;
use session::sleep::{
    self, ControlPlane, Coordinator, CoordinatorOptions, DeploymentState, ListenerExit,
    ListenerHandle,
};
use session::{
    Decision, EngineOptions, Gate, Leader, Request, SamplingParams, SessionConfig, SessionReport,
    StopHandle, Worker,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tensor::kernels::Backend;

/// Runs this rank of the job described by `TPCTL_RANK_SPEC`.
///
/// # Errors
/// Any failure of this rank; a peer's failure surfaces as "another rank failed".
pub fn run() -> Result<()> {
    crate::launcher::watch_launcher();
    let spec = RankSpec::from_env()?;
    let config = checkpoint::Checkpoint::open(&spec.model)
        .and_then(|ck| ck.config())
        .with_context(|| format!("opening {}", spec.model.display()))?;
    let backends = spec.backends;
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let rv = mesh::Rendezvous::from_env()?;
    let compute = compute_backend(&spec, &rv)?;
    // NCCL groups live on this rank's GPU; every other backend stages through the host.
    let uses_nccl = [backends.tp, backends.cp].contains(&mesh::CommBackend::Nccl);
    let opts = InitOptions {
        tp: Some(spec.tp),
        head_groups: layers::parallel::mesh_head_groups(&config, Some(spec.tp)),
        backends,
        timeout,
        device: mesh::Device::select(&rv, uses_nccl).context("choosing this rank's device")?,
        ..InitOptions::default()
    };
    let ctx = init_parallel_with(rv, &opts).context("joining the other ranks")?;
    let memory = model_memory(&spec, &compute)?;
    let form = if spec.native_weights { WeightForm::Native } else { WeightForm::F32 };
    let factory = ShardedFactory::new(spec.threads)
        .with_weights(form)
        .with_context(spec.kv_cache_tokens)
        .with_kv_cache(spec.kv_cache)
        .with_memory(memory.clone())
        .with_backend(compute.clone())
        .with_progress(Arc::new(crate::progress::report));
    let engine = EngineOptions { step_timeout: timeout, ..EngineOptions::default() };
    let gate = Gate::for_rank(ctx.rank(), engine.quiesce_timeout);
    gate.set_lossy(memory.lossy_tags());
    let rank_memory =
        Arc::new(ModelRankMemory::new(&memory, compute).with_communicators(ctx.device_resources()));
    let plane = control_plane(&ctx, rank_memory, gate.clone(), timeout)?;
    let model = spec.model.to_string_lossy().into_owned();
    let coordinator: Arc<Coordinator> = match plane {
        ControlPlane::Coordinator(c) => Arc::from(c),
        ControlPlane::Listener(listener) => {
            let mut worker = Worker::new(ctx, Box::new(factory), engine)?.with_gate(gate);
            stop_on_signal(worker.stop_handle());
            let watch = watch_listener(listener, worker.stop_handle());
            let ran = worker.run();
            watch.engine_done.store(true, Ordering::SeqCst);
            // A failed rank reports at once: it waits neither for rank 0's shutdown nor for
            // its own teardown.
            if let Err(e) = ran {
                exit_failed(&e.into(), None);
            }
            let exit = watch.thread.join().unwrap_or(Ok(ListenerExit::Shutdown));
            if let Err(e @ sleep::Error::FailStop { .. }) = exit {
                return Err(e).context("the deployment was stopped by a failed sleep/wakeup");
            }
            return Ok(());
        }
    };
    let stop = StopHandle::default();
    // One handle for the control socket and the HTTP API: one journal of what they did.
    let controller = crate::control::Controller::new(coordinator.clone())
        .with_live_config(config.clone())
        .with_checkpoint(&model);
    let control = control_socket(&spec, &controller, &stop)?;
    let watch = watch_coordinator(&coordinator, &stop);
    let ran = lead(&spec, ctx, factory, engine, gate, stop, model, &config, &controller);
    watch.engine_done.store(true, Ordering::SeqCst);
    if let Err(e) = ran {
        exit_failed(&e, control);
    }
    drop(control);
    if let Ok(Some(reason)) = watch.thread.join() {
        anyhow::bail!("the deployment was stopped by a failed sleep/wakeup: {reason}");
    }
    if let Err(e) = coordinator.shutdown() {
        tracing::debug!("control plane shutdown: {e}");
    }
    Ok(())
}

/// A worker's control listener, watched while the engine runs.
struct ListenerWatch {
    engine_done: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<sleep::Result<ListenerExit>>,
}

/// Watches the listener: when it ends while the engine still runs (rank 0 stopped the
/// deployment after a failed rollback, or rank 0 is gone), the engine stops at its next step
/// boundary on every rank. Once the engine is done, waits a little for rank 0's shutdown.
fn watch_listener(mut listener: ListenerHandle, stop: StopHandle) -> ListenerWatch {
    let engine_done = Arc::new(AtomicBool::new(false));
    let done = engine_done.clone();
    let thread = std::thread::spawn(move || loop {
        if listener.is_finished() {
            let exit = listener.join(Duration::ZERO);
            if !done.load(Ordering::SeqCst) {
                tracing::error!("sleep/wakeup control listener ended: {exit:?}");
                stop.request_stop();
            }
            return exit;
        }
        if done.load(Ordering::SeqCst) {
            // Rank 0 sends its shutdown when it leaves; a lost rank 0 closes the channel.
            return listener.join(Duration::from_secs(5));
        }
        std::thread::sleep(Duration::from_millis(50));
    });
    ListenerWatch { engine_done, thread }
}

/// Rank 0's coordinator, watched while the engine runs.
struct CoordinatorWatch {
    engine_done: Arc<AtomicBool>,
    /// Why the watch stopped the engine, if it did.
    thread: std::thread::JoinHandle<Option<String>>,
}

/// Stops rank 0's engine (and so every rank) when the coordinator fails the deployment while
/// the engine runs (a rollback failed, or a rank was lost: no rank may run on half-restored
/// memory). A peer that leaves after the engine finished is no failure.
fn watch_coordinator(coordinator: &Arc<Coordinator>, stop: &StopHandle) -> CoordinatorWatch {
    let engine_done = Arc::new(AtomicBool::new(false));
    let (coordinator, stop, done) = (coordinator.clone(), stop.clone(), engine_done.clone());
    let thread = std::thread::spawn(move || {
        while !done.load(Ordering::SeqCst) {
            if let DeploymentState::Failed(reason) = coordinator.state() {
                tracing::error!("the deployment failed: {reason}; stopping every rank");
                stop.request_stop();
                return Some(reason);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    });
    CoordinatorWatch { engine_done, thread }
}

/// Rank 0's part once the control plane runs: serve HTTP, or run the prompts.
#[allow(clippy::too_many_arguments)]
fn lead(
    spec: &RankSpec,
    ctx: collectives::ParallelContext,
    factory: ShardedFactory,
    engine: EngineOptions,
    gate: Arc<Gate>,
    stop: StopHandle,
    model: String,
    config: &checkpoint::LlamaConfig,
    controller: &crate::control::Controller,
) -> Result<()> {
    // One tokenizer on rank 0: prompts are encoded and output decoded with the same one.
    let mut tokenizer = text::Tokenizer::load(&spec.model).context("building the tokenizer")?;
    if let Some(template) = &spec.chat_template {
        tokenizer = tokenizer.with_chat_template(template.clone());
    }
    let tokenizer = Arc::new(tokenizer);
    let mut factory = factory.with_tokenizer(tokenizer.clone());
    if let Some(serve) = &spec.serve {
        // Structured outputs: one grammar engine for the HTTP checks and the sampler.
        let grammars = match text::GrammarEngine::new(&tokenizer) {
            Ok(engine) => Some(engine),
            Err(e) => {
                eprintln!("warning: structured outputs are not available: {e}");
                None
            }
        };
        if let Some(engine) = &grammars {
            factory = factory.with_grammars(engine.clone());
        }
        let compute = factory.backend().cloned();
        let factory = Box::new(factory);
        let rank0 = crate::serve::Rank0 {
            ctx,
            factory,
            tokenizer,
            engine,
            model,
            config,
            context_tokens: spec.kv_cache_tokens,
            max_num_seqs: spec.max_num_seqs,
            gate,
            stop,
            control: Some(controller.clone()),
            grammars,
            compute,
        };
        return crate::serve::run(rank0, serve);
    }

    let mut prompts = Vec::with_capacity(spec.prompts.len());
    for (i, p) in spec.prompts.iter().enumerate() {
        let ids = match &p.ids {
            Some(ids) => ids.clone(),
            None if p.chat => tokenizer.encode(
                &tokenizer.apply_chat_template(&[text::ChatMessage::new("user", &p.text)], true)?,
            )?,
            None => tokenizer.encode(&p.text)?,
        };
        if ids.is_empty() {
            anyhow::bail!("prompt {i} ({:?}) encodes to no tokens", p.text);
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= config.vocab_size) {
            anyhow::bail!(
                "prompt {i}: token id {bad} is outside the vocabulary of {}",
                config.vocab_size
            );
        }
        prompts.push(PromptInfo { text: p.text.clone(), ids });
    }
    let s = &spec.sampling;
    let requests: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                max_tokens: s.max_tokens,
                temperature: s.temperature,
                top_k: s.top_k,
                top_p: s.top_p,
                seed: s.seed.wrapping_add(i as u64),
                ..SamplingParams::default()
            };
            Request::tokens(i as u64, p.ids.clone(), params)
        })
        .collect();
    let clock = Arc::new(Mutex::new(RunClock::default()));
    let meter = factory.backend().map_or_else(Meter::default, Meter::with_backend);
    let max_tokens = spec.sampling.max_tokens as usize;
    let printer = Printer::new(spec.output, prompts, tokenizer, max_tokens, clock.clone());
    let mut leader =
        Leader::new(ctx, Box::new(factory), Box::new(printer), Box::new(meter.clone()), engine)?
            .with_gate(gate)
            .with_stop(stop);
    stop_on_signal(leader.stop_handle());
    let start = Instant::now();
    let mut stop = |_: &SessionReport| Decision::Stop;
    let session = SessionConfig { max_batch: spec.max_num_seqs, ..SessionConfig::new(model) };
    if let Err(e) = leader.run(session, requests, &mut stop) {
        abandon(leader);
        return Err(e.into());
    }
    let totals = *meter.totals.lock().unwrap_or_else(|e| e.into_inner());
    let clock = *clock.lock().unwrap_or_else(|e| e.into_inner());
    let line = summary(&totals, &clock, start.elapsed());
    match spec.output {
        OutputFormat::Text => println!("-- {line}"),
        OutputFormat::Jsonl => eprintln!("{line}"),
    }
    Ok(())
}

/// The restore policy of `tag` per the spec, else its default.
fn restore(spec: &RankSpec, tag: &str, default: Restore) -> Restore {
    spec.sleep.get(tag).map_or(default, |p| match p.restore {
        RestoreMode::Discard => Restore::Discard,
        RestoreMode::Zero => Restore::Zero,
        RestoreMode::Backup => Restore::Backup,
        RestoreMode::Reload => Restore::Reload,
    })
}

/// The kernels of this rank: the CPU with the spec's threads, or a GPU: that of its
/// `LOCAL_RANK`, wrapping around when a node has more ranks than GPUs (ranks then share a GPU;
/// their collectives stage through host memory anyway unless an axis uses NCCL).
fn compute_backend(spec: &RankSpec, rv: &mesh::Rendezvous) -> Result<Backend> {
    match spec.device {
        ComputeDevice::Cpu => Backend::cpu(spec.threads).context("starting the CPU kernels"),
        ComputeDevice::Cuda => {
            use mesh::CudaProbe;
            let count = mesh::DriverProbe.device_count().context("counting the GPUs")?;
            if count == 0 {
                anyhow::bail!("--device cuda: this machine has no CUDA device");
            }
            let ordinal = rv.local_rank.unwrap_or(0) % count;
            let backend = Backend::cuda_with(ordinal, spec.dtype.into())
                .with_context(|| format!("starting the CUDA kernels on cuda:{ordinal}"))?;
            backend.set_graphs(!spec.enforce_eager);
            Ok(backend)
        }
    }
}

/// Where this rank's weights and KV caches live: host memory the deployment can sleep, plus
/// the GPU's memory (KV caches, device copies of the weights) when the kernels run there.
fn model_memory(spec: &RankSpec, compute: &Backend) -> Result<ModelMemory> {
    let spill = spec.sleep.values().find_map(|p| p.spill_dir.clone());
    let memory = ModelMemory::host(
        spill,
        restore(spec, vmm::Tag::WEIGHTS.as_str(), Restore::Reload),
        restore(spec, vmm::Tag::KV_CACHE.as_str(), Restore::Discard),
    )
    .context("sleep policy")?;
    // Sleep level 1 keeps the weights' contents, unless their restore is configured.
    let level_one = !spec.sleep.contains_key(vmm::Tag::WEIGHTS.as_str());
    let memory = memory.with_level_one_weights(level_one).with_threads(spec.threads);
    if spec.preallocate_sleep_memory && level_one {
        // The pool grows as the weights are allocated, by what their level-1 backup takes
        // in host memory: nothing where it goes to a spill file (this host manager's default
        // store). The device manager's weights are device copies that a sleep discards, not
        // backs up, so it has nothing to preallocate.
        memory
            .manager()
            .preallocate_host_backups([vmm::Tag::WEIGHTS])
            .context("--preallocate-sleep-memory")?;
    }
    match compute.device() {
        tensor::Device::Cuda(ordinal) => Ok(memory.with_device(ordinal)?),
        _ => Ok(memory),
    }
}

/// Starts this rank's end of the sleep/wakeup control plane, collectively, before any engine
/// runs: rank 0's coordinator, a listener thread elsewhere.
fn control_plane(
    ctx: &collectives::ParallelContext,
    rank_memory: Arc<ModelRankMemory>,
    gate: Arc<Gate>,
    timeout: Duration,
) -> Result<ControlPlane> {
    let opts = CoordinatorOptions { ack_timeout: timeout };
    let Some(world) = ctx.world() else {
        // One rank: a coordinator without peers.
        let (link, _) = sleep::transport::memory::world(1, Default::default());
        let coordinator = Coordinator::new(link, rank_memory, gate, opts);
        return Ok(ControlPlane::Coordinator(Box::new(coordinator)));
    };
    let rv = world.rendezvous();
    let host = if rv.single_host() { "127.0.0.1" } else { rv.master_addr.as_str() };
    sleep::start(world.store(), rv.rank, rv.world_size, host, rank_memory, gate, opts, timeout)
        .context("starting the sleep/wakeup control plane")
}

/// Rank 0's control socket for `tpctl sleep / wakeup / status / stop`, when the spec names
/// one. `stop` stops the engine at its next step boundary.
fn control_socket(
    spec: &RankSpec,
    controller: &crate::control::Controller,
    stop: &StopHandle,
) -> Result<Option<crate::control::Server>> {
    let Some(path) = &spec.control_socket else { return Ok(None) };
    let stop = stop.clone();
    let server = crate::control::Server::start(
        path,
        controller.clone(),
        Arc::new(move || stop.request_stop()),
    )
    .with_context(|| format!("control socket {}", path.display()))?;
    Ok(Some(server))
}
