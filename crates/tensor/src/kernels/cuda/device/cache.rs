//! What the backend keeps on the device between calls: weight matrices and model vectors
//! (keyed by their host buffer, trusted within one weights generation, dequantized on upload)
//! and the small position and block-table arrays that every layer of a step repeats.

use super::graphs::{Call, KernelCall};
use super::staging::Staged;
use super::{elementwise, Count, CudaBackend, OrUnavailable};
use crate::error::Result;
use crate::kernels::cuda::weight_stamps::{WeightKey, WeightStamps};
use crate::kernels::{GemmDtype, Weight, WeightUse};
use crate::memory::{alloc_device_exact, weights_generation, DeviceArena};
use cudarc::driver::{CudaSlice, DeviceRepr};
use mesh::DeviceMemory;
use std::sync::{Arc, Mutex};

/// The device memory of one cached weight: dense, row-major, in its key's dtype.
pub(super) enum Slot {
    /// From the driver's memory pool; freed when the weight leaves the cache.
    Pool(CudaSlice<u8>),
    /// A region of the weight arena; kept (and written again) when the weight is cleared.
    Arena(Box<dyn DeviceMemory>),
}

impl Slot {
    fn bytes(&self) -> usize {
        match self {
            Slot::Pool(s) => s.len(),
            Slot::Arena(m) => m.size(),
        }
    }
}

pub(super) struct CachedWeight {
    slot: Arc<Slot>,
    /// A fingerprint of the host bytes it was made from, in builds with debug assertions only:
    /// a hit whose bytes changed without a generation bump is then logged and uploaded again,
    /// so a writer that forgot [`crate::memory::weights_changed`] shows in tests.
    #[cfg(debug_assertions)]
    print: u64,
}

/// A hash of the length and 64 evenly spaced 32-bit words of each of `parts` (all of them when
/// shorter), the debug builds' check of the weights generation (see [`CachedWeight`]).
#[cfg(debug_assertions)]
fn fingerprint(parts: &[&[u8]]) -> u64 {
    use std::hash::{Hash, Hasher};
    const SAMPLES: usize = 64;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in parts {
        p.len().hash(&mut h);
        let words = p.len() / 4;
        let step = words.div_ceil(SAMPLES).max(1);
        for w in (0..words).step_by(step) {
            p[4 * w..4 * w + 4].hash(&mut h);
        }
        p[4 * words..].hash(&mut h);
    }
    h.finish()
}

/// The weight cache and where its slots come from.
#[derive(Default)]
pub(super) struct WeightCache {
    pub(super) entries: WeightStamps<CachedWeight>,
    arena: Option<Arc<dyn DeviceArena>>,
}

/// Small host arrays and their device copies, most recently used last.
pub(super) type Recent<T> = Vec<(Vec<T>, Arc<CudaSlice<T>>)>;

/// Arrays of each kind kept on the device: a step's query positions, its keys' positions, the
/// per-row offsets of a batched attention and the places of its decode rows' keys and values
/// in the pool (each the same in every layer of a group), or its block tables, with room for a
/// CP rank's two views and a few sequences' own arrays. A step visits its arrays in the same
/// order in every layer, so fewer slots than arrays would miss every time (with 4, a batched
/// step's 6 arrays did).
const RECENT_UPLOADS: usize = 16;

impl CudaBackend {
    /// Keeps the device copies of weights (and norm vectors) in memory from `arena` from now on:
    /// one region of exactly the copy's size per weight, never returned. The weights cached so
    /// far are dropped and uploaded there at their next use.
    pub fn keep_weights_in(&self, arena: Arc<dyn DeviceArena>) {
        let mut cache = self.cache();
        cache.entries.clear();
        cache.arena = Some(arena);
        drop(cache);
        self.wait_for_frees();
    }

    /// Forgets the device values of every cached weight: the next use of a weight uploads it
    /// again. Needed when the arena's memory was unmapped (a sleep), and to give back the
    /// device memory of copies whose host weights are gone (new weights adopted). Host weights
    /// changed in place need no clear: their writer bumps the weights generation
    /// ([`crate::memory::weights_changed`]), which makes every copy stale.
    ///
    /// Copies in pool memory are freed, on the backend's stream, into the driver's memory
    /// pool, which is then trimmed ([`CudaBackend::trim_pool`]) so a sleep's NVML reading
    /// sees the memory free. Copies in arena memory keep their regions (the arena's owner
    /// releases those).
    pub fn clear_weight_cache(&self) {
        let mut cache = self.cache();
        cache.entries.mark_stale(|w| matches!(*w.slot, Slot::Arena(_)));
        drop(cache);
        self.trim_pool();
    }

    /// The device copies of `weights`, made now (see [`crate::kernels::Backend::prepare_weights`]):
    /// each as its use would make it (a linear layer's in the matrix type, an embedding table
    /// in f32, a norm's vector), then a wait until every copy is written.
    pub(crate) fn prepare_weights(&self, weights: &[WeightUse<'_>]) -> Result<()> {
        const OP: &str = "prepare_weights";
        for w in weights {
            match w {
                // A quantized matrix stays packed (see `quant`).
                WeightUse::Linear(Weight::Quant(q)) if q.dims().1 % 32 == 0 => {
                    drop(self.packed(OP, q)?)
                }
                WeightUse::Linear(w) => drop(self.weight(OP, w, self.inner.dtype)?),
                WeightUse::Embedding(t) => drop(self.weight(OP, t, GemmDtype::F32)?),
                WeightUse::Norm(v) => drop(self.vector(OP, v.host()?)?),
            }
        }
        self.inner.sync(OP)
    }

    /// Device bytes held by cached weights (arena regions included).
    pub fn cached_weight_bytes(&self) -> usize {
        self.cache().entries.values().map(|w| w.slot.bytes()).sum()
    }

    pub(super) fn cache(&self) -> std::sync::MutexGuard<'_, WeightCache> {
        // The map stays consistent even if a holder panicked: entries are inserted whole.
        self.inner.weights.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device address of a weight slot; see [`CudaBackend::addr`].
    pub(super) fn slot_addr(&self, slot: &Slot) -> u64 {
        match slot {
            Slot::Pool(s) => self.addr(s),
            Slot::Arena(m) => m.device_ptr(),
        }
    }

    /// The device copy of `w` as dense `[rows, cols]` in `dtype`, uploading (and dequantizing)
    /// it on first use, or again after a clear or a change of the weights generation.
    pub(super) fn weight(&self, op: &str, w: &Weight, dtype: GemmDtype) -> Result<Arc<Slot>> {
        // Keyed by the values' buffer (a quantized matrix's quants).
        let (values, scales, mins): (&[u8], &[u8], &[u8]) = match w {
            Weight::F32(t) => (bytemuck::cast_slice(t.data()), &[], &[]),
            Weight::Quant(q) => {
                let (scales, mins, qs) = q.parts();
                (qs, bytemuck::cast_slice(scales), bytemuck::cast_slice(mins))
            }
        };
        let key =
            WeightKey { addr: values.as_ptr() as usize, len: values.len(), dtype, packed: false };
        let (rows, cols) = w.dims();
        let n = rows * cols;
        self.cached(op, key, &[values, scales, mins], n, |dst| match (dtype, w) {
            // SAFETY: the slot holds at least n floats of this device and is used by no one
            // else while the cache's lock is held.
            (GemmDtype::F32, Weight::F32(t)) => unsafe { self.copy_to_addr(op, dst, t.data()) },
            (GemmDtype::F32, Weight::Quant(q)) => self.dequantize(op, q, dst),
            (half, _) => {
                // Dense f32 first, then rounded into the slot.
                let dense = match w {
                    Weight::F32(t) => self.upload(op, t.data())?,
                    Weight::Quant(q) => {
                        let out = self.zeros(op, n.max(1))?;
                        self.dequantize(op, q, self.addr(&out))?;
                        out
                    }
                };
                self.round_to(op, half, self.addr(&dense), dst, n)?;
                // `dense` is freed on return: wait until the rounding has read it.
                self.inner.sync(op)
            }
        })
    }

    /// The device copy of a small f32 vector of the model (a norm's weight), cached like the
    /// weight matrices.
    pub(super) fn vector(&self, op: &str, v: &[f32]) -> Result<Arc<Slot>> {
        let bytes: &[u8] = bytemuck::cast_slice(v);
        let key = WeightKey {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
            dtype: GemmDtype::F32,
            packed: false,
        };
        // SAFETY: as in `weight`: the slot holds at least v.len() floats and is this call's.
        self.cached(op, key, &[bytes], v.len(), |dst| unsafe { self.copy_to_addr(op, dst, v) })
    }

    /// The cache entry of `key` when it is current (made in this weights generation, not
    /// cleared since), else a slot of `elements` values of the key's dtype filled by `fill`
    /// (given its device address) from the host bytes `parts`: the entry's old slot when it
    /// has that size, so a weight keeps its address.
    pub(super) fn cached(
        &self,
        op: &str,
        key: WeightKey,
        parts: &[&[u8]],
        elements: usize,
        fill: impl FnOnce(u64) -> Result<()>,
    ) -> Result<Arc<Slot>> {
        // Read before the host bytes are: a change during the upload leaves the copy stale.
        let generation = weights_generation();
        #[cfg(debug_assertions)]
        let print = fingerprint(parts);
        #[cfg(not(debug_assertions))]
        let _ = parts;
        // Held through the upload, so two threads never upload the same weight twice.
        let mut cache = self.cache();
        if let Some(hit) = cache.entries.current(&key, generation) {
            #[cfg(debug_assertions)]
            if hit.print != print {
                tracing::warn!(
                    op,
                    addr = key.addr,
                    len = key.len,
                    "host weight bytes changed without tensor::memory::weights_changed(): \
                     uploading them again (a release build would use the old copy)"
                );
            } else {
                return Ok(hit.slot.clone());
            }
            #[cfg(not(debug_assertions))]
            return Ok(hit.slot.clone());
        }
        let bytes = elements.max(1) * key.dtype.size();
        let slot = match cache.entries.take(&key) {
            Some(old) if old.slot.bytes() == bytes => old.slot,
            _ => Arc::new(match &cache.arena {
                Some(arena) => {
                    let memory = alloc_device_exact(arena.as_ref(), bytes)?;
                    self.owned_addr(op, memory.as_ref())?;
                    Slot::Arena(memory)
                }
                None => Slot::Pool({
                    self.count(Count::Allocation);
                    self.count(Count::DeviceCopy);
                    self.stream()
                        .alloc_zeros::<u8>(bytes)
                        .or_unavailable(|| format!("{op}: allocating {bytes} bytes"))?
                }),
            }),
        };
        fill(self.slot_addr(&slot))?;
        let entry = CachedWeight {
            slot: slot.clone(),
            #[cfg(debug_assertions)]
            print,
        };
        cache.entries.insert(key, generation, entry);
        Ok(slot)
    }

    /// Uploads a quantized matrix and expands it to f32 on the device at address `out`, which
    /// holds at least rows·cols floats.
    fn dequantize(&self, op: &str, q: &crate::kernels::QMatrix, out: u64) -> Result<()> {
        let (rows, cols) = q.dims();
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        let (scales, mins, qs) = q.parts();
        let kind = super::quant::packing(q);
        let scales = self.upload(op, scales)?;
        // 8-bit weights have no minimums (nor may `Eight16` ones); the kernel then never reads
        // them, but needs a pointer.
        let mins = if mins.is_empty() { self.zeros(op, 1)? } else { self.upload(op, mins)? };
        let qs = self.upload(op, qs)?;
        let n64 = n as u64;
        let cfg = elementwise(op, n)?;
        let mut b = KernelCall::new(&self.inner.k.dequantize, cfg);
        b.arg(self.addr(&scales)).arg(self.addr(&mins)).arg(self.addr(&qs));
        b.arg(out).arg(n64).arg(kind);
        // SAFETY: the arguments match `dequantize(const float*, const float*, const unsigned
        // char*, float*, u64, int)`. For n = rows·cols elements it reads n/32 scales (n/16 for
        // kinds 2 and 3), as many minimums (kinds 1 and 3 only), n (8-bit) or n/2 (4-bit)
        // quant bytes, and writes n floats:
        // exactly the lengths of the buffers uploaded from a well-formed `QMatrix`, and at
        // most what `out` holds (the caller's promise).
        unsafe { self.issue(op, Call::Kernel(b)) }?;
        // The uploaded parts are freed on return: wait until the kernel has read them.
        self.inner.sync(op)
    }

    /// `positions` as u64 on the device. Every layer of a step passes the same query and key
    /// positions, so the last few arrays are kept and a repeat is not uploaded again (checked
    /// by value: the host comparison costs far less than a copy and its synchronization).
    /// In a step, every such array is staged instead (see [`super::staging`]).
    pub(super) fn positions(&self, op: &str, positions: &[usize]) -> Result<Staged<u64>> {
        let wanted: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
        self.stage(op, &wanted, || self.recent(op, &self.inner.positions, wanted.clone()))
    }

    /// A block table on the device: staged in a step, else kept as the positions are.
    pub(super) fn table(&self, op: &str, table: Vec<u32>) -> Result<Staged<u32>> {
        self.stage(op, &table, || self.recent(op, &self.inner.tables, table.clone()))
    }

    /// The device copy of `wanted` from `cache` when it holds the same values, else a new
    /// upload, kept there in place of the least recently used one.
    pub(super) fn recent<T: DeviceRepr + PartialEq>(
        &self,
        op: &str,
        cache: &Mutex<Recent<T>>,
        wanted: Vec<T>,
    ) -> Result<Arc<CudaSlice<T>>> {
        let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = cache.iter().position(|(p, _)| *p == wanted) {
            let hit = cache.remove(i);
            let dev = hit.1.clone();
            cache.push(hit);
            return Ok(dev);
        }
        let dev = Arc::new(self.upload(op, &wanted)?);
        if cache.len() == RECENT_UPLOADS {
            // Freed in stream order, after the kernels queued with it.
            cache.remove(0);
        }
        cache.push((wanted, dev.clone()));
        Ok(dev)
    }
}
