//! [`CudaBackend`] in a build without feature `cuda`: it cannot be constructed, and its methods
//! exist only so that the dispatch in `Backend` compiles unchanged.

use crate::error::{Error, Result};
use crate::kernels::{AttnShape, Weight};
use std::convert::Infallible;

/// The CUDA backend, not compiled into this build (enable feature `cuda`).
#[derive(Clone, Debug)]
pub struct CudaBackend {
    never: Infallible,
}

#[allow(clippy::unused_self, clippy::too_many_arguments)]
impl CudaBackend {
    /// Always fails: the backend is not compiled in.
    ///
    /// # Errors
    /// Always [`Error::NotCompiledWith`] naming feature `cuda`.
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// Drops every cached device copy of a weight.
    pub fn clear_weight_cache(&self) {
        match self.never {}
    }

    /// Device bytes held by cached weights.
    pub fn cached_weight_bytes(&self) -> usize {
        match self.never {}
    }

    pub(crate) fn linear(
        &self,
        _x: &[f32],
        _w: &Weight,
        _mnk: (usize, usize, usize),
        _out: &mut [f32],
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn rms_norm(
        &self,
        _x: &[f32],
        _w: &[f32],
        _eps: f32,
        _out: &mut [f32],
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn rope(
        &self,
        _x: &mut [f32],
        _positions: &[usize],
        _dims: (usize, usize, usize),
        _theta: f32,
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn attention(
        &self,
        _q: &[f32],
        _q_pos: &[usize],
        _k: &[f32],
        _v: &[f32],
        _kv_pos: &[usize],
        _shape: AttnShape,
        _out: &mut [f32],
        _lse: Option<&mut [f32]>,
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn silu_mul(&self, _gate: &mut [f32], _up: &[f32]) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn add_assign(&self, _x: &mut [f32], _y: &[f32]) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn add_rows(&self, _x: &mut [f32], _bias: &[f32]) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn embedding(&self, _table: &Weight, _ids: &[u32], _out: &mut [f32]) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn argmax_rows(&self, _x: &[f32], _rows: usize) -> Result<Vec<usize>> {
        match self.never {}
    }
}
