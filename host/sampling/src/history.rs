//! The token history of one sequence, kept in the form the penalties need.

use std::collections::HashMap;

/// Prompt and generated tokens of one sequence.
///
/// Repetition penalty looks at the distinct tokens of prompt and output; presence and frequency
/// penalties at per-token output counts. Both are kept incrementally so a sampling step costs
/// O(distinct tokens), not O(sequence length).
#[derive(Debug, Clone, Default)]
pub struct SeqHistory {
    /// Distinct prompt tokens, sorted (binary-searched to avoid penalising a token twice).
    prompt_distinct: Vec<u32>,
    output: Vec<u32>,
    output_counts: HashMap<u32, u32>,
}

impl SeqHistory {
    pub fn new(prompt: &[u32]) -> Self {
        let mut prompt_distinct = prompt.to_vec();
        prompt_distinct.sort_unstable();
        prompt_distinct.dedup();
        Self {
            prompt_distinct,
            output: Vec::new(),
            output_counts: HashMap::new(),
        }
    }

    /// Records a generated token.
    pub fn push(&mut self, token: u32) {
        self.output.push(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Drops generated tokens after the first `len` (speculative-decoding rollback).
    pub fn truncate_output(&mut self, len: usize) {
        while self.output.len() > len {
            let Some(t) = self.output.pop() else { break };
            if let Some(c) = self.output_counts.get_mut(&t) {
                *c -= 1;
                if *c == 0 {
                    self.output_counts.remove(&t);
                }
            }
        }
    }

    /// The generated tokens, in order.
    pub fn output(&self) -> &[u32] {
        &self.output
    }

    /// How many times `token` was generated.
    pub fn output_count(&self, token: u32) -> u32 {
        self.output_counts.get(&token).copied().unwrap_or(0)
    }

    pub fn in_prompt(&self, token: u32) -> bool {
        self.prompt_distinct.binary_search(&token).is_ok()
    }

    pub(crate) fn prompt_distinct(&self) -> &[u32] {
        &self.prompt_distinct
    }

    pub(crate) fn output_counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.output_counts.iter().map(|(&t, &c)| (t, c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_truncation() {
        let mut h = SeqHistory::new(&[5, 3, 5]);
        assert!(h.in_prompt(5) && h.in_prompt(3) && !h.in_prompt(4));
        h.extend(&[1, 2, 1, 1]);
        assert_eq!(h.output_count(1), 3);
        h.truncate_output(2);
        assert_eq!(h.output(), &[1, 2]);
        assert_eq!(h.output_count(1), 1);
        h.truncate_output(0);
        assert_eq!(h.output_count(2), 0);
        assert_eq!(h.output_counts().count(), 0);
    }
}
