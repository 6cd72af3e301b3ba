//! Step-agreement benchmark: the per-step coordination of the session engine (admission with
//! rank 0's plan, decoding it, confirmation; no model) next to one 8-byte all_reduce on the
//! same control group, in the same run, for 2 and 4 ranks on the shm and tcp backends.
//!
//! Run through `cargo xtask bench session`. Without `RANK` in the environment this program is
//! the launcher: it starts the ranks (copies of itself) and prints a table, or one JSON object
//! per configuration with `--json`.

use collectives::{init_parallel, Collective, Communicator, InitOptions, ReduceOp};
use mesh::{AxisBackends, CommBackend};
use session::protocol::{self, Agreement, Contribution, Message, State};
use session::{PlanEntry, StepPlan};
mod common;
use std::time::{Duration, Instant};

const ITERS: usize = 1000;
const ROUNDS: usize = 9;

fn main() {
    if std::env::var_os("RANK").is_some() {
        rank_main();
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let backends: Vec<String> = match args.iter().position(|a| a == "--backends") {
        Some(i) => args[i + 1].split(',').map(str::to_owned).collect(),
        None => vec!["shm".into(), "tcp".into()],
    };
    if !json {
        println!(
            "{:<7} {:>5} {:>14} {:>12} {:>8} {:>16}",
            "backend", "ranks", "allreduce8_us", "step_us", "ratio", "step_64seq_us"
        );
    }
    for backend in &backends {
        for world in [2usize, 4] {
            let line = launch(backend, world);
            if json {
                println!("{line}");
            } else {
                let f = |k: &str| field(&line, k).unwrap_or_default();
                println!(
                    "{:<7} {:>5} {:>14} {:>12} {:>8} {:>16}",
                    f("backend"),
                    f("ranks"),
                    f("allreduce8_us"),
                    f("step_us"),
                    f("ratio"),
                    f("step_64seq_us")
                );
            }
        }
    }
}

fn field(json: &str, key: &str) -> Option<String> {
    let key = format!("\"{key}\":");
    let start = json.find(&key)? + key.len();
    let rest = &json[start..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    Some(rest[..end].trim_matches('"').to_owned())
}

/// Starts `world` ranks on `backend` and returns rank 0's result line.
fn launch(backend: &str, world: usize) -> String {
    let env = [("TPCTL_BENCH_BACKEND", backend.to_owned())];
    common::launch_ranks(backend, world, &env).join("\n").trim().to_owned()
}

/// A decode step of `seqs` running sequences.
fn decode_plan(seqs: u64, step: u64) -> StepPlan {
    StepPlan {
        epoch: 0,
        step,
        entries: (0..seqs)
            .map(|s| PlanEntry {
                seq: s + 1,
                start: 100 + step as u32,
                tokens: vec![(s * 7 + step) as u32 % 32000],
                sample: true,
                reserve: 4096,
                blocks: Vec::new(),
                sampling: None,
            })
            .collect(),
        released: Vec::new(),
    }
}

/// One measured operation: a name and one call of it (the argument varies per call).
type Variant<'a> = (&'static str, Box<dyn FnMut(&mut dyn Communicator, u64) + 'a>);

/// Runs every variant in turn, round after round (so machine noise hits them alike), and
/// returns per variant the best round's mean time of one call, in microseconds.
fn measure(comm: &mut dyn Communicator, variants: &mut [Variant<'_>]) -> Vec<f64> {
    let mut best = vec![f64::INFINITY; variants.len()];
    for (_, f) in variants.iter_mut() {
        for i in 0..200 {
            f(comm, i);
        }
    }
    for r in 0..ROUNDS {
        for (v, (_, f)) in variants.iter_mut().enumerate() {
            comm.barrier().expect("barrier");
            let start = Instant::now();
            for i in 0..ITERS {
                f(comm, (r * ITERS + i) as u64 + 1000);
            }
            let t = start.elapsed().as_secs_f64() * 1e6 / ITERS as f64;
            best[v] = best[v].min(t);
        }
    }
    best
}

fn coordination(seqs: u64) -> impl FnMut(&mut dyn Communicator, u64) {
    let mut agreement = Agreement::new();
    let mut buf = Vec::new();
    // Rank 0's scheduler keeps its plan between steps; only the tokens and positions move.
    let mut msg = Message::Step(decode_plan(seqs, 0));
    move |comm, step| {
        let rank = comm.rank();
        if rank == 0 {
            if let Message::Step(plan) = &mut msg {
                plan.step = step + 1;
                for (s, e) in plan.entries.iter_mut().enumerate() {
                    e.start = 100 + step as u32;
                    e.tokens[0] = (s as u64 * 7 + step) as u32 % 32000;
                }
            }
            protocol::encode(&msg, 0, step + 1, &mut buf);
        }
        let c = Contribution {
            state: State::Go,
            epoch: 0,
            step,
            message: (rank == 0).then_some(&buf[..]),
        };
        agreement.admit(comm, c).expect("admission");
        if rank != 0 {
            protocol::decode_into(agreement.message(), &mut msg).expect("a plan");
            std::hint::black_box(&msg);
        }
        agreement.confirm(comm, Contribution { message: None, ..c }).expect("confirmation");
    }
}

fn rank_main() {
    let backend: CommBackend = std::env::var("TPCTL_BENCH_BACKEND")
        .unwrap_or_else(|_| "shm".into())
        .parse()
        .expect("backend");
    let world: usize = std::env::var("WORLD_SIZE").expect("WORLD_SIZE").parse().expect("number");
    let opts = InitOptions {
        tp: Some(world),
        head_groups: world,
        backends: AxisBackends { tp: backend, cp: backend, control: backend },
        timeout: Duration::from_secs(120),
        ..InitOptions::default()
    };
    let mut ctx = init_parallel(&opts).expect("init_parallel");
    let comm = ctx.control.as_mut();
    let mut one = [0i64; 1];
    let mut words = [0i64; protocol::HEADER_WORDS];
    let mut agreement = Agreement::new();
    let mut variants: Vec<Variant<'_>> = vec![
        (
            "allreduce8",
            Box::new(|c, i| {
                one[0] = i as i64;
                c.all_reduce(&mut one, ReduceOp::Max).expect("all_reduce");
            }),
        ),
        ("step", Box::new(coordination(4))),
        (
            "header",
            Box::new(|c, i| {
                words[0] = i as i64;
                c.all_reduce(&mut words, ReduceOp::Max).expect("all_reduce");
            }),
        ),
        (
            "admission",
            Box::new(|c, i| {
                let cont = Contribution { state: State::Go, epoch: 0, step: i, message: None };
                agreement.admit(c, cont).expect("admission");
            }),
        ),
        ("large", Box::new(coordination(64))),
    ];
    let t = measure(comm, &mut variants);
    drop(variants);
    let (raw, step, header, admit, large) = (t[0], t[1], t[2], t[3], t[4]);
    if ctx.rank() == 0 {
        println!(
            "{{\"backend\":\"{}\",\"ranks\":{world},\"allreduce8_us\":{raw:.2},\"step_us\":{step:.2},\"ratio\":{:.2},\"step_64seq_us\":{large:.2},\"header_us\":{header:.2},\"admission_us\":{admit:.2}}}",
            backend.name(),
            step / raw
        );
    }
    ctx.shutdown(Duration::from_secs(30)).expect("shutdown");
}
