//! K3 weights bound to a backend, and the layer graph (docs/k3-model.md) for one sequence.

use crate::backend::{
    Backend, KdaCommit, KdaGeom, KdaInputs, KdaParams, KdaStateLoc, MlaCacheLoc, MlaGeom,
    MxExpertsHost, MxMatrixHost, RouterParams, SituParams,
};
use crate::config::{Config, ConfigError, MixerKind};
use crate::error::{BackendError, ExecError, OpResult};
use crate::exec::{MediaInput, VerifiedBlock};
use crate::vision::{MEDIA_CACHE_IMAGES, MediaCache, VisionTower};
use crate::weights::{Tensors, WeightError, WeightFile};
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

struct AttnResW<B: Backend> {
    w: B::Vector,
}

struct KdaW<B: Backend> {
    q: B::Linear,
    k: B::Linear,
    v: B::Linear,
    g: B::Linear,
    conv: [B::Vector; 3],
    f_a: B::Linear,
    f_b: B::Linear,
    b: B::Linear,
    a_log: B::Vector,
    dt_bias: B::Vector,
    o_norm: B::Vector,
    o: B::Linear,
}

struct MlaW<B: Backend> {
    q_a: B::Linear,
    q_a_norm: B::Vector,
    q_b: B::Linear,
    kv_a: B::Linear,
    kv_a_norm: B::Vector,
    kv_b: B::Linear,
    g: B::Linear,
    o: B::Linear,
}

struct GluW<B: Backend> {
    gate: B::Linear,
    up: B::Linear,
    down: B::Linear,
}

struct MoeW<B: Backend> {
    router: B::Linear,
    bias: B::Vector,
    down: B::Linear,
    norm: Option<B::Vector>,
    up: B::Linear,
    experts: B::Experts,
    shared: GluW<B>,
}

enum Mixer<B: Backend> {
    Kda(KdaW<B>),
    Mla(MlaW<B>),
}

enum Ffn<B: Backend> {
    Dense(GluW<B>),
    Moe(MoeW<B>),
}

struct Layer<B: Backend> {
    input_norm: B::Vector,
    post_norm: B::Vector,
    attn_res: Option<AttnResW<B>>,
    mlp_res: AttnResW<B>,
    mixer: Mixer<B>,
    ffn: Ffn<B>,
}

/// The K3 model's weights on backend `B`.
pub struct Model<B: Backend> {
    pub config: Config,
    pub backend: B,
    embed: B::Linear,
    layers: Vec<Layer<B>>,
    final_res: AttnResW<B>,
    norm: B::Vector,
    lm_head: B::Linear,
    /// The vision tower, when the config has one (docs/vision.md).
    vision: Option<VisionTower<B>>,
    /// Tower outputs of recent images, by content hash.
    media_cache: MediaCache<B>,
}

/// Byte offsets of each layer's cache region: KDA layers inside a state block, MLA layers inside a page.
#[derive(Debug, Clone)]
pub struct CacheOffsets {
    /// Per layer: offset of its KDA state inside the block (KDA layers only).
    pub kda: Vec<Option<usize>>,
    /// Per layer: offset of its rows inside a KV page (MLA layers only).
    pub mla: Vec<Option<usize>>,
    pub state_block_bytes: usize,
    pub kv_page_bytes: usize,
    /// Per layer: offset of its ReplaySSM record inside a record block (KDA layers only). A
    /// record block is a state block lent to a verifying sequence; each KDA layer's share holds
    /// [`CacheOffsets::verify_tokens_max`] tokens.
    pub kda_record: Vec<Option<usize>>,
    /// The most tokens one verify pass may hold in a record block.
    pub verify_tokens_max: usize,
}

impl CacheOffsets {
    pub fn new(cfg: &Config, page_tokens: usize) -> Self {
        let (mut kda, mut mla) = (Vec::new(), Vec::new());
        let (mut sb, mut pb) = (0, 0);
        let kda_layers = cfg
            .layer_kinds
            .iter()
            .filter(|k| matches!(k, MixerKind::Kda))
            .count();
        let per_token = kda_geom(cfg).record_floats_per_token();
        let verify_tokens_max = (cfg.kda_layer_state_floats() * kda_layers)
            .checked_div(per_token * kda_layers)
            .unwrap_or(0);
        let mut kda_record = Vec::new();
        let mut rb = 0;
        for kind in &cfg.layer_kinds {
            match kind {
                MixerKind::Kda => {
                    kda.push(Some(sb));
                    kda_record.push(Some(rb));
                    mla.push(None);
                    sb += cfg.kda_layer_state_floats() * 4;
                    rb += verify_tokens_max * per_token * 4;
                }
                MixerKind::Mla => {
                    kda.push(None);
                    kda_record.push(None);
                    mla.push(Some(pb));
                    pb += page_tokens * cfg.mla_row_floats() * 4;
                }
            }
        }
        Self {
            kda,
            mla,
            state_block_bytes: sb,
            kv_page_bytes: pb,
            kda_record,
            verify_tokens_max,
        }
    }
}

fn kda_geom(c: &Config) -> KdaGeom {
    let k = &c.kda;
    KdaGeom {
        heads: k.num_heads,
        head_dim: k.head_dim,
        conv_kernel: k.conv_kernel,
        gate_lower_bound: k.gate_lower_bound,
    }
}

/// What [`Model::forward_batch_tapped`] returns: the wanted logits rows (if any) and one
/// activation per hidden-state tap.
pub type TappedPass<B> = (Option<<B as Backend>::Act>, Vec<<B as Backend>::Act>);

/// Rows of one sequence that the MLA op takes as one unit (see `Model::pieces`).
struct Piece {
    seq: usize,
    /// The first row's index among the sequence's new tokens.
    offset: usize,
    rows: (usize, usize),
}

/// One sequence's share of a batched forward pass.
pub struct SeqPass<'a> {
    /// Its new tokens.
    pub ids: &'a [u32],
    pub cache: SeqCache<'a>,
    /// First row (among its new tokens) whose logits are wanted; `None`: no logits.
    pub logits_from: Option<usize>,
    /// The sequence's images (absolute positions): its new rows inside an image's span take
    /// the vision tower's output rows instead of their token embeddings.
    pub media: &'a [MediaInput],
}

/// One sequence's view of the cache for a forward pass.
#[derive(Clone, Copy)]
pub struct SeqCache<'a> {
    pub start_pos: usize,
    pub kv_pages: &'a [usize],
    pub page_tokens: usize,
    pub state_block: usize,
    pub checkpoints: &'a [(usize, usize)],
    /// A speculative verify: the record block its KDA layers write instead of the state.
    pub record_block: Option<usize>,
}

fn attn_res_w<B: Backend>(
    be: &B,
    t: &Tensors<'_>,
    prefix: &str,
    d: usize,
) -> Result<AttnResW<B>, WeightError> {
    let norm = t.f32(&format!("{prefix}.norm.weight"), &[d])?;
    let proj = t.f32(&format!("{prefix}.proj.weight"), &[1, d])?;
    Ok(AttnResW {
        w: be.vector(norm.iter().zip(&proj).map(|(a, b)| a * b).collect())?,
    })
}

fn lin<B: Backend>(
    be: &B,
    t: &Tensors<'_>,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<B::Linear, WeightError> {
    // bf16 weights are widened to f32 once here (exact): k3-mini is small, so the CPU backend
    // keeps f32 panels for compute-bound prefill (no per-use conversion) and, since the values are
    // exactly bf16, also bf16 panels for memory-bound decode. Other backends choose behind the trait.
    Ok(be.linear(rows, cols, t.f32(name, &[rows, cols])?)?)
}

fn vecw<B: Backend>(
    be: &B,
    t: &Tensors<'_>,
    name: &str,
    shape: &[usize],
) -> Result<B::Vector, WeightError> {
    Ok(be.vector(t.f32(name, shape)?)?)
}

fn glu<B: Backend>(
    be: &B,
    t: &Tensors<'_>,
    p: &str,
    d: usize,
    i: usize,
) -> Result<GluW<B>, WeightError> {
    Ok(GluW {
        gate: lin(be, t, &format!("{p}.gate_proj.weight"), i, d)?,
        up: lin(be, t, &format!("{p}.up_proj.weight"), i, d)?,
        down: lin(be, t, &format!("{p}.down_proj.weight"), d, i)?,
    })
}

fn mx_matrix(
    t: &Tensors<'_>,
    p: &str,
    rows: usize,
    cols: usize,
) -> Result<MxMatrixHost, WeightError> {
    Ok(MxMatrixHost {
        rows,
        cols,
        packed: t.u8(&format!("{p}.weight_packed"), &[rows, cols / 2])?,
        scales: t.u8(&format!("{p}.weight_scale"), &[rows, cols / 32])?,
    })
}

impl<B: Backend> Model<B> {
    /// Load `config.json` and `model.safetensors` from a model directory.
    /// Load `config.json` and `model.safetensors` from a model directory, and the vision
    /// tower's file (`vision_config.weights`) when the config has one.
    pub fn load_dir(dir: &Path, backend: B) -> Result<Self, LoadError> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let vision = config.vision.as_ref().map(|v| dir.join(&v.weights));
        let file = WeightFile::open(&dir.join("model.safetensors"))?;
        let model = Self::from_tensors(config, &file.tensors(), backend)?;
        Ok(match vision {
            Some(path) => model.with_vision(&WeightFile::open(&path)?.tensors())?,
            None => model,
        })
    }

    /// `config.json` from a model directory with seeded random weights (no checkpoint needed):
    /// for benchmarking real K3 shapes, e.g. `models/k3-slice`.
    pub fn load_dir_dummy(dir: &Path, backend: B, seed: u64) -> Result<Self, LoadError> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let vision = config.vision.is_some();
        let model = Self::from_tensors(config, &Tensors::dummy(seed), backend)?;
        Ok(match vision {
            true => model.with_vision(&Tensors::dummy(seed))?,
            false => model,
        })
    }

    /// Load the vision tower of `config.vision` from `t` (the model then takes images).
    pub fn with_vision(mut self, t: &Tensors<'_>) -> Result<Self, WeightError> {
        let Some(cfg) = &self.config.vision else {
            return Err(WeightError::Missing(
                "vision_config (the config has no vision tower)".into(),
            ));
        };
        self.vision = Some(VisionTower::load(
            cfg,
            self.config.hidden_size,
            t,
            &self.backend,
        )?);
        Ok(self)
    }

    /// The vision tower, if the model has one.
    pub fn vision(&self) -> Option<&VisionTower<B>> {
        self.vision.as_ref()
    }

    /// The tower's output rows `[image tokens, hidden]` for `img` (not cached).
    pub fn encode_image(&self, img: &crate::exec::ImagePixels) -> Result<B::Act, ExecError> {
        let tower = self
            .vision
            .as_ref()
            .ok_or_else(|| ExecError::InvalidBatch("this model has no vision tower".into()))?;
        tower.encode(&self.backend, img)
    }

    /// Images the tower has encoded for forward passes so far (the others came from the cache).
    pub fn images_encoded(&self) -> usize {
        self.media_cache.encoded()
    }

    pub fn from_tensors(config: Config, t: &Tensors<'_>, be: B) -> Result<Self, WeightError> {
        let c = &config;
        let d = c.hidden_size;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mixer = match c.layer_kinds[l] {
                MixerKind::Kda => {
                    let (h, k, r, w) = (
                        c.kda.num_heads,
                        c.kda.head_dim,
                        c.kda.gate_low_rank_dim,
                        c.kda.conv_kernel,
                    );
                    let hk = h * k;
                    let a = format!("{p}.self_attn");
                    Mixer::Kda(KdaW {
                        q: lin(&be, t, &format!("{a}.q_proj.weight"), hk, d)?,
                        k: lin(&be, t, &format!("{a}.k_proj.weight"), hk, d)?,
                        v: lin(&be, t, &format!("{a}.v_proj.weight"), hk, d)?,
                        g: lin(&be, t, &format!("{a}.g_proj.weight"), hk, d)?,
                        conv: [
                            vecw(&be, t, &format!("{a}.q_conv1d.weight"), &[hk, 1, w])?,
                            vecw(&be, t, &format!("{a}.k_conv1d.weight"), &[hk, 1, w])?,
                            vecw(&be, t, &format!("{a}.v_conv1d.weight"), &[hk, 1, w])?,
                        ],
                        f_a: lin(&be, t, &format!("{a}.f_a_proj.weight"), r, d)?,
                        f_b: lin(&be, t, &format!("{a}.f_b_proj.weight"), hk, r)?,
                        b: lin(&be, t, &format!("{a}.b_proj.weight"), h, d)?,
                        a_log: vecw(&be, t, &format!("{a}.A_log"), &[h])?,
                        dt_bias: vecw(&be, t, &format!("{a}.dt_bias"), &[hk])?,
                        o_norm: vecw(&be, t, &format!("{a}.o_norm.weight"), &[k])?,
                        o: lin(&be, t, &format!("{a}.o_proj.weight"), d, hk)?,
                    })
                }
                MixerKind::Mla => {
                    let m = &c.mla;
                    let a = format!("{p}.self_attn");
                    Mixer::Mla(MlaW {
                        q_a: lin(&be, t, &format!("{a}.q_a_proj.weight"), m.q_lora_rank, d)?,
                        q_a_norm: vecw(
                            &be,
                            t,
                            &format!("{a}.q_a_layernorm.weight"),
                            &[m.q_lora_rank],
                        )?,
                        q_b: lin(
                            &be,
                            t,
                            &format!("{a}.q_b_proj.weight"),
                            m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                            m.q_lora_rank,
                        )?,
                        kv_a: lin(
                            &be,
                            t,
                            &format!("{a}.kv_a_proj_with_mqa.weight"),
                            m.kv_lora_rank + m.qk_rope_head_dim,
                            d,
                        )?,
                        kv_a_norm: vecw(
                            &be,
                            t,
                            &format!("{a}.kv_a_layernorm.weight"),
                            &[m.kv_lora_rank],
                        )?,
                        kv_b: lin(
                            &be,
                            t,
                            &format!("{a}.kv_b_proj.weight"),
                            m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                            m.kv_lora_rank,
                        )?,
                        g: lin(
                            &be,
                            t,
                            &format!("{a}.g_proj.weight"),
                            m.num_heads * m.v_head_dim,
                            d,
                        )?,
                        o: lin(
                            &be,
                            t,
                            &format!("{a}.o_proj.weight"),
                            d,
                            m.num_heads * m.v_head_dim,
                        )?,
                    })
                }
            };
            let ffn = if c.is_dense(l) {
                Ffn::Dense(glu(&be, t, &format!("{p}.mlp"), d, c.intermediate_size)?)
            } else {
                let m = &c.moe;
                let q = format!("{p}.block_sparse_moe");
                let (e, lt, ie) = (m.num_experts, m.latent_dim, m.expert_intermediate);
                let mut host = MxExpertsHost {
                    num_experts: e,
                    latent: lt,
                    inter: ie,
                    w1: Vec::with_capacity(e),
                    w3: Vec::with_capacity(e),
                    w2: Vec::with_capacity(e),
                };
                for x in 0..e {
                    host.w1
                        .push(mx_matrix(t, &format!("{q}.experts.{x}.w1"), ie, lt)?);
                    host.w3
                        .push(mx_matrix(t, &format!("{q}.experts.{x}.w3"), ie, lt)?);
                    host.w2
                        .push(mx_matrix(t, &format!("{q}.experts.{x}.w2"), lt, ie)?);
                }
                Ffn::Moe(MoeW {
                    router: lin(&be, t, &format!("{q}.gate.weight"), e, d)?,
                    bias: vecw(&be, t, &format!("{q}.gate.e_score_correction_bias"), &[e])?,
                    down: lin(
                        &be,
                        t,
                        &format!("{q}.routed_expert_down_proj.weight"),
                        lt,
                        d,
                    )?,
                    norm: if m.latent_use_norm {
                        Some(vecw(
                            &be,
                            t,
                            &format!("{q}.routed_expert_norm.weight"),
                            &[lt],
                        )?)
                    } else {
                        None
                    },
                    up: lin(&be, t, &format!("{q}.routed_expert_up_proj.weight"), d, lt)?,
                    experts: be.experts(host)?,
                    shared: glu(
                        &be,
                        t,
                        &format!("{q}.shared_experts"),
                        d,
                        m.shared_intermediate,
                    )?,
                })
            };
            layers.push(Layer {
                input_norm: vecw(&be, t, &format!("{p}.input_layernorm.weight"), &[d])?,
                post_norm: vecw(
                    &be,
                    t,
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[d],
                )?,
                attn_res: if l == 0 {
                    None
                } else {
                    Some(attn_res_w(&be, t, &format!("{p}.self_attention_res"), d)?)
                },
                mlp_res: attn_res_w(&be, t, &format!("{p}.mlp_res"), d)?,
                mixer,
                ffn,
            });
        }
        Ok(Self {
            embed: lin(&be, t, "model.embed_tokens.weight", c.vocab_size, d)?,
            lm_head: lin(&be, t, "lm_head.weight", c.vocab_size, d)?,
            norm: vecw(&be, t, "model.norm.weight", &[d])?,
            final_res: attn_res_w(&be, t, "model.output_attn_res", d)?,
            layers,
            config,
            backend: be,
            vision: None,
            media_cache: MediaCache::new(MEDIA_CACHE_IMAGES),
        })
    }

    fn kda_geom(&self) -> KdaGeom {
        kda_geom(&self.config)
    }

    /// ReplaySSM commit after a verify: every KDA layer replays each block's accepted tokens
    /// into its state and rolls its conv windows back. MLA layers need nothing: rows past the
    /// committed length are simply overwritten later.
    pub fn commit_verified(
        &self,
        arena: &mut B::Arena,
        offsets: &CacheOffsets,
        blocks: &[VerifiedBlock],
    ) -> Result<(), ExecError> {
        if blocks.is_empty() {
            return Ok(());
        }
        for (lo, ro) in offsets.kda.iter().zip(&offsets.kda_record) {
            let (Some(lo), Some(ro)) = (lo, ro) else {
                continue;
            };
            let commits: Vec<KdaCommit> = blocks
                .iter()
                .map(|b| KdaCommit {
                    state: b.state_block + lo,
                    record: b.record_block + ro,
                    tokens: b.tokens,
                    accepted: b.accepted,
                })
                .collect();
            self.backend.kda_commit(arena, self.kda_geom(), &commits)?;
        }
        Ok(())
    }

    fn mla_geom(&self) -> MlaGeom {
        let m = &self.config.mla;
        MlaGeom {
            heads: m.num_heads,
            nope: m.qk_nope_head_dim,
            rope: m.qk_rope_head_dim,
            v_dim: m.v_head_dim,
            kv_lora: m.kv_lora_rank,
            eps: self.config.rms_norm_eps,
        }
    }

    fn situ(&self) -> SituParams {
        SituParams {
            beta: self.config.situ_beta,
            linear_beta: self.config.situ_linear_beta,
        }
    }

    fn glu(&self, x: &B::Act, w: &GluW<B>) -> OpResult<B::Act> {
        let be = &self.backend;
        let [gate, up] = results(be.matmuls(x, &[&w.gate, &w.up])?)?;
        let h = be.situ_glu(&gate, &up, self.situ())?;
        be.matmul(&h, &w.down)
    }

    /// Run the layer graph over the new tokens of one sequence (see [`Model::forward_batch`]).
    pub fn forward_seq(
        &self,
        arena: &mut B::Arena,
        offsets: &CacheOffsets,
        ids: &[u32],
        cache: &SeqCache<'_>,
        logits_from: Option<usize>,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<B::Act>, ExecError> {
        let pass = SeqPass {
            ids,
            cache: *cache,
            logits_from,
            media: &[],
        };
        self.forward_batch(arena, offsets, &[pass], trace)
    }

    /// Run the layer graph over the new tokens of several sequences at once: their rows are
    /// stacked, so every dense op (projections, norms, AttnRes, MoE) runs once per step and reads
    /// its weights once; only the KDA and MLA cores run per sequence, each on its own rows and
    /// cache. Returns the logits `[rows, V]` of the rows each sequence wants (from its
    /// `logits_from` to its end), in batch order, or `None` when no sequence wants any.
    /// `trace`, when given, receives the partial sum `p` (all rows) after every layer.
    pub fn forward_batch(
        &self,
        arena: &mut B::Arena,
        offsets: &CacheOffsets,
        seqs: &[SeqPass<'_>],
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Option<B::Act>, ExecError> {
        Ok(self
            .forward_batch_tapped(arena, offsets, seqs, trace, &[])?
            .0)
    }

    /// [`Model::forward_batch`], also returning the hidden-state taps `tap_layers` asks for, one
    /// activation `[rows, d]` per tap over all rows of the batch (docs/speculative-decoding.md,
    /// "Target taps"): for a tap `l < L`, the AttnRes-mixed input of layer `l` before its norm;
    /// for `l = L`, the final AttnRes mix before the final norm.
    pub fn forward_batch_tapped(
        &self,
        arena: &mut B::Arena,
        offsets: &CacheOffsets,
        seqs: &[SeqPass<'_>],
        mut trace: Option<&mut Vec<Vec<f32>>>,
        tap_layers: &[usize],
    ) -> Result<TappedPass<B>, ExecError> {
        let nl = self.config.num_hidden_layers;
        if let Some(&bad) = tap_layers.iter().find(|&&l| l == 0 || l > nl) {
            return Err(ExecError::InvalidBatch(format!(
                "hidden-state tap {bad} is outside 1..={nl}"
            )));
        }
        let mut taps: Vec<Option<B::Act>> = (0..tap_layers.len()).map(|_| None).collect();
        let be = &self.backend;
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let mut spans = Vec::with_capacity(seqs.len());
        let mut ids: Vec<u32> = Vec::new();
        for s in seqs {
            if let Some(&bad) = s.ids.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ExecError::InvalidBatch(format!(
                    "token id {bad} >= vocab size {}",
                    c.vocab_size
                )));
            }
            if s.ids.is_empty() || s.logits_from.is_some_and(|f| f >= s.ids.len()) {
                return Err(ExecError::InvalidBatch(
                    "a sequence has no tokens or asks for logits past its end".into(),
                ));
            }
            spans.push((ids.len(), ids.len() + s.ids.len()));
            ids.extend_from_slice(s.ids);
        }
        let total = ids.len();
        if total == 0 {
            return Err(ExecError::InvalidBatch("an empty batch".into()));
        }
        let pieces = self.pieces(seqs, &spans);
        let mut bank: Vec<B::Act> = Vec::new();
        let mut p: Option<B::Act> = Some(self.embed_rows(&ids, seqs, &spans)?);
        for (l, layer) in self.layers.iter().enumerate() {
            let tapped = tap_layers.contains(&l);
            let x = match (&layer.attn_res, bank.is_empty()) {
                (Some(w), false) if !tapped => {
                    let src: Vec<&B::Act> = bank.iter().collect();
                    let cur = p.as_mut().expect("p is set between layers");
                    be.attn_res_norm(&src, cur, None, &w.w, &layer.input_norm, eps)?
                }
                (res, empty) => {
                    let cur = p.as_ref().expect("p is set between layers");
                    let h = match (res, empty) {
                        (Some(w), false) => {
                            let mut src: Vec<&B::Act> = bank.iter().collect();
                            src.push(cur);
                            Some(be.attn_res(&src, &w.w, eps)?)
                        }
                        _ => None,
                    };
                    let h = h.as_ref().unwrap_or(cur);
                    for (slot, _) in tap_layers.iter().enumerate().filter(|(_, t)| **t == l) {
                        taps[slot] = Some(be.slice_rows(h, 0, total)?);
                    }
                    be.rms_norm(h, &layer.input_norm, eps)?
                }
            };
            if l % c.attn_res_block_size == 0 {
                bank.push(p.take().expect("p set"));
            }
            let a = match &layer.mixer {
                Mixer::Kda(w) => self.kda_layer(arena, offsets, l, &x, w, seqs, &spans)?,
                Mixer::Mla(w) => self.mla_layer(arena, offsets, l, &x, w, seqs, &pieces)?,
            };
            // The mixer's output starts the block's running sum, or is added to it.
            let (mut pp, add) = match p.take() {
                None => (a, None),
                Some(pp) => (pp, Some(a)),
            };
            let x = {
                let src: Vec<&B::Act> = bank.iter().collect();
                let (w, norm) = (&layer.mlp_res.w, &layer.post_norm);
                be.attn_res_norm(&src, &mut pp, add.as_ref(), w, norm, eps)?
            };
            let f = match &layer.ffn {
                Ffn::Dense(w) => self.glu(&x, w)?,
                Ffn::Moe(w) => self.moe(&x, w, &spans)?,
            };
            be.add_assign(&mut pp, &f)?;
            if let Some(tr) = trace.as_deref_mut() {
                tr.push(be.to_host(&pp)?);
            }
            p = Some(pp);
        }
        let wanted: Vec<(usize, usize)> = seqs
            .iter()
            .zip(&spans)
            .filter_map(|(s, &(r0, r1))| s.logits_from.map(|f| (r0 + f, r1)))
            .collect();
        let mut p = p.expect("p set");
        let mut mixed = None;
        if tap_layers.contains(&nl) {
            // The final mix of every row, for the tap; the wanted rows are then picked from it
            // (AttnRes is per row, so the logits do not change).
            let mut src: Vec<&B::Act> = bank.iter().collect();
            src.push(&p);
            let all = be.attn_res(&src, &self.final_res.w, eps)?;
            for (slot, _) in tap_layers.iter().enumerate().filter(|(_, t)| **t == nl) {
                taps[slot] = Some(be.slice_rows(&all, 0, total)?);
            }
            mixed = Some(all);
        }
        let taps = taps
            .into_iter()
            .map(|t| t.ok_or_else(|| ExecError::Backend("a hidden-state tap was not taken".into())))
            .collect::<Result<Vec<_>, _>>()?;
        if wanted.is_empty() {
            return Ok((None, taps));
        }
        // The final AttnRes, norm and lm_head run on the wanted rows only.
        let whole = wanted == [(0, total)];
        let (w, norm) = (&self.final_res.w, &self.norm);
        let y = match mixed {
            Some(all) if whole => be.rms_norm(&all, norm, eps)?,
            Some(all) => be.rms_norm(&self.gather_rows(&all, &wanted)?, norm, eps)?,
            None if whole => {
                let src: Vec<&B::Act> = bank.iter().collect();
                be.attn_res_norm(&src, &mut p, None, w, norm, eps)?
            }
            None => {
                let picked = bank
                    .iter()
                    .map(|a| self.gather_rows(a, &wanted))
                    .collect::<OpResult<Vec<_>>>()?;
                let mut last = self.gather_rows(&p, &wanted)?;
                let src: Vec<&B::Act> = picked.iter().collect();
                be.attn_res_norm(&src, &mut last, None, w, norm, eps)?
            }
        };
        Ok((Some(be.matmul(&y, &self.lm_head)?), taps))
    }

    /// The input rows of the step: token embeddings, except rows inside an image's span, which
    /// take the vision tower's output (docs/vision.md).
    fn embed_rows(
        &self,
        ids: &[u32],
        seqs: &[SeqPass<'_>],
        spans: &[(usize, usize)],
    ) -> Result<B::Act, ExecError> {
        let embedded = self.backend.embed(&self.embed, ids)?;
        if seqs.iter().all(|s| s.media.is_empty()) {
            return Ok(embedded);
        }
        let views: Vec<(usize, usize, &[MediaInput])> = seqs
            .iter()
            .map(|s| (s.cache.start_pos, s.ids.len(), s.media))
            .collect();
        crate::vision::splice(
            &self.backend,
            self.vision.as_ref(),
            &self.media_cache,
            embedded,
            &views,
            spans,
        )
    }

    /// The sequences' rows as the MLA op sees them: each sequence whole, except that a verify
    /// on a backend whose one-token attention is numerically its own
    /// ([`Backend::verify_rows_as_decode`]) is cut into one-token pieces, so it reproduces
    /// decoding bit for bit.
    fn pieces(&self, seqs: &[SeqPass<'_>], spans: &[(usize, usize)]) -> Vec<Piece> {
        let split = self.backend.verify_rows_as_decode();
        let mut out = Vec::with_capacity(spans.len());
        for (k, (s, &(r0, r1))) in seqs.iter().zip(spans).enumerate() {
            if split && s.cache.record_block.is_some() {
                out.extend((r0..r1).map(|r| Piece {
                    seq: k,
                    offset: r - r0,
                    rows: (r, r + 1),
                }));
            } else {
                out.push(Piece {
                    seq: k,
                    offset: 0,
                    rows: (r0, r1),
                });
            }
        }
        out
    }

    /// Rows `ranges` of `a`, stacked in order.
    fn gather_rows(&self, a: &B::Act, ranges: &[(usize, usize)]) -> OpResult<B::Act> {
        let be = &self.backend;
        match ranges {
            [(r0, r1)] => be.slice_rows(a, *r0, *r1),
            _ => {
                let parts = ranges
                    .iter()
                    .map(|&(r0, r1)| be.slice_rows(a, r0, r1))
                    .collect::<OpResult<Vec<B::Act>>>()?;
                be.concat_rows(&parts.iter().collect::<Vec<_>>())
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn kda_layer(
        &self,
        arena: &mut B::Arena,
        offsets: &CacheOffsets,
        l: usize,
        x: &B::Act,
        w: &KdaW<B>,
        seqs: &[SeqPass<'_>],
        spans: &[(usize, usize)],
    ) -> Result<B::Act, ExecError> {
        let be = &self.backend;
        let geom = self.kda_geom();
        let lo = offsets.kda[l].expect("KDA layer has a state offset");
        let [q, k, v, f_a, b, gate] =
            results(be.matmuls(x, &[&w.q, &w.k, &w.v, &w.f_a, &w.b, &w.g])?)?;
        let f = be.matmul(&f_a, &w.f_b)?;
        let cps: Vec<Vec<(usize, usize)>> = seqs
            .iter()
            .map(|s| {
                let cps = s.cache.checkpoints.iter();
                cps.map(|&(n, dst)| (n, dst + lo)).collect()
            })
            .collect();
        let locs: Vec<KdaStateLoc<'_>> = seqs
            .iter()
            .zip(&cps)
            .map(|(s, cps)| KdaStateLoc {
                offset: s.cache.state_block + lo,
                checkpoints: cps,
                record: s
                    .cache
                    .record_block
                    .map(|r| r + offsets.kda_record[l].expect("KDA layer has a record offset")),
            })
            .collect();
        let o = be.kda_batch(
            arena,
            geom,
            &KdaParams {
                conv: [&w.conv[0], &w.conv[1], &w.conv[2]],
                a_log: &w.a_log,
                dt_bias: &w.dt_bias,
            },
            &KdaInputs {
                qkv: [&q, &k, &v],
                f: &f,
                b: &b,
            },
            spans,
            &locs,
        )?;
        let o = be.gated_head_norm(
            &o,
            &gate,
            &w.o_norm,
            geom.head_dim,
            self.config.rms_norm_eps,
        )?;
        Ok(be.matmul(&o, &w.o)?)
    }

    #[allow(clippy::too_many_arguments)]
    fn mla_layer(
        &self,
        arena: &mut B::Arena,
        offsets: &CacheOffsets,
        l: usize,
        x: &B::Act,
        w: &MlaW<B>,
        seqs: &[SeqPass<'_>],
        pieces: &[Piece],
    ) -> Result<B::Act, ExecError> {
        let be = &self.backend;
        let eps = self.config.rms_norm_eps;
        let [q_a, kv_a, gate] = results(be.matmuls(x, &[&w.q_a, &w.kv_a, &w.g])?)?;
        let cq = be.rms_norm(&q_a, &w.q_a_norm, eps)?;
        let q = be.matmul(&cq, &w.q_b)?;
        let layer_offset = offsets.mla[l].expect("MLA layer has a page offset");
        let locs: Vec<MlaCacheLoc<'_>> = pieces
            .iter()
            .map(|p| {
                let s = &seqs[p.seq];
                MlaCacheLoc {
                    pages: s.cache.kv_pages,
                    page_tokens: s.cache.page_tokens,
                    layer_offset,
                    start_pos: s.cache.start_pos + p.offset,
                }
            })
            .collect();
        let spans: Vec<(usize, usize)> = pieces.iter().map(|p| p.rows).collect();
        let mut o = be.mla_batch(
            arena,
            self.mla_geom(),
            &q,
            &kv_a,
            &w.kv_a_norm,
            &w.kv_b,
            &spans,
            &locs,
        )?;
        be.sigmoid_mul(&mut o, &gate)?;
        Ok(be.matmul(&o, &w.o)?)
    }

    fn moe(&self, x: &B::Act, w: &MoeW<B>, spans: &[(usize, usize)]) -> OpResult<B::Act> {
        let be = &self.backend;
        let m = &self.config.moe;
        let [z, logits] = results(be.matmuls(x, &[&w.down, &w.router])?)?;
        let router = RouterParams {
            top_k: m.experts_per_token,
            renormalize: m.renormalize,
            scaling: m.routed_scaling_factor,
        };
        let y_lat =
            be.moe_routed_batch(&z, &logits, &w.bias, &w.experts, router, self.situ(), spans)?;
        let y_lat = match &w.norm {
            Some(n) => be.rms_norm(&y_lat, n, self.config.rms_norm_eps)?,
            None => y_lat,
        };
        let mut y = be.matmul(&y_lat, &w.up)?;
        be.add_assign(&mut y, &self.glu(x, &w.shared)?)?;
        Ok(y)
    }
}

/// The results of one `Backend::matmuls` call as an array, one per weight passed.
fn results<A, const N: usize>(v: Vec<A>) -> OpResult<[A; N]> {
    let got = v.len();
    v.try_into().map_err(|_| {
        BackendError::InvalidArg(format!("matmuls returned {got} results for {N} weights"))
    })
}
