//! Named fault-injection points, compiled in with the feature `failpoints`.
//!
//! A failpoint is a call to [`hit`] at a place where a real deployment can fail: a send, a
//! receive, a wait, a store call. Without the feature `hit` is an inlined `Ok(())`. With it, the
//! environment variable `TPCTL_FAILPOINTS` selects which points fire, on which rank and how:
//!
//! ```text
//! TPCTL_FAILPOINTS="shm.send=kill@1#3;store.get=error;tcp.recv=delay(200)"
//! ```
//!
//! Each entry is `POINT=ACTION[@RANK][#SKIP]`: `ACTION` is `error` (the call returns
//! [`Injected`]), `delay(MS)` (the call sleeps, then goes on), `kill` (the process exits at once
//! with code 137, like a SIGKILL, skipping destructors) or `panic`. `@RANK` limits the entry to
//! the process whose `RANK` variable (under `mpirun`, `OMPI_COMM_WORLD_RANK`) has that value; `#SKIP` lets the first `SKIP` hits pass, so a
//! peer can die in the middle of a collective rather than before it.

use std::fmt;

/// The error a failpoint with the action `error` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Injected {
    /// The failpoint that fired.
    pub point: String,
}

impl fmt::Display for Injected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "injected failure at failpoint `{}`", self.point)
    }
}

impl std::error::Error for Injected {}

/// The environment variable that configures failpoints.
pub const ENV: &str = "TPCTL_FAILPOINTS";

/// Passes through the failpoint `point`.
///
/// # Errors
/// Returns [`Injected`] when `TPCTL_FAILPOINTS` selects the action `error` for this point on
/// this rank (only with the feature `failpoints`).
#[inline(always)]
pub fn hit(point: &str) -> Result<(), Injected> {
    #[cfg(feature = "failpoints")]
    {
        active::hit(point)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = point;
        Ok(())
    }
}

/// Whether failpoints are compiled in.
pub const fn enabled() -> bool {
    cfg!(feature = "failpoints")
}

/// One parsed `POINT=ACTION[@RANK][#SKIP]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Failpoint name.
    pub point: String,
    /// What happens when it fires.
    pub action: Action,
    /// Only on this rank, when set.
    pub rank: Option<usize>,
    /// Hits that pass before the action fires.
    pub skip: u64,
}

/// What a failpoint does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Return [`Injected`].
    Error,
    /// Sleep this many milliseconds, then continue.
    Delay(u64),
    /// Exit the process at once with code 137.
    Kill,
    /// Panic.
    Panic,
}

/// Parses a `TPCTL_FAILPOINTS` value.
///
/// # Errors
/// Names the entry that does not parse and why.
pub fn parse(spec: &str) -> Result<Vec<Entry>, String> {
    spec.split(';').map(str::trim).filter(|s| !s.is_empty()).map(parse_entry).collect()
}

fn parse_entry(entry: &str) -> Result<Entry, String> {
    let bad = |why: &str| format!("{ENV}: entry `{entry}`: {why}");
    let (point, rest) = entry.split_once('=').ok_or_else(|| bad("expected POINT=ACTION"))?;
    let (rest, skip) = match rest.split_once('#') {
        Some((r, s)) => (r, s.trim().parse().map_err(|_| bad("#SKIP is not a whole number"))?),
        None => (rest, 0),
    };
    let (action, rank) = match rest.split_once('@') {
        Some((a, r)) => (a, Some(r.trim().parse().map_err(|_| bad("@RANK is not a rank"))?)),
        None => (rest, None),
    };
    let action = match action.trim() {
        "error" => Action::Error,
        "kill" => Action::Kill,
        "panic" => Action::Panic,
        a => {
            let ms = a
                .strip_prefix("delay(")
                .and_then(|a| a.strip_suffix(')'))
                .ok_or_else(|| bad("action must be error, kill, panic or delay(MS)"))?;
            Action::Delay(ms.trim().parse().map_err(|_| bad("delay(MS) needs milliseconds"))?)
        }
    };
    let point = point.trim();
    if point.is_empty() {
        return Err(bad("empty failpoint name"));
    }
    Ok(Entry { point: point.to_owned(), action, rank, skip })
}

#[cfg(feature = "failpoints")]
mod active {
    use super::{parse, Action, Entry, Injected, ENV};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    struct Armed {
        entry: Entry,
        hits: AtomicU64,
    }

    fn armed() -> &'static [Armed] {
        static ARMED: OnceLock<Vec<Armed>> = OnceLock::new();
        ARMED.get_or_init(|| {
            let Ok(spec) = std::env::var(ENV) else { return Vec::new() };
            let entries = parse(&spec).unwrap_or_else(|e| {
                // A mistyped spec in a fault-injection run must not silently test nothing.
                eprintln!("{e}");
                std::process::exit(2)
            });
            // torchrun's (and tpctl's) rank, or OpenMPI's under mpirun.
            let rank = ["RANK", "OMPI_COMM_WORLD_RANK"]
                .iter()
                .find_map(|var| std::env::var(var).ok())
                .and_then(|r| r.parse::<usize>().ok());
            entries
                .into_iter()
                .filter(|e| e.rank.is_none() || e.rank == rank)
                .map(|entry| Armed { entry, hits: AtomicU64::new(0) })
                .collect()
        })
    }

    pub(super) fn hit(point: &str) -> Result<(), Injected> {
        for armed in armed().iter().filter(|a| a.entry.point == point) {
            if armed.hits.fetch_add(1, Ordering::Relaxed) < armed.entry.skip {
                continue;
            }
            tracing::warn!(point, action = ?armed.entry.action, "failpoint fired");
            match armed.entry.action {
                Action::Error => return Err(Injected { point: point.to_owned() }),
                Action::Delay(ms) => std::thread::sleep(std::time::Duration::from_millis(ms)),
                Action::Kill => {
                    // SIGKILL semantics: no destructors, no flushing, peers see a vanished rank.
                    std::process::exit(137)
                }
                Action::Panic => panic!("failpoint `{point}` fired"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        let got = parse("a=error; b=delay(25)@1 ;c=kill@0#3;d=panic#2").unwrap();
        assert_eq!(
            got,
            vec![
                Entry { point: "a".into(), action: Action::Error, rank: None, skip: 0 },
                Entry { point: "b".into(), action: Action::Delay(25), rank: Some(1), skip: 0 },
                Entry { point: "c".into(), action: Action::Kill, rank: Some(0), skip: 3 },
                Entry { point: "d".into(), action: Action::Panic, rank: None, skip: 2 },
            ]
        );
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn rejects_bad_entries_by_name() {
        for (spec, needle) in [
            ("a", "expected POINT=ACTION"),
            ("a=explode", "action must be"),
            ("a=delay(x)", "milliseconds"),
            ("a=error@x", "@RANK"),
            ("a=error#-1", "#SKIP"),
            ("=error", "empty failpoint name"),
        ] {
            let err = parse(spec).unwrap_err();
            assert!(err.contains(needle) && err.contains(spec), "{spec}: {err}");
        }
    }
}
