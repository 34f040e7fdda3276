//! Routed experts with MXFP8 activations (`Dtype::Mxfp8`, K3's shipped precision: MXFP4 weights
//! times MXFP8 activations; docs/k3-model.md): `mxfp8_quantize_f32` rounds the latent input to E4M3
//! with one power-of-two scale per 32 values, the few-token walk multiplies it on FP8 tensor cores
//! (`mxfp4_experts_few_tokens_up_e4m3`, f32 SiTU-GLU out), the intermediate is quantized the same
//! way, `mxfp4_experts_few_tokens_down_e4m3` gives each assignment's row, and the combine sums them
//! in slot order. One path at every step size, so a prompt and its decode see the same rounding.
//!
//! Why not faster than the bf16 pair. E2M1 -> E4M3 costs two or three logic ops per four weights
//! against four and an fma per two for bf16, and an mma covers 32 k instead of 16, but Hopper has
//! no block-scaled mma: each 32-wide block must land in a fresh accumulator and be scaled into the
//! f32 sums (four multiplies and four fmas per mma), and the weight words come one block at a
//! time. docs/performance.md has the same-run comparison.

use crate::device::{CudaBackend, DeviceMat};
use crate::error::Result;
use crate::geometry::{self, Launch};
use crate::launch::i32_of;
use crate::moe::sorted::SortedStep;
use crate::moe::{
    FEW_TOKEN_DOWN_ROWS, FEW_TOKEN_STAGES, FEW_TOKEN_UP_ROWS, few_token_launch, few_token_ntiles,
};

/// kernels/moe_few_tokens.cu MXF8_STAGE_BYTES: 256 weight rows x 64 bytes, their scales and
/// `ntiles` x 8 staged token rows of 160 bytes.
fn stage_bytes(ntiles: usize) -> usize {
    256 * 64 + 256 * 4 + ntiles * 8 * 160
}

/// Quantized row lengths of `cols` values: E4M3 bytes and f32 block factors (128 and 4 per
/// 128-column super-step, the tail padded with zeros).
fn quantized_row(cols: usize) -> (usize, usize) {
    let ss = cols.div_ceil(128);
    (ss * 128, ss * 4)
}

/// `mxfp8_quantize_f32`: one 32-thread block per (row, 128-column super-step).
fn quantize_launch(rows: usize, cols: usize) -> Result<Launch> {
    geometry::check_mx_width(cols)?;
    Launch::new((rows, cols.div_ceil(128), 1), 32)
}

impl CudaBackend {
    /// `out [T, latent] = Σ_j w[t,j] · expert_{idx[t,j]}(z_t)` with MXFP8 activations.
    pub(crate) fn moe_experts_mxfp8(&self, step: SortedStep<'_>) -> Result<DeviceMat> {
        let (d, ex, situ) = (step.dims()?, step.ex, step.situ);
        let (t, n, lt, ie) = (d.t, d.n, d.lt, d.ie);
        let (ti, ni, kk, lti, iei, ei) =
            (d.ti, i32_of(n, "assignments")?, d.kk, d.lti, d.iei, d.ei);
        let nt = few_token_ntiles(t, 1);
        let (shared, nti) = (FEW_TOKEN_STAGES * stage_bytes(nt), nt as i32);
        let busy = d.e.min(n).max(1);
        let sms = self.multiprocessors;
        let (zq_row, zf_row) = quantized_row(lt);
        let (aq_row, af_row) = quantized_row(ie);
        // Every element read is written first: the quantizer writes whole super-steps (zeros past
        // the row), the up kernel every row of every assignment, the down kernel every output row.
        let zq = self.uninit::<u8>(t * zq_row)?;
        let zf = self.uninit::<f32>(t * zf_row)?;
        let act = self.uninit::<f32>(n * ie)?;
        let aq = self.uninit::<u8>(n * aq_row)?;
        let af = self.uninit::<f32>(n * af_row)?;
        let y = self.output(n, lt)?; // every row: the down walk, as the bf16 pair (mod.rs)
        let (lin, has) = crate::launch::situ_linear_args(situ);
        launch!(self, "mxfp8_quantize_f32", quantize_launch(t, lt)?; &step.z.buf, &zq, &zf, &ti, &lti)?;
        launch!(self, "mxfp4_experts_few_tokens_up_e4m3", few_token_launch(busy, ie, lt, FEW_TOKEN_UP_ROWS, shared, sms)?;
            &zq, &zf, &ex.w1.0, &ex.w1.1, &ex.w3.0, &ex.w3.1, step.offsets, step.sorted, &act, &kk, &lti,
            &iei, &situ.beta, &lin, &has, &ei, &nti)?;
        launch!(self, "mxfp8_quantize_f32", quantize_launch(n, ie)?; &act, &aq, &af, &ni, &iei)?;
        launch!(self, "mxfp4_experts_few_tokens_down_e4m3", few_token_launch(busy, lt, ie, FEW_TOKEN_DOWN_ROWS, shared, sms)?;
            &aq, &af, &ex.w2.0, &ex.w2.1, step.offsets, step.sorted, &y.buf, &lti, &iei, &ei, &nti)?;
        let out = self.output(t, lt)?; // the combine writes every element
        launch!(self, "moe_combine_f32", geometry::elementwise(t * lt)?; &y.buf, step.w, &out.buf, &ti, &kk, &lti)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp8_geometry() {
        // The largest ring (4 n-tiles) is what geometry opts the kernels in to, and two blocks fit
        // an SM of 227 KB.
        assert_eq!(
            FEW_TOKEN_STAGES * stage_bytes(4),
            geometry::FEW_TOKEN_E4M3_MAX_SHARED
        );
        const { assert!(2 * (geometry::FEW_TOKEN_E4M3_MAX_SHARED + 4_352 + 1024) <= 233_472) };
        for name in [
            "mxfp4_experts_few_tokens_up_e4m3",
            "mxfp4_experts_few_tokens_down_e4m3",
        ] {
            assert_eq!(
                geometry::opt_in_shared(name),
                Some(geometry::FEW_TOKEN_E4M3_MAX_SHARED)
            );
        }
        // K3: 28 super-steps of latent, 24 of intermediate; a partial super-step is padded.
        assert_eq!(quantized_row(3584), (28 * 128, 28 * 4));
        assert_eq!(quantized_row(160), (256, 8));
        let q = quantize_launch(16 * 16, 3072).unwrap();
        assert_eq!((q.grid, q.block), ((256, 24, 1), 32));
        assert!(quantize_launch(4, 100).is_err());
    }
}
