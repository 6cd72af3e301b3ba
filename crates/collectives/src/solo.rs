//! The communicator of a one-rank group: every collective is the identity (or a copy).

use crate::comm::{check, AbortHandle, Communicator, DEFAULT_TIMEOUT};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Op, Result};
use std::sync::Arc;
use std::time::Duration;

/// A group of one: what an inert single-rank [`ParallelContext`](crate::ParallelContext) holds.
/// Arguments are still checked, so code that runs on one rank is refused the same way it
/// would be on many.
#[derive(Debug)]
pub struct Solo {
    group: Arc<str>,
    timeout: Duration,
    abort: AbortHandle,
}

impl Solo {
    /// A one-rank group named `group`.
    pub fn new(group: &str) -> Solo {
        Solo { group: group.into(), timeout: DEFAULT_TIMEOUT, abort: AbortHandle::default() }
    }

    fn site(&self, op: Op) -> crate::Site {
        check::site(op, &self.group, 0, 1)
    }
}

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn group(&self) -> &str {
        &self.group
    }
    fn backend(&self) -> &'static str {
        "solo"
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
    fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    fn fail(&mut self, _reason: &str) {
        // Nobody else to tell.
    }

    fn all_reduce_raw(&mut self, buf: &mut [u8], dtype: DType, _op: ReduceOp) -> Result<()> {
        check::elements(&self.site(Op::AllReduce), "buffer", buf, dtype)
    }

    fn all_gather_uneven_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        dtype: DType,
    ) -> Result<()> {
        check::gather(&self.site(Op::AllGatherUneven), send, recv, sizes, dtype)?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn reduce_scatter_raw(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        _op: ReduceOp,
    ) -> Result<()> {
        let at = self.site(Op::ReduceScatter);
        check::elements(&at, "send buffer", send, dtype)?;
        check::chunked(&at, send, recv.len(), "send buffer")?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn broadcast_raw(&mut self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        let at = self.site(Op::Broadcast);
        check::elements(&at, "buffer", buf, dtype)?;
        check::rank(&at, "root", root)
    }

    fn send_raw(&mut self, _buf: &[u8], _dtype: DType, peer: usize) -> Result<()> {
        check::peer(&self.site(Op::Send), peer)
    }

    fn recv_raw(&mut self, _buf: &mut [u8], _dtype: DType, peer: usize) -> Result<()> {
        check::peer(&self.site(Op::Recv), peer)
    }

    fn all_to_all_raw(&mut self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let at = self.site(Op::AllToAll);
        check::elements(&at, "send buffer", send, dtype)?;
        check::chunked(&at, send, recv.len(), "send buffer")?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
}
