//! Device copies of a model's weights made ahead of their first use: a GPU backend uploads
//! (and dequantizes, and rounds to its matrix type) each weight the first time a product
//! reads it, so without this the first request after a model is loaded, or after a wakeup
//! brought its weights back, pays for all of them.

use super::{Backend, Weight};
use crate::error::Result;
use crate::tensor::Tensor;

/// A weight as the model's computation reads it, for [`Backend::prepare_weights`].
#[derive(Clone, Copy, Debug)]
pub enum WeightUse<'a> {
    /// The weight of a linear layer (a product in the backend's matrix type).
    Linear(&'a Weight),
    /// An embedding table (rows looked up as f32).
    Embedding(&'a Weight),
    /// A norm's weight vector.
    Norm(&'a Tensor),
}

impl Backend {
    /// Makes now the device copies that the first uses of `weights` would make: a GPU
    /// backend uploads each into its weight cache and waits until they are written; the CPU
    /// backend, which reads the weights where they are, does nothing.
    ///
    /// # Errors
    /// The device's, naming the operation (an allocation or copy that failed).
    pub fn prepare_weights(&self, weights: &[WeightUse<'_>]) -> Result<()> {
        match self {
            Backend::Cpu(_) => Ok(()),
            Backend::Cuda(cuda) => cuda.prepare_weights(weights),
        }
    }
}
