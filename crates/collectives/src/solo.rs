//! The communicator of a one-rank group: every collective is the identity (or a copy).

use crate::call::{GroupCore, Transport};
use crate::comm::DEFAULT_TIMEOUT;
use crate::dtype::{ElemType, ReduceOp};
use crate::error::{Error, Result, Site};
use std::time::Instant;

/// A group of one: what an inert single-rank [`ParallelContext`](crate::ParallelContext) holds.
/// Arguments are still checked, and a failure still poisons it, so code that runs on one rank
/// is refused the same way it would be on many.
#[derive(Debug)]
pub struct Solo {
    core: GroupCore,
}

impl Solo {
    /// A one-rank group named `group`.
    pub fn new(group: &str) -> Solo {
        Solo { core: GroupCore::new(group.into(), 0, 1, DEFAULT_TIMEOUT) }
    }
}

impl Transport for Solo {
    fn core(&self) -> &GroupCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        &mut self.core
    }
    fn backend(&self) -> &'static str {
        "solo"
    }

    fn publish_failure(&mut self, _error: &Error, _first: bool) {
        // Nobody else to tell.
    }

    fn all_reduce(
        &mut self,
        _: &Site,
        _: Instant,
        _: &mut [u8],
        _: ElemType,
        _: ReduceOp,
    ) -> Result<()> {
        Ok(())
    }

    fn all_gather(
        &mut self,
        _: &Site,
        _: Instant,
        send: &[u8],
        recv: &mut [u8],
        _: &[usize],
        _: ElemType,
    ) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        _: &Site,
        _: Instant,
        send: &[u8],
        recv: &mut [u8],
        _: ElemType,
        _: ReduceOp,
    ) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }

    fn broadcast(
        &mut self,
        _: &Site,
        _: Instant,
        _: &mut [u8],
        _: ElemType,
        _: usize,
    ) -> Result<()> {
        Ok(())
    }

    // A group of one has no peer: the argument check refuses every send and receive first.
    fn send(&mut self, _: &Site, _: Instant, _: &[u8], _: ElemType, _: usize) -> Result<()> {
        Ok(())
    }

    fn recv(&mut self, _: &Site, _: Instant, _: &mut [u8], _: ElemType, _: usize) -> Result<()> {
        Ok(())
    }

    fn all_to_all(
        &mut self,
        _: &Site,
        _: Instant,
        send: &[u8],
        recv: &mut [u8],
        _: ElemType,
    ) -> Result<()> {
        recv.copy_from_slice(send);
        Ok(())
    }

    fn barrier(&mut self, _: &Site, _: Instant) -> Result<()> {
        Ok(())
    }
}
