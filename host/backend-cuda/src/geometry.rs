//! Launch geometry and the shape limits of the kernels, as pure functions (testable without a GPU).
//! Each kernel's comment in kernels/*.cu states the grid it expects; these must agree with it.

use crate::error::{CudaError, Result};
use k3_model::backend::{KdaGeom, MlaGeom};

/// Grid and block dimensions of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Dynamic shared memory in bytes (0 unless set by `with_shared`).
    pub shared: u32,
}

impl Launch {
    pub fn new(grid: (usize, usize, usize), block: u32) -> Result<Self> {
        let dim = |v: usize, max: usize, what: &str| -> Result<u32> {
            if v == 0 || v > max {
                return Err(CudaError::Unsupported(format!(
                    "grid {what} = {v} (1..={max})"
                )));
            }
            Ok(v as u32)
        };
        Ok(Self {
            grid: (
                dim(grid.0, (1 << 31) - 1, "x")?,
                dim(grid.1, 65535, "y")?,
                dim(grid.2, 65535, "z")?,
            ),
            block,
            shared: 0,
        })
    }

    /// The same launch with `bytes` of dynamic shared memory: at most 48 KB, what a kernel gets
    /// without the opt-in attribute (static shared memory counts against it too).
    pub fn with_shared(self, bytes: usize) -> Result<Self> {
        if bytes > 48 * 1024 {
            return Err(CudaError::Unsupported(format!(
                "{bytes} B of dynamic shared memory (48 KB at most)"
            )));
        }
        Ok(Self {
            shared: bytes as u32,
            ..self
        })
    }

    /// The same launch with `bytes` of dynamic shared memory past the 48 KB default, for a kernel
    /// listed in [`OPT_IN_SHARED`] (device.rs raises its limit once when the module loads).
    pub fn with_opt_in_shared(self, bytes: usize) -> Result<Self> {
        if bytes > MAX_OPT_IN_SHARED {
            return Err(CudaError::Unsupported(format!(
                "{bytes} B of dynamic shared memory ({MAX_OPT_IN_SHARED} at most)"
            )));
        }
        Ok(Self {
            shared: bytes as u32,
            ..self
        })
    }

    pub fn config(&self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: self.grid,
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: self.shared,
        }
    }
}

/// KDA kernels hold K = V = 128 tiles (kernels/kda.cuh), windows of up to 8 taps, and the chunked
/// prefill factorises the decay inside 16-token chunks (needs |lower bound| · 16 < 88 in f32).
pub const KDA_HEAD_DIM: usize = 128;
pub const KDA_MAX_CONV: usize = 8;
pub const KDA_CHUNK: usize = 16;

pub fn check_kda(g: &KdaGeom) -> Result<()> {
    if g.head_dim != KDA_HEAD_DIM {
        return Err(CudaError::Unsupported(format!(
            "KDA head_dim {} (kernels need 128)",
            g.head_dim
        )));
    }
    if g.conv_kernel == 0 || g.conv_kernel > KDA_MAX_CONV {
        return Err(CudaError::Unsupported(format!(
            "KDA conv kernel {} (1..=8)",
            g.conv_kernel
        )));
    }
    let lb = g.gate_lower_bound;
    if !(lb.is_finite() && lb < 0.0 && -lb * (KDA_CHUNK as f32) < 88.0) {
        return Err(CudaError::Unsupported(format!(
            "KDA gate lower bound {lb} (needs -5.5 < lb < 0)"
        )));
    }
    Ok(())
}

/// Column slices of `kda_decode_lines_f32` per (head, sequence): its compile-time cluster size.
pub const KDA_DECODE_SPLIT: usize = 4;

/// Decode (`kda_decode_lines_f32`): a cluster of 4 128-thread blocks per (head, sequence),
/// grid.x = 4 * heads.
pub fn kda_decode(g: &KdaGeom, seqs: usize) -> Result<Launch> {
    check_kda(g)?;
    Launch::new((KDA_DECODE_SPLIT * g.heads, seqs, 1), 128)
}

/// Verify (`kda_verify_lines_f32`, ReplaySSM): the decode kernel's grid and cluster, one
/// (head, sequence) cluster per verifying or decoding sequence, whatever its token count.
pub fn kda_verify(g: &KdaGeom, seqs: usize) -> Result<Launch> {
    kda_decode(g, seqs)
}

/// Commit (`kda_commit_lines_f32`): 4 independent 128-thread column-slice blocks per
/// (head, commit), grid.x = 4 * heads (no cluster: the record holds everything a slice needs).
pub fn kda_commit(g: &KdaGeom, commits: usize) -> Result<Launch> {
    check_kda(g)?;
    Launch::new((KDA_DECODE_SPLIT * g.heads, commits, 1), 128)
}

/// Floats per (head, token) of a ReplaySSM record's recurrence part (`KDA_REC_HEAD` in
/// kernels/kda_decode.cu): k̂ `[K]`, v `[V]`, the decay factors exp(g) `[K]`, β.
pub const KDA_RECORD_HEAD_FLOATS: usize = 3 * KDA_HEAD_DIM + 1;

/// Float offset, inside a record of `tokens` verified tokens, of its pre-conv q, k, v rows
/// (`kda_rec_pre_base` in the kernel): after the `[H, T]` recurrence part.
pub fn kda_record_pre_conv_base(g: &KdaGeom, tokens: usize) -> usize {
    tokens * g.heads * KDA_RECORD_HEAD_FLOATS
}

/// Floats of one layer's record of `tokens` verified tokens: the recurrence part, then the
/// pre-conv rows `[3, T, H·K]`. Equals `tokens ·` [`KdaGeom::record_floats_per_token`], the room
/// the engine reserves.
pub fn kda_record_floats(g: &KdaGeom, tokens: usize) -> usize {
    kda_record_pre_conv_base(g, tokens) + 3 * tokens * g.hk()
}

/// Prefill: (conv, prep, chunk) launches for `tokens` new tokens.
pub fn kda_prefill(g: &KdaGeom, tokens: usize) -> Result<[Launch; 3]> {
    check_kda(g)?;
    if tokens == 0 {
        return Err(CudaError::InvalidArg("KDA prefill of 0 tokens".into()));
    }
    let channels = 3 * g.hk();
    Ok([
        Launch::new((channels.div_ceil(256), 1, 1), 256)?,
        Launch::new(((tokens * g.heads).div_ceil(4), 1, 1), 128)?,
        Launch::new((g.heads, KDA_HEAD_DIM / 32, 1), 128)?,
    ])
}

/// Limits of kernels/mla.cu: a latent row of at most 576 values (72 k-steps of 8), o~ in 512, q_nope
/// staged in 256 floats of shared memory, at most 256 position splits.
pub const MLA_MAX_ROW: usize = 576;
pub const MLA_MAX_KV_LORA: usize = 512;
pub const MLA_MAX_NOPE: usize = 256;
pub const MLA_MAX_SPLITS: usize = 256;

pub fn check_mla(g: &MlaGeom) -> Result<()> {
    if g.row() > MLA_MAX_ROW
        || g.kv_lora > MLA_MAX_KV_LORA
        || g.nope > MLA_MAX_NOPE
        || g.kv_lora == 0
    {
        return Err(CudaError::Unsupported(format!(
            "MLA kv_lora {} + rope {} (row <= 576, kv_lora <= 512), nope {} (<= 256)",
            g.kv_lora, g.rope, g.nope
        )));
    }
    Ok(())
}

/// The tensor-core attend (`mla_attend_tf32_f32`) runs 16 heads per 256-thread block.
pub const MLA_TC_HEADS_PER_BLOCK: usize = 16;

/// Grid (head groups, items, splits): the head groups of one (item, split) run side by side and
/// share the KV tile through L2.
pub fn mla_attend_f32(g: &MlaGeom, items: usize, splits: usize) -> Result<Launch> {
    check_mla(g)?;
    Launch::new(
        (g.heads.div_ceil(MLA_TC_HEADS_PER_BLOCK), items, splits),
        256,
    )
}

/// `mla_attend_tf32_f32` is register-capped to two resident blocks per SM. Position splits: at
/// least one wave of 2 · `sms` blocks, then the count in [want, 2 want] whose last wave is fullest,
/// splits of at least 128 positions.
pub const MLA_F32_BLOCKS_PER_SM: usize = 2;

pub fn mla_splits_f32(items: usize, heads: usize, max_len: usize, sms: usize) -> (usize, usize) {
    let blocks = items.max(1) * heads.div_ceil(MLA_TC_HEADS_PER_BLOCK);
    let splits = fullest_wave_splits(blocks, sms.max(1) * MLA_F32_BLOCKS_PER_SM, max_len);
    (splits, max_len.max(1).div_ceil(splits))
}

/// Position splits for `blocks` blocks per split over `slots` resident blocks: at least one wave
/// (`want`), then the count in [want, 2 want] whose last wave is fullest, splits of at least 128
/// positions (the MLA decode attends).
fn fullest_wave_splits(blocks: usize, slots: usize, max_len: usize) -> usize {
    let want = slots.div_ceil(blocks).max(1);
    let cap = max_len.div_ceil(128).clamp(1, MLA_MAX_SPLITS);
    let fill = |s: usize| wave_fill(blocks * s, slots);
    let mut splits = want.min(cap);
    for s in want..=(2 * want).min(cap) {
        if fill(s) > fill(splits) + 1e-9 {
            splits = s;
        }
    }
    splits
}

/// Share of the launched waves' block slots that `blocks` blocks occupy (1.0 = no idle slot).
fn wave_fill(blocks: usize, slots: usize) -> f64 {
    blocks as f64 / (blocks.div_ceil(slots) * slots) as f64
}

/// Shared memory per block on sm_90 with the opt-in attribute (227 KB).
pub const MAX_OPT_IN_SHARED: usize = 232_448;

/// `mla_attend_bf16_f32` (kernels/mla_attend_bf16.cu): 48 heads per 256-thread block, one block
/// per SM, MLC_SHARED bytes of dynamic shared memory (Q, two K tiles, score partials, P).
pub const MLA_BF16_HEADS_PER_BLOCK: usize = 48;
pub const MLA_BF16_SHARED: usize = 165_568;

/// `mla_attend_pair_wgmma_f32` (kernels/mla_attend_pair_wgmma.cu, wgmma: sm_90a only, clusters of 2 blocks): 48
/// heads per 384-thread block (a producer and two consumer warpgroups), one block per SM,
/// MLW_SHARED_PAIR bytes of dynamic shared memory (Q^T, two 64-position bf16 tiles, P^T, scores, 1 KB
/// to align the base, the four ring mbarriers).
pub const MLA_WGMMA_HEADS_PER_BLOCK: usize = 48;
pub const MLA_WGMMA_THREADS: u32 = 384;
pub const MLA_WGMMA_SHARED: usize = 223_200;

/// The few-token expert kernels (kernels/moe_few_tokens.cu, moe/mod.rs few_token_shared) at 4 n-tiles per pass: two
/// 256-thread blocks per SM.
pub const FEW_TOKEN_MAX_SHARED: usize = 78_336;

/// The MXFP8 few-token kernels (moe/mxfp8.rs): three stages of 256 weight rows x 68 bytes and 4
/// n-tiles x 8 staged token rows of 160 bytes (128 E4M3 values, 4 block factors, padding).
pub const FEW_TOKEN_E4M3_MAX_SHARED: usize = 3 * (256 * 68 + 4 * 8 * 160);

/// The most experts the few-token kernels list per block (kernels/moe_few_tokens.cu
/// MXF_MAX_EXPERTS); dispatch.rs sends layers with more to cuBLAS.
pub const FEW_TOKEN_MAX_EXPERTS: usize = 1024;

/// Dynamic shared memory of both wgmma expert GEMM kernels (kernels/moe_wgmma.cu MXW_SHARED_BYTES:
/// five 41,984-byte stages of 256 packed weight rows, their scales and 128 tokens x 64 columns x
/// hi / lo).
pub const MX_WG_SHARED: usize = 209_920;

/// The single-token expert kernels (kernels/moe_single_token.cu, moe/single_token.rs): 16 warps per
/// block, one block per SM; dynamic shared memory MXV_SHARED = the 64 KB table + 17 rings of 4
/// steps x 2,176 bytes (16 warps and the most that packing them around the 64 KB-aligned table
/// can waste).
pub const SINGLE_TOKEN_SHARED: usize = 65_536 + 17 * 4 * 2_176;

/// Widest input row of the single-token kernels' expert matrices (the staged row limit).
pub const SINGLE_TOKEN_MAX_COLS: usize = 124 * 32;

/// Whether the single-token kernels take a matrix of `rows` x `cols` (an expert's bytes index as
/// u32).
pub fn single_token_matrix_fits(rows: usize, cols: usize) -> bool {
    cols <= SINGLE_TOKEN_MAX_COLS && rows * cols / 2 < 1 << 31
}

/// Whether the single-token kernels take experts of these widths: whole 128-column steps both ways
/// (no padded blocks, 4-byte-aligned scale words), each matrix within
/// [`single_token_matrix_fits`].
pub fn single_token_fits(latent: usize, inter: usize) -> bool {
    latent.is_multiple_of(128)
        && inter.is_multiple_of(128)
        && single_token_matrix_fits(inter, latent)
        && single_token_matrix_fits(latent, inter)
}

/// Whether the wgmma expert GEMMs exist on a device compiled for `arch` (the arch-specific Hopper
/// target; elsewhere they are trapping stubs).
pub fn moe_wg_supported(arch: &str) -> bool {
    arch == "sm_90a"
}

/// Kernels launched with more than 48 KB of dynamic shared memory, and how much. device.rs skips
/// an entry past the device's opt-in limit (the wgmma ones, 223 KB, on an A100's 163 KB), and
/// dispatch.rs never launches such a kernel there.
pub const OPT_IN_SHARED: &[(&str, usize)] = &[
    ("mla_attend_bf16_f32", MLA_BF16_SHARED),
    ("mla_attend_pair_wgmma_f32", MLA_WGMMA_SHARED),
    ("mxfp4_experts_few_tokens_up_f32", FEW_TOKEN_MAX_SHARED),
    ("mxfp4_experts_few_tokens_down_f32", FEW_TOKEN_MAX_SHARED),
    (
        "mxfp4_experts_few_tokens_up_e4m3",
        FEW_TOKEN_E4M3_MAX_SHARED,
    ),
    (
        "mxfp4_experts_few_tokens_down_e4m3",
        FEW_TOKEN_E4M3_MAX_SHARED,
    ),
    ("mxfp4_experts_wgmma_up_f32", MX_WG_SHARED),
    ("mxfp4_experts_wgmma_down_f32", MX_WG_SHARED),
    ("mxfp4_experts_single_token_up_f32", SINGLE_TOKEN_SHARED),
    ("mxfp4_experts_single_token_down_f32", SINGLE_TOKEN_SHARED),
];

/// The [`OPT_IN_SHARED`] bytes of `kernel`, if it is listed.
pub fn opt_in_shared(kernel: &str) -> Option<usize> {
    OPT_IN_SHARED
        .iter()
        .find(|(n, _)| *n == kernel)
        .map(|&(_, b)| b)
}

/// Grid (head groups, items, splits): the two head groups of one (item, split) run side by side,
/// so the second one's cache reads hit L2.
pub fn mla_attend_bf16(g: &MlaGeom, items: usize, splits: usize) -> Result<Launch> {
    check_mla(g)?;
    Launch::new(
        (g.heads.div_ceil(MLA_BF16_HEADS_PER_BLOCK), items, splits),
        256,
    )?
    .with_opt_in_shared(MLA_BF16_SHARED)
}

/// Position splits of `mla_attend_bf16_f32` (one block per SM): one wave of `sms` blocks at
/// least, then the fullest last wave in [want, 2 want], splits of at least 128 positions (4
/// tiles). More splits only add partials ([H, splits, kv_lora + 2] f32 written and merged).
pub fn mla_splits_bf16(items: usize, heads: usize, max_len: usize, sms: usize) -> usize {
    let blocks = items.max(1) * heads.div_ceil(MLA_BF16_HEADS_PER_BLOCK);
    fullest_wave_splits(blocks, sms.max(1), max_len)
}

/// Grid of `mla_attend_pair_wgmma_f32` (`__cluster_dims__(2, 1, 1)`): head groups rounded up to pairs, a
/// block past the last head still loads its half of the rows for its partner (and writes nothing).
pub fn mla_attend_pair_wgmma(g: &MlaGeom, items: usize, splits: usize) -> Result<Launch> {
    check_mla(g)?;
    Launch::new(
        (mla_wgmma_blocks(g.heads), items, splits),
        MLA_WGMMA_THREADS,
    )?
    .with_opt_in_shared(MLA_WGMMA_SHARED)
}

/// Blocks per (item, split) of the wgmma attend: head groups of 48, rounded up to pairs for the
/// cluster, whose second block loads rows for its partner even without heads.
pub fn mla_wgmma_blocks(heads: usize) -> usize {
    2 * heads.div_ceil(MLA_WGMMA_HEADS_PER_BLOCK).div_ceil(2)
}

/// Position splits of the wgmma attend (one block per SM, as the bf16 attend): one split whenever it fills the SMs as well as the fullest-wave choice -
/// the attend then writes the final rows itself (`final_rows`) and the merge launch and the
/// partials' round trip go (at K3's N = 64, L = 32k: 128 blocks on 132 SMs, as full as 2 splits'
/// 256) - else that choice.
pub fn mla_splits_wgmma(items: usize, heads: usize, max_len: usize, sms: usize) -> usize {
    let blocks = items.max(1) * mla_wgmma_blocks(heads);
    let sms = sms.max(1);
    let splits = fullest_wave_splits(blocks, sms, max_len);
    if wave_fill(blocks, sms) + 1e-9 >= wave_fill(blocks * splits, sms) {
        1
    } else {
        splits
    }
}

/// Whether `mla_attend_pair_wgmma_f32` runs on a device compiled for `arch` (wgmma exists only on the
/// arch-specific Hopper target; elsewhere the kernel is a trapping stub).
pub fn mla_wgmma_supported(arch: &str) -> bool {
    arch == "sm_90a"
}

/// `mla_merge_f32` (both attends' partials): one 128-thread block per (item, head, 128 latent
/// columns).
pub fn mla_merge(g: &MlaGeom, items: usize) -> Result<Launch> {
    Launch::new((items, g.heads, g.kv_lora.div_ceil(128)), 128)
}

/// `mla_out_proj_f32`: W_UV rows in tiles of 16 per block, up to 64 items per block.
pub const MLA_OUT_PROJ_ROWS: usize = 16;
pub const MLA_OUT_PROJ_ITEMS: usize = 64;

pub fn mla_out_proj(g: &MlaGeom, items: usize) -> Result<Launch> {
    check_mla(g)?;
    Launch::new(
        (
            g.heads,
            g.v_dim.div_ceil(MLA_OUT_PROJ_ROWS),
            items.div_ceil(MLA_OUT_PROJ_ITEMS),
        ),
        256,
    )
}

/// Whether the bf16 kv_b products (`mla_absorb_q_bf16`, `mla_out_proj_bf16`) take this shape: nope
/// in k16 steps, 16-byte q rows, 16-byte W_UV rows (kv_lora <= 512 is `check_mla`'s).
pub fn mla_bf16_products(g: &MlaGeom) -> bool {
    g.nope.is_multiple_of(16)
        && (g.nope + g.rope).is_multiple_of(4)
        && g.kv_lora.is_multiple_of(8)
        && check_mla(g).is_ok()
}

/// `mla_absorb_q_bf16`: 128 latent columns per 128-thread block, one block row per head.
pub fn mla_absorb_bf16(g: &MlaGeom) -> Result<Launch> {
    check_mla(g)?;
    Launch::new((g.kv_lora.div_ceil(128), g.heads, 1), 128)
}

/// `mla_out_proj_bf16`: 32 W_UV rows per 128-thread block (the 4 warps split kv_lora), all items.
pub fn mla_out_proj_bf16(g: &MlaGeom) -> Result<Launch> {
    check_mla(g)?;
    Launch::new((g.v_dim.div_ceil(32), g.heads, 1), 128)
}

/// Grid-stride elementwise kernels: enough 256-thread blocks for `n`, capped (each thread loops).
pub fn elementwise(n: usize) -> Result<Launch> {
    Launch::new((n.div_ceil(256).clamp(1, 132 * 32), 1, 1), 256)
}

/// One block per row.
pub fn per_row(rows: usize, block: u32) -> Result<Launch> {
    Launch::new((rows, 1, 1), block)
}

/// `attn_res_f32` (kernels/attnres.cu): a cluster of ATTNRES_SPLIT = 8 blocks of 128 threads per row.
pub fn attn_res(rows: usize) -> Result<Launch> {
    if rows == 0 {
        return Err(CudaError::InvalidArg("attn_res over no rows".into()));
    }
    Launch::new((rows * 8, 1, 1), 128)
}

/// Per-(row, head) warp kernels with 4 warps per block.
pub fn warp_per_item(items: usize) -> Result<Launch> {
    Launch::new((items.div_ceil(4), 1, 1), 128)
}

/// MXFP4 expert kernels read whole 32-value blocks of a row: the input width must be a multiple of 32.
pub fn check_mx_width(cols: usize) -> Result<()> {
    if !cols.is_multiple_of(32) || cols == 0 {
        return Err(CudaError::Unsupported(format!(
            "MXFP4 input width {cols} is not a multiple of 32"
        )));
    }
    Ok(())
}

/// Router kernel limits (shared arrays in kernels/router.cu); one warp per token, 4 per block.
pub fn router(tokens: usize, experts: usize, k: usize) -> Result<Launch> {
    if experts > 1024 || k == 0 || k > 64 || k > experts {
        return Err(CudaError::Unsupported(format!(
            "router with {experts} experts, top-{k} (E <= 1024, k <= 64)"
        )));
    }
    Launch::new((tokens.div_ceil(4).max(1), 1, 1), 128)
}

/// The oldest GPUs the backend runs on: compute capability 9.0. The KDA decode and the MLA pair
/// attend are thread-block clusters, which sm_8x does not have (`scripts/nvrtc-check sm_80`
/// fails on them); every kernel compiles for sm_90a, sm_100 and sm_120.
pub fn check_compute_capability(major: i32, minor: i32) -> Result<()> {
    if major < 9 {
        return Err(CudaError::Unsupported(format!(
            "GPU of compute capability {major}.{minor} (sm_{major}{minor}): the CUDA backend needs \
             9.0 or newer (Hopper, Blackwell) for thread-block clusters"
        )));
    }
    Ok(())
}

/// NVRTC target for a device's compute capability: the arch-specific `a` variant on Hopper
/// (wgmma/setmaxnreg need it), the plain one elsewhere.
pub fn nvrtc_arch(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_capability_below_9_is_a_clear_error() {
        for (major, minor) in [(7, 5), (8, 0), (8, 6), (8, 9)] {
            let e = check_compute_capability(major, minor).unwrap_err();
            assert!(matches!(e, CudaError::Unsupported(_)));
            assert!(e.to_string().contains(&format!("sm_{major}{minor}")), "{e}");
        }
        for (major, minor) in [(9, 0), (10, 0), (12, 0)] {
            assert!(check_compute_capability(major, minor).is_ok());
        }
    }

    fn kda(heads: usize) -> KdaGeom {
        KdaGeom {
            heads,
            head_dim: 128,
            conv_kernel: 4,
            gate_lower_bound: -5.0,
        }
    }

    #[test]
    fn kda_geometry_matches_the_kernels() {
        let l = kda_decode(&kda(96), 64).unwrap();
        assert_eq!((l.grid, l.block), ((4 * 96, 64, 1), 128));
        let [conv, prep, chunk] = kda_prefill(&kda(96), 8192).unwrap();
        assert_eq!(conv.grid.0 as usize * 256, 3 * 96 * 128);
        assert_eq!(prep.grid.0 as usize * 4, 8192 * 96);
        assert_eq!(chunk.grid, (96, 4, 1));
        assert!(kda_prefill(&kda(2), 0).is_err());
    }

    #[test]
    fn kda_replay_geometry_and_record_size() {
        let l = kda_verify(&kda(96), 64).unwrap();
        assert_eq!((l.grid, l.block), ((4 * 96, 64, 1), 128));
        let l = kda_commit(&kda(8), 3).unwrap();
        assert_eq!((l.grid, l.block), ((4 * 8, 3, 1), 128));
        assert!(kda_commit(&kda(2), 0).is_err());
        // The kernel's record layout fills exactly the room the engine reserves, per head and
        // token 3K + 1 floats of recurrence and 3K of pre-conv inputs (769 at K = 128).
        for heads in [1, 2, 8, 96] {
            let g = kda(heads);
            for t in 1..=16 {
                assert_eq!(
                    kda_record_floats(&g, t),
                    t * g.record_floats_per_token(),
                    "heads {heads}, T {t}"
                );
                assert_eq!(kda_record_pre_conv_base(&g, t), t * heads * 385);
            }
        }
        assert_eq!(kda_record_floats(&kda(1), 1), 769);
        // The kernel's own definition of the per-head block agrees with KDA_RECORD_HEAD_FLOATS.
        let src = k3_kernels::FILES
            .iter()
            .find(|f| f.name == "kda_decode.cu")
            .unwrap()
            .text;
        assert!(src.contains("#define KDA_REC_HEAD (2 * KDA_K + KDA_V + 1)"));
        assert_eq!(KDA_RECORD_HEAD_FLOATS, 2 * KDA_HEAD_DIM + KDA_HEAD_DIM + 1);
    }

    #[test]
    fn kda_limits_are_enforced() {
        assert!(check_kda(&kda(2)).is_ok());
        assert!(
            check_kda(&KdaGeom {
                head_dim: 64,
                ..kda(2)
            })
            .is_err()
        );
        assert!(
            check_kda(&KdaGeom {
                conv_kernel: 9,
                ..kda(2)
            })
            .is_err()
        );
        assert!(
            check_kda(&KdaGeom {
                gate_lower_bound: -6.0,
                ..kda(2)
            })
            .is_err()
        );
        assert!(
            check_kda(&KdaGeom {
                gate_lower_bound: f32::NAN,
                ..kda(2)
            })
            .is_err()
        );
        assert!(
            kda_decode(&kda(2), 70_000).is_err(),
            "grid y is limited to 65535 sequences"
        );
    }

    #[test]
    fn mla_limits_and_splits() {
        let k3 = MlaGeom {
            heads: 96,
            nope: 128,
            rope: 64,
            v_dim: 128,
            kv_lora: 512,
            eps: 1e-6,
        };
        assert!(check_mla(&k3).is_ok());
        assert!(check_mla(&MlaGeom { rope: 65, ..k3 }).is_err());
        // 6 head groups of 16; two blocks per SM, so one 264-block wave at N = 1 (44 splits
        // covering 32k positions); 768 blocks (2.9 waves) at N = 64.
        let (s, c) = mla_splits_f32(1, 96, 32768, 132);
        assert!(s * c >= 32768 && (s - 1) * c < 32768);
        let l = mla_attend_f32(&k3, 3, 5).unwrap();
        assert_eq!((l.grid, l.block), ((6, 3, 5), 256));
        assert_eq!(mla_splits_f32(1, 96, 32768, 132).0, 44);
        assert_eq!(mla_splits_f32(16, 96, 8192, 132).0, 5);
        assert_eq!(mla_splits_f32(64, 96, 32768, 132).0, 2);
        assert_eq!(mla_splits_f32(1, 96, 100, 132).0, 1);
        // bf16 attend: 2 head groups of 48, one block per SM: 66 splits fill 132 SMs at N = 1;
        // 256 blocks at N = 64 (two splits, two waves).
        let l = mla_attend_bf16(&k3, 3, 5).unwrap();
        assert_eq!((l.grid, l.block, l.shared), ((2, 3, 5), 256, 165_568));
        assert_eq!(mla_splits_bf16(1, 96, 32768, 132), 66);
        assert_eq!(mla_splits_bf16(64, 96, 32768, 132), 2);
        assert_eq!(mla_splits_bf16(16, 96, 8192, 132), 8);
        assert_eq!(mla_splits_bf16(1, 96, 100, 132), 1);
        assert_eq!(mla_splits_bf16(1, 4, 900, 132), 8);
        assert_eq!(mla_splits_wgmma(1, 96, 32768, 132), 66);
        assert_eq!(mla_splits_wgmma(16, 96, 32768, 132), 8);
        // 128 blocks fill 132 SMs as well as 2 splits' 256: one split, final rows, no merge.
        assert_eq!(mla_splits_wgmma(64, 96, 32768, 132), 1);
        assert_eq!(mla_splits_wgmma(66, 96, 4096, 132), 1);
        // 40 blocks: one split would leave 70 % of the SMs idle.
        assert_eq!(
            mla_splits_wgmma(20, 96, 32768, 132),
            mla_splits_bf16(20, 96, 32768, 132)
        );
        assert!(mla_splits_wgmma(20, 96, 32768, 132) > 1);
        // Fewer than 48 heads: the cluster still launches a pair per (item, split).
        assert_eq!(mla_wgmma_blocks(4), 2);
        assert_eq!(mla_wgmma_blocks(52), 2);
        assert_eq!(mla_wgmma_blocks(144), 4);
        assert_eq!(mla_splits_wgmma(1, 4, 32768, 132), 66);
        assert!(
            mla_wgmma_supported("sm_90a")
                && !mla_wgmma_supported("sm_90")
                && !mla_wgmma_supported("sm_89")
        );
        assert!(OPT_IN_SHARED.contains(&("mla_attend_pair_wgmma_f32", MLA_WGMMA_SHARED)));
        // Pair variant: clusters of two blocks, so the head groups round up to an even count.
        let l = mla_attend_pair_wgmma(&k3, 3, 5).unwrap();
        assert_eq!((l.grid, l.block, l.shared), ((2, 3, 5), 384, 223_200));
        assert_eq!(
            mla_attend_pair_wgmma(&MlaGeom { heads: 4, ..k3 }, 1, 1)
                .unwrap()
                .grid,
            (2, 1, 1)
        );
        assert_eq!(
            mla_attend_pair_wgmma(&MlaGeom { heads: 100, ..k3 }, 1, 1)
                .unwrap()
                .grid,
            (4, 1, 1)
        );
        assert!(
            Launch::new((1, 1, 1), 32)
                .unwrap()
                .with_opt_in_shared(MAX_OPT_IN_SHARED + 1)
                .is_err()
        );
        let l = mla_out_proj(&k3, 65).unwrap();
        assert_eq!((l.grid, l.block), ((96, 8, 2), 256));
        assert_eq!(mla_merge(&k3, 3).unwrap().grid, (3, 96, 4));
        assert_eq!(
            mla_merge(&MlaGeom { kv_lora: 96, ..k3 }, 3).unwrap().grid,
            (3, 96, 1)
        );
        // bf16 kv_b products: 384 blocks each at K3 (one wave at 3 per SM), any item count.
        assert!(mla_bf16_products(&k3));
        let l = mla_absorb_bf16(&k3).unwrap();
        assert_eq!((l.grid, l.block), ((4, 96, 1), 128));
        let l = mla_out_proj_bf16(&k3).unwrap();
        assert_eq!((l.grid, l.block), ((4, 96, 1), 128));
        assert!(!mla_bf16_products(&MlaGeom { nope: 120, ..k3 }));
        assert!(!mla_bf16_products(&MlaGeom { rope: 62, ..k3 }));
        assert!(!mla_bf16_products(&MlaGeom {
            kv_lora: 500,
            rope: 64,
            ..k3
        }));
    }

    #[test]
    fn small_helpers() {
        assert_eq!(elementwise(1).unwrap().grid.0, 1);
        assert_eq!(elementwise(1 << 30).unwrap().grid.0, 132 * 32);
        assert!(per_row(0, 256).is_err());
        assert_eq!(warp_per_item(9).unwrap().grid.0, 3);
        assert!(check_mx_width(3584).is_ok() && check_mx_width(100).is_err());
        assert!(check_mx_width(0).is_err());
        assert!(
            router(4, 896, 16).is_ok() && router(4, 2048, 16).is_err() && router(4, 8, 9).is_err()
        );
        let a = attn_res(3).unwrap();
        assert_eq!((a.grid, a.block), ((24, 1, 1), 128));
        assert!(attn_res(0).is_err());
        // kernels/router.cu: one warp per token, ROUTER_WARPS = 4 per block.
        let r = router(5, 128, 16).unwrap();
        assert_eq!((r.grid, r.block), ((2, 1, 1), 128));
        assert_eq!(nvrtc_arch(9, 0), "sm_90a");
        assert_eq!(nvrtc_arch(8, 9), "sm_89");
    }
}
