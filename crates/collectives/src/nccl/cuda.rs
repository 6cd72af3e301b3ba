//! The NCCL communicator itself (feature `cuda`): set-up, staging, the waiting loop that is its
//! watchdog, and the device entry points.

use crate::call::{self, GroupCore, Transport};
#[cfg(doc)]
use crate::comm::Communicator;
use crate::comm::{check, DeviceRange, DeviceStream};
use crate::common::{blame_word, blamed};
use crate::dtype::{ElemType, ReduceOp};
use crate::error::{Error, Op, Result, Site};
use crate::nccl::{NcclId, BINDINGS_VERSION, ID_BYTES, MIN_VERSION};
use cudarc::driver::{
    result as cu, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DriverError,
};
use cudarc::nccl::sys;
use mesh::Store;
use std::ffi::{c_void, CStr};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// A device address, as the CUDA driver writes it.
type DevPtr = cudarc::driver::sys::CUdeviceptr;

/// How long a wait spins before it starts sleeping: collectives of a decode step take tens of
/// microseconds, and a sleep costs about as much.
const SPIN: Duration = Duration::from_micros(200);
/// Longest sleep between two polls, so the abort handle and the deadline are noticed promptly.
const MAX_NAP: Duration = Duration::from_millis(1);
/// When a wait first looks at the group's failure key, and how often after that: a store
/// round trip is cheap, but not free.
const STORE_FIRST: Duration = Duration::from_millis(20);
const STORE_EVERY: Duration = Duration::from_millis(100);
/// Deadline of one store call made while failing, so failing never blocks for long.
const STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL decide".
const UNDEF: i32 = i32::MIN;
/// Functions this backend calls, checked once so that a library missing one is a clear error
/// instead of cudarc's panic at the first call.
const SYMBOLS: [&str; 16] = [
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRankConfig",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclAllReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclBroadcast",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclCommCount",
];

/// Loads and checks the CUDA driver and NCCL once per process; the reason when unusable.
pub(super) fn probe() -> std::result::Result<(), String> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: the probe only tries to dlopen the library; it calls nothing in it.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err("the CUDA driver library (libcuda) cannot be loaded".to_owned());
            }
            cu::init().map_err(|e| format!("cuInit failed: {e}"))?;
            // SAFETY: as above, for libnccl.
            if !unsafe { sys::is_culib_present() } {
                return Err(format!(
                    "the NCCL library cannot be loaded (looked for {}; NCCL ships as \
                     libnccl.so.2: put a libnccl.so link to it on LD_LIBRARY_PATH)",
                    cudarc::get_lib_name_candidates("nccl").join(", ")
                ));
            }
            // SAFETY: the library is present (checked above), so `culib` loads it without
            // panicking; looking a symbol up calls nothing.
            let lib = unsafe { sys::culib() };
            for name in SYMBOLS {
                // SAFETY: the symbol is only looked up, never called through this type.
                if unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
                    return Err(format!("the NCCL library has no {name}: it is too old"));
                }
            }
            let v = version()?;
            if v < MIN_VERSION {
                return Err(format!(
                    "NCCL {} is too old: 2.14 or newer is needed",
                    show_version(v)
                ));
            }
            Ok(())
        })
        .clone()
}

/// The loaded library's version code.
pub(super) fn version() -> std::result::Result<i32, String> {
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer; the symbol exists (or cudarc panics, which `probe`
    // rules out before any caller gets here).
    let code = unsafe { sys::ncclGetVersion(&mut v) };
    match code {
        sys::ncclResult_t::ncclSuccess => Ok(v),
        code => Err(format!("ncclGetVersion failed: {}", describe(code, std::ptr::null_mut()))),
    }
}

fn show_version(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100)
}

pub(super) fn device_count() -> Result<usize> {
    let n = cu::device::get_count().map_err(|e| Error::BackendUnavailable {
        backend: "nccl",
        reason: format!("cuDeviceGetCount failed: {e}"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(super) fn unique_id() -> Result<NcclId> {
    let mut id = sys::ncclUniqueId { internal: [0; ID_BYTES] };
    // SAFETY: `id` is a valid out-pointer; `available` checked the symbol.
    let code = unsafe { sys::ncclGetUniqueId(&mut id) };
    if code != sys::ncclResult_t::ncclSuccess {
        return Err(Error::BackendUnavailable {
            backend: "nccl",
            reason: format!("ncclGetUniqueId failed: {}", describe(code, std::ptr::null_mut())),
        });
    }
    // `c_char` is `i8` or `u8` depending on the target; either way a byte.
    Ok(NcclId(id.internal.map(|c| c as u8)))
}

/// NCCL's name and description of `code`, with the communicator's last error message.
fn describe(code: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: both return pointers to static or thread-local NUL-terminated strings (or null),
    // which are copied out at once; a null `comm` asks for the thread's last error.
    let (what, last) = unsafe {
        let text = |p: *const std::ffi::c_char| {
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        (text(sys::ncclGetErrorString(code)), text(sys::ncclGetLastError(comm)))
    };
    let mut s = format!("{code:?}");
    if !what.is_empty() {
        s.push_str(&format!(" ({what})"));
    }
    if !last.is_empty() {
        s.push_str(&format!(": {last}"));
    }
    s
}

fn nccl_type(dtype: ElemType) -> sys::ncclDataType_t {
    match dtype {
        ElemType::U8 => sys::ncclDataType_t::ncclUint8,
        ElemType::F32 => sys::ncclDataType_t::ncclFloat32,
        ElemType::F16 => sys::ncclDataType_t::ncclFloat16,
        ElemType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        ElemType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

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

/// The device staging buffer of the host API, grown on demand.
struct Staging {
    buf: CudaSlice<u8>,
    ptr: DevPtr,
}

/// A member of an NCCL communicator. See the [module documentation](crate::nccl).
pub struct NcclCommunicator {
    core: GroupCore,
    device: usize,
    comm: RawComm,
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
        Self::init(&id, group, rank, size, device, timeout, Some(fail))
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
        Self::init(id, group, rank, size, device, timeout, None)
    }

    fn init(
        id: &NcclId,
        group: &str,
        rank: usize,
        size: usize,
        device: usize,
        timeout: Duration,
        fail_key: Option<FailKey>,
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
        // SAFETY: `raw` and `config` are valid for the call; the device's context is current on
        // this thread, which is how NCCL picks the device. Non-blocking: NCCL finishes the set-up
        // in the background and `wait` below polls it.
        let code = unsafe {
            sys::ncclCommInitRankConfig(
                &mut raw,
                nranks,
                sys::ncclUniqueId { internal },
                myrank,
                &mut config,
            )
        };
        let mut comm = NcclCommunicator {
            core: GroupCore::new(group, rank, size, timeout),
            device,
            comm: RawComm(raw),
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

    fn publish(&self, word: u32) {
        if let Some(f) = &self.fail_key {
            if let Err(e) = f.store.set(&f.key, format!("{}:{word}", self.core.rank).as_bytes()) {
                tracing::warn!(group = %self.core.group, rank = self.core.rank, "could not publish a failure: {e}");
            }
        }
    }

    fn abort_comm(&mut self) {
        let raw = std::mem::replace(&mut self.comm.0, std::ptr::null_mut());
        if !raw.is_null() {
            // SAFETY: `raw` is this communicator's live handle, used by no other thread (see
            // `RawComm`), and never used again: the field is null from here on.
            let code = unsafe { sys::ncclCommAbort(raw) };
            if code != sys::ncclResult_t::ncclSuccess {
                tracing::warn!(group = %self.core.group, rank = self.core.rank, "ncclCommAbort: {code:?}");
            }
        }
    }

    /// NCCL's asynchronous state: `Ok(true)` when idle, `Ok(false)` while an operation is still
    /// being set up or enqueued (`ncclInProgress`), an error when NCCL failed.
    fn async_state(&self, at: &Site) -> Result<bool> {
        let raw = self.comm.0;
        if raw.is_null() {
            return Err(Error::Aborted { at: at.clone() });
        }
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is live (not null) and used only by this thread; `state` is valid.
        let code = unsafe { sys::ncclCommGetAsyncError(raw, &mut state) };
        let failed = |call, code| Error::Nccl { at: at.clone(), call, reason: describe(code, raw) };
        match (code, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => Ok(true),
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => Ok(false),
            (sys::ncclResult_t::ncclSuccess, state) => Err(failed("operation", state)),
            (code, _) => Err(failed("ncclCommGetAsyncError", code)),
        }
    }

    /// The watchdog: polls until NCCL is idle and `ready` says so, failing on an NCCL error,
    /// abort, a peer's published failure, or the deadline.
    fn wait(
        &self,
        at: &Site,
        start: Instant,
        deadline: Instant,
        mut ready: impl FnMut(&Self) -> Result<bool>,
    ) -> Result<()> {
        let mut nap = Duration::from_micros(20);
        let mut next_store = start + STORE_FIRST;
        loop {
            if self.async_state(at)? && ready(self)? {
                return Ok(());
            }
            if self.core.abort.is_aborted() {
                return Err(Error::Aborted { at: at.clone() });
            }
            let now = Instant::now();
            if now >= next_store {
                if let Some(f) = &self.fail_key {
                    if let Some(e) = peer_failure(&f.store, &f.key, at, self.core.rank, now - start)
                    {
                        return Err(e);
                    }
                }
                next_store = now + STORE_EVERY;
            }
            if now >= deadline {
                return Err(Error::Timeout {
                    at: at.clone(),
                    elapsed: now - start,
                    waiting_for: self.others(),
                });
            }
            if now - start < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(MAX_NAP);
            }
        }
    }

    /// Runs one NCCL operation: `enqueue` issues its calls on the communicator's stream; then
    /// waits for it under the watchdog.
    fn run(
        &mut self,
        at: &Site,
        enqueue: impl FnOnce(&Self) -> std::result::Result<(), (&'static str, sys::ncclResult_t)>,
    ) -> Result<()> {
        let start = Instant::now();
        let deadline = start + self.core.timeout;
        self.accept(at, start, deadline, enqueue)?;
        self.done.record(&self.stream).map_err(cuda_err(at, "cuEventRecord"))?;
        self.wait(at, start, deadline, |me| {
            me.done.try_is_complete().map_err(cuda_err(at, "cuEventQuery"))
        })
    }

    /// Issues `enqueue`'s calls and waits until NCCL has accepted them (a non-blocking
    /// communicator may still be enqueuing when its calls return).
    fn accept(
        &mut self,
        at: &Site,
        start: Instant,
        deadline: Instant,
        enqueue: impl FnOnce(&Self) -> std::result::Result<(), (&'static str, sys::ncclResult_t)>,
    ) -> Result<()> {
        if let Err((call, code)) = enqueue(self) {
            return Err(Error::Nccl { at: at.clone(), call, reason: describe(code, self.comm.0) });
        }
        self.wait(at, start, deadline, |_| Ok(true))
    }

    /// Waits, under the watchdog, for the reduction queued on a caller's stream, if one is
    /// in flight: within the call deadline counted from its enqueue.
    fn settle(&mut self, at: &Site) -> Result<()> {
        let Some(since) = self.in_flight else { return Ok(()) };
        self.wait(at, since, since + self.core.timeout, |me| {
            me.done.try_is_complete().map_err(cuda_err(at, "cuEventQuery"))
        })?;
        self.in_flight = None;
        Ok(())
    }

    /// A device buffer of at least `bytes`, its base address.
    fn staging(&mut self, at: &Site, bytes: usize) -> Result<DevPtr> {
        if self.staging.as_ref().is_none_or(|s| s.buf.len() < bytes) {
            self.staging = None;
            let cap = bytes.max(4096).next_power_of_two();
            let buf = self.stream.alloc_zeros::<u8>(cap).map_err(cuda_err(at, "cuMemAlloc"))?;
            let ptr = {
                let (ptr, _sync) = buf.device_ptr(&self.stream);
                ptr
            };
            self.staging = Some(Staging { buf, ptr });
        }
        Ok(self.staging.as_ref().map_or(0, |s| s.ptr))
    }

    fn upload(&self, at: &Site, dst: DevPtr, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` points into the staging buffer with room for `src` (the caller sized
        // it), on this communicator's context, which is current.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(cuda_err(at, "cuMemcpyHtoDAsync"))
    }

    fn download(&self, at: &Site, dst: &mut [u8], src: DevPtr) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` points into the staging buffer holding at least `dst.len()` bytes; the
        // copy into pageable memory returns once it is complete, and the stream holds no other
        // work (the operation before it finished under `run`).
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(cuda_err(at, "cuMemcpyDtoHAsync"))
    }

    fn sync(&self, at: &Site) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err(at, "cuStreamSynchronize"))
    }

    fn raw(&self) -> sys::ncclComm_t {
        self.comm.0
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }
}

/// The error a peer's published failure means for this rank, if the group's failure key is set.
fn peer_failure(
    store: &Store,
    key: &str,
    at: &Site,
    me: usize,
    elapsed: Duration,
) -> Option<Error> {
    let value = store.get(key).ok().flatten()?;
    let text = String::from_utf8_lossy(&value);
    let (reporter, word) = text.split_once(':')?;
    let (reporter, word) = (reporter.parse::<usize>().ok()?, word.parse::<u32>().ok()?);
    if reporter == me {
        return None;
    }
    blamed(word, at, reporter, |_| 0, elapsed)
}

/// An NCCL call's result as `run` wants it.
fn ok(
    call: &'static str,
    code: sys::ncclResult_t,
) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
    match code {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        code => Err((call, code)),
    }
}

/// The enqueue half of each operation, on device addresses. All `unsafe`: the addresses must
/// be valid for the sizes given, on the communicator's device.
impl NcclCommunicator {
    /// # Safety
    /// `src` and `dst` hold `count` elements of `dtype` on this communicator's device, and
    /// `stream` is a live stream of it (its own, [`NcclCommunicator::cu_stream`], or a
    /// caller's).
    unsafe fn enqueue_all_reduce(
        &self,
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        dtype: ElemType,
        op: ReduceOp,
        stream: sys::cudaStream_t,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclAllReduce(
                src as *const c_void,
                dst as *mut c_void,
                count,
                nccl_type(dtype),
                nccl_op(op),
                self.raw(),
                stream,
            )
        };
        ok("ncclAllReduce", code)
    }

    /// # Safety
    /// `src` holds `bytes`, `dst` `size * bytes` on this communicator's device.
    unsafe fn enqueue_all_gather(
        &self,
        src: DevPtr,
        dst: DevPtr,
        bytes: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclAllGather(
                src as *const c_void,
                dst as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclAllGather", code)
    }

    /// # Safety
    /// `src` holds `size * count`, `dst` `count` elements of `dtype` on this device.
    unsafe fn enqueue_reduce_scatter(
        &self,
        src: DevPtr,
        dst: DevPtr,
        count: usize,
        dtype: ElemType,
        op: ReduceOp,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclReduceScatter(
                src as *const c_void,
                dst as *mut c_void,
                count,
                nccl_type(dtype),
                nccl_op(op),
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclReduceScatter", code)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    unsafe fn enqueue_broadcast(
        &self,
        buf: DevPtr,
        bytes: usize,
        root: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract; in place, as NCCL allows.
        let code = unsafe {
            sys::ncclBroadcast(
                buf as *const c_void,
                buf as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                root as i32,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclBroadcast", code)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    unsafe fn enqueue_send(
        &self,
        buf: DevPtr,
        bytes: usize,
        peer: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclSend(
                buf as *const c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                peer as i32,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclSend", code)
    }

    /// # Safety
    /// `buf` holds `bytes` on this device.
    unsafe fn enqueue_recv(
        &self,
        buf: DevPtr,
        bytes: usize,
        peer: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: per this function's contract.
        let code = unsafe {
            sys::ncclRecv(
                buf as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                peer as i32,
                self.raw(),
                self.cu_stream(),
            )
        };
        ok("ncclRecv", code)
    }

    /// # Safety
    /// `src` and `dst` hold `size * chunk` bytes on this device.
    unsafe fn enqueue_all_to_all(
        &self,
        src: DevPtr,
        dst: DevPtr,
        chunk: usize,
    ) -> std::result::Result<(), (&'static str, sys::ncclResult_t)> {
        // SAFETY: group calls take no pointers.
        ok("ncclGroupStart", unsafe { sys::ncclGroupStart() })?;
        let mut result = Ok(());
        for peer in 0..self.core.size {
            let off = (peer * chunk) as DevPtr;
            // SAFETY: chunk `peer` of each buffer is in bounds per this function's contract.
            result = unsafe { self.enqueue_send(src + off, chunk, peer) }
                .and_then(|()| unsafe { self.enqueue_recv(dst + off, chunk, peer) });
            if result.is_err() {
                break;
            }
        }
        // The group is closed even after a failed call, so NCCL's group state stays sane.
        // SAFETY: as above.
        let end = ok("ncclGroupEnd", unsafe { sys::ncclGroupEnd() });
        result.and(end)
    }
}

impl Transport for NcclCommunicator {
    fn core(&self) -> &GroupCore {
        &self.core
    }
    fn core_mut(&mut self) -> &mut GroupCore {
        &mut self.core
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }

    /// Once: the failure published through the store (unless it came from a peer, or is a
    /// timeout every rank sees by itself), then the NCCL communicator aborted, which stops any
    /// kernel of it still running.
    fn publish_failure(&mut self, error: &Error, first: bool) {
        if !first {
            return;
        }
        let from_peer = matches!(error, Error::PeerFailed { .. } | Error::PeerDied { .. });
        if !from_peer && !matches!(error, Error::Timeout { .. }) {
            self.publish(blame_word(error, self.core.rank));
        }
        self.abort_comm();
    }

    /// Makes this communicator's CUDA context current on the calling thread, and waits for a
    /// reduction still in flight on a caller's stream (`settle`): the operations of one
    /// communicator never overlap on the device, whichever streams they were queued on.
    fn enter(&mut self, at: &Site) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(cuda_err(at, "cuCtxSetCurrent"))?;
        self.settle(at)
    }

    fn cuda_device(&self) -> Option<usize> {
        Some(self.device)
    }

    unsafe fn all_reduce_device(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let (ptr, bytes) = (buf.addr, buf.bytes);
        // SAFETY: the caller guarantees `bytes` bytes of this device at `ptr`, untouched by
        // other work until the reduction (waited for by `run`) completes.
        self.run(at, |me| unsafe {
            me.enqueue_all_reduce(ptr, ptr, bytes / dtype.size(), dtype, op, me.cu_stream())
        })
    }

    unsafe fn all_reduce_device_enqueue(
        &mut self,
        at: &Site,
        deadline: Instant,
        buf: DeviceRange,
        dtype: ElemType,
        op: ReduceOp,
        stream: DeviceStream,
    ) -> Result<()> {
        let start = Instant::now();
        let (ptr, count) = (buf.addr, buf.bytes / dtype.size());
        let raw = stream.raw as sys::cudaStream_t;
        // SAFETY: the caller guarantees `buf` on this device and `stream` a live stream of
        // it, with only the stream's own work touching `buf` until the reduction completes
        // (`settle`, from the next call's `enter`).
        self.accept(at, start, deadline, |me| unsafe {
            me.enqueue_all_reduce(ptr, ptr, count, dtype, op, raw)
        })?;
        // SAFETY: `done` is this communicator's event, of this device's primary context, as
        // the caller guarantees `stream` is.
        unsafe { cu::event::record(self.done.cu_event(), stream.raw as _) }
            .map_err(cuda_err(at, "cuEventRecord"))?;
        self.in_flight = Some(start);
        Ok(())
    }

    fn device_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    fn all_reduce(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        self.upload(at, dev, buf)?;
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe {
            me.enqueue_all_reduce(dev, dev, buf.len() / dtype.size(), dtype, op, me.cu_stream())
        })?;
        self.download(at, buf, dev)?;
        self.sync(at)
    }

    fn all_gather(
        &mut self,
        at: &Site,
        _deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        sizes: &[usize],
        _dtype: ElemType,
    ) -> Result<()> {
        // NCCL gathers equal shards: pad each to the widest, drop the padding after.
        let width = sizes.iter().copied().max().unwrap_or(0);
        let dev = self.staging(at, width * (self.core.size + 1))?;
        let out = dev + width as DevPtr;
        self.upload(at, dev, send)?;
        // SAFETY: the staging buffer holds `width` bytes at `dev` and `size * width` after.
        self.run(at, |me| unsafe { me.enqueue_all_gather(dev, out, width) })?;
        let mut off = 0;
        for (r, &n) in sizes.iter().enumerate() {
            let src = out + (r * width) as DevPtr;
            self.download(at, &mut recv[off..off + n], src)?;
            off += n;
        }
        self.sync(at)
    }

    fn reduce_scatter(
        &mut self,
        at: &Site,
        _deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        let dev = self.staging(at, send.len() + recv.len())?;
        let out = dev + send.len() as DevPtr;
        self.upload(at, dev, send)?;
        let count = recv.len() / dtype.size();
        // SAFETY: `size * count` elements at `dev`, `count` at `out`.
        self.run(at, |me| unsafe { me.enqueue_reduce_scatter(dev, out, count, dtype, op) })?;
        self.download(at, recv, out)?;
        self.sync(at)
    }

    fn broadcast(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &mut [u8],
        _dtype: ElemType,
        root: usize,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        if self.core.rank == root {
            self.upload(at, dev, buf)?;
        }
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe { me.enqueue_broadcast(dev, buf.len(), root) })?;
        if self.core.rank != root {
            self.download(at, buf, dev)?;
        }
        self.sync(at)
    }

    fn send(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &[u8],
        _dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        self.upload(at, dev, buf)?;
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe { me.enqueue_send(dev, buf.len(), peer) })
            .map_err(|e| name_peer(e, peer))
    }

    fn recv(
        &mut self,
        at: &Site,
        _deadline: Instant,
        buf: &mut [u8],
        _dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        let dev = self.staging(at, buf.len())?;
        // SAFETY: the staging buffer holds `buf.len()` bytes at `dev`.
        self.run(at, |me| unsafe { me.enqueue_recv(dev, buf.len(), peer) })
            .and_then(|()| self.download(at, buf, dev))
            .and_then(|()| self.sync(at))
            .map_err(|e| name_peer(e, peer))
    }

    fn all_to_all(
        &mut self,
        at: &Site,
        _deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        _dtype: ElemType,
    ) -> Result<()> {
        let chunk = send.len() / self.core.size;
        let dev = self.staging(at, 2 * send.len())?;
        let out = dev + send.len() as DevPtr;
        self.upload(at, dev, send)?;
        // SAFETY: `size * chunk` bytes at `dev` and at `out`.
        self.run(at, |me| unsafe { me.enqueue_all_to_all(dev, out, chunk) })?;
        self.download(at, recv, out)?;
        self.sync(at)
    }

    fn barrier(&mut self, at: &Site, _deadline: Instant) -> Result<()> {
        let dev = self.staging(at, 1)?;
        // SAFETY: the staging buffer holds at least one byte at `dev`; its value is irrelevant.
        self.run(at, |me| unsafe {
            me.enqueue_all_reduce(dev, dev, 1, ElemType::U8, ReduceOp::Max, me.cu_stream())
        })?;
        self.sync(at)
    }
}

/// A timeout of a send or receive waits for exactly one peer.
fn name_peer(e: Error, peer: usize) -> Error {
    match e {
        Error::Timeout { at, elapsed, .. } => {
            Error::Timeout { at, elapsed, waiting_for: vec![peer] }
        }
        e => e,
    }
}

/// Device entry points: the same operations on buffers already on this communicator's device,
/// for the CUDA tensor backend. Each returns when the operation has completed (the same
/// watchdog as the host API); lengths are in bytes, as in [`Communicator`].
impl NcclCommunicator {
    fn device_call(
        &mut self,
        op: Op,
        body: impl FnOnce(&mut Self, &Site) -> Result<()>,
    ) -> Result<()> {
        call::run(self, op, |me, at, _| body(me, at))
    }

    /// In-place all-reduce of `buf`, which holds elements of `dtype` on this device.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_raw`].
    pub fn all_reduce_device(
        &mut self,
        buf: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        self.device_call(Op::AllReduce, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe {
                me.enqueue_all_reduce(ptr, ptr, len / dtype.size(), dtype, op, me.cu_stream())
            })
        })
    }

    /// Equal all-gather: `recv` gets every rank's `send` in rank order
    /// (`recv.len() == size * send.len()`).
    ///
    /// # Errors
    /// As [`Communicator::all_gather_raw`].
    pub fn all_gather_device(
        &mut self,
        send: &impl DevicePtr<u8>,
        recv: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
    ) -> Result<()> {
        self.device_call(Op::AllGather, |me, at| {
            let (n, total) = (send.len(), recv.len());
            check::device_elements(at, "send buffer", n, dtype)?;
            if total != n * me.core.size {
                return Err(check::invalid(
                    at,
                    format!("receive buffer has {total} bytes, not {} ranks x {n}", me.core.size),
                ));
            }
            let stream = me.stream.clone();
            let (src, _s) = send.device_ptr(&stream);
            let (dst, _d) = recv.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees the sizes checked above while the guards live.
            me.run(at, |me| unsafe { me.enqueue_all_gather(src, dst, n) })
        })
    }

    /// Reduce-scatter: rank `r` gets chunk `r` of the reduction
    /// (`send.len() == size * recv.len()`).
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter_raw`].
    pub fn reduce_scatter_device(
        &mut self,
        send: &impl DevicePtr<u8>,
        recv: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        op: ReduceOp,
    ) -> Result<()> {
        self.device_call(Op::ReduceScatter, |me, at| {
            let (total, n) = (send.len(), recv.len());
            check::device_elements(at, "receive buffer", n, dtype)?;
            if total != n * me.core.size {
                return Err(check::invalid(
                    at,
                    format!("send buffer: {total} bytes is not {} ranks x {n} bytes", me.core.size),
                ));
            }
            let stream = me.stream.clone();
            let (src, _s) = send.device_ptr(&stream);
            let (dst, _d) = recv.device_ptr_mut(&stream);
            let count = n / dtype.size();
            // SAFETY: cudarc guarantees the sizes checked above while the guards live.
            me.run(at, |me| unsafe { me.enqueue_reduce_scatter(src, dst, count, dtype, op) })
        })
    }

    /// Copies `root`'s `buf` to every rank, in place.
    ///
    /// # Errors
    /// As [`Communicator::broadcast_raw`].
    pub fn broadcast_device(
        &mut self,
        buf: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        root: usize,
    ) -> Result<()> {
        self.device_call(Op::Broadcast, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            check::rank(at, "root", root)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe { me.enqueue_broadcast(ptr, len, root) })
        })
    }

    /// Sends `buf` to `peer`, which receives it with [`NcclCommunicator::recv_device`] or
    /// [`Communicator::recv_raw`].
    ///
    /// # Errors
    /// As [`Communicator::send_raw`].
    pub fn send_device(
        &mut self,
        buf: &impl DevicePtr<u8>,
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        self.device_call(Op::Send, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            check::peer(at, peer)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe { me.enqueue_send(ptr, len, peer) })
                .map_err(|e| name_peer(e, peer))
        })
    }

    /// Receives `buf` from `peer`.
    ///
    /// # Errors
    /// As [`Communicator::recv_raw`].
    pub fn recv_device(
        &mut self,
        buf: &mut impl DevicePtrMut<u8>,
        dtype: ElemType,
        peer: usize,
    ) -> Result<()> {
        self.device_call(Op::Recv, |me, at| {
            let len = buf.len();
            check::device_elements(at, "buffer", len, dtype)?;
            check::peer(at, peer)?;
            let stream = me.stream.clone();
            let (ptr, _sync) = buf.device_ptr_mut(&stream);
            // SAFETY: cudarc guarantees `len` bytes at `ptr` while `_sync` lives.
            me.run(at, |me| unsafe { me.enqueue_recv(ptr, len, peer) })
                .map_err(|e| name_peer(e, peer))
        })
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // Abort, not finalize: finalizing waits for the peers, and dropping must never block.
        // The staging buffer is freed on the stream, after any kernel still queued there.
        self.abort_comm();
    }
}
