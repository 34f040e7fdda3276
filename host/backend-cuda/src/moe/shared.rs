//! An MoE block's shared experts beside its routed experts (`Backend::moe_routed_and_shared`).
//! Both halves read the layer's input, neither reads the other's output. At decode the routed
//! kernels reach about half of their weight floor (latency- and instruction-bound: the MXFP4
//! decode), while the shared GLU's three bf16 products stream at the copy rate; so in bfloat16
//! mode the GLU (its gate and up products, SiTU-GLU, its down product) runs on a side stream
//! (lanes.rs) while the routed experts run on the backend's stream, and the products fill the
//! bandwidth the routed kernels leave idle. Same kernels and cuBLAS algorithms as one after the
//! other (each handle has the same workspace), so the same bits.

use super::DeviceExperts;
use crate::device::{CudaBackend, DeviceLinear, DeviceMat};
use crate::error::{CudaError, Result};
use cudarc::driver::CudaSlice;
use k3_model::backend::{Glu, RouterParams};

impl CudaBackend {
    /// Whether the shared GLU of `x` can run on a side stream: bfloat16 mode, a side stream, and
    /// every product of the GLU a cuBLAS product over bf16 rows (the GEMV's products stay on the
    /// backend's stream, `matmul_linears`).
    pub(crate) fn shared_glu_beside_routed(&self, x: &DeviceMat, w: &Glu<'_, CudaBackend>) -> bool {
        let (rows, inter) = (x.rows, w.gate.rows);
        self.options.dtype.planes() == 1
            && !self.lanes.is_empty()
            && w.up.rows == inter
            && self.takes_cublas(x, w.gate)
            && self.takes_cublas(x, w.up)
            && w.down.bf16.is_some()
            && w.down.cols == inter
            && rows * w.down.rows != 0
            && !self.takes_gemv(rows, w.down.rows, inter)
    }

    /// The routed experts of `z` here and the shared GLU of `x` on the first side stream, joined
    /// before returning (routed latent output, shared output). The caller checked
    /// `shared_glu_beside_routed`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_routed_beside_shared(
        &self,
        z: &DeviceMat,
        router_logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        experts: &DeviceExperts,
        router: RouterParams,
        x: &DeviceMat,
        w: &Glu<'_, CudaBackend>,
    ) -> Result<(DeviceMat, DeviceMat)> {
        fn bits(l: &DeviceLinear) -> Result<&CudaSlice<u16>> {
            l.bf16
                .as_ref()
                .ok_or_else(|| CudaError::InvalidArg("shared GLU: a weight without bf16".into()))
        }
        let (gate_w, up_w, down_w) = (bits(w.gate)?, bits(w.up)?, bits(w.down)?);
        let (rows, k, inter, hidden) = (x.rows, x.cols, w.gate.rows, w.down.rows);
        // Everything the side stream touches exists before the fork and is freed after the join
        // (lanes.rs): x's bf16 rows (the norm's, or made here), the GLU's buffers, its output.
        let own;
        let xs = match &x.bf16 {
            Some(rows) => rows,
            None => {
                own = self.bf16_rows(x)?;
                &own
            }
        };
        let (mut gate, mut up) = (self.output(rows, inter)?, self.output(rows, inter)?);
        let mut h = self.output(rows, inter)?;
        h.bf16 = self.norm_bf16_rows(rows * inter)?;
        let mut out = self.output(rows, hidden)?;
        let lane = &self.lanes[0];
        self.fork_lanes(1)?;
        let side = (|| {
            self.gemm_bf16_on(
                &lane.blas,
                gate_w,
                0,
                xs,
                0,
                &mut gate.buf,
                0,
                inter,
                rows,
                k,
            )?;
            self.gemm_bf16_on(&lane.blas, up_w, 0, xs, 0, &mut up.buf, 0, inter, rows, k)?;
            self.situ_glu_into(&lane.stream, &gate, &up, w.situ, &h)?;
            let hs = h
                .bf16
                .as_ref()
                .ok_or_else(|| CudaError::InvalidArg("shared GLU: no bf16 rows".into()))?;
            self.gemm_bf16_on(
                &lane.blas,
                down_w,
                0,
                hs,
                0,
                &mut out.buf,
                0,
                hidden,
                rows,
                inter,
            )
        })();
        let routed = self.moe_routed(z, router_logits, bias, experts, router, w.situ);
        // Joined whatever failed: nothing is freed while the side stream may still run.
        let joined = self.join_lanes(1);
        side?;
        joined?;
        Ok((routed?, out))
    }
}
