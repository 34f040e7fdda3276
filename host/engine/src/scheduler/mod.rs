//! The engine core: request state, continuous-batching scheduler, state transitions.
//!
//! [`EngineCore`] is single-threaded and synchronous: `schedule` → `launch` → (executor runs the
//! [`StepJob`]) → `complete`. The threaded [`Engine`](crate::Engine) overlaps `schedule` of step
//! N+1 with the forward of step N; tests drive the core directly with [`EngineCore::step`].
//!
//! State transitions, all issued as ordered ops/in-pass checkpoints on the executor's stream:
//! - *restore* (copy-on-write): admission copies the matched checkpoint into the working slot;
//! - *snapshot*: a step writes the working state at an aligned position into a spare slot from
//!   inside the forward (`SeqInput::checkpoints`): once per prefill chunk (the last aligned
//!   position in it, plus the branch point) and once per interval in decode (ping-pong: the new
//!   snapshot replaces the previous one, whose slot returns to the spares);
//! - *donate*: after the step, a prefill snapshot slot goes to the radix tree with the pages
//!   below it; at request end the newest decode snapshot does. A snapshot always targets a slot
//!   the request holds privately, and a slot is donated only after its step completed, so the
//!   two never alias.

mod plan;
mod speculate;
mod step;

pub use plan::Plan;
pub use step::StepJob;

use crate::cache::{NodeId, RadixCache};
use crate::config::{EngineConfig, EngineConfigError};
use crate::memory::{ArenaOp, BlockId, MemoryPool};
use crate::metrics::EngineMetrics;
use crate::request::{FinishReason, Request, RequestError, RequestId, SubmitError, TokenEvent};
use crate::sampling::{RequestSampler, TokenSampler};
use k3_cache_events::CacheEvent;
use k3_model::{CacheLayout, Executor, MediaInput};
use k3_sampling::{StopChecker, TokenVerdict};
use std::collections::VecDeque;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

pub(crate) type EventSender = UnboundedSender<Result<TokenEvent, RequestError>>;
/// The receiving end of a request's events when driving [`EngineCore`] directly.
pub type EventReceiver = tokio::sync::mpsc::UnboundedReceiver<Result<TokenEvent, RequestError>>;

/// A launched step not yet run (see [`EngineCore::step_overlapped`]).
pub struct InFlight {
    job: StepJob,
    launched: step::Launched,
}

/// A checkpoint written by a planned/in-flight step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PendingCheckpoint {
    /// Tokens covered (the state after `pos` tokens).
    pos: usize,
    slot: BlockId,
    /// Prefill checkpoints go to the tree; decode ones become the request's latest snapshot.
    donate: bool,
}

/// One request, waiting or running.
pub(crate) struct Seq {
    id: RequestId,
    /// Bumped on each admission so results of a step launched before a preemption are ignored.
    epoch: u64,
    arrival: u64,
    /// Prompt + generated tokens.
    tokens: Vec<u32>,
    generated: usize,
    sampler: Box<dyn TokenSampler>,
    /// Token-level stop logic (EOS, stop ids, max_tokens); stop strings are the caller's.
    stop: StopChecker,
    events: EventSender,
    /// Tokens handed to forwards (including any in flight).
    fed: usize,
    /// Pages covering positions `0..`; the first `tree_len / page` belong to the tree.
    pages: Vec<BlockId>,
    tree_node: NodeId,
    tree_len: usize,
    working: Option<BlockId>,
    spares: Vec<BlockId>,
    snapshot: Option<(usize, BlockId)>,
    pending: Vec<PendingCheckpoint>,
    branch_at: Option<usize>,
    /// The request's [`Request::checkpoint_hint`](crate::Request::checkpoint_hint).
    hint: Option<usize>,
    /// `tokens.len()` at admission: everything before it is prefill for this incarnation.
    prefill_end: usize,
    /// A launched step will produce this request's next token.
    awaiting_token: bool,
    cached_tokens: Option<usize>,
    /// When the request was enqueued and first admitted ([`crate::RequestTiming`]).
    enqueued: Instant,
    admitted: Option<Instant>,
    /// Drafting state when the request speculates.
    spec: Option<speculate::SeqSpec>,
    /// The prompt's images (positions absolute); empty for a text prompt.
    media: std::sync::Arc<[MediaInput]>,
}

impl Seq {
    fn holds_memory(&self) -> bool {
        self.working.is_some()
    }
}

/// The synchronous engine core.
pub struct EngineCore {
    cfg: EngineConfig,
    layout: CacheLayout,
    vocab: usize,
    page: usize,
    pool: MemoryPool,
    tree: Option<RadixCache>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Arena ops recorded since the last launch, in order.
    ops: Vec<ArenaOp>,
    arrivals: u64,
    epochs: u64,
    metrics: EngineMetrics,
    /// Requests that ended since the last `take_retired` (the handle frees their ids).
    retired: Vec<RequestId>,
    /// What speculation has been yielding (its early exit).
    spec_gate: speculate::SpecGate,
}

impl EngineCore {
    pub fn new(
        layout: CacheLayout,
        vocab: usize,
        cfg: EngineConfig,
    ) -> Result<Self, EngineConfigError> {
        cfg.validate_for(&layout)?;
        if vocab == 0 {
            return Err(EngineConfigError::EmptyVocab);
        }
        let pool = MemoryPool::new(layout, cfg.pool_mode)?;
        let page = layout.page_tokens;
        let tree = cfg
            .prefix_cache
            .then(|| RadixCache::new(page, cfg.interval(page), cfg.checkpoints_per_path));
        Ok(Self {
            cfg,
            layout,
            vocab,
            page,
            pool,
            tree,
            waiting: VecDeque::new(),
            running: Vec::new(),
            ops: Vec::new(),
            arrivals: 0,
            epochs: 0,
            metrics: EngineMetrics::default(),
            retired: Vec::new(),
            spec_gate: speculate::SpecGate::default(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Checks a submission against limits that do not depend on the engine's current load.
    pub fn validate(
        layout: &CacheLayout,
        vocab: usize,
        cfg: &EngineConfig,
        req: &Request,
    ) -> Result<(), SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.sampling.max_tokens == Some(0) {
            return Err(SubmitError::ZeroMaxTokens);
        }
        if req.sampler.is_none() {
            req.sampling
                .validate()
                .map_err(|e| SubmitError::InvalidSampling(e.to_string()))?;
        }
        if req.prompt.len() >= cfg.max_context {
            return Err(SubmitError::ContextLengthExceeded {
                prompt: req.prompt.len(),
                limit: cfg.max_context,
            });
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::InvalidToken { token: t, vocab });
        }
        crate::cache::validate_spans(&req.media, req.prompt.len())
            .map_err(SubmitError::InvalidMedia)?;
        let pool = MemoryPool::new(*layout, cfg.pool_mode)
            .map_err(|_| SubmitError::PromptTooLargeForMemory)?;
        let pages = (req.prompt.len() + 1).div_ceil(layout.page_tokens);
        if !pool.could_ever_fit(cfg.state_slots_per_request, pages) {
            return Err(SubmitError::PromptTooLargeForMemory);
        }
        Ok(())
    }

    /// Queue a request (driving the core directly); returns its event receiver.
    pub fn submit(&mut self, req: Request) -> Result<EventReceiver, SubmitError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.enqueue(req, tx)?;
        Ok(rx)
    }

    /// Queue a request; its events go to `events`.
    pub(crate) fn enqueue(&mut self, req: Request, events: EventSender) -> Result<(), SubmitError> {
        Self::validate(&self.layout, self.vocab, &self.cfg, &req)?;
        if self
            .waiting
            .iter()
            .chain(self.running.iter())
            .any(|s| s.id == req.id)
        {
            return Err(SubmitError::DuplicateId(req.id));
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(SubmitError::Overloaded {
                waiting: self.waiting.len(),
            });
        }
        let sampler: Box<dyn TokenSampler> = match req.sampler {
            Some(s) => s,
            None => Box::new(
                RequestSampler::new(&req.sampling, self.vocab, &req.prompt)
                    .map_err(SubmitError::InvalidSampling)?
                    .with_min_tokens(&req.sampling, &self.cfg.eos_token_ids),
            ),
        };
        let stop = StopChecker::new(&req.sampling, &self.cfg.eos_token_ids);
        let spec = match &self.cfg.speculation {
            Some(c) if sampler.speculation().is_some() => {
                Some(speculate::SeqSpec::new(c.source.create(), req.id))
            }
            _ => None,
        };
        self.arrivals += 1;
        self.metrics.prompt_tokens += req.prompt.len() as u64;
        self.waiting.push_back(Seq {
            id: req.id,
            epoch: 0,
            arrival: self.arrivals,
            tokens: req.prompt,
            generated: 0,
            sampler,
            stop,
            events,
            fed: 0,
            pages: Vec::new(),
            tree_node: NodeId::ROOT,
            tree_len: 0,
            working: None,
            spares: Vec::new(),
            snapshot: None,
            pending: Vec::new(),
            branch_at: None,
            hint: req.checkpoint_hint,
            prefill_end: 0,
            awaiting_token: false,
            cached_tokens: None,
            enqueued: Instant::now(),
            admitted: None,
            spec,
            media: req.media.into(),
        });
        Ok(())
    }

    /// Abort a request wherever it is and free everything it holds. Returns whether it existed.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            self.metrics.cancelled += 1;
            self.retired.push(id);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(i);
            self.release(&mut seq, false);
            self.metrics.cancelled += 1;
            self.retired.push(id);
            return true;
        }
        false
    }

    /// End every request with `err` (shutdown, fatal executor error).
    pub fn abort_all(&mut self, err: RequestError) {
        for seq in std::mem::take(&mut self.waiting) {
            let _ = seq.events.send(Err(err.clone()));
            self.metrics.failed += 1;
            self.retired.push(seq.id);
        }
        for mut seq in std::mem::take(&mut self.running) {
            let _ = seq.events.send(Err(err.clone()));
            self.metrics.failed += 1;
            self.retired.push(seq.id);
            self.release(&mut seq, false);
        }
    }

    /// Drop every unlocked prefix-cache entry.
    pub fn flush_cache(&mut self) {
        let mut rel = Vec::new();
        if let Some(t) = self.tree.as_mut() {
            t.evict_all(&mut rel);
        }
        self.free_blocks(rel);
    }

    /// Ids of requests that ended since the last call.
    pub fn take_retired(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.retired)
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn is_empty(&self) -> bool {
        !self.has_work()
    }

    pub fn metrics(&self) -> EngineMetrics {
        let mut m = self.metrics.clone();
        m.running = self.running.len();
        m.waiting = self.waiting.len();
        m.pool = self.pool.usage();
        if let Some(t) = &self.tree {
            m.cache_checkpoints = t.checkpoint_count();
            m.cache_kv_pages = t.page_count();
        }
        m
    }

    /// Start recording the prefix cache's changes and describe what it holds now (`None`
    /// without a prefix cache). Changes come from [`take_cache_events`](Self::take_cache_events).
    pub fn subscribe_cache(&mut self) -> Option<CacheEvent> {
        let load = self
            .metrics()
            .replica_load(self.layout.kv_page_bytes, self.layout.state_block_bytes);
        let tree = self.tree.as_mut()?;
        tree.record_events(true);
        Some(CacheEvent::Snapshot {
            block_tokens: tree.page_tokens() as u32,
            checkpoint_interval: tree.checkpoint_interval() as u32,
            blocks: tree.block_records(),
            load,
        })
    }

    /// The prefix cache's changes since the last call (or since [`subscribe_cache`](Self::subscribe_cache)).
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.tree
            .as_mut()
            .map(RadixCache::take_events)
            .unwrap_or_default()
    }

    /// Stop recording changes (nobody listens).
    pub fn unsubscribe_cache(&mut self) {
        if let Some(t) = self.tree.as_mut() {
            t.record_events(false);
        }
    }

    pub fn pool_free_bytes(&self) -> usize {
        self.pool.free_bytes()
    }

    fn free_blocks(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            self.pool.free(b, &mut self.ops);
        }
    }

    /// Free everything `seq` holds; with `donate`, first give its newest decode snapshot (and
    /// the pages below it) to the prefix cache so the next turn resumes there.
    fn release(&mut self, seq: &mut Seq, donate: bool) {
        if donate && let Some((pos, slot)) = seq.snapshot.take() {
            self.donate(seq, pos, slot);
        }
        let mut rel: Vec<BlockId> = seq.pages.drain(seq.tree_len / self.page..).collect();
        rel.extend(seq.working.take());
        rel.append(&mut seq.spares);
        rel.extend(seq.snapshot.take().map(|s| s.1));
        rel.extend(seq.pending.drain(..).map(|p| p.slot));
        if let Some(spec) = seq.spec.as_mut() {
            rel.extend(spec.record.take());
            spec.verifying = false;
        }
        if let Some(t) = self.tree.as_mut() {
            t.unlock(seq.tree_node, &mut rel);
        }
        self.free_blocks(rel);
        seq.pages.clear();
        seq.tree_node = NodeId::ROOT;
        seq.tree_len = 0;
        seq.fed = 0;
        seq.branch_at = None;
        seq.awaiting_token = false;
    }

    /// Give the tree the state after `pos` tokens (in `slot`) and the pages below it.
    fn donate(&mut self, seq: &mut Seq, pos: usize, slot: BlockId) {
        let Some(tree) = self.tree.as_mut().filter(|_| pos > seq.tree_len) else {
            // Nothing new to give (or no cache): the slot is simply freed.
            self.pool.free(slot, &mut self.ops);
            return;
        };
        let np = pos / self.page;
        let key = crate::cache::cache_key(&seq.tokens[..pos], &seq.media);
        let out = tree.insert(&key, &seq.pages[..np], Some(slot));
        seq.pages.splice(..np, out.path_pages.iter().copied());
        tree.lock(out.node);
        let mut rel = out.release;
        tree.unlock(seq.tree_node, &mut rel);
        seq.tree_node = out.node;
        seq.tree_len = pos;
        self.free_blocks(rel);
    }

    /// Every invariant the property tests rely on: the pool's own, the tree's, and that every
    /// live block has exactly one owner (the tree, or one request).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut owners = std::collections::HashMap::new();
        let mut own = |b: BlockId, who: String| -> Result<(), String> {
            if let Some(prev) = owners.insert(b, who.clone()) {
                return Err(format!("{b:?} owned by both {prev} and {who}"));
            }
            Ok(())
        };
        if let Some(t) = &self.tree {
            t.check_invariants()?;
            if self.running.is_empty() && !t.is_unreferenced() {
                return Err("prefix tree still locked or pinned with nothing running".into());
            }
            for b in t.owned_blocks() {
                own(b, "tree".into())?;
            }
        }
        for s in &self.running {
            let who = format!("request {}", s.id);
            if s.tree_len % self.page != 0 || s.pages.len() * self.page < s.fed {
                return Err(format!(
                    "{who}: tree_len {} / pages {} / fed {}",
                    s.tree_len,
                    s.pages.len(),
                    s.fed
                ));
            }
            for &b in &s.pages[s.tree_len / self.page..] {
                own(b, who.clone())?;
            }
            let slots = s
                .working
                .iter()
                .chain(&s.spares)
                .chain(s.snapshot.iter().map(|x| &x.1));
            let record = s.spec.as_ref().and_then(|x| x.record.as_ref());
            for &b in slots.chain(s.pending.iter().map(|p| &p.slot)).chain(record) {
                own(b, who.clone())?;
            }
        }
        for s in &self.waiting {
            let record = s.spec.as_ref().is_some_and(|x| x.record.is_some());
            if s.holds_memory() || !s.pages.is_empty() || !s.spares.is_empty() || record {
                return Err(format!("waiting request {} holds memory", s.id));
            }
        }
        let live: std::collections::HashSet<BlockId> =
            self.pool.live_blocks().map(|b| b.0).collect();
        if live.len() != owners.len() || owners.keys().any(|b| !live.contains(b)) {
            return Err(format!(
                "{} live blocks vs {} owned",
                live.len(),
                owners.len()
            ));
        }
        Ok(())
    }

    /// One step of the overlapped pipeline, run synchronously: plan step N+1 while step N is
    /// "in flight" (held in `inflight`), then run and complete N, then launch N+1. Same
    /// bookkeeping order as the threaded engine; the executor just runs later. False when idle.
    pub fn step_overlapped(
        &mut self,
        exec: &mut dyn Executor,
        inflight: &mut Option<InFlight>,
    ) -> bool {
        let mut next = if inflight.is_some() {
            self.schedule()
        } else {
            None
        };
        let had = inflight.is_some();
        if let Some(f) = inflight.take() {
            let out = f.job.run(exec);
            self.complete(f.launched, out);
        }
        match next.as_mut() {
            Some(plan) => self.plan_ready(plan),
            None => next = self.schedule(),
        }
        if let Some((job, launched)) = next.and_then(|p| self.launch(p)) {
            *inflight = Some(InFlight { job, launched });
            return true;
        }
        had || self.has_work()
    }

    /// One synchronous step (schedule, launch, run, complete). Returns false when idle.
    pub fn step(&mut self, exec: &mut dyn Executor) -> bool {
        let Some(plan) = self.schedule() else {
            return false;
        };
        let Some((job, launched)) = self.launch(plan) else {
            return self.has_work();
        };
        let out = job.run(exec);
        self.complete(launched, out);
        true
    }
}

/// Token-level end of generation: stop tokens and `max_tokens` (via the request's
/// `StopChecker`), then the context length.
fn finish_reason(seq: &mut Seq, token: u32, max_context: usize) -> Option<FinishReason> {
    match seq.stop.on_token(token) {
        TokenVerdict::StopToken { .. } => Some(FinishReason::Stop),
        TokenVerdict::LastToken => Some(FinishReason::Length),
        TokenVerdict::Continue if seq.tokens.len() >= max_context => Some(FinishReason::Length),
        TokenVerdict::Continue => None,
    }
}
