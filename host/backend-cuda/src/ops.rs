//! Launch wrappers: one method per op, shapes validated on the host before anything is launched.
//! Arena offsets are in bytes at this API (like `k3_model::backend`) and converted to f32 offsets.

use crate::device::{CudaBackend, DeviceLinear, DeviceMat};
use crate::dispatch::{ExpertPath, ExpertStep, MlaAttend, expert_path};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::options::MlaDecodePrecision;
use cudarc::driver::CudaSlice;
use k3_model::backend::{KdaGeom, MlaGeom, RouterParams, SituParams};

/// `mla_decode`'s kv_b for the W_UK / W_UV products: bf16 as stored, or f32.
#[derive(Clone, Copy)]
enum KvB<'a> {
    Bf16(&'a CudaSlice<u16>),
    F32(&'a CudaSlice<f32>),
}

/// Push every argument (references that outlive the builder), then launch on the stream. Inside
/// a replayable step (graph.rs) the launch is logged first, and a dry pass stops there.
macro_rules! launch {
    ($be:expr, $name:expr, $l:expr; $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let l: $crate::geometry::Launch = $l;
        if $be.step.recording() {
            let words = [$( $crate::graph::StepArg::step_word(&$arg, &$be.step, &$be.stream) ),*];
            $be.step.log_launch($name, &l, &words);
        }
        if $be.step.dry() {
            Ok(())
        } else {
            let f = $be.function($name)?;
            let mut b: cudarc::driver::LaunchArgs<'_> = $be.stream.launch_builder(f);
            $( b.arg($arg); )*
            // SAFETY: argument count and types follow the kernel's C signature (checked against
            // the parsed signatures by the device harness), every buffer is live for the launch.
            unsafe { b.launch(l.config()) }.map(|_| ()).map_err($crate::error::CudaError::from)
        }
    }};
}

/// kernels/mxfp4_tc.cu tc2 (`mxfp4_up_tc2_f32` / `mxfp4_down_tc2_f32`): weight rows per 256-thread
/// block (up: 128 rows of W1 and of W3 = one 128-column super-step of the split intermediate;
/// down: 256 rows of W2), n-tiles of 4 tokens per pass (at most 4), and the split activations'
/// row length in bf16: per 128-column super-step, 128 hi then 128 lo.
const MX_TC2_UP_ROWS: usize = 128;
const MX_TC2_DOWN_ROWS: usize = 256;
const MX_TC2_MAX_NTILES: usize = 4;
fn mx_tc2_row_u16(cols: usize) -> usize {
    cols.div_ceil(128) * 256
}

/// n-tiles per pass: tokens per expert are at most T, so T <= 12 stages fewer (less shared memory).
fn mx_tc2_ntiles(tokens: usize) -> usize {
    tokens.div_ceil(4).clamp(1, MX_TC2_MAX_NTILES)
}

/// kernels/mxfp4_tc.cu MX2 shared memory: 3 stages of 256 weight rows x 64 bytes, their scales
/// and `ntiles` x 8 staged bf16 rows of 272 bytes. At most `geometry::MX_TC2_MAX_SHARED` (two
/// blocks per SM).
fn mx_tc2_shared(ntiles: usize) -> usize {
    3 * (256 * 64 + 256 * 4 + ntiles * 8 * 272)
}

/// Grid of the tc2 expert kernels: `busy` experts x blocks of `rows_per_block` rows.
fn mx_tc2_launch(
    busy: usize,
    rows: usize,
    cols: usize,
    rows_per_block: usize,
    ntiles: usize,
) -> Result<Launch> {
    geometry::check_mx_width(cols)?;
    Launch::new((busy, rows.div_ceil(rows_per_block), 1), 256)?
        .with_opt_in_shared(mx_tc2_shared(ntiles))
}

/// `mxfp4_tc2_split_f32`: one 32-thread block per (row, 128-column super-step).
fn mx_tc2_split_launch(rows: usize, cols: usize) -> Result<Launch> {
    geometry::check_mx_width(cols)?;
    Launch::new((rows, cols.div_ceil(128), 1), 32)
}

/// Tiles the f32 MLA attend prefetches into L2 ahead of the one it reads.
const MLA_TC_PREFETCH_TILES: i32 = 4;

/// Largest k of `top_k_rows` (kernels/sampling.cu TOPK_MAX: the picks are sorted in shared memory).
pub const TOPK_MAX: usize = 1024;
/// Columns per block in the first top-k pass: a 163,840-wide row spreads over 40 SMs.
const TOPK_SEGMENT: usize = 4096;

fn same_shape(a: &DeviceMat, b: &DeviceMat, what: &str) -> Result<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(CudaError::InvalidArg(format!(
            "{what}: {}x{} vs {}x{}",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

/// SiTU's optional linear branch as kernel arguments: (beta_lin, has_lin), 1.0 / 0 when absent.
pub(crate) fn situ_linear_args(situ: SituParams) -> (f32, i32) {
    (
        situ.linear_beta.unwrap_or(1.0),
        i32::from(situ.linear_beta.is_some()),
    )
}

pub(crate) fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::InvalidArg(format!("{what} = {v} exceeds i32")))
}

/// Byte offset → f32 offset (4-aligned), bounds-checked against the arena.
pub fn float_offset(byte_offset: usize, len_floats: usize, arena_floats: usize) -> Result<i64> {
    if !byte_offset.is_multiple_of(4) {
        return Err(CudaError::InvalidArg(format!(
            "arena offset {byte_offset} is not 4-byte aligned"
        )));
    }
    let f = byte_offset / 4;
    if f + len_floats > arena_floats {
        return Err(CudaError::InvalidArg(format!(
            "arena range {}..{} beyond {} bytes",
            byte_offset,
            byte_offset + 4 * len_floats,
            4 * arena_floats
        )));
    }
    Ok(f as i64)
}

/// The KDA decode kernel (kernels/kda_decode.cu): a cluster of 4 column-slice blocks per head,
/// whole 128-byte state lines per warp instruction, evict-first state accesses (the state is
/// read and written once per token, so the step is bound by its DRAM traffic).
const KDA_DECODE_KERNEL: &str = "kda_decode_lines_f32";

/// KDA prefill with a short conv (<= 4, K3's) runs in two passes (kernels/kda_chunk_scan.cu):
/// a record pass, parallel over chunks, holds everything that does not depend on the state, then
/// a scan carries the state across chunks. Longer convs take the one-pass f32 kernels of
/// kda_chunk.cu (conv + SiLU, prep, chunked delta rule).
const KDA_SCAN_MAX_CONV: usize = 4;

/// 16-token chunks per record-pass block (KDA_REC_NCH in kernels/kda_chunk_scan.cu).
const KDA_REC_NCH: usize = 8;

/// The record pass: grid (ceil(chunks / 8), heads), 128 threads.
fn kda_rec_launch(tokens: usize, heads: usize) -> Result<Launch> {
    Launch::new((tokens.div_ceil(16 * KDA_REC_NCH), heads, 1), 128)
}

/// The record pass (conv, prep and the state-independent chunk algebra).
const KDA_REC_KERNEL: &str = "kda_chunk_rec3m_f32";

/// The state scan after the record pass (`kda_chunk_scan4_f32`).
const KDA_SCAN_KERNEL: &str = "kda_chunk_scan4_f32";

/// `kda_chunk_scan4_f32`: 32 state columns per 128-thread block (4 warps: 2 column tiles x 2 key
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

/// Routed experts of one layer, all experts back to back (kernels/mxfp4.cu layout).
pub struct DeviceExperts {
    pub experts: usize,
    pub latent: usize,
    pub inter: usize,
    pub w1: (CudaSlice<u8>, CudaSlice<u8>),
    pub w3: (CudaSlice<u8>, CudaSlice<u8>),
    pub w2: (CudaSlice<u8>, CudaSlice<u8>),
}

impl CudaBackend {
    /// Choose the MLA decode precision (default: `CudaOptions::mla_decode_precision`).
    pub fn set_mla_decode_precision(&mut self, precision: MlaDecodePrecision) {
        self.options.mla_decode_precision = precision;
    }

    pub fn options(&self) -> &crate::CudaOptions {
        &self.options
    }

    pub fn rms_norm(&self, x: &DeviceMat, w: &CudaSlice<f32>, eps: f32) -> Result<DeviceMat> {
        if w.len() != x.cols {
            return Err(CudaError::InvalidArg(format!(
                "rms_norm weight {} for width {}",
                w.len(),
                x.cols
            )));
        }
        let y = self.zeros(x.rows, x.cols)?;
        let (rows, cols) = (i32_of(x.rows, "rows")?, i32_of(x.cols, "cols")?);
        launch!(self, "rms_norm_f32", geometry::per_row(x.rows, 256)?; &x.buf, w, &y.buf, &rows, &cols, &eps)?;
        Ok(y)
    }

    pub fn gated_head_norm(
        &self,
        o: &DeviceMat,
        gate: &DeviceMat,
        w: &CudaSlice<f32>,
        head_dim: usize,
        eps: f32,
    ) -> Result<DeviceMat> {
        same_shape(o, gate, "gated_head_norm")?;
        if head_dim == 0 || !o.cols.is_multiple_of(head_dim) || w.len() != head_dim {
            return Err(CudaError::InvalidArg(format!(
                "gated_head_norm: width {} head_dim {head_dim}",
                o.cols
            )));
        }
        let y = self.zeros(o.rows, o.cols)?;
        let heads = o.cols / head_dim;
        let (r, h, hd) = (
            i32_of(o.rows, "rows")?,
            i32_of(heads, "heads")?,
            i32_of(head_dim, "head_dim")?,
        );
        launch!(self, "gated_head_norm_f32", geometry::warp_per_item(o.rows * heads)?;
            &o.buf, &gate.buf, w, &y.buf, &r, &h, &hd, &eps)?;
        Ok(y)
    }

    pub fn situ_glu(&self, gate: &DeviceMat, up: &DeviceMat, p: SituParams) -> Result<DeviceMat> {
        same_shape(gate, up, "situ_glu")?;
        let out = self.zeros(gate.rows, gate.cols)?;
        let n = (gate.rows * gate.cols) as i64;
        let (lin, has) = situ_linear_args(p);
        launch!(self, "situ_glu_f32", geometry::elementwise(n as usize)?;
            &gate.buf, &up.buf, &out.buf, &n, &p.beta, &lin, &has)?;
        Ok(out)
    }

    pub fn add_assign(&self, p: &mut DeviceMat, a: &DeviceMat) -> Result<()> {
        same_shape(p, a, "add_assign")?;
        let n = (p.rows * p.cols) as i64;
        launch!(self, "add_assign_f32", geometry::elementwise(n as usize)?; &mut p.buf, &a.buf, &n)
    }

    pub fn sigmoid_mul(&self, o: &mut DeviceMat, gate: &DeviceMat) -> Result<()> {
        same_shape(o, gate, "sigmoid_mul")?;
        let n = (o.rows * o.cols) as i64;
        launch!(self, "sigmoid_mul_f32", geometry::elementwise(n as usize)?; &mut o.buf, &gate.buf, &n)
    }

    /// Block AttnRes over 1..=9 sources of the same shape.
    pub fn attn_res(
        &self,
        sources: &[&DeviceMat],
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<DeviceMat> {
        let first = *sources
            .first()
            .ok_or_else(|| CudaError::InvalidArg("attn_res with no sources".into()))?;
        if sources.len() > 9 {
            return Err(CudaError::Unsupported(format!(
                "attn_res over {} sources (<= 9)",
                sources.len()
            )));
        }
        for s in sources {
            same_shape(first, s, "attn_res")?;
        }
        let out = self.zeros(first.rows, first.cols)?;
        let src: Vec<&CudaSlice<f32>> = (0..9)
            .map(|i| &sources.get(i).unwrap_or(&first).buf)
            .collect();
        let (n, rows, d) = (
            sources.len() as i32,
            i32_of(first.rows, "rows")?,
            i32_of(first.cols, "cols")?,
        );
        launch!(self, "attn_res_f32", geometry::per_row(first.rows, 256)?;
            src[0], src[1], src[2], src[3], src[4], src[5], src[6], src[7], src[8], &n, w, &out.buf, &rows, &d, &eps)?;
        Ok(out)
    }

    /// Each row's `k` largest finite logits (1 <= k <= TOPK_MAX), as k3_model::top_k_of_row
    /// orders them, selected on the device (kernels/sampling.cu): only k pairs per row are
    /// copied back. Not part of a logged step (it reads back), so it runs after the step.
    pub fn top_k_rows(&self, logits: &DeviceMat, k: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        if k == 0 || k > TOPK_MAX {
            return Err(CudaError::InvalidArg(format!(
                "top-k of {k} (1..={TOPK_MAX})"
            )));
        }
        let rows = logits.rows;
        // Each row is cut into segments selected in parallel, then merged (kernels/sampling.cu).
        let segments = logits.cols.div_ceil(TOPK_SEGMENT).max(1);
        let seg_ids = self.uninit::<i32>(rows * segments * k)?;
        let seg_vals = self.uninit::<f32>(rows * segments * k)?;
        let seg_count = self.uninit::<i32>(rows * segments)?;
        // The merge writes ids, values (as f32 bits) and counts into one buffer, so the step
        // reads back once: each read-back is a stream wait plus a copy.
        let out = self.uninit::<i32>(rows * (2 * k + 1))?;
        let ids = out.slice(0..rows * k);
        let vals = out.slice(rows * k..2 * rows * k);
        let count = out.slice(2 * rows * k..);
        let (r, v, kk, sl, sg) = (
            i32_of(rows, "rows")?,
            i32_of(logits.cols, "vocab")?,
            k as i32,
            TOPK_SEGMENT as i32,
            i32_of(segments, "segments")?,
        );
        launch!(self, "topk_segments_f32", Launch::new((segments, rows, 1), 512)?;
            &logits.buf, &seg_ids, &seg_vals, &seg_count, &r, &v, &kk, &sl)?;
        launch!(self, "topk_merge_f32", geometry::per_row(rows, 1024)?;
            &logits.buf, &seg_ids, &seg_vals, &seg_count, &ids, &vals, &count, &r, &v, &kk, &sg)?;
        let all = self.read_back("top-k candidates", &out)?;
        let (ids, rest) = all.split_at(rows * k);
        let (vals, count) = rest.split_at(rows * k);
        Ok((0..rows)
            .map(|row| {
                let n = (count[row].max(0) as usize).min(k);
                (0..n)
                    .map(|i| {
                        let at = row * k + i;
                        (ids[at] as u32, f32::from_bits(vals[at] as u32))
                    })
                    .collect()
            })
            .collect())
    }

    /// Router: (expert ids, weights) per token, `[T, k]` each, on the device.
    pub fn route(
        &self,
        logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        r: RouterParams,
    ) -> Result<(CudaSlice<i32>, CudaSlice<f32>)> {
        if bias.len() != logits.cols {
            return Err(CudaError::InvalidArg(format!(
                "router bias {} for {} experts",
                bias.len(),
                logits.cols
            )));
        }
        let l = geometry::router(logits.rows, logits.cols, r.top_k)?;
        let idx = self.zeroed::<i32>(logits.rows * r.top_k)?;
        let w = self.zeroed::<f32>(logits.rows * r.top_k)?;
        let (t, e, k, ren) = (
            logits.rows as i32,
            logits.cols as i32,
            r.top_k as i32,
            i32::from(r.renormalize),
        );
        launch!(self, "router_topk_f32", l; &logits.buf, bias, &idx, &w, &t, &e, &k, &ren, &r.scaling)?;
        Ok((idx, w))
    }

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

    /// Absorbed MLA for `q` `[items, H·(nope+rope)]`: appends `kv_a` rows (one per item, at
    /// `append_at` byte offsets) and attends item i over `lens[i]` rows whose page starts (byte
    /// offsets including the layer offset) are `pages[i]`. Returns `o` `[items, H·v_dim]`. A bf16
    /// `kv_b` is read as stored (`mla_bf16_products` shapes); an f32 one (or another shape) goes
    /// through its f32 storage / copy and the f32 kernels.
    pub fn mla_decode(
        &self,
        arena: &mut CudaSlice<f32>,
        g: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        append_at: &[usize],
        pages: &[&[usize]],
        lens: &[usize],
        page_tokens: usize,
    ) -> Result<DeviceMat> {
        geometry::check_mla(&g)?;
        let (items, row, len) = (q.rows, g.row(), arena.len());
        if kv_a.rows != append_at.len()
            || kv_a.cols != row
            || pages.len() != items
            || lens.len() != items
        {
            return Err(CudaError::InvalidArg(
                "mla_decode: inconsistent item counts or row width".into(),
            ));
        }
        if q.cols != g.heads * (g.nope + g.rope)
            || kv_b.rows != g.heads * (g.nope + g.v_dim)
            || kv_b.cols != g.kv_lora
        {
            return Err(CudaError::InvalidArg("mla_decode: q or kv_b shape".into()));
        }
        if page_tokens == 0 {
            return Err(CudaError::InvalidArg("page_tokens = 0".into()));
        }
        let dst: Vec<i64> = append_at
            .iter()
            .map(|&o| float_offset(o, row, len))
            .collect::<Result<_>>()?;
        let mut starts = Vec::new();
        let mut base = Vec::with_capacity(items);
        for (p, &l) in pages.iter().zip(lens) {
            if l == 0 || p.len() < l.div_ceil(page_tokens) {
                return Err(CudaError::InvalidArg(format!(
                    "{} pages for {l} positions",
                    p.len()
                )));
            }
            base.push(i32_of(starts.len(), "page table")?);
            for &s in &p[..l.div_ceil(page_tokens)] {
                starts.push(float_offset(s, page_tokens * row, len)?);
            }
        }
        // Splits from the longest length rounded up to a power of two, positions per split
        // from each item's own length (chunk 0, mla.cu): the launch then changes only when the
        // bucket does, not every step (graph.rs replays a step only if its launches are equal).
        let max_len = lens.iter().copied().max().unwrap_or(1).next_power_of_two();
        let attend = crate::dispatch::mla_attend(self.options.mla_decode_precision, &self.limits);
        let sms = self.multiprocessors;
        let splits = match attend {
            MlaAttend::F32 => geometry::mla_splits_tc2(items, g.heads, max_len, sms).0,
            MlaAttend::Bf16Mma => geometry::mla_splits_bf16(items, g.heads, max_len, sms),
            MlaAttend::PairWgmma => geometry::mla_splits_wg(items, g.heads, max_len, sms),
        };
        let chunk: i32 = 0;
        // Padded to a power of two for the same reason (entries past an item's pages are unread).
        starts.resize(starts.len().next_power_of_two(), 0);
        let lens32: Vec<i32> = lens
            .iter()
            .map(|&l| i32_of(l, "length"))
            .collect::<Result<_>>()?;
        let (dst, starts, base, lens_d) = (
            self.upload_slice(&dst)?,
            self.upload_slice(&starts)?,
            self.upload_slice(&base)?,
            self.upload_slice(&lens32)?,
        );
        let (t, lkv, rope, nope, vd, h) = (
            kv_a.rows as i32,
            g.kv_lora as i32,
            g.rope as i32,
            g.nope as i32,
            g.v_dim as i32,
            g.heads as i32,
        );
        if kv_a.rows > 0 {
            launch!(self, "mla_append_rows_f32", geometry::per_row(kv_a.rows, 128)?;
                &kv_a.buf, kv_norm, &mut *arena, &dst, &t, &lkv, &rope, &g.eps)?;
        }
        // W_UK / W_UV products: on bf16 kv_b as stored (tensor cores, each weight byte read once
        // for all items: mla.cu), else the f32 kernels. Both write every element of qt and o.
        let kv_w = match &kv_b.bf16 {
            Some(b) if geometry::mla_bf16_products(&g) => KvB::Bf16(b),
            _ => KvB::F32(&self.linear_f32(kv_b)?.buf),
        };
        let qt = self.output(items * g.heads, row)?;
        let it = i32_of(items, "items")?;
        match kv_w {
            KvB::Bf16(w) => launch!(self, "mla_absorb_q_bf16", geometry::mla_absorb_bf16(&g)?;
                &q.buf, w, &qt.buf, &it, &h, &nope, &rope, &vd, &lkv)?,
            KvB::F32(w) => {
                launch!(self, "mla_absorb_q_f32", Launch::new((items, g.heads, 1), 128)?;
                &q.buf, w, &qt.buf, &it, &h, &nope, &rope, &vd, &lkv)?
            }
        }
        // One split on the wgmma attend: it writes the final latent rows itself (no merge).
        let final_rows = splits == 1 && attend == MlaAttend::PairWgmma;
        let lat = self.zeros(items * g.heads, g.kv_lora)?;
        let part = if final_rows {
            None
        } else {
            Some(self.zeros(items * g.heads * splits, g.kv_lora + 2)?)
        };
        let out = part.as_ref().unwrap_or(&lat);
        let (pt, sp, ch) = (page_tokens as i32, splits as i32, chunk);
        let scale = 1.0 / ((g.nope + g.rope) as f32).sqrt();
        // Attend on tensor cores, merge the splits, then W_UV once per call. F32: 3xTF32 (two
        // blocks per SM, L2 prefetch of MLA_TC_PREFETCH_TILES tiles ahead); Bf16Mma: one bf16 MMA
        // per product (kernels/mla_attend_bf16.cu); PairWgmma: the same rounding on wgmma
        // (kernels/mla_attend_wg.cu). All write the same partials.
        match attend {
            MlaAttend::F32 => {
                let tc_mode = 1 | (MLA_TC_PREFETCH_TILES << 2);
                launch!(self, "mla_attend_tc2_f32", geometry::mla_attend_tc(&g, items, splits)?;
                    &qt.buf, &*arena, &starts, &base, &lens_d, &out.buf, &it, &h, &lkv, &rope, &pt, &sp, &ch,
                    &scale, &tc_mode)?;
            }
            MlaAttend::Bf16Mma => {
                launch!(self, "mla_attend_bf16_f32", geometry::mla_attend_bf16(&g, items, splits)?;
                    &qt.buf, &*arena, &starts, &base, &lens_d, &out.buf, &it, &h, &lkv, &rope, &pt, &sp, &ch,
                    &scale)?;
            }
            MlaAttend::PairWgmma => {
                let fin = i32::from(final_rows);
                launch!(self, "mla_attend_wg2_f32", geometry::mla_attend_wg2(&g, items, splits)?;
                    &qt.buf, &*arena, &starts, &base, &lens_d, &out.buf, &it, &h, &lkv, &rope, &pt, &sp, &ch,
                    &scale, &fin)?;
            }
        }
        if let Some(part) = &part {
            launch!(self, "mla_merge_f32", geometry::mla_merge(&g, items)?;
                &part.buf, &lat.buf, &it, &h, &lkv, &sp)?;
        }
        let o = self.output(items, g.heads * g.v_dim)?;
        match kv_w {
            KvB::Bf16(w) => launch!(self, "mla_out_proj_bf16", geometry::mla_out_proj_bf16(&g)?;
                &lat.buf, w, &o.buf, &it, &h, &nope, &vd, &lkv)?,
            KvB::F32(w) => launch!(self, "mla_out_proj_f32", geometry::mla_out_proj(&g, items)?;
                &lat.buf, w, &o.buf, &it, &h, &nope, &vd, &lkv)?,
        }
        Ok(o)
    }

    /// Routed LatentMoE: router, grouping by expert, MXFP4 SiTU-GLU experts, fixed-order combine.
    pub fn moe_routed(
        &self,
        z: &DeviceMat,
        router_logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        ex: &DeviceExperts,
        r: RouterParams,
        situ: SituParams,
    ) -> Result<DeviceMat> {
        if z.cols != ex.latent || router_logits.cols != ex.experts || z.rows != router_logits.rows {
            return Err(CudaError::InvalidArg(
                "moe_routed: z / logits / experts shapes differ".into(),
            ));
        }
        let (idx, w) = self.route(router_logits, bias, r)?;
        let (t, k) = (z.rows, r.top_k);
        let step = ExpertStep {
            tokens: t,
            many: t * k >= self.options.moe_gemm_min_assignments,
            latent: ex.latent,
            inter: ex.inter,
        };
        let path = expert_path(step, &self.limits);
        // The single-token pair takes the router's ids as they are: no sort, no offsets.
        if path == ExpertPath::SingleToken {
            return self.moe_experts_stream2v2(z, &idx, &w, ex, k, situ);
        }
        let offsets = self.zeroed::<i32>(ex.experts + 1)?;
        let sorted = self.zeroed::<i32>((t * k).max(1))?;
        let (na, e) = (i32_of(t * k, "assignments")?, ex.experts as i32);
        launch!(self, "moe_sort_assignments", Launch::new((1, 1, 1), 1024)?; &idx, &na, &e, &offsets, &sorted)?;
        let sorted_step = crate::moe_sorted::SortedStep {
            z,
            idx: &idx,
            w: &w,
            ex,
            top_k: k,
            offsets: &offsets,
            sorted: &sorted,
            situ,
        };
        match path {
            ExpertPath::Wgmma => return self.moe_experts_wg(sorted_step),
            ExpertPath::Cublas => return self.moe_experts_gemm(sorted_step),
            ExpertPath::FewTokens | ExpertPath::SingleToken => {}
        }
        let y = self.zeros(t * k, ex.latent)?;
        let (kk, lt, ie) = (k as i32, ex.latent as i32, ex.inter as i32);
        let (lin, has) = crate::ops::situ_linear_args(situ);
        // Blocks for at most min(E, T*k) experts: each maps itself to a busy one.
        let busy = ex.experts.min(t * k).max(1);
        // The tc2 pair: z and the intermediate as hi / lo bf16 in fragment order (every element
        // written: the split pads z, each up block writes its whole 128-column super-step).
        let nt = mx_tc2_ntiles(t);
        let (nti, ti) = (nt as i32, i32_of(t, "tokens")?);
        let zx = self.uninit::<u16>(t * mx_tc2_row_u16(ex.latent))?;
        let actx = self.uninit::<u16>(t * k * mx_tc2_row_u16(ex.inter))?;
        launch!(self, "mxfp4_tc2_split_f32", mx_tc2_split_launch(t, ex.latent)?; &z.buf, &zx, &ti, &lt)?;
        launch!(self, "mxfp4_up_tc2_f32", mx_tc2_launch(busy, ex.inter, ex.latent, MX_TC2_UP_ROWS, nt)?;
            &zx, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, &offsets, &sorted, &actx, &kk, &lt, &ie,
            &situ.beta, &lin, &has, &e, &nti)?;
        launch!(self, "mxfp4_down_tc2_f32", mx_tc2_launch(busy, ex.latent, ex.inter, MX_TC2_DOWN_ROWS, nt)?;
            &actx, &ex.w2.0, &ex.w2.1, &offsets, &sorted, &y.buf, &lt, &ie, &e, &nti)?;
        let out = self.zeros(t, ex.latent)?;
        let tt = t as i32;
        launch!(self, "moe_combine_f32", geometry::elementwise(t * ex.latent)?; &y.buf, &w, &out.buf, &tt, &kk, &lt)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_offsets_are_aligned_and_bounded() {
        assert_eq!(float_offset(16, 4, 8).unwrap(), 4);
        assert!(float_offset(18, 1, 100).is_err(), "unaligned");
        assert!(float_offset(16, 5, 8).is_err(), "past the end");
        assert!(float_offset(0, 8, 8).is_ok());
    }

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

    #[test]
    fn tc2_launch_geometry() {
        // kernels/mxfp4_tc.cu MX2_STAGE_BYTES: two blocks per SM at the largest pass.
        assert_eq!(
            mx_tc2_shared(MX_TC2_MAX_NTILES),
            geometry::MX_TC2_MAX_SHARED
        );
        // Two blocks (plus 1 KB reserved and the static shared memory each) in an SM's 228 KB.
        const { assert!(2 * (geometry::MX_TC2_MAX_SHARED + 1024 + 256) <= 233_472) };
        assert_eq!(
            (
                mx_tc2_ntiles(2),
                mx_tc2_ntiles(5),
                mx_tc2_ntiles(16),
                mx_tc2_ntiles(64)
            ),
            (1, 2, 4, 4)
        );
        // K3: up blocks are one 128-column super-step of the intermediate each; down 256 rows.
        let up = mx_tc2_launch(128, 3072, 3584, MX_TC2_UP_ROWS, 4).unwrap();
        assert_eq!((up.grid, up.block, up.shared), ((128, 24, 1), 256, 78_336));
        let down = mx_tc2_launch(128, 3584, 3072, MX_TC2_DOWN_ROWS, 1).unwrap();
        assert_eq!((down.grid, down.shared), ((128, 14, 1), 58_752));
        assert_eq!(mx_tc2_row_u16(3584), 28 * 256);
        assert_eq!(mx_tc2_row_u16(160), 2 * 256);
        assert_eq!(mx_tc2_split_launch(64, 3584).unwrap().grid, (64, 28, 1));
        assert!(mx_tc2_launch(16, 3072, 100, MX_TC2_UP_ROWS, 1).is_err());
    }
}
