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

/// Largest `k` a sampler asks the executor to select for it ([`Sampler::top_k_need`]); larger
/// top-k requests take whole rows.
pub const MAX_SELECTED_TOP_K: usize = 1024;

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// log-softmax of the raw logits at `token`; computed only when the request asked for
    /// logprobs (it costs an extra exp pass over the vocabulary).
    pub logprob: Option<f32>,
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
    /// Candidates (weight, id) when a filter has narrowed the set; weights are copied in so
    /// selections and sorts touch contiguous memory.
    candidates: Vec<Candidate>,
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
        self.penalised(logits, history)?;

        let token = if self.greedy {
            argmax(&self.work).ok_or(SamplingError::NoFiniteLogits)?
        } else {
            self.sample_random()?
        };

        self.reported(logits, token)
    }

    /// `token` as [`Sampler::sample`] reports it from `logits`: with its logprobs when the
    /// request asked for them. For a token chosen some other way (speculative verification).
    pub fn reported(&self, logits: &[f32], token: u32) -> Result<SampledToken, SamplingError> {
        let (logprob, top_logprobs) = match self.logprobs {
            None => (None, Vec::new()),
            Some(n) => {
                let log_norm = log_sum_exp(logits).ok_or(SamplingError::NoFiniteLogits)?;
                let raw = logits.get(token as usize).copied().unwrap_or(f32::NAN);
                let logprob = if raw.is_finite() {
                    raw - log_norm
                } else {
                    f32::NEG_INFINITY
                };
                let top = top_n(logits, n)
                    .into_iter()
                    .map(|(t, l)| (t, l - log_norm))
                    .collect();
                (Some(logprob), top)
            }
        };
        Ok(SampledToken {
            token,
            logprob,
            top_logprobs,
        })
    }

    /// Whether this request takes the argmax (no randomness).
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// The temperature a sampled request draws at (meaningless for greedy ones).
    pub fn temperature(&self) -> f32 {
        self.temperature
    }

    /// The request's random stream: what speculative verification draws its acceptance tests
    /// from, so a seeded request stays reproducible.
    pub fn rng(&mut self) -> &mut impl Rng {
        &mut self.rng
    }

    /// The distribution [`Sampler::sample`] draws the next token from (penalties →
    /// temperature → top-k → top-p → min-p, normalised), over the whole vocabulary; a point
    /// mass on the argmax for greedy requests. Consumes no randomness. Speculative verification
    /// compares draft tokens against exactly this.
    pub fn distribution(
        &mut self,
        logits: &[f32],
        history: &SeqHistory,
    ) -> Result<Vec<f32>, SamplingError> {
        self.penalised(logits, history)?;
        let mut p = vec![0f32; self.vocab_size];
        if self.greedy {
            let t = argmax(&self.work).ok_or(SamplingError::NoFiniteLogits)?;
            p[t as usize] = 1.0;
            return Ok(p);
        }
        let narrowed = self.weigh()?;
        let pairs: Vec<(u32, f32)> = if narrowed {
            self.candidates.iter().map(|c| (c.id, c.weight)).collect()
        } else {
            (0u32..).zip(self.work.iter().copied()).collect()
        };
        let total: f64 = pairs.iter().map(|&(_, w)| f64::from(w)).sum();
        if total.is_nan() || total <= 0.0 {
            return Err(SamplingError::NoFiniteLogits);
        }
        for (t, w) in pairs {
            p[t as usize] = (f64::from(w) / total) as f32;
        }
        Ok(p)
    }

    /// How many of a row's largest logits this request needs to pick its next token exactly
    /// as [`Sampler::sample`] would from the whole row: 1 for greedy, `k` for top-k. `None` when
    /// it needs the whole row: penalties change logits anywhere in the row, logprobs need the
    /// row's normaliser, and plain temperature / top-p / min-p sampling may pick any token.
    pub fn top_k_need(&self) -> Option<usize> {
        let penalised = self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0;
        if penalised || self.logprobs.is_some() {
            return None;
        }
        if self.greedy {
            return Some(1);
        }
        self.top_k.filter(|&k| k <= MAX_SELECTED_TOP_K)
    }

    /// [`Sampler::sample`] from a row's `top_k_need()` largest finite logits, as `(id, logit)`
    /// largest first with ties to the lower id (`k3_model::top_k_of_row`'s order). Picks the same
    /// token as `sample` on the whole row and consumes the random stream the same way.
    pub fn sample_top(&mut self, top: &[(u32, f32)]) -> Result<SampledToken, SamplingError> {
        let Some(k) = self.top_k_need() else {
            return Err(SamplingError::CandidatesUnusable);
        };
        if top.len() > k
            || top
                .iter()
                .any(|&(t, l)| t as usize >= self.vocab_size || !l.is_finite())
        {
            return Err(SamplingError::CandidatesUnusable);
        }
        let token = if self.greedy {
            top.first().map(|&(t, _)| t)
        } else {
            self.candidates.clear();
            self.candidates
                .extend(top.iter().map(|&(id, weight)| Candidate { weight, id }));
            self.sample_candidates()
        };
        Ok(SampledToken {
            token: token.ok_or(SamplingError::NoFiniteLogits)?,
            logprob: None,
            top_logprobs: Vec::new(),
        })
    }

    /// `work` := the row with non-finite logits masked and the penalties applied.
    fn penalised(&mut self, logits: &[f32], history: &SeqHistory) -> Result<(), SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLength {
                expected: self.vocab_size,
                got: logits.len(),
            });
        }
        self.work.clear();
        self.work.extend(
            logits
                .iter()
                .map(|&l| if l.is_finite() { l } else { f32::NEG_INFINITY }),
        );
        self.apply_penalties(history);
        Ok(())
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
        let narrowed = self.weigh()?;
        let u: f64 = self.rng.random();
        let pick = if narrowed {
            draw(self.candidates.iter().map(|c| (c.id, c.weight)), u)
        } else {
            draw(self.work.iter().enumerate().map(|(t, &w)| (t as u32, w)), u)
        };
        pick.ok_or(SamplingError::NoFiniteLogits)
    }

    /// The random path's weights from the penalised logits in `work`: temperature, top-k,
    /// top-p, min-p. Returns whether `candidates` now holds the allowed set (else `work` holds a
    /// weight for every token).
    fn weigh(&mut self) -> Result<bool, SamplingError> {
        let max = self.work.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(SamplingError::NoFiniteLogits);
        }
        // Weights are softmax numerators at temperature T; the argmax gets weight exactly 1.
        let inv_t = 1.0 / self.temperature;
        let weight = |l: f32| ((l - max) * inv_t).exp();

        if let Some(k) = self.top_k {
            // Select on logits (same order as weights), so only k exps are needed.
            self.select_top_k_logits(k);
            if self.candidates.is_empty() {
                return Err(SamplingError::NoFiniteLogits);
            }
            self.weigh_candidates();
            return Ok(true);
        }
        for w in &mut self.work {
            *w = weight(*w);
        }
        // `narrowed` = the candidate list holds the allowed set; otherwise every token is allowed.
        let mut narrowed = false;
        if self.top_p < 1.0 {
            if !narrowed {
                self.collect_positive();
                narrowed = true;
            }
            self.keep_nucleus();
        }
        if self.min_p > 0.0 {
            if narrowed {
                let top = self.candidates.iter().map(|c| c.weight).fold(0.0, f32::max);
                let threshold = self.min_p * top;
                self.candidates.retain(|c| c.weight >= threshold);
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
        Ok(narrowed)
    }

    /// The top-k path after selection: `candidates` hold the k largest logits in rank order
    /// (whether selected here or by the executor). Temperature → top-p → min-p → draw.
    fn sample_candidates(&mut self) -> Option<u32> {
        if self.candidates.is_empty() {
            return None;
        }
        self.weigh_candidates();
        let u: f64 = self.rng.random();
        draw(self.candidates.iter().map(|c| (c.id, c.weight)), u)
    }

    /// Temperature → top-p → min-p over the selected candidates (at least one).
    fn weigh_candidates(&mut self) {
        let max = self.candidates[0].weight;
        let inv_t = 1.0 / self.temperature;
        for c in &mut self.candidates {
            c.weight = ((c.weight - max) * inv_t).exp();
        }
        if self.top_p < 1.0 {
            self.keep_nucleus();
        }
        if self.min_p > 0.0 {
            let top = self.candidates.iter().map(|c| c.weight).fold(0.0, f32::max);
            let threshold = self.min_p * top;
            self.candidates.retain(|c| c.weight >= threshold);
        }
    }

    /// Candidates := the `k` largest finite entries of `work` as (logit, id), ties to the lower
    /// id, in that rank order (so the draw sees the same sequence as from executor-selected
    /// candidates). One scan against a running threshold; the buffer is pruned back to `k` when it fills,
    /// so a small k costs little more than reading the logits once.
    fn select_top_k_logits(&mut self, k: usize) {
        let cands = &mut self.candidates;
        cands.clear();
        let capacity = (2 * k).max(256);
        // Anything not above the current k-th best (a tie comes later, so has the higher id)
        // cannot enter the top k.
        let mut threshold = f32::NEG_INFINITY;
        for (id, &l) in (0u32..).zip(&self.work) {
            if l > threshold {
                cands.push(Candidate { weight: l, id });
                if cands.len() == capacity {
                    cands.select_nth_unstable_by(k - 1, Candidate::rank);
                    cands.truncate(k);
                    threshold = cands[k - 1].weight;
                }
            }
        }
        if cands.len() > k {
            cands.select_nth_unstable_by(k - 1, Candidate::rank);
            cands.truncate(k);
        }
        cands.sort_unstable_by(Candidate::rank);
    }

    /// Candidates := every token with non-zero weight.
    fn collect_positive(&mut self) {
        self.candidates.clear();
        self.candidates.extend(
            (0u32..)
                .zip(&self.work)
                .filter(|&(_, &w)| w > 0.0)
                .map(|(id, &weight)| Candidate { weight, id }),
        );
    }

    /// Keeps the smallest most-likely prefix of the candidates whose mass reaches `top_p` (the token
    /// that crosses the threshold stays). Finds it by partial selection of a growing prefix, so
    /// the usual small nucleus costs O(V), not a sort of the whole vocabulary, and only the last
    /// growth step's slice gets sorted.
    fn keep_nucleus(&mut self) {
        let cands = &mut self.candidates;
        let mass = |c: &[Candidate]| c.iter().map(|c| c.weight as f64).sum::<f64>();
        let target = self.top_p as f64 * mass(cands);
        // Invariant: cands[..lo] are the top `lo` candidates and their mass is below the target.
        let mut lo = 0;
        let mut lo_mass = 0.0;
        let mut n = NUCLEUS_FIRST_GUESS.min(cands.len());
        loop {
            if n < cands.len() {
                // Only the part after `lo` needs reordering: the top `lo` are already in place.
                cands[lo..].select_nth_unstable_by(n - lo - 1, Candidate::rank);
            }
            let n_mass = lo_mass + mass(&cands[lo..n]);
            if n_mass >= target || n == cands.len() {
                break;
            }
            (lo, lo_mass) = (n, n_mass);
            n = (n * 4).min(cands.len());
        }
        cands[lo..n].sort_unstable_by(Candidate::rank);
        let mut cumulative = lo_mass;
        let mut keep = n;
        for (i, c) in cands[lo..n].iter().enumerate() {
            cumulative += c.weight as f64;
            if cumulative >= target {
                keep = lo + i + 1;
                break;
            }
        }
        cands.truncate(keep.max(1));
    }
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    weight: f32,
    id: u32,
}

impl Candidate {
    /// Descending by weight, ties to the lower id (so selections are deterministic).
    fn rank(a: &Self, b: &Self) -> Ordering {
        b.weight.total_cmp(&a.weight).then(a.id.cmp(&b.id))
    }
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
        // total_cmp: +0 ranks above -0, as in every top-k selection (`Candidate::rank`).
        if v.is_finite() && best.is_none_or(|(_, b)| v.total_cmp(&b).is_gt()) {
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
        .map(|&l| (l - max).exp() as f64)
        .sum();
    Some(max + sum.ln() as f32)
}

/// The `n` largest finite logits as (id, logit), largest first, ties to the lower id.
/// A single scan with a small sorted buffer: n ≤ 20, so no vocabulary-sized allocation.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
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
