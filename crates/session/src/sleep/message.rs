//! The frames of the control channel: requests from rank 0 and the ACKs peers answer with.
//!
//! Every frame carries the operation id and the phase it belongs to, so a late ACK of an
//! earlier operation, or an ACK of the wrong phase, is recognised and dropped instead of being
//! taken as the answer to the current request.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The memory operation of a sleep/wakeup call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Release the physical memory of the tags.
    Sleep,
    /// Map the tags' memory again and restore it per policy.
    Wakeup,
    /// Load the weights of the checkpoint the PREPARE staged into the live `weights`
    /// allocation (asleep: make it what the wakeup reloads).
    Update,
    /// Put back the weights an update replaced (its rollback).
    Revert,
}

impl Action {
    /// The action that undoes this one.
    pub fn inverse(self) -> Action {
        match self {
            Action::Sleep => Action::Wakeup,
            Action::Wakeup => Action::Sleep,
            Action::Update => Action::Revert,
            Action::Revert => Action::Update,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Sleep => "sleep",
            Action::Wakeup => "wakeup",
            Action::Update => "update_weights",
            Action::Revert => "revert_weights",
        })
    }
}

/// The protocol phase a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Quiesce and check the request; never touches memory.
    Prepare,
    /// Run the memory operation.
    Commit,
    /// Forget a prepared request (resume the engine); never touches memory.
    Abort,
    /// Undo a committed operation (run its inverse).
    Rollback,
    /// Report the rank's state and memory probe.
    Status,
    /// Stop the listener after acknowledging.
    Shutdown,
    /// The deployment is stopping after a failed rollback: acknowledge and stop.
    FailStop,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Prepare => "prepare",
            Phase::Commit => "commit",
            Phase::Abort => "abort",
            Phase::Rollback => "rollback",
            Phase::Status => "status",
            Phase::Shutdown => "shutdown",
            Phase::FailStop => "fail-stop",
        })
    }
}

/// What a frame says about its phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// A request from rank 0.
    Request,
    /// The phase succeeded on the sending peer.
    Ok,
    /// The phase failed; the peer's memory is as before the phase.
    Failed,
    /// The request was dropped because an ABORT for its operation had arrived first.
    Aborted,
    /// The phase failed and the peer could not restore its memory: only a fail-stop is safe.
    Fatal,
}

/// How the engine reaches a step boundary before its memory goes away.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuiesceMode {
    /// Let the running requests finish, admit no new ones.
    #[default]
    Wait,
    /// Fail the running requests with a clear reason.
    Abort,
    /// Pause the running requests; they continue after wakeup.
    Keep,
}

/// A host or device memory reading of one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    /// Resident bytes of the rank's process (procfs).
    pub resident: u64,
    /// Per device the rank uses: (NVML index, bytes used by this process; the device's used
    /// bytes where the driver does not report processes). Empty on CPU.
    pub devices: Vec<(u32, u64)>,
    /// Per device the rank uses: (NVML index, bytes used by all processes together).
    #[serde(default)]
    pub device_used: Vec<(u32, u64)>,
    /// The NVML indices whose [`Probe::devices`] reading is the whole device's used bytes,
    /// not this process's (the driver did not list the process, as in most containers): such
    /// readings can only be verified together with every rank on the device.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_wide: Vec<u32>,
    /// Per device the rank uses: (NVML index, what the device is: its UUID where NVML gives
    /// it, else `HOST:nvmlINDEX`), so ranks on one physical device are matched.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_ids: Vec<(u32, String)>,
}

impl Probe {
    /// Whether the reading of device `index` is the whole device's.
    pub fn is_device_wide(&self, index: u32) -> bool {
        self.device_wide.contains(&index)
    }

    /// What device `index` is (its UUID, else `nvmlINDEX`).
    pub fn device_id(&self, index: u32) -> String {
        self.device_ids
            .iter()
            .find(|(i, _)| *i == index)
            .map_or_else(|| format!("nvml{index}"), |(_, id)| id.clone())
    }

    /// The bytes the rank's tagged memory lives in: device bytes of this process when it uses
    /// a device, resident host bytes otherwise.
    pub fn measure(&self) -> u64 {
        if self.devices.is_empty() {
            self.resident
        } else {
            self.devices.iter().map(|(_, b)| b).sum()
        }
    }
}

/// What one operation did to one tag on one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagReceipt {
    /// The tag.
    pub tag: String,
    /// Allocations whose state changed.
    pub allocations: usize,
    /// Bytes released (sleep) or mapped again (wakeup).
    pub bytes: u64,
    /// Of [`TagReceipt::bytes`], those in device (GPU) memory; the rest is host memory.
    #[serde(default)]
    pub device_bytes: u64,
    /// Bytes copied to a backup (sleep) or restored from one or reloaded (wakeup).
    pub copied_bytes: u64,
    /// How the tag's contents come back (sleep) or came back (wakeup): `discard`, `zero`,
    /// `backup` or `reload`; empty where the memory does not say.
    #[serde(default)]
    pub restore: String,
    /// Time spent on the tag, in microseconds.
    pub elapsed_us: u64,
}

/// What one operation did on one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReceipt {
    /// The rank.
    pub rank: usize,
    /// One receipt per tag asked for, in the order asked.
    pub tags: Vec<TagReceipt>,
    /// The memory probe just before the operation.
    pub before: Probe,
    /// The memory probe just after it.
    pub after: Probe,
    /// Wall time of the operation on this rank, in microseconds.
    pub elapsed_us: u64,
    /// Tags asleep on this rank after the operation.
    pub asleep: Vec<String>,
}

impl RankReceipt {
    /// Bytes released or restored over all tags.
    pub fn bytes(&self) -> u64 {
        self.tags.iter().map(|t| t.bytes).sum()
    }

    /// Of [`RankReceipt::bytes`], those in device memory.
    pub fn device_bytes(&self) -> u64 {
        self.tags.iter().map(|t| t.device_bytes).sum()
    }

    /// How far the probe moved: bytes freed by a sleep, or taken by a wakeup.
    pub fn probe_delta(&self, action: Action) -> i64 {
        Self::delta(self.before.measure(), self.after.measure(), action)
    }

    /// How far the resident host memory moved (as [`RankReceipt::probe_delta`]).
    pub fn host_delta(&self, action: Action) -> i64 {
        Self::delta(self.before.resident, self.after.resident, action)
    }

    /// How far this process's device memory moved, summed over its devices (as
    /// [`RankReceipt::probe_delta`]); `None` without a device reading before and after.
    pub fn device_delta(&self, action: Action) -> Option<i64> {
        let sum = |p: &Probe| p.devices.iter().map(|(_, b)| b).sum::<u64>();
        (!self.before.devices.is_empty() && !self.after.devices.is_empty())
            .then(|| Self::delta(sum(&self.before), sum(&self.after), action))
    }

    fn delta(before: u64, after: u64, action: Action) -> i64 {
        let (b, a) = (before as i64, after as i64);
        match action {
            Action::Sleep => b - a,
            Action::Wakeup | Action::Update | Action::Revert => a - b,
        }
    }
}

/// One frame of the control channel, in both directions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// The operation this frame belongs to (0 for shutdown and status).
    pub op_id: u64,
    /// Its phase.
    pub phase: Phase,
    /// The memory operation (prepare, commit and rollback).
    pub action: Option<Action>,
    /// The tags (requests).
    #[serde(default)]
    pub tags: Vec<String>,
    /// How to quiesce (prepare).
    #[serde(default)]
    pub mode: QuiesceMode,
    /// vLLM's sleep level of a sleep (prepare; the commit runs what was prepared).
    #[serde(default)]
    pub level: Option<u8>,
    /// The checkpoint a weight update loads (prepare).
    #[serde(default)]
    pub model: Option<String>,
    /// Safetensors files laid over `model` (prepare of an update from memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<String>,
    /// Request, or the outcome of an ACK.
    pub status: Status,
    /// What failed, with the peer's context (ACKs with a failure status).
    #[serde(default)]
    pub error: Option<String>,
    /// What the phase did to memory (ACKs of commit, rollback and status).
    #[serde(default)]
    pub receipt: Option<RankReceipt>,
}

impl Message {
    /// A request from rank 0.
    pub fn request(op_id: u64, phase: Phase, action: Option<Action>, tags: &[String]) -> Message {
        Message {
            op_id,
            phase,
            action,
            tags: tags.to_vec(),
            mode: QuiesceMode::default(),
            level: None,
            model: None,
            tensors: Vec::new(),
            status: Status::Request,
            error: None,
            receipt: None,
        }
    }

    /// The ACK of `self` with `status`.
    pub fn ack(&self, status: Status) -> Message {
        Message {
            op_id: self.op_id,
            phase: self.phase,
            action: self.action,
            tags: Vec::new(),
            mode: self.mode,
            level: self.level,
            model: None,
            tensors: Vec::new(),
            status,
            error: None,
            receipt: None,
        }
    }

    /// Whether this frame answers a request of `op_id` in `phase`.
    pub fn answers(&self, op_id: u64, phase: Phase) -> bool {
        self.status != Status::Request && self.op_id == op_id && self.phase == phase
    }

    /// Decodes a frame's body (its JSON). A body that is not a whole frame still gives its
    /// operation id and phase when they can be read, so the receiver can answer a failure
    /// to the right request.
    ///
    /// # Errors
    /// `Undecodable` with what could be read and why the rest could not.
    pub fn decode(body: &[u8]) -> Result<Message, Undecodable> {
        serde_json::from_slice(body).map_err(|e| {
            let partial: Option<serde_json::Value> = serde_json::from_slice(body).ok();
            let field = |name: &str| partial.as_ref().and_then(|v| v.get(name)).cloned();
            Undecodable {
                op_id: field("op_id").and_then(|v| v.as_u64()),
                phase: field("phase").and_then(|v| serde_json::from_value(v).ok()),
                reason: format!("undecodable frame of {} bytes: {e}", body.len()),
            }
        })
    }

    /// Encodes the frame: a 4-byte little-endian length, then JSON.
    pub fn encode(&self) -> Vec<u8> {
        // Plain structs, enums and strings: serializing them cannot fail. Were it to, the empty
        // body is a frame the receiver rejects as undecodable, naming this rank.
        let body = serde_json::to_vec(self).unwrap_or_default();
        let mut out = Vec::with_capacity(4 + body.len());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }
}

/// A frame whose body is not a [`Message`]: what could be read of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Undecodable {
    /// The operation id, when the body has a readable one.
    pub op_id: Option<u64>,
    /// The phase, when the body has a readable one.
    pub phase: Option<Phase>,
    /// Why it did not decode.
    pub reason: String,
}

/// What a peer receives on the control channel: a request, or a frame that arrived whole
/// but did not decode (the connection is still good: the listener answers it with a failure
/// rather than hanging up).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Received {
    /// A decoded frame (boxed: far larger than the other variant).
    Frame(Box<Message>),
    /// A frame that did not decode.
    Undecodable(Undecodable),
}
