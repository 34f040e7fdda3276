//! A deterministic toy [`Executor`] whose memory behaves like the real model's: KV rows and state
//! blocks are real bytes in an arena, the recurrent state is a hash-like recurrence over every
//! byte of the state block, and each token attends to (hashes) every earlier KV row. A wrong
//! restore, a wrong page, a lost compaction move or a stale checkpoint changes the outputs.
//!
//! Used by the engine's tests and the benchmark (`examples/engine_bench.rs`); the same harnesses
//! take any `Box<dyn Executor>`, so the real model can be swapped in.

use k3_model::{
    CacheLayout, ExecError, Executor, ForwardBatch, ForwardOutput, LogitsWant, MediaInput,
    SeqInput, VerifiedBlock,
};

/// Shape of the toy model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToyConfig {
    pub vocab: usize,
    pub page_tokens: usize,
    /// Bytes of one token's KV row (multiple of 8).
    pub row_bytes: usize,
    /// Bytes of the state block (multiple of 8, ≥ 32): conv window + recurrent state + payload.
    pub state_bytes: usize,
    pub arena_bytes: usize,
}

impl Default for ToyConfig {
    fn default() -> Self {
        Self {
            vocab: 97,
            page_tokens: 4,
            row_bytes: 16,
            state_bytes: 64,
            arena_bytes: 1 << 16,
        }
    }
}

pub struct ToyExecutor {
    cfg: ToyConfig,
    arena: Vec<u8>,
}

const HEADER_WORDS: usize = 4; // h, conv0, conv1, conv2

fn mix(mut x: u64) -> u64 {
    // splitmix64 finalizer
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl ToyExecutor {
    pub fn new(cfg: ToyConfig) -> Result<Self, ExecError> {
        if cfg.row_bytes == 0
            || !cfg.row_bytes.is_multiple_of(8)
            || cfg.state_bytes < 32
            || !cfg.state_bytes.is_multiple_of(8)
        {
            return Err(ExecError::Backend(format!("bad toy config {cfg:?}")));
        }
        if cfg.vocab == 0 || cfg.page_tokens == 0 {
            return Err(ExecError::Backend(
                "vocab and page_tokens must be positive".into(),
            ));
        }
        Ok(Self {
            cfg,
            arena: vec![0; cfg.arena_bytes],
        })
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), ExecError> {
        if offset.checked_add(len).is_none_or(|e| e > self.arena.len()) {
            return Err(ExecError::OutOfBounds {
                offset,
                len,
                arena: self.arena.len(),
            });
        }
        Ok(())
    }

    fn word(&self, off: usize) -> u64 {
        u64::from_le_bytes(self.arena[off..off + 8].try_into().expect("8 bytes"))
    }

    fn set_word(&mut self, off: usize, v: u64) {
        self.arena[off..off + 8].copy_from_slice(&v.to_le_bytes());
    }

    fn row_offset(&self, s: &SeqInput<'_>, pos: usize) -> usize {
        s.kv_pages[pos / self.cfg.page_tokens] + (pos % self.cfg.page_tokens) * self.cfg.row_bytes
    }

    fn validate(&self, s: &SeqInput<'_>) -> Result<(), ExecError> {
        let c = &self.cfg;
        let end = s.start_pos + s.tokens.len();
        if s.tokens.is_empty() {
            return Err(ExecError::InvalidBatch("empty sequence".into()));
        }
        if s.kv_pages.len() < end.div_ceil(c.page_tokens) {
            return Err(ExecError::InvalidBatch(format!(
                "{} pages for {end} tokens",
                s.kv_pages.len()
            )));
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab) {
            return Err(ExecError::InvalidBatch(format!("token {t} outside vocab")));
        }
        for &p in s.kv_pages {
            self.check(p, c.page_tokens * c.row_bytes)?;
        }
        self.check(s.state_block, c.state_bytes)?;
        for &(n, dst) in s.checkpoints {
            if n == 0 || n > s.tokens.len() {
                return Err(ExecError::InvalidBatch(format!(
                    "checkpoint after {n} of {}",
                    s.tokens.len()
                )));
            }
            self.check(dst, c.state_bytes)?;
        }
        Ok(())
    }

    fn logits_row(&self, h: u64, out: &mut Vec<f32>) {
        for v in 0..self.cfg.vocab {
            let x = mix(h ^ (v as u64).wrapping_mul(0xA24B_AED4_963E_E407));
            out.push((x >> 40) as f32 / (1u64 << 24) as f32 * 8.0);
        }
    }

    /// One token's step of the toy recurrence (the state half): returns the token's hidden `h`.
    fn advance(state: &mut [u64], pos: usize, t: u32, acc: u64) -> u64 {
        let payload = state.len() - HEADER_WORDS;
        let p = if payload > 0 {
            state[HEADER_WORDS + pos % payload]
        } else {
            0
        };
        let h = mix(state[0]
            ^ mix(t as u64)
            ^ state[1].rotate_left(7)
            ^ state[2].rotate_left(19)
            ^ state[3].rotate_left(31)
            ^ acc
            ^ p);
        state[0] = h;
        state[1] = state[2];
        state[2] = state[3];
        state[3] = t as u64;
        if payload > 0 {
            let k = HEADER_WORDS + (pos.wrapping_mul(7) + 1) % payload;
            state[k] = mix(state[k] ^ h);
        }
        h
    }

    /// Tokens one verify may hold in a record block: the step count, (token, acc) per step,
    /// then the start position.
    fn verify_tokens_max(&self) -> usize {
        (self.cfg.state_bytes / 8 - 2) / 2
    }

    /// `record`: a speculative verify (state read into a scratch copy only; each step's token
    /// and attention summary go to the record block, which `commit_verified` replays).
    /// `media`: the sequence's images; a position inside one mixes the image's content and the
    /// row's offset into its step, as an image row replaces a token embedding in a real model.
    fn run_seq(
        &mut self,
        s: &SeqInput<'_>,
        record: Option<usize>,
        media: &[MediaInput],
        logits: &mut Vec<f32>,
    ) -> usize {
        let c = self.cfg;
        let words = c.state_bytes / 8;
        let mut state: Vec<u64> = (0..words)
            .map(|w| self.word(s.state_block + 8 * w))
            .collect();
        let mut rows = 0;
        if let Some(rec) = record {
            self.set_word(rec, s.tokens.len() as u64);
            self.set_word(rec + 8 + 16 * s.tokens.len(), s.start_pos as u64);
        }
        for (i, &t) in s.tokens.iter().enumerate() {
            let pos = s.start_pos + i;
            // Attention-like: depends on every earlier KV row, weighted by position.
            let mut acc = 0u64;
            for j in 0..pos {
                let off = self.row_offset(s, j);
                for w in 0..c.row_bytes / 8 {
                    acc = mix(acc ^ self.word(off + 8 * w).wrapping_mul(j as u64 | 1));
                }
            }
            if let Some(m) = media.iter().find(|m| m.span().contains(&pos)) {
                let seed = u64::from_le_bytes(m.image.content_hash[..8].try_into().expect("8"));
                acc = mix(acc ^ seed ^ (pos - m.position) as u64);
            }
            if let Some(rec) = record {
                self.set_word(rec + 8 + 16 * i, t as u64);
                self.set_word(rec + 16 + 16 * i, acc);
            }
            let h = Self::advance(&mut state, pos, t, acc);
            let off = self.row_offset(s, pos);
            for w in 0..c.row_bytes / 8 {
                self.set_word(off + 8 * w, mix(h ^ ((pos as u64) << 20) ^ w as u64));
            }
            for &(n, dst) in s.checkpoints {
                if n == i + 1 {
                    for (w, v) in state.iter().enumerate() {
                        self.set_word(dst + 8 * w, *v);
                    }
                }
            }
            let last = i + 1 == s.tokens.len();
            let last_wanted = matches!(s.logits, LogitsWant::Last | LogitsWant::LastTopK(_));
            if s.logits == LogitsWant::All || (last_wanted && last) {
                self.logits_row(h, logits);
                rows += 1;
            }
        }
        if record.is_none() {
            for (w, v) in state.iter().enumerate() {
                self.set_word(s.state_block + 8 * w, *v);
            }
        }
        rows
    }
}

impl Executor for ToyExecutor {
    fn layout(&self) -> CacheLayout {
        CacheLayout {
            page_tokens: self.cfg.page_tokens,
            kv_page_bytes: self.cfg.page_tokens * self.cfg.row_bytes,
            state_block_bytes: self.cfg.state_bytes,
            arena_bytes: self.cfg.arena_bytes,
            verify_tokens_max: self.verify_tokens_max(),
        }
    }

    fn commit_verified(&mut self, blocks: &[VerifiedBlock]) -> Result<(), ExecError> {
        let words = self.cfg.state_bytes / 8;
        for b in blocks {
            self.check(b.state_block, self.cfg.state_bytes)?;
            self.check(b.record_block, self.cfg.state_bytes)?;
            let steps = self.word(b.record_block) as usize;
            if steps != b.tokens || b.accepted > steps {
                return Err(ExecError::InvalidBatch(format!(
                    "commit of {} of {} tokens, the record holds {steps}",
                    b.accepted, b.tokens
                )));
            }
            let mut state: Vec<u64> = (0..words)
                .map(|w| self.word(b.state_block + 8 * w))
                .collect();
            let start = self.word(b.record_block + 8 + 16 * steps) as usize;
            for i in 0..b.accepted {
                let t = self.word(b.record_block + 8 + 16 * i) as u32;
                let acc = self.word(b.record_block + 16 + 16 * i);
                Self::advance(&mut state, start + i, t, acc);
            }
            for (w, v) in state.iter().enumerate() {
                self.set_word(b.state_block + 8 * w, *v);
            }
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    fn arena_copy(&mut self, src: usize, dst: usize, len: usize) -> Result<(), ExecError> {
        self.check(src, len)?;
        self.check(dst, len)?;
        if src < dst + len && dst < src + len {
            return Err(ExecError::InvalidBatch(format!(
                "overlapping copy {src}->{dst} ({len})"
            )));
        }
        self.arena.copy_within(src..src + len, dst);
        Ok(())
    }

    fn arena_zero(&mut self, offset: usize, len: usize) -> Result<(), ExecError> {
        self.check(offset, len)?;
        self.arena[offset..offset + len].fill(0);
        Ok(())
    }

    fn arena_read(&self, offset: usize, len: usize) -> Result<Vec<u8>, ExecError> {
        self.check(offset, len)?;
        Ok(self.arena[offset..offset + len].to_vec())
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<ForwardOutput, ExecError> {
        for s in &batch.seqs {
            self.validate(s)?;
        }
        let mut logits = Vec::new();
        let mut row_ranges = Vec::with_capacity(batch.seqs.len());
        let mut row = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            if let Some(rec) = batch.verify_records.get(i).copied().flatten() {
                self.check(rec, self.cfg.state_bytes)?;
                if s.tokens.len() > self.verify_tokens_max() || !s.checkpoints.is_empty() {
                    return Err(ExecError::InvalidBatch(
                        "a verify of too many tokens, or with checkpoints".into(),
                    ));
                }
            }
        }
        for (i, s) in batch.seqs.iter().enumerate() {
            let record = batch.verify_records.get(i).copied().flatten();
            let media = batch.media.get(i).copied().unwrap_or(&[]);
            let n = self.run_seq(s, record, media, &mut logits);
            row_ranges.push(row..row + n);
            row += n;
        }
        let mut out = ForwardOutput {
            vocab: self.cfg.vocab,
            logits,
            row_ranges,
            ..Default::default()
        };
        // Candidates instead of rows where asked, as a device backend returns them.
        let wants: Vec<LogitsWant> = batch.seqs.iter().map(|s| s.logits).collect();
        out.apply_masks(&wants, &batch.wait_masks()?);
        out.select_candidates(&wants);
        Ok(out)
    }
}

/// Run one prompt through an executor directly, with no engine: greedy decode of `n` tokens
/// using fresh pages. The reference the engine's outputs must match token for token.
pub fn reference_greedy(
    exec: &mut dyn Executor,
    prompt: &[u32],
    n: usize,
) -> Result<Vec<u32>, ExecError> {
    let l = exec.layout();
    let total = prompt.len() + n;
    let pages: Vec<usize> = (0..total.div_ceil(l.page_tokens))
        .map(|i| l.arena_bytes - (i + 1) * l.kv_page_bytes)
        .collect();
    if pages.len() * l.kv_page_bytes + l.state_block_bytes > l.arena_bytes {
        return Err(ExecError::Backend(
            "reference run does not fit the arena".into(),
        ));
    }
    exec.arena_zero(0, l.state_block_bytes)?;
    let mut tokens = prompt.to_vec();
    let mut out = Vec::new();
    let mut fed = 0;
    while out.len() < n {
        let input = tokens[fed..].to_vec();
        let batch = ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &input,
                start_pos: fed,
                kv_pages: &pages[..(fed + input.len()).div_ceil(l.page_tokens)],
                state_block: 0,
                checkpoints: &[],
                logits: LogitsWant::Last,
            }],
            ..Default::default()
        };
        let o = exec.forward(&batch)?;
        fed += input.len();
        let row = o.row(o.row_ranges[0].end - 1);
        let mut best = 0;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        tokens.push(best as u32);
        out.push(best as u32);
    }
    Ok(out)
}
