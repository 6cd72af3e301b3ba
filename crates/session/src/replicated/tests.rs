//! The replicated Llama through the whole engine (one rank): continuous batching with chunked
//! prefill gives, per request, exactly the tokens of the model's own greedy generation.

use super::*;
use crate::engine::{Decision, EngineOptions, Leader, SessionReport};
use crate::sampler::{Sampler, SamplingParams, TokenLogprobs};
use crate::scheduler::Request;
use crate::sharded::ShardedFactory;
use crate::sink::{Collect, FinishReason, MetricsSink, NoMetrics, OutputSink, StepMetrics};
use collectives::{init_parallel_with, InitOptions};
use layers::parallel::{Comms, LoadOptions, ParallelCache, ParallelModel, Placement};
use layers::Logits;
use std::sync::{Arc, Mutex};

/// The model alone, one sequence at a time (one rank, no engine, no batching, no chunking):
/// what the engine's batched steps must reproduce.
struct Reference(ParallelModel);

impl Reference {
    fn load(path: &str) -> Reference {
        Reference(ParallelModel::load(path, LoadOptions::new(Placement::single())).unwrap())
    }

    /// The last row of logits after `tokens` are appended to `cache`.
    fn next_logits(&self, cache: &mut ParallelCache, tokens: &[u32]) -> Vec<f32> {
        let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
        let mut comms = Comms { tp: &mut tp, cp: &mut cp };
        let logits = self.0.forward(&mut comms, tokens, cache, Logits::Last).unwrap();
        logits.row(logits.rows() - 1).to_vec()
    }

    /// `n` greedy tokens after `prompt` (the first of the largest logits).
    fn greedy(&self, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut cache = self.0.new_cache(64);
        let mut out = Vec::new();
        let mut logits = self.next_logits(&mut cache, prompt);
        while out.len() < n {
            let best = tensor::kernels::cpu::activation::argmax(&logits).unwrap() as u32;
            out.push(best);
            logits = self.next_logits(&mut cache, &[best]);
        }
        out
    }
}

#[test]
fn batched_chunked_generation_matches_single_sequence_greedy() {
    let path = std::env::temp_dir().join(format!("tpctl-session-unit-{}.gguf", std::process::id()));
    layers::model::random::RandomLlama::default().write(&path).unwrap();
    let model = path.to_string_lossy().into_owned();
    let prompts: [(&[u32], u32); 3] = [(&[1, 2, 3, 4, 5], 6), (&[7], 4), (&[9, 8, 7, 6], 5)];

    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let tokenizer = Arc::new(text::Tokenizer::load(&path).unwrap());
    let out = Collect::decoding(Box::new(crate::TokenizerCodec(tokenizer)));
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

    let reference = Reference::load(&model);
    let done = out.finished();
    assert_eq!(done.len(), 3);
    for (i, (p, n)) in prompts.iter().enumerate() {
        let want = reference.greedy(p, *n as usize);
        let got = done.iter().find(|d| d.request == i as u64).unwrap();
        assert_eq!((got.reason, &got.tokens), (FinishReason::Length, &want), "request {i}");
        assert_eq!(got.text.is_empty(), want.is_empty(), "the sink decoded the pieces");
    }
    let _ = std::fs::remove_file(&path);
}

/// Every token a request generated and its log-probabilities, as the output sink saw them.
#[derive(Clone, Default)]
struct Tokens(Arc<Mutex<Seen>>);
type Seen = std::collections::HashMap<u64, Vec<(u32, Option<TokenLogprobs>)>>;

impl OutputSink for Tokens {
    fn token(
        &mut self,
        request: u64,
        token: u32,
        _: bool,
        logprobs: Option<&TokenLogprobs>,
    ) -> Result<(), BoxError> {
        self.0.lock().unwrap().entry(request).or_default().push((token, logprobs.cloned()));
        Ok(())
    }

    fn finished(&mut self, _: u64, _: FinishReason, _: &[u32]) -> Result<(), BoxError> {
        Ok(())
    }
}

/// Preemptions the scheduler reported.
#[derive(Clone, Default)]
struct Preemptions(Arc<Mutex<u64>>);

impl MetricsSink for Preemptions {
    fn step(&mut self, m: &StepMetrics) {
        *self.0.lock().unwrap() += m.preemptions;
    }
}

/// One rank's factory for a `context`-token sequence over a paged pool of 4-token blocks, with
/// prefix caching on.
fn paged_factory(context: usize) -> ShardedFactory {
    ShardedFactory::new(1).with_context(context).with_kv_cache(crate::sharded::KvCacheConfig {
        bytes: None,
        cap_bytes: 0,
        block_size: 4,
        prefix_caching: true,
        device_fraction: None,
    })
}

/// Runs `requests` (prompt and parameters; request `i` has id `i`) on one rank whose KV pool
/// holds one 40-token sequence (blocks of 4, prefix caching on, a token budget of 5), into
/// `output`, and checks that the pool was small enough to preempt.
fn run_preempting(
    model: &str,
    requests: &[(Vec<u32>, SamplingParams)],
    output: Box<dyn OutputSink>,
) {
    let factory = paged_factory(40);
    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let preemptions = Preemptions::default();
    let mut leader = Leader::new(
        ctx,
        Box::new(factory),
        output,
        Box::new(preemptions.clone()),
        EngineOptions::default(),
    )
    .unwrap();
    let batch = requests
        .iter()
        .enumerate()
        .map(|(i, (p, params))| Request::tokens(i as u64, p.clone(), params.clone()))
        .collect();
    let cfg = SessionConfig { token_budget: 5, ..SessionConfig::new(model.to_owned()) };
    leader.run(cfg, batch, &mut |_: &SessionReport| Decision::Stop).unwrap();
    assert!(*preemptions.0.lock().unwrap() > 0, "the pool is small enough to preempt");
}

/// Sampling moved from rank 0's scheduler into the model runner: each request's tokens and
/// log-probabilities must be those of a plain [`Sampler`] over the single-sequence model's
/// logits, token after token, whatever the batch, the prefill chunks, a prompt prefix reused
/// from the cache, or a preemption that recomputes a sequence under a new id.
#[test]
fn seeded_sampling_with_penalties_gives_what_a_plain_sampler_gives() {
    let path =
        std::env::temp_dir().join(format!("tpctl-session-seeded-{}.gguf", std::process::id()));
    layers::model::random::RandomLlama::default().write(&path).unwrap();
    let model = path.to_string_lossy().into_owned();
    let sampling = |seed| SamplingParams {
        max_tokens: 14,
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        seed,
        ignore_eos: true,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        repetition_penalty: 1.3,
        logit_bias: vec![(5, 2.0), (6, -1.5)],
        logprobs: Some(3),
        ..SamplingParams::default()
    };
    let requests: Vec<(Vec<u32>, SamplingParams)> = vec![
        (vec![1, 2, 3, 4, 10, 11], sampling(7)),
        // Shares its first block of 4 with the first prompt.
        (vec![1, 2, 3, 4, 20, 21, 22], sampling(8)),
        (vec![9, 8, 7], SamplingParams { temperature: 1.0, min_p: 0.05, ..sampling(9) }),
        (
            vec![30, 31, 32, 33, 34],
            SamplingParams { temperature: 0.0, logprobs: Some(0), ..sampling(0) },
        ),
    ];

    // A pool of one 40-token sequence: four requests of about 20 tokens preempt each other.
    let seen = Tokens::default();
    run_preempting(&model, &requests, Box::new(seen.clone()));

    let reference = Reference::load(&model);
    let seen = seen.0.lock().unwrap();
    for (i, (prompt, params)) in requests.iter().enumerate() {
        let mut sampler = Sampler::new(params.clone());
        let mut cache = reference.0.new_cache(64);
        let mut logits = reference.next_logits(&mut cache, prompt);
        let mut want: Vec<(u32, Option<TokenLogprobs>)> = Vec::new();
        let mut generated = Vec::new();
        for _ in 0..params.max_tokens {
            let row = &logits;
            let token = sampler.sample_next(row, prompt, &generated);
            want.push((token, sampler.logprobs(row, token)));
            generated.push(token);
            logits = reference.next_logits(&mut cache, &[token]);
        }
        let got = &seen[&(i as u64)];
        let ids = |v: &[(u32, Option<TokenLogprobs>)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
        assert_eq!(ids(got), ids(&want), "request {i}'s tokens");
        for (g, w) in got.iter().zip(&want) {
            let (g, w) = (g.1.as_ref().unwrap(), w.1.as_ref().unwrap());
            assert!((g.logprob - w.logprob).abs() < 1e-4, "request {i}: {g:?} vs {w:?}");
            let top = |t: &TokenLogprobs| t.top.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(top(g), top(w), "request {i}'s alternatives");
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// Requests that keep a few tokens each (greedy, or top-k with or without top-p and min-p)
/// and want nothing else of the logits are sampled from each row's candidates, which the
/// model runner finds where the logits are (`Samplers::candidates`): their tokens are still
/// those of a plain [`Sampler`] over the whole rows of the single-sequence model, whatever the
/// batch, the chunks or a preemption.
#[test]
fn seeded_top_k_sampling_from_candidates_gives_what_a_plain_sampler_gives() {
    let sampling = |seed, top_k| SamplingParams { temperature: 0.9, top_k, ..plain(seed) };
    assert_plain_sampler_tokens(
        "top-k",
        &[
            (vec![1, 2, 3, 4, 10, 11], sampling(7, 5)),
            (vec![1, 2, 3, 4, 20, 21, 22], SamplingParams { top_p: 0.8, ..sampling(8, 40) }),
            (vec![9, 8, 7], SamplingParams { temperature: 1.3, min_p: 0.02, ..sampling(9, 2) }),
            (vec![30, 31, 32, 33, 34], SamplingParams { temperature: 0.0, ..sampling(0, 0) }),
        ],
    );
}

/// Requests that draw from their whole rows (a temperature, perhaps min-p or top-p) or decode
/// greedily, and want nothing else of the logits, are drawn where the logits are (the
/// backend's `sample_rows`, with each request's next number): their tokens are still those of
/// a plain [`Sampler`] over the single-sequence model's rows, whatever the batch, the chunks or
/// a preemption.
#[test]
fn seeded_sampling_drawn_where_the_logits_are_gives_what_a_plain_sampler_gives() {
    let sampling = |seed, temperature| SamplingParams { temperature, ..plain(seed) };
    assert_plain_sampler_tokens(
        "drawn",
        &[
            (vec![1, 2, 3, 4, 10, 11], sampling(7, 0.9)),
            (vec![1, 2, 3, 4, 20, 21, 22], SamplingParams { min_p: 0.05, ..sampling(8, 1.4) }),
            (vec![9, 8, 7], SamplingParams { top_p: 0.8, ..sampling(9, 0.4) }),
            (vec![30, 31, 32, 33, 34], sampling(0, 0.0)),
        ],
    );
}

/// Requests that keep a few tokens (top-k) beside requests that weigh their whole row and
/// greedy ones, batched into the same steps (candidates found and rows drawn where the logits
/// are): each one's tokens are those a plain sampler picks from the single-sequence model's
/// rows, with batching, chunked prefill and preemption.
#[test]
fn seeded_sampling_of_mixed_steps_gives_what_a_plain_sampler_gives() {
    let sampling = |seed, temperature| SamplingParams { temperature, ..plain(seed) };
    assert_plain_sampler_tokens(
        "mixed",
        &[
            (vec![1, 2, 3, 4, 10, 11], SamplingParams { top_k: 6, ..sampling(7, 0.9) }),
            (vec![1, 2, 3, 4, 20, 21, 22], SamplingParams { top_p: 0.8, ..sampling(8, 1.2) }),
            (vec![9, 8, 7], SamplingParams { top_k: 3, top_p: 0.7, ..sampling(9, 0.6) }),
            (vec![30, 31, 32, 33, 34], sampling(0, 0.0)),
            (vec![5, 6], SamplingParams { min_p: 0.05, ..sampling(10, 1.0) }),
        ],
    );
}

/// Penalties and a logit bias in each path that picks where the logits are (greedy picks,
/// candidates, whole rows drawn, and a mix), the edits applied there: each request's tokens
/// are those a plain sampler picks after the same penalties from the single-sequence model's
/// rows, with batching, chunked prefill and preemption.
#[test]
fn penalties_and_bias_applied_where_the_logits_are_give_what_a_plain_sampler_gives() {
    let sampling = |seed, temperature| SamplingParams { temperature, ..plain(seed) };
    let penalized = |p: SamplingParams| SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.4,
        frequency_penalty: 0.2,
        logit_bias: vec![(7, 0.5), (11, -1.0)],
        ..p
    };
    let greedy = [
        (vec![1, 2, 3, 4, 10, 11], penalized(sampling(0, 0.0))),
        (vec![9, 8, 7], SamplingParams { repetition_penalty: 1.8, ..sampling(0, 0.0) }),
        (vec![30, 31, 32], sampling(0, 0.0)),
    ];
    let top_k = [
        (vec![1, 2, 3, 4, 10, 11], penalized(SamplingParams { top_k: 6, ..sampling(7, 0.9) })),
        (vec![5, 6], SamplingParams { top_k: 3, frequency_penalty: 1.0, ..sampling(9, 0.6) }),
        (vec![12, 13, 14, 15], SamplingParams { top_k: 4, ..sampling(11, 0.7) }),
    ];
    let whole = [
        (vec![1, 2, 3, 4, 20], penalized(SamplingParams { top_p: 0.8, ..sampling(8, 1.2) })),
        (vec![5, 6], SamplingParams { logit_bias: vec![(3, 2.0)], ..sampling(10, 1.0) }),
        (vec![16, 17, 18], SamplingParams { min_p: 0.05, ..sampling(12, 1.0) }),
    ];
    let mixed: Vec<_> = top_k.iter().chain(&whole).cloned().collect();
    for (name, requests) in
        [("greedy", &greedy[..]), ("top-k", &top_k[..]), ("whole", &whole[..]), ("mixed", &mixed)]
    {
        assert_plain_sampler_tokens(&format!("penalized-{name}"), requests);
    }
}

/// 14 tokens past the end-of-sequence token, seeded.
fn plain(seed: u64) -> SamplingParams {
    SamplingParams { max_tokens: 14, seed, ignore_eos: true, ..SamplingParams::default() }
}

/// Runs `requests` through a preempting engine on a random model and checks each one's tokens
/// against a plain [`Sampler`] over the single-sequence model's rows.
fn assert_plain_sampler_tokens(name: &str, requests: &[(Vec<u32>, SamplingParams)]) {
    let path =
        std::env::temp_dir().join(format!("tpctl-session-{name}-{}.gguf", std::process::id()));
    layers::model::random::RandomLlama::default().write(&path).unwrap();
    let model = path.to_string_lossy().into_owned();
    let seen = Tokens::default();
    run_preempting(&model, requests, Box::new(seen.clone()));
    let reference = Reference::load(&model);
    let seen = seen.0.lock().unwrap();
    for (i, (prompt, params)) in requests.iter().enumerate() {
        let mut sampler = Sampler::new(params.clone());
        let mut cache = reference.0.new_cache(64);
        let mut logits = reference.next_logits(&mut cache, prompt);
        let mut want = Vec::new();
        for _ in 0..params.max_tokens {
            let token = sampler.sample_next(&logits, prompt, &want);
            want.push(token);
            logits = reference.next_logits(&mut cache, &[token]);
        }
        let got: Vec<u32> = seen[&(i as u64)].iter().map(|t| t.0).collect();
        assert_eq!(got, want, "{name}: request {i}'s tokens");
        assert!(seen[&(i as u64)].iter().all(|t| t.1.is_none()), "{name}: request {i}: logprobs");
    }
    let _ = std::fs::remove_file(&path);
}

/// What the output sink saw of each request, in order: prompt log-probabilities (their first
/// position and values) and tokens.
#[derive(Clone, Default)]
struct Scored(Arc<Mutex<std::collections::HashMap<u64, Vec<Heard>>>>);

#[derive(Debug, Clone)]
enum Heard {
    Prompt(u32, Vec<crate::sampler::RankedLogprobs>),
    Token,
}

impl OutputSink for Scored {
    fn token(
        &mut self,
        request: u64,
        _: u32,
        _: bool,
        _: Option<&TokenLogprobs>,
    ) -> Result<(), BoxError> {
        self.0.lock().unwrap().entry(request).or_default().push(Heard::Token);
        Ok(())
    }

    fn prompt_logprobs(
        &mut self,
        request: u64,
        start: u32,
        tokens: &[crate::sampler::RankedLogprobs],
    ) -> Result<(), BoxError> {
        let heard = Heard::Prompt(start, tokens.to_vec());
        self.0.lock().unwrap().entry(request).or_default().push(heard);
        Ok(())
    }

    fn finished(&mut self, _: u64, _: FinishReason, _: &[u32]) -> Result<(), BoxError> {
        Ok(())
    }
}

/// Prompt log-probabilities: position `p` of a prompt is scored by the logits of the prompt's
/// first `p` tokens run alone (the one-sequence model, a prefix at a time), with its rank and
/// alternatives, every position once and in order before the first token; whatever the
/// chunks, a prefix another request left in the cache (not reused for a scored prompt), or
/// preemptions that recompute sequences. A request that does not ask gets none.
#[test]
fn prompt_logprobs_are_each_prefixs_next_token_distribution() {
    const TOP: usize = 3;
    let path =
        std::env::temp_dir().join(format!("tpctl-session-prompt-lp-{}.gguf", std::process::id()));
    layers::model::random::RandomLlama::default().write(&path).unwrap();
    let model = path.to_string_lossy().into_owned();
    let asks = SamplingParams {
        max_tokens: 12,
        ignore_eos: true,
        prompt_logprobs: Some(TOP),
        ..SamplingParams::default()
    };
    let plain = SamplingParams { prompt_logprobs: None, ..asks.clone() };
    let requests: Vec<(Vec<u32>, SamplingParams)> = vec![
        (vec![1, 2, 3, 4, 10, 11, 12, 13, 14], plain.clone()),
        // Its first two blocks of 4 are cached by the first request.
        (vec![1, 2, 3, 4, 10, 11, 12, 13, 20, 21, 22], asks.clone()),
        (vec![9, 8, 7, 6, 5, 4, 3], asks.clone()),
        (vec![30], asks.clone()),
        (vec![40, 41, 42, 43, 44, 45], SamplingParams { max_tokens: 1, ..asks.clone() }),
    ];
    // A pool of one 40-token sequence: the requests preempt each other.
    let seen = Scored::default();
    run_preempting(&model, &requests, Box::new(seen.clone()));

    let reference = Reference::load(&model);
    let seen = seen.0.lock().unwrap();
    for (i, (prompt, params)) in requests.iter().enumerate() {
        let heard = &seen[&(i as u64)];
        let first_token = heard.iter().position(|h| matches!(h, Heard::Token)).unwrap();
        let mut got = Vec::new();
        for h in &heard[..first_token] {
            let Heard::Prompt(start, tokens) = h else { unreachable!() };
            assert_eq!(*start as usize, got.len() + 1, "request {i}: positions in order, once");
            got.extend(tokens.iter().cloned());
        }
        assert!(
            heard[first_token..].iter().all(|h| matches!(h, Heard::Token)),
            "request {i}: the prompt's log-probabilities come before its first token"
        );
        if params.prompt_logprobs.is_none() {
            assert!(got.is_empty(), "request {i} did not ask");
            continue;
        }
        assert_eq!(got.len(), prompt.len() - 1, "request {i}: every position but the first");
        for (p, g) in (1..prompt.len()).zip(&got) {
            let logits = reference.next_logits(&mut reference.0.new_cache(64), &prompt[..p]);
            let want = crate::sampler::RankedLogprobs::of(&logits, prompt[p], TOP);
            let (gl, wl) = (&g.logprobs, &want.logprobs);
            assert!((gl.logprob - wl.logprob).abs() < 1e-4, "request {i} position {p}");
            assert_eq!(g.rank, want.rank, "request {i} position {p}");
            let top = |t: &TokenLogprobs| t.top.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(top(gl), top(wl), "request {i} position {p}'s alternatives");
            for (a, b) in gl.top.iter().zip(&wl.top) {
                assert!((a.1 - b.1).abs() < 1e-4, "request {i} position {p}: {a:?} vs {b:?}");
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// A Gemma 3 (7 layers: layer 5 global, the others with a window of 4) through the engine
/// with a paged pool of blocks of 4 tokens that holds one 64-token sequence: four requests
/// decode 40 tokens each, far past the window, while their windowed groups give blocks back
/// before every step; each gets the greedy tokens of the model alone on its own unpaged
/// cache.
#[test]
fn a_windowed_model_over_a_paged_pool_generates_what_it_generates_alone() {
    let path =
        std::env::temp_dir().join(format!("tpctl-session-gemma3-{}.gguf", std::process::id()));
    let spec = layers::model::random::RandomLlama {
        gemma3: Some(layers::model::random::Gemma3::default()),
        layers: 7,
        heads: 6,
        kv_heads: 3,
        hidden: 48,
        ffn: 64,
        vocab: 40,
        seed: 93,
        ..layers::model::random::RandomLlama::default()
    };
    spec.write(&path).unwrap();
    let model = path.to_string_lossy().into_owned();
    let factory = paged_factory(64);
    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let out = Tokens::default();
    let mut leader = Leader::new(
        ctx,
        Box::new(factory),
        Box::new(out.clone()),
        Box::new(NoMetrics),
        EngineOptions::default(),
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> =
        (0..4u32).map(|i| (0..6).map(|j| (i * 11 + j * 7 + 1) % 40).collect()).collect();
    let params = SamplingParams { max_tokens: 40, ignore_eos: true, ..SamplingParams::default() };
    let batch = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request::tokens(i as u64, p.clone(), params.clone()))
        .collect();
    let cfg = SessionConfig { token_budget: 5, ..SessionConfig::new(model.clone()) };
    leader.run(cfg, batch, &mut |_: &SessionReport| Decision::Stop).unwrap();
    let reference = Reference::load(&model);
    let seen = out.0.lock().unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let got: Vec<u32> = seen[&(i as u64)].iter().map(|(t, _)| *t).collect();
        assert_eq!(got, reference.greedy(p, 40), "request {i}");
    }
    let _ = std::fs::remove_file(&path);
}
