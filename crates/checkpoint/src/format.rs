//! [`Checkpoint`]: a model path opened as the format it is in.

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::fused::FusedSource;
use crate::gguf::GgufFile;
use crate::safetensors::HfCheckpoint;
use crate::source::WeightSource;
use std::path::Path;

/// The format of a model path: the only place tpctl tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A GGUF file (the first part of a split one included).
    Gguf,
    /// A Hugging Face folder: `config.json`, safetensors, tokenizer files.
    HfFolder,
}

impl Format {
    /// The format of `path`, from what it is on disk: a folder is a Hugging Face checkpoint,
    /// anything else a GGUF file (opening it says when it is not one).
    pub fn of(path: &Path) -> Format {
        if path.is_dir() {
            Format::HfFolder
        } else {
            Format::Gguf
        }
    }
}

/// A model checkpoint, opened: its tensors are mapped, not read.
#[derive(Debug)]
pub enum Checkpoint {
    /// A GGUF file.
    Gguf(GgufFile),
    /// A Hugging Face folder.
    Hf(HfCheckpoint),
}

impl Checkpoint {
    /// Opens the checkpoint at `path` as its [`Format`].
    ///
    /// # Errors
    /// As [`GgufFile::open`] or [`HfCheckpoint::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        Ok(match Format::of(path) {
            Format::Gguf => Checkpoint::Gguf(GgufFile::open(path)?),
            Format::HfFolder => Checkpoint::Hf(HfCheckpoint::open(path)?),
        })
    }

    /// The model's hyper-parameters: the GGUF metadata, or the folder's `config.json`.
    ///
    /// # Errors
    /// A key is missing or mistyped, or names an architecture tpctl does not run.
    pub fn config(&self) -> Result<LlamaConfig> {
        match self {
            Checkpoint::Gguf(file) => LlamaConfig::from_gguf(file),
            Checkpoint::Hf(ck) => ck.config(),
        }
    }

    /// Checks that every tensor is of a type tpctl can read, so an unsupported model is
    /// refused before any rank starts (a folder's dtypes are checked as it opens).
    ///
    /// # Errors
    /// [`crate::Error::Tensor`] naming the first tensor of a type tpctl cannot read, with
    /// GGML's name of the type (`IQ2_XXS`).
    pub fn check_weights(&self) -> Result<()> {
        match self {
            Checkpoint::Gguf(file) => file.check_types(),
            Checkpoint::Hf(_) => Ok(()),
        }
    }

    /// The weights under the llama names the model asks for, for a model of `config` (Phi-3's
    /// fused projections are seen through [`FusedSource`]).
    pub fn weights<'a>(&'a self, config: &LlamaConfig) -> Box<dyn WeightSource + 'a> {
        match self {
            Checkpoint::Gguf(file) if file.has_fused_projections() => {
                Box::new(FusedSource::new(file, config))
            }
            Checkpoint::Gguf(file) => Box::new(file),
            Checkpoint::Hf(ck) => Box::new(ck),
        }
    }
}
