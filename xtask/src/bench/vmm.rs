//! VMM benchmark: release/materialize of 1 GiB per restore policy against a plain memcpy.
//!
//! Runs the `vmm` bench binary of `tpctl-vmm` (`crates/vmm/benches/vmm.rs`), which measures
//! the memcpy reference in the same run. `TPCTL_VMM_BENCH_BYTES` (for example `256M`) picks
//! a smaller size.

use crate::util::{self, cargo};
use anyhow::Result;

pub(crate) fn run(json: bool) -> Result<()> {
    let mut cmd = cargo();
    cmd.args(["bench", "-p", "tpctl-vmm", "--bench", "vmm", "--"]);
    if json {
        cmd.arg("--json");
    }
    util::run(&mut cmd)
}
