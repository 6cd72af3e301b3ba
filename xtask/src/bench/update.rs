//! Weight-update benchmark: the whole default model pushed from memory (one f32 safetensors
//! bucket in `/dev/shm`) into one rank's live f32 weights, against a memcpy of the live bytes
//! in the same run (goal: at most 1.5x, the protocol's round trips aside), and a reload of the
//! same weights from the checkpoint file. Runs the `update` bench binary of `tpctl-session`
//! (`crates/session/benches/update.rs`).

use super::field;
use crate::util::{self, cargo};
use anyhow::Result;

/// The ratio to a memcpy an update from memory should reach.
const GOAL: f64 = 1.5;

pub(crate) fn run(json: bool) -> Result<()> {
    let model = crate::fetch_model::fetch_default()?;
    let mut cmd = cargo();
    cmd.args(["bench", "--quiet", "-p", "tpctl-session", "--bench", "update"]);
    cmd.env("TPCTL_UPDATE_BENCH_MODEL", &model);
    let out = util::output(&mut cmd)?;
    let row = out
        .lines()
        .find(|l| field(l, "mode") == Some("update"))
        .ok_or_else(|| anyhow::anyhow!("the update benchmark printed no row:\n{out}"))?;
    if json {
        println!("{row}");
        return Ok(());
    }
    let f = |k| field(row, k).unwrap_or("?").to_owned();
    let mib = |k| field(row, k).and_then(|v| v.parse::<f64>().ok()).map(|b| b / (1 << 20) as f64);
    println!(
        "weight update of {} ({:.1} MiB of live f32 weights, one rank), median of 3:",
        f("model"),
        mib("live_bytes").unwrap_or(0.0)
    );
    println!(
        "from memory (one bucket of every tensor) {} ms | from the file {} ms | memcpy of the live \
         bytes {} ms",
        f("from_memory_ms"),
        f("from_file_ms"),
        f("memcpy_ms")
    );
    let ratio: f64 = f("ratio").parse().unwrap_or(f64::NAN);
    println!(
        "from memory: {ratio:.2}x a memcpy (goal <= {GOAL}x) | from the file: {}x",
        f("file_ratio")
    );
    if ratio.is_nan() || ratio > GOAL {
        eprintln!("warning: an update from memory took {ratio:.2}x a memcpy, above {GOAL}x");
    }
    Ok(())
}
