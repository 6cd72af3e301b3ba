//! Release and materialize of one large allocation under each restore policy, against a plain
//! memcpy of the same bytes measured in the same run.
//!
//! `cargo bench -p tpctl-vmm --bench vmm -- [--json] [--bytes 256M]` (or the environment
//! variable `TPCTL_VMM_BENCH_BYTES`); the default size is 1 GiB. Each number is the median of
//! several rounds. Run it through `cargo xtask bench vmm [--json]`.

use std::hint::black_box;
use std::time::{Duration, Instant};
use vmm::{BackupStore, Manager, Policy, Source, Tag};

const ROUNDS: usize = 5;

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult).filter(|&n| n > 0)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Fills `buf` with bytes that are not all the same, quickly.
fn fill(buf: &mut [u8], seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = (i as u64 ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// A cheap checksum that reads every page.
fn sample_sum(buf: &[u8]) -> u64 {
    buf.iter().step_by(4096).chain(buf.last()).map(|&b| u64::from(b)).sum()
}

struct Row {
    policy: &'static str,
    release: Duration,
    materialize: Duration,
    note: &'static str,
}

fn memcpy_baseline(bytes: usize) -> Duration {
    let mut src = vec![0u8; bytes];
    fill(&mut src, 1);
    let mut dst = vec![1u8; bytes];
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        black_box(&mut dst);
        times.push(t.elapsed());
    }
    median(times)
}

fn run_policy(
    m: &Manager,
    bytes: usize,
    policy: Policy,
    expect: Option<&[u8]>,
) -> (Duration, Duration) {
    let tag = Tag::KV_CACHE;
    let a = m.allocate(&tag, bytes, policy).expect("allocate");
    fill(&mut a.write().expect("write"), 7);
    let want = expect.map(sample_sum).unwrap_or_else(|| sample_sum(&a.read().expect("read")));
    let (mut rel, mut mat) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        if round > 0 && matches!(a.policy(), Policy::Discard | Policy::Zero) {
            // Lazily mapped memory: touch it so that the release has pages to give back.
            fill(&mut a.write().expect("write"), 7);
        }
        let t = Instant::now();
        m.release([&tag]).expect("release");
        rel.push(t.elapsed());
        let t = Instant::now();
        m.materialize([&tag]).expect("materialize");
        mat.push(t.elapsed());
        if !matches!(a.policy(), Policy::Discard | Policy::Zero) {
            assert_eq!(
                sample_sum(&a.read().expect("read")),
                want,
                "{} lost bytes",
                a.policy().name()
            );
        }
    }
    (median(rel), median(mat))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let from_arg = args.iter().position(|a| a == "--bytes").and_then(|i| args.get(i + 1)).cloned();
    let size = from_arg.or_else(|| std::env::var("TPCTL_VMM_BENCH_BYTES").ok());
    let bytes = match size {
        Some(s) => parse_size(&s).unwrap_or_else(|| {
            eprintln!("vmm bench: cannot read the size `{s}` (use for example 256M or 1G)");
            std::process::exit(2)
        }),
        None => 1 << 30,
    };

    let memcpy = memcpy_baseline(bytes);
    let m = Manager::cpu().expect("cpu manager");
    let kept = Manager::builder().keep_host_backups(true).build().expect("cpu manager");
    let source_path = m.spill_dir().join(format!("bench-reload-{}.bin", std::process::id()));
    std::fs::create_dir_all(m.spill_dir()).expect("spill dir");
    let mut model = vec![0u8; bytes];
    fill(&mut model, 7);
    std::fs::write(&source_path, &model).expect("reload source file");
    let source = Source::file(&source_path, 0).expect("reload source");

    let mut rows = Vec::new();
    type Case<'a> = (&'static str, &'a Manager, Policy, Option<&'a [u8]>, &'static str);
    let cases: Vec<Case<'_>> = vec![
        (
            "discard",
            &m,
            Policy::Discard,
            None,
            "materialize maps lazily: pages fault in on first touch",
        ),
        ("zero", &m, Policy::Zero, None, "fresh memfd pages are zero; mapped lazily"),
        (
            "backup-host",
            &m,
            Policy::Backup(BackupStore::Host),
            None,
            "copy into a fresh buffer; pwrite into a fresh memfd",
        ),
        (
            "backup-host-kept",
            &kept,
            Policy::Backup(BackupStore::Host),
            None,
            "keep_host_backups: buffer reused",
        ),
        (
            "backup-spill",
            &m,
            Policy::Backup(BackupStore::Spill),
            None,
            "one write to an unnamed file; kernel copy back",
        ),
        (
            "reload",
            &m,
            Policy::Reload(source),
            Some(&model),
            "kernel copy from the (page-cached) file",
        ),
    ];
    for (name, manager, policy, expect, note) in cases {
        let (release, materialize) = run_policy(manager, bytes, policy, expect);
        rows.push(Row { policy: name, release, materialize, note });
    }
    let _ = std::fs::remove_file(&source_path);

    let gib = bytes as f64 / f64::from(1u32 << 30);
    if json {
        println!(
            "{{\"bench\":\"vmm\",\"policy\":\"memcpy\",\"bytes\":{bytes},\"seconds\":{:.6},\"gbps\":{:.3}}}",
            memcpy.as_secs_f64(),
            gbps(bytes, memcpy)
        );
        for r in &rows {
            println!(
                "{{\"bench\":\"vmm\",\"policy\":\"{}\",\"bytes\":{bytes},\"release_s\":{:.6},\"release_gbps\":{:.3},\"release_vs_memcpy\":{:.3},\"release_ms_per_gib\":{:.3},\"materialize_s\":{:.6},\"materialize_gbps\":{:.3},\"materialize_vs_memcpy\":{:.3}}}",
                r.policy,
                r.release.as_secs_f64(),
                gbps(bytes, r.release),
                r.release.as_secs_f64() / memcpy.as_secs_f64(),
                r.release.as_secs_f64() * 1e3 / gib,
                r.materialize.as_secs_f64(),
                gbps(bytes, r.materialize),
                r.materialize.as_secs_f64() / memcpy.as_secs_f64(),
            );
        }
        return;
    }
    println!(
        "vmm: {} MiB, median of {ROUNDS} rounds; memcpy {:.1} ms ({:.2} GB/s)",
        bytes >> 20,
        memcpy.as_secs_f64() * 1e3,
        gbps(bytes, memcpy)
    );
    println!(
        "{:<16} {:>10} {:>7} {:>8} {:>10} {:>7} {:>8}  note",
        "policy", "release ms", "GB/s", "x memcpy", "mater. ms", "GB/s", "x memcpy"
    );
    for r in &rows {
        println!(
            "{:<16} {:>10.1} {:>7.2} {:>8.2} {:>10.1} {:>7.2} {:>8.2}  {}",
            r.policy,
            r.release.as_secs_f64() * 1e3,
            gbps(bytes, r.release),
            r.release.as_secs_f64() / memcpy.as_secs_f64(),
            r.materialize.as_secs_f64() * 1e3,
            gbps(bytes, r.materialize),
            r.materialize.as_secs_f64() / memcpy.as_secs_f64(),
            r.note
        );
    }
    let discard = rows.iter().find(|r| r.policy == "discard").map(|r| r.release);
    if let Some(d) = discard {
        println!(
            "release with discard: {:.1} ms per GiB (target < 50)",
            d.as_secs_f64() * 1e3 / gib
        );
    }
}
