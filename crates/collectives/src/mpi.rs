//! MPI communicator (feature `mpi`): the backend for CPU ranks on several hosts, started by
//! `mpirun`, whose bytes move through the system's MPI library (OpenMPI), and so through its
//! transports (shared memory on one host; TCP, InfiniBand or EFA across hosts).
//!
//! [`MpiComm`] implements every [`Communicator`](crate::Communicator) operation with MPI's
//! collectives and point-to-point calls (`MPI_Allreduce`, `MPI_Allgather(v)`,
//! `MPI_Reduce_scatter_block`, `MPI_Bcast`, `MPI_Alltoall`, `MPI_Send`/`MPI_Recv`) on the
//! caller's buffers, after an agreement described below. `f32`,
//! `i64` and `u8` reduce with MPI's own operators; `f16` and `bf16`, which MPI has no type
//! for, are exchanged as bytes and reduced here in `f32`, in rank order, as the other CPU
//! backends do. The all-reduce copies its input once (MPI cannot reduce in place through the
//! `mpi` crate).
//!
//! # What MPI guarantees, and what tpctl adds
//!
//! MPI calls have no deadline: a blocking collective waits for its peers forever, and MPI
//! cannot cancel a collective once it started. What bounds a wait is the launcher: under
//! `mpirun`, OpenMPI ends the whole job when a rank exits without `MPI_Finalize` or is killed
//! (with a message naming the rank), so a dead peer does not hang the others. A peer that is
//! alive but never arrives (stuck, or failed and waiting for something else) is not detected
//! by MPI at all, and MPI does not check that the ranks called the same operation with the
//! same sizes: mismatched calls hang or corrupt memory.
//!
//! So every call here first has each rank send its descriptor of the call (operation, dtype,
//! reduce operator, call count, bytes, root or sizes) to every peer, on a communicator of its
//! own, and polls those messages with `MPI_Test` against the call's deadline, the
//! [`AbortHandle`](crate::AbortHandle) and failure words from peers. This is where a call
//! fails the way it fails on `shm` and `tcp`: [`Error::Timeout`](crate::Error::Timeout)
//! naming the ranks whose descriptor did not come, [`Error::Mismatch`](crate::Error::Mismatch)
//! naming the field that differs, [`Error::PeerFailed`](crate::Error::PeerFailed) when a peer
//! published its failure ([`Communicator::fail`](crate::Communicator::fail), or any failed
//! call, sends it to every peer), [`Error::Aborted`](crate::Error::Aborted). Only the buffers
//! of this exchange are in MPI's hands then, and they are the communicator's own, so the
//! receives are cancelled and the call returns. The exchange costs one small message to and
//! from each peer per call (a few microseconds on one host).
//!
//! Once every rank has agreed, the data moves in MPI's blocking call (OpenMPI's blocking
//! collectives use its tuned algorithms; its nonblocking ones, polled, were 10-30% slower on
//! one host), under a watchdog thread of the process that holds each call's deadline. MPI
//! cannot interrupt or cancel the call, and it owns the caller's buffers until the call
//! returns, so a rank cannot give up on it and return. If the deadline passes (a peer stalled
//! after agreeing; a dead one ends the job through `mpirun` first), the watchdog logs the
//! error (operation, group, rank; through `tracing`) and ends the job with `MPI_Abort` and
//! error code 75, which under `mpirun` stops every rank, and `mpirun` exits with 75. An abort
//! through the handle during the data phase lets the data finish and then fails the call with
//! [`Error::Aborted`](crate::Error::Aborted).
//!
//! Set-up: MPI is initialized once per process, with `MPI_THREAD_MULTIPLE` (TP, CP and control
//! groups may be used from different threads), the first time a group is made, and finalized
//! when the process exits. A group is made with `MPI_Comm_create_group`, which only its members
//! call; the ranks must be MPI's world ranks (`OMPI_COMM_WORLD_RANK`, which the rendezvous
//! reads), so the processes must be started by `mpirun`.
//!
//! Without the feature `mpi` every entry point returns [`Error::NotCompiledWith`]; with it,
//! [`Error::BackendUnavailable`] when MPI cannot start or lacks thread support.

#[cfg(not(feature = "mpi"))]
use crate::error::Error;
use crate::error::Result;

#[cfg(feature = "mpi")]
mod imp;
#[cfg(feature = "mpi")]
pub use imp::MpiComm;
#[cfg(not(feature = "mpi"))]
mod stub;
#[cfg(not(feature = "mpi"))]
pub use stub::MpiComm;

/// Starts MPI in this process (once) and returns MPI's view of it: (world rank, world size).
///
/// # Errors
/// [`Error::NotCompiledWith`] without the feature `mpi`; [`Error::BackendUnavailable`] when
/// MPI does not start or does not offer `MPI_THREAD_MULTIPLE`.
pub fn world() -> Result<(usize, usize)> {
    #[cfg(not(feature = "mpi"))]
    {
        Err(Error::NotCompiledWith { feature: "mpi" })
    }
    #[cfg(feature = "mpi")]
    {
        imp::world()
    }
}
