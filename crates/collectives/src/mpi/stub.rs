//! [`MpiComm`] in a build without the feature `mpi`: it cannot be made, and its constructor
//! says which feature is missing, so callers carry no `#[cfg]`.

use crate::call::{GroupCore, Transport};
use crate::dtype::{ElemType, ReduceOp};
use crate::error::{Error, Result, Site};
use std::convert::Infallible;
use std::time::{Duration, Instant};

/// The MPI communicator; this build has no MPI support, so no value of it exists.
#[derive(Debug)]
pub struct MpiComm {
    never: Infallible,
}

impl MpiComm {
    /// See the MPI build: makes the group of MPI world ranks `members`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiledWith`].
    pub fn create(_group: &str, _members: &[usize], _timeout: Duration) -> Result<MpiComm> {
        Err(Error::NotCompiledWith { feature: "mpi" })
    }
}

impl Transport for MpiComm {
    fn core(&self) -> &GroupCore {
        match self.never {}
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        match self.never {}
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn publish_failure(&mut self, _error: &Error, _first: bool) {
        match self.never {}
    }
    fn all_reduce(
        &mut self,
        _: &Site,
        _: Instant,
        _: &mut [u8],
        _: ElemType,
        _: ReduceOp,
    ) -> Result<()> {
        match self.never {}
    }
    fn all_gather(
        &mut self,
        _: &Site,
        _: Instant,
        _: &[u8],
        _: &mut [u8],
        _: &[usize],
        _: ElemType,
    ) -> Result<()> {
        match self.never {}
    }
    fn reduce_scatter(
        &mut self,
        _: &Site,
        _: Instant,
        _: &[u8],
        _: &mut [u8],
        _: ElemType,
        _: ReduceOp,
    ) -> Result<()> {
        match self.never {}
    }
    fn broadcast(
        &mut self,
        _: &Site,
        _: Instant,
        _: &mut [u8],
        _: ElemType,
        _: usize,
    ) -> Result<()> {
        match self.never {}
    }
    fn send(&mut self, _: &Site, _: Instant, _: &[u8], _: ElemType, _: usize) -> Result<()> {
        match self.never {}
    }
    fn recv(&mut self, _: &Site, _: Instant, _: &mut [u8], _: ElemType, _: usize) -> Result<()> {
        match self.never {}
    }
    fn all_to_all(
        &mut self,
        _: &Site,
        _: Instant,
        _: &[u8],
        _: &mut [u8],
        _: ElemType,
    ) -> Result<()> {
        match self.never {}
    }
    fn barrier(&mut self, _: &Site, _: Instant) -> Result<()> {
        match self.never {}
    }
}
