//! The order of a chunked copy's calls, its chunk boundaries and its failures, on the fake
//! device (which copies a chunk only when it is waited for).

use super::*;
use crate::backend::fake::{self, Call, GARBAGE, GRANULARITY};
use crate::backend::Init;

/// Deterministic bytes that differ from their neighbours.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 131 % 251) as u8 + 1).collect()
}

/// The calls `n` chunks of `chunk` bytes over `len` bytes should make: begin, start 0, then
/// start i before wait i-1, then the last wait.
fn expected(direction: Direction, len: usize, chunk: usize) -> Vec<Call> {
    let n = len.div_ceil(chunk);
    let start = |i: usize| Call::Start {
        direction,
        chunk: i,
        offset: i * chunk,
        len: chunk.min(len - i * chunk),
    };
    let mut calls = vec![Call::Begin(direction), start(0)];
    for i in 1..n {
        calls.push(start(i));
        calls.push(Call::Wait(i - 1));
    }
    calls.push(Call::Wait(n - 1));
    calls
}

#[test]
fn chunks_are_queued_one_ahead_of_their_wait_and_copy_every_byte() {
    let (mut backend, probe) = fake::create();
    // 10 pages in chunks of 3 pages and a bit: four chunks, the last one shorter.
    let len = 10 * GRANULARITY;
    let chunk = 3 * GRANULARITY + 100;
    let addr = backend.reserve(len).unwrap();
    let data = pattern(len);
    let _phys = backend.map(addr, len, "t", Init::Fresh).unwrap();
    backend.copy_from_host(addr, &data).unwrap();

    let mut host = vec![0u8; len];
    to_host(&*backend, addr, &mut host, chunk).unwrap();
    assert_eq!(probe.take_calls(), expected(Direction::ToHost, len, chunk));
    assert!(host == data, "the backup differs from the device memory");

    // Back into fresh (garbage) memory.
    let addr2 = backend.reserve(len).unwrap();
    let _phys2 = backend.map(addr2, len, "t", Init::Fresh).unwrap();
    from_host(&*backend, addr2, &host, chunk).unwrap();
    assert_eq!(probe.take_calls(), expected(Direction::FromHost, len, chunk));
    let mut back = vec![GARBAGE; len];
    backend.copy_to_host(addr2, &mut back).unwrap();
    assert!(back == data, "the restore differs from the backup");
    assert_eq!(probe.max_in_flight(), IN_FLIGHT);
}

#[test]
fn one_chunk_and_nothing_at_all() {
    let (mut backend, probe) = fake::create();
    let len = GRANULARITY;
    let addr = backend.reserve(len).unwrap();
    let _phys = backend.map(addr, len, "t", Init::Fresh).unwrap();
    backend.copy_from_host(addr, &pattern(len)).unwrap();
    let mut host = vec![0u8; len];
    to_host(&*backend, addr, &mut host, CHUNK).unwrap();
    assert_eq!(probe.take_calls(), expected(Direction::ToHost, len, CHUNK));
    assert_eq!(host, pattern(len));
    to_host(&*backend, addr, &mut [], CHUNK).unwrap();
    assert_eq!(probe.take_calls(), vec![Call::Begin(Direction::ToHost)]);
}

#[test]
fn a_chunk_that_fails_drains_the_queued_ones_and_is_named() {
    let (mut backend, probe) = fake::create();
    let len = 8 * GRANULARITY;
    let chunk = 2 * GRANULARITY;
    let addr = backend.reserve(len).unwrap();
    let _phys = backend.map(addr, len, "t", Init::Fresh).unwrap();
    let host = pattern(len);
    probe.fail_chunk(Direction::FromHost, 0, 2);
    let err = from_host(&*backend, addr, &host, chunk).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "restore from host memory, chunk 3 of 4 ({chunk} bytes at offset {}): ",
            2 * chunk
        )),
        "{msg}"
    );
    let mut calls = expected(Direction::FromHost, len, chunk);
    // Chunks 0 and 1 were queued, chunk 0 waited for; the third start failed.
    calls.truncate(5);
    calls.push(Call::Drain);
    assert_eq!(probe.take_calls(), calls);
    // The drain finished chunk 1 before the call returned: nothing still reads `host`.
    let mut back = vec![0u8; 2 * chunk];
    backend.copy_to_host(addr, &mut back).unwrap();
    assert!(back == host[..2 * chunk], "the chunks queued before the failure were not drained");
}
