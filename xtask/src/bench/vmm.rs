//! VMM benchmark: release/materialize of 1 GiB per restore policy against a plain memcpy.

use anyhow::{bail, Result};

pub(crate) fn run(_json: bool) -> Result<()> {
    bail!("the vmm benchmark is not written yet")
}
