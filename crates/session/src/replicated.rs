//! The single-rank Llama model of the `layers` crate run replicated, every rank computing the
//! full model (tp = 1 per rank), and its tokenizer on rank 0. The TP/CP-sharded model
//! ([`crate::sharded`]) plugs into the same [`StepModel`] seam.

use crate::error::BoxError;
use crate::model::{Groups, Logits, ModelFactory, StepModel};
use crate::plan::{SeqId, SessionConfig, StepPlan};
use crate::sequences::run_entries;
use crate::sink::TextCodec;
use std::collections::HashMap;

/// Builds a [`ReplicatedLlama`] from the GGUF file named by [`SessionConfig::model`].
#[derive(Debug, Clone)]
pub struct LlamaFactory {
    threads: usize,
}

impl LlamaFactory {
    /// A factory whose models compute with `threads` CPU threads.
    pub fn new(threads: usize) -> Self {
        LlamaFactory { threads: threads.max(1) }
    }
}

impl ModelFactory for LlamaFactory {
    fn build(
        &mut self,
        config: &SessionConfig,
        groups: &mut Groups<'_>,
    ) -> Result<Box<dyn StepModel>, BoxError> {
        let rank = groups.rank;
        let model = layers::Model::load(&config.model, self.threads)
            .map_err(|e| format!("loading {}: {e}", config.model))?;
        Ok(Box::new(ReplicatedLlama { model, caches: HashMap::new(), logits: rank == 0 }))
    }

    fn codec(&mut self, config: &SessionConfig) -> Result<Option<Box<dyn TextCodec>>, BoxError> {
        let file = layers::gguf::GgufFile::open(&config.model)
            .map_err(|e| format!("opening {}: {e}", config.model))?;
        let tok = layers::Tokenizer::from_gguf(&file)
            .map_err(|e| format!("tokenizer of {}: {e}", config.model))?;
        Ok(Some(Box::new(LlamaCodec(tok))))
    }
}

/// The whole single-rank model on this rank, one KV cache per sequence.
pub struct ReplicatedLlama {
    model: layers::Model,
    caches: HashMap<SeqId, layers::KvCache>,
    logits: bool,
}

impl std::fmt::Debug for ReplicatedLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicatedLlama").field("sequences", &self.caches.len()).finish()
    }
}

impl StepModel for ReplicatedLlama {
    fn forward(
        &mut self,
        plan: &StepPlan,
        _groups: &mut Groups<'_>,
    ) -> Result<Option<Logits>, BoxError> {
        // Replicated: every rank computes the whole model, so no collective is needed.
        let capacity = self.context_len();
        let model = &self.model;
        let rows = run_entries(
            plan,
            &mut self.caches,
            || Ok(model.new_cache(capacity)),
            |e, cache| {
                let positions: Vec<usize> = e.positions().collect();
                model.forward(&e.tokens, &positions, cache, layers::Logits::Last)
            },
        )?;
        Ok(self.logits.then_some(rows))
    }

    fn release(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }

    fn context_len(&self) -> usize {
        self.model.config().context_length
    }
}

/// The model's tokenizer as a [`TextCodec`].
struct LlamaCodec(layers::Tokenizer);

impl TextCodec for LlamaCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, BoxError> {
        Ok(self.0.encode(text)?)
    }

    fn decode(&self, ids: &[u32]) -> Result<String, BoxError> {
        Ok(self.0.decode(ids, true)?)
    }

    fn eos(&self) -> Option<u32> {
        self.0.eos_id()
    }
}

#[cfg(test)]
mod tests;
