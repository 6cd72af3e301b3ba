//! The budget arithmetic, table-driven: which models sleep before another wakes, when a
//! request waits, and the refusals of a budget too small.

use super::*;

const MIB: u64 = 1 << 20;

/// A model measured at `asleep` + `swap` MiB, in `state`, last used at `used`, with
/// `in_flight` requests.
fn entry(name: &str, state: State, asleep: u64, swap: u64, used: u64, in_flight: usize) -> Entry {
    Entry {
        name: name.to_owned(),
        state,
        pinned: false,
        last_used: used,
        in_flight,
        draining: false,
        asleep_bytes: asleep * MIB,
        swap_bytes: swap * MIB,
        restartable: true,
        backup_bytes: 0,
        kept: false,
        checkpoint: String::new(),
        measured: Default::default(),
        gpu_asleep: Default::default(),
        gpu_swap: Default::default(),
    }
}

const AWAKE: State = State::Awake;

/// [`check_fits`] with the host's budget alone (CPU models).
fn check_fits_host(budget: u64, models: &[Entry]) -> Result<(), String> {
    check_fits(budget, &BTreeMap::new(), models)
}
const ASLEEP: State = State::Asleep { level: Some(1) };

#[test]
fn a_wakeup_sleeps_the_least_recently_used_idle_models_first() {
    // (budget MiB, models, target, plan)
    let cases: Vec<(u64, Vec<Entry>, usize, Plan)> = vec![
        // Room for the target beside the one awake: nothing sleeps.
        (
            300,
            vec![entry("a", AWAKE, 40, 100, 5, 0), entry("b", ASLEEP, 40, 100, 1, 0)],
            1,
            Plan::Swap { evict: vec![] },
        ),
        // One fits: the only awake one sleeps.
        (
            200,
            vec![entry("a", AWAKE, 40, 100, 5, 0), entry("b", ASLEEP, 40, 100, 1, 0)],
            1,
            Plan::Swap { evict: vec![0] },
        ),
        // Two awake, room for one more only after one sleeps: the least recently used.
        (
            350,
            vec![
                entry("a", AWAKE, 40, 100, 7, 0),
                entry("b", AWAKE, 40, 100, 3, 0),
                entry("c", ASLEEP, 40, 100, 1, 0),
            ],
            2,
            Plan::Swap { evict: vec![1] },
        ),
        // The least recently used is busy: the idle one sleeps instead.
        (
            350,
            vec![
                entry("a", AWAKE, 40, 100, 7, 0),
                entry("b", AWAKE, 40, 100, 3, 2),
                entry("c", ASLEEP, 40, 100, 1, 0),
            ],
            2,
            Plan::Swap { evict: vec![0] },
        ),
        // Only busy models can make room: drain the least recently used of them.
        (
            250,
            vec![
                entry("a", AWAKE, 40, 100, 7, 1),
                entry("b", AWAKE, 40, 10, 3, 0),
                entry("c", ASLEEP, 40, 100, 1, 0),
            ],
            2,
            Plan::Drain { evict: vec![1, 0] },
        ),
        // A big model makes two small ones sleep, least recently used first.
        (
            280,
            vec![
                entry("a", AWAKE, 20, 50, 2, 0),
                entry("b", AWAKE, 20, 50, 4, 0),
                entry("c", AWAKE, 20, 50, 3, 0),
                entry("big", ASLEEP, 20, 150, 1, 0),
            ],
            3,
            Plan::Swap { evict: vec![0, 2] },
        ),
        // Already awake.
        (100, vec![entry("a", AWAKE, 40, 100, 1, 0)], 0, Plan::Ready),
    ];
    for (budget, models, target, plan) in cases {
        let names: Vec<String> = models.iter().map(|m| format!("{}:{}", m.name, m.state)).collect();
        let table = Table::new(budget * MIB, models);
        assert_eq!(table.plan(target), plan, "budget {budget} MiB, {names:?}, target {target}");
    }
}

#[test]
fn pinned_failed_and_moving_models_are_never_evicted() {
    let mut pinned = entry("p", AWAKE, 40, 100, 1, 0);
    pinned.pinned = true;
    let table = Table::new(
        200 * MIB,
        vec![pinned, entry("a", AWAKE, 40, 10, 9, 0), entry("b", ASLEEP, 0, 100, 1, 0)],
    );
    let Plan::Unavailable(why) = table.plan(2) else { panic!("{:?}", table.plan(2)) };
    assert_eq!(
        why,
        "model `b` needs 100.0 MiB to wake; with every other model that can sleep asleep, 180.0 MiB of the --memory-budget 200.0 MiB stays held, leaving 20.0 MiB"
    );

    // The same while another model wakes: that swap may make room, so the request waits.
    let mut pinned = entry("p", AWAKE, 40, 100, 1, 0);
    pinned.pinned = true;
    let table = Table::new(
        200 * MIB,
        vec![pinned, entry("a", State::Waking, 40, 10, 9, 0), entry("b", ASLEEP, 0, 100, 1, 0)],
    );
    assert_eq!(table.plan(2), Plan::Wait("model `b` waits for room: model `a` is waking".into()));

    // A failed model holds nothing (its ranks are gone); a request restarts it, with room
    // for all it holds (it loads awake), unless its restart failed already.
    let mut table = Table::new(
        200 * MIB,
        vec![
            entry("f", State::Failed("rank 0 exited".into()), 40, 100, 1, 0),
            entry("b", ASLEEP, 40, 100, 1, 0),
        ],
    );
    assert_eq!(table.resident(), 40 * MIB);
    assert_eq!(table.plan(1), Plan::Swap { evict: vec![] });
    assert_eq!(table.plan(0), Plan::Restart { evict: vec![] });
    table.models[1].state = AWAKE;
    assert_eq!(table.plan(0), Plan::Restart { evict: vec![1] });
    table.budget = 150 * MIB;
    assert_eq!(
        table.plan(0),
        Plan::Unavailable("model `f` needs 140.0 MiB to wake; with every other model that can sleep asleep, 40.0 MiB of the --memory-budget 150.0 MiB stays held, leaving 110.0 MiB".into())
    );
    table.models[0].restartable = false;
    assert_eq!(table.plan(0), Plan::Unavailable("model `f` failed: rank 0 exited".into()));

    // Requests for a model loading, waking, sleeping or draining wait.
    for state in [State::Loading, State::Waking, State::Sleeping] {
        let table = Table::new(500 * MIB, vec![entry("m", state.clone(), 40, 100, 1, 0)]);
        assert!(matches!(table.plan(0), Plan::Wait(_)), "{state}");
    }
    let mut draining = entry("d", AWAKE, 40, 100, 1, 1);
    draining.draining = true;
    let mut table = Table::new(500 * MIB, vec![draining]);
    assert!(matches!(table.plan(0), Plan::Wait(_)));
    assert!(!table.admit(0));
}

#[test]
fn admitting_counts_requests_and_orders_use() {
    let mut table = Table::new(
        1000 * MIB,
        vec![entry("a", AWAKE, 40, 100, 0, 0), entry("b", AWAKE, 40, 100, 0, 0)],
    );
    assert!(table.admit(1));
    assert!(table.admit(0));
    assert!(table.admit(0));
    assert_eq!((table.models[0].in_flight, table.models[1].in_flight), (2, 1));
    assert!(table.models[0].last_used > table.models[1].last_used);
    table.finish(0);
    table.finish(0);
    table.finish(0);
    assert_eq!(table.models[0].in_flight, 0, "never below zero");
    // Resident: awake models count both numbers, asleep ones the first.
    assert_eq!(table.resident(), 280 * MIB);
    table.models[1].state = ASLEEP;
    assert_eq!(table.resident(), 180 * MIB);
}

#[test]
fn a_budget_that_cannot_hold_a_model_is_refused_with_the_numbers() {
    let models = vec![
        entry("small", ASLEEP, 40, 100, 0, 0),
        entry("large", ASLEEP, 40, 150, 0, 0),
        entry("mid", ASLEEP, 40, 120, 0, 0),
    ];
    assert_eq!(check_fits_host(270 * MIB, &models), Ok(()));
    assert_eq!(
        check_fits_host(269 * MIB, &models),
        Err("--memory-budget 269.0 MiB cannot hold model `large` awake: it needs 150.0 MiB to wake beside the 120.0 MiB every model keeps asleep, 270.0 MiB in all; give at least that".into())
    );
    assert_eq!(
        check_fits_host(100 * MIB, &models),
        Err("--memory-budget 100.0 MiB cannot hold the models asleep: their ranks keep 120.0 MiB resident asleep; give at least 120.0 MiB".into())
    );
    // A pinned model stays awake: it counts in full beside the largest other.
    let mut pinned = models.clone();
    pinned[1].pinned = true;
    assert_eq!(check_fits_host(390 * MIB, &pinned), Ok(()));
    assert_eq!(
        check_fits_host(389 * MIB, &pinned),
        Err("--memory-budget 389.0 MiB cannot hold model `mid` awake: it needs 120.0 MiB to wake beside the 120.0 MiB every model keeps asleep and 150.0 MiB of pinned models, 390.0 MiB in all; give at least that".into())
    );
}

#[test]
fn memory_budgets_parse_as_bytes_or_a_share() {
    let ok: [(&str, MemoryBudget); 6] = [
        ("0.9", MemoryBudget::Fraction(0.9)),
        ("1", MemoryBudget::Bytes(1)),
        ("1073741824", MemoryBudget::Bytes(1 << 30)),
        ("512MiB", MemoryBudget::Bytes(512 << 20)),
        ("1.5 GiB", MemoryBudget::Bytes(3 << 29)),
        ("2GB", MemoryBudget::Bytes(2_000_000_000)),
    ];
    for (text, budget) in ok {
        assert_eq!(text.parse::<MemoryBudget>(), Ok(budget), "{text}");
    }
    for (text, why) in [
        ("0", "a budget of 0 bytes holds nothing"),
        ("1.5", "a share of the host's memory is in (0, 1], not 1.5"),
        ("-0.5", "a share of the host's memory is in (0, 1], not -0.5"),
        ("lots", "give bytes (1073741824, 512MiB, 4GiB) or a share of the host's memory (0.9)"),
        ("xMiB", "is not a memory budget"),
    ] {
        let err = text.parse::<MemoryBudget>().unwrap_err();
        assert!(err.contains(why), "{text}: {err}");
    }
    assert_eq!(MemoryBudget::Fraction(0.5).bytes(1000), 500);
    assert_eq!(MemoryBudget::Bytes(7).bytes(1000), 7);
}

#[test]
fn a_level_1_sleep_whose_backup_host_memory_cannot_hold_is_a_level_2_one() {
    /// Configured level, backup MiB, available MiB or why not, level, whether it says why.
    type Case = (u8, u64, Result<u64, &'static str>, u8, bool);
    let cases: Vec<Case> = vec![
        (1, 100, Ok(101), 1, false),
        (1, 100, Ok(100), 1, false),
        (1, 100, Ok(99), 2, true),
        (1, 100, Err("no MemAvailable"), 2, true),
        (2, 100, Ok(1000), 2, false),
        (2, 100, Ok(1), 2, false),
    ];
    for (configured, backup, available, level, why) in cases {
        let available = available.map(|a| a * MIB).map_err(str::to_owned);
        let (got, reason) = sleep_level(configured, backup * MIB, available.clone());
        assert_eq!((got, reason.is_some()), (level, why), "{configured} {backup} {available:?}");
    }
    let (_, reason) = sleep_level(1, 100 * MIB, Ok(99 * MIB));
    assert_eq!(
        reason.unwrap(),
        "its level-1 backup needs 100.0 MiB of host memory and only 99.0 MiB is available (MemAvailable); its weights reload from the checkpoint at the wakeup"
    );
}

/// While the models start, a measured model wakes as at any time (the load beside it holds
/// the swap turn); a model still loading waits, and so does one whose room depends on a model
/// still loading.
#[test]
fn a_measured_model_wakes_while_others_still_load() {
    let mut table = Table::new(
        1000 * MIB,
        vec![entry("a", ASLEEP, 40, 100, 0, 0), entry("b", State::Loading, 0, 0, 0, 0)],
    );
    table.starting = true;
    assert_eq!(table.plan(0), Plan::Swap { evict: vec![] });
    assert_eq!(table.plan(1), Plan::Wait("model `b` is loading".into()));
    table.budget = 200 * MIB;
    table.models.push(entry("c", State::Awake, 40, 100, 0, 0));
    assert_eq!(
        table.plan(0),
        Plan::Swap { evict: vec![2] },
        "an awake model makes room, as after the start"
    );
}

/// `e` with `asleep` + `swap` MiB on GPU `gpu` as well.
fn on_gpu(mut e: Entry, gpu: &str, asleep: u64, swap: u64) -> Entry {
    e.gpu_asleep.insert(gpu.to_owned(), asleep * MIB);
    e.gpu_swap.insert(gpu.to_owned(), swap * MIB);
    e
}

/// Each GPU has a budget of its own: a wakeup on one GPU puts to sleep models of that GPU
/// only (a model elsewhere frees nothing there, however long unused), and a GPU too small for
/// a model is refused by its name, whatever room the host has.
#[test]
fn each_gpu_has_its_own_budget() {
    let models = vec![
        // `b`, on the other GPU, is the least recently used.
        on_gpu(entry("a", AWAKE, 10, 10, 5, 0), "GPU-0", 2, 80),
        on_gpu(entry("b", AWAKE, 10, 10, 1, 0), "GPU-1", 2, 80),
        on_gpu(entry("c", ASLEEP, 10, 10, 3, 0), "GPU-0", 2, 60),
        on_gpu(entry("d", ASLEEP, 10, 10, 4, 0), "GPU-1", 2, 10),
    ];
    let mut table = Table::new(1000 * MIB, models.clone());
    table.gpu_budgets = [("GPU-0".to_owned(), 100 * MIB), ("GPU-1".to_owned(), 100 * MIB)].into();
    assert_eq!(table.plan(2), Plan::Swap { evict: vec![0] }, "c needs GPU-0's room: a sleeps");
    assert_eq!(table.plan(3), Plan::Swap { evict: vec![] }, "d fits beside b on GPU-1");

    // A pinned model holds its GPU: nothing else there can make room.
    table.models[0].pinned = true;
    assert_eq!(
        table.plan(2),
        Plan::Unavailable("model `c` needs 60.0 MiB on GPU GPU-0 to wake; with every other model that can sleep asleep, 84.0 MiB of that GPU's --memory-budget 100.0 MiB stays held, leaving 16.0 MiB".into())
    );

    // At start: a GPU whose budget cannot hold a model awake beside the others asleep.
    let budgets = [("GPU-0".to_owned(), 100 * MIB), ("GPU-1".to_owned(), 100 * MIB)].into();
    assert_eq!(check_fits(1000 * MIB, &budgets, &models), Ok(()));
    let small = [("GPU-0".to_owned(), 80 * MIB), ("GPU-1".to_owned(), 100 * MIB)].into();
    assert_eq!(
        check_fits(1000 * MIB, &small, &models),
        Err("--memory-budget 80.0 MiB on GPU GPU-0 cannot hold model `a` awake: it needs 80.0 MiB to wake beside the 4.0 MiB every model keeps asleep, 84.0 MiB in all; give at least that".into())
    );
}
