//! Tests of the manager on the fake device backend (`backend::fake`): backups to host memory
//! and their restores go in chunks, restore every byte, and roll back a failed restore; the
//! host memory they use is allocated once and kept across cycles.

use super::*;
use crate::backend::fake::{Call, Probe, GRANULARITY};
use crate::chunked::Direction;

/// A chunk of a few pages, for tests that do not look at the chunks.
const CHUNK_FOR_TESTS: usize = 2 * GRANULARITY;

/// Deterministic bytes per seed.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 131 % 251) as u8 ^ seed).collect()
}

/// A manager on the fake device with chunks of `chunk` bytes.
fn fake(chunk: usize) -> (Manager, Arc<Probe>) {
    Manager::builder().build_fake(chunk)
}

/// The chunk starts of the calls: `(direction, offset, len)` each.
fn starts(calls: &[Call]) -> Vec<(Direction, usize, usize)> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Start { direction, offset, len, .. } => Some((*direction, *offset, *len)),
            _ => None,
        })
        .collect()
}

fn contents(a: &Allocation) -> Vec<u8> {
    let mut out = vec![0u8; a.bytes()];
    a.read_into(0, &mut out).unwrap();
    out
}

#[test]
fn host_backups_and_restores_go_in_chunks_and_restore_every_byte() {
    let chunk = 3 * GRANULARITY;
    let (m, probe) = fake(chunk);
    let len = 10 * GRANULARITY;
    let a = m.allocate(Tag::WEIGHTS, len, Policy::Backup(BackupStore::Host)).unwrap();
    let data = pattern(1, len);
    a.write_from(0, &data).unwrap();
    let want: Vec<(Direction, usize, usize)> =
        [(0, chunk), (chunk, chunk), (2 * chunk, chunk), (3 * chunk, GRANULARITY)]
            .into_iter()
            .map(|(o, l)| (Direction::ToHost, o, l))
            .collect();

    let receipts = m.release([Tag::WEIGHTS]).unwrap();
    assert_eq!(receipts[0].copied_bytes, len as u64);
    assert_eq!(starts(&probe.take_calls()), want);

    m.materialize([Tag::WEIGHTS]).unwrap();
    let back: Vec<_> =
        want.iter().map(|&(_, o, l)| (Direction::FromHost, o, l)).collect::<Vec<_>>();
    assert_eq!(starts(&probe.take_calls()), back);
    assert!(contents(&a) == data, "the restored bytes differ from the original");
    // One host allocation of the allocation's size, kept by the materialize.
    assert_eq!(probe.host_alloc_sizes(), vec![len]);
    assert_eq!((probe.host_allocs(), probe.host_frees()), (1, 0));
}

#[test]
fn a_restore_that_fails_part_way_rolls_back_and_keeps_the_backup() {
    let chunk = 2 * GRANULARITY;
    let (m, probe) = fake(chunk);
    let len = 8 * GRANULARITY;
    let first = m.allocate(Tag::WEIGHTS, len, Policy::Backup(BackupStore::Host)).unwrap();
    let second = m.allocate(Tag::WEIGHTS, len, Policy::Backup(BackupStore::Host)).unwrap();
    first.write_from(0, &pattern(1, len)).unwrap();
    second.write_from(0, &pattern(2, len)).unwrap();
    m.release([Tag::WEIGHTS]).unwrap();
    probe.take_calls();

    // The first allocation restores; the second fails at its third chunk.
    probe.fail_chunk(Direction::FromHost, 1, 2);
    let err = m.materialize([Tag::WEIGHTS]).unwrap_err();
    assert!(matches!(err, Error::MaterializeRolledBack { rolled_back: 1, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("restore from host memory, chunk 3 of 4"), "{msg}");
    assert!(msg.contains(&format!("allocation {}", second.id())), "{msg}");
    assert!(probe.take_calls().contains(&Call::Drain), "the failed restore drained nothing");
    assert!(first.is_released() && second.is_released(), "a rolled-back allocation is mapped");

    // Both backups were kept: the retry restores every byte.
    m.materialize([Tag::WEIGHTS]).unwrap();
    assert!(contents(&first) == pattern(1, len), "the first allocation lost its bytes");
    assert!(contents(&second) == pattern(2, len), "the second allocation lost its bytes");
}

/// `cycles` sleep/wake cycles of `allocs` (each filled with new bytes first) as a level-1
/// sleep does them: a release that backs the tag up to the default store (host memory on a
/// device), checking every byte after each wakeup.
fn cycle(m: &Manager, allocs: &[&Allocation], cycles: usize) {
    for c in 0..cycles {
        let data: Vec<Vec<u8>> =
            allocs.iter().enumerate().map(|(i, a)| pattern((c * 7 + i) as u8, a.bytes())).collect();
        for (a, d) in allocs.iter().zip(&data) {
            a.write_from(0, d).unwrap();
        }
        m.release_with([Tag::WEIGHTS], &[(Tag::WEIGHTS, BackupStore::Default)]).unwrap();
        m.materialize([Tag::WEIGHTS]).unwrap();
        for (i, (a, d)) in allocs.iter().zip(&data).enumerate() {
            assert!(contents(a) == *d, "cycle {c}: allocation {i} lost its bytes");
        }
    }
}

#[test]
fn host_memory_is_allocated_at_the_first_sleep_only_and_never_freed_between_cycles() {
    let (m, probe) = fake(4 * GRANULARITY);
    let a = m.allocate(Tag::WEIGHTS, 10 * GRANULARITY, Policy::Discard).unwrap();
    let b = m.allocate(Tag::WEIGHTS, 3 * GRANULARITY + 1, Policy::Discard).unwrap();
    let total = (a.mapped_bytes() + b.mapped_bytes()) as u64;
    assert_eq!(probe.host_allocs(), 0);
    cycle(&m, &[&a, &b], 6);
    // One allocation of both backups' bytes at the first release, none since, nothing freed.
    assert_eq!(probe.host_alloc_sizes(), vec![total as usize]);
    assert_eq!(probe.host_frees(), 0);
    assert_eq!((m.host_pool_bytes(), m.host_pool_lent_bytes()), (total, 0));

    // Freed when asked, or with the manager.
    assert_eq!(m.free_host_pool(), total);
    assert_eq!(probe.host_frees(), 1);
    cycle(&m, &[&a, &b], 1);
    assert_eq!((probe.host_allocs(), probe.host_frees()), (2, 1));
    drop((a, b, m));
    assert_eq!(probe.host_frees(), 2, "dropping the manager did not free its pool");
}

#[test]
fn preallocated_host_memory_is_allocated_up_front_once() {
    let (m, probe) = fake(4 * GRANULARITY);
    let a = m.allocate(Tag::WEIGHTS, 10 * GRANULARITY, Policy::Discard).unwrap();
    let b = m.allocate(Tag::WEIGHTS, 6 * GRANULARITY, Policy::Discard).unwrap();
    let kv = m.allocate(Tag::KV_CACHE, 8 * GRANULARITY, Policy::Discard).unwrap();
    let weights = (a.mapped_bytes() + b.mapped_bytes()) as u64;
    assert_eq!(m.preallocate_host_backups([Tag::WEIGHTS]).unwrap(), weights);
    assert_eq!(probe.host_alloc_sizes(), vec![weights as usize]);
    // Asking again allocates nothing more.
    assert_eq!(m.preallocate_host_backups(["weights"]).unwrap(), weights);
    cycle(&m, &[&a, &b], 4);
    assert_eq!((probe.host_allocs(), probe.host_frees()), (1, 0));

    // A new allocation of the tag grows the pool when it is made, not at the next sleep.
    let c = m.allocate(Tag::WEIGHTS, 2 * GRANULARITY, Policy::Discard).unwrap();
    assert_eq!(probe.host_alloc_sizes(), vec![weights as usize, c.mapped_bytes()]);
    cycle(&m, &[&a, &b, &c], 3);
    assert_eq!((probe.host_allocs(), probe.host_frees()), (2, 0));
    drop(kv);
}

#[test]
fn preallocation_from_the_builder_and_nothing_for_a_spill_store() {
    let (m, probe) =
        Manager::builder().preallocate_host_backups([Tag::WEIGHTS]).build_fake(CHUNK_FOR_TESTS);
    let a = m.allocate(Tag::WEIGHTS, 5 * GRANULARITY, Policy::Discard).unwrap();
    assert_eq!(probe.host_alloc_sizes(), vec![a.mapped_bytes()]);
    // Backups to a spill file take no host memory.
    let _s = m.allocate(Tag::WEIGHTS, GRANULARITY, Policy::Backup(BackupStore::Spill)).unwrap();
    assert_eq!(probe.host_allocs(), 1);
}

#[test]
fn a_backup_that_fails_gives_its_host_memory_back_to_the_pool() {
    let (m, probe) = fake(CHUNK_FOR_TESTS);
    let a = m.allocate(Tag::WEIGHTS, 4 * GRANULARITY, Policy::Backup(BackupStore::Host)).unwrap();
    let b = m.allocate(Tag::WEIGHTS, 4 * GRANULARITY, Policy::Backup(BackupStore::Host)).unwrap();
    // The second allocation's backup fails at its second chunk: nothing is released.
    probe.fail_chunk(Direction::ToHost, 1, 1);
    let err = m.release([Tag::WEIGHTS]).unwrap_err();
    assert!(matches!(err, Error::ReleaseAborted { .. }), "{err}");
    assert!(err.to_string().contains("backup to host memory, chunk 2 of 2"), "{err}");
    assert!(!a.is_released() && !b.is_released());
    assert_eq!(m.host_pool_lent_bytes(), 0, "the failed release kept pool memory");
    cycle(&m, &[&a, &b], 2);
    assert_eq!((probe.host_allocs(), probe.host_frees()), (1, 0));
}

#[test]
fn a_host_buffer_is_the_backups_kind_of_memory_outside_the_pool() {
    let (m, probe) = fake(CHUNK_FOR_TESTS);
    let mut buf = m.host_buffer(3 * GRANULARITY).unwrap();
    buf.fill(7);
    assert_eq!((buf.len(), probe.host_alloc_sizes()), (3 * GRANULARITY, vec![3 * GRANULARITY]));
    assert_eq!(m.host_pool_bytes(), 0);
    drop(buf);
    assert_eq!(probe.host_frees(), 1);
}
