//! [`MpiComm`] in a build without the feature `mpi`: it cannot be made, and its constructor
//! says which feature is missing, so callers carry no `#[cfg]`.

use crate::error::{Error, Result};
use std::convert::Infallible;
use std::time::Duration;

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

crate::unavailable::unavailable_transport!(MpiComm, "mpi");
