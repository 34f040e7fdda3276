//! The bf16 products (`gemm_bf16_on`: bf16 weights and rows, f32 accumulate and result) through
//! cuBLASLt with its heuristic's algorithm for each shape. For decode-sized rows its choice
//! streams the weights faster than `cublasGemmEx`'s (docs/performance.md, "Dense decode
//! products"). A shape's plan (descriptors and algorithm) is made once and kept, so a product
//! takes the same algorithm, and gives the same bits, on every stream and in every step; a shape
//! the heuristic has no algorithm for stays on `cublasGemmEx`.

use crate::error::Result;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// One shape's descriptors and algorithm: `c [rows, n] = x [rows, k] · w [n, k]ᵀ`, row-major,
/// seen column-major as `C' [n, rows] = W'ᵀ X'` (as `gemm_bf16_on`'s `cublasGemmEx`).
pub(crate) struct LtPlan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are only read after creation (by cublasLtMatmul), which cuBLASLt
// allows from any thread.
unsafe impl Send for LtPlan {}
unsafe impl Sync for LtPlan {}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: created by `LtMatmul::make_plan` (null where it stopped early) and destroyed
        // only here; errors at teardown are not actionable.
        unsafe {
            for layout in [self.a, self.b, self.c] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// Products of more rows keep `cublasGemmEx`: prefill-sized products are bound by the tensor
/// cores, where its choice is the measured one, and the plan map stays bounded.
pub(crate) const LT_MAX_ROWS: usize = 256;

/// (n, rows, k) of a product.
type Shape = (usize, usize, usize);

/// A cuBLASLt handle and the plans of the shapes seen so far.
pub(crate) struct LtMatmul {
    handle: sys::cublasLtHandle_t,
    /// `None`: the heuristic had no algorithm for the shape (it takes `cublasGemmEx`).
    plans: Mutex<HashMap<Shape, Option<Arc<LtPlan>>>>,
    workspace_bytes: usize,
}

// SAFETY: a cuBLASLt handle may be used from several threads and streams at once (it holds no
// stream); the plan map is behind a mutex.
unsafe impl Send for LtMatmul {}
unsafe impl Sync for LtMatmul {}

impl Drop for LtMatmul {
    fn drop(&mut self) {
        if let Ok(plans) = self.plans.get_mut() {
            plans.clear();
        }
        // SAFETY: the handle was created in `new` and every plan made with it is gone.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl LtMatmul {
    /// A handle whose algorithms may use up to `workspace_bytes` of each stream's workspace.
    pub(crate) fn new(workspace_bytes: usize) -> Result<Self> {
        Ok(Self {
            handle: lt::create_handle()?,
            plans: Mutex::default(),
            workspace_bytes,
        })
    }

    /// The plan of `n`-column, `rows`-row products over `k`, made on first use; `None` past
    /// `LT_MAX_ROWS` or where the heuristic has no algorithm.
    pub(crate) fn plan(&self, n: usize, rows: usize, k: usize) -> Result<Option<Arc<LtPlan>>> {
        if rows > LT_MAX_ROWS {
            return Ok(None);
        }
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = plans.get(&(n, rows, k)) {
            return Ok(p.clone());
        }
        let p = self.make_plan(n, rows, k)?.map(Arc::new);
        plans.insert((n, rows, k), p.clone());
        Ok(p)
    }

    fn make_plan(&self, n: usize, rows: usize, k: usize) -> Result<Option<LtPlan>> {
        let (n64, r64, k64) = (n as u64, rows as u64, k as u64);
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        // The plan owns each descriptor as soon as it exists, so an error below frees them.
        let mut plan = LtPlan {
            desc: lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType::CUDA_R_32F,
            )?,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            // SAFETY: a plain-data struct that the heuristic overwrites before it is used.
            algo: unsafe { std::mem::zeroed() },
        };
        // cublasLt takes cuBLAS's operation enum (cublasLt's bindings do not repeat it).
        let transa = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: `desc` is live; the attribute is a cublasOperation_t read during the call.
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&transa as *const cudarc::cublas::sys::cublasOperation_t).cast(),
                std::mem::size_of::<cudarc::cublas::sys::cublasOperation_t>(),
            )?;
        }
        plan.a = lt::create_matrix_layout(bf16, k64, n64, k as i64)?;
        plan.b = lt::create_matrix_layout(bf16, k64, r64, k as i64)?;
        plan.c = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_32F, n64, r64, n as i64)?;
        let pref = lt::create_matmul_pref()?;
        let ws = self.workspace_bytes;
        // SAFETY: live descriptors; the heuristic reads them and writes one result.
        let found = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                std::mem::size_of::<usize>(),
            );
            let found = set.and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.c,
                    plan.c,
                    pref,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            found
        };
        match found {
            Ok(h) => {
                plan.algo = h.algo;
                Ok(Some(plan))
            }
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Queue `plan`'s product on `stream` with `workspace` (at least `workspace_bytes`).
    ///
    /// # Safety
    /// `w`, `x` and `c` point to device memory holding the plan's operands, `workspace` to
    /// `workspace_bytes` that nothing else uses while the stream runs the product, and all of it
    /// outlives the queued work.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run(
        &self,
        plan: &LtPlan,
        w: u64,
        x: u64,
        c: u64,
        workspace: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: per the caller; alpha and beta are host scalars read at enqueue.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const c_void,
                plan.a,
                x as *const c_void,
                plan.b,
                c as *const c_void,
                plan.c,
                c as *mut c_void,
                plan.c,
                &plan.algo,
                workspace as *mut c_void,
                self.workspace_bytes,
                stream as sys::cudaStream_t,
            )?;
        }
        Ok(())
    }
}
