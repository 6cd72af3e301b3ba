//! What the launcher hands every rank process: the resolved job, as JSON in the environment
//! variable `TPCTL_RANK_SPEC`, so ranks never re-read files the launcher already checked.

use crate::config::{ComputeDevice, ComputeDtype, SleepPolicy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The environment variable that carries a [`RankSpec`].
pub const ENV: &str = "TPCTL_RANK_SPEC";

/// How rank 0 prints results of `tpctl run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OutputFormat {
    /// Generated text (streamed for a single prompt), then a summary.
    Text,
    /// One JSON object per prompt, as each finishes; `index` is the prompt's position in the
    /// input; times in ms from the requests' admission, `startup_ms` the start-up before it.
    Jsonl,
}

/// One prompt of a `tpctl run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptSpec {
    /// The text as given (for token-id prompts, the ids as written).
    pub text: String,
    /// Whether to wrap it in the model's chat template as a user message.
    pub chat: bool,
    /// Token ids given directly (`--prompt-ids`), bypassing the tokenizer.
    pub ids: Option<Vec<u32>>,
}

/// Sampling of every prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// Tokens to generate per prompt.
    pub max_tokens: u32,
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Top-k (0: off).
    pub top_k: usize,
    /// Seed.
    pub seed: u64,
}

/// The whole job, as every rank sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSpec {
    /// The model file (already fetched and checked by the launcher).
    pub model: PathBuf,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Backends for the tp, cp and control axes.
    #[serde(with = "axis_backends")]
    pub backends: mesh::AxisBackends,
    /// Compute threads per rank.
    pub threads: usize,
    /// Keep quantized weights quantized (`false`: convert to f32).
    pub native_weights: bool,
    /// KV-cache tokens per sequence.
    pub kv_cache_tokens: usize,
    /// Each rank's paged KV pool.
    pub kv_cache: session::sharded::KvCacheConfig,
    /// The most requests in one step.
    pub max_num_seqs: u32,
    /// Deadline of one collective, seconds.
    pub timeout_s: f64,
    /// Prompts (for `run`).
    pub prompts: Vec<PromptSpec>,
    /// Sampling.
    pub sampling: Sampling,
    /// Output format of rank 0.
    pub output: OutputFormat,
    /// Set for `tpctl serve`: rank 0 serves HTTP instead of running `prompts`.
    #[serde(default)]
    pub serve: Option<ServeSpec>,
    /// Restore policy per memory tag (`[sleep.TAG]`); tags not named use the defaults
    /// (`weights`: reload, `kv_cache`: discard).
    #[serde(default)]
    pub sleep: BTreeMap<String, SleepPolicy>,
    /// Allocate the host memory of level-1 sleeps at start and keep it across sleeps
    /// (`--preallocate-sleep-memory`).
    #[serde(default)]
    pub preallocate_sleep_memory: bool,
    /// Run every step eagerly: no CUDA graphs (`--enforce-eager`).
    #[serde(default)]
    pub enforce_eager: bool,
    /// Where rank 0 listens for `tpctl sleep / wakeup / status / stop` (`None`: no socket).
    #[serde(default)]
    pub control_socket: Option<PathBuf>,
    /// Where the kernels run.
    #[serde(default)]
    pub device: ComputeDevice,
    /// The element type of the weight matrices on a GPU.
    #[serde(default)]
    pub dtype: ComputeDtype,
    /// A chat template that replaces the model's (`--chat-template FILE`'s text).
    #[serde(default)]
    pub chat_template: Option<String>,
}

/// The API key's variable for the launcher (`--api-key`'s `env`): removed from the ranks'
/// environment.
pub const API_KEY_ENV: &str = "TPCTL_API_KEY";

/// Where rank 0 alone finds the API key (see [`ServeSpec::api_key`]).
pub const RANK0_API_KEY_ENV: &str = "TPCTL_RANK0_API_KEY";

/// What rank 0 of `tpctl serve` needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServeSpec {
    /// Address of the HTTP API (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// Required as `Authorization: Bearer KEY` on every request but `/health` when set. Never
    /// in `TPCTL_RANK_SPEC` (every rank reads that): the launcher hands it to rank 0 alone in
    /// [`RANK0_API_KEY_ENV`], and [`RankSpec::from_env`] puts it back here on rank 0.
    #[serde(skip)]
    pub api_key: Option<String>,
    /// The model's name in the API (`/v1/models`, the `model` field of requests).
    pub model_name: String,
    /// Answer completion requests with 503 while the deployment sleeps (`false`: they wait
    /// for the wakeup, at most `asleep_wait_ms`).
    #[serde(default)]
    pub refuse_while_asleep: bool,
    /// Milliseconds a completion request waits for a wakeup before it gets 503.
    #[serde(default)]
    pub asleep_wait_ms: u64,
    /// The sampling a request gets for the fields it leaves out (a config file's
    /// `[sampling]`); `None`: OpenAI's defaults.
    #[serde(default)]
    pub defaults: Option<SamplingDefaults>,
}

/// A server's sampling defaults, from a config file's `[sampling]` or the model's
/// `generation_config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingDefaults {
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// The k most likely tokens (0: all).
    pub top_k: usize,
    /// Tokens of a completion that does not say.
    pub max_tokens: u32,
    /// The Hugging Face repetition penalty (1: none).
    #[serde(default = "one")]
    pub repetition_penalty: f32,
}

fn one() -> f32 {
    1.0
}

impl Default for SamplingDefaults {
    /// OpenAI's: temperature 1, no truncation, 16 tokens, no penalty.
    fn default() -> Self {
        SamplingDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 16,
            repetition_penalty: 1.0,
        }
    }
}

impl Eq for SamplingDefaults {}

impl RankSpec {
    /// The spec in the environment of this process.
    ///
    /// # Errors
    /// The variable is missing or does not parse.
    pub fn from_env() -> anyhow::Result<RankSpec> {
        let text = std::env::var(ENV).map_err(|_| {
            anyhow::anyhow!(
                "{ENV} is not set: `tpctl __rank` is started by `tpctl run` or `tpctl serve`"
            )
        })?;
        let mut spec: RankSpec = serde_json::from_str(&text)?;
        if let Some(serve) = &mut spec.serve {
            serve.api_key = std::env::var(RANK0_API_KEY_ENV).ok().filter(|k| !k.is_empty());
        }
        Ok(spec)
    }
}

/// [`mesh::AxisBackends`] in the spec as `{"tp": "shm", "cp": "shm", "control": "shm"}`, the
/// names `mesh::CommBackend` parses (mesh itself has no serde).
mod axis_backends {
    use mesh::{AxisBackends, CommBackend};
    use serde::{de::Error as _, Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Names {
        tp: String,
        cp: String,
        control: String,
    }

    pub(super) fn serialize<S: Serializer>(b: &AxisBackends, s: S) -> Result<S::Ok, S::Error> {
        Names { tp: b.tp.to_string(), cp: b.cp.to_string(), control: b.control.to_string() }
            .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<AxisBackends, D::Error> {
        let names = Names::deserialize(d)?;
        let parse = |name: &str| name.parse::<CommBackend>().map_err(D::Error::custom);
        Ok(AxisBackends {
            tp: parse(&names.tp)?,
            cp: parse(&names.cp)?,
            control: parse(&names.control)?,
        })
    }
}
