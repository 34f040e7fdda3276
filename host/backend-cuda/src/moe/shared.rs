//! An MoE block's shared experts beside its routed experts (`Backend::moe_routed_and_shared`).
//! Both halves read the layer's input, neither reads the other's output. At decode the routed
//! kernels reach about half of their weight floor (latency- and instruction-bound: the MXFP4
//! decode), while the shared GLU's three bf16 products stream at the copy rate; so in bfloat16
//! mode the GLU (its gate and up products, SiTU-GLU, its down product) runs on a side stream
//! (lanes.rs) while the routed experts run on the backend's stream, and the products fill the
//! bandwidth the routed kernels leave idle. Same kernels and cuBLAS algorithms as one after the
//! other (each handle has the same workspace), so the same bits.

use crate::buf::Buf;
use crate::device::{CudaBackend, DeviceLinear, DeviceMat};
use crate::error::{CudaError, Result};
use cudarc::driver::CudaSlice;
use k3_model::backend::Glu;

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

    /// The shared GLU of `x` queued on the first side stream after a fork from the backend's
    /// stream; the caller queues the routed experts here, then `join_side_glu`, whatever failed
    /// in between. The caller checked `shared_glu_beside_routed`.
    pub(crate) fn glu_on_side(&self, x: &DeviceMat, w: &Glu<'_, CudaBackend>) -> Result<SideGlu> {
        fn bits(l: &DeviceLinear) -> Result<&CudaSlice<u16>> {
            l.bf16
                .as_ref()
                .ok_or_else(|| CudaError::InvalidArg("shared GLU: a weight without bf16".into()))
        }
        let (gate_w, up_w, down_w) = (bits(w.gate)?, bits(w.up)?, bits(w.down)?);
        let (rows, k, inter, hidden) = (x.rows, x.cols, w.gate.rows, w.down.rows);
        // Everything the side stream touches exists before the fork and is freed after the join
        // (lanes.rs): x's bf16 rows (the norm's, or made here), the GLU's buffers, its output.
        let mut own = None;
        let xs = self.bf16_rows_of(x, &mut own)?;
        let mut gate = self.output(rows, inter)?;
        let mut up = self.output(rows, inter)?;
        let mut h = self.output(rows, inter)?;
        h.bf16 = self.norm_bf16_rows(rows * inter)?;
        let mut out = self.output(rows, hidden)?;
        let lane = &self.lanes[0];
        self.fork_lanes(1)?;
        let queued = (|| {
            let gl = lane.gemm();
            self.gemm_bf16_on(gl, gate_w, 0, xs, 0, &mut gate.buf, 0, inter, rows, k)?;
            self.gemm_bf16_on(gl, up_w, 0, xs, 0, &mut up.buf, 0, inter, rows, k)?;
            self.situ_glu_into(&lane.stream, &gate, &up, w.situ, &h)?;
            let hs = h
                .bf16
                .as_ref()
                .ok_or_else(|| CudaError::InvalidArg("shared GLU: no bf16 rows".into()))?;
            self.gemm_bf16_on(gl, down_w, 0, hs, 0, &mut out.buf, 0, hidden, rows, inter)
        })();
        Ok(SideGlu {
            out,
            _held: (own, [gate, up, h]),
            queued,
        })
    }

    /// Wait here for the side stream's GLU; its output.
    pub(crate) fn join_side_glu(&self, side: SideGlu) -> Result<DeviceMat> {
        let joined = self.join_lanes(1);
        side.queued?;
        joined?;
        Ok(side.out)
    }
}

/// A shared GLU queued on a side stream (`glu_on_side`), until `join_side_glu`.
pub(crate) struct SideGlu {
    out: DeviceMat,
    /// What the side stream reads or writes: freed (stream-ordered, on the backend's stream)
    /// only after the join.
    _held: (Option<Buf<u16>>, [DeviceMat; 3]),
    /// Whether everything was queued.
    queued: Result<()>,
}
