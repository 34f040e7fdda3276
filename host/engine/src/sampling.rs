//! The seam between the engine and token selection. The engine only needs "logits in, token
//! out"; the full sampler (temperature, top-k/p, penalties, seeds, constraints) lives in
//! `k3-sampling` and plugs in through [`TokenSampler`] (callers pass one per request).

/// A picked token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// Log-probability of `token` under the (unmodified) softmax of the logits.
    pub logprob: f32,
    /// Best `top_n` alternatives, best first.
    pub top: Vec<(u32, f32)>,
}

/// Picks the next token from one logits row.
pub trait TokenSampler: Send {
    /// `history`: all tokens so far (prompt + generated), for penalties.
    fn sample(&mut self, logits: &[f32], history: &[u32], top_n: usize) -> SampledToken;
}

/// Deterministic argmax (ties go to the lowest id).
#[derive(Debug, Default, Clone, Copy)]
pub struct Greedy;

impl TokenSampler for Greedy {
    fn sample(&mut self, logits: &[f32], _history: &[u32], top_n: usize) -> SampledToken {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        let lse = log_sum_exp(logits);
        let mut top = Vec::new();
        if top_n > 0 {
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            top = idx
                .into_iter()
                .take(top_n)
                .map(|i| (i as u32, logits[i] - lse))
                .collect();
        }
        SampledToken {
            token: best as u32,
            logprob: logits.get(best).map_or(0.0, |l| l - lse),
            top,
        }
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
        let s = Greedy.sample(&[0.0, 2.0, 1.0, 2.0], &[], 2);
        assert_eq!(s.token, 1);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3]);
        let p: f32 = [0.0f32, 2.0, 1.0, 2.0].iter().map(|x| x.exp()).sum();
        assert!((s.logprob - (2.0 - p.ln())).abs() < 1e-5);
    }
}
