//! Tests of the manager on the CPU backend: policies, receipts, failures, concurrency.

use super::*;
use crate::policy::Source;
use crate::probe::ProcessMemory;
use proptest::prelude::*;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const MIB: usize = 1 << 20;

/// FNV-1a over the bytes.
fn hash(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Deterministic non-trivial bytes.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A directory for one test, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

fn scratch_dir(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("tpctl-vmm-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Scratch(dir)
}

/// A manager whose spill directory is removed with it. Spill files have no names, so removing
/// the directory while allocations still hold them is fine.
struct TestManager {
    manager: Manager,
    _dir: Scratch,
}

impl std::ops::Deref for TestManager {
    type Target = Manager;

    fn deref(&self) -> &Manager {
        &self.manager
    }
}

fn manager(name: &str) -> TestManager {
    let dir = scratch_dir(name);
    TestManager { manager: Manager::builder().spill_dir(&*dir).build().unwrap(), _dir: dir }
}

const CHILD_ENV: &str = "TPCTL_VMM_TEST_CHILD";

/// Whether this process is the child started by [`run_child`] for `test`.
fn is_child(test: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == test)
}

/// Runs the single test `test` (its path below the crate root) in a fresh process with `env`
/// and fails when it fails. A deadline bounds the wait.
fn run_child(test: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"]).env(CHILD_ENV, test);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut child = out;
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("child test {test} ran past its 120 s deadline");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child test {test} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Manager>();
    check::<Allocation>();
    check::<Error>();
}

#[test]
fn address_is_stable_over_100_cycles() {
    let m = manager("stable");
    let a = m.allocate(Tag::KV_CACHE, 3 * 4096 + 5, Policy::Backup(BackupStore::Host)).unwrap();
    let w = m.allocate(Tag::WEIGHTS, 10_000, Policy::Zero).unwrap();
    let (base_a, base_w) = (a.base(), w.base());
    assert_eq!(a.mapped_bytes() % m.granularity(), 0);
    for i in 0..100u64 {
        let data = pattern(i, a.bytes());
        a.write().unwrap().copy_from_slice(&data);
        w.write().unwrap()[0] = 1;
        let r = m.release([Tag::KV_CACHE, Tag::WEIGHTS]).unwrap();
        assert_eq!((r[0].allocations, r[1].allocations), (1, 1), "cycle {i}");
        assert!(a.is_released() && w.is_released());
        let r = m.materialize(["weights", "kv_cache"]).unwrap();
        assert_eq!(r[0].tag, Tag::WEIGHTS);
        assert_eq!((r[0].allocations, r[1].allocations), (1, 1), "cycle {i}");
        assert_eq!((a.base(), w.base()), (base_a, base_w), "cycle {i}");
        assert_eq!(hash(&a.read().unwrap()), hash(&data), "cycle {i}");
        assert_eq!(w.read().unwrap()[0], 0, "cycle {i}");
    }
}

/// A backup dropped while released is not restored: the next materialize follows the
/// policy (zeros for `Backup` with no backup); a materialized allocation has none to drop.
#[test]
fn a_discarded_backup_is_not_restored() {
    let m = manager("discard-backup");
    for store in [BackupStore::Host, BackupStore::Spill] {
        let a = m.allocate("discard", 2 * 4096, Policy::Backup(store)).unwrap();
        a.write().unwrap().fill(7);
        assert!(!a.discard_backup(), "{store:?}: nothing to drop while materialized");
        m.release(["discard"]).unwrap();
        assert!(a.discard_backup(), "{store:?}");
        assert!(!a.discard_backup(), "{store:?}: dropped once");
        m.materialize(["discard"]).unwrap();
        assert!(a.read().unwrap().iter().all(|&b| b == 0), "{store:?}: the backup came back");
        drop(a);
    }
    assert_eq!(m.spilled_bytes(), 0, "the spill file's bytes are given back");
}

#[test]
fn backup_to_host_and_spill_restores_identical_bytes() {
    let m = manager("backup");
    let host = m.allocate("host-tag", 5 * MIB + 123, Policy::Backup(BackupStore::Host)).unwrap();
    let spill = m.allocate("spill-tag", 7 * MIB + 1, Policy::Backup(BackupStore::Spill)).unwrap();
    let default = m.allocate("spill-tag", 4096, Policy::Backup(BackupStore::Default)).unwrap();
    let want: Vec<u64> = [&host, &spill, &default]
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let data = pattern(i as u64 + 10, a.bytes());
            a.write().unwrap().copy_from_slice(&data);
            hash(&data)
        })
        .collect();
    let r = m.release(["host-tag", "spill-tag"]).unwrap();
    assert_eq!(r[0].copied_bytes, host.mapped_bytes() as u64);
    assert_eq!(r[1].copied_bytes, (spill.mapped_bytes() + default.mapped_bytes()) as u64);
    assert_eq!(r[1].bytes, r[1].copied_bytes);
    // The CPU default store is the spill file.
    assert_eq!(m.spilled_bytes(), r[1].copied_bytes);
    let r = m.materialize(["spill-tag", "host-tag"]).unwrap();
    assert_eq!(r[0].copied_bytes, (spill.mapped_bytes() + default.mapped_bytes()) as u64);
    assert_eq!(m.spilled_bytes(), 0);
    let got: Vec<u64> =
        [&host, &spill, &default].iter().map(|a| hash(&a.read().unwrap())).collect();
    assert_eq!(got, want);
}

#[test]
fn host_backups_reuse_the_pool_and_still_restore_the_bytes() {
    let m = manager("pool");
    let a = m.allocate(Tag::KV_CACHE, 3 * MIB, Policy::Backup(BackupStore::Host)).unwrap();
    for i in 0..5 {
        let data = pattern(i, a.bytes());
        a.write().unwrap().copy_from_slice(&data);
        m.release([Tag::KV_CACHE]).unwrap();
        assert_eq!(m.host_pool_lent_bytes(), a.mapped_bytes() as u64, "cycle {i}");
        m.materialize([Tag::KV_CACHE]).unwrap();
        assert_eq!(hash(&a.read().unwrap()), hash(&data), "cycle {i}");
        // Kept for the next release, not freed.
        assert_eq!(m.host_pool_bytes(), a.mapped_bytes() as u64, "cycle {i}");
        assert_eq!(m.host_pool_lent_bytes(), 0, "cycle {i}");
    }
    assert_eq!(m.free_host_pool(), a.mapped_bytes() as u64);
    assert_eq!(m.host_pool_bytes(), 0);
}

#[test]
fn reload_refills_from_a_file_or_a_function() {
    let dir = scratch_dir("reload");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.bin");
    let file_bytes = pattern(99, 3 * MIB);
    std::fs::write(&path, &file_bytes).unwrap();
    let m = manager("reload-m");
    let offset = 4096 + 17;
    let len = 2 * MIB + 3;
    let from_file = m
        .allocate(Tag::WEIGHTS, len, Policy::Reload(Source::file(&path, offset as u64).unwrap()))
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let from_fn = m
        .allocate(
            Tag::WEIGHTS,
            1000,
            Policy::Reload(Source::from_fn(move |dst| {
                counter.fetch_add(1, Ordering::SeqCst);
                dst.fill(0xab);
                Ok(())
            })),
        )
        .unwrap();
    // Allocations start zeroed: the source is used only on materialize.
    assert!(from_file.read().unwrap().iter().all(|&b| b == 0));
    from_fn.write().unwrap().fill(1);
    for _ in 0..3 {
        let r = m.release([Tag::WEIGHTS]).unwrap();
        assert_eq!(r[0].copied_bytes, 0, "reload backs nothing up");
        let r = m.materialize([Tag::WEIGHTS]).unwrap();
        assert_eq!(r[0].copied_bytes, (len + 1000) as u64);
        assert_eq!(hash(&from_file.read().unwrap()), hash(&file_bytes[offset..offset + len]));
        assert!(from_fn.read().unwrap().iter().all(|&b| b == 0xab));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[test]
fn reload_file_must_cover_the_allocation() {
    let dir = scratch_dir("short");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("short.bin");
    std::fs::write(&path, [1u8; 100]).unwrap();
    let m = manager("short-m");
    let err =
        m.allocate(Tag::WEIGHTS, 100, Policy::Reload(Source::file(&path, 1).unwrap())).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::BadSource { .. })
            && msg.contains("100 bytes")
            && msg.contains("short.bin"),
        "{msg}"
    );
    let err = Source::file(dir.join("missing.bin"), 0).unwrap_err().to_string();
    assert!(err.contains("missing.bin"), "{err}");
}

#[test]
fn zero_gives_zeros_and_discard_is_usable() {
    let m = manager("zero");
    let z = m.allocate(Tag::ACTIVATIONS, 3 * MIB, Policy::Zero).unwrap();
    let d = m.allocate(Tag::ACTIVATIONS, MIB, Policy::Discard).unwrap();
    z.write().unwrap().fill(0x5a);
    d.write().unwrap().fill(0x5a);
    m.release([Tag::ACTIVATIONS]).unwrap();
    m.materialize([Tag::ACTIVATIONS]).unwrap();
    assert!(z.read().unwrap().iter().all(|&b| b == 0));
    d.write().unwrap().fill(3);
    assert!(d.read().unwrap().iter().all(|&b| b == 3));
}

#[test]
fn repeated_release_or_materialize_is_a_noop_with_zero_receipts() {
    let m = manager("noop");
    let a = m.allocate(Tag::KV_CACHE, 4096, Policy::Backup(BackupStore::Spill)).unwrap();
    let r = m.materialize([Tag::KV_CACHE]).unwrap();
    assert!(r[0].is_noop() && r[0] == Receipt::zero(Tag::KV_CACHE, Op::Materialize));
    m.release([Tag::KV_CACHE]).unwrap();
    let spilled = m.spilled_bytes();
    let r = m.release([Tag::KV_CACHE, Tag::KV_CACHE]).unwrap();
    assert_eq!(
        r,
        vec![Receipt::zero(Tag::KV_CACHE, Op::Release)],
        "duplicates collapse, nothing done"
    );
    assert_eq!(m.spilled_bytes(), spilled);
    // A known tag without allocations is a no-op too.
    let r = m.release([Tag::WEIGHTS]).unwrap();
    assert!(r[0].is_noop());
    m.define_tag("lora").unwrap();
    assert!(m.materialize(["lora"]).unwrap()[0].is_noop());
    drop(a);
}

#[test]
fn unknown_or_invalid_tags_fail_before_anything_changes() {
    let m = manager("unknown");
    let a = m.allocate(Tag::KV_CACHE, 4096, Policy::Zero).unwrap();
    let err = m.release(["kv_cache", "kv-cache"]).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::UnknownTag { .. })
            && msg.contains("`kv-cache`")
            && msg.contains("kv_cache"),
        "{msg}"
    );
    assert!(!a.is_released());
    let err = m.materialize(["bad tag"]).unwrap_err();
    assert!(matches!(err, Error::InvalidTag { .. }), "{err}");
    m.release(["kv_cache"]).unwrap();
    let err = m.materialize(["kv_cache", "nope"]).unwrap_err();
    assert!(matches!(err, Error::UnknownTag { .. }), "{err}");
    assert!(a.is_released());
    assert!(m.known_tags().contains(&Tag::WEIGHTS));
}

#[test]
fn zero_sized_and_huge_allocations_are_rejected_clearly() {
    let m = manager("sizes");
    let err = m.allocate(Tag::WEIGHTS, 0, Policy::Zero).unwrap_err();
    assert!(matches!(err, Error::ZeroSize { .. }) && err.to_string().contains("0 bytes"), "{err}");
    for bytes in [usize::MAX, 1 << 50] {
        let err = m.allocate(Tag::WEIGHTS, bytes, Policy::Zero).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::TooLarge { .. }) && msg.contains(&bytes.to_string()), "{msg}");
    }
    let capped = Manager::builder().max_allocation(MIB as u64).build().unwrap();
    let err = capped.allocate(Tag::WEIGHTS, MIB + 1, Policy::Zero).unwrap_err().to_string();
    assert!(err.contains("max_allocation"), "{err}");
    assert!(m.allocations().is_empty() && capped.allocations().is_empty());
}

#[test]
fn released_memory_cannot_be_touched_through_the_safe_api() {
    let m = manager("access");
    let a = m.allocate(Tag::KV_CACHE, 100, Policy::Discard).unwrap();
    m.release([Tag::KV_CACHE]).unwrap();
    let err = a.read().unwrap_err();
    assert!(
        matches!(err, Error::Released { .. }) && err.to_string().contains("materialize"),
        "{err}"
    );
    assert!(matches!(a.write().unwrap_err(), Error::Released { .. }));
    assert!(matches!(a.read_into(0, &mut [0; 4]).unwrap_err(), Error::Released { .. }));
    m.materialize([Tag::KV_CACHE]).unwrap();
    a.write_from(96, &[1, 2, 3, 4]).unwrap();
    let mut out = [0; 4];
    a.read_into(96, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3, 4]);
    let err = a.write_from(97, &[0; 4]).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
}

#[test]
fn a_borrowed_allocation_blocks_release_before_any_change() {
    let m = manager("busy");
    let a = m.allocate(Tag::KV_CACHE, 4096, Policy::Backup(BackupStore::Spill)).unwrap();
    let b = m.allocate(Tag::KV_CACHE, 4096, Policy::Backup(BackupStore::Spill)).unwrap();
    let guard = b.read().unwrap();
    let err = m.release([Tag::KV_CACHE]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::ReleaseAborted { .. }) && msg.contains("borrowed"), "{msg}");
    assert!(!a.is_released());
    assert_eq!(m.spilled_bytes(), 0);
    // Copies through the manager do not wait for the guard either.
    assert!(matches!(b.read_into(0, &mut [0; 1]).unwrap_err(), Error::Busy { .. }));
    drop(guard);
    m.release([Tag::KV_CACHE]).unwrap();
    assert!(a.is_released() && b.is_released());
}

/// Two allocations under one tag with a backup that fails for the second: nothing released.
fn assert_backup_failure_releases_nothing(m: &Manager, needle: &str, before_release: fn()) {
    let first = m.allocate("t", 64 * 1024, Policy::Backup(BackupStore::Host)).unwrap();
    let second = m.allocate("t", 64 * 1024, Policy::Backup(BackupStore::Spill)).unwrap();
    let other = m.allocate("u", 4096, Policy::Discard).unwrap();
    first.write().unwrap().fill(1);
    second.write().unwrap().fill(2);
    before_release();
    let err = m.release(["t", "u"]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::ReleaseAborted { .. }), "{msg}");
    assert!(msg.contains(needle) && msg.contains(&format!("allocation {}", second.id())), "{msg}");
    for a in [&first, &second, &other] {
        assert!(!a.is_released(), "{msg}");
    }
    assert!(first.read().unwrap().iter().all(|&b| b == 1));
    assert!(second.read().unwrap().iter().all(|&b| b == 2));
    assert_eq!(m.spilled_bytes(), 0);
}

#[test]
fn an_unwritable_spill_directory_fails_the_backup_and_loses_nothing() {
    // Root ignores permission bits, so use a directory below a regular file.
    let dir = scratch_dir("unwritable");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let m = Manager::builder().spill_dir(file.join("spill")).build().unwrap();
    assert_backup_failure_releases_nothing(&m, "not-a-dir", || ());
}

#[test]
fn a_full_spill_store_fails_the_backup_and_loses_nothing() {
    let dir = scratch_dir("cap");
    let m = Manager::builder().spill_dir(&*dir).spill_limit(32 * 1024).build().unwrap();
    assert_backup_failure_releases_nothing(&m, "is full", || ());
}

/// Caps the size of files this process writes at 16 KiB, once the allocations exist.
fn limit_file_size() {
    let limit = libc::rlimit { rlim_cur: 16 * 1024, rlim_max: 16 * 1024 };
    // SAFETY: plain system calls on this (child test) process's own limit and signal
    // disposition; no memory is shared with them.
    unsafe {
        libc::setrlimit(libc::RLIMIT_FSIZE, &limit);
        // Without this the kernel kills the process at the limit instead of failing the write.
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

#[test]
fn a_spill_file_that_hits_the_file_size_limit_loses_nothing() {
    if is_child("manager::tests::a_spill_file_that_hits_the_file_size_limit_loses_nothing") {
        let m = manager("fsize");
        assert_backup_failure_releases_nothing(&m, "File too large", limit_file_size);
        return;
    }
    run_child("manager::tests::a_spill_file_that_hits_the_file_size_limit_loses_nothing", &[]);
}

#[test]
fn a_failed_materialize_rolls_back_what_it_mapped() {
    let m = manager("rollback");
    let fail = Arc::new(AtomicBool::new(true));
    let flag = Arc::clone(&fail);
    let a = m.allocate(Tag::KV_CACHE, 8192, Policy::Backup(BackupStore::Spill)).unwrap();
    let b = m.allocate(Tag::KV_CACHE, 8192, Policy::Backup(BackupStore::Host)).unwrap();
    let c = m
        .allocate(
            Tag::KV_CACHE,
            100,
            Policy::Reload(Source::from_fn(move |dst| {
                if flag.load(Ordering::SeqCst) {
                    return Err(std::io::Error::other("source went away"));
                }
                dst.fill(9);
                Ok(())
            })),
        )
        .unwrap();
    a.write().unwrap().fill(1);
    b.write().unwrap().fill(2);
    let base = (a.base(), b.base(), c.base());
    m.release([Tag::KV_CACHE]).unwrap();
    let err = m.materialize([Tag::KV_CACHE]).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, Error::MaterializeRolledBack { rolled_back: 2, .. })
            && msg.contains("source went away")
            && msg.contains(&format!("allocation {}", c.id())),
        "{msg}"
    );
    assert!(a.is_released() && b.is_released() && c.is_released());
    assert_eq!(m.spilled_bytes(), 8192, "the backups survive the rollback");
    fail.store(false, Ordering::SeqCst);
    let r = m.materialize([Tag::KV_CACHE]).unwrap();
    assert_eq!(r[0].allocations, 3);
    assert_eq!((a.base(), b.base(), c.base()), base);
    assert!(a.read().unwrap().iter().all(|&x| x == 1));
    assert!(b.read().unwrap().iter().all(|&x| x == 2));
    assert!(c.read().unwrap().iter().all(|&x| x == 9));
}

#[test]
fn dropping_frees_the_allocation_and_its_backup() {
    let m = manager("drop");
    let a = m.allocate("t", MIB, Policy::Backup(BackupStore::Spill)).unwrap();
    let _keep = m.allocate("t", 4096, Policy::Zero).unwrap();
    m.release(["t"]).unwrap();
    assert_eq!(m.spilled_bytes(), MIB as u64);
    drop(a);
    assert_eq!(m.spilled_bytes(), 0);
    assert_eq!(m.allocations().len(), 1);
    // The tag stays known after its allocations are gone.
    assert!(m.release(["t"]).unwrap()[0].is_noop());
}

/// Resident anonymous memory of this process (where the CPU backend's allocations are), in
/// bytes.
fn anonymous_now() -> u64 {
    ProcessMemory::current().unwrap().anonymous
}

/// A new allocation is zero pages the kernel allocates as they are written; `commit` makes
/// all of it resident at once (on several threads), keeps its contents, and refuses a
/// released allocation by name.
#[test]
fn commit_makes_an_allocation_resident_and_keeps_its_contents() {
    // RSS of a test process is noisy when tests run in parallel: measure in a child.
    const NAME: &str = "manager::tests::commit_makes_an_allocation_resident_and_keeps_its_contents";
    if !is_child(NAME) {
        return run_child(NAME, &[]);
    }
    let m = manager("commit");
    let size = 64 * MIB + 4096;
    let kv = m.allocate(Tag::KV_CACHE, size, Policy::Discard).unwrap();
    kv.write().unwrap()[..4096].copy_from_slice(&pattern(3, 4096));
    let before = anonymous_now();
    assert!(before < (size / 2) as u64, "a new allocation is not resident yet: {before}");
    kv.commit(3).unwrap();
    let after = anonymous_now();
    // The first write may have faulted in a whole 2 MiB huge page already.
    assert!(after >= before + size as u64 - 3 * MIB as u64, "{before} -> {after}");
    let bytes = kv.read().unwrap();
    assert_eq!(&bytes[..4096], &pattern(3, 4096)[..]);
    assert!(bytes[4096..].iter().all(|&b| b == 0));
    drop(bytes);
    // Committing what is committed changes nothing.
    kv.commit(1).unwrap();
    m.release([Tag::KV_CACHE]).unwrap();
    let err = kv.commit(2).unwrap_err();
    assert!(err.to_string().contains("is released"), "{err}");
}

#[test]
fn resident_memory_drops_on_release_and_returns_on_materialize() {
    // RSS of a test process is noisy when tests run in parallel: measure in a child.
    const NAME: &str =
        "manager::tests::resident_memory_drops_on_release_and_returns_on_materialize";
    if !is_child(NAME) {
        return run_child(NAME, &[]);
    }
    let m = manager("rss");
    let size = 256 * MIB;
    let spill = m.allocate(Tag::KV_CACHE, size, Policy::Backup(BackupStore::Spill)).unwrap();
    let data = pattern(5, size);
    let want = hash(&data);
    spill.write().unwrap().copy_from_slice(&data);
    drop(data);
    let discard = m.allocate(Tag::ACTIVATIONS, size, Policy::Discard).unwrap();
    discard.write().unwrap().fill(1);

    for (tag, alloc) in [(Tag::KV_CACHE, &spill), (Tag::ACTIVATIONS, &discard)] {
        let before = ProcessMemory::current().unwrap();
        let r = m.release([&tag]).unwrap();
        let after = ProcessMemory::current().unwrap();
        let dropped = before.resident.saturating_sub(after.resident);
        assert!(
            dropped as f64 >= 0.9 * r[0].bytes as f64,
            "{tag}: rss {before:?} -> {after:?}, released {}",
            r[0].bytes
        );
        let anonymous_dropped = before.anonymous.saturating_sub(after.anonymous);
        assert!(anonymous_dropped >= (0.9 * size as f64) as u64, "{tag}: {before:?} -> {after:?}");
        m.materialize([&tag]).unwrap();
        if tag == Tag::ACTIVATIONS {
            // Discard maps lazily: the memory comes back when it is touched.
            alloc.write().unwrap().fill(2);
        }
        let back = ProcessMemory::current().unwrap();
        assert!(
            back.resident >= after.resident + (0.9 * size as f64) as u64,
            "{tag}: {after:?} -> {back:?}"
        );
    }
    assert_eq!(hash(&spill.read().unwrap()), want);
    assert!(anonymous_now() >= 2 * size as u64);
}

#[test]
fn concurrent_releases_and_materializes_never_interleave() {
    let m = manager("threads");
    let tags = [Tag::WEIGHTS, Tag::KV_CACHE, Tag::ACTIVATIONS];
    let allocs: Vec<Allocation> = (0..9)
        .map(|i| {
            let a = m.allocate(&tags[i % 3], 8192 + i, Policy::Backup(BackupStore::Host)).unwrap();
            a.write().unwrap().fill(i as u8);
            a
        })
        .collect();
    let per_tag = 3;
    let worker = |mine: [Tag; 2]| {
        let m = m.clone();
        move || {
            for _ in 0..200 {
                for r in m.release(&mine).unwrap().iter().chain(&m.materialize(&mine).unwrap()) {
                    // A tag is handled whole by one call: a partial count would mean another
                    // call ran in the middle of this one.
                    assert!(r.allocations == 0 || r.allocations == per_tag, "{r:?}");
                }
                // Every call leaves each tag uniform (all released or all materialized).
                let snapshot = m.allocations();
                for tag in &mine {
                    let states: BTreeSet<bool> =
                        snapshot.iter().filter(|a| &a.tag == tag).map(|a| a.released).collect();
                    assert_eq!(states.len(), 1, "{tag} is mixed: {snapshot:?}");
                }
            }
        }
    };
    std::thread::scope(|s| {
        let one = s.spawn(worker([Tag::WEIGHTS, Tag::KV_CACHE]));
        let two = s.spawn(worker([Tag::KV_CACHE, Tag::ACTIVATIONS]));
        one.join().unwrap();
        two.join().unwrap();
    });
    for (i, a) in allocs.iter().enumerate() {
        assert!(a.read().unwrap().iter().all(|&b| b == i as u8), "allocation {i}");
    }
}

#[test]
fn cuda_backend_is_unavailable_or_works_and_never_panics() {
    let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let built = Manager::builder().backend(BackendKind::Cuda { device: 0 }).build();
    let m = match built {
        Ok(m) => m,
        Err(e) => {
            if cfg!(feature = "cuda") {
                assert!(matches!(e, Error::BackendUnavailable { backend: "cuda", .. }), "{e}");
            } else {
                assert!(matches!(e, Error::NotCompiledWith { feature: "cuda" }), "{e}");
            }
            assert!(!require, "TPCTL_REQUIRE_GPU=1 but the CUDA backend is unusable: {e}");
            eprintln!("skipping the CUDA round trip: {e}");
            return;
        }
    };
    // A usable GPU: the same round trip as on CPU, checked through device copies.
    let a = m.allocate(Tag::KV_CACHE, 3 * MIB + 1, Policy::Backup(BackupStore::Host)).unwrap();
    let s = m.allocate(Tag::KV_CACHE, MIB, Policy::Backup(BackupStore::Spill)).unwrap();
    let z = m.allocate(Tag::KV_CACHE, MIB, Policy::Zero).unwrap();
    assert!(matches!(a.read().unwrap_err(), Error::NotHostAccessible { .. }));
    let (da, ds) = (pattern(1, a.bytes()), pattern(2, s.bytes()));
    a.write_from(0, &da).unwrap();
    s.write_from(0, &ds).unwrap();
    z.write_from(0, &ds).unwrap();
    let bases = (a.base(), s.base(), z.base());
    for _ in 0..3 {
        m.release([Tag::KV_CACHE]).unwrap();
        m.materialize([Tag::KV_CACHE]).unwrap();
    }
    assert_eq!(bases, (a.base(), s.base(), z.base()));
    let mut got = vec![0; a.bytes()];
    a.read_into(0, &mut got).unwrap();
    assert_eq!(hash(&got), hash(&da));
    let mut got = vec![1; s.bytes()];
    s.read_into(0, &mut got).unwrap();
    assert_eq!(hash(&got), hash(&ds));
    z.read_into(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0));
}

/// On a GPU: releasing a tag gives its physical memory back to the device, as NVML sees it for
/// this process (at least 95% of the tagged bytes), and materializing takes it again.
#[test]
fn cuda_release_returns_device_memory_as_nvml_sees_it() {
    let require = std::env::var("TPCTL_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let (m, nvml) = match (
        Manager::builder().backend(BackendKind::Cuda { device: 0 }).build(),
        crate::NvmlMemory::new(),
    ) {
        (Ok(m), Ok(nvml)) => (m, nvml),
        (m, nvml) => {
            let why = format!("{:?} / {:?}", m.err(), nvml.err());
            assert!(!require, "TPCTL_REQUIRE_GPU=1 but CUDA or NVML is unusable: {why}");
            eprintln!("skipping: {why}");
            return;
        }
    };
    const BYTES: usize = 512 * MIB;
    let pid = std::process::id();
    // This process's bytes, or the device's used bytes where NVML does not list it.
    let used = || {
        let usage = nvml.device(0).unwrap();
        usage.bytes_of(pid).unwrap_or(usage.used)
    };
    let a = m.allocate(Tag::WEIGHTS, BYTES, Policy::Discard).unwrap();
    let held = used();
    m.release([Tag::WEIGHTS]).unwrap();
    let released = used();
    assert!(
        held.saturating_sub(released) >= (BYTES as u64) * 95 / 100,
        "device bytes of this process {held} -> {released} after releasing {BYTES}"
    );
    m.materialize([Tag::WEIGHTS]).unwrap();
    assert!(used() >= released + (BYTES as u64) * 95 / 100, "materialize takes it again");
    drop(a);
}

#[cfg(feature = "failpoints")]
mod failpoints {
    use super::*;

    #[test]
    fn a_release_that_fails_part_way_names_the_failed_allocations() {
        const NAME: &str = "manager::tests::failpoints::a_release_that_fails_part_way_names_the_failed_allocations";
        if !is_child(NAME) {
            // Every unmap after the first fails (a failpoint fires on each hit past its skip).
            return run_child(NAME, &[("TPCTL_FAILPOINTS", "vmm.unmap=error#1")]);
        }
        let m = manager("fp-release");
        let allocs: Vec<Allocation> = (0..3)
            .map(|i| {
                let a =
                    m.allocate(Tag::KV_CACHE, 4096, Policy::Backup(BackupStore::Spill)).unwrap();
                a.write().unwrap().fill(i + 1);
                a
            })
            .collect();
        let other = m.allocate(Tag::WEIGHTS, 4096, Policy::Zero).unwrap();
        let Err(err) = m.release([Tag::KV_CACHE]) else { panic!("expected a partial release") };
        let msg = err.to_string();
        let Error::ReleasePartial { failures, receipts } = err else { panic!("{msg}") };
        let failed: Vec<u64> = failures.iter().map(|f| f.id).collect();
        assert_eq!(failed, [allocs[1].id(), allocs[2].id()], "{msg}");
        assert!(
            msg.contains("vmm.unmap") && msg.contains(&format!("allocation {}", allocs[2].id())),
            "{msg}"
        );
        assert_eq!(
            (receipts[0].allocations, receipts[0].bytes, receipts[0].copied_bytes),
            (1, 4096, 4096)
        );
        assert!(allocs[0].is_released() && !allocs[1].is_released() && !allocs[2].is_released());
        assert!(!other.is_released());
        assert!(allocs[1].read().unwrap().iter().all(|&b| b == 2));
        assert!(allocs[2].read().unwrap().iter().all(|&b| b == 3));
        assert_eq!(m.spilled_bytes(), 4096, "only the released allocation keeps its backup");
        m.materialize([Tag::KV_CACHE]).unwrap();
        for (i, a) in allocs.iter().enumerate() {
            assert!(a.read().unwrap().iter().all(|&b| b == i as u8 + 1));
        }
        assert_eq!(m.spilled_bytes(), 0);
    }

    #[test]
    fn a_materialize_that_fails_part_way_rolls_back() {
        const NAME: &str =
            "manager::tests::failpoints::a_materialize_that_fails_part_way_rolls_back";
        if !is_child(NAME) {
            return run_child(NAME, &[("TPCTL_FAILPOINTS", "vmm.map=error#2")]);
        }
        let m = manager("fp-map");
        let allocs: Vec<Allocation> = (0..3)
            .map(|_| m.allocate(Tag::WEIGHTS, 4096, Policy::Backup(BackupStore::Host)).unwrap())
            .collect();
        allocs[0].write().unwrap().fill(7);
        m.release([Tag::WEIGHTS]).unwrap();
        let err = m.materialize([Tag::WEIGHTS]).unwrap_err();
        assert!(matches!(err, Error::MaterializeRolledBack { rolled_back: 2, .. }), "{err}");
        assert!(err.to_string().contains("vmm.map"), "{err}");
        assert!(allocs.iter().all(Allocation::is_released));
    }
}

// A model of the manager: per allocation, its tag, policy, released flag and expected bytes.
#[derive(Clone, Debug)]
enum Step {
    Allocate { tag: usize, policy: usize, pages: usize, seed: u8 },
    Write { index: usize, seed: u8 },
    Release { tags: Vec<usize> },
    Materialize { tags: Vec<usize> },
    Free { index: usize },
}

const MODEL_TAGS: [&str; 4] = ["weights", "kv_cache", "activations", "user.tag"];

fn step() -> impl Strategy<Value = Step> {
    let tags = proptest::collection::vec(0..MODEL_TAGS.len(), 1..3);
    prop_oneof![
        (0..MODEL_TAGS.len(), 0..5usize, 1..4usize, any::<u8>())
            .prop_map(|(tag, policy, pages, seed)| Step::Allocate { tag, policy, pages, seed }),
        (0..8usize, any::<u8>()).prop_map(|(index, seed)| Step::Write { index, seed }),
        tags.clone().prop_map(|tags| Step::Release { tags }),
        tags.prop_map(|tags| Step::Materialize { tags }),
        (0..8usize).prop_map(|index| Step::Free { index }),
    ]
}

struct Model {
    alloc: Allocation,
    released: bool,
    /// The bytes a read must see when materialized; `None` when undefined (Discard).
    expect: Option<Vec<u8>>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_match_the_model(steps in proptest::collection::vec(step(), 1..40)) {
        let m = manager("prop");
        m.define_tag("user.tag").unwrap();
        let page = m.granularity();
        let reload_bytes = Arc::new(pattern(77, 4 * page));
        let mut live: Vec<Model> = Vec::new();
        for step in steps {
            match step {
                Step::Allocate { tag, policy, pages, seed } => {
                    let bytes = pages * page - usize::from(seed % 3);
                    let src = Arc::clone(&reload_bytes);
                    let policy = match policy {
                        0 => Policy::Discard,
                        1 => Policy::Zero,
                        2 => Policy::Backup(BackupStore::Host),
                        3 => Policy::Backup(BackupStore::Spill),
                        _ => Policy::Reload(Source::from_fn(move |dst| {
                            dst.copy_from_slice(&src[..dst.len()]);
                            Ok(())
                        })),
                    };
                    let alloc = m.allocate(MODEL_TAGS[tag], bytes, policy).unwrap();
                    live.push(Model { alloc, released: false, expect: Some(vec![0; bytes]) });
                }
                Step::Write { index, seed } => {
                    let Some(model) = live.get_mut(index) else { continue };
                    let data = pattern(u64::from(seed), model.alloc.bytes());
                    match model.alloc.write() {
                        Ok(mut g) => {
                            prop_assert!(!model.released);
                            g.copy_from_slice(&data);
                            model.expect = Some(data);
                        }
                        Err(e) => {
                            let ok = model.released && matches!(e, Error::Released { .. });
                            prop_assert!(ok, "write failed on a materialized allocation: {}", e);
                        }
                    }
                }
                Step::Release { tags } => {
                    let names: Vec<&str> = tags.iter().map(|&t| MODEL_TAGS[t]).collect();
                    let receipts = m.release(&names).unwrap();
                    for r in &receipts {
                        let hit: Vec<&mut Model> = live
                            .iter_mut()
                            .filter(|x| x.alloc.tag() == &r.tag && !x.released)
                            .collect();
                        prop_assert_eq!(r.allocations, hit.len());
                        prop_assert_eq!(r.bytes, hit.iter().map(|x| x.alloc.mapped_bytes() as u64).sum::<u64>());
                        for x in hit {
                            x.released = true;
                        }
                    }
                }
                Step::Materialize { tags } => {
                    let names: Vec<&str> = tags.iter().map(|&t| MODEL_TAGS[t]).collect();
                    let receipts = m.materialize(&names).unwrap();
                    for r in &receipts {
                        let hit: Vec<&mut Model> = live
                            .iter_mut()
                            .filter(|x| x.alloc.tag() == &r.tag && x.released)
                            .collect();
                        prop_assert_eq!(r.allocations, hit.len());
                        for x in hit {
                            x.released = false;
                            let len = x.alloc.bytes();
                            x.expect = match x.alloc.policy() {
                                Policy::Discard => None,
                                Policy::Zero => Some(vec![0; len]),
                                Policy::Backup(_) => x.expect.take(),
                                Policy::Reload(_) => Some(reload_bytes[..len].to_vec()),
                            };
                        }
                    }
                }
                Step::Free { index } => {
                    if index < live.len() {
                        live.remove(index);
                    }
                }
            }
            for x in &live {
                prop_assert_eq!(x.alloc.is_released(), x.released);
                if let (false, Some(expect)) = (x.released, &x.expect) {
                    prop_assert!(hash(&x.alloc.read().unwrap()) == hash(expect), "contents of {:?}", x.alloc);
                }
            }
            prop_assert_eq!(m.allocations().len(), live.len());
        }
        drop(live);
        prop_assert_eq!(m.spilled_bytes(), 0);
    }
}

#[test]
fn scratch_dirs_are_per_process_and_removed() {
    let dir = scratch_dir("x");
    assert!(dir.starts_with(std::env::temp_dir()) && !dir.exists());
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let path = dir.to_path_buf();
    drop(dir);
    assert!(!path.exists());
}

#[test]
fn a_release_can_back_up_any_policy_and_its_copy_wins_over_the_policy() {
    let m = manager("release-with");
    let reloaded = pattern(1, 3 * MIB);
    let source = reloaded.clone();
    let w = m
        .allocate(
            Tag::WEIGHTS,
            3 * MIB,
            Policy::Reload(Source::from_fn(move |dst| {
                dst.copy_from_slice(&source[..dst.len()]);
                Ok(())
            })),
        )
        .unwrap();
    let kv = m.allocate(Tag::KV_CACHE, MIB, Policy::Discard).unwrap();
    let updated = pattern(2, w.bytes());
    w.write().unwrap().copy_from_slice(&updated);
    // Backed up for this release only: the wakeup restores the current bytes, not the source.
    for store in [BackupStore::Host, BackupStore::Spill] {
        let r = m.release_with([Tag::WEIGHTS, Tag::KV_CACHE], &[(Tag::WEIGHTS, store)]).unwrap();
        assert_eq!(r[0].copied_bytes, w.mapped_bytes() as u64, "{store:?}");
        assert_eq!(r[1].copied_bytes, 0, "{store:?}: the KV cache keeps its policy");
        let r = m.materialize([Tag::WEIGHTS, Tag::KV_CACHE]).unwrap();
        assert_eq!(r[0].copied_bytes, w.mapped_bytes() as u64, "{store:?}");
        assert_eq!(hash(&w.read().unwrap()), hash(&updated), "{store:?}");
    }
    // A plain release applies the policy: the source's bytes come back.
    m.release([Tag::WEIGHTS]).unwrap();
    m.materialize([Tag::WEIGHTS]).unwrap();
    assert_eq!(hash(&w.read().unwrap()), hash(&reloaded));
    drop(kv);
}
