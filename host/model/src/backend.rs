//! The narrow set of operations the K3 layer graph needs from a compute backend.
//!
//! Activations are row-major f32 matrices `[tokens, width]` owned by the backend (`Act`).
//! The heavy, stateful mixers (KDA, MLA) are single fused ops because their cache layout and
//! loop structure are backend concerns; everything else is a small elementwise/linear op.

use crate::error::ExecError;
pub use crate::error::{BackendError, OpResult};

/// Geometry and parameters of the KDA op (one layer).
#[derive(Debug, Clone, Copy)]
pub struct KdaGeom {
    pub heads: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
    pub gate_lower_bound: f32,
}

impl KdaGeom {
    pub fn hk(&self) -> usize {
        self.heads * self.head_dim
    }
    /// f32 values in one layer's state: conv windows q, k, v `[hk, W-1]` then `S [H, K, V]`.
    pub fn state_floats(&self) -> usize {
        3 * self.hk() * (self.conv_kernel - 1) + self.heads * self.head_dim * self.head_dim
    }
    /// f32 values one verified token adds to a layer's ReplaySSM record
    /// (docs/speculative-decoding.md): per head k̂ (K), v (V = K), g (K) and β, plus the three
    /// pre-conv projection rows (`H·K` each) that roll the conv windows.
    pub fn record_floats_per_token(&self) -> usize {
        self.heads * (3 * self.head_dim + 1) + 3 * self.hk()
    }
}

/// Where one KDA layer keeps its state for one sequence (byte offsets into the arena).
#[derive(Debug, Clone, Copy)]
pub struct KdaStateLoc<'a> {
    /// This layer's region in the working state block (read as the initial state, overwritten).
    pub offset: usize,
    /// `(n, dst)`: after the first `n` new tokens also write this layer's state to `dst`
    /// (already offset to this layer's region inside the destination block).
    pub checkpoints: &'a [(usize, usize)],
    /// `Some(dst)`: a speculative verify. The state at `offset` is read and never written (nor
    /// checkpointed); instead the layer's ReplaySSM record for the `T` new tokens is written at
    /// byte offset `dst` (`T ·` [`KdaGeom::record_floats_per_token`] f32 values, laid out as
    /// the backend chooses), for a later [`Backend::kda_commit`].
    pub record: Option<usize>,
}

/// Commit an accepted prefix of one verified block of one KDA layer (ReplaySSM): replay the
/// first `accepted` of its `tokens` recorded steps into the state at `state` in place and roll
/// the conv windows back to end at the last accepted token. The state must be unchanged since the
/// verify that wrote the record at `record`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KdaCommit {
    pub state: usize,
    pub record: usize,
    pub tokens: usize,
    pub accepted: usize,
}

/// Per-layer KDA parameters (besides the projections, which the graph applies).
pub struct KdaParams<'a, B: Backend + ?Sized> {
    /// Depthwise conv weights `[hk, W]` each, for q, k, v.
    pub conv: [&'a B::Vector; 3],
    pub a_log: &'a B::Vector,
    pub dt_bias: &'a B::Vector,
}

/// Pre-conv projections and gate inputs of a KDA layer for the new tokens.
pub struct KdaInputs<'a, B: Backend + ?Sized> {
    /// `x Wqᵀ, x Wkᵀ, x Wvᵀ` before the short convolution, `[T, hk]` each.
    pub qkv: [&'a B::Act; 3],
    /// Forget-gate logits `(x W_faᵀ) W_fbᵀ`, `[T, hk]`.
    pub f: &'a B::Act,
    /// β logits `x W_bᵀ`, `[T, H]`.
    pub b: &'a B::Act,
}

#[derive(Debug, Clone, Copy)]
pub struct MlaGeom {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub kv_lora: usize,
    pub eps: f32,
}

impl MlaGeom {
    pub fn row(&self) -> usize {
        self.kv_lora + self.rope
    }
}

/// Where one MLA layer's latent rows live for one sequence.
#[derive(Debug, Clone, Copy)]
pub struct MlaCacheLoc<'a> {
    /// Page byte offsets covering positions `0 .. start_pos + T`.
    pub pages: &'a [usize],
    pub page_tokens: usize,
    /// Byte offset of this layer's rows inside each page.
    pub layer_offset: usize,
    /// Position of the first new token.
    pub start_pos: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct SituParams {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

#[derive(Debug, Clone, Copy)]
pub struct RouterParams {
    pub top_k: usize,
    pub renormalize: bool,
    pub scaling: f32,
}

/// Routed experts of one layer as stored: MXFP4 codes and E8M0 scales (see docs/model-format.md).
#[derive(Debug, Clone)]
pub struct MxExpertsHost {
    pub num_experts: usize,
    /// Latent width `Lt` (w1/w3 input, w2 output).
    pub latent: usize,
    /// Expert intermediate width `Ie`.
    pub inter: usize,
    /// Per expert: `w1`, `w3` packed `[Ie, Lt/2]` + scales `[Ie, Lt/32]`; `w2` packed `[Lt, Ie/2]` + scales `[Lt, Ie/32]`.
    pub w1: Vec<MxMatrixHost>,
    pub w3: Vec<MxMatrixHost>,
    pub w2: Vec<MxMatrixHost>,
}

#[derive(Debug, Clone)]
pub struct MxMatrixHost {
    pub rows: usize,
    pub cols: usize,
    pub packed: Vec<u8>,
    pub scales: Vec<u8>,
}

/// The vision tower's attention over one image's patches (docs/vision.md): non-causal
/// multi-head softmax attention with 2-D RoPE. The patches are the rows of the input in
/// row-major order over a `grid_h × grid_w` grid.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VisionAttnGeom {
    pub heads: usize,
    /// A multiple of 4: each half of a head rotates (in rotate-half pairs) with one grid axis.
    pub head_dim: usize,
    pub grid_h: usize,
    pub grid_w: usize,
    pub rope_theta: f32,
}

impl VisionAttnGeom {
    /// The checks every backend applies to `qkv` `[rows, cols]` before attending.
    pub fn check(&self, rows: usize, cols: usize) -> OpResult<()> {
        let width = self.heads * self.head_dim;
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(4) {
            return Err(BackendError::InvalidArg(format!(
                "vision attention: head_dim {} is not a positive multiple of 4",
                self.head_dim
            )));
        }
        if rows != self.grid_h * self.grid_w || cols != 3 * width || rows == 0 {
            return Err(BackendError::InvalidArg(format!(
                "vision attention: qkv {rows}x{cols} for a {}x{} grid of {} heads x {}",
                self.grid_h, self.grid_w, self.heads, self.head_dim
            )));
        }
        Ok(())
    }
}

/// Checks of [`Backend::merge_patches`]'s arguments; returns the merged `(rows, cols)`.
pub fn merge_patches_shape(
    rows: usize,
    cols: usize,
    grid_h: usize,
    grid_w: usize,
    merge: usize,
) -> OpResult<(usize, usize)> {
    if merge == 0
        || rows != grid_h * grid_w
        || !grid_h.is_multiple_of(merge)
        || !grid_w.is_multiple_of(merge)
    {
        return Err(BackendError::InvalidArg(format!(
            "merge_patches: {rows} rows as a {grid_h}x{grid_w} grid in {merge}x{merge} blocks"
        )));
    }
    Ok((rows / (merge * merge), cols * merge * merge))
}

/// Decode steps by how a backend that records steps ran them (CUDA graphs: backend-cuda's
/// graph.rs), and the host time the graph machinery took: the dry pass that checks a step
/// against its recorded graph and the graph launch. Both are host work ahead of the GPU's, so
/// a step's wall time is at least their sum (`k3serve bench` prints them per step).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphCounts {
    pub replayed: u64,
    pub captured: u64,
    pub eager: u64,
    pub aborted: u64,
    /// Dry passes run (one per replayable step, whatever came of it), their host time and the
    /// device buffers their ops asked for (backend-cuda's buf.rs: aliases of one target, but for
    /// the step's uploads).
    pub dry_passes: u64,
    pub dry_pass_ns: u64,
    pub dry_allocs: u64,
    /// Host time of the replays (staging upload and graph launch; not the GPU's time).
    pub launch_ns: u64,
    /// Dry passes run ahead for the step expected next ([`Backend::prepare_step`]) and their
    /// host time, spent while the device ran the step before (not counted in `dry_passes`).
    pub prepared: u64,
    pub prepared_ns: u64,
    /// Replays launched from a prepared pass (also in `replayed`): steps with no dry pass of
    /// their own.
    pub prepared_replays: u64,
    /// Nodes of the graphs captured, by kind, summed over the captures (÷ `captured`: per graph).
    /// Every node is a step on the GPU's critical path, work or not.
    pub captured_kernels: u64,
    pub captured_memsets: u64,
    pub captured_copies: u64,
    /// Graph allocation and free nodes (activations allocated inside the capture).
    pub captured_mem_nodes: u64,
    pub captured_other_nodes: u64,
}

impl GraphCounts {
    /// Field by field `f(self, other)`.
    fn zip(self, o: GraphCounts, f: impl Fn(u64, u64) -> u64) -> GraphCounts {
        GraphCounts {
            replayed: f(self.replayed, o.replayed),
            captured: f(self.captured, o.captured),
            eager: f(self.eager, o.eager),
            aborted: f(self.aborted, o.aborted),
            dry_passes: f(self.dry_passes, o.dry_passes),
            dry_pass_ns: f(self.dry_pass_ns, o.dry_pass_ns),
            dry_allocs: f(self.dry_allocs, o.dry_allocs),
            launch_ns: f(self.launch_ns, o.launch_ns),
            prepared: f(self.prepared, o.prepared),
            prepared_ns: f(self.prepared_ns, o.prepared_ns),
            prepared_replays: f(self.prepared_replays, o.prepared_replays),
            captured_kernels: f(self.captured_kernels, o.captured_kernels),
            captured_memsets: f(self.captured_memsets, o.captured_memsets),
            captured_copies: f(self.captured_copies, o.captured_copies),
            captured_mem_nodes: f(self.captured_mem_nodes, o.captured_mem_nodes),
            captured_other_nodes: f(self.captured_other_nodes, o.captured_other_nodes),
        }
    }
}

/// Counts over two stretches of steps.
impl std::ops::Add for GraphCounts {
    type Output = GraphCounts;
    fn add(self, o: GraphCounts) -> GraphCounts {
        self.zip(o, u64::saturating_add)
    }
}

/// The counts since `o` was read (both from the same backend).
impl std::ops::Sub for GraphCounts {
    type Output = GraphCounts;
    fn sub(self, o: GraphCounts) -> GraphCounts {
        self.zip(o, u64::saturating_sub)
    }
}

pub trait Backend: Send + Sync + 'static {
    /// A row-major f32 activation matrix.
    type Act: Send;
    /// A dense weight `[out, in]`, applied as `y = x Wᵀ`.
    type Linear: Send + Sync;
    /// An f32 vector parameter.
    type Vector: Send + Sync;
    /// One layer's routed experts.
    type Experts: Send + Sync;
    /// The cache arena (KDA state blocks + MLA KV pages).
    type Arena: Send;

    // ---- uploads ----
    /// `data` is `[rows, cols]` row-major f32.
    fn linear(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<Self::Linear>;
    fn vector(&self, data: Vec<f32>) -> OpResult<Self::Vector>;
    fn experts(&self, host: MxExpertsHost) -> OpResult<Self::Experts>;
    fn arena(&self, bytes: usize) -> OpResult<Self::Arena>;

    // ---- arena ----
    fn arena_len(&self, arena: &Self::Arena) -> usize;
    fn arena_copy(
        &self,
        arena: &mut Self::Arena,
        src: usize,
        dst: usize,
        len: usize,
    ) -> OpResult<()>;
    fn arena_zero(&self, arena: &mut Self::Arena, offset: usize, len: usize) -> OpResult<()>;
    fn arena_read(&self, arena: &Self::Arena, offset: usize, len: usize) -> OpResult<Vec<u8>>;

    // ---- activations ----
    fn to_host(&self, a: &Self::Act) -> OpResult<Vec<f32>>;
    fn rows(&self, a: &Self::Act) -> usize;
    /// Each row's `k` largest finite entries, exactly as [`crate::select::top_k_of_row`] orders
    /// them. The default copies the rows to the host; a device backend selects on the device.
    fn top_k_rows(&self, a: &Self::Act, k: usize) -> OpResult<Vec<Vec<(u32, f32)>>> {
        Ok(crate::select::top_k_of_rows(
            &self.to_host(a)?,
            self.rows(a),
            k,
        ))
    }
    /// [`Backend::top_k_rows`] after removing, per row, the tokens its mask forbids (constrained
    /// decoding). `masks` has one entry per row of `a`: `None` leaves the row as it is, `Some(m)`
    /// is a token bitmask as [`crate::select::apply_token_mask`] reads it. A row whose mask allows no
    /// finite logit gets no candidates. The default works on the host; a device backend uploads
    /// the masks and applies them before its selection.
    fn top_k_rows_masked(
        &self,
        a: &Self::Act,
        k: usize,
        masks: &[Option<&[u32]>],
    ) -> OpResult<Vec<Vec<(u32, f32)>>> {
        Ok(crate::select::top_k_of_rows_masked(
            self.to_host(a)?,
            self.rows(a),
            k,
            masks,
        ))
    }
    /// Rows `[start, end)` of `a` as a new activation.
    fn slice_rows(&self, a: &Self::Act, start: usize, end: usize) -> OpResult<Self::Act>;
    /// The rows of `parts` one after another (all of the same width; at least one part).
    fn concat_rows(&self, parts: &[&Self::Act]) -> OpResult<Self::Act>;
    /// Rows of `table` selected by `ids`.
    fn embed(&self, table: &Self::Linear, ids: &[u32]) -> OpResult<Self::Act>;
    fn matmul(&self, x: &Self::Act, w: &Self::Linear) -> OpResult<Self::Act>;
    /// `matmul(x, w)` for several weights sharing one input, in order. A backend that converts `x`
    /// before a product (CUDA: x as bf16 rows for cuBLAS) converts it once for all of them, and
    /// may run the products at once (CUDA: one stream each).
    fn matmuls(&self, x: &Self::Act, ws: &[&Self::Linear]) -> OpResult<Vec<Self::Act>> {
        ws.iter().map(|w| self.matmul(x, w)).collect()
    }
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32) -> OpResult<Self::Act>;
    fn add_assign(&self, p: &mut Self::Act, a: &Self::Act) -> OpResult<()>;

    // ---- vision tower (docs/vision.md) ----
    /// `data` (`[rows, cols]` row-major) as an activation: an image's patches.
    fn upload_act(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<Self::Act>;
    /// `x[r, :] += b` for every row (a Linear's bias).
    fn add_bias(&self, x: &mut Self::Act, b: &Self::Vector) -> OpResult<()>;
    /// GELU, tanh approximation, elementwise in place.
    fn gelu_tanh(&self, x: &mut Self::Act) -> OpResult<()>;
    /// `qkv` `[n, 3·H·hd]` (q, k, v each `H` heads of `hd`) → `o` `[n, H·hd]`: q and k rotated
    /// by 2-D RoPE (first half of each head by the patch's grid row, second half by its column,
    /// rotate-half pairs, frequencies `θ^(−i/(hd/4))`), then `softmax(q·kᵀ/√hd) v` over all
    /// `n` patches (non-causal).
    fn vision_attention(&self, qkv: &Self::Act, geom: VisionAttnGeom) -> OpResult<Self::Act>;
    /// Patch rows of a `grid_h × grid_w` grid → one row per `merge × merge` block (blocks in
    /// row-major order), each the concatenation of its patches' rows in row-major order.
    fn merge_patches(
        &self,
        x: &Self::Act,
        grid_h: usize,
        grid_w: usize,
        merge: usize,
    ) -> OpResult<Self::Act>;
    /// Block AttnRes: softmax over sources of `Σ_d V_i[d]·rsqrt(mean(V_i²)+eps)·w[d]`, then `Σ α_i V_i`.
    /// `w` is the product of the op's norm and proj weights.
    fn attn_res(&self, sources: &[&Self::Act], w: &Self::Vector, eps: f32) -> OpResult<Self::Act>;
    /// What opens each sublayer: `last += add` (when given: the residual stream's update), then
    /// `rms_norm(attn_res(sources ++ [last], w), norm)`. One pass where a backend fuses it (three
    /// ops each reading the rows otherwise); the default composes the ops above.
    fn attn_res_norm(
        &self,
        sources: &[&Self::Act],
        last: &mut Self::Act,
        add: Option<&Self::Act>,
        w: &Self::Vector,
        norm: &Self::Vector,
        eps: f32,
    ) -> OpResult<Self::Act> {
        if let Some(a) = add {
            self.add_assign(last, a)?;
        }
        let mut src = sources.to_vec();
        src.push(&*last);
        let h = self.attn_res(&src, w, eps)?;
        self.rms_norm(&h, norm, eps)
    }
    /// SiTU-GLU of `gate` and `up` (same shape).
    fn situ_glu(&self, gate: &Self::Act, up: &Self::Act, p: SituParams) -> OpResult<Self::Act>;
    /// `o *= σ(gate)` elementwise.
    fn sigmoid_mul(&self, o: &mut Self::Act, gate: &Self::Act) -> OpResult<()>;
    /// Per head of width `head_dim`: `RMSNorm(o_h)·w ⊙ σ(gate_h)`.
    fn gated_head_norm(
        &self,
        o: &Self::Act,
        gate: &Self::Act,
        w: &Self::Vector,
        head_dim: usize,
        eps: f32,
    ) -> OpResult<Self::Act>;

    /// Kimi Delta Attention over the new tokens of one sequence: short conv (+ window update),
    /// gates, L2 norms, chunked (prefill) or recurrent (decode) delta rule from the stored state.
    /// Returns `o` `[T, H·V]` before the output norm. Writes the final state and checkpoints.
    fn kda(
        &self,
        arena: &mut Self::Arena,
        geom: KdaGeom,
        params: &KdaParams<'_, Self>,
        inputs: &KdaInputs<'_, Self>,
        loc: KdaStateLoc<'_>,
    ) -> OpResult<Self::Act>;

    /// Whether the model should hand this backend a verify's rows one token at a time for MLA:
    /// a backend whose one-token attention rounds differently from its multi-token one (the
    /// CPU's absorbed form) then gives verify rows exactly the values decoding gives.
    fn verify_rows_as_decode(&self) -> bool {
        false
    }

    /// The most tokens one verify may have on this backend (`None`: no limit of its own). The
    /// CPU keeps a verify below the token count at which an expert switches to its prefill
    /// kernel, so verify rows keep decoding's expert arithmetic.
    fn max_verify_tokens(&self) -> Option<usize> {
        None
    }

    /// Whether [`KdaStateLoc::record`] and [`Backend::kda_commit`] are implemented (speculative
    /// decoding needs them).
    fn supports_kda_verify(&self) -> bool {
        false
    }

    /// Replay accepted prefixes of verified blocks into their states (see [`KdaCommit`]); the
    /// commits touch distinct states. After it, each state and its conv windows equal those of
    /// decoding the accepted tokens one at a time (bit for bit on the CPU; within the kernels'
    /// tolerance elsewhere).
    fn kda_commit(
        &self,
        arena: &mut Self::Arena,
        geom: KdaGeom,
        commits: &[KdaCommit],
    ) -> OpResult<()> {
        let _ = (arena, geom, commits);
        Err(BackendError::Unsupported(
            "speculative verification (KDA commit) on this backend".into(),
        ))
    }

    /// Gated-NoPE MLA attention of the new tokens of one sequence over its paged latent cache.
    /// `q` is `[T, H·(nope+rope)]`; `kv_a` is `[T, kv_lora + rope]` (`c_kv` before its norm, then `k_r`).
    /// Appends the normalised latent rows to the cache, returns `o` `[T, H·v_dim]` (before the gate).
    fn mla(
        &self,
        arena: &mut Self::Arena,
        geom: MlaGeom,
        q: &Self::Act,
        kv_a: &Self::Act,
        kv_norm: &Self::Vector,
        kv_b: &Self::Linear,
        loc: MlaCacheLoc<'_>,
    ) -> OpResult<Self::Act>;

    /// Routed part of LatentMoE: sigmoid router with selection bias, top-k, weighted sum of
    /// SiTU-GLU MXFP4 experts applied to the latent `z`. Returns `y_lat` `[T, Lt]`.
    fn moe_routed(
        &self,
        z: &Self::Act,
        router_logits: &Self::Act,
        bias: &Self::Vector,
        experts: &Self::Experts,
        router: RouterParams,
        situ: SituParams,
    ) -> OpResult<Self::Act>;

    /// Runs `pass`, one engine step's forward pass. `replayable` marks a decode step (one new
    /// token per sequence): its work recurs step after step with only small inputs changing,
    /// so a backend may record it once and replay it (the CUDA backend's graphs). The default
    /// just runs `pass`.
    #[allow(clippy::type_complexity)]
    fn run_step(
        &self,
        replayable: bool,
        pass: &mut dyn FnMut() -> Result<Option<Self::Act>, ExecError>,
    ) -> Result<Option<Self::Act>, ExecError> {
        let _ = replayable;
        pass()
    }

    /// While the replayable step just handed to [`Backend::run_step`] runs on the device, do the
    /// host work of the step expected next: `pass` is its forward with placeholder token ids
    /// (the same sequences one position on). If that step comes with only its ids differing,
    /// [`Backend::launch_prepared`] launches it without that work. Returns whether something
    /// was kept; the default keeps nothing (and does not run `pass`).
    #[allow(clippy::type_complexity)]
    fn prepare_step(&self, pass: &mut dyn FnMut() -> Result<Option<Self::Act>, ExecError>) -> bool {
        let _ = pass;
        false
    }

    /// Launch the step [`Backend::prepare_step`] prepared, with `ids` (one per row, in order)
    /// in place of its placeholders. The caller vouches that the step is the prepared one but
    /// for its ids. `Ok(None)`: nothing was launched (none prepared, or it no longer fits); run
    /// the step with [`Backend::run_step`].
    fn launch_prepared(&self, ids: &[u32]) -> Result<Option<Option<Self::Act>>, ExecError> {
        let _ = ids;
        Ok(None)
    }

    /// How [`Backend::run_step`] has run the replayable steps so far; `None` from a backend
    /// that does not record them.
    fn step_graph_counts(&self) -> Option<GraphCounts> {
        None
    }

    /// [`Backend::moe_routed`] over the stacked rows of several sequences (`spans`: each
    /// sequence's rows, in order). The default routes them all together, so an expert's weights
    /// are read once per step. A backend whose expert kernels choose their algorithm (and so
    /// their reduction order) by the number of tokens per expert overrides this to keep every
    /// sequence's results independent of the rest of the batch.
    #[allow(clippy::too_many_arguments)]
    fn moe_routed_batch(
        &self,
        z: &Self::Act,
        router_logits: &Self::Act,
        bias: &Self::Vector,
        experts: &Self::Experts,
        router: RouterParams,
        situ: SituParams,
        spans: &[(usize, usize)],
    ) -> OpResult<Self::Act> {
        let _ = spans;
        self.moe_routed(z, router_logits, bias, experts, router, situ)
    }

    /// The MoE block's two halves, which do not depend on each other: the routed experts' latent
    /// output ([`Backend::moe_routed_batch`] of `z`) and the shared experts' GLU of `x`
    /// ([`glu`]). A backend may run them at once (CUDA: the GLU's products on a side stream
    /// while the routed experts run); the default runs one, then the other.
    #[allow(clippy::too_many_arguments)]
    fn moe_routed_and_shared(
        &self,
        z: &Self::Act,
        router_logits: &Self::Act,
        bias: &Self::Vector,
        experts: &Self::Experts,
        router: RouterParams,
        spans: &[(usize, usize)],
        x: &Self::Act,
        shared: &Glu<'_, Self>,
    ) -> OpResult<(Self::Act, Self::Act)> {
        let routed =
            self.moe_routed_batch(z, router_logits, bias, experts, router, shared.situ, spans)?;
        Ok((routed, glu(self, x, shared)?))
    }

    /// [`Backend::kda`] for several sequences' stacked rows: `spans[i]` are sequence i's rows of
    /// every input, `locs[i]` its state. Returns the stacked `o`. The default runs one `kda` per
    /// sequence; a backend with a batched decode kernel overrides it.
    fn kda_batch(
        &self,
        arena: &mut Self::Arena,
        geom: KdaGeom,
        params: &KdaParams<'_, Self>,
        inputs: &KdaInputs<'_, Self>,
        spans: &[(usize, usize)],
        locs: &[KdaStateLoc<'_>],
    ) -> OpResult<Self::Act> {
        kda_per_sequence(self, arena, geom, params, inputs, spans, locs)
    }

    /// [`Backend::mla`] for several sequences' stacked rows (`spans[i]`, cache `locs[i]`).
    /// The default runs one `mla` per sequence.
    #[allow(clippy::too_many_arguments)]
    fn mla_batch(
        &self,
        arena: &mut Self::Arena,
        geom: MlaGeom,
        q: &Self::Act,
        kv_a: &Self::Act,
        kv_norm: &Self::Vector,
        kv_b: &Self::Linear,
        spans: &[(usize, usize)],
        locs: &[MlaCacheLoc<'_>],
    ) -> OpResult<Self::Act> {
        per_sequence(self, [q, kv_a], spans, |i, [q, kv_a]| {
            self.mla(arena, geom, q, kv_a, kv_norm, kv_b, locs[i])
        })
    }
}

/// `f(i, rows)` for each sequence `i` with its rows of every act in `acts` (the acts themselves
/// when there is one sequence), the results stacked in order.
pub fn per_sequence<B: Backend + ?Sized, const N: usize>(
    be: &B,
    acts: [&B::Act; N],
    spans: &[(usize, usize)],
    mut f: impl FnMut(usize, [&B::Act; N]) -> OpResult<B::Act>,
) -> OpResult<B::Act> {
    if spans.len() == 1 {
        return f(0, acts);
    }
    let mut outs = Vec::with_capacity(spans.len());
    for (i, &(r0, r1)) in spans.iter().enumerate() {
        let rows = acts
            .iter()
            .map(|a| be.slice_rows(a, r0, r1))
            .collect::<OpResult<Vec<B::Act>>>()?;
        let refs: [&B::Act; N] = std::array::from_fn(|j| &rows[j]);
        outs.push(f(i, refs)?);
    }
    be.concat_rows(&outs.iter().collect::<Vec<_>>())
}

/// A SiTU-GLU's weights (a dense FFN, or an MoE block's shared experts): `down · SiTU(gate · x,
/// up · x)`.
pub struct Glu<'a, B: Backend + ?Sized> {
    pub gate: &'a B::Linear,
    pub up: &'a B::Linear,
    pub down: &'a B::Linear,
    pub situ: SituParams,
}

/// The GLU of `x`: its gate and up products (one [`Backend::matmuls`]), SiTU-GLU, then down.
pub fn glu<B: Backend + ?Sized>(be: &B, x: &B::Act, w: &Glu<'_, B>) -> OpResult<B::Act> {
    let products = be.matmuls(x, &[w.gate, w.up])?;
    let got = products.len();
    let [gate, up]: [B::Act; 2] = products.try_into().map_err(|_| {
        BackendError::InvalidArg(format!("matmuls returned {got} results for 2 weights"))
    })?;
    let h = be.situ_glu(&gate, &up, w.situ)?;
    be.matmul(&h, w.down)
}

/// The default [`Backend::kda_batch`]: one [`Backend::kda`] per sequence (also the fallback of
/// backends that batch only some cases).
pub fn kda_per_sequence<B: Backend + ?Sized>(
    be: &B,
    arena: &mut B::Arena,
    geom: KdaGeom,
    params: &KdaParams<'_, B>,
    inputs: &KdaInputs<'_, B>,
    spans: &[(usize, usize)],
    locs: &[KdaStateLoc<'_>],
) -> OpResult<B::Act> {
    let acts = [
        inputs.qkv[0],
        inputs.qkv[1],
        inputs.qkv[2],
        inputs.f,
        inputs.b,
    ];
    per_sequence(be, acts, spans, |i, [q, k, v, f, b]| {
        be.kda(
            arena,
            geom,
            params,
            &KdaInputs {
                qkv: [q, k, v],
                f,
                b,
            },
            locs[i],
        )
    })
}

#[cfg(test)]
mod tests {
    use super::GraphCounts;

    #[test]
    fn graph_counts_add_up_and_difference_field_by_field() {
        let a = GraphCounts {
            replayed: 5,
            captured: 1,
            eager: 2,
            aborted: 0,
            dry_passes: 8,
            dry_pass_ns: 800,
            dry_allocs: 40,
            launch_ns: 50,
            prepared: 4,
            prepared_ns: 400,
            prepared_replays: 3,
            captured_kernels: 300,
            captured_memsets: 20,
            captured_copies: 3,
            captured_mem_nodes: 600,
            captured_other_nodes: 1,
        };
        let b = GraphCounts {
            replayed: 7,
            dry_passes: 7,
            dry_pass_ns: 700,
            launch_ns: 70,
            prepared: 2,
            prepared_replays: 2,
            ..Default::default()
        };
        let sum = a + b;
        assert_eq!((sum.replayed, sum.captured, sum.eager), (12, 1, 2));
        assert_eq!(
            (sum.dry_passes, sum.dry_pass_ns, sum.launch_ns),
            (15, 1500, 120)
        );
        assert_eq!(sum.dry_allocs, 40);
        assert_eq!(
            (sum.prepared, sum.prepared_ns, sum.prepared_replays),
            (6, 400, 5)
        );
        assert_eq!(
            (
                sum.captured_kernels,
                sum.captured_memsets,
                sum.captured_copies,
                sum.captured_mem_nodes,
                sum.captured_other_nodes
            ),
            (300, 20, 3, 600, 1)
        );
        assert_eq!(sum - b, a);
        // A counter read out of order never wraps.
        assert_eq!((a - sum).replayed, 0);
    }
}
