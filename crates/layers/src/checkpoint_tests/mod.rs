//! Checkpoint tests that need the model or its random checkpoints (`model::random`): the
//! GGUF parser under mutation of real model files, Hugging Face folders against GGUF, and
//! weight updates (`checkpoint::Overlay`) through the loader.

mod gguf_fuzz;
mod overlay;
mod provenance;
mod safetensors;
