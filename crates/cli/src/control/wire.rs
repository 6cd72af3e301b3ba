//! The control socket's wire format: one [`Request`] line in, one [`Reply`] line out (see the
//! module docs of [`super`] for the methods), and the receipts, statuses and errors as they
//! travel.

use serde::{Deserialize, Serialize};
use session::sleep::{
    Action, DeploymentState, DeploymentStatus, OpReceipt, Outcome, Phase, QuiesceMode, RankFailure,
    RankReceipt,
};

/// One request line, tagged by its `method` (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "method", rename_all = "snake_case")]
pub enum Request {
    /// Releases tags on every rank.
    Sleep(SleepArgs),
    /// Materializes tags again, optionally from another checkpoint.
    #[serde(alias = "wake_up")]
    Wakeup(WakeupArgs),
    /// Replaces the weights on every rank.
    UpdateWeights(UpdateArgs),
    /// Opens an update from memory.
    StartWeightUpdate(StartUpdateArgs),
    /// Adds a bucket of tensors to the open update.
    WeightBucket(BucketArgs),
    /// Commits the open update on every rank.
    FinishWeightUpdate(FinishUpdateArgs),
    /// Drops the open update.
    AbortWeightUpdate,
    /// Pauses generation, memory kept.
    Pause(PauseArgs),
    /// Resumes generation after a pause.
    Resume,
    /// The deployment's state.
    Status,
    /// Stops the deployment.
    Stop,
    /// Starts a failed model of a model host again (only a host's socket serves it).
    Restart(RestartArgs),
}

/// The options of a `restart`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestartArgs {
    /// The model's deployment (`HOST-NAME`), or its name in the API.
    pub deployment: String,
}

/// The options of a `sleep`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SleepArgs {
    /// The tags; empty means all (see the module docs).
    #[serde(default)]
    pub tags: Vec<String>,
    /// vLLM's sleep level, 1 or 2 (see the module docs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<u8>,
    /// What running requests do during the sleep.
    #[serde(default)]
    pub mode: QuiesceMode,
    /// Fail a sleep whose memory probe did not drop on some rank.
    #[serde(default)]
    pub verify: bool,
}

/// The options of a `wakeup`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WakeupArgs {
    /// The tags; empty means every tag asleep.
    #[serde(default)]
    pub tags: Vec<String>,
    /// The checkpoint sleeping weights come back from (a GGUF file or a Hugging Face folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// The options of an `update_weights`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateArgs {
    /// The checkpoint to load (a GGUF file or a Hugging Face folder).
    #[serde(default)]
    pub model: String,
    /// What running requests do while awake weights are replaced.
    #[serde(default)]
    pub mode: QuiesceMode,
    /// The version the new weights take (default: the count of updates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// The options of a `start_weight_update`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartUpdateArgs {
    /// The version the new weights take (the finish may name another).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
}

/// The options of a `weight_bucket`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketArgs {
    /// A safetensors file of named tensors, as rank 0 sees it (e.g. in `/dev/shm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Or the tensors as CUDA IPC handles of the trainer's device memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipc: Option<super::ipc_bucket::IpcBucket>,
}

/// The options of a `finish_weight_update`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinishUpdateArgs {
    /// The version the new weights take (default: the start's, else the count of updates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// What running requests do while the weights are replaced.
    #[serde(default)]
    pub mode: QuiesceMode,
}

/// The options of a `pause`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PauseArgs {
    /// What running requests do: `abort` (vLLM's default), `wait` or `keep`.
    #[serde(default = "abort")]
    pub mode: QuiesceMode,
}

impl Default for PauseArgs {
    fn default() -> Self {
        PauseArgs { mode: abort() }
    }
}

fn abort() -> QuiesceMode {
    QuiesceMode::Abort
}

/// The most characters of a weight version.
pub const MAX_VERSION_CHARS: usize = 128;

/// Checks a weight version: 1 to [`MAX_VERSION_CHARS`] printable characters.
///
/// # Errors
/// A message naming what is wrong.
pub fn check_version(version: &str) -> Result<(), String> {
    let chars = version.chars().count();
    if chars == 0 || chars > MAX_VERSION_CHARS {
        return Err(format!(
            "weight_version `{version}`: give 1 to {MAX_VERSION_CHARS} characters ({chars} given)"
        ));
    }
    if version.chars().any(char::is_control) {
        return Err(format!("weight_version {version:?} holds a control character"));
    }
    Ok(())
}

/// The methods a request line may name.
const METHODS: [&str; 12] = [
    "sleep",
    "wakeup",
    "update_weights",
    "start_weight_update",
    "weight_bucket",
    "finish_weight_update",
    "abort_weight_update",
    "pause",
    "resume",
    "status",
    "stop",
    "restart",
];

impl Request {
    /// The request's method, as the wire names it.
    pub fn method(&self) -> &'static str {
        match self {
            Request::Sleep(_) => "sleep",
            Request::Wakeup(_) => "wakeup",
            Request::UpdateWeights(_) => "update_weights",
            Request::StartWeightUpdate(_) => "start_weight_update",
            Request::WeightBucket(_) => "weight_bucket",
            Request::FinishWeightUpdate(_) => "finish_weight_update",
            Request::AbortWeightUpdate => "abort_weight_update",
            Request::Pause(_) => "pause",
            Request::Resume => "resume",
            Request::Status => "status",
            Request::Stop => "stop",
            Request::Restart(_) => "restart",
        }
    }

    /// Reads one request line. An unknown method is refused by name with the methods there
    /// are; an unknown field is refused by name.
    ///
    /// # Errors
    /// A message for the caller.
    pub fn parse(line: &str) -> Result<Request, String> {
        let not_a_request = |e: serde_json::Error| {
            format!(
                "the request is not a JSON control request (one line like {{\"method\":\"status\"}}): {e}"
            )
        };
        let value: serde_json::Value = serde_json::from_str(line).map_err(not_a_request)?;
        if let Some(method) = value.get("method").and_then(serde_json::Value::as_str) {
            if !METHODS.contains(&method) && method != "wake_up" {
                return Err(format!(
                    "unknown control method `{method}`: expected {}",
                    METHODS.join(", ")
                ));
            }
        }
        serde_json::from_value(value).map_err(not_a_request)
    }
}

/// One reply line: `ok` with exactly one of `op`, `status`, `stopping`, `paused`, `staged`,
/// `host`, or not `ok` with `error`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request succeeded.
    pub ok: bool,
    /// The receipt of a sleep or wakeup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<OpWire>,
    /// The answer to a status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<StatusWire>,
    /// Set by a stop: the deployment is stopping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopping: Option<bool>,
    /// The answer to a pause or a resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<PausedWire>,
    /// The answer to a start, a bucket or an abort of an update from memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged: Option<StagedWire>,
    /// A model host's answer to a status or a restart: its table of models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostWire>,
    /// Why the request failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorWire>,
}

/// A model host's table, as its control socket answers a status.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostWire {
    /// The host's deployment name; each model's is this, a dash and its name.
    pub deployment: String,
    /// The memory budget the models share, bytes.
    pub memory_budget_bytes: u64,
    /// Bytes the models count against the budget together.
    pub resident_bytes: u64,
    /// The models, in the order given.
    pub models: Vec<HostModelWire>,
}

/// One model of a host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostModelWire {
    /// Its name in the API.
    pub name: String,
    /// Its deployment (`tpctl sleep/wakeup/status --deployment` take it).
    pub deployment: String,
    /// `awake`, `asleep`, `waking`, `sleeping`, `loading` or `failed`.
    pub state: String,
    /// The level it sleeps at (`asleep`); none when it was put to sleep outside the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep_level: Option<u8>,
    /// Why it failed (`failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Bytes it counts against the budget.
    pub resident_bytes: u64,
    /// The checkpoint its weights come from now.
    pub checkpoint: String,
    /// Requests it is answering (paused ones included).
    pub in_flight: usize,
    /// Requests waiting for it to be ready.
    pub queued: usize,
    /// Never put to sleep to make room.
    #[serde(default)]
    pub pinned: bool,
}

impl Reply {
    /// The reply refusing a caller's mistake (a bad method, tag or option).
    pub fn refused(message: impl Into<String>) -> Reply {
        Reply { ok: false, error: Some(ErrorWire::client(message)), ..Reply::default() }
    }
}

/// Whether generation is paused after a `pause` or `resume`, and whether the call changed it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedWire {
    /// Generation is paused.
    pub paused: bool,
    /// The call paused (or resumed) it; `false`: it already was.
    pub changed: bool,
}

/// An update from memory between its start and its finish.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedWire {
    /// Whether an update is open.
    pub open: bool,
    /// Its buckets so far (an abort: the buckets it dropped).
    pub buckets: usize,
    /// The model's tensors the latest bucket updates.
    #[serde(default)]
    pub tensors: usize,
}

/// [`OpReceipt`] on the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpWire {
    /// The operation's id (0 when nothing had to run: the tags were already so).
    pub op_id: u64,
    /// `sleep` or `wakeup`.
    pub action: String,
    /// The tags the operation ran on.
    pub tags: Vec<String>,
    /// Bytes released or restored over every rank and tag.
    pub bytes: u64,
    /// Wall time of the whole call on rank 0, in microseconds.
    pub elapsed_us: u64,
    /// One receipt per rank, in rank order.
    pub ranks: Vec<RankReceipt>,
    /// A weight update's: the version the weights have now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<String>,
    /// A weight update's: the KV caches and the prefix cache held the old weights' keys and
    /// values, so they were dropped (running requests are computed again).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kv_cache_dropped: bool,
}

impl From<&OpReceipt> for OpWire {
    fn from(r: &OpReceipt) -> Self {
        OpWire {
            op_id: r.op_id,
            action: r.action.to_string(),
            tags: r.tags.clone(),
            bytes: r.bytes(),
            elapsed_us: r.elapsed.as_micros() as u64,
            ranks: r.ranks.clone(),
            weight_version: r.weight_version.clone(),
            kv_cache_dropped: r.action == Action::Update && r.op_id != 0,
        }
    }
}

/// [`DeploymentStatus`] on the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusWire {
    /// `running`, `sleeping`, `waking` or `failed`.
    pub state: String,
    /// The tags asleep (`sleeping`) or being woken (`waking`).
    #[serde(default)]
    pub tags: Vec<String>,
    /// Why the deployment failed (`failed`).
    #[serde(default)]
    pub reason: Option<String>,
    /// Each rank that answered: asleep tags and memory probe (`before` = `after`).
    pub ranks: Vec<RankReceipt>,
    /// Ranks that did not answer, with why.
    #[serde(default)]
    pub failures: Vec<FailureWire>,
    /// The sleep or wakeup running when the status was asked: only rank 0 answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_progress: Option<String>,
    /// Whether generation is paused (`pause`).
    #[serde(default)]
    pub paused: bool,
    /// The live weights' version.
    #[serde(default)]
    pub weight_version: String,
    /// The live checkpoint (the latest weight update's, else the one it started with).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<String>,
}

impl From<&DeploymentStatus> for StatusWire {
    fn from(s: &DeploymentStatus) -> Self {
        let (state, tags, reason) = state_parts(&s.state);
        StatusWire {
            state: state.to_owned(),
            tags,
            reason,
            ranks: s.ranks.clone(),
            failures: s.failures.iter().map(FailureWire::from).collect(),
            in_progress: s.in_progress.clone(),
            paused: s.paused,
            weight_version: s.weight_version.clone(),
            checkpoint: None,
        }
    }
}

/// A state's name, tags and failure reason.
fn state_parts(state: &DeploymentState) -> (&'static str, Vec<String>, Option<String>) {
    match state {
        DeploymentState::Running => ("running", Vec::new(), None),
        DeploymentState::Sleeping(t) => ("sleeping", t.clone(), None),
        DeploymentState::Waking(t) => ("waking", t.clone(), None),
        DeploymentState::Failed(why) => ("failed", Vec::new(), Some(why.clone())),
    }
}

/// One failing rank on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureWire {
    /// The rank.
    pub rank: usize,
    /// The protocol phase it failed in.
    pub phase: Phase,
    /// What went wrong, in the rank's words.
    pub message: String,
}

impl From<&RankFailure> for FailureWire {
    fn from(f: &RankFailure) -> Self {
        FailureWire { rank: f.rank, phase: f.phase, message: f.message.clone() }
    }
}

/// A failed request on the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorWire {
    /// The whole error, every failing rank included.
    pub message: String,
    /// Every failing rank, in rank order (empty when no rank is to blame).
    #[serde(default)]
    pub failures: Vec<FailureWire>,
    /// What state the failure left the deployment in: `aborted` (nothing changed),
    /// `rolled_back` or `fail_stop`.
    #[serde(default)]
    pub outcome: Option<String>,
    /// Whether the caller asked for something wrong (a bad tag, method or option) rather than
    /// the deployment failing: HTTP answers 400 instead of 500.
    #[serde(default)]
    pub client_error: bool,
}

impl ErrorWire {
    /// A caller's mistake.
    pub fn client(message: impl Into<String>) -> ErrorWire {
        ErrorWire { message: message.into(), client_error: true, ..ErrorWire::default() }
    }
}

impl From<&session::sleep::Error> for ErrorWire {
    fn from(e: &session::sleep::Error) -> Self {
        ErrorWire {
            message: e.to_string(),
            failures: e.failures().iter().map(FailureWire::from).collect(),
            outcome: e.outcome().map(|o| {
                match o {
                    Outcome::Aborted => "aborted",
                    Outcome::RolledBack => "rolled_back",
                    Outcome::FailStop => "fail_stop",
                }
                .to_owned()
            }),
            // A state the caller asked in vain; every other failure is the deployment's.
            client_error: matches!(e, session::sleep::Error::WeightsAwake { .. }),
        }
    }
}
