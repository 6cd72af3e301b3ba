//! `cargo xtask ci`: the whole gate CI runs, in the order that fails fastest.

use crate::util::{self, cargo};
use anyhow::Result;

/// Feature sets clippy checks; the last one is also the set the tests run with.
/// `bench-internals` rides with `cuda` so the benchmark that needs it is checked too; `mpi`
/// rides with `failpoints`, so the MPI backend is linted and tested without another build.
const CLIPPY_FEATURES: [&[&str]; 3] =
    [&[], &["--features", "cuda,bench-internals"], &["--features", TEST_FEATURES]];

/// The features the tests run with: fault injection, and the MPI backend, whose conformance
/// suite runs its ranks under `mpirun` (`crates/collectives/tests/mpi_processes.rs`).
const TEST_FEATURES: &str = "failpoints,mpi";

pub(crate) fn run(_args: &[String]) -> Result<()> {
    util::run(cargo().args(["fmt", "--all", "--check"]))?;
    // The `mpi` feature links the system's OpenMPI (its bindings need libclang), and its tests
    // start `mpirun`: installed here when missing.
    crate::mpi::ensure_openmpi()?;
    for features in CLIPPY_FEATURES {
        util::run(
            cargo()
                .args(["clippy", "--workspace", "--all-targets", "--locked"])
                .args(features)
                .args(["--", "-D", "warnings"]),
        )?;
    }
    // The tests that check the real model (greedy text per layout, sleep/wakeup of its
    // weights) need it in the cache; fetched once, then reused.
    let model = crate::fetch_model::fetch_default()?;
    println!("default model: {}", model.display());
    // Tests run with fault injection compiled in, so the failure scenarios are exercised.
    util::run(cargo().args(["test", "--workspace", "--locked", "--features", TEST_FEATURES]))?;
    Ok(())
}
