//! The sleep/wakeup lock: at most one sleep, wakeup or weight update runs on a deployment at a
//! time, and a status fan-out never shares the control channel with one.
//!
//! The [`Coordinator`](super::Coordinator) takes it for every operation, a single rank's too,
//! before it quiesces the engine, and gives it back after the last ACK is drained and the
//! state is set, on success and on every failure path alike. [`LocalLock`] is the default; a
//! deployment that shares its GPUs with another job can pass a lock both take (one over a lock
//! file, say) with [`Coordinator::with_lock`](super::Coordinator::with_lock).

use std::sync::{Condvar, Mutex, MutexGuard};

/// A lock the coordinator takes around each operation. Implementations must be fair enough
/// that a waiting caller gets it eventually; the coordinator never takes it twice.
pub trait OpLock: Send + Sync {
    /// Blocks until the caller holds the lock.
    fn acquire(&self);

    /// Takes the lock if it is free, without waiting; whether it did.
    fn try_acquire(&self) -> bool;

    /// Gives back the lock the caller holds.
    fn release(&self);
}

/// The lock of one process: a flag and a condition variable.
#[derive(Debug, Default)]
pub struct LocalLock {
    held: Mutex<bool>,
    freed: Condvar,
}

impl LocalLock {
    fn flag(&self) -> MutexGuard<'_, bool> {
        // The flag is a plain bool: a panic while holding its mutex cannot leave it torn.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl OpLock for LocalLock {
    fn acquire(&self) {
        let mut held = self.flag();
        while *held {
            held = self.freed.wait(held).unwrap_or_else(|e| e.into_inner());
        }
        *held = true;
    }

    fn try_acquire(&self) -> bool {
        let mut held = self.flag();
        !std::mem::replace(&mut *held, true)
    }

    fn release(&self) {
        *self.flag() = false;
        self.freed.notify_one();
    }
}

/// The lock held by this scope: given back when dropped, a panic's unwinding included.
pub(super) struct Held<'a>(&'a dyn OpLock);

impl<'a> Held<'a> {
    /// Waits for `lock`.
    pub(super) fn acquire(lock: &'a dyn OpLock) -> Held<'a> {
        lock.acquire();
        Held(lock)
    }

    /// Takes `lock` if it is free.
    pub(super) fn try_acquire(lock: &'a dyn OpLock) -> Option<Held<'a>> {
        lock.try_acquire().then_some(Held(lock))
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}
