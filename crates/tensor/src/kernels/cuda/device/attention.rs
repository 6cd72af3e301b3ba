//! Causal GQA attention: one launch over key ranges, read from host, device or paged KV
//! caches, with the score rules of `AttnShape` (query scale, soft-cap, sliding window), and
//! the merge of the ranges' partial results.

use super::buffers::StepBuf;
use super::graphs::{Call, KernelCall};
use super::{int, per_row, CudaBackend};
use crate::error::{Error, Result};
use crate::kernels::cpu::attention::AttnShape;
use crate::kernels::cuda::{attention_blocks, attention_most_splits, ATTN_TILE};
use crate::kernels::step_attention::{misfit, RowKv};
use crate::kernels::{Kv, KvElem};
use crate::tensor::Tensor;

/// Threads per block of `attention` (`ATTN_BLOCK` in `kernels.cu`).
const ATTN_BLOCK: u32 = ATTN_TILE as u32;
/// Largest head dimension `attention` handles (`ATTN_BLOCK * ATTN_DIMS` in `kernels.cu`).
const ATTN_MAX_HEAD_DIM: usize = 512;

/// Where `attention` finds keys and values: device addresses of the keys, the values, their
/// positions and the block table (0: contiguous rows), and the table's block layout.
struct Keys {
    k: u64,
    v: u64,
    pos: u64,
    table: u64,
    block_size: i32,
    block_stride: u64,
}

/// What an attention launch leaves: the outputs, their log-sum-exps, and on a bf16 backend the
/// outputs rounded to bf16.
type Attended = (StepBuf<f32>, StepBuf<f32>, Option<StepBuf<u16>>);

/// What the kernel cannot take: a head larger than its output slots, a soft-cap that is not a
/// positive finite number (it reads 0 as none).
fn check_shape(shape: AttnShape) -> Result<()> {
    const OP: &str = "attention";
    let head_dim = shape.head_dim;
    if head_dim > ATTN_MAX_HEAD_DIM {
        return Err(Error::shape(
            OP,
            format!("head_dim {head_dim} exceeds the cuda kernel's {ATTN_MAX_HEAD_DIM}"),
        ));
    }
    if let Some(cap) = shape.softcap.filter(|c| !(c.is_finite() && *c > 0.0)) {
        return Err(Error::shape(
            OP,
            format!("attention soft-cap {cap} is not a positive finite number"),
        ));
    }
    Ok(())
}

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
        check_shape(shape)?;
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
                table = Some(self.table(OP, wanted)?);
                block_size = int(OP, "block_size", blocks.block_size)?;
                block_stride = blocks.block_stride as u64;
                let base = self.owned_addr(OP, blocks.memory)?;
                kv_bf16 = i32::from(blocks.elem == KvElem::Bf16);
                let at = |elements: usize| base + (blocks.elem.size() * elements) as u64;
                (at(blocks.keys), at(blocks.values))
            }
        };
        let tp = table.as_ref().map_or(0, |t| t.ptr);
        let kpd = self.positions(OP, kv_pos)?;
        let keys = Keys { k: kp, v: vp, pos: kpd.ptr, table: tp, block_size, block_stride };
        let (od, ld, half) = self.launch_attention(
            qd.ptr,
            qpd.ptr,
            keys,
            kv_pos.len(),
            kv_bf16,
            0,
            q_pos.len(),
            shape,
        )?;
        let lse = want_lse.then(|| self.output(&lse_shape, ld)).transpose()?;
        Ok((self.output_with_half(&out_shape, od, half)?, lse))
    }

    /// [`crate::Backend::attention_rows`] in one launch when every row's keys and values are
    /// blocks of the same device pool (a step's decode rows over the engine's paged KV cache on
    /// a GPU): the rows' key positions and block tables are concatenated (uploaded once per
    /// step: every layer of the step has the same), and the kernel finds each row's through
    /// `seqs`. Key ranges are cut for the longest row; a shorter row's ranges past its keys are
    /// empty and weigh nothing in the merge. `None` when the rows' keys are elsewhere (the
    /// caller then runs them one at a time). The caller checked `q`'s size.
    ///
    /// # Errors
    /// A row whose blocks do not hold its keys (named), and those of [`CudaBackend::attention`].
    pub(crate) fn attention_rows(
        &self,
        q: &Tensor,
        q_pos: &[usize],
        shape: AttnShape,
        kv: &RowKv<'_>,
    ) -> Result<Option<Tensor>> {
        const OP: &str = "attention";
        let AttnShape { q_heads, kv_heads, head_dim, .. } = shape;
        let n = q_pos.len();
        /// Where a row's keys live: the pool and its layout, equal for every row.
        #[derive(PartialEq)]
        struct Pool {
            base: u64,
            keys: usize,
            values: usize,
            block_size: usize,
            block_stride: usize,
            elem: KvElem,
        }
        let (mut pool, mut one_pool, mut failed) = (None::<Pool>, true, None);
        let (mut kv_pos_all, mut table_all) = (Vec::new(), Vec::new());
        let mut seqs = Vec::with_capacity(3 * n);
        for i in 0..n {
            kv(i, &mut |kv, kv_pos| {
                let Kv::PagedDevice(b) = &kv else {
                    one_pool = false;
                    return;
                };
                if let Some(e) = misfit(&kv, kv_pos.len(), kv_heads * head_dim, i, shape) {
                    failed = Some(e);
                    return;
                }
                let base = match self.owned_addr(OP, b.memory) {
                    Ok(base) => base,
                    Err(e) => return failed = Some(e),
                };
                let this = Pool {
                    base,
                    keys: b.keys,
                    values: b.values,
                    block_size: b.block_size,
                    block_stride: b.block_stride,
                    elem: b.elem,
                };
                match &pool {
                    Some(p) if *p != this => one_pool = false,
                    Some(_) => {}
                    None => pool = Some(this),
                }
                seqs.extend([kv_pos_all.len(), table_all.len(), kv_pos.len()]);
                kv_pos_all.extend_from_slice(kv_pos);
                let used = kv_pos.len().div_ceil(b.block_size.max(1));
                table_all.extend_from_slice(&b.table[..used]);
            });
            if let Some(e) = failed.take() {
                return Err(e);
            }
            if !one_pool {
                return Ok(None);
            }
        }
        let (Some(pool), Some(&most)) = (pool, seqs.iter().skip(2).step_by(3).max()) else {
            return Ok(None);
        };
        let out_shape = [n, q_heads, head_dim];
        if most == 0 || head_dim == 0 {
            return Ok(Some(Tensor::zeros(&out_shape)));
        }
        check_shape(shape)?;
        let qd = self.input(OP, q)?;
        let qpd = self.positions(OP, q_pos)?;
        // The same in every layer of a step: each uploaded once per step.
        let kpd = self.positions(OP, &kv_pos_all)?;
        let sd = self.positions(OP, &seqs)?;
        let table = self.table(OP, table_all)?;
        let at = |elements: usize| pool.base + (pool.elem.size() * elements) as u64;
        let keys = Keys {
            k: at(pool.keys),
            v: at(pool.values),
            pos: kpd.ptr,
            table: table.ptr,
            block_size: int(OP, "block_size", pool.block_size)?,
            block_stride: pool.block_stride as u64,
        };
        let kv_bf16 = i32::from(pool.elem == KvElem::Bf16);
        // Each token reads its own count of keys from `seqs`: the launch's arguments do not
        // depend on the context (0 keys), so they repeat at every step of the shape.
        let (od, _, half) =
            self.launch_attention(qd.ptr, qpd.ptr, keys, 0, kv_bf16, sd.ptr, n, shape)?;
        Ok(Some(self.output_with_half(&out_shape, od, half)?))
    }

    /// Launches `attention` over `tokens` query tokens (and the merge of its key ranges when
    /// there are several): the output and log-sum-exp rows, and on a bf16 backend the output
    /// rounded to bf16 by the same launch (the output projection's input). `n_kv` is the keys
    /// of every token; with `seqs` (a device address; 0 for none) each token's own count is
    /// there and `n_kv` is unread.
    #[allow(clippy::too_many_arguments)]
    fn launch_attention(
        &self,
        q: u64,
        q_pos: u64,
        keys: Keys,
        n_kv: usize,
        kv_bf16: i32,
        seqs: u64,
        tokens: usize,
        shape: AttnShape,
    ) -> Result<Attended> {
        const OP: &str = "attention";
        let AttnShape { q_heads, kv_heads, head_dim, .. } = shape;
        let rows = tokens * q_heads;
        let blocks = attention_blocks(tokens, q_heads, kv_heads);
        // As many key ranges as the step's shape wants, whatever its keys: the kernel splits
        // each token's keys over them (chunk 0) and a range past them is empty, so a decode
        // step's launch, buffers and merge are the same at every context length (see
        // `attention_most_splits`).
        let most = attention_most_splits(blocks);
        let half = self.half_buf(OP, rows * head_dim)?;
        // Written by the attention kernel with one range, by the merge with several.
        let hp = if most == 1 { self.half_addr(&half) } else { 0 };
        // Block (r, s) writes row s·rows + r of out (head_dim floats) and of lse, for s <
        // most; with one range those are the answer, else the partial results.
        let od = self.output_buf(OP, most * rows * head_dim)?;
        let ld = self.output_buf(OP, most * rows)?;
        let args = [
            int(OP, "keys", n_kv)?,
            int(OP, "q_heads", q_heads)?,
            int(OP, "kv_heads", kv_heads)?,
            int(OP, "head_dim", head_dim)?,
        ];
        // 0: each token's keys split evenly over the ranges, in whole tiles.
        let chunk32 = 0i32;
        // The CPU's factor (the query scale, or 1/sqrt(d) computed in f32 the same way), its
        // cap (0: none) and its window in positions (all ones: none, so every key from
        // position 0 on is in it).
        let scale = shape.factor();
        let softcap = shape.softcap.unwrap_or(0.0);
        let window = shape.window.map_or(u64::MAX, |w| w as u64);
        let mut cfg = per_row(OP, blocks, ATTN_BLOCK)?;
        cfg.grid_dim.1 = int(OP, "key ranges", most)? as u32;
        let mut b = KernelCall::new(&self.inner.k.attention, cfg);
        b.arg(q).arg(q_pos).arg(keys.k).arg(keys.v).arg(keys.pos);
        b.arg(keys.table).arg(keys.block_size).arg(keys.block_stride);
        b.args(&args);
        b.arg(scale)
            .arg(softcap)
            .arg(window)
            .arg(chunk32)
            .arg(kv_bf16)
            .arg(seqs)
            .arg(od.ptr)
            .arg(ld.ptr)
            .arg(hp);
        // SAFETY: the arguments match `attention(const float*, const u64*, const float*,
        // const float*, const u64*, const unsigned*, int, u64, int, int, int, int, float,
        // float, u64, int, int, const u64*, float*, float*, unsigned short*)`; keys and
        // values are bf16 (two bytes an element) exactly when kv_bf16 is 1; `half`, when not
        // null (one range only), holds rows·head_dim halves, written as out is. Block (b, s)
        // serves query token i, KV head g and up to ATTN_GROUP of g's query heads (b =
        // (i·kv_heads + g)·slices + slice, the grid's first dimension being
        // `attention_blocks`): it reads q_pos[i] and
        // those heads' rows of q (head_dim floats each), the key positions of its range
        // [s·chunk_i, (s+1)·chunk_i) ∩ [0, n_i) (chunk_i from n_i and the grid's `most`
        // ranges, `attention_chunk`) and head g of those key and value rows, and writes those
        // rows' entries s·rows + row of out and lse, which hold most·rows rows (s < most, the
        // grid's second dimension). Without `seqs`, n_i = n_kv
        // and the callers checked q holds tokens·q_heads·head_dim floats and that the keys
        // and values hold n_kv rows of kv_heads·head_dim: contiguous buffers at least that
        // long (staged ones are freed stream-ordered, after the kernel; a device cache is
        // mapped while steps run, as `DeviceMemory` promises), or a paged pool whose table
        // (uploaded, ceil(n_kv / block_size) ids, freed stream-ordered) names blocks that lie
        // inside it (`DeviceBlocks::holds`). With `seqs` (3 u64 per token, uploaded by
        // `attention_rows`), token i reads its n_i = seqs[3i + 2] key positions from offset
        // seqs[3i] of the concatenated positions and its ceil(n_i / block_size) block ids
        // from offset seqs[3i + 1] of the concatenated table, each checked to hold its keys
        // inside the one pool. q_heads is a multiple of kv_heads (so g < kv_heads); head_dim
        // <= 512 fits the kernel's per-thread output slots and shared query copy.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        if most == 1 {
            return Ok((od, ld, half));
        }
        let mp = self.half_addr(&half);
        let (od, ld) = self.merge_attention(&od, &ld, most, rows, head_dim, mp)?;
        Ok((od, ld, half))
    }

    /// Row r of the combined attention result from the `splits` partial results of key
    /// ranges in `part` / `part_lse` (rows s·rows + r): `[rows, head_dim]` and `[rows]`.
    fn merge_attention(
        &self,
        part: &StepBuf<f32>,
        part_lse: &StepBuf<f32>,
        splits: usize,
        rows: usize,
        head_dim: usize,
        half: u64,
    ) -> Result<(StepBuf<f32>, StepBuf<f32>)> {
        const OP: &str = "attention merge";
        // Written whole: block r writes row r of out (head_dim floats) and lse[r].
        let od = self.output_buf(OP, rows * head_dim)?;
        let ld = self.output_buf(OP, rows)?;
        let args =
            [int(OP, "splits", splits)?, int(OP, "rows", rows)?, int(OP, "head_dim", head_dim)?];
        let cfg = per_row(OP, rows, ATTN_BLOCK)?;
        let mut b = KernelCall::new(&self.inner.k.attention_merge, cfg);
        b.arg(part.ptr).arg(part_lse.ptr);
        b.args(&args);
        b.arg(od.ptr).arg(ld.ptr).arg(half);
        // SAFETY: the arguments match `attention_merge(const float*, const float*, int, int,
        // int, float*, float*, unsigned short*)`. Block r reads rows s·rows + r (s < splits) of
        // part (head_dim floats each) and part_lse, which hold at least splits·rows rows, written by the
        // attention launch before it on this stream, and writes row r of out and lse[r], which
        // hold rows rows, and of `half` (rows·head_dim halves) unless it is null.
        unsafe { self.issue(OP, Call::Kernel(b)) }?;
        Ok((od, ld))
    }
}
