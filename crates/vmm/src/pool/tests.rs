//! The pool's arithmetic: first fit, coalescing, growth by the bytes missing, freeing.

use super::*;
use crate::backend::fake;

#[test]
fn grows_once_by_what_is_missing_and_reuses_given_back_ranges() {
    let (backend, probe) = fake::create();
    let mut pool = HostPool::default();
    pool.reserve(&*backend, &[100, 50]).unwrap();
    assert_eq!((pool.capacity(), probe.host_alloc_sizes()), (150, vec![150]));

    let a = pool.take(100).unwrap();
    let b = pool.take(50).unwrap();
    assert!(pool.take(1).is_none());
    assert_eq!(pool.lent(), 150);
    pool.bytes_mut(&a).fill(1);
    pool.bytes_mut(&b).fill(2);
    assert!(pool.bytes(&a).iter().all(|&x| x == 1) && pool.bytes(&b).iter().all(|&x| x == 2));

    // Given back in either order, the ranges coalesce: one of 150 fits again.
    pool.give(b);
    pool.give(a);
    assert_eq!(pool.lent(), 0);
    pool.reserve(&*backend, &[150]).unwrap();
    assert_eq!(probe.host_allocs(), 1, "a range given back was not reused");
    let whole = pool.take(150).unwrap();

    // Only the sizes that do not fit in what is free are allocated, together.
    pool.reserve(&*backend, &[30, 40]).unwrap();
    assert_eq!(probe.host_alloc_sizes(), vec![150, 70]);
    let (c, d) = (pool.take(30).unwrap(), pool.take(40).unwrap());
    pool.give(whole);
    pool.give(c);
    pool.give(d);
    assert_eq!(probe.host_frees(), 0, "giving back freed host memory");
    assert_eq!(pool.free_unused(), 220);
    assert_eq!((pool.capacity(), probe.host_frees()), (0, 2));
}

#[test]
fn frees_only_what_lends_nothing() {
    let (backend, probe) = fake::create();
    let mut pool = HostPool::default();
    pool.reserve(&*backend, &[64]).unwrap();
    let held = pool.take(64).unwrap();
    pool.reserve(&*backend, &[32]).unwrap();
    assert_eq!(pool.free_unused(), 32);
    assert_eq!((pool.capacity(), pool.lent(), probe.host_frees()), (64, 64, 1));
    pool.give(held);
    assert_eq!(pool.free_unused(), 64);
}
