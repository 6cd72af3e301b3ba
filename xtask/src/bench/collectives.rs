//! Collectives benchmark (shm and tcp, 2 and 4 ranks) against OpenMPI's `MPI_Allreduce`.

use anyhow::{bail, Result};

pub(crate) fn run(_json: bool) -> Result<()> {
    bail!("the collectives benchmark is not written yet")
}
