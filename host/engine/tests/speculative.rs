//! Speculative decoding in the engine, against the deterministic toy executor (its verify keeps
//! state untouched and its commit replays the accepted steps, like the model's ReplaySSM).
//!
//! - greedy outputs are identical with speculation on and off: alone, mixed with requests that
//!   do not speculate, with the prefix cache on and off, overlapped or not, across multi-turn
//!   conversations, with stop tokens inside a draft;
//! - random mixes with cancels in the middle of verifies keep every invariant and give the pool
//!   back whole;
//! - sampled outputs keep the target's distribution (chi-square against the toy's exact
//!   probabilities, with a drafter whose own distribution is far from the target's).

use anyhow::{Result, bail};
use k3_engine::testing::{ToyConfig, ToyExecutor, reference_greedy};
use k3_engine::{
    EngineConfig, EngineCore, Greedy, Request, RequestError, SamplingParams, SpeculationConfig,
};
use k3_model::{Executor, ForwardBatch, LogitsWant, SeqInput};
use k3_speculative::{
    Draft, DraftSampling, DraftSource, DraftSourceFactory, NgramParams, StepCostProfile,
};
use proptest::prelude::*;
use rand::Rng;
use std::sync::Arc;

fn toy(arena: usize) -> Box<dyn Executor> {
    Box::new(
        ToyExecutor::new(ToyConfig {
            arena_bytes: arena,
            state_bytes: 256,
            ..ToyConfig::default()
        })
        .unwrap(),
    )
}

/// Knows the reference greedy continuation of some prompts and proposes it, wrong at every
/// `wrong_every`-th proposed position (so drafts are accepted, cut and corrected).
struct Oracle {
    known: Arc<Vec<Vec<u32>>>,
    wrong_every: usize,
    tokens: Vec<u32>,
    proposals: usize,
}

impl DraftSource for Oracle {
    fn extend(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    fn propose(&mut self, max: usize, _: &mut DraftSampling<'_>) -> Draft {
        let n = self.tokens.len();
        let Some(seq) = self
            .known
            .iter()
            .find(|s| s.len() > n && s[..n] == self.tokens[..])
        else {
            return Draft::default();
        };
        let mut tokens: Vec<u32> = seq[n..].iter().copied().take(max).collect();
        for t in tokens.iter_mut() {
            self.proposals += 1;
            if self.proposals.is_multiple_of(self.wrong_every) {
                *t = (*t + 1) % 97;
            }
        }
        let confidence = vec![0.9; tokens.len()];
        Draft {
            tokens,
            confidence,
            probs: None,
        }
    }
}

struct OracleFactory {
    known: Arc<Vec<Vec<u32>>>,
    wrong_every: usize,
}

impl DraftSourceFactory for OracleFactory {
    fn method(&self) -> &str {
        "oracle"
    }

    fn create(&self) -> Box<dyn DraftSource> {
        Box::new(Oracle {
            known: self.known.clone(),
            wrong_every: self.wrong_every,
            tokens: Vec::new(),
            proposals: 0,
        })
    }
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens as u32),
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn cfg(cache: bool, overlap: bool, spec: Option<SpeculationConfig>) -> EngineConfig {
    EngineConfig {
        prefix_cache: cache,
        checkpoint_interval: 8,
        step_tokens: 24,
        max_step_tokens: 40,
        few_running: 1,
        max_context: 4096,
        overlap,
        speculation: spec,
        ..EngineConfig::default()
    }
}

fn oracle(known: &[Vec<u32>], wrong_every: usize, max_draft: usize) -> SpeculationConfig {
    SpeculationConfig {
        source: Arc::new(OracleFactory {
            known: Arc::new(known.to_vec()),
            wrong_every,
        }),
        max_draft,
        cost: None,
    }
}

/// Run requests (prompt, max_tokens, speculates) to the end on one core, checking invariants
/// after every step; returns outputs in order, and the core.
fn run(
    exec: &mut dyn Executor,
    config: EngineConfig,
    reqs: &[(Vec<u32>, usize, bool)],
) -> Result<(Vec<Vec<u32>>, EngineCore)> {
    let overlap = config.overlap;
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), config)?;
    let mut rxs = Vec::new();
    for (id, (prompt, max_tokens, speculates)) in reqs.iter().enumerate() {
        let mut r = Request::new(id as u64, prompt.clone(), greedy(*max_tokens));
        if !speculates {
            // A sampler that cannot verify: this request decodes one token per step.
            r.sampler = Some(Box::new(Greedy::default()));
        }
        rxs.push(core.submit(r)?);
    }
    let mut inflight = None;
    let mut steps = 0;
    while if overlap {
        core.step_overlapped(exec, &mut inflight)
    } else {
        core.step(exec)
    } {
        core.check_invariants().map_err(anyhow::Error::msg)?;
        steps += 1;
        if steps > 20_000 {
            bail!("no progress");
        }
    }
    let mut outs = Vec::new();
    for mut rx in rxs {
        let mut out = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            out.push(
                ev.map_err(|e| anyhow::anyhow!("request failed: {e}"))?
                    .token,
            );
        }
        outs.push(out);
    }
    Ok((outs, core))
}

fn prompts() -> Vec<(Vec<u32>, usize)> {
    let system: Vec<u32> = (0..29).map(|i| (i * 7 + 3) % 97).collect();
    vec![
        ([&system[..], &[1, 2, 3]].concat(), 23),
        ([&system[..], &[4, 5]].concat(), 31),
        (vec![42], 17),
        ([&system[..19], &[50, 51]].concat(), 12),
        ((0..40).map(|i| i % 5).collect(), 26),
    ]
}

#[test]
fn greedy_outputs_are_identical_with_speculation_on_and_off() -> Result<()> {
    let mut reference = toy(1 << 16);
    let cases = prompts();
    let want: Vec<Vec<u32>> = cases
        .iter()
        .map(|(p, n)| reference_greedy(reference.as_mut(), p, *n))
        .collect::<Result<_, _>>()?;
    let known: Vec<Vec<u32>> = cases
        .iter()
        .zip(&want)
        .map(|((p, _), w)| [p.as_slice(), w].concat())
        .collect();
    for (cache, overlap, wrong_every, max_draft) in [
        (true, true, 3, 4),
        (false, true, 2, 7),
        (true, false, 5, 6),
        (false, false, 1, 3),
    ] {
        let spec = oracle(&known, wrong_every, max_draft);
        // Every request speculates; then every other one does not (mixed steps).
        for mixed in [false, true] {
            let reqs: Vec<_> = cases
                .iter()
                .enumerate()
                .map(|(i, (p, n))| (p.clone(), *n, !mixed || i % 2 == 0))
                .collect();
            let (outs, core) = run(
                toy(1 << 16).as_mut(),
                cfg(cache, overlap, Some(spec.clone())),
                &reqs,
            )?;
            assert_eq!(
                outs, want,
                "cache {cache}, overlap {overlap}, wrong every {wrong_every}, mixed {mixed}"
            );
            let m = core.metrics();
            assert!(m.spec_verify_rounds > 0, "{m:?}");
            assert_eq!(m.spec_accepted_tokens > 0, wrong_every > 1, "{m:?}");
            if wrong_every == 1 {
                assert_eq!(m.spec_accepted_tokens, 0, "every draft token was wrong");
            }
            let mean = m.spec_mean_acceptance_length().unwrap();
            assert!(mean >= 1.0 && mean <= max_draft as f64 + 1.0);
        }
    }
    Ok(())
}

#[test]
fn prompt_lookup_keeps_greedy_outputs_and_accepts_repeats() -> Result<()> {
    // The toy's continuations are pseudo-random, so matches of one-token suffixes are what
    // the drafter finds; whatever it proposes, the output must be the reference.
    let block: Vec<u32> = (0..12).map(|i| (i * 11 + 5) % 97).collect();
    let prompt = [block.clone(), block.clone(), block[..6].to_vec()].concat();
    let mut reference = toy(1 << 16);
    let want = reference_greedy(reference.as_mut(), &prompt, 20)?;
    let spec = SpeculationConfig {
        source: Arc::new(NgramParams {
            min_n: 1,
            max_n: 3,
            confidence: 0.5,
        }),
        max_draft: 5,
        cost: None,
    };
    let (outs, core) = run(
        toy(1 << 16).as_mut(),
        cfg(true, true, Some(spec)),
        &[(prompt, 20, true)],
    )?;
    assert_eq!(outs[0], want);
    assert!(
        core.metrics().spec_draft_tokens > 0,
        "one-token suffixes recur"
    );
    Ok(())
}

#[test]
fn multi_turn_continuations_hit_checkpoints_written_at_committed_boundaries() -> Result<()> {
    let mut reference = toy(1 << 16);
    let system: Vec<u32> = (0..21).map(|i| (i * 5 + 2) % 97).collect();
    let first = reference_greedy(reference.as_mut(), &system, 30)?;
    let turn2 = [system.as_slice(), &first, &[7, 8, 9]].concat();
    let second = reference_greedy(reference.as_mut(), &turn2, 20)?;
    let known = vec![
        [system.as_slice(), &first].concat(),
        [turn2.as_slice(), &second].concat(),
    ];
    let spec = oracle(&known, 4, 6);
    let mut exec = toy(1 << 16);
    let mut core = EngineCore::new(
        exec.layout(),
        exec.vocab_size(),
        cfg(true, true, Some(spec)),
    )?;
    let mut outs = Vec::new();
    let mut cached = Vec::new();
    for (id, (prompt, n)) in [(system.clone(), 30), (turn2.clone(), 20)]
        .into_iter()
        .enumerate()
    {
        let mut rx = core.submit(Request::new(id as u64, prompt, greedy(n)))?;
        let mut inflight = None;
        while core.step_overlapped(exec.as_mut(), &mut inflight) {
            core.check_invariants().map_err(anyhow::Error::msg)?;
        }
        let mut out = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            let ev = ev.map_err(|e| anyhow::anyhow!("{e}"))?;
            if out.is_empty() {
                cached.push(ev.cached_tokens);
            }
            out.push(ev.token);
        }
        outs.push(out);
    }
    assert_eq!(outs, vec![first, second]);
    // Turn 1 ended at 51 tokens; its decode snapshots sit at multiples of 8 that verifies
    // stopped at, so turn 2 resumes from the one at 48 (not just the prompt's 16).
    assert_eq!(cached[1], Some(48), "{cached:?}");
    Ok(())
}

#[test]
fn a_stop_token_inside_an_accepted_draft_ends_the_request_there() -> Result<()> {
    let prompt: Vec<u32> = (0..9).map(|i| (i * 13 + 1) % 97).collect();
    let mut reference = toy(1 << 16);
    let full = reference_greedy(reference.as_mut(), &prompt, 30)?;
    // The 12th generated token stops the request (first occurrence of it).
    let stop = full[11];
    let cut = full.iter().position(|&t| t == stop).unwrap() + 1;
    let spec = oracle(&[[prompt.as_slice(), &full].concat()], 1000, 7);
    let mut exec = toy(1 << 16);
    let mut core = EngineCore::new(
        exec.layout(),
        exec.vocab_size(),
        cfg(true, true, Some(spec)),
    )?;
    let params = SamplingParams {
        stop_token_ids: vec![stop],
        ..greedy(30)
    };
    let mut rx = core.submit(Request::new(1, prompt, params))?;
    let mut inflight = None;
    while core.step_overlapped(exec.as_mut(), &mut inflight) {}
    let mut out = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        out.push(ev.map_err(|e| anyhow::anyhow!("{e}"))?.token);
    }
    assert_eq!(out, full[..cut].to_vec());
    assert!(core.metrics().spec_accepted_tokens > 0);
    Ok(())
}

#[test]
fn the_planner_drops_drafts_that_cannot_pay() -> Result<()> {
    let cases = prompts();
    let mut reference = toy(1 << 16);
    let known: Vec<Vec<u32>> = cases
        .iter()
        .map(|(p, n)| Ok([p.as_slice(), &reference_greedy(reference.as_mut(), p, *n)?].concat()))
        .collect::<Result<_>>()?;
    // A step whose cost grows with every token (compute-bound): no draft token pays.
    let linear = StepCostProfile::new(vec![(1, 1.0), (100, 100.0)]).unwrap();
    let spec = SpeculationConfig {
        cost: Some(linear),
        ..oracle(&known, 3, 4)
    };
    let reqs: Vec<_> = cases.iter().map(|(p, n)| (p.clone(), *n, true)).collect();
    let (outs, core) = run(toy(1 << 16).as_mut(), cfg(true, true, Some(spec)), &reqs)?;
    let m = core.metrics();
    assert_eq!(m.spec_draft_tokens, 0, "{m:?}");
    assert_eq!(
        outs,
        known
            .iter()
            .zip(&cases)
            .map(|(k, (p, _))| k[p.len()..].to_vec())
            .collect::<Vec<_>>()
    );
    // A flat (memory-bound) step: confident drafts are verified in full.
    let flat = StepCostProfile::new(vec![(1, 1.0), (64, 1.0)]).unwrap();
    let spec = SpeculationConfig {
        cost: Some(flat),
        ..oracle(&known, 3, 4)
    };
    let (_, core) = run(toy(1 << 16).as_mut(), cfg(true, true, Some(spec)), &reqs)?;
    let m = core.metrics();
    assert!(
        m.spec_verify_lengths.get(4).copied().unwrap_or(0) > 0,
        "{m:?}"
    );
    Ok(())
}

#[test]
fn configurations_the_executor_cannot_verify_are_refused() {
    let exec = toy(1 << 16);
    let too_long = oracle(&[], 2, 200);
    assert!(
        EngineCore::new(
            exec.layout(),
            exec.vocab_size(),
            cfg(true, true, Some(too_long))
        )
        .is_err()
    );
    let zero = oracle(&[], 2, 0);
    assert!(
        EngineCore::new(
            exec.layout(),
            exec.vocab_size(),
            cfg(true, true, Some(zero))
        )
        .is_err()
    );
}

#[derive(Debug, Clone)]
enum Op {
    Submit {
        tail: Vec<u32>,
        max_tokens: usize,
        speculates: bool,
    },
    Steps(usize),
    Cancel(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u32..97, 1..12), 1usize..30, any::<bool>())
            .prop_map(|(tail, max_tokens, speculates)| Op::Submit { tail, max_tokens, speculates }),
        4 => (1usize..4).prop_map(Op::Steps),
        2 => any::<usize>().prop_map(Op::Cancel),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Random mixes of speculating and plain requests under memory pressure, cancelled at any
    /// point (including while their verify is in flight): invariants hold after every step,
    /// the pool is whole again at the end, and finished outputs equal the reference.
    #[test]
    fn random_mixes_with_cancels_mid_verify(
        ops in prop::collection::vec(op(), 1..25),
        arena_kib in 6usize..14,
        cache in any::<bool>(),
        overlap in any::<bool>(),
        wrong_every in 1usize..5,
    ) {
        let mut exec = toy(arena_kib * 1024);
        let prefix: Vec<u32> = (0..13).collect();
        let mut reference = toy(1 << 16);
        // The oracle knows every continuation the test can ask for: computed on submit.
        let known = Arc::new(std::sync::Mutex::new(Vec::<Vec<u32>>::new()));
        struct Shared(Arc<std::sync::Mutex<Vec<Vec<u32>>>>, usize);
        impl DraftSourceFactory for Shared {
            fn method(&self) -> &str { "oracle" }
            fn create(&self) -> Box<dyn DraftSource> {
                Box::new(Oracle {
                    known: Arc::new(self.0.lock().unwrap().clone()),
                    wrong_every: self.1,
                    tokens: Vec::new(),
                    proposals: 0,
                })
            }
        }
        let spec = SpeculationConfig {
            source: Arc::new(Shared(known.clone(), wrong_every)),
            max_draft: 5,
            cost: None,
        };
        let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg(cache, overlap, Some(spec))).unwrap();
        let total = core.pool_free_bytes();
        let mut live = Vec::new();
        let mut next_id = 0u64;
        let mut inflight = None;
        for op in ops.into_iter().chain([Op::Steps(20_000)]) {
            match op {
                Op::Submit { tail, max_tokens, speculates } => {
                    let prompt = [prefix.as_slice(), &tail].concat();
                    let want = reference_greedy(reference.as_mut(), &prompt, max_tokens).unwrap();
                    known.lock().unwrap().push([prompt.as_slice(), &want].concat());
                    let mut r = Request::new(next_id, prompt, greedy(max_tokens));
                    if !speculates {
                        r.sampler = Some(Box::new(Greedy::default()));
                    }
                    if let Ok(rx) = core.submit(r) {
                        live.push((next_id, want, rx));
                    }
                    next_id += 1;
                }
                Op::Steps(n) => {
                    for _ in 0..n {
                        let progressed = if overlap {
                            core.step_overlapped(exec.as_mut(), &mut inflight)
                        } else {
                            core.step(exec.as_mut())
                        };
                        core.check_invariants().map_err(TestCaseError::fail)?;
                        if !progressed { break; }
                    }
                }
                Op::Cancel(i) if !live.is_empty() => {
                    let (id, ..) = live.remove(i % live.len());
                    core.cancel(id);
                    core.check_invariants().map_err(TestCaseError::fail)?;
                }
                Op::Cancel(_) => {}
            }
        }
        prop_assert!(core.is_empty());
        for (_, want, mut rx) in live {
            let mut out = Vec::new();
            let mut failed = false;
            while let Ok(item) = rx.try_recv() {
                match item {
                    Ok(ev) => out.push(ev.token),
                    Err(RequestError::OutOfMemory) => failed = true,
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected {e}"))),
                }
            }
            if !failed {
                prop_assert_eq!(out, want);
            }
        }
        core.flush_cache();
        core.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(core.pool_free_bytes(), total, "nothing leaks");
    }
}

/// Samples from a fixed distribution far from the target's: q(v) ∝ (v + 1)² over the vocab.
struct Skewed {
    tokens: usize,
}

fn skewed_q(vocab: usize) -> Vec<f32> {
    let w: Vec<f64> = (0..vocab).map(|v| ((v + 1) * (v + 1)) as f64).collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|x| (x / total) as f32).collect()
}

impl DraftSource for Skewed {
    fn extend(&mut self, tokens: &[u32]) {
        self.tokens += tokens.len();
    }

    fn propose(&mut self, max: usize, sampling: &mut DraftSampling<'_>) -> Draft {
        let DraftSampling::Sample { rng, .. } = sampling else {
            return Draft::default();
        };
        let q = skewed_q(97);
        let mut tokens = Vec::new();
        for _ in 0..max {
            let mut u: f64 = rng.random();
            let mut pick = 96;
            for (v, &p) in q.iter().enumerate() {
                if u < f64::from(p) {
                    pick = v;
                    break;
                }
                u -= f64::from(p);
            }
            tokens.push(pick as u32);
        }
        Draft {
            confidence: vec![0.5; tokens.len()],
            probs: Some(vec![q; tokens.len()]),
            tokens,
        }
    }
}

struct SkewedFactory;

impl DraftSourceFactory for SkewedFactory {
    fn method(&self) -> &str {
        "skewed"
    }

    fn create(&self) -> Box<dyn DraftSource> {
        Box::new(Skewed { tokens: 0 })
    }
}

/// The toy's next-token distribution after `prompt` at temperature 1.
fn target_probs(exec: &mut dyn Executor, prompt: &[u32]) -> Vec<f64> {
    let l = exec.layout();
    let pages: Vec<usize> = (0..prompt.len().div_ceil(l.page_tokens))
        .map(|i| l.arena_bytes - (i + 1) * l.kv_page_bytes)
        .collect();
    exec.arena_zero(0, l.state_block_bytes).unwrap();
    let out = exec
        .forward(&ForwardBatch {
            seqs: vec![SeqInput {
                tokens: prompt,
                start_pos: 0,
                kv_pages: &pages,
                state_block: 0,
                checkpoints: &[],
                logits: LogitsWant::Last,
            }],
            ..Default::default()
        })
        .unwrap();
    let row = out.row(out.row_ranges[0].end - 1);
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = row.iter().map(|&x| f64::from(x - max).exp()).collect();
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

/// Pearson's statistic of `counts` against `probs` over cells with expected count ≥ 5 (the
/// rest pooled into one cell), and its degrees of freedom.
fn chi_square(counts: &[usize], probs: &[f64], n: usize) -> (f64, usize) {
    let (mut stat, mut cells, mut rest_c, mut rest_e) = (0.0, 0, 0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e >= 5.0 {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        } else {
            rest_c += c as f64;
            rest_e += e;
        }
    }
    if rest_e > 0.0 {
        stat += (rest_c - rest_e).powi(2) / rest_e;
        cells += 1;
    }
    (stat, cells - 1)
}

#[test]
fn sampled_outputs_keep_the_target_distribution() -> Result<()> {
    let vocab = 97;
    let prompt = vec![42u32];
    let mut reference = toy(1 << 16);
    let p1 = target_probs(reference.as_mut(), &prompt);
    // The second token's marginal: Σ_a p(a) p(· | a).
    let mut p2 = vec![0.0; vocab];
    for (a, &pa) in p1.iter().enumerate() {
        for (b, pb) in target_probs(reference.as_mut(), &[42, a as u32])
            .iter()
            .enumerate()
        {
            p2[b] += pa * pb;
        }
    }
    let spec = SpeculationConfig {
        source: Arc::new(SkewedFactory),
        max_draft: 3,
        cost: None,
    };
    let n = 3000;
    let mut exec = toy(1 << 18);
    let mut core = EngineCore::new(
        exec.layout(),
        exec.vocab_size(),
        cfg(false, true, Some(spec)),
    )?;
    let (mut c1, mut c2) = (vec![0usize; vocab], vec![0usize; vocab]);
    for batch in 0..n / 100 {
        let mut rxs = Vec::new();
        for i in 0..100 {
            let params = SamplingParams {
                temperature: 1.0,
                max_tokens: Some(2),
                ignore_eos: true,
                seed: Some((batch * 100 + i) as u64),
                ..SamplingParams::default()
            };
            rxs.push(core.submit(Request::new(
                (batch * 100 + i) as u64,
                prompt.clone(),
                params,
            ))?);
        }
        let mut inflight = None;
        while core.step_overlapped(exec.as_mut(), &mut inflight) {}
        for mut rx in rxs {
            let out: Vec<u32> = std::iter::from_fn(|| rx.try_recv().ok())
                .map(|e| e.map(|e| e.token))
                .collect::<Result<_, _>>()
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            assert_eq!(out.len(), 2);
            c1[out[0] as usize] += 1;
            c2[out[1] as usize] += 1;
        }
    }
    let m = core.metrics();
    assert!(
        m.spec_accepted_tokens > 0 && m.spec_accepted_tokens < m.spec_draft_tokens,
        "{m:?}"
    );
    // 99.9th percentile of chi-square with d degrees of freedom, d ≤ 96 here: below
    // d + 3.1·√(2d) + 10 (a loose Wilson–Hilferty bound); a biased rule overshoots by hundreds.
    for (name, counts, probs) in [("first", &c1, &p1), ("second", &c2, &p2)] {
        let (stat, dof) = chi_square(counts, probs, n);
        let bound = dof as f64 + 3.1 * (2.0 * dof as f64).sqrt() + 10.0;
        assert!(
            stat < bound,
            "{name} token: chi-square {stat:.1} over {dof} dof (bound {bound:.1})"
        );
    }
    // The drafter's own distribution would fail the same test by far.
    let q = skewed_q(vocab);
    let q64: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
    let (stat, dof) = chi_square(&c1, &q64, n);
    assert!(
        stat > 10.0 * dof as f64,
        "the test can tell the distributions apart"
    );
    Ok(())
}

/// A drafter slower than the target step: after the first rounds measure it, drafting stops
/// (the early exit), apart from a probe now and then; outputs stay the reference.
#[test]
fn drafting_stops_where_it_cannot_pay() -> Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    struct Slow(Oracle, Arc<AtomicUsize>);
    impl DraftSource for Slow {
        fn extend(&mut self, tokens: &[u32]) {
            self.0.extend(tokens);
        }
        fn propose(&mut self, max: usize, s: &mut DraftSampling<'_>) -> Draft {
            self.1.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(10));
            self.0.propose(max, s)
        }
    }
    struct SlowFactory(Arc<Vec<Vec<u32>>>, Arc<AtomicUsize>);
    impl DraftSourceFactory for SlowFactory {
        fn method(&self) -> &str {
            "slow"
        }
        fn create(&self) -> Box<dyn DraftSource> {
            let oracle = Oracle {
                known: self.0.clone(),
                wrong_every: 1000,
                tokens: Vec::new(),
                proposals: 0,
            };
            Box::new(Slow(oracle, self.1.clone()))
        }
    }
    let prompt = vec![3u32, 1, 4, 1, 5];
    let mut reference = toy(1 << 16);
    let want = reference_greedy(reference.as_mut(), &prompt, 200)?;
    let calls = Arc::new(AtomicUsize::new(0));
    let spec = SpeculationConfig {
        source: Arc::new(SlowFactory(
            Arc::new(vec![[prompt.as_slice(), &want].concat()]),
            calls.clone(),
        )),
        max_draft: 4,
        // A 1 ms step whatever its size: only the drafter's 10 ms can make drafting lose.
        cost: Some(StepCostProfile::new(vec![(1, 0.001), (64, 0.001)]).unwrap()),
    };
    let (outs, core) = run(
        toy(1 << 16).as_mut(),
        cfg(false, true, Some(spec)),
        &[(prompt, 200, true)],
    )?;
    assert_eq!(outs[0], want);
    let proposals = calls.load(Ordering::Relaxed);
    assert!(
        (2..12).contains(&proposals),
        "{proposals} proposals; {:?}",
        core.metrics()
    );
    Ok(())
}
