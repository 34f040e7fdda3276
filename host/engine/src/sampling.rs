//! The seam between the engine and token selection: "logits in, token out". Requests are
//! sampled by `k3-sampling` ([`RequestSampler`]: penalties, temperature, top-k/p, min-p, seeds,
//! logprobs); a caller may plug in its own [`TokenSampler`] (e.g. a grammar-constrained one).

use k3_model::PendingTokenMask;
use k3_sampling::{SampledToken, Sampler, SamplingParams, SeqHistory};
use k3_speculative::{Draft, verify_token};
use std::borrow::Cow;

/// How a request chooses tokens, as speculative decoding needs to know it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpecMode {
    /// The argmax: a draft token is accepted when it is the target's choice.
    Greedy,
    /// Random draws: drafts are accepted by rejection sampling against the request's own
    /// processed distribution (docs/speculative-decoding.md).
    Sampled { temperature: f32 },
}

/// Picks the next token of one request from one logits row. Called exactly once per generated
/// token, in order, so an implementation may keep per-request state (history, random stream).
pub trait TokenSampler: Send {
    fn sample(&mut self, logits: &[f32]) -> Result<SampledToken, String>;

    /// `Some(k)`: the next token follows from the row's `k` largest logits alone
    /// ([`TokenSampler::sample_top`]), so the executor may select them where the logits are
    /// instead of returning the whole row. Default: whole rows.
    fn top_k_need(&self) -> Option<usize> {
        None
    }

    /// The same choice as [`TokenSampler::sample`] from the row's `top_k_need()` largest finite
    /// logits (`(id, logit)`, largest first, ties to the lower id).
    fn sample_top(&mut self, top: &[(u32, f32)]) -> Result<SampledToken, String> {
        let _ = top;
        Err("this sampler needs whole logits rows".into())
    }

    /// The token mask the candidates of the next [`TokenSampler::sample_top`] must respect
    /// (constrained decoding), possibly still being computed: the executor waits for it after
    /// the forward pass and selects among the allowed tokens only. Default: no mask.
    fn pending_mask(&self) -> Option<PendingTokenMask> {
        None
    }

    /// Whether (and how) this sampler can verify speculative drafts; `None` (the default): the
    /// request decodes one token per step.
    fn speculation(&self) -> Option<SpecMode> {
        None
    }

    /// Verify `draft` against `rows`, the target's logits for the position after the last
    /// committed token and after each draft token (`draft.tokens.len() + 1` rows). Returns the
    /// tokens to commit: the accepted drafts, then one more (the correction, or the bonus
    /// token), each reported as [`TokenSampler::sample`] would have reported it. Advances the
    /// sampler exactly as sampling those tokens one by one.
    fn verify(&mut self, rows: &[&[f32]], draft: &Draft) -> Result<Vec<SampledToken>, String> {
        let _ = (rows, draft);
        Err("this sampler cannot verify speculative tokens".into())
    }
}

/// `k3_sampling::Sampler` plus the request's token history (for penalties) and its
/// `min_tokens` rule.
pub struct RequestSampler {
    sampler: Sampler,
    history: SeqHistory,
    generated: u32,
    min_tokens: u32,
    /// Tokens that would end the generation (EOS unless ignored, `stop_token_ids`): never
    /// sampled before `min_tokens` tokens.
    enders: Vec<u32>,
}

impl RequestSampler {
    pub fn new(params: &SamplingParams, vocab: usize, prompt: &[u32]) -> Result<Self, String> {
        let sampler = Sampler::new(params, vocab).map_err(|e| e.to_string())?;
        Ok(Self {
            sampler,
            history: SeqHistory::new(prompt),
            generated: 0,
            min_tokens: 0,
            enders: Vec::new(),
        })
    }

    /// Hold back the tokens that would end the generation (`eos_token_ids` unless the request
    /// ignores EOS, and its `stop_token_ids`) until `params.min_tokens` tokens are out, as vLLM
    /// does. Until then the sampler wants whole rows (the candidates alone could all be enders).
    pub fn with_min_tokens(mut self, params: &SamplingParams, eos_token_ids: &[u32]) -> Self {
        self.min_tokens = params.min_tokens;
        self.enders = params.stop_token_ids.clone();
        if !params.ignore_eos {
            self.enders.extend_from_slice(eos_token_ids);
        }
        self
    }

    fn holds_enders(&self) -> bool {
        self.generated < self.min_tokens && !self.enders.is_empty()
    }

    /// The row the sampler sees: the enders masked while `min_tokens` holds them back.
    fn seen<'a>(&self, logits: &'a [f32]) -> Cow<'a, [f32]> {
        if !self.holds_enders() {
            return Cow::Borrowed(logits);
        }
        let mut row = logits.to_vec();
        for &t in &self.enders {
            if let Some(l) = row.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        Cow::Owned(row)
    }

    fn accept(&mut self, s: SampledToken) -> SampledToken {
        self.history.push(s.token);
        self.generated = self.generated.saturating_add(1);
        s
    }
}

impl TokenSampler for RequestSampler {
    fn sample(&mut self, logits: &[f32]) -> Result<SampledToken, String> {
        let row = self.seen(logits);
        let s = self.sampler.sample(&row, &self.history);
        Ok(self.accept(s.map_err(|e| e.to_string())?))
    }

    fn speculation(&self) -> Option<SpecMode> {
        Some(if self.sampler.is_greedy() {
            SpecMode::Greedy
        } else {
            SpecMode::Sampled {
                temperature: self.sampler.temperature(),
            }
        })
    }

    fn verify(&mut self, rows: &[&[f32]], draft: &Draft) -> Result<Vec<SampledToken>, String> {
        if rows.len() != draft.tokens.len() + 1 {
            return Err(format!(
                "{} logits rows for {} draft tokens",
                rows.len(),
                draft.tokens.len()
            ));
        }
        let mut out = Vec::with_capacity(rows.len());
        for (j, &x) in draft.tokens.iter().enumerate() {
            if self.sampler.is_greedy() {
                // The sampler's own choice at each position (penalties and min_tokens
                // included): what decoding without a draft would have produced.
                let s = self.sample(rows[j])?;
                let hit = s.token == x;
                out.push(s);
                if !hit {
                    return Ok(out);
                }
                continue;
            }
            let row = self.seen(rows[j]).into_owned();
            let p = self
                .sampler
                .distribution(&row, &self.history)
                .map_err(|e| e.to_string())?;
            let q = draft
                .probs
                .as_ref()
                .and_then(|q| q.get(j))
                .map(Vec::as_slice);
            let verdict = verify_token(&p, x, q, self.sampler.rng());
            let token = verdict.unwrap_or(x);
            let s = self
                .sampler
                .reported(&row, token)
                .map_err(|e| e.to_string())?;
            out.push(self.accept(s));
            if verdict.is_some() {
                return Ok(out);
            }
        }
        out.push(self.sample(rows[draft.tokens.len()])?);
        Ok(out)
    }

    fn top_k_need(&self) -> Option<usize> {
        if self.holds_enders() {
            return None;
        }
        self.sampler.top_k_need()
    }

    fn sample_top(&mut self, top: &[(u32, f32)]) -> Result<SampledToken, String> {
        let s = self.sampler.sample_top(top).map_err(|e| e.to_string())?;
        Ok(self.accept(s))
    }
}

/// Deterministic argmax (ties go to the lowest id), with `top_n` alternatives.
#[derive(Debug, Default, Clone, Copy)]
pub struct Greedy {
    pub top_n: usize,
}

impl TokenSampler for Greedy {
    fn sample(&mut self, logits: &[f32]) -> Result<SampledToken, String> {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        let lse = log_sum_exp(logits);
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let top_logprobs = idx
            .into_iter()
            .take(self.top_n)
            .map(|i| (i as u32, logits[i] - lse))
            .collect();
        let logprob = logits
            .get(best)
            .map(|l| l - lse)
            .ok_or("empty logits row")?;
        Ok(SampledToken {
            token: best as u32,
            logprob: Some(logprob),
            top_logprobs,
        })
    }
}

fn log_sum_exp(xs: &[f32]) -> f32 {
    let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    m + xs.iter().map(|x| (x - m).exp()).sum::<f32>().ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_with_logprobs() {
        let s = Greedy { top_n: 2 }.sample(&[0.0, 2.0, 1.0, 2.0]).unwrap();
        assert_eq!(s.token, 1);
        assert_eq!(
            s.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3]
        );
        let p: f32 = [0.0f32, 2.0, 1.0, 2.0].iter().map(|x| x.exp()).sum();
        assert!((s.logprob.unwrap() - (2.0 - p.ln())).abs() < 1e-5);
    }

    #[test]
    fn request_sampler_greedy_matches_argmax() {
        let params = SamplingParams {
            temperature: 0.0,
            logprobs: Some(1),
            ..Default::default()
        };
        let mut s = RequestSampler::new(&params, 4, &[0]).unwrap();
        let out = s.sample(&[0.0, 2.0, 1.0, 3.0]).unwrap();
        assert_eq!((out.token, out.top_logprobs.len()), (3, 1));
        assert!(
            RequestSampler::new(
                &SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                4,
                &[]
            )
            .is_err()
        );
    }

    #[test]
    fn min_tokens_holds_back_eos_and_stop_tokens() {
        // Token 3 (EOS) and token 2 (a stop token) lead every row; token 1 is next.
        let row = [0.0f32, 1.0, 5.0, 9.0];
        let params = SamplingParams {
            temperature: 0.0,
            min_tokens: 2,
            stop_token_ids: vec![2],
            ..Default::default()
        };
        let mut s = RequestSampler::new(&params, 4, &[0])
            .unwrap()
            .with_min_tokens(&params, &[3]);
        assert_eq!(
            s.top_k_need(),
            None,
            "whole rows while enders are held back"
        );
        assert_eq!(s.sample(&row).unwrap().token, 1);
        assert_eq!(s.sample(&row).unwrap().token, 1);
        assert_eq!(s.top_k_need(), Some(1));
        assert_eq!(
            s.sample(&row).unwrap().token,
            3,
            "EOS once min_tokens are out"
        );
    }
}
