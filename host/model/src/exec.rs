//! The seam between the serving engine and a model running on some backend.
//!
//! The engine owns *where* things live (byte offsets in one arena: KDA state blocks and MLA KV
//! pages); the model owns *what* they contain (layouts). Every operation here is ordered on the
//! backend's stream: a copy issued before a forward is visible to it, and vice versa.

pub use crate::backend::GraphCounts;
pub use crate::error::ExecError;
use crate::select::{apply_token_mask, top_k_of_row};

/// Sizes the engine needs to manage the arena; fixed for the executor's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    /// Tokens per MLA KV page.
    pub page_tokens: usize,
    /// Bytes of one KV page (all MLA layers' latent rows for `page_tokens` tokens).
    pub kv_page_bytes: usize,
    /// Bytes of one KDA state block (all KDA layers' conv windows + recurrent states).
    pub state_block_bytes: usize,
    /// Total arena size in bytes.
    pub arena_bytes: usize,
    /// The most tokens one speculative verify may process for a sequence: what one state
    /// block holds of its ReplaySSM record (a record block is a state block from the pool).
    /// 0 when the executor cannot verify.
    pub verify_tokens_max: usize,
}

impl CacheLayout {
    /// The arena split evenly for `n` sequences of up to `tokens` tokens each, without the
    /// engine's pool (benchmarks, device tests): `n` state blocks (4-byte aligned) from offset 0,
    /// then each sequence's KV pages in turn. Returns (state block stride, each sequence's
    /// pages), or None if the arena is too small.
    pub fn split_evenly(&self, n: usize, tokens: usize) -> Option<(usize, Vec<Vec<usize>>)> {
        let block = self.state_block_bytes.div_ceil(4) * 4;
        let per_seq = tokens.div_ceil(self.page_tokens.max(1));
        let need = n * (block + per_seq * self.kv_page_bytes);
        (need <= self.arena_bytes).then(|| {
            let pages = (0..n)
                .map(|i| {
                    (0..per_seq)
                        .map(|j| n * block + (i * per_seq + j) * self.kv_page_bytes)
                        .collect()
                })
                .collect();
            (block, pages)
        })
    }
}

/// Commit an accepted prefix of one sequence's verify pass (see [`Executor::commit_verified`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifiedBlock {
    /// The sequence's working state block (byte offset), unchanged since the verify.
    pub state_block: usize,
    /// The record block the verify wrote.
    pub record_block: usize,
    /// Tokens the verify processed.
    pub tokens: usize,
    /// How many of them to commit (0..=tokens).
    pub accepted: usize,
}

/// Which logits a sequence wants back from a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWant {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// The last new position only (normal prefill end / decode).
    Last,
    /// Every new position (echo / prompt logprobs / speculative verify).
    All,
    /// The last new position's `k` largest finite logits only, in [`ForwardOutput::top`]: what a
    /// greedy or top-k sampler needs. A device backend selects them on the device, so a decode
    /// step moves k pairs per sequence to the host instead of a whole vocabulary row.
    LastTopK(usize),
}

/// One sequence's share of a step.
#[derive(Debug, Clone)]
pub struct SeqInput<'a> {
    /// Token ids to process now (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in its KV pages and state (the position of `tokens[0]`).
    pub start_pos: usize,
    /// Byte offsets of the KV pages covering positions `0 .. start_pos + tokens.len()`, in order.
    pub kv_pages: &'a [usize],
    /// Byte offset of the working KDA state block (read as the state after `start_pos` tokens,
    /// overwritten with the state after the last new token). Must be zeroed for `start_pos == 0`.
    pub state_block: usize,
    /// In-pass checkpoints: `(n, dst)` = after the first `n` of `tokens` (1..=len), write the full
    /// state block to byte offset `dst`. Emitted from inside the pass; the prefill is never split.
    pub checkpoints: &'a [(usize, usize)],
    pub logits: LogitsWant,
}

/// A batch of sequences for one forward step (mixed prefill chunks and decode tokens).
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch<'a> {
    pub seqs: Vec<SeqInput<'a>>,
    /// Per sequence (or empty for none): the token mask its [`LogitsWant::LastTopK`] candidates
    /// must respect (constrained decoding). Whole rows are masked by the sampler itself.
    pub masks: Vec<Option<PendingTokenMask>>,
    /// Per sequence (or empty for none): `Some(record_block)` makes its step a speculative
    /// verify. Its KDA state is read, not written; the layers' ReplaySSM records go to the
    /// record block (a state block's bytes) until [`Executor::commit_verified`]. MLA rows are
    /// written for every token; those past the committed length are overwritten later.
    pub verify_records: Vec<Option<usize>>,
    /// Per sequence (or empty for none): whether it wants the hidden-state taps of its new
    /// rows in [`ForwardOutput::taps`] (see [`Executor::set_hidden_taps`]).
    pub want_taps: Vec<bool>,
    /// Per sequence (or empty for none): the images of the whole sequence, positions absolute.
    /// The rows of this step's tokens that fall in an image's span take the vision tower's
    /// output instead of their token embeddings (see [`MediaInput`]).
    pub media: Vec<&'a [MediaInput]>,
}

/// One image of a sequence: its `tokens` rows from `position` on (the `<|media_pad|>` tokens the
/// prompt holds for it) take the vision tower's output rows for `image`, in order (docs/vision.md).
#[derive(Debug, Clone)]
pub struct MediaInput {
    /// Sequence position of the image's first token.
    pub position: usize,
    /// Image tokens (rows) the image occupies: the tower's output rows for it.
    pub tokens: usize,
    pub image: std::sync::Arc<ImagePixels>,
}

impl MediaInput {
    /// The positions this image occupies.
    pub fn span(&self) -> std::ops::Range<usize> {
        self.position..self.position + self.tokens
    }
}

/// An image as the media stage prepared it: resized so each side is a multiple of the tower's
/// patch × merge size, normalised to [-1, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct ImagePixels {
    pub height: usize,
    pub width: usize,
    /// Channel-major values: `pixels[(c * height + y) * width + x]`, c = R, G, B.
    pub pixels: Vec<f32>,
    /// A cryptographic hash of `pixels` (and the size): the key of the image's tower output,
    /// and what the prefix cache keys the image's span by.
    pub content_hash: [u8; 32],
}

/// A token bitmask (see [`token_mask_allows`](crate::select::token_mask_allows)) that another thread may still be computing: a
/// constrained request's mask for this step is computed while the forward pass runs, and the
/// executor waits for it only when it selects the candidates.
#[derive(Clone)]
pub struct PendingTokenMask(
    std::sync::Arc<dyn Fn() -> Result<std::sync::Arc<[u32]>, String> + Send + Sync>,
);

impl PendingTokenMask {
    /// `wait` blocks until the mask is ready (or has failed).
    pub fn new(
        wait: impl Fn() -> Result<std::sync::Arc<[u32]>, String> + Send + Sync + 'static,
    ) -> Self {
        Self(std::sync::Arc::new(wait))
    }

    /// The mask, once computed.
    pub fn wait(&self) -> Result<std::sync::Arc<[u32]>, String> {
        (self.0)()
    }
}

impl std::fmt::Debug for PendingTokenMask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingTokenMask")
    }
}

/// Logits rows, in batch order: for each sequence, 0, 1 or `tokens.len()` rows per its `LogitsWant`.
#[derive(Debug, Clone, Default)]
pub struct ForwardOutput {
    pub vocab: usize,
    /// `rows.len() == Σ rows per sequence`, each row `vocab` long, row-major.
    pub logits: Vec<f32>,
    /// Row range per sequence into `logits` (in rows); empty for [`LogitsWant::LastTopK`].
    pub row_ranges: Vec<std::ops::Range<usize>>,
    /// Per sequence: for [`LogitsWant::LastTopK`], its candidates as [`top_k_of_row`] orders them;
    /// empty otherwise.
    pub top: Vec<Vec<(u32, f32)>>,
    /// Hidden-state taps of the sequences that wanted them: per new row, the taps in
    /// [`Executor::set_hidden_taps`] order, `tap_width` floats, row-major.
    pub taps: Vec<f32>,
    pub tap_width: usize,
    /// Per sequence: its rows of `taps` (empty when it did not want them).
    pub tap_ranges: Vec<std::ops::Range<usize>>,
}

impl ForwardBatch<'_> {
    /// Each sequence's token mask (`None` without one), waiting for those still being computed.
    pub fn wait_masks(&self) -> Result<Vec<Option<std::sync::Arc<[u32]>>>, ExecError> {
        (0..self.seqs.len())
            .map(|i| match self.masks.get(i) {
                Some(Some(m)) => m
                    .wait()
                    .map(Some)
                    .map_err(|e| ExecError::Backend(format!("token mask: {e}"))),
                _ => Ok(None),
            })
            .collect()
    }
}

impl ForwardOutput {
    /// Apply each [`LogitsWant::LastTopK`] sequence's mask (`masks` from
    /// [`ForwardBatch::wait_masks`]) to its last row: the host path, before
    /// [`ForwardOutput::select_candidates`].
    pub fn apply_masks(&mut self, wants: &[LogitsWant], masks: &[Option<std::sync::Arc<[u32]>>]) {
        let vocab = self.vocab;
        for ((want, range), mask) in wants.iter().zip(&self.row_ranges).zip(masks) {
            if let (LogitsWant::LastTopK(_), Some(m)) = (want, mask)
                && !range.is_empty()
            {
                let r = range.end - 1;
                if let Some(row) = self.logits.get_mut(r * vocab..(r + 1) * vocab) {
                    apply_token_mask(row, m);
                }
            }
        }
    }

    /// The logits row `r` (absolute row index).
    pub fn row(&self, r: usize) -> &[f32] {
        &self.logits[r * self.vocab..(r + 1) * self.vocab]
    }

    /// For an output computed with whole rows for every sequence, `wants[i]` the form sequence i
    /// asked for: each [`LogitsWant::LastTopK`] sequence's last row becomes its candidates in
    /// [`ForwardOutput::top`] (and leaves `logits`); the other rows stay, in order. The host
    /// path of every executor that cannot select where its logits are.
    pub fn select_candidates(&mut self, wants: &[LogitsWant]) {
        self.top.resize(wants.len(), Vec::new());
        if !wants.iter().any(|w| matches!(w, LogitsWant::LastTopK(_))) {
            return;
        }
        let vocab = self.vocab;
        let (mut kept, mut ranges) = (Vec::new(), Vec::with_capacity(wants.len()));
        for (i, want) in wants.iter().enumerate() {
            let range = self.row_ranges.get(i).cloned().unwrap_or_default();
            let start = kept.len() / vocab.max(1);
            if let LogitsWant::LastTopK(k) = *want {
                if !range.is_empty() {
                    self.top[i] = top_k_of_row(self.row(range.end - 1), k);
                }
                ranges.push(start..start);
            } else {
                kept.extend_from_slice(&self.logits[range.start * vocab..range.end * vocab]);
                ranges.push(start..start + range.len());
            }
        }
        self.logits = kept;
        self.row_ranges = ranges;
    }
}

/// A model bound to a backend and an arena: what the engine drives.
pub trait Executor: Send {
    fn layout(&self) -> CacheLayout;
    fn vocab_size(&self) -> usize;
    /// Copy `len` bytes inside the arena (regions may not overlap).
    fn arena_copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), ExecError>;
    /// Zero `len` bytes of the arena.
    fn arena_zero(&mut self, offset: usize, len: usize) -> Result<(), ExecError>;
    /// Read bytes back (tests, debugging, property checks).
    fn arena_read(&self, offset: usize, len: usize) -> Result<Vec<u8>, ExecError>;
    /// Run one step.
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<ForwardOutput, ExecError>;
    /// Which hidden states [`ForwardBatch::want_taps`] returns (layer indices; see
    /// `Model::forward_batch_tapped`). Executors without taps refuse.
    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), ExecError> {
        let _ = layers;
        Err(ExecError::Backend(
            "this executor returns no hidden states".into(),
        ))
    }
    /// The backend's recorded-step counts and host times ([`GraphCounts`]), if it keeps them.
    fn graph_counts(&self) -> Option<GraphCounts> {
        None
    }
    /// Commit accepted prefixes of verify passes (ReplaySSM, see [`VerifiedBlock`]).
    fn commit_verified(&mut self, blocks: &[VerifiedBlock]) -> Result<(), ExecError> {
        let _ = blocks;
        Err(ExecError::Backend(
            "this executor cannot verify speculative tokens".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::CacheLayout;

    #[test]
    fn split_evenly_tiles_the_arena_without_overlap() {
        let lay = CacheLayout {
            page_tokens: 16,
            kv_page_bytes: 100,
            state_block_bytes: 38,
            arena_bytes: 3 * (40 + 2 * 100),
            verify_tokens_max: 0,
        };
        let (block, pages) = lay.split_evenly(3, 17).expect("fits exactly");
        assert_eq!(block, 40, "state blocks 4-byte aligned");
        assert_eq!(pages, [vec![120, 220], vec![320, 420], vec![520, 620]]);
        assert!(
            lay.split_evenly(3, 33).is_none(),
            "a third page each does not fit"
        );
        assert!(
            lay.split_evenly(4, 17).is_none(),
            "a fourth sequence does not fit"
        );
    }
}
