//! From `tpctl serve`'s flags to a model host: each model's deployment gets the launch flags
//! the models share (its own `tp` / `cp` from a `[[models]]` table), the budget is resolved
//! against the host's memory, and names already taken are refused before anything starts.

use super::{table::MemoryBudget, HostSpec, ModelSpec};
use crate::config::{HostedModel, KvMemory, LaunchFlags};
use crate::control::paths;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// What a server of several models takes beyond the launch flags.
#[derive(Clone, Debug)]
pub struct HostArgs {
    /// The models (from `--model NAME=PATH` or the config's `[[models]]`).
    pub models: Vec<HostedModel>,
    /// `--memory-budget` or `[server] memory_budget` (default: 0.9 of the host's memory).
    pub budget: Option<MemoryBudget>,
    /// `[server] asleep_wait_timeout`: how long a request waits for its model, seconds.
    pub asleep_wait_s: f64,
    /// `[server] drain_timeout`: how long a model that must sleep waits for its running
    /// requests before it pauses them, seconds.
    pub drain_s: f64,
    /// The address of the API.
    pub listen: String,
    /// Required bearer token, if any.
    pub api_key: Option<String>,
    /// The config file, which every model's deployment reads too.
    pub config: Option<PathBuf>,
    /// `--chat-template`, for every model.
    pub chat_template: Option<PathBuf>,
    /// `--deployment`: the host's name (default `tpctl-PID`); each model's is this, a dash
    /// and its name.
    pub deployment: Option<String>,
    /// `--served-model-name`, refused: each model has its name.
    pub served_model_name: Option<String>,
}

/// Runs a model host for `args` with the shared launch `flags`; `verbose` and `quiet` are the
/// command's. Returns the exit code.
///
/// # Errors
/// A flag that does not fit several models, a name already running, a model that does not
/// start, a budget that cannot hold the models, or an API that cannot serve.
pub fn serve(flags: &LaunchFlags, args: HostArgs, verbose: u8, quiet: bool) -> Result<i32> {
    if args.served_model_name.is_some() {
        bail!("--served-model-name names one model: with several, give each --model NAME=PATH");
    }
    if flags.nnodes > 1 {
        bail!(
            "a server of several models runs on one node: --nnodes {} is not supported with several --model",
            flags.nnodes
        );
    }
    let wait = args.asleep_wait_s;
    if !(wait.is_finite() && wait >= 0.0) {
        bail!("[server] asleep_wait_timeout = {wait}: expected seconds, 0 or more");
    }
    let drain = args.drain_s;
    if !(drain.is_finite() && drain >= 0.0) {
        bail!("[server] drain_timeout = {drain}: expected seconds, 0 or more");
    }
    let deployment = args.deployment.clone().unwrap_or_else(paths::default_name);
    // The host's own socket, then each model's.
    let names = std::iter::once((deployment.clone(), "the host".to_owned())).chain(
        args.models
            .iter()
            .map(|m| (format!("{deployment}-{}", m.name), format!("model `{}`", m.name))),
    );
    for (name, whose) in names {
        let socket = paths::socket_path(&paths::runtime_dir(), &name)
            .with_context(|| format!("{whose}: its deployment's name"))?;
        if paths::occupant(&socket) == paths::Occupant::Live {
            bail!(
                "deployment `{name}` is already running (control socket {}): give another --deployment name, or stop it with `tpctl stop --deployment {name}`",
                socket.display()
            );
        }
    }
    let total = super::host_total_bytes().context("reading the host's memory")?;
    let budget_rule = args.budget.unwrap_or(MemoryBudget::Fraction(0.9));
    let budget = budget_rule.bytes(total);
    let shared = shared_flags(flags, &args);
    let verbosity = if quiet {
        vec!["-q".to_owned()]
    } else {
        (0..verbose.min(2)).map(|_| "-v".to_owned()).collect()
    };
    let models = args
        .models
        .into_iter()
        .map(|m| {
            let mut args = shared.clone();
            for (flag, value) in [("--tp", m.tp.or(flags.tp)), ("--cp", m.cp.or(flags.cp))] {
                if let Some(v) = value {
                    args.extend([flag.to_owned(), v.to_string()]);
                }
            }
            ModelSpec {
                name: m.name,
                model: m.model,
                args,
                pinned: m.pinned,
                sleep_level: m.sleep_level,
                env: m.env.into_iter().collect(),
            }
        })
        .collect();
    super::run(HostSpec {
        models,
        deployment,
        listen: args.listen,
        api_key: args.api_key,
        budget,
        budget_rule,
        wait: Duration::from_secs_f64(wait.min(1e9)),
        drain: Duration::from_secs_f64(drain.min(1e9)),
        verbosity,
        quiet,
    })
}

/// The flags every model's `tpctl serve` gets: the config file, then each launch flag given.
fn shared_flags(flags: &LaunchFlags, args: &HostArgs) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(config) = &args.config {
        out.push(config.to_string_lossy().into_owned());
    }
    let mut flag = |name: &str, value: Option<String>| {
        if let Some(v) = value {
            out.extend([format!("--{name}"), v]);
        }
    };
    flag("threads", flags.threads.map(|v| v.to_string()));
    flag("max-model-len", flags.max_model_len.map(|v| v.to_string()));
    flag(
        "kv-cache-memory",
        flags.kv_cache_memory.map(|m| match m {
            KvMemory::Bytes(b) => b.to_string(),
            KvMemory::Fraction(f) => f.to_string(),
        }),
    );
    flag("max-num-seqs", flags.max_num_seqs.map(|v| v.to_string()));
    flag("device", flags.device.and_then(|d| value_name(&d)));
    flag("dtype", flags.dtype.and_then(|d| value_name(&d)));
    flag("backend", flags.backend.map(|b| b.to_string()));
    flag("chat-template", args.chat_template.as_ref().map(|p| p.to_string_lossy().into_owned()));
    if flags.no_prefix_caching {
        out.push("--no-prefix-caching".into());
    }
    if flags.preallocate_sleep_memory {
        out.push("--preallocate-sleep-memory".into());
    }
    out
}

/// A value's name on the command line.
fn value_name<T: clap::ValueEnum>(value: &T) -> Option<String> {
    value.to_possible_value().map(|p| p.get_name().to_owned())
}
