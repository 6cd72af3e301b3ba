//! Model benchmark: prefill and decode tokens/s of SmolLM2 in several `tp × cp` layouts.
//!
//! Run through `cargo xtask bench model`, which also measures llama.cpp on the same f32
//! weights in the same run. Ranks are threads of this process joined by `local` groups (the
//! shared-memory communicator over anonymous memory), each with its own thread pool.
//!
//! `model [--model PATH] [--prompt-tokens N] [--decode-tokens N] [--json]`

use collectives::{local, ShmOptions};
use layers::parallel::{Comms, ParallelModel, Placement};
use layers::{Logits, Tokenizer};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// (tp, cp, threads per rank)
const LAYOUTS: [(usize, usize, usize); 3] = [(1, 1, 2), (2, 1, 1), (2, 2, 1)];
const REPEATS: usize = 3;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let path = arg(&args, "--model")
        .map(PathBuf::from)
        .or_else(layers::model::default_model_path)
        .expect("no model: pass --model PATH or run `cargo xtask fetch-model`");
    let n_prompt: usize =
        arg(&args, "--prompt-tokens").map_or(128, |v| v.parse().expect("a number"));
    let n_decode: usize =
        arg(&args, "--decode-tokens").map_or(64, |v| v.parse().expect("a number"));
    let tokenizer = Tokenizer::load(&path).expect("tokenizer");
    // The same prompt as the llama.cpp anchor script.
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(200);
    let mut prompt = tokenizer.encode(&text).expect("encode");
    prompt.truncate(n_prompt);
    if !json {
        println!("{:<7} {:>8} {:>14} {:>13}", "layout", "threads", "prefill tok/s", "decode tok/s");
    }
    for (tp, cp, threads) in LAYOUTS {
        let (prefill, decode) = run_layout(&path, &prompt, n_decode, tp, cp, threads);
        let (pf, dc) =
            (prompt.len() as f64 / prefill.as_secs_f64(), n_decode as f64 / decode.as_secs_f64());
        if json {
            println!(
                "{{\"tp\":{tp},\"cp\":{cp},\"threads_per_rank\":{threads},\"prompt_tokens\":{},\"prefill_tok_s\":{pf:.1},\"decode_tokens\":{n_decode},\"decode_tok_s\":{dc:.1}}}",
                prompt.len()
            );
        } else {
            println!("{:<7} {:>8} {:>14.1} {:>13.1}", format!("{tp}x{cp}"), threads, pf, dc);
        }
    }
}

/// Best prefill and decode times over `REPEATS` runs on a `tp × cp` thread mesh.
fn run_layout(
    path: &PathBuf,
    prompt: &[u32],
    n_decode: usize,
    tp: usize,
    cp: usize,
    threads: usize,
) -> (Duration, Duration) {
    let comms = local::mesh(tp, cp, ShmOptions::default()).expect("thread mesh");
    let times = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|(mut t, mut c)| {
                s.spawn(move || {
                    let mut comms = Comms { tp: &mut t, cp: &mut c };
                    let placement = Placement::of(&comms);
                    let model = ParallelModel::load(
                        path,
                        placement,
                        threads,
                        layers::model::WeightForm::Native,
                    )
                    .expect("load model");
                    let (mut best_pf, mut best_dc) = (Duration::MAX, Duration::MAX);
                    for _ in 0..REPEATS {
                        let mut cache = model.new_cache(prompt.len() + n_decode + 1);
                        comms.tp.barrier().expect("barrier");
                        comms.cp.barrier().expect("barrier");
                        let t0 = Instant::now();
                        let mut next = model
                            .forward_argmax(&mut comms, prompt, &mut cache, Logits::Last)
                            .expect("prefill")[0];
                        let t1 = Instant::now();
                        for _ in 0..n_decode {
                            next = model
                                .forward_argmax(&mut comms, &[next], &mut cache, Logits::Last)
                                .expect("decode")[0];
                        }
                        let t2 = Instant::now();
                        best_pf = best_pf.min(t1 - t0);
                        best_dc = best_dc.min(t2 - t1);
                    }
                    (best_pf, best_dc)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect::<Vec<_>>()
    });
    times[0]
}
