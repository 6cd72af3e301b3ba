//! [`Backend::attention_rows`]: the attention of a step's decode rows, one query row per
//! sequence, each against its own keys and values.

use super::cpu::attention::{self, KvBlocks};
use super::{check, device_memory_on_cpu, AttnShape, Backend, Kv};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::sync::Mutex;

/// Sequence `i`'s keys and values for [`Backend::attention_rows`]: `kv(i, f)` calls `f` with
/// them and their positions.
pub type RowKv<'a> = dyn Fn(usize, &mut dyn FnMut(Kv<'_>, &[usize])) + Sync + 'a;

/// The floats `kv` holds for keys and for values, and whether they cover `tokens` tokens of
/// `row` floats each.
pub(super) fn extent(kv: &Kv<'_>, tokens: usize, row: usize) -> (usize, usize, bool) {
    let need = tokens * row;
    match kv {
        Kv::Host { k, v } => (k.len(), v.len(), k.len() == need && v.len() == need),
        Kv::Device { k, v, elem } => {
            let (kn, vn) = (k.size() / elem.size(), v.size() / elem.size());
            (kn, vn, kn >= need && vn >= need)
        }
        Kv::Paged(blocks) => {
            let (k, v) = blocks.blocks();
            let sum = |b: &[&[f32]]| b.iter().map(|x| x.len()).sum::<usize>();
            (sum(k), sum(v), blocks.holds(tokens, row))
        }
        Kv::PagedDevice(blocks) => {
            let floats = blocks.memory.size() / 4;
            (floats, floats, blocks.holds(tokens, row))
        }
    }
}

/// The error of row `i`'s keys and values when they do not hold `tokens` tokens of `row`
/// floats each.
pub(super) fn misfit(
    kv: &Kv<'_>,
    tokens: usize,
    row: usize,
    i: usize,
    shape: AttnShape,
) -> Option<Error> {
    let (k_len, v_len, fits) = extent(kv, tokens, row);
    (!fits).then(|| {
        Error::shape(
            "attention",
            format!("k {k_len} v {v_len} for {tokens} keys of row {i}, {shape:?}"),
        )
    })
}

impl Backend {
    /// [`Backend::attention`] of `n = q_pos.len()` sequences' single query rows at once: row
    /// `i` of `q` (`[n, q_heads, head_dim]`), at position `q_pos[i]`, against sequence `i`'s
    /// keys and values, which `kv(i, f)` hands to `f`. Returns `[n, q_heads, head_dim]`, row
    /// `i` the same bits as [`Backend::attention`] of that row alone.
    ///
    /// On the CPU this is one parallel loop over the rows (a decode step of 64 sequences on a
    /// 30-layer model made 1,920 parallel loops of a few heads each before); `kv` is called on
    /// the pool's threads. On the CUDA backend it is one launch when every row's keys are
    /// blocks of one device pool (the engine's paged KV cache), else the rows one after
    /// another.
    ///
    /// # Errors
    /// As [`Backend::attention`], for the first row whose keys and values do not fit.
    pub fn attention_rows(
        &self,
        q: &Tensor,
        q_pos: &[usize],
        shape: AttnShape,
        kv: &RowKv<'_>,
    ) -> Result<Tensor> {
        let AttnShape { q_heads, kv_heads, head_dim, .. } = shape;
        let n = q_pos.len();
        check(
            "attention",
            kv_heads > 0 && q_heads % kv_heads == 0 && q.len() == n * q_heads * head_dim,
            || format!("q {} for {n} rows, {shape:?}", q.len()),
        )?;
        let cpu = match self {
            Backend::Cpu(cpu) => cpu,
            Backend::Cuda(cuda) => {
                if let Some(out) = cuda.attention_rows(q, q_pos, shape, kv)? {
                    return Ok(out);
                }
                return self.attention_each_row(q, q_pos, shape, kv);
            }
        };
        let row = kv_heads * head_dim;
        let first_error = Mutex::new(None);
        let fail = |e: Error| {
            first_error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
        };
        let blocks = |i: usize, f: &mut dyn FnMut(KvBlocks<'_>, &[usize])| {
            kv(i, &mut |kv, kv_pos| {
                if let Some(e) = misfit(&kv, kv_pos.len(), row, i, shape) {
                    return fail(e);
                }
                match kv {
                    Kv::Host { k, v } => {
                        let (k, v) = ([k], [v]);
                        f(KvBlocks::contiguous(&k, &v), kv_pos);
                    }
                    Kv::Paged(blocks) => f(blocks, kv_pos),
                    Kv::Device { .. } | Kv::PagedDevice(_) => {
                        fail(device_memory_on_cpu("attention"));
                    }
                }
            });
        };
        let mut out = Tensor::zeros(&[n, q_heads, head_dim]);
        let q = q.host()?;
        cpu.install(|| attention::attention_rows(q, q_pos, shape, out.data_mut(), &blocks));
        if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        cpu.output(out)
    }

    /// [`Backend::attention_rows`] as one [`Backend::attention`] per row.
    fn attention_each_row(
        &self,
        q: &Tensor,
        q_pos: &[usize],
        shape: AttnShape,
        kv: &RowKv<'_>,
    ) -> Result<Tensor> {
        let mut outs = Vec::with_capacity(q_pos.len());
        for i in 0..q_pos.len() {
            let qi = self.slice_first(q, i..i + 1)?;
            let mut out = None;
            kv(i, &mut |kv, kv_pos| {
                out = Some(self.attention(&qi, &q_pos[i..=i], kv, kv_pos, shape, false));
            });
            let (o, _) = out.ok_or_else(|| {
                Error::shape("attention", format!("no keys and values were given for row {i}"))
            })??;
            outs.push(o);
        }
        self.cat_first(&outs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_vec;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.data().iter().map(|x| x.to_bits()).collect()
    }

    /// Each row of a step is the same bits as its sequence's attention alone, for contiguous
    /// and paged keys of different lengths (up to several chunks), on a GQA shape with a window, a soft cap and a
    /// scale of its own; also the one-row-at-a-time path the CUDA backend takes.
    #[test]
    fn a_steps_rows_are_each_rows_attention_alone() {
        let be = Backend::cpu(2).unwrap();
        let plain = AttnShape::new(6, 2, 16);
        let shape = AttnShape { scale: Some(0.3), softcap: Some(2.0), window: Some(9), ..plain };
        let row = 2 * 16;
        // Past 128 keys a row's keys are taken in chunks, merged: 300 is three of them, and
        // with the window of 9 the first two see no key.
        let lens = [1, 5, 12, 17, 30, 3, 8, 300, 129];
        let keys: Vec<(Vec<f32>, Vec<f32>)> = lens
            .iter()
            .enumerate()
            .map(|(i, &t)| (random_vec(t * row, 50 + i as u64), random_vec(t * row, 70 + i as u64)))
            .collect();
        let positions: Vec<Vec<usize>> = lens.iter().map(|&t| (0..t).collect()).collect();
        // Paged: blocks of 4 tokens (the last partly filled), for the odd sequences.
        fn in_blocks(x: &[f32], rows: usize) -> Vec<&[f32]> {
            x.chunks(rows).collect()
        }
        let paged: Vec<_> =
            keys.iter().map(|(k, v)| (in_blocks(k, 4 * row), in_blocks(v, 4 * row))).collect();
        let kv = |i: usize, f: &mut dyn FnMut(Kv<'_>, &[usize])| {
            let kv = if i % 2 == 1 {
                Kv::Paged(KvBlocks::new(&paged[i].0, &paged[i].1, 4).unwrap())
            } else {
                Kv::Host { k: &keys[i].0, v: &keys[i].1 }
            };
            f(kv, &positions[i]);
        };
        for s in [plain, shape] {
            let q = Tensor::from_vec(&[lens.len(), 6, 16], random_vec(lens.len() * 96, 9)).unwrap();
            let q_pos: Vec<usize> = lens.iter().map(|&t| t - 1).collect();
            let step = be.attention_rows(&q, &q_pos, s, &kv).unwrap();
            let one_by_one = be.attention_each_row(&q, &q_pos, s, &kv).unwrap();
            assert_eq!(bits(&step), bits(&one_by_one));
            for (i, &p) in q_pos.iter().enumerate() {
                let qi = be.slice_first(&q, i..i + 1).unwrap();
                let (k, v) = &keys[i];
                let kv = Kv::Host { k, v };
                let (alone, _) = be.attention(&qi, &[p], kv, &positions[i], s, false).unwrap();
                assert_eq!(bits(&alone), bits(&step)[i * 96..(i + 1) * 96], "row {i}, {s:?}");
            }
        }
    }

    #[test]
    fn keys_too_short_for_their_positions_are_an_error_naming_the_row() {
        let be = Backend::cpu(2).unwrap();
        let s = AttnShape::new(2, 1, 8);
        let (k, v) = (random_vec(3 * 8, 1), random_vec(3 * 8, 2));
        let kv = |i: usize, f: &mut dyn FnMut(Kv<'_>, &[usize])| {
            let tokens = if i == 2 { 2 } else { 3 };
            f(Kv::Host { k: &k[..tokens * 8], v: &v[..tokens * 8] }, &[0, 1, 2]);
        };
        let q = Tensor::from_vec(&[4, 2, 8], random_vec(4 * 16, 3)).unwrap();
        let e = be.attention_rows(&q, &[2; 4], s, &kv).unwrap_err().to_string();
        assert!(e.contains("row 2") && e.contains("3 keys"), "{e}");
        let q = Tensor::from_vec(&[3, 2, 8], random_vec(3 * 16, 3)).unwrap();
        let e = be.attention_rows(&q, &[2; 4], s, &kv).unwrap_err().to_string();
        assert!(e.contains("for 4 rows"), "{e}");
    }
}
