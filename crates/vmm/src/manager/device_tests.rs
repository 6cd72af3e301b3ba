//! Tests of the manager on the fake device backend (`backend::fake`): backups to host memory
//! and their restores go in chunks, restore every byte, and roll back a failed restore.

use super::*;
use crate::backend::fake::{Call, Probe, GRANULARITY};
use crate::chunked::Direction;

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
    // One host buffer of the allocation's size, freed by the materialize.
    assert_eq!(probe.host_alloc_sizes(), vec![len]);
    assert_eq!((probe.host_allocs(), probe.host_frees()), (1, 1));
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
