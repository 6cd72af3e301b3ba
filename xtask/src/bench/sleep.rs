//! Sleep/wakeup benchmark: the multi-rank control protocol alone and with tagged memory, for
//! 1, 2, 4 and 8 rank processes, with wakeup time per GiB next to a memcpy measured in the same
//! run. Runs the `sleep` bench binary of `tpctl-session` (`crates/session/benches/sleep.rs`);
//! `TPCTL_SLEEP_BENCH_MIB` sets the MiB per rank (default 256).

use super::field;
use crate::util::{self, cargo};
use anyhow::Result;

pub(crate) fn run(json: bool) -> Result<()> {
    let out = util::output(cargo().args([
        "bench",
        "--quiet",
        "-p",
        "tpctl-session",
        "--bench",
        "sleep",
    ]))?;
    let rows: Vec<&str> = out.lines().filter(|l| field(l, "mode").is_some()).collect();
    anyhow::ensure!(!rows.is_empty(), "the sleep benchmark printed no rows:\n{out}");
    if json {
        for l in rows {
            println!("{l}");
        }
        return Ok(());
    }
    println!(
        "{:<8} {:>5} {:>9} {:>13} {:>13} {:>12} {:>12} {:>14} {:>16} {:>14}",
        "mode",
        "ranks",
        "MiB/rank",
        "fan-out RT us",
        "serial RT us",
        "sleep us",
        "wakeup us",
        "wakeup s/GiB",
        "rank0 wake s/GiB",
        "memcpy s/GiB"
    );
    for l in rows {
        let f = |k| field(l, k).unwrap_or("?");
        println!(
            "{:<8} {:>5} {:>9} {:>13} {:>13} {:>12} {:>12} {:>14} {:>16} {:>14}",
            f("mode"),
            f("ranks"),
            f("mib_per_rank"),
            f("status_fanout_us"),
            f("status_serial_us"),
            f("sleep_us"),
            f("wakeup_us"),
            f("wakeup_s_per_gib"),
            f("rank0_wakeup_s_per_gib"),
            f("memcpy_s_per_gib")
        );
    }
    println!(
        "fan-out RT: one status round trip to every peer at once (how each protocol phase \
         fans out); serial RT: the same round trips one peer at a time, the cost a serial \
         fan-out would add per phase; sleep/wakeup: median wall time of one call on rank 0 (lock, prepare fan-out, local op, \
         commit fan-out, ACK drains); control: no tagged memory (protocol round trips only); \
         memory: MiB/rank of Backup(Spill) weights on every rank; wakeup s/GiB: whole wakeup \
         per GiB of one rank's memory (ranks restore concurrently), rank0: rank 0's own \
         materialize, next to memcpy of the same bytes in the same run"
    );
    Ok(())
}
