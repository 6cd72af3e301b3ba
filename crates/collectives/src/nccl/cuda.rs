//! The NCCL communicator itself (feature `cuda`): its handles and its set-up. Its other halves
//! live in the submodules: the library, the watchdog, staging, enqueueing, the
//! [`Transport`](crate::call::Transport) impl and the device entry points.

mod device;
mod enqueue;
mod library;
mod sleep;
mod staging;
mod transport;
mod watchdog;

pub(super) use library::{device_count, probe, unique_id, version};

use crate::call::{self, GroupCore};
use crate::comm::check;
#[cfg(doc)]
use crate::comm::Communicator;
use crate::common::blame_word;
use crate::error::{Error, Op, Result, Site};
use crate::nccl::{NcclId, BINDINGS_VERSION};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};
use cudarc::nccl::sys;
use library::describe;
use mesh::Store;
use sleep::{Rejoin, Shared};
use staging::Staging;
use std::sync::Arc;
use std::time::{Duration, Instant};
use watchdog::peer_failure;

/// A device address, as the CUDA driver writes it.
type DevPtr = cudarc::driver::sys::CUdeviceptr;

/// Deadline of one store call made while failing, so failing never blocks for long.
const STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL decide".
const UNDEF: i32 = i32::MIN;

/// An `ncclComm_t` owned by one [`NcclCommunicator`]; null once aborted.
struct RawComm(sys::ncclComm_t);

// SAFETY: NCCL lets a communicator be used from any thread as long as calls on it do not
// overlap. `RawComm` is owned by one `NcclCommunicator`, whose methods take `&mut self` for
// every call that touches it, so moving it to another thread cannot create overlapping calls.
// (Not `Sync`: the abort handle shares only a flag, never the pointer.)
unsafe impl Send for RawComm {}

/// Where a rank publishes that it failed, so peers stuck in an NCCL kernel waiting for it learn
/// of it from the store.
struct FailKey {
    store: Store,
    key: String,
}

/// A member of an NCCL communicator. See the [module documentation](crate::nccl).
pub struct NcclCommunicator {
    core: GroupCore,
    device: usize,
    /// The NCCL handle, shared with the handle that releases it for a sleep (`sleep`).
    shared: Arc<Shared>,
    stream: Arc<CudaStream>,
    done: CudaEvent,
    staging: Option<Staging>,
    fail_key: Option<FailKey>,
    /// When the reduction queued on a caller's stream
    /// ([`Communicator::all_reduce_device_enqueue`]) started, until it is waited for; `done`
    /// is recorded on that stream after it.
    in_flight: Option<Instant>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("group", &self.core.group)
            .field("rank", &self.core.rank)
            .field("size", &self.core.size)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// The key of a group's unique id and of its failure flag, under the group's store prefix.
fn id_key(prefix: &str) -> String {
    format!("{prefix}/nccl-id")
}
fn failed_key(prefix: &str) -> String {
    format!("{prefix}/nccl-failed")
}

fn cuda_err<'a>(at: &'a Site, call: &'static str) -> impl Fn(DriverError) -> Error + 'a {
    move |e| Error::Cuda { at: at.clone(), call, reason: e.to_string() }
}

impl NcclCommunicator {
    /// Joins rank `rank` of a group of `size` on CUDA device `device`: the group's first member
    /// makes the NCCL unique id and publishes it in `store` under `key_prefix` (unique per group
    /// and generation); the others wait for it. A member that cannot take part publishes its
    /// failure there too, so the others fail at once instead of at the deadline.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] when NCCL or the device cannot be used; the store's errors;
    /// [`Error::Timeout`] when a member does not join within `timeout`; [`Error::PeerFailed`]
    /// when another member failed to join; [`Error::Nccl`] or [`Error::Cuda`] from the set-up.
    pub fn connect(
        store: &Store,
        key_prefix: &str,
        group: &str,
        rank: usize,
        size: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<NcclCommunicator> {
        let group_name: Arc<str> = group.into();
        let at = check::site(Op::Setup, &group_name, rank, size);
        check::rank(&at, "rank", rank)?;
        let key = id_key(key_prefix);
        let fail_key = failed_key(key_prefix);
        let publish_failure = |e: &Error| {
            let word = blame_word(e, rank);
            let _ = store.set(&fail_key, format!("{rank}:{word}").as_bytes());
        };
        let id = if rank == 0 {
            match NcclId::new() {
                Ok(id) => {
                    store.set(&key, id.as_bytes())?;
                    id
                }
                Err(e) => {
                    publish_failure(&e);
                    return Err(e);
                }
            }
        } else {
            if let Err(e) = crate::nccl::available() {
                publish_failure(&e);
                return Err(e);
            }
            let deadline = Instant::now() + timeout;
            loop {
                // Wait in short slices so a leader that failed is noticed before the deadline.
                let left = deadline.saturating_duration_since(Instant::now());
                match store.wait(&[&key], left.min(Duration::from_millis(200))) {
                    Ok(mut v) => {
                        let bytes = v.remove(0);
                        break NcclId::from_bytes(&bytes).ok_or_else(|| {
                            check::invalid(
                                &at,
                                format!(
                                    "store key {key} holds {} bytes, not an NCCL id",
                                    bytes.len()
                                ),
                            )
                        })?;
                    }
                    Err(e) => {
                        if let Some(err) = peer_failure(store, &fail_key, &at, 0, timeout - left) {
                            return Err(err);
                        }
                        if left.is_zero() {
                            return Err(Error::Timeout {
                                at,
                                elapsed: timeout,
                                waiting_for: vec![0],
                            });
                        }
                        if !matches!(e, mesh::Error::StoreTimeout { .. }) {
                            return Err(e.into());
                        }
                    }
                }
            }
        };
        // A connection of its own: the world's store client may be busy in another thread.
        let mut own = Store::connect(store.server_addr(), timeout)?;
        own.set_timeout(STORE_TIMEOUT);
        let fail = FailKey { store: own, key: fail_key };
        // And one for the sleep's handle, which meets the peers again at a wakeup.
        let rejoin = Rejoin::new(Store::connect(store.server_addr(), timeout)?, key_prefix);
        Self::init(&id, group, rank, size, device, timeout, Some(fail), Some(rejoin))
    }

    /// Joins the communicator named by `id` as rank `rank` of `size`, on CUDA device `device`,
    /// without a store: failures are not announced to the peers (they reach their deadline).
    /// For tests and for callers that hand the id around themselves.
    ///
    /// # Errors
    /// As [`NcclCommunicator::connect`], without the store's.
    pub fn from_id(
        id: &NcclId,
        group: &str,
        rank: usize,
        size: usize,
        device: usize,
        timeout: Duration,
    ) -> Result<NcclCommunicator> {
        Self::init(id, group, rank, size, device, timeout, None, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn init(
        id: &NcclId,
        group: &str,
        rank: usize,
        size: usize,
        device: usize,
        timeout: Duration,
        fail_key: Option<FailKey>,
        rejoin: Option<Rejoin>,
    ) -> Result<NcclCommunicator> {
        crate::nccl::available()?;
        let group: Arc<str> = group.into();
        let at = check::site(Op::Setup, &group, rank, size);
        check::rank(&at, "rank", rank)?;
        let (Ok(nranks), Ok(myrank)) = (i32::try_from(size), i32::try_from(rank)) else {
            return Err(check::invalid(&at, format!("a group of {size} ranks is too large")));
        };
        let count = device_count()?;
        if device >= count {
            return Err(Error::BackendUnavailable {
                backend: "nccl",
                reason: format!(
                    "{at}: cuda:{device} is not visible (this process sees {count} CUDA devices)"
                ),
            });
        }
        let ctx = CudaContext::new(device).map_err(cuda_err(&at, "cuDevicePrimaryCtxRetain"))?;
        ctx.bind_to_thread().map_err(cuda_err(&at, "cuCtxSetCurrent"))?;
        let stream = ctx.new_stream().map_err(cuda_err(&at, "cuStreamCreate"))?;
        let done = ctx.new_event(None).map_err(cuda_err(&at, "cuEventCreate"))?;

        let (raw, code) = start_init(id, nranks, myrank);
        let mut comm = NcclCommunicator {
            core: GroupCore::new(group.clone(), rank, size, timeout),
            device,
            shared: Arc::new(Shared::new(
                RawComm(raw),
                rejoin,
                (group.clone(), rank, size),
                device,
                timeout,
            )),
            stream,
            done,
            staging: None,
            fail_key,
            in_flight: None,
        };
        let start = Instant::now();
        let result = match code {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {
                comm.wait(&at, start, start + timeout, |_| Ok(true))
            }
            code => Err(Error::Nccl {
                at: at.clone(),
                call: "ncclCommInitRankConfig",
                reason: describe(code, raw),
            }),
        };
        call::finish(&mut comm, result)?;
        Ok(comm)
    }

    /// The CUDA device ordinal of this communicator.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The stream NCCL operations run on. Device buffers passed to the device entry points
    /// may be written on other streams: cudarc makes this stream wait for those writes.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn others(&self) -> Vec<usize> {
        (0..self.core.size).filter(|&r| r != self.core.rank).collect()
    }

    fn raw(&self) -> sys::ncclComm_t {
        self.shared.raw()
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }
}

/// Starts NCCL's set-up of rank `myrank` of `nranks` in the communicator `id` names, on the
/// device whose context is current on this thread (how NCCL picks the device), non-blocking:
/// NCCL finishes it in the background, and the caller polls it. The handle (null when the
/// call failed at once) and the call's code.
fn start_init(id: &NcclId, nranks: i32, myrank: i32) -> (sys::ncclComm_t, sys::ncclResult_t) {
    let mut config = sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL reads only the fields it knows (up to its own `size`) and fills in the rest.
        version: BINDINGS_VERSION as u32,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    };
    let internal = id.as_bytes().map(|b| b as std::ffi::c_char);
    let mut raw: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: `raw` and `config` are valid for the call; the caller made the device's context
    // current on this thread.
    let code = unsafe {
        sys::ncclCommInitRankConfig(
            &mut raw,
            nranks,
            sys::ncclUniqueId { internal },
            myrank,
            &mut config,
        )
    };
    (raw, code)
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // Abort, not finalize: finalizing waits for the peers, and dropping must never block.
        // The staging buffer is freed on the stream, after any kernel still queued there.
        self.abort_comm();
        // A sleep's handle that outlives this restores nothing.
        self.shared.owner_gone();
    }
}
