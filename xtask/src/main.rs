//! Project automation, run as `cargo xtask <task>`: `ci`, `bench`, `gpu-test`, `fetch-model`,
//! `install-mpi`.
#![forbid(unsafe_code)]

mod bench;
mod ci;
mod fetch_model;
mod gpu_test;
mod mpi;
mod tidy;
mod util;

use anyhow::{bail, Result};

const HELP: &str = "\
cargo xtask <task> [args]

tasks:
  ci                      install OpenMPI if missing, fmt check, clippy (default, cuda,
                          failpoints+mpi features), all tests (failpoints+mpi)
  bench <what> [--json]   benchmarks with their reference measured in the same run;
                          <what>: collectives | vmm | session | model | serve (with the
                          concurrency curve) | concurrency (N = 1..64 streams vs llama.cpp
                          batched, a same-run roofline, a per-step breakdown) | sleep | cycles |
                          swap (a model host's swap vs a cold start) |
                          coldstart (run's time to first token vs warm serve's) |
                          large (an 8B-shaped Q4_K model on the CPU vs llama.cpp) |
                          agree (greedy ids and logprobs vs llama.cpp) |
                          agree-random (logits vs llama.cpp on random Gemma 2, Gemma 3,
                          Qwen3 and Phi-3 longrope files) |
                          all
  gpu-test [--bundle [DIR]]
                          the GPU tests with --features cuda; fails without a usable GPU;
                          --bundle: build them with run.sh for a GPU machine without Rust
  fetch-model             download the default model once into the cache; print its path
  install-mpi             install OpenMPI and libclang (for --features mpi) when missing
  help                    this text
";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_else(|| "help".to_owned());
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "ci" => ci::run(&rest),
        "bench" => bench::run(&rest),
        "fetch-model" => fetch_model::run(&rest),
        "gpu-test" => gpu_test::run(&rest),
        "install-mpi" => mpi::ensure_openmpi(),
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => bail!("unknown task `{other}`\n\n{HELP}"),
    }
}
