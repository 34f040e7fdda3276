//! Dense ops: matmuls (cuBLAS SGEMM for f32 weights; for bf16 weights the tensor-core GEMV on
//! decode rows or a cuBLAS bf16 GEMM over hi / lo halves of the activation), embeddings, row
//! copies, norms, elementwise ops, AttnRes and the top-k selection of logits.

use crate::buf::Buf;
use crate::device::{CudaBackend, DeviceLinear, DeviceMat, exact_bf16};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::launch::{i32_of, same_shape, situ_linear_args};
use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::CudaSlice;
use k3_model::backend::SituParams;

/// Largest k of `top_k_rows` (kernels/sampling.cu TOPK_MAX: the picks are sorted in shared memory).
pub const TOPK_MAX: usize = 1024;

/// Columns per block in the first top-k pass: a 163,840-wide row spreads over 40 SMs.
const TOPK_SEGMENT: usize = 4096;

/// Threads per block of the one-block-per-row kernel kernels/norm.cu rms_norm_f32: at decode
/// sizes a block streams its row alone, so it is wide.
const ROW_BLOCK: u32 = 512;

impl CudaBackend {
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

    pub(crate) fn embed_rows(&self, table: &DeviceLinear, ids: &[u32]) -> Result<DeviceMat> {
        let d = table.cols;
        let out = self.output(ids.len(), d)?; // a block per token writes its whole row
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(CudaError::InvalidArg(format!(
                "token id {id} outside the vocabulary of {}",
                table.rows
            )));
        }
        if ids.is_empty() {
            return Ok(out);
        }
        let dev_ids = self.upload_ids(ids)?;
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
    pub(crate) fn upload_linear(
        &self,
        rows: usize,
        cols: usize,
        data: &[f32],
    ) -> Result<DeviceLinear> {
        if data.len() != rows * cols {
            return Err(CudaError::InvalidArg(format!(
                "{} values for a {rows}x{cols} matrix",
                data.len()
            )));
        }
        let f32 = std::sync::OnceLock::new();
        let bf16 = match exact_bf16(data) {
            Some(bits) => Some(self.upload_kept(&bits)?),
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
        if self.step.dry() {
            // The copy is kept with the weight, so it must be real memory that a launch has
            // filled; a dry pass launches nothing (its step then runs eagerly, which makes it).
            return Err(CudaError::Unsupported(
                "a weight's f32 copy is made by an eager step, not a dry pass".into(),
            ));
        }
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
    /// and lo bf16 rows of x (kernels/bf16.cu), or the hi rows alone in bf16 mode
    /// (`CudaOptions::dtype`); f32 weights through `matmul_rt`.
    pub fn matmul_linear(&self, x: &DeviceMat, w: &DeviceLinear) -> Result<DeviceMat> {
        self.matmul_linear_split(x, w, &mut None)
    }

    /// `matmul_linear` for several weights sharing `x`: x's bf16 rows are made once, by the first
    /// product that takes cuBLAS, and read by the others. In bfloat16 mode the cuBLAS products
    /// run at once, each on a side stream, while the backend's stream runs the others (the
    /// small-N GEMVs) (lanes.rs).
    pub fn matmul_linears(&self, x: &DeviceMat, ws: &[&DeviceLinear]) -> Result<Vec<DeviceMat>> {
        let cublas: Vec<bool> = ws.iter().map(|w| self.takes_cublas(x, w)).collect();
        let side = (cublas.iter().filter(|&&c| c).count()).min(self.lanes.len());
        if side == 0 || ws.len() < 2 || self.options.dtype.planes() != 1 {
            let mut split = None;
            return ws
                .iter()
                .map(|w| self.matmul_linear_split(x, w, &mut split))
                .collect();
        }
        // Everything the side streams touch exists before the fork and is freed after the join.
        // x's bf16 rows, if made here freed when this returns, after the join.
        let mut own = None;
        let xs = self.bf16_rows_of(x, &mut own)?;
        let mut outs = cublas
            .iter()
            .zip(ws)
            .map(|(&c, w)| c.then(|| self.output(x.rows, w.rows)).transpose())
            .collect::<Result<Vec<_>>>()?;
        self.fork_lanes(side)?;
        let mut product = 0;
        let res = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| match (out.take(), &w.bf16) {
                (Some(mut y), Some(bits)) => {
                    let lane = self.lanes[product % side].gemm();
                    product += 1;
                    let (n, m, k) = (w.rows, x.rows, x.cols);
                    self.gemm_bf16_on(lane, bits, 0, xs, 0, &mut y.buf, 0, n, m, k)?;
                    Ok(y)
                }
                _ => self.matmul_linear_split(x, w, &mut None),
            })
            .collect::<Result<Vec<_>>>();
        let joined = self.join_lanes(side);
        let res = res?;
        joined?;
        Ok(res)
    }

    /// Whether `x Wᵀ` is a cuBLAS bf16 GEMM over x's bf16 rows (`matmul_linear_split`).
    pub(crate) fn takes_cublas(&self, x: &DeviceMat, w: &DeviceLinear) -> bool {
        let (m, n, k) = (x.rows, w.rows, w.cols);
        w.bf16.is_some() && x.cols == k && m * n * k != 0 && !self.takes_gemv(m, n, k)
    }

    /// Whether a bf16 product of these dims is the tensor-core GEMV's (decode rows, small weight).
    pub(crate) fn takes_gemv(&self, m: usize, n: usize, k: usize) -> bool {
        m <= GEMV_TC_MAX_ROWS && k.is_multiple_of(8) && n * k <= self.options.gemv_max_weight_elems
    }

    /// x's bf16 rows for products in bfloat16 mode: those the norm that wrote x left beside it
    /// (`DeviceMat::bf16`), or made into `own`, which the caller keeps while a product may read
    /// them.
    pub(crate) fn bf16_rows_of<'a>(
        &self,
        x: &'a DeviceMat,
        own: &'a mut Option<Buf<u16>>,
    ) -> Result<&'a Buf<u16>> {
        match &x.bf16 {
            Some(rows) => Ok(rows),
            None => Ok(own.insert(self.bf16_rows(x)?)),
        }
    }

    /// x's rows as bf16 in the mode's planes (hi rows, then lo rows in float32 mode).
    pub(crate) fn bf16_rows(&self, x: &DeviceMat) -> Result<Buf<u16>> {
        let planes = self.options.dtype.planes();
        let (n, pi) = (x.rows * x.cols, planes as i32);
        let xs = self.uninit::<u16>(planes * n)?; // every element written by the split
        let xn = n as i64;
        launch!(self, "bf16_split_rows_f32", geometry::elementwise(n)?; &x.buf, &xs, &xn, &pi)?;
        Ok(xs)
    }

    /// `matmul_linear`, with x's bf16 rows (`bf16_split_rows_f32` of x in the mode's planes) taken
    /// from `split` or made and left there.
    fn matmul_linear_split(
        &self,
        x: &DeviceMat,
        w: &DeviceLinear,
        split: &mut Option<Buf<u16>>,
    ) -> Result<DeviceMat> {
        let Some(bits) = &w.bf16 else {
            return self.matmul_rt(x, self.linear_f32(w)?);
        };
        let (m, n, k) = matmul_dims(x, w.rows, w.cols)?;
        if m == 0 || n == 0 || k == 0 {
            return self.zeros(m, n);
        }
        let y = self.output(m, n)?; // both paths below write every element
        if self.takes_gemv(m, n, k) {
            let (splits, kslice) = gemv_tc_plan(n, k, self.multiprocessors);
            let (mi, ni, ki, ks) = (m as i32, n as i32, k as i32, kslice as i32);
            // x in three exact bf16 pieces in float32 mode, rounded once like the GEMMs otherwise.
            let pieces: i32 = if self.options.dtype == crate::Dtype::F32 {
                3
            } else {
                1
            };
            let row_blocks = n.div_ceil(GEMV_TC_BLOCK_ROWS);
            let l = Launch::new((row_blocks, splits, 1), 128)?;
            let t = &self.gemv_tickets;
            if splits == 1 {
                launch!(self, "gemv_bf16_tc_f32", l; &x.buf, bits, &y.buf, &y.buf, t, &mi, &ni, &ki, &ks, &pieces)?;
                return Ok(y);
            }
            // A ticket per row block (gemv_tc_plan splits only what fits one wave of blocks).
            if row_blocks > t.len() {
                return Err(CudaError::InvalidArg(format!(
                    "gemv: {row_blocks} row blocks split, {} tickets",
                    t.len()
                )));
            }
            // Every split writes its whole [M, N] partial before the last block sums them.
            let part = self.uninit::<f32>(splits * m * n)?;
            launch!(self, "gemv_bf16_tc_f32", l; &x.buf, bits, &part, &y.buf, t, &mi, &ni, &ki, &ks, &pieces)?;
            return Ok(y);
        }
        // Both are written in full (split, then the GEMM) before anything reads them. In
        // bfloat16 mode x's bf16 rows may have come with it, from the norm that wrote it.
        let planes = self.options.dtype.planes();
        let yn = (m * n) as i64;
        let xs: &Buf<u16> = match (&x.bf16, split) {
            (Some(rows), _) if planes == 1 => rows,
            (_, Some(xs)) => xs,
            (_, split) => split.insert(self.bf16_rows(x)?),
        };
        if planes == 1 {
            // The hi rows alone: x rounded once to bf16, half the tensor-core work.
            let mut y = y;
            self.gemm_bf16_on(self.main_gemm(), bits, 0, xs, 0, &mut y.buf, 0, n, m, k)?;
            return Ok(y);
        }
        let mut c = self.uninit::<f32>(2 * m * n)?;
        self.gemm_bf16_on(self.main_gemm(), bits, 0, xs, 0, &mut c, 0, n, 2 * m, k)?;
        launch!(self, "sum_row_halves_f32", geometry::elementwise(m * n)?; &c, &y.buf, &yn)?;
        Ok(y)
    }

    pub(crate) fn rows_of(&self, a: &DeviceMat, start: usize, end: usize) -> Result<DeviceMat> {
        if start > end || end > a.rows {
            return Err(CudaError::InvalidArg(format!(
                "rows {start}..{end} of a {}-row matrix",
                a.rows
            )));
        }
        let mut out = self.output(end - start, a.cols)?; // the copy fills it
        if end > start {
            let src = a.buf.slice(start * a.cols..end * a.cols);
            let mut dst = out.buf.slice_mut(0..(end - start) * a.cols);
            self.copy_dtod(&src, &mut dst)?;
        }
        Ok(out)
    }

    pub(crate) fn concat(&self, parts: &[&DeviceMat]) -> Result<DeviceMat> {
        let cols = parts.first().map_or(0, |m| m.cols);
        if parts.iter().any(|m| m.cols != cols) {
            return Err(CudaError::InvalidArg("concat_rows: widths differ".into()));
        }
        let rows = parts.iter().map(|m| m.rows).sum();
        let mut out = self.output(rows, cols)?; // the parts' copies fill it
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

    pub fn rms_norm(&self, x: &DeviceMat, w: &CudaSlice<f32>, eps: f32) -> Result<DeviceMat> {
        if w.len() != x.cols {
            return Err(CudaError::InvalidArg(format!(
                "rms_norm weight {} for width {}",
                w.len(),
                x.cols
            )));
        }
        let mut y = self.output(x.rows, x.cols)?; // a block per row writes its whole row
        let (rows, cols) = (i32_of(x.rows, "rows")?, i32_of(x.cols, "cols")?);
        // In bfloat16 mode the rows' bf16 copy too (whole rows), for a cuBLAS product.
        let l = geometry::per_row(x.rows, ROW_BLOCK)?;
        y.bf16 = self.norm_bf16_rows(x.rows * x.cols)?;
        match &y.bf16 {
            Some(b) => {
                launch!(self, "rms_norm_f32", l; &x.buf, w, &y.buf, &rows, &cols, &eps, b, &1i32)?
            }
            None => {
                launch!(self, "rms_norm_f32", l; &x.buf, w, &y.buf, &rows, &cols, &eps, &y.buf, &0i32)?
            }
        }
        Ok(y)
    }

    /// The bf16 rows a norm (or the GLU) writes beside its f32 output in bfloat16 mode
    /// (`DeviceMat::bf16`): `None` in float32 mode, whose products take x in hi / lo planes.
    pub(crate) fn norm_bf16_rows(&self, len: usize) -> Result<Option<Buf<u16>>> {
        if self.options.dtype.planes() != 1 {
            return Ok(None);
        }
        Ok(Some(self.uninit::<u16>(len)?))
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
        let mut y = self.output(o.rows, o.cols)?; // a warp per (row, head) writes its head
        let heads = o.cols / head_dim;
        let (r, h, hd) = (
            i32_of(o.rows, "rows")?,
            i32_of(heads, "heads")?,
            i32_of(head_dim, "head_dim")?,
        );
        // In bfloat16 mode the rows' bf16 copy too, for the output projection's cuBLAS product.
        let l = geometry::warp_per_item(o.rows * heads)?;
        y.bf16 = self.norm_bf16_rows(o.rows * o.cols)?;
        match &y.bf16 {
            Some(b) => launch!(self, "gated_head_norm_f32", l;
                &o.buf, &gate.buf, w, &y.buf, &r, &h, &hd, &eps, b, &1i32)?,
            None => launch!(self, "gated_head_norm_f32", l;
                &o.buf, &gate.buf, w, &y.buf, &r, &h, &hd, &eps, &y.buf, &0i32)?,
        }
        Ok(y)
    }

    pub fn situ_glu(&self, gate: &DeviceMat, up: &DeviceMat, p: SituParams) -> Result<DeviceMat> {
        let mut out = self.output(gate.rows, gate.cols)?; // grid-stride over every element
        // In bfloat16 mode the bf16 copy too, for the down-projection's cuBLAS product.
        out.bf16 = self.norm_bf16_rows(gate.rows * gate.cols)?;
        self.situ_glu_into(&self.stream, gate, up, p, &out)?;
        Ok(out)
    }

    /// SiTU-GLU of `gate` and `up` into `out` (and its bf16 rows, if it has them) on `stream`.
    pub(crate) fn situ_glu_into(
        &self,
        stream: &cudarc::driver::CudaStream,
        gate: &DeviceMat,
        up: &DeviceMat,
        p: SituParams,
        out: &DeviceMat,
    ) -> Result<()> {
        same_shape(gate, up, "situ_glu")?;
        same_shape(gate, out, "situ_glu output")?;
        let n = (gate.rows * gate.cols) as i64;
        let (lin, has) = situ_linear_args(p);
        let l = geometry::elementwise(n as usize)?;
        match &out.bf16 {
            Some(b) => launch!(on stream, self, "situ_glu_f32", l;
                &gate.buf, &up.buf, &out.buf, &n, &p.beta, &lin, &has, b, &1i32),
            None => launch!(on stream, self, "situ_glu_f32", l;
                &gate.buf, &up.buf, &out.buf, &n, &p.beta, &lin, &has, &out.buf, &0i32),
        }
    }

    pub fn add_assign(&self, p: &mut DeviceMat, a: &DeviceMat) -> Result<()> {
        let p = p.written();
        same_shape(p, a, "add_assign")?;
        let n = (p.rows * p.cols) as i64;
        launch!(self, "add_assign_f32", geometry::elementwise(n as usize)?; &mut p.buf, &a.buf, &n)
    }

    pub fn sigmoid_mul(&self, o: &mut DeviceMat, gate: &DeviceMat) -> Result<()> {
        let o = o.written();
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
        let (last, bank) = sources
            .split_last()
            .ok_or_else(|| CudaError::InvalidArg("attn_res with no sources".into()))?;
        self.attn_res_launch(bank, last, None, None, w, eps)
    }

    /// `last += add`, then `rms_norm(attn_res(bank ++ [last], w), norm)` in one kernel
    /// (Backend::attn_res_norm).
    pub fn attn_res_norm(
        &self,
        bank: &[&DeviceMat],
        last: &mut DeviceMat,
        add: Option<&DeviceMat>,
        w: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<DeviceMat> {
        if let Some(a) = add {
            same_shape(last, a, "attn_res_norm")?;
        }
        if norm.len() != last.cols {
            return Err(CudaError::InvalidArg(format!(
                "attn_res_norm: norm weight {} for width {}",
                norm.len(),
                last.cols
            )));
        }
        // The kernel writes `last` (held mutably here) only when `add` is given.
        self.attn_res_launch(bank, last.written(), add, Some(norm), w, eps)
    }

    /// kernels/attnres.cu `attn_res_f32` over `bank` and `last`: `add` into `last` first and
    /// `norm` after, when given.
    fn attn_res_launch(
        &self,
        bank: &[&DeviceMat],
        last: &DeviceMat,
        add: Option<&DeviceMat>,
        norm: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<DeviceMat> {
        let (rows, cols) = (last.rows, last.cols);
        if bank.len() > 8 {
            return Err(CudaError::Unsupported(format!(
                "attn_res over {} sources (<= 9)",
                bank.len() + 1
            )));
        }
        if let Some(m) = bank.iter().find(|m| (m.rows, m.cols) != (rows, cols)) {
            return Err(CudaError::InvalidArg(format!(
                "attn_res: a {}x{} source beside {rows}x{cols}",
                m.rows, m.cols
            )));
        }
        if w.len() != cols {
            return Err(CudaError::InvalidArg(format!(
                "attn_res weight {} for width {cols}",
                w.len()
            )));
        }
        // A cluster per row; its blocks' column spans cover the row.
        let out = self.output(rows, cols)?;
        // Unused bank slots, `add` and `norm` when absent: any valid pointer, never read.
        let src: Vec<&CudaSlice<f32>> =
            (0..8).map(|i| bank.get(i).map_or(w, |m| &*m.buf)).collect();
        let (add_buf, has_add) = add.map_or((w, 0), |a| (&*a.buf, 1));
        let (norm_buf, has_norm) = norm.map_or((w, 0), |n| (n, 1));
        let (nb, r, d) = (
            bank.len() as i32,
            i32_of(rows, "rows")?,
            i32_of(cols, "cols")?,
        );
        // With the norm (a sublayer's input), in bfloat16 mode its bf16 copy too.
        let mut out = out;
        if norm.is_some() {
            out.bf16 = self.norm_bf16_rows(rows * cols)?;
        }
        let l = geometry::attn_res(rows)?;
        match &out.bf16 {
            Some(b) => launch!(self, "attn_res_f32", l;
                src[0], src[1], src[2], src[3], src[4], src[5], src[6], src[7], &nb, &last.buf, add_buf, &has_add,
                w, norm_buf, &has_norm, &out.buf, &r, &d, &eps, b, &1i32)?,
            None => launch!(self, "attn_res_f32", l;
                src[0], src[1], src[2], src[3], src[4], src[5], src[6], src[7], &nb, &last.buf, add_buf, &has_add,
                w, norm_buf, &has_norm, &out.buf, &r, &d, &eps, &out.buf, &0i32)?,
        }
        Ok(out)
    }

    /// Each row's `k` largest finite logits (1 <= k <= TOPK_MAX), as k3_model::top_k_of_row
    /// orders them, selected on the device (kernels/sampling.cu): only k pairs per row are
    /// copied back. Not part of a logged step (it reads back), so it runs after the step.
    ///
    /// `masks` (empty, or one entry per row) are token bitmasks for constrained decoding
    /// (`k3_model::select::token_mask_allows`); they are uploaded in one copy and applied by the
    /// segment selection, so a forbidden token is never a candidate.
    pub fn top_k_rows(
        &self,
        logits: &DeviceMat,
        k: usize,
        masks: &[Option<&[u32]>],
    ) -> Result<Vec<Vec<(u32, f32)>>> {
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
        let (mask_table, mask_words) = self.upload_token_masks(rows, logits.cols, masks)?;
        let mw = i32_of(mask_words, "mask words")?;
        launch!(self, "topk_segments_f32", Launch::new((segments, rows, 1), 512)?;
            &logits.buf, &seg_ids, &seg_vals, &seg_count, &r, &v, &kk, &sl, &mask_table, &mw)?;
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
}

impl CudaBackend {
    /// The mask table `topk_segments_f32` reads: `rows` mask indices (-1: unmasked) then each
    /// given mask padded with zero words (forbidden) to `ceil(vocab / 32)` words. Without any
    /// mask: a one-word placeholder and 0 words, so nothing is copied but the kernel argument.
    fn upload_token_masks(
        &self,
        rows: usize,
        vocab: usize,
        masks: &[Option<&[u32]>],
    ) -> Result<(Buf<u32>, usize)> {
        if masks.iter().all(Option::is_none) {
            return Ok((self.uninit::<u32>(1)?, 0));
        }
        if masks.len() != rows {
            return Err(CudaError::InvalidArg(format!(
                "{} token masks for {rows} rows",
                masks.len()
            )));
        }
        let words = vocab.div_ceil(32);
        let mut table: Vec<u32> = Vec::with_capacity(rows + rows * words);
        let mut next = 0u32;
        for m in masks {
            table.push(match m {
                Some(_) => {
                    next += 1;
                    next - 1
                }
                None => u32::MAX, // -1 as the kernel's int
            });
        }
        for m in masks.iter().flatten() {
            let n = m.len().min(words);
            table.extend_from_slice(&m[..n]);
            table.resize(table.len() + (words - n), 0);
        }
        Ok((self.stream.memcpy_stod(&table)?.into(), words))
    }
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

/// Blocks resident per SM (`__launch_bounds__(128, 4)`: at most 128 registers a thread).
const GEMV_TC_BLOCKS_PER_SM: usize = 4;

/// Fewest columns per K split. Small-N shapes (N <= 576 at K = 7168) are latency-bound: each
/// block's K steps run one after another, so short slices over more blocks finish sooner
/// (128 x 7168: 5.4 us against 9.3 at 512 columns); shorter than 128 the partial sums (splits x M
/// x N floats written and read) cost more than they return (performance-history.md, call DL).
const GEMV_TC_MIN_SLICE: usize = 128;

/// Tickets `gemv_bf16_tc_f32` needs on `sms` SMs: one per row block of a split product, and
/// `gemv_tc_plan` splits only products whose row blocks fit half a wave.
pub(crate) fn gemv_tickets(sms: usize) -> usize {
    sms * GEMV_TC_BLOCKS_PER_SM
}

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

#[cfg(test)]
mod tests {
    use super::gemv_tc_plan;

    #[test]
    fn gemv_tc_plan_covers_k_in_one_wave() {
        // K3 decode shapes on 132 SMs: (n, k) -> (splits, kslice).
        assert_eq!(gemv_tc_plan(12288, 7168, 132), (5, 1472));
        assert_eq!(gemv_tc_plan(33792, 7168, 132), (2, 3584));
        assert_eq!(gemv_tc_plan(1536, 7168, 132), (38, 192));
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
            assert!(
                s == 1 || n.div_ceil(128) <= super::gemv_tickets(132),
                "{n}x{k}: a ticket per row block"
            );
        }
    }
}
