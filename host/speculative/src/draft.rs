//! Draft sources. A source follows one sequence: it is told every committed token and proposes
//! what may come next; the target model verifies the proposal (see [`crate::verify`]).

use std::collections::HashMap;

/// A proposal: tokens to verify after the committed sequence, with what the acceptance rule and
/// the planner need to know about them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// Each token's estimated chance of being accepted given the ones before it were (the
    /// planner multiplies them into prefix survival). A source with no better estimate gives a
    /// constant.
    pub confidence: Vec<f32>,
    /// The draft's own distribution at each position when it sampled from one (a model drafter);
    /// `None` when each token was chosen outright (prompt lookup): a point mass.
    pub probs: Option<Vec<Vec<f32>>>,
}

/// How a draft source chooses its tokens: the request's own mode, so that a sampled request's
/// draft distribution is a real distribution the acceptance rule can compare against.
pub enum DraftSampling<'a> {
    /// Take each position's most likely token.
    Greedy,
    /// Sample each position from the source's distribution at this temperature.
    Sample {
        temperature: f32,
        rng: &'a mut dyn rand::RngCore,
    },
}

/// Where a sequence's draft tokens come from.
pub trait DraftSource: Send {
    /// Floats per position of the target's hidden-state taps this source reads (0: none).
    fn tap_width(&self) -> usize {
        0
    }
    /// Committed tokens were appended to the sequence: the prompt first, then each step's.
    fn extend(&mut self, tokens: &[u32]);
    /// The target processed positions `first_pos ..` (committed ones only): their taps,
    /// `tap_width()` floats per position. A position the target never ran (a prefix-cache hit)
    /// gets none; a source must cope with gaps.
    fn observe_taps(&mut self, first_pos: usize, taps: &[f32]) {
        let _ = (first_pos, taps);
    }
    /// Up to `max` tokens that may follow the committed sequence (possibly none).
    fn propose(&mut self, max: usize, sampling: &mut DraftSampling<'_>) -> Draft;
}

/// Makes one [`DraftSource`] per sequence: the server's chosen method, shared by the engine.
pub trait DraftSourceFactory: Send + Sync {
    /// The method's name as operators configure it (`"ngram"`, `"dspark"`).
    fn method(&self) -> &str;
    /// A source for a new sequence.
    fn create(&self) -> Box<dyn DraftSource>;
    /// The target's hidden-state taps its sources read (layer indices; empty: none).
    fn tap_layers(&self) -> Vec<usize> {
        Vec::new()
    }
}

impl DraftSourceFactory for NgramParams {
    fn method(&self) -> &str {
        "ngram"
    }

    fn create(&self) -> Box<dyn DraftSource> {
        Box::new(NgramDrafter::new(*self))
    }
}

/// Prompt-lookup settings (vLLM's `prompt_lookup_min` / `prompt_lookup_max`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NgramParams {
    /// Shortest suffix worth matching.
    pub min_n: usize,
    /// Longest suffix tried first (a longer match predicts better).
    pub max_n: usize,
    /// The prior chance that a proposed token is accepted, given the ones before it were.
    /// Prompt lookup has no per-token estimate of its own, so each sequence's drafter moves
    /// from this prior to the rate it actually sees (see [`NgramDrafter`]).
    pub confidence: f32,
}

impl Default for NgramParams {
    fn default() -> Self {
        NgramParams {
            min_n: 2,
            max_n: 4,
            confidence: 0.6,
        }
    }
}

/// Prompt lookup over one sequence: the longest suffix (from `max_n` down to `min_n` tokens)
/// that occurred earlier is matched at its most recent earlier occurrence, and the tokens that
/// followed it there are proposed. An index of every n-gram's latest end keeps a proposal
/// O(max_n) however long the sequence is; extending is O(max_n) per token.
///
/// Its confidence is learnt per sequence: the tokens committed after a proposal show which of
/// its tokens the target would have accepted (the committed token at each position, while the
/// proposal agreed with every one before it), and a decaying count of those outcomes, started
/// from the prior, gives each proposed token's chance.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    params: NgramParams,
    tokens: Vec<u32>,
    /// For each n in min_n..=max_n (index n - min_n): n-gram → the position just after its most
    /// recent occurrence that has a following token.
    latest: Vec<HashMap<Box<[u32]>, usize>>,
    /// The last proposal, the position it starts at, and how many of its tokens have been
    /// checked against committed ones (`None` once a mismatch ended the check).
    last: Vec<u32>,
    last_at: usize,
    checked: Option<usize>,
    /// Decayed counts of proposed tokens that matched, and of those checked.
    hits: f32,
    trials: f32,
}

/// Weight of older outcomes per new one in the learnt confidence.
const CONFIDENCE_DECAY: f32 = 0.9;

impl NgramDrafter {
    pub fn new(params: NgramParams) -> Self {
        let min_n = params.min_n.max(1);
        let params = NgramParams {
            min_n,
            max_n: params.max_n.max(min_n),
            ..params
        };
        NgramDrafter {
            params,
            tokens: Vec::new(),
            latest: vec![HashMap::new(); params.max_n - params.min_n + 1],
            last: Vec::new(),
            last_at: 0,
            checked: None,
            hits: 2.0 * params.confidence.clamp(0.0, 1.0),
            trials: 2.0,
        }
    }

    /// The current chance that a proposed token is accepted given the ones before it were.
    pub fn confidence(&self) -> f32 {
        self.hits / self.trials
    }

    /// Score the last proposal against the tokens committed since it was made.
    fn learn(&mut self) {
        let Some(mut j) = self.checked else { return };
        while j < self.last.len() && self.last_at + j < self.tokens.len() {
            let hit = self.last[j] == self.tokens[self.last_at + j];
            self.hits = self.hits * CONFIDENCE_DECAY + f32::from(u8::from(hit));
            self.trials = self.trials * CONFIDENCE_DECAY + 1.0;
            j += 1;
            if !hit {
                self.checked = None;
                return;
            }
        }
        self.checked = Some(j);
    }

    /// The committed sequence so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Index the n-grams that end just before position `next` (so the token at `next` follows).
    fn index_before(&mut self, next: usize) {
        for (slot, n) in (self.params.min_n..=self.params.max_n).enumerate() {
            if next < n {
                break;
            }
            let gram: Box<[u32]> = self.tokens[next - n..next].into();
            self.latest[slot].insert(gram, next);
        }
    }
}

impl DraftSource for NgramDrafter {
    fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.tokens.push(t);
            // The n-grams ending before the new token now have a follower.
            let next = self.tokens.len() - 1;
            self.index_before(next);
        }
        self.learn();
    }

    fn propose(&mut self, max: usize, _sampling: &mut DraftSampling<'_>) -> Draft {
        let len = self.tokens.len();
        if max == 0 {
            return Draft::default();
        }
        for n in (self.params.min_n..=self.params.max_n).rev() {
            if len < n {
                continue;
            }
            let suffix = &self.tokens[len - n..];
            // The index holds only occurrences with a follower, so never the suffix itself.
            if let Some(&start) = self.latest[n - self.params.min_n].get(suffix) {
                let tokens: Vec<u32> = self.tokens[start..len.min(start + max)].to_vec();
                let confidence = vec![self.confidence(); tokens.len()];
                self.last = tokens.clone();
                self.last_at = len;
                self.checked = Some(0);
                return Draft {
                    tokens,
                    confidence,
                    probs: None,
                };
            }
        }
        Draft::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    impl NgramDrafter {
        fn propose_greedy(&mut self, max: usize) -> Draft {
            self.propose(max, &mut DraftSampling::Greedy)
        }
    }

    fn drafter(tokens: &[u32]) -> NgramDrafter {
        let mut d = NgramDrafter::new(NgramParams::default());
        d.extend(tokens);
        d
    }

    #[test]
    fn proposes_what_followed_the_latest_match() {
        // "1 2 3 9 ... 1 2 3 7 8 ... 1 2 3" → the latest earlier "1 2 3" was followed by 7 8.
        let d = &mut drafter(&[1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3]);
        assert_eq!(d.propose_greedy(2).tokens, vec![7, 8]);
        assert_eq!(d.propose_greedy(10).tokens, vec![7, 8, 6, 1, 2, 3]);
        assert_eq!(d.propose_greedy(0).tokens, Vec::<u32>::new());
    }

    #[test]
    fn confidence_follows_what_the_target_committed() {
        let mut d = drafter(&[1, 2, 3, 4, 5, 1, 2]);
        let prior = d.confidence();
        assert_eq!(d.propose_greedy(3).tokens, vec![3, 4, 5]);
        // The target agreed with all three: the estimate rises.
        d.extend(&[3, 4, 5]);
        let up = d.confidence();
        assert!(up > prior, "{up} > {prior}");
        // Now the repeat of "1 2" is followed by 3; propose, and the target disagrees at once.
        d.extend(&[1, 2]);
        assert_eq!(d.propose_greedy(2).tokens, vec![3, 4]);
        d.extend(&[9, 4]);
        assert!(
            d.confidence() < up,
            "one miss lowers it; the token after it is not scored"
        );
        let after_miss = d.confidence();
        d.extend(&[7]);
        assert_eq!(d.confidence(), after_miss);
    }

    #[test]
    fn prefers_the_longest_suffix() {
        // The 2-gram "2 3" last occurred before 4, but the 3-gram "1 2 3" before 9.
        let d = &mut drafter(&[1, 2, 3, 9, 0, 2, 3, 4, 0, 1, 2, 3]);
        assert_eq!(d.propose_greedy(1).tokens, vec![9]);
    }

    #[test]
    fn nothing_without_a_match_and_grows_with_extend() {
        let mut d = drafter(&[1, 2, 3, 4]);
        assert!(d.propose_greedy(4).tokens.is_empty());
        d.extend(&[1, 2]);
        assert_eq!(d.propose_greedy(4).tokens, vec![3, 4, 1, 2]);
        let p = d.propose_greedy(2);
        assert_eq!(p.confidence.len(), 2);
        assert!(p.probs.is_none());
    }

    /// The most recent earlier occurrence of the longest suffix, found by brute force.
    fn brute(tokens: &[u32], params: NgramParams, max: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (params.min_n..=params.max_n).rev() {
            if len < n {
                continue;
            }
            let suffix = &tokens[len - n..];
            for start in (n..len).rev() {
                if &tokens[start - n..start] == suffix {
                    return tokens[start..len.min(start + max)].to_vec();
                }
            }
        }
        Vec::new()
    }

    proptest! {
        /// Extending in any chunking gives the brute-force answer after every chunk.
        #[test]
        fn index_agrees_with_brute_force(
            tokens in prop::collection::vec(0u32..4, 0..120),
            cuts in prop::collection::vec(1usize..9, 0..40),
            max in 1usize..9,
        ) {
            let params = NgramParams::default();
            let mut d = NgramDrafter::new(params);
            let mut at = 0;
            for c in cuts.iter().copied().chain(std::iter::repeat(7)) {
                if at >= tokens.len() { break; }
                let end = (at + c).min(tokens.len());
                d.extend(&tokens[at..end]);
                at = end;
                prop_assert_eq!(d.propose_greedy(max).tokens, brute(&tokens[..at], params, max));
            }
        }
    }
}
