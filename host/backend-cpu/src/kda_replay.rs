//! ReplaySSM for KDA on the CPU (docs/speculative-decoding.md, "ReplaySSM on the CPU").
//!
//! Speculative verification runs a KDA layer over the `T = ℓ + 1` tokens of a draft, but only a
//! prefix of `n ≤ T` of them is accepted. Instead of saving the state after every token (a
//! `K×V` snapshot per head and step), [`verify_layer`] reads the committed state and conv windows
//! without writing them and records each step's inputs to the recurrence; after acceptance,
//! [`commit_layer`] replays the first `n` steps into the committed state in place and rolls the
//! conv windows to end at the last accepted token.
//!
//! Both halves reuse the decode path's own functions (`conv_qkv`, `head_inputs`, `run_head`
//! without chunking, and the state half of `recurrent_step`), so verify outputs and the replayed
//! state are bit-identical to decoding the accepted tokens one at a time with
//! [`kda_layer`](crate::kda::kda_layer).

use crate::kda::{Dims, conv_qkv, decay_and_correct, head_inputs, run_head, window_at};
use crate::simd::{axpy, simd_fn};
use rayon::prelude::*;

/// What [`commit_layer`] needs to replay any prefix of a verified block of one layer.
///
/// Layout (all f32, head-major so that one head's replay reads contiguous memory):
/// - `k`: `[H, T, K]` the normalised keys k̂ exactly as `recurrent_step` consumes them
///   (after conv, SiLU and the L2 norm);
/// - `v`: `[H, T, V]` values after conv and SiLU;
/// - `g`: `[H, T, K]` the activated per-channel log decay (the safe gate's output);
/// - `beta`: `[H, T]` post-sigmoid;
/// - `pre_conv`: the q, k, v projections before the conv, `[T, H·K]` each: a conv window is the
///   last `W − 1` pre-conv inputs, so rolling it to any accepted prefix needs these rows.
///
/// q̂ is not kept: it only affects the outputs, which verify has already produced.
#[derive(Debug, Clone)]
pub struct VerifyRecord {
    dims: Dims,
    steps: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    pre_conv: [Vec<f32>; 3],
}

impl VerifyRecord {
    /// Verified tokens `T`; [`commit_layer`] accepts any count in `0..=T`.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// f32 values held per verified step and head: `2K + V + 1` for the recurrence plus
    /// `3K` pre-conv inputs for the windows (with `V = K` in K3: `6K + 1`).
    pub fn floats_per_step_per_head(d: &Dims) -> usize {
        let (kd, vd) = (d.k, d.k);
        (2 * kd + vd + 1) + 3 * kd
    }

    /// f32 values held in total: `T · H ·` [`Self::floats_per_step_per_head`].
    pub fn floats(&self) -> usize {
        self.k.len()
            + self.v.len()
            + self.g.len()
            + self.beta.len()
            + self.pre_conv.iter().map(Vec::len).sum::<usize>()
    }

    /// The record as one flat buffer of [`Self::floats`] values, its fields in the order
    /// documented on the type: how the CPU backend keeps it in the arena between verify and
    /// commit.
    pub fn write_to(&self, dst: &mut [f32]) {
        let mut at = 0;
        for part in [&self.k, &self.v, &self.g, &self.beta]
            .into_iter()
            .chain(self.pre_conv.iter())
        {
            dst[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
    }

    /// The record of `steps` verified tokens that [`Self::write_to`] wrote into `src`.
    pub fn read_from(dims: Dims, steps: usize, src: &[f32]) -> Self {
        let (h, kd, hk) = (dims.heads, dims.k, dims.hk());
        let mut at = 0;
        let mut take = |n: usize| {
            let part = src[at..at + n].to_vec();
            at += n;
            part
        };
        VerifyRecord {
            dims,
            steps,
            k: take(h * steps * kd),
            v: take(h * steps * kd),
            g: take(h * steps * kd),
            beta: take(h * steps),
            pre_conv: [take(steps * hk), take(steps * hk), take(steps * hk)],
        }
    }
}

/// Verify `t` tokens of one KDA layer from the committed conv `windows` (`[3, H·K, W−1]`) and
/// state `s` (`[H, K, V]`); neither is written. The two slices are the halves of the layer's
/// state region as [`kda_layer`](crate::kda::kda_layer) takes it
/// (`split_at(3 * d.window_floats())`); the other inputs are the same as there.
///
/// Returns `o` `[T, H·V]`, bit-identical to `t` one-token calls of `kda_layer`, and the record
/// from which [`commit_layer`] replays an accepted prefix.
pub fn verify_layer(
    d: &Dims,
    t: usize,
    qkv: [&[f32]; 3],
    conv_w: [&[f32]; 3],
    f: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    windows: &[f32],
    s: &[f32],
) -> (Vec<f32>, VerifyRecord) {
    let (hk, kd, wf) = (d.hk(), d.k, d.window_floats());
    assert_eq!(windows.len(), 3 * wf, "conv windows of another shape");
    assert_eq!(s.len(), d.heads * kd * kd, "KDA state of another shape");
    // Each output row of the conv depends only on its own `W` inputs, so one call over `t`
    // tokens gives the same bits as `t` one-token calls with the rolled window.
    let conv = conv_qkv(d, t, qkv, conv_w, windows);
    // Per token and head, exactly the normalisation and gating of a one-token call.
    let heads = head_inputs(d, t, &conv[0], &conv[1], &conv[2], f, b, a_log, dt_bias);
    // One scratch copy of each head's state, stepped token by token with the decode kernel; the
    // committed state is only read.
    let outs: Vec<Vec<f32>> = s
        .par_chunks(kd * kd)
        .zip(heads.par_iter())
        .map(|(sh, hi)| {
            let mut scratch = sh.to_vec();
            run_head(&mut scratch, kd, hi, t, &[], false).0
        })
        .collect();
    let mut o = vec![0f32; t * hk];
    for (h, oh) in outs.iter().enumerate() {
        for tt in 0..t {
            o[tt * hk + h * kd..tt * hk + (h + 1) * kd]
                .copy_from_slice(&oh[tt * kd..(tt + 1) * kd]);
        }
    }
    let mut record = VerifyRecord {
        dims: *d,
        steps: t,
        k: Vec::with_capacity(d.heads * t * kd),
        v: Vec::with_capacity(d.heads * t * kd),
        g: Vec::with_capacity(d.heads * t * kd),
        beta: Vec::with_capacity(d.heads * t),
        pre_conv: [0, 1, 2].map(|i| qkv[i][..t * hk].to_vec()),
    };
    for hi in &heads {
        record.k.extend_from_slice(&hi.k);
        record.v.extend_from_slice(&hi.v);
        record.g.extend_from_slice(&hi.g);
        record.beta.extend_from_slice(&hi.beta);
    }
    (o, record)
}

simd_fn! {
    /// The state half of `recurrent_step`: the same decay, correction and rank-1 update in the
    /// same order, without reading out `o` (verify already did).
    fn replay_step(s: &mut [f32], kd: usize, k: &[f32], v: &[f32], g: &[f32], beta: f32) {
        let vd = v.len();
        let u = decay_and_correct(s, kd, k, v, g, beta);
        for r in 0..kd {
            axpy(k[r], &u, &mut s[r * vd..(r + 1) * vd]);
        }
    }
}

/// Commit the first `accepted` tokens of a verified block: replay them into the committed state
/// `s` (`[H, K, V]`) in place and roll the conv `windows` (`[3, H·K, W−1]`) to end at the last
/// accepted token. `s` and `windows` must be the ones [`verify_layer`] read, unchanged since.
/// Afterwards both are bit-identical to having decoded those `accepted` tokens one at a time.
///
/// # Panics
/// If `accepted > record.steps()` or the slices do not have the record's shapes.
pub fn commit_layer(s: &mut [f32], windows: &mut [f32], record: &VerifyRecord, accepted: usize) {
    let d = &record.dims;
    let (t, hk, kd, wf) = (record.steps, d.hk(), d.k, d.window_floats());
    assert!(accepted <= t, "accepted {accepted} of {t} verified tokens");
    assert_eq!(windows.len(), 3 * wf, "conv windows of another shape");
    assert_eq!(s.len(), d.heads * kd * kd, "KDA state of another shape");
    let replay_head = |(h, sh): (usize, &mut [f32])| {
        // `run_head` decodes with denormals flushed; the replay must round the same way.
        let _ftz = crate::simd::FlushDenormals::new();
        let base = h * t;
        for step in 0..accepted {
            let (kr, br) = ((base + step) * kd, base + step);
            replay_step(
                sh,
                kd,
                &record.k[kr..kr + kd],
                &record.v[kr..kr + kd],
                &record.g[kr..kr + kd],
                record.beta[br],
            );
        }
    };
    // Heads are independent; a single step is too small to pay for a fork/join (as in decode).
    if accepted > 1 {
        s.par_chunks_mut(kd * kd).enumerate().for_each(replay_head);
    } else {
        s.chunks_mut(kd * kd).enumerate().for_each(replay_head);
    }
    for i in 0..3 {
        let w = &mut windows[i * wf..(i + 1) * wf];
        let rolled = window_at(&record.pre_conv[i], hk, d.conv, w, accepted);
        w.copy_from_slice(&rolled);
    }
}

/// Snapshot floats per step and head that ReplaySSM avoids: one `K×V` state.
pub fn snapshot_floats_per_step_per_head(d: &Dims) -> usize {
    d.k * d.k
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kda::kda_layer;
    use crate::kda::tests::rand;

    /// One layer's weights, `t` tokens of inputs and a committed state region.
    struct Case {
        d: Dims,
        t: usize,
        qkv: [Vec<f32>; 3],
        conv_w: [Vec<f32>; 3],
        f: Vec<f32>,
        b: Vec<f32>,
        a_log: Vec<f32>,
        dt_bias: Vec<f32>,
        region: Vec<f32>,
    }

    impl Case {
        fn new(heads: usize, kd: usize, t: usize, seed: u64) -> Self {
            let mut seed = seed;
            let d = Dims {
                heads,
                k: kd,
                conv: 4,
                lower_bound: -5.0,
            };
            let hk = d.hk();
            let mut region = rand(3 * d.window_floats(), &mut seed, 1.0);
            region.extend(rand(heads * kd * kd, &mut seed, 0.5));
            Self {
                d,
                t,
                qkv: [0, 1, 2].map(|_| rand(t * hk, &mut seed, 1.0)),
                conv_w: [0, 1, 2].map(|_| rand(hk * d.conv, &mut seed, 0.7)),
                f: rand(t * hk, &mut seed, 3.0),
                b: rand(t * heads, &mut seed, 2.0),
                a_log: rand(heads, &mut seed, 0.5),
                dt_bias: rand(hk, &mut seed, 1.0),
                region,
            }
        }

        /// Plain decoding: `t` one-token calls of `kda_layer`. Returns the outputs `[T, H·V]`
        /// and the state region after each prefix `0..=T`.
        fn decode(&self) -> (Vec<f32>, Vec<Vec<f32>>) {
            let (d, hk) = (&self.d, self.d.hk());
            let mut region = self.region.clone();
            let mut outs = Vec::with_capacity(self.t * hk);
            let mut after = vec![region.clone()];
            for i in 0..self.t {
                let row = |x: &Vec<f32>, w: usize| x[i * w..(i + 1) * w].to_vec();
                let qkv = [0, 1, 2].map(|j| row(&self.qkv[j], hk));
                let (f, b) = (row(&self.f, hk), row(&self.b, d.heads));
                let (o, _) = kda_layer(
                    d,
                    1,
                    [&qkv[0], &qkv[1], &qkv[2]],
                    [&self.conv_w[0], &self.conv_w[1], &self.conv_w[2]],
                    &f,
                    &b,
                    &self.a_log,
                    &self.dt_bias,
                    &mut region,
                    &[],
                );
                outs.extend(o);
                after.push(region.clone());
            }
            (outs, after)
        }

        fn verify(&self) -> (Vec<f32>, VerifyRecord) {
            let (windows, s) = self.region.split_at(3 * self.d.window_floats());
            verify_layer(
                &self.d,
                self.t,
                [&self.qkv[0], &self.qkv[1], &self.qkv[2]],
                [&self.conv_w[0], &self.conv_w[1], &self.conv_w[2]],
                &self.f,
                &self.b,
                &self.a_log,
                &self.dt_bias,
                windows,
                s,
            )
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Every accepted count 0..=T: outputs, state and windows bit-identical to plain decoding,
    /// and the committed region untouched by verify.
    fn check_bit_identical(case: &Case) {
        let (d, t, hk) = (&case.d, case.t, case.d.hk());
        let wf3 = 3 * d.window_floats();
        let (plain_o, plain_after) = case.decode();
        let committed = bits(&case.region);
        let (o, record) = case.verify();
        assert_eq!(record.steps(), t);
        assert_eq!(
            bits(&case.region),
            committed,
            "verify wrote the committed state"
        );
        for n in 0..=t {
            assert_eq!(
                bits(&o[..n * hk]),
                bits(&plain_o[..n * hk]),
                "outputs of the first {n} tokens"
            );
            let mut region = case.region.clone();
            let (windows, s) = region.split_at_mut(wf3);
            commit_layer(s, windows, &record, n);
            let want = &plain_after[n];
            assert_eq!(bits(s), bits(&want[wf3..]), "state after committing {n}");
            assert_eq!(
                bits(windows),
                bits(&want[..wf3]),
                "windows after committing {n}"
            );
        }
    }

    #[test]
    fn small_heads_match_plain_decoding_bit_for_bit() {
        // K = 12 is not a multiple of the 16-lane vectors: exercises the scalar tails too.
        check_bit_identical(&Case::new(3, 12, 5, 11));
        check_bit_identical(&Case::new(2, 16, 8, 12));
        // T = 1: no drafts, only the bonus position.
        check_bit_identical(&Case::new(2, 16, 1, 13));
    }

    #[test]
    fn k3_head_size_matches_plain_decoding_bit_for_bit() {
        // K3's head size (K = V = 128) at block 7 + bonus, 2 heads as in k3-mini.
        check_bit_identical(&Case::new(2, 128, 8, 21));
    }

    #[test]
    fn commit_can_follow_commit() {
        // Two verify/commit rounds equal plain decoding of the accepted tokens of both.
        let case = Case::new(2, 16, 6, 31);
        let wf3 = 3 * case.d.window_floats();
        let (_, record) = case.verify();
        let mut region = case.region.clone();
        let (w, s) = region.split_at_mut(wf3);
        commit_layer(s, w, &record, 4);
        let (_, plain_after) = case.decode();
        assert_eq!(bits(&region), bits(&plain_after[4]));
        // Round 2 starts from the committed region; its tokens are fresh inputs.
        let mut next = Case::new(2, 16, 3, 32);
        next.region = region;
        check_bit_identical(&next);
    }

    #[test]
    fn record_size_is_documented_size_and_far_below_snapshots() {
        let case = Case::new(3, 12, 5, 41);
        let (_, record) = case.verify();
        let (d, t) = (&case.d, case.t);
        let (kd, vd) = (d.k, d.k);
        // k̂ + v + g + β for the recurrence, then q', k', v' rows for the windows.
        assert_eq!(
            VerifyRecord::floats_per_step_per_head(d),
            2 * kd + vd + 1 + 3 * kd
        );
        assert_eq!(
            record.floats(),
            t * d.heads * VerifyRecord::floats_per_step_per_head(d)
        );
        // At K3's shapes (docs/k3-model.md §1: 96 heads × 128): 769 floats (3,076 B) per step and
        // head against a 16,384-float (64 KiB) state snapshot, 21× less.
        let k3 = Dims {
            heads: 96,
            k: 128,
            conv: 4,
            lower_bound: -5.0,
        };
        assert_eq!(VerifyRecord::floats_per_step_per_head(&k3), 769);
        assert_eq!(snapshot_floats_per_step_per_head(&k3), 16_384);
    }

    #[test]
    #[should_panic(expected = "accepted 6 of 5")]
    fn committing_more_than_verified_panics() {
        let case = Case::new(1, 12, 5, 51);
        let (_, record) = case.verify();
        let mut region = case.region.clone();
        let (w, s) = region.split_at_mut(3 * case.d.window_floats());
        commit_layer(s, w, &record, 6);
    }
}
