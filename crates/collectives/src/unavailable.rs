//! The transport of a backend this build was compiled without (`nccl` without `cuda`, `mpi`
//! without `mpi`): its communicator type holds an [`std::convert::Infallible`], so no value
//! exists and every method is unreachable. Its constructors return
//! [`crate::Error::NotCompiledWith`], so callers carry no `#[cfg]`.

/// Implements `Transport` for `$comm`, a struct with a field `never: Infallible`, naming
/// `$backend`.
macro_rules! unavailable_transport {
    ($comm:ty, $backend:literal) => {
        impl $crate::call::Transport for $comm {
            fn core(&self) -> &$crate::call::GroupCore {
                match self.never {}
            }
            fn core_mut(&mut self) -> &mut $crate::call::GroupCore {
                match self.never {}
            }
            fn backend(&self) -> &'static str {
                $backend
            }
            fn publish_failure(&mut self, _: &$crate::error::Error, _: bool) {
                match self.never {}
            }
            fn all_reduce(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
                _: &mut [u8],
                _: $crate::dtype::ElemType,
                _: $crate::dtype::ReduceOp,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
            fn all_gather(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
                _: &[u8],
                _: &mut [u8],
                _: &[usize],
                _: $crate::dtype::ElemType,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
            fn reduce_scatter(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
                _: &[u8],
                _: &mut [u8],
                _: $crate::dtype::ElemType,
                _: $crate::dtype::ReduceOp,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
            fn broadcast(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
                _: &mut [u8],
                _: $crate::dtype::ElemType,
                _: usize,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
            fn send(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
                _: &[u8],
                _: $crate::dtype::ElemType,
                _: usize,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
            fn recv(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
                _: &mut [u8],
                _: $crate::dtype::ElemType,
                _: usize,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
            fn all_to_all(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
                _: &[u8],
                _: &mut [u8],
                _: $crate::dtype::ElemType,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
            fn barrier(
                &mut self,
                _: &$crate::error::Site,
                _: std::time::Instant,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }
        }
    };
}

pub(crate) use unavailable_transport;
