//! Scheduling one step: decode first, then prefill chunks, then admissions, inside one adaptive
//! token budget; memory by eviction first, preemption (recompute) second.
//!
//! Fairness: requests are served oldest first; when memory runs out the *newest* running request
//! is preempted (freed, put back at the head of the queue with all its tokens, recomputed later,
//! mostly from the prefix cache). The oldest running request is never preempted for a newer one,
//! so every request eventually reaches the front and finishes: no starvation.

use super::{EngineCore, PendingCheckpoint, Seq};
use crate::cache::{EvictWant, NodeId, PrefixMatch};
use crate::memory::{ArenaOp, BlockId, BlockKind, PoolMode};
use crate::request::{RequestError, RequestId};
use k3_model::LogitsWant;

/// One request's share of a planned step.
#[derive(Debug, Clone)]
pub(crate) struct PlannedSeq {
    pub(super) id: RequestId,
    pub(super) epoch: u64,
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) logits: LogitsWant,
    /// Most draft tokens its launch may add to a decode step (0: a plain step).
    pub(super) draft_max: usize,
}

/// A planned step (offsets are resolved only at launch).
#[derive(Debug, Default)]
pub struct Plan {
    pub(super) seqs: Vec<PlannedSeq>,
}

impl Plan {
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }
}

enum Admit {
    Admitted(RequestId),
    NoRoom,
    Failed,
}

enum Work {
    /// Exactly one token to feed, logits wanted (decode, or a prompt's last token).
    Decode,
    /// More than one token left to feed.
    Prefill,
    None,
}

impl EngineCore {
    fn idx(&self, id: RequestId) -> Option<usize> {
        self.running.iter().position(|s| s.id == id)
    }

    fn work(s: &Seq) -> Work {
        if s.spec.as_ref().is_some_and(|x| x.verifying) {
            return Work::None;
        }
        match s.tokens.len() - s.fed.min(s.tokens.len()) {
            0 if s.awaiting_token && s.fed == s.tokens.len() => Work::Decode,
            0 => Work::None,
            1 => Work::Decode,
            _ => Work::Prefill,
        }
    }

    fn evict_want(&self, kind: BlockKind) -> EvictWant {
        match (self.cfg.pool_mode, kind) {
            (PoolMode::Unified, _) => EvictWant::Any,
            (PoolMode::Split { .. }, BlockKind::State) => EvictWant::State,
            (PoolMode::Split { .. }, BlockKind::Kv) => EvictWant::Kv,
        }
    }

    /// Evict one prefix-cache entry that frees `kind` memory; false if none is evictable.
    fn evict_for(&mut self, kind: BlockKind) -> bool {
        let want = self.evict_want(kind);
        let mut rel = Vec::new();
        let evicted = self
            .tree
            .as_mut()
            .is_some_and(|t| t.evict_one(want, &mut rel));
        self.free_blocks(rel);
        evicted
    }

    /// Allocate, evicting cache entries as needed (never preempting).
    pub(super) fn alloc_evicting(&mut self, kind: BlockKind) -> Option<BlockId> {
        loop {
            if let Some(b) = self.pool.alloc(kind) {
                return Some(b);
            }
            if !self.evict_for(kind) {
                return None;
            }
        }
    }

    /// Allocate for `requester`, preempting newer requests if eviction is not enough. `None`
    /// means `requester` itself was preempted or failed (and removed from `plan`).
    fn alloc_for(
        &mut self,
        kind: BlockKind,
        requester: RequestId,
        plan: &mut Plan,
    ) -> Option<BlockId> {
        loop {
            if let Some(b) = self.alloc_evicting(kind) {
                return Some(b);
            }
            let arrival = self.running[self.idx(requester)?].arrival;
            let victim = self
                .running
                .iter()
                .filter(|s| s.arrival > arrival)
                .max_by_key(|s| s.arrival)
                .map(|s| s.id);
            match victim {
                Some(v) => self.preempt(v, plan),
                None => {
                    let older_running = self.running.iter().any(|s| s.arrival < arrival);
                    if older_running {
                        self.preempt(requester, plan);
                    } else {
                        // Alone (everyone newer is preempted) and still out of memory.
                        self.fail(requester, RequestError::OutOfMemory, plan);
                    }
                    return None;
                }
            }
        }
    }

    /// Free a running request and requeue it at the front (recompute later).
    fn preempt(&mut self, id: RequestId, plan: &mut Plan) {
        let Some(i) = self.idx(id) else { return };
        let mut seq = self.running.remove(i);
        plan.seqs.retain(|p| p.id != id);
        self.release(&mut seq, false);
        self.metrics.preemptions += 1;
        self.waiting.push_front(seq);
    }

    pub(super) fn fail(&mut self, id: RequestId, err: RequestError, plan: &mut Plan) {
        let Some(i) = self.idx(id) else { return };
        let mut seq = self.running.remove(i);
        plan.seqs.retain(|p| p.id != id);
        let _ = seq.events.send(Err(err));
        self.release(&mut seq, false);
        self.metrics.failed += 1;
        self.retired.push(id);
    }

    /// Make `id`'s pages cover `upto` tokens. False if the request lost its place.
    fn ensure_pages(&mut self, id: RequestId, upto: usize, plan: &mut Plan) -> bool {
        loop {
            let Some(i) = self.idx(id) else { return false };
            if self.running[i].pages.len() * self.page >= upto {
                return true;
            }
            match self.alloc_for(BlockKind::Kv, id, plan) {
                Some(b) => match self.idx(id) {
                    Some(i) => self.running[i].pages.push(b),
                    None => self.pool.free(b, &mut self.ops),
                },
                None => return false,
            }
        }
    }

    /// Give a decoding `id` the page for position `upto - 1` a step early if a free one is at
    /// hand (no eviction, no preemption): its next decode step then uses only pages this step
    /// was given, so the executor can prepare that step while this one runs (k3_model's
    /// `ExpectedStep`).
    fn page_ahead(&mut self, id: RequestId, upto: usize) {
        let Some(i) = self.idx(id) else { return };
        if self.running[i].pages.len() * self.page < upto
            && let Some(b) = self.pool.alloc(BlockKind::Kv)
        {
            self.running[i].pages.push(b);
        }
    }

    /// A slot for a snapshot: a spare, else a fresh block (eviction only); `None` skips it.
    fn take_spare(&mut self, i: usize) -> Option<BlockId> {
        if let Some(b) = self.running[i].spares.pop() {
            return Some(b);
        }
        self.alloc_evicting(BlockKind::State)
    }

    /// Plan the next step; `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<Plan> {
        self.update_spec_gate();
        let mut plan = Plan::default();
        let budget = if self.running.len() <= self.cfg.few_running {
            self.cfg.max_step_tokens
        } else {
            self.cfg.step_tokens
        };
        let mut order: Vec<(u64, RequestId)> =
            self.running.iter().map(|s| (s.arrival, s.id)).collect();
        order.sort_unstable();
        let mut used = 0;
        for &(_, id) in &order {
            if let Some(i) = self.idx(id)
                && matches!(Self::work(&self.running[i]), Work::Decode)
            {
                used += self.plan_tokens(id, 1, &mut plan);
            }
        }
        for &(_, id) in &order {
            if used >= budget {
                break;
            }
            if let Some(i) = self.idx(id)
                && matches!(Self::work(&self.running[i]), Work::Prefill)
            {
                used += self.plan_tokens(id, budget - used, &mut plan);
            }
        }
        while used < budget && !self.waiting.is_empty() {
            match self.try_admit() {
                Admit::Admitted(id) => used += self.plan_tokens(id, budget - used, &mut plan),
                Admit::NoRoom => break,
                Admit::Failed => {}
            }
        }
        (!plan.seqs.is_empty()).then_some(plan)
    }

    /// Plan up to `avail` tokens of `id`'s remaining input. Returns tokens planned.
    fn plan_tokens(&mut self, id: RequestId, avail: usize, plan: &mut Plan) -> usize {
        let Some(i) = self.idx(id) else { return 0 };
        let s = &self.running[i];
        let start = s.fed;
        let remaining = (s.tokens.len() - start).max(usize::from(s.awaiting_token));
        let len = remaining.min(avail);
        let mut draft_max = if remaining == 1 && len == 1 {
            self.draft_room(i, start)
        } else {
            0
        };
        if len == 0 || !self.ensure_pages(id, start + len + draft_max, plan) {
            return 0;
        }
        if remaining == 1 && len == 1 && draft_max == 0 {
            self.page_ahead(id, start + len + 1);
        }
        let Some(i) = self.idx(id) else { return 0 };
        if draft_max > 0 && !self.reserve_record(i) {
            draft_max = 0;
        }
        let end = start + len;
        let prefill = !self.running[i].awaiting_token && end <= self.running[i].prefill_end;
        let mut ckpts = Vec::new();
        if self.tree.is_some() {
            let interval = self.cfg.interval(self.page);
            let last_aligned = end / interval * interval;
            if let Some(b) = self.running[i].branch_at.filter(|&b| b > start && b <= end) {
                ckpts.push(b);
            }
            let hint = self.running[i].hint.map(|h| h / interval * interval);
            if let Some(h) = hint.filter(|&h| h > start && h <= end && !ckpts.contains(&h)) {
                ckpts.push(h);
            }
            if last_aligned > start && !ckpts.contains(&last_aligned) {
                ckpts.push(last_aligned);
            }
        }
        for pos in ckpts {
            let donate = prefill && pos <= self.running[i].prefill_end;
            if let Some(slot) = self.take_spare(i) {
                self.running[i]
                    .pending
                    .push(PendingCheckpoint { pos, slot, donate });
            }
        }
        let s = &mut self.running[i];
        s.fed = end;
        let logits = if end >= s.tokens.len() {
            // Greedy and top-k requests need only the row's largest logits, which the executor
            // can select next to the logits (a decode step then moves no vocabulary rows).
            match s.sampler.top_k_need() {
                Some(k) => LogitsWant::LastTopK(k),
                None => LogitsWant::Last,
            }
        } else {
            LogitsWant::None
        };
        if let Some(spec) = s.spec.as_mut() {
            spec.verifying = draft_max > 0;
        }
        plan.seqs.push(PlannedSeq {
            id,
            epoch: s.epoch,
            start,
            len,
            logits,
            draft_max,
        });
        len + draft_max
    }

    /// Plan the decode steps that became possible since `plan` was made: requests whose verify
    /// just completed (the overlapped pipeline plans before it completes the running step, and a
    /// request cannot be planned while its verify is out).
    pub(crate) fn plan_ready(&mut self, plan: &mut Plan) {
        let mut order: Vec<(u64, RequestId)> = self
            .running
            .iter()
            .filter(|s| s.spec.is_some() && !plan.seqs.iter().any(|p| p.id == s.id))
            .map(|s| (s.arrival, s.id))
            .collect();
        order.sort_unstable();
        for (_, id) in order {
            if let Some(i) = self.idx(id)
                && matches!(Self::work(&self.running[i]), Work::Decode)
            {
                self.plan_tokens(id, 1, plan);
            }
        }
    }

    /// Admit the head of the queue if memory allows: match the prefix cache, reserve state slots,
    /// restore the checkpoint (copy-on-write) or zero the working state.
    fn try_admit(&mut self) -> Admit {
        if self.running.len() >= self.cfg.max_running {
            return Admit::NoRoom;
        }
        let Some(seq) = self.waiting.front() else {
            return Admit::NoRoom;
        };
        let n = seq.tokens.len();
        let m = match self.tree.as_mut() {
            Some(t) => {
                let m = t.match_prefix(&crate::cache::cache_key(&seq.tokens[..n - 1], &seq.media));
                // Locked: its KV stays; pinned: its checkpoint survives the evictions below
                // until the restore copy is issued.
                t.lock(m.node);
                t.pin(m.node);
                m
            }
            None => PrefixMatch {
                node: NodeId::ROOT,
                len: 0,
                pages: Vec::new(),
                checkpoint: None,
                walked: 0,
                branch_at: None,
            },
        };
        let slots = self.cfg.state_slots_per_request;
        let need_pages = (n + 1).div_ceil(self.page) - m.pages.len();
        let outstanding: usize = self
            .running
            .iter()
            .map(|s| {
                (s.tokens.len() + 1)
                    .div_ceil(self.page)
                    .saturating_sub(s.pages.len())
            })
            .sum();
        while !self.pool.fits(slots, need_pages + outstanding) {
            let kind = if self.pool.fits(slots, 0) {
                BlockKind::Kv
            } else {
                BlockKind::State
            };
            if !self.evict_for(kind) {
                break;
            }
        }
        if !self.pool.fits(slots, need_pages + outstanding) {
            let mut rel = Vec::new();
            if let Some(t) = self.tree.as_mut() {
                t.unpin(m.node);
                t.unlock(m.node, &mut rel);
            }
            self.free_blocks(rel);
            if !self.running.is_empty() {
                return Admit::NoRoom;
            }
            let seq = self.waiting.pop_front().expect("head");
            let _ = seq.events.send(Err(RequestError::OutOfMemory));
            self.metrics.failed += 1;
            self.retired.push(seq.id);
            return Admit::Failed;
        }
        let mut seq = self.waiting.pop_front().expect("head");
        let working = self.pool.alloc(BlockKind::State).expect("fits");
        seq.spares = (1..slots)
            .map(|_| self.pool.alloc(BlockKind::State).expect("fits"))
            .collect();
        let state_len = self.layout.state_block_bytes;
        let dst = self.pool.offset(working);
        match m.checkpoint {
            Some(c) => self.ops.push(ArenaOp::Copy {
                src: self.pool.offset(c),
                dst,
                len: state_len,
            }),
            None => self.ops.push(ArenaOp::Zero {
                offset: dst,
                len: state_len,
            }),
        }
        if let Some(t) = self.tree.as_mut() {
            t.unpin(m.node);
        }
        self.metrics.prefix_hit_tokens += m.len as u64;
        self.metrics.checkpoint_hits += u64::from(m.checkpoint.is_some());
        self.metrics.replayed_tokens += (m.walked - m.len) as u64;
        self.epochs += 1;
        seq.epoch = self.epochs;
        seq.working = Some(working);
        seq.pages = m.pages;
        seq.tree_node = m.node;
        seq.tree_len = m.len;
        seq.fed = m.len;
        seq.branch_at = m.branch_at;
        seq.prefill_end = n;
        seq.awaiting_token = false;
        seq.cached_tokens.get_or_insert(m.len);
        seq.admitted.get_or_insert_with(std::time::Instant::now);
        let id = seq.id;
        self.running.push(seq);
        Admit::Admitted(id)
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{ToyConfig, ToyExecutor};
    use crate::{EngineConfig, EngineCore, Request, SamplingParams};
    use k3_model::{Executor, LogitsWant};

    fn core(exec: &ToyExecutor) -> EngineCore {
        let cfg = EngineConfig {
            prefix_cache: false,
            step_tokens: 16,
            max_step_tokens: 64,
            few_running: 2,
            ..EngineConfig::default()
        };
        EngineCore::new(exec.layout(), exec.vocab_size(), cfg).unwrap()
    }

    /// The receiver must stay alive: a dropped one reads as a client disconnect.
    fn submit(core: &mut EngineCore, id: u64, len: usize) -> crate::scheduler::EventReceiver {
        let sampling = SamplingParams {
            temperature: 0.0,
            max_tokens: Some(100),
            ..Default::default()
        };
        core.submit(Request::new(id, (0..len as u32).collect(), sampling))
            .unwrap()
    }

    #[test]
    fn rows_or_candidates_follow_what_each_sampler_needs() {
        let exec = ToyExecutor::new(ToyConfig {
            arena_bytes: 1 << 16,
            ..Default::default()
        })
        .unwrap();
        let mut core = core(&exec);
        let with = |id: u64, s: SamplingParams| Request::new(id, vec![1, 2, 3], s);
        let base = SamplingParams {
            max_tokens: Some(4),
            ..Default::default()
        };
        let requests = [
            SamplingParams {
                top_k: 40,
                ..base.clone()
            },
            SamplingParams {
                temperature: 0.0,
                logprobs: Some(1),
                ..base.clone()
            },
            SamplingParams {
                temperature: 0.0,
                frequency_penalty: 0.5,
                ..base.clone()
            },
            base.clone(),
        ];
        let _rx: Vec<_> = (0u64..)
            .zip(requests)
            .map(|(id, s)| core.submit(with(id, s)).unwrap())
            .collect();
        let plan = core.schedule().unwrap();
        let wants: Vec<_> = plan.seqs.iter().map(|s| s.logits).collect();
        assert_eq!(
            wants,
            vec![
                LogitsWant::LastTopK(40),
                LogitsWant::Last, // logprobs need the row's normaliser
                LogitsWant::Last, // penalties change logits anywhere
                LogitsWant::Last, // plain temperature sampling may pick any token
            ]
        );
    }

    #[test]
    fn budget_grows_when_few_run_and_decode_goes_first() {
        let mut exec = ToyExecutor::new(ToyConfig {
            arena_bytes: 1 << 16,
            ..Default::default()
        })
        .unwrap();
        let mut core = core(&exec);
        // Alone: the large budget takes a 60-token prompt in one forward.
        let _a = submit(&mut core, 0, 60);
        let plan = core.schedule().unwrap();
        assert_eq!(
            plan.seqs.iter().map(|s| s.len).collect::<Vec<_>>(),
            vec![60]
        );
        // Greedy: the executor selects the top logit instead of returning the row.
        assert_eq!(plan.seqs[0].logits, LogitsWant::LastTopK(1));
        let (job, l) = core.launch(plan).unwrap();
        core.complete(l, job.run(&mut exec));
        // Two more long prompts: few running → budget 64 = 1 decode + 63 of prefill, chunked.
        let _b = submit(&mut core, 1, 50);
        let _c = submit(&mut core, 2, 50);
        let plan = core.schedule().unwrap();
        let shape: Vec<_> = plan.seqs.iter().map(|s| (s.id, s.len, s.logits)).collect();
        assert_eq!(
            shape,
            vec![
                (0, 1, LogitsWant::LastTopK(1)),
                (1, 50, LogitsWant::LastTopK(1)),
                (2, 13, LogitsWant::None)
            ]
        );
        let (job, l) = core.launch(plan).unwrap();
        core.complete(l, job.run(&mut exec));
        // Now 3 running (> few): budget 16, decodes first, then the rest of the prefill.
        let plan = core.schedule().unwrap();
        let shape: Vec<_> = plan.seqs.iter().map(|s| (s.id, s.len)).collect();
        assert_eq!(shape, vec![(0, 1), (1, 1), (2, 14)]);
    }
}
