//! [`NcclCommunicator`] in a build without the feature `cuda`: it cannot be made, and every
//! constructor says which feature is missing, so callers carry no `#[cfg]`.

use crate::call::{GroupCore, Transport};
use crate::dtype::{ElemType, ReduceOp};
use crate::error::{Error, Result, Site};
use crate::nccl::NcclId;
use mesh::Store;
use std::convert::Infallible;
use std::time::{Duration, Instant};

/// The NCCL communicator; this build has no CUDA support, so no value of it exists.
#[derive(Debug)]
pub struct NcclCommunicator {
    never: Infallible,
}

impl NcclCommunicator {
    /// See the CUDA build: joins the group's NCCL communicator through `store`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiledWith`].
    pub fn connect(
        _store: &Store,
        _key_prefix: &str,
        _group: &str,
        _rank: usize,
        _size: usize,
        _device: usize,
        _timeout: Duration,
    ) -> Result<NcclCommunicator> {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }

    /// See the CUDA build: joins the communicator named by `id`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiledWith`].
    pub fn from_id(
        _id: &NcclId,
        _group: &str,
        _rank: usize,
        _size: usize,
        _device: usize,
        _timeout: Duration,
    ) -> Result<NcclCommunicator> {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        match self.never {}
    }
}

impl Transport for NcclCommunicator {
    fn core(&self) -> &GroupCore {
        match self.never {}
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        match self.never {}
    }
    fn backend(&self) -> &'static str {
        "nccl"
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
