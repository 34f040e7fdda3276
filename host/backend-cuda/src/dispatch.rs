//! Which kernels a step runs on this GPU, where that depends on the GPU itself: its architecture
//! (wgmma exists only on sm_90a) and its opt-in shared-memory limit per block (227 KB on Hopper
//! and the B200, 99 KB on sm_120 cards). The backend needs compute capability 9.0
//! (`geometry::check_compute_capability`). Pure functions of [`DeviceLimits`], so the fallbacks
//! for GPUs other than the H200 are tested here without one: a kernel whose shared memory does not
//! fit is never launched (the launch would fail), the next-best path runs. Only the H200's paths
//! are measured.

use crate::geometry;
use crate::moe_grouped::MoePrefill;
use crate::moe_stream::{self, Stream2Variant};
use crate::moe_wg::{self, MoeAct};
use crate::ops::MlaDecodeMode;

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

/// The routed-expert kernels of one step (ops.rs `moe_routed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertPath {
    /// moe_stream.rs v2: one token, cp.async weight ring (213 KB of shared memory).
    Stream2V2,
    /// moe_stream.rs v1: one token, 64 KB.
    Stream2V1,
    /// ops.rs tc2 pair: a few tokens per expert on tensor cores (78 KB).
    Tc2,
    /// moe_wg.rs: many assignments, wgmma (sm_90a, 210 KB).
    Wg(MoeAct),
    /// moe_grouped.rs: many assignments, mma.sync grouped GEMMs (196 KB).
    Grouped,
    /// moe_gemm.rs: experts expanded to bf16 and cuBLAS; runs anywhere.
    Gemm,
}

/// The step's shape and the start-up preferences that pick among the expert paths.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExpertStep {
    /// tokens x top-k.
    pub assignments: usize,
    /// At least `K3_MOE_GEMM_MIN` assignments (the many-assignment paths).
    pub many: bool,
    /// `K3_MX_EXPERTS` (ops.rs `mx_experts_choice`) asks for the stream2 pair.
    pub stream2: bool,
    pub latent: usize,
    pub inter: usize,
}

pub(crate) fn expert_path(
    step: ExpertStep,
    prefill: MoePrefill,
    stream2: Stream2Variant,
    dev: &DeviceLimits,
) -> ExpertPath {
    let (lt, ie) = (step.latent, step.inter);
    if !step.many {
        if step.stream2
            && moe_stream::stream2_fits(lt, ie)
            && dev.launchable(&["mxfp4_up_stream2_f32", "mxfp4_down_stream2_f32"])
        {
            let v2 = stream2 == Stream2Variant::V2
                && moe_stream::stream2v2_fits(lt, ie)
                && dev.launchable(&["mxfp4_up_stream2v2_f32", "mxfp4_down_stream2v2_f32"]);
            return if v2 {
                ExpertPath::Stream2V2
            } else {
                ExpertPath::Stream2V1
            };
        }
        return if dev.launchable(&["mxfp4_up_tc2_f32", "mxfp4_down_tc2_f32"]) {
            ExpertPath::Tc2
        } else {
            ExpertPath::Gemm
        };
    }
    if let MoePrefill::Wg(act) = prefill
        && moe_wg::wg_supported(&dev.arch)
        && dev.launchable(&["mxfp4_up_wg_f32", "mxfp4_down_wg_f32"])
    {
        return ExpertPath::Wg(act);
    }
    if prefill.grouped(step.assignments)
        && dev.launchable(&["mxfp4_up_grouped_f32", "mxfp4_down_grouped_f32"])
    {
        return ExpertPath::Grouped;
    }
    ExpertPath::Gemm
}

/// The MLA decode attend that runs for the configured `wanted` one: the wgmma kernels need
/// sm_90a and 223 KB, the mma.sync `Bf16` one 166 KB; `Precise` (static shared memory) runs
/// anywhere.
pub(crate) fn mla_decode_mode(wanted: MlaDecodeMode, dev: &DeviceLimits) -> MlaDecodeMode {
    let mut mode = wanted;
    let wg_kernel = match mode {
        MlaDecodeMode::Wg => Some("mla_attend_wg_f32"),
        MlaDecodeMode::WgPair => Some("mla_attend_wg2_f32"),
        _ => None,
    };
    if let Some(k) = wg_kernel
        && !(geometry::mla_wg_supported(&dev.arch) && dev.launchable(&[k]))
    {
        mode = MlaDecodeMode::Bf16;
    }
    if mode == MlaDecodeMode::Bf16 && !dev.launchable(&["mla_attend_bf16_f32"]) {
        mode = MlaDecodeMode::Precise;
    }
    mode
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
            assignments: tokens * 16,
            many,
            stream2: tokens == 1,
            latent: 3584,
            inter: 3072,
        }
    }

    const WG: MoePrefill = MoePrefill::Wg(MoeAct::Split);
    const V1: Stream2Variant = Stream2Variant::V1;
    const V2: Stream2Variant = Stream2Variant::V2;

    #[test]
    fn experts_on_the_h200_take_the_fastest_kernels() {
        let d = h200();
        assert_eq!(
            expert_path(step(1, false), WG, V2, &d),
            ExpertPath::Stream2V2
        );
        assert_eq!(
            expert_path(step(1, false), WG, V1, &d),
            ExpertPath::Stream2V1
        );
        assert_eq!(expert_path(step(4, false), WG, V2, &d), ExpertPath::Tc2);
        assert_eq!(
            expert_path(step(2048, true), WG, V2, &d),
            ExpertPath::Wg(MoeAct::Split)
        );
        assert_eq!(
            expert_path(step(512, true), MoePrefill::Grouped, V2, &d),
            ExpertPath::Grouped
        );
        assert_eq!(
            expert_path(step(512, true), MoePrefill::Gemm, V2, &d),
            ExpertPath::Gemm
        );
    }

    #[test]
    fn experts_without_wgmma_take_the_mma_sync_kernels() {
        let d = b200();
        assert_eq!(
            expert_path(step(1, false), WG, V2, &d),
            ExpertPath::Stream2V2
        );
        assert_eq!(
            expert_path(step(512, true), WG, V2, &d),
            ExpertPath::Grouped
        );
        // From K3_MOE_GROUPED_MAX assignments on, cuBLAS wins off sm_90a (moe_grouped.rs).
        assert_eq!(expert_path(step(2048, true), WG, V2, &d), ExpertPath::Gemm);
    }

    #[test]
    fn experts_fall_back_where_the_shared_memory_does_not_fit() {
        // 163 KB: stream2 v2 (213 KB) and the grouped GEMMs (196 KB) do not fit; tc2 (78 KB) does.
        let d = kb163();
        assert_eq!(
            expert_path(step(1, false), WG, V2, &d),
            ExpertPath::Stream2V1
        );
        assert_eq!(expert_path(step(4, false), WG, V2, &d), ExpertPath::Tc2);
        assert_eq!(expert_path(step(512, true), WG, V2, &d), ExpertPath::Gemm);
        assert_eq!(
            expert_path(step(512, true), MoePrefill::Grouped, V2, &d),
            ExpertPath::Gemm
        );
        // 99 KB: stream2 v1 (64 KB) and tc2 (78 KB) of the MXFP4 kernels; cuBLAS for the
        // many-assignment steps.
        let d = sm120();
        assert_eq!(
            expert_path(step(1, false), WG, V2, &d),
            ExpertPath::Stream2V1
        );
        assert_eq!(expert_path(step(4, false), WG, V2, &d), ExpertPath::Tc2);
        assert_eq!(expert_path(step(2048, true), WG, V2, &d), ExpertPath::Gemm);
        // Experts wider than stream2 takes go to tc2, or to cuBLAS where tc2 does not fit.
        let wide = ExpertStep {
            latent: moe_stream::MX_STREAM2_MAX_COLS + 32,
            ..step(1, false)
        };
        assert_eq!(expert_path(wide, WG, V2, &h200()), ExpertPath::Tc2);
        assert_eq!(expert_path(wide, WG, V2, &d), ExpertPath::Tc2);
        assert_eq!(
            expert_path(wide, WG, V2, &limits("sm_90", 65_536)),
            ExpertPath::Gemm
        );
    }

    #[test]
    fn every_chosen_expert_kernel_is_launchable() {
        let kernels = |p: ExpertPath| -> &'static [&'static str] {
            match p {
                ExpertPath::Stream2V2 => &["mxfp4_up_stream2v2_f32", "mxfp4_down_stream2v2_f32"],
                ExpertPath::Stream2V1 => &["mxfp4_up_stream2_f32", "mxfp4_down_stream2_f32"],
                ExpertPath::Tc2 => &["mxfp4_up_tc2_f32", "mxfp4_down_tc2_f32"],
                ExpertPath::Wg(_) => &["mxfp4_up_wg_f32", "mxfp4_down_wg_f32"],
                ExpertPath::Grouped => &["mxfp4_up_grouped_f32", "mxfp4_down_grouped_f32"],
                ExpertPath::Gemm => &[],
            }
        };
        for limit in [49_152, 101_376, 166_912, 200_000, 232_448] {
            for arch in ["sm_90", "sm_90a", "sm_100", "sm_120"] {
                let d = limits(arch, limit);
                for tokens in [1, 2, 4, 16, 64, 512, 2048] {
                    for many in [false, true] {
                        for prefill in [WG, MoePrefill::Grouped, MoePrefill::Gemm] {
                            for v in [V1, V2] {
                                let p = expert_path(step(tokens, many), prefill, v, &d);
                                assert!(d.launchable(kernels(p)), "{p:?} on {d:?}");
                                assert!(!matches!(p, ExpertPath::Wg(_)) || arch == "sm_90a");
                            }
                        }
                    }
                }
                let m = mla_decode_mode(MlaDecodeMode::WgPair, &d);
                let kernel = match m {
                    MlaDecodeMode::Precise => "mla_attend_tc2_f32",
                    MlaDecodeMode::Bf16 => "mla_attend_bf16_f32",
                    MlaDecodeMode::Wg => "mla_attend_wg_f32",
                    MlaDecodeMode::WgPair => "mla_attend_wg2_f32",
                };
                assert!(d.launchable(&[kernel]), "{m:?} on {d:?}");
            }
        }
    }

    #[test]
    fn mla_decode_falls_back_by_arch_and_shared_memory() {
        use MlaDecodeMode::*;
        assert_eq!(mla_decode_mode(WgPair, &h200()), WgPair);
        assert_eq!(mla_decode_mode(Wg, &h200()), Wg);
        assert_eq!(mla_decode_mode(Precise, &h200()), Precise);
        // No wgmma off sm_90a; Bf16 needs 166 KB (fits 163 KB = 166,912 B).
        assert_eq!(mla_decode_mode(WgPair, &limits("sm_90", 232_448)), Bf16);
        assert_eq!(mla_decode_mode(WgPair, &b200()), Bf16);
        assert_eq!(mla_decode_mode(Bf16, &kb163()), Bf16);
        // 99 KB: neither fits; the 3xTF32 kernel runs.
        assert_eq!(mla_decode_mode(WgPair, &sm120()), Precise);
        assert_eq!(mla_decode_mode(Bf16, &sm120()), Precise);
    }

    #[test]
    fn opt_in_follows_the_table_and_the_limit() {
        let d = kb163();
        assert_eq!(
            d.opt_in("mla_attend_bf16_f32"),
            Some(geometry::MLA_BF16_SHARED)
        );
        assert_eq!(d.opt_in("mla_attend_wg2_f32"), None, "past the limit");
        assert_eq!(d.opt_in("rmsnorm_f32"), None, "not in the table");
        assert!(d.launchable(&["rmsnorm_f32"]));
        assert!(!d.launchable(&["mla_attend_wg2_f32"]));
        assert_eq!(
            h200().opt_in("mla_attend_wg2_f32"),
            Some(geometry::MLA_WG2_SHARED)
        );
    }
}
