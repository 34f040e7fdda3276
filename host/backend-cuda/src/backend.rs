//! `k3_model::backend::Backend` for [`CudaBackend`]: f32 activations and dense weights on the
//! device, dense matmuls through cuBLAS (sgemm, default math mode so results track the CPU
//! backend to ~1e-5), everything else through the NVRTC kernels of the op modules (dense/, kda/, mla/, moe/).
//!
//! All work is queued on the backend's one stream; only `to_host` and `arena_read` wait for it.
//! Every op returns its error ([`CudaError`] as a `BackendError`), so a failed step stops there.

use crate::device::{CudaBackend, DeviceLinear, DeviceMat};
use crate::error::{CudaError, Result};
use crate::kda::{decode_slots, kda_parts};
use crate::moe::DeviceExperts;
use cudarc::driver::{CudaSlice, DevicePtrMut};
use k3_model::ExecError;
use k3_model::backend::{
    Backend, BackendError, Glu, KdaCommit, KdaGeom, KdaInputs, KdaParams, KdaStateLoc, MlaCacheLoc,
    MlaGeom, MxExpertsHost, OpResult, RouterParams, SituParams, VisionAttnGeom,
};

impl CudaBackend {
    /// Make our context current on the calling thread: the engine runs the executor on its own
    /// thread, and raw driver / cuBLAS calls use the thread's current context.
    fn bound(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// Run one op of the `Backend` trait with the context bound, its error as the trait's.
    fn op<T>(&self, f: impl FnOnce() -> Result<T>) -> OpResult<T> {
        self.bound().and_then(|()| f()).map_err(BackendError::from)
    }

    fn arena_check(arena: &CudaSlice<f32>, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > arena.len() * 4) {
            return Err(CudaError::InvalidArg(format!(
                "arena bytes {offset}+{len} beyond {}",
                arena.len() * 4
            )));
        }
        Ok(())
    }

    /// Byte-granular copy inside the arena (the caller guarantees the regions do not overlap).
    fn arena_copy_bytes(
        &self,
        arena: &mut CudaSlice<f32>,
        src: usize,
        dst: usize,
        len: usize,
    ) -> Result<()> {
        Self::arena_check(arena, src, len)?;
        Self::arena_check(arena, dst, len)?;
        self.refuse_while_recording("arena copy")?; // cache moves: not part of a step
        if len == 0 {
            return Ok(());
        }
        let (base, _sync) = arena.device_ptr_mut(&self.stream);
        // SAFETY: both ranges are inside the allocation (checked above); queued on our stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                base + dst as u64,
                base + src as u64,
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    fn arena_zero_bytes(
        &self,
        arena: &mut CudaSlice<f32>,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        Self::arena_check(arena, offset, len)?;
        self.refuse_while_recording("arena zero")?; // cache moves: not part of a step
        if len == 0 {
            return Ok(());
        }
        let (base, _sync) = arena.device_ptr_mut(&self.stream);
        // SAFETY: the range is inside the allocation (checked above); queued on our stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                base + offset as u64,
                0,
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    /// Reads the whole floats covering the byte range (synchronous), then trims to the bytes.
    fn arena_read_bytes(
        &self,
        arena: &CudaSlice<f32>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>> {
        Self::arena_check(arena, offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let (f0, f1) = (offset / 4, (offset + len).div_ceil(4));
        let floats = self.read_back("arena read", &arena.slice(f0..f1))?;
        let bytes: Vec<u8> = floats.iter().flat_map(|f| f.to_ne_bytes()).collect();
        let skip = offset - f0 * 4;
        Ok(bytes[skip..skip + len].to_vec())
    }

    /// `f`, timed under `key` when `K3_PROFILE` is set (see `profile.rs`).
    pub(crate) fn timed<T>(&self, key: impl FnOnce() -> String, f: impl FnOnce() -> T) -> T {
        match &self.profile {
            None => f(),
            Some(p) => p.time(
                key(),
                || {
                    let _ = self.stream.synchronize();
                },
                f,
            ),
        }
    }
}

/// Row counts in the profile's keys, rounded up to a power of two so prompts of similar length
/// share a line.
fn bucket(n: usize) -> usize {
    n.next_power_of_two()
}

impl Backend for CudaBackend {
    type Act = DeviceMat;
    type Linear = DeviceLinear;
    type Vector = CudaSlice<f32>;
    type Experts = DeviceExperts;
    type Arena = CudaSlice<f32>;

    fn linear(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<DeviceLinear> {
        self.op(|| self.upload_linear(rows, cols, &data))
    }

    fn vector(&self, data: Vec<f32>) -> OpResult<CudaSlice<f32>> {
        self.op(|| {
            if data.is_empty() {
                return Ok(self.stream.alloc_zeros::<f32>(1)?);
            }
            self.upload_kept(&data)
        })
    }

    fn experts(&self, host: MxExpertsHost) -> OpResult<DeviceExperts> {
        self.op(|| self.upload_experts(&host))
    }

    fn arena(&self, bytes: usize) -> OpResult<CudaSlice<f32>> {
        self.op(|| {
            // At least one float, so the buffer exists.
            let a = self.stream.alloc_zeros::<f32>((bytes / 4).max(1))?;
            let base = cudarc::driver::DevicePtr::device_ptr(&a, &self.stream).0;
            self.step.add_arena(base, a.len() * 4);
            Ok(a)
        })
    }

    fn arena_len(&self, arena: &CudaSlice<f32>) -> usize {
        arena.len() * 4
    }

    fn arena_copy(
        &self,
        arena: &mut CudaSlice<f32>,
        src: usize,
        dst: usize,
        len: usize,
    ) -> OpResult<()> {
        self.op(|| self.arena_copy_bytes(arena, src, dst, len))
    }

    fn arena_zero(&self, arena: &mut CudaSlice<f32>, offset: usize, len: usize) -> OpResult<()> {
        self.op(|| self.arena_zero_bytes(arena, offset, len))
    }

    fn arena_read(&self, arena: &CudaSlice<f32>, offset: usize, len: usize) -> OpResult<Vec<u8>> {
        self.op(|| self.arena_read_bytes(arena, offset, len))
    }

    fn to_host(&self, a: &DeviceMat) -> OpResult<Vec<f32>> {
        self.op(|| self.download(a))
    }

    fn rows(&self, a: &DeviceMat) -> usize {
        a.rows
    }

    fn top_k_rows(&self, a: &DeviceMat, k: usize) -> OpResult<Vec<Vec<(u32, f32)>>> {
        if k == 0 || k > crate::dense::TOPK_MAX {
            return Ok(k3_model::select::top_k_of_rows(
                &self.to_host(a)?,
                a.rows,
                k,
            ));
        }
        self.op(|| CudaBackend::top_k_rows(self, a, k, &[]))
    }

    fn top_k_rows_masked(
        &self,
        a: &DeviceMat,
        k: usize,
        masks: &[Option<&[u32]>],
    ) -> OpResult<Vec<Vec<(u32, f32)>>> {
        if k == 0 || k > crate::dense::TOPK_MAX {
            return Ok(k3_model::select::top_k_of_rows_masked(
                self.to_host(a)?,
                a.rows,
                k,
                masks,
            ));
        }
        self.op(|| CudaBackend::top_k_rows(self, a, k, masks))
    }

    fn slice_rows(&self, a: &DeviceMat, start: usize, end: usize) -> OpResult<DeviceMat> {
        self.timed(
            || "slice_rows".into(),
            || self.op(|| self.rows_of(a, start, end)),
        )
    }

    fn concat_rows(&self, parts: &[&DeviceMat]) -> OpResult<DeviceMat> {
        self.timed(|| "concat_rows".into(), || self.op(|| self.concat(parts)))
    }

    fn embed(&self, table: &DeviceLinear, ids: &[u32]) -> OpResult<DeviceMat> {
        self.timed(
            || "embed".into(),
            || self.op(|| self.embed_rows(table, ids)),
        )
    }

    fn matmul(&self, x: &DeviceMat, w: &DeviceLinear) -> OpResult<DeviceMat> {
        self.timed(
            || {
                let ty = if w.bf16.is_some() { "bf16" } else { "f32" };
                format!("matmul {}x{} {ty} (M={})", w.rows, w.cols, bucket(x.rows))
            },
            || self.op(|| self.matmul_linear(x, w)),
        )
    }

    fn matmuls(&self, x: &DeviceMat, ws: &[&DeviceLinear]) -> OpResult<Vec<DeviceMat>> {
        self.timed(
            || format!("matmuls x{} (M={})", ws.len(), bucket(x.rows)),
            || self.op(|| self.matmul_linears(x, ws)),
        )
    }

    fn rms_norm(&self, x: &DeviceMat, w: &CudaSlice<f32>, eps: f32) -> OpResult<DeviceMat> {
        self.timed(
            || "rms_norm".into(),
            || self.op(|| CudaBackend::rms_norm(self, x, w, eps)),
        )
    }

    fn add_assign(&self, p: &mut DeviceMat, a: &DeviceMat) -> OpResult<()> {
        self.timed(
            || "add_assign".into(),
            || self.op(|| CudaBackend::add_assign(self, p, a)),
        )
    }

    fn upload_act(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<DeviceMat> {
        self.op(|| CudaBackend::upload_act(self, rows, cols, &data))
    }

    fn add_bias(&self, x: &mut DeviceMat, b: &CudaSlice<f32>) -> OpResult<()> {
        self.timed(
            || "add_bias".into(),
            || self.op(|| CudaBackend::add_bias(self, x, b)),
        )
    }

    fn gelu_tanh(&self, x: &mut DeviceMat) -> OpResult<()> {
        self.timed(
            || "gelu_tanh".into(),
            || self.op(|| CudaBackend::gelu_tanh(self, x)),
        )
    }

    fn vision_attention(&self, qkv: &DeviceMat, geom: VisionAttnGeom) -> OpResult<DeviceMat> {
        self.timed(
            || format!("vision_attention (N={})", bucket(qkv.rows)),
            || self.op(|| CudaBackend::vision_attention(self, qkv, geom)),
        )
    }

    fn merge_patches(
        &self,
        x: &DeviceMat,
        grid_h: usize,
        grid_w: usize,
        merge: usize,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || "merge_patches".into(),
            || self.op(|| CudaBackend::merge_patches(self, x, grid_h, grid_w, merge)),
        )
    }

    fn attn_res(
        &self,
        sources: &[&DeviceMat],
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || format!("attn_res ({} sources)", sources.len()),
            || self.op(|| CudaBackend::attn_res(self, sources, w, eps)),
        )
    }

    fn attn_res_norm(
        &self,
        sources: &[&DeviceMat],
        last: &mut DeviceMat,
        add: Option<&DeviceMat>,
        w: &CudaSlice<f32>,
        norm: &CudaSlice<f32>,
        eps: f32,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || format!("attn_res_norm ({} sources)", sources.len() + 1),
            || self.op(|| CudaBackend::attn_res_norm(self, sources, last, add, w, norm, eps)),
        )
    }

    fn situ_glu(&self, gate: &DeviceMat, up: &DeviceMat, p: SituParams) -> OpResult<DeviceMat> {
        self.timed(
            || "situ_glu".into(),
            || self.op(|| CudaBackend::situ_glu(self, gate, up, p)),
        )
    }

    fn sigmoid_mul(&self, o: &mut DeviceMat, gate: &DeviceMat) -> OpResult<()> {
        self.timed(
            || "sigmoid_mul".into(),
            || self.op(|| CudaBackend::sigmoid_mul(self, o, gate)),
        )
    }

    fn gated_head_norm(
        &self,
        o: &DeviceMat,
        gate: &DeviceMat,
        w: &CudaSlice<f32>,
        head_dim: usize,
        eps: f32,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || "gated_head_norm".into(),
            || self.op(|| CudaBackend::gated_head_norm(self, o, gate, w, head_dim, eps)),
        )
    }

    fn kda(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: KdaGeom,
        params: &KdaParams<'_, Self>,
        inputs: &KdaInputs<'_, Self>,
        loc: KdaStateLoc<'_>,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || {
                let verify = if loc.record.is_some() { " verify" } else { "" };
                format!("kda{verify} (T={})", bucket(inputs.qkv[0].rows))
            },
            || self.op(|| self.kda_seq(arena, geom, params, inputs, loc)),
        )
    }

    fn mla(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        loc: MlaCacheLoc<'_>,
    ) -> OpResult<DeviceMat> {
        let spans = [(0, q.rows)];
        self.timed(
            || format!("mla (T={})", bucket(q.rows)),
            || self.op(|| self.mla_spans(arena, geom, q, kv_a, kv_norm, kv_b, &spans, &[loc])),
        )
    }

    fn moe_routed(
        &self,
        z: &DeviceMat,
        router_logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        experts: &DeviceExperts,
        router: RouterParams,
        situ: SituParams,
    ) -> OpResult<DeviceMat> {
        self.timed(
            || format!("moe_routed (T={})", bucket(z.rows)),
            || {
                self.op(|| {
                    CudaBackend::moe_routed(self, z, router_logits, bias, experts, router, situ)
                })
            },
        )
    }

    /// In bfloat16 mode the shared GLU's products on a side stream while the routed experts run
    /// (moe/shared.rs); otherwise one after the other.
    #[allow(clippy::too_many_arguments)]
    fn moe_routed_and_shared(
        &self,
        z: &DeviceMat,
        router_logits: &DeviceMat,
        bias: &CudaSlice<f32>,
        experts: &DeviceExperts,
        router: RouterParams,
        spans: &[(usize, usize)],
        x: &DeviceMat,
        shared: &Glu<'_, Self>,
    ) -> OpResult<(DeviceMat, DeviceMat)> {
        let side = if self.shared_glu_beside_routed(x, shared) {
            Some(self.op(|| self.glu_on_side(x, shared))?)
        } else {
            None
        };
        let routed =
            self.moe_routed_batch(z, router_logits, bias, experts, router, shared.situ, spans);
        let shared = match side {
            Some(side) => self.op(|| self.join_side_glu(side)),
            None => k3_model::backend::glu(self, x, shared),
        };
        Ok((routed?, shared?))
    }

    /// Every sequence decoding one token (at most one checkpoint, after it): one launch of the
    /// batched decode kernel over the sequences' state slots. Any verifying sequence: one verify
    /// launch for the verifying and one-token sequences, a chunked prefill per other sequence
    /// (kda/replay.rs). Anything else: per sequence.
    fn kda_batch(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: KdaGeom,
        params: &KdaParams<'_, Self>,
        inputs: &KdaInputs<'_, Self>,
        spans: &[(usize, usize)],
        locs: &[KdaStateLoc<'_>],
    ) -> OpResult<DeviceMat> {
        if locs.iter().any(|l| l.record.is_some()) {
            return self.timed(
                || {
                    format!(
                        "kda_batch verify (T={}, seqs={})",
                        bucket(inputs.qkv[0].rows),
                        bucket(spans.len())
                    )
                },
                || self.op(|| self.kda_replay_batch(arena, geom, params, inputs, spans, locs)),
            );
        }
        match decode_slots(spans, locs) {
            Some(slots) if spans.len() > 1 => {
                let (w, x) = kda_parts(params, inputs);
                self.timed(
                    || format!("kda_batch decode (N={})", bucket(slots.len())),
                    || self.op(|| self.kda_decode(arena, geom, &w, &x, &slots)),
                )
            }
            _ => {
                k3_model::backend::kda_per_sequence(self, arena, geom, params, inputs, spans, locs)
            }
        }
    }

    fn supports_kda_verify(&self) -> bool {
        true
    }

    /// ReplaySSM commit: one replay launch for every commit of the layer (kda/replay.rs).
    fn kda_commit(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: KdaGeom,
        commits: &[KdaCommit],
    ) -> OpResult<()> {
        self.timed(
            || format!("kda_commit (seqs={})", bucket(commits.len())),
            || self.op(|| self.kda_commit_blocks(arena, geom, commits)),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn mla_batch(
        &self,
        arena: &mut CudaSlice<f32>,
        geom: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        spans: &[(usize, usize)],
        locs: &[MlaCacheLoc<'_>],
    ) -> OpResult<DeviceMat> {
        self.timed(
            || {
                format!(
                    "mla_batch (T={}, seqs={})",
                    bucket(q.rows),
                    bucket(spans.len())
                )
            },
            || self.op(|| self.mla_spans(arena, geom, q, kv_a, kv_norm, kv_b, spans, locs)),
        )
    }

    fn run_step(
        &self,
        replayable: bool,
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, ExecError>,
    ) -> std::result::Result<Option<DeviceMat>, ExecError> {
        self.run_graph_step(replayable, pass)
    }

    fn prepare_step(
        &self,
        pass: &mut dyn FnMut() -> std::result::Result<Option<DeviceMat>, ExecError>,
    ) -> bool {
        self.prepare_graph_step(pass)
    }

    fn launch_prepared(
        &self,
        ids: &[u32],
    ) -> std::result::Result<Option<Option<DeviceMat>>, ExecError> {
        match self.launch_prepared_step(ids) {
            Ok(Some(out)) => Ok(Some(out.map_err(k3_model::BackendError::from)?)),
            Ok(None) => Ok(None),
            Err(e) => {
                // Nothing was queued: the caller runs the step the usual way.
                tracing::warn!("launch of a prepared step failed ({e}); running it afresh");
                Ok(None)
            }
        }
    }

    fn step_graph_counts(&self) -> Option<k3_model::backend::GraphCounts> {
        Some(self.graph_counts())
    }
}
