//! Element types that travel through collectives, reduction operators and their kernels.

use half::{bf16, f16};
use std::fmt;

/// The element type of a buffer, checked to agree on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ElemType {
    /// Raw bytes (no reduction other than wrapping sum, max, min).
    U8,
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit signed integer.
    I64,
}

impl ElemType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            ElemType::U8 => 1,
            ElemType::F16 | ElemType::BF16 => 2,
            ElemType::F32 => 4,
            ElemType::I64 => 8,
        }
    }

    /// The name users write.
    pub const fn name(self) -> &'static str {
        match self {
            ElemType::U8 => "u8",
            ElemType::F32 => "f32",
            ElemType::F16 => "f16",
            ElemType::BF16 => "bf16",
            ElemType::I64 => "i64",
        }
    }

    pub(crate) const fn code(self) -> u32 {
        match self {
            ElemType::U8 => 1,
            ElemType::F32 => 2,
            ElemType::F16 => 3,
            ElemType::BF16 => 4,
            ElemType::I64 => 5,
        }
    }

    pub(crate) fn from_code(code: u32) -> Option<ElemType> {
        [ElemType::U8, ElemType::F32, ElemType::F16, ElemType::BF16, ElemType::I64]
            .into_iter()
            .find(|d| d.code() == code)
    }
}

impl fmt::Display for ElemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How `all_reduce` and `reduce_scatter` combine the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (f16/bf16 accumulate in f32; integers wrap).
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ReduceOp {
    pub(crate) const fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
        }
    }

    pub(crate) fn from_code(code: u32) -> Option<ReduceOp> {
        [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min].into_iter().find(|o| o.code() == code)
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// A plain-data element type with a [`ElemType`].
pub trait Element: bytemuck::Pod + Send + Sync {
    /// Its dtype tag.
    const DTYPE: ElemType;
}

impl Element for u8 {
    const DTYPE: ElemType = ElemType::U8;
}
impl Element for f32 {
    const DTYPE: ElemType = ElemType::F32;
}
impl Element for f16 {
    const DTYPE: ElemType = ElemType::F16;
}
impl Element for bf16 {
    const DTYPE: ElemType = ElemType::BF16;
}
impl Element for i64 {
    const DTYPE: ElemType = ElemType::I64;
}

/// Elements per block when reducing many sources: small enough that the accumulator stays in L1.
const BLOCK: usize = 1024;

/// A reduction operator as a type, so each kernel is compiled (and vectorised) per operator
/// instead of calling through a function pointer per element.
trait Combine<T>: Copy {
    fn apply(self, acc: T, x: T) -> T;
}

#[derive(Clone, Copy)]
struct SumOp;
#[derive(Clone, Copy)]
struct MaxOp;
#[derive(Clone, Copy)]
struct MinOp;

/// Element types reduced natively.
trait Native: bytemuck::Pod + PartialOrd {
    fn add(self, other: Self) -> Self;
}
impl Native for u8 {
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
}
impl Native for i64 {
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
}
impl Native for f32 {
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self + other
    }
}

// NaN handling follows `PartialOrd`: a NaN in `acc` stays, a NaN in `x` is skipped. Every rank
// applies the same order, so results still agree bit for bit.
impl<T: Native> Combine<T> for SumOp {
    #[inline(always)]
    fn apply(self, acc: T, x: T) -> T {
        acc.add(x)
    }
}
impl<T: Native> Combine<T> for MaxOp {
    #[inline(always)]
    fn apply(self, acc: T, x: T) -> T {
        if x > acc {
            x
        } else {
            acc
        }
    }
}
impl<T: Native> Combine<T> for MinOp {
    #[inline(always)]
    fn apply(self, acc: T, x: T) -> T {
        if x < acc {
            x
        } else {
            acc
        }
    }
}

/// Calls `$body` with `$f` bound to the operator type of `$op`.
macro_rules! with_op {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            ReduceOp::Sum => {
                let $f = SumOp;
                $body
            }
            ReduceOp::Max => {
                let $f = MaxOp;
                $body
            }
            ReduceOp::Min => {
                let $f = MinOp;
                $body
            }
        }
    };
}

/// Reduces `sources` element-wise, in the order given, into `out`.
///
/// Every rank that reduces the same sources in the same order gets bit-identical results, which
/// tensor parallelism relies on. All slices must be `out.len()` bytes and aligned for `dtype`
/// (callers check this at the API boundary).
pub(crate) fn reduce(dtype: ElemType, op: ReduceOp, out: &mut [u8], sources: &[&[u8]]) {
    debug_assert!(sources.iter().all(|s| s.len() == out.len()));
    match dtype {
        ElemType::U8 => with_op!(op, f => reduce_native::<u8, _>(f, out, sources)),
        ElemType::F32 => with_op!(op, f => reduce_native::<f32, _>(f, out, sources)),
        ElemType::I64 => with_op!(op, f => reduce_native::<i64, _>(f, out, sources)),
        ElemType::F16 => {
            with_op!(op, f => reduce_half(f, out, sources, f16::to_f32, f16::from_f32))
        }
        ElemType::BF16 => {
            with_op!(op, f => reduce_half(f, out, sources, bf16::to_f32, bf16::from_f32))
        }
    }
}

/// `acc = acc op src`, element-wise (f16/bf16 through f32).
pub(crate) fn accumulate(dtype: ElemType, op: ReduceOp, acc: &mut [u8], src: &[u8]) {
    debug_assert_eq!(acc.len(), src.len());
    match dtype {
        ElemType::U8 => with_op!(op, f => accumulate_native::<u8, _>(f, acc, src)),
        ElemType::F32 => with_op!(op, f => accumulate_native::<f32, _>(f, acc, src)),
        ElemType::I64 => with_op!(op, f => accumulate_native::<i64, _>(f, acc, src)),
        ElemType::F16 => {
            with_op!(op, f => accumulate_half(f, acc, src, f16::to_f32, f16::from_f32))
        }
        ElemType::BF16 => {
            with_op!(op, f => accumulate_half(f, acc, src, bf16::to_f32, bf16::from_f32))
        }
    }
}

#[inline(always)]
fn fold_into<T: Copy, F: Combine<T>>(f: F, acc: &mut [T], src: &[T]) {
    for (a, &x) in acc.iter_mut().zip(src) {
        *a = f.apply(*a, x);
    }
}

fn accumulate_native<T: Native, F: Combine<T>>(f: F, acc: &mut [u8], src: &[u8]) {
    fold_into(f, bytemuck::cast_slice_mut::<u8, T>(acc), bytemuck::cast_slice(src));
}

fn accumulate_half<H: bytemuck::Pod, F: Combine<f32>>(
    f: F,
    acc: &mut [u8],
    src: &[u8],
    to_f32: fn(H) -> f32,
    from_f32: fn(f32) -> H,
) {
    let src: &[H] = bytemuck::cast_slice(src);
    for (a, &x) in bytemuck::cast_slice_mut::<u8, H>(acc).iter_mut().zip(src) {
        *a = from_f32(f.apply(to_f32(*a), to_f32(x)));
    }
}

fn reduce_native<T: Native, F: Combine<T>>(f: F, out: &mut [u8], sources: &[&[u8]]) {
    let out: &mut [T] = bytemuck::cast_slice_mut(out);
    let srcs: Vec<&[T]> = sources.iter().map(|s| bytemuck::cast_slice(s)).collect();
    let Some((first, rest)) = srcs.split_first() else { return };
    for start in (0..out.len()).step_by(BLOCK) {
        let end = (start + BLOCK).min(out.len());
        let acc = &mut out[start..end];
        acc.copy_from_slice(&first[start..end]);
        for src in rest {
            fold_into(f, acc, &src[start..end]);
        }
    }
}

fn reduce_half<H: bytemuck::Pod, F: Combine<f32>>(
    f: F,
    out: &mut [u8],
    sources: &[&[u8]],
    to_f32: fn(H) -> f32,
    from_f32: fn(f32) -> H,
) {
    let out: &mut [H] = bytemuck::cast_slice_mut(out);
    let srcs: Vec<&[H]> = sources.iter().map(|s| bytemuck::cast_slice(s)).collect();
    let Some((first, rest)) = srcs.split_first() else { return };
    let mut acc = [0f32; BLOCK];
    for start in (0..out.len()).step_by(BLOCK) {
        let end = (start + BLOCK).min(out.len());
        let acc = &mut acc[..end - start];
        for (a, &x) in acc.iter_mut().zip(&first[start..end]) {
            *a = to_f32(x);
        }
        for src in rest {
            for (a, &x) in acc.iter_mut().zip(&src[start..end]) {
                *a = f.apply(*a, to_f32(x));
            }
        }
        for (o, &a) in out[start..end].iter_mut().zip(acc.iter()) {
            *o = from_f32(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn reduces_every_dtype_and_op() {
        let a = [1.0f32, -2.0, 3.5];
        let b = [4.0f32, 5.0, -1.0];
        for (op, want) in [
            (ReduceOp::Sum, [5.0f32, 3.0, 2.5]),
            (ReduceOp::Max, [4.0, 5.0, 3.5]),
            (ReduceOp::Min, [1.0, -2.0, -1.0]),
        ] {
            let mut out = vec![0u8; 12];
            reduce(ElemType::F32, op, &mut out, &[&bytes(&a), &bytes(&b)]);
            assert_eq!(bytemuck::cast_slice::<u8, f32>(&out), want, "{op}");
        }
        let mut out = vec![0u8; 16];
        reduce(
            ElemType::I64,
            ReduceOp::Sum,
            &mut out,
            &[&bytes(&[i64::MAX, 2]), &bytes(&[1i64, 3])],
        );
        assert_eq!(bytemuck::cast_slice::<u8, i64>(&out), [i64::MIN, 5]);

        let h = |v: f32| bf16::from_f32(v);
        let mut out = vec![0u8; 4];
        reduce(
            ElemType::BF16,
            ReduceOp::Sum,
            &mut out,
            &[&bytes(&[h(1.0), h(2.0)]), &bytes(&[h(0.5), h(-2.0)])],
        );
        assert_eq!(bytemuck::cast_slice::<u8, bf16>(&out), [h(1.5), h(0.0)]);
    }

    #[test]
    fn half_sums_accumulate_in_f32() {
        // 2048 + 1 + 1 in f16 pairwise would round 2049 back to 2048 twice; f32 keeps 2050.
        let x = |v: f32| f16::from_f32(v);
        let srcs = [bytes(&[x(2048.0)]), bytes(&[x(1.0)]), bytes(&[x(1.0)])];
        let refs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
        let mut out = vec![0u8; 2];
        reduce(ElemType::F16, ReduceOp::Sum, &mut out, &refs);
        assert_eq!(bytemuck::cast_slice::<u8, f16>(&out)[0].to_f32(), 2050.0);
    }

    #[test]
    fn codes_round_trip() {
        for d in [ElemType::U8, ElemType::F32, ElemType::F16, ElemType::BF16, ElemType::I64] {
            assert_eq!(ElemType::from_code(d.code()), Some(d));
        }
        for o in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            assert_eq!(ReduceOp::from_code(o.code()), Some(o));
        }
    }
}
