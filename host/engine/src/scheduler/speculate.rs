//! Speculative decoding in the scheduler (docs/speculative-decoding.md, "In the engine").
//!
//! A speculating request's decode step becomes a verify: its input is the last committed token
//! followed by up to `draft_max` draft tokens, the executor returns a logits row for each and
//! keeps its KDA state untouched (the layers' ReplaySSM records go to a record block the
//! request holds), and after acceptance a commit op replays the accepted prefix into the state
//! before the request's next step. The plan reserves pages and a record block for the longest
//! draft; the draft itself is proposed at launch, once the previous step's tokens are known, and
//! the planner then trims every draft in the step to what pays for itself.

use super::plan::PlannedSeq;
use super::{EngineCore, Seq};
use crate::memory::{ArenaOp, BlockId, BlockKind};
use crate::sampling::SpecMode;
use k3_model::VerifiedBlock;
use k3_sampling::SampledToken;
use k3_speculative::{
    Draft, DraftSampling, DraftSource, DraftingRecord, drafting_pays, plan_verify_lengths,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// A speculating request's drafting state.
pub(crate) struct SeqSpec {
    source: Box<dyn DraftSource>,
    /// Tokens of the request already given to `source`.
    extended: usize,
    /// The first position whose hidden-state taps `source` has not seen.
    taps_from: usize,
    /// The block its verify passes write their ReplaySSM records to; held while it runs.
    pub(super) record: Option<BlockId>,
    /// A verify of this request is planned or in flight: it is not planned again (its next
    /// input depends on how much of the draft is accepted) until that step completes.
    pub(super) verifying: bool,
    /// Draws of a sampling drafter (any stream keeps verification exact).
    rng: ChaCha8Rng,
}

impl SeqSpec {
    pub(super) fn new(source: Box<dyn DraftSource>, seed: u64) -> Self {
        Self {
            source,
            extended: 0,
            taps_from: 0,
            record: None,
            verifying: false,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Whether its steps return hidden-state taps.
    pub(super) fn wants_taps(&self) -> bool {
        self.source.tap_width() > 0
    }

    /// Hand the source the taps of positions `start ..` (`rows` rows of `width` floats) that it
    /// has not seen; positions recomputed after a preemption are skipped.
    pub(super) fn observe(&mut self, start: usize, taps: &[f32], width: usize) {
        if width == 0 || width != self.source.tap_width() {
            return;
        }
        let rows = taps.len() / width;
        let skip = self.taps_from.saturating_sub(start).min(rows);
        if skip < rows {
            self.source
                .observe_taps(start + skip, &taps[skip * width..rows * width]);
            self.taps_from = start + rows;
        }
    }
}

/// The engine's running record of what speculation yields, for the early exit
/// ([`drafting_pays`]): exponential averages over recent verify rounds and proposals.
#[derive(Debug)]
pub(crate) struct SpecGate {
    record: Option<DraftingRecord>,
    /// Whether the steps planned now may draft.
    open: bool,
    /// Steps in a row whose drafting was skipped; at [`PROBE_EVERY`] the next step drafts
    /// anyway, so the record follows a workload that changed.
    skipped: u32,
}

/// Skipped steps after which one step drafts again to refresh the record.
const PROBE_EVERY: u32 = 32;
/// Weight of the newest observation in the averages.
const GATE_WEIGHT: f64 = 0.1;

impl Default for SpecGate {
    fn default() -> Self {
        Self {
            record: None,
            open: true,
            skipped: 0,
        }
    }
}

impl SpecGate {
    fn observe_round(&mut self, committed: usize, verified: usize) {
        let r = self.record.get_or_insert(DraftingRecord {
            committed: committed as f64,
            verified: verified as f64,
            draft_seconds: 0.0,
        });
        r.committed += GATE_WEIGHT * (committed as f64 - r.committed);
        r.verified += GATE_WEIGHT * (verified as f64 - r.verified);
    }

    fn observe_drafting(&mut self, seconds_per_request: f64) {
        if let Some(r) = self.record.as_mut() {
            r.draft_seconds += GATE_WEIGHT * (seconds_per_request - r.draft_seconds);
        }
    }
}

impl EngineCore {
    /// Draft tokens a decode step of running request `i` at `start` may verify: 0 when it does
    /// not speculate. A verify never crosses a checkpoint boundary: the state is committed only
    /// at the end of the accepted prefix, so a draft stops at the next aligned position, which
    /// a fully accepted draft then reaches exactly (and snapshots there).
    pub(super) fn draft_room(&self, i: usize, start: usize) -> usize {
        let (Some(cfg), Some(spec)) = (&self.cfg.speculation, &self.running[i].spec) else {
            return 0;
        };
        if spec.verifying || !self.spec_gate.open {
            return 0;
        }
        let mut room = cfg
            .max_draft
            .min(self.cfg.max_context.saturating_sub(start + 2));
        if self.tree.is_some() {
            let interval = self.cfg.interval(self.page);
            let next_aligned = (start / interval + 1) * interval;
            room = room.min(next_aligned - start - 1);
        }
        room
    }

    /// The early exit, decided once per planned step (before any drafting is paid for, and so
    /// that a closed gate plans plain decode steps, which the pipeline overlaps): open while the
    /// record says drafting for the running speculating requests pays, and for one probing step
    /// after [`PROBE_EVERY`] closed ones.
    pub(super) fn update_spec_gate(&mut self) {
        let (Some(cost), Some(record)) = (
            self.cfg.speculation.as_ref().and_then(|c| c.cost.as_ref()),
            self.spec_gate.record,
        ) else {
            return;
        };
        let requests = self.running.iter().filter(|s| s.spec.is_some()).count();
        let gate = &mut self.spec_gate;
        if requests == 0 {
            return;
        }
        if drafting_pays(requests, 0, &record, cost) || gate.skipped >= PROBE_EVERY {
            gate.open = true;
            gate.skipped = 0;
        } else {
            gate.open = false;
            gate.skipped += 1;
        }
    }

    /// Reserve a record block for request `i`'s verify; false when memory is short (it then
    /// decodes one token).
    pub(super) fn reserve_record(&mut self, i: usize) -> bool {
        if self.running[i]
            .spec
            .as_ref()
            .is_some_and(|s| s.record.is_some())
        {
            return true;
        }
        let Some(b) = self.alloc_evicting(BlockKind::State) else {
            return false;
        };
        match self.running[i].spec.as_mut() {
            Some(spec) => {
                spec.record = Some(b);
                true
            }
            None => {
                self.pool.free(b, &mut self.ops);
                false
            }
        }
    }

    /// Propose the drafts of the planned verifies (the sequences' tokens are final now) and
    /// trim them with the planner. One entry per planned sequence: `None` for a plain step.
    pub(super) fn propose_drafts(&mut self, planned: &[PlannedSeq]) -> Vec<Option<Draft>> {
        let mut drafts: Vec<Option<Draft>> = Vec::with_capacity(planned.len());
        let cost = self.cfg.speculation.as_ref().and_then(|c| c.cost.clone());
        let speculating = planned.iter().filter(|p| p.draft_max > 0).count();
        let started = Instant::now();
        let mut other_tokens = 0;
        for p in planned {
            let found = self
                .running
                .iter_mut()
                .find(|s| s.id == p.id && s.epoch == p.epoch);
            let draft = match found {
                Some(s) if p.draft_max > 0 => Some(propose(s, p.draft_max, self.vocab)),
                _ => None,
            };
            if draft.is_none() {
                other_tokens += p.len;
            }
            drafts.push(draft);
        }
        if speculating > 0 {
            let per_request = started.elapsed().as_secs_f64() / speculating as f64;
            self.spec_gate.observe_drafting(per_request);
        }
        if let Some(cost) = cost.as_ref() {
            let idx: Vec<usize> = (0..drafts.len()).filter(|&k| drafts[k].is_some()).collect();
            let confidences: Vec<Vec<f32>> = idx
                .iter()
                .map(|&k| {
                    drafts[k]
                        .as_ref()
                        .map_or_else(Vec::new, |d| d.confidence.clone())
                })
                .collect();
            let lengths = plan_verify_lengths(&confidences, other_tokens, cost);
            for (&k, len) in idx.iter().zip(lengths) {
                if let Some(d) = drafts[k].as_mut() {
                    truncate(d, len);
                }
            }
        }
        for d in drafts.iter().flatten() {
            let n = d.tokens.len();
            let lengths = &mut self.metrics.spec_verify_lengths;
            if lengths.len() <= n {
                lengths.resize(n + 1, 0);
            }
            lengths[n] += 1;
        }
        drafts
    }

    /// After a verify of `seq` over `start ..` (the committed token and `draft`): accept, queue
    /// the state commit (and a checkpoint if the committed end is aligned), and return the
    /// tokens to emit.
    pub(super) fn accept_verified(
        &mut self,
        seq: &mut Seq,
        start: usize,
        draft: &Draft,
        rows: &[&[f32]],
        taps: &[f32],
        tap_width: usize,
    ) -> Result<Vec<SampledToken>, String> {
        let committed = seq.sampler.verify(rows, draft)?;
        let n = committed.len();
        let (working, record) = match (seq.working, seq.spec.as_ref().and_then(|s| s.record)) {
            (Some(w), Some(r)) => (w, r),
            _ => return Err("internal: a verified request holds no state or record".into()),
        };
        self.ops.push(ArenaOp::CommitVerified(VerifiedBlock {
            state_block: self.pool.offset(working),
            record_block: self.pool.offset(record),
            tokens: rows.len(),
            accepted: n,
        }));
        seq.fed = start + n;
        if let Some(spec) = seq.spec.as_mut() {
            spec.observe(start, &taps[..(n * tap_width).min(taps.len())], tap_width);
        }
        let accepted = n - 1;
        self.spec_gate.observe_round(n, draft.tokens.len());
        let m = &mut self.metrics;
        m.spec_verify_rounds += 1;
        m.spec_draft_tokens += draft.tokens.len() as u64;
        m.spec_accepted_tokens += accepted as u64;
        if m.spec_accepted_by_position.len() < draft.tokens.len() {
            m.spec_accepted_by_position.resize(draft.tokens.len(), 0);
        }
        for slot in &mut m.spec_accepted_by_position[..accepted] {
            *slot += 1;
        }
        let end = start + n;
        if n > 1 && self.tree.is_some() && end.is_multiple_of(self.cfg.interval(self.page)) {
            // A fully accepted draft reached the checkpoint boundary it was cut at: snapshot
            // the committed state there, as a plain decode step would have in its pass.
            let spare = match seq.spares.pop() {
                Some(b) => Some(b),
                None => self.alloc_evicting(BlockKind::State),
            };
            if let Some(slot) = spare {
                self.ops.push(ArenaOp::Copy {
                    src: self.pool.offset(working),
                    dst: self.pool.offset(slot),
                    len: self.layout.state_block_bytes,
                });
                if let Some((_, old)) = seq.snapshot.replace((end, slot)) {
                    seq.spares.push(old);
                }
            }
        }
        Ok(committed)
    }
}

/// Request `s`'s draft of at most `max` tokens, after catching its source up on the committed
/// tokens. A source's malformed tail (tokens outside the vocabulary, missing distributions) is
/// cut off rather than allowed to fail the step.
fn propose(s: &mut Seq, max: usize, vocab: usize) -> Draft {
    let mode = s.sampler.speculation();
    let Some(spec) = s.spec.as_mut() else {
        return Draft::default();
    };
    if spec.extended < s.tokens.len() {
        spec.source.extend(&s.tokens[spec.extended..]);
        spec.extended = s.tokens.len();
    }
    let mut draft = match mode {
        Some(SpecMode::Greedy) => spec.source.propose(max, &mut DraftSampling::Greedy),
        Some(SpecMode::Sampled { temperature }) => spec.source.propose(
            max,
            &mut DraftSampling::Sample {
                temperature,
                rng: &mut spec.rng,
            },
        ),
        None => Draft::default(),
    };
    let mut valid = draft
        .tokens
        .iter()
        .take_while(|&&t| (t as usize) < vocab)
        .count()
        .min(max)
        .min(draft.confidence.len());
    if let Some(p) = &draft.probs {
        valid = valid.min(p.iter().take_while(|q| q.len() == vocab).count());
    }
    truncate(&mut draft, valid);
    draft
}

fn truncate(d: &mut Draft, len: usize) {
    d.tokens.truncate(len);
    d.confidence.truncate(len);
    if let Some(p) = d.probs.as_mut() {
        p.truncate(len);
    }
}
