//! The decode step a runner expects after the one it is running: every sequence one position
//! on, with the same KV pages (those its positions need: a page the engine already holds for
//! the next position counts), state block and logits request. A backend may do that step's
//! host work ahead, while the device runs the current one ([`Backend::prepare_step`]); the
//! next step is launched from it only if it turns out to be exactly this step but for its
//! token ids ([`ExpectedStep::matches`]). A sequence that finishes, joins, writes a checkpoint
//! or crosses into a KV page it was not given yet makes the next step differ, and it runs the
//! usual way.
//!
//! [`Backend::prepare_step`]: crate::backend::Backend::prepare_step

use crate::exec::{ForwardBatch, LogitsWant, SeqInput};

/// The token id the expected step's pass is run with; the real ids replace it at launch.
const PLACEHOLDER: [u32; 1] = [0];

#[derive(Debug, Clone, PartialEq, Eq)]
struct ExpectedSeq {
    start_pos: usize,
    kv_pages: Vec<usize>,
    state_block: usize,
    logits: LogitsWant,
}

/// See the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExpectedStep {
    seqs: Vec<ExpectedSeq>,
    page_tokens: usize,
}

/// The pages of `kv_pages` that `positions` positions use (all of them if fewer are given:
/// the model's own check reports a short list).
pub(crate) fn pages_used(kv_pages: &[usize], positions: usize, page_tokens: usize) -> &[usize] {
    &kv_pages[..positions.div_ceil(page_tokens).min(kv_pages.len())]
}

impl ExpectedStep {
    /// The step after `batch`, if `batch` is a plain decode step (one token per sequence, no
    /// verify, taps, images or checkpoints) and each sequence's pages (`page_tokens` positions
    /// each; `paged`: the model has paged layers) already include its next position's.
    pub(crate) fn after(batch: &ForwardBatch<'_>, page_tokens: usize, paged: bool) -> Option<Self> {
        let plain = batch.verify_records.iter().all(Option::is_none)
            && !batch.want_taps.iter().any(|&t| t)
            && batch.media.iter().all(|m| m.is_empty());
        if !plain || batch.seqs.is_empty() {
            return None;
        }
        let seqs = batch
            .seqs
            .iter()
            .map(|s| {
                let next = s.start_pos + 1;
                let fits = !paged || s.kv_pages.len() * page_tokens > next;
                (s.tokens.len() == 1 && s.checkpoints.is_empty() && fits).then(|| ExpectedSeq {
                    start_pos: next,
                    kv_pages: pages_used(s.kv_pages, next + 1, page_tokens).to_vec(),
                    state_block: s.state_block,
                    logits: s.logits,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { seqs, page_tokens })
    }

    /// Whether `batch` is this step but for its token ids.
    pub(crate) fn matches(&self, batch: &ForwardBatch<'_>) -> bool {
        batch.verify_records.iter().all(Option::is_none)
            && !batch.want_taps.iter().any(|&t| t)
            && batch.media.iter().all(|m| m.is_empty())
            && batch.seqs.len() == self.seqs.len()
            && batch.seqs.iter().zip(&self.seqs).all(|(s, e)| {
                s.tokens.len() == 1
                    && s.checkpoints.is_empty()
                    && s.start_pos == e.start_pos
                    && pages_used(s.kv_pages, s.start_pos + 1, self.page_tokens) == e.kv_pages
                    && s.state_block == e.state_block
                    && s.logits == e.logits
            })
    }

    /// The step's inputs, each with the placeholder token.
    pub(crate) fn inputs(&self) -> Vec<SeqInput<'_>> {
        self.seqs
            .iter()
            .map(|e| SeqInput {
                tokens: &PLACEHOLDER,
                start_pos: e.start_pos,
                kv_pages: &e.kv_pages,
                state_block: e.state_block,
                checkpoints: &[],
                logits: e.logits,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq<'a>(tokens: &'a [u32], start_pos: usize, pages: &'a [usize]) -> SeqInput<'a> {
        SeqInput {
            tokens,
            start_pos,
            kv_pages: pages,
            state_block: 4096,
            checkpoints: &[],
            logits: LogitsWant::LastTopK(1),
        }
    }

    fn batch(seqs: Vec<SeqInput<'_>>) -> ForwardBatch<'_> {
        ForwardBatch {
            seqs,
            ..Default::default()
        }
    }

    #[test]
    fn a_decode_step_expects_the_next_position_with_any_ids() {
        let pages = [0, 512];
        let now = batch(vec![seq(&[7], 5, &pages), seq(&[9], 11, &pages)]);
        let e = ExpectedStep::after(&now, 8, true).expect("a plain decode step");
        assert!(!e.matches(&now), "the same positions again");
        let next = batch(vec![seq(&[3], 6, &pages), seq(&[4], 12, &pages)]);
        assert!(e.matches(&next));
        let inputs = e.inputs();
        assert_eq!(inputs.len(), 2);
        assert_eq!((inputs[0].start_pos, inputs[1].start_pos), (6, 12));
        assert!(inputs.iter().all(|s| s.tokens == PLACEHOLDER));
    }

    #[test]
    fn any_other_difference_is_a_different_step() {
        let (pages, more) = ([0, 512], [0, 512, 1024]);
        let now = batch(vec![seq(&[7], 5, &pages), seq(&[9], 11, &pages)]);
        let e = ExpectedStep::after(&now, 8, true).unwrap();
        let differ = |b: ForwardBatch<'_>, why: &str| assert!(!e.matches(&b), "{why}");
        differ(batch(vec![seq(&[3], 6, &pages)]), "a sequence finished");
        let other = [0, 1024];
        differ(
            batch(vec![seq(&[3], 6, &pages), seq(&[4], 12, &other)]),
            "another page",
        );
        // A page beyond the ones the step uses is not a difference (the engine may hold the
        // next page early).
        assert!(e.matches(&batch(vec![seq(&[3], 6, &more), seq(&[4], 12, &more)])));
        differ(
            batch(vec![seq(&[3], 6, &pages), seq(&[4, 5], 12, &pages)]),
            "two tokens",
        );
        let mut b = batch(vec![seq(&[3], 6, &pages), seq(&[4], 12, &pages)]);
        b.seqs[1].state_block = 8192;
        differ(b.clone(), "another state block");
        b.seqs[1].state_block = 4096;
        b.seqs[0].logits = LogitsWant::Last;
        differ(b.clone(), "another logits request");
        b.seqs[0].logits = LogitsWant::LastTopK(1);
        b.seqs[0].checkpoints = &[(1, 8192)];
        differ(b.clone(), "a checkpoint");
        b.seqs[0].checkpoints = &[];
        b.verify_records = vec![None, Some(8192)];
        differ(b.clone(), "a verify");
        b.verify_records.clear();
        assert!(e.matches(&b), "back to the expected step");
    }

    #[test]
    fn no_expectation_past_the_last_page_or_for_other_steps() {
        let pages = [0, 512];
        // Positions 0..16 fit two pages of 8: the token at 15 is the last one.
        assert!(ExpectedStep::after(&batch(vec![seq(&[1], 14, &pages)]), 8, true).is_some());
        assert!(ExpectedStep::after(&batch(vec![seq(&[1], 15, &pages)]), 8, true).is_none());
        // With the third page given a step early, the step into it is expected, using it.
        let more = [0, 512, 1024];
        let e = ExpectedStep::after(&batch(vec![seq(&[1], 15, &more)]), 8, true).unwrap();
        assert_eq!(e.inputs()[0].kv_pages, &more[..]);
        assert!(e.matches(&batch(vec![seq(&[2], 16, &more)])));
        assert!(!e.matches(&batch(vec![seq(&[2], 16, &[0, 512, 2048])])));
        // Pages the next step does not use are not part of what it is expected to be.
        let e = ExpectedStep::after(&batch(vec![seq(&[1], 3, &more)]), 8, true).unwrap();
        assert_eq!(e.inputs()[0].kv_pages, &[0]);
        assert!(e.matches(&batch(vec![seq(&[2], 4, &[0])])));
        // Without paged layers pages do not matter.
        assert!(ExpectedStep::after(&batch(vec![seq(&[1], 15, &[])]), 8, false).is_some());
        // Prefill chunks, checkpoints, verifies, taps and images are not decode steps.
        assert!(ExpectedStep::after(&batch(vec![seq(&[1, 2], 3, &pages)]), 8, true).is_none());
        let mut b = batch(vec![seq(&[1], 3, &pages)]);
        b.seqs[0].checkpoints = &[(1, 8192)];
        assert!(ExpectedStep::after(&b, 8, true).is_none());
        let mut b = batch(vec![seq(&[1], 3, &pages)]);
        b.verify_records = vec![Some(8192)];
        assert!(ExpectedStep::after(&b, 8, true).is_none());
        let mut b = batch(vec![seq(&[1], 3, &pages)]);
        b.want_taps = vec![true];
        assert!(ExpectedStep::after(&b, 8, true).is_none());
        assert!(ExpectedStep::after(&batch(vec![]), 8, true).is_none());
    }
}
