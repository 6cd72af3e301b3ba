//! Causal GQA attention: one launch over key ranges, read from host, device or paged KV
//! caches, with the score rules of `AttnShape` (query scale, soft-cap, sliding window), and
//! the merge of the ranges' partial results.

use super::{int, per_row, Count, CudaBackend, OrUnavailable};
use crate::error::{Error, Result};
use crate::kernels::cpu::attention::AttnShape;
use crate::kernels::cuda::{attention_blocks, attention_splits, ATTN_TILE};
use crate::kernels::{Kv, KvElem};
use crate::tensor::Tensor;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// Threads per block of `attention` (`ATTN_BLOCK` in `kernels.cu`).
const ATTN_BLOCK: u32 = ATTN_TILE as u32;
/// Largest head dimension `attention` handles (`ATTN_BLOCK * ATTN_DIMS` in `kernels.cu`).
const ATTN_MAX_HEAD_DIM: usize = 512;

impl CudaBackend {
    /// Causal GQA attention with per-row log-sum-exp (see `cpu::attention::attention`):
    /// returns `[q_pos.len(), q_heads, head_dim]` and, when `want_lse`, `[q_pos.len(), q_heads]`.
    pub(crate) fn attention(
        &self,
        q: &Tensor,
        q_pos: &[usize],
        kv: Kv<'_>,
        kv_pos: &[usize],
        shape: AttnShape,
        want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "attention";
        let AttnShape { q_heads, kv_heads, head_dim, .. } = shape;
        let rows = q_pos.len() * q_heads;
        let (out_shape, lse_shape) = ([q_pos.len(), q_heads, head_dim], [q_pos.len(), q_heads]);
        if head_dim > ATTN_MAX_HEAD_DIM {
            return Err(Error::shape(
                OP,
                format!("head_dim {head_dim} exceeds the cuda kernel's {ATTN_MAX_HEAD_DIM}"),
            ));
        }
        // The kernel reads a cap of 0 as none, so only a positive one can be passed on.
        if let Some(cap) = shape.softcap.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(Error::shape(
                OP,
                format!("attention soft-cap {cap} is not a positive finite number"),
            ));
        }
        if rows == 0 || head_dim == 0 || kv_pos.is_empty() {
            // No keys at all: zeros and -inf, the neutral partial result.
            let lse = want_lse
                .then(|| Tensor::from_vec(&lse_shape, vec![f32::NEG_INFINITY; rows]))
                .transpose()?;
            return Ok((Tensor::zeros(&out_shape), lse));
        }
        let qd = self.input(OP, q)?;
        let qpd = self.positions(OP, q_pos)?;
        // Host keys and values are uploaded for this call; a device cache is read in place,
        // a paged one through its block table (uploaded here).
        let mut staged = None;
        let mut table = None;
        // Key row j is at `table[j / block_size] · block_stride + (j % block_size) · row`
        // with a table, at `j · row` without.
        let (mut block_size, mut block_stride) = (1, 0u64);
        // Only device caches and pools may hold bf16 keys and values.
        let mut kv_bf16 = 0i32;
        let (kp, vp) = match kv {
            Kv::Host { k, v } => {
                let (kd, vd) = staged.insert((self.upload(OP, k)?, self.upload(OP, v)?));
                (self.addr(kd), self.addr(vd))
            }
            Kv::Device { k, v, elem } => {
                kv_bf16 = i32::from(elem == KvElem::Bf16);
                (self.owned_addr(OP, k)?, self.owned_addr(OP, v)?)
            }
            Kv::Paged(blocks) => {
                // Host blocks are copied into one buffer per tensor and uploaded.
                let (k, v) = blocks.gather(kv_pos.len(), kv_heads * head_dim);
                let (kd, vd) = staged.insert((self.upload(OP, &k)?, self.upload(OP, &v)?));
                (self.addr(kd), self.addr(vd))
            }
            Kv::PagedDevice(blocks) => {
                let used = kv_pos.len().div_ceil(blocks.block_size);
                // The same table in every layer of a step: uploaded once.
                let wanted = blocks.table[..used].to_vec();
                table = Some(self.recent(OP, &self.inner.tables, wanted)?);
                block_size = int(OP, "block_size", blocks.block_size)?;
                block_stride = blocks.block_stride as u64;
                let base = self.owned_addr(OP, blocks.memory)?;
                kv_bf16 = i32::from(blocks.elem == KvElem::Bf16);
                let at = |elements: usize| base + (blocks.elem.size() * elements) as u64;
                (at(blocks.keys), at(blocks.values))
            }
        };
        let tp = table.as_ref().map_or(0, |t| self.addr(t));
        let kpd = self.positions(OP, kv_pos)?;
        let n_kv = kv_pos.len();
        let blocks = attention_blocks(q_pos.len(), q_heads, kv_heads);
        let (splits, chunk) = attention_splits(blocks, n_kv);
        // Written whole: block (r, s) writes row s·rows + r of out (head_dim floats) and of
        // lse; with one range those are the answer, with several the partial results.
        let mut od = self.output_buf(OP, splits * rows * head_dim)?;
        let mut ld = self.output_buf(OP, splits * rows)?;
        let args = [
            int(OP, "keys", n_kv)?,
            int(OP, "q_heads", q_heads)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
        ];
        let chunk32 = int(OP, "key range", chunk)?;
        // The CPU's factor (the query scale, or 1/sqrt(d) computed in f32 the same way), its
        // cap (0: none) and its window in positions (all ones: none, so every key from
        // position 0 on is in it).
        let scale = shape.factor();
        let softcap = shape.softcap.unwrap_or(0.0);
        let window = shape.window.map_or(u64::MAX, |w| w as u64);
        let mut cfg = per_row(OP, blocks, ATTN_BLOCK)?;
        cfg.grid_dim.1 = splits as u32;
        self.count(Count::Launch);
        let mut b = self.stream().launch_builder(&self.inner.k.attention);
        b.arg(&qd.ptr).arg(&*qpd).arg(&kp).arg(&vp).arg(&*kpd);
        b.arg(&tp).arg(&block_size).arg(&block_stride);
        for a in &args {
            b.arg(a);
        }
        b.arg(&scale)
            .arg(&softcap)
            .arg(&window)
            .arg(&chunk32)
            .arg(&kv_bf16)
            .arg(&mut od)
            .arg(&mut ld);
        // SAFETY: the arguments match `attention(const float*, const u64*, const float*,
        // const float*, const u64*, const unsigned*, int, u64, int, int, int, int, float,
        // float, u64, int, int, float*, float*)`; keys and values are bf16 (two bytes an element) exactly when
        // kv_bf16 is 1. Block (b, s) serves query token i, KV head g and up to ATTN_GROUP
        // of g's query heads (b = (i·kv_heads + g)·slices + slice, the grid's first dimension
        // being `attention_blocks`): it reads q_pos[i] and those heads' rows of q (head_dim
        // floats each), the key positions of its range [s·chunk, (s+1)·chunk) ∩ [0, n_kv) and
        // head g of those key and value rows, and writes those rows' entries s·rows + row of
        // out and lse, which hold splits·rows rows (splits·chunk >= n_kv, from
        // `attention_splits`). The caller checked q holds q_pos.len()·q_heads·head_dim
        // floats and that the keys and values hold kv_pos.len() rows of kv_heads·head_dim:
        // contiguous buffers at least that long (staged ones are freed stream-ordered, after
        // the kernel; a device cache is mapped while steps run, as `DeviceMemory` promises),
        // or a paged pool whose table (uploaded above, ceil(n_kv / block_size) ids, freed
        // stream-ordered) names blocks that lie inside it (`DeviceBlocks::holds`); q_heads is
        // a multiple of kv_heads (so g < kv_heads); head_dim <= 512 fits the kernel's
        // per-thread output slots and shared query copy.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        let (od, ld) = if splits == 1 {
            (od, ld)
        } else {
            self.merge_attention(&od, &ld, splits, rows, head_dim)?
        };
        let lse = want_lse.then(|| self.output(&lse_shape, ld)).transpose()?;
        Ok((self.output(&out_shape, od)?, lse))
    }

    /// Row r of the combined attention result from the `splits` partial results of key
    /// ranges in `part` / `part_lse` (rows s·rows + r): `[rows, head_dim]` and `[rows]`.
    fn merge_attention(
        &self,
        part: &CudaSlice<f32>,
        part_lse: &CudaSlice<f32>,
        splits: usize,
        rows: usize,
        head_dim: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        const OP: &str = "attention merge";
        // Written whole: block r writes row r of out (head_dim floats) and lse[r].
        let mut od = self.output_buf(OP, rows * head_dim)?;
        let mut ld = self.output_buf(OP, rows)?;
        let args =
            [int(OP, "splits", splits)?, int(OP, "rows", rows)?, int(OP, "head_dim", head_dim)?];
        let cfg = per_row(OP, rows, ATTN_BLOCK)?;
        self.count(Count::Launch);
        let mut b = self.stream().launch_builder(&self.inner.k.attention_merge);
        b.arg(part).arg(part_lse);
        for a in &args {
            b.arg(a);
        }
        b.arg(&mut od).arg(&mut ld);
        // SAFETY: the arguments match `attention_merge(const float*, const float*, int, int,
        // int, float*, float*)`. Block r reads rows s·rows + r (s < splits) of part (head_dim
        // floats each) and part_lse, which hold splits·rows rows, written by the attention
        // launch before it on this stream, and writes row r of out and lse[r], which hold
        // rows rows.
        unsafe { b.launch(cfg) }.or_unavailable(|| format!("{OP}: launch"))?;
        Ok((od, ld))
    }
}
