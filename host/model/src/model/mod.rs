//! K3 weights bound to a backend: the layer types and their loading (checkpoints, dummy weights,
//! the vision tower). The forward pass over them is in `forward`.

use crate::backend::{
    Backend, Glu, KdaCommit, KdaGeom, KdaInputs, KdaParams, KdaStateLoc, MlaCacheLoc, MlaGeom,
    MxExpertsHost, MxMatrixHost, RouterParams, SituParams,
};
use crate::config::{Config, ConfigError, MixerKind};
use crate::error::{BackendError, ExecError, OpResult};
use crate::exec::{MediaInput, VerifiedBlock};
use crate::vision::{MEDIA_CACHE_IMAGES, MediaCache, VisionTower};
use crate::weights::{Tensors, WeightError, WeightFile};
use std::path::Path;

mod forward;

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
}
