//! [`DsparkDrafter`]: one sequence's DSpark drafting state behind [`DraftSource`].

use crate::{ContextCache, DsparkError, DsparkModel};
use k3_model::Backend;
use k3_speculative::{Draft, DraftSampling, DraftSource};
use std::sync::Arc;

/// Follows one sequence: the committed length and last token, and the context (keys and values
/// of the most recent `context_window` processed positions, see [`ContextCache`]). The model is
/// shared; a drafter holds only its sequence's state (`context_window · context_width · 4`
/// bytes once taps arrive: 2 MiB for k3-mini's drafter at 512 positions).
pub struct DsparkDrafter<B: Backend> {
    model: Arc<DsparkModel<B>>,
    len: usize,
    last: Option<u32>,
    context: ContextCache,
    error: Option<DsparkError>,
}

impl<B: Backend> DsparkDrafter<B> {
    pub fn new(model: Arc<DsparkModel<B>>) -> Self {
        let context = model.new_context(model.config().context_window);
        DsparkDrafter {
            model,
            len: 0,
            last: None,
            context,
            error: None,
        }
    }

    pub fn model(&self) -> &Arc<DsparkModel<B>> {
        &self.model
    }

    pub fn context(&self) -> &ContextCache {
        &self.context
    }

    /// Committed tokens so far.
    pub fn committed_len(&self) -> usize {
        self.len
    }

    /// The last failure (a backend op, or taps of the wrong width). [`DraftSource`] methods
    /// cannot return errors: a failed `observe_taps` leaves those positions out of the context,
    /// a failed `propose` proposes nothing, and the error waits here (it is also logged).
    pub fn take_error(&mut self) -> Option<DsparkError> {
        self.error.take()
    }

    fn fail(&mut self, e: DsparkError) {
        tracing::warn!(error = %e, "DSpark drafter");
        self.error = Some(e);
    }
}

impl<B: Backend> DraftSource for DsparkDrafter<B> {
    fn tap_width(&self) -> usize {
        self.model.tap_width()
    }

    fn extend(&mut self, tokens: &[u32]) {
        if let Some(&t) = tokens.last() {
            self.last = Some(t);
            self.len += tokens.len();
        }
    }

    fn observe_taps(&mut self, first_pos: usize, taps: &[f32]) {
        let tw = self.model.tap_width();
        if !taps.len().is_multiple_of(tw) {
            self.fail(DsparkError::Input(format!(
                "{} tap values at position {first_pos}: not rows of {tw}",
                taps.len()
            )));
            return;
        }
        let rows = taps.len() / tw;
        // Positions that were observed before are replaced; rows that could not stay in the
        // window are not worth projecting.
        self.context.truncate_from(first_pos);
        let skip = rows.saturating_sub(self.context.capacity());
        if rows == skip {
            return;
        }
        let first = first_pos + skip;
        match self
            .model
            .context_rows_from_taps(first, &taps[skip * tw..], rows - skip)
        {
            Ok(kv) => self.context.insert(first, &kv),
            Err(e) => self.fail(e),
        }
    }

    /// Drafts from the last committed token at position `len − 1` over the observed positions
    /// before it. With no observed position at all it still drafts: the block then attends to
    /// itself only, and its confidences tell the planner how little that is worth.
    fn propose(&mut self, max: usize, sampling: &mut DraftSampling<'_>) -> Draft {
        let Some(anchor) = self.last else {
            return Draft::default();
        };
        let anchor_pos = self.len - 1;
        let ctx = self.context.view_before(anchor_pos);
        let result = self
            .model
            .draft_with_context(&ctx, anchor, anchor_pos, max, sampling);
        match result {
            Ok(d) => d,
            Err(e) => {
                self.fail(e);
                Draft::default()
            }
        }
    }
}
