//! Release and materialize of one large allocation under each restore policy, against a plain
//! memcpy of the same bytes measured in the same run.
//!
//! `cargo bench -p tpctl-vmm --bench vmm -- [--json] [--bytes 256M] [--device cuda:N]` (or the
//! environment variables `TPCTL_VMM_BENCH_BYTES`, `TPCTL_VMM_BENCH_DEVICE`); the default size
//! is 1 GiB. Each number is the median of several rounds. Run it through
//! `cargo xtask bench vmm [--json]`. The references copy into and out of host memory of the
//! kind the manager's backups live in (`Manager::host_buffer`), so the ratios compare copies
//! of the same memory: with `--device cuda:N` (feature `cuda`) the allocation is device memory
//! and the references are a plain device-to-host copy (for a release) and host-to-device copy
//! (for a materialize) of the same bytes into and out of pinned memory; the GPU bundle runs it
//! so.

use mesh::Device;
use std::hint::black_box;
use std::time::{Duration, Instant};
use vmm::{Allocation, BackendKind, BackupStore, Manager, Policy, Source, Tag};

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

/// A memcpy of `bytes` into host memory of the kind `m`'s backups live in.
fn memcpy_baseline(m: &Manager, bytes: usize) -> Duration {
    let mut src = vec![0u8; bytes];
    fill(&mut src, 1);
    let mut dst = m.host_buffer(bytes).expect("host memory for the reference copy");
    dst.fill(1);
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        black_box(&mut dst);
        times.push(t.elapsed());
    }
    median(times)
}

/// Writes the bench pattern into `a`: in place on the host, by a copy on a device.
fn fill_alloc(a: &Allocation, seed: u64) {
    if a.device() == Device::Cpu {
        fill(&mut a.write().expect("write"), seed);
    } else {
        let mut host = vec![0u8; a.bytes()];
        fill(&mut host, seed);
        a.write_from(0, &host).expect("copy to the device");
    }
}

/// [`sample_sum`] of `a`'s bytes (copied out first on a device).
fn alloc_sum(a: &Allocation) -> u64 {
    if a.device() == Device::Cpu {
        sample_sum(&a.read().expect("read"))
    } else {
        let mut host = vec![0u8; a.bytes()];
        a.read_into(0, &mut host).expect("copy from the device");
        sample_sum(&host)
    }
}

/// A plain copy of `bytes` between a device allocation and pinned host memory (the kind the
/// backups live in), each way: `(device to host, host to device)`, the references of a device
/// manager's release and materialize.
fn device_copy_baseline(m: &Manager, bytes: usize) -> (Duration, Duration) {
    let a = m.allocate(Tag::WEIGHTS, bytes, Policy::Discard).expect("allocate");
    let mut host = m.host_buffer(bytes).expect("pinned host memory for the reference copies");
    fill(&mut host, 3);
    let (mut out, mut back) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let t = Instant::now();
        a.write_from(0, &host).expect("host to device");
        back.push(t.elapsed());
        let t = Instant::now();
        a.read_into(0, &mut host).expect("device to host");
        out.push(t.elapsed());
    }
    (median(out), median(back))
}

fn run_policy(
    m: &Manager,
    bytes: usize,
    policy: Policy,
    expect: Option<&[u8]>,
) -> (Duration, Duration) {
    let tag = Tag::KV_CACHE;
    let a = m.allocate(&tag, bytes, policy).expect("allocate");
    fill_alloc(&a, 7);
    let want = expect.map(sample_sum).unwrap_or_else(|| alloc_sum(&a));
    let (mut rel, mut mat) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        if round > 0 && matches!(a.policy(), Policy::Discard | Policy::Zero) {
            // Lazily mapped memory: touch it so that the release has pages to give back.
            fill_alloc(&a, 7);
        }
        let t = Instant::now();
        m.release([&tag]).expect("release");
        rel.push(t.elapsed());
        let t = Instant::now();
        m.materialize([&tag]).expect("materialize");
        mat.push(t.elapsed());
        if !matches!(a.policy(), Policy::Discard | Policy::Zero) {
            assert_eq!(alloc_sum(&a), want, "{} lost bytes", a.policy().name());
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
    let device = args.iter().position(|a| a == "--device").and_then(|i| args.get(i + 1)).cloned();
    let device = device.or_else(|| std::env::var("TPCTL_VMM_BENCH_DEVICE").ok());
    match device.as_deref().map(str::parse::<Device>) {
        None | Some(Ok(Device::Cpu)) => {}
        Some(Ok(Device::Cuda(ordinal))) => return device_main(ordinal, bytes, json),
        Some(Err(e)) => {
            eprintln!("vmm bench: --device: {e}");
            std::process::exit(2)
        }
    }

    let m = Manager::cpu().expect("cpu manager");
    let memcpy = memcpy_baseline(&m, bytes);
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
            "chunked copies into the host pool (kept across rounds); back into a fresh memfd",
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

/// The device run: release and materialize of `bytes` of CUDA device memory per restore
/// policy, against plain copies of the same bytes to and from pinned memory measured in the
/// same run. The backup that vLLM's level 1 keeps is pinned host memory (`backup-host`, the
/// host pool); its numbers are the ones the GPU path aims at (a wakeup at most 1.3 times the
/// host-to-device copy, a sleep at most 1.5 times the device-to-host one).
fn device_main(ordinal: usize, bytes: usize, json: bool) {
    let m = Manager::builder()
        .backend(BackendKind::Cuda { device: ordinal })
        .build()
        .unwrap_or_else(|e| {
            eprintln!("vmm bench: device memory on cuda:{ordinal}: {e}");
            std::process::exit(2)
        });
    let (d2h, h2d) = device_copy_baseline(&m, bytes);
    let cases: [(&str, Policy); 4] = [
        ("discard", Policy::Discard),
        ("zero", Policy::Zero),
        ("backup-host", Policy::Backup(BackupStore::Host)),
        ("backup-spill", Policy::Backup(BackupStore::Spill)),
    ];
    let gib = bytes as f64 / f64::from(1u32 << 30);
    if !json {
        println!(
            "vmm on cuda:{ordinal}: {} MiB, median of {ROUNDS} rounds; plain copies: device to host {:.1} ms ({:.2} GB/s), host to device {:.1} ms ({:.2} GB/s)",
            bytes >> 20,
            d2h.as_secs_f64() * 1e3,
            gbps(bytes, d2h),
            h2d.as_secs_f64() * 1e3,
            gbps(bytes, h2d)
        );
        println!(
            "{:<14} {:>10} {:>8} {:>10} {:>8} {:>10}",
            "policy", "release ms", "x d2h", "mater. ms", "x h2d", "s/GiB wake"
        );
    } else {
        println!(
            "{{\"bench\":\"vmm\",\"device\":\"cuda:{ordinal}\",\"policy\":\"copy\",\"bytes\":{bytes},\"d2h_s\":{:.6},\"h2d_s\":{:.6}}}",
            d2h.as_secs_f64(),
            h2d.as_secs_f64()
        );
    }
    for (name, policy) in cases {
        let (release, materialize) = run_policy(&m, bytes, policy, None);
        let (r, w) = (release.as_secs_f64(), materialize.as_secs_f64());
        if json {
            println!(
                "{{\"bench\":\"vmm\",\"device\":\"cuda:{ordinal}\",\"policy\":\"{name}\",\"bytes\":{bytes},\"release_s\":{r:.6},\"release_vs_d2h\":{:.3},\"materialize_s\":{w:.6},\"materialize_vs_h2d\":{:.3}}}",
                r / d2h.as_secs_f64(),
                w / h2d.as_secs_f64()
            );
        } else {
            println!(
                "{name:<14} {:>10.1} {:>8.2} {:>10.1} {:>8.2} {:>10.3}",
                r * 1e3,
                r / d2h.as_secs_f64(),
                w * 1e3,
                w / h2d.as_secs_f64(),
                w / gib
            );
        }
    }
}
