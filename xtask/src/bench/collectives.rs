//! Collectives benchmark (shm, tcp and mpi, 2 and 4 ranks) next to OpenMPI's `MPI_Allreduce`,
//! measured in the same run from `shared/anchors/mpi_allreduce.c`. The mpi rows need OpenMPI,
//! installed here when missing; where it cannot be, they are left out with a note.

use super::field;
use crate::util::{self, cargo, root};
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

/// One measurement row, parsed from the flat JSON the bench binary prints.
#[derive(Debug, Clone)]
struct Row {
    backend: String,
    ranks: usize,
    op: String,
    bytes: usize,
    time_us: f64,
    algbw: f64,
    busbw: f64,
}

fn parse_row(line: &str) -> Option<Row> {
    Some(Row {
        backend: field(line, "backend")?.to_owned(),
        ranks: field(line, "ranks")?.parse().ok()?,
        op: field(line, "op")?.to_owned(),
        bytes: field(line, "bytes")?.parse().ok()?,
        time_us: field(line, "time_us")?.parse().ok()?,
        algbw: field(line, "algbw_GBps")?.parse().ok()?,
        busbw: field(line, "busbw_GBps")?.parse().ok()?,
    })
}

/// Rounds of (ours, OpenMPI), interleaved; each figure is the best round's.
const ROUNDS: usize = 3;

pub(crate) fn run(json: bool) -> Result<()> {
    let mut rows: Vec<Row> = Vec::new();
    let mut mpi: BTreeMap<(usize, usize), f64> = BTreeMap::new();
    let mut mpi_error = None;
    let features: &[&str] = match crate::mpi::ensure_openmpi() {
        Ok(()) => &["--features", "mpi"],
        Err(e) => {
            eprintln!("no mpi rows: {e:#}");
            &[]
        }
    };
    for _ in 0..ROUNDS {
        let out = util::output(
            cargo()
                .args(["bench", "--quiet", "-p", "tpctl-collectives", "--bench", "collectives"])
                .args(features)
                .args(["--", "--json"]),
        )?;
        let round: Vec<Row> = out.lines().filter_map(parse_row).collect();
        anyhow::ensure!(!round.is_empty(), "the collectives benchmark printed no rows:\n{out}");
        for r in round {
            match rows.iter_mut().find(|x| {
                (x.backend.as_str(), x.ranks, x.op.as_str(), x.bytes)
                    == (r.backend.as_str(), r.ranks, r.op.as_str(), r.bytes)
            }) {
                Some(x) if r.time_us < x.time_us => *x = r,
                Some(_) => {}
                None => rows.push(r),
            }
        }
        if mpi_error.is_none() {
            match mpi_anchor() {
                Ok(m) => {
                    for (k, t) in m {
                        let best = mpi.entry(k).or_insert(t);
                        *best = best.min(t);
                    }
                }
                Err(e) => mpi_error = Some(e),
            }
        }
    }
    if let Some(e) = mpi_error {
        eprintln!("OpenMPI anchor not measured: {e:#}");
    }
    if json {
        for r in &rows {
            let reference = mpi.get(&(r.ranks, r.bytes)).filter(|_| r.op == "all_reduce");
            println!(
                "{{\"backend\":\"{}\",\"ranks\":{},\"op\":\"{}\",\"bytes\":{},\"time_us\":{:.2},\"algbw_GBps\":{:.3},\"busbw_GBps\":{:.3},\"openmpi_time_us\":{},\"speedup_vs_openmpi\":{}}}",
                r.backend,
                r.ranks,
                r.op,
                r.bytes,
                r.time_us,
                r.algbw,
                r.busbw,
                reference.map_or("null".to_owned(), |t| format!("{t:.2}")),
                reference.map_or("null".to_owned(), |t| format!("{:.2}", t / r.time_us)),
            );
        }
        return Ok(());
    }
    println!(
        "{:<7} {:>5} {:<10} {:>9} {:>11} {:>10} {:>10} {:>12} {:>9}",
        "backend",
        "ranks",
        "op",
        "bytes",
        "time_us",
        "algbw GB/s",
        "busbw GB/s",
        "OpenMPI us",
        "speedup"
    );
    for r in &rows {
        let reference = mpi.get(&(r.ranks, r.bytes)).filter(|_| r.op == "all_reduce");
        println!(
            "{:<7} {:>5} {:<10} {:>9} {:>11.2} {:>10.3} {:>10.3} {:>12} {:>9}",
            r.backend,
            r.ranks,
            r.op,
            r.bytes,
            r.time_us,
            r.algbw,
            r.busbw,
            reference.map_or("-".to_owned(), |t| format!("{t:.2}")),
            reference.map_or("-".to_owned(), |t| format!("{:.2}x", t / r.time_us)),
        );
    }
    println!(
        "speedup = OpenMPI MPI_Allreduce time / ours, same sizes, same machine, same run; \
         best of {ROUNDS} interleaved rounds each"
    );
    Ok(())
}

/// Builds and runs the OpenMPI anchor for 2 and 4 ranks: (ranks, bytes) -> time in us.
fn mpi_anchor() -> Result<BTreeMap<(usize, usize), f64>> {
    let source = root().join("../shared/anchors/mpi_allreduce.c");
    anyhow::ensure!(source.exists(), "{} is missing", source.display());
    crate::mpi::ensure_openmpi()?;
    let dir = root().join("target/anchors");
    std::fs::create_dir_all(&dir)?;
    let exe: PathBuf = dir.join("mpi_allreduce");
    util::run(Command::new("mpicc").arg("-O2").arg("-o").arg(&exe).arg(&source))?;
    let mut times = BTreeMap::new();
    for np in [2usize, 4] {
        let out = util::output(
            Command::new("mpirun")
                .args(crate::mpi::MPIRUN_ARGS)
                .args(["-np", &np.to_string()])
                .arg(&exe)
                .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
        )?;
        for line in out.lines() {
            // np=2 bytes=8 time_us=0.31 algbw_GBps=... busbw_GBps=...
            let get = |k: &str| {
                line.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_owned)
            };
            if let (Some(bytes), Some(t)) = (get("bytes="), get("time_us=")) {
                times.insert((np, bytes.parse()?), t.parse()?);
            }
        }
    }
    anyhow::ensure!(!times.is_empty(), "the OpenMPI anchor printed nothing");
    Ok(times)
}
