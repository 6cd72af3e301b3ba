//! The model host's bookkeeping, free of processes and sockets: each model's state, its memory
//! and its use, and the arithmetic of the memory budget (which models must sleep before
//! another wakes, and whether the budget can hold every model at all).
//!
//! Memory is counted per model as two measured numbers: what its ranks keep resident while
//! asleep (`asleep_bytes`: the runtime, the tokenizer, mapped files), and what a wakeup brings
//! back (`swap_bytes`: the bytes its sleep released, the weights and the KV cache). A model
//! awake, or in the middle of a swap, counts both; one asleep counts the first; a failed one,
//! whose ranks are gone, nothing. The budget holds when the sum stays within it, so a model
//! wakes only after enough others slept: never both resident beyond the budget.

use crate::control::render::bytes;
use std::collections::BTreeMap;
use std::fmt;

/// Where a model is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Its deployment is starting (the model loads).
    Loading,
    /// Serving.
    Awake,
    /// Its memory is released; a request wakes it.
    Asleep {
        /// The sleep level it was put to sleep at (1: weights kept in a backup, 2: reloaded
        /// from the checkpoint); `None` when it was put to sleep outside the host (`tpctl
        /// sleep --deployment HOST-NAME`), whose level the deployment does not tell.
        level: Option<u8>,
    },
    /// Being woken.
    Waking,
    /// Being put to sleep.
    Sleeping,
    /// Its deployment failed (a rank died, or a swap could not be rolled back); the reason. A
    /// request for it starts it again (see [`Entry::restartable`]).
    Failed(String),
}

impl State {
    /// Whether the model holds its swappable memory now (or is about to, or still does).
    fn holds_memory(&self) -> bool {
        matches!(self, State::Loading | State::Awake | State::Waking | State::Sleeping)
    }

    /// The state's name in `/v1/models`: `awake`, `asleep`, `waking`, `sleeping`,
    /// `loading` or `failed`.
    pub fn name(&self) -> &'static str {
        match self {
            State::Loading => "loading",
            State::Awake => "awake",
            State::Asleep { .. } => "asleep",
            State::Waking => "waking",
            State::Sleeping => "sleeping",
            State::Failed(_) => "failed",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            State::Asleep { level: Some(level) } => write!(f, "asleep at level {level}"),
            State::Asleep { level: None } => f.write_str("asleep (put to sleep outside the host)"),
            State::Failed(why) => write!(f, "failed: {why}"),
            other => f.write_str(other.name()),
        }
    }
}

/// One model of the host, as the table sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The model's name in the API.
    pub name: String,
    /// Where it is.
    pub state: State,
    /// Never put to sleep to make room.
    pub pinned: bool,
    /// The table's clock when a request last used it (0: never).
    pub last_used: u64,
    /// Requests admitted and not answered yet.
    pub in_flight: usize,
    /// Admits no new request: a swap waits for the running ones to finish to put it to sleep.
    pub draining: bool,
    /// Resident bytes of its ranks while asleep.
    pub asleep_bytes: u64,
    /// Bytes a wakeup brings back (what its sleep released).
    pub swap_bytes: u64,
    /// Whether a request for it may restart its deployment once it failed (not after a
    /// restart failed: the next request would only fail the same way, slowly).
    pub restartable: bool,
    /// Bytes a level-1 sleep keeps in a backup in host memory (its weights).
    pub backup_bytes: u64,
    /// Asleep with requests paused by a sleep that did not wait for them (keep): it wakes
    /// for them as soon as there is room.
    pub kept: bool,
    /// The checkpoint its weights come from now, as its deployment last told.
    pub checkpoint: String,
    /// Resident bytes per device (`host`, then each GPU) as its ranks last measured them: at
    /// its last sleep or wakeup, or its deployment's status (read every second).
    pub measured: BTreeMap<String, u64>,
    /// Per GPU (by the probes' id) the model uses: device bytes its ranks keep asleep (the
    /// CUDA contexts), as `asleep_bytes` is for the host. Empty on the CPU.
    pub gpu_asleep: BTreeMap<String, u64>,
    /// Per GPU: device bytes a wakeup brings back there, as `swap_bytes` is for the host.
    pub gpu_swap: BTreeMap<String, u64>,
}

impl Entry {
    /// A model starting to load, its memory not measured yet.
    pub fn loading(name: &str, pinned: bool) -> Entry {
        Entry {
            name: name.to_owned(),
            state: State::Loading,
            pinned,
            last_used: 0,
            in_flight: 0,
            draining: false,
            asleep_bytes: 0,
            swap_bytes: 0,
            restartable: true,
            backup_bytes: 0,
            kept: false,
            checkpoint: String::new(),
            measured: BTreeMap::new(),
            gpu_asleep: BTreeMap::new(),
            gpu_swap: BTreeMap::new(),
        }
    }

    /// The bytes the model counts against the host's budget in its current state.
    pub fn resident(&self) -> u64 {
        self.resident_on(HOST)
    }

    /// What its ranks keep on `place` ([`HOST`] or a GPU's id) while asleep.
    fn asleep_on(&self, place: &str) -> u64 {
        if place == HOST {
            self.asleep_bytes
        } else {
            self.gpu_asleep.get(place).copied().unwrap_or(0)
        }
    }

    /// What a wakeup brings back on `place`.
    fn swap_on(&self, place: &str) -> u64 {
        if place == HOST {
            self.swap_bytes
        } else {
            self.gpu_swap.get(place).copied().unwrap_or(0)
        }
    }

    /// The bytes the model counts against `place`'s budget in its current state.
    fn resident_on(&self, place: &str) -> u64 {
        match &self.state {
            State::Failed(_) => 0,
            s if s.holds_memory() => self.asleep_on(place) + self.swap_on(place),
            _ => self.asleep_on(place),
        }
    }
}

/// The place of the host's memory in the budget's arithmetic; each GPU is a place of its own,
/// named by its id in the ranks' probes (its UUID).
pub const HOST: &str = "host";

/// What must happen before a request for a model can be admitted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// It is awake and admits requests.
    Ready,
    /// Put these models to sleep (all idle, least recently used first), then wake it.
    Swap {
        /// Indices of the models to put to sleep first (empty: it fits as is).
        evict: Vec<usize>,
    },
    /// Its deployment failed: put these models to sleep, then start it again (it loads
    /// awake, so it needs room for all it holds).
    Restart {
        /// Indices of the models to put to sleep first (empty: it fits as is).
        evict: Vec<usize>,
    },
    /// The models that must sleep to make room have requests running: stop admitting to
    /// them (`drain`), wait until they are idle, then plan again.
    Drain {
        /// Indices of the models to put to sleep first, busy ones included.
        evict: Vec<usize>,
    },
    /// It is in the middle of something (loading, a swap, draining for another model's
    /// wakeup): wait and plan again. The reason, for a 503 when the wait runs out.
    Wait(String),
    /// It cannot be served: failed, or the budget cannot make room for it. The reason, for
    /// a 503.
    Unavailable(String),
}

/// Every model of the host and the budget they share.
#[derive(Clone, Debug)]
pub struct Table {
    /// The most bytes the models may hold together in host memory.
    pub budget: u64,
    /// The most bytes the models may hold together on each GPU they use, by its id: the same
    /// `--memory-budget` as a share of that GPU, or the same bytes.
    pub gpu_budgets: BTreeMap<String, u64>,
    /// The models, in the order they were given.
    pub models: Vec<Entry>,
    /// The models are still being started and measured: `/health` says `loading` and the
    /// control socket follows no model yet. A model measured (asleep) is woken by a request
    /// as at any time: the one loading holds the swap turn, and those not started yet hold
    /// nothing.
    pub starting: bool,
    /// A logical clock: each admitted request ticks it, so "least recently used" does not
    /// depend on the wall clock's resolution.
    clock: u64,
}

impl Table {
    /// A table of `models` sharing `budget` bytes.
    pub fn new(budget: u64, models: Vec<Entry>) -> Table {
        Table { budget, gpu_budgets: BTreeMap::new(), models, starting: false, clock: 0 }
    }

    /// The index of the model named `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        self.models.iter().position(|m| m.name == name)
    }

    /// Bytes every model holds together now.
    pub fn resident(&self) -> u64 {
        self.models.iter().map(Entry::resident).sum()
    }

    /// What a request for model `target` needs before it is admitted.
    pub fn plan(&self, target: usize) -> Plan {
        let model = &self.models[target];
        match &model.state {
            State::Awake if !model.draining => return Plan::Ready,
            State::Awake => {
                // Draining for another model's wakeup: wait for that swap.
                return Plan::Wait(format!(
                    "model `{}` is about to sleep to make room for another",
                    model.name
                ));
            }
            State::Asleep { .. } => {}
            State::Failed(why) if !model.restartable => {
                return Plan::Unavailable(format!("model `{}` failed: {why}", model.name))
            }
            // A start loads it awake: it needs room for all it holds (see `need` below).
            State::Failed(_) => {}
            State::Loading | State::Waking | State::Sleeping => {
                return Plan::Wait(format!("model `{}` is {}", model.name, model.state))
            }
        }
        let restart = matches!(model.state, State::Failed(_));
        // Every place with a budget: the host, then each GPU.
        let places: Vec<(&str, u64)> = std::iter::once((HOST, self.budget))
            .chain(self.gpu_budgets.iter().map(|(id, b)| (id.as_str(), *b)))
            .collect();
        let need = |place: &str| match &model.state {
            State::Failed(_) => model.asleep_on(place) + model.swap_on(place),
            _ => model.swap_on(place),
        };
        let mut held: Vec<u64> = places
            .iter()
            .map(|(p, _)| self.models.iter().map(|m| m.resident_on(p)).sum())
            .collect();
        let short = |held: &[u64]| {
            places.iter().zip(held).position(|(&(p, budget), &h)| h + need(p) > budget)
        };
        if short(&held).is_none() {
            return if restart {
                Plan::Restart { evict: Vec::new() }
            } else {
                Plan::Swap { evict: Vec::new() }
            };
        }
        // Idle models first, then busy ones; least recently used first within each. A model
        // that frees nothing where room is short (another GPU's) is left awake.
        let mut candidates: Vec<usize> = (0..self.models.len())
            .filter(|&i| {
                let m = &self.models[i];
                i != target && !m.pinned && m.state == State::Awake
            })
            .collect();
        candidates.sort_by_key(|&i| (self.models[i].in_flight > 0, self.models[i].last_used));
        let mut evict = Vec::new();
        for i in candidates {
            let Some(k) = short(&held) else { break };
            let m = &self.models[i];
            if m.swap_on(places[k].0) == 0 {
                continue;
            }
            evict.push(i);
            for ((p, _), h) in places.iter().zip(held.iter_mut()) {
                *h = h.saturating_sub(m.swap_on(p));
            }
        }
        if let Some(k) = short(&held) {
            // A model in the middle of a swap (another request's) may make room once it is
            // done: wait for it rather than refuse.
            let moving = self.models.iter().enumerate().find(|(i, m)| {
                *i != target && matches!(m.state, State::Loading | State::Waking | State::Sleeping)
            });
            if let Some((_, m)) = moving {
                return Plan::Wait(format!(
                    "model `{}` waits for room: model `{}` is {}",
                    model.name, m.name, m.state
                ));
            }
            let (place, budget) = places[k];
            let (need, held) = (need(place), held[k]);
            return Plan::Unavailable(if place == HOST {
                format!(
                    "model `{}` needs {} to wake; with every other model that can sleep asleep, {} of the --memory-budget {} stays held, leaving {}",
                    model.name,
                    bytes(need),
                    bytes(held),
                    bytes(budget),
                    bytes(budget.saturating_sub(held)),
                )
            } else {
                format!(
                    "model `{}` needs {} on GPU {place} to wake; with every other model that can sleep asleep, {} of that GPU's --memory-budget {} stays held, leaving {}",
                    model.name,
                    bytes(need),
                    bytes(held),
                    bytes(budget),
                    bytes(budget.saturating_sub(held)),
                )
            });
        }
        if evict.iter().any(|&i| self.models[i].in_flight > 0) {
            Plan::Drain { evict }
        } else if restart {
            Plan::Restart { evict }
        } else {
            Plan::Swap { evict }
        }
    }

    /// Admits a request for `target` when it is ready: counts it in flight and marks the
    /// model used now. Returns whether it was admitted.
    pub fn admit(&mut self, target: usize) -> bool {
        if self.plan(target) != Plan::Ready {
            return false;
        }
        self.clock += 1;
        let model = &mut self.models[target];
        model.in_flight += 1;
        model.last_used = self.clock;
        true
    }

    /// A request for `target` was answered.
    pub fn finish(&mut self, target: usize) {
        let model = &mut self.models[target];
        model.in_flight = model.in_flight.saturating_sub(1);
    }
}

/// Refuses a budget that cannot hold some model awake even with every other model asleep
/// (pinned ones awake), naming the model and the numbers: the host's `budget`, then each GPU's
/// in `gpu_budgets`. `models` are those measured so far: a refusal from part of them stands,
/// since more models only take more.
///
/// # Errors
/// The message for the person who chose the budget.
pub fn check_fits(
    budget: u64,
    gpu_budgets: &BTreeMap<String, u64>,
    models: &[Entry],
) -> Result<(), String> {
    std::iter::once((HOST, budget))
        .chain(gpu_budgets.iter().map(|(id, b)| (id.as_str(), *b)))
        .try_for_each(|(place, budget)| check_place(place, budget, models))
}

/// [`check_fits`] for one place: the host, or a GPU.
fn check_place(place: &str, budget: u64, models: &[Entry]) -> Result<(), String> {
    let on = if place == HOST { String::new() } else { format!(" on GPU {place}") };
    let asleep: u64 = models.iter().map(|m| m.asleep_on(place)).sum();
    let pinned: u64 = models.iter().filter(|m| m.pinned).map(|m| m.swap_on(place)).sum();
    let base = asleep + pinned;
    if base > budget {
        return Err(format!(
            "--memory-budget {}{on} cannot hold the models asleep: their ranks keep {} resident asleep{}; give at least {}",
            bytes(budget),
            bytes(asleep),
            if pinned > 0 { format!(" and the pinned models {} awake", bytes(pinned)) } else { String::new() },
            bytes(base),
        ));
    }
    let largest = models.iter().filter(|m| !m.pinned).max_by_key(|m| m.swap_on(place));
    if let Some(m) = largest.filter(|m| base + m.swap_on(place) > budget) {
        return Err(format!(
            "--memory-budget {}{on} cannot hold model `{}` awake: it needs {} to wake beside the {} every model keeps asleep{}, {} in all; give at least that",
            bytes(budget),
            m.name,
            bytes(m.swap_on(place)),
            bytes(asleep),
            if pinned > 0 { format!(" and {} of pinned models", bytes(pinned)) } else { String::new() },
            bytes(base + m.swap_on(place)),
        ));
    }
    Ok(())
}

/// The level a model whose level is `configured` sleeps at, when its level-1 backup takes
/// `backup` bytes of host memory and `available` are free (`MemAvailable`, or why it could
/// not be read): level 2 instead of 1 when the backup does not fit (or the room is unknown),
/// with the reason for the log.
pub fn sleep_level(
    configured: u8,
    backup: u64,
    available: Result<u64, String>,
) -> (u8, Option<String>) {
    if configured != 1 {
        return (configured, None);
    }
    match available {
        Ok(free) if backup <= free => (1, None),
        Ok(free) => (
            2,
            Some(format!(
                "its level-1 backup needs {} of host memory and only {} is available (MemAvailable); its weights reload from the checkpoint at the wakeup",
                bytes(backup),
                bytes(free)
            )),
        ),
        Err(why) => (
            2,
            Some(format!(
                "the host memory its level-1 backup needs ({}) cannot be checked ({why}); its weights reload from the checkpoint at the wakeup",
                bytes(backup)
            )),
        ),
    }
}

/// The memory budget as given: bytes, or a share of the host's memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryBudget {
    /// Bytes.
    Bytes(u64),
    /// A share of the host's memory, in (0, 1].
    Fraction(f64),
}

impl MemoryBudget {
    /// The bytes of the budget on a host of `total` bytes of memory.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            MemoryBudget::Bytes(b) => b,
            MemoryBudget::Fraction(f) => (f * total as f64) as u64,
        }
    }
}

impl std::str::FromStr for MemoryBudget {
    type Err = String;

    /// `0.9` (a share of the host's memory), `1073741824` (bytes), `512MiB`, `4GiB`, `2GB`.
    fn from_str(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let bad = || {
            format!(
                "{text:?} is not a memory budget: give bytes (1073741824, 512MiB, 4GiB) or a share of the host's memory (0.9)"
            )
        };
        let units = [("KiB", 1u64 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40)];
        let units =
            units.into_iter().chain([("KB", 1000), ("MB", 1_000_000), ("GB", 1_000_000_000)]);
        let budget = match units.into_iter().find_map(|(u, s)| Some((t.strip_suffix(u)?, s))) {
            Some((n, scale)) => {
                let n: f64 = n.trim().parse().map_err(|_| bad())?;
                MemoryBudget::Bytes((n * scale as f64) as u64)
            }
            None => match t.parse::<u64>() {
                Ok(b) => MemoryBudget::Bytes(b),
                Err(_) => MemoryBudget::Fraction(t.parse::<f64>().map_err(|_| bad())?),
            },
        };
        match budget {
            MemoryBudget::Bytes(0) => Err(format!("{}: a budget of 0 bytes holds nothing", bad())),
            MemoryBudget::Fraction(f) if !(f > 0.0 && f <= 1.0) => {
                Err(format!("{}: a share of the host's memory is in (0, 1], not {f}", bad()))
            }
            ok => Ok(ok),
        }
    }
}

impl<'de> serde::Deserialize<'de> for MemoryBudget {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use crate::config::MemoryAmount;
        match MemoryAmount::deserialize(d)? {
            MemoryAmount::Int(b) => b.to_string().parse(),
            MemoryAmount::Float(f) => f.to_string().parse(),
            MemoryAmount::Text(t) => t.parse(),
        }
        .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests;
