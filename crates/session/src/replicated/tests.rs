//! The replicated Llama through the whole engine (one rank): continuous batching with chunked
//! prefill gives, per request, exactly the tokens of the model's own greedy generation.

use super::*;
use crate::engine::{Decision, EngineOptions, Leader, SessionReport};
use crate::sampler::SamplingParams;
use crate::scheduler::Request;
use crate::sink::{Collect, FinishReason, NoMetrics};
use collectives::{init_parallel_with, InitOptions};

#[test]
fn batched_chunked_generation_matches_single_sequence_greedy() {
    let path = std::env::temp_dir().join(format!("tpctl-session-unit-{}.gguf", std::process::id()));
    layers::model::random::RandomLlama::default().write(&path).unwrap();
    let model = path.to_string_lossy().into_owned();
    let prompts: [(&[u32], u32); 3] = [(&[1, 2, 3, 4, 5], 6), (&[7], 4), (&[9, 8, 7, 6], 5)];

    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let out = Collect::new();
    let mut leader = Leader::new(
        ctx,
        Box::new(LlamaFactory::new(1)),
        Box::new(out.clone()),
        Box::new(NoMetrics),
        EngineOptions::default(),
    )
    .unwrap();
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(i, (p, n))| {
            let params =
                SamplingParams { max_tokens: *n, ignore_eos: true, ..SamplingParams::default() };
            Request::tokens(i as u64, p.to_vec(), params)
        })
        .collect();
    let cfg = SessionConfig { token_budget: 3, ..SessionConfig::new(model.clone()) };
    let mut stop = |_: &SessionReport| Decision::Stop;
    leader.run(cfg, requests, &mut stop).unwrap();

    let reference = layers::Model::load(&model, 1).unwrap();
    let done = out.finished();
    assert_eq!(done.len(), 3);
    for (i, (p, n)) in prompts.iter().enumerate() {
        let mut cache = reference.new_cache(64);
        let want = reference.generate(p, *n as usize, &[], &mut cache, |_| {}).unwrap();
        let got = done.iter().find(|d| d.request == i as u64).unwrap();
        assert_eq!((got.reason, &got.tokens), (FinishReason::Length, &want), "request {i}");
        assert_eq!(got.text.is_empty(), want.is_empty(), "the tokenizer decoded the pieces");
    }
    let _ = std::fs::remove_file(&path);
}
