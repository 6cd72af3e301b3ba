//! The engine on a world of one rank (an inert context): the whole session lifecycle on rank 0
//! with a small counting model. Multi-rank behavior is tested with real processes in
//! `tests/tests/session.rs`.

use super::*;
use crate::error::BoxError;
use crate::sampler::SamplingParams;
use crate::sink::{Collect, FinishReason};
use collectives::{init_parallel_with, InitOptions};
use std::sync::Mutex;

const VOCAB: usize = 16;

/// Next token = last token + 1 (mod 16), as logits, sampled by the runner's samplers.
struct Count {
    seqs: std::collections::HashMap<SeqIdAlias, usize>,
    samplers: crate::Samplers,
    fail_at: Option<u64>,
    /// Model `slow`: every forward pass takes [`SLOW_FORWARD`] more, and its sampling
    /// [`SLOW_SAMPLE`] more.
    slow: bool,
    /// The last step's sampling time, as a runner reports it.
    sampling: Duration,
}
type SeqIdAlias = crate::plan::SeqId;

impl StepModel for Count {
    fn forward(
        &mut self,
        plan: &StepPlan,
        _groups: &mut Groups<'_>,
    ) -> std::result::Result<Option<crate::StepOutput>, BoxError> {
        if self.fail_at == Some(plan.step) {
            return Err("the counting model broke".into());
        }
        let mut rows: Vec<f32> = Vec::new();
        for e in &plan.entries {
            let len = self.seqs.entry(e.seq).or_default();
            assert_eq!(*len, e.start as usize, "positions continue the sequence");
            *len += e.tokens.len();
            if e.sample {
                let next = (*e.tokens.last().unwrap() as usize + 1) % VOCAB;
                rows.extend((0..VOCAB).map(|i| if i == next { 1.0 } else { 0.0 }));
            }
        }
        if self.slow {
            std::thread::sleep(SLOW_FORWARD);
        }
        let since = std::time::Instant::now();
        if self.slow {
            std::thread::sleep(SLOW_SAMPLE);
        }
        let sampled = self.samplers.sample(plan, &rows, VOCAB)?;
        self.sampling = since.elapsed();
        Ok(Some(sampled))
    }

    fn sampling_time(&self) -> Duration {
        self.sampling
    }

    fn release(&mut self, seq: SeqIdAlias) {
        self.seqs.remove(&seq);
        self.samplers.release(seq);
    }

    fn context_len(&self) -> usize {
        64
    }
}

#[derive(Clone, Default)]
struct Factory {
    builds: Arc<Mutex<Vec<String>>>,
}

impl ModelFactory for Factory {
    fn build(
        &mut self,
        config: &SessionConfig,
        _groups: &mut Groups<'_>,
    ) -> std::result::Result<Box<dyn StepModel>, BoxError> {
        self.builds.lock().unwrap().push(config.model.clone());
        if config.model == "broken" {
            return Err("no such model".into());
        }
        let fail_at = config.model.strip_prefix("fail-at-").and_then(|s| s.parse().ok());
        Ok(Box::new(Count {
            seqs: Default::default(),
            samplers: Default::default(),
            fail_at,
            slow: config.model == "slow",
            sampling: Duration::ZERO,
        }))
    }

    fn codec(
        &mut self,
        config: &SessionConfig,
    ) -> std::result::Result<Option<Box<dyn crate::sink::TextCodec>>, BoxError> {
        Ok((config.model == "bytes").then(|| {
            Box::new(EncodeOnly(crate::sink::TokenizerCodec(Arc::new(byte_tokenizer()))))
                as Box<dyn crate::sink::TextCodec>
        }))
    }
}

/// A codec that encodes and names stop tokens but refuses to decode: the engine hands out
/// token ids only, and decoding is the sink's.
struct EncodeOnly(crate::sink::TokenizerCodec);

impl crate::sink::TextCodec for EncodeOnly {
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, BoxError> {
        self.0.encode(text)
    }
    fn decode(&self, _: &[u32]) -> std::result::Result<String, BoxError> {
        Err("the engine decoded a token".into())
    }
    fn decode_next(
        &self,
        _: &mut crate::sink::TextStream,
        _: u32,
        _: bool,
    ) -> std::result::Result<String, BoxError> {
        Err("the engine decoded a token".into())
    }
    fn eos(&self) -> Option<u32> {
        self.0.eos()
    }
}

/// Byte-level pieces in counting order: from token 0 the counting model writes "a", then the
/// four bytes of "🦀" (F0 9F A6 80), the three of "猫" (E7 8C AB) and the two of "é" (C3 A9).
const BYTE_PIECES: [&str; 11] = ["<|endoftext|>", "a", "ð", "Ł", "¦", "Ģ", "ç", "Į", "«", "Ã", "©"];

fn byte_tokenizer() -> text::Tokenizer {
    use checkpoint::gguf::{GgufFile, GgufWriter, Value};
    let strings = |v: &[&str]| Value::Array(v.iter().map(|s| Value::String((*s).into())).collect());
    let types = BYTE_PIECES.iter().map(|t| Value::I32(if t.starts_with("<|") { 3 } else { 1 }));
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.tokens", strings(&BYTE_PIECES))
        .metadata("tokenizer.ggml.token_type", Value::Array(types.collect()))
        .metadata("tokenizer.ggml.merges", strings(&[]))
        .metadata("tokenizer.ggml.eos_token_id", Value::U32(0));
    let path = std::env::temp_dir().join(format!("tpctl-engine-bytes-{}.gguf", std::process::id()));
    w.write(&path).unwrap();
    let t = text::Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    std::fs::remove_file(path).unwrap();
    t
}

/// The engine hands out ids (its codec refuses to decode) and the sink decodes them, with
/// characters split over tokens whole and the last token flushing what is left.
#[test]
fn characters_split_over_tokens_come_out_whole() {
    let codec = crate::sink::TokenizerCodec(Arc::new(byte_tokenizer()));
    let (f, out, m) = (Factory::default(), Collect::decoding(Box::new(codec)), Metrics::default());
    let mut l = leader(&f, &out, &m);
    // Request 1 writes all ten pieces; request 2 stops after the first two bytes of "🦀".
    let cfg = SessionConfig::new("bytes");
    l.run(cfg, vec![req(1, &[0], 10), req(2, &[0], 3)], &mut stop).unwrap();
    let done = out.finished();
    let text = |id| done.iter().find(|d| d.request == id).unwrap().text.clone();
    assert_eq!(text(1), "a🦀猫é", "pieces decoded one by one would be replacement characters");
    // An unfinished character at the end is flushed as U+FFFD, once.
    let two = text(2);
    assert!(
        two.starts_with('a') && two.ends_with('\u{fffd}') && !two[1..].contains('a'),
        "{two:?}"
    );
}

/// What model `slow` adds to each forward pass, and to its sampling.
const SLOW_FORWARD: Duration = Duration::from_millis(4);
const SLOW_SAMPLE: Duration = Duration::from_millis(3);

#[derive(Clone, Default)]
struct Metrics(Arc<Mutex<Vec<StepMetrics>>>);

impl MetricsSink for Metrics {
    fn step(&mut self, m: &StepMetrics) {
        self.0.lock().unwrap().push(*m);
    }
}

fn leader(factory: &Factory, out: &Collect, metrics: &Metrics) -> Leader {
    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let opts = EngineOptions { tick: Duration::from_millis(5), ..EngineOptions::default() };
    Leader::new(
        ctx,
        Box::new(factory.clone()),
        Box::new(out.clone()),
        Box::new(metrics.clone()),
        opts,
    )
    .unwrap()
}

fn req(id: u64, prompt: &[u32], max_tokens: u32) -> Request {
    Request::tokens(id, prompt.to_vec(), SamplingParams { max_tokens, ..SamplingParams::default() })
}

fn stop(_: &SessionReport) -> Decision {
    Decision::Stop
}

fn closes(events: &[Event]) -> Vec<(u64, u64)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Closed { epoch, steps } => Some((*epoch, *steps)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_batch_runs_to_its_natural_end() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let mut l = leader(&f, &out, &m);
    let cfg = SessionConfig { token_budget: 3, ..SessionConfig::new("count") };
    let summary = l.run(cfg, vec![req(1, &[1, 2, 3, 4], 3), req(2, &[9], 2)], &mut stop).unwrap();
    let done = out.finished();
    assert_eq!(done.len(), 2);
    let one = done.iter().find(|d| d.request == 1).unwrap();
    assert_eq!((one.tokens.clone(), one.reason), (vec![5, 6, 7], FinishReason::Length));
    let two = done.iter().find(|d| d.request == 2).unwrap();
    assert_eq!(two.tokens, vec![10, 11]);
    assert_eq!(closes(l.events()), vec![(0, summary.steps)]);
    let steps: Vec<u64> = l
        .events()
        .iter()
        .filter_map(|e| if let Event::Step { step, .. } = e { Some(*step) } else { None })
        .collect();
    assert_eq!(steps, (1..=summary.steps).collect::<Vec<_>>());
    let m = m.0.lock().unwrap();
    assert!(m.iter().all(|s| s.prefill_tokens + s.decode_tokens <= 3), "{m:?}");
    assert!(m.iter().any(|s| s.prefill_tokens > 0 && s.decode_tokens > 0), "{m:?}");
    assert!(matches!(
        l.run(SessionConfig::new("count"), vec![], &mut stop),
        Err(Error::Finished { rank: 0 })
    ));
}

#[test]
fn max_steps_bounds_the_session_and_zero_steps_run_nothing() {
    for (max, want) in [(2u64, 2u64), (0, 0)] {
        let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
        let mut l = leader(&f, &out, &m);
        let cfg = SessionConfig { max_steps: Some(max), ..SessionConfig::new("count") };
        let mut reports = Vec::new();
        let mut decide = |r: &SessionReport| {
            reports.push(r.clone());
            Decision::Stop
        };
        let summary = l.run(cfg, vec![req(1, &[1], 10)], &mut decide).unwrap();
        assert_eq!(summary, RunSummary { sessions: 1, steps: want });
        assert!(reports[0].step_limit);
        let done = out.finished();
        assert_eq!(done[0].reason, FinishReason::Cancelled);
        assert_eq!(done[0].tokens.len() as u64, want);
    }
}

#[test]
fn a_stop_before_start_opens_and_closes_without_building() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let mut l = leader(&f, &out, &m);
    l.stop_handle().request_stop();
    let summary = l.run(SessionConfig::new("count"), vec![req(1, &[1], 3)], &mut stop).unwrap();
    assert_eq!(summary, RunSummary { sessions: 1, steps: 0 });
    assert_eq!(l.events(), &[Event::Opened { epoch: 0 }, Event::Closed { epoch: 0, steps: 0 }]);
    assert!(f.builds.lock().unwrap().is_empty());
}

#[test]
fn a_replacement_opens_a_new_session_with_new_requests() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let mut l = leader(&f, &out, &m);
    let mut n = 0;
    let mut decide = |r: &SessionReport| {
        n += 1;
        if r.epoch == 0 {
            Decision::Replace(SessionConfig::new("count-2"), vec![req(7, &[3], 2)])
        } else {
            Decision::Stop
        }
    };
    let summary = l.run(SessionConfig::new("count"), vec![req(1, &[1], 1)], &mut decide).unwrap();
    assert_eq!(summary.sessions, 2);
    assert_eq!(n, 2);
    assert_eq!(*f.builds.lock().unwrap(), vec!["count".to_owned(), "count-2".to_owned()]);
    assert_eq!(closes(l.events()).iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
    let done = out.finished();
    assert_eq!(done.iter().map(|d| d.request).collect::<Vec<_>>(), vec![1, 7]);
    assert_eq!(done[1].tokens, vec![4, 5]);
}

#[test]
fn serve_batches_requests_that_arrive_while_others_run() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let mut l = leader(&f, &out, &m);
    let (tx, rx) = std::sync::mpsc::channel();
    tx.send(req(1, &[1, 2], 12)).unwrap();
    tx.send(req(2, &[5], 3)).unwrap();
    let feeder = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        tx.send(req(3, &[8, 8, 8], 2)).unwrap();
    });
    let mut decide =
        |r: &SessionReport| if r.finished >= 3 { Decision::Stop } else { Decision::KeepOpen };
    l.serve(SessionConfig::new("count"), &rx, &mut decide).unwrap();
    feeder.join().unwrap();
    let done = out.finished();
    assert_eq!(done.len(), 3, "{done:?}");
    assert_eq!(done.iter().find(|d| d.request == 3).unwrap().tokens, vec![9, 10]);
    assert_eq!(closes(l.events()).len(), 1);
}

#[test]
fn an_idle_session_stops_when_asked() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let mut l = leader(&f, &out, &m);
    let (_tx, rx) = std::sync::mpsc::channel();
    let handle = l.stop_handle();
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(40));
        handle.request_stop();
    });
    let mut decide = |_: &SessionReport| Decision::KeepOpen;
    let summary = l.serve(SessionConfig::new("count"), &rx, &mut decide).unwrap();
    stopper.join().unwrap();
    assert_eq!(summary, RunSummary { sessions: 1, steps: 0 });
    assert_eq!(closes(l.events()), vec![(0, 0)]);
}

#[test]
fn failures_are_reported_with_their_place_and_close_the_session_once() {
    struct Broken;
    impl OutputSink for Broken {
        fn token(
            &mut self,
            _: u64,
            _: u32,
            _: bool,
            _: Option<&crate::TokenLogprobs>,
        ) -> std::result::Result<(), BoxError> {
            Err("disk full".into())
        }
        fn finished(
            &mut self,
            _: u64,
            _: FinishReason,
            _: &[u32],
        ) -> std::result::Result<(), BoxError> {
            Ok(())
        }
    }
    let cases: [(&str, bool, &str); 3] = [
        ("broken", false, "session init at epoch 0 step 0 (rank 0): no such model"),
        ("fail-at-2", false, "step at epoch 0 step 2 (rank 0): the counting model broke"),
        ("count", true, "output sink at epoch 0 step 1 (rank 0): disk full"),
    ];
    for (model, broken_sink, want) in cases {
        let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
        let output: Box<dyn OutputSink> =
            if broken_sink { Box::new(Broken) } else { Box::new(Collect::new()) };
        let mut l = Leader::new(
            ctx,
            Box::new(Factory::default()),
            output,
            Box::new(crate::NoMetrics),
            EngineOptions::default(),
        )
        .unwrap();
        let e = l.run(SessionConfig::new(model), vec![req(1, &[1], 5)], &mut stop).unwrap_err();
        assert_eq!(e.to_string(), want);
        assert_eq!(closes(l.events()).len(), 1, "{model}");
    }
}

#[test]
fn roles_follow_the_rank() {
    let ctx = || init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let e =
        Worker::new(ctx(), Box::new(Factory::default()), EngineOptions::default()).err().unwrap();
    assert!(e.to_string().contains("a worker runs on ranks 1 and up, this is rank 0"), "{e}");
    let e = Role::new(ctx(), Box::new(Factory::default()), EngineOptions::default(), None)
        .err()
        .unwrap();
    assert!(matches!(e, Error::WrongRole { rank: 0, .. }), "{e}");
    let sinks = Sinks { output: Box::new(Collect::new()), metrics: Box::new(crate::NoMetrics) };
    let role =
        Role::new(ctx(), Box::new(Factory::default()), EngineOptions::default(), Some(sinks))
            .unwrap();
    assert!(matches!(role, Role::Leader(_)));
}

#[test]
fn engines_can_move_to_another_thread() {
    fn send<T: Send>() {}
    send::<Leader>();
    send::<Worker>();
    send::<Role>();
    send::<StopHandle>();
}

/// Collects like [`Collect`] and, at the `at`-th token, tells the test and holds the engine
/// until the test has asked the gate for a quiesce: the sleep lands mid-generation.
struct Pausing {
    inner: Collect,
    at: usize,
    seen: usize,
    gate: Arc<Mutex<Option<Arc<Gate>>>>,
    reached: std::sync::mpsc::Sender<()>,
}

impl OutputSink for Pausing {
    fn token(
        &mut self,
        request: u64,
        token: u32,
        last: bool,
        logprobs: Option<&crate::TokenLogprobs>,
    ) -> std::result::Result<(), BoxError> {
        self.seen += 1;
        if self.seen == self.at {
            self.reached.send(()).unwrap();
            let gate = self.gate.lock().unwrap().clone().unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            while gate.request().is_none() {
                assert!(Instant::now() < deadline, "the test never asked for a quiesce");
                std::thread::yield_now();
            }
        }
        self.inner.token(request, token, last, logprobs)
    }
    fn finished(
        &mut self,
        request: u64,
        reason: FinishReason,
        tokens: &[u32],
    ) -> std::result::Result<(), BoxError> {
        OutputSink::finished(&mut self.inner, request, reason, tokens)
    }
}

/// Serves one request of `max_tokens` and quiesces the engine with `mode` at its 5th token;
/// `between` runs while it is parked. Returns what finished and the prefill tokens of every
/// step.
fn sleep_mid_generation(
    mode: QuiesceMode,
    max_tokens: u32,
    between: impl FnOnce(&Gate, &Collect),
) -> (Vec<crate::sink::Finished>, Vec<usize>) {
    use crate::sleep::Quiesce;
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let (reached_tx, reached) = std::sync::mpsc::channel();
    let slot = Arc::new(Mutex::new(None));
    let sink =
        Pausing { inner: out.clone(), at: 5, seen: 0, gate: slot.clone(), reached: reached_tx };
    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let opts = EngineOptions { tick: Duration::from_millis(2), ..EngineOptions::default() };
    let mut l =
        Leader::new(ctx, Box::new(f.clone()), Box::new(sink), Box::new(m.clone()), opts).unwrap();
    let gate = l.gate();
    *slot.lock().unwrap() = Some(gate.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    tx.send(req(1, &[1, 2, 3], max_tokens)).unwrap();
    let engine = std::thread::spawn(move || {
        let mut decide = |r: &SessionReport| {
            if r.finished >= 2 {
                Decision::Stop
            } else {
                Decision::KeepOpen
            }
        };
        l.serve(SessionConfig::new("count"), &rx, &mut decide)
    });
    reached.recv_timeout(Duration::from_secs(10)).expect("the 5th token never came");
    gate.quiesce(mode).expect("the engine parks");
    assert!(gate.is_parked());
    // A request that arrives while parked waits for the wakeup.
    tx.send(req(2, &[7], 2)).unwrap();
    between(&gate, &out);
    gate.resume();
    engine.join().unwrap().unwrap();
    let prefills = m.0.lock().unwrap().iter().map(|s| s.prefill_tokens).collect();
    (out.finished(), prefills)
}

#[test]
fn keep_pauses_a_generation_and_it_continues_identically_after_resume() {
    let (done, prefills) = sleep_mid_generation(QuiesceMode::Keep, 12, |gate, out| {
        // Parked: no step runs, nothing finishes, the new request is not admitted.
        let tokens = out.finished().len();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(out.finished().len(), tokens);
        assert!(gate.is_parked());
    });
    let one = done.iter().find(|d| d.request == 1).unwrap();
    assert_eq!(one.reason, FinishReason::Length);
    assert_eq!(one.tokens, (4..16).collect::<Vec<u32>>(), "same as an uninterrupted run");
    assert_eq!(done.iter().find(|d| d.request == 2).unwrap().tokens, vec![8, 9]);
    assert_eq!(prefills.iter().sum::<usize>(), 3 + 1, "the kept cache is not recomputed");
}

#[test]
fn a_discarded_kv_cache_is_recomputed_from_the_tokens_after_resume() {
    use crate::sleep::Quiesce;
    // The counting model asserts that positions continue its cache: after the recompute the
    // sequence starts again at 0 under a new id, and the output is unchanged.
    let (done, prefills) = sleep_mid_generation(QuiesceMode::Keep, 12, |gate, _| {
        gate.set_lossy(["kv_cache".to_string()]);
        gate.released(&["kv_cache".to_string()]);
    });
    let one = done.iter().find(|d| d.request == 1).unwrap();
    assert_eq!(one.tokens, (4..16).collect::<Vec<u32>>());
    // The prompt (3) and the 4 generated tokens before the last are prefilled again, in one
    // step with the prompt (1) of the request that waited.
    assert!(prefills.contains(&(3 + 4 + 1)), "{prefills:?}");
}

#[test]
fn abort_fails_the_running_request_and_wait_lets_it_finish() {
    let (done, _) = sleep_mid_generation(QuiesceMode::Abort, 12, |_, out| {
        let f = out.finished();
        assert_eq!(f.len(), 1, "the running request ended before the sleep: {f:?}");
        assert_eq!(f[0].reason, FinishReason::Aborted);
    });
    assert_eq!(done.iter().find(|d| d.request == 1).unwrap().tokens, vec![4, 5, 6, 7, 8]);

    let (done, _) = sleep_mid_generation(QuiesceMode::Wait, 12, |_, out| {
        let f = out.finished();
        assert_eq!(f.len(), 1, "quiesce(wait) returns once the running request finished");
        assert_eq!(f[0].tokens, (4..16).collect::<Vec<u32>>());
    });
    assert_eq!(done.len(), 2);
}

#[test]
fn a_worker_gate_closes_between_steps_and_refuses_a_step_while_closed() {
    use crate::sleep::Quiesce;
    let gate = Arc::new(Gate::new(false, Duration::from_secs(5)));
    gate.enter_step().unwrap();
    let g = gate.clone();
    let quiescer = std::thread::spawn(move || g.quiesce(QuiesceMode::Wait));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!gate.is_parked(), "a running step is never cut");
    gate.leave_step();
    quiescer.join().unwrap().unwrap();
    assert!(gate.is_parked());
    assert!(gate.enter_step().unwrap_err().contains("quiesced"));
    gate.resume();
    gate.enter_step().unwrap();

    let slow = Gate::new(false, Duration::from_millis(30));
    slow.enter_step().unwrap();
    let err = slow.quiesce(QuiesceMode::Wait).unwrap_err();
    assert!(err.to_string().contains("step boundary"), "{err}");
    assert!(!slow.is_parked());
}

#[test]
fn a_cancelled_request_stops_generating_and_the_others_go_on() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let (reached_tx, reached) = std::sync::mpsc::channel();
    let slot = Arc::new(Mutex::new(None));
    let sink =
        Pausing { inner: out.clone(), at: 3, seen: 0, gate: slot.clone(), reached: reached_tx };
    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let opts = EngineOptions { tick: Duration::from_millis(2), ..EngineOptions::default() };
    let mut l =
        Leader::new(ctx, Box::new(f.clone()), Box::new(sink), Box::new(m.clone()), opts).unwrap();
    let gate = l.gate();
    *slot.lock().unwrap() = Some(gate.clone());
    let cancel = crate::Cancel::default();
    let (tx, rx) = std::sync::mpsc::channel();
    tx.send(req(1, &[1], 40).with_cancel(cancel.clone())).unwrap();
    let engine = std::thread::spawn(move || {
        let mut decide =
            |r: &SessionReport| if r.finished >= 2 { Decision::Stop } else { Decision::KeepOpen };
        l.serve(SessionConfig::new("count"), &rx, &mut decide)
    });
    reached.recv_timeout(Duration::from_secs(10)).expect("the 3rd token never came");
    // Hold the engine at the 3rd token until the cancel is in, via the pausing sink's gate
    // check: ask for a quiesce that is resumed at once.
    cancel.cancel();
    {
        use crate::sleep::Quiesce;
        gate.quiesce(QuiesceMode::Keep).unwrap();
        gate.resume();
    }
    tx.send(req(2, &[7], 2)).unwrap();
    engine.join().unwrap().unwrap();
    let done = out.finished();
    let one = done.iter().find(|d| d.request == 1).unwrap();
    assert_eq!(one.reason, FinishReason::Cancelled);
    assert_eq!(one.tokens, vec![2, 3, 4], "no token after the cancel");
    assert_eq!(done.iter().find(|d| d.request == 2).unwrap().tokens, vec![8, 9]);
}

#[test]
fn a_sleep_right_after_a_wakeup_parks_the_engine_again() {
    use crate::sleep::Quiesce;
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    // A long tick: the wakeup and the next sleep land between two boundaries.
    let opts = EngineOptions {
        tick: Duration::from_millis(50),
        quiesce_timeout: Duration::from_secs(5),
        ..EngineOptions::default()
    };
    let mut l =
        Leader::new(ctx, Box::new(f.clone()), Box::new(out.clone()), Box::new(m.clone()), opts)
            .unwrap();
    let (gate, stop) = (l.gate(), l.stop_handle());
    let (tx, rx) = std::sync::mpsc::channel::<Request>();
    let engine = std::thread::spawn(move || {
        let mut decide = |_: &SessionReport| Decision::KeepOpen;
        l.serve(SessionConfig::new("count"), &rx, &mut decide)
    });
    for cycle in 0..5 {
        let mode = if cycle % 2 == 0 { QuiesceMode::Wait } else { QuiesceMode::Keep };
        gate.quiesce(mode).unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
        assert!(gate.is_parked());
        gate.resume();
    }
    tx.send(req(1, &[1], 3)).unwrap();
    let start = Instant::now();
    while out.finished().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10), "the engine runs again");
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.request_stop();
    engine.join().unwrap().unwrap();
    assert_eq!(out.finished()[0].tokens, vec![2, 3, 4]);
}

/// An idle rank 0 waits for requests a tick at a time, and a parked one idles a tick at a
/// time: a sleep asked of it, and the first request after the wakeup, are still taken up at
/// once, not when the tick ends. With a tick far longer than the deadlines below, either wait
/// cut short only at the tick's end fails them.
#[test]
fn an_idle_engine_parks_and_runs_again_without_waiting_out_its_tick() {
    use crate::sleep::Quiesce;
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let ctx = init_parallel_with(mesh::Rendezvous::single(), &InitOptions::default()).unwrap();
    let opts = EngineOptions {
        tick: Duration::from_secs(600),
        quiesce_timeout: Duration::from_secs(20),
        ..EngineOptions::default()
    };
    let mut l =
        Leader::new(ctx, Box::new(f.clone()), Box::new(out.clone()), Box::new(m.clone()), opts)
            .unwrap();
    let (gate, stop) = (l.gate(), l.stop_handle());
    let (tx, rx) = std::sync::mpsc::channel::<Request>();
    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut decide = |_: &SessionReport| Decision::KeepOpen;
        let _ = done_tx.send(l.serve(SessionConfig::new("count"), &rx, &mut decide));
    });
    // The engine idles: one request served, then nothing to do.
    tx.send(req(1, &[1], 2)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.finished().is_empty() {
        assert!(Instant::now() < deadline, "the first request was never answered");
        std::thread::sleep(Duration::from_millis(2));
    }
    gate.quiesce(QuiesceMode::Wait).expect("an idle engine parks before its tick ends");
    gate.resume();
    tx.send(req(2, &[5], 2)).unwrap();
    while out.finished().len() < 2 {
        assert!(Instant::now() < deadline, "the request after the wakeup was never answered");
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.request_stop();
    let served = done.recv_timeout(Duration::from_secs(20)).expect("the engine stops");
    served.unwrap();
    assert_eq!(out.finished()[1].tokens, vec![6, 7]);
}

#[test]
fn a_failed_agreement_is_an_error_for_every_rank_but_its_origin() {
    let agreed = |failed| Agreed { state: State::Failed, failed, stopped: None };
    // Rank 2 failed on its own: the others name it, rank 2 reports its own error.
    let e = peer_failure(&agreed(Some(2)), 1, "admission", 3, 7).unwrap_err();
    assert!(matches!(e, Error::PeerFailed { peer: 2, rank: 1, step: 7, .. }), "{e}");
    assert!(peer_failure(&agreed(Some(2)), 2, "admission", 3, 7).is_ok());
    // Every failing rank failed after a peer (a data-group timeout on each): no origin, and
    // a healthy rank still stops rather than running the step alone.
    let e = peer_failure(&agreed(None), 0, "confirmation", 3, 7).unwrap_err();
    assert!(matches!(e, Error::PeersFailed { rank: 0, .. }), "{e}");
    assert!(e.known_to_peers(), "not announced again");
    assert!(e.to_string().contains("none reported a failure of its own"), "{e}");
    let go = Agreed { state: State::Go, failed: None, stopped: None };
    assert!(peer_failure(&go, 1, "admission", 3, 7).is_ok());
}

/// A stop agreed at the boundary where rank 0 closes a session for its replacement: the
/// requests it handed to the replacement are reported cancelled (they used to vanish, their
/// clients waiting until their own timeouts).
#[test]
fn the_requests_of_a_session_that_never_opens_are_cancelled() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let mut l = leader(&f, &out, &m);
    let handle = l.stop_handle();
    let mut decide = |r: &SessionReport| {
        assert_eq!(r.epoch, 0, "the replacement never runs");
        // A stop asked between the close and the replacement's open.
        handle.request_stop();
        Decision::Replace(SessionConfig::new("count"), vec![req(10, &[1], 3), req(11, &[2], 3)])
    };
    let summary = l.run(SessionConfig::new("count"), vec![req(1, &[1], 2)], &mut decide).unwrap();
    assert_eq!(summary.sessions, 1, "the stop is agreed at the close");
    let done = out.finished();
    let ends: Vec<(u64, FinishReason, usize)> =
        done.iter().map(|d| (d.request, d.reason, d.tokens.len())).collect();
    assert_eq!(
        ends,
        vec![
            (1, FinishReason::Length, 2),
            (10, FinishReason::Cancelled, 0),
            (11, FinishReason::Cancelled, 0)
        ]
    );
}

/// Each step's phases account for rank 0's time where it went: the model's sampling apart
/// from its forward pass, the two and the scheduler's update within the model time.
#[test]
fn step_phases_split_the_model_time() {
    let (f, out, m) = (Factory::default(), Collect::new(), Metrics::default());
    let mut l = leader(&f, &out, &m);
    let cfg = SessionConfig { token_budget: 8, ..SessionConfig::new("slow") };
    l.run(cfg, vec![req(1, &[1, 2, 3], 3), req(2, &[7], 3)], &mut stop).unwrap();
    let steps = m.0.lock().unwrap().clone();
    assert_eq!(steps.len(), 3, "{steps:?}");
    for s in &steps {
        let p = s.phases;
        assert!(p.forward >= SLOW_FORWARD && p.sample >= SLOW_SAMPLE, "{s:?}");
        assert!(p.forward + p.sample + p.update <= s.model, "{s:?}");
        let named: Vec<&str> = p.named().iter().map(|(n, _)| *n).collect();
        assert_eq!(named, ["schedule", "forward", "sample", "update", "emit"]);
    }
}
