//! [`ConstrainedSampler`]: a request's sampler behind a grammar. The grammar's matcher lives on
//! a worker thread of its own; after each accepted token the worker computes the next step's
//! mask while that step's forward pass runs, so the sampler (or the executor, for candidates
//! selected where the logits are) only waits when the mask is late.

use std::sync::Arc;
use std::sync::mpsc;

use k3_engine::TokenSampler;
use k3_model::PendingTokenMask;
use k3_model::select::{apply_token_mask, token_mask_allows};
use k3_sampling::SampledToken;
use llguidance::Matcher;
use llguidance::toktrie::{TokEnv, TokTrie};
use parking_lot::{Condvar, Mutex};

use crate::CompiledGrammar;

/// What constrains one request's output.
#[derive(Debug)]
pub struct GrammarPlan {
    pub grammar: CompiledGrammar,
    /// `None`: the grammar applies from the first generated token. `Some(t)`: generation is free
    /// until the output text ends with `t` (special tokens spelled by name); the grammar then
    /// applies to what follows. `t` must end at a token boundary.
    pub trigger: Option<String>,
}

/// The mask of grammar step `step` (tokens consumed so far), or why there is none.
struct Slot {
    step: u64,
    mask: Option<Result<Arc<[u32]>, String>>,
    /// The worker is gone: nothing more will come.
    closed: bool,
}

struct Shared {
    slot: Mutex<Slot>,
    ready: Condvar,
}

impl Shared {
    /// Block until the mask of `step` is published.
    fn wait(&self, step: u64) -> Result<Arc<[u32]>, String> {
        let mut slot = self.slot.lock();
        loop {
            if slot.step == step
                && let Some(m) = &slot.mask
            {
                return m.clone();
            }
            if slot.closed {
                return Err("the grammar worker stopped".into());
            }
            self.ready.wait(&mut slot);
        }
    }

    fn publish(&self, step: u64, mask: Result<Arc<[u32]>, String>) {
        let mut slot = self.slot.lock();
        slot.step = step;
        slot.mask = Some(mask);
        self.ready.notify_all();
    }
}

enum Job {
    /// Compute the first mask.
    Start,
    /// Consume this token, then compute the next mask.
    Advance(u32),
}

/// The matcher's owner: consumes tokens and computes masks, one job at a time.
fn worker(mut matcher: Matcher, jobs: mpsc::Receiver<Job>, shared: Arc<Shared>) {
    struct Close(Arc<Shared>);
    impl Drop for Close {
        fn drop(&mut self) {
            self.0.slot.lock().closed = true;
            self.0.ready.notify_all();
        }
    }
    let _close = Close(shared.clone());
    let eos: Vec<u32> = matcher
        .tok_env()
        .map(|e| e.tok_trie().eos_tokens().to_vec())
        .unwrap_or_default();
    let mut step = 0u64;
    while let Ok(job) = jobs.recv() {
        if let Job::Advance(t) = job {
            step += 1;
            // Once complete, the matcher stops by itself; the EOS that follows ends the output
            // and is not consumed (a stopped matcher treats it as an error).
            let done = matcher.is_stopped() && eos.contains(&t);
            if !done && let Err(e) = matcher.consume_token(t) {
                shared.publish(step, Err(format!("token {t} rejected by the grammar: {e}")));
                continue;
            }
        }
        let mask = matcher
            .compute_mask_or_eos()
            .map(|v| Arc::<[u32]>::from(v.as_slice()))
            .map_err(|e| e.to_string());
        shared.publish(step, mask);
    }
}

enum Phase {
    /// Before the trigger: the last bytes of the output, enough to spot it.
    Free { trigger: Vec<u8>, tail: Vec<u8> },
    /// The grammar applies; `step` = tokens it has consumed.
    Constrained { step: u64 },
}

/// A [`TokenSampler`] that lets only grammar-allowed tokens through: whole rows are masked here
/// on the CPU, candidate lists by the executor ([`TokenSampler::pending_mask`]).
pub struct ConstrainedSampler {
    inner: Box<dyn TokenSampler>,
    env: TokEnv,
    shared: Arc<Shared>,
    jobs: mpsc::Sender<Job>,
    phase: Phase,
}

impl ConstrainedSampler {
    /// `inner` samples among the allowed tokens (the request's usual sampler).
    pub fn new(inner: Box<dyn TokenSampler>, plan: GrammarPlan) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot {
                step: 0,
                mask: None,
                closed: false,
            }),
            ready: Condvar::new(),
        });
        let (jobs, rx) = mpsc::channel();
        let matcher = plan.grammar.matcher;
        let s = shared.clone();
        std::thread::Builder::new()
            .name("k3-grammar".into())
            .spawn(move || worker(matcher, rx, s))?;
        let phase = match plan.trigger.filter(|t| !t.is_empty()) {
            Some(t) => Phase::Free {
                trigger: t.into_bytes(),
                tail: Vec::new(),
            },
            None => {
                // The first mask is computed while the prompt is prefilled.
                let _ = jobs.send(Job::Start);
                Phase::Constrained { step: 0 }
            }
        };
        Ok(Self {
            inner,
            env: plan.grammar.env,
            shared,
            jobs,
            phase,
        })
    }

    /// Whether the grammar applies to the next token (the trigger has been seen, or there is
    /// none).
    pub fn is_constrained(&self) -> bool {
        matches!(self.phase, Phase::Constrained { .. })
    }

    /// The mask for the next token (waiting for it), if the grammar applies.
    fn current_mask(&self) -> Result<Option<Arc<[u32]>>, String> {
        match self.phase {
            Phase::Constrained { step } => self.shared.wait(step).map(Some),
            Phase::Free { .. } => Ok(None),
        }
    }

    /// Record the chosen token: the grammar consumes it (and starts on the next mask), or the
    /// free text grows and may complete the trigger.
    fn accept(&mut self, token: u32) {
        match &mut self.phase {
            Phase::Constrained { step } => {
                *step += 1;
                let _ = self.jobs.send(Job::Advance(token));
            }
            Phase::Free { trigger, tail } => {
                tail.extend_from_slice(token_text(self.env.tok_trie(), token));
                if tail.ends_with(trigger) {
                    self.phase = Phase::Constrained { step: 0 };
                    let _ = self.jobs.send(Job::Start);
                } else if tail.len() > trigger.len() {
                    let cut = tail.len() - trigger.len();
                    tail.drain(..cut);
                }
            }
        }
    }
}

/// The text a token adds: its bytes, or a special token's name.
fn token_text(trie: &TokTrie, token: u32) -> &[u8] {
    if (token as usize) >= trie.vocab_size() {
        return &[];
    }
    let b = trie.token(token);
    match b.first() {
        Some(&TokTrie::SPECIAL_TOKEN_MARKER) => &b[1..],
        _ => b,
    }
}

impl TokenSampler for ConstrainedSampler {
    fn sample(&mut self, logits: &[f32]) -> Result<SampledToken, String> {
        let s = match self.current_mask()? {
            Some(mask) => {
                let mut row = logits.to_vec();
                apply_token_mask(&mut row, &mask);
                if !row.iter().any(|l| l.is_finite()) {
                    return Err("the grammar allows no token here".into());
                }
                self.inner.sample(&row)?
            }
            None => self.inner.sample(logits)?,
        };
        self.accept(s.token);
        Ok(s)
    }

    fn top_k_need(&self) -> Option<usize> {
        self.inner.top_k_need()
    }

    fn sample_top(&mut self, top: &[(u32, f32)]) -> Result<SampledToken, String> {
        let s = match self.current_mask()? {
            // The executor selected among allowed tokens; checked again so an executor that
            // ignores masks cannot break the grammar.
            Some(mask) => {
                let allowed: Vec<(u32, f32)> = top
                    .iter()
                    .copied()
                    .filter(|&(t, _)| token_mask_allows(&mask, t as usize))
                    .collect();
                if allowed.is_empty() {
                    return Err("the grammar allows none of the candidates".into());
                }
                self.inner.sample_top(&allowed)?
            }
            None => self.inner.sample_top(top)?,
        };
        self.accept(s.token);
        Ok(s)
    }

    fn pending_mask(&self) -> Option<PendingTokenMask> {
        let Phase::Constrained { step } = self.phase else {
            return None;
        };
        let shared = self.shared.clone();
        Some(PendingTokenMask::new(move || shared.wait(step)))
    }
}
