//! Scheduler: budgets, chunked prefill next to decode, joins and leaves at boundaries.

use super::*;

fn req(id: u64, len: usize, max_tokens: u32) -> Request {
    let params = SamplingParams { max_tokens, ..SamplingParams::default() };
    Request::tokens(id, (1..=len as u32).collect(), params)
}

/// Logits whose argmax is `token` for every sampled entry.
fn pick(plan: &StepPlan, token: usize) -> Vec<Vec<f32>> {
    plan.sampled().map(|_| (0..8).map(|i| if i == token { 1.0 } else { 0.0 }).collect()).collect()
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
    assert!(s.apply(&p1, &[]).unwrap().is_empty());
    let p2 = s.plan(0, 2).unwrap();
    assert_eq!(
        (p2.entries[0].start, p2.entries[0].tokens.clone(), p2.entries[0].sample),
        (4, vec![5, 6], true)
    );
    assert_eq!(
        s.apply(&p2, &pick(&p2, 3)).unwrap(),
        vec![Emit::Token { request: 10, token: 3, logprobs: None }]
    );
    // A second request joins: its prompt is prefilled next to the first one's decode token.
    s.add(req(11, 5, 1), None, 0).unwrap();
    let p3 = s.plan(0, 3).unwrap();
    // Its cache needs room for the prompt and the 2 tokens it may generate.
    let reserve = 6 + 2;
    assert_eq!(
        p3.entries[0],
        PlanEntry { seq: 1, start: 6, tokens: vec![3], sample: true, reserve }
    );
    assert_eq!(
        (p3.entries[1].seq, p3.entries[1].tokens.len(), p3.entries[1].sample),
        (2, 3, false)
    );
    let out = s.apply(&p3, &pick(&p3, 5)).unwrap();
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
    let out = s.apply(&p4, &pick(&p4, 7)).unwrap();
    assert!(matches!(out[1], Emit::Finished { request: 11, .. }));
    assert!(!s.has_work());
    assert!(s.plan(0, 5).is_none());
}

#[test]
fn stop_tokens_eos_and_context_end_requests() {
    let mut s = Scheduler::new(64, 8, 6, vec![7]);
    s.add(req(1, 3, 50), None, 0).unwrap();
    let p = s.plan(0, 1).unwrap();
    let out = s.apply(&p, &pick(&p, 7)).unwrap();
    assert_eq!(
        out[1],
        Emit::Finished { request: 1, reason: FinishReason::StopToken, tokens: vec![7] }
    );
    s.add(req(2, 4, 50), None, 0).unwrap();
    let p = s.plan(0, 2).unwrap();
    s.apply(&p, &pick(&p, 1)).unwrap();
    let p = s.plan(0, 3).unwrap();
    let out = s.apply(&p, &pick(&p, 1)).unwrap();
    assert!(matches!(out[1], Emit::Finished { reason: FinishReason::Length, .. }), "{out:?}");
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
fn logits_rows_must_match_the_sampled_entries() {
    let mut s = Scheduler::new(8, 4, 10, Vec::new());
    s.add(req(1, 2, 4), None, 0).unwrap();
    let p = s.plan(0, 1).unwrap();
    assert!(s.apply(&p, &[]).unwrap_err().contains("0 logits rows for 1"));
}

#[test]
fn a_recomputed_sequence_prefills_its_tokens_again_and_decodes_on() {
    let mut s = Scheduler::new(64, 8, 64, Vec::new());
    s.add(req(1, 3, 10), None, 0).unwrap();
    let mut step = 0;
    let mut next = |s: &mut Scheduler, token: usize| {
        step += 1;
        let plan = s.plan(0, step).unwrap();
        s.apply(&plan, &pick(&plan, token)).unwrap();
        plan
    };
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
fn a_cancelled_request_ends_at_the_next_boundary_and_frees_its_sequence() {
    let mut s = Scheduler::new(64, 8, 64, Vec::new());
    let cancel = Cancel::default();
    s.add(req(1, 3, 10).with_cancel(cancel.clone()), None, 0).unwrap();
    s.add(req(2, 2, 10), None, 0).unwrap();
    let plan = s.plan(0, 1).unwrap();
    s.apply(&plan, &pick(&plan, 5)).unwrap();
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
