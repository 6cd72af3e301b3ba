//! Model benchmark: prefill and decode tokens/s of SmolLM2 in several `tp × cp` layouts, one
//! sequence alone and a batch of sequences decoded together (one batched step for all;
//! [`BATCH`] unless `--batch N`).
//!
//! Run through `cargo xtask bench model`, which also measures llama.cpp on the same f32
//! weights in the same run. Ranks are threads of this process joined by `local` groups (the
//! shared-memory communicator over anonymous memory), each with its own thread pool.
//!
//! `model [--model PATH] [--prompt-tokens N] [--decode-tokens N] [--batch N] [--layout TPxCPxTHREADS] [--json]`
//! (`--layout 1x1x2` measures that layout alone, for a profiler).

use collectives::{local, ShmOptions};
use layers::parallel::{Comms, LoadOptions, ParallelCache, ParallelModel, Placement, Sequence};
use layers::Logits;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use text::Tokenizer;

/// (tp, cp, threads per rank)
const LAYOUTS: [(usize, usize, usize); 3] = [(1, 1, 2), (2, 1, 1), (2, 2, 1)];
const REPEATS: usize = 3;
/// Sequences decoded together by default, and their prompt length.
const BATCH: usize = 8;
const BATCH_PROMPT: usize = 32;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let path = arg(&args, "--model")
        .map(PathBuf::from)
        .or_else(checkpoint::cache::default_model_path)
        .expect("no model: pass --model PATH or run `cargo xtask fetch-model`");
    let n_prompt: usize =
        arg(&args, "--prompt-tokens").map_or(128, |v| v.parse().expect("a number"));
    let n_decode: usize =
        arg(&args, "--decode-tokens").map_or(64, |v| v.parse().expect("a number"));
    let batch: usize = arg(&args, "--batch").map_or(BATCH, |v| v.parse().expect("a number"));
    let tokenizer = Tokenizer::load(&path).expect("tokenizer");
    // The same prompt as the llama.cpp anchor script.
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(200);
    let mut prompt = tokenizer.encode(&text).expect("encode");
    prompt.truncate(n_prompt);
    if !json {
        println!(
            "{:<7} {:>8} {:>14} {:>13} {:>18}",
            "layout",
            "threads",
            "prefill tok/s",
            "decode tok/s",
            format!("{batch}-seq decode tok/s")
        );
    }
    let layouts: Vec<(usize, usize, usize)> = match arg(&args, "--layout") {
        Some(l) => {
            let n: Vec<usize> = l.split('x').map(|v| v.parse().expect("TPxCPxTHREADS")).collect();
            vec![(n[0], n[1], n[2])]
        }
        None => LAYOUTS.to_vec(),
    };
    for (tp, cp, threads) in layouts {
        let (prefill, decode, batched) =
            run_layout(&path, &prompt, n_decode, batch, (tp, cp, threads));
        let (pf, dc) =
            (prompt.len() as f64 / prefill.as_secs_f64(), n_decode as f64 / decode.as_secs_f64());
        let bt = (batch * n_decode) as f64 / batched.as_secs_f64();
        if json {
            println!(
                "{{\"tp\":{tp},\"cp\":{cp},\"threads_per_rank\":{threads},\"prompt_tokens\":{},\"prefill_tok_s\":{pf:.1},\"decode_tokens\":{n_decode},\"decode_tok_s\":{dc:.1},\"batch\":{batch},\"batch_decode_tok_s\":{bt:.1}}}",
                prompt.len()
            );
        } else {
            println!(
                "{:<7} {:>8} {:>14.1} {:>13.1} {:>18.1}",
                format!("{tp}x{cp}"),
                threads,
                pf,
                dc,
                bt
            );
        }
    }
}

/// Best prefill, decode and batched decode times over `REPEATS` runs on a `tp × cp` thread
/// mesh.
fn run_layout(
    path: &PathBuf,
    prompt: &[u32],
    n_decode: usize,
    batch: usize,
    (tp, cp, threads): (usize, usize, usize),
) -> (Duration, Duration, Duration) {
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
                        LoadOptions::new(placement)
                            .threads(threads)
                            .form(layers::model::WeightForm::Native),
                    )
                    .expect("load model");
                    let (mut best_pf, mut best_dc, mut best_bt) =
                        (Duration::MAX, Duration::MAX, Duration::MAX);
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
                        best_bt = best_bt
                            .min(batched_decode(&model, &mut comms, prompt, n_decode, batch));
                    }
                    (best_pf, best_dc, best_bt)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect::<Vec<_>>()
    });
    times[0]
}

/// `batch` sequences (prompts of [`BATCH_PROMPT`] ids from `prompt`, each shifted) prefilled
/// in one step, then `n_decode` steps of one token each for all of them; returns the time of
/// the decode steps. The fed tokens are fixed (the speed does not depend on them), so no rank
/// waits for rank 0's logits.
fn batched_decode(
    model: &ParallelModel,
    comms: &mut Comms<'_>,
    prompt: &[u32],
    n_decode: usize,
    batch: usize,
) -> Duration {
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|s| prompt.iter().cycle().skip(s).take(BATCH_PROMPT).copied().collect())
        .collect();
    let mut caches: Vec<ParallelCache> =
        (0..batch).map(|_| model.new_cache(BATCH_PROMPT + n_decode + 1)).collect();
    let mut step = |tokens: &[&[u32]], caches: &mut [ParallelCache]| {
        let mut seqs: Vec<Sequence<'_>> = tokens
            .iter()
            .zip(caches.iter_mut())
            .map(|(tokens, cache)| Sequence::sampled(tokens, cache))
            .collect();
        model.forward_batch(comms, &mut seqs).expect("batched step");
    };
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    step(&refs, &mut caches);
    let t0 = Instant::now();
    for i in 0..n_decode {
        let next: Vec<[u32; 1]> = prompts.iter().map(|p| [p[i % p.len()]]).collect();
        let refs: Vec<&[u32]> = next.iter().map(|t| &t[..]).collect();
        step(&refs, &mut caches);
    }
    t0.elapsed()
}
