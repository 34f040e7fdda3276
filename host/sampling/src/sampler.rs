//! Turning one row of logits into one token.
//!
//! Order (as in vLLM): penalties → temperature → top-k → top-p → min-p → draw. Greedy requests take
//! the argmax after penalties. Logprobs are always those of the *unmodified* logits (vLLM's default
//! "raw" logprobs, what OpenAI returns).

use std::cmp::Ordering;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;

use crate::history::SeqHistory;
use crate::params::{SamplingError, SamplingParams};

/// First candidate-set size tried when looking for the top-p nucleus without sorting the whole
/// vocabulary; grows ×8 until the nucleus fits.
const NUCLEUS_FIRST_GUESS: usize = 64;

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// log-softmax of the raw logits at `token`.
    pub logprob: f32,
    /// The `logprobs` most likely tokens by raw logits, most likely first (ties: lower id first);
    /// empty when the request did not ask for logprobs.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The sampler of one request: its settings, its random stream and reusable scratch buffers.
#[derive(Debug, Clone)]
pub struct Sampler {
    greedy: bool,
    temperature: f32,
    top_k: Option<usize>,
    top_p: f32,
    min_p: f32,
    repetition_penalty: f32,
    presence_penalty: f32,
    frequency_penalty: f32,
    logprobs: Option<usize>,
    vocab_size: usize,
    seed: u64,
    rng: ChaCha12Rng,
    /// Penalised logits, then (random path) unnormalised probabilities `exp((l - max) / T)`.
    work: Vec<f32>,
    /// Candidate token ids when a filter has narrowed the set.
    candidates: Vec<u32>,
}

impl Sampler {
    /// Validates `params` and sets up a sampler for logits rows of `vocab_size` entries.
    /// Without a seed, one is drawn from the OS ([`Sampler::seed`] reports it).
    pub fn new(params: &SamplingParams, vocab_size: usize) -> Result<Self, SamplingError> {
        params.validate()?;
        if vocab_size == 0 {
            return Err(SamplingError::EmptyVocab);
        }
        let seed = params.seed.unwrap_or_else(rand::random);
        Ok(Self {
            greedy: params.is_greedy(),
            temperature: params.temperature,
            top_k: params.top_k_limit().filter(|&k| k < vocab_size),
            top_p: params.top_p,
            min_p: params.min_p,
            repetition_penalty: params.repetition_penalty,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            logprobs: params.logprobs,
            vocab_size,
            seed,
            rng: ChaCha12Rng::seed_from_u64(seed),
            work: Vec::with_capacity(vocab_size),
            candidates: Vec::new(),
        })
    }

    /// The seed of this request's random stream (given or drawn).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Picks the next token from one row of logits. Non-finite logits (NaN, ±inf) count as masked.
    /// Each non-greedy call consumes exactly one draw of the request's random stream, so a seeded
    /// request reproduces regardless of how it was batched.
    pub fn sample(
        &mut self,
        logits: &[f32],
        history: &SeqHistory,
    ) -> Result<SampledToken, SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLength {
                expected: self.vocab_size,
                got: logits.len(),
            });
        }
        let log_norm = log_sum_exp(logits).ok_or(SamplingError::NoFiniteLogits)?;

        self.work.clear();
        self.work.extend(
            logits
                .iter()
                .map(|&l| if l.is_finite() { l } else { f32::NEG_INFINITY }),
        );
        self.apply_penalties(history);

        let token = if self.greedy {
            argmax(&self.work).ok_or(SamplingError::NoFiniteLogits)?
        } else {
            self.sample_random()?
        };

        let raw = logits[token as usize];
        let logprob = if raw.is_finite() {
            raw - log_norm
        } else {
            f32::NEG_INFINITY
        };
        let top_logprobs = match self.logprobs {
            Some(n) if n > 0 => top_n(logits, n)
                .into_iter()
                .map(|(t, l)| (t, l - log_norm))
                .collect(),
            _ => Vec::new(),
        };
        Ok(SampledToken {
            token,
            logprob,
            top_logprobs,
        })
    }

    fn apply_penalties(&mut self, history: &SeqHistory) {
        let vocab = self.work.len();
        let rep = self.repetition_penalty;
        if rep != 1.0 {
            // Positive logits shrink, negative ones grow more negative: both make the token less likely.
            let penalise = |l: &mut f32| *l = if *l > 0.0 { *l / rep } else { *l * rep };
            for &t in history.prompt_distinct() {
                if let Some(l) = self.work.get_mut(t as usize) {
                    penalise(l);
                }
            }
            for (t, _) in history.output_counts() {
                if (t as usize) < vocab && !history.in_prompt(t) {
                    penalise(&mut self.work[t as usize]);
                }
            }
        }
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            for (t, count) in history.output_counts() {
                if let Some(l) = self.work.get_mut(t as usize) {
                    *l -= self.presence_penalty + self.frequency_penalty * count as f32;
                }
            }
        }
    }

    fn sample_random(&mut self) -> Result<u32, SamplingError> {
        let max = self.work.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(SamplingError::NoFiniteLogits);
        }
        // Temperature and softmax numerator in one pass; the argmax gets weight exactly 1.
        let inv_t = 1.0 / self.temperature;
        for w in &mut self.work {
            *w = ((*w - max) * inv_t).exp();
        }

        // `narrowed` = the candidate list holds the allowed set; otherwise every token is allowed.
        let mut narrowed = false;
        if let Some(k) = self.top_k {
            self.collect_positive();
            let work = &self.work;
            if self.candidates.len() > k {
                self.candidates
                    .select_nth_unstable_by(k - 1, |&a, &b| by_weight_desc(work, a, b));
                self.candidates.truncate(k);
            }
            narrowed = true;
        }
        if self.top_p < 1.0 {
            if !narrowed {
                self.collect_positive();
                narrowed = true;
            }
            self.keep_nucleus();
        }
        if self.min_p > 0.0 {
            if narrowed {
                let work = &self.work;
                let top = self
                    .candidates
                    .iter()
                    .map(|&t| work[t as usize])
                    .fold(0.0, f32::max);
                let threshold = self.min_p * top;
                self.candidates.retain(|&t| work[t as usize] >= threshold);
            } else {
                // The unfiltered maximum weight is exactly 1.
                let threshold = self.min_p;
                for w in &mut self.work {
                    if *w < threshold {
                        *w = 0.0;
                    }
                }
            }
        }

        let u: f64 = self.rng.random();
        let pick = if narrowed {
            let work = &self.work;
            draw(self.candidates.iter().map(|&t| (t, work[t as usize])), u)
        } else {
            draw(self.work.iter().enumerate().map(|(t, &w)| (t as u32, w)), u)
        };
        pick.ok_or(SamplingError::NoFiniteLogits)
    }

    /// Candidates := every token with non-zero weight.
    fn collect_positive(&mut self) {
        self.candidates.clear();
        let work = &self.work;
        self.candidates
            .extend((0..work.len() as u32).filter(|&t| work[t as usize] > 0.0));
    }

    /// Keeps the smallest most-likely prefix of the candidates whose mass reaches `top_p` (the token
    /// that crosses the threshold stays). Finds it by partial selection of a growing prefix, so
    /// the usual small nucleus costs O(V), not a sort of the whole vocabulary.
    fn keep_nucleus(&mut self) {
        let work = &self.work;
        let cands = &mut self.candidates;
        let total: f64 = cands.iter().map(|&t| work[t as usize] as f64).sum();
        let target = self.top_p as f64 * total;
        let mut n = NUCLEUS_FIRST_GUESS.min(cands.len());
        loop {
            if n < cands.len() {
                cands.select_nth_unstable_by(n - 1, |&a, &b| by_weight_desc(work, a, b));
            }
            let mass: f64 = cands[..n].iter().map(|&t| work[t as usize] as f64).sum();
            if mass >= target || n == cands.len() {
                break;
            }
            n = (n * 8).min(cands.len());
        }
        cands[..n].sort_unstable_by(|&a, &b| by_weight_desc(work, a, b));
        let mut cumulative = 0.0f64;
        let mut keep = n;
        for (i, &t) in cands[..n].iter().enumerate() {
            cumulative += work[t as usize] as f64;
            if cumulative >= target {
                keep = i + 1;
                break;
            }
        }
        cands.truncate(keep.max(1));
    }
}

/// Descending by weight, ties to the lower id (so selections are deterministic).
fn by_weight_desc(work: &[f32], a: u32, b: u32) -> Ordering {
    work[b as usize]
        .total_cmp(&work[a as usize])
        .then(a.cmp(&b))
}

/// Inverse-CDF draw: `u` in [0, 1) scaled to the total weight. Zero-weight tokens are never picked.
fn draw(weights: impl Iterator<Item = (u32, f32)> + Clone, u: f64) -> Option<u32> {
    let total: f64 = weights.clone().map(|(_, w)| w as f64).sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut cumulative = 0.0f64;
    let mut last_positive = None;
    for (t, w) in weights {
        if w > 0.0 {
            cumulative += w as f64;
            last_positive = Some(t);
            if cumulative > target {
                return Some(t);
            }
        }
    }
    // Rounding can leave `target` a hair above the final sum.
    last_positive
}

/// Index of the largest finite value, ties to the lower index.
fn argmax(values: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_finite() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i as u32, v));
        }
    }
    best.map(|(i, _)| i)
}

/// log Σ exp(l) over the finite logits; `None` when there are none.
fn log_sum_exp(logits: &[f32]) -> Option<f32> {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    Some(max + sum.ln() as f32)
}

/// The `n` largest finite logits as (id, logit), largest first, ties to the lower id.
/// A single scan with a small sorted buffer: n ≤ 20, so no vocabulary-sized allocation.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_finite() || (best.len() == n && l <= best[n - 1].1) {
            continue;
        }
        // Insert after equal values, so an earlier (lower) id keeps precedence.
        let pos = best.partition_point(|&(_, b)| b >= l);
        best.insert(pos, (i as u32, l));
        best.truncate(n);
    }
    best
}

#[cfg(test)]
mod tests;
