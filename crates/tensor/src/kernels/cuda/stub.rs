//! [`CudaBackend`] in a build without feature `cuda`: it cannot be constructed, and its methods
//! exist only so that the dispatch in `Backend` compiles unchanged.

use crate::error::{Error, Result};
use crate::kernels::{AttnShape, GemmDtype, Kv, Weight};
use crate::memory::DeviceArena;
use crate::tensor::Tensor;
use mesh::DeviceMemory;
use std::convert::Infallible;
use std::sync::Arc;

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

    /// Always fails: the backend is not compiled in.
    ///
    /// # Errors
    /// Always [`Error::NotCompiledWith`] naming feature `cuda`.
    pub fn with_gemm_dtype(_ordinal: usize, _dtype: GemmDtype) -> Result<Self> {
        Err(Error::NotCompiledWith { feature: "cuda" })
    }

    /// The element type of the weight matrices on the device.
    pub fn gemm_dtype(&self) -> GemmDtype {
        match self.never {}
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// What the driver says about the device.
    ///
    /// # Errors
    /// Never returns: no value of this type exists.
    pub fn describe(&self) -> Result<super::CudaDeviceInfo> {
        match self.never {}
    }

    /// What the backend has asked of the driver since it opened (see [`super::Counters`]).
    pub fn counters(&self) -> super::Counters {
        match self.never {}
    }

    /// Which form of the kernels the backend loaded.
    pub fn kernel_image(&self) -> &super::KernelImage {
        match self.never {}
    }

    /// The time the host has spent blocked waiting for the device.
    pub fn device_wait(&self) -> std::time::Duration {
        match self.never {}
    }

    /// Drops every cached device copy of a weight.
    pub fn clear_weight_cache(&self) {
        match self.never {}
    }

    /// Gives the memory the driver's pool keeps back to the device.
    pub fn trim_pool(&self) {
        match self.never {}
    }

    /// Destroys the step graphs.
    pub fn release_graphs(&self) -> crate::kernels::workspace::Released {
        match self.never {}
    }

    /// Gives back what the steps hold between them.
    pub fn release_workspace(&self) -> crate::kernels::workspace::Released {
        match self.never {}
    }

    /// Starts a step of shape `key` (see [`crate::Backend::step`]).
    pub(crate) fn begin_step(
        &self,
        _key: Option<crate::kernels::workspace::StepKey>,
        _shape: (usize, usize),
    ) {
        match self.never {}
    }

    pub(crate) fn edit_rows(
        &self,
        _x: &mut crate::tensor::Tensor,
        _edits: &crate::kernels::LogitEdits,
        _first: usize,
    ) -> crate::error::Result<()> {
        match self.never {}
    }

    /// The time the device spent in this backend's steps so far.
    pub fn device_busy(&self) -> std::time::Duration {
        match self.never {}
    }

    /// Turns CUDA graphs of decode steps on or off.
    pub fn set_graphs(&self, _enabled: bool) {
        match self.never {}
    }

    /// What this backend's graphs have done.
    pub fn graph_stats(&self) -> super::GraphStats {
        match self.never {}
    }

    /// Ends the step begun last.
    pub(crate) fn end_step(&self) {
        match self.never {}
    }

    /// What the step workspaces have done so far.
    pub(crate) fn workspace_stats(&self) -> crate::kernels::workspace::WorkspaceStats {
        match self.never {}
    }

    /// Keeps the device copies of weights in memory from `arena`.
    pub fn keep_weights_in(&self, _arena: Arc<dyn DeviceArena>) {
        match self.never {}
    }

    pub(crate) fn prepare_weights(&self, _weights: &[crate::kernels::WeightUse<'_>]) -> Result<()> {
        match self.never {}
    }

    /// Device bytes held by cached weights.
    pub fn cached_weight_bytes(&self) -> usize {
        match self.never {}
    }

    pub(crate) fn linear(
        &self,
        _x: &Tensor,
        _w: &Weight,
        _mnk: (usize, usize, usize),
        _shape: &[usize],
    ) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn rms_norm(&self, _x: &Tensor, _w: &Tensor, _eps: f32) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn add_rms_norm(
        &self,
        _x: &mut Tensor,
        _y: &Tensor,
        _w: &Tensor,
        _eps: f32,
    ) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn rope(
        &self,
        _x: &mut Tensor,
        _positions: &[usize],
        _dims: (usize, usize, usize),
        _theta: f32,
        _factors: Option<&[f32]>,
        _attn_factor: f32,
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn attention(
        &self,
        _q: &Tensor,
        _q_pos: &[usize],
        _kv: Kv<'_>,
        _kv_pos: &[usize],
        _shape: AttnShape,
        _want_lse: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        match self.never {}
    }

    pub(crate) fn write_device(
        &self,
        _dst: &dyn DeviceMemory,
        _elem: crate::kernels::KvElem,
        _offset: usize,
        _src: &[f32],
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn write_tensor(
        &self,
        _dst: &dyn DeviceMemory,
        _elem: crate::kernels::KvElem,
        _offset: usize,
        _src: &Tensor,
        _range: std::ops::Range<usize>,
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn attention_rows(
        &self,
        _q: &Tensor,
        _q_pos: &[usize],
        _shape: crate::kernels::AttnShape,
        _kv: &crate::kernels::RowKv<'_>,
    ) -> Result<Option<Tensor>> {
        match self.never {}
    }

    pub(crate) fn write_rows(
        &self,
        _dst: &dyn mesh::DeviceMemory,
        _elem: crate::kernels::KvElem,
        _src: &Tensor,
        _row: usize,
        _moves: &[(usize, usize)],
        _shift: usize,
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn split_rope_append(
        &self,
        _y: crate::kernels::Projected<'_>,
        _positions: &[usize],
        _dims: (usize, usize, usize, usize),
        _rope: (f32, Option<&[f32]>, f32),
        _pool: (&dyn mesh::DeviceMemory, crate::kernels::KvElem, &[usize], usize, usize),
    ) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn split_rope(
        &self,
        _y: crate::kernels::Projected<'_>,
        _positions: &[usize],
        _dims: (usize, usize, usize, usize),
        _rope: (f32, Option<&[f32]>, f32),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match self.never {}
    }

    pub(crate) fn gated_halves(
        &self,
        _act: crate::kernels::Activation,
        _x: &Tensor,
    ) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn silu_mul(&self, _gate: &mut Tensor, _up: &Tensor) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn gelu_tanh_mul(&self, _gate: &mut Tensor, _up: &Tensor) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn scale(&self, _x: &mut Tensor, _s: f32) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn soft_cap(&self, _x: &mut Tensor, _cap: f32) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn add_assign(&self, _x: &mut Tensor, _y: &Tensor) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn add_rows(&self, _x: &mut Tensor, _bias: &Tensor) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn all_reduce_sum(
        &self,
        _comm: &mut dyn collectives::Communicator,
        _t: &mut Tensor,
    ) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn wait_collectives(&self, _comm: &mut dyn collectives::Communicator) -> Result<()> {
        match self.never {}
    }

    pub(crate) fn split_last(&self, _x: &Tensor, _sizes: &[usize]) -> Result<Vec<Tensor>> {
        match self.never {}
    }

    pub(crate) fn slice_first(
        &self,
        _t: &Tensor,
        _range: std::ops::Range<usize>,
    ) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn cat_first(&self, _parts: &[Tensor]) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn embedding(&self, _table: &Weight, _ids: &[u32]) -> Result<Tensor> {
        match self.never {}
    }

    pub(crate) fn argmax_rows(&self, _x: &Tensor) -> Result<Vec<usize>> {
        match self.never {}
    }

    pub(crate) fn top_k_rows(&self, _x: &Tensor, _k: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        match self.never {}
    }

    pub(crate) fn sample_rows(
        &self,
        _x: &Tensor,
        _draws: &[crate::kernels::Draw],
    ) -> Result<Vec<u32>> {
        match self.never {}
    }

    pub(crate) fn normalizers(&self, _x: &Tensor) -> Result<Vec<crate::kernels::Normalizer>> {
        match self.never {}
    }

    pub(crate) fn columns_at(&self, _x: &Tensor, _columns: &[u32]) -> Result<Vec<f32>> {
        match self.never {}
    }
}

/// A device arena in the driver's memory pool, not compiled into this build.
#[derive(Debug)]
pub struct PoolArena {
    never: Infallible,
}

impl PoolArena {
    /// Cannot be called: no [`CudaBackend`] exists in this build.
    ///
    /// # Errors
    /// Never returns.
    pub fn new(backend: &CudaBackend, _bytes: usize) -> Result<PoolArena> {
        match backend.never {}
    }
}

impl PoolArena {
    /// Overwrites every byte with `value` (for tests; no value of the type exists here).
    pub fn scribble(&self, _backend: &CudaBackend, _value: u8) {
        match self.never {}
    }
}

impl DeviceArena for PoolArena {
    fn alloc_device(&self, _bytes: usize) -> Result<Box<dyn DeviceMemory>> {
        match self.never {}
    }
}
