//! [`ModelExecutor`]: a [`Model`] plus its cache arena, implementing the engine's [`Executor`];
//! and [`Session`], a single-sequence convenience built on the same path (CLI, tests).

use crate::backend::Backend;
use crate::error::ExecError;
use crate::exec::{
    CacheLayout, Executor, ForwardBatch, ForwardOutput, LogitsWant, MediaInput, SeqInput,
    VerifiedBlock,
};
use crate::expected::{ExpectedStep, pages_used};
use crate::model::{CacheOffsets, Model, SeqCache, SeqPass};

/// A model bound to its backend and one arena.
pub struct ModelExecutor<B: Backend> {
    model: Model<B>,
    arena: B::Arena,
    offsets: CacheOffsets,
    layout: CacheLayout,
    /// Hidden-state taps returned to sequences that want them.
    tap_layers: Vec<usize>,
    /// The decode step whose host work the backend did while the last step ran.
    expected: Option<ExpectedStep>,
}

impl<B: Backend> ModelExecutor<B> {
    /// `page_tokens` tokens per KV page; `arena_bytes` total (rounded down to a multiple of 4).
    pub fn new(model: Model<B>, page_tokens: usize, arena_bytes: usize) -> Result<Self, ExecError> {
        if page_tokens == 0 {
            return Err(ExecError::InvalidBatch("page_tokens must be > 0".into()));
        }
        let offsets = CacheOffsets::new(&model.config, page_tokens);
        let arena_bytes = arena_bytes / 4 * 4;
        let arena = model.backend.arena(arena_bytes)?;
        let layout = CacheLayout {
            page_tokens,
            kv_page_bytes: offsets.kv_page_bytes,
            state_block_bytes: offsets.state_block_bytes,
            arena_bytes,
            verify_tokens_max: if model.backend.supports_kda_verify() {
                let limit = model.backend.max_verify_tokens().unwrap_or(usize::MAX);
                offsets.verify_tokens_max.min(limit)
            } else {
                0
            },
        };
        Ok(Self {
            model,
            arena,
            offsets,
            layout,
            tap_layers: Vec::new(),
            expected: None,
        })
    }

    /// An arena big enough for `seqs` sequences of up to `max_tokens` each, plus `extra_blocks`
    /// spare state blocks (checkpoints).
    pub fn with_capacity(
        model: Model<B>,
        page_tokens: usize,
        seqs: usize,
        max_tokens: usize,
        extra_blocks: usize,
    ) -> Result<Self, ExecError> {
        let offs = CacheOffsets::new(&model.config, page_tokens.max(1));
        let pages = max_tokens.div_ceil(page_tokens.max(1));
        let bytes = seqs * (offs.state_block_bytes + pages * offs.kv_page_bytes)
            + extra_blocks * offs.state_block_bytes;
        Self::new(model, page_tokens, bytes)
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), ExecError> {
        let arena = self.layout.arena_bytes;
        if offset.checked_add(len).is_none_or(|end| end > arena) {
            return Err(ExecError::OutOfBounds { offset, len, arena });
        }
        Ok(())
    }

    fn check_aligned(&self, what: &str, offset: usize) -> Result<(), ExecError> {
        if !offset.is_multiple_of(4) {
            return Err(ExecError::InvalidBatch(format!(
                "{what} offset {offset} is not 4-byte aligned"
            )));
        }
        Ok(())
    }

    fn validate(&self, s: &SeqInput<'_>) -> Result<(), ExecError> {
        let n = s.tokens.len();
        if n == 0 {
            return Err(ExecError::InvalidBatch("a sequence has no tokens".into()));
        }
        let need_pages = (s.start_pos + n).div_ceil(self.layout.page_tokens);
        if self.offsets.kv_page_bytes > 0 && s.kv_pages.len() < need_pages {
            return Err(ExecError::InvalidBatch(format!(
                "{} KV pages given, {need_pages} needed for {} positions",
                s.kv_pages.len(),
                s.start_pos + n
            )));
        }
        for &p in s.kv_pages.iter().take(need_pages) {
            self.check_aligned("KV page", p)?;
            self.check_range(p, self.layout.kv_page_bytes)?;
        }
        self.check_aligned("state block", s.state_block)?;
        self.check_range(s.state_block, self.layout.state_block_bytes)?;
        for &(cp, dst) in s.checkpoints {
            if cp == 0 || cp > n {
                return Err(ExecError::InvalidBatch(format!(
                    "checkpoint at {cp} is outside 1..={n}"
                )));
            }
            self.check_aligned("checkpoint", dst)?;
            self.check_range(dst, self.layout.state_block_bytes)?;
        }
        Ok(())
    }

    /// A verify pass's record block and size (see [`ForwardBatch::verify_records`]).
    fn validate_verify(&self, s: &SeqInput<'_>, record: usize) -> Result<(), ExecError> {
        let max = self.layout.verify_tokens_max;
        if s.tokens.len() > max {
            return Err(ExecError::InvalidBatch(format!(
                "a verify pass of {} tokens (this executor verifies at most {max})",
                s.tokens.len()
            )));
        }
        if !s.checkpoints.is_empty() {
            return Err(ExecError::InvalidBatch(
                "a verify pass writes no state, so it takes no checkpoints".into(),
            ));
        }
        self.check_aligned("record block", record)?;
        self.check_range(record, self.layout.state_block_bytes)?;
        let (a, b, n) = (s.state_block, record, self.layout.state_block_bytes);
        if a < b + n && b < a + n {
            return Err(ExecError::InvalidBatch(
                "a record block overlaps its state block".into(),
            ));
        }
        Ok(())
    }

    /// One sequence's forward, also returning the per-layer partial sums `p` (golden tests).
    pub fn forward_traced(
        &mut self,
        s: &SeqInput<'_>,
    ) -> Result<(ForwardOutput, Vec<Vec<f32>>), ExecError> {
        self.validate(s)?;
        let mut trace = Vec::new();
        let out = self.run_one(s, Some(&mut trace))?;
        let vocab = self.model.config.vocab_size;
        let rows = out.len() / vocab;
        let mut output = ForwardOutput {
            vocab,
            logits: out,
            row_ranges: std::iter::once(0..rows).collect(),
            ..Default::default()
        };
        output.select_candidates(&[s.logits]);
        Ok((output, trace))
    }

    fn run_one(
        &mut self,
        s: &SeqInput<'_>,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>, ExecError> {
        let ids: Vec<u32> = s.tokens.to_vec();
        let cache = SeqCache {
            start_pos: s.start_pos,
            kv_pages: s.kv_pages,
            page_tokens: self.layout.page_tokens,
            state_block: s.state_block,
            checkpoints: s.checkpoints,
            record_block: None,
        };
        let from = logits_from(s);
        let logits =
            self.model
                .forward_seq(&mut self.arena, &self.offsets, &ids, &cache, from, trace)?;
        match logits {
            Some(l) => Ok(self.model.backend.to_host(&l)?),
            None => Ok(Vec::new()),
        }
    }
}

impl<B: Backend> Executor for ModelExecutor<B> {
    fn layout(&self) -> CacheLayout {
        self.layout
    }

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn arena_copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), ExecError> {
        self.check_range(src, len)?;
        self.check_range(dst, len)?;
        if src < dst + len && dst < src + len && len > 0 && src != dst {
            return Err(ExecError::InvalidBatch(format!(
                "arena_copy regions overlap: {src} -> {dst} ({len} bytes)"
            )));
        }
        self.model
            .backend
            .arena_copy(&mut self.arena, src, dst, len)?;
        Ok(())
    }

    fn arena_zero(&mut self, offset: usize, len: usize) -> Result<(), ExecError> {
        self.check_range(offset, len)?;
        self.model
            .backend
            .arena_zero(&mut self.arena, offset, len)?;
        Ok(())
    }

    fn arena_read(&self, offset: usize, len: usize) -> Result<Vec<u8>, ExecError> {
        self.check_range(offset, len)?;
        Ok(self.model.backend.arena_read(&self.arena, offset, len)?)
    }

    /// All sequences in one pass ([`Model::forward_batch`]): dense ops over the stacked rows,
    /// KDA/MLA cores with each sequence's cache. A backend whose ops are row-invariant (the CPU:
    /// packed GEMM, per-row norms, experts grouped per sequence) gives each sequence the same
    /// results as alone.
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<ForwardOutput, ExecError> {
        let record = |i: usize| batch.verify_records.get(i).copied().flatten();
        let wants_taps = |i: usize| batch.want_taps.get(i).copied().unwrap_or(false);
        for (i, s) in batch.seqs.iter().enumerate() {
            self.validate(s)?;
            if let Some(r) = record(i) {
                self.validate_verify(s, r)?;
            }
        }
        let any_taps = (0..batch.seqs.len()).any(wants_taps);
        if any_taps && self.tap_layers.is_empty() {
            return Err(ExecError::InvalidBatch(
                "hidden-state taps asked for, none configured".into(),
            ));
        }
        let vocab = self.model.config.vocab_size;
        let page_tokens = self.layout.page_tokens;
        let passes: Vec<SeqPass<'_>> = batch
            .seqs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let media = batch.media.get(i).copied().unwrap_or(&[]);
                seq_pass(s, page_tokens, record(i), media)
            })
            .collect();
        let expected = self.expected.take();
        let mut out = ForwardOutput {
            vocab,
            logits: Vec::new(),
            row_ranges: Vec::with_capacity(batch.seqs.len()),
            top: vec![Vec::new(); batch.seqs.len()],
            ..Default::default()
        };
        if batch.seqs.is_empty() {
            return Ok(out);
        }
        // Plain decode steps (one token per sequence) may be replayed as a CUDA graph; not a
        // step with image rows (the tower runs, and the rows come from it, not the ids).
        let image_rows = passes.iter().any(|p| {
            let step = p.cache.start_pos..p.cache.start_pos + p.ids.len();
            p.media
                .iter()
                .any(|m| m.position < step.end && step.start < m.span().end)
        });
        let replayable = batch.seqs.iter().all(|s| s.tokens.len() == 1)
            && batch.verify_records.iter().all(Option::is_none)
            && !any_taps
            && !image_rows;
        let tap_layers: &[usize] = if any_taps { &self.tap_layers } else { &[] };
        let (model, arena, offsets) = (&self.model, &mut self.arena, &self.offsets);
        let mut tap_acts = Vec::new();
        let prepared = match &expected {
            Some(e) if replayable && e.matches(batch) => {
                let ids: Vec<u32> = batch.seqs.iter().map(|s| s.tokens[0]).collect();
                model.backend.launch_prepared(&ids)?
            }
            _ => None,
        };
        let logits = match prepared {
            Some(logits) => logits,
            None => model.backend.run_step(replayable, &mut || {
                let (logits, taps) =
                    model.forward_batch_tapped(arena, offsets, &passes, None, tap_layers)?;
                tap_acts = taps;
                Ok(logits)
            })?,
        };
        // While the device runs this step, the host work of the one expected next.
        let paged = offsets.kv_page_bytes > 0;
        if replayable && let Some(next) = ExpectedStep::after(batch, page_tokens, paged) {
            let inputs = next.inputs();
            let passes: Vec<SeqPass<'_>> = inputs
                .iter()
                .map(|s| seq_pass(s, page_tokens, None, &[]))
                .collect();
            let kept = model.backend.prepare_step(&mut || {
                Ok(model
                    .forward_batch_tapped(arena, offsets, &passes, None, &[])?
                    .0)
            });
            drop(passes);
            if kept {
                self.expected = Some(next);
            }
        }
        if any_taps {
            self.collect_taps(batch, &tap_acts, &mut out)?;
        }
        // Only candidates wanted (decode steps of greedy / top-k requests): select them where
        // the logits are, so whole vocabulary rows never cross to the host.
        let top_k = batch.seqs.iter().try_fold(0, |m, s| match s.logits {
            LogitsWant::LastTopK(k) => Some(m.max(k)),
            LogitsWant::None => Some(m),
            LogitsWant::Last | LogitsWant::All => None,
        });
        let backend = &self.model.backend;
        // Constrained sequences' masks, waited for only now: they were computed while the
        // forward pass ran.
        let masks = batch.wait_masks()?;
        let (host, tops) = match (logits, top_k) {
            (Some(l), Some(k)) if masks.iter().any(Option::is_some) => {
                let rows: Vec<Option<&[u32]>> = batch
                    .seqs
                    .iter()
                    .zip(&masks)
                    .filter(|(s, _)| matches!(s.logits, LogitsWant::LastTopK(_)))
                    .map(|(_, m)| m.as_deref())
                    .collect();
                (Vec::new(), backend.top_k_rows_masked(&l, k, &rows)?)
            }
            (Some(l), Some(k)) => (Vec::new(), backend.top_k_rows(&l, k)?),
            (Some(l), None) => (backend.to_host(&l)?, Vec::new()),
            (None, _) => (Vec::new(), Vec::new()),
        };
        if top_k.is_some() {
            // Selected by the backend: one candidate list per wanted (last) row, in batch order.
            let mut tops = tops.into_iter();
            for (i, s) in batch.seqs.iter().enumerate() {
                out.row_ranges.push(0..0);
                if let LogitsWant::LastTopK(k) = s.logits {
                    let mut t = tops.next().ok_or_else(|| {
                        ExecError::Backend("top-k selection returned too few rows".into())
                    })?;
                    t.truncate(k);
                    out.top[i] = t;
                }
            }
            return Ok(out);
        }
        let mut row = 0;
        for (s, p) in batch.seqs.iter().zip(&passes) {
            let rows = p.logits_from.map_or(0, |f| s.tokens.len() - f);
            out.row_ranges.push(row..row + rows);
            row += rows;
        }
        debug_assert_eq!(row * vocab, host.len());
        out.logits = host;
        // A mixed step downloaded every row: candidates, if any, are selected on the host.
        let wants: Vec<LogitsWant> = batch.seqs.iter().map(|s| s.logits).collect();
        out.apply_masks(&wants, &masks);
        out.select_candidates(&wants);
        Ok(out)
    }

    fn set_hidden_taps(&mut self, layers: &[usize]) -> Result<(), ExecError> {
        let nl = self.model.config.num_hidden_layers;
        if let Some(&bad) = layers.iter().find(|&&l| l == 0 || l > nl) {
            return Err(ExecError::InvalidBatch(format!(
                "hidden-state tap {bad} is outside 1..={nl}"
            )));
        }
        self.tap_layers = layers.to_vec();
        Ok(())
    }

    fn graph_counts(&self) -> Option<crate::exec::GraphCounts> {
        self.model.backend.step_graph_counts()
    }

    fn commit_verified(&mut self, blocks: &[VerifiedBlock]) -> Result<(), ExecError> {
        let n = self.layout.state_block_bytes;
        for b in blocks {
            if b.accepted > b.tokens || b.tokens > self.layout.verify_tokens_max {
                return Err(ExecError::InvalidBatch(format!(
                    "commit of {} of {} verified tokens",
                    b.accepted, b.tokens
                )));
            }
            for (what, at) in [("state", b.state_block), ("record", b.record_block)] {
                self.check_aligned(what, at)?;
                self.check_range(at, n)?;
            }
        }
        self.model
            .commit_verified(&mut self.arena, &self.offsets, blocks)
    }
}

impl<B: Backend> ModelExecutor<B> {
    /// The wanted sequences' rows of the tap activations, on the host, into `out`.
    fn collect_taps(
        &self,
        batch: &ForwardBatch<'_>,
        acts: &[B::Act],
        out: &mut ForwardOutput,
    ) -> Result<(), ExecError> {
        let d = self.model.config.hidden_size;
        let host = acts
            .iter()
            .map(|a| self.model.backend.to_host(a))
            .collect::<Result<Vec<_>, _>>()?;
        let width = d * host.len();
        let (mut row, mut kept) = (0, 0);
        out.tap_width = width;
        for (i, s) in batch.seqs.iter().enumerate() {
            let n = s.tokens.len();
            if batch.want_taps.get(i).copied().unwrap_or(false) {
                for r in row..row + n {
                    for h in &host {
                        out.taps.extend_from_slice(&h[r * d..(r + 1) * d]);
                    }
                }
                out.tap_ranges.push(kept..kept + n);
                kept += n;
            } else {
                out.tap_ranges.push(kept..kept);
            }
            row += n;
        }
        Ok(())
    }
}

/// The first new row whose logits `s` wants.
/// How the model's forward pass sees sequence `s` of a step.
fn seq_pass<'a>(
    s: &SeqInput<'a>,
    page_tokens: usize,
    record_block: Option<usize>,
    media: &'a [MediaInput],
) -> SeqPass<'a> {
    SeqPass {
        ids: s.tokens,
        cache: SeqCache {
            start_pos: s.start_pos,
            // The engine may hold a page for the next position already; the pass sees the ones
            // its positions use, so the same step always stages the same page tables.
            kv_pages: pages_used(s.kv_pages, s.start_pos + s.tokens.len(), page_tokens),
            page_tokens,
            state_block: s.state_block,
            checkpoints: s.checkpoints,
            record_block,
        },
        logits_from: logits_from(s),
        media,
    }
}

fn logits_from(s: &SeqInput<'_>) -> Option<usize> {
    match s.logits {
        LogitsWant::None => None,
        LogitsWant::Last | LogitsWant::LastTopK(_) => Some(s.tokens.len() - 1),
        LogitsWant::All => Some(0),
    }
}

/// One sequence driven through an [`Executor`] with a private, contiguous arena layout:
/// state block at 0, then KV pages. For the CLI and tests; the engine manages its own arena.
pub struct Session<E: Executor> {
    exec: E,
    pages: Vec<usize>,
    pos: usize,
}

impl<E: Executor> Session<E> {
    /// Uses the executor's whole arena for one sequence (zeroes its state block).
    pub fn new(mut exec: E) -> Result<Self, ExecError> {
        let lay = exec.layout();
        exec.arena_zero(0, lay.state_block_bytes)?;
        let mut pages = Vec::new();
        if lay.kv_page_bytes > 0 {
            let mut off = lay.state_block_bytes.div_ceil(4) * 4;
            while off + lay.kv_page_bytes <= lay.arena_bytes {
                pages.push(off);
                off += lay.kv_page_bytes;
            }
        }
        Ok(Self {
            exec,
            pages,
            pos: 0,
        })
    }

    /// Tokens this session can hold in total.
    pub fn capacity(&self) -> usize {
        if self.exec.layout().kv_page_bytes == 0 {
            usize::MAX
        } else {
            self.pages.len() * self.exec.layout().page_tokens
        }
    }

    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn executor(&mut self) -> &mut E {
        &mut self.exec
    }

    /// Give the executor back.
    pub fn into_inner(self) -> E {
        self.exec
    }

    /// Forget everything (the next `feed` starts at position 0).
    pub fn reset(&mut self) -> Result<(), ExecError> {
        let bytes = self.exec.layout().state_block_bytes;
        self.exec.arena_zero(0, bytes)?;
        self.pos = 0;
        Ok(())
    }

    /// Process `tokens` and return the requested logits rows (row-major, `vocab` wide).
    pub fn feed(&mut self, tokens: &[u32], want: LogitsWant) -> Result<Vec<f32>, ExecError> {
        Ok(self.step(tokens, &[], want)?.logits)
    }

    /// [`Session::feed`] for a sequence with images: `media` are all of the sequence's images
    /// (absolute positions, as [`ForwardBatch::media`] has them); the rows of `tokens` inside
    /// an image's span take the vision tower's output.
    pub fn feed_media(
        &mut self,
        tokens: &[u32],
        media: &[MediaInput],
        want: LogitsWant,
    ) -> Result<Vec<f32>, ExecError> {
        Ok(self.step(tokens, media, want)?.logits)
    }

    /// Process `tokens` and return the last position's `k` largest logits
    /// ([`LogitsWant::LastTopK`]: selected by the backend, no vocabulary row copied out).
    pub fn feed_top(&mut self, tokens: &[u32], k: usize) -> Result<Vec<(u32, f32)>, ExecError> {
        let mut out = self.step(tokens, &[], LogitsWant::LastTopK(k))?;
        out.top
            .pop()
            .ok_or_else(|| ExecError::Backend("the executor returned no top-k candidates".into()))
    }

    fn step(
        &mut self,
        tokens: &[u32],
        media: &[MediaInput],
        want: LogitsWant,
    ) -> Result<ForwardOutput, ExecError> {
        if self.pos + tokens.len() > self.capacity() {
            return Err(ExecError::InvalidBatch(format!(
                "sequence of {} tokens exceeds the session capacity {}",
                self.pos + tokens.len(),
                self.capacity()
            )));
        }
        let seq = SeqInput {
            tokens,
            start_pos: self.pos,
            kv_pages: &self.pages,
            state_block: 0,
            checkpoints: &[],
            logits: want,
        };
        let out = self.exec.forward(&ForwardBatch {
            seqs: vec![seq],
            media: if media.is_empty() {
                Vec::new()
            } else {
                vec![media]
            },
            ..Default::default()
        })?;
        self.pos += tokens.len();
        Ok(out)
    }

    /// Greedy continuation: `n` new tokens after `prompt` (no stopping): the largest finite
    /// logit, lowest index on ties, selected by the backend ([`Session::feed_top`]).
    pub fn generate_greedy(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>, ExecError> {
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return Ok(out);
        }
        let mut top = self.feed_top(prompt, 1)?;
        loop {
            let next = top.first().map(|&(t, _)| t).ok_or_else(|| {
                ExecError::Backend("no finite logit to continue greedily from".into())
            })?;
            out.push(next);
            if out.len() == n {
                return Ok(out);
            }
            top = self.feed_top(&[next], 1)?;
        }
    }
}

/// Index of the largest value (the first one on ties; NaN never wins).
pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] || xs[best].is_nan() {
            best = i;
        }
    }
    best as u32
}
