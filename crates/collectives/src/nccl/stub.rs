//! [`NcclCommunicator`] in a build without the feature `cuda`: it cannot be made, and every
//! constructor says which feature is missing, so callers carry no `#[cfg]`.

use crate::comm::{AbortHandle, Communicator};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::nccl::NcclId;
use mesh::Store;
use std::convert::Infallible;
use std::time::Duration;

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

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        match self.never {}
    }
    fn size(&self) -> usize {
        match self.never {}
    }
    fn group(&self) -> &str {
        match self.never {}
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
    fn timeout(&self) -> Duration {
        match self.never {}
    }
    fn set_timeout(&mut self, _timeout: Duration) {
        match self.never {}
    }
    fn abort_handle(&self) -> AbortHandle {
        match self.never {}
    }
    fn fail(&mut self, _reason: &str) {
        match self.never {}
    }
    fn all_reduce_raw(&mut self, _buf: &mut [u8], _dtype: DType, _op: ReduceOp) -> Result<()> {
        match self.never {}
    }
    fn all_gather_uneven_raw(
        &mut self,
        _send: &[u8],
        _recv: &mut [u8],
        _sizes: &[usize],
        _dtype: DType,
    ) -> Result<()> {
        match self.never {}
    }
    fn reduce_scatter_raw(
        &mut self,
        _send: &[u8],
        _recv: &mut [u8],
        _dtype: DType,
        _op: ReduceOp,
    ) -> Result<()> {
        match self.never {}
    }
    fn broadcast_raw(&mut self, _buf: &mut [u8], _dtype: DType, _root: usize) -> Result<()> {
        match self.never {}
    }
    fn send_raw(&mut self, _buf: &[u8], _dtype: DType, _peer: usize) -> Result<()> {
        match self.never {}
    }
    fn recv_raw(&mut self, _buf: &mut [u8], _dtype: DType, _peer: usize) -> Result<()> {
        match self.never {}
    }
    fn all_to_all_raw(&mut self, _send: &[u8], _recv: &mut [u8], _dtype: DType) -> Result<()> {
        match self.never {}
    }
    fn barrier(&mut self) -> Result<()> {
        match self.never {}
    }
}
