//! Launching a planned step (resolving block ids to offsets) and completing it (checkpoints,
//! sampling, events, finishing).

use super::plan::Plan;
use super::{EngineCore, finish_reason};
use crate::memory::{ArenaOp, BlockKind};
use crate::request::{RequestError, RequestId, RequestTiming, TokenEvent};
use k3_model::{
    ExecError, Executor, ForwardBatch, ForwardOutput, LogitsWant, MediaInput, PendingTokenMask,
    SeqInput,
};
use k3_sampling::SampledToken;
use k3_speculative::Draft;

/// One sequence of a launched step, with offsets resolved.
#[derive(Debug, Clone)]
struct SeqJob {
    tokens: Vec<u32>,
    start_pos: usize,
    kv_pages: Vec<usize>,
    state_block: usize,
    checkpoints: Vec<(usize, usize)>,
    logits: LogitsWant,
    /// The constrained sampler's mask for this step's candidates ([`LogitsWant::LastTopK`]).
    mask: Option<PendingTokenMask>,
    /// A speculative verify: the record block its KDA layers write.
    record: Option<usize>,
    /// Return the hidden-state taps of its rows (a drafter reads them).
    taps: bool,
    /// The sequence's images when one falls in this step's positions (else empty).
    media: std::sync::Arc<[MediaInput]>,
}

/// Everything the executor does for one step: arena ops in order, then one forward.
#[derive(Debug, Clone, Default)]
pub struct StepJob {
    ops: Vec<ArenaOp>,
    seqs: Vec<SeqJob>,
}

impl StepJob {
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Run on `exec` (the engine's worker thread, or directly in tests).
    pub fn run(&self, exec: &mut dyn Executor) -> Result<ForwardOutput, ExecError> {
        for op in &self.ops {
            op.apply(exec)?;
        }
        if self.seqs.is_empty() {
            return Ok(ForwardOutput {
                vocab: exec.vocab_size(),
                ..Default::default()
            });
        }
        let batch = ForwardBatch {
            seqs: self
                .seqs
                .iter()
                .map(|s| SeqInput {
                    tokens: &s.tokens,
                    start_pos: s.start_pos,
                    kv_pages: &s.kv_pages,
                    state_block: s.state_block,
                    checkpoints: &s.checkpoints,
                    logits: s.logits,
                })
                .collect(),
            masks: self.seqs.iter().map(|s| s.mask.clone()).collect(),
            verify_records: self.seqs.iter().map(|s| s.record).collect(),
            want_taps: self.seqs.iter().map(|s| s.taps).collect(),
            media: self.seqs.iter().map(|s| &s.media[..]).collect(),
        };
        exec.forward(&batch)
    }
}

#[derive(Debug, Clone)]
struct LaunchedSeq {
    id: RequestId,
    epoch: u64,
    start: usize,
    len: usize,
    logits: LogitsWant,
    /// The draft its verify checks (the rows after the committed token's).
    draft: Option<Draft>,
    /// Planned as a verify (even if no draft came): the request may be planned again once
    /// this step completes.
    verify_planned: bool,
}

/// Bookkeeping of a step handed to the executor, needed to complete it.
#[derive(Debug)]
pub(crate) struct Launched {
    seqs: Vec<LaunchedSeq>,
}

impl EngineCore {
    /// Resolve a plan into a job. Sequences whose request ended since planning are dropped.
    /// `None` if nothing is left (pending arena ops then stay queued for the next launch).
    pub(crate) fn launch(&mut self, plan: Plan) -> Option<(StepJob, Launched)> {
        let mut seqs = Vec::new();
        let mut launched = Vec::new();
        let drafts = self.propose_drafts(&plan.seqs);
        for (p, draft) in plan.seqs.into_iter().zip(drafts) {
            let Some(i) = self
                .running
                .iter()
                .position(|s| s.id == p.id && s.epoch == p.epoch)
            else {
                continue;
            };
            let s = &self.running[i];
            if p.start + p.len > s.tokens.len() {
                // Its previous step produced no token for it: bookkeeping would be wrong from
                // here on, so the request ends rather than guess.
                let mut dead = Plan::default();
                self.fail_running(
                    p.id,
                    "internal: a planned token was never produced",
                    &mut dead,
                );
                continue;
            }
            let s = &self.running[i];
            let record = s.spec.as_ref().and_then(|x| x.record);
            let draft = draft.filter(|d| !d.tokens.is_empty() && record.is_some());
            let mut tokens = s.tokens[p.start..p.start + p.len].to_vec();
            let logits = match &draft {
                Some(d) => {
                    tokens.extend_from_slice(&d.tokens);
                    LogitsWant::All
                }
                None => p.logits,
            };
            // With the next position's page when it is held already (`page_ahead`).
            let npages = (p.start + tokens.len() + 1)
                .div_ceil(self.page)
                .min(s.pages.len());
            let checkpoints = s
                .pending
                .iter()
                .filter(|c| c.pos > p.start && c.pos <= p.start + p.len)
                .map(|c| (c.pos - p.start, self.pool.offset(c.slot)))
                .collect();
            seqs.push(SeqJob {
                tokens,
                start_pos: p.start,
                kv_pages: s.pages[..npages]
                    .iter()
                    .map(|&b| self.pool.offset(b))
                    .collect(),
                state_block: self
                    .pool
                    .offset(s.working.expect("running request has a working slot")),
                checkpoints,
                logits,
                mask: match logits {
                    LogitsWant::LastTopK(_) => s.sampler.pending_mask(),
                    _ => None,
                },
                record: draft.as_ref().and(record).map(|r| self.pool.offset(r)),
                taps: s.spec.as_ref().is_some_and(|x| x.wants_taps()),
                media: if s
                    .media
                    .iter()
                    .any(|m| m.position < p.start + p.len && m.span().end > p.start)
                {
                    s.media.clone()
                } else {
                    std::sync::Arc::from([])
                },
            });
            self.running[i].awaiting_token = logits != LogitsWant::None;
            launched.push(LaunchedSeq {
                id: p.id,
                epoch: p.epoch,
                start: p.start,
                len: p.len,
                logits,
                draft,
                verify_planned: p.draft_max > 0,
            });
        }
        if seqs.is_empty() {
            return None;
        }
        let ops = std::mem::take(&mut self.ops);
        Some((StepJob { ops, seqs }, Launched { seqs: launched }))
    }

    fn fail_running(&mut self, id: RequestId, msg: &str, plan: &mut Plan) {
        self.fail(id, RequestError::Execution(msg.to_string()), plan);
    }

    /// Apply a finished step: donate/snapshot its checkpoints, sample, emit, finish.
    pub(crate) fn complete(
        &mut self,
        launched: Launched,
        result: Result<ForwardOutput, ExecError>,
    ) {
        let out = match result {
            Ok(out) if out.row_ranges.len() == launched.seqs.len() && out.vocab == self.vocab => {
                out
            }
            Ok(out) => {
                let msg = format!(
                    "executor returned {} row ranges / vocab {} for {} sequences / vocab {}",
                    out.row_ranges.len(),
                    out.vocab,
                    launched.seqs.len(),
                    self.vocab
                );
                return self.fail_step(&launched, &msg);
            }
            Err(e) => return self.fail_step(&launched, &e.to_string()),
        };
        let tokens: usize = launched.seqs.iter().map(|s| s.len).sum();
        self.metrics.steps += 1;
        self.metrics.last_step_tokens = tokens;
        self.metrics.step_tokens_total += tokens as u64;
        for (k, ls) in launched.seqs.iter().enumerate() {
            let Some(i) = self
                .running
                .iter()
                .position(|s| s.id == ls.id && s.epoch == ls.epoch)
            else {
                continue;
            };
            let mut seq = self.running.remove(i);
            let end = ls.start + ls.len;
            let (mut mine, rest): (Vec<_>, Vec<_>) = seq
                .pending
                .drain(..)
                .partition(|c| c.pos > ls.start && c.pos <= end);
            seq.pending = rest;
            mine.sort_by_key(|c| c.pos);
            for c in mine {
                if c.donate {
                    self.donate(&mut seq, c.pos, c.slot);
                } else if let Some((_, old)) = seq.snapshot.replace((c.pos, c.slot)) {
                    // Ping-pong: the older snapshot's slot becomes a spare again.
                    seq.spares.push(old);
                }
            }
            // Keep the request's slot reservation (working + snapshot + spares) topped up.
            let held =
                1 + seq.spares.len() + seq.pending.len() + usize::from(seq.snapshot.is_some());
            for _ in held..self.cfg.state_slots_per_request {
                match self.alloc_evicting(BlockKind::State) {
                    Some(b) => seq.spares.push(b),
                    None => break,
                }
            }
            if ls.verify_planned
                && let Some(spec) = seq.spec.as_mut()
            {
                spec.verifying = false;
            }
            let taps = match out.tap_ranges.get(k) {
                Some(r) if out.tap_width > 0 && r.end * out.tap_width <= out.taps.len() => {
                    &out.taps[r.start * out.tap_width..r.end * out.tap_width]
                }
                _ => &[][..],
            };
            if ls.logits == LogitsWant::None {
                if let Some(spec) = seq.spec.as_mut() {
                    spec.observe(ls.start, taps, out.tap_width);
                }
                self.running.insert(i, seq);
                continue;
            }
            seq.awaiting_token = false;
            let range = out.row_ranges.get(k).cloned().unwrap_or_default();
            let sampled = if let Some(draft) = &ls.draft {
                if range.len() != draft.tokens.len() + 1 || range.end * out.vocab > out.logits.len()
                {
                    Err("executor returned the wrong number of verify rows".to_string())
                } else {
                    let rows: Vec<&[f32]> = range.clone().map(|r| out.row(r)).collect();
                    self.accept_verified(&mut seq, ls.start, draft, &rows, taps, out.tap_width)
                }
            } else {
                if let Some(spec) = seq.spec.as_mut() {
                    spec.observe(ls.start, taps, out.tap_width);
                }
                if let LogitsWant::LastTopK(_) = ls.logits {
                    match out.top.get(k) {
                        Some(top) => seq.sampler.sample_top(top).map(|s| vec![s]),
                        None => Err("executor returned no top-k candidates".into()),
                    }
                } else {
                    if range.is_empty() || range.end * out.vocab > out.logits.len() {
                        self.running.insert(i, seq);
                        let mut dead = Plan::default();
                        self.fail_running(ls.id, "executor returned no logits row", &mut dead);
                        continue;
                    }
                    seq.sampler.sample(out.row(range.end - 1)).map(|s| vec![s])
                }
            };
            match sampled {
                Ok(tokens) => self.emit(seq, i, tokens),
                Err(e) => {
                    let _ = seq.events.send(Err(RequestError::Sampling(e)));
                    self.release(&mut seq, false);
                    self.metrics.failed += 1;
                    self.retired.push(seq.id);
                }
            }
        }
    }

    /// Hand a request its new tokens in order, ending it at the first that finishes it (a
    /// verify may commit several; the rest of them are dropped). Reinserts it at `i` if it goes
    /// on.
    fn emit(&mut self, mut seq: super::Seq, i: usize, tokens: Vec<SampledToken>) {
        for sampled in tokens {
            seq.tokens.push(sampled.token);
            seq.generated += 1;
            self.metrics.generated_tokens += 1;
            let finish = finish_reason(&mut seq, sampled.token, self.cfg.max_context);
            let finished = finish.is_some();
            let event = TokenEvent {
                token: sampled.token,
                logprob: sampled.logprob,
                top_logprobs: sampled.top_logprobs,
                finish,
                cached_tokens: if seq.generated == 1 {
                    seq.cached_tokens
                } else {
                    None
                },
                timing: (seq.generated == 1).then(|| {
                    let admitted = seq.admitted.unwrap_or(seq.enqueued);
                    RequestTiming {
                        queued: admitted - seq.enqueued,
                        prefill: admitted.elapsed(),
                    }
                }),
            };
            if seq.events.send(Ok(event)).is_err() {
                // The stream is gone: the client disconnected.
                self.release(&mut seq, false);
                self.metrics.cancelled += 1;
                self.retired.push(seq.id);
                return;
            }
            if finished {
                // A verify may have committed state past the token that ended the request; a
                // snapshot there does not describe these tokens.
                if let Some((pos, slot)) = seq.snapshot
                    && pos > seq.tokens.len()
                {
                    seq.snapshot = None;
                    seq.spares.push(slot);
                }
                self.release(&mut seq, true);
                self.metrics.finished += 1;
                self.retired.push(seq.id);
                return;
            }
        }
        self.running.insert(i, seq);
    }

    fn fail_step(&mut self, launched: &Launched, msg: &str) {
        tracing::error!("step failed: {msg}");
        let mut dead = Plan::default();
        for ls in &launched.seqs {
            if self
                .running
                .iter()
                .any(|s| s.id == ls.id && s.epoch == ls.epoch)
            {
                self.fail_running(ls.id, msg, &mut dead);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{ToyConfig, ToyExecutor};
    use crate::{EngineConfig, EngineCore, Request, SamplingParams};
    use k3_model::Executor;

    /// Pages given to the single sequence of each of `steps` steps, after `prompt` tokens.
    fn pages_per_step(arena_bytes: usize, prompt: usize, steps: usize) -> Vec<usize> {
        let mut exec = ToyExecutor::new(ToyConfig {
            arena_bytes,
            ..Default::default()
        })
        .unwrap();
        let cfg = EngineConfig {
            prefix_cache: false,
            ..EngineConfig::default()
        };
        let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg).unwrap();
        let sampling = SamplingParams {
            temperature: 0.0,
            max_tokens: Some(100),
            ..Default::default()
        };
        let _rx = core
            .submit(Request::new(0, (0..prompt as u32).collect(), sampling))
            .unwrap();
        let mut pages = Vec::new();
        for _ in 0..steps {
            let Some((job, l)) = core.schedule().and_then(|p| core.launch(p)) else {
                break;
            };
            pages.push(job.seqs[0].kv_pages.len());
            core.complete(l, job.run(&mut exec));
        }
        pages
    }

    #[test]
    fn a_decode_step_holds_its_next_positions_page_when_one_is_free() {
        // 4-token pages, a 7-token prompt: the prefill needs 2 pages; the decode step at
        // position 7 needs 2 and is given the 3rd its successor at 8 needs, so the two steps
        // see the same pages (the executor can prepare the second while the first runs).
        assert_eq!(pages_per_step(1 << 16, 7, 4), vec![2, 3, 3, 3]);
        // Room for the request's state slots (4) and two pages only: no page ahead, the step
        // still runs.
        let tight = 4 * 64 + 2 * 64;
        assert_eq!(pages_per_step(tight, 7, 2)[..2], [2, 2]);
    }
}
