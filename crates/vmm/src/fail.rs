//! vmm's failpoints, through `mesh::failpoint` (feature `failpoints`; `TPCTL_FAILPOINTS`, its
//! syntax): `vmm.map` (before each allocation is mapped by a materialize) and `vmm.unmap`
//! (before each allocation is unmapped by a release).

use crate::error::{Error, Result};

/// Passes through the failpoint `point`.
#[inline(always)]
pub(crate) fn hit(point: &'static str) -> Result<()> {
    mesh::failpoint::hit(point).map_err(|_| Error::Injected { point })
}
