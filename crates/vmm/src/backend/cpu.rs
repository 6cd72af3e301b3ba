//! The CPU backend: a `PROT_NONE` reservation per allocation, with a memfd mapped over it
//! (`MAP_FIXED | MAP_SHARED`) while the allocation is materialized.
//!
//! Releasing replaces the mapping by a fresh inaccessible reservation and closes the memfd,
//! so its pages go back to the kernel; materializing maps a new memfd at the same address.

use super::{Backend, HostBuf, Init, Phys};
use crate::chunked::Direction;
use crate::error::{Error, Result};
use crate::policy::BackupStore;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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

fn memfd(label: &str, len: usize) -> Result<OwnedFd> {
    let name = std::ffi::CString::new(format!("tpctl-vmm:{label}")).unwrap_or_default();
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::os("memfd_create"));
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on a valid descriptor; the length fits in off_t (checked by the manager,
    // which caps allocations at physical memory).
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(Error::os(format!("ftruncate of a memfd to {len} bytes")));
    }
    Ok(fd)
}

/// Copies `len` bytes of `file` at `offset` into the memfd at 0 inside the kernel.
/// Returns false, having copied nothing, when the kernel cannot do it for this pair of files.
fn kernel_copy(file: &File, offset: u64, fd: &OwnedFd, len: usize) -> io::Result<bool> {
    let mut off_in = offset as libc::loff_t;
    let mut off_out: libc::loff_t = 0;
    let copied =
        copy_loop(len, &[libc::EXDEV, libc::EINVAL, libc::EOPNOTSUPP, libc::ENOSYS], |n| {
            // SAFETY: both descriptors are valid and open; the offsets point to live locals.
            unsafe {
                libc::copy_file_range(
                    file.as_raw_fd(),
                    &mut off_in,
                    fd.as_raw_fd(),
                    &mut off_out,
                    n,
                    0,
                )
            }
        })?;
    if copied {
        return Ok(true);
    }
    sendfile_copy(file, offset, fd, len)
}

/// `sendfile` into the memfd: the kernel copies page by page without zeroing first.
fn sendfile_copy(file: &File, offset: u64, fd: &OwnedFd, len: usize) -> io::Result<bool> {
    let mut off_in = offset as libc::off_t;
    copy_loop(len, &[libc::EINVAL, libc::ENOSYS], |n| {
        // SAFETY: both descriptors are valid; `off_in` is a live local. The memfd's own file
        // position starts at 0 and advances with each call, which is where the bytes go.
        unsafe { libc::sendfile(fd.as_raw_fd(), file.as_raw_fd(), &mut off_in, n) }
    })
}

/// Calls `copy(remaining)` until `len` bytes are copied, each call returning how many it
/// copied (negative: failed, with `errno`). Returns false, having copied nothing, when the
/// first call fails with one of `unsupported` (the caller falls back to another way).
fn copy_loop(
    len: usize,
    unsupported: &[i32],
    mut copy: impl FnMut(usize) -> isize,
) -> io::Result<bool> {
    let mut done = 0;
    while done < len {
        let n = copy(len - done);
        if n < 0 {
            let err = io::Error::last_os_error();
            if done == 0 && err.raw_os_error().is_some_and(|e| unsupported.contains(&e)) {
                return Ok(false);
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("file ends {} bytes short", len - done),
            ));
        }
        done += n as usize;
    }
    Ok(true)
}

impl CpuBackend {
    fn map_fd(&self, addr: u64, len: usize, fd: &OwnedFd, populate: bool) -> Result<()> {
        let mut flags = libc::MAP_SHARED | libc::MAP_FIXED;
        if populate {
            flags |= libc::MAP_POPULATE;
        }
        // SAFETY: `addr..addr+len` is a reservation this backend owns (the manager passes only
        // its own allocations' ranges) and nothing references it, so MAP_FIXED replaces only
        // our PROT_NONE placeholder. `fd` is a memfd of at least `len` bytes.
        let ptr = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::os(format!("mmap of a {len}-byte memfd at {addr:#x}")));
        }
        debug_assert_eq!(ptr as u64, addr);
        Ok(())
    }

    fn fill(&self, addr: u64, len: usize, fd: &OwnedFd, init: Init<'_>) -> Result<()> {
        match init {
            // A discarded allocation comes back held, as device memory does after a materialize
            // (so the next release gives back what a receipt says); a new one is zero pages
            // that the kernel allocates as they are written.
            Init::Fresh => self.map_fd(addr, len, fd, true),
            Init::Zero => self.map_fd(addr, len, fd, false),
            Init::File { file, offset, len: n, what } => {
                let n = n.min(len);
                let copied = kernel_copy(file, offset, fd, n)
                    .map_err(|e| Error::os_with(format!("copying {n} bytes from {what}"), e))?;
                self.map_fd(addr, len, fd, true)?;
                if !copied {
                    // SAFETY: the range was just mapped read-write with `len >= n` bytes and no
                    // other reference to it exists yet.
                    let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n) };
                    file.read_exact_at(dst, offset)
                        .map_err(|e| Error::os_with(format!("reading {n} bytes from {what}"), e))?;
                }
                Ok(())
            }
            Init::Fill { len: n, fill } => {
                self.map_fd(addr, len, fd, true)?;
                // SAFETY: as above, a fresh read-write mapping of `len >= n` bytes that nothing
                // else references.
                let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n.min(len)) };
                fill(dst)
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
        reserve_at(None, len)
    }

    fn map(&mut self, addr: u64, len: usize, label: &str, init: Init<'_>) -> Result<Phys> {
        let fd = memfd(label, len)?;
        if let Err(e) = self.fill(addr, len, &fd, init) {
            // Put the placeholder back: the range may be mapped to the memfd by now.
            if let Err(undo) = reserve_at(Some(addr), len) {
                tracing::error!(addr, len, error = %undo, "could not restore a reservation after a failed map");
            }
            return Err(e);
        }
        Ok(Phys::Fd(fd))
    }

    fn unmap(&mut self, addr: u64, len: usize, phys: Phys) -> Result<(), (Phys, Error)> {
        match reserve_at(Some(addr), len) {
            // Dropping the memfd closes it; with the mapping gone its pages are freed.
            Ok(_) => Ok(()),
            Err(e) => Err((phys, e)),
        }
    }

    fn free(&mut self, addr: u64, len: usize, phys: Option<Phys>) -> Result<()> {
        // SAFETY: the range is a reservation (maybe with a memfd mapped over it) that this
        // backend owns; the manager frees an allocation only when its handle is dropped, so no
        // reference into the range is alive.
        let rc = unsafe { libc::munmap(addr as *mut libc::c_void, len) };
        drop(phys);
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

    /// Files on disk and on tmpfs take different kernel copy paths (`copy_file_range` or
    /// `sendfile`); both must land the same bytes.
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
