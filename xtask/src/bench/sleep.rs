//! Sleep/wakeup benchmark: the multi-rank control protocol alone, with synthetic tagged
//! memory, and with each rank's shard of the real default model, for 1, 2, 4 and 8 rank
//! processes, with wakeup time per GiB next to a memcpy measured in the same run. Runs the
//! `sleep` bench binary of `tpctl-session` (`crates/session/benches/sleep.rs`);
//! `TPCTL_SLEEP_BENCH_MIB` sets the MiB per rank of the `memory` mode (default 256).

use super::field;
use crate::util::{self, cargo};
use anyhow::Result;

pub(crate) fn run(json: bool) -> Result<()> {
    // The `model` mode loads the default model: fetched once, like the other benches' inputs.
    // Without it the bench skips only that mode.
    let model = crate::fetch_model::fetch_default();
    let mut cmd = cargo();
    cmd.args(["bench", "--quiet", "-p", "tpctl-session", "--bench", "sleep"]);
    let skipped = match &model {
        Ok(path) => {
            cmd.env("TPCTL_SLEEP_BENCH_MODEL", path);
            None
        }
        Err(e) => Some(format!(
            "note: the model mode was skipped: the default model is not cached and could not \
             be fetched ({e:#})"
        )),
    };
    let out = util::output(&mut cmd)?;
    let rows: Vec<&str> = out.lines().filter(|l| field(l, "mode").is_some()).collect();
    anyhow::ensure!(!rows.is_empty(), "the sleep benchmark printed no rows:\n{out}");
    if json {
        for l in rows {
            println!("{l}");
        }
        if let Some(note) = skipped {
            eprintln!("{note}");
        }
        return Ok(());
    }
    let header = [
        "mode",
        "ranks",
        "tp x cp",
        "MiB/rank",
        "fan-out RT us",
        "serial RT us",
        "sleep ms",
        "wakeup ms",
        "res. drop %",
        "wakeup s/GiB",
        "rank0 wake s/GiB",
        "memcpy s/GiB",
    ];
    print_row(&header.map(String::from));
    for l in rows {
        let f = |k| field(l, k).unwrap_or("?").to_owned();
        // Columns only some modes have.
        let opt = |k| field(l, k).unwrap_or("-").to_owned();
        let ms = |k| {
            field(l, k)
                .and_then(|v| v.parse::<f64>().ok())
                .map_or_else(|| "?".to_owned(), |us| format!("{:.3}", us / 1e3))
        };
        print_row(&[
            f("mode"),
            f("ranks"),
            opt("layout"),
            f("mib_per_rank"),
            f("status_fanout_us"),
            f("status_serial_us"),
            ms("sleep_us"),
            ms("wakeup_us"),
            opt("resident_drop_pct"),
            f("wakeup_s_per_gib"),
            f("rank0_wakeup_s_per_gib"),
            f("memcpy_s_per_gib"),
        ]);
    }
    println!(
        "fan-out RT: one status round trip to every peer at once (how each protocol phase \
         fans out); serial RT: the same round trips one peer at a time, the cost a serial \
         fan-out would add per phase; sleep/wakeup: median wall time of one call on rank 0 \
         (lock, prepare fan-out, local op, commit fan-out, ACK drains); control: no tagged \
         memory (protocol round trips only); memory: MiB/rank of Backup(Spill) weights on \
         every rank; model: each rank's shard of SmolLM2-135M (Q4_1, native weights) in vmm \
         memory as tpctl holds it, weights reloaded from the file at wakeup, plus one \
         {CACHE_TOKENS}-token KV cache (discarded), both slept; tp x cp: the model's mesh (TP as \
         wide as its 3 KV heads allow, the rest CP), MiB/rank: the largest rank's bytes from \
         the receipts; res. drop: the smallest drop of one rank's resident memory during the \
         first sleep, as % of the bytes that rank released (a discarded KV cache comes back \
         untouched, so later sleeps free less: later_resident_drop_pct in --json); wakeup s/GiB: whole wakeup per GiB of \
         the largest rank's memory (ranks restore concurrently), rank0: rank 0's own \
         materialize, next to memcpy of the same bytes in the same run; after the model \
         cycles every rank checked that its weights hash as before the first sleep"
    );
    if let Some(note) = skipped {
        println!("{note}");
    }
    Ok(())
}

/// Tokens of the KV cache each rank of the `model` mode holds (as in the bench).
const CACHE_TOKENS: usize = 1024;

fn print_row(cells: &[String; 12]) {
    let [mode, ranks, layout, mib, fanout, serial, sleep, wakeup, drop, per_gib, rank0, memcpy] =
        cells;
    println!(
        "{mode:<8} {ranks:>5} {layout:>7} {mib:>9} {fanout:>13} {serial:>13} {sleep:>10} \
         {wakeup:>10} {drop:>11} {per_gib:>13} {rank0:>16} {memcpy:>13}"
    );
}
