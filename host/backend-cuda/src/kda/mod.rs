//! Kimi Delta Attention (docs/k3-model.md): the batched one-token decode kernel over every
//! decoding sequence's state slot, and the chunked prefill of one sequence (a parallel record pass
//! and the state scan for short convs, the one-pass f32 kernels for longer ones); ReplaySSM's
//! verify and commit for speculative decoding in `replay.rs`.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::launch::float_offset;
use cudarc::driver::CudaSlice;
use k3_model::backend::{KdaGeom, KdaInputs, KdaParams, KdaStateLoc};

mod replay;

/// The KDA decode kernel (kernels/kda_decode.cu): a cluster of 4 column-slice blocks per head,
/// whole 128-byte state lines per warp instruction, evict-first state accesses (the state is
/// read and written once per token, so the step is bound by its DRAM traffic).
const KDA_DECODE_KERNEL: &str = "kda_decode_lines_f32";

/// KDA prefill with a short conv (<= 4, K3's) runs in two passes (kernels/kda_prefill_scan.cu):
/// a record pass, parallel over chunks, holds everything that does not depend on the state, then
/// a scan carries the state across chunks. Longer convs take the one-pass f32 kernels of
/// kda_chunk.cu (conv + SiLU, prep, chunked delta rule).
const KDA_SCAN_MAX_CONV: usize = 4;

/// 16-token chunks per record-pass block (KDA_REC_NCH in kernels/kda_prefill_scan.cu).
const KDA_REC_NCH: usize = 8;

/// The record pass: grid (ceil(chunks / 8), heads), 128 threads.
fn kda_rec_launch(tokens: usize, heads: usize) -> Result<Launch> {
    Launch::new((tokens.div_ceil(16 * KDA_REC_NCH), heads, 1), 128)
}

/// The record pass (conv, prep and the state-independent chunk algebra).
const KDA_REC_KERNEL: &str = "kda_prefill_record_f32";

/// The state scan after the record pass (`kda_prefill_scan_f32`).
const KDA_SCAN_KERNEL: &str = "kda_prefill_scan_f32";

/// `kda_prefill_scan_f32`: 32 state columns per 128-thread block (4 warps: 2 column tiles x 2 key
/// halves), grid (V / 32, heads).
fn kda_scan_launch(heads: usize) -> Result<Launch> {
    Launch::new((geometry::KDA_HEAD_DIM / 32, heads, 1), 128)
}

/// Floats of one (16-token chunk, head) record of the record pass (KDA_REC in the kernel).
const KDA_REC_FLOATS: usize = 8576;

/// Tokens per rec + scan segment (a multiple of 16): bounds the record buffer to
/// 512 chunks x H x 34 KiB (1.7 GB at H = 96); the state and windows carry over in the arena.
const KDA_SCAN_SEG: usize = 8192;

/// One sequence's slot for a batched KDA decode: working state offset and an optional checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct KdaSlot {
    pub offset: usize,
    pub checkpoint: Option<usize>,
}

/// Pre-conv inputs of a KDA layer (as in `k3_model::backend::KdaInputs`).
pub struct KdaIn<'a> {
    pub q: &'a DeviceMat,
    pub k: &'a DeviceMat,
    pub v: &'a DeviceMat,
    pub f: &'a DeviceMat,
    pub b: &'a DeviceMat,
}

/// Per-layer KDA parameters on the device.
pub struct KdaWeights<'a> {
    pub conv: [&'a CudaSlice<f32>; 3],
    pub a_log: &'a CudaSlice<f32>,
    pub dt_bias: &'a CudaSlice<f32>,
}

impl CudaBackend {
    /// One decode token for each of `slots.len()` sequences (row i of every input is sequence i).
    /// Returns `o` `[N, H·V]`.
    pub fn kda_decode(
        &self,
        arena: &mut CudaSlice<f32>,
        g: KdaGeom,
        w: &KdaWeights<'_>,
        x: &KdaIn<'_>,
        slots: &[KdaSlot],
    ) -> Result<DeviceMat> {
        let n = slots.len();
        let l = geometry::kda_decode(&g, n)?;
        for m in [x.q, x.k, x.v, x.f] {
            if (m.rows, m.cols) != (n, g.hk()) {
                return Err(CudaError::InvalidArg(format!(
                    "KDA decode input {}x{}, want {n}x{}",
                    m.rows,
                    m.cols,
                    g.hk()
                )));
            }
        }
        if (x.b.rows, x.b.cols) != (n, g.heads) {
            return Err(CudaError::InvalidArg("KDA decode beta logits shape".into()));
        }
        let (len, region) = (arena.len(), g.state_floats());
        let mut offs = Vec::with_capacity(n);
        let mut cks = Vec::with_capacity(n);
        for s in slots {
            offs.push(float_offset(s.offset, region, len)?);
            cks.push(match s.checkpoint {
                Some(c) => float_offset(c, region, len)?,
                None => -1,
            });
        }
        let (offs, cks) = (self.upload_slice(&offs)?, self.upload_slice(&cks)?);
        // The kernel writes all of o (each head's 128 columns): no memset node in the step.
        let o = self.output(n, g.hk())?;
        let (nn, h, conv) = (n as i32, g.heads as i32, g.conv_kernel as i32);
        launch!(self, KDA_DECODE_KERNEL, l;
            &x.q.buf, &x.k.buf, &x.v.buf, &x.f.buf, &x.b.buf, w.conv[0], w.conv[1], w.conv[2], w.a_log,
            w.dt_bias, arena, &offs, &cks, &o.buf, &nn, &h, &conv, &g.gate_lower_bound)?;
        Ok(o)
    }

    /// Prefill of T tokens of one sequence from the state at `offset`, with checkpoints
    /// `(n, byte offset)` (n in 1..=T). Returns `o` `[T, H·V]`.
    pub fn kda_prefill(
        &self,
        arena: &mut CudaSlice<f32>,
        g: KdaGeom,
        w: &KdaWeights<'_>,
        x: &KdaIn<'_>,
        offset: usize,
        checkpoints: &[(usize, usize)],
    ) -> Result<DeviceMat> {
        let t = x.q.rows;
        let [lc, lp, lk] = geometry::kda_prefill(&g, t)?;
        let (len, region) = (arena.len(), g.state_floats());
        let off = float_offset(offset, region, len)?;
        let mut cps: Vec<(usize, usize)> = checkpoints.to_vec();
        cps.sort_unstable();
        let mut ck_n = Vec::with_capacity(cps.len().max(1));
        let mut ck_off = Vec::with_capacity(cps.len().max(1));
        for &(n, dst) in &cps {
            if n == 0 || n > t {
                return Err(CudaError::InvalidArg(format!(
                    "checkpoint after {n} of {t} tokens"
                )));
            }
            ck_n.push(n as i32);
            ck_off.push(float_offset(dst, region, len)?);
        }
        let n_ck = ck_n.len() as i32;
        if ck_n.is_empty() {
            ck_n.push(0); // the kernels never read it; a 0-length upload is not allowed
            ck_off.push(0);
        }
        let (ck_n, ck_off) = (self.upload_slice(&ck_n)?, self.upload_slice(&ck_off)?);
        for m in [x.q, x.k, x.v, x.f] {
            if (m.rows, m.cols) != (t, g.hk()) {
                return Err(CudaError::InvalidArg(format!(
                    "KDA prefill input {}x{}, want {t}x{}",
                    m.rows,
                    m.cols,
                    g.hk()
                )));
            }
        }
        if (x.b.rows, x.b.cols) != (t, g.heads) {
            return Err(CudaError::InvalidArg(
                "KDA prefill beta logits shape".into(),
            ));
        }
        let (tt, hk, conv, h) = (
            t as i32,
            g.hk() as i32,
            g.conv_kernel as i32,
            g.heads as i32,
        );
        if g.conv_kernel <= KDA_SCAN_MAX_CONV {
            // Record pass (conv, prep, chunk algebra; parallel) then the state scan, per segment.
            let o = self.output(t, g.hk())?;
            let mut rec =
                self.uninit::<f32>(t.min(KDA_SCAN_SEG).div_ceil(16) * g.heads * KDA_REC_FLOATS)?;
            let ls = kda_scan_launch(g.heads)?;
            let mut t0 = 0;
            while t0 < t {
                let t1 = (t0 + KDA_SCAN_SEG).min(t);
                let lr = kda_rec_launch(t1 - t0, g.heads)?;
                let (b, e) = (t0 as i32, t1 as i32);
                launch!(self, KDA_REC_KERNEL, lr;
                    &x.q.buf, &x.k.buf, &x.v.buf, &x.f.buf, &x.b.buf, w.conv[0], w.conv[1], w.conv[2], w.a_log,
                    w.dt_bias, &mut rec, &mut *arena, &off, &ck_n, &ck_off, &n_ck, &b, &e, &h, &conv,
                    &g.gate_lower_bound)?;
                launch!(self, KDA_SCAN_KERNEL, ls;
                    &rec, &mut *arena, &off, &ck_n, &ck_off, &n_ck, &o.buf, &x.f.buf, w.a_log, w.dt_bias,
                    &g.gate_lower_bound, &b, &e, &h, &conv)?;
                t0 = t1;
            }
            return Ok(o);
        }
        let (q, k, v) = (
            self.zeros(t, g.hk())?,
            self.zeros(t, g.hk())?,
            self.zeros(t, g.hk())?,
        );
        let mut gate = self.zeros(t, g.hk())?;
        let beta = self.zeros(t, g.heads)?;
        let o = self.zeros(t, g.hk())?;
        // The prep kernel writes the gate over its input: work on a copy of f.
        self.copy_dtod(&x.f.buf, &mut gate.buf)?;
        launch!(self, "kda_conv_silu_f32", lc;
            &x.q.buf, &x.k.buf, &x.v.buf, w.conv[0], w.conv[1], w.conv[2], &q.buf, &k.buf, &v.buf, &mut *arena,
            &off, &ck_n, &ck_off, &n_ck, &tt, &hk, &conv)?;
        launch!(self, "kda_prep_f32", lp;
            &q.buf, &k.buf, &gate.buf, &x.b.buf, &beta.buf, w.a_log, w.dt_bias, &tt, &h, &g.gate_lower_bound)?;
        launch!(self, "kda_chunk_fwd_f32", lk;
            &q.buf, &k.buf, &v.buf, &gate.buf, &beta.buf, &mut *arena, &off, &ck_n, &ck_off, &n_ck, &o.buf, &tt, &h, &conv)?;
        Ok(o)
    }

    pub(crate) fn kda_seq(
        &self,
        arena: &mut CudaSlice<f32>,
        g: KdaGeom,
        p: &KdaParams<'_, Self>,
        inp: &KdaInputs<'_, Self>,
        loc: KdaStateLoc<'_>,
    ) -> Result<DeviceMat> {
        if loc.record.is_some() {
            return self.kda_replay_batch(arena, g, p, inp, &[(0, inp.qkv[0].rows)], &[loc]);
        }
        let (w, x) = kda_parts(p, inp);
        // One token is the recurrent decode kernel; anything else (prefill chunks) goes through
        // the chunked path, which also rejects checkpoints outside 1..=T.
        if let Some(slots) = decode_slots(&[(0, x.q.rows)], &[loc]) {
            return self.kda_decode(arena, g, &w, &x, &slots);
        }
        self.kda_prefill(arena, g, &w, &x, loc.offset, loc.checkpoints)
    }
}

/// The decode kernel's state slots when every sequence has exactly one new token and at most one
/// checkpoint (after it); `None` otherwise (the chunked path).
pub(crate) fn decode_slots(
    spans: &[(usize, usize)],
    locs: &[KdaStateLoc<'_>],
) -> Option<Vec<KdaSlot>> {
    let decode = spans.iter().all(|&(r0, r1)| r1 == r0 + 1)
        && locs.iter().all(|l| matches!(l.checkpoints, [] | [(1, _)]));
    decode.then(|| {
        locs.iter()
            .map(|l| KdaSlot {
                offset: l.offset,
                checkpoint: l.checkpoints.first().map(|&(_, dst)| dst),
            })
            .collect()
    })
}

/// The trait's KDA arguments as the launch wrappers take them.
pub(crate) fn kda_parts<'a>(
    p: &KdaParams<'a, CudaBackend>,
    inp: &KdaInputs<'a, CudaBackend>,
) -> (KdaWeights<'a>, KdaIn<'a>) {
    let w = KdaWeights {
        conv: p.conv,
        a_log: p.a_log,
        dt_bias: p.dt_bias,
    };
    let x = KdaIn {
        q: inp.qkv[0],
        k: inp.qkv[1],
        v: inp.qkv[2],
        f: inp.f,
        b: inp.b,
    };
    (w, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kda_scan_launch_geometry() {
        // K3: 96 heads; 32 state columns per scan block; 8 chunks of 16 tokens per record block.
        let l = kda_scan_launch(96).unwrap();
        assert_eq!((l.grid, l.block), ((4, 96, 1), 128));
        let l = kda_rec_launch(8192, 96).unwrap();
        assert_eq!((l.grid, l.block), ((64, 96, 1), 128));
        assert_eq!(kda_rec_launch(129, 96).unwrap().grid, (2, 96, 1));
        assert!(kda_rec_launch(0, 96).is_err());
    }
}
