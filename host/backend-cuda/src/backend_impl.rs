//! `k3_model::backend::Backend` for [`CudaBackend`]: f32 activations and dense weights on the
//! device, dense matmuls through cuBLAS (sgemm, default math mode so results track the CPU
//! backend to ~1e-5), everything else through the NVRTC kernels of `ops.rs`.
//!
//! All work is queued on the backend's one stream; only `to_host` and `arena_read` wait for it.
//! Every op returns its error ([`CudaError`] as a `BackendError`), so a failed step stops there.

use crate::device::{CudaBackend, DeviceLinear, DeviceMat, exact_bf16};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::ops::{DeviceExperts, KdaIn, KdaSlot, KdaWeights};
use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaSlice, DevicePtrMut};
use k3_model::backend::{
    Backend, BackendError, KdaGeom, KdaInputs, KdaParams, KdaStateLoc, MlaCacheLoc, MlaGeom,
    MxExpertsHost, MxMatrixHost, OpResult, RouterParams, SituParams,
};
use k3_model::exec::ExecError;

impl CudaBackend {
    /// Make our context current on the calling thread: the engine runs the executor on its own
    /// thread, and raw driver / cuBLAS calls use the thread's current context.
    fn bound(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// Run one op of the `Backend` trait with the context bound, its error as the trait's.
    fn op<T>(&self, f: impl FnOnce() -> Result<T>) -> OpResult<T> {
        self.bound().and_then(|()| f()).map_err(BackendError::from)
    }

    /// `y = x Wᵀ` for row-major `x [M, K]` and `w [N, K]`. Column-major cuBLAS sees `x` as
    /// `Xc [K, M]` and `w` as `Wc [K, N]`, so it computes `Yc [N, M] = Wcᵀ Xc`, which is the
    /// row-major `y [M, N]`.
    pub fn matmul_rt(&self, x: &DeviceMat, w: &DeviceMat) -> Result<DeviceMat> {
        let (m, n, k) = matmul_dims(x, w.rows, w.cols)?;
        if m == 0 || n == 0 || k == 0 {
            return self.zeros(m, n);
        }
        let mut y = self.output(m, n)?; // beta = 0: the GEMM writes every element
        let i = |v: usize| {
            i32::try_from(v).map_err(|_| CudaError::InvalidArg(format!("matmul dim {v} > i32")))
        };
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: i(n)?,
            n: i(m)?,
            k: i(k)?,
            alpha: 1.0f32,
            lda: i(k)?,
            ldb: i(k)?,
            beta: 0.0f32,
            ldc: i(n)?,
        };
        if self.step.recording() {
            self.step.log_gemm(&[0, m, n, k]);
            if self.step.dry() {
                return Ok(y);
            }
        }
        // SAFETY: w holds n*k, x holds m*k and y holds m*n floats, matching the dims and leading
        // dimensions above; all three live until the call is queued on the stream.
        unsafe { self.blas.gemm(cfg, &w.buf, &x.buf, &mut y.buf) }?;
        Ok(y)
    }

    fn embed_rows(&self, table: &DeviceLinear, ids: &[u32]) -> Result<DeviceMat> {
        let d = table.cols;
        let out = self.zeros(ids.len(), d)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(CudaError::InvalidArg(format!(
                "token id {id} outside the vocabulary of {}",
                table.rows
            )));
        }
        if ids.is_empty() {
            return Ok(out);
        }
        let dev_ids = self.upload_slice(ids)?;
        let (t, di, v) = (ids.len() as i32, d as i32, table.rows as u32);
        let l = Launch::new((ids.len(), 1, 1), 256)?;
        match &table.bf16 {
            Some(b) => launch!(self, "embed_rows_bf16", l; b, &dev_ids, &out.buf, &t, &di, &v)?,
            None => {
                let f = self.linear_f32(table)?;
                launch!(self, "embed_rows_f32", l; &f.buf, &dev_ids, &out.buf, &t, &di, &v)?
            }
        }
        Ok(out)
    }

    /// A weight on the device: bf16 bits when every value is exactly bf16, else f32.
    fn upload_linear(&self, rows: usize, cols: usize, data: &[f32]) -> Result<DeviceLinear> {
        if data.len() != rows * cols {
            return Err(CudaError::InvalidArg(format!(
                "{} values for a {rows}x{cols} matrix",
                data.len()
            )));
        }
        let f32 = std::sync::OnceLock::new();
        let bf16 = match exact_bf16(data) {
            Some(bits) => Some(self.upload_slice(&bits)?),
            None => {
                let _ = f32.set(self.upload(rows, cols, data)?);
                None
            }
        };
        Ok(DeviceLinear {
            rows,
            cols,
            bf16,
            f32,
        })
    }

    /// The weight as f32 (its storage, or a copy widened from bf16 once, on first use).
    pub fn linear_f32<'a>(&self, w: &'a DeviceLinear) -> Result<&'a DeviceMat> {
        if let Some(m) = w.f32.get() {
            return Ok(m);
        }
        let bits = w
            .bf16
            .as_ref()
            .ok_or_else(|| CudaError::InvalidArg("weight without storage".into()))?;
        let m = self.zeros(w.rows, w.cols)?;
        let n = (w.rows * w.cols) as i64;
        launch!(self, "bf16_to_f32", geometry::elementwise(n as usize)?; bits, &m.buf, &n)?;
        let _ = w.f32.set(m);
        w.f32
            .get()
            .ok_or_else(|| CudaError::InvalidArg("weight f32 copy".into()))
    }

    /// `y = x Wᵀ` for any weight: bf16 weights through the tensor-core GEMV for decode rows of
    /// small weights (`CudaOptions::gemv_max_weight_elems`) and otherwise one cuBLAS tensor-core GEMM over the hi
    /// and lo bf16 rows of x (kernels/bf16.cu); f32 weights through `matmul_rt`.
    pub fn matmul_linear(&self, x: &DeviceMat, w: &DeviceLinear) -> Result<DeviceMat> {
        let Some(bits) = &w.bf16 else {
            return self.matmul_rt(x, self.linear_f32(w)?);
        };
        let (m, n, k) = matmul_dims(x, w.rows, w.cols)?;
        if m == 0 || n == 0 || k == 0 {
            return self.zeros(m, n);
        }
        let y = self.output(m, n)?; // both paths below write every element
        if m <= GEMV_TC_MAX_ROWS
            && k.is_multiple_of(8)
            && n * k <= self.options.gemv_max_weight_elems
        {
            let (splits, kslice) = gemv_tc_plan(n, k, self.multiprocessors);
            let (mi, ni, ki, ks) = (m as i32, n as i32, k as i32, kslice as i32);
            let l = Launch::new((n.div_ceil(GEMV_TC_BLOCK_ROWS), splits, 1), 128)?;
            if splits == 1 {
                launch!(self, "gemv_bf16_tc_f32", l; &x.buf, bits, &y.buf, &mi, &ni, &ki, &ks)?;
                return Ok(y);
            }
            // Every split writes its whole [M, N] partial before the sum reads it.
            let part = self.uninit::<f32>(splits * m * n)?;
            let (si, yn) = (splits as i32, (m * n) as i64);
            launch!(self, "gemv_bf16_tc_f32", l; &x.buf, bits, &part, &mi, &ni, &ki, &ks)?;
            launch!(self, "gemv_sum_splits_f32", geometry::elementwise(m * n)?; &part, &y.buf, &si, &yn)?;
            return Ok(y);
        }
        // Both are written in full (split, then the GEMM) before anything reads them.
        let xs = self.uninit::<u16>(2 * m * k)?;
        let mut c = self.uninit::<f32>(2 * m * n)?;
        let (xn, yn) = ((m * k) as i64, (m * n) as i64);
        launch!(self, "bf16_split_rows_f32", geometry::elementwise(m * k)?; &x.buf, &xs, &xn)?;
        self.gemm_bf16(bits, 0, &xs, 0, &mut c, 0, n, 2 * m, k)?;
        launch!(self, "sum_row_halves_f32", geometry::elementwise(m * n)?; &c, &y.buf, &yn)?;
        Ok(y)
    }

    fn rows_of(&self, a: &DeviceMat, start: usize, end: usize) -> Result<DeviceMat> {
        if start > end || end > a.rows {
            return Err(CudaError::InvalidArg(format!(
                "rows {start}..{end} of a {}-row matrix",
                a.rows
            )));
        }
        let mut out = self.zeros(end - start, a.cols)?;
        if end > start {
            let src = a.buf.slice(start * a.cols..end * a.cols);
            let mut dst = out.buf.slice_mut(0..(end - start) * a.cols);
            self.copy_dtod(&src, &mut dst)?;
        }
        Ok(out)
    }

    fn concat(&self, parts: &[&DeviceMat]) -> Result<DeviceMat> {
        let cols = parts.first().map_or(0, |m| m.cols);
        if parts.iter().any(|m| m.cols != cols) {
            return Err(CudaError::InvalidArg("concat_rows: widths differ".into()));
        }
        let rows = parts.iter().map(|m| m.rows).sum();
        let mut out = self.zeros(rows, cols)?;
        let mut at = 0;
        for m in parts {
            let n = m.rows * cols;
            if n > 0 {
                let src = m.buf.slice(0..n);
                let mut dst = out.buf.slice_mut(at..at + n);
                self.copy_dtod(&src, &mut dst)?;
            }
            at += n;
        }
        Ok(out)
    }

    fn arena_check(arena: &CudaSlice<f32>, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > arena.len() * 4) {
            return Err(CudaError::InvalidArg(format!(
                "arena bytes {offset}+{len} beyond {}",
                arena.len() * 4
            )));
        }
        Ok(())
    }

    /// Byte-granular copy inside the arena (the caller guarantees the regions do not overlap).
    fn arena_copy_bytes(
        &self,
        arena: &mut CudaSlice<f32>,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<()> {
        Self::arena_check(arena, src, len)?;
        Self::arena_check(arena, dst, len)?;
        self.refuse_while_recording("arena copy")?; // cache moves: not part of a step
        if len == 0 {
            return Ok(());
        }
        let (base, _sync) = arena.device_ptr_mut(&self.stream);
        // SAFETY: both ranges are inside the allocation (checked above); queued on our stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                base + dst as u64,
                base + src as u64,
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    fn arena_zero_bytes(
        &self,
        arena: &mut CudaSlice<f32>,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        Self::arena_check(arena, offset, len)?;
        self.refuse_while_recording("arena zero")?; // cache moves: not part of a step
        if len == 0 {
            return Ok(());
        }
        let (base, _sync) = arena.device_ptr_mut(&self.stream);
        // SAFETY: the range is inside the allocation (checked above); queued on our stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                base + offset as u64,
                0,
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    /// Reads the whole floats covering the byte range (synchronous), then trims to the bytes.
    fn arena_read_bytes(
        &self,
        arena: &CudaSlice<f32>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>> {
        Self::arena_check(arena, offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let (f0, f1) = (offset / 4, (offset + len).div_ceil(4));
        let floats = self.read_back("arena read", &arena.slice(f0..f1))?;
        let bytes: Vec<u8> = floats.iter().flat_map(|f| f.to_ne_bytes()).collect();
        let skip = offset - f0 * 4;
        Ok(bytes[skip..skip + len].to_vec())
    }

    fn upload_experts(&self, h: &MxExpertsHost) -> Result<DeviceExperts> {
        let cat = |ms: &[MxMatrixHost],
                   rows: usize,
                   cols: usize|
         -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
            let mut packed = Vec::with_capacity(ms.len() * rows * cols / 2);
            let mut scales = Vec::with_capacity(ms.len() * rows * cols / 32);
            for m in ms {
                if (m.rows, m.cols) != (rows, cols)
                    || m.packed.len() != rows * cols / 2
                    || m.scales.len() != rows * cols / 32
                {
                    return Err(CudaError::InvalidArg(format!(
                        "expert matrix {}x{} ({} packed, {} scales), want {rows}x{cols}",
                        m.rows,
                        m.cols,
                        m.packed.len(),
                        m.scales.len()
                    )));
                }
                packed.extend_from_slice(&m.packed);
                scales.extend_from_slice(&m.scales);
            }
            Ok((self.upload_slice(&packed)?, self.upload_slice(&scales)?))
        };
        if h.w1.len() != h.num_experts || h.w3.len() != h.num_experts || h.w2.len() != h.num_experts
        {
            return Err(CudaError::InvalidArg(
                "expert count differs per matrix".into(),
            ));
        }
        Ok(DeviceExperts {
            experts: h.num_experts,
            latent: h.latent,
            inter: h.inter,
            w1: cat(&h.w1, h.inter, h.latent)?,
            w3: cat(&h.w3, h.inter, h.latent)?,
            w2: cat(&h.w2, h.latent, h.inter)?,
        })
    }

    fn kda_seq(
        &self,
        arena: &mut CudaSlice<f32>,
        g: KdaGeom,
        p: &KdaParams<'_, Self>,
        inp: &KdaInputs<'_, Self>,
        loc: KdaStateLoc<'_>,
    ) -> Result<DeviceMat> {
        let (w, x) = kda_parts(p, inp);
        // One token is the recurrent decode kernel; anything else (prefill chunks) goes through
        // the chunked path, which also rejects checkpoints outside 1..=T.
        if let Some(slots) = decode_slots(&[(0, x.q.rows)], &[loc]) {
            return self.kda_decode(arena, g, &w, &x, &slots);
        }
        self.kda_prefill(arena, g, &w, &x, loc.offset, loc.checkpoints)
    }

    /// `f`, timed under `key` when `K3_PROFILE` is set (see `profile.rs`).
    pub(crate) fn timed<T>(&self, key: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
        match &self.profile {
            None => f(),
            Some(p) => p.time(
                key(),
                || {
                    let _ = self.stream.synchronize();
                },
                f,
            ),
        }
    }

    /// Run a fallible mixer op: refused once an earlier failure is recorded, on our context.
    #[allow(clippy::too_many_arguments)]
    fn mla_seqs(
        &self,
        arena: &mut CudaSlice<f32>,
        g: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        spans: &[(usize, usize)],
        locs: &[MlaCacheLoc<'_>],
    ) -> Result<DeviceMat> {
        if spans.len() != locs.len() || spans.last().map_or(0, |s| s.1) != q.rows {
            return Err(CudaError::InvalidArg(
                "MLA batch: spans do not cover the rows".into(),
            ));
        }
        let row_bytes = 4 * g.row();
        let mut seq_pages = Vec::with_capacity(locs.len());
        let (mut append_at, mut lens, mut owner) = (Vec::new(), Vec::new(), Vec::new());
        let mut pt = 0;
        for (i, (&(r0, r1), loc)) in spans.iter().zip(locs).enumerate() {
            pt = loc.page_tokens;
            if pt == 0 || (i > 0 && pt != locs[0].page_tokens) {
                return Err(CudaError::InvalidArg("page_tokens differ or are 0".into()));
            }
            let end = loc.start_pos + (r1 - r0);
            let npages = end.div_ceil(pt);
            if loc.pages.len() < npages {
                return Err(CudaError::InvalidArg(format!(
                    "{} KV pages for {end} positions",
                    loc.pages.len()
                )));
            }
            let pages: Vec<usize> = loc.pages[..npages]
                .iter()
                .map(|&p| p + loc.layer_offset)
                .collect();
            for pos in loc.start_pos..end {
                append_at.push(pages[pos / pt] + (pos % pt) * row_bytes);
                lens.push(pos + 1);
                owner.push(i);
            }
            seq_pages.push(pages);
        }
        // Sequences with many new tokens take the expanded form (mla_prefill.rs); the others
        // stay on this absorbed launch sequence.
        if spans
            .iter()
            .any(|&(r0, r1)| crate::mla_prefill::expanded(r1 - r0))
        {
            let starts: Vec<usize> = locs.iter().map(|l| l.start_pos).collect();
            return self.mla_seqs_split(
                arena, g, q, kv_a, kv_norm, kv_b, spans, &starts, &seq_pages, pt,
            );
        }
        let tables: Vec<&[usize]> = owner.iter().map(|&i| &seq_pages[i][..]).collect();
        self.mla_decode(
            arena, g, q, kv_a, kv_norm, kv_b, &append_at, &tables, &lens, pt,
        )
    }
}

/// The decode kernel's state slots when every sequence has exactly one new token and at most one
/// checkpoint (after it); `None` otherwise (the chunked path).
fn decode_slots(spans: &[(usize, usize)], locs: &[KdaStateLoc<'_>]) -> Option<Vec<KdaSlot>> {
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
fn kda_parts<'a>(
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

/// `(M, N, K)` of `x [M, K] · Wᵀ` for a weight `[rows, cols]`, or the mismatch as an error.
fn matmul_dims(x: &DeviceMat, rows: usize, cols: usize) -> Result<(usize, usize, usize)> {
    if x.cols != cols {
        return Err(CudaError::InvalidArg(format!(
            "matmul: x {}x{} with W {rows}x{cols}",
            x.rows, x.cols
        )));
    }
    Ok((x.rows, rows, x.cols))
}

/// kernels/bf16.cu `gemv_bf16_tc_f32`: most rows of x, weight rows per 128-thread block, K step.
const GEMV_TC_MAX_ROWS: usize = 16;
const GEMV_TC_BLOCK_ROWS: usize = 128;
const GEMV_TC_KSTEP: usize = 64;
/// Blocks resident per SM (98 registers x 128 threads, `__launch_bounds__(128, 4)`).
const GEMV_TC_BLOCKS_PER_SM: usize = 4;
/// Fewest columns per K split: shorter slices cost more in partial sums (splits x M x N floats
/// written and read) and per-warp setup than the extra parallelism returns.
const GEMV_TC_MIN_SLICE: usize = 512;

/// `(splits, kslice)` for `gemv_bf16_tc_f32`: as many K splits as fit the row blocks into one
/// wave of resident blocks (the weight stream needs every SM's loads in flight; a second, partial
/// wave would leave most SMs idle at the end), slices a multiple of the K step and at least
/// `GEMV_TC_MIN_SLICE` long. Big-N shapes get one split (no partials, one launch).
fn gemv_tc_plan(n: usize, k: usize, sms: usize) -> (usize, usize) {
    let row_blocks = n.div_ceil(GEMV_TC_BLOCK_ROWS);
    let wave = sms.max(1) * GEMV_TC_BLOCKS_PER_SM;
    let want = (wave / row_blocks).clamp(1, k.div_ceil(GEMV_TC_MIN_SLICE).clamp(1, 65535));
    let kslice = k.div_ceil(want).next_multiple_of(GEMV_TC_KSTEP);
    (k.div_ceil(kslice), kslice)
}

/// Largest weight (elements) `gemv_bf16_tc_f32` takes (M <= 16, K % 8 == 0); bigger ones, more
/// rows and other K go to the split cuBLAS GEMM; `CudaOptions::gemv_max_weight_elems` sets the
/// bound (0: cuBLAS always). The kernel wins where launch overhead dominates and loses above
/// about 2^22 weights, where cuBLAS streams the weight faster.

/// Row counts in the profile's keys, rounded up to a power of two so prompts of similar length
/// share a line.
fn bucket(n: usize) -> usize {
    n.next_power_of_two()
}

impl Backend for CudaBackend {
    type Act = DeviceMat;
    type Linear = DeviceLinear;
    type Vector = CudaSlice<f32>;
    type Experts = DeviceExperts;
    type Arena = CudaSlice<f32>;

    fn linear(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<DeviceLinear> {
        self.op(|| self.upload_linear(rows, cols, &data))
    }

    fn vector(&self, data: Vec<f32>) -> OpResult<CudaSlice<f32>> {
        self.op(|| {
            if data.is_empty() {
                return Ok(self.stream.alloc_zeros::<f32>(1)?);
            }
            self.upload_slice(&data)
        })
    }

    fn experts(&self, host: MxExpertsHost) -> OpResult<DeviceExperts> {
        self.op(|| self.upload_experts(&host))
    }

    fn arena(&self, bytes: usize) -> OpResult<CudaSlice<f32>> {
        self.op(|| {
            // At least one float, so the buffer exists.
            let a = self.stream.alloc_zeros::<f32>((bytes / 4).max(1))?;
            let base = cudarc::driver::DevicePtr::device_ptr(&a, &self.stream).0;
            self.step.add_arena(base, a.len() * 4);
            Ok(a)
        })
    }

    fn arena_len(&self, arena: &CudaSlice<f32>) -> usize {
        arena.len() * 4
    }

    fn arena_copy(
        &self,
        arena: &mut CudaSlice<f32>,
        src: usize,
        dst: usize,
        len: usize,
    ) -> OpResult<()> {
        self.op(|| self.arena_copy_bytes(arena, src, dst, len))
    }

    fn arena_zero(&self, arena: &mut CudaSlice<f32>, offset: usize, len: usize) -> OpResult<()> {
        self.op(|| self.arena_zero_bytes(arena, offset, len))
    }

    fn arena_read(&self, arena: &CudaSlice<f32>, offset: usize, len: usize) -> OpResult<Vec<u8>> {
        self.op(|| self.arena_read_bytes(arena, offset, len))
    }

    fn to_host(&self, a: &DeviceMat) -> OpResult<Vec<f32>> {
        self.op(|| self.download(a))
    }

    fn rows(&self, a: &DeviceMat) -> usize {
        a.rows
    }

    fn top_k_rows(&self, a: &DeviceMat, k: usize) -> OpResult<Vec<Vec<(u32, f32)>>> {
        if k == 0 || k > crate::ops::TOPK_MAX {
            return Ok(k3_model::exec::top_k_of_rows(&self.to_host(a)?, a.rows, k));
        }
        self.op(|| CudaBackend::top_k_rows(self, a, k))
    }

    fn slice_rows(&self, a: &DeviceMat, start: usize, end: usize) -> OpResult<DeviceMat> {
        self.timed(
            || "slice_rows".into(),
            || self.op(|| self.rows_of(a, start, end)),
        )
    }

    fn concat_rows(&self, parts: &[&DeviceMat]) -> OpResult<DeviceMat> {
        self.timed(|| "concat_rows".into(), || self.op(|| self.concat(parts)))
    }

    fn embed(&self, table: &DeviceLinear, ids: &[u32]) -> OpResult<DeviceMat> {
        self.timed(
            || "embed".into(),
            || self.op(|| self.embed_rows(table, ids)),
        )
    }

    fn matmul(&self, x: &DeviceMat, w: &DeviceLinear) -> OpResult<DeviceMat> {
        self.timed(
            || {
                let ty = if w.bf16.is_some() { "bf16" } else { "f32" };
                format!("matmul {}x{} {ty} (M={})", w.rows, w.cols, bucket(x.rows))
            },
            || self.op(|| self.matmul_linear(x, w)),
        )
    }

    fn rms_norm(&self, x: &DeviceMat, w: &CudaSlice<f32>, eps: f32) -> OpResult<DeviceMat> {
        self.timed(
            || "rms_norm".into(),
            || self.op(|| CudaBackend::rms_norm(self, x, w, eps)),
        )
    }

    fn add_assign(&self, p: &mut DeviceMat, a: &DeviceMat) -> OpResult<()> {
        self.timed(
            || "add_assign".into(),
            || self.op(|| CudaBackend::add_assign(self, p, a)),
        )
    }

    fn attn_res(
        &self,
        sources: &[&DeviceMat],
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || format!("attn_res ({} sources)", sources.len()),
            || self.op(|| CudaBackend::attn_res(self, sources, w, eps)),
        )
    }

    fn situ_glu(&self, gate: &DeviceMat, up: &DeviceMat, p: SituParams) -> OpResult<DeviceMat> {
        self.timed(
            || "situ_glu".into(),
            || self.op(|| CudaBackend::situ_glu(self, gate, up, p)),
        )
    }

    fn sigmoid_mul(&self, o: &mut DeviceMat, gate: &DeviceMat) -> OpResult<()> {
        self.timed(
            || "sigmoid_mul".into(),
            || self.op(|| CudaBackend::sigmoid_mul(self, o, gate)),
        )
    }

    fn gated_head_norm(
        &self,
        o: &DeviceMat,
        gate: &DeviceMat,
        w: &CudaSlice<f32>,
        head_dim: usize,
        eps: f32,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || "gated_head_norm".into(),
            || self.op(|| CudaBackend::gated_head_norm(self, o, gate, w, head_dim, eps)),
        )
    }

    fn kda(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: KdaGeom,
        params: &KdaParams<'_, Self>,
        inputs: &KdaInputs<'_, Self>,
        loc: KdaStateLoc<'_>,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || format!("kda (T={})", bucket(inputs.qkv[0].rows)),
            || self.op(|| self.kda_seq(arena, geom, params, inputs, loc)),
        )
    }

    fn mla(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        loc: MlaCacheLoc<'_>,
    ) -> OpResult<DeviceMat> {
        let spans = [(0, q.rows)];
        self.timed(
            || format!("mla (T={})", bucket(q.rows)),
            || self.op(|| self.mla_seqs(arena, geom, q, kv_a, kv_norm, kv_b, &spans, &[loc])),
        )
    }

    fn moe_routed(
        &self,
        z: &DeviceMat,
        router_logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        experts: &DeviceExperts,
        router: RouterParams,
        situ: SituParams,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || format!("moe_routed (T={})", bucket(z.rows)),
            || {
                self.op(|| {
                    CudaBackend::moe_routed(self, z, router_logits, bias, experts, router, situ)
                })
            },
        )
    }

    /// Every sequence decoding one token (at most one checkpoint, after it): one launch of the
    /// batched decode kernel over the sequences' state slots. Anything else: per sequence.
    fn kda_batch(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: KdaGeom,
        params: &KdaParams<'_, Self>,
        inputs: &KdaInputs<'_, Self>,
        spans: &[(usize, usize)],
        locs: &[KdaStateLoc<'_>],
    ) -> OpResult<DeviceMat> {
        match decode_slots(spans, locs) {
            Some(slots) if spans.len() > 1 => {
                let (w, x) = kda_parts(params, inputs);
                self.timed(
                    || format!("kda_batch decode (N={})", bucket(slots.len())),
                    || self.op(|| self.kda_decode(arena, geom, &w, &x, &slots)),
                )
            }
            _ => {
                k3_model::backend::kda_per_sequence(self, arena, geom, params, inputs, spans, locs)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn mla_batch(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        spans: &[(usize, usize)],
        locs: &[MlaCacheLoc<'_>],
    ) -> OpResult<DeviceMat> {
        self.timed(
            || {
                format!(
                    "mla_batch (T={}, seqs={})",
                    bucket(q.rows),
                    bucket(spans.len())
                )
            },
            || self.op(|| self.mla_seqs(arena, geom, q, kv_a, kv_norm, kv_b, spans, locs)),
        )
    }

    fn run_step(
        &self,
        replayable: bool,
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, ExecError>,
    ) -> std::result::Result<Option<DeviceMat>, ExecError> {
        self.run_graph_step(replayable, pass)
    }
}

#[cfg(test)]
mod gemv_tests {
    use super::gemv_tc_plan;

    #[test]
    fn gemv_tc_plan_covers_k_in_one_wave() {
        // K3 decode shapes on 132 SMs: (n, k) -> (splits, kslice).
        assert_eq!(gemv_tc_plan(12288, 7168, 132), (5, 1472));
        assert_eq!(gemv_tc_plan(33792, 7168, 132), (2, 3584));
        assert_eq!(gemv_tc_plan(1536, 7168, 132), (14, 512));
        assert_eq!(gemv_tc_plan(12288, 128, 132), (1, 128));
        assert_eq!(gemv_tc_plan(100_000, 7168, 132), (1, 7168));
        for &(n, k) in &[
            (1, 8),
            (77, 520),
            (7168, 12288),
            (18432, 1536),
            (96, 7168),
            (300, 7000),
        ] {
            let (s, ks) = gemv_tc_plan(n, k, 132);
            assert!(
                ks.is_multiple_of(64) && s * ks >= k && (s - 1) * ks < k,
                "{n}x{k}"
            );
            assert!(
                s == 1 || n.div_ceil(128) * s <= 132 * 4,
                "{n}x{k}: one wave"
            );
        }
    }
}
