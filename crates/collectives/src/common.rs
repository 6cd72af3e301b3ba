//! Small pieces every backend shares: failure blame, message splitting, fingerprints.

/// Why a peer's failure flag is set; encoded with the rank that caused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blame {
    /// The rank failed by itself (bad arguments, injected fault, mismatch).
    Failed = 1,
    /// The rank's process is gone.
    Died = 2,
    /// The rank did not arrive before the deadline.
    Unresponsive = 3,
}

pub(crate) fn encode_blame(blame: Blame, origin: usize) -> u32 {
    ((blame as u32) << 16) | (origin as u32 + 1)
}

pub(crate) fn decode_blame(word: u32) -> Option<(Blame, usize)> {
    let origin = (word & 0xffff).checked_sub(1)? as usize;
    let blame = match word >> 16 {
        2 => Blame::Died,
        3 => Blame::Unresponsive,
        _ => Blame::Failed,
    };
    Some((blame, origin))
}

/// The failure word a rank publishes for error `e`: the original culprit, so every rank
/// names the same one.
pub(crate) fn blame_word(e: &crate::Error, me: usize) -> u32 {
    use crate::Error;
    match e {
        Error::PeerDied { peer, .. } => encode_blame(Blame::Died, *peer),
        Error::Timeout { waiting_for, .. } => {
            encode_blame(Blame::Unresponsive, waiting_for.first().copied().unwrap_or(me))
        }
        Error::PeerFailed { peer, .. } => encode_blame(Blame::Failed, *peer),
        _ => encode_blame(Blame::Failed, me),
    }
}

/// The error a rank raises when a peer published failure `word` (or `None` for no failure).
pub(crate) fn blamed(
    word: u32,
    at: &crate::Site,
    reporter: usize,
    pid_of: impl Fn(usize) -> u32,
    elapsed: std::time::Duration,
) -> Option<crate::Error> {
    use crate::Error;
    let (blame, origin) = decode_blame(word)?;
    let at = at.clone();
    Some(match blame {
        Blame::Died if origin != at.rank => {
            Error::PeerDied { at, peer: origin, pid: pid_of(origin), elapsed }
        }
        Blame::Unresponsive if origin != at.rank => {
            Error::Timeout { at, elapsed, waiting_for: vec![origin] }
        }
        _ => Error::PeerFailed { peer: if origin == at.rank { reporter } else { origin }, at },
    })
}

/// The pieces `[off, off + len)` a message of `total` bytes is processed in; at least one, so
/// ranks with an empty buffer still meet (and check) the others.
pub(crate) fn pieces(total: usize, cap: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = total.div_ceil(cap).max(1);
    (0..n).map(move |i| (i * cap, cap.min(total - (i * cap).min(total))))
}

/// Element range of part `r` of `n` elements in `parts`, remainder to the low parts.
pub(crate) fn part(n: usize, parts: usize, r: usize) -> std::ops::Range<usize> {
    let (q, rem) = (n / parts, n % parts);
    let start = r * q + r.min(rem);
    start..start + q + usize::from(r < rem)
}

/// FNV-1a over a list of sizes: a cheap fingerprint every rank compares.
pub(crate) fn fnv(sizes: &[usize]) -> u64 {
    let bytes: Vec<u8> = sizes.iter().flat_map(|s| (*s as u64).to_le_bytes()).collect();
    fnv_bytes(&bytes)
}

/// FNV-1a over bytes.
pub(crate) fn fnv_bytes(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// What a rank says about the call it is in, as every backend compares it with each peer's
/// (shm through the segment's descriptor slots, tcp in each message header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Descriptor {
    /// [`crate::Op::code`].
    pub(crate) op: u32,
    /// [`crate::ElemType::code`].
    pub(crate) dtype: u32,
    /// [`crate::ReduceOp::code`], 0 for none.
    pub(crate) rop: u32,
    /// Collective calls (or pieces) so far: a rank that skipped one is caught here.
    pub(crate) seq: u64,
    /// The call's bytes.
    pub(crate) total: u64,
    /// The call's own number (broadcast root, gather sizes' fingerprint, ...), named `aux_name`.
    pub(crate) aux: u64,
}

impl Descriptor {
    /// Fails naming the first field, in a fixed order (operation, dtype, reduce op, operation
    /// count, bytes, `aux_name`), where `theirs` (from `peer`) differs from this rank's.
    pub(crate) fn agree(
        &self,
        theirs: &Descriptor,
        at: &crate::Site,
        peer: usize,
        aux_name: &'static str,
    ) -> crate::Result<()> {
        use crate::{ElemType, Error, Op, ReduceOp};
        let mismatch = |what, mine: String, theirs: String| {
            Err(Error::Mismatch { at: at.clone(), peer, what, mine, theirs })
        };
        let op = |c: u32| Op::from_code(c).map_or("unknown".to_owned(), |o| o.to_string());
        let dtype = |c: u32| ElemType::from_code(c).map_or("unknown".to_owned(), |d| d.to_string());
        let rop = |c: u32| ReduceOp::from_code(c).map_or("none".to_owned(), |o| o.to_string());
        if self.op != theirs.op {
            return mismatch("operation", op(self.op), op(theirs.op));
        }
        if self.dtype != theirs.dtype {
            return mismatch("dtype", dtype(self.dtype), dtype(theirs.dtype));
        }
        if self.rop != theirs.rop {
            return mismatch("reduce op", rop(self.rop), rop(theirs.rop));
        }
        if self.seq != theirs.seq {
            return mismatch("operation count", self.seq.to_string(), theirs.seq.to_string());
        }
        if self.total != theirs.total {
            return mismatch("bytes", self.total.to_string(), theirs.total.to_string());
        }
        if self.aux != theirs.aux {
            return mismatch(aux_name, self.aux.to_string(), theirs.aux.to_string());
        }
        Ok(())
    }
}
