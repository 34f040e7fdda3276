//! MLA prefill in the expanded ("compute-friendly") form (docs/k3-model.md, the DeepSeek /
//! vLLM prefill path), for sequences with many new tokens.
//!
//! The absorbed form (`CudaBackend::mla_absorbed`) attends every new token over its causal prefix
//! with 576-wide rows: ~2·(576+512) FLOPs per (head, query, key) on a bandwidth-shaped kernel,
//! tens of ms per K3 layer at 2048 tokens and quadratic beyond. Here the cached latents of the sequence
//! are expanded once per call, `K_nope,h = c W_UK,hᵀ` and `V_h = c W_UV,hᵀ` (2·512·256 FLOPs per
//! (head, key)), and attention runs as cuBLAS SGEMMs with qk-dim 192 and v-dim 128
//! (2·(192+128) FLOPs per pair). All f32, default math mode (no TF32): the results track the CPU
//! backend's expanded form (`k3_backend_cpu::mla::attend_naive`) to f32 rounding.
//!
//! Per sequence (`len = start_pos + T` keys, the new rows already appended to the pages):
//! 1. `mla_prefill_gather_f32`: latents `c` `[len, kv_lora]` out of the pages, and `k_r` into the
//!    rope columns of `K` `[hg, len, qk]` (identical for every head: written once per call).
//! 2. Per group of `hg` heads: two strided-batched SGEMMs write `K_nope,h` into `K`'s first `nope`
//!    columns (ldc = qk) and `V_h` `[len, v]`.
//! 3. Per chunk of `q_chunk` queries `i0..i1` (keys `0..start_pos + i1`): `S_h = Q_h K_hᵀ · scale`
//!    (Q read in place from `q`, ld = H·qk), `mla_prefill_softmax_f32` (causal, in place), and
//!    `O_h = P_h V_h` written in place into `o` `[T, H·v]` (ldc = H·v): no transposes.
//!
//! In bf16 mode (`--dtype bfloat16`, the default) step 3 is one fused kernel per head group,
//! `mla_prefill_flash_bf16`: QKᵀ, the causal online softmax and PV on bf16 tensor cores with f32
//! accumulation, scores kept on chip (no score scratch); float32 mode keeps the SGEMMs above, the
//! path that matches the CPU to f32 rounding.
//!
//! `plan` bounds the scratch (`lat`, `K`, `V`, `S`) by [`MLA_PREFILL_SCRATCH_BYTES`] through the
//! head-group size and the query chunk, so 8k–128k-token prompts fit.

use crate::buf::Buf;
use crate::device::{CudaBackend, DeviceLinear, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::launch::{float_offset, i32_of};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig, sys::cublasOperation_t};
use cudarc::driver::CudaSlice;
use k3_model::backend::MlaGeom;

/// Sequences with at least this many new tokens take the expanded form. Per (head, query, key)
/// pair it does 2·320 FLOPs of f32 SGEMM (~50 TFLOP/s expected on the H200) against 2·1088 on the
/// absorbed kernel (~11 TFLOP/s effective at 2048 tokens); its fixed cost
/// is the expansion of every key of the sequence (2·kv_lora·H·(nope+v) FLOPs per key, re-done per
/// call) plus 3 launches per query chunk. By that estimate it wins from ~30 new tokens even over
/// 30k cached rows (sooner over short prefixes); the threshold sits at about twice that because
/// the estimate's margin is thin there and below it short chunks stay in the one batched absorbed
/// launch sequence with the decodes. 64 also splits the k3-mini golden prompts (31, 41: absorbed;
/// 82: expanded), so the end-to-end tests cover both paths.
pub const MLA_EXPANDED_MIN_TOKENS: usize = 64;

/// Queries per chunk (at most): large enough for efficient SGEMMs (n = 512), small enough that
/// the masked upper triangle of the last key block (~q_chunk/2 of the keys of each row on the
/// diagonal chunk) stays a small part of the work at prompt lengths where this path matters.
pub const MLA_PREFILL_Q_CHUNK: usize = 512;

/// The smallest query chunk `plan` falls back to when one head's scratch does not fit.
pub const MLA_PREFILL_MIN_Q_CHUNK: usize = 16;

/// Scratch bound (bytes) for one call: latents, K and V of a head group, scores of a chunk.
pub const MLA_PREFILL_SCRATCH_BYTES: usize = 2 << 30;

/// Threads per block of `mla_prefill_softmax_f32` (its `MLA_SM_THREADS`) and of the gather.
const SOFTMAX_THREADS: u32 = 256;
const GATHER_THREADS: u32 = 128;
/// Block size of `mla_append_rows_f32`: the same as `mla_absorbed`'s launch, so the appended rows
/// (a block-wide sum of squares) are bit-identical whichever path appends them.
const APPEND_THREADS: u32 = 128;

/// Whether a span of `tokens` new tokens takes the expanded form (else the absorbed path).
pub fn expanded(tokens: usize) -> bool {
    tokens >= MLA_EXPANDED_MIN_TOKENS
}

/// Queries per block, threads per block and the largest qk / v widths of
/// `mla_prefill_flash_bf16` (kernels/mla_prefill.cu MLA_FL_Q, MLA_FL_THREADS, MLA_FL_QK_MAX,
/// MLA_FL_V_MAX).
const FLASH_QUERIES: usize = 64;
const FLASH_THREADS: u32 = 128;
const FLASH_QK_MAX: usize = 192;
const FLASH_V_MAX: usize = 128;

/// Whether the fused bf16 kernel takes these head shapes (K3: qk 192, v 128; k3-mini: 96, 64).
pub fn flash_fits(g: &MlaGeom) -> bool {
    let qk = g.nope + g.rope;
    qk > 0
        && qk.is_multiple_of(16)
        && qk <= FLASH_QK_MAX
        && g.v_dim > 0
        && g.v_dim.is_multiple_of(8)
        && g.v_dim <= FLASH_V_MAX
}

/// Grid of `mla_prefill_flash_bf16`: query tiles of 64 by heads of the group.
fn flash_launch(tokens: usize, heads: usize) -> Result<Launch> {
    Launch::new((tokens.div_ceil(FLASH_QUERIES), heads, 1), FLASH_THREADS)
}

/// Head-group size and query-chunk length of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub head_group: usize,
    pub q_chunk: usize,
}

impl Plan {
    /// Scratch floats of a call with `len` keys: latents, K and V of one head group, scores of
    /// one query chunk of that group.
    pub fn scratch_floats(&self, g: &MlaGeom, len: usize) -> usize {
        let qk = g.nope + g.rope;
        len * g.kv_lora + self.head_group * len * (qk + g.v_dim + self.q_chunk)
    }
}

/// Chunking for `t` new tokens over `len` keys within `budget` bytes: the query chunk first (up to
/// [`MLA_PREFILL_Q_CHUNK`]), then as many heads per group as fit, evened out over the groups. If
/// even one head does not fit, the chunk shrinks (not below [`MLA_PREFILL_MIN_Q_CHUNK`]; past
/// that the budget is exceeded rather than failing: ~1M-token prompts).
pub fn plan(g: &MlaGeom, t: usize, len: usize, budget: usize) -> Plan {
    let (heads, len) = (g.heads.max(1), len.max(1));
    let avail = (budget / 4).saturating_sub(len * g.kv_lora);
    let kv = g.nope + g.rope + g.v_dim;
    let mut q_chunk = t.clamp(1, MLA_PREFILL_Q_CHUNK);
    let per_head = len * (kv + q_chunk);
    if avail < per_head {
        let fit = (avail / len).saturating_sub(kv);
        q_chunk = fit.clamp(MLA_PREFILL_MIN_Q_CHUNK.min(q_chunk), q_chunk);
    }
    let fit = (avail / (len * (kv + q_chunk))).clamp(1, heads);
    let head_group = heads.div_ceil(heads.div_ceil(fit));
    Plan {
        head_group,
        q_chunk,
    }
}

/// How a head group attends: fused on bf16 tensor cores (K and V rounded to bf16 first), or
/// per query chunk through a score scratch (float32 mode, or head shapes the kernel lacks).
enum Attend {
    Fused { k16: Buf<u16>, v16: Buf<u16> },
    Chunks { scores: Buf<f32> },
}

/// One sequence for [`CudaBackend::mla_prefill_expanded`].
#[derive(Debug, Clone, Copy)]
pub struct ExpandedSeq<'a> {
    /// First row of this sequence in `q` and `o`.
    pub row0: usize,
    /// New tokens (rows `row0..row0 + tokens`).
    pub tokens: usize,
    /// Position of the first new token.
    pub start_pos: usize,
    /// Byte offsets of this layer's rows in each page (page offset + layer offset), covering
    /// positions `0..start_pos + tokens`.
    pub pages: &'a [usize],
    pub page_tokens: usize,
}

/// A column-major strided-batched SGEMM `C_b = alpha·op(A_b)·op(B_b) + beta·C_b`, operands given
/// as (buffer, float offset); `trans_*` = true is `CUBLAS_OP_T`.
struct Sgemm {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    lda: usize,
    stride_a: usize,
    ldb: usize,
    stride_b: usize,
    ldc: usize,
    stride_c: usize,
    batch: usize,
}

impl Sgemm {
    /// One past the last float an operand of `rows x cols` (as stored) touches, checked against
    /// the buffer: cuBLAS itself does not know the allocation sizes.
    fn check(
        &self,
        what: &str,
        (rows, cols, ld, stride): (usize, usize, usize, usize),
        off: usize,
        len: usize,
    ) -> Result<()> {
        let end = off + (cols - 1) * ld + rows + (self.batch - 1) * stride;
        if ld < rows.max(1) || end > len {
            return Err(CudaError::InvalidArg(format!(
                "sgemm {what}: {rows}x{cols} ld {ld} stride {stride} x{} at {off} in {len} floats",
                self.batch
            )));
        }
        Ok(())
    }
}

impl CudaBackend {
    /// Run `p` on (`a`, `b`, `c`) at the given float offsets.
    fn sgemm_sb(
        &self,
        p: &Sgemm,
        (a, a_off): (&CudaSlice<f32>, usize),
        (b, b_off): (&CudaSlice<f32>, usize),
        (c, c_off): (&mut CudaSlice<f32>, usize),
    ) -> Result<()> {
        if p.m == 0 || p.n == 0 || p.k == 0 || p.batch == 0 {
            return Ok(());
        }
        let (ar, ac) = if p.trans_a { (p.k, p.m) } else { (p.m, p.k) };
        let (br, bc) = if p.trans_b { (p.n, p.k) } else { (p.k, p.n) };
        p.check("A", (ar, ac, p.lda, p.stride_a), a_off, a.len())?;
        p.check("B", (br, bc, p.ldb, p.stride_b), b_off, b.len())?;
        p.check("C", (p.m, p.n, p.ldc, p.stride_c), c_off, c.len())?;
        let op = |t: bool| {
            if t {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let cfg = StridedBatchedConfig {
            gemm: GemmConfig {
                transa: op(p.trans_a),
                transb: op(p.trans_b),
                m: i32_of(p.m, "sgemm m")?,
                n: i32_of(p.n, "sgemm n")?,
                k: i32_of(p.k, "sgemm k")?,
                alpha: p.alpha,
                lda: i32_of(p.lda, "lda")?,
                ldb: i32_of(p.ldb, "ldb")?,
                beta: 0.0f32,
                ldc: i32_of(p.ldc, "ldc")?,
            },
            batch_size: i32_of(p.batch, "batch")?,
            stride_a: p.stride_a as i64,
            stride_b: p.stride_b as i64,
            stride_c: p.stride_c as i64,
        };
        let (av, bv) = (a.slice(a_off..), b.slice(b_off..));
        let mut cv = c.slice_mut(c_off..);
        // SAFETY: every batch's operand extents were checked against the buffers above; beta = 0
        // so C is only written; all three live until the call is queued on the stream.
        unsafe { self.blas.gemm_strided_batched(cfg, &av, &bv, &mut cv) }?;
        Ok(())
    }

    /// Scratch that every reader finds fully written first (no zeroing pass over ~GiB): each
    /// buffer of mla_prefill_expanded is written (gather, SGEMM with beta = 0, softmax) before it
    /// is read, over exactly the ranges read.
    fn scratch(&self, floats: usize) -> Result<Buf<f32>> {
        self.uninit::<f32>(floats)
    }

    /// `mla_append_rows_f32` for rows `row0..row0 + dst.len()` of `kv_a` at byte offsets `dst`.
    fn mla_append(
        &self,
        arena: &mut CudaSlice<f32>,
        g: MlaGeom,
        kv_a: &DeviceMat,
        row0: usize,
        dst: &[usize],
        kv_norm: &CudaSlice<f32>,
    ) -> Result<()> {
        let row = g.row();
        if dst.is_empty() {
            return Ok(());
        }
        if kv_a.cols != row || row0 + dst.len() > kv_a.rows || kv_norm.len() != g.kv_lora {
            return Err(CudaError::InvalidArg(
                "MLA append: kv_a / norm shape".into(),
            ));
        }
        let len = arena.len();
        let dst: Vec<i64> = dst
            .iter()
            .map(|&o| float_offset(o, row, len))
            .collect::<Result<_>>()?;
        let dst = self.upload_slice(&dst)?;
        let src = kv_a.buf.slice(row0 * row..);
        let (t, lkv, rope) = (
            i32_of(dst.len(), "rows")?,
            i32_of(g.kv_lora, "kv_lora")?,
            i32_of(g.rope, "rope")?,
        );
        launch!(self, "mla_append_rows_f32", geometry::per_row(dst.len(), APPEND_THREADS)?;
            &src, kv_norm, &mut *arena, &dst, &t, &lkv, &rope, &g.eps)
    }

    /// Expanded MLA for one sequence whose rows `0..start_pos + tokens` are already in its pages:
    /// reads rows `row0..row0 + tokens` of `q` `[*, H·(nope+rope)]`, writes the same rows of `o`
    /// `[*, H·v_dim]` (the absorbed path's output layout, before the gate).
    pub fn mla_prefill_expanded(
        &self,
        arena: &CudaSlice<f32>,
        g: MlaGeom,
        q: &DeviceMat,
        kv_b: &CudaSlice<f32>,
        seq: ExpandedSeq<'_>,
        o: &mut DeviceMat,
    ) -> Result<()> {
        let o = o.written();
        if self.step.recording() {
            // Prefill-sized spans only: never part of a replayable (decode) step.
            return Err(CudaError::Unsupported(
                "MLA expanded prefill inside a replayable step".into(),
            ));
        }
        let (t, start, pt) = (seq.tokens, seq.start_pos, seq.page_tokens);
        let (heads, nope, rope, vd, lkv) = (g.heads, g.nope, g.rope, g.v_dim, g.kv_lora);
        let (qk, row, len) = (nope + rope, g.row(), start + t);
        if t == 0 {
            return Ok(());
        }
        if q.cols != heads * qk
            || o.cols != heads * vd
            || seq.row0 + t > q.rows.min(o.rows)
            || kv_b.len() != heads * (nope + vd) * lkv
            || heads == 0
            || lkv == 0
        {
            return Err(CudaError::InvalidArg(
                "MLA expanded prefill: q / o / kv_b shape".into(),
            ));
        }
        if pt == 0 || seq.pages.len() < len.div_ceil(pt) {
            return Err(CudaError::InvalidArg(format!(
                "{} KV pages of {pt} rows for {len} positions",
                seq.pages.len()
            )));
        }
        let starts: Vec<i64> = seq.pages[..len.div_ceil(pt)]
            .iter()
            .map(|&p| float_offset(p, pt * row, arena.len()))
            .collect::<Result<_>>()?;
        let starts = self.upload_slice(&starts)?;
        let p = plan(&g, t, len, MLA_PREFILL_SCRATCH_BYTES);
        let hg = p.head_group;
        let lat = self.scratch(len * lkv)?;
        let mut kbuf = self.scratch(hg * len * qk)?;
        let mut vbuf = self.scratch(hg * len * vd)?;
        let flash = self.options.dtype != crate::Dtype::F32 && flash_fits(&g);
        // The fused kernel keeps scores on chip (no score scratch) and reads K and V as bf16.
        let mut attend = if flash {
            Attend::Fused {
                k16: self.uninit::<u16>(hg * len * qk)?,
                v16: self.uninit::<u16>(hg * len * vd)?,
            }
        } else {
            Attend::Chunks {
                scores: self.scratch(hg * p.q_chunk * len)?,
            }
        };
        let (len32, hg32, lkv32, rope32, qk32, pt32) = (
            i32_of(len, "keys")?,
            i32_of(hg, "heads")?,
            i32_of(lkv, "kv_lora")?,
            i32_of(rope, "rope")?,
            i32_of(qk, "qk")?,
            i32_of(pt, "page_tokens")?,
        );
        launch!(self, "mla_prefill_gather_f32", geometry::per_row(len, GATHER_THREADS)?;
            arena, &starts, &lat, &mut kbuf, &len32, &hg32, &lkv32, &rope32, &qk32, &pt32)?;
        let scale = 1.0 / (qk as f32).sqrt();
        let hw = (nope + vd) * lkv; // kv_b floats per head
        for h0 in (0..heads).step_by(hg) {
            let hn = hg.min(heads - h0);
            // K_nope,h = c W_UK,hᵀ: column-major [nope, len] into K's rows (ldc = qk), so each
            // row of K is [k_nope,h | k_r]. lat is shared by every head (stride 0).
            let expand = |m: usize, ldc: usize| Sgemm {
                trans_a: true,
                trans_b: false,
                m,
                n: len,
                k: lkv,
                alpha: 1.0,
                lda: lkv,
                stride_a: hw,
                ldb: lkv,
                stride_b: 0,
                ldc,
                stride_c: len * ldc,
                batch: hn,
            };
            self.sgemm_sb(
                &expand(nope, qk),
                (kv_b, h0 * hw),
                (&lat, 0),
                (&mut kbuf, 0),
            )?;
            // V_h = c W_UV,hᵀ, [len, v] row-major per head.
            self.sgemm_sb(
                &expand(vd, vd),
                (kv_b, h0 * hw + nope * lkv),
                (&lat, 0),
                (&mut vbuf, 0),
            )?;
            let sbuf = match &mut attend {
                Attend::Chunks { scores } => scores,
                Attend::Fused { k16, v16 } => {
                    let (t32, s32, heads32, h032, row032, vd32) = (
                        i32_of(t, "tokens")?,
                        i32_of(start, "start")?,
                        i32_of(heads, "heads")?,
                        i32_of(h0, "head")?,
                        i32_of(seq.row0, "row0")?,
                        i32_of(vd, "v_dim")?,
                    );
                    // K and V of the group rounded once to bf16 (the hi plane alone).
                    let one = 1i32;
                    for (src, dst, n) in
                        [(&kbuf, &*k16, hn * len * qk), (&vbuf, &*v16, hn * len * vd)]
                    {
                        let n64 = n as i64;
                        launch!(self, "bf16_split_rows_f32", geometry::elementwise(n)?;
                            src, dst, &n64, &one)?;
                    }
                    launch!(self, "mla_prefill_flash_bf16", flash_launch(t, hn)?;
                        &q.buf, &*k16, &*v16, &mut o.buf, &t32, &len32, &s32, &heads32, &h032,
                        &row032, &qk32, &vd32, &scale)?;
                    continue;
                }
            };
            for i0 in (0..t).step_by(p.q_chunk) {
                let tq = p.q_chunk.min(t - i0);
                let lk = start + i0 + tq; // keys any query of the chunk can see
                // S_h [tq, lk] row-major = (K_h[..lk] as [lk, qk]) · Q_hᵀ in column-major terms;
                // Q_h is read in place: row i of q, columns h·qk.., so ld = H·qk, stride qk.
                let qk_gemm = Sgemm {
                    trans_a: true,
                    trans_b: false,
                    m: lk,
                    n: tq,
                    k: qk,
                    alpha: scale,
                    lda: qk,
                    stride_a: len * qk,
                    ldb: heads * qk,
                    stride_b: qk,
                    ldc: lk,
                    stride_c: tq * lk,
                    batch: hn,
                };
                let q_off = (seq.row0 + i0) * heads * qk + h0 * qk;
                self.sgemm_sb(&qk_gemm, (&kbuf, 0), (&q.buf, q_off), (&mut *sbuf, 0))?;
                let (rows, tq32, lk32, q0) = (
                    i32_of(hn * tq, "score rows")?,
                    i32_of(tq, "chunk")?,
                    i32_of(lk, "keys")?,
                    i32_of(start + i0, "position")?,
                );
                launch!(self, "mla_prefill_softmax_f32", Launch::new((hn * tq, 1, 1), SOFTMAX_THREADS)?;
                    &mut *sbuf, &rows, &tq32, &lk32, &q0)?;
                // O_h [tq, v] = P_h V_h[..lk], column-major [v, tq] straight into o (ldc = H·v).
                let pv = Sgemm {
                    trans_a: false,
                    trans_b: false,
                    m: vd,
                    n: tq,
                    k: lk,
                    alpha: 1.0,
                    lda: vd,
                    stride_a: len * vd,
                    ldb: lk,
                    stride_b: tq * lk,
                    ldc: heads * vd,
                    stride_c: vd,
                    batch: hn,
                };
                let o_off = (seq.row0 + i0) * heads * vd + h0 * vd;
                self.sgemm_sb(&pv, (&vbuf, 0), (&*sbuf, 0), (&mut o.buf, o_off))?;
            }
        }
        Ok(())
    }

    /// The rows `spans` of `m`, stacked.
    fn stack_rows(&self, m: &DeviceMat, spans: &[(usize, usize)]) -> Result<DeviceMat> {
        let rows = spans.iter().map(|&(a, b)| b - a).sum();
        let mut out = self.zeros(rows, m.cols)?;
        let mut at = 0;
        for &(r0, r1) in spans {
            let n = (r1 - r0) * m.cols;
            let src = m.buf.slice(r0 * m.cols..r0 * m.cols + n);
            let mut dst = out.buf.slice_mut(at..at + n);
            self.copy_dtod(&src, &mut dst)?;
            at += n;
        }
        Ok(out)
    }

    /// The inverse of `stack_rows`: consecutive rows of `src` into rows `spans` of `dst`.
    fn unstack_rows(
        &self,
        src: &DeviceMat,
        dst: &mut DeviceMat,
        spans: &[(usize, usize)],
    ) -> Result<()> {
        let dst = dst.written();
        let mut at = 0;
        for &(r0, r1) in spans {
            let n = (r1 - r0) * dst.cols;
            let s = src.buf.slice(at..at + n);
            let mut d = dst.buf.slice_mut(r0 * dst.cols..r0 * dst.cols + n);
            self.copy_dtod(&s, &mut d)?;
            at += n;
        }
        Ok(())
    }

    /// `mla_spans` when some sequence takes the expanded form: each such sequence appends its rows
    /// (the same kernel and block size as the absorbed path: identical cache bytes) and runs
    /// `mla_prefill_expanded` into its rows of `o`; the others (decode, short chunks) go through
    /// one `mla_absorbed` over their stacked rows, as before. `seq_pages[i]` are sequence i's page
    /// byte offsets including the layer offset; `starts[i]` its first new position; `kv_b` the
    /// `[H·(nope+v), kv_lora]` weights (the expanded form reads their f32 storage / copy: its
    /// cuBLAS SGEMMs need f32; `mla_absorbed` reads a bf16 kv_b as stored).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mla_spans_mixed(
        &self,
        arena: &mut CudaSlice<f32>,
        g: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        spans: &[(usize, usize)],
        starts: &[usize],
        seq_pages: &[Vec<usize>],
        page_tokens: usize,
    ) -> Result<DeviceMat> {
        let (pt, row_bytes) = (page_tokens, 4 * g.row());
        if starts.len() != spans.len() || seq_pages.len() != spans.len() || pt == 0 {
            return Err(CudaError::InvalidArg(
                "MLA split: per-sequence lists".into(),
            ));
        }
        let mut o = self.zeros(q.rows, g.heads * g.v_dim)?;
        let (mut abs_spans, mut append_at, mut lens, mut owner) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, &(r0, r1)) in spans.iter().enumerate() {
            let (t, s, pages) = (r1 - r0, starts[i], &seq_pages[i]);
            let dst = (s..s + t).map(|pos| pages[pos / pt] + (pos % pt) * row_bytes);
            if !expanded(t) {
                abs_spans.push((r0, r1));
                append_at.extend(dst);
                lens.extend(s + 1..=s + t);
                owner.extend(std::iter::repeat_n(i, t));
                continue;
            }
            let dst: Vec<usize> = dst.collect();
            self.mla_append(arena, g, kv_a, r0, &dst, kv_norm)?;
            let seq = ExpandedSeq {
                row0: r0,
                tokens: t,
                start_pos: s,
                pages,
                page_tokens: pt,
            };
            self.mla_prefill_expanded(arena, g, q, &self.linear_f32(kv_b)?.buf, seq, &mut o)?;
        }
        if !abs_spans.is_empty() {
            let (qa, ka) = (
                self.stack_rows(q, &abs_spans)?,
                self.stack_rows(kv_a, &abs_spans)?,
            );
            let tables: Vec<&[usize]> = owner.iter().map(|&i| &seq_pages[i][..]).collect();
            let oa = self.mla_absorbed(
                arena, g, &qa, &ka, kv_norm, kv_b, &append_at, &tables, &lens, pt,
            )?;
            self.unstack_rows(&oa, &mut o, &abs_spans)?;
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k3() -> MlaGeom {
        MlaGeom {
            heads: 96,
            nope: 128,
            rope: 64,
            v_dim: 128,
            kv_lora: 512,
            eps: 1e-6,
        }
    }

    #[test]
    fn flash_takes_k3_and_k3_mini_heads() {
        assert!(flash_fits(&k3()));
        let mini = MlaGeom {
            nope: 64,
            rope: 32,
            v_dim: 64,
            ..k3()
        };
        assert!(flash_fits(&mini));
        // qk not a multiple of 16, or wider than the kernel's registers: the SGEMM path.
        assert!(!flash_fits(&MlaGeom { rope: 40, ..k3() }));
        assert!(!flash_fits(&MlaGeom { v_dim: 256, ..k3() }));
        let l = flash_launch(2048, 96).unwrap();
        assert_eq!((l.grid, l.block), ((32, 96, 1), 128));
        assert_eq!(flash_launch(65, 3).unwrap().grid, (2, 3, 1));
    }

    #[test]
    fn threshold() {
        assert!(!expanded(1) && !expanded(MLA_EXPANDED_MIN_TOKENS - 1));
        assert!(expanded(MLA_EXPANDED_MIN_TOKENS) && expanded(8192));
        // k3-mini's golden prompts (31, 41, 82 tokens) exercise both paths end to end.
        assert!(!expanded(41) && expanded(82));
    }

    #[test]
    fn plan_fits_the_budget_at_k3_shapes() {
        let g = k3();
        let b = MLA_PREFILL_SCRATCH_BYTES;
        assert_eq!(
            plan(&g, 2048, 2048, b),
            Plan {
                head_group: 96,
                q_chunk: 512
            }
        );
        assert_eq!(plan(&g, 100, 100, b).q_chunk, 100);
        assert_eq!(plan(&g, 8192, 8192, b).head_group, 48);
        for (t, len) in [(2048, 2048), (8192, 8192), (32768, 32768), (64, 131072)] {
            let p = plan(&g, t, len, b);
            assert!(p.scratch_floats(&g, len) * 4 <= b, "{t} {len} {p:?}");
            assert!(p.q_chunk >= MLA_PREFILL_MIN_Q_CHUNK.min(t) && p.q_chunk <= t);
            // Groups evened out: no group much smaller than the others.
            let groups = g.heads.div_ceil(p.head_group);
            assert!(groups * p.head_group - g.heads < groups, "{p:?}");
        }
        // One head does not fit: the chunk shrinks first, and never below the minimum.
        let p = plan(&g, 4096, 1 << 20, b);
        assert_eq!(p.head_group, 1);
        assert_eq!(p.q_chunk, MLA_PREFILL_MIN_Q_CHUNK);
        let tight = plan(&g, 4096, 400_000, b);
        assert_eq!(tight.head_group, 1);
        assert!(tight.q_chunk < MLA_PREFILL_Q_CHUNK && tight.scratch_floats(&g, 400_000) * 4 <= b);
    }

    #[test]
    fn sgemm_extents_are_checked() {
        let p = Sgemm {
            trans_a: true,
            trans_b: false,
            m: 4,
            n: 3,
            k: 2,
            alpha: 1.0,
            lda: 2,
            stride_a: 8,
            ldb: 2,
            stride_b: 0,
            ldc: 5,
            stride_c: 15,
            batch: 2,
        };
        // A stored [k=2, m=4] ld 2: the last batch ends at 8 + 3·2 + 2 = 16.
        assert!(p.check("A", (2, 4, 2, 8), 0, 16).is_ok());
        assert!(p.check("A", (2, 4, 2, 8), 1, 16).is_err());
        assert!(p.check("C", (4, 3, 3, 15), 0, 100).is_err(), "ld < rows");
    }
}
