//! The CUDA backend's choices that a deployment may make: passed to
//! [`crate::CudaBackend::with_options`], set from `k3serve serve` / `bench` flags and the serve
//! TOML (`[cuda]`). Which kernel runs for a step is otherwise fixed by the step's shape and the
//! GPU (dispatch.rs).

/// Precision of the absorbed MLA decode attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlaDecodePrecision {
    /// The query and the cached latent rows rounded to bf16 for tensor-core products, f32
    /// accumulation and softmax (like FlashMLA and vLLM; MLA's output within ~3e-3 of the CPU
    /// backend's): the wgmma attend on sm_90a, the mma.sync one elsewhere.
    #[default]
    Bf16,
    /// 3xTF32 products (`mla_attend_tf32_f32`): the CPU backend's results to ~1e-5, several times
    /// slower. For verification runs; also what GPUs without the bf16 attend's shared memory run.
    F32,
}

impl std::str::FromStr for MlaDecodePrecision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(Self::Bf16),
            "f32" => Ok(Self::F32),
            other => Err(format!("MLA decode precision {other:?}: use bf16 or f32")),
        }
    }
}

/// Options of a [`crate::CudaBackend`]; `Default` is what the measured runs use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Replay decode steps as CUDA graphs (graph.rs). Off runs every step eagerly.
    pub cuda_graphs: bool,
    /// Routed-expert assignments (tokens x top-k) from which a step takes the many-assignment
    /// path (wgmma GEMMs on sm_90a, else cuBLAS over bf16-expanded experts) instead of the
    /// few-token MXFP4 kernels.
    pub moe_gemm_min_assignments: usize,
    /// Largest bf16 weight (elements) that decode rows (up to 16) multiply through the
    /// tensor-core GEMV; larger weights and more rows take cuBLAS. 0: cuBLAS always.
    pub gemv_max_weight_elems: usize,
    /// Precision of the MLA decode attention.
    pub mla_decode_precision: MlaDecodePrecision,
}

impl CudaOptions {
    pub const DEFAULT_MOE_GEMM_MIN_ASSIGNMENTS: usize = 4096;
    pub const DEFAULT_GEMV_MAX_WEIGHT_ELEMS: usize = 1 << 22;
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            cuda_graphs: true,
            moe_gemm_min_assignments: Self::DEFAULT_MOE_GEMM_MIN_ASSIGNMENTS,
            gemv_max_weight_elems: Self::DEFAULT_GEMV_MAX_WEIGHT_ELEMS,
            mla_decode_precision: MlaDecodePrecision::Bf16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_parses() {
        assert_eq!("bf16".parse(), Ok(MlaDecodePrecision::Bf16));
        assert_eq!("f32".parse(), Ok(MlaDecodePrecision::F32));
        assert!("BF16".parse::<MlaDecodePrecision>().is_err());
    }
}
