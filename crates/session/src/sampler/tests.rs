//! Sampler: greedy ties, seeded reproducibility, top-k and top-p cut-offs, grammar masks.

use super::*;
use crate::model::SampledToken;
use tensor::kernels::{DRAW_MAX_COLUMNS, TOP_K_MAX};

fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, seed, ..SamplingParams::default() }
}

#[test]
fn greedy_takes_the_first_maximum_and_skips_nan() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    assert_eq!(argmax(&[f32::NAN, -5.0, f32::NAN]), 1);
    assert_eq!(argmax(&[]), 0);
    let mut s = Sampler::new(SamplingParams::default());
    assert_eq!(s.sample(&[0.0, 2.0, 1.0]), 1);
}

#[test]
fn a_seed_reproduces_the_same_tokens() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let draw = |seed| {
        let mut s = Sampler::new(params(1.0, 0, 1.0, seed));
        (0..40).map(|_| s.sample(&logits)).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}

#[test]
fn top_k_and_top_p_keep_only_the_likely_tokens() {
    let logits = [0.0, 5.0, 4.9, 0.1, 4.8];
    let mut s = Sampler::new(params(1.0, 2, 1.0, 1));
    for _ in 0..200 {
        assert!([1, 2].contains(&s.sample(&logits)));
    }
    // One token holds nearly all the mass: top_p 0.5 keeps it alone.
    let logits = [0.0, 20.0, 1.0, 2.0];
    let mut s = Sampler::new(params(1.0, 0, 0.5, 3));
    for _ in 0..200 {
        assert_eq!(s.sample(&logits), 1);
    }
    // A high temperature with everything kept reaches every token eventually.
    let mut s = Sampler::new(params(50.0, 0, 1.0, 3));
    let mut seen = [false; 4];
    for _ in 0..400 {
        seen[s.sample(&logits) as usize] = true;
    }
    assert!(seen.iter().all(|&x| x), "{seen:?}");
}

#[test]
fn sampling_follows_the_softmax_of_the_kept_tokens() {
    // Two tokens one nat apart: with temperature 1 the first is e times as likely.
    let logits = [1.0, 0.0, -30.0];
    for (top_k, top_p) in [(0, 1.0), (2, 1.0), (0, 0.999)] {
        let mut s = Sampler::new(params(1.0, top_k, top_p, 11));
        let n = 20_000;
        let first = (0..n).filter(|_| s.sample(&logits) == 0).count() as f64 / n as f64;
        let want = std::f64::consts::E / (1.0 + std::f64::consts::E);
        assert!((first - want).abs() < 0.02, "top_k {top_k} top_p {top_p}: {first} vs {want}");
    }
}

#[test]
fn penalties_and_bias_move_the_greedy_choice() {
    let logits = [1.0, 3.0, 2.9, -1.0];
    let greedy = |p: SamplingParams, prompt: &[u32], generated: &[u32]| {
        Sampler::new(p).sample_next(&logits, prompt, generated)
    };
    let base = SamplingParams::default();
    assert_eq!(greedy(base.clone(), &[], &[1]), 1, "no penalty: the maximum");
    // Presence: token 1 was generated, 3.0 - 0.5 < 2.9.
    let p = SamplingParams { presence_penalty: 0.5, ..base.clone() };
    assert_eq!(greedy(p.clone(), &[], &[1]), 2);
    assert_eq!(greedy(p, &[1], &[]), 1, "the prompt does not count for presence");
    // Frequency: 0.04 per time; once is not enough, three times is.
    let p = SamplingParams { frequency_penalty: 0.04, ..base.clone() };
    assert_eq!(greedy(p.clone(), &[], &[1]), 1);
    assert_eq!(greedy(p, &[], &[1, 1, 1]), 2);
    // Repetition counts the prompt too, and divides positive logits: 3.0 / 1.1 < 2.9.
    let p = SamplingParams { repetition_penalty: 1.1, ..base.clone() };
    assert_eq!(greedy(p.clone(), &[1], &[]), 2);
    assert_eq!(greedy(p, &[], &[]), 1);
    // A bias can make any token win, and out-of-vocabulary ids are ignored.
    let p = SamplingParams { logit_bias: vec![(3, 10.0), (99, 5.0)], ..base };
    assert_eq!(greedy(p, &[], &[]), 3);
}

#[test]
fn min_p_drops_unlikely_tokens_when_sampling() {
    // Token 1 is e^3 ~ 20x as likely as 0 and 2: min_p 0.1 keeps only token 1.
    let logits = [0.0, 3.0, 0.0];
    let mut s = Sampler::new(SamplingParams { min_p: 0.1, ..params(1.0, 0, 1.0, 5) });
    for _ in 0..200 {
        assert_eq!(s.sample(&logits), 1);
    }
    let mut s = Sampler::new(params(1.0, 0, 1.0, 5));
    assert!((0..200).any(|_| s.sample(&logits) != 1), "without min_p the others come up");
}

#[test]
fn logprobs_are_the_log_softmax_of_the_raw_logits() {
    let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
    let lp = TokenLogprobs::of(&logits, 4, 3);
    let lse = [1.0f64, 3.0, 3.0, -2.0].iter().map(|l| l.exp()).sum::<f64>().ln();
    assert!((f64::from(lp.logprob) - (-2.0 - lse)).abs() < 1e-6, "{lp:?}");
    // Most likely first, the tie by the lower id; NaN never listed.
    let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
    assert_eq!(ids, [1, 3, 0]);
    assert_eq!(lp.top[0].1, lp.top[1].1);
    let all = TokenLogprobs::of(&logits, 2, 10);
    assert_eq!(all.logprob, f32::NEG_INFINITY);
    assert_eq!(all.top.len(), 4);
    let total: f64 = all.top.iter().map(|t| f64::from(t.1).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6, "{total}");
}

#[test]
fn logprobs_ignore_temperature_and_bias_and_only_come_when_asked() {
    let logits = [0.5f32, 2.0, 1.0];
    let plain = Sampler::new(SamplingParams::default());
    assert_eq!(plain.logprobs(&logits, 1), None);
    let params = SamplingParams {
        temperature: 0.7,
        logit_bias: vec![(0, 50.0)],
        logprobs: Some(1),
        ..SamplingParams::default()
    };
    let mut s = Sampler::new(params);
    let token = s.sample_next(&logits, &[], &[]);
    assert_eq!(token, 0, "the bias decides the choice");
    let lp = s.logprobs(&logits, token).unwrap();
    assert_eq!(lp, TokenLogprobs::of(&logits, 0, 1));
    assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1]);
}

#[test]
fn a_resumed_generator_continues_where_the_first_stopped() {
    let logits: Vec<f32> = (0..30).map(|i| ((i * 13) % 7) as f32 * 0.4).collect();
    let p = params(0.9, 0, 1.0, 21);
    let mut whole = Sampler::new(p.clone());
    let all: Vec<u32> = (0..12).map(|_| whole.sample(&logits)).collect();
    let mut resumed = Sampler::resumed(p.clone(), 5);
    let rest: Vec<u32> = (0..7).map(|_| resumed.sample(&logits)).collect();
    assert_eq!(rest, all[5..]);
    // An all-NaN row still takes its draw, so the tokens after it keep their draws.
    let mut s = Sampler::new(p.clone());
    assert_eq!(s.sample(&[f32::NAN; 4]), 0);
    assert_eq!(s.sample(&logits), Sampler::resumed(p, 1).sample(&logits));
}

fn plan_of(entries: Vec<crate::PlanEntry>) -> StepPlan {
    StepPlan { epoch: 0, step: 3, entries, released: Vec::new() }
}

fn entry(seq: u64, sample: bool, sampling: Option<SeqSampling>) -> crate::PlanEntry {
    crate::PlanEntry {
        seq,
        start: 0,
        tokens: vec![1],
        sample,
        reserve: 8,
        blocks: Vec::new(),
        sampling: sampling.map(Box::new),
    }
}

#[test]
fn the_runner_samples_each_sequence_with_the_parameters_its_first_entry_brought() {
    let mut samplers = Samplers::new();
    let greedy = SeqSampling::default();
    let biased = SeqSampling {
        params: SamplingParams {
            logit_bias: vec![(0, 10.0)],
            logprobs: Some(1),
            ..SamplingParams::default()
        },
        ..SeqSampling::default()
    };
    let plan = plan_of(vec![entry(1, true, Some(greedy)), entry(2, false, Some(biased))]);
    // One sampled entry of a 3-token vocabulary.
    let out = samplers.sample(&plan, &[0.0, 2.0, 1.0], 3).unwrap();
    assert_eq!(out, vec![SampledToken { token: 1, logprobs: None }]);
    assert_eq!(samplers.len(), 2);
    // Later entries bring nothing: each sequence keeps its own sampler.
    let plan = plan_of(vec![entry(1, true, None), entry(2, true, None)]);
    let out = samplers.sample(&plan, &[0.0, 2.0, 1.0, 0.0, 2.0, 1.0], 3).unwrap();
    assert_eq!(out[0].token, 1);
    assert_eq!(out[1].token, 0, "the bias picks token 0");
    let lp = out[1].logprobs.as_ref().unwrap();
    assert_eq!(lp.top[0].0, 1, "log-probabilities are the model's own, before the bias");
    assert_eq!(*lp, TokenLogprobs::of(&[0.0, 2.0, 1.0], 0, 1));

    let err = samplers.sample(&plan, &[0.0; 3], 3).unwrap_err();
    assert_eq!(err, SampleError::Logits { values: 3, sampled: 2, vocab: 3 });
    samplers.release(2);
    let err = samplers.sample(&plan, &[0.0; 6], 3).unwrap_err();
    assert_eq!(
        err.to_string(),
        "sequence 2 is sampled in step 3, but no plan carried its sampling parameters"
    );
}

/// A step is argmax-only when every sampled sequence is greedy with nothing else wanted of
/// its logits (a penalty or a bias is an edit the runner applies first); a sequence that is
/// not sampled does not count, unless its prompt is scored.
#[test]
fn only_plain_greedy_steps_skip_the_logits() {
    let with = |params: SamplingParams| SeqSampling { params, ..SeqSampling::default() };
    let plain = SeqSampling::default();
    let cases = [
        ("greedy", plain.clone(), true),
        ("sampled", with(SamplingParams { temperature: 0.7, ..Default::default() }), false),
        ("logprobs", with(SamplingParams { logprobs: Some(2), ..Default::default() }), false),
        ("bias", with(SamplingParams { logit_bias: vec![(1, 1.0)], ..Default::default() }), true),
        ("penalty", with(SamplingParams { presence_penalty: 0.5, ..Default::default() }), true),
        ("prompt", with(SamplingParams { prompt_logprobs: Some(1), ..Default::default() }), false),
    ];
    for (what, sampling, want) in cases {
        let mut samplers = Samplers::new();
        let plan =
            plan_of(vec![entry(1, true, Some(plain.clone())), entry(2, true, Some(sampling))]);
        samplers.admit(&plan);
        assert_eq!(samplers.argmax_only(&plan), want, "{what}");
        let edits = samplers.edits(&plan);
        assert!(edits[0].is_empty(), "{what}: a plain sampler edits nothing");
        assert_eq!(edits[1].is_empty(), !what.starts_with('b'), "{what}: only the bias edits");
    }
    // Not sampled in this step: only a scored prompt needs its rows.
    let mut samplers = Samplers::new();
    let sampled = with(SamplingParams { temperature: 0.7, ..Default::default() });
    let plan = plan_of(vec![entry(1, true, Some(plain.clone())), entry(2, false, Some(sampled))]);
    samplers.admit(&plan);
    assert!(samplers.argmax_only(&plan));
    let scored = with(SamplingParams { prompt_logprobs: Some(1), ..Default::default() });
    let plan = plan_of(vec![entry(3, true, Some(plain)), entry(4, false, Some(scored))]);
    samplers.admit(&plan);
    assert!(!samplers.argmax_only(&plan));
}

/// A step can pick from a few candidates per row when every sampled sequence keeps fewer than
/// `TOP_K_MAX` tokens and nothing else is wanted of its logits: one more than the most any
/// keeps.
#[test]
fn steps_of_samplers_that_keep_a_few_tokens_need_only_candidates() {
    let with = |params: SamplingParams| SeqSampling { params, ..SeqSampling::default() };
    let plain = SeqSampling::default();
    let top =
        |k| with(SamplingParams { temperature: 0.8, top_k: k, top_p: 0.9, ..Default::default() });
    let cases = [
        ("greedy", plain.clone(), Some(1)),
        ("top-k", top(40), Some(40)),
        ("top-k at the most", top(TOP_K_MAX - 1), Some(TOP_K_MAX - 1)),
        ("top-k above the most", top(TOP_K_MAX), None),
        ("no top-k", top(0), None),
        ("logprobs", with(SamplingParams { logprobs: Some(2), ..Default::default() }), None),
        (
            "bias",
            with(SamplingParams { logit_bias: vec![(1, 1.0)], ..Default::default() }),
            Some(1),
        ),
        ("penalty", with(SamplingParams { presence_penalty: 0.5, ..Default::default() }), Some(1)),
        ("prompt", with(SamplingParams { prompt_logprobs: Some(1), ..Default::default() }), None),
    ];
    for (what, sampling, want) in cases {
        let mut samplers = Samplers::new();
        let plan = plan_of(vec![entry(1, true, Some(top(3))), entry(2, true, Some(sampling))]);
        samplers.admit(&plan);
        assert_eq!(samplers.candidates(&plan), want.map(|k: usize| k.max(3) + 1), "{what}");
    }
    // A sequence that is not sampled in the step does not count.
    let mut samplers = Samplers::new();
    let plan = plan_of(vec![entry(1, true, Some(top(3))), entry(2, false, Some(top(0)))]);
    samplers.admit(&plan);
    assert_eq!(samplers.candidates(&plan), Some(4));
}

/// A row's candidates give the token its whole row gives, draw after draw: greedy (the first
/// of equal maxima, -0 equal to +0), top-k with and without top-p and min-p, from one more
/// candidate than top-k or more (a batch's largest), and rows with no more numbers than top-k
/// (NaN), where the row's order weighs them. Rows of few distinct values, so ties decide often.
#[test]
fn sampling_from_a_rows_candidates_picks_what_the_row_picks() {
    let be = tensor::Backend::cpu(1).unwrap();
    let vocab = 300;
    let mut state = 1u64;
    let mut next = move || {
        state =
            state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as u32
    };
    let mut checked = 0;
    for case in 0..200 {
        let levels = [3, 20, 1000][case % 3];
        let holes = case % 4 == 0;
        let row: Vec<f32> = (0..vocab)
            .map(|_| {
                let v = (next() % levels) as f32 * 0.25 - 2.0;
                match (holes, next() % 8) {
                    (true, 0) => f32::NAN,
                    (true, 1) => -0.0,
                    (true, 2) => 0.0,
                    _ => v,
                }
            })
            .collect();
        let numbers = row.iter().filter(|v| !v.is_nan()).count();
        let temperature = [0.0, 0.5, 1.0, 1.7][case % 4];
        let top_k = [1, 2, 7, 50, 299, 400][(next() % 6) as usize];
        let top_p = [1.0, 0.9, 0.5][(next() % 3) as usize];
        let min_p = [0.0, 0.05][(next() % 2) as usize];
        let p = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: case as u64,
            ..Default::default()
        };
        let keep = if temperature <= 0.0 { 1 } else { top_k };
        // One more than the row keeps, or more (a batch's largest).
        let n = keep + 1 + [0, 5][case % 2];
        let x = tensor::Tensor::from_vec(&[1, vocab], row.clone()).unwrap();
        let top = be.top_k_rows(&x, n).unwrap();
        let (mut whole, mut part) = (Sampler::new(p.clone()), Sampler::new(p));
        for draw in 0..20 {
            let want = whole.sample(&row);
            let got = part.sample_candidates(top.row(0));
            assert_eq!(got, want, "case {case} draw {draw}: {numbers} numbers, k {top_k}, n {n}");
            checked += 1;
        }
    }
    assert_eq!(checked, 4000);
}

/// A step is drawn where its logits are when every sampled sequence is greedy or draws from
/// its whole row (no top-k), with nothing else wanted of its logits, and the vocabulary fits
/// the kernel.
#[test]
fn steps_of_samplers_that_weigh_every_token_are_drawn_where_the_logits_are() {
    let with = |params: SamplingParams| SeqSampling { params, ..SeqSampling::default() };
    let warm = |p: SamplingParams| with(SamplingParams { temperature: 0.8, ..p });
    let cases = [
        ("greedy", SeqSampling::default(), true),
        ("temperature", warm(SamplingParams::default()), true),
        ("min-p", warm(SamplingParams { min_p: 0.1, ..Default::default() }), true),
        ("top-k", warm(SamplingParams { top_k: 5, ..Default::default() }), false),
        ("top-p", warm(SamplingParams { top_p: 0.9, ..Default::default() }), true),
        (
            "top-k and top-p",
            warm(SamplingParams { top_k: 9, top_p: 0.9, ..Default::default() }),
            false,
        ),
        ("logprobs", warm(SamplingParams { logprobs: Some(1), ..Default::default() }), false),
        ("penalty", warm(SamplingParams { frequency_penalty: 0.5, ..Default::default() }), true),
        ("prompt", warm(SamplingParams { prompt_logprobs: Some(1), ..Default::default() }), false),
    ];
    for (what, sampling, want) in cases {
        let mut samplers = Samplers::new();
        let plan = plan_of(vec![
            entry(1, true, Some(warm(SamplingParams::default()))),
            entry(2, true, Some(sampling)),
        ]);
        samplers.admit(&plan);
        assert_eq!(samplers.drawable(&plan, 1000), want, "{what}");
    }
    let mut samplers = Samplers::new();
    let plan = plan_of(vec![entry(1, true, None)]);
    samplers.admit(&plan);
    assert!(!samplers.drawable(&plan, 1000), "a sequence without parameters");
    let plan = plan_of(vec![entry(2, true, Some(SeqSampling::default()))]);
    samplers.admit(&plan);
    assert!(!samplers.drawable(&plan, tensor::kernels::DRAW_MAX_COLUMNS + 1), "too wide");
}

/// A sampler's draws, drawn where the row is (`sample_rows`), give the tokens the sampler picks
/// from the row, draw after draw, and greedy rows take no number from the generator.
#[test]
fn draws_where_the_row_is_pick_what_the_sampler_picks() {
    let be = tensor::Backend::cpu(1).unwrap();
    let vocab = 700;
    for case in 0..24u64 {
        let row: Vec<f32> = (0..vocab)
            .map(|i| match (i * 31 + case as usize * 7) % 97 {
                0 => f32::NAN,
                v => (v % 13) as f32 * 0.5 - 3.0,
            })
            .collect();
        let x = tensor::Tensor::from_vec(&[1, vocab], row.clone()).unwrap();
        let p = SamplingParams {
            temperature: [0.0, 0.3, 1.0, 1.9][case as usize % 4],
            min_p: [0.0, 0.2][case as usize % 2],
            top_p: [1.0, 0.9, 0.6][case as usize % 3],
            seed: case,
            ..Default::default()
        };
        let (mut whole, mut there) = (Sampler::new(p.clone()), Sampler::new(p));
        for draw in 0..30 {
            let want = whole.sample(&row);
            let got = be.sample_rows(&x, &[there.next_draw()]).unwrap()[0];
            assert_eq!(got, want, "case {case} draw {draw}");
        }
        // Both generators are at the same place: the next draws agree.
        assert_eq!(whole.uniform(), there.uniform(), "case {case}");
    }
}

#[test]
fn penalties_count_the_history_sent_and_the_tokens_sampled_since() {
    let penalized = |generated: Vec<u32>| SeqSampling {
        params: SamplingParams { presence_penalty: 5.0, ..SamplingParams::default() },
        drawn: generated.len() as u32,
        prompt: vec![],
        generated,
    };
    let logits = [3.0, 2.0, 1.0];
    let mut samplers = Samplers::new();
    // Token 0 was generated before (a recompute): it is penalized from the first sample on.
    let plan = plan_of(vec![entry(1, true, Some(penalized(vec![0])))]);
    assert_eq!(samplers.sample(&plan, &logits, 3).unwrap()[0].token, 1);
    // Token 1, sampled here, is remembered too.
    let plan = plan_of(vec![entry(1, true, None)]);
    assert_eq!(samplers.sample(&plan, &logits, 3).unwrap()[0].token, 2);
}

#[test]
fn a_rank_counts_the_tokens_above_and_nan_is_below_all() {
    let logits = [1.0f32, 3.0, f32::NAN, 3.0, 0.5];
    let rank = |t| RankedLogprobs::of(&logits, t, 0).rank;
    assert_eq!([rank(1), rank(3), rank(0), rank(4)], [1, 1, 3, 4]);
    assert_eq!(rank(2), 6, "a NaN logit is below every token");
    assert_eq!(rank(9), 6, "an id outside the row too");
}

/// Prompt log-probabilities over chunks: each row scores the next prompt token, a chunk that
/// does not sample keeps its last row for the next chunk's first token, the sampled row picks
/// the first token, and after it the sequence's decode entries are single rows again.
#[test]
fn prompt_rows_score_the_next_prompt_token_across_chunks() {
    let mut samplers = Samplers::new();
    let asks = SeqSampling {
        params: SamplingParams { prompt_logprobs: Some(1), ..SamplingParams::default() },
        ..SeqSampling::default()
    };
    let row = |i: u32| -> Vec<f32> { (0..4).map(|t| if t == i % 4 { 2.0 } else { 0.0 }).collect() };
    let chunk = |start: u32, tokens: Vec<u32>, sample: bool, sampling: Option<SeqSampling>| {
        crate::PlanEntry { start, tokens, sample, ..entry(7, sample, sampling) }
    };
    // Tokens 0..3 of the prompt [1, 2, 3, 0, 1], then 3..5 with the sample, next to a plain
    // sequence sampled at its last row.
    let first = plan_of(vec![
        chunk(0, vec![1, 2, 3], false, Some(asks)),
        entry(8, true, Some(SeqSampling::default())),
    ]);
    samplers.admit(&first);
    assert!(samplers.every_row(&first.entries[0]));
    assert!(!samplers.every_row(&first.entries[1]));
    let logits: Vec<f32> = [row(2), row(0), row(1), row(3)].concat();
    let (out, prompt) = samplers.sample_with_prompts(&first, &logits, 4).unwrap();
    assert_eq!(out.iter().map(|t| t.token).collect::<Vec<_>>(), [3]);
    assert_eq!(prompt.len(), 1);
    assert_eq!((prompt[0].seq, prompt[0].start), (7, 1));
    let want = [RankedLogprobs::of(&row(2), 2, 1), RankedLogprobs::of(&row(0), 3, 1)];
    assert_eq!(prompt[0].tokens, want);
    assert_eq!(prompt[0].tokens[0].rank, 1);

    let second = plan_of(vec![chunk(3, vec![0, 1], true, None)]);
    let logits: Vec<f32> = [row(0), row(2)].concat();
    let (out, prompt) = samplers.sample_with_prompts(&second, &logits, 4).unwrap();
    assert_eq!(out[0].token, 2, "greedy over the last row");
    assert_eq!(prompt[0].start, 3, "the kept row scores the chunk's first token");
    let want = [RankedLogprobs::of(&row(1), 0, 1), RankedLogprobs::of(&row(0), 1, 1)];
    assert_eq!(prompt[0].tokens, want);

    let decode = plan_of(vec![chunk(5, vec![2], true, None)]);
    assert!(!samplers.every_row(&decode.entries[0]), "the prompt is scored");
    let (out, prompt) = samplers.sample_with_prompts(&decode, &row(1), 4).unwrap();
    assert_eq!((out[0].token, prompt.len()), (1, 0));
    // A rank without the logits agrees: its sequence's prompt is scored once sampled.
    let mut elsewhere = Samplers::new();
    elsewhere.admit(&first);
    elsewhere.end_step(&first);
    assert!(elsewhere.every_row(&second.entries[0]));
    elsewhere.end_step(&second);
    assert!(!elsewhere.every_row(&decode.entries[0]), "as on the rank with the logits");
    // Too few rows for the plan: the error says so.
    let err = samplers.sample_with_prompts(&decode, &[], 4).unwrap_err();
    assert!(matches!(err, SampleError::Logits { values: 0, .. }), "{err}");
}

/// A grammar engine over the vocabulary `<eos>` (0), `a` (1), `b` (2), `0`..`9` (3..=12).
fn digits_engine() -> GrammarEngine {
    use checkpoint::gguf::{GgufFile, GgufWriter, Value};
    let mut tokens = vec!["<eos>".to_owned(), "a".into(), "b".into()];
    tokens.extend(('0'..='9').map(String::from));
    let types = (0..tokens.len()).map(|i| Value::I32(if i == 0 { 3 } else { 1 })).collect();
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata(
            "tokenizer.ggml.tokens",
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        )
        .metadata("tokenizer.ggml.token_type", Value::Array(types))
        .metadata("tokenizer.ggml.merges", Value::Array(Vec::new()))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(0));
    let path = tensor::test_util::temp_path("digits.gguf");
    w.write(&path).unwrap();
    let tokenizer = text::Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    std::fs::remove_file(path).unwrap();
    GrammarEngine::new(&tokenizer).unwrap()
}

fn constrained(regex: &str, generated: Vec<u32>) -> SeqSampling {
    SeqSampling {
        params: SamplingParams {
            logprobs: Some(0),
            constraint: Some(text::Grammar::Regex(regex.into())),
            ..SamplingParams::default()
        },
        drawn: generated.len() as u32,
        prompt: vec![],
        generated,
    }
}

#[test]
fn a_grammar_masks_its_sequence_only_and_ends_it_with_the_end_token() {
    // The model always prefers `b`, then the end token, then 7.
    let mut logits = vec![0.0f32; 13];
    logits[2] = 5.0;
    logits[0] = 4.0;
    logits[10] = 3.0;
    let mut samplers = Samplers::new().with_grammars(digits_engine());
    let plan = plan_of(vec![
        entry(1, true, Some(constrained("a[0-9]", vec![]))),
        entry(2, true, Some(SeqSampling::default())),
    ]);
    let rows = [logits.clone(), logits.clone()].concat();
    let out = samplers.sample(&plan, &rows, 13).unwrap();
    assert_eq!((out[0].token, out[1].token), (1, 2), "only `a` may start the regex");
    let lp = out[0].logprobs.as_ref().unwrap();
    assert_eq!(*lp, TokenLogprobs::of(&logits, 1, 0), "the model's own log-probability");
    let plan = plan_of(vec![entry(1, true, None), entry(2, true, None)]);
    let picks = |s: &mut Samplers| {
        let out = s.sample(&plan, &rows, 13).unwrap();
        (out[0].token, out[1].token)
    };
    assert_eq!(picks(&mut samplers), (10, 2), "the best digit, not `b` or the end");
    assert_eq!(picks(&mut samplers), (0, 2), "complete: only the end token");

    // A recomputed sequence replays what it generated before.
    let mut resumed = Samplers::new().with_grammars(digits_engine());
    let plan = plan_of(vec![entry(3, true, Some(constrained("a[0-9]", vec![1])))]);
    assert_eq!(resumed.sample(&plan, &logits, 13).unwrap()[0].token, 10);

    // Without an engine a constrained sequence is an error, not free text.
    let mut bare = Samplers::new();
    let plan = plan_of(vec![entry(4, true, Some(constrained("a", vec![])))]);
    let err = bare.sample(&plan, &logits, 13).unwrap_err();
    assert_eq!(err, SampleError::NoGrammarEngine { seq: 4 });
}

#[test]
fn a_grammar_that_allows_nothing_ends_its_sequence() {
    // `c` is not in the vocabulary: no token can start it, so the end token is picked (the
    // request's stop tokens do not hold it: the scheduler adds the end ids on its side).
    let mut logits = vec![1.0f32; 13];
    logits[0] = -3.0;
    let mut samplers = Samplers::new().with_grammars(digits_engine());
    let plan = plan_of(vec![entry(1, true, Some(constrained("c", vec![])))]);
    assert_eq!(samplers.sample(&plan, &logits, 13).unwrap()[0].token, 0);
    // The request's own stop tokens may end it too.
    let mut stopped = constrained("c", vec![]);
    stopped.params.stop = vec![5];
    logits[5] = 2.0;
    let plan = plan_of(vec![entry(2, true, Some(stopped))]);
    assert_eq!(samplers.sample(&plan, &logits, 13).unwrap()[0].token, 5);
}

/// A step whose samplers mix those that keep a few tokens with those that weigh their whole
/// row (or are greedy) is neither the candidates' path nor the draws' but both at once; a
/// sampler that wants more of its logits, or a top-k too large, leaves it to the host.
#[test]
fn steps_that_mix_candidates_and_whole_rows_are_sampled_where_the_logits_are() {
    let with = |params: SamplingParams| SeqSampling { params, ..SeqSampling::default() };
    let warm = |p: SamplingParams| with(SamplingParams { temperature: 0.8, ..p });
    let top_k = |k| warm(SamplingParams { top_k: k, ..Default::default() });
    let cases = [
        ("top-k and whole row", vec![top_k(5), warm(SamplingParams::default())], Some(6)),
        (
            "top-k, top-p and greedy",
            vec![
                top_k(9),
                warm(SamplingParams { top_p: 0.9, ..Default::default() }),
                SeqSampling::default(),
            ],
            Some(10),
        ),
        ("top-k alone is the candidates' path", vec![top_k(5), top_k(7)], Some(8)),
        ("a top-k too large", vec![top_k(5), top_k(TOP_K_MAX)], None),
        (
            "log-probabilities",
            vec![top_k(5), warm(SamplingParams { logprobs: Some(2), ..Default::default() })],
            None,
        ),
        (
            "a penalty",
            vec![top_k(5), warm(SamplingParams { presence_penalty: 1.0, ..Default::default() })],
            Some(6),
        ),
    ];
    for (what, samplings, want) in cases {
        let mut samplers = Samplers::new();
        let plan = step_plan(0, samplings);
        samplers.admit(&plan);
        assert_eq!(samplers.mixed(&plan, 1000), want, "{what}");
        if want.is_some() && !what.contains("alone") {
            // Neither path alone takes the step.
            assert_eq!(samplers.candidates(&plan), None, "{what}");
            assert!(!samplers.drawable(&plan, 1000), "{what}");
        }
        if want.is_some() {
            assert_eq!(samplers.mixed(&plan, DRAW_MAX_COLUMNS + 1), None, "{what}: too wide");
        }
    }
}

/// Sampling at temperature 0.9 with `seed`, the rest of `p`.
fn seeded(seed: u64, p: SamplingParams) -> SeqSampling {
    SeqSampling { params: SamplingParams { seed, temperature: 0.9, ..p }, ..SeqSampling::default() }
}

/// Step `step` of sequences 1, 2, ... each sampling one token, with `samplings` brought by
/// their first entries (step 0).
fn step_plan(step: u64, samplings: Vec<SeqSampling>) -> StepPlan {
    let entries = samplings
        .into_iter()
        .enumerate()
        .map(|(i, s)| entry(i as u64 + 1, true, (step == 0).then_some(s)));
    plan_of(entries.collect())
}

/// The tokens of mixed steps, candidates picked on the host and whole rows drawn where the
/// logits are, are those the samplers pick from the rows' logits, step after step (so each
/// generator takes its numbers as the plain path takes them).
#[test]
fn mixed_steps_pick_what_the_samplers_pick_from_the_rows() {
    let be = tensor::Backend::cpu(1).unwrap();
    let vocab = 300;
    let samplings = || {
        vec![
            seeded(1, SamplingParams { top_k: 7, ..Default::default() }),
            seeded(2, SamplingParams { top_p: 0.8, ..Default::default() }),
            SeqSampling::default(),
            seeded(3, SamplingParams { top_k: 2, top_p: 0.7, ..Default::default() }),
            seeded(4, SamplingParams { min_p: 0.1, ..Default::default() }),
        ]
    };
    let (mut plain, mut mixed) = (Samplers::new(), Samplers::new());
    for step in 0..12u64 {
        let plan = step_plan(step, samplings());
        let rows = 5;
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i as u64 * 2654435761 + step * 97) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let want = plain.sample(&plan, &logits, vocab).unwrap();
        mixed.admit(&plan);
        let k = mixed.mixed(&plan, vocab).expect("a mixed step");
        let draws = mixed.draws(&plan).unwrap();
        let x = tensor::Tensor::from_vec(&[rows, vocab], logits).unwrap();
        let top = be.top_k_rows(&x, k).unwrap();
        let drawn = be.sample_rows(&x, &draws).unwrap();
        let got = mixed.pick_mixed(&plan, &top, &drawn).unwrap();
        mixed.end_step(&plan);
        let tokens = |out: &StepOutput| out.iter().map(|t| t.token).collect::<Vec<_>>();
        assert_eq!(tokens(&got), tokens(&want), "step {step}");
    }
    let plan = plan_of(vec![entry(1, true, None)]);
    let top = be.top_k_rows(&tensor::Tensor::zeros(&[2, vocab]), 3).unwrap();
    assert!(mixed.pick_mixed(&plan, &top, &[0]).is_err(), "rows the plan does not sample");
}

/// Which steps are scored where the logits are: those whose sampled entries want their
/// tokens' log-probabilities, each drawn from its whole row, greedy or from a few
/// candidates, with nothing else wanted of the logits.
#[test]
fn steps_that_want_log_probabilities_are_scored_where_the_logits_are() {
    let with = |params: SamplingParams| SeqSampling { params, ..SeqSampling::default() };
    let scored = |n| SamplingParams { logprobs: Some(n), ..Default::default() };
    let warm = |p: SamplingParams| with(SamplingParams { temperature: 0.8, ..p });
    let cases = [
        (
            "greedy beside one that wants two",
            vec![with(scored(2)), SeqSampling::default()],
            Some((None, 2)),
        ),
        ("its own only", vec![warm(scored(0))], Some((None, 0))),
        (
            "a top-k beside",
            vec![warm(SamplingParams { top_k: 5, ..Default::default() }), with(scored(3))],
            Some((Some(6), 3)),
        ),
        (
            "penalties and a bias",
            vec![warm(SamplingParams {
                presence_penalty: 0.5,
                logit_bias: vec![(3, 2.0)],
                ..scored(1)
            })],
            Some((None, 1)),
        ),
        ("none wanted", vec![warm(SamplingParams::default())], None),
        ("too many alternatives", vec![with(scored(TOP_K_MAX + 1))], None),
        ("a top-k too large", vec![warm(SamplingParams { top_k: TOP_K_MAX, ..scored(1) })], None),
        (
            "a scored prompt",
            vec![with(SamplingParams { prompt_logprobs: Some(1), ..scored(1) })],
            None,
        ),
    ];
    for (what, samplings, want) in cases {
        let mut samplers = Samplers::new();
        let plan = step_plan(0, samplings);
        samplers.admit(&plan);
        let want = want.map(|(candidates, top)| Scoring { candidates, top });
        assert_eq!(samplers.scored(&plan, 1000), want, "{what}");
        if want.is_some() {
            assert_eq!(samplers.scored(&plan, DRAW_MAX_COLUMNS + 1), None, "{what}: too wide");
            assert!(!samplers.argmax_only(&plan) && samplers.candidates(&plan).is_none());
            assert!(!samplers.drawable(&plan, 1000) && samplers.mixed(&plan, 1000).is_none());
        }
    }
}

/// Scored steps give what the samplers give from the rows' logits, tokens and
/// log-probabilities bit for bit, step after step: each row's normalizer and most likely
/// tokens before the edits, the draws and candidates after them, the picked tokens' logits
/// read back; penalties, a bias, NaN and -inf logits among them.
#[test]
fn scored_steps_give_what_the_samplers_give_from_the_rows() {
    let be = tensor::Backend::cpu(2).unwrap();
    let vocab = 700;
    let samplings = || {
        vec![
            seeded(1, SamplingParams { top_k: 7, logprobs: Some(3), ..Default::default() }),
            seeded(2, SamplingParams { top_p: 0.8, logprobs: Some(0), ..Default::default() }),
            SeqSampling {
                params: SamplingParams {
                    logprobs: Some(5),
                    presence_penalty: 0.7,
                    repetition_penalty: 1.3,
                    logit_bias: vec![(4, 9.0), (650, -3.0)],
                    ..Default::default()
                },
                ..SeqSampling::default()
            },
            seeded(3, SamplingParams { min_p: 0.1, ..Default::default() }),
            seeded(
                4,
                SamplingParams {
                    logprobs: Some(20),
                    logit_bias: vec![(9, 4.0)],
                    ..Default::default()
                },
            ),
        ]
    };
    let (mut plain, mut scored) = (Samplers::new(), Samplers::new());
    let mut wanted = 0;
    for step in 0..10u64 {
        let plan = step_plan(step, samplings());
        let rows = 5;
        let mut logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i as u64 * 2654435761 + step * 97) % 1000) as f32 / 150.0 - 2.0)
            .collect();
        logits[vocab + 11] = f32::NAN;
        logits[2 * vocab + 4] = f32::NEG_INFINITY;
        let want = plain.sample(&plan, &logits, vocab).unwrap();
        scored.admit(&plan);
        let how = scored.scored(&plan, vocab).expect("a scored step");
        let draws = scored.draws(&plan).unwrap();
        let raw = tensor::Tensor::from_vec(&[rows, vocab], logits).unwrap();
        let normalizers = be.normalizers(&raw).unwrap();
        let best = be.top_k_rows(&raw, how.top).unwrap();
        let mut edited = raw.clone();
        let edits = scored.edits(&plan);
        let rows_of: Vec<&[tensor::kernels::LogitEdit]> = edits.iter().map(Vec::as_slice).collect();
        be.edit_rows(&mut edited, &tensor::kernels::LogitEdits::from_rows(rows_of), 0).unwrap();
        let top = how.candidates.map(|k| be.top_k_rows(&edited, k).unwrap());
        let drawn = be.sample_rows(&edited, &draws).unwrap();
        let mut got = scored.pick_scored(&plan, top.as_ref(), &drawn).unwrap();
        let picked: Vec<u32> = got.iter().map(|t| t.token).collect();
        let own = be.columns_at(&raw, &picked).unwrap();
        scored.score_picks(&plan, &mut got, &normalizers, &best, &own).unwrap();
        scored.end_step(&plan);
        assert_eq!(got, want, "step {step}");
        wanted +=
            got.iter().filter(|t| t.logprobs.as_ref().is_some_and(|l| !l.top.is_empty())).count();
    }
    assert_eq!(wanted, 10 * 3, "three rows a step list alternatives");
    let plan = plan_of(vec![entry(1, true, None)]);
    let normalizers = vec![tensor::kernels::Normalizer { top: 0.0, sum: 1.0 }; 2];
    let best = be.top_k_rows(&tensor::Tensor::zeros(&[2, vocab]), 3).unwrap();
    let mut out = vec![SampledToken { token: 0, logprobs: None }];
    assert!(scored.score_picks(&plan, &mut out, &normalizers, &best, &[0.0]).is_err());
}
