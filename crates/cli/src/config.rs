//! `CONFIG.toml`: model, layout, runtime, sampling, sleep policy and server settings.
//!
//! Every table refuses unknown keys, and every error names the key with its line and column,
//! so a typo never silently falls back to a default. Command-line flags override the file.

use anyhow::{Context, Result};
use mesh::{AxisBackends, CommBackend};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The whole file. Every table is optional.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Which model to run.
    #[serde(default)]
    pub model: ModelConfig,
    /// How ranks are laid out and connected.
    #[serde(default)]
    pub layout: LayoutConfig,
    /// Per-rank runtime settings.
    #[serde(default)]
    pub runtime: RuntimeConfig,
    /// Sampling defaults.
    #[serde(default)]
    pub sampling: SamplingConfig,
    /// Restore policy per memory tag (`[sleep.kv_cache]`, `[sleep.weights]`).
    #[serde(default)]
    pub sleep: BTreeMap<String, SleepPolicy>,
    /// HTTP server settings for `tpctl serve`.
    #[serde(default)]
    pub server: ServerConfig,
    /// `[[models]]`: the models of a server of several (`tpctl serve` without `--model`).
    #[serde(default)]
    pub models: Vec<HostedModel>,
}

/// One `[[models]]` table: a model of a server of several, a deployment of its own.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostedModel {
    /// Its name in the API (requests' `model`).
    pub name: String,
    /// Its checkpoint: a catalog name, a GGUF file or a Hugging Face folder.
    pub model: String,
    /// Its tensor-parallel ranks (default: `[layout] tp` or `--tp`).
    pub tp: Option<usize>,
    /// Its context-parallel ranks (default: `[layout] cp` or `--cp`).
    pub cp: Option<usize>,
    /// Never put to sleep to make room for another model.
    #[serde(default)]
    pub pinned: bool,
    /// The level it sleeps at to make room: 1 keeps its weights in a backup (fast wakeup), 2
    /// reloads them from the checkpoint.
    #[serde(default = "default_sleep_level")]
    pub sleep_level: u8,
    /// More environment for its deployment's processes (`CUDA_VISIBLE_DEVICES` to place it
    /// on other GPUs, `TPCTL_FAILPOINTS` in tests).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

fn default_sleep_level() -> u8 {
    1
}

/// `[model]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// A catalog name (fetched once into the cache) or a path to a GGUF file.
    #[serde(default = "default_model")]
    pub name: String,
    /// Weight form: `native` keeps quantized weights quantized, `f32` converts them.
    #[serde(default)]
    pub weights: WeightsForm,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig { name: default_model(), weights: WeightsForm::default() }
    }
}

fn default_model() -> String {
    "smollm2-135m-instruct".to_owned()
}

/// How weights are kept in memory.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum WeightsForm {
    /// Quantized weights stay quantized.
    #[default]
    Native,
    /// Everything in f32.
    F32,
}

/// `[layout]`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LayoutConfig {
    /// Tensor-parallel ranks.
    pub tp: Option<usize>,
    /// Context-parallel ranks.
    pub cp: Option<usize>,
    /// Communication backend per axis.
    #[serde(default)]
    pub backends: BackendsConfig,
}

/// `[layout.backends]`: `local`, `shm`, `tcp`, `nccl` or `mpi` (the ranks then start under
/// one `mpirun`) per axis.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendsConfig {
    /// Tensor-parallel axis.
    #[serde(default = "shm", deserialize_with = "parsed")]
    pub tp: mesh::CommBackend,
    /// Context-parallel axis.
    #[serde(default = "shm", deserialize_with = "parsed")]
    pub cp: mesh::CommBackend,
    /// Control messages (step agreement, sleep/wakeup).
    #[serde(default = "shm", deserialize_with = "parsed")]
    pub control: mesh::CommBackend,
}

/// Deserializes a string through the type's `FromStr`, keeping its error message.
fn parsed<'de, D, T>(de: D) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let text = String::deserialize(de)?;
    text.parse().map_err(serde::de::Error::custom)
}

fn shm() -> mesh::CommBackend {
    mesh::CommBackend::Shm
}

impl Default for BackendsConfig {
    fn default() -> Self {
        BackendsConfig { tp: shm(), cp: shm(), control: shm() }
    }
}

/// `[runtime]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Compute threads per rank (0: the cores divided by the ranks on this host).
    #[serde(default)]
    pub threads: usize,
    /// Tokens of KV cache per rank.
    #[serde(default = "default_kv_tokens")]
    pub kv_cache_tokens: usize,
    /// Deadline of one collective call, in seconds.
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
    /// Where the kernels run: `cpu`, or `cuda` (each rank on the GPU of its `LOCAL_RANK`).
    #[serde(default)]
    pub device: ComputeDevice,
    /// The element type of the weight matrices on a GPU: `f32`, `bf16` or `f16`. Default:
    /// `bf16` on a GPU (half the device memory and the bytes each step reads), `f32` on the
    /// CPU, which always computes in f32.
    #[serde(default)]
    pub dtype: Option<ComputeDtype>,
    /// The paged KV pool of each rank: bytes (`4294967296`, `"4GiB"`), or a fraction of the
    /// memory available at launch split over this node's ranks (`0.2`). Default: room for 2
    /// sequences of max-model-len tokens, at most a tenth of the available memory.
    #[serde(default)]
    pub kv_cache_memory: Option<KvMemory>,
    /// Tokens per KV block (a power of two up to 256).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// Whether prompts reuse the cached blocks of earlier prompts that start the same way
    /// (without context parallelism, and never for models with sliding-window layers).
    #[serde(default = "yes")]
    pub prefix_caching: bool,
    /// The most requests in one step (vLLM's max_num_seqs).
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: u32,
    /// Allocate at start the host memory that level-1 sleeps back the weights up into, and
    /// keep it across sleeps (`--preallocate-sleep-memory`).
    #[serde(default)]
    pub preallocate_sleep_memory: bool,
    /// Run every step eagerly: no CUDA graphs of decode steps (`--enforce-eager`, vLLM's
    /// flag). Only a GPU captures graphs.
    #[serde(default)]
    pub enforce_eager: bool,
}

/// The size of the KV pool: bytes, or a fraction of the memory available at launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvMemory {
    /// Bytes per rank.
    Bytes(u64),
    /// A share of the memory available at launch, split over this node's ranks.
    Fraction(f64),
}

impl std::str::FromStr for KvMemory {
    type Err = String;

    /// `0.25` (a fraction), `1073741824` (bytes), `512MiB`, `4GiB`, `2GB`.
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let t = text.trim();
        let units = [("KiB", 1u64 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40)];
        let units =
            units.into_iter().chain([("KB", 1000), ("MB", 1_000_000), ("GB", 1_000_000_000)]);
        let bad = || {
            format!(
                "{text:?} is not a KV cache size: give bytes (1073741824, 512MiB, 4GiB) or a \
                 fraction of the available memory (0.2)"
            )
        };
        for (unit, scale) in units {
            if let Some(n) = t.strip_suffix(unit) {
                let n: f64 = n.trim().parse().map_err(|_| bad())?;
                return KvMemory::Bytes((n * scale as f64) as u64).checked().map_err(|_| bad());
            }
        }
        if let Ok(bytes) = t.parse::<u64>() {
            return KvMemory::Bytes(bytes).checked();
        }
        t.parse::<f64>().map_err(|_| bad()).map(KvMemory::Fraction)?.checked()
    }
}

impl KvMemory {
    /// Itself, when it is a size at all: some bytes, or a fraction in (0, 1].
    fn checked(self) -> std::result::Result<Self, String> {
        match self {
            KvMemory::Bytes(0) => Err("a KV cache of 0 bytes holds nothing".into()),
            KvMemory::Fraction(f) if !(f > 0.0 && f <= 1.0) => {
                Err(format!("a fraction of the available memory is in (0, 1], not {f}"))
            }
            ok => Ok(ok),
        }
    }

    /// Bytes per rank, with `available` bytes of memory shared by `ranks` ranks.
    pub fn bytes(self, available: u64, ranks: usize) -> u64 {
        match self {
            KvMemory::Bytes(b) => b,
            KvMemory::Fraction(f) => (f * available as f64 / ranks.max(1) as f64) as u64,
        }
    }
}

/// A memory amount as a config file writes it: bytes (an integer), a share (a float) or text
/// (`"4GiB"`, `"0.5"`), for the keys that take either.
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum MemoryAmount {
    Int(u64),
    Float(f64),
    Text(String),
}

impl<'de> Deserialize<'de> for KvMemory {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match MemoryAmount::deserialize(d)? {
            MemoryAmount::Int(b) => KvMemory::Bytes(b).checked(),
            MemoryAmount::Float(f) => KvMemory::Fraction(f).checked(),
            MemoryAmount::Text(t) => t.parse(),
        }
        .map_err(serde::de::Error::custom)
    }
}

fn default_block_size() -> usize {
    16
}

fn yes() -> bool {
    true
}

fn default_max_num_seqs() -> u32 {
    32
}

/// `runtime.dtype`.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    /// 32-bit floats (the CPU's arithmetic).
    #[default]
    F32,
    /// bfloat16 weights and products, accumulated in f32 (half the device memory).
    Bf16,
    /// IEEE half weights and products, accumulated in f32 (half the device memory).
    F16,
}

impl From<ComputeDtype> for tensor::kernels::GemmDtype {
    fn from(d: ComputeDtype) -> Self {
        match d {
            ComputeDtype::F32 => tensor::kernels::GemmDtype::F32,
            ComputeDtype::Bf16 => tensor::kernels::GemmDtype::Bf16,
            ComputeDtype::F16 => tensor::kernels::GemmDtype::F16,
        }
    }
}

/// `runtime.device`.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDevice {
    /// CPU kernels.
    #[default]
    Cpu,
    /// CUDA kernels (feature `cuda`), on the GPU of each rank's `LOCAL_RANK`.
    Cuda,
}

fn default_kv_tokens() -> usize {
    4096
}

fn default_timeout() -> f64 {
    60.0
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            threads: 0,
            kv_cache_tokens: default_kv_tokens(),
            timeout_s: default_timeout(),
            device: ComputeDevice::Cpu,
            dtype: None,
            kv_cache_memory: None,
            block_size: default_block_size(),
            prefix_caching: true,
            max_num_seqs: default_max_num_seqs(),
            preallocate_sleep_memory: false,
            enforce_eager: false,
        }
    }
}

/// `[sampling]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SamplingConfig {
    /// 0 is greedy.
    #[serde(default)]
    pub temperature: f32,
    /// Nucleus sampling mass (1.0: off).
    #[serde(default = "one")]
    pub top_p: f32,
    /// Keep the k most likely tokens (0: off).
    #[serde(default)]
    pub top_k: usize,
    /// Random seed.
    #[serde(default)]
    pub seed: u64,
    /// Tokens to generate per prompt.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
}

fn one() -> f32 {
    1.0
}

fn default_max_tokens() -> usize {
    64
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            max_tokens: default_max_tokens(),
        }
    }
}

/// `[sleep.TAG]`: how memory with this tag is restored after a wakeup.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SleepPolicy {
    /// `discard`, `zero`, `backup` or `reload`.
    pub restore: RestoreMode,
    /// Where `backup` spills to (default: the cache dir).
    pub spill_dir: Option<PathBuf>,
}

/// Restore modes of `[sleep.TAG]`.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RestoreMode {
    /// Contents are undefined after wakeup.
    Discard,
    /// Zeros after wakeup.
    Zero,
    /// Copied out before sleep, back after wakeup.
    Backup,
    /// Re-read from the model file.
    Reload,
}

/// `[server]`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address of the HTTP API.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Required on every request when set; needed for a non-loopback address.
    pub api_key: Option<String>,
    /// Answer completion requests with 503 while the deployment sleeps, instead of letting
    /// them wait for the wakeup.
    #[serde(default)]
    pub refuse_while_asleep: bool,
    /// Otherwise the seconds a completion request waits for the wakeup before it gets 503
    /// (with `Retry-After`).
    #[serde(default = "default_asleep_wait_timeout")]
    pub asleep_wait_timeout: f64,
    /// With several models: the seconds a model that must sleep to make room waits for its
    /// running requests before it sleeps with them paused (`keep`; they continue once it
    /// wakes again).
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout: f64,
    /// With several models: the memory they share (`--memory-budget`), a share of the
    /// host's memory (0.9) or bytes (8589934592, "8GiB").
    pub memory_budget: Option<crate::host::table::MemoryBudget>,
}

fn default_listen() -> String {
    "127.0.0.1:8000".to_owned()
}

fn default_asleep_wait_timeout() -> f64 {
    60.0
}

fn default_drain_timeout() -> f64 {
    5.0
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: default_listen(),
            api_key: None,
            refuse_while_asleep: false,
            asleep_wait_timeout: default_asleep_wait_timeout(),
            drain_timeout: default_drain_timeout(),
            memory_budget: None,
        }
    }
}

impl Config {
    /// Parses a config from text; `origin` names it in errors.
    ///
    /// # Errors
    /// Malformed TOML, an unknown key or a bad value, with its key, line and column.
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
        let config: Config = toml::from_str(text).map_err(|e| {
            // toml's message already holds the line, the column and the offending key.
            anyhow::anyhow!("{origin}: {}", e.to_string().trim_end())
        })?;
        config.validate().with_context(|| format!("{origin}: invalid configuration"))?;
        Ok(config)
    }

    /// Reads and parses `path`.
    ///
    /// # Errors
    /// The file cannot be read, or see [`Config::parse`].
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        Config::parse(&text, &path.display().to_string())
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, why: String| Err(anyhow::anyhow!("`{key}` {why}"));
        if self.layout.tp == Some(0) {
            return bad("layout.tp", "must be at least 1".into());
        }
        if self.layout.cp == Some(0) {
            return bad("layout.cp", "must be at least 1".into());
        }
        if self.runtime.kv_cache_tokens == 0 {
            return bad("runtime.kv_cache_tokens", "must be at least 1".into());
        }
        let bs = self.runtime.block_size;
        if !(bs.is_power_of_two() && bs <= 256) {
            return bad(
                "runtime.block_size",
                format!("must be a power of two up to 256, not {bs}"),
            );
        }
        if self.runtime.max_num_seqs == 0 {
            return bad("runtime.max_num_seqs", "must be at least 1".into());
        }
        if !(self.runtime.timeout_s.is_finite() && self.runtime.timeout_s > 0.0) {
            return bad(
                "runtime.timeout_s",
                format!("must be a positive number of seconds, not {}", self.runtime.timeout_s),
            );
        }
        let s = &self.sampling;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return bad(
                "sampling.temperature",
                format!("must be 0 or more, not {}", s.temperature),
            );
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return bad("sampling.top_p", format!("must be in (0, 1], not {}", s.top_p));
        }
        for (i, m) in self.models.iter().enumerate() {
            let key = format!("models[{i}]");
            if m.name.is_empty() {
                return bad(&format!("{key}.name"), "is empty: each model needs a name".into());
            }
            if self.models[..i].iter().any(|o| o.name == m.name) {
                return bad(
                    &format!("{key}.name"),
                    format!("`{}` is the name of an earlier model: each needs its own", m.name),
                );
            }
            if m.tp == Some(0) || m.cp == Some(0) {
                return bad(&format!("{key}.tp/cp"), "must be at least 1".into());
            }
            if !(1..=2).contains(&m.sleep_level) {
                return bad(
                    &format!("{key}.sleep_level"),
                    format!("must be 1 or 2, not {}", m.sleep_level),
                );
            }
        }
        for tag in self.sleep.keys() {
            if tag.is_empty()
                || !tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return bad(
                    &format!("sleep.{tag}"),
                    "is not a tag name (letters, digits, _ and -)".into(),
                );
            }
        }
        Ok(())
    }
}

/// What the command line says about a launch (`tpctl run` and `tpctl serve` alike); `None`
/// leaves the setting to the config file, then to the default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaunchFlags {
    /// `--tp`.
    pub tp: Option<usize>,
    /// `--cp`.
    pub cp: Option<usize>,
    /// `--model`.
    pub model: Option<String>,
    /// `--threads`.
    pub threads: Option<usize>,
    /// `--max-model-len`.
    pub max_model_len: Option<u32>,
    /// `--device`.
    pub device: Option<ComputeDevice>,
    /// `--dtype`.
    pub dtype: Option<ComputeDtype>,
    /// `--backend` (every axis).
    pub backend: Option<mesh::CommBackend>,
    /// `--kv-cache-memory`.
    pub kv_cache_memory: Option<KvMemory>,
    /// `--max-num-seqs`.
    pub max_num_seqs: Option<u32>,
    /// `--no-prefix-caching`.
    pub no_prefix_caching: bool,
    /// `--preallocate-sleep-memory`.
    pub preallocate_sleep_memory: bool,
    /// `--enforce-eager`.
    pub enforce_eager: bool,
    /// `--nnodes`.
    pub nnodes: usize,
    /// `--node-rank`.
    pub node_rank: usize,
}

/// A launch's settings, resolved: flags over the config file over the defaults, and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSettings {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Context-parallel ranks.
    pub cp: usize,
    /// Rank processes on this node.
    pub nproc: usize,
    /// The model as given (a path, catalog name or Hugging Face id), not resolved yet.
    pub model: String,
    /// The backend of the TP, CP and control axes.
    pub backends: AxisBackends,
    /// Compute threads per rank.
    pub threads: usize,
    /// Tokens of one sequence (its KV cache).
    pub kv_cache_tokens: usize,
    /// Where the kernels run.
    pub device: ComputeDevice,
    /// Element type of the weights on a GPU.
    pub dtype: ComputeDtype,
    /// The KV pool's size (`None`: the default).
    pub kv_cache_memory: Option<KvMemory>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Whether prompts reuse cached prefix blocks.
    pub prefix_caching: bool,
    /// The most requests in one step.
    pub max_num_seqs: u32,
    /// Whether the host memory of level-1 sleeps is allocated at start and kept.
    pub preallocate_sleep_memory: bool,
    /// Whether every step runs eagerly (no CUDA graphs).
    pub enforce_eager: bool,
}

/// The optional backends compiled into this tpctl.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Built {
    /// Feature `cuda`: NCCL and `--device cuda`.
    pub cuda: bool,
    /// Feature `mpi`: the `mpi` backend.
    pub mpi: bool,
}

impl Built {
    /// This build's.
    pub const THIS: Built = Built { cuda: cfg!(feature = "cuda"), mpi: cfg!(feature = "mpi") };
}

impl Config {
    /// The launch `flags` ask for on a machine with `cores` cores, this config filling what
    /// they leave out; `built` says which optional backends this tpctl has.
    ///
    /// # Errors
    /// A layout of zero ranks, a node rank outside `--nnodes`, ranks that do not split over
    /// the nodes, NCCL or `--device cuda` without CUDA, half precision on the CPU, the `mpi`
    /// backend without MPI or over several nodes (one mpirun on this host starts its ranks).
    pub fn launch(
        &self,
        flags: &LaunchFlags,
        cores: usize,
        built: Built,
    ) -> Result<LaunchSettings> {
        let Built { cuda: cuda_built, mpi: mpi_built } = built;
        use anyhow::bail;
        let tp = flags.tp.or(self.layout.tp).unwrap_or(1);
        let cp = flags.cp.or(self.layout.cp).unwrap_or(1);
        if tp == 0 || cp == 0 {
            bail!("--tp and --cp must be at least 1");
        }
        let nnodes = flags.nnodes;
        if nnodes == 0 || flags.node_rank >= nnodes {
            bail!("--node-rank {} is not below --nnodes {nnodes}", flags.node_rank);
        }
        let world = tp * cp;
        if !world.is_multiple_of(nnodes) {
            bail!("tp x cp = {world} ranks do not split evenly over --nnodes {nnodes}");
        }
        let nproc = world / nnodes;
        let every = |b| AxisBackends { tp: b, cp: b, control: b };
        let backends = match flags.backend {
            // NCCL carries data only: the control axis (step agreement) stays on the host.
            Some(CommBackend::Nccl) => {
                let control = if nnodes > 1 { CommBackend::Tcp } else { CommBackend::Shm };
                AxisBackends { tp: CommBackend::Nccl, cp: CommBackend::Nccl, control }
            }
            Some(b) => every(b),
            // Across nodes shared memory cannot carry an axis: TCP everywhere.
            None if nnodes > 1 => every(CommBackend::Tcp),
            None => {
                let b = &self.layout.backends;
                AxisBackends { tp: b.tp, cp: b.cp, control: b.control }
            }
        };
        if [backends.tp, backends.cp, backends.control].contains(&CommBackend::Nccl) && !cuda_built
        {
            bail!(
                "the nccl backend: this tpctl was built without CUDA; build it with \
                 `cargo build --release -p tpctl --features cuda`"
            );
        }
        if [backends.tp, backends.cp, backends.control].contains(&CommBackend::Mpi) {
            if !mpi_built {
                bail!(
                    "the mpi backend: this tpctl was built without MPI; build it with \
                     `cargo build --release -p tpctl --features mpi` (needs OpenMPI)"
                );
            }
            // One mpirun on this host starts the whole world.
            if nnodes > 1 {
                bail!(
                    "the mpi backend starts every rank from one mpirun on this host: \
                     --nnodes {nnodes} needs --backend tcp"
                );
            }
        }
        let threads = flags.threads.unwrap_or(if self.runtime.threads > 0 {
            self.runtime.threads
        } else {
            (cores / nproc).max(1)
        });
        let device = flags.device.unwrap_or(self.runtime.device);
        if device == ComputeDevice::Cuda && !cuda_built {
            bail!(
                "--device cuda (or [runtime] device = \"cuda\"): this tpctl was built without \
                 CUDA; build it with `cargo build --release -p tpctl --features cuda`"
            );
        }
        let dtype = flags.dtype.or(self.runtime.dtype).unwrap_or(match device {
            ComputeDevice::Cuda => ComputeDtype::Bf16,
            ComputeDevice::Cpu => ComputeDtype::F32,
        });
        if dtype != ComputeDtype::F32 && device != ComputeDevice::Cuda {
            bail!(
                "--dtype {} (or [runtime] dtype): the CPU kernels compute in f32; half \
                 precision needs --device cuda",
                tensor::kernels::GemmDtype::from(dtype).name()
            );
        }
        Ok(LaunchSettings {
            tp,
            cp,
            nproc,
            model: flags.model.clone().unwrap_or_else(|| self.model.name.clone()),
            backends,
            threads,
            kv_cache_tokens: flags
                .max_model_len
                .map_or(self.runtime.kv_cache_tokens, |n| n as usize),
            device,
            dtype,
            kv_cache_memory: flags.kv_cache_memory.or(self.runtime.kv_cache_memory),
            block_size: self.runtime.block_size,
            prefix_caching: self.runtime.prefix_caching && !flags.no_prefix_caching,
            max_num_seqs: flags.max_num_seqs.unwrap_or(self.runtime.max_num_seqs),
            preallocate_sleep_memory: flags.preallocate_sleep_memory
                || self.runtime.preallocate_sleep_memory,
            enforce_eager: flags.enforce_eager || self.runtime.enforce_eager,
        })
    }
}

/// The memory available for new allocations on this host (`MemAvailable` of /proc/meminfo).
pub fn host_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests;
