//! One rank of a multi-process collectives test: joins the world from the torchrun
//! environment and runs the scenario named by `TPCTL_SCENARIO` on the backend named by
//! `TPCTL_BACKEND`. Prints `ok` on success; on an expected failure prints `error: MESSAGE`
//! and exits with code 3.
#![forbid(unsafe_code)]

use collectives::{init_parallel, Collective, InitOptions, ParallelContext, ReduceOp};
use mesh::{AxisBackends, CommBackend};
use std::sync::Arc;
use std::time::Duration;

fn main() {
    let scenario = std::env::var("TPCTL_SCENARIO").unwrap_or_default();
    match run(&scenario) {
        Ok(()) => println!("ok"),
        Err(e) => {
            println!("error: {e}");
            std::process::exit(3);
        }
    }
}

fn env_ms(name: &str, default: u64) -> Duration {
    Duration::from_millis(std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default))
}

fn context(tp: Option<usize>) -> Result<ParallelContext, collectives::Error> {
    let backend: CommBackend = std::env::var("TPCTL_BACKEND")
        .unwrap_or_else(|_| "shm".into())
        .parse()
        .map_err(collectives::Error::Store)?;
    let world: usize = std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse().ok()).unwrap_or(1);
    let opts = InitOptions {
        tp: Some(tp.unwrap_or(world)),
        head_groups: world,
        backends: AxisBackends { tp: backend, cp: backend, control: backend },
        timeout: env_ms("TPCTL_TIMEOUT_MS", 20_000),
        ..InitOptions::default()
    };
    init_parallel(&opts)
}

fn value(rank: usize, i: usize) -> f32 {
    ((rank * 5 + i * 11) % 19) as f32 - 9.0
}

fn check(ok: bool, what: &str) -> Result<(), collectives::Error> {
    if ok {
        Ok(())
    } else {
        eprintln!("wrong result: {what}");
        std::process::exit(4)
    }
}

fn run(scenario: &str) -> Result<(), collectives::Error> {
    match scenario {
        "ops" => ops(),
        "mesh" => mesh_groups(),
        "repeat" => repeat(),
        "reuse" => reuse(),
        "mismatch" => {
            let mut ctx = context(None)?;
            let c = &mut ctx.tp;
            let len = if c.rank() == 1 { 7 } else { 6 };
            c.all_reduce(&mut vec![1f32; len], ReduceOp::Sum)
        }
        "store-death" => {
            let ctx = context(None)?;
            let world = ctx.world().expect("a world of several ranks").clone();
            if ctx.rank() == 0 {
                // Leave without a word: the store server dies with this process.
                std::process::exit(0);
            }
            world.store().wait(&["never-set"], env_ms("TPCTL_WAIT_MS", 60_000))?;
            Ok(())
        }
        other => {
            eprintln!("unknown scenario `{other}`");
            std::process::exit(2)
        }
    }
}

/// Every operation against its serial definition, with uneven sizes.
fn ops() -> Result<(), collectives::Error> {
    let mut ctx = context(None)?;
    let c = &mut ctx.tp;
    let (r, n) = (c.rank(), c.size());
    for len in [1usize, 1000, 300_000] {
        let mut buf: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        c.all_reduce(&mut buf, ReduceOp::Sum)?;
        check(
            buf.iter().enumerate().all(|(i, &x)| x == (0..n).map(|s| value(s, i)).sum::<f32>()),
            "all_reduce",
        )?;
    }
    let sizes: Vec<usize> = (0..n).map(|s| (s * 37_000 + 5) % 90_001).collect();
    let send: Vec<f32> = (0..sizes[r]).map(|i| value(r, i)).collect();
    let mut recv = vec![0f32; sizes.iter().sum()];
    c.all_gather_uneven(&send, &mut recv, &sizes)?;
    let want: Vec<f32> = (0..n).flat_map(|s| (0..sizes[s]).map(move |i| value(s, i))).collect();
    check(recv == want, "all_gather_uneven")?;

    let chunk = 50_000;
    let send: Vec<f32> = (0..n * chunk).map(|i| value(r, i)).collect();
    let mut out = vec![0f32; chunk];
    c.reduce_scatter(&send, &mut out, ReduceOp::Max)?;
    let want: Vec<f32> = (0..chunk)
        .map(|i| (0..n).map(|s| value(s, r * chunk + i)).fold(f32::MIN, f32::max))
        .collect();
    check(out == want, "reduce_scatter")?;

    let mut swapped = vec![0f32; n * chunk];
    c.all_to_all(&send, &mut swapped)?;
    let want: Vec<f32> =
        (0..n).flat_map(|s| (0..chunk).map(move |i| value(s, r * chunk + i))).collect();
    check(swapped == want, "all_to_all")?;

    let root = n - 1;
    let mut b: Vec<i64> = (0..10_000).map(|i| (i * (r + 1)) as i64).collect();
    c.broadcast(&mut b, root)?;
    check(b.iter().enumerate().all(|(i, &x)| x == (i * (root + 1)) as i64), "broadcast")?;

    if n > 1 {
        let to = (r + 1) % n;
        let from = (r + n - 1) % n;
        let msg: Vec<f32> = (0..100_000).map(|i| value(r, i)).collect();
        let mut got = vec![0f32; 100_000];
        if r % 2 == 0 {
            c.send(&msg, to)?;
            c.recv(&mut got, from)?;
        } else {
            c.recv(&mut got, from)?;
            c.send(&msg, to)?;
        }
        check(got.iter().enumerate().all(|(i, &x)| x == value(from, i)), "send/recv")?;
    }
    c.barrier()?;
    ctx.shutdown(Duration::from_secs(20))?;
    Ok(())
}

/// TP rows and CP columns of a tp x cp mesh each reduce over their own members.
fn mesh_groups() -> Result<(), collectives::Error> {
    let mut ctx = context(Some(2))?;
    let rank = ctx.rank();
    let (tp_rank, cp_rank) = ctx.mesh().coords(rank).map_err(collectives::Error::Store)?;
    let mut t = [rank as i64];
    ctx.tp.all_reduce(&mut t, ReduceOp::Sum)?;
    let row: i64 = ctx
        .mesh()
        .tp_group(cp_rank)
        .map_err(collectives::Error::Store)?
        .iter()
        .map(|&x| x as i64)
        .sum();
    check(t[0] == row, "tp row sum")?;
    let mut c = [rank as i64];
    ctx.cp.all_reduce(&mut c, ReduceOp::Sum)?;
    let col: i64 = ctx
        .mesh()
        .cp_group(tp_rank)
        .map_err(collectives::Error::Store)?
        .iter()
        .map(|&x| x as i64)
        .sum();
    check(c[0] == col, "cp column sum")?;
    let mut all = [1i64];
    ctx.control.all_reduce(&mut all, ReduceOp::Sum)?;
    check(all[0] == ctx.mesh().world() as i64, "control sum")?;
    ctx.shutdown(Duration::from_secs(20))?;
    Ok(())
}

/// Many small all-reduces: a peer killed (or slowed) part way through by a failpoint.
fn repeat() -> Result<(), collectives::Error> {
    let mut ctx = context(None)?;
    let n = ctx.tp.size() as f32;
    for _ in 0..50 {
        let mut x = [1f32; 16];
        ctx.tp.all_reduce(&mut x, ReduceOp::Sum)?;
        check(x[0] == n, "repeated all_reduce")?;
    }
    ctx.shutdown(Duration::from_secs(20))?;
    Ok(())
}

/// A second `init_parallel` in the same process reuses the world without owning it.
fn reuse() -> Result<(), collectives::Error> {
    let mut first = context(None)?;
    let mut second = context(None)?;
    check(first.owns_world() && !second.owns_world(), "world ownership")?;
    check(
        Arc::ptr_eq(first.world().expect("world"), second.world().expect("world")),
        "the same world",
    )?;
    let mut x = [1i64];
    second.tp.all_reduce(&mut x, ReduceOp::Sum)?;
    check(x[0] == second.tp.size() as i64, "all_reduce on the reused world")?;
    first.tp.all_reduce(&mut x, ReduceOp::Max)?;
    second.shutdown(Duration::from_secs(20))?;
    first.shutdown(Duration::from_secs(20))?;
    Ok(())
}
