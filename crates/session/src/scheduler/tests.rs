//! Scheduler: budgets, chunked prefill next to decode, joins and leaves at boundaries.

use super::*;
use crate::model::KvLayout;
use layers::model::window_dead_blocks;
use std::collections::HashMap;

fn req(id: u64, len: usize, max_tokens: u32) -> Request {
    let params = SamplingParams { max_tokens, ..SamplingParams::default() };
    Request::tokens(id, (1..=len as u32).collect(), params)
}

/// The model runner's output: `token` for every sampled entry.
fn pick(plan: &StepPlan, token: usize) -> Vec<SampledToken> {
    plan.sampled().map(|_| SampledToken { token: token as u32, logprobs: None }).collect()
}

/// Plans step `step + 1`, runs it with `token` for every sampled entry, and returns its plan.
fn run_step(s: &mut Scheduler, step: &mut u64, token: usize) -> StepPlan {
    *step += 1;
    let plan = s.plan(0, *step).unwrap();
    s.apply(&plan, pick(&plan, token)).unwrap();
    plan
}

#[test]
fn prompts_are_chunked_to_the_budget_and_decode_goes_first() {
    let mut s = Scheduler::new(4, 8, 100, Vec::new());
    assert!(s.add(req(10, 6, 2), None, 0).unwrap().is_none());
    let p1 = s.plan(0, 1).unwrap();
    assert_eq!(p1.entries.len(), 1);
    assert_eq!(
        (p1.entries[0].start, p1.entries[0].tokens.len(), p1.entries[0].sample),
        (0, 4, false)
    );
    assert_eq!(s.take_started(), [10], "its first chunk ends its queue time");
    assert!(s.apply(&p1, Vec::new()).unwrap().is_empty());
    let p2 = s.plan(0, 2).unwrap();
    assert!(s.take_started().is_empty(), "a later chunk starts nothing");
    assert_eq!(
        (p2.entries[0].start, p2.entries[0].tokens.clone(), p2.entries[0].sample),
        (4, vec![5, 6], true)
    );
    assert_eq!(
        s.apply(&p2, pick(&p2, 3)).unwrap(),
        vec![Emit::Token { request: 10, token: 3, logprobs: None }]
    );
    // A second request joins: its prompt is prefilled next to the first one's decode token.
    s.add(req(11, 5, 1), None, 0).unwrap();
    let p3 = s.plan(0, 3).unwrap();
    // Its cache needs room for the prompt and the 2 tokens it may generate.
    let reserve = 6 + 2;
    assert_eq!(
        p3.entries[0],
        PlanEntry {
            seq: 1,
            start: 6,
            tokens: vec![3],
            sample: true,
            reserve,
            blocks: vec![],
            sampling: None
        }
    );
    assert_eq!(
        (p3.entries[1].seq, p3.entries[1].tokens.len(), p3.entries[1].sample),
        (2, 3, false)
    );
    let out = s.apply(&p3, pick(&p3, 5)).unwrap();
    assert_eq!(
        out,
        vec![
            Emit::Token { request: 10, token: 5, logprobs: None },
            Emit::Finished { request: 10, reason: FinishReason::Length, tokens: vec![3, 5] }
        ]
    );
    let p4 = s.plan(0, 4).unwrap();
    assert_eq!(p4.released, vec![1]);
    assert_eq!((p4.entries[0].seq, p4.entries[0].start, p4.entries[0].sample), (2, 3, true));
    let out = s.apply(&p4, pick(&p4, 7)).unwrap();
    assert!(matches!(out[1], Emit::Finished { request: 11, .. }));
    assert!(!s.has_work());
    assert!(s.plan(0, 5).is_none());
}

#[test]
fn stop_tokens_eos_and_context_end_requests() {
    let mut s = Scheduler::new(64, 8, 6, vec![7]);
    s.add(req(1, 3, 50), None, 0).unwrap();
    let p = s.plan(0, 1).unwrap();
    let out = s.apply(&p, pick(&p, 7)).unwrap();
    assert_eq!(
        out[1],
        Emit::Finished { request: 1, reason: FinishReason::StopToken, tokens: vec![7] }
    );
    s.add(req(2, 4, 50), None, 0).unwrap();
    let p = s.plan(0, 2).unwrap();
    s.apply(&p, pick(&p, 1)).unwrap();
    let p = s.plan(0, 3).unwrap();
    let out = s.apply(&p, pick(&p, 1)).unwrap();
    assert!(matches!(out[1], Emit::Finished { reason: FinishReason::Length, .. }), "{out:?}");
    // With `ignore_eos` the end id goes on, unless a grammar allowed it (where it ends).
    let free = SamplingParams { max_tokens: 2, ignore_eos: true, ..SamplingParams::default() };
    let constrained =
        SamplingParams { constraint: Some(text::Grammar::Regex("[0-9]".into())), ..free.clone() };
    s.add(Request::tokens(3, vec![1], free), None, 0).unwrap();
    s.add(Request::tokens(4, vec![1], constrained), None, 0).unwrap();
    let p = s.plan(0, 4).unwrap();
    let out = s.apply(&p, pick(&p, 7)).unwrap();
    let ended: Vec<u64> = out
        .iter()
        .filter_map(|e| match e {
            Emit::Finished { request, reason: FinishReason::StopToken, .. } => Some(*request),
            _ => None,
        })
        .collect();
    assert_eq!(ended, [4]);
}

#[test]
fn unrunnable_requests_finish_at_once_and_close_cancels_the_rest() {
    let mut s = Scheduler::new(8, 1, 10, Vec::new());
    let empty = s.add(req(1, 0, 4), None, 0).unwrap().unwrap();
    assert!(matches!(empty, Emit::Finished { reason: FinishReason::Rejected, .. }));
    let zero = s.add(req(2, 3, 0), None, 0).unwrap().unwrap();
    assert!(matches!(zero, Emit::Finished { reason: FinishReason::Length, .. }));
    let text = Request {
        id: 3,
        prompt: Prompt::Text("hi".into()),
        params: SamplingParams::default(),
        cancel: None,
    };
    assert!(s.add(text, None, 0).unwrap_err().to_string().contains("needs a tokenizer"));
    s.add(req(4, 2, 4), None, 0).unwrap();
    s.add(req(5, 2, 4), None, 0).unwrap();
    // max_batch 1: one sequence per step.
    assert_eq!(s.plan(0, 1).unwrap().entries.len(), 1);
    let cancelled = s.cancel_all();
    assert_eq!(cancelled.len(), 2);
    assert!(!s.has_work());
}

#[test]
fn sampled_tokens_must_match_the_sampled_entries() {
    let mut s = Scheduler::new(8, 4, 10, Vec::new());
    s.add(req(1, 2, 4), None, 0).unwrap();
    let p = s.plan(0, 1).unwrap();
    assert!(s.apply(&p, Vec::new()).unwrap_err().contains("0 tokens for 1"));
}

#[test]
fn a_recomputed_sequence_prefills_its_tokens_again_and_decodes_on() {
    let mut s = Scheduler::new(64, 8, 64, Vec::new());
    s.add(req(1, 3, 10), None, 0).unwrap();
    let mut step = 0;
    let mut next = |s: &mut Scheduler, token: usize| run_step(s, &mut step, token);
    next(&mut s, 5);
    next(&mut s, 6);
    let decode = next(&mut s, 7);
    assert_eq!(decode.entries[0].start, 4);
    s.recompute_all();
    let plan = next(&mut s, 0);
    assert_eq!(plan.released, vec![1], "the old cache is dropped");
    let e = &plan.entries[0];
    assert_ne!(e.seq, 1);
    assert_eq!((e.start, e.tokens.len(), e.sample), (0, 5, false), "prompt + 2 generated");
    assert_eq!(&e.tokens[3..], &[5, 6]);
    let plan = next(&mut s, 2);
    let e = &plan.entries[0];
    assert_eq!((e.start, e.tokens.clone(), e.sample), (5, vec![7], true));
}

#[test]
fn a_sequence_brings_its_sampling_with_its_first_entry_and_again_after_a_recompute() {
    let mut s = Scheduler::new(2, 8, 64, Vec::new());
    let params = SamplingParams {
        max_tokens: 10,
        temperature: 0.5,
        seed: 3,
        repetition_penalty: 1.2,
        ..SamplingParams::default()
    };
    s.add(Request::tokens(1, vec![4, 5, 6], params.clone()), None, 0).unwrap();
    let plain = SamplingParams { max_tokens: 10, ..SamplingParams::default() };
    s.add(Request::tokens(2, vec![7], plain.clone()), None, 0).unwrap();
    let mut step = 0;
    let mut next = |s: &mut Scheduler, token: usize| run_step(s, &mut step, token);
    // Budget 2: the first prompt's chunk brings its sampling, its second chunk nothing.
    let p = next(&mut s, 9);
    let first = p.entries[0].sampling.as_deref().unwrap();
    assert_eq!(first.drawn, 0);
    assert_eq!(first.prompt, vec![4, 5, 6], "a penalty counts the prompt");
    assert!(first.generated.is_empty());
    let p = next(&mut s, 9);
    assert!(p.entries[0].sampling.is_none(), "sent once per sequence id");
    let request_2 = p.entries.iter().find(|e| e.seq == 2).unwrap();
    let second = request_2.sampling.as_deref().unwrap();
    assert_eq!(second.params, plain);
    assert!(second.prompt.is_empty(), "no penalty: no history is sent");
    next(&mut s, 8);
    s.recompute_all();
    let p = next(&mut s, 0);
    let again = p.entries[0].sampling.as_deref().unwrap();
    assert_ne!(p.entries[0].seq, 1);
    assert_eq!((again.drawn, again.generated.clone()), (2, vec![9, 8]), "the generator resumes");
}

#[test]
fn a_recomputed_constrained_sequence_brings_its_output_to_replay() {
    let mut s = Scheduler::new(8, 8, 64, Vec::new());
    let params = SamplingParams {
        max_tokens: 10,
        constraint: Some(text::Grammar::Regex("[0-9]+".into())),
        ..SamplingParams::default()
    };
    s.add(Request::tokens(1, vec![4, 5], params), None, 0).unwrap();
    let mut step = 0;
    let p = run_step(&mut s, &mut step, 6);
    let first = p.entries[0].sampling.as_deref().unwrap();
    assert!(first.prompt.is_empty() && first.generated.is_empty(), "no penalty, nothing yet");
    run_step(&mut s, &mut step, 7);
    s.recompute_all();
    let p = run_step(&mut s, &mut step, 8);
    let again = p.entries[0].sampling.as_deref().unwrap();
    assert_eq!(again.generated, vec![6, 7], "the grammar replays the output");
    assert!(again.prompt.is_empty(), "no penalty counts the prompt");
}

#[test]
fn a_cancelled_request_ends_at_the_next_boundary_and_frees_its_sequence() {
    let mut s = Scheduler::new(64, 8, 64, Vec::new());
    let cancel = Cancel::default();
    s.add(req(1, 3, 10).with_cancel(cancel.clone()), None, 0).unwrap();
    s.add(req(2, 2, 10), None, 0).unwrap();
    let plan = s.plan(0, 1).unwrap();
    s.apply(&plan, pick(&plan, 5)).unwrap();
    assert!(s.take_cancelled().is_empty(), "nothing cancelled yet");
    cancel.cancel();
    let ended = s.take_cancelled();
    assert_eq!(
        ended,
        vec![Emit::Finished { request: 1, reason: FinishReason::Cancelled, tokens: vec![5] }]
    );
    let plan = s.plan(0, 2).unwrap();
    assert_eq!(plan.released, vec![1], "its cache is freed on every rank");
    assert_eq!(plan.entries.len(), 1);
    assert!(s.take_cancelled().is_empty(), "reported once");
}

/// A paged pool of `blocks` blocks of 4 tokens, no context parallelism.
fn paged(budget: u32, context: usize, blocks: u32, prefix_caching: bool) -> Scheduler {
    let layout = KvLayout::single(blocks, 4, 1, prefix_caching);
    Scheduler::new(budget, 8, context, Vec::new()).with_kv(layout)
}

/// What every rank does with the plans: block tables per sequence, checked against the pool.
#[derive(Default)]
struct Ranks {
    tables: std::collections::HashMap<SeqId, Vec<u32>>,
    /// Token sequences of each request, as emitted.
    out: std::collections::BTreeMap<u64, Vec<u32>>,
    preemptions: u64,
    hits: u64,
    load: Load,
    /// Requests in the order their first step was planned.
    started: Vec<u64>,
}

impl Ranks {
    /// Runs `s` to the end; the "model" samples `position % 7`, so a sequence's tokens do not
    /// depend on how it was scheduled. Checks on every step that each entry fits its table and
    /// that no two live sequences hold the same block (no prefix sharing here).
    fn run(&mut self, s: &mut Scheduler, total: usize, shared: bool) {
        for step in 1..1000 {
            if self.step(s, step, total, shared).is_none() {
                break;
            }
        }
        assert!(!s.has_work(), "every request finished");
    }

    /// One step of [`Ranks::run`]; the plan, or `None` when nothing ran.
    fn step(
        &mut self,
        s: &mut Scheduler,
        step: u64,
        total: usize,
        shared: bool,
    ) -> Option<StepPlan> {
        let plan = s.plan(0, step)?;
        self.started.extend(s.take_started());
        for seq in &plan.released {
            self.tables.remove(seq);
        }
        for e in &plan.entries {
            let table = self.tables.entry(e.seq).or_default();
            table.extend(&e.blocks);
            assert!(table.iter().all(|&b| (b as usize) < total));
            let end = e.start as usize + e.tokens.len();
            assert!(end <= table.len() * 4, "step {step}: {e:?} overflows {table:?}");
        }
        if !shared {
            let mut held: Vec<u32> = self.tables.values().flatten().copied().collect();
            let n = held.len();
            held.sort_unstable();
            held.dedup();
            assert_eq!(held.len(), n, "step {step}: a block held twice");
            assert!(n <= total);
        }
        let sampled: Vec<SampledToken> = plan
            .entries
            .iter()
            .filter(|e| e.sample)
            .map(|e| {
                let pos = e.start as usize + e.tokens.len();
                SampledToken { token: (pos % 7) as u32, logprobs: None }
            })
            .collect();
        for emit in s.apply(&plan, sampled).unwrap() {
            if let Emit::Finished { request, reason, tokens } = emit {
                assert_eq!(reason, FinishReason::Length);
                self.out.insert(request, tokens);
            }
        }
        let load = s.take_load();
        assert!(load.kv_usage <= 1.0);
        self.preemptions += load.preemptions;
        self.hits += load.prefix_hits;
        self.load = load;
        Some(plan)
    }
}

#[test]
fn a_full_pool_makes_requests_wait_or_preempts_and_every_request_gets_its_tokens() {
    // Roomy: every request runs at once.
    let mut roomy = paged(64, 64, 100, false);
    // Tight: 6 blocks of 4 tokens for 4 requests of up to 6 + 10 tokens (4 blocks each).
    let mut tight = paged(64, 64, 6, false);
    for s in [&mut roomy, &mut tight] {
        for id in 0..4 {
            assert!(s.add(req(id, 6, 10), None, 0).unwrap().is_none());
        }
    }
    let (mut want, mut got) = (Ranks::default(), Ranks::default());
    want.run(&mut roomy, 100, false);
    got.run(&mut tight, 6, false);
    assert_eq!(want.preemptions, 0);
    assert!(got.preemptions > 0, "the tight pool had to preempt");
    assert_eq!(got.out.len(), 4);
    assert_eq!(got.out, want.out, "preempted requests recompute to the same tokens");
    // Each request leaves the queue once, in arrival order, preempted or not.
    assert_eq!(got.started, [0, 1, 2, 3]);
    assert_eq!(want.started, [0, 1, 2, 3]);
}

#[test]
fn a_waiting_prompt_holds_no_step_and_starts_when_blocks_free_up() {
    // 5 blocks: the first request takes 3 of them (prompt 9, one block left spare).
    let mut s = paged(64, 64, 5, false);
    for id in 1..=3 {
        s.add(req(id, 9, 2), None, 0).unwrap();
    }
    let mut ranks = Ranks::default();
    let p1 = ranks.step(&mut s, 1, 5, false).unwrap();
    assert_eq!(p1.entries.len(), 2, "the third prompt waits");
    assert_eq!(p1.entries[0].blocks, vec![0, 1, 2]);
    // The second prompt gets what is left above the watermark: one block, 4 tokens.
    assert_eq!((p1.entries[1].tokens.len(), p1.entries[1].blocks.len()), (4, 1));
    assert_eq!((ranks.load.running, ranks.load.waiting), (2, 1));
    assert!((ranks.load.kv_usage - 0.8).abs() < 1e-9);
    // The first decodes in its room (and finishes), the second takes the last block; the
    // third still waits.
    let p2 = ranks.step(&mut s, 2, 5, false).unwrap();
    assert_eq!(p2.entries.iter().map(|e| e.tokens.len()).collect::<Vec<_>>(), [1, 4]);
    assert_eq!(p2.entries[1].blocks, [4]);
    assert_eq!((ranks.load.running, ranks.load.waiting, ranks.load.kv_usage), (1, 1, 0.4));
    ranks.run(&mut s, 5, false);
    assert_eq!(ranks.out.len(), 3);
}

#[test]
fn a_prompt_starting_with_cached_blocks_skips_them_and_counts_the_hit() {
    let mut s = paged(64, 64, 16, true);
    // 10 prompt tokens: blocks [1..4] and [5..8] are full and cached once computed.
    s.add(req(1, 10, 1), None, 0).unwrap();
    let mut ranks = Ranks::default();
    ranks.run(&mut s, 16, true);
    assert_eq!(ranks.hits, 0);
    // The same first 8 tokens, then others.
    let mut prompt: Vec<u32> = (1..=8).collect();
    prompt.extend([20, 21, 22]);
    let params = SamplingParams { max_tokens: 2, ..SamplingParams::default() };
    s.add(Request::tokens(2, prompt, params.clone()), None, 0).unwrap();
    let plan = s.plan(0, 100).unwrap();
    let e = &plan.entries[0];
    assert_eq!((e.start, e.tokens.clone()), (8, vec![20, 21, 22]), "the prefix is skipped");
    assert_eq!(&e.blocks[..2], &[0, 1], "the cached blocks come first");
    s.apply(&plan, pick(&plan, 1)).unwrap();
    let load = s.take_load();
    assert_eq!((load.prefix_queries, load.prefix_hits), (8, 8));
    // A prompt that differs in its first block finds nothing.
    s.add(Request::tokens(3, vec![9; 11], params), None, 0).unwrap();
    let plan = s.plan(0, 101).unwrap();
    assert_eq!(plan.entries.iter().find(|e| e.tokens.len() > 1).unwrap().start, 0);
    // A lost cache forgets every cached block.
    s.recompute_all();
    let mut ranks = Ranks::default();
    ranks.run(&mut s, 16, true);
    assert_eq!(ranks.hits, 0, "nothing is reused after the cache was lost");
}

/// Prompt log-probabilities go out once per position, in order, from position 1 and within
/// the prompt: a recompute that scores positions again sends only the new ones; a sequence
/// whose prompt is scored does not take a cached prefix.
#[test]
fn prompt_logprobs_go_out_once_per_position_and_skip_the_prefix_cache() {
    let layout = KvLayout::single(16, 2, 1, true);
    let mut s = Scheduler::new(16, 8, 100, Vec::new()).with_kv(layout);
    let mut step = 0;
    s.add(req(1, 6, 1), None, 0).unwrap();
    run_step(&mut s, &mut step, 9);
    let scored =
        SamplingParams { max_tokens: 3, prompt_logprobs: Some(0), ..SamplingParams::default() };
    s.add(Request::tokens(2, (1..=6).collect(), scored), None, 0).unwrap();
    let plan = s.plan(0, 2).unwrap();
    let e = &plan.entries[0];
    assert_eq!((e.start, e.tokens.len()), (0, 6), "no cached prefix for a scored prompt");
    let lp = |v: f32| crate::sampler::RankedLogprobs {
        logprobs: TokenLogprobs { logprob: v, top: Vec::new() },
        rank: 1,
    };
    let run = |start: u32, values: &[f32]| crate::sampler::PromptLogprobs {
        seq: e.seq,
        start,
        tokens: values.iter().map(|&v| lp(v)).collect(),
    };
    let sent = |emits: Vec<Emit>| -> Vec<(u32, usize)> {
        emits
            .into_iter()
            .map(|e| match e {
                Emit::PromptLogprobs { request: 2, start, tokens } => (start, tokens.len()),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    assert_eq!(sent(s.prompt_logprobs(vec![run(1, &[-1.0, -2.0, -3.0])])), [(1, 3)]);
    // Positions 1..=3 again (a recompute), then 4 and 5; one past the prompt is dropped.
    assert_eq!(
        sent(s.prompt_logprobs(vec![run(1, &[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])])),
        [(4, 2)]
    );
    assert!(s.prompt_logprobs(vec![run(5, &[-5.0])]).is_empty(), "position 5 went out");
    // A run that begins past the next position (a gap) is not sent.
    assert!(s.prompt_logprobs(vec![run(7, &[-7.0])]).is_empty());
}

/// A model of 7 layer groups (one global, six of sliding-window layers with a window of 8
/// tokens), blocks of 4 tokens, no context parallelism; `windowed: 0` keeps every block.
fn windowed_layout(blocks: u32, windowed: u32) -> KvLayout {
    KvLayout { groups: 7, windowed, window: 8, ..KvLayout::single(blocks, 4, 1, true) }
}

/// What the ranks of a windowed model do with the plans, run to the end: every sequence's
/// tables (one block per group per 4 tokens), of which a windowed group's entries before the
/// window of the sequence's next token are never read again. Checks on every step that no
/// block is read by two sequences or two groups, that the pool counts exactly the blocks
/// still read, and that each windowed group reads at most `ceil(8 / 4) + 1` blocks. Returns
/// the preemptions, the most sequences running at once and the most blocks held at once.
fn run_windowed(s: &mut Scheduler, layout: KvLayout) -> (u64, usize, usize) {
    let (g, windowed) = (layout.groups as usize, layout.windowed as usize);
    let spread = layout.spread as usize;
    let mut tables: HashMap<SeqId, (Vec<u32>, usize)> = HashMap::new();
    let (mut preemptions, mut running, mut most) = (0, 0, 0);
    for step in 1..10_000 {
        let Some(plan) = s.plan(0, step) else { break };
        for seq in &plan.released {
            tables.remove(seq);
        }
        for e in &plan.entries {
            let (table, len) = tables.entry(e.seq).or_default();
            assert_eq!(*len, e.start as usize, "step {step}: {e:?}");
            table.extend(&e.blocks);
            assert!(table.len().is_multiple_of(g));
            let end = e.start as usize + e.tokens.len();
            assert!(end.div_ceil(spread) <= table.len() / g * 4, "step {step}");
        }
        let mut live = Vec::new();
        for (table, len) in tables.values() {
            let dead = if windowed == 0 { 0 } else { window_dead_blocks(*len, spread, 8, 4) };
            for (entry, ids) in table.chunks(g).enumerate() {
                let read = if entry < dead { &ids[..g - windowed] } else { ids };
                live.extend_from_slice(read);
            }
            if windowed > 0 {
                let per_group = table.len() / g - dead.min(table.len() / g);
                assert!(per_group <= 8 / 4 + 1, "step {step}: {per_group} blocks of a window");
            }
        }
        let n = live.len();
        live.sort_unstable();
        live.dedup();
        assert_eq!(live.len(), n, "step {step}: a block is read twice");
        assert_eq!(s.pool.as_ref().unwrap().blocks.used(), n, "step {step}: blocks held");
        most = most.max(n);
        running = running.max(plan.entries.len());
        let sampled: Vec<SampledToken> = plan
            .entries
            .iter()
            .filter(|e| e.sample)
            .map(|e| SampledToken {
                token: ((e.start as usize + e.tokens.len()) % 7) as u32,
                logprobs: None,
            })
            .collect();
        for e in &plan.entries {
            tables.get_mut(&e.seq).unwrap().1 += e.tokens.len();
        }
        s.apply(&plan, sampled).unwrap();
        preemptions += s.take_load().preemptions;
    }
    assert!(!s.has_work(), "every request finished");
    (preemptions, running, most)
}

/// One long sequence of a windowed model (prompt 10, 200 new tokens): its global group's
/// blocks grow with it, each windowed group holds at most 3 blocks, so it holds
/// `53 + 6 · 3` blocks at most, where keeping every block takes `7 · 53`; spread over 2 CP
/// ranks, half the global blocks and still 3 of each windowed group.
#[test]
fn a_long_windowed_sequence_holds_its_global_blocks_and_a_window_of_the_others() {
    let mut most = Vec::new();
    for windowed in [6, 0] {
        let layout = windowed_layout(400, windowed);
        let mut s = Scheduler::new(16, 8, 512, Vec::new()).with_kv(layout);
        assert!(!s.pool.as_ref().unwrap().prefix_caching, "no prefix caching with groups");
        s.add(req(1, 10, 200), None, 0).unwrap();
        let (preemptions, _, held) = run_windowed(&mut s, layout);
        assert_eq!(preemptions, 0);
        most.push(held);
    }
    // 210 tokens: 53 table entries (the last token is sampled, never cached: 209 held).
    assert_eq!(most, [53 + 6 * 3, 7 * 53]);
    // Spread over 2 CP ranks: each rank holds half the tokens, the windowed groups still at
    // most 3 blocks each (checked in `run_windowed`).
    let layout = KvLayout { spread: 2, ..windowed_layout(400, 6) };
    let mut s = Scheduler::new(16, 8, 512, Vec::new()).with_kv(layout);
    s.add(req(1, 10, 200), None, 0).unwrap();
    let (preemptions, _, held) = run_windowed(&mut s, layout);
    assert_eq!(preemptions, 0);
    assert!(held <= 27 + 6 * 3, "{held} blocks");
}

/// A pool too small for four long sequences of a windowed model that keep every block (4 ·
/// 7 · 17 blocks) holds them at once when the windowed groups give their blocks back (4 ·
/// (17 + 6 · 3)): no preemption, every sequence running together; keeping every block, the
/// same pool preempts. One sequence that needs 364 blocks kept runs alone in a pool of 80.
#[test]
fn a_pool_too_small_to_keep_every_block_runs_windowed_sequences_together() {
    let mut runs = Vec::new();
    for windowed in [6, 0] {
        let layout = windowed_layout(160, windowed);
        let mut s = Scheduler::new(64, 8, 512, Vec::new()).with_kv(layout);
        for id in 0..4 {
            s.add(req(id, 6, 60), None, 0).unwrap();
        }
        runs.push(run_windowed(&mut s, layout));
    }
    let [(freeing, together, _), (keeping, _, _)] = runs[..] else { unreachable!() };
    assert_eq!((freeing, together), (0, 4), "giving blocks back, all four run at once");
    assert!(keeping > 0, "keeping every block, the pool must preempt");
    // One sequence of 6 + 200 tokens needs 52 table entries: 364 blocks kept, 52 + 6 · 3
    // given back; a pool of 80 runs it without a preemption.
    let layout = windowed_layout(80, 6);
    let mut s = Scheduler::new(64, 8, 512, Vec::new()).with_kv(layout);
    s.add(req(1, 6, 200), None, 0).unwrap();
    assert_eq!(run_windowed(&mut s, layout), (0, 1, 52 + 6 * 3));
}
