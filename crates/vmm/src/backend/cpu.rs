//! The CPU backend: a `PROT_NONE` reservation per allocation, with private anonymous memory
//! mapped over it (`MAP_FIXED`) while the allocation is materialized.
//!
//! Releasing replaces the mapping by a fresh inaccessible reservation, so its pages go back to
//! the kernel; materializing maps new memory at the same address. Reservations of 2 MiB or
//! more start on a 2 MiB boundary and their memory is advised for transparent huge pages
//! (`MADV_HUGEPAGE`): where the kernel grants them, a 106 MiB allocation is faulted in with 53
//! faults instead of 27,000, which on this project's virtual machines took the refault of
//! 106 MiB from about 50 ms to about 17 ms (a memcpy of it: about 10 ms). Where it does not,
//! the advice changes nothing.

use super::{Backend, HostBuf, Init, Phys};
use crate::chunked::Direction;
use crate::error::{Error, Result};
use crate::policy::BackupStore;
#[cfg(test)]
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
#[cfg(test)]
use std::path::Path;

/// Host memory backend.
pub(crate) struct CpuBackend {
    page: usize,
    phys_bytes: u64,
}

impl CpuBackend {
    pub(crate) fn new() -> Result<CpuBackend> {
        Ok(CpuBackend { page: page_size(), phys_bytes: physical_memory() })
    }
}

/// The system page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
}

fn physical_memory() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    u64::try_from(pages).unwrap_or(0).saturating_mul(page_size() as u64)
}

/// The size of a transparent huge page on x86-64 and of the alignment that lets the kernel
/// use them for a whole range.
const HUGE_PAGE: usize = 2 << 20;

/// Maps an inaccessible, unbacked range; with `at` it replaces whatever is mapped there.
fn reserve_at(at: Option<u64>, len: usize) -> Result<u64> {
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    if at.is_some() {
        flags |= libc::MAP_FIXED;
    }
    let hint = at.unwrap_or(0) as *mut libc::c_void;
    // SAFETY: without MAP_FIXED the kernel picks a free range. With MAP_FIXED, `at` is the base
    // of a range of `len` bytes that this backend reserved earlier and still owns, so the call
    // replaces only our own mapping; no reference into it is alive (the manager holds the
    // allocation's write lock, so no guard exists).
    let ptr = unsafe { libc::mmap(hint, len, libc::PROT_NONE, flags, -1, 0) };
    if ptr == libc::MAP_FAILED {
        return Err(Error::os(format!("mmap PROT_NONE reservation of {len} bytes")));
    }
    Ok(ptr as u64)
}

/// A new reservation of `len` bytes; from [`HUGE_PAGE`] bytes on, it starts on a huge-page
/// boundary (a larger range is reserved and its ends given back).
fn reserve_aligned(len: usize) -> Result<u64> {
    if len < HUGE_PAGE {
        return reserve_at(None, len);
    }
    let raw = reserve_at(None, len + HUGE_PAGE)?;
    let start = raw.next_multiple_of(HUGE_PAGE as u64);
    let (head, tail) = ((start - raw) as usize, HUGE_PAGE - (start - raw) as usize);
    for (at, n) in [(raw, head), (start + len as u64, tail)] {
        // SAFETY: both pieces lie inside the reservation just made, outside `start..start+len`,
        // and nothing references them.
        if n > 0 && unsafe { libc::munmap(at as *mut libc::c_void, n) } != 0 {
            return Err(Error::os(format!("munmap of {n} bytes around a reservation")));
        }
    }
    Ok(start)
}

/// Maps private anonymous memory (zero pages, allocated as they are touched) over the
/// reservation `addr..addr+len`, advised for huge pages when it is large enough.
fn map_anonymous(addr: u64, len: usize) -> Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE;
    // SAFETY: `addr..addr+len` is a reservation this backend owns (the manager passes only
    // its own allocations' ranges) and nothing references it, so MAP_FIXED replaces only our
    // PROT_NONE placeholder.
    let ptr = unsafe {
        libc::mmap(addr as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0)
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::os(format!("mmap of {len} bytes of memory at {addr:#x}")));
    }
    debug_assert_eq!(ptr as u64, addr);
    if len >= HUGE_PAGE {
        // SAFETY: advice on the range just mapped; it never changes contents. A kernel without
        // transparent huge pages refuses it, which changes nothing.
        let _ = unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
    }
    Ok(())
}

impl CpuBackend {
    fn fill(&self, addr: u64, len: usize, init: Init<'_>) -> Result<()> {
        map_anonymous(addr, len)?;
        match init {
            // A discarded allocation comes back held, as device memory does after a materialize
            // (so the next release gives back what a receipt says); a new one is zero pages
            // that the kernel allocates as they are written.
            Init::Fresh => commit(addr, len, 1),
            Init::Zero => Ok(()),
            Init::File { file, offset, len: n, what } => {
                let n = n.min(len);
                // SAFETY: the range was just mapped read-write with `len >= n` bytes and no
                // other reference to it exists yet.
                let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n) };
                file.read_exact_at(dst, offset)
                    .map_err(|e| Error::os_with(format!("reading {n} bytes from {what}"), e))?;
                // Held whole, as `Fresh` (the tail past the file's bytes too).
                commit(addr, len, 1)
            }
            Init::Fill { len: n, fill } => {
                // SAFETY: as above, a fresh read-write mapping of `len >= n` bytes that nothing
                // else references.
                let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n.min(len)) };
                fill(dst)?;
                commit(addr, len, 1)
            }
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn device(&self) -> mesh::Device {
        mesh::Device::Cpu
    }

    fn granularity(&self) -> usize {
        self.page
    }

    fn max_bytes(&self) -> u64 {
        self.phys_bytes
    }

    fn default_store(&self) -> BackupStore {
        BackupStore::Spill
    }

    fn reserve(&mut self, len: usize) -> Result<u64> {
        reserve_aligned(len)
    }

    fn map(&mut self, addr: u64, len: usize, _label: &str, init: Init<'_>) -> Result<Phys> {
        if let Err(e) = self.fill(addr, len, init) {
            // Put the placeholder back: the range may be mapped by now.
            if let Err(undo) = reserve_at(Some(addr), len) {
                tracing::error!(addr, len, error = %undo, "could not restore a reservation after a failed map");
            }
            return Err(e);
        }
        Ok(Phys::Anonymous)
    }

    fn unmap(&mut self, addr: u64, len: usize, phys: Phys) -> Result<(), (Phys, Error)> {
        match reserve_at(Some(addr), len) {
            // With the mapping replaced, its pages are freed.
            Ok(_) => Ok(()),
            Err(e) => Err((phys, e)),
        }
    }

    fn free(&mut self, addr: u64, len: usize, _phys: Option<Phys>) -> Result<()> {
        // SAFETY: the range is a reservation (maybe with memory mapped over it) that this
        // backend owns; the manager frees an allocation only when its handle is dropped, so no
        // reference into the range is alive. Unmapping it frees its pages.
        let rc = unsafe { libc::munmap(addr as *mut libc::c_void, len) };
        if rc != 0 {
            return Err(Error::os(format!("munmap of {len} bytes at {addr:#x}")));
        }
        Ok(())
    }

    fn host_ptr(&self, addr: u64) -> Option<*mut u8> {
        Some(addr as *mut u8)
    }

    fn alloc_host(&self, len: usize) -> Result<HostBuf> {
        if len == 0 {
            return Ok(HostBuf::Heap(Vec::new()));
        }
        Ok(HostBuf::Mapped(MappedBuf::new(len)?))
    }

    fn copy_to_host(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the manager calls this only on a materialized allocation while holding its
        // write lock, so `addr..addr+dst.len()` is mapped and not aliased mutably.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, dst.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn copy_from_host(&self, addr: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the manager calls this only on a materialized allocation while holding its
        // write lock, so `addr..addr+src.len()` is mapped read-write and not otherwise borrowed.
        let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, src.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn save(&self, addr: u64, len: usize, sink: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        // SAFETY: as in `copy_to_host`: mapped, and locked against writers.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        sink(src)
    }

    fn begin_chunks(&self, _direction: Direction) -> Result<()> {
        Ok(())
    }

    // The CPU copies each chunk at once (a memcpy): there is nothing to overlap with.
    unsafe fn start_to_host(
        &self,
        addr: u64,
        dst: *mut u8,
        len: usize,
        _chunk: usize,
    ) -> Result<()> {
        // SAFETY: the manager copies only a materialized allocation's range, holding its write
        // lock, so `addr..addr+len` is mapped and not written meanwhile; the caller promises
        // that `dst..dst+len` is writable and not otherwise accessed. The two do not overlap:
        // host backups never live inside an allocation.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst, len) };
        Ok(())
    }

    unsafe fn start_from_host(
        &self,
        addr: u64,
        src: *const u8,
        len: usize,
        _chunk: usize,
    ) -> Result<()> {
        // SAFETY: as in `start_to_host`, the other way: the allocation's range is mapped
        // read-write and held by the manager alone, `src..src+len` is readable.
        unsafe { std::ptr::copy_nonoverlapping(src, addr as *mut u8, len) };
        Ok(())
    }

    fn wait_chunk(&self, _chunk: usize) -> Result<()> {
        Ok(())
    }

    fn drain_chunks(&self) -> Result<()> {
        Ok(())
    }
}

/// Commits the pages of the mapped range `[addr, addr + len)` (a page-aligned range of this
/// backend's, mapped read-write) on `threads` threads, each a contiguous share: the kernel
/// allocates every page now (`MADV_POPULATE_WRITE`, Linux 5.14 and later), or, where the
/// kernel does not know that advice, each page is written once with the byte it holds. The
/// contents do not change. The caller holds the allocation exclusively (its write lock), so no
/// other reference reads or writes the range meanwhile.
pub(crate) fn commit(addr: u64, len: usize, threads: usize) -> Result<()> {
    let page = page_size();
    let pages = len.div_ceil(page);
    let per = pages.div_ceil(threads.clamp(1, pages.max(1))).max(1) * page;
    std::thread::scope(|s| {
        let parts: Vec<_> = (0..len)
            .step_by(per)
            .map(|start| {
                let n = per.min(len - start);
                s.spawn(move || commit_part(addr + start as u64, n, page))
            })
            .collect();
        parts.into_iter().try_for_each(|part| {
            part.join().unwrap_or_else(|_| {
                Err(Error::os_with(
                    "committing pages",
                    io::Error::other("a committing thread panicked"),
                ))
            })
        })
    })
}

fn commit_part(addr: u64, len: usize, page: usize) -> Result<()> {
    // SAFETY: `addr..addr+len` is a mapped read-write range of the caller's allocation
    // (see `commit`); madvise does not change its contents.
    let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(Error::os_with(format!("committing {len} bytes at {addr:#x} (madvise)"), err));
    }
    // An older kernel.
    touch_pages(addr, len, page);
    Ok(())
}

/// Faults each page of `[addr, addr + len)` in by a write of the byte it holds (the range as
/// in [`commit`]).
fn touch_pages(addr: u64, len: usize, page: usize) {
    for offset in (0..len).step_by(page) {
        let p = (addr as usize + offset) as *mut u8;
        // SAFETY: `p` lies inside a mapped read-write range that nothing else accesses while
        // the caller holds it; volatile, so the write of the same byte is not elided.
        unsafe { p.write_volatile(p.read_volatile()) };
    }
}

/// Anonymous memory mapped with `MAP_POPULATE`: the kernel faults every page in one pass
/// (several times faster than faulting them one by one during the copy that follows).
pub(crate) struct MappedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a MappedBuf owns its mapping exclusively, like a `Box<[u8]>`: nothing else holds the
// pointer, and munmap may be called from any thread.
unsafe impl Send for MappedBuf {}
// SAFETY: `&MappedBuf` only hands out `&[u8]`; mutation needs `&mut MappedBuf`.
unsafe impl Sync for MappedBuf {}

impl MappedBuf {
    fn new(len: usize) -> Result<MappedBuf> {
        // SAFETY: a fresh private anonymous mapping; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::os(format!("mmap of a {len}-byte host backup")));
        }
        Ok(MappedBuf { ptr: ptr.cast(), len })
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live read-write mapping of `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for MappedBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping belongs to self and no slice of it outlives `&self`.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies `data` into the start of a fresh mapping (an `Init::Fill`).
    fn copier(data: &[u8]) -> impl FnMut(&mut [u8]) -> Result<()> + '_ {
        move |dst| {
            dst.copy_from_slice(data);
            Ok(())
        }
    }

    fn read_back(addr: u64, len: usize) -> Vec<u8> {
        // SAFETY: the callers pass a range they just mapped and keep mapped during the read.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
    }

    #[test]
    fn maps_bytes_and_zeroes_the_tail_at_the_same_address() {
        let mut b = CpuBackend::new().unwrap();
        let len = 3 * b.granularity();
        let addr = b.reserve(len).unwrap();
        let data: Vec<u8> = (0..len / 2).map(|i| (i % 251) as u8 + 1).collect();
        let phys = b
            .map(addr, len, "t", Init::Fill { len: data.len(), fill: &mut copier(&data) })
            .unwrap();
        let got = read_back(addr, len);
        assert_eq!(&got[..data.len()], &data[..]);
        assert!(got[data.len()..].iter().all(|&x| x == 0));
        b.unmap(addr, len, phys).map_err(|(_, e)| e).unwrap();
        let phys = b.map(addr, len, "t", Init::Zero).unwrap();
        assert!(read_back(addr, len).iter().all(|&x| x == 0));
        b.free(addr, len, Some(phys)).unwrap();
    }

    /// Where the kernel has no `MADV_POPULATE_WRITE`, pages are committed by writing each
    /// one's first byte back: the contents stay.
    #[test]
    fn touching_pages_keeps_their_contents() {
        let mut b = CpuBackend::new().unwrap();
        let page = b.granularity();
        let len = 4 * page;
        let addr = b.reserve(len).unwrap();
        let data: Vec<u8> = (0..page + 7).map(|i| (i % 253) as u8 + 1).collect();
        let phys = b
            .map(addr, len, "t", Init::Fill { len: data.len(), fill: &mut copier(&data) })
            .unwrap();
        touch_pages(addr, len, page);
        commit(addr, len, 3).unwrap();
        let got = read_back(addr, len);
        assert_eq!(&got[..data.len()], &data[..]);
        assert!(got[data.len()..].iter().all(|&x| x == 0));
        b.free(addr, len, Some(phys)).unwrap();
    }

    /// A reservation of 2 MiB or more starts on a huge-page boundary, and its memory is
    /// eligible for transparent huge pages wherever the kernel has them enabled (the smaps
    /// field `THPeligible` of its mapping).
    #[test]
    fn large_allocations_are_aligned_and_advised_for_huge_pages() {
        let mut b = CpuBackend::new().unwrap();
        let len = 3 * HUGE_PAGE + b.granularity();
        let addr = b.reserve(len).unwrap();
        assert_eq!(addr % HUGE_PAGE as u64, 0, "{addr:#x}");
        let phys = b.map(addr, len, "t", Init::Zero).unwrap();
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !thp.is_empty() && !thp.contains("[never]") {
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            let start = format!("{addr:x}-");
            // The mapping's header line, then its fields (`Name: value`) up to the next one.
            let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
            let header = lines.next().unwrap_or_default();
            let fields =
                lines.take_while(|l| l.split_whitespace().next().is_some_and(|k| k.ends_with(':')));
            let mapping: String =
                std::iter::once(header).chain(fields).collect::<Vec<_>>().join("\n");
            let eligible = mapping.lines().find_map(|l| l.strip_prefix("THPeligible:"));
            assert_eq!(eligible.map(str::trim), Some("1"), "{thp}\n{mapping}");
        }
        b.free(addr, len, Some(phys)).unwrap();
        // A small one needs no alignment.
        let small = b.reserve(b.granularity()).unwrap();
        b.free(small, b.granularity(), None).unwrap();
    }

    /// Files on disk and on tmpfs land the same bytes, the tail past them zero.
    #[test]
    fn maps_file_contents_from_disk_and_tmpfs() {
        let mut b = CpuBackend::new().unwrap();
        let page = b.granularity();
        let len = 5 * page;
        let contents: Vec<u8> = (0..4 * page + 100).map(|i| (i * 7 % 256) as u8).collect();
        let mut dirs = vec![std::env::temp_dir()];
        if Path::new("/dev/shm").is_dir() {
            dirs.push("/dev/shm".into());
        }
        for dir in dirs {
            let path = dir.join(format!("tpctl-vmm-cpu-test-{}", std::process::id()));
            std::fs::write(&path, &contents).unwrap();
            let file = File::open(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            let addr = b.reserve(len).unwrap();
            let n = contents.len() - 3;
            let init = Init::File { file: &file, offset: 3, len: n, what: "test file" };
            let phys = b.map(addr, len, "t", init).unwrap();
            let got = read_back(addr, len);
            assert_eq!(&got[..n], &contents[3..], "{}", dir.display());
            assert!(got[n..].iter().all(|&x| x == 0), "{}", dir.display());
            b.free(addr, len, Some(phys)).unwrap();

            // A file shorter than asked for is an error that names it.
            let addr = b.reserve(len).unwrap();
            let init =
                Init::File { file: &file, offset: 0, len: contents.len() + 1, what: "test file" };
            let err = b.map(addr, len, "t", init).unwrap_err();
            assert!(err.to_string().contains("test file"), "{err}");
            b.free(addr, len, None).unwrap();
        }
    }
}
