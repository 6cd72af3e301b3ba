//! [`NcclCommunicator`] in a build without the feature `cuda`: it cannot be made, and every
//! constructor says which feature is missing, so callers carry no `#[cfg]`.

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

crate::unavailable::unavailable_transport!(NcclCommunicator, "nccl");
