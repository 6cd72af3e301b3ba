//! Private failpoints (feature `failpoints`), in the syntax of `mesh::failpoint`.
//!
//! vmm does not depend on mesh, so it reads `TPCTL_FAILPOINTS` itself and acts only on
//! entries whose point starts with `vmm.`: `vmm.POINT=error[@RANK][#SKIP]` or
//! `vmm.POINT=delay(MS)[@RANK][#SKIP]` (`@RANK`: only in the process whose `RANK` environment
//! variable is RANK). Points: `vmm.map` (before each allocation is mapped by a
//! materialize) and `vmm.unmap` (before each allocation is unmapped by a release).

use crate::error::Result;

/// Passes through the failpoint `point`.
#[inline(always)]
pub(crate) fn hit(point: &'static str) -> Result<()> {
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

#[cfg(feature = "failpoints")]
mod active {
    use crate::error::{Error, Result};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    enum Action {
        Error,
        Delay(u64),
    }

    struct Armed {
        point: String,
        action: Action,
        skip: u64,
        hits: AtomicU64,
    }

    /// The armed failpoint of `entry`; `Some(None)` when it is for another rank; `None` when
    /// it does not parse.
    fn parse(entry: &str) -> Option<Option<Armed>> {
        let (point, rest) = entry.split_once('=')?;
        let point = point.trim();
        if !point.starts_with("vmm.") {
            return None;
        }
        let (action, skip) = match rest.split_once('#') {
            Some((a, s)) => (a, s.trim().parse().ok()?),
            None => (rest, 0),
        };
        let action = match action.split_once('@') {
            Some((a, rank)) => {
                let rank: usize = rank.trim().parse().ok()?;
                let here = std::env::var("RANK").ok().and_then(|r| r.parse::<usize>().ok());
                if here.unwrap_or(0) != rank {
                    return Some(None);
                }
                a
            }
            None => action,
        };
        let action = match action.trim() {
            "error" => Action::Error,
            a => Action::Delay(a.strip_prefix("delay(")?.strip_suffix(')')?.trim().parse().ok()?),
        };
        Some(Some(Armed { point: point.to_owned(), action, skip, hits: AtomicU64::new(0) }))
    }

    fn armed() -> &'static [Armed] {
        static ARMED: OnceLock<Vec<Armed>> = OnceLock::new();
        ARMED.get_or_init(|| {
            let spec = std::env::var("TPCTL_FAILPOINTS").unwrap_or_default();
            let mut armed = Vec::new();
            for entry in spec.split(';').map(str::trim).filter(|e| e.starts_with("vmm.")) {
                match parse(entry) {
                    Some(a) => armed.extend(a),
                    // A mistyped spec in a fault-injection run must not silently test nothing.
                    None => tracing::error!(entry, "TPCTL_FAILPOINTS: cannot parse vmm entry"),
                }
            }
            armed
        })
    }

    pub(super) fn hit(point: &'static str) -> Result<()> {
        for armed in armed().iter().filter(|a| a.point == point) {
            if armed.hits.fetch_add(1, Ordering::Relaxed) < armed.skip {
                continue;
            }
            tracing::warn!(point, "failpoint fired");
            match armed.action {
                Action::Error => return Err(Error::Injected { point }),
                Action::Delay(ms) => std::thread::sleep(std::time::Duration::from_millis(ms)),
            }
        }
        Ok(())
    }
}
