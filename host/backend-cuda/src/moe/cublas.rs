//! Routed experts through cuBLAS tensor-core GEMMs (kernels/moe_gemm.cu) for steps with many
//! (token, expert) assignments (from `CudaOptions::moe_gemm_min_assignments`) on GPUs without
//! wgmma, and where the MXFP4 kernels' shared memory does not fit (dispatch.rs). The decode-step
//! kernels (kernels/moe_single_token.cu, moe_few_tokens.cu) read each expert's weights once per 16 tokens at most,
//! right for a few tokens but far below the tensor cores once experts see hundreds of rows.
//!
//! Per step: the assignments sorted by expert are gathered into stacked hi/lo bf16 rows; the
//! touched experts are expanded from MXFP4 to bf16 in groups that fit a fixed scratch budget;
//! each expert is one up GEMM (`[2 cnt, latent] x [latent, 2 inter]`, gate and up together) and,
//! after the fused SiTU-GLU + split, one down GEMM; a combine sums hi + lo rows per slot. The
//! expert counts are read back to the host once per call (one stream sync) to size the GEMMs.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry::Launch;
use crate::moe::sorted::SortedStep;
use crate::workspace::MoeScratch;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// Slots per token `moe_combine_split_f32` holds (kernels/moe_gemm.cu MOE_MAX_TOP_K).
const MAX_TOP_K: usize = 64;

/// Bytes of bf16 expert weights expanded at once (the rest of the touched experts follow in
/// later groups); bounds the scratch at K3 sizes (66 MB per expert) to ~32 experts.
const SCRATCH_BYTES: usize = 2 << 30;

/// The stacked-row plan of one call: expert offsets (host copy) and the touched experts.
struct Plan {
    offsets: Vec<i32>,
    touched: Vec<usize>,
}

impl Plan {
    fn count(&self, e: usize) -> usize {
        (self.offsets[e + 1] - self.offsets[e]) as usize
    }
    /// First stacked row of expert e (its hi rows; lo rows follow after `count(e)`).
    fn row0(&self, e: usize) -> usize {
        2 * self.offsets[e] as usize
    }
}

impl CudaBackend {
    /// `out [T, latent] = Σ_j w[t,j] · expert_{idx[t,j]}(z_t)` for a step sorted by expert (the
    /// router's ids are not read: the sort has them).
    pub(crate) fn moe_experts_cublas(&self, step: SortedStep<'_>) -> Result<DeviceMat> {
        let SortedStep {
            z,
            w,
            ex,
            top_k,
            offsets,
            sorted,
            situ,
            ..
        } = step;
        let (t, lt, ie, e) = (z.rows, ex.latent, ex.inter, ex.experts);
        if top_k > MAX_TOP_K {
            return Err(CudaError::Unsupported(format!(
                "moe GEMM path: top-{top_k} (the combine kernel holds at most {MAX_TOP_K} slots)"
            )));
        }
        let n = t * top_k;
        let host_offsets = self.part("offsets to host", || {
            self.read_back("moe GEMM path", offsets)
        })?;
        let touched = (0..e)
            .filter(|&i| host_offsets[i + 1] > host_offsets[i])
            .collect();
        let plan = Plan {
            offsets: host_offsets,
            touched,
        };
        if plan.offsets[e] as usize != n {
            return Err(CudaError::InvalidArg(format!(
                "moe: {} sorted assignments for {n}",
                plan.offsets[e]
            )));
        }
        let i = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| CudaError::InvalidArg(format!("moe {what} = {v} > i32")))
        };
        let (ei, kk, lti, iei) = (
            i(e, "experts")?,
            i(top_k, "top_k")?,
            i(lt, "latent")?,
            i(ie, "inter")?,
        );

        let mut guard = self.moe_scratch.lock().unwrap_or_else(|p| p.into_inner());
        let MoeScratch {
            xs,
            w13,
            w2,
            act,
            h,
            y,
            inv,
        } = &mut *guard;
        let per_expert = 2 * (2 * ie * lt + lt * ie);
        let group = (SCRATCH_BYTES / per_expert).clamp(1, plan.touched.len().max(1));
        let (xs, inv, w13, w2, h, act, y) = self.part("scratch", || {
            Ok::<_, CudaError>((
                &*self.ensure(xs, 2 * n * lt)?,
                &*self.ensure(inv, n)?,
                &*self.ensure(w13, group * 2 * ie * lt)?,
                &*self.ensure(w2, group * lt * ie)?,
                self.ensure(h, 2 * n * 2 * ie)?,
                &*self.ensure(act, 2 * n * ie)?,
                self.ensure(y, 2 * n * lt)?,
            ))
        })?;
        self.part("gather", || {
            launch!(self, "moe_gather_split_bf16", Launch::new((n, 1, 1), 256)?; &z.buf, sorted, offsets, &ei, &kk, &lti, xs, inv)
        })?;

        let (lin, has) = crate::launch::situ_linear_args(situ);

        for chunk in plan.touched.chunks(group) {
            let list: Vec<i32> = chunk.iter().map(|&x| x as i32).collect();
            let list_dev = self.upload_slice(&list)?;
            let count = i(chunk.len(), "group")?;
            // W1 -> rows [0, inter), W3 -> rows [inter, 2 inter) of each expert's [2 inter, latent].
            self.part("expand", || {
                for (mat, row0) in [(&ex.w1, 0), (&ex.w3, iei)] {
                    let stride = (2 * ie * lt) as i64;
                    self.expand(mat, &list_dev, count, ie, lt, w13, stride, row0)?;
                }
                self.expand(&ex.w2, &list_dev, count, lt, ie, w2, (lt * ie) as i64, 0)
            })?;
            self.part("up GEMMs", || {
                for (g, &ex_i) in chunk.iter().enumerate() {
                    let rows = 2 * plan.count(ex_i);
                    let r0 = plan.row0(ex_i);
                    // h[r0.., 2 inter] = xs[r0.., latent] · W13_gᵀ
                    self.gemm_bf16_on(
                        self.main_gemm(),
                        w13,
                        g * 2 * ie * lt,
                        xs,
                        r0 * lt,
                        h,
                        r0 * 2 * ie,
                        2 * ie,
                        rows,
                        lt,
                    )?;
                }
                Ok::<_, CudaError>(())
            })?;
            let p0 = plan.offsets[chunk[0]];
            let p1 = plan.offsets[chunk[chunk.len() - 1] + 1];
            self.part("glu", || {
                launch!(self, "moe_glu_split_bf16", Launch::new(((p1 - p0) as usize, ie.div_ceil(256), 1), 256)?; &*h, offsets, &ei, &p0, &p1, &iei, &situ.beta, &lin, &has, act)
            })?;
            self.part("down GEMMs", || {
                for (g, &ex_i) in chunk.iter().enumerate() {
                    let rows = 2 * plan.count(ex_i);
                    let r0 = plan.row0(ex_i);
                    // y[r0.., latent] = act[r0.., inter] · W2_gᵀ
                    self.gemm_bf16_on(
                        self.main_gemm(),
                        w2,
                        g * lt * ie,
                        act,
                        r0 * ie,
                        y,
                        r0 * lt,
                        lt,
                        rows,
                        ie,
                    )?;
                }
                Ok::<_, CudaError>(())
            })?;
        }

        self.part("combine", || {
            let out = self.zeros(t, lt)?;
            launch!(self, "moe_combine_split_f32", Launch::new((t, 1, 1), 256)?; &*y, inv, offsets, &ei, w, &out.buf, &kk, &lti)?;
            Ok(out)
        })
    }

    /// One stage of this path, timed on its own line when `K3_PROFILE` is set.
    fn part<T>(&self, stage: &str, f: impl FnOnce() -> T) -> T {
        self.timed(|| format!("  moe gemm path: {stage}"), f)
    }

    /// `slot`, reallocated (uninitialised, 25% headroom) when shorter than `len`. No memset: the
    /// MoE steps write every element they later read.
    fn ensure<'a, T: cudarc::driver::DeviceRepr>(
        &self,
        slot: &'a mut Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<&'a mut CudaSlice<T>> {
        if slot.as_ref().is_none_or(|b| b.len() < len.max(1)) {
            *slot = None; // free first: the old and new buffers need not coexist
            *slot = Some(self.alloc_kept::<T>(len + len / 4)?);
        }
        slot.as_mut()
            .ok_or_else(|| CudaError::InvalidArg("moe scratch".into()))
    }

    /// Expand the listed experts of one MXFP4 weight ([E, rows, cols]) to bf16 at
    /// `out + i·stride + row0·cols`.
    #[allow(clippy::too_many_arguments)]
    fn expand(
        &self,
        mat: &(CudaSlice<u8>, CudaSlice<u8>),
        list: &CudaSlice<i32>,
        count: i32,
        rows: usize,
        cols: usize,
        out: &CudaSlice<u16>,
        stride: i64,
        row0: i32,
    ) -> Result<()> {
        let (r, c) = (rows as i32, cols as i32);
        // Per expert: enough x blocks to cover its MX blocks, at most ~2 waves over the GPU.
        let per_expert = rows * cols / 32;
        let x = per_expert.div_ceil(256).clamp(
            1,
            (2 * self.multiprocessors * 8).div_ceil(count.max(1) as usize),
        );
        launch!(self, "mxfp4_to_bf16_experts", Launch::new((x, count as usize, 1), 256)?; &mat.0, &mat.1, list, &count, &r, &c, out, &stride, &row0)
    }

    /// Row-major `c[rows, n] = x[rows, k] · wᵀ` with `w [n, k]` and `x` in bf16 bits, f32
    /// accumulate and output; each operand starts at the given element offset of its buffer. On
    /// `lane`'s stream (lanes.rs: the backend's own, or a side stream's), through cuBLASLt with
    /// the shape's plan where it has one (blas_lt.rs), else `cublasGemmEx`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_bf16_on(
        &self,
        lane: crate::lanes::GemmLane<'_>,
        w: &CudaSlice<u16>,
        w_off: usize,
        x: &CudaSlice<u16>,
        x_off: usize,
        c: &mut CudaSlice<f32>,
        c_off: usize,
        n: usize,
        rows: usize,
        k: usize,
    ) -> Result<()> {
        if (w_off + n * k) > w.len() || (x_off + rows * k) > x.len() || (c_off + rows * n) > c.len()
        {
            return Err(CudaError::InvalidArg(
                "moe gemm: operand out of range".into(),
            ));
        }
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| CudaError::InvalidArg(format!("gemm dim {v} > i32")))
        };
        let (m_, n_, k_) = (dim(n)?, dim(rows)?, dim(k)?);
        if self.step.recording() {
            // Weight offsets are logged: a different expert or layer is different work.
            self.step.log_gemm(&[1, w_off, x_off, c_off, n, rows, k]);
            if self.step.dry() {
                return Ok(());
            }
        }
        let (wp, _g1) = w.device_ptr(&self.stream);
        let (xp, _g2) = x.device_ptr(&self.stream);
        let (cp, _g3) = c.device_ptr_mut(&self.stream);
        let plan = match &self.lt {
            Some(lt) => lt.plan(n, rows, k)?.map(|p| (lt, p)),
            None => None,
        };
        if let Some((lt, plan)) = plan {
            let (wsp, _g4) = lane.workspace.device_ptr(&self.stream);
            // SAFETY: the three ranges were bounds-checked above and the plan is this shape's;
            // the workspace is the lane's, used only in its stream's order, and every buffer is
            // kept alive by its owner past the queued work (lanes.rs).
            return unsafe {
                lt.run(
                    &plan,
                    wp + 2 * w_off as u64,
                    xp + 2 * x_off as u64,
                    cp + 4 * c_off as u64,
                    wsp,
                    lane.stream.cu_stream(),
                )
            };
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Column-major view (as in `matmul_rt`): C' [n, rows] = W' ᵀ X' with W' = w as [k, n]
        // and X' = x as [k, rows], leading dimensions k, k and n.
        // SAFETY: the three ranges were bounds-checked above; alpha/beta live on this frame
        // until the call returns (cuBLAS reads host scalars synchronously at enqueue).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *lane.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m_,
                n_,
                k_,
                (&alpha as *const f32).cast(),
                (wp + 2 * w_off as u64) as *const std::ffi::c_void,
                cudaDataType::CUDA_R_16BF,
                k_,
                (xp + 2 * x_off as u64) as *const std::ffi::c_void,
                cudaDataType::CUDA_R_16BF,
                k_,
                (&beta as *const f32).cast(),
                (cp + 4 * c_off as u64) as *mut std::ffi::c_void,
                cudaDataType::CUDA_R_32F,
                m_,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}
