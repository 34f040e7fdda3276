//! The DSpark drafter's weights on a backend and its forward pass (docs/speculative-decoding.md,
//! "DSpark drafter"). Matrix products (features, projections, MLP, LM head, Markov head) run
//! through the backend's ops; the block's small attention, RoPE and the MLP's elementwise SiLU
//! gate run on the host, because the `Backend` trait has no ops for them.

use crate::attention::{AttnGeom, block_attention, dot, rope_inv_freq, rope_row};
use crate::context::{ContextCache, ContextShape, ContextView};
use crate::{DsparkConfig, DsparkError};
use k3_model::{Backend, BackendError, Tensors, WeightFile};
use k3_speculative::{Draft, DraftSampling};
use rand::Rng;
use std::path::Path;

struct LayerW<B: Backend> {
    input_norm: B::Vector,
    /// `q_proj`, `k_proj`, `v_proj` stacked: one product per layer for the block rows.
    qkv: B::Linear,
    o: B::Linear,
    post_norm: B::Vector,
    /// `gate_proj` then `up_proj` stacked.
    gate_up: B::Linear,
    down: B::Linear,
}

/// A loaded drafter. Immutable after loading and `Sync` where the backend's weights are, so one
/// `Arc<DsparkModel>` serves every sequence's [`crate::DsparkDrafter`].
pub struct DsparkModel<B: Backend> {
    config: DsparkConfig,
    backend: B,
    /// Shared with the target: `model.embed_tokens.weight` and `lm_head.weight`, `[V, d]`.
    embed: B::Linear,
    lm_head: B::Linear,
    fc: B::Linear,
    hidden_norm: B::Vector,
    /// `mask_embedding` as a one-row table, so mask rows come from the backend's `embed`.
    mask: B::Linear,
    layers: Vec<LayerW<B>>,
    /// Every layer's `k_proj` then `v_proj`, stacked: a context row's keys and values for all
    /// layers in one product (the layout [`crate::ContextCache`] rows have).
    ctx_kv: B::Linear,
    norm: B::Vector,
    /// `markov.w1` `[V, r]`, read by row.
    markov_w1: B::Linear,
    /// `markov.w2` transposed to `[V, r]`, applied as `w1[x] · w2`.
    markov_w2t: B::Linear,
    /// `confidence.weight` `[d + r]` and its bias.
    confidence_w: Vec<f32>,
    confidence_b: f32,
    inv_freq: Vec<f64>,
}

/// The block pass before the token-by-token heads.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockOutput {
    /// `y = RMSNorm(x, norm)`, `[γ, d]`.
    pub hidden: Vec<f32>,
    /// `U = y lm_headᵀ`, `[γ, V]`.
    pub base_logits: Vec<f32>,
}

/// A block scored along given tokens (teacher forcing): what the drafter would have proposed
/// them with.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockScores {
    pub block: BlockOutput,
    /// Per token: the Markov-adjusted logits, or with a temperature the distribution q_k.
    pub rows: Vec<Vec<f32>>,
    /// Per token: calibrated confidence c_k.
    pub confidence: Vec<f32>,
}

/// `data` as a backend activation. The trait has no upload op, so the rows go up as a weight
/// table and come back as activations through `embed`.
fn upload<B: Backend>(
    be: &B,
    rows: usize,
    cols: usize,
    data: Vec<f32>,
) -> Result<B::Act, BackendError> {
    let table = be.linear(rows, cols, data)?;
    let ids: Vec<u32> = (0..rows as u32).collect();
    be.embed(&table, &ids)
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Index of the largest finite entry (ties to the lower id); `None` when there is none.
pub fn argmax(row: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in row.iter().enumerate() {
        if x.is_finite() && best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// `softmax(logits / t)`; `None` when the logits have no finite maximum.
pub fn softmax_at(logits: &[f32], t: f32) -> Option<Vec<f32>> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || logits.iter().any(|x| x.is_nan()) {
        return None;
    }
    let mut q: Vec<f32> = logits.iter().map(|&x| ((x - max) / t).exp()).collect();
    let sum: f64 = q.iter().map(|&x| f64::from(x)).sum();
    let inv = (1.0 / sum) as f32;
    q.iter_mut().for_each(|x| *x *= inv);
    Some(q)
}

/// A token drawn from `q` by inverse CDF.
fn sample(q: &[f32], rng: &mut dyn rand::RngCore) -> u32 {
    let u: f64 = rng.random();
    let (mut acc, mut last) = (0f64, 0);
    for (i, &p) in q.iter().enumerate() {
        if p > 0.0 {
            acc += f64::from(p);
            last = i;
            if u < acc {
                return i as u32;
            }
        }
    }
    last as u32
}

impl<B: Backend> DsparkModel<B> {
    /// Load a drafter directory (`config.json`, `model.safetensors`) and the embedding and LM
    /// head it shares with the target in `target_dir`, validating shapes against the target's
    /// config.
    pub fn load(drafter_dir: &Path, target_dir: &Path, backend: B) -> Result<Self, DsparkError> {
        let config = DsparkConfig::from_file(&drafter_dir.join("config.json"))?;
        let target = k3_model::Config::from_file(&target_dir.join("config.json"))?;
        config.check_target(&target)?;
        let drafter = WeightFile::open(&drafter_dir.join("model.safetensors"))
            .map_err(DsparkError::DrafterWeights)?;
        let shared = WeightFile::open(&target_dir.join("model.safetensors"))
            .map_err(DsparkError::TargetWeights)?;
        Self::from_tensors(config, &drafter.tensors(), &shared.tensors(), backend)
    }

    /// Bind already-opened tensors (e.g. [`Tensors::dummy`] drafter weights for timing).
    /// `shared` holds the target's `model.embed_tokens.weight` and `lm_head.weight`.
    pub fn from_tensors(
        config: DsparkConfig,
        drafter: &Tensors<'_>,
        shared: &Tensors<'_>,
        backend: B,
    ) -> Result<Self, DsparkError> {
        let c = &config;
        let (d, w, i) = (c.hidden_size, c.attn_width(), c.intermediate_size);
        let (v, r) = (c.vocab_size, c.markov_rank);
        let be = &backend;
        let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>, DsparkError> {
            drafter
                .f32(name, shape)
                .map_err(DsparkError::DrafterWeights)
        };
        let shared_lin = |name: &str| -> Result<B::Linear, DsparkError> {
            let data = shared
                .f32(name, &[v, d])
                .map_err(DsparkError::TargetWeights)?;
            Ok(be.linear(v, d, data)?)
        };
        let lin = |name: &str, rows: usize, cols: usize| -> Result<B::Linear, DsparkError> {
            Ok(be.linear(rows, cols, get(name, &[rows, cols])?)?)
        };
        let vector = |name: &str, n: usize| -> Result<B::Vector, DsparkError> {
            Ok(be.vector(get(name, &[n])?)?)
        };

        let mut layers = Vec::with_capacity(c.num_layers);
        let mut ctx_kv = Vec::with_capacity(c.num_layers * 2 * w * d);
        for l in 0..c.num_layers {
            let p = format!("layers.{l}");
            let q = get(&format!("{p}.q_proj.weight"), &[w, d])?;
            let k = get(&format!("{p}.k_proj.weight"), &[w, d])?;
            let vv = get(&format!("{p}.v_proj.weight"), &[w, d])?;
            ctx_kv.extend_from_slice(&k);
            ctx_kv.extend_from_slice(&vv);
            let mut gate_up = get(&format!("{p}.gate_proj.weight"), &[i, d])?;
            gate_up.extend(get(&format!("{p}.up_proj.weight"), &[i, d])?);
            layers.push(LayerW {
                input_norm: vector(&format!("{p}.input_norm.weight"), d)?,
                qkv: be.linear(3 * w, d, [q, k, vv].concat())?,
                o: lin(&format!("{p}.o_proj.weight"), d, w)?,
                post_norm: vector(&format!("{p}.post_norm.weight"), d)?,
                gate_up: be.linear(2 * i, d, gate_up)?,
                down: lin(&format!("{p}.down_proj.weight"), d, i)?,
            });
        }
        let w2 = get("markov.w2", &[r, v])?;
        let w2t: Vec<f32> = (0..v)
            .flat_map(|col| (0..r).map(move |row| (row, col)))
            .map(|(row, col)| w2[row * v + col])
            .collect();
        let confidence_b = get("confidence.bias", &[1])?[0];
        Ok(DsparkModel {
            embed: shared_lin("model.embed_tokens.weight")?,
            lm_head: shared_lin("lm_head.weight")?,
            fc: lin("fc.weight", d, c.tap_width())?,
            hidden_norm: vector("hidden_norm.weight", d)?,
            mask: be.linear(1, d, get("mask_embedding", &[d])?)?,
            layers,
            ctx_kv: be.linear(c.num_layers * 2 * w, d, ctx_kv)?,
            norm: vector("norm.weight", d)?,
            markov_w1: lin("markov.w1", v, r)?,
            markov_w2t: be.linear(v, r, w2t)?,
            confidence_w: get("confidence.weight", &[1, d + r])?,
            confidence_b,
            inv_freq: rope_inv_freq(c.head_dim, c.rope_theta),
            config,
            backend,
        })
    }

    pub fn config(&self) -> &DsparkConfig {
        &self.config
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Target layers the drafter reads (see [`DsparkConfig::target_taps`]).
    pub fn tap_layers(&self) -> &[usize] {
        &self.config.target_taps
    }

    /// Floats of one position's tap row.
    pub fn tap_width(&self) -> usize {
        self.config.tap_width()
    }

    /// What one position of context holds: per layer, a key (RoPE applied) and a value.
    pub fn context_shape(&self) -> ContextShape {
        ContextShape {
            layers: self.config.num_layers,
            heads: self.config.num_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Floats of one context row ([`ContextShape::row_width`]).
    pub fn context_width(&self) -> usize {
        self.context_shape().row_width()
    }

    /// An empty context of `capacity` positions for this drafter.
    pub fn new_context(&self, capacity: usize) -> ContextCache {
        ContextCache::new(self.context_shape(), capacity)
    }

    fn features_act(&self, taps: &[f32], rows: usize) -> Result<B::Act, DsparkError> {
        let tw = self.tap_width();
        if taps.len() != rows * tw {
            return Err(DsparkError::Input(format!(
                "{} tap values for {rows} rows of {tw}",
                taps.len()
            )));
        }
        let be = &self.backend;
        let x = upload(be, rows, tw, taps.to_vec())?;
        Ok(be.rms_norm(
            &be.matmul(&x, &self.fc)?,
            &self.hidden_norm,
            self.config.rms_norm_eps,
        )?)
    }

    /// Feature rows `c_p = RMSNorm(taps_p fcᵀ, hidden_norm)`, `[rows, d]`.
    pub fn features(&self, taps: &[f32], rows: usize) -> Result<Vec<f32>, DsparkError> {
        let f = self.features_act(taps, rows)?;
        Ok(self.backend.to_host(&f)?)
    }

    /// Keys and values of every layer for context rows `c` (an activation) at `positions`.
    fn project_context(
        &self,
        c: &B::Act,
        positions: impl Iterator<Item = usize>,
    ) -> Result<Vec<f32>, DsparkError> {
        let be = &self.backend;
        let mut kv = be.to_host(&be.matmul(c, &self.ctx_kv)?)?;
        let (w, hd) = (self.config.attn_width(), self.config.head_dim);
        for (row, pos) in kv.chunks_exact_mut(self.context_width()).zip(positions) {
            for layer in row.chunks_exact_mut(2 * w) {
                rope_row(&mut layer[..w], hd, pos, &self.inv_freq);
            }
        }
        Ok(kv)
    }

    /// Context rows for taps of positions `first_pos ..` (`rows` of them).
    pub fn context_rows_from_taps(
        &self,
        first_pos: usize,
        taps: &[f32],
        rows: usize,
    ) -> Result<Vec<f32>, DsparkError> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        let c = self.features_act(taps, rows)?;
        self.project_context(&c, first_pos..first_pos + rows)
    }

    /// Context rows for feature rows `[n, d]` at `positions`.
    pub fn context_rows(
        &self,
        features: &[f32],
        positions: &[usize],
    ) -> Result<Vec<f32>, DsparkError> {
        let d = self.config.hidden_size;
        if features.len() != positions.len() * d {
            return Err(DsparkError::Input(format!(
                "{} feature values for {} positions of width {d}",
                features.len(),
                positions.len()
            )));
        }
        if positions.is_empty() {
            return Ok(Vec::new());
        }
        let c = upload(&self.backend, positions.len(), d, features.to_vec())?;
        self.project_context(&c, positions.iter().copied())
    }

    /// The non-causal block pass: the anchor at `anchor_pos` and γ − 1 mask rows after it,
    /// attending to the context `ctx`.
    pub fn block_forward(
        &self,
        ctx: &ContextView<'_>,
        anchor: u32,
        anchor_pos: usize,
    ) -> Result<BlockOutput, DsparkError> {
        let c = &self.config;
        let (g, d, w, eps) = (c.block_size, c.hidden_size, c.attn_width(), c.rms_norm_eps);
        if anchor as usize >= c.vocab_size {
            return Err(DsparkError::Input(format!(
                "anchor token {anchor} outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let be = &self.backend;
        let mut x = be.embed(&self.embed, &[anchor])?;
        if g > 1 {
            let masks = be.embed(&self.mask, &vec![0; g - 1])?;
            x = be.concat_rows(&[&x, &masks])?;
        }
        let geom = AttnGeom {
            heads: c.num_heads,
            head_dim: c.head_dim,
        };
        for (l, lw) in self.layers.iter().enumerate() {
            let u = be.rms_norm(&x, &lw.input_norm, eps)?;
            let mut qkv = be.to_host(&be.matmul(&u, &lw.qkv)?)?;
            let o = block_attention(&mut qkv, g, geom, anchor_pos, &self.inv_freq, ctx, l);
            let o = upload(be, g, w, o)?;
            be.add_assign(&mut x, &be.matmul(&o, &lw.o)?)?;
            let z = be.rms_norm(&x, &lw.post_norm, eps)?;
            let gu = be.to_host(&be.matmul(&z, &lw.gate_up)?)?;
            let i = c.intermediate_size;
            let h: Vec<f32> = gu
                .chunks_exact(2 * i)
                .flat_map(|row| {
                    let (gate, up) = row.split_at(i);
                    gate.iter().zip(up).map(|(&a, &b)| a * sigmoid(a) * b)
                })
                .collect();
            let h = upload(be, g, i, h)?;
            be.add_assign(&mut x, &be.matmul(&h, &lw.down)?)?;
        }
        let y = be.rms_norm(&x, &self.norm, eps)?;
        let base_logits = be.to_host(&be.matmul(&y, &self.lm_head)?)?;
        let hidden = be.to_host(&y)?;
        debug_assert_eq!(hidden.len(), g * d);
        Ok(BlockOutput {
            hidden,
            base_logits,
        })
    }

    /// Block position `k` (1-based) after token `prev`: the Markov-adjusted logits
    /// `U_k + w1[prev] w2` and the calibrated confidence `σ(([y_k ; w1[prev]]·w + b) / T_k)`.
    pub fn head_step(
        &self,
        block: &BlockOutput,
        k: usize,
        prev: u32,
    ) -> Result<(Vec<f32>, f32), DsparkError> {
        let c = &self.config;
        let (d, v) = (c.hidden_size, c.vocab_size);
        if k == 0 || k > c.block_size {
            return Err(DsparkError::Input(format!(
                "block position {k} outside 1..={}",
                c.block_size
            )));
        }
        if prev as usize >= v {
            return Err(DsparkError::Input(format!(
                "token {prev} outside the vocabulary of {v}"
            )));
        }
        let be = &self.backend;
        let w1 = be.embed(&self.markov_w1, &[prev])?;
        let bias = be.to_host(&be.matmul(&w1, &self.markov_w2t)?)?;
        let w1 = be.to_host(&w1)?;
        let logits: Vec<f32> = block.base_logits[(k - 1) * v..k * v]
            .iter()
            .zip(&bias)
            .map(|(u, b)| u + b)
            .collect();
        let (wy, wm) = self.confidence_w.split_at(d);
        let z = dot(wy, &block.hidden[(k - 1) * d..k * d]) + dot(wm, &w1) + self.confidence_b;
        Ok((logits, sigmoid(z / c.confidence_temperatures[k - 1])))
    }

    /// Draft up to `max` (≤ γ) tokens after `anchor` at `anchor_pos` over the context `ctx`
    /// (a [`ContextCache::view_before`] the anchor). Greedy takes each
    /// argmax (ties to the lower id); sampling at temperature T draws from `q_k = softmax(logits
    /// / T)` and returns the q rows in [`Draft::probs`] (a temperature that is not a positive
    /// number drafts greedily). A position whose logits have no finite maximum ends the draft.
    pub fn draft_with_context(
        &self,
        ctx: &ContextView<'_>,
        anchor: u32,
        anchor_pos: usize,
        max: usize,
        sampling: &mut DraftSampling<'_>,
    ) -> Result<Draft, DsparkError> {
        let n = max.min(self.config.block_size);
        if n == 0 {
            return Ok(Draft::default());
        }
        let temperature = match sampling {
            DraftSampling::Sample { temperature, .. }
                if *temperature > 0.0 && temperature.is_finite() =>
            {
                Some(*temperature)
            }
            _ => None,
        };
        let block = self.block_forward(ctx, anchor, anchor_pos)?;
        let mut draft = Draft::default();
        let mut probs = Vec::new();
        let mut prev = anchor;
        for k in 1..=n {
            let (logits, confidence) = self.head_step(&block, k, prev)?;
            let token = match (temperature, &mut *sampling) {
                (Some(t), DraftSampling::Sample { rng, .. }) => {
                    let Some(q) = softmax_at(&logits, t) else {
                        break;
                    };
                    let token = sample(&q, &mut **rng);
                    probs.push(q);
                    token
                }
                _ => match argmax(&logits) {
                    Some(t) => t,
                    None => break,
                },
            };
            draft.tokens.push(token);
            draft.confidence.push(confidence);
            prev = token;
        }
        if temperature.is_some() {
            draft.probs = Some(probs);
        }
        Ok(draft)
    }

    /// A context holding exactly the feature rows `features` (`[n, d]`) at `positions`
    /// (strictly increasing, each before `anchor_pos`).
    pub fn context_from_features(
        &self,
        features: &[f32],
        positions: &[usize],
        anchor_pos: usize,
    ) -> Result<ContextCache, DsparkError> {
        if let Some(p) = positions.iter().find(|&&p| p >= anchor_pos) {
            return Err(DsparkError::Input(format!(
                "context position {p} is not before the anchor's {anchor_pos}"
            )));
        }
        if positions.windows(2).any(|w| w[0] >= w[1]) {
            return Err(DsparkError::Input(
                "context positions must strictly increase".into(),
            ));
        }
        let rows = self.context_rows(features, positions)?;
        let mut cache = self.new_context(positions.len());
        let width = self.context_width();
        for (&p, row) in positions.iter().zip(rows.chunks_exact(width.max(1))) {
            cache.insert(p, row);
        }
        Ok(cache)
    }

    /// One block from explicit feature rows `ctx_rows` (`[n, d]`, from [`DsparkModel::features`])
    /// at `ctx_positions` (strictly increasing, each before `anchor_pos`; gaps allowed, used as
    /// they are). See
    /// [`DsparkModel::draft_with_context`].
    pub fn draft_block(
        &self,
        ctx_rows: &[f32],
        ctx_positions: &[usize],
        anchor: u32,
        anchor_pos: usize,
        max: usize,
        sampling: &mut DraftSampling<'_>,
    ) -> Result<Draft, DsparkError> {
        let ctx = self.context_from_features(ctx_rows, ctx_positions, anchor_pos)?;
        self.draft_with_context(
            &ctx.view_before(anchor_pos),
            anchor,
            anchor_pos,
            max,
            sampling,
        )
    }

    /// Score given tokens as block positions 1.. (teacher forcing, at most γ of them): the
    /// Markov-adjusted logits, or with `temperature` the draft distributions, and confidences.
    /// This is what golden files compare against (see [`crate::golden`]).
    pub fn score_tokens(
        &self,
        ctx_rows: &[f32],
        ctx_positions: &[usize],
        anchor: u32,
        anchor_pos: usize,
        tokens: &[u32],
        temperature: Option<f32>,
    ) -> Result<BlockScores, DsparkError> {
        if tokens.len() > self.config.block_size {
            return Err(DsparkError::Input(format!(
                "{} tokens for a block of {}",
                tokens.len(),
                self.config.block_size
            )));
        }
        let ctx = self.context_from_features(ctx_rows, ctx_positions, anchor_pos)?;
        let block = self.block_forward(&ctx.view_before(anchor_pos), anchor, anchor_pos)?;
        let (mut rows, mut confidence) = (Vec::new(), Vec::new());
        let mut prev = anchor;
        for (k, &t) in tokens.iter().enumerate() {
            let (logits, c) = self.head_step(&block, k + 1, prev)?;
            rows.push(match temperature {
                Some(t) => softmax_at(&logits, t).ok_or_else(|| {
                    DsparkError::Input(format!("block position {}: no finite logit", k + 1))
                })?,
                None => logits,
            });
            confidence.push(c);
            prev = t;
        }
        Ok(BlockScores {
            block,
            rows,
            confidence,
        })
    }
}
