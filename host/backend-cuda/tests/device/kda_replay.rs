//! ReplaySSM for KDA (host/backend-cuda/src/kda/replay.rs, kernels/kda_decode.cu): speculative
//! verify and commit against plain one-token decoding, at K3-like shapes (2 and 8 heads of
//! K = V = 128, conv 4) and T = 1, 4, 8 verified tokens:
//!   kda_replay_matches_decode          (a) verify outputs, (c) the state and windows after
//!                                      committing every accepted count 0..=T: within TOL_FUSED of
//!                                      CUDA decoding and of the CPU backend's; (b) verify leaves
//!                                      the state and windows bit for bit unchanged
//!   kda_replay_bit_identical_to_decode the same against CUDA decoding bit for bit: verify and
//!                                      commit run the decode kernel's own step in its order
//!   kda_replay_mixed_batch_matches_apart (d) two verifies, a decode and a prefill chunk in one
//!                                      kda_batch (and both commits in one kda_commit) give the
//!                                      bits of running each alone
//! Every state region is derived by copies from one prefill in one arena, so CUDA-vs-CUDA
//! comparisons do not depend on the prefill kernels being run-to-run deterministic.

use super::*;
use k3_model::backend::KdaCommit;

const HEADS: [usize; 2] = [2, 8];
const TOKENS: [usize; 3] = [1, 4, 8];
/// Tokens prefilled before the verify, so the state and the conv windows are not zero.
const PREFILL: usize = 9;

fn geom(heads: usize) -> KdaGeom {
    KdaGeom {
        heads,
        head_dim: 128,
        conv_kernel: 4,
        gate_lower_bound: -5.0,
    }
}

/// Host inputs of `t` tokens: q, k, v, f `[t, H·K]`, b `[t, H]`.
#[derive(Clone)]
struct Rows {
    t: usize,
    x: [Vec<f32>; 5],
}

impl Rows {
    fn random(r: &mut Rng, g: KdaGeom, t: usize) -> Self {
        let hk = g.hk();
        Rows {
            t,
            x: [
                r.vec(t * hk, 1.0),
                r.vec(t * hk, 1.0),
                r.vec(t * hk, 1.0),
                r.vec(t * hk, 2.0),
                r.vec(t * g.heads, 2.0),
            ],
        }
    }

    /// Rows `a..b`.
    fn range(&self, g: KdaGeom, a: usize, b: usize) -> Rows {
        let w = |i: usize| if i == 4 { g.heads } else { g.hk() };
        Rows {
            t: b - a,
            x: std::array::from_fn(|i| self.x[i][a * w(i)..b * w(i)].to_vec()),
        }
    }

    /// These rows, then `other`'s.
    fn stacked(parts: &[&Rows]) -> Rows {
        Rows {
            t: parts.iter().map(|p| p.t).sum(),
            x: std::array::from_fn(|i| parts.iter().flat_map(|p| p.x[i].clone()).collect()),
        }
    }
}

/// One layer's weights on the host.
struct Weights {
    conv: [Vec<f32>; 3],
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
}

impl Weights {
    fn random(r: &mut Rng, g: KdaGeom) -> Self {
        Weights {
            conv: std::array::from_fn(|_| r.vec(g.hk() * g.conv_kernel, 0.5)),
            a_log: r.vec(g.heads, 0.5),
            dt_bias: r.vec(g.hk(), 0.5),
        }
    }
}

/// The weights uploaded to one backend.
struct Layer<B: Backend> {
    g: KdaGeom,
    conv: Vec<B::Vector>,
    a_log: B::Vector,
    dt_bias: B::Vector,
}

impl<B: Backend> Layer<B> {
    fn new(be: &B, g: KdaGeom, w: &Weights) -> Self {
        Layer {
            g,
            conv: w
                .conv
                .iter()
                .map(|c| be.vector(c.clone()).unwrap())
                .collect(),
            a_log: be.vector(w.a_log.clone()).unwrap(),
            dt_bias: be.vector(w.dt_bias.clone()).unwrap(),
        }
    }

    fn params(&self) -> KdaParams<'_, B> {
        KdaParams {
            conv: [&self.conv[0], &self.conv[1], &self.conv[2]],
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
        }
    }

    fn acts(&self, be: &B, rows: &Rows) -> Vec<B::Act> {
        let ids: Vec<u32> = (0..rows.t as u32).collect();
        (0..5)
            .map(|i| {
                let w = if i == 4 { self.g.heads } else { self.g.hk() };
                let m = be.linear(rows.t, w, rows.x[i].clone()).unwrap();
                be.embed(&m, &ids).unwrap()
            })
            .collect()
    }

    /// `kda` of one sequence; returns `o`.
    fn kda(&self, be: &B, arena: &mut B::Arena, rows: &Rows, loc: KdaStateLoc<'_>) -> Vec<f32> {
        let a = self.acts(be, rows);
        let inputs = KdaInputs {
            qkv: [&a[0], &a[1], &a[2]],
            f: &a[3],
            b: &a[4],
        };
        let o = be
            .kda(arena, self.g, &self.params(), &inputs, loc)
            .unwrap_or_else(|e| panic!("kda of {} tokens (record {:?}): {e}", rows.t, loc.record));
        be.to_host(&o).unwrap()
    }

    /// One layer's state region (conv windows, then S) at byte `off`.
    fn state(&self, be: &B, arena: &B::Arena, off: usize) -> Vec<f32> {
        bytes_to_f32(
            &be.arena_read(arena, off, 4 * self.g.state_floats())
                .unwrap(),
        )
    }
}

fn plain(offset: usize) -> KdaStateLoc<'static> {
    KdaStateLoc {
        offset,
        checkpoints: &[],
        record: None,
    }
}

/// What one backend gives for one case.
struct Outcome {
    /// Plain decoding of the T tokens one at a time: outputs `[T, H·V]`, and the state region
    /// after each prefix 0..=T.
    decode_o: Vec<f32>,
    decode_states: Vec<Vec<f32>>,
    /// Verify (when asked): outputs, whether the state region was bit for bit unchanged, and the
    /// region after committing each accepted count 0..=T (all commits in one call).
    verify_o: Vec<f32>,
    unchanged: bool,
    committed: Vec<Vec<f32>>,
}

/// Prefill, then plain decoding and (with `verify`) verify + commit, all from copies of the one
/// prefilled region. Arena blocks: 0 prefilled, 1 decoding, 2 verified, 3.. commit targets, then
/// the record. `shift` bytes offset every block (4: exercises the unaligned state accesses).
fn run_case<B: Backend>(
    be: &B,
    g: KdaGeom,
    w: &Weights,
    pre: &Rows,
    new: &Rows,
    verify: bool,
    shift: usize,
) -> Outcome {
    let layer = Layer::new(be, g, w);
    let (t, hk, sb) = (new.t, g.hk(), 4 * g.state_floats());
    let block = |i: usize| shift + i * sb;
    let rec = block(3 + t + 1);
    let mut arena = be.arena(rec + 4 * t * g.record_floats_per_token()).unwrap();
    let len = be.arena_len(&arena);
    be.arena_zero(&mut arena, 0, len).unwrap();
    layer.kda(be, &mut arena, pre, plain(block(0)));
    let before = layer.state(be, &arena, block(0));

    be.arena_copy(&mut arena, block(0), block(1), sb).unwrap();
    let mut out = Outcome {
        decode_o: Vec::with_capacity(t * hk),
        decode_states: vec![before.clone()],
        verify_o: Vec::new(),
        unchanged: true,
        committed: Vec::new(),
    };
    for i in 0..t {
        out.decode_o
            .extend(layer.kda(be, &mut arena, &new.range(g, i, i + 1), plain(block(1))));
        out.decode_states.push(layer.state(be, &arena, block(1)));
    }
    if !verify {
        return out;
    }
    be.arena_copy(&mut arena, block(0), block(2), sb).unwrap();
    let loc = KdaStateLoc {
        offset: block(2),
        checkpoints: &[],
        record: Some(rec),
    };
    out.verify_o = layer.kda(be, &mut arena, new, loc);
    let after = layer.state(be, &arena, block(2));
    out.unchanged = bits(&after) == bits(&before);
    let commits: Vec<KdaCommit> = (0..=t)
        .map(|n| {
            be.arena_copy(&mut arena, block(2), block(3 + n), sb)
                .unwrap();
            KdaCommit {
                state: block(3 + n),
                record: rec,
                tokens: t,
                accepted: n,
            }
        })
        .collect();
    be.kda_commit(&mut arena, g, &commits)
        .unwrap_or_else(|e| panic!("kda_commit of {} commits: {e}", commits.len()));
    out.committed = (0..=t)
        .map(|n| layer.state(be, &arena, block(3 + n)))
        .collect();
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `None` when `a` and `b` are bit for bit equal, else where they first differ and the relative
/// error of the whole tensor.
fn bit_diff(a: &[f32], b: &[f32]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("lengths {} vs {}", a.len(), b.len()));
    }
    let i = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())?;
    Some(format!(
        "first differs at {i} of {} ({} vs {}), rel_err {:.3e}",
        a.len(),
        a[i],
        b[i],
        rel_err(a, b)
    ))
}

/// A fresh case: weights, PREFILL tokens, then `t` tokens to verify.
fn case(r: &mut Rng, g: KdaGeom, t: usize) -> (Weights, Rows, Rows) {
    (
        Weights::random(r, g),
        Rows::random(r, g, PREFILL),
        Rows::random(r, g, t),
    )
}

#[test]
fn kda_replay_matches_decode() {
    let Some(gpu) = cuda() else { return };
    let cpu = CpuBackend::new();
    let seed = Rng::new("kda_replay_matches_decode").0;
    let mut tab = Table::new("");
    for heads in HEADS {
        for t in TOKENS {
            let g = geom(heads);
            let (w, pre, new) = case(&mut Rng(seed ^ (heads * 100 + t) as u64), g, t);
            let shift = if heads == 2 { 4 } else { 0 };
            let c = run_case(&cpu, g, &w, &pre, &new, false, shift);
            let d = run_case(&gpu, g, &w, &pre, &new, true, shift);
            let name = format!("kda replay H={heads} T={t}");
            tab.check(
                &format!("{name} verify o vs cuda decode"),
                &d.verify_o,
                &d.decode_o,
                TOL_FUSED,
            );
            tab.check(
                &format!("{name} verify o vs cpu decode"),
                &d.verify_o,
                &c.decode_o,
                TOL_FUSED,
            );
            println!(
                "op={name} verify leaves state+windows bitwise-unchanged={}",
                d.unchanged
            );
            if !d.unchanged {
                tab.failed
                    .push(format!("{name}: verify wrote the state or windows"));
            }
            for n in 0..=t {
                let got = &d.committed[n];
                tab.check(
                    &format!("{name} commit {n}/{t} state+windows vs cuda decode"),
                    got,
                    &d.decode_states[n],
                    TOL_FUSED,
                );
                tab.check(
                    &format!("{name} commit {n}/{t} state+windows vs cpu decode"),
                    got,
                    &c.decode_states[n],
                    TOL_FUSED,
                );
            }
            let bitwise = bit_diff(&d.verify_o, &d.decode_o).is_none()
                && (0..=t).all(|n| bit_diff(&d.committed[n], &d.decode_states[n]).is_none());
            println!("op={name} bitwise-equal to cuda decode={bitwise}");
        }
    }
    tab.finish();
}

#[test]
fn kda_replay_bit_identical_to_decode() {
    let Some(gpu) = cuda() else { return };
    let seed = Rng::new("kda_replay_bit_identical_to_decode").0;
    let mut failed = Vec::new();
    for heads in HEADS {
        for t in TOKENS {
            let g = geom(heads);
            let (w, pre, new) = case(&mut Rng(seed ^ (heads * 100 + t) as u64), g, t);
            let d = run_case(&gpu, g, &w, &pre, &new, true, 0);
            let name = format!("H={heads} T={t}");
            let mut diffs = Vec::new();
            if let Some(e) = bit_diff(&d.verify_o, &d.decode_o) {
                diffs.push(format!("{name} verify o: {e}"));
            }
            for n in 0..=t {
                if let Some(e) = bit_diff(&d.committed[n], &d.decode_states[n]) {
                    diffs.push(format!("{name} commit {n}/{t}: {e}"));
                }
            }
            println!("op=kda replay {name} bitwise-equal={}", diffs.is_empty());
            failed.extend(diffs);
        }
    }
    assert!(
        failed.is_empty(),
        "ReplaySSM on CUDA is not bit-identical to CUDA decoding (kda_replay_matches_decode \
         says whether it is within tolerance): {failed:#?}"
    );
}

/// One sequence's state location, owning its checkpoints: (offset, checkpoints, record).
struct SeqLoc(usize, Vec<(usize, usize)>, Option<usize>);

impl SeqLoc {
    fn loc(&self) -> KdaStateLoc<'_> {
        KdaStateLoc {
            offset: self.0,
            checkpoints: &self.1,
            record: self.2,
        }
    }
}

#[test]
fn kda_replay_mixed_batch_matches_apart() {
    let Some(gpu) = cuda() else { return };
    let seed = Rng::new("kda_replay_mixed_batch_matches_apart").0;
    let mut failed = Vec::new();
    for heads in HEADS {
        let g = geom(heads);
        let r = &mut Rng(seed ^ heads as u64);
        let w = Weights::random(r, g);
        let layer = Layer::new(&gpu, g, &w);
        // In batch order: a verify of 4, a decode (with a checkpoint), a prefill chunk of 5
        // (checkpoint after 3), a verify of 8.
        let tokens = [4usize, 1, 5, 8];
        let rows: Vec<Rows> = tokens.iter().map(|&t| Rows::random(r, g, t)).collect();
        let sb = 4 * g.state_floats();
        let rec_bytes = |t: usize| 4 * t * g.record_floats_per_token();
        // Blocks 0..4: the prefilled states; 4..8 batch run, 8..10 its checkpoints (decode, chunk);
        // 10..14 apart run, 14..16 its checkpoints; then the records (batch V1, V2, apart V1, V2).
        let recs0 = 16 * sb;
        let recs = [
            recs0,
            recs0 + rec_bytes(4),
            recs0 + rec_bytes(4) + rec_bytes(8),
            recs0 + 2 * rec_bytes(4) + rec_bytes(8),
        ];
        let mut arena = gpu
            .arena(recs0 + 2 * (rec_bytes(4) + rec_bytes(8)))
            .unwrap();
        let len = gpu.arena_len(&arena);
        gpu.arena_zero(&mut arena, 0, len).unwrap();
        for s in 0..4 {
            let pre = Rows::random(r, g, PREFILL + s);
            layer.kda(&gpu, &mut arena, &pre, plain(s * sb));
            for run in [4, 10] {
                gpu.arena_copy(&mut arena, s * sb, (run + s) * sb, sb)
                    .unwrap();
            }
        }
        let locs_of = |run: usize, ck: usize, rec: [usize; 2]| {
            [
                SeqLoc(run * sb, vec![], Some(rec[0])),
                SeqLoc((run + 1) * sb, vec![(1, ck * sb)], None),
                SeqLoc((run + 2) * sb, vec![(3, (ck + 1) * sb)], None),
                SeqLoc((run + 3) * sb, vec![], Some(rec[1])),
            ]
        };
        let batch_locs = locs_of(4, 8, [recs[0], recs[1]]);
        let apart_locs = locs_of(10, 14, [recs[2], recs[3]]);

        // The batch: one kda_batch over the stacked rows.
        let stacked = Rows::stacked(&rows.iter().collect::<Vec<_>>());
        let a = layer.acts(&gpu, &stacked);
        let mut spans = Vec::new();
        let mut at = 0;
        for &t in &tokens {
            spans.push((at, at + t));
            at += t;
        }
        let locs: Vec<KdaStateLoc<'_>> = batch_locs.iter().map(SeqLoc::loc).collect();
        let inputs = KdaInputs {
            qkv: [&a[0], &a[1], &a[2]],
            f: &a[3],
            b: &a[4],
        };
        let o_batch = gpu
            .to_host(
                &gpu.kda_batch(&mut arena, g, &layer.params(), &inputs, &spans, &locs)
                    .unwrap_or_else(|e| panic!("mixed kda_batch: {e}")),
            )
            .unwrap();

        // Apart: one kda per sequence.
        let mut o_apart = Vec::new();
        for (i, l) in apart_locs.iter().enumerate() {
            o_apart.extend(layer.kda(&gpu, &mut arena, &rows[i], l.loc()));
        }
        let name = format!("H={heads}");
        if let Some(e) = bit_diff(&o_batch, &o_apart) {
            failed.push(format!("{name} outputs: {e}"));
        }
        // States after the step (the verified ones unchanged in both), and the two checkpoints.
        let states = |run: usize, ck: usize| -> Vec<Vec<f32>> {
            let mut v: Vec<Vec<f32>> = (0..4)
                .map(|s| layer.state(&gpu, &arena, (run + s) * sb))
                .collect();
            v.extend((0..2).map(|c| layer.state(&gpu, &arena, (ck + c) * sb)));
            v
        };
        let (sb_batch, sb_apart) = (states(4, 8), states(10, 14));
        let what = [
            "verify 4",
            "decode",
            "chunk",
            "verify 8",
            "decode ckpt",
            "chunk ckpt",
        ];
        for (i, w) in what.iter().enumerate() {
            if let Some(e) = bit_diff(&sb_batch[i], &sb_apart[i]) {
                failed.push(format!("{name} state after the step, {w}: {e}"));
            }
        }
        for (s, w) in [(0, "verify 4"), (3, "verify 8")] {
            if let Some(e) = bit_diff(&sb_batch[s], &layer.state(&gpu, &arena, s * sb)) {
                failed.push(format!(
                    "{name} {w}: verify in a batch wrote its state: {e}"
                ));
            }
        }
        // Commits: both of the batch in one call, those of the apart run one by one.
        let commit = |run: usize, rec: [usize; 2], s: usize, i: usize, accepted: usize| KdaCommit {
            state: (run + s) * sb,
            record: rec[i],
            tokens: tokens[s],
            accepted,
        };
        let (rb, ra) = ([recs[0], recs[1]], [recs[2], recs[3]]);
        gpu.kda_commit(
            &mut arena,
            g,
            &[commit(4, rb, 0, 0, 3), commit(4, rb, 3, 1, 8)],
        )
        .unwrap_or_else(|e| panic!("kda_commit (batch): {e}"));
        for c in [commit(10, ra, 0, 0, 3), commit(10, ra, 3, 1, 8)] {
            gpu.kda_commit(&mut arena, g, &[c])
                .unwrap_or_else(|e| panic!("kda_commit (apart): {e}"));
        }
        for s in [0, 3] {
            let (b, a) = (
                layer.state(&gpu, &arena, (4 + s) * sb),
                layer.state(&gpu, &arena, (10 + s) * sb),
            );
            if let Some(e) = bit_diff(&b, &a) {
                failed.push(format!("{name} committed state of sequence {s}: {e}"));
            }
        }
        println!(
            "op=kda replay mixed batch {name} bitwise-equal-to-apart={}",
            failed.is_empty()
        );
    }
    assert!(
        failed.is_empty(),
        "a mixed KDA batch (verify 4, decode, prefill chunk, verify 8) differs from running each \
         sequence alone: {failed:#?}"
    );
}

/// The harness on the CPU backend (runs everywhere): the decoding half of every case, and all of
/// it, verify and commit bit-identical to decoding, once the CPU backend implements the seam.
#[test]
fn kda_replay_harness_on_cpu() {
    let cpu = CpuBackend::new();
    let seed = Rng::new("kda_replay_harness_on_cpu").0;
    let verify = cpu.supports_kda_verify();
    println!("cpu-selfcheck kda replay: CPU verify/commit implemented={verify}");
    for heads in HEADS {
        let (g, t) = (geom(heads), 4);
        let (w, pre, new) = case(&mut Rng(seed ^ heads as u64), g, t);
        let c = run_case(&cpu, g, &w, &pre, &new, verify, 4);
        assert_eq!(c.decode_o.len(), t * g.hk());
        assert_eq!(c.decode_states.len(), t + 1);
        assert!(
            c.decode_states[0].iter().any(|&v| v != 0.0),
            "prefill left a zero state"
        );
        assert_ne!(bits(&c.decode_states[0]), bits(&c.decode_states[t]));
        if verify {
            assert!(c.unchanged, "CPU verify wrote the state");
            assert!(bit_diff(&c.verify_o, &c.decode_o).is_none());
            for n in 0..=t {
                assert!(
                    bit_diff(&c.committed[n], &c.decode_states[n]).is_none(),
                    "commit {n}"
                );
            }
        }
    }
}
