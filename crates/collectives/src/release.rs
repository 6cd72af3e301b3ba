//! Device memory a communicator gives back for a sleep and makes again at the wakeup
//! ([`DeviceResources`], from [`Communicator::device_resources`]): NCCL's buffers, channels and
//! proxy state, which vLLM users see held by an engine asleep (about 1 GiB per rank at TP 4).
//!
//! The communicator stays owned by its thread (`&mut self`, the engine); the sleep runs on
//! another (the control plane's) while the engine is parked between steps. The [`Lease`]
//! keeps the two apart without a lock on the call path: a call enters the lease and leaves it
//! when done, a release takes the lease only while no call is inside, and a call that comes
//! while it is taken is refused ([`crate::Error::Released`]) instead of touching a freed
//! communicator.
//!
//! [`Communicator::device_resources`]: crate::Communicator::device_resources

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// What a communicator holds on a device, released and made again from another thread than
/// its owner's. Both are collective: every member of the group releases (or restores) at about
/// the same time, within the group's deadline; a member that does not come fails the others'
/// restore at the deadline, naming the group.
pub trait DeviceResources: Send + Sync + std::fmt::Debug {
    /// The group's name (for example `tp[cp=0]`).
    fn group(&self) -> &str;

    /// Gives the communicator's device resources back, once no call of it is in progress;
    /// calls fail until [`DeviceResources::restore`]. Releasing twice releases nothing more.
    ///
    /// # Errors
    /// A call is in progress (the communicator is left as it was), or the library failed to
    /// tear the communicator down (it is aborted instead, its memory freed all the same).
    fn release(&self) -> crate::Result<()>;

    /// Makes the communicator again with the other members of its group (a new rendezvous
    /// through the store), and lets calls in. Restoring one that is not released does
    /// nothing.
    ///
    /// # Errors
    /// The rendezvous or the library's set-up failed (it stays released, so a later restore
    /// may try again), or a member did not come within the deadline.
    fn restore(&self) -> crate::Result<()>;

    /// Whether the resources are released now.
    fn is_released(&self) -> bool;
}

/// Why a release could not take a [`Lease`]: a call is inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Busy;

/// Why a call could not enter a [`Lease`]: it is taken (released resources).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taken;

/// Calls of a communicator against the release of what they use (see the module docs).
///
/// A call counts itself in, then looks at the flag; a release raises the flag, then looks at
/// the count. Both are sequentially consistent, so at least one of them sees the other: a call
/// that got in has the count above zero until it leaves, and a release that got the lease saw
/// no call inside and is seen by every later one.
#[derive(Debug, Default)]
pub struct Lease {
    inside: AtomicUsize,
    taken: AtomicBool,
}

/// A call inside a [`Lease`]; dropping it leaves.
#[derive(Debug)]
#[must_use = "the call leaves the lease when this is dropped"]
pub struct Inside<'a>(&'a Lease);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Lease {
    /// Enters a call.
    ///
    /// # Errors
    /// [`Taken`] while the lease is taken.
    pub fn enter(&self) -> Result<Inside<'_>, Taken> {
        self.inside.fetch_add(1, Ordering::SeqCst);
        let inside = Inside(self);
        if self.taken.load(Ordering::SeqCst) {
            return Err(Taken);
        }
        Ok(inside)
    }

    /// Takes the lease for a release: no call is inside, and none gets in until
    /// [`Lease::give_back`]. Taking a taken lease succeeds (it stays taken).
    ///
    /// # Errors
    /// [`Busy`] while a call is inside (the lease is left as it was).
    pub fn take(&self) -> Result<(), Busy> {
        if self.taken.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        if self.inside.load(Ordering::SeqCst) > 0 {
            self.taken.store(false, Ordering::SeqCst);
            return Err(Busy);
        }
        Ok(())
    }

    /// Lets calls in again.
    pub fn give_back(&self) {
        self.taken.store(false, Ordering::SeqCst);
    }

    /// Whether the lease is taken.
    pub fn is_taken(&self) -> bool {
        self.taken.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// A call and a release exclude each other: a release is refused while a call is inside,
    /// a call is refused while the lease is taken, and both work again after.
    #[test]
    fn calls_and_a_release_exclude_each_other() {
        let lease = Lease::default();
        let inside = lease.enter().unwrap();
        assert_eq!(lease.take(), Err(Busy));
        assert!(!lease.is_taken(), "a refused release leaves the lease as it was");
        drop(inside);
        lease.take().unwrap();
        assert!(lease.enter().is_err());
        lease.take().unwrap();
        lease.give_back();
        drop(lease.enter().unwrap());
    }

    /// Under contention, no call is ever inside while the lease is taken: each call checks
    /// that the resources it uses are live (the "generation" a release bumps is the one it saw
    /// when it entered) for its whole duration.
    #[test]
    fn no_call_runs_while_a_release_holds_the_lease() {
        const EACH: u64 = 1_000;
        let lease = Arc::new(Lease::default());
        // Odd while released.
        let generation = Arc::new(AtomicU64::new(0));
        let (calls, releases) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let caller = {
            let (lease, generation) = (lease.clone(), generation.clone());
            let (calls, releases) = (calls.clone(), releases.clone());
            std::thread::spawn(move || {
                while calls.load(Ordering::Relaxed) < EACH || releases.load(Ordering::SeqCst) < EACH
                {
                    assert!(std::time::Instant::now() < deadline, "the two sides never met");
                    if let Ok(_inside) = lease.enter() {
                        let seen = generation.load(Ordering::SeqCst);
                        assert_eq!(seen % 2, 0, "a call got in while released");
                        std::hint::spin_loop();
                        assert_eq!(
                            generation.load(Ordering::SeqCst),
                            seen,
                            "released under a call"
                        );
                        calls.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        while !caller.is_finished() {
            if lease.take().is_ok() {
                generation.fetch_add(1, Ordering::SeqCst);
                std::hint::spin_loop();
                generation.fetch_add(1, Ordering::SeqCst);
                lease.give_back();
                releases.fetch_add(1, Ordering::SeqCst);
            }
        }
        caller.join().unwrap();
    }
}
