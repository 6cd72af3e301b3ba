//! Rank 0's sampler: greedy, or temperature with top-k and top-p from a seeded generator, so
//! a request with a seed produces the same tokens on every run.

/// How a request picks its tokens and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// The most tokens to generate.
    pub max_tokens: u32,
    /// 0 is greedy (argmax); above 0 divides the logits before the softmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 keeps all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    pub top_p: f32,
    /// Seed of the request's generator.
    pub seed: u64,
    /// Tokens that end the request (kept in its output); the tokenizer's end-of-sequence
    /// token is added unless `ignore_eos`.
    pub stop: Vec<u32>,
    /// Whether to keep going past the end-of-sequence token.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// A request's sampler: its parameters and its generator's state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let state = params.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler { params, state, scratch: Vec::new() }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// A uniform number in `[0, 1)` (SplitMix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks a token from one logits row. NaN logits are never picked; an all-NaN or empty
    /// row gives token 0.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut cand = std::mem::take(&mut self.scratch);
        cand.clear();
        cand.extend(
            logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (l, i as u32)),
        );
        if cand.is_empty() {
            self.scratch = cand;
            return 0;
        }
        // Highest logit first; ties by the lower id, so the order never depends on the sort.
        let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = self.params.top_k;
        if k > 0 && k < cand.len() {
            // Only the k best need ordering: a full sort of a 150k vocabulary costs milliseconds.
            cand.select_nth_unstable_by(k - 1, order);
            cand.truncate(k);
            cand.sort_unstable_by(order);
        } else if self.params.top_p < 1.0 {
            cand.sort_unstable_by(order);
        }
        // Without top-p the order of the candidates does not matter, only their weights.
        let t = f64::from(self.params.temperature);
        let top = cand.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> =
            cand.iter().map(|(l, _)| ((f64::from(*l) - f64::from(top)) / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut keep = weights.len();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, w) in weights.iter().enumerate() {
                acc += w / total;
                if acc >= f64::from(self.params.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept: f64 = weights[..keep].iter().sum();
        let mut u = self.uniform() * kept;
        let mut pick = cand[keep - 1].1;
        for (w, (_, id)) in weights[..keep].iter().zip(&cand) {
            if u < *w {
                pick = *id;
                break;
            }
            u -= w;
        }
        self.scratch = cand;
        pick
    }
}

/// The index of the largest logit, the lowest index on ties; NaN is never picked.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_nan() && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

#[cfg(test)]
mod tests;
