//! The CUDA backend's choices that a deployment may make: passed to
//! [`crate::CudaBackend::with_options`], set from `k3serve serve` / `bench` flags and the serve
//! TOML (`[cuda]`). Which kernel runs for a step is otherwise fixed by the step's shape and the
//! GPU (dispatch.rs).

/// The precision activations enter the tensor cores in, vLLM's `--dtype`. Accumulation is f32
/// and the KDA state f32 in both; weights are what the checkpoint holds (bf16 matrices, MXFP4
/// experts). Tolerances against the CPU backend are stated and tested in tests/device.rs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dtype {
    /// Activations rounded once to bf16 for the tensor cores: the dense prefill GEMMs and the
    /// routed experts' GEMMs and few-token decode kernels on one bf16 plane (half the
    /// tensor-core work of the hi / lo split), f32 products (MLA prefill, f32 weights) on TF32 tensor cores, the MLA
    /// decode attend on bf16 rows (like FlashMLA and vLLM). What K3 is served in.
    #[default]
    Bf16,
    /// f32-level results throughout (hi / lo bf16 planes, plain SGEMM, the 3xTF32 MLA decode
    /// attend): the CPU backend's numbers to ~1e-5 per op, slower. For parity and debugging.
    F32,
    /// K3's shipped precision for its routed experts: their activations (the latent input and
    /// the SiTU-GLU intermediate) as MXFP8, E4M3 values with one power-of-two scale per 32, on
    /// FP8 tensor cores at every step size (moe/mxfp8.rs); everything else as `Bf16`.
    Mxfp8,
}

impl Dtype {
    /// The name `--dtype` prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F32 => "float32",
            Self::Mxfp8 => "mxfp8",
        }
    }

    /// bf16 planes per activation value in the split GEMMs: 1 (rounded once) or 2 (hi / lo).
    pub fn planes(self) -> usize {
        match self {
            Self::Bf16 | Self::Mxfp8 => 1,
            Self::F32 => 2,
        }
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "bfloat16" | "bf16" => Ok(Self::Bf16),
            "float32" | "float" | "f32" => Ok(Self::F32),
            "mxfp8" => Ok(Self::Mxfp8),
            other => Err(format!(
                "dtype {other:?}: use bfloat16 (the default), float32 or mxfp8"
            )),
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
    /// The precision activations enter the tensor cores in.
    pub dtype: Dtype,
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
            dtype: Dtype::Bf16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_parses_vllm_names() {
        for s in ["auto", "bfloat16", "bf16"] {
            assert_eq!(s.parse(), Ok(Dtype::Bf16));
        }
        for s in ["float32", "float", "f32"] {
            assert_eq!(s.parse(), Ok(Dtype::F32));
        }
        assert_eq!("mxfp8".parse(), Ok(Dtype::Mxfp8));
        let e = "float16".parse::<Dtype>().unwrap_err();
        assert!(
            e.contains("bfloat16") && e.contains("float32") && e.contains("mxfp8"),
            "{e}"
        );
        assert_eq!(Dtype::Mxfp8.planes(), 1);
        assert_eq!(Dtype::Mxfp8.name(), "mxfp8");
        assert_eq!(Dtype::default().planes(), 1);
        assert_eq!(Dtype::F32.planes(), 2);
        assert_eq!(Dtype::F32.name(), "float32");
    }
}
