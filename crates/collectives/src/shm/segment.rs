//! The shared-memory segment of one group: its layout and typed access to its parts.
//!
//! ```text
//! header                      magic, version, ranks, slot and ring sizes   (one line)
//! bell                        futex word every waiter sleeps on, sleepers  (one line)
//! rank controls [size]        arrival epoch, failure, pid, op descriptors  (4 lines each)
//! pair controls [size*size]   written / read counters of each p2p ring     (2 lines each)
//! slots [size][2]             each rank's staging area, double-buffered    (page aligned)
//! rings [size*size]           point-to-point byte rings, src -> dst        (page aligned)
//! ```
//!
//! Control words are atomics; data areas are written by their owner and read by peers only
//! between barriers, which order the accesses (release on arrival, acquire on observing it).

use memmap2::{MmapOptions, MmapRaw};
use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"tpctlshm");
const VERSION: u32 = 1;
/// Two cache lines: adjacent-line prefetch makes 64-byte padding share lines in practice.
const LINE: usize = 128;
const PAGE: usize = 4096;

/// Sizes of a segment's data areas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmOptions {
    /// Bytes of each rank's staging slot (there are two per rank); larger messages are
    /// processed in pieces of this size.
    pub slot_bytes: usize,
    /// Bytes of each point-to-point ring.
    pub ring_bytes: usize,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions { slot_bytes: 1 << 20, ring_bytes: 256 << 10 }
    }
}

impl ShmOptions {
    /// Sizes for a group of `ranks` on this machine. With a core per rank, 1 MiB slots keep
    /// a piece in L2 while it is reduced. With more ranks than cores every barrier costs
    /// context switches, so 4 MiB slots cut the number of barriers a large message needs.
    pub fn for_group(ranks: usize) -> ShmOptions {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let slot_bytes = if ranks <= cores { 1 << 20 } else { 4 << 20 };
        ShmOptions { slot_bytes, ..ShmOptions::default() }
    }
}

/// One operation's descriptor, posted by every rank and compared after the first barrier.
#[repr(C)]
pub(crate) struct Desc {
    pub(crate) seq: AtomicU64,
    /// `op << 32 | dtype << 16 | reduce op`.
    pub(crate) kind: AtomicU64,
    pub(crate) len: AtomicU64,
    pub(crate) aux: AtomicU64,
}

/// Per-rank control block.
#[repr(C, align(128))]
pub(crate) struct RankCtrl {
    /// Barrier arrivals of this rank.
    pub(crate) epoch: AtomicU64,
    /// 0, or 1 + the group rank whose failure this rank reports.
    pub(crate) failed: AtomicU32,
    /// This rank's process id, 0 until it joined.
    pub(crate) pid: AtomicU32,
    _pad: [u8; LINE - 16],
    /// Descriptors for even and odd operations.
    pub(crate) desc: [Desc; 2],
    _pad2: [u8; 2 * LINE - 64],
}

/// Counters of one point-to-point ring.
#[repr(C, align(128))]
pub(crate) struct PairCtrl {
    pub(crate) written: AtomicU64,
    _pad: [u8; LINE - 8],
    pub(crate) read: AtomicU64,
    _pad2: [u8; LINE - 8],
}

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    size: AtomicU32,
    slot_bytes: AtomicU64,
    ring_bytes: AtomicU64,
}

#[repr(C, align(128))]
struct Bell {
    bell: AtomicU32,
    sleepers: AtomicU32,
}

const _: () = assert!(size_of::<RankCtrl>() == 3 * LINE);
const _: () = assert!(size_of::<PairCtrl>() == 2 * LINE);

#[derive(Debug, Clone, Copy)]
struct Layout {
    size: usize,
    slot: usize,
    ring: usize,
    ranks: usize,
    pairs: usize,
    slots: usize,
    rings: usize,
    total: usize,
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

impl Layout {
    fn new(size: usize, opts: ShmOptions) -> Layout {
        let slot = round_up(opts.slot_bytes.max(PAGE), PAGE);
        let ring = round_up(opts.ring_bytes.max(PAGE), PAGE);
        let ranks = 2 * LINE;
        let pairs = ranks + size * size_of::<RankCtrl>();
        let slots = round_up(pairs + size * size * size_of::<PairCtrl>(), PAGE);
        let rings = slots + size * 2 * slot;
        let total = rings + size * size * ring;
        Layout { size, slot, ring, ranks, pairs, slots, rings, total }
    }
}

/// A mapped segment.
pub(crate) struct Segment {
    map: MmapRaw,
    layout: Layout,
}

impl Segment {
    /// Creates a segment backed by a new file (normally under `/dev/shm`).
    pub(crate) fn create(path: &Path, size: usize, opts: ShmOptions) -> io::Result<Segment> {
        let layout = Layout::new(size, opts);
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        file.set_len(layout.total as u64)?;
        let seg = Segment { map: MmapRaw::map_raw(&file)?, layout };
        seg.write_header();
        Ok(seg)
    }

    /// Opens a segment another rank created.
    pub(crate) fn open(path: &Path) -> io::Result<Segment> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Segment::from_file(&file)
    }

    fn from_file(file: &File) -> io::Result<Segment> {
        let len = file.metadata()?.len() as usize;
        if len < PAGE {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "segment is too small"));
        }
        let map = MmapRaw::map_raw(file)?;
        // SAFETY: the mapping is at least one page, page aligned, and lives in `map`.
        let header = unsafe { &*(map.as_ptr() as *const Header) };
        if header.magic.load(Ordering::Acquire) != MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a tpctl shm segment"));
        }
        if header.version.load(Ordering::Relaxed) != VERSION {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "shm segment version differs"));
        }
        let opts = ShmOptions {
            slot_bytes: header.slot_bytes.load(Ordering::Relaxed) as usize,
            ring_bytes: header.ring_bytes.load(Ordering::Relaxed) as usize,
        };
        let layout = Layout::new(header.size.load(Ordering::Relaxed) as usize, opts);
        if layout.total != len {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "shm segment size differs"));
        }
        Ok(Segment { map, layout })
    }

    /// An anonymous segment for threads of one process.
    pub(crate) fn anonymous(size: usize, opts: ShmOptions) -> io::Result<Segment> {
        let layout = Layout::new(size, opts);
        let map = MmapRaw::from(MmapOptions::new().len(layout.total).map_anon()?);
        let seg = Segment { map, layout };
        seg.write_header();
        Ok(seg)
    }

    fn write_header(&self) {
        let h = self.header();
        h.version.store(VERSION, Ordering::Relaxed);
        h.size.store(self.layout.size as u32, Ordering::Relaxed);
        h.slot_bytes.store(self.layout.slot as u64, Ordering::Relaxed);
        h.ring_bytes.store(self.layout.ring as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
    }

    /// Ranks the segment was made for.
    pub(crate) fn size(&self) -> usize {
        self.layout.size
    }

    /// Bytes of one staging slot.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.layout.slot
    }

    /// Bytes of one ring.
    pub(crate) fn ring_bytes(&self) -> usize {
        self.layout.ring
    }

    /// # Safety
    /// `offset` must be aligned for `T`, `offset + size_of::<T>()` within the mapping, and `T`
    /// a type of atomics for which all-zero bytes are a valid value.
    unsafe fn at<T>(&self, offset: usize) -> &T {
        debug_assert!(offset + size_of::<T>() <= self.layout.total);
        // SAFETY: guaranteed by the caller; the mapping outlives `&self`, and shared memory
        // only ever holds atomics at these offsets, so concurrent access is sound.
        unsafe { &*(self.map.as_ptr().add(offset) as *const T) }
    }

    fn header(&self) -> &Header {
        // SAFETY: offset 0 is page aligned and the header fits in the first line.
        unsafe { self.at(0) }
    }

    /// The futex word all waiters sleep on, and the number of sleepers.
    pub(crate) fn bell(&self) -> (&AtomicU32, &AtomicU32) {
        // SAFETY: the bell line follows the header line, aligned to LINE.
        let b: &Bell = unsafe { self.at(LINE) };
        (&b.bell, &b.sleepers)
    }

    /// Control block of group rank `r`.
    pub(crate) fn rank(&self, r: usize) -> &RankCtrl {
        assert!(r < self.layout.size);
        // SAFETY: in bounds by the assert and the layout; aligned to LINE.
        unsafe { self.at(self.layout.ranks + r * size_of::<RankCtrl>()) }
    }

    /// Counters of the ring from `src` to `dst`.
    pub(crate) fn pair(&self, src: usize, dst: usize) -> &PairCtrl {
        assert!(src < self.layout.size && dst < self.layout.size);
        let i = src * self.layout.size + dst;
        // SAFETY: in bounds by the assert and the layout; aligned to LINE.
        unsafe { self.at(self.layout.pairs + i * size_of::<PairCtrl>()) }
    }

    /// Start of rank `r`'s staging slot `parity`.
    pub(crate) fn slot(&self, r: usize, parity: usize) -> *mut u8 {
        assert!(r < self.layout.size && parity < 2);
        let off = self.layout.slots + (r * 2 + parity) * self.layout.slot;
        // SAFETY: the offset is within the mapping by the layout.
        unsafe { self.map.as_mut_ptr().add(off) }
    }

    /// Start of the ring from `src` to `dst`.
    pub(crate) fn ring(&self, src: usize, dst: usize) -> *mut u8 {
        assert!(src < self.layout.size && dst < self.layout.size);
        let off = self.layout.rings + (src * self.layout.size + dst) * self.layout.ring;
        // SAFETY: the offset is within the mapping by the layout.
        unsafe { self.map.as_mut_ptr().add(off) }
    }
}
