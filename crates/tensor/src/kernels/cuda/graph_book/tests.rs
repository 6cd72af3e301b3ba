use super::*;
use proptest::prelude::*;

/// What a device does with the book's answers: the calls it ran, in order (a graph's calls
/// run when it is launched), the capture open, and the graphs launched.
#[derive(Default)]
struct Device {
    ran: Vec<u32>,
    capture: Vec<u32>,
    capturing: bool,
    launches: usize,
    /// Make the next capture fail.
    fail_capture: bool,
}

impl Device {
    fn begin(&mut self, book: &mut GraphBook<u32, Vec<u32>>, shape: Option<Shape>) {
        self.capturing = book.begin(shape);
        self.capture.clear();
    }

    fn call(&mut self, book: &mut GraphBook<u32, Vec<u32>>, c: u32) {
        match book.call(&c) {
            OnCall::Issue => self.issue(c),
            OnCall::Skip => {}
            OnCall::Recover(skipped) => {
                assert!(!self.capturing, "a capture never recovers: it aborts");
                self.ran.extend(skipped);
                self.issue(c);
            }
        }
    }

    fn issue(&mut self, c: u32) {
        if self.capturing {
            self.capture.push(c);
        } else {
            self.ran.push(c);
        }
    }

    fn leave(&mut self, book: &mut GraphBook<u32, Vec<u32>>, flush: bool) {
        let leave = if flush { book.flush() } else { book.other() };
        match leave {
            Leave::Nothing => {}
            Leave::EndCapture => {
                self.capturing = false;
                let graph = std::mem::take(&mut self.capture);
                if std::mem::take(&mut self.fail_capture) {
                    assert_eq!(book.capture_failed(), graph, "the calls captured are returned");
                    self.ran.extend(graph);
                } else {
                    self.ran.extend(&graph);
                    self.launches += 1;
                    book.captured(graph, std::time::Duration::from_millis(2));
                }
            }
            Leave::Launch(graph) => {
                self.ran.extend(graph);
                self.launches += 1;
            }
            Leave::Issue(skipped) => self.ran.extend(skipped),
            Leave::AbortCapture(captured) => {
                self.capturing = false;
                assert_eq!(captured, std::mem::take(&mut self.capture));
                self.ran.extend(captured);
            }
        }
    }

    /// A step of `shape` making `calls`, flushed at its end.
    fn step(&mut self, book: &mut GraphBook<u32, Vec<u32>>, shape: Shape, calls: &[u32]) {
        self.begin(book, Some(shape));
        for &c in calls {
            self.call(book, c);
        }
        self.leave(book, true);
    }
}

#[test]
fn two_equal_eager_steps_capture_the_third_and_later_steps_replay_it() {
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    let calls = [1, 2, 3];
    for i in 0..2 {
        assert!(!book.begin(Some((1, 1))), "step {i} is eager");
        for c in calls {
            assert_eq!(book.call(&c), OnCall::Issue);
        }
        assert_eq!(book.flush(), Leave::Nothing);
    }
    assert!(book.begin(Some((1, 1))), "the third step is captured");
    assert!(book.capturing());
    for c in calls {
        assert_eq!(book.call(&c), OnCall::Issue);
    }
    assert_eq!(book.flush(), Leave::EndCapture);
    book.captured(vec![1, 2, 3], std::time::Duration::from_millis(3));
    for _ in 0..3 {
        assert!(!book.begin(Some((1, 1))));
        assert!(book.replaying());
        for c in calls {
            assert_eq!(book.call(&c), OnCall::Skip);
        }
        assert_eq!(book.flush(), Leave::Launch(&vec![1, 2, 3]));
        // Past the flush the step is eager again.
        assert_eq!(book.call(&9), OnCall::Issue);
    }
    let stats = book.stats();
    assert_eq!((stats.captures, stats.replays, stats.misses), (1, 3, 0));
    assert_eq!(stats.capture_time, std::time::Duration::from_millis(3));
    assert_eq!(book.graphs(), 1);
    dev.step(&mut book, (2, 2), &calls);
    assert_eq!(dev.launches, 0, "another shape has graphs of its own");
}

#[test]
fn a_step_that_stops_matching_issues_what_it_skipped_and_goes_on_eagerly() {
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    for _ in 0..4 {
        dev.step(&mut book, (1, 1), &[1, 2, 3]);
    }
    assert_eq!(dev.launches, 2, "captured at the third step, replayed at the fourth");
    book.begin(Some((1, 1)));
    assert_eq!(book.call(&1), OnCall::Skip);
    assert_eq!(book.call(&7), OnCall::Recover(vec![1]), "the key positions' slot grew");
    assert_eq!(book.call(&3), OnCall::Issue);
    assert_eq!(book.flush(), Leave::Nothing);
    assert_eq!(book.graphs(), 0, "the graph is dropped");
    assert_eq!(book.stats().misses, 1);
    // The step it became was recorded: one more like it, and the next is captured.
    dev.step(&mut book, (1, 1), &[1, 7, 3]);
    assert!(book.begin(Some((1, 1))), "captured again");
    book.other();

    // A step shorter than its graph.
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    for _ in 0..3 {
        dev.step(&mut book, (1, 1), &[1, 2, 3]);
    }
    book.begin(Some((1, 1)));
    assert_eq!(book.call(&1), OnCall::Skip);
    assert_eq!(book.flush(), Leave::Issue(vec![1]));
}

#[test]
fn anything_but_a_call_ends_a_replay_or_a_capture_and_a_failed_capture_stays_eager() {
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    for _ in 0..3 {
        dev.step(&mut book, (1, 1), &[1, 2, 3]);
    }
    book.begin(Some((1, 1)));
    book.call(&1);
    book.call(&2);
    assert_eq!(book.other(), Leave::Issue(vec![1, 2]), "an allocation inside a replay");
    assert_eq!(book.call(&3), OnCall::Issue);
    assert_eq!(book.flush(), Leave::Nothing);

    // An allocation in a recorded step: the next step is not captured.
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    dev.step(&mut book, (1, 1), &[1, 2]);
    book.begin(Some((1, 1)));
    book.call(&1);
    assert_eq!(book.other(), Leave::Nothing);
    book.call(&2);
    book.flush();
    assert!(!book.begin(Some((1, 1))), "not two equal steps that could be captured");
    book.flush();

    // Inside a capture: abandoned, its calls issued.
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    dev.step(&mut book, (1, 1), &[1, 2]);
    dev.step(&mut book, (1, 1), &[1, 2]);
    assert!(book.begin(Some((1, 1))));
    book.call(&1);
    assert_eq!(book.other(), Leave::AbortCapture(vec![1]));
    assert_eq!(book.stats().failed_captures, 1);

    // A capture that makes no graph: that shape stays eager, others do not.
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    dev.step(&mut book, (1, 1), &[1, 2]);
    dev.step(&mut book, (1, 1), &[1, 2]);
    dev.fail_capture = true;
    dev.step(&mut book, (1, 1), &[1, 2]);
    assert_eq!(dev.ran, [1, 2, 1, 2, 1, 2]);
    for _ in 0..5 {
        assert!(!book.begin(Some((1, 1))));
        assert!(!book.replaying());
        book.flush();
    }
    assert_eq!(book.stats().eager_shapes, 1);
    for _ in 0..3 {
        dev.step(&mut book, (2, 1), &[1, 2]);
    }
    assert_eq!(book.graphs(), 1);
    // A graph that fails to launch: its shape stays eager too.
    book.begin(Some((2, 1)));
    book.call(&1);
    book.call(&2);
    assert!(matches!(book.flush(), Leave::Launch(_)));
    book.launch_failed();
    assert_eq!((book.graphs(), book.stats().eager_shapes), (0, 2));
    assert!(!book.begin(Some((2, 1))) && !book.replaying());
    book.flush();
    dev.step(&mut book, (3, 1), &[1, 2]);
    dev.step(&mut book, (3, 1), &[1, 2]);
    dev.step(&mut book, (3, 1), &[1, 2]);
    assert_eq!(book.graphs(), 1);
    book.clear();
    assert_eq!(book.graphs(), 0, "a sleep drops the graphs");
}

#[test]
fn a_shape_that_keeps_missing_stays_eager_and_graphs_off_or_unshaped_steps_are_never_captured() {
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    let mut step = 0;
    while book.stats().eager_shapes == 0 {
        // Two equal steps, a capture, then a replay that misses.
        let calls = [step, step + 1];
        for _ in 0..3 {
            dev.step(&mut book, (1, 1), &calls);
        }
        dev.step(&mut book, (1, 1), &[step + 100]);
        step += 2;
        assert!(step < 100, "never stayed eager");
    }
    assert_eq!(book.stats().misses, MISSES_MAX as u64);

    // A shape that misses once in a while (an input outgrowing its slot) keeps its graphs.
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    for grown in 0..2 * MISSES_MAX as u32 {
        for _ in 0..3 + REPLAYS_PER_MISS {
            dev.step(&mut book, (1, 1), &[1, grown]);
        }
    }
    let stats = book.stats();
    assert_eq!(stats.misses, 2 * MISSES_MAX as u64 - 1);
    assert_eq!(stats.eager_shapes, 0);
    assert_eq!(book.graphs(), 1);

    let (mut off, mut dev) = (GraphBook::new(false), Device::default());
    assert!(!off.enabled());
    for _ in 0..5 {
        dev.step(&mut off, (1, 1), &[1, 2]);
        dev.begin(&mut off, None);
        dev.call(&mut off, 3);
        dev.leave(&mut off, true);
    }
    assert_eq!((dev.launches, off.stats().captures), (0, 0));
    let (mut on, mut dev) = (GraphBook::new(true), Device::default());
    for _ in 0..5 {
        dev.begin(&mut on, None);
        dev.call(&mut on, 3);
        dev.leave(&mut on, true);
    }
    assert_eq!(dev.launches, 0, "a step of no shape is never captured");
}

#[test]
fn at_most_graphs_max_graphs_are_kept_the_least_recently_used_going_first() {
    let (mut book, mut dev) = (GraphBook::new(true), Device::default());
    for seqs in 1..=GRAPHS_MAX + 1 {
        for _ in 0..3 {
            dev.step(&mut book, (seqs, seqs), &[seqs as u32]);
        }
    }
    assert_eq!(book.graphs(), GRAPHS_MAX);
    assert!(!book.begin(Some((1, 1))) && !book.replaying(), "the first shape's graph went");
    book.flush();
    assert!(!book.begin(Some((2, 2))) && book.replaying(), "the second's stays");
}

/// One event of a random step: a call, the flush, or something that is not a call.
#[derive(Clone, Debug)]
enum Event {
    Call(u32),
    Flush,
    Other,
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        8 => (0u32..4).prop_map(Event::Call),
        1 => Just(Event::Flush),
        1 => Just(Event::Other),
    ]
}

proptest! {
    /// Whatever the steps do, the calls that run (issued, or in a graph launched) are each
    /// step's calls, in order: a replay never loses or repeats one.
    #[test]
    fn every_step_runs_exactly_its_calls_in_order(
        kinds in prop::collection::vec(prop::collection::vec(event(), 0..8), 3),
        steps in prop::collection::vec(
            (0usize..2, 0usize..3, prop::bool::weighted(0.1)),
            1..80,
        ),
    ) {
        let (mut book, mut dev) = (GraphBook::new(true), Device::default());
        for (shape, kind, fail) in steps {
            let events = kinds[kind].clone();
            dev.ran.clear();
            dev.fail_capture = fail;
            dev.begin(&mut book, Some((shape, 1)));
            let mut calls = Vec::new();
            for e in events {
                match e {
                    Event::Call(c) => {
                        calls.push(c);
                        dev.call(&mut book, c);
                    }
                    Event::Flush => dev.leave(&mut book, true),
                    Event::Other => dev.leave(&mut book, false),
                }
            }
            dev.leave(&mut book, true);
            prop_assert!(!dev.capturing);
            prop_assert_eq!(&dev.ran, &calls);
        }
    }
}
