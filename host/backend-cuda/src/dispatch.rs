//! Which kernels a step runs on this GPU, where that depends on the GPU itself: its architecture
//! (wgmma exists only on sm_90a) and its opt-in shared-memory limit per block (227 KB on Hopper
//! and the B200, 99 KB on sm_120 cards). The backend needs compute capability 9.0
//! (`geometry::check_compute_capability`). Pure functions of [`DeviceLimits`], so the fallbacks
//! for GPUs other than the H200 are tested here without one: a kernel whose shared memory does not
//! fit is never launched (the launch would fail), the next-best path runs. Only the H200's paths
//! are measured.

use crate::geometry;
use crate::options::Dtype;

/// Kernels launched without the opt-in attribute may use this much dynamic shared memory.
const DEFAULT_SHARED: usize = 48 * 1024;

/// The facts about one GPU that the dispatch depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLimits {
    /// The NVRTC target (`geometry::nvrtc_arch`), e.g. `sm_90a`.
    pub arch: String,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`, bytes.
    pub opt_in_shared: usize,
}

impl DeviceLimits {
    /// The dynamic shared memory `kernel` is launched with when it needs more than the default
    /// (its [`geometry::OPT_IN_SHARED`] entry), if this GPU allows that much; `None` for every other kernel.
    pub fn opt_in(&self, kernel: &str) -> Option<usize> {
        let bytes = geometry::opt_in_shared(kernel)?;
        (bytes > DEFAULT_SHARED && bytes <= self.opt_in_shared).then_some(bytes)
    }

    /// Whether every kernel in `kernels` can be launched here (shared memory within the limit).
    pub fn launchable(&self, kernels: &[&str]) -> bool {
        kernels.iter().all(|k| {
            geometry::opt_in_shared(k)
                .is_none_or(|b| b <= DEFAULT_SHARED || b <= self.opt_in_shared)
        })
    }
}

/// The routed-expert kernels of one step (moe/mod.rs `moe_routed`), one per step-shape class, with
/// cuBLAS as the one fallback where a GPU lacks wgmma or the shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertPath {
    /// One token: the router's ids as they are, weights streamed through cp.async rings
    /// (moe/single_token.rs, 213 KB of shared memory).
    SingleToken,
    /// A few tokens per expert, below the many-assignment threshold: MXFP4 decoded in
    /// registers for mma.sync (the few-token pair of moe/mod.rs, 78 KB).
    FewTokens,
    /// Many assignments: grouped MXFP4 GEMMs on wgmma (moe/wgmma.rs; sm_90a, 210 KB).
    Wgmma,
    /// MXFP8 activations (`Dtype::Mxfp8`), every step size: the few-token walk with E4M3
    /// stages on FP8 tensor cores (moe/mxfp8.rs, 66 KB).
    Mxfp8,
    /// Experts expanded to bf16 and cuBLAS (moe/cublas.rs): runs anywhere.
    Cublas,
}

/// The step's shape that picks among the expert paths.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExpertStep {
    pub tokens: usize,
    /// At least `CudaOptions::moe_gemm_min_assignments` assignments (tokens x top-k).
    pub many: bool,
    pub latent: usize,
    pub inter: usize,
    /// Experts of the layer (the few-token kernels list the busy ones in shared memory).
    pub experts: usize,
    /// The routed experts take MXFP8 activations (`Dtype::Mxfp8`).
    pub mxfp8: bool,
}

/// In mxfp8 mode every step takes the MXFP8 pair; only layers of more experts than its busy list
/// holds fall back to the bf16 paths.
pub(crate) fn expert_path(step: ExpertStep, dev: &DeviceLimits) -> ExpertPath {
    let (lt, ie) = (step.latent, step.inter);
    if step.mxfp8
        && step.experts <= geometry::FEW_TOKEN_MAX_EXPERTS
        && dev.launchable(&[
            "mxfp4_experts_few_tokens_up_e4m3",
            "mxfp4_experts_few_tokens_down_e4m3",
        ])
    {
        return ExpertPath::Mxfp8;
    }
    if !step.many {
        if step.tokens == 1
            && geometry::single_token_fits(lt, ie)
            && dev.launchable(&[
                "mxfp4_experts_single_token_up_f32",
                "mxfp4_experts_single_token_down_f32",
            ])
        {
            return ExpertPath::SingleToken;
        }
        return if step.experts <= geometry::FEW_TOKEN_MAX_EXPERTS
            && dev.launchable(&[
                "mxfp4_experts_few_tokens_up_f32",
                "mxfp4_experts_few_tokens_down_f32",
            ]) {
            ExpertPath::FewTokens
        } else {
            ExpertPath::Cublas
        };
    }
    if geometry::moe_wg_supported(&dev.arch)
        && dev.launchable(&["mxfp4_experts_wgmma_up_f32", "mxfp4_experts_wgmma_down_f32"])
    {
        return ExpertPath::Wgmma;
    }
    ExpertPath::Cublas
}

/// The attend kernel of the absorbed MLA decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MlaAttend {
    /// `mla_attend_pair_wgmma_f32`: bf16 products on wgmma, clusters of two blocks (sm_90a, 223 KB).
    PairWgmma,
    /// `mla_attend_bf16_f32`: the same rounding on mma.sync (any arch, 166 KB).
    Bf16Mma,
    /// `mla_attend_tf32_f32`: 3xTF32 (static shared memory: runs anywhere).
    F32,
}

/// The MLA decode attend for `dtype` on this GPU: bf16 on wgmma where it exists, on mma.sync
/// elsewhere, and the f32 kernel where neither bf16 kernel's shared memory fits.
pub(crate) fn mla_attend(dtype: Dtype, dev: &DeviceLimits) -> MlaAttend {
    if dtype == Dtype::F32 {
        return MlaAttend::F32;
    }
    if geometry::mla_wgmma_supported(&dev.arch) && dev.launchable(&["mla_attend_pair_wgmma_f32"]) {
        return MlaAttend::PairWgmma;
    }
    if dev.launchable(&["mla_attend_bf16_f32"]) {
        return MlaAttend::Bf16Mma;
    }
    MlaAttend::F32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(arch: &str, opt_in_shared: usize) -> DeviceLimits {
        DeviceLimits {
            arch: arch.into(),
            opt_in_shared,
        }
    }
    // Opt-in limits per block: H100 / H200 / B200 227 KB, sm_120 cards (RTX 5090) 99 KB; 163 KB
    // (an A100's) as a limit between the kernels' needs.
    fn h200() -> DeviceLimits {
        limits("sm_90a", 232_448)
    }
    fn b200() -> DeviceLimits {
        limits("sm_100", 232_448)
    }
    fn kb163() -> DeviceLimits {
        limits("sm_100", 166_912)
    }
    fn sm120() -> DeviceLimits {
        limits("sm_120", 101_376)
    }

    // K3's expert widths (k3-slice: latent 3584, intermediate 3072), top-16.
    fn step(tokens: usize, many: bool) -> ExpertStep {
        ExpertStep {
            tokens,
            many,
            latent: 3584,
            inter: 3072,
            experts: 128,
            mxfp8: false,
        }
    }

    #[test]
    fn experts_on_the_h200_take_one_path_per_step_shape() {
        let d = h200();
        assert_eq!(expert_path(step(1, false), &d), ExpertPath::SingleToken);
        assert_eq!(expert_path(step(4, false), &d), ExpertPath::FewTokens);
        assert_eq!(expert_path(step(2048, true), &d), ExpertPath::Wgmma);
        assert_eq!(expert_path(step(256, true), &d), ExpertPath::Wgmma);
    }

    #[test]
    fn mxfp8_mode_takes_the_mxfp8_pair_at_every_size() {
        for d in [h200(), b200(), kb163(), sm120()] {
            for (tokens, many) in [(1, false), (4, false), (2048, true)] {
                let s = ExpertStep {
                    mxfp8: true,
                    ..step(tokens, many)
                };
                assert_eq!(expert_path(s, &d), ExpertPath::Mxfp8, "{d:?}");
            }
        }
        let wide = ExpertStep {
            mxfp8: true,
            experts: geometry::FEW_TOKEN_MAX_EXPERTS + 1,
            ..step(4, false)
        };
        assert_eq!(expert_path(wide, &h200()), ExpertPath::Cublas);
    }

    #[test]
    fn experts_without_wgmma_take_cublas_for_many_assignments() {
        let d = b200();
        assert_eq!(expert_path(step(1, false), &d), ExpertPath::SingleToken);
        assert_eq!(expert_path(step(512, true), &d), ExpertPath::Cublas);
        assert_eq!(expert_path(step(2048, true), &d), ExpertPath::Cublas);
    }

    #[test]
    fn experts_fall_back_where_the_shared_memory_does_not_fit() {
        // 163 KB and 99 KB: the single-token kernels (213 KB) do not fit, the few-token pair
        // (78 KB) does, and takes one token too.
        for d in [kb163(), sm120()] {
            assert_eq!(expert_path(step(1, false), &d), ExpertPath::FewTokens);
            assert_eq!(expert_path(step(4, false), &d), ExpertPath::FewTokens);
            assert_eq!(expert_path(step(2048, true), &d), ExpertPath::Cublas);
        }
        // Widths that are not whole 128-column steps go to the few-token pair, or to cuBLAS
        // where it does not fit.
        let odd = ExpertStep {
            latent: 3584 + 32,
            ..step(1, false)
        };
        assert_eq!(expert_path(odd, &h200()), ExpertPath::FewTokens);
        assert_eq!(
            expert_path(odd, &limits("sm_90", 65_536)),
            ExpertPath::Cublas
        );
        // More experts than the few-token kernels can list: cuBLAS.
        let wide = ExpertStep {
            experts: geometry::FEW_TOKEN_MAX_EXPERTS + 1,
            ..step(4, false)
        };
        assert_eq!(expert_path(wide, &h200()), ExpertPath::Cublas);
    }

    #[test]
    fn every_chosen_expert_kernel_is_launchable() {
        let kernels = |p: ExpertPath| -> &'static [&'static str] {
            match p {
                ExpertPath::SingleToken => &[
                    "mxfp4_experts_single_token_up_f32",
                    "mxfp4_experts_single_token_down_f32",
                ],
                ExpertPath::FewTokens => &[
                    "mxfp4_experts_few_tokens_up_f32",
                    "mxfp4_experts_few_tokens_down_f32",
                ],
                ExpertPath::Wgmma => {
                    &["mxfp4_experts_wgmma_up_f32", "mxfp4_experts_wgmma_down_f32"]
                }
                ExpertPath::Mxfp8 => &[
                    "mxfp4_experts_few_tokens_up_e4m3",
                    "mxfp4_experts_few_tokens_down_e4m3",
                ],
                ExpertPath::Cublas => &[],
            }
        };
        for limit in [49_152, 101_376, 166_912, 200_000, 232_448] {
            for arch in ["sm_90", "sm_90a", "sm_100", "sm_120"] {
                let d = limits(arch, limit);
                for tokens in [1, 2, 4, 16, 64, 512, 2048] {
                    for (many, mxfp8) in
                        [(false, false), (true, false), (false, true), (true, true)]
                    {
                        let s = ExpertStep {
                            mxfp8,
                            ..step(tokens, many)
                        };
                        let p = expert_path(s, &d);
                        assert!(d.launchable(kernels(p)), "{p:?} on {d:?}");
                        assert!(p != ExpertPath::Wgmma || arch == "sm_90a");
                    }
                }
                for precision in [Dtype::Bf16, Dtype::F32] {
                    let m = mla_attend(precision, &d);
                    let kernel = match m {
                        MlaAttend::F32 => "mla_attend_tf32_f32",
                        MlaAttend::Bf16Mma => "mla_attend_bf16_f32",
                        MlaAttend::PairWgmma => "mla_attend_pair_wgmma_f32",
                    };
                    assert!(d.launchable(&[kernel]), "{m:?} on {d:?}");
                }
            }
        }
    }

    #[test]
    fn mla_decode_falls_back_by_arch_and_shared_memory() {
        use Dtype::{Bf16, F32};
        assert_eq!(mla_attend(Bf16, &h200()), MlaAttend::PairWgmma);
        assert_eq!(mla_attend(F32, &h200()), MlaAttend::F32);
        // No wgmma off sm_90a; the mma.sync attend needs 166 KB (fits 163 KB = 166,912 B).
        assert_eq!(
            mla_attend(Bf16, &limits("sm_90", 232_448)),
            MlaAttend::Bf16Mma
        );
        assert_eq!(mla_attend(Bf16, &b200()), MlaAttend::Bf16Mma);
        assert_eq!(mla_attend(Bf16, &kb163()), MlaAttend::Bf16Mma);
        // 99 KB: neither bf16 kernel fits; the 3xTF32 kernel runs.
        assert_eq!(mla_attend(Bf16, &sm120()), MlaAttend::F32);
    }

    #[test]
    fn opt_in_follows_the_table_and_the_limit() {
        let d = kb163();
        assert_eq!(
            d.opt_in("mla_attend_bf16_f32"),
            Some(geometry::MLA_BF16_SHARED)
        );
        assert_eq!(
            d.opt_in("mla_attend_pair_wgmma_f32"),
            None,
            "past the limit"
        );
        assert_eq!(d.opt_in("rmsnorm_f32"), None, "not in the table");
        assert!(d.launchable(&["rmsnorm_f32"]));
        assert!(!d.launchable(&["mla_attend_pair_wgmma_f32"]));
        assert_eq!(
            h200().opt_in("mla_attend_pair_wgmma_f32"),
            Some(geometry::MLA_WGMMA_SHARED)
        );
    }
}
