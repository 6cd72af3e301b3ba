//! Where tpctl keeps the models it fetched, and the default model's file there.

use std::path::PathBuf;

/// The file name of the default model in the model cache (`cargo xtask fetch-model`).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The model cache folder: `$TPCTL_CACHE`, else `$XDG_CACHE_HOME/tpctl/models`, else
/// `~/.cache/tpctl/models` (the same rule as `cargo xtask fetch-model`).
pub fn model_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("TPCTL_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("tpctl").join("models")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("tpctl").join("models")))
}

/// The default model's path, if it has been fetched into the cache.
pub fn default_model_path() -> Option<PathBuf> {
    model_cache_dir().map(|d| d.join(DEFAULT_MODEL_FILE)).filter(|p| p.is_file())
}
