//! One rank of a multi-process sleep/wakeup test: joins the world from the torchrun
//! environment, allocates `TPCTL_SLEEP_MIB` MiB (default 64) per tag (`weights`, `kv_cache`)
//! through vmm, fills and hashes them, starts the control plane, and runs the scenario named by
//! `TPCTL_SCENARIO`:
//!
//! - `cycle`: rank 0 sleeps both tags with verification, then wakes them up; every rank then
//!   checks its bytes against the hash taken before.
//! - `fail`: rank 0 sleeps both tags and expects an error (a failpoint kills a peer); every
//!   surviving rank then checks that its memory is awake and intact.
//!
//! Lines printed: rank 0 prints `receipt rank=R action=A bytes=B before=X after=Y` per rank
//! and `error: MESSAGE`, `outcome=O`, `state=S` for a failed operation; every surviving rank
//! prints `awake intact` after its check, then `ok` last, or `fatal: MESSAGE` with exit code 3.
#![forbid(unsafe_code)]

use session::sleep::{
    self, ControlPlane, CoordinatorOptions, Idle, OpOptions, OpReceipt, RankMemory, VmmMemory,
};
use std::sync::Arc;
use std::time::Duration;
use vmm::{Allocation, BackupStore, Manager, Policy, Tag};

const TIMEOUT: Duration = Duration::from_secs(60);

fn fnv(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fn main() {
    let rank = std::env::var("RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0usize);
    let spill = std::env::temp_dir().join(format!("tpctl-sleep-rank-{}", std::process::id()));
    let result = run(rank, &spill);
    std::fs::remove_dir_all(&spill).ok();
    match result {
        Ok(()) => println!("ok"),
        Err(e) => {
            println!("fatal: {e}");
            std::process::exit(3);
        }
    }
}

fn print_receipt(r: &OpReceipt) {
    for rr in &r.ranks {
        println!(
            "receipt rank={} action={} bytes={} before={} after={} elapsed_us={}",
            rr.rank,
            r.action,
            rr.bytes(),
            rr.before.measure(),
            rr.after.measure(),
            rr.elapsed_us
        );
    }
}

/// Checks that every allocation is materialized and holds the bytes it held at the start.
fn check_intact(allocs: &[(Allocation, u64)]) -> Result<(), String> {
    for (a, hash) in allocs {
        let guard = a.read().map_err(|e| format!("tag {}: {e}", a.tag()))?;
        if fnv(&guard) != *hash {
            return Err(format!("tag {}: contents differ from before the sleep", a.tag()));
        }
    }
    println!("awake intact");
    Ok(())
}

fn run(rank: usize, spill: &std::path::Path) -> Result<(), String> {
    let scenario = std::env::var("TPCTL_SCENARIO").unwrap_or_default();
    let mib: usize =
        std::env::var("TPCTL_SLEEP_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let rv = mesh::Rendezvous::from_env().map_err(|e| e.to_string())?;
    let (_server, store) = mesh::rendezvous_store(&rv, TIMEOUT).map_err(|e| e.to_string())?;

    let manager = Arc::new(Manager::builder().spill_dir(spill).build().map_err(|e| e.to_string())?);
    let mut allocs = Vec::new();
    for (i, tag) in [Tag::WEIGHTS, Tag::KV_CACHE].into_iter().enumerate() {
        let a = manager
            .allocate(tag, mib << 20, Policy::Backup(BackupStore::Spill))
            .map_err(|e| e.to_string())?;
        {
            let mut g = a.write().map_err(|e| e.to_string())?;
            for (j, b) in g.iter_mut().enumerate() {
                *b = (j as u64).wrapping_mul(2654435761).wrapping_add((rank * 7 + i) as u64) as u8
                    ^ (j >> 12) as u8;
            }
        }
        let hash = fnv(&a.read().map_err(|e| e.to_string())?);
        allocs.push((a, hash));
    }
    let memory: Arc<dyn RankMemory> = Arc::new(VmmMemory::new(manager.clone(), None));
    let plane = sleep::start(
        &store,
        rank,
        rv.world_size,
        "127.0.0.1",
        memory,
        Arc::new(Idle),
        CoordinatorOptions { ack_timeout: Duration::from_secs(30) },
        TIMEOUT,
    )
    .map_err(|e| e.to_string())?;
    let tags = vec!["weights".to_string(), "kv_cache".to_string()];
    match plane {
        ControlPlane::Coordinator(c) => {
            let verify = OpOptions { verify: true, ..OpOptions::default() };
            match scenario.as_str() {
                "cycle" => {
                    let r = c.sleep(&tags, verify).map_err(|e| e.to_string())?;
                    print_receipt(&r);
                    if allocs.iter().any(|(a, _)| !a.is_released()) {
                        return Err("rank 0 still holds memory after the sleep".into());
                    }
                    let again = c.sleep(&tags, verify).map_err(|e| e.to_string())?;
                    println!("again bytes={}", again.bytes());
                    let r = c.wakeup(&tags, OpOptions::default()).map_err(|e| e.to_string())?;
                    print_receipt(&r);
                    check_intact(&allocs)?;
                }
                "fail" => {
                    match c.sleep(&tags, verify) {
                        Ok(_) => return Err("the sleep succeeded although a peer died".into()),
                        Err(e) => {
                            println!("error: {e}");
                            println!("outcome={:?}", e.outcome());
                        }
                    }
                    println!("state={:?}", c.state());
                    check_intact(&allocs)?;
                }
                other => return Err(format!("unknown scenario `{other}`")),
            }
            if let Err(e) = c.shutdown() {
                println!("shutdown: {e}");
            }
        }
        ControlPlane::Listener(mut h) => {
            let exit = h.join(Duration::from_secs(120));
            println!("listener: {exit:?}");
            check_intact(&allocs)?;
        }
    }
    Ok(())
}
