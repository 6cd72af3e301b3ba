//! The Llama model of the `layers` crate run replicated, every rank computing the full model
//! (a one-rank placement with one-rank groups of its own), and its tokenizer on rank 0. The TP/CP-sharded model
//! ([`crate::sharded`]) plugs into the same [`StepModel`] seam.

use crate::error::BoxError;
use crate::model::{Groups, ModelFactory, StepModel, StepOutput};
use crate::plan::{SeqId, SessionConfig, StepPlan};
use crate::sequences::Sequences;
use crate::sink::TextCodec;
use collectives::Solo;
use layers::model::WeightForm;
use layers::parallel::{Comms, LoadOptions, ParallelModel, Placement};

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
        let model = ParallelModel::load(
            &config.model,
            LoadOptions::new(Placement::single()).threads(self.threads).form(WeightForm::Native),
        )
        .map_err(|e| format!("loading {}: {e}", config.model))?;
        Ok(Box::new(ReplicatedLlama {
            model,
            sequences: Sequences::default(),
            groups: (Solo::new("replicated-tp"), Solo::new("replicated-cp")),
            logits: rank == 0,
        }))
    }

    fn codec(&mut self, config: &SessionConfig) -> Result<Option<Box<dyn TextCodec>>, BoxError> {
        let tok = text::Tokenizer::load(std::path::Path::new(&config.model))
            .map_err(|e| format!("tokenizer of {}: {e}", config.model))?;
        Ok(Some(Box::new(crate::sink::TokenizerCodec(std::sync::Arc::new(tok)))))
    }
}

/// The whole model on this rank, one KV cache per sequence.
pub struct ReplicatedLlama {
    model: ParallelModel,
    sequences: Sequences,
    /// The one-rank TP and CP groups the model computes in.
    groups: (Solo, Solo),
    logits: bool,
}

impl std::fmt::Debug for ReplicatedLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicatedLlama").field("sequences", &self.sequences.len()).finish()
    }
}

impl StepModel for ReplicatedLlama {
    fn forward(
        &mut self,
        plan: &StepPlan,
        _groups: &mut Groups<'_>,
    ) -> Result<Option<StepOutput>, BoxError> {
        // Replicated: every rank computes the whole model, so no collective is needed.
        let context = self.context_len();
        let model = &self.model;
        let (tp, cp) = &mut self.groups;
        let mut comms = Comms { tp, cp };
        // A new sequence's cache holds what it can reach, not the whole context.
        let capacity =
            |e: &crate::plan::PlanEntry| (e.reserve as usize).clamp(e.tokens.len(), context);
        let tokens =
            self.sequences.run(model, &mut comms, plan, |e| Ok(model.new_cache(capacity(e))))?;
        Ok(tokens.filter(|_| self.logits))
    }

    fn release(&mut self, seq: SeqId) {
        self.sequences.release(seq);
    }

    fn take_prompt_logprobs(&mut self) -> Vec<crate::sampler::PromptLogprobs> {
        self.sequences.take_prompt_logprobs()
    }

    fn sampling_time(&self) -> std::time::Duration {
        self.sequences.sampling_time()
    }

    fn context_len(&self) -> usize {
        self.model.config().context_length
    }
}

#[cfg(test)]
mod tests;
