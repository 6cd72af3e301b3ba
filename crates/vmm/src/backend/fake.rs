//! A backend for tests that imitates device memory on the heap: the host cannot address it,
//! host allocations are counted (and their frees), every chunked-copy call is recorded, a
//! chosen chunk's copy can be made to fail, and a queued chunk is copied only when it is
//! waited for or drained, as an asynchronous device finishes it, so a caller that used host
//! memory before waiting would see stale bytes.

use super::{Backend, HostBuf, Init, Phys};
use crate::chunked::Direction;
use crate::error::{Error, Result};
use crate::policy::BackupStore;
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The fake's granularity: small, so tests cut small allocations into several chunks.
pub(crate) const GRANULARITY: usize = 4096;

/// Bytes a fresh mapping holds before anything writes it (device memory is undefined).
pub(crate) const GARBAGE: u8 = 0xa5;

/// One chunked-copy call, with offsets relative to the allocation's base.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Begin(Direction),
    Start { direction: Direction, chunk: usize, offset: usize, len: usize },
    Wait(usize),
    Drain,
}

/// What a test reads of the fake and how it steers it; shared with the backend.
#[derive(Default)]
pub(crate) struct Probe {
    host_allocs: AtomicUsize,
    host_frees: Arc<AtomicUsize>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    calls: Vec<Call>,
    /// Bytes of each host allocation, in order.
    host_alloc_sizes: Vec<usize>,
    /// A chunk copy that fails to start, once.
    fail: Option<Fail>,
    /// The most chunks queued and not waited for at any time.
    max_in_flight: usize,
}

impl Probe {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Host allocations made so far.
    pub(crate) fn host_allocs(&self) -> usize {
        self.host_allocs.load(Ordering::SeqCst)
    }

    /// Host allocations freed so far.
    pub(crate) fn host_frees(&self) -> usize {
        self.host_frees.load(Ordering::SeqCst)
    }

    /// The size of each host allocation, in order.
    pub(crate) fn host_alloc_sizes(&self) -> Vec<usize> {
        self.inner().host_alloc_sizes.clone()
    }

    /// Every chunked-copy call so far; clears the record.
    pub(crate) fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut self.inner().calls)
    }

    /// The most chunks that were queued and not waited for at once.
    pub(crate) fn max_in_flight(&self) -> usize {
        self.inner().max_in_flight
    }

    /// Makes chunk `chunk` of the `copy`-th next chunked copy in `direction` (both 0-based)
    /// fail to start.
    pub(crate) fn fail_chunk(&self, direction: Direction, copy: usize, chunk: usize) {
        self.inner().fail = Some(Fail { direction, copy, chunk, begun: 0 });
    }
}

/// Chunk `chunk` of chunked copy `copy` (both 0-based) in `direction` fails to start.
struct Fail {
    direction: Direction,
    copy: usize,
    chunk: usize,
    /// Chunked copies in `direction` begun since the failure was armed.
    begun: usize,
}

/// Host memory of the fake, which counts its free.
pub(crate) struct FakeHostBuf {
    pub(crate) bytes: Vec<u8>,
    frees: Arc<AtomicUsize>,
}

impl Drop for FakeHostBuf {
    fn drop(&mut self) {
        self.frees.fetch_add(1, Ordering::SeqCst);
    }
}

/// A chunk queued and not yet copied.
struct Pending {
    chunk: usize,
    direction: Direction,
    addr: u64,
    host: usize,
    len: usize,
}

/// The fake device.
pub(crate) struct FakeBackend {
    probe: Arc<Probe>,
    /// Mapped memory by base address (behind a lock: copies write it through `&self`, as a
    /// device writes its memory).
    mapped: Mutex<BTreeMap<u64, Vec<u8>>>,
    next: u64,
    pending: Mutex<Vec<Pending>>,
}

/// A fake device and the probe that watches it.
pub(crate) fn create() -> (Box<dyn Backend>, Arc<Probe>) {
    let probe = Arc::new(Probe::default());
    let backend = FakeBackend {
        probe: Arc::clone(&probe),
        mapped: Mutex::new(BTreeMap::new()),
        next: 1 << 40,
        pending: Mutex::new(Vec::new()),
    };
    (Box::new(backend), probe)
}

impl FakeBackend {
    fn mapped(&self) -> MutexGuard<'_, BTreeMap<u64, Vec<u8>>> {
        self.mapped.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the mapped bytes `addr..addr + len`.
    fn with_mem<T>(&self, addr: u64, len: usize, f: impl FnOnce(&mut [u8]) -> T) -> Result<T> {
        let mut mapped = self.mapped();
        let (&base, mem) = mapped.range_mut(..=addr).next_back().ok_or_else(|| unmapped(addr))?;
        let offset = (addr - base) as usize;
        let mem = mem.get_mut(offset..offset + len).ok_or_else(|| unmapped(addr))?;
        Ok(f(mem))
    }

    /// The offset of `addr` in the mapping that holds `addr..addr + len`.
    fn offset(&self, addr: u64, len: usize) -> Result<usize> {
        let mapped = self.mapped();
        let (&base, mem) = mapped.range(..=addr).next_back().ok_or_else(|| unmapped(addr))?;
        let offset = (addr - base) as usize;
        if offset + len > mem.len() {
            return Err(unmapped(addr));
        }
        Ok(offset)
    }

    fn pending(&self) -> MutexGuard<'_, Vec<Pending>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Copies every queued chunk up to `chunk` (all of them with `None`), in queue order.
    fn complete(&self, upto: Option<usize>) {
        let mut pending = self.pending();
        let done: Vec<Pending> = {
            let (done, rest) =
                pending.drain(..).partition(|p| upto.is_none_or(|upto| p.chunk <= upto));
            *pending = rest;
            done
        };
        for p in done {
            let copied = self.with_mem(p.addr, p.len, |mem| match p.direction {
                Direction::ToHost => {
                    // SAFETY: the caller of `start_to_host` keeps `host..host+len` writable and
                    // untouched until this chunk is waited for or drained, which is now.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.host as *mut u8, p.len) };
                    dst.copy_from_slice(mem);
                }
                Direction::FromHost => {
                    // SAFETY: as above: `host..host+len` stays readable and unwritten until now.
                    let src = unsafe { std::slice::from_raw_parts(p.host as *const u8, p.len) };
                    mem.copy_from_slice(src);
                }
            });
            copied.expect("a queued chunk stays mapped until it is waited for");
        }
    }

    fn start(
        &self,
        direction: Direction,
        addr: u64,
        host: usize,
        len: usize,
        chunk: usize,
    ) -> Result<()> {
        let offset = self.offset(addr, len)?;
        let mut inner = self.probe.inner();
        inner.calls.push(Call::Start { direction, chunk, offset, len });
        if let Some(f) = &inner.fail {
            if f.direction == direction && f.begun == f.copy + 1 && f.chunk == chunk {
                inner.fail = None;
                return Err(Error::Injected { point: "fake device copy" });
            }
        }
        let mut pending = self.pending();
        pending.push(Pending { chunk, direction, addr, host, len });
        inner.max_in_flight = inner.max_in_flight.max(pending.len());
        Ok(())
    }
}

fn unmapped(addr: u64) -> Error {
    Error::Cuda { op: format!("fake access at {addr:#x}"), code: "not mapped".into() }
}

impl Backend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn device(&self) -> mesh::Device {
        mesh::Device::Cuda(0)
    }

    fn granularity(&self) -> usize {
        GRANULARITY
    }

    fn max_bytes(&self) -> u64 {
        1 << 40
    }

    fn default_store(&self) -> BackupStore {
        BackupStore::Host
    }

    fn reserve(&mut self, len: usize) -> Result<u64> {
        let addr = self.next;
        self.next += (len as u64).next_multiple_of(1 << 30) + (1 << 30);
        Ok(addr)
    }

    fn map(&mut self, addr: u64, len: usize, _label: &str, init: Init<'_>) -> Result<Phys> {
        let mut mem = vec![GARBAGE; len];
        match init {
            Init::Fresh => {}
            Init::Zero => mem.fill(0),
            Init::File { file, offset, len: n, what } => {
                mem.fill(0);
                file.read_exact_at(&mut mem[..n], offset)
                    .map_err(|e| Error::os_with(format!("reading {n} bytes from {what}"), e))?;
            }
            Init::Fill { len: n, fill } => {
                mem.fill(0);
                fill(&mut mem[..n])?;
            }
        }
        self.mapped().insert(addr, mem);
        Ok(Phys::Cuda(addr))
    }

    fn unmap(&mut self, addr: u64, _len: usize, _phys: Phys) -> Result<(), (Phys, Error)> {
        self.mapped().remove(&addr);
        Ok(())
    }

    fn free(&mut self, addr: u64, _len: usize, _phys: Option<Phys>) -> Result<()> {
        self.mapped().remove(&addr);
        Ok(())
    }

    fn host_ptr(&self, _addr: u64) -> Option<*mut u8> {
        None
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuf> {
        self.probe.host_allocs.fetch_add(1, Ordering::SeqCst);
        self.probe.inner().host_alloc_sizes.push(len);
        let frees = Arc::clone(&self.probe.host_frees);
        Ok(HostBuf::Fake(FakeHostBuf { bytes: vec![0; len], frees }))
    }

    fn copy_to_host(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        self.with_mem(addr, dst.len(), |mem| dst.copy_from_slice(mem))
    }

    fn copy_from_host(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.with_mem(addr, src.len(), |mem| mem.copy_from_slice(src))
    }

    fn save(&self, addr: u64, len: usize, sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        self.with_mem(addr, len, |mem| sink(mem))?
    }

    fn begin_chunks(&self, direction: Direction) -> Result<()> {
        let mut inner = self.probe.inner();
        inner.calls.push(Call::Begin(direction));
        if let Some(f) = inner.fail.as_mut().filter(|f| f.direction == direction) {
            f.begun += 1;
        }
        Ok(())
    }

    unsafe fn start_to_host(
        &self,
        addr: u64,
        dst: *mut u8,
        len: usize,
        chunk: usize,
    ) -> Result<()> {
        self.start(Direction::ToHost, addr, dst as usize, len, chunk)
    }

    unsafe fn start_from_host(
        &self,
        addr: u64,
        src: *const u8,
        len: usize,
        chunk: usize,
    ) -> Result<()> {
        self.start(Direction::FromHost, addr, src as usize, len, chunk)
    }

    fn wait_chunk(&self, chunk: usize) -> Result<()> {
        self.probe.inner().calls.push(Call::Wait(chunk));
        self.complete(Some(chunk));
        Ok(())
    }

    fn drain_chunks(&self) -> Result<()> {
        self.probe.inner().calls.push(Call::Drain);
        self.complete(None);
        Ok(())
    }
}
