//! `tpctl`: launch tensor/context-parallel LLM jobs on this machine (or several), and manage
//! the models they run.
#![forbid(unsafe_code)]

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tpctl::config::{self, ComputeDevice, ComputeDtype, Config, LaunchFlags, WeightsForm};
use tpctl::control::{self, paths, render};
use tpctl::launcher::{self, Launch, Outcome};
use tpctl::spec::{OutputFormat, PromptSpec, RankSpec, Sampling, ServeSpec};

/// The prompt used when none is given.
const DEMO_PROMPT: &str =
    "Explain in two sentences why large language models are split across several GPUs.";

#[derive(Parser, Debug)]
#[command(name = "tpctl", version, about = "Tensor- and context-parallel LLM inference, on CPU or GPU", long_about = None)]
struct Cli {
    /// More logging (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Errors only: no logs or progress, and `sleep`, `wakeup`, `reload` print no receipt
    /// (their exit code tells; `--json` still prints the reply).
    #[arg(short, long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Launch the rank processes, run the prompts, stream rank 0's text and a summary.
    ///
    /// Example: tpctl run --tp 2 --cp 2 examples/smollm2.toml --prompt "The capital of France is"
    Run(Box<RunArgs>),
    /// Launch the rank processes and serve an OpenAI-style HTTP API from rank 0.
    ///
    /// Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true
    /// for SSE), GET /v1/models, /v1/models/{id}, /health, /metrics (vLLM's metric names,
    /// labelled model_name, and tpctl_* for what only tpctl has); vLLM's POST /tokenize,
    /// /detokenize, GET /version; vLLM-style POST /sleep?level=1&tags=.., POST
    /// /wake_up?tags=.., GET /is_sleeping, POST /update_weights?model=..&weight_version=..,
    /// POST /pause?mode=abort|wait|keep, POST /resume, GET /is_paused, GET
    /// /get_weight_version; an RL trainer's update from memory: POST /start_weight_update,
    /// POST /update_weights with {"update_info": {"path": "/dev/shm/BUCKET.safetensors"}} per
    /// bucket (or, from a trainer's GPU, {"update_info": {"names", "dtype_names", "shapes",
    /// "ipc_handles"}} with CUDA IPC handles; a build with the cuda feature), POST
    /// /finish_weight_update (or /abort_weight_update). Every answer carries the
    /// weights' version (`weight_version` and `system_fingerprint`). Ctrl-C (or `tpctl stop`)
    /// stops every rank.
    ///
    /// Completions take a list of prompts (strings or token-id lists; n choices each); the
    /// prompt's log-probabilities come with "echo" and "logprobs" ("max_tokens": 0 answers
    /// the prompt alone) and with vLLM's "prompt_logprobs" (not streamed).
    ///
    /// Structured outputs: "response_format" ({"type": "json_object"} or "json_schema"),
    /// vLLM's "guided_json", "guided_regex", "guided_choice", "guided_grammar" (Lark) and
    /// "structured_outputs"; "tool_choice": "required" or a named function makes a chat's
    /// answer a call of its tools.
    ///
    /// Several models: `--model NAME=PATH` repeated serves them from one endpoint, routed by
    /// the request's `model` (GET /v1/models lists each with its state and resident bytes).
    /// Each is a deployment of its own (HOST-NAME) with the shared launch flags; they are
    /// swapped by sleep/wakeup within --memory-budget: a request for a sleeping model wakes
    /// it after the least recently used idle models slept to make room.
    ///
    /// Example: tpctl serve --tp 2 --listen 127.0.0.1:8000 --deployment chat
    ///
    /// Example: tpctl serve --model a=/models/a.gguf --model b=/models/b.gguf --memory-budget 8GiB
    Serve(Box<ServeArgs>),
    /// Put a running deployment to sleep: release the memory of the given tags on every rank.
    ///
    /// Prints a receipt per rank and tag (device, bytes released, memory probe before ->
    /// after, time, restore) and a total. Without `--level` each tag comes back per its
    /// `[sleep.TAG] restore` (defaults: weights reloaded from the checkpoint, kv_cache
    /// discarded). `--level` is vLLM's: 1 keeps the weights' contents for a fast wakeup (in a
    /// spill file of the ranks' host weights, on a GPU too, whose device copies are dropped),
    /// 2 discards them and reloads them from
    /// the checkpoint; the KV cache is discarded at both, and a tag with its own `[sleep.TAG]
    /// restore` keeps it. What the runtime holds on a GPU (cuda_graph, workspace, nccl) has no
    /// contents to keep: graphs and workspaces are made again by the steps after the wakeup,
    /// NCCL communicators by the wakeup (restore recapture, replan, reconnect); a rank that
    /// holds none of them (a CPU rank) reports "nothing held". Exits 1, naming every failing
    /// rank, when the sleep or its verification fails (the deployment is rolled back).
    ///
    /// Example: tpctl sleep --deployment chat --tags kv_cache,weights --mode wait --verify
    Sleep(SleepArgs),
    /// Wake a sleeping deployment: materialize the given tags (default: every tag asleep
    /// when the wakeup's turn comes; the last tags of memory asleep bring the runtime's with
    /// them) on every rank and restore them per their policy.
    ///
    /// After a sleep that discarded the weights (`--level 2`), `--model PATH` wakes them from
    /// another checkpoint of the same shapes (as `tpctl reload` then `tpctl wakeup`, in one
    /// operation: no other sleep or reload runs between them).
    ///
    /// Example: tpctl wakeup --deployment chat --tags weights
    Wakeup(WakeupArgs),
    /// Replace a running deployment's weights with another checkpoint of the same model
    /// (same architecture and shapes: a fine-tuned or re-trained copy), on every rank.
    ///
    /// Works asleep (the wakeup then loads the new checkpoint) or awake (the engine quiesces
    /// per `--mode` first; paused requests continue, computed again with the new weights).
    /// Two-phase: every rank loads and checks its shard first, and any failure leaves the old
    /// weights everywhere. Exits 1, naming every failing rank, when it fails.
    ///
    /// The new weights get the version `--weight-version` (default: the count of updates),
    /// which every answer carries from then on (`weight_version`, `system_fingerprint`).
    ///
    /// `--tensors FILE` (repeatable) updates from memory instead: safetensors files of named
    /// tensors (Hugging Face or GGUF names, the model's shapes, f32/f16/bf16; e.g. what a
    /// trainer wrote to /dev/shm) laid over the live weights, all committed at once (the
    /// control socket's start_weight_update, weight_bucket per file, finish_weight_update).
    ///
    /// Example: tpctl reload --deployment chat --model /ckpt/step-2000.gguf --weight-version 2000
    Reload(ReloadArgs),
    /// Pause generation without releasing memory (vLLM's `/pause`), e.g. while an RL trainer
    /// pushes new weights: `--mode abort` (default) ends the running requests, `wait` lets them
    /// finish, `keep` freezes them with their KV cache until `tpctl resume`. New requests wait.
    /// Sleeps, wakeups and reloads run while paused and leave it paused.
    ///
    /// Example: tpctl pause --deployment chat --mode keep
    Pause(PauseArgs),
    /// Resume generation after `tpctl pause`.
    ///
    /// Example: tpctl resume --deployment chat
    Resume(TargetArgs),
    /// Show a deployment's state and, per rank, the tags asleep and the memory in use; for a
    /// model host (`tpctl serve` with several models), its table: each model's state,
    /// resident bytes, live checkpoint, requests in flight and queued. With no --deployment,
    /// a host and its models count as one deployment.
    ///
    /// Example: tpctl status --deployment chat
    Status(TargetArgs),
    /// Start a failed model of a model host again, without stopping the server (a request
    /// for it does so too, once): --deployment is the model's, HOST-NAME.
    ///
    /// Example: tpctl restart --deployment chat-b
    Restart(TargetArgs),
    /// Stop a running deployment (every rank), as Ctrl-C on its launcher would.
    ///
    /// Example: tpctl stop --deployment chat
    Stop(TargetArgs),
    /// Download a catalog model into the cache (once) and print its path.
    ///
    /// Example: tpctl fetch smollm2-135m-instruct
    Fetch {
        /// Catalog name.
        #[arg(default_value = "smollm2-135m-instruct")]
        model: String,
    },
    /// List the catalog and what is cached.
    ///
    /// Example: tpctl models
    Models,
    /// Check this machine's GPU path before a run: opens each visible CUDA device as a rank
    /// would (driver, NVRTC compiling the kernels, cuBLAS), prints its name, compute
    /// capability, memory, UUID and the driver's CUDA version, whether NVML lists this process
    /// there (what sleep receipts read), and the NCCL version. Exits 1 when something blocks
    /// computing on the GPU, naming it.
    ///
    /// Example: CUDA_VISIBLE_DEVICES=1 tpctl doctor
    Doctor {
        /// Only this CUDA ordinal (default: every visible device).
        #[arg(long, value_name = "N")]
        device: Option<usize>,
    },
    /// One rank of a job (started by `tpctl run` or `tpctl serve`; reads TPCTL_RANK_SPEC).
    #[command(name = "__rank", hide = true)]
    Rank,
    /// A process mpirun started for the mpi backend: runs `tpctl ARGS` as its rank.
    #[command(name = "__mpirun-rank", hide = true)]
    MpirunRank {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

/// What `tpctl run` and `tpctl serve` share: the model, the layout, the nodes, the runtime.
#[derive(Args, Debug)]
struct LaunchArgs {
    /// Config file (TOML, see examples/); flags override it.
    config: Option<PathBuf>,
    /// Tensor-parallel ranks (split heads and MLP).
    #[arg(long)]
    tp: Option<usize>,
    /// Context-parallel ranks (split tokens and the KV cache).
    #[arg(long)]
    cp: Option<usize>,
    /// Catalog name, path of a GGUF file (the first part of a split one), a Hugging Face
    /// folder (config.json, *.safetensors in F32/F16/BF16, tokenizer.json), or a Hugging Face
    /// id (org/name) in the local Hugging Face cache. `serve` takes several as NAME=PATH
    /// (repeat the flag): a model host that routes requests by their `model` and swaps the
    /// models by sleep/wakeup under --memory-budget
    #[arg(long, value_name = "MODEL")]
    model: Vec<String>,
    /// Compute threads per rank (default: cores / ranks on this node).
    #[arg(long)]
    threads: Option<usize>,
    /// The most tokens of one sequence, prompt and generated (vLLM's name; default:
    /// [runtime] kv_cache_tokens, else 4096).
    #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    max_model_len: Option<u32>,
    /// Each rank's KV pool, shared by all requests: bytes (4GiB, 512MiB, 1073741824) or a
    /// fraction of the memory available at launch, split over this node's ranks (0.2).
    /// Default: [runtime] kv_cache_memory, else room for 2 sequences of max-model-len tokens,
    /// at most a tenth of the available memory. Requests wait when it is full.
    #[arg(long, value_name = "SIZE")]
    kv_cache_memory: Option<config::KvMemory>,
    /// The most requests in one step (default: [runtime] max_num_seqs, else 32).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_num_seqs: Option<u32>,
    /// Do not reuse the KV blocks of earlier prompts that start the same way (prefix caching
    /// is on by default, except with context parallelism and for models with sliding-window
    /// layers such as Gemma 2 and 3).
    #[arg(long)]
    no_prefix_caching: bool,
    /// Allocate at start, not at the first sleep, the host memory that level-1 sleeps back
    /// device-resident weights up into (pinned), and keep it across sleeps (default: [runtime]
    /// preallocate_sleep_memory). Today a level-1 sleep writes the weights to a spill file, on
    /// the CPU and on a GPU alike, which needs no such memory: the flag reserves nothing yet.
    #[arg(long)]
    preallocate_sleep_memory: bool,
    /// Run every step eagerly (default: [runtime] enforce_eager, else false). On a GPU, decode
    /// steps that repeat their shape are otherwise captured as CUDA graphs and replayed with
    /// one launch each; a shape whose capture fails runs eagerly, with a log line.
    #[arg(long)]
    enforce_eager: bool,
    /// Where the kernels run (default: [runtime] device, else cpu); cuda needs a build with
    /// `--features cuda` and puts each rank on the GPU of its LOCAL_RANK.
    #[arg(long, value_enum)]
    device: Option<ComputeDevice>,
    /// Element type of the weight matrices on the GPU (default: [runtime] dtype, else bf16 on
    /// the GPU and f32 on the CPU); bf16 and f16 halve their device memory and need --device
    /// cuda.
    #[arg(long, value_enum)]
    dtype: Option<ComputeDtype>,
    /// Backend of every axis: shm (one host), tcp (any hosts), mpi (OpenMPI; the ranks are
    /// started by one mpirun on this host; needs a build with `--features mpi`) or nccl
    /// (GPUs; the control axis then stays on shm or tcp).
    #[arg(long)]
    backend: Option<mesh::CommBackend>,
    #[command(flatten)]
    nodes: NodeArgs,
    /// The deployment's name, for `tpctl sleep / wakeup / status / stop --deployment NAME`
    /// (default: tpctl-PID, unique to this launch).
    #[arg(long, value_name = "NAME")]
    deployment: Option<String>,
    /// A Jinja chat template to use instead of the model's (rendered as Hugging Face renders
    /// templates: trim_blocks, lstrip_blocks, Python string methods, tojson, strftime_now).
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
}

impl LaunchArgs {
    /// The flags the config file's settings give way to.
    fn flags(&self) -> LaunchFlags {
        LaunchFlags {
            tp: self.tp,
            cp: self.cp,
            model: self.model.first().cloned(),
            threads: self.threads,
            max_model_len: self.max_model_len,
            device: self.device,
            dtype: self.dtype,
            backend: self.backend,
            kv_cache_memory: self.kv_cache_memory,
            max_num_seqs: self.max_num_seqs,
            no_prefix_caching: self.no_prefix_caching,
            preallocate_sleep_memory: self.preallocate_sleep_memory,
            enforce_eager: self.enforce_eager,
            nnodes: self.nodes.nnodes,
            node_rank: self.nodes.node_rank,
        }
    }
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    launch: LaunchArgs,
    /// A prompt (repeat for a batch). Without any, prompts are read from standard input
    /// (one per line) when it is not a terminal; with none there either, a demo prompt runs.
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    /// A prompt as token ids, comma-separated (repeat for a batch), bypassing the tokenizer.
    #[arg(long = "prompt-ids", value_name = "IDS")]
    prompt_ids: Vec<String>,
    /// A file with one prompt per line.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Tokens to generate per prompt.
    #[arg(long)]
    max_tokens: Option<u32>,
    /// Sampling temperature (0: greedy).
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep the k most likely tokens (0: all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Random seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Wrap each prompt in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
}

/// Where this launcher's ranks sit in a job of several nodes (torchrun conventions). Inside
/// Slurm or mpirun the ranks take their place from those launchers' environment instead.
#[derive(Args, Debug, Clone)]
struct NodeArgs {
    /// Nodes in the job; each runs `tpctl` with the same layout and its own --node-rank.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host of rank 0 (reachable from every node).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of rank 0's store (default: a free one on a single node).
    #[arg(long)]
    master_port: Option<u16>,
}

#[derive(Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    launch: LaunchArgs,
    /// Address of the HTTP API (default 127.0.0.1:8000, or [server] listen; port 0 picks a
    /// free one). Beyond loopback it needs an API key.
    #[arg(long, conflicts_with_all = ["host", "port"])]
    listen: Option<String>,
    /// The HTTP API's host, as vLLM names it (with --port; default: that of --listen's
    /// default or [server] listen).
    #[arg(long)]
    host: Option<String>,
    /// The HTTP API's port, as vLLM names it (with --host).
    #[arg(long)]
    port: Option<u16>,
    /// Require `Authorization: Bearer KEY` on every request but /health.
    #[arg(long, env = tpctl::spec::API_KEY_ENV, hide_env_values = true)]
    api_key: Option<String>,
    /// The model's name in the API (`/v1/models`, requests' `model` field); default: the
    /// `--model` as given, or the config's.
    #[arg(long, value_name = "NAME")]
    served_model_name: Option<String>,
    /// With several models: the memory they share, as a share of the host's memory (0.9) or
    /// bytes (8GiB); models on GPUs are held to it on each GPU apart as well (that share of
    /// the GPU's memory as NVML reads it, or those bytes). A request for a sleeping model wakes it, after the least recently used
    /// idle models slept to make room (default: 0.9). Each model is measured at start (loaded,
    /// `loading` until then, and put to sleep at its level); a budget that cannot hold one of
    /// them is refused. A model with requests running sleeps once they finished, or after
    /// [server] drain_timeout seconds (default 5) with them paused (keep), to continue when it
    /// wakes again. A level-1 sleep whose backup host memory (MemAvailable) cannot hold is a
    /// level-2 one.
    #[arg(long, value_name = "SIZE")]
    memory_budget: Option<tpctl::host::table::MemoryBudget>,
}

/// Which deployment a control command talks to, and how.
#[derive(Args, Debug)]
struct TargetArgs {
    /// The deployment's name, as given to `tpctl serve/run --deployment` (default: the only
    /// running deployment of this user).
    #[arg(long, value_name = "NAME", conflicts_with = "socket")]
    deployment: Option<String>,
    /// The control socket's path (instead of a name).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// How long to wait for the reply, seconds.
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    timeout: f64,
    /// Print the reply as JSON (one line) instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct SleepArgs {
    /// Memory tags to release, comma-separated: weights, kv_cache, cuda_graph (the CUDA graphs
    /// of decode steps), workspace (step buffers and pooled temporaries on a GPU) and nccl (the
    /// NCCL communicators, made again at the wakeup); default: all of them.
    #[arg(long, value_delimiter = ',', value_name = "TAGS")]
    tags: Vec<String>,
    /// vLLM's sleep level: 1 keeps the weights' contents for a fast wakeup, 2 reloads them
    /// from the checkpoint (default: each tag's `[sleep.TAG] restore`).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    level: Option<u8>,
    /// Running requests: `wait` for them to finish, `abort` them, or `keep` them paused until
    /// the wakeup.
    #[arg(long, value_enum, default_value_t = Mode::Wait)]
    mode: Mode,
    /// Fail (and roll back) when some rank's memory probe does not drop by at least 90% of
    /// the bytes it released (less 1 MiB of measurement noise).
    #[arg(long)]
    verify: bool,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "tensors"])))]
struct ReloadArgs {
    /// The checkpoint to load: a GGUF file or a Hugging Face folder, as the ranks see it.
    #[arg(long, value_name = "PATH")]
    model: Option<String>,
    /// A safetensors file of tensors to lay over the live weights (repeat for several; a
    /// later file wins).
    #[arg(long, value_name = "FILE")]
    tensors: Vec<String>,
    /// Running requests: `wait` for them to finish, `abort` them, or `keep` them paused and
    /// continue them (recomputed) with the new weights.
    #[arg(long, value_enum, default_value_t = Mode::Wait)]
    mode: Mode,
    /// The new weights' version, which answers carry (default: the count of updates).
    #[arg(long, value_name = "VERSION")]
    weight_version: Option<String>,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(Args, Debug)]
struct PauseArgs {
    /// Running requests: `abort` them (their answers end with what they have), `wait` for
    /// them to finish, or `keep` them frozen until `tpctl resume`.
    #[arg(long, value_enum, default_value_t = Mode::Abort)]
    mode: Mode,
    #[command(flatten)]
    target: TargetArgs,
}

#[derive(Args, Debug)]
struct WakeupArgs {
    /// Memory tags to restore, comma-separated (default: every tag asleep).
    #[arg(long, value_delimiter = ',', value_name = "TAGS")]
    tags: Vec<String>,
    /// Load the weights from this checkpoint (a GGUF file or a Hugging Face folder of the
    /// same shapes) instead of the live one; only while the weights are asleep.
    #[arg(long, value_name = "PATH")]
    model: Option<String>,
    #[command(flatten)]
    target: TargetArgs,
}

/// What a sleep does to running requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    /// Let them finish, admit no new ones.
    Wait,
    /// Fail them.
    Abort,
    /// Pause them until the wakeup.
    Keep,
}

impl From<Mode> for session::sleep::QuiesceMode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Wait => session::sleep::QuiesceMode::Wait,
            Mode::Abort => session::sleep::QuiesceMode::Abort,
            Mode::Keep => session::sleep::QuiesceMode::Keep,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose, cli.quiet);
    let result = match cli.command {
        Command::Run(args) if args.launch.model.len() > 1 => Err(anyhow::anyhow!(
            "`tpctl run` runs one model: give one --model (`tpctl serve` serves several)"
        )),
        Command::Run(args) => run(*args, None, cli.verbose, cli.quiet),
        Command::Serve(args) => serve(*args, cli.verbose, cli.quiet),
        Command::Fetch { model } => tpctl::fetch::fetch(&model),
        Command::Models => tpctl::fetch::list(),
        Command::Doctor { device } => Ok(tpctl::doctor::run(device)),
        Command::Sleep(args) => {
            let request = control::Request::Sleep(control::SleepArgs {
                tags: args.tags,
                level: args.level,
                mode: args.mode.into(),
                verify: args.verify,
            });
            control_command(&args.target, &request, cli.quiet)
        }
        Command::Reload(args) => reload(args, cli.quiet),
        Command::Pause(args) => {
            let request = control::Request::Pause(control::PauseArgs { mode: args.mode.into() });
            control_command(&args.target, &request, cli.quiet)
        }
        Command::Resume(target) => control_command(&target, &control::Request::Resume, cli.quiet),
        Command::Wakeup(args) => {
            let request = control::Request::Wakeup(control::WakeupArgs {
                tags: args.tags,
                model: args.model,
            });
            control_command(&args.target, &request, cli.quiet)
        }
        Command::Status(target) => control_command(&target, &control::Request::Status, cli.quiet),
        Command::Stop(target) => control_command(&target, &control::Request::Stop, cli.quiet),
        Command::Restart(target) => restart(target, cli.quiet),
        Command::Rank => match tpctl::exit::failing_on_panic(tpctl::rank::run) {
            Ok(()) => Ok(0),
            Err(e) => tpctl::exit::exit_failed(&e, None),
        },
        Command::MpirunRank { args } => launcher::mpirun::run_rank(&args),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("error: {}", tpctl::output::describe(&e));
            ExitCode::from(1)
        }
    }
}

/// `tpctl reload`: a checkpoint in one request, or `--tensors` as an update from memory (start,
/// one bucket per file, finish; a refused bucket aborts the update).
fn reload(args: ReloadArgs, quiet: bool) -> Result<i32> {
    let mode = args.mode.into();
    let weight_version = args.weight_version;
    if let Some(model) = args.model {
        let update = control::UpdateArgs { model, mode, weight_version };
        return control_command(&args.target, &control::Request::UpdateWeights(update), quiet);
    }
    let step = |request: &control::Request| -> Result<bool> {
        let target = &args.target;
        let socket = paths::resolve(
            &paths::runtime_dir(),
            target.deployment.as_deref(),
            target.socket.as_deref(),
        )?;
        let reply =
            control::client::call(&socket, request, Duration::from_secs_f64(target.timeout))?;
        if let Some(e) = reply.error.as_ref().filter(|_| !reply.ok) {
            eprintln!("error: {}", e.message);
            return Ok(false);
        }
        Ok(true)
    };
    if !step(&control::Request::StartWeightUpdate(control::StartUpdateArgs::default()))? {
        return Ok(1);
    }
    for path in &args.tensors {
        // The ranks read it: an absolute path, whatever the working directory.
        let path = std::path::absolute(path).unwrap_or_else(|_| path.into());
        let bucket =
            control::BucketArgs { path: Some(path.to_string_lossy().into_owned()), ipc: None };
        if !step(&control::Request::WeightBucket(bucket))? {
            step(&control::Request::AbortWeightUpdate)?;
            return Ok(1);
        }
    }
    let finish = control::FinishUpdateArgs { weight_version, mode };
    control_command(&args.target, &control::Request::FinishWeightUpdate(finish), quiet)
}

fn init_logging(verbose: u8, quiet: bool) {
    let level = match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => "warn",
        (false, 1) => "info",
        (false, _) => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// `tpctl sleep / wakeup / status / stop`: one request to the deployment's control socket.
/// The reply goes to standard output (a table, or JSON; an operation's receipt not with
/// `quiet`); a failure to standard error, with exit code 1.
fn control_command(target: &TargetArgs, request: &control::Request, quiet: bool) -> Result<i32> {
    if !(target.timeout.is_finite() && target.timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds, not {}", target.timeout);
    }
    let socket = paths::resolve(
        &paths::runtime_dir(),
        target.deployment.as_deref(),
        target.socket.as_deref(),
    )?;
    let reply = control::client::call(&socket, request, Duration::from_secs_f64(target.timeout))?;
    if target.json {
        println!("{}", serde_json::to_string(&reply)?);
    }
    if let Some(e) = reply.error.as_ref().filter(|_| !reply.ok) {
        // The aggregate message names every failing rank already.
        eprintln!("error: {}", e.message);
        return Ok(1);
    }
    if target.json {
        return Ok(0);
    }
    if let Some(host) = &reply.host {
        if let control::Request::Restart(args) = request {
            println!("model {} started again", args.deployment);
        }
        print!("{}", render::host(host));
    } else if let Some(op) = &reply.op {
        if !quiet {
            print!("{}", render::receipt(op));
        }
    } else if let Some(status) = &reply.status {
        print!("{}", render::status(status));
        if !status.failures.is_empty() {
            eprintln!("error: {} rank(s) did not answer the status", status.failures.len());
            return Ok(1);
        }
    } else if reply.stopping == Some(true) {
        println!("stopping {}", socket.display());
    } else if let Some(p) = &reply.paused {
        if !quiet {
            let what = match (p.paused, p.changed) {
                (true, true) => "paused",
                (true, false) => "already paused",
                (false, true) => "resumed",
                (false, false) => "not paused: nothing to resume",
            };
            println!("{what} ({})", socket.display());
        }
    } else {
        bail!("{} answered an empty reply", socket.display());
    }
    Ok(0)
}

/// `tpctl restart --deployment HOST-NAME`: asks the model host whose model that is (the
/// model's own socket is gone when its ranks died) to start it again.
fn restart(mut target: TargetArgs, quiet: bool) -> Result<i32> {
    let Some(name) = target.deployment.take() else {
        bail!(
            "tpctl restart needs --deployment HOST-NAME: the model of a model host to start again"
        );
    };
    let Some((host, _)) = paths::host_of(&paths::runtime_dir(), &name) else {
        bail!(
            "no running model host has a model with deployment `{name}`: `tpctl restart` starts a failed model of `tpctl serve --model NAME=PATH ...` (`tpctl status` lists the host's models)"
        );
    };
    target.socket = Some(host.socket);
    control_command(
        &target,
        &control::Request::Restart(control::RestartArgs { deployment: name }),
        quiet,
    )
}

/// The control socket of a launch, refused early when a live deployment already has it.
fn control_socket(name: Option<&str>, check: bool) -> Result<(String, PathBuf)> {
    let name = name.map_or_else(paths::default_name, str::to_owned);
    let socket = paths::socket_path(&paths::runtime_dir(), &name)?;
    if check && paths::occupant(&socket) == paths::Occupant::Live {
        bail!(
            "deployment `{name}` is already running (control socket {}): give another --deployment name, or stop it with `tpctl stop --deployment {name}`",
            socket.display()
        );
    }
    Ok((name, socket))
}

/// The prompts of a run: flags, then a file, then standard input, else the demo prompt.
fn prompts(args: &RunArgs) -> Result<Vec<PromptSpec>> {
    let mut texts = args.prompts.clone();
    if let Some(file) = &args.prompt_file {
        let body = std::fs::read_to_string(file)
            .with_context(|| format!("reading --prompt-file {}", file.display()))?;
        texts.extend(body.lines().filter(|l| !l.trim().is_empty()).map(str::to_owned));
    }
    let mut chat = args.chat;
    let mut specs = Vec::new();
    for (i, list) in args.prompt_ids.iter().enumerate() {
        let ids = list
            .split(',')
            .map(|t| t.trim().parse::<u32>())
            .collect::<std::result::Result<Vec<u32>, _>>()
            .with_context(|| {
                format!("--prompt-ids #{i} `{list}`: expected comma-separated token ids")
            })?;
        specs.push(PromptSpec { text: list.clone(), chat: false, ids: Some(ids) });
    }
    if texts.is_empty() && specs.is_empty() {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            let mut body = String::new();
            stdin
                .lock()
                .read_to_string(&mut body)
                .context("reading prompts from standard input")?;
            texts.extend(body.lines().filter(|l| !l.trim().is_empty()).map(str::to_owned));
        }
        if texts.is_empty() {
            texts.push(DEMO_PROMPT.to_owned());
            chat = true;
        }
    }
    specs.extend(texts.into_iter().map(|text| PromptSpec { text, chat, ids: None }));
    if specs.is_empty() {
        bail!("no prompt: give --prompt, --prompt-ids, --prompt-file or lines on standard input");
    }
    Ok(specs)
}

/// [`prompts`], and when none was given (the demo), the demo prompt on standard error, so
/// the answer that follows reads as one.
fn prompts_shown(args: &RunArgs, quiet: bool) -> Result<Vec<PromptSpec>> {
    let specs = prompts(args)?;
    if !quiet && specs.len() == 1 && specs[0].text == DEMO_PROMPT && args.prompts.is_empty() {
        eprintln!("No prompt given (--prompt, --prompt-file or standard input): the demo prompt.");
        eprintln!("> {DEMO_PROMPT}");
    }
    Ok(specs)
}

/// `tpctl serve`: `run`'s launch with rank 0 serving HTTP instead of running prompts.
fn serve(args: ServeArgs, verbose: u8, quiet: bool) -> Result<i32> {
    let config = match &args.launch.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let listen = match (args.listen, args.host, args.port) {
        (Some(listen), _, _) => listen,
        (None, None, None) => config.server.listen,
        (None, host, port) => join_host_port(&config.server.listen, host, port)?,
    };
    let api_key = args.api_key.or(config.server.api_key).filter(|k| !k.is_empty());
    // Several models: `--model NAME=PATH` repeated, else the config's `[[models]]` (one
    // `--model` overrides them, as flags override the file).
    let hosted = if args.launch.model.len() > 1 {
        let models = tpctl::host::parse_models(&args.launch.model)?;
        let models = models.into_iter().map(|(name, model)| config::HostedModel {
            name,
            model,
            tp: None,
            cp: None,
            pinned: false,
            sleep_level: 1,
            env: Default::default(),
        });
        Some(models.collect())
    } else if args.launch.model.is_empty() && !config.models.is_empty() {
        Some(config.models.clone())
    } else {
        None
    };
    if let Some(models) = hosted {
        let host = tpctl::host::launch::HostArgs {
            models,
            budget: args.memory_budget.or(config.server.memory_budget),
            asleep_wait_s: config.server.asleep_wait_timeout,
            drain_s: config.server.drain_timeout,
            listen,
            api_key,
            config: args.launch.config.clone(),
            chat_template: args.launch.chat_template.clone(),
            deployment: args.launch.deployment.clone(),
            served_model_name: args.served_model_name,
        };
        return tpctl::host::launch::serve(&args.launch.flags(), host, verbose, quiet);
    }
    if args.memory_budget.is_some() {
        bail!("--memory-budget is for a server of several models: give --model NAME=PATH for each");
    }
    let refuse_while_asleep = config.server.refuse_while_asleep;
    let has_config = args.launch.config.is_some();
    let asleep_wait_s = config.server.asleep_wait_timeout;
    if !(asleep_wait_s.is_finite() && asleep_wait_s >= 0.0) {
        bail!("[server] asleep_wait_timeout = {asleep_wait_s}: expected seconds, 0 or more");
    }
    tpctl::serve::check_listen(&listen, api_key.is_some())?;
    // The name the API knows the model by: the catalog name or the path, as given.
    let model_name = args
        .served_model_name
        .or_else(|| args.launch.model.first().cloned())
        .unwrap_or(config.model.name);
    let job = RunArgs {
        launch: args.launch,
        prompts: Vec::new(),
        prompt_ids: Vec::new(),
        prompt_file: None,
        max_tokens: None,
        temperature: None,
        top_p: None,
        top_k: None,
        seed: None,
        chat: false,
        output: OutputFormat::Text,
    };
    let asleep_wait_ms = (asleep_wait_s * 1000.0).min(u64::MAX as f64) as u64;
    // A config file's [sampling] gives the defaults of requests that leave fields out.
    let defaults = has_config.then(|| tpctl::spec::SamplingDefaults {
        temperature: config.sampling.temperature,
        top_p: config.sampling.top_p,
        top_k: config.sampling.top_k,
        max_tokens: u32::try_from(config.sampling.max_tokens).unwrap_or(u32::MAX),
        ..tpctl::spec::SamplingDefaults::default()
    });
    let spec =
        ServeSpec { listen, api_key, model_name, refuse_while_asleep, asleep_wait_ms, defaults };
    run(job, Some(spec), verbose, quiet)
}

/// A server without a config file's `[sampling]` takes its defaults from the model's
/// `generation_config.json` (a Hugging Face folder's), as vLLM does; fields it leaves out keep
/// OpenAI's.
fn with_generation_defaults(mut spec: ServeSpec, model: &std::path::Path) -> Result<ServeSpec> {
    if spec.defaults.is_some() {
        return Ok(spec);
    }
    if let Some(g) = checkpoint::GenerationConfig::load(model)? {
        let openai = tpctl::spec::SamplingDefaults::default();
        spec.defaults = Some(tpctl::spec::SamplingDefaults {
            temperature: g.temperature.unwrap_or(openai.temperature),
            top_p: g.top_p.unwrap_or(openai.top_p),
            top_k: g.top_k.unwrap_or(openai.top_k),
            repetition_penalty: g.repetition_penalty.unwrap_or(openai.repetition_penalty),
            ..openai
        });
    }
    Ok(spec)
}

/// `--host` / `--port` over the host and port of `listen` (the configured or default
/// address) for the one left out.
fn join_host_port(listen: &str, host: Option<String>, port: Option<u16>) -> Result<String> {
    let (base_host, base_port) = listen
        .rsplit_once(':')
        .with_context(|| format!("[server] listen = {listen:?}: expected HOST:PORT"))?;
    let host = host.unwrap_or_else(|| base_host.to_owned());
    let port = match port {
        Some(p) => p.to_string(),
        None => base_port.to_owned(),
    };
    // An IPv6 literal needs brackets before its port.
    if host.contains(':') && !host.starts_with('[') {
        Ok(format!("[{host}]:{port}"))
    } else {
        Ok(format!("{host}:{port}"))
    }
}

/// Launches the job; with `serve` (which names the model for the API) rank 0 serves HTTP.
fn run(args: RunArgs, serve: Option<ServeSpec>, verbose: u8, quiet: bool) -> Result<i32> {
    let config = match &args.launch.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let settings = config.launch(&args.launch.flags(), cores, config::Built::THIS)?;
    let nodes = &args.launch.nodes;
    // Rank 0, which serves the socket, runs on node 0.
    let (deployment, socket) =
        control_socket(args.launch.deployment.as_deref(), nodes.node_rank == 0)?;
    let model = match tpctl::catalog::entry(&settings.model) {
        Some(entry) if !std::path::Path::new(&settings.model).exists() => {
            tpctl::fetch::fetch_with_progress(entry)?
        }
        _ => tpctl::catalog::resolve(&settings.model, true)?,
    };
    check_layout(&model, settings.tp)?;
    let s = &config.sampling;
    let serve = serve.map(|spec| with_generation_defaults(spec, &model)).transpose()?;
    let spec = RankSpec {
        model,
        tp: settings.tp,
        cp: settings.cp,
        backends: settings.backends,
        threads: settings.threads,
        native_weights: config.model.weights == WeightsForm::Native,
        kv_cache_tokens: settings.kv_cache_tokens,
        kv_cache: {
            let available = config::host_available_bytes().unwrap_or(8 << 30);
            session::sharded::KvCacheConfig {
                bytes: settings.kv_cache_memory.map(|m| m.bytes(available, settings.nproc)),
                cap_bytes: available / 10 / settings.nproc.max(1) as u64,
                block_size: settings.block_size,
                prefix_caching: settings.prefix_caching,
                device_fraction: match settings.kv_cache_memory {
                    Some(config::KvMemory::Fraction(f)) => Some(f),
                    _ => None,
                },
            }
        },
        max_num_seqs: settings.max_num_seqs,
        timeout_s: config.runtime.timeout_s,
        prompts: if serve.is_none() { prompts_shown(&args, quiet)? } else { Vec::new() },
        sampling: Sampling {
            max_tokens: args.max_tokens.unwrap_or(s.max_tokens as u32),
            temperature: args.temperature.unwrap_or(s.temperature),
            top_p: args.top_p.unwrap_or(s.top_p),
            top_k: args.top_k.unwrap_or(s.top_k),
            seed: args.seed.unwrap_or(s.seed),
        },
        output: args.output,
        serve,
        sleep: config.sleep.clone(),
        preallocate_sleep_memory: settings.preallocate_sleep_memory,
        enforce_eager: settings.enforce_eager,
        device: settings.device,
        dtype: settings.dtype,
        control_socket: Some(socket.clone()),
        chat_template: args
            .launch
            .chat_template
            .as_ref()
            .map(|p| {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("--chat-template {}: cannot read it", p.display()))?;
                text::tokenizer::chat::check(&text)
                    .with_context(|| format!("--chat-template {}", p.display()))?;
                anyhow::Ok(text)
            })
            .transpose()?,
    };
    let master_port = match nodes.master_port {
        Some(p) => p,
        None if nodes.nnodes == 1 => free_port()?,
        None => bail!("--master-port is needed with --nnodes > 1"),
    };
    // The spec (every rank's) leaves the API key out; rank 0 alone gets it (`rank0_env`).
    let api_key = spec.serve.as_ref().and_then(|s| s.api_key.clone());
    let mut env = vec![(tpctl::spec::ENV.to_owned(), serde_json::to_string(&spec)?)];
    if std::env::var_os("RUST_LOG").is_none() {
        let level =
            if quiet { "error" } else { ["warn", "info", "debug"][verbose.min(2) as usize] };
        env.push(("RUST_LOG".into(), level.into()));
    }
    let launch = Launch {
        program: std::env::current_exe().context("finding the tpctl executable")?,
        args: vec!["__rank".into()],
        nproc_per_node: settings.nproc,
        nnodes: nodes.nnodes,
        node_rank: nodes.node_rank,
        master_addr: nodes.master_addr.clone(),
        master_port,
        env,
        rank0_env: api_key
            .map(|k| (tpctl::spec::RANK0_API_KEY_ENV.to_owned(), k))
            .into_iter()
            .collect(),
        grace: Duration::from_secs(5),
        mpirun: settings.backends.axes().iter().any(|&(_, b)| b == mesh::CommBackend::Mpi),
    };
    if nodes.node_rank == 0 && !quiet {
        eprintln!("tpctl: deployment {deployment} (control socket {})", socket.display());
    }
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .context("installing the Ctrl-C handler")?;
    // A model of a model host stops with its host.
    tpctl::host::child::watch_host(interrupted.clone());
    let outcome = launcher::launch(&launch, &interrupted)?;
    match &outcome {
        Outcome::Success => {}
        Outcome::Failed(f) => eprintln!("error: {f}"),
        Outcome::Interrupted => eprintln!("interrupted: every rank stopped"),
    }
    Ok(outcome.exit_code())
}

/// Refuses a model with tensors tpctl cannot read, or a layout the model cannot be split
/// into, before any rank starts.
fn check_layout(model: &std::path::Path, tp: usize) -> Result<()> {
    let ck = checkpoint::Checkpoint::open(model)?;
    ck.check_weights()?;
    let config = ck.config()?;
    layers::parallel::check_tp(&config, tp)
        .with_context(|| format!("--tp {tp} does not fit {}", model.display()))?;
    Ok(())
}

/// The master port of a one-node job (see [`mesh::rendezvous::free_master_port`]).
fn free_port() -> Result<u16> {
    mesh::rendezvous::free_master_port().context("finding a free port")
}
