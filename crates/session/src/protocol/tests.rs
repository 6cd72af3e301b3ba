//! Message round trips and the admission between threads of one process.

use super::*;
use collectives::{local, ShmOptions};

fn plan(tokens: usize) -> StepPlan {
    StepPlan {
        epoch: 3,
        step: 7,
        entries: vec![
            PlanEntry {
                seq: 1,
                start: 0,
                tokens: (0..tokens as u32).collect(),
                sample: true,
                reserve: 64,
                blocks: vec![3, 0, 7],
                sampling: None,
            },
            PlanEntry {
                seq: 9,
                start: 12,
                tokens: vec![5],
                sample: true,
                reserve: 40,
                blocks: vec![],
                sampling: None,
            },
        ],
        released: vec![4, 2],
    }
}

/// [`plan`] whose first entry starts its sequence, with every sampling field set.
fn sampled_plan(tokens: usize) -> StepPlan {
    let mut plan = plan(tokens);
    plan.entries[0].sampling = Some(Box::new(SeqSampling {
        params: SamplingParams {
            max_tokens: 9,
            temperature: 0.7,
            top_k: 40,
            top_p: 0.95,
            seed: u64::MAX - 3,
            stop: vec![2, 7],
            ignore_eos: true,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            repetition_penalty: 1.1,
            min_p: 0.05,
            logit_bias: vec![(11, -100.0), (3, 2.5)],
            logprobs: Some(5),
            prompt_logprobs: Some(3),
            constraint: Some(text::Grammar::Choice(vec!["a".into(), "b\"ç".into()])),
        },
        drawn: 4,
        prompt: vec![1, 2, 3],
        generated: vec![8, 8, 9, 1],
    }));
    plan
}

#[test]
fn every_message_round_trips() {
    let cfg = SessionConfig { max_steps: Some(4), ..SessionConfig::new("m.gguf") };
    for msg in [
        Message::Open(cfg.clone()),
        Message::Step(plan(3)),
        Message::Step(sampled_plan(3)),
        Message::Idle,
        Message::Close(SessionDecision::Stop),
        Message::Close(SessionDecision::KeepOpen),
        Message::Close(SessionDecision::Replace(cfg)),
    ] {
        let mut buf = Vec::new();
        encode(&msg, 3, 7, &mut buf);
        assert_eq!(decode(&buf).unwrap(), (3, 7, msg));
    }
}

#[test]
fn every_kind_of_constraint_round_trips() {
    use text::Grammar;
    for constraint in [
        None,
        Some(Grammar::JsonSchema("{\"type\":\"integer\"}".into())),
        Some(Grammar::JsonObject),
        Some(Grammar::Regex("[a-z]+".into())),
        Some(Grammar::Choice(Vec::new())),
        Some(Grammar::Lark("start: \"x\"".into())),
    ] {
        let mut plan = sampled_plan(2);
        plan.entries[0].sampling.as_mut().unwrap().params.constraint = constraint;
        let msg = Message::Step(plan);
        let mut buf = Vec::new();
        encode(&msg, 3, 7, &mut buf);
        assert_eq!(decode(&buf).unwrap(), (3, 7, msg));
    }
}

#[test]
fn truncated_and_padded_messages_are_refused() {
    let mut buf = Vec::new();
    encode(&Message::Step(sampled_plan(2)), 0, 1, &mut buf);
    let err = decode(&buf[..buf.len() - 1]).unwrap_err();
    assert!(matches!(err, DecodeError::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("runs past the end"), "{err}");
    buf.push(0);
    assert!(decode(&buf).unwrap_err().to_string().contains("trailing"));
    assert!(decode(&[9]).unwrap_err().to_string().contains("runs past"));
}

/// Runs `f(rank, comm)` on `n` threads joined to one local group.
fn on_threads<T: Send + 'static>(
    n: usize,
    f: impl Fn(usize, &mut dyn Communicator) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let comms = local::group(n, "control", ShmOptions::default()).unwrap();
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(r, mut c)| {
            let f = f.clone();
            std::thread::spawn(move || {
                c.set_timeout(std::time::Duration::from_secs(10));
                f(r, &mut c)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn rank_0_message_reaches_every_rank_inline_and_by_broadcast() {
    for tokens in [2usize, 400] {
        let got = on_threads(3, move |rank, comm| {
            let mut buf = Vec::new();
            encode(&Message::Step(plan(tokens)), 3, 7, &mut buf);
            assert_eq!(buf.len() > INLINE_BYTES, tokens == 400);
            let mut a = Agreement::new();
            let c = Contribution {
                state: State::Go,
                epoch: 3,
                step: 6,
                message: (rank == 0).then_some(&buf[..]),
            };
            let agreed = a.admit(comm, c).unwrap();
            let msg = decode(a.message()).unwrap();
            let confirmed = a.confirm(comm, Contribution { message: None, ..c }).unwrap();
            (agreed, confirmed, msg)
        });
        for (agreed, confirmed, msg) in got {
            assert_eq!(agreed, Agreed { state: State::Go, failed: None, stopped: None });
            assert_eq!(confirmed, agreed);
            assert_eq!(msg, (3, 7, Message::Step(plan(tokens))));
        }
    }
}

#[test]
fn a_failed_rank_is_named_and_a_stop_wins_over_go() {
    let got = on_threads(4, |rank, comm| {
        let mut a = Agreement::new();
        let state = [State::Go, State::Stop, State::Go, State::Go][rank];
        let first =
            a.admit(comm, Contribution { state, epoch: 0, step: 2, message: None }).unwrap();
        let state = if rank == 2 { State::Failed } else { State::Go };
        let second = a.confirm(comm, Contribution { state, epoch: 0, step: 2, message: None });
        (first, second.unwrap(), a.message().is_empty())
    });
    for (first, second, empty) in got {
        assert_eq!(first, Agreed { state: State::Stop, failed: None, stopped: Some(1) });
        assert_eq!(second, Agreed { state: State::Failed, failed: Some(2), stopped: None });
        assert!(empty);
    }
}

#[test]
fn a_rank_at_another_step_is_a_loud_desync_everywhere() {
    let got = on_threads(2, |rank, comm| {
        let mut a = Agreement::new();
        let c = Contribution { state: State::Go, epoch: 1, step: 4 + rank as u64, message: None };
        a.admit(comm, c).unwrap_err().to_string()
    });
    for (rank, e) in got.iter().enumerate() {
        assert!(e.contains(&format!("admission at epoch 1 step {} (rank {rank})", 4 + rank)));
        assert!(e.contains("ranks disagree: ranks are at epochs 1..=1 and steps 4..=5"), "{e}");
    }
}

#[test]
fn admission_and_confirmation_out_of_phase_is_a_mismatch() {
    let got = on_threads(2, |rank, comm| {
        let mut a = Agreement::new();
        let c = Contribution { state: State::Go, epoch: 0, step: 0, message: None };
        if rank == 0 { a.admit(comm, c).map(|_| ()) } else { a.confirm(comm, c).map(|_| ()) }
            .unwrap_err()
            .to_string()
    });
    assert!(got.iter().any(|e| e.contains("mismatch")), "{got:?}");
}

#[test]
fn a_failure_after_a_peer_does_not_claim_to_be_the_origin() {
    let got = on_threads(3, |rank, comm| {
        let mut a = Agreement::new();
        let state = [State::FailedAfterPeer, State::Go, State::Failed][rank];
        let c = Contribution { state, epoch: 2, step: 9, message: None };
        let first = a.admit(comm, c).unwrap();
        let state = [State::FailedAfterPeer, State::Go, State::Go][rank];
        let second = a.confirm(comm, Contribution { state, ..c }).unwrap();
        (first, second)
    });
    for (first, second) in got {
        assert_eq!(first, Agreed { state: State::Failed, failed: Some(2), stopped: None });
        assert_eq!(second, Agreed { state: State::Failed, failed: None, stopped: None });
    }
}

#[test]
fn decoding_into_a_previous_plan_reuses_it_exactly() {
    let mut out = Message::Step(plan(9));
    for p in [plan(2), StepPlan { entries: Vec::new(), ..plan(1) }, plan(5)] {
        let mut buf = Vec::new();
        encode(&Message::Step(p.clone()), 3, 7, &mut buf);
        assert_eq!(decode_into(&buf, &mut out).unwrap(), (3, 7));
        assert_eq!(out, Message::Step(p));
    }
    let mut buf = Vec::new();
    encode(&Message::Idle, 3, 7, &mut buf);
    decode_into(&buf, &mut out).unwrap();
    assert_eq!(out, Message::Idle);
    // A count that cannot fit is refused before anything is reserved.
    let mut bad = vec![2u8];
    bad.extend_from_slice(&[0; 16]);
    bad.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(decode(&bad).unwrap_err().to_string().contains("cannot fit"));
}
