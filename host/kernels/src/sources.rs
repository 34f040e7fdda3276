//! The kernel sources, embedded at build time, and their local `#include "..."` expansion.
//! NVRTC gets one self-contained string per file (no include paths on disk needed), exactly as
//! scripts/nvrtc-check and the device harness build it.

use crate::error::{KernelError, Result};

/// One compilation unit: a `kernels/*.cu` file and the `extern "C"` entry points it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelFile {
    pub name: &'static str,
    pub text: &'static str,
    pub entries: &'static [&'static str],
}

/// Headers that `.cu` files may include by name.
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../kernels/common.cuh")),
    ("kda.cuh", include_str!("../../../kernels/kda.cuh")),
    (
        "mxfp4_mma.cuh",
        include_str!("../../../kernels/mxfp4_mma.cuh"),
    ),
    (
        "tensor_core.cuh",
        include_str!("../../../kernels/tensor_core.cuh"),
    ),
];

pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "attnres.cu",
        text: include_str!("../../../kernels/attnres.cu"),
        entries: &["attn_res_f32"],
    },
    KernelFile {
        name: "bf16.cu",
        text: include_str!("../../../kernels/bf16.cu"),
        entries: &[
            "bf16_split_rows_f32",
            "sum_row_halves_f32",
            "bf16_to_f32",
            "gemv_bf16_tc_f32",
        ],
    },
    KernelFile {
        name: "elementwise.cu",
        text: include_str!("../../../kernels/elementwise.cu"),
        entries: &[
            "add_assign_f32",
            "sigmoid_mul_f32",
            "embed_rows_f32",
            "embed_rows_bf16",
        ],
    },
    KernelFile {
        name: "kda_chunk.cu",
        text: include_str!("../../../kernels/kda_chunk.cu"),
        entries: &["kda_conv_silu_f32", "kda_prep_f32", "kda_chunk_fwd_f32"],
    },
    KernelFile {
        name: "kda_decode.cu",
        text: include_str!("../../../kernels/kda_decode.cu"),
        entries: &[
            "kda_decode_lines_f32",
            "kda_verify_lines_f32",
            "kda_commit_lines_f32",
        ],
    },
    KernelFile {
        name: "kda_prefill_scan.cu",
        text: include_str!("../../../kernels/kda_prefill_scan.cu"),
        entries: &["kda_prefill_record_f32", "kda_prefill_scan_f32"],
    },
    KernelFile {
        name: "mla.cu",
        text: include_str!("../../../kernels/mla.cu"),
        entries: &[
            "mla_append_rows_f32",
            "mla_absorb_q_f32",
            "mla_attend_tf32_f32",
            "mla_merge_f32",
            "mla_out_proj_f32",
            "mla_absorb_q_bf16",
            "mla_out_proj_bf16",
        ],
    },
    KernelFile {
        name: "mla_attend_bf16.cu",
        text: include_str!("../../../kernels/mla_attend_bf16.cu"),
        entries: &["mla_attend_bf16_f32"],
    },
    KernelFile {
        name: "mla_attend_pair_wgmma.cu",
        text: include_str!("../../../kernels/mla_attend_pair_wgmma.cu"),
        entries: &["mla_attend_pair_wgmma_f32"],
    },
    KernelFile {
        name: "mla_prefill.cu",
        text: include_str!("../../../kernels/mla_prefill.cu"),
        entries: &[
            "mla_prefill_gather_f32",
            "mla_prefill_softmax_f32",
            "mla_prefill_flash_bf16",
        ],
    },
    KernelFile {
        name: "moe_few_tokens.cu",
        text: include_str!("../../../kernels/moe_few_tokens.cu"),
        entries: &[
            "mxfp4_experts_few_tokens_split_f32",
            "mxfp4_experts_few_tokens_up_f32",
            "mxfp4_experts_few_tokens_down_f32",
            "mxfp8_quantize_f32",
            "mxfp4_experts_few_tokens_up_e4m3",
            "mxfp4_experts_few_tokens_down_e4m3",
        ],
    },
    KernelFile {
        name: "moe_gemm.cu",
        text: include_str!("../../../kernels/moe_gemm.cu"),
        entries: &[
            "moe_gather_split_bf16",
            "mxfp4_to_bf16_experts",
            "moe_glu_split_bf16",
            "moe_combine_split_f32",
        ],
    },
    KernelFile {
        name: "moe_single_token.cu",
        text: include_str!("../../../kernels/moe_single_token.cu"),
        entries: &[
            "mxfp4_experts_single_token_up_f32",
            "mxfp4_experts_single_token_down_f32",
        ],
    },
    KernelFile {
        name: "moe_wgmma.cu",
        text: include_str!("../../../kernels/moe_wgmma.cu"),
        entries: &[
            "mxfp4_experts_wgmma_split_f32",
            "mxfp4_experts_wgmma_up_f32",
            "mxfp4_experts_wgmma_down_f32",
        ],
    },
    KernelFile {
        name: "mxfp4.cu",
        text: include_str!("../../../kernels/mxfp4.cu"),
        entries: &[
            "moe_sort_assignments",
            "moe_combine_f32",
            "moe_combine_ids_f32",
        ],
    },
    KernelFile {
        name: "norm.cu",
        text: include_str!("../../../kernels/norm.cu"),
        entries: &["rms_norm_f32", "gated_head_norm_f32"],
    },
    KernelFile {
        name: "router.cu",
        text: include_str!("../../../kernels/router.cu"),
        entries: &["router_topk_f32"],
    },
    KernelFile {
        name: "sampling.cu",
        text: include_str!("../../../kernels/sampling.cu"),
        entries: &["topk_segments_f32", "topk_merge_f32"],
    },
    KernelFile {
        name: "situ.cu",
        text: include_str!("../../../kernels/situ.cu"),
        entries: &["situ_glu_f32", "situ_glu_packed_f32"],
    },
    KernelFile {
        name: "vision.cu",
        text: include_str!("../../../kernels/vision.cu"),
        entries: &[
            "add_bias_f32",
            "gelu_tanh_f32",
            "vision_rope_f32",
            "vision_attention_f32",
            "merge_patches_f32",
        ],
    },
];

/// `text` with every `#include "name"` replaced by the header's (recursively expanded) text,
/// each header at most once (they all `#pragma once`).
pub fn expand(file: &str, text: &str) -> Result<String> {
    let mut seen = Vec::new();
    let mut out = String::with_capacity(text.len() * 2);
    expand_into(file, text, &mut seen, &mut out)?;
    Ok(out)
}

fn expand_into(
    file: &str,
    text: &str,
    seen: &mut Vec<&'static str>,
    out: &mut String,
) -> Result<()> {
    for line in text.lines() {
        let Some(name) = include_target(line) else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let Some(&(hname, htext)) = HEADERS.iter().find(|(n, _)| *n == name) else {
            return Err(KernelError::Source {
                file: file.into(),
                message: format!("unknown include \"{name}\""),
            });
        };
        if !seen.contains(&hname) {
            seen.push(hname);
            expand_into(hname, htext, seen, out)?;
        }
    }
    Ok(())
}

/// `Some("x")` for a line `#include "x"` (leading spaces and `# include` allowed).
fn include_target(line: &str) -> Option<&str> {
    let rest = line
        .trim_start()
        .strip_prefix('#')?
        .trim_start()
        .strip_prefix("include")?
        .trim();
    rest.strip_prefix('"')?.split('"').next()
}

/// Names of the `extern "C" __global__` functions defined in `text`.
pub fn entry_points(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("extern \"C\" __global__ void") {
        rest = &rest[i + "extern \"C\" __global__ void".len()..];
        let mut head = rest.trim_start();
        // Skip attributes such as `__launch_bounds__(..)` and `__cluster_dims__(..)`.
        while let Some(after) = ["__launch_bounds__(", "__cluster_dims__("]
            .iter()
            .find_map(|a| head.strip_prefix(a))
        {
            head = after
                .split_once(')')
                .map(|(_, r)| r.trim_start())
                .unwrap_or("");
        }
        let name: String = head
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn include_lines_are_recognised() {
        assert_eq!(
            include_target("#include \"common.cuh\""),
            Some("common.cuh")
        );
        assert_eq!(
            include_target("  #  include \"kda.cuh\"  // x"),
            Some("kda.cuh")
        );
        assert_eq!(include_target("#include <stdio.h>"), None);
        assert_eq!(include_target("int include = 1;"), None);
    }

    #[test]
    fn expansion_inlines_each_header_once_and_rejects_unknown_ones() {
        let out = expand(
            "t.cu",
            "#include \"kda.cuh\"\n#include \"common.cuh\"\nint x;\n",
        )
        .unwrap();
        assert_eq!(
            out.matches("__device__ __forceinline__ float warp_sum")
                .count(),
            1
        );
        assert!(out.contains("#define KDA_K 128") && out.ends_with("int x;\n"));
        assert!(!out.contains("#include \""));
        let err = expand("t.cu", "#include \"nope.cuh\"\n").unwrap_err();
        assert!(err.to_string().contains("nope.cuh"), "{err}");
    }

    #[test]
    fn every_kernel_file_is_embedded_with_its_entry_points() {
        // A new kernels/*.cu must be listed in FILES, and the listed entries must match the source.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let embedded: Vec<String> = FILES.iter().map(|f| f.name.to_string()).collect();
        assert_eq!(on_disk, embedded);
        for f in FILES {
            let mut found = entry_points(f.text);
            found.sort();
            let mut listed: Vec<String> = f.entries.iter().map(|s| s.to_string()).collect();
            listed.sort();
            assert_eq!(found, listed, "{}", f.name);
            let text = expand(f.name, f.text).unwrap();
            assert!(
                !text.contains("#include"),
                "{} keeps an include NVRTC cannot resolve",
                f.name
            );
        }
    }
}
