//! The version of a deployment's weights: which weights produced a token.
//!
//! Rank 0's [`super::Coordinator`] sets it when a weight update commits, while the engine is
//! still quiesced, so a token emitted by the engine carries the version that computed it when
//! its output sink reads [`WeightVersion::get`] at emission.

use std::sync::{Arc, Mutex, PoisonError};

/// What a weight update loads, and the version the weights take once it commits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightUpdate {
    /// The checkpoint: a GGUF file or a Hugging Face folder.
    pub model: String,
    /// Safetensors files of named tensors laid over `model`'s, a later one winning (an RL
    /// trainer's buckets, [`checkpoint::Overlay`]); empty: the checkpoint alone.
    pub tensors: Vec<String>,
    /// The version the weights take (an RL trainer's step, say); `None`: the number of
    /// updates so far, counted from 1.
    pub version: Option<String>,
}

impl WeightUpdate {
    /// An update from the checkpoint at `model`, versioned by the counter.
    pub fn from_checkpoint(model: impl Into<String>) -> WeightUpdate {
        WeightUpdate { model: model.into(), tensors: Vec::new(), version: None }
    }

    /// This update, taking `version` when it commits.
    #[must_use]
    pub fn versioned(mut self, version: Option<String>) -> WeightUpdate {
        self.version = version;
        self
    }
}

/// The live weights' version, shared (cheap to clone) between the coordinator that changes
/// it and the readers that stamp answers with it. Starts at [`WeightVersion::INITIAL`].
#[derive(Clone, Debug)]
pub struct WeightVersion(Arc<Mutex<Arc<str>>>);

impl Default for WeightVersion {
    fn default() -> Self {
        WeightVersion(Arc::new(Mutex::new(Arc::from(WeightVersion::INITIAL))))
    }
}

impl WeightVersion {
    /// The version of the weights a deployment started with.
    pub const INITIAL: &'static str = "0";

    /// The version now.
    pub fn get(&self) -> Arc<str> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(super) fn set(&self, version: &str) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Arc::from(version);
    }
}
