//! Who this process is in the world, read from the launcher's environment.
//!
//! Three launchers are understood, in this order of precedence: torchrun (and `tpctl` itself,
//! which sets the same names), Slurm (`srun`) and OpenMPI (`mpirun`). A value set by several
//! launchers must agree: a process that believes it is rank 1 while its neighbour believes the
//! same would hang the whole world, so a disagreement is an error that names both variables.

use crate::error::{Error, Result};

/// The store address used when a single rank runs alone.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// This process's place in the world and where to find the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the world.
    pub world_size: usize,
    /// Rank among the processes on this host, when the launcher said so (`LOCAL_RANK`). It
    /// selects the GPU; when it is `None` the caller's current device is kept.
    pub local_rank: Option<usize>,
    /// Number of ranks on this host, when the launcher said so (`LOCAL_WORLD_SIZE`).
    pub local_world_size: Option<usize>,
    /// Index of this host among the hosts of the job, when the launcher said so.
    pub node_rank: Option<usize>,
    /// Host of the store (rank 0), `MASTER_ADDR`.
    pub master_addr: String,
    /// Port of the store, `MASTER_PORT`; `0` (any free port) only for a single rank.
    pub master_port: u16,
}

/// The variable names one launcher uses for each quantity.
struct Launcher {
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
    node_rank: &'static str,
}

/// In order of precedence.
const LAUNCHERS: [Launcher; 3] = [
    Launcher {
        rank: "RANK",
        world: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_world: "LOCAL_WORLD_SIZE",
        node_rank: "GROUP_RANK",
    },
    Launcher {
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_world: "OMPI_COMM_WORLD_LOCAL_SIZE",
        node_rank: "OMPI_COMM_WORLD_NODE_RANK",
    },
    Launcher {
        rank: "SLURM_PROCID",
        world: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_world: "SLURM_NTASKS_PER_NODE",
        node_rank: "SLURM_NODEID",
    },
];

/// Slurm's older spelling of the tasks per node, e.g. `4` or `4(x2)`.
const SLURM_TASKS_PER_NODE: &str = "SLURM_TASKS_PER_NODE";

impl Rendezvous {
    /// A world of one: rank 0 of 1, the store on `127.0.0.1` at any free port, no `LOCAL_RANK`.
    pub fn single() -> Rendezvous {
        Rendezvous {
            rank: 0,
            world_size: 1,
            local_rank: None,
            local_world_size: None,
            node_rank: None,
            master_addr: DEFAULT_MASTER_ADDR.to_owned(),
            master_port: 0,
        }
    }

    /// Reads the rendezvous from the process environment.
    ///
    /// # Errors
    /// See [`Rendezvous::from_lookup`].
    pub fn from_env() -> Result<Rendezvous> {
        Rendezvous::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the rendezvous through `lookup`, which returns the value of an environment variable
    /// (tests pass a map).
    ///
    /// When no launcher variable is set at all the result is [`Rendezvous::single`] (with
    /// `LOCAL_RANK` and `MASTER_*` still honoured).
    ///
    /// # Errors
    /// - a launcher's rank is set without its world size or the other way round
    ///   ([`Error::MissingEnv`] naming the missing variable);
    /// - a number does not parse, the world size is zero, a rank is not below its world size
    ///   ([`Error::InvalidEnv`] naming the variable and its value);
    /// - a world of more than one rank without `MASTER_ADDR` or `MASTER_PORT`, or with
    ///   `MASTER_PORT=0`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Rendezvous> {
        let number = |var: &'static str| -> Result<Option<(&'static str, usize)>> {
            match lookup(var) {
                None => Ok(None),
                Some(value) => match value.trim().parse::<usize>() {
                    Ok(n) => Ok(Some((var, n))),
                    Err(_) => Err(Error::InvalidEnv {
                        var,
                        value,
                        reason: "expected a whole number".into(),
                    }),
                },
            }
        };

        // A launcher is present when it names a rank or a world size; then it must name both.
        // The innermost launcher describes this process: torchrun run under srun, or mpirun
        // under Slurm, leaves the outer launcher's variables describing the launcher itself.
        // So the first launcher present, in the order torchrun, OpenMPI, Slurm, is the one.
        let mut rank = Merged::default();
        let mut world = Merged::default();
        let mut local_rank = Merged::default();
        let mut local_world = Merged::default();
        let mut node_rank = Merged::default();
        for launcher in &LAUNCHERS {
            let r = number(launcher.rank)?;
            let w = number(launcher.world)?;
            match (r, w) {
                (None, None) => {}
                (Some((var, value)), None) => {
                    return Err(Error::MissingEnv {
                        var: launcher.world,
                        why: format!("{var}={value} is set, so the world size must be too"),
                    })
                }
                (None, Some((var, value))) => {
                    return Err(Error::MissingEnv {
                        var: launcher.rank,
                        why: format!("{var}={value} is set, so the rank must be too"),
                    })
                }
                (Some(_), Some(_)) if rank.value.is_some() => {
                    tracing::debug!(
                        rank_var = launcher.rank,
                        "an outer launcher's variables are set too; the inner launcher's win"
                    );
                }
                (Some(r), Some(w)) => {
                    rank.push(r)?;
                    world.push(w)?;
                    node_rank.push_opt(number(launcher.node_rank)?)?;
                    local_rank.push_opt(number(launcher.local_rank)?)?;
                    local_world.push_opt(if launcher.local_world == "SLURM_NTASKS_PER_NODE" {
                        slurm_tasks_per_node(&lookup, launcher.local_world)?
                    } else {
                        number(launcher.local_world)?
                    })?;
                }
            }
        }
        // `LOCAL_RANK` alone still picks the GPU of a single process.
        if rank.value.is_none() {
            local_rank.push_opt(number(LAUNCHERS[0].local_rank)?)?;
            local_world.push_opt(number(LAUNCHERS[0].local_world)?)?;
        }

        let (rank_var, rank) = rank.value.unwrap_or(("RANK", 0));
        let (world_var, world_size) = world.value.unwrap_or(("WORLD_SIZE", 1));
        if world_size == 0 {
            return Err(Error::InvalidEnv {
                var: world_var,
                value: "0".into(),
                reason: "a world needs at least one rank".into(),
            });
        }
        if rank >= world_size {
            return Err(Error::InvalidEnv {
                var: rank_var,
                value: rank.to_string(),
                reason: format!("rank is not below the world size {world_var}={world_size}"),
            });
        }
        if let Some((var, n)) = local_world.value {
            if n == 0 || n > world_size {
                return Err(Error::InvalidEnv {
                    var,
                    value: n.to_string(),
                    reason: format!(
                        "must be between 1 and the world size {world_var}={world_size}"
                    ),
                });
            }
            if let Some((lvar, l)) = local_rank.value {
                if l >= n {
                    return Err(Error::InvalidEnv {
                        var: lvar,
                        value: l.to_string(),
                        reason: format!("local rank is not below {var}={n}"),
                    });
                }
            }
        }

        let master_addr = match lookup("MASTER_ADDR") {
            Some(addr) if !addr.trim().is_empty() => addr.trim().to_owned(),
            Some(addr) => {
                return Err(Error::InvalidEnv {
                    var: "MASTER_ADDR",
                    value: addr,
                    reason: "empty host name".into(),
                })
            }
            None if world_size == 1 => DEFAULT_MASTER_ADDR.to_owned(),
            None => {
                return Err(Error::MissingEnv {
                    var: "MASTER_ADDR",
                    why: format!(
                        "a world of {world_size} ranks needs the host of the store (rank 0)"
                    ),
                })
            }
        };
        let master_port = match lookup("MASTER_PORT") {
            Some(value) => {
                let port = value.trim().parse::<u16>().map_err(|_| Error::InvalidEnv {
                    var: "MASTER_PORT",
                    value: value.clone(),
                    reason: "expected a TCP port (0 to 65535)".into(),
                })?;
                if port == 0 && world_size > 1 {
                    return Err(Error::InvalidEnv {
                        var: "MASTER_PORT",
                        value,
                        reason: format!(
                            "the {world_size} ranks cannot agree on a port chosen by the system"
                        ),
                    });
                }
                port
            }
            None if world_size == 1 => 0,
            None => {
                return Err(Error::MissingEnv {
                    var: "MASTER_PORT",
                    why: format!("a world of {world_size} ranks needs the port of the store"),
                })
            }
        };

        Ok(Rendezvous {
            rank,
            world_size,
            local_rank: local_rank.value.map(|(_, n)| n),
            local_world_size: local_world.value.map(|(_, n)| n),
            node_rank: node_rank.value.map(|(_, n)| n),
            master_addr,
            master_port,
        })
    }

    /// Whether every rank of the world runs on this host: a single rank, or a launcher that
    /// says the local world is the whole world.
    pub fn single_host(&self) -> bool {
        self.world_size == 1 || self.local_world_size == Some(self.world_size)
    }

    /// `MASTER_ADDR:MASTER_PORT`, the address of the store.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// The value of one quantity as the launchers present give it, in order of precedence.
#[derive(Default)]
struct Merged {
    value: Option<(&'static str, usize)>,
}

impl Merged {
    fn push(&mut self, (var, n): (&'static str, usize)) -> Result<()> {
        match self.value {
            None => self.value = Some((var, n)),
            Some((first, m)) if m != n => {
                return Err(Error::EnvConflict {
                    first,
                    first_value: m,
                    second: var,
                    second_value: n,
                })
            }
            Some(_) => {}
        }
        Ok(())
    }

    fn push_opt(&mut self, value: Option<(&'static str, usize)>) -> Result<()> {
        value.map_or(Ok(()), |v| self.push(v))
    }
}

/// Slurm's tasks per node: `SLURM_NTASKS_PER_NODE`, else the simple form of
/// `SLURM_TASKS_PER_NODE` (`4` or `4(x2)`, the same count on every node). A per-node list such as
/// `2(x3),1` gives no single count and is ignored.
fn slurm_tasks_per_node(
    lookup: &impl Fn(&str) -> Option<String>,
    primary: &'static str,
) -> Result<Option<(&'static str, usize)>> {
    if let Some(value) = lookup(primary) {
        return match value.trim().parse::<usize>() {
            Ok(n) => Ok(Some((primary, n))),
            Err(_) => Err(Error::InvalidEnv {
                var: primary,
                value,
                reason: "expected a whole number".into(),
            }),
        };
    }
    let Some(value) = lookup(SLURM_TASKS_PER_NODE) else { return Ok(None) };
    let trimmed = value.trim();
    if trimmed.contains(',') {
        tracing::debug!(value = trimmed, "{SLURM_TASKS_PER_NODE} differs between nodes; ignored");
        return Ok(None);
    }
    let count = match trimmed.split_once('(') {
        Some((count, repeat)) => {
            let ok = repeat
                .strip_prefix('x')
                .and_then(|r| r.strip_suffix(')'))
                .is_some_and(|r| r.parse::<usize>().is_ok());
            if ok {
                count
            } else {
                ""
            }
        }
        None => trimmed,
    };
    match count.parse::<usize>() {
        Ok(n) => Ok(Some((SLURM_TASKS_PER_NODE, n))),
        Err(_) => Err(Error::InvalidEnv {
            var: SLURM_TASKS_PER_NODE,
            value,
            reason: "expected a count such as `4` or `4(x2)`".into(),
        }),
    }
}

#[cfg(test)]
mod tests;

/// A loopback port nobody listens on now, for a job's master port: picked below the kernel's
/// ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), so no outgoing connection of
/// this host can take it between the pick and rank 0's bind, as one could a port the kernel
/// handed out. Successive calls in a process try different ports; falls back to a kernel-chosen
/// port when none below the range is free.
///
/// # Errors
/// Not even a kernel-chosen port can be bound.
pub fn free_master_port() -> std::io::Result<u16> {
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (low, span) = (10_000, ephemeral.saturating_sub(10_000).max(1));
    let seed = std::process::id().wrapping_mul(2_654_435_761);
    for _ in 0..1000 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = low + seed.wrapping_add(n.wrapping_mul(7919)) % span;
        if let Ok(port) = u16::try_from(port) {
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
