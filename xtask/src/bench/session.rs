//! Step-agreement benchmark: the session engine's per-step coordination (admission carrying
//! rank 0's plan, confirmation; no model) next to one 8-byte all_reduce measured in the same
//! run, for 2 and 4 ranks. Runs the `session` bench binary of `tpctl-session`
//! (`crates/session/benches/session.rs`).

use super::field;
use crate::util::{self, cargo};
use anyhow::Result;

/// One row, parsed from the flat JSON the bench binary prints.
struct Row {
    backend: String,
    ranks: usize,
    allreduce_us: f64,
    step_us: f64,
    large_us: f64,
    admission_us: f64,
}

fn parse_row(line: &str) -> Option<Row> {
    Some(Row {
        backend: field(line, "backend")?.to_owned(),
        ranks: field(line, "ranks")?.parse().ok()?,
        allreduce_us: field(line, "allreduce8_us")?.parse().ok()?,
        step_us: field(line, "step_us")?.parse().ok()?,
        large_us: field(line, "step_64seq_us")?.parse().ok()?,
        admission_us: field(line, "admission_us")?.parse().ok()?,
    })
}

pub(crate) fn run(json: bool) -> Result<()> {
    let out = util::output(cargo().args([
        "bench",
        "--quiet",
        "-p",
        "tpctl-session",
        "--features",
        "bench-internals",
        "--bench",
        "session",
        "--",
        "--json",
    ]))?;
    let rows: Vec<Row> = out.lines().filter_map(parse_row).collect();
    anyhow::ensure!(!rows.is_empty(), "the session benchmark printed no rows:\n{out}");
    if json {
        for l in out.lines().filter(|l| parse_row(l).is_some()) {
            println!("{l}");
        }
        return Ok(());
    }
    println!(
        "{:<7} {:>5} {:>16} {:>12} {:>15} {:>9} {:>7} {:>16}",
        "backend",
        "ranks",
        "all_reduce 8B us",
        "admission us",
        "step (4 seq) us",
        "x allred",
        "target",
        "step (64 seq) us"
    );
    for r in &rows {
        let ratio = r.step_us / r.allreduce_us;
        let met = ratio < 3.0 && (r.ranks != 4 || r.step_us < 100.0);
        println!(
            "{:<7} {:>5} {:>16.2} {:>12.2} {:>15.2} {:>8.2}x {:>7} {:>16.2}",
            r.backend,
            r.ranks,
            r.allreduce_us,
            r.admission_us,
            r.step_us,
            ratio,
            if met { "met" } else { "missed" },
            r.large_us
        );
    }
    println!(
        "step = admission (plan inline) + plan decode + confirmation; 64 seq: the plan no longer \
         fits inline and is broadcast; best of 9 interleaved rounds of 1000; target: under 3x the 8-byte \
         all_reduce, and under 100 us at 4 ranks"
    );
    Ok(())
}
