//! Writes a Llama file of Llama 3 8B's dimensions with random weights (see
//! `layers::model::shaped`), for timing that shape where no checkpoint can be fetched: the GPU
//! bundle's `run.sh` makes one on the device machine. Prints one JSON line: the file, its size
//! and the bytes a decode step reads from the weights (for the memory roofline).
//!
//! `shaped_llama bf16|q4_k SEED OUT.gguf [LAYERS]` (LAYERS: fewer blocks than 32, for a quick
//! try of the same widths).

use layers::model::shaped::{ShapedLlama, ShapedStorage};
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: shaped_llama bf16|q4_k SEED OUT.gguf [LAYERS]";
    let (storage, seed, out, layers) = match args.as_slice() {
        [storage, seed, out, rest @ ..] if rest.len() <= 1 => (storage, seed, out, rest.first()),
        _ => fail(usage),
    };
    let storage = ShapedStorage::parse(storage)
        .unwrap_or_else(|| fail(&format!("storage `{storage}`: expected bf16 or q4_k")));
    let seed = seed.parse().unwrap_or_else(|_| fail(&format!("seed `{seed}`: not a number")));
    let mut spec = ShapedLlama::llama3_8b(storage, seed);
    if let Some(layers) = layers {
        spec.layers = layers
            .parse()
            .ok()
            .filter(|&l| l >= 1)
            .unwrap_or_else(|| fail(&format!("layers `{layers}`: expected a count from 1")));
    }
    let out = PathBuf::from(out);
    let started = Instant::now();
    if let Err(e) = spec.write(&out) {
        fail(&format!("writing {}: {e}", out.display()));
    }
    let bytes = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    println!(
        "{{\"file\": \"{}\", \"file_bytes\": {bytes}, \"step_weight_bytes\": {}, \"layers\": {}, \"seconds\": {:.1}}}",
        out.display(),
        spec.step_weight_bytes(),
        spec.layers,
        started.elapsed().as_secs_f64()
    );
}

fn fail(message: &str) -> ! {
    eprintln!("shaped_llama: {message}");
    std::process::exit(2);
}
