use super::*;
use proptest::prelude::*;

fn life(bytes: usize, start: usize, end: Option<usize>) -> Lifetime {
    Lifetime { bytes, start, end }
}

/// Asserts no two planned buffers alive at the same time share a byte, each lies in the
/// workspace, and each overlap in bytes is in both buffers' conflicts.
fn check_layout(lifetimes: &[Lifetime], layout: &Layout) {
    for (i, a) in lifetimes.iter().enumerate() {
        let Some(oa) = layout.offsets[i] else {
            assert!(a.end.is_none(), "buffer {i} was given back but not planned");
            continue;
        };
        assert_eq!(oa % SLOT_ALIGN, 0, "buffer {i} at {oa}");
        assert!(oa + a.bytes <= layout.total, "buffer {i} past the workspace");
        for (j, b) in lifetimes.iter().enumerate().filter(|&(j, _)| j != i) {
            let Some(ob) = layout.offsets[j] else { continue };
            let bytes_overlap = oa < ob + b.bytes && ob < oa + a.bytes;
            if bytes_overlap {
                assert!(!overlap_in_time(a, b), "buffers {i} and {j} overlap while both are held");
                assert!(layout.conflicts[i].contains(&(j as u32)), "{j} not a conflict of {i}");
            } else {
                assert!(
                    !layout.conflicts[i].contains(&(j as u32)),
                    "{j} wrongly a conflict of {i}"
                );
            }
        }
    }
}

#[test]
fn a_chain_of_buffers_each_freed_after_the_next_is_taken_needs_two_slots() {
    // a taken, b taken, a freed, c taken, b freed, d taken, c freed, d freed.
    let l = [
        life(1000, 0, Some(2)),
        life(1000, 1, Some(4)),
        life(1000, 3, Some(6)),
        life(1000, 5, Some(7)),
    ];
    let layout = plan(&l);
    check_layout(&l, &layout);
    assert_eq!(layout.total, 2 * 1024);
    assert_eq!(layout.offsets[0], layout.offsets[2]);
    assert_eq!(layout.offsets[1], layout.offsets[3]);
    assert_eq!(layout.conflicts[0], vec![2]);
}

#[test]
fn a_buffer_held_past_the_step_is_not_planned_and_overlaps_everything_after_it() {
    let l = [life(512, 0, None), life(256, 1, Some(2)), life(4096, 3, Some(4))];
    let layout = plan(&l);
    check_layout(&l, &layout);
    assert_eq!(layout.offsets[0], None);
    assert_eq!(layout.total, 4096);
    assert!(overlap_in_time(&l[0], &l[2]));
}

/// Random recordings: buffers taken in order, each given back at a random later event or
/// never.
fn recordings() -> impl Strategy<Value = Vec<Lifetime>> {
    prop::collection::vec((1usize..5000, 0usize..12, any::<bool>()), 0..40).prop_map(|spec| {
        // Events: buffer i is taken at its own event; frees are interleaved after it.
        let mut frees: Vec<(usize, usize)> = Vec::new(); // (take index + delay, buffer)
        let mut out = Vec::new();
        for (i, &(bytes, delay, kept)) in spec.iter().enumerate() {
            out.push(life(bytes, 0, None));
            if !kept {
                frees.push((i + delay, i));
            }
        }
        frees.sort();
        let mut next_free = 0;
        // Events in order: each take, then the frees due after it.
        let mut clock = 0;
        let mut starts = vec![0; out.len()];
        let mut ends = vec![None; out.len()];
        for i in 0..out.len() {
            starts[i] = clock;
            clock += 1;
            while next_free < frees.len() && frees[next_free].0 <= i {
                let b = frees[next_free].1;
                ends[b] = Some(clock.max(starts[b] + 1));
                clock = ends[b].unwrap() + 1;
                next_free += 1;
            }
        }
        for (b, e) in frees[next_free..].iter().map(|f| f.1).zip(clock..) {
            ends[b] = Some(e.max(starts[b] + 1));
        }
        for (i, l) in out.iter_mut().enumerate() {
            l.start = starts[i];
            l.end = ends[i];
        }
        out
    })
}

proptest! {
    #[test]
    fn planned_buffers_held_together_never_share_a_byte(l in recordings()) {
        let layout = plan(&l);
        check_layout(&l, &layout);
        let aligned = |x: &Lifetime| x.bytes.next_multiple_of(SLOT_ALIGN);
        let sum: usize = l.iter().filter(|x| x.end.is_some()).map(aligned).sum();
        prop_assert!(layout.total <= sum);
    }
}

/// Host memory standing for a device workspace: words that buffers stamp and check.
type Words = Mutex<Vec<u32>>;

/// A buffer of a simulated step: its words stamped with its own tag.
enum SimBuf {
    Slot(Slot<Words>, usize, u32),
    /// The tracking is kept for its drop, which records the free.
    Own(#[allow(dead_code)] Option<Tracked>, Vec<u32>, u32),
}

impl SimBuf {
    fn take(mem: &mut StepMemory<Words>, bytes: usize, tag: u32) -> SimBuf {
        let words = bytes / 4;
        match mem.place(bytes, |b| Ok::<_, ()>(Mutex::new(vec![0; b / 4]))) {
            Placement::Slot(s) => {
                let at = s.offset() / 4;
                s.workspace().lock().unwrap()[at..at + words].fill(tag);
                SimBuf::Slot(s, words, tag)
            }
            Placement::Own(t) => SimBuf::Own(t, vec![tag; words], tag),
        }
    }

    /// Panics when another buffer wrote over this one.
    fn check(&self) {
        match self {
            SimBuf::Slot(s, words, tag) => {
                let at = s.offset() / 4;
                let mem = s.workspace().lock().unwrap();
                assert!(
                    mem[at..at + words].iter().all(|w| w == tag),
                    "slot of buffer {tag} overwritten"
                );
            }
            SimBuf::Own(_, v, tag) => assert!(v.iter().all(|w| w == tag)),
        }
    }

    fn is_slot(&self) -> bool {
        matches!(self, SimBuf::Slot(..))
    }
}

/// Runs one step of `program` (sizes in words; each buffer freed `delay` takes later, or kept
/// past the step into `kept` when `delay` is `None`), checking every buffer before it is
/// dropped.
fn run_step(
    mem: &mut StepMemory<Words>,
    key: StepKey,
    program: &[(usize, Option<usize>)],
    tag: &mut u32,
    kept: &mut Vec<SimBuf>,
) -> usize {
    step_offsets(mem, key, program, tag, kept).iter().flatten().count()
}

/// [`run_step`], returning the offset of each buffer served from a slot.
fn step_offsets(
    mem: &mut StepMemory<Words>,
    key: StepKey,
    program: &[(usize, Option<usize>)],
    tag: &mut u32,
    kept: &mut Vec<SimBuf>,
) -> Vec<Option<usize>> {
    mem.begin(Some(key));
    let mut held: Vec<(usize, SimBuf)> = Vec::new();
    let mut slots = Vec::new();
    for (i, &(words, delay)) in program.iter().enumerate() {
        *tag += 1;
        let b = SimBuf::take(mem, 4 * words, *tag);
        slots.push(match &b {
            SimBuf::Slot(s, ..) => Some(s.offset()),
            SimBuf::Own(..) => None,
        });
        match delay {
            Some(d) => held.push((i + d, b)),
            None => kept.push(b),
        }
        held.retain(|(due, b)| {
            b.check();
            *due > i
        });
    }
    for (_, b) in &held {
        b.check();
    }
    drop(held);
    mem.end();
    slots
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Steps that repeat, grow, reorder their frees or keep buffers never see a buffer
    /// overwritten, and a repeated step is served from its slots.
    #[test]
    fn steps_never_overwrite_a_held_buffer(
        program in prop::collection::vec((1usize..300, prop::option::weighted(0.95, 0usize..6)), 1..30),
        grow in 0usize..30,
        late in 0usize..30,
    ) {
        let mut mem = StepMemory::<Words>::default();
        let key = StepKey::of(3, 2).unwrap();
        let (mut tag, mut kept) = (0, Vec::new());
        run_step(&mut mem, key, &program, &mut tag, &mut kept);
        // The same step again: served from the plan, except buffers overlapping one kept.
        let kept_before = kept.len();
        let served = run_step(&mut mem, key, &program, &mut tag, &mut kept);
        let freed = program.iter().filter(|p| p.1.is_some()).count();
        if kept_before == 0 {
            prop_assert_eq!(served, freed);
        }
        // A buffer larger than planned, and one freed later than recorded.
        let mut other = program.clone();
        if let Some(p) = other.get_mut(grow % program.len()) { p.0 += 64; }
        if let Some(p) = other.get_mut(late % program.len()) { p.1 = p.1.map(|d| d + 3); }
        run_step(&mut mem, key, &other, &mut tag, &mut kept);
        run_step(&mut mem, key, &other, &mut tag, &mut kept);
        drop(kept.drain(..kept_before));
        run_step(&mut mem, key, &program, &mut tag, &mut kept);
        for b in &kept { b.check(); }
    }
}

#[test]
fn a_warm_step_takes_each_buffer_from_the_same_slot_of_one_workspace() {
    let mut mem = StepMemory::<Words>::default();
    let key = StepKey::of(8, 8).unwrap();
    let program = [(100, Some(1)), (200, Some(1)), (50, Some(0)), (300, None)];
    let (mut tag, mut kept) = (0, Vec::new());
    assert_eq!(
        run_step(&mut mem, key, &program, &mut tag, &mut kept),
        0,
        "the first step is recorded"
    );
    let first = step_offsets(&mut mem, key, &program, &mut tag, &mut kept);
    assert_eq!(first.iter().flatten().count(), 3, "the kept buffer is the allocator's");
    let again = step_offsets(&mut mem, key, &program, &mut tag, &mut kept);
    assert_eq!(again, first, "the same offsets at every step");
    let s = mem.stats();
    assert_eq!((s.recordings, s.workspaces, s.slots), (1, 1, 6));
    assert_eq!(s.fallbacks, 4, "the recorded step's four buffers");
}

#[test]
fn a_buffer_kept_from_an_earlier_step_sends_its_overlaps_to_the_allocator() {
    let mut mem = StepMemory::<Words>::default();
    let key = StepKey::of(1, 1).unwrap();
    // a, freed; b over a's bytes.
    let program = [(64, Some(0)), (64, Some(0))];
    let (mut tag, mut kept) = (0, Vec::new());
    run_step(&mut mem, key, &program, &mut tag, &mut kept);
    mem.begin(Some(key));
    let a = SimBuf::take(&mut mem, 256, 1);
    assert!(a.is_slot());
    mem.end();
    // `a` is still held: the next step's `a` and `b` (over the same bytes) take the allocator.
    mem.begin(Some(key));
    let a2 = SimBuf::take(&mut mem, 256, 2);
    let b2 = SimBuf::take(&mut mem, 256, 3);
    assert!(!a2.is_slot() && !b2.is_slot());
    a.check();
    mem.end();
    drop((a, a2, b2));
    mem.begin(Some(key));
    assert!(SimBuf::take(&mut mem, 256, 4).is_slot());
    mem.end();
}

#[test]
fn a_plan_too_small_is_recorded_again_at_the_larger_sizes_a_bounded_number_of_times() {
    let mut mem = StepMemory::<Words>::default();
    let key = StepKey::of(2, 1).unwrap();
    let (mut tag, mut kept) = (0, Vec::new());
    run_step(&mut mem, key, &[(10, Some(0)), (20, Some(0))], &mut tag, &mut kept);
    // Larger first buffer: the plan is outgrown, the next step records, then both fit.
    assert_eq!(run_step(&mut mem, key, &[(40, Some(0)), (20, Some(0))], &mut tag, &mut kept), 1);
    assert_eq!(run_step(&mut mem, key, &[(40, Some(0)), (20, Some(0))], &mut tag, &mut kept), 0);
    assert_eq!(run_step(&mut mem, key, &[(10, Some(0)), (20, Some(0))], &mut tag, &mut kept), 2);
    assert_eq!(run_step(&mut mem, key, &[(40, Some(0)), (20, Some(0))], &mut tag, &mut kept), 2);
    assert_eq!(mem.stats().recordings, 2);
    // A step that always outgrows its plan stops being recorded.
    for words in 1..=3 * RECORDINGS_MAX {
        run_step(&mut mem, key, &[(100 * words, Some(0))], &mut tag, &mut kept);
    }
    assert_eq!(mem.stats().recordings as usize, RECORDINGS_MAX);
}

#[test]
fn nested_steps_are_one_and_unplanned_steps_take_the_allocator() {
    assert_eq!(StepKey::of(0, 0), None);
    assert_eq!(StepKey::of(PLANNED_TOKENS_MAX + 1, 1), None);
    assert_eq!(StepKey::of(5, 3), Some(StepKey { tokens: 8, seqs: 4 }));
    let mut mem = StepMemory::<Words>::default();
    let key = StepKey::of(1, 1);
    for _ in 0..2 {
        mem.begin(key);
        mem.begin(key);
        drop(SimBuf::take(&mut mem, 64, 1));
        mem.end();
        drop(SimBuf::take(&mut mem, 64, 2));
        mem.end();
    }
    assert_eq!(mem.stats().recordings, 1);
    assert_eq!(mem.stats().slots, 2);
    mem.begin(None);
    assert!(matches!(mem.place(64, |_| Err::<Words, ()>(())), Placement::Own(None)));
    mem.end();
    // Outside any step too.
    assert!(matches!(mem.place(64, |_| Err::<Words, ()>(())), Placement::Own(None)));
}

#[test]
fn a_workspace_that_cannot_be_made_leaves_buffers_to_the_allocator_and_clear_records_again() {
    let mut mem = StepMemory::<Words>::default();
    let key = StepKey::of(1, 1).unwrap();
    let (mut tag, mut kept) = (0, Vec::new());
    run_step(&mut mem, key, &[(10, Some(0))], &mut tag, &mut kept);
    mem.begin(Some(key));
    assert!(matches!(mem.place(40, |_| Err::<Words, ()>(())), Placement::Own(None)));
    mem.end();
    assert_eq!(mem.stats().workspaces, 0);
    assert!(mem.stats().planned_bytes > 0);
    mem.clear();
    assert_eq!(mem.stats().planned_bytes, 0);
    assert_eq!(run_step(&mut mem, key, &[(10, Some(0))], &mut tag, &mut kept), 0, "recorded again");
    assert_eq!(mem.stats().recordings, 2);
}

#[test]
fn plans_past_the_budget_drop_the_least_recently_used_and_record_it_again() {
    // Each plan is one buffer of 1,024 words (4 KiB); room for two.
    let mut mem = StepMemory::<Words>::with_budget(2 * 4096);
    let (mut tag, mut kept) = (0, Vec::new());
    let keys: Vec<StepKey> = [1, 2, 4].iter().map(|&t| StepKey::of(t, 1).unwrap()).collect();
    let program = [(1024, Some(0))];
    run_step(&mut mem, keys[0], &program, &mut tag, &mut kept);
    run_step(&mut mem, keys[1], &program, &mut tag, &mut kept);
    assert_eq!(run_step(&mut mem, keys[0], &program, &mut tag, &mut kept), 1, "served");
    assert_eq!(mem.stats().planned_bytes, 2 * 4096);
    // A third shape: the least recently used (keys[1]) goes, keys[0] stays.
    run_step(&mut mem, keys[2], &program, &mut tag, &mut kept);
    assert_eq!(mem.stats().planned_bytes, 2 * 4096);
    assert_eq!(run_step(&mut mem, keys[0], &program, &mut tag, &mut kept), 1, "kept");
    assert_eq!(run_step(&mut mem, keys[1], &program, &mut tag, &mut kept), 0, "recorded again");
    assert_eq!(mem.stats().recordings, 4);
    // A plan larger than the budget alone is kept while it is the only one.
    let mut small = StepMemory::<Words>::with_budget(1024);
    run_step(&mut small, keys[0], &program, &mut tag, &mut kept);
    assert_eq!(run_step(&mut small, keys[0], &program, &mut tag, &mut kept), 1);
}
