//! Routed LatentMoE experts (MXFP4 weights, SiTU-GLU; docs/k3-model.md): the router, then one
//! expert path per step shape (dispatch.rs `expert_path`): the single-token pair
//! (single_token.rs), the few-token pair below (MXFP4 decoded in registers for mma.sync, weights
//! read once per expert for up to 16 tokens), the wgmma GEMMs for many assignments (wgmma.rs), and
//! cuBLAS over bf16-expanded experts as the fallback (cublas.rs); in mxfp8 mode the MXFP8 pair
//! (mxfp8.rs) at every size. The sorted paths share sorted.rs.

pub(crate) mod cublas;
pub(crate) mod mxfp8;
pub(crate) mod shared;
pub(crate) mod single_token;
pub(crate) mod sorted;
pub(crate) mod wgmma;

use crate::buf::Buf;
use crate::device::{CudaBackend, DeviceMat};
use crate::dispatch::{ExpertPath, ExpertStep, expert_path};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::launch::i32_of;
use cudarc::driver::CudaSlice;
use k3_model::backend::{MxExpertsHost, MxMatrixHost, RouterParams, SituParams};

/// Routed experts of one layer, all experts back to back (kernels/mxfp4.cu layout).
pub struct DeviceExperts {
    pub experts: usize,
    pub latent: usize,
    pub inter: usize,
    pub w1: (CudaSlice<u8>, CudaSlice<u8>),
    pub w3: (CudaSlice<u8>, CudaSlice<u8>),
    pub w2: (CudaSlice<u8>, CudaSlice<u8>),
}

/// kernels/moe_few_tokens.cu (`mxfp4_experts_few_tokens_up_f32` / `mxfp4_experts_few_tokens_down_f32`):
/// weight rows per tile (up: 128 rows of W1 and of W3 = one 128-column super-step of the split
/// intermediate; down: 256 rows of W2), n-tiles of 8 columns per pass (at most 4: 8 tokens in
/// one bf16 plane, 4 as hi / lo), and the split activations' row length in bf16: per 128-column
/// super-step, 128 per plane.
pub(crate) const FEW_TOKEN_UP_ROWS: usize = 128;

pub(crate) const FEW_TOKEN_DOWN_ROWS: usize = 256;

const FEW_TOKEN_MAX_NTILES: usize = 4;

/// Persistent blocks per SM of the few-token pair (its `__launch_bounds__`).
const FEW_TOKEN_BLOCKS_PER_SM: usize = 2;

/// Ring stages of the few-token pair (the kernels take as many as their shared memory holds): 4,
/// 5 and 6 measured no faster than 3 with bf16 activations, nor with the producer kept two
/// stages ahead so the warps get more slack before a refill, and 3 fit 99 KB parts.
pub(crate) const FEW_TOKEN_STAGES: usize = 3;

fn few_token_row_u16(cols: usize, planes: usize) -> usize {
    cols.div_ceil(128) * 128 * planes
}

/// n-tiles per pass: tokens per expert are at most T, so small T stage fewer (less shared memory).
pub(crate) fn few_token_ntiles(tokens: usize, planes: usize) -> usize {
    (tokens * planes).div_ceil(8).clamp(1, FEW_TOKEN_MAX_NTILES)
}

/// kernels/moe_few_tokens.cu MXF_STAGE_BYTES: 256 weight rows x 64 bytes, their scales and
/// `ntiles` x 8 staged bf16 rows of 272 bytes.
fn few_token_stage_bytes(ntiles: usize) -> usize {
    256 * 64 + 256 * 4 + ntiles * 8 * 272
}

/// The ring's dynamic shared memory (at most `geometry::FEW_TOKEN_MAX_SHARED`: two blocks per SM).
fn few_token_shared(ntiles: usize) -> usize {
    FEW_TOKEN_STAGES * few_token_stage_bytes(ntiles)
}

/// Persistent grid of the few-token expert kernels: one block per tile (at most `busy` experts x
/// row blocks of `rows_per_block`), capped at two blocks per SM; each block walks its tiles.
pub(crate) fn few_token_launch(
    busy: usize,
    rows: usize,
    cols: usize,
    rows_per_block: usize,
    shared: usize,
    sms: usize,
) -> Result<Launch> {
    geometry::check_mx_width(cols)?;
    let tiles = busy * rows.div_ceil(rows_per_block);
    Launch::new((tiles.min(FEW_TOKEN_BLOCKS_PER_SM * sms).max(1), 1, 1), 256)?
        .with_opt_in_shared(shared)
}

/// `mxfp4_experts_few_tokens_split_f32`: one 32-thread block per (row, 128-column super-step).
fn few_token_split_launch(rows: usize, cols: usize) -> Result<Launch> {
    geometry::check_mx_width(cols)?;
    Launch::new((rows, cols.div_ceil(128), 1), 32)
}

impl CudaBackend {
    /// Router: (expert ids, weights) per token, `[T, k]` each, on the device.
    pub fn route(
        &self,
        logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        r: RouterParams,
    ) -> Result<(Buf<i32>, Buf<f32>)> {
        if bias.len() != logits.cols {
            return Err(CudaError::InvalidArg(format!(
                "router bias {} for {} experts",
                bias.len(),
                logits.cols
            )));
        }
        let l = geometry::router(logits.rows, logits.cols, r.top_k)?;
        // Every (token, slot) pair is written (geometry::router refuses what the kernel skips).
        let idx = self.uninit::<i32>(logits.rows * r.top_k)?;
        let w = self.uninit::<f32>(logits.rows * r.top_k)?;
        let (t, e, k, ren) = (
            logits.rows as i32,
            logits.cols as i32,
            r.top_k as i32,
            i32::from(r.renormalize),
        );
        launch!(self, "router_topk_f32", l; &logits.buf, bias, &idx, &w, &t, &e, &k, &ren, &r.scaling)?;
        Ok((idx, w))
    }

    /// Routed LatentMoE: router, grouping by expert, MXFP4 SiTU-GLU experts, fixed-order combine.
    pub fn moe_routed(
        &self,
        z: &DeviceMat,
        router_logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        ex: &DeviceExperts,
        r: RouterParams,
        situ: SituParams,
    ) -> Result<DeviceMat> {
        if z.cols != ex.latent || router_logits.cols != ex.experts || z.rows != router_logits.rows {
            return Err(CudaError::InvalidArg(
                "moe_routed: z / logits / experts shapes differ".into(),
            ));
        }
        let (idx, w) = self.route(router_logits, bias, r)?;
        let (t, k) = (z.rows, r.top_k);
        let step = ExpertStep {
            tokens: t,
            many: t * k >= self.options.moe_gemm_min_assignments,
            latent: ex.latent,
            inter: ex.inter,
            experts: ex.experts,
            mxfp8: self.options.dtype == crate::Dtype::Mxfp8,
        };
        let path = expert_path(step, &self.limits);
        // The single-token pair takes the router's ids as they are: no sort, no offsets.
        if path == ExpertPath::SingleToken {
            return self.moe_experts_single_token(z, &idx, &w, ex, k, situ);
        }
        // The sort writes every offset, and the sorted ids that the offsets cover (all that any
        // consumer reads).
        let offsets = self.uninit::<i32>(ex.experts + 1)?;
        let sorted = self.uninit::<i32>((t * k).max(1))?;
        let (na, e) = (i32_of(t * k, "assignments")?, ex.experts as i32);
        launch!(self, "moe_sort_assignments", Launch::new((1, 1, 1), 1024)?; &idx, &na, &e, &offsets, &sorted)?;
        let sorted_step = crate::moe::sorted::SortedStep {
            z,
            idx: &idx,
            w: &w,
            ex,
            top_k: k,
            offsets: &offsets,
            sorted: &sorted,
            situ,
        };
        match path {
            ExpertPath::Wgmma => return self.moe_experts_wgmma(sorted_step),
            ExpertPath::Cublas => return self.moe_experts_cublas(sorted_step),
            ExpertPath::Mxfp8 => return self.moe_experts_mxfp8(sorted_step),
            ExpertPath::FewTokens | ExpertPath::SingleToken => {}
        }
        // The down walk writes every latent row of every sorted assignment, and the router's ids
        // put every assignment in the sort: all of y.
        let y = self.output(t * k, ex.latent)?;
        let (kk, lt, ie) = (k as i32, ex.latent as i32, ex.inter as i32);
        let (lin, has) = crate::launch::situ_linear_args(situ);
        // Tiles for at most min(E, T*k) busy experts: the kernels list the busy ones themselves.
        let busy = ex.experts.min(t * k).max(1);
        // The few-token pair: z and the intermediate in bf16 planes (one in bfloat16 mode, hi / lo
        // in float32 mode) in fragment order (every element written: the split pads z, each up
        // block writes its whole 128-column super-step).
        let planes = self.options.dtype.planes();
        let nt = few_token_ntiles(t, planes);
        let shared = few_token_shared(nt);
        let (nti, ti, pl) = (nt as i32, i32_of(t, "tokens")?, planes as i32);
        let zx = self.uninit::<u16>(t * few_token_row_u16(ex.latent, planes))?;
        let actx = self.uninit::<u16>(t * k * few_token_row_u16(ex.inter, planes))?;
        launch!(self, "mxfp4_experts_few_tokens_split_f32", few_token_split_launch(t, ex.latent)?; &z.buf, &zx, &ti, &lt, &pl)?;
        let sms = self.multiprocessors;
        launch!(self, "mxfp4_experts_few_tokens_up_f32", few_token_launch(busy, ex.inter, ex.latent, FEW_TOKEN_UP_ROWS, shared, sms)?;
            &zx, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, &offsets, &sorted, &actx, &kk, &lt, &ie,
            &situ.beta, &lin, &has, &e, &nti, &pl)?;
        launch!(self, "mxfp4_experts_few_tokens_down_f32", few_token_launch(busy, ex.latent, ex.inter, FEW_TOKEN_DOWN_ROWS, shared, sms)?;
            &actx, &ex.w2.0, &ex.w2.1, &offsets, &sorted, &y.buf, &lt, &ie, &e, &nti, &pl)?;
        let out = self.output(t, ex.latent)?; // the combine writes every element
        let tt = t as i32;
        launch!(self, "moe_combine_f32", geometry::elementwise(t * ex.latent)?; &y.buf, &w, &out.buf, &tt, &kk, &lt)?;
        Ok(out)
    }

    pub(crate) fn upload_experts(&self, h: &MxExpertsHost) -> Result<DeviceExperts> {
        let cat = |ms: &[MxMatrixHost],
                   rows: usize,
                   cols: usize|
         -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
            let mut packed = Vec::with_capacity(ms.len() * rows * cols / 2);
            let mut scales = Vec::with_capacity(ms.len() * rows * cols / 32);
            for m in ms {
                if (m.rows, m.cols) != (rows, cols)
                    || m.packed.len() != rows * cols / 2
                    || m.scales.len() != rows * cols / 32
                {
                    return Err(CudaError::InvalidArg(format!(
                        "expert matrix {}x{} ({} packed, {} scales), want {rows}x{cols}",
                        m.rows,
                        m.cols,
                        m.packed.len(),
                        m.scales.len()
                    )));
                }
                packed.extend_from_slice(&m.packed);
                scales.extend_from_slice(&m.scales);
            }
            Ok((self.upload_kept(&packed)?, self.upload_kept(&scales)?))
        };
        if h.w1.len() != h.num_experts || h.w3.len() != h.num_experts || h.w2.len() != h.num_experts
        {
            return Err(CudaError::InvalidArg(
                "expert count differs per matrix".into(),
            ));
        }
        Ok(DeviceExperts {
            experts: h.num_experts,
            latent: h.latent,
            inter: h.inter,
            w1: cat(&h.w1, h.inter, h.latent)?,
            w3: cat(&h.w3, h.inter, h.latent)?,
            w2: cat(&h.w2, h.latent, h.inter)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_token_launch_geometry() {
        // kernels/moe_few_tokens.cu MXF_STAGE_BYTES: two blocks per SM at the largest pass.
        assert_eq!(
            few_token_shared(FEW_TOKEN_MAX_NTILES),
            geometry::FEW_TOKEN_MAX_SHARED
        );
        // Two blocks (plus 1 KB reserved and the static shared memory each: the busy-expert list
        // and its counts) in an SM's 228 KB.
        const {
            assert!(
                2 * (geometry::FEW_TOKEN_MAX_SHARED
                    + 1024
                    + 4 * geometry::FEW_TOKEN_MAX_EXPERTS
                    + 128)
                    <= 233_472
            )
        };
        let nts = |planes| [2, 5, 16, 64].map(|t| few_token_ntiles(t, planes));
        assert_eq!(nts(2), [1, 2, 4, 4]);
        assert_eq!(nts(1), [1, 1, 2, 4]);
        // K3: up blocks are one 128-column super-step of the intermediate each; down 256 rows.
        // K3 on 132 SMs: 128 x 24 up tiles and 128 x 14 down tiles over 264 persistent blocks.
        let up = few_token_launch(128, 3072, 3584, FEW_TOKEN_UP_ROWS, 78_336, 132).unwrap();
        assert_eq!((up.grid, up.block, up.shared), ((264, 1, 1), 256, 78_336));
        let down = few_token_launch(
            128,
            3584,
            3072,
            FEW_TOKEN_DOWN_ROWS,
            few_token_shared(1),
            132,
        )
        .unwrap();
        assert_eq!((down.grid, down.shared), ((264, 1, 1), 58_752));
        // Fewer tiles than blocks: one block per tile.
        let small = few_token_launch(2, 256, 256, FEW_TOKEN_UP_ROWS, 58_752, 132).unwrap();
        assert_eq!(small.grid, (4, 1, 1));
        assert_eq!(few_token_row_u16(3584, 2), 28 * 256);
        assert_eq!(few_token_row_u16(3584, 1), 28 * 128);
        assert_eq!(few_token_row_u16(160, 2), 2 * 256);
        assert_eq!(few_token_split_launch(64, 3584).unwrap().grid, (64, 28, 1));
        assert!(few_token_launch(16, 3072, 100, FEW_TOKEN_UP_ROWS, 58_752, 132).is_err());
    }
}
