//! The GPU side: driver detection, module loading (the cubins come from kernels.rs), device
//! buffers.

use crate::buf::Buf;
use crate::cache::KernelCache;
use crate::error::{CudaError, Result};
use crate::geometry::nvrtc_arch;
use crate::kernels::KernelStats;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use k3_kernels::FILES;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How long opening the device took, step by step (the start-up progress lines print it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StartupTimes {
    /// Creating the CUDA context and stream (the driver's own start-up).
    pub context_s: f64,
    /// Finding or compiling the cubins.
    pub kernels: KernelStats,
    /// Loading the modules into the context.
    pub modules_s: f64,
    /// Creating the cuBLAS handle.
    pub cublas_s: f64,
}

/// A row-major f32 matrix on the device.
pub struct DeviceMat {
    pub rows: usize,
    pub cols: usize,
    pub buf: Buf<f32>,
    /// In bfloat16 mode, the same rows rounded to bf16, when the kernel that wrote `buf` wrote
    /// them too (the norms that open each sublayer): what a cuBLAS product takes as its input,
    /// so it needs no conversion of its own (dense/mod.rs). Every op that changes `buf` in place
    /// drops it first (`written`).
    pub(crate) bf16: Option<Buf<u16>>,
}

impl DeviceMat {
    /// A matrix of `rows` x `cols` in `buf`, without bf16 rows.
    pub fn new(rows: usize, cols: usize, buf: Buf<f32>) -> Self {
        Self {
            rows,
            cols,
            buf,
            bf16: None,
        }
    }

    /// Called by every op that writes `buf` in place: its bf16 rows no longer match.
    pub(crate) fn written(&mut self) -> &mut Self {
        self.bf16 = None;
        self
    }
}

/// A weight matrix `[rows, cols]` (row-major) on the device. Values that are all exactly bf16 (a
/// bf16 checkpoint, or `--load-format dummy`) are kept as bf16 bits: half the bytes per matmul,
/// and no precision lost. Ops with only an f32 kernel (MLA's `kv_b`) get an f32 copy made on
/// first use.
pub struct DeviceLinear {
    pub rows: usize,
    pub cols: usize,
    pub bf16: Option<CudaSlice<u16>>,
    pub(crate) f32: std::sync::OnceLock<DeviceMat>,
}

/// bf16 bits of every value when all of them are exactly representable in bf16, else None.
pub fn exact_bf16(data: &[f32]) -> Option<Vec<u16>> {
    if data.is_empty() || data.iter().any(|v| v.to_bits() & 0xFFFF != 0) {
        return None;
    }
    Some(data.iter().map(|v| (v.to_bits() >> 16) as u16).collect())
}

/// The CUDA context, stream and every kernel of kernels/*.cu, compiled for this GPU.
pub struct CudaBackend {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub multiprocessors: usize,
    /// The NVRTC target (`limits.arch`, e.g. `sm_90a`) and opt-in shared-memory limit that decide
    /// which kernels run (dispatch.rs).
    pub limits: crate::dispatch::DeviceLimits,
    pub(crate) functions: HashMap<&'static str, CudaFunction>,
    /// cuBLAS on `stream` (dense matmuls); its math mode follows `options.dtype`.
    pub(crate) blas: CudaBlas,
    /// `blas`'s workspace (lanes.rs `set_workspace`), also cuBLASLt's on `stream`.
    pub(crate) blas_workspace: CudaSlice<u8>,
    /// The bf16 products through cuBLASLt (blas_lt.rs); `None` where libcublasLt is missing.
    pub(crate) lt: Option<crate::blas_lt::LtMatmul>,
    /// Side streams for products that share an input (lanes.rs).
    pub(crate) lanes: Vec<crate::lanes::SideLane>,
    /// Per-op wall times when `K3_PROFILE` is set (see `profile.rs`).
    pub(crate) profile: Option<crate::profile::OpProfile>,
    /// The tensor-core MoE path's work buffers (moe/cublas.rs), kept between calls.
    pub(crate) moe_scratch: Mutex<crate::workspace::MoeScratch>,
    /// The sorted many-assignment paths' work buffers (moe/sorted.rs), kept between calls.
    pub(crate) moe_sorted_scratch: Mutex<crate::workspace::SortedScratch>,
    /// CUDA graphs of decode steps (graph.rs).
    pub(crate) step: crate::step::StepState,
    /// What every buffer of a dry pass aliases (buf.rs): 256 bytes that no work touches.
    pub(crate) dry_target: CudaSlice<u8>,
    /// kernels/bf16.cu `gemv_bf16_tc_f32`'s tickets: one per row block, 0 between launches.
    pub(crate) gemv_tickets: CudaSlice<i32>,
    /// The deployment's choices (options.rs).
    pub(crate) options: crate::CudaOptions,
    /// Where opening the device spent its time.
    pub startup: StartupTimes,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", p.report());
        }
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("arch", &self.limits.arch)
            .field("kernels", &self.functions.len())
            .finish()
    }
}

/// Whether the driver library can be loaded, without touching cudarc's panicking loader.
pub fn driver_present() -> bool {
    // SAFETY: only tries dlopen on the candidate names; calls nothing in the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

pub fn cublas_present() -> bool {
    // SAFETY: as above, for libcublas.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

impl CudaBackend {
    /// Choose the precision activations enter the tensor cores in (default:
    /// `CudaOptions::dtype`). Takes effect from the next op.
    pub fn set_dtype(&mut self, dtype: crate::Dtype) -> Result<()> {
        set_blas_math(&self.blas, dtype)?;
        for lane in &self.lanes {
            set_blas_math(&lane.blas, dtype)?;
        }
        self.options.dtype = dtype;
        Ok(())
    }

    pub fn options(&self) -> &crate::CudaOptions {
        &self.options
    }
}

impl CudaBackend {
    /// Device `ordinal`, kernels from the default cache directory. Errors (never panics) when the
    /// driver or NVRTC is missing, so callers can fall back to the CPU backend.
    pub fn try_new(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, crate::CudaOptions::default())
    }

    /// [`CudaBackend::try_new`] with `options` instead of the defaults.
    pub fn with_options(ordinal: usize, options: crate::CudaOptions) -> Result<Self> {
        Self::with_cache(
            ordinal,
            KernelCache::new(crate::cache::default_dir()),
            options,
        )
    }

    pub fn with_cache(
        ordinal: usize,
        cache: KernelCache,
        backend_options: crate::CudaOptions,
    ) -> Result<Self> {
        if !driver_present() {
            return Err(CudaError::NoDriver(
                "libcuda.so could not be loaded (no NVIDIA driver)".into(),
            ));
        }
        if !cublas_present() {
            return Err(CudaError::NoCublas(
                "libcublas.so could not be loaded; add its directory to LD_LIBRARY_PATH".into(),
            ));
        }
        let t = Instant::now();
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: everything runs on the one stream below, so the per-buffer events that order
        // work across streams are not needed (and cost two driver calls per allocation).
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory_pooled(&ctx);
        let (major, minor) = ctx.compute_capability()?;
        crate::geometry::check_compute_capability(major, minor)?;
        let arch = nvrtc_arch(major, minor);
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let opt_in_max = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?;
        let limits = crate::dispatch::DeviceLimits {
            arch: arch.clone(),
            opt_in_shared: opt_in_max.max(0) as usize,
        };
        // Not the legacy default stream: stream capture (CUDA graphs) needs a created one.
        let stream = ctx.new_stream()?;
        let context_s = t.elapsed().as_secs_f64();
        let (cubins, kernels) =
            crate::kernels::cubins(FILES, &arch, &cache, crate::kernels::embedded())?;
        let t = Instant::now();
        let mut functions = HashMap::new();
        for (file, cubin) in FILES.iter().zip(&cubins) {
            let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_file(&cubin.path)) {
                Ok(m) => m,
                // A built-in cubin from an NVRTC newer than this driver: compile it here.
                Err(e) if cubin.origin == crate::kernels::Origin::Embedded => {
                    tracing::warn!(file = file.name, error = %e, "built-in cubin refused; compiling");
                    let path = crate::kernels::recompile(file, &arch, &cache)?;
                    ctx.load_module(cudarc::nvrtc::Ptx::from_file(path))?
                }
                Err(e) => return Err(e.into()),
            };
            for &entry in file.entries {
                let f = module.load_function(entry)?;
                // Kernels past the 48 KB default of dynamic shared memory opt in once here; one
                // past this device's limit is never dispatched on it (dispatch.rs), so it is left
                // at the default rather than failing start-up.
                if let Some(bytes) = limits.opt_in(entry) {
                    f.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )?;
                }
                functions.insert(entry, f);
            }
        }
        let modules_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let blas = CudaBlas::new(stream.clone())?;
        set_blas_math(&blas, backend_options.dtype)?;
        let blas_workspace = crate::lanes::set_workspace(&blas, &stream)?;
        let lanes = crate::lanes::side_lanes(&ctx, &stream, backend_options.dtype)?;
        // SAFETY: only tries dlopen on the candidate names, as cublas_present.
        let lt = if unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            Some(crate::blas_lt::LtMatmul::new(
                crate::lanes::WORKSPACE_BYTES,
            )?)
        } else {
            None
        };
        let cublas_s = t.elapsed().as_secs_f64();
        let profile = crate::profile::OpProfile::from_env();
        let dry_target = stream.alloc_zeros::<u8>(256)?;
        let gemv_tickets =
            stream.alloc_zeros::<i32>(crate::dense::gemv_tickets(sms.max(1) as usize))?;
        Ok(Self {
            ctx,
            stream,
            multiprocessors: sms.max(1) as usize,
            limits,
            functions,
            blas,
            blas_workspace,
            lt,
            lanes,
            step: crate::step::StepState::new(backend_options.cuda_graphs, profile.is_some()),
            dry_target,
            gemv_tickets,
            profile,
            moe_scratch: Mutex::default(),
            moe_sorted_scratch: Mutex::default(),
            options: backend_options,
            startup: StartupTimes {
                context_s,
                kernels,
                modules_s,
                cublas_s,
            },
        })
    }

    pub(crate) fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::MissingKernel(name.into()))
    }

    pub fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<DeviceMat> {
        if data.len() != rows * cols {
            return Err(CudaError::InvalidArg(format!(
                "{} values for a {rows}x{cols} matrix",
                data.len()
            )));
        }
        Ok(DeviceMat::new(
            rows,
            cols,
            self.stream.memcpy_stod(data)?.into(),
        ))
    }

    pub fn zeros(&self, rows: usize, cols: usize) -> Result<DeviceMat> {
        Ok(DeviceMat::new(rows, cols, self.zeroed::<f32>(rows * cols)?))
    }

    /// `len` (at least one) zeroed elements; not zeroed in a dry pass (graph.rs), which
    /// queues no device work.
    pub(crate) fn zeroed<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<Buf<T>> {
        if self.step.dry() {
            return self.uninit(len);
        }
        Ok(Buf::owned(self.stream.alloc_zeros::<T>(len.max(1))?))
    }

    /// A buffer of `len` elements (at least one) that is not zeroed: for buffers whose every
    /// element read is first written by work queued on the same stream (GEMM outputs with
    /// beta = 0, kernels that cover their output, scratch; at prefill sizes a memset would move
    /// gigabytes for nothing).
    pub(crate) fn uninit<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> Result<Buf<T>> {
        if self.step.dry() {
            self.step.lock().counts.dry_allocs += 1;
            let (ptr, _sync) = self.dry_target.device_ptr(&self.stream);
            // SAFETY: dry_target lives as long as the backend, and a dry pass queues no work.
            return Ok(unsafe { Buf::alias(&self.stream, ptr, len.max(1)) });
        }
        // SAFETY: device memory holds no Rust values; stale contents are only ever overwritten
        // before they are read (the callers' contract above).
        Ok(Buf::owned(unsafe { self.stream.alloc::<T>(len.max(1)) }?))
    }

    /// `len` elements (at least one) of real, uninitialised memory even inside a dry pass: for
    /// buffers that outlive the op (workspaces kept between calls, step uploads, a graph's
    /// result), which must never alias the dry target (buf.rs).
    pub(crate) fn alloc_kept<T: cudarc::driver::DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        // SAFETY: as `uninit`: every element is written before it is read.
        Ok(unsafe { self.stream.alloc::<T>(len.max(1)) }?)
    }

    /// A matrix whose every element the caller's next launch writes (see `uninit`).
    pub fn output(&self, rows: usize, cols: usize) -> Result<DeviceMat> {
        let buf = self.uninit::<f32>(rows * cols)?;
        Ok(DeviceMat::new(rows, cols, buf))
    }

    pub fn download(&self, m: &DeviceMat) -> Result<Vec<f32>> {
        let mut v = self.read_back("download", &m.buf)?;
        v.truncate(m.rows * m.cols);
        Ok(v)
    }

    /// (free, total) bytes of this device's memory, as the driver reports them now.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread()?;
        Ok(cudarc::driver::result::mem_get_info()?)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

/// Let the device's default memory pool keep freed blocks instead of returning them to the driver
/// at every synchronisation (its default): every op allocates its output on the stream, and a
/// prefill step frees and re-allocates gigabytes per layer. Best effort; without it allocations
/// are only slower.
fn keep_freed_memory_pooled(ctx: &CudaContext) {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let threshold: u64 = u64::MAX;
    // SAFETY: an out-pointer to a local, then an attribute write through a pointer to a local u64
    // (the type CU_MEMPOOL_ATTR_RELEASE_THRESHOLD takes); both calls only read / write those.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS
        {
            let _ = sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &threshold as *const u64 as *mut std::ffi::c_void,
            );
        }
    }
}

/// cuBLAS's math mode for `dtype`: f32 products (SGEMM) on TF32 tensor cores in bf16 (and mxfp8) mode,
/// plain f32 FMAs in float32 mode. The bf16 GEMMs name their compute type and ignore it.
pub(crate) fn set_blas_math(blas: &CudaBlas, dtype: crate::Dtype) -> Result<()> {
    use cudarc::cublas::sys::{cublasMath_t, cublasSetMathMode};
    let mode = match dtype {
        crate::Dtype::Bf16 | crate::Dtype::Mxfp8 => cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
        crate::Dtype::F32 => cublasMath_t::CUBLAS_DEFAULT_MATH,
    };
    // SAFETY: a live handle owned by `blas`; the mode is a valid enum value.
    unsafe { cublasSetMathMode(*blas.handle(), mode) }.result()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_storage_only_for_exact_values() {
        let exact = [1.0f32, -0.5, f32::from_bits(0x3B45_0000)];
        let bits = exact_bf16(&exact).unwrap();
        assert_eq!(bits, vec![0x3F80, 0xBF00, 0x3B45]);
        assert_eq!(
            exact_bf16(&[1.0, 0.1]),
            None,
            "0.1 needs more than bf16's 8 bits"
        );
        assert_eq!(exact_bf16(&[]), None);
    }
}
