//! Checkpoint tests that need the model or its random checkpoints (`model::random`): the
//! GGUF parser under mutation of real model files, and Hugging Face folders against GGUF.

mod gguf_fuzz;
mod safetensors;
