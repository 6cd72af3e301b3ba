//! Copies on the device: rows sliced and stacked, and tensors written into device memory
//! someone else owns (a KV cache append, also row by row to scattered places in one launch).

use super::buffers::StepBuf;
use super::graphs::{Call, KernelCall};
use super::{elementwise, int, CudaBackend};
use crate::error::Result;
use crate::kernels::{GemmDtype, KvElem};
use crate::tensor::Tensor;
use mesh::DeviceMemory;

impl CudaBackend {
    /// Copies `src` into device memory `dst`, stored as `elem` (bf16 rounded on the host, to
    /// nearest even as the `to_bf16` kernel rounds), from its `offset`-th element on (the
    /// caller checked that they fit).
    pub(crate) fn write_device(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        offset: usize,
        src: &[f32],
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        const OP: &str = "kv cache append";
        debug_assert!(elem.size() * (offset + src.len()) <= dst.size());
        let at = self.owned_addr(OP, dst)? + (elem.size() * offset) as u64;
        match elem {
            // SAFETY: `dst` is memory of this device (checked above) that its `DeviceMemory`
            // implementation promises is mapped while kernels may run; the src.len() elements
            // from `offset` lie inside it (checked by the caller).
            KvElem::F32 => unsafe { self.copy_to_addr(OP, at, src) },
            KvElem::Bf16 => {
                let bits: Vec<u16> =
                    src.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                // SAFETY: as for f32, with two bytes an element.
                unsafe { self.copy_to_addr(OP, at, &bits) }
            }
        }
    }

    /// Row `s` of `src` (rows of `row` floats) into elements `shift + d..` of `dst` (`row` of
    /// them), stored as `elem`, for every `(s, d)` of `moves`, in one launch (the caller
    /// checked that the rows are in `src` and the places inside `dst`). The moves are uploaded
    /// through the recent-arrays cache: a step passes the same ones in every layer of a group.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_rows(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        src: &Tensor,
        row: usize,
        moves: &[(usize, usize)],
        shift: usize,
    ) -> Result<()> {
        const OP: &str = "kv cache append";
        if moves.is_empty() || row == 0 {
            return Ok(());
        }
        let to = self.owned_addr(OP, dst)?;
        let sd = self.input(OP, src)?;
        let flat: Vec<usize> = moves.iter().flat_map(|&(s, d)| [s, d]).collect();
        let md = self.positions(OP, &flat)?;
        let (n, row32) = (int(OP, "rows", moves.len())?, int(OP, "row", row)?);
        let (shift, bf16) = (shift as u64, i32::from(elem == KvElem::Bf16));
        let cfg = elementwise(OP, moves.len() * row)?;
        let mut b = KernelCall::new(&self.inner.k.write_rows, cfg);
        b.arg(sd.ptr).arg(to).arg(md.ptr).arg(shift).arg(n).arg(row32).arg(bf16);
        // SAFETY: the arguments match `write_rows(const float*, float*, const u64*, u64, int,
        // int, int)`; thread (m, c) for m < n reads element moves[m].0·row + c of src, inside
        // its rows (checked by the caller), and writes element shift + moves[m].1 + c of dst,
        // in f32 or (bf16 = 1, two bytes an element) bf16, inside `dst` (checked by the
        // caller), memory of this device (checked above) that its `DeviceMemory`
        // implementation promises is mapped while kernels may run; the moves' upload is kept
        // by the cache or freed stream-ordered.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        Ok(())
    }

    /// Rows `range` of `t`'s first dimension: a device-to-device copy when `t` is this
    /// backend's output, else [`Tensor::slice_first`] (which also reports a bad range).
    pub(crate) fn slice_first(&self, t: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
        const OP: &str = "slice rows";
        let first = t.shape().first().copied().unwrap_or(0);
        let Some(buf) = self.own(t.storage().device_data()) else {
            return t.slice_first(range);
        };
        if range.start > range.end || range.end > first {
            return t.slice_first(range);
        }
        let step = t.len() / first.max(1);
        let mut shape = t.shape().to_vec();
        shape[0] = range.len();
        let n = range.len() * step;
        if n == 0 {
            return Ok(Tensor::zeros(&shape));
        }
        // Written whole by the copy below.
        let od = self.output_buf(OP, n)?;
        self.bind(OP)?;
        let from = buf.ptr + 4 * (range.start * step) as u64;
        let to = od.ptr;
        // SAFETY: `buf` holds t.len() floats of this stream's device, of which the n from
        // range.start·step are read (range checked above); `od` holds n floats; both are
        // freed stream-ordered, after the copy.
        unsafe { self.issue(OP, Call::Copy { dst: to, src: from, bytes: 4 * n }) }?;
        self.output(&shape, od)
    }

    /// `parts` stacked along their first dimension: device-to-device copies when every part is
    /// this backend's output, else [`Tensor::cat_first`] (which also checks the shapes).
    pub(crate) fn cat_first(&self, parts: &[Tensor]) -> Result<Tensor> {
        const OP: &str = "stack rows";
        let bufs: Option<Vec<&StepBuf<f32>>> =
            parts.iter().map(|p| self.own(p.storage().device_data())).collect();
        let (Some(bufs), Some(head)) = (bufs, parts.first()) else {
            return Tensor::cat_first(parts);
        };
        let inner = &head.shape()[1.min(head.shape().len())..];
        if parts.iter().any(|p| p.shape().is_empty() || &p.shape()[1..] != inner) {
            return Tensor::cat_first(parts);
        }
        let mut shape = head.shape().to_vec();
        shape[0] = parts.iter().map(|p| p.shape()[0]).sum();
        let total: usize = parts.iter().map(Tensor::len).sum();
        if total == 0 {
            return Ok(Tensor::zeros(&shape));
        }
        // Written whole: the parts' lengths add up to `total`.
        let od = self.output_buf(OP, total)?;
        self.bind(OP)?;
        let base = od.ptr;
        let mut at = 0usize;
        for (part, buf) in parts.iter().zip(bufs) {
            let n = part.len();
            if n == 0 {
                continue;
            }
            let copy = Call::Copy { dst: base + 4 * at as u64, src: buf.ptr, bytes: 4 * n };
            // SAFETY: `buf` holds the part's n floats on this stream's device; `od` holds
            // `total` floats, of which at..at + n are written (the lengths add up to total);
            // both are freed stream-ordered, after the copy.
            unsafe { self.issue(OP, copy) }?;
            at += n;
        }
        self.output(&shape, od)
    }

    /// Copies elements `range` of `src` to device memory `dst` from its `offset`-th f32 on
    /// (the caller checked that they fit and lie in `src`): a device-to-device copy for this
    /// backend's outputs.
    pub(crate) fn write_tensor(
        &self,
        dst: &dyn DeviceMemory,
        elem: KvElem,
        offset: usize,
        src: &Tensor,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        const OP: &str = "kv cache append";
        let Some(buf) = self.own(src.storage().device_data()) else {
            return self.write_device(dst, elem, offset, &src.host()?[range]);
        };
        if range.is_empty() {
            return Ok(());
        }
        debug_assert!(elem.size() * (offset + range.len()) <= dst.size() && range.end <= src.len());
        self.bind(OP)?;
        let from = buf.ptr + 4 * range.start as u64;
        let to = self.owned_addr(OP, dst)? + (elem.size() * offset) as u64;
        if elem == KvElem::Bf16 {
            // Rounded on the device straight into the pool: `round_to` writes range.len()
            // halves at `to`, inside `dst` (checked by the caller), reading range.len() floats
            // of `buf` from range.start, on this stream.
            return self.round_to(OP, GemmDtype::Bf16, from, to, range.len());
        }
        // SAFETY: `dst` is memory of this device (checked above) that its `DeviceMemory`
        // implementation promises is mapped while kernels may run, and the range lies inside
        // it (checked by the caller); `buf` holds the src.len() floats of which `range` is
        // read, on this stream, and is freed stream-ordered after the copy.
        unsafe { self.issue(OP, Call::Copy { dst: to, src: from, bytes: 4 * range.len() }) }
    }
}
