//! The vision tower and projector (docs/vision.md), written over the [`Backend`], and the splice
//! that puts its output rows in place of an image's `<|media_pad|>` embeddings.
//!
//! Patches are cut on the host (a reshuffle of the media stage's CHW pixels), everything after
//! the upload runs on the backend: patch embedding, `layers` pre-norm blocks (2-D RoPE attention
//! over all of the image's patches, GELU MLP), the 2×2 merge, its norm and the two-layer
//! projector into the decoder's width.

use crate::backend::{Backend, VisionAttnGeom};
use crate::config::VisionConfig;
use crate::error::{ExecError, OpResult};
use crate::exec::{ImagePixels, MediaInput};
use crate::weights::{Tensors, WeightError};
use std::collections::VecDeque;
use std::sync::Mutex;

/// Input channels (RGB).
const CHANNELS: usize = 3;

/// Tower outputs kept for later steps: an image whose span crosses prefill chunks, or that a
/// later request repeats, is encoded once. Each entry is small (rows × decoder width floats).
pub const MEDIA_CACHE_IMAGES: usize = 32;

/// A Linear layer with bias.
struct Lin<B: Backend> {
    w: B::Linear,
    b: B::Vector,
}

impl<B: Backend> Lin<B> {
    fn load(
        be: &B,
        t: &Tensors<'_>,
        name: &str,
        out: usize,
        inp: usize,
    ) -> Result<Self, WeightError> {
        Ok(Self {
            w: be.linear(out, inp, t.f32(&format!("{name}.weight"), &[out, inp])?)?,
            b: be.vector(t.f32(&format!("{name}.bias"), &[out])?)?,
        })
    }

    fn apply(&self, be: &B, x: &B::Act) -> OpResult<B::Act> {
        let mut y = be.matmul(x, &self.w)?;
        be.add_bias(&mut y, &self.b)?;
        Ok(y)
    }
}

struct Block<B: Backend> {
    norm1: B::Vector,
    qkv: Lin<B>,
    proj: Lin<B>,
    norm2: B::Vector,
    fc1: Lin<B>,
    fc2: Lin<B>,
}

/// The tower and projector of one model, on backend `B`.
pub struct VisionTower<B: Backend> {
    cfg: VisionConfig,
    patch_embed: Lin<B>,
    blocks: Vec<Block<B>>,
    merge_norm: B::Vector,
    proj1: Lin<B>,
    proj2: Lin<B>,
    /// The decoder's width: the width of every output row.
    out_width: usize,
}

impl<B: Backend> VisionTower<B> {
    /// Load the tensors `vision_tower.*` and `multi_modal_projector.*` (bf16, f16 or f32).
    pub fn load(
        cfg: &VisionConfig,
        decoder_hidden: usize,
        t: &Tensors<'_>,
        be: &B,
    ) -> Result<Self, WeightError> {
        let (w, m, d) = (cfg.hidden_size, cfg.intermediate_size, decoder_hidden);
        let patch = cfg.patch_size * cfg.patch_size * CHANNELS;
        let merged = cfg.merge_size * cfg.merge_size * w;
        let vec = |name: &str, n: usize| -> Result<B::Vector, WeightError> {
            Ok(be.vector(t.f32(name, &[n])?)?)
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("vision_tower.blocks.{i}");
                Ok(Block {
                    norm1: vec(&format!("{p}.norm1"), w)?,
                    qkv: Lin::load(be, t, &format!("{p}.qkv"), 3 * w, w)?,
                    proj: Lin::load(be, t, &format!("{p}.proj"), w, w)?,
                    norm2: vec(&format!("{p}.norm2"), w)?,
                    fc1: Lin::load(be, t, &format!("{p}.fc1"), m, w)?,
                    fc2: Lin::load(be, t, &format!("{p}.fc2"), w, m)?,
                })
            })
            .collect::<Result<Vec<_>, WeightError>>()?;
        Ok(Self {
            cfg: cfg.clone(),
            patch_embed: Lin::load(be, t, "vision_tower.patch_embed", w, patch)?,
            blocks,
            merge_norm: vec("multi_modal_projector.merge_norm", merged)?,
            proj1: Lin::load(be, t, "multi_modal_projector.proj1", d, merged)?,
            proj2: Lin::load(be, t, "multi_modal_projector.proj2", d, d)?,
            out_width: d,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// The patch grid `(rows, cols)` of `img`, or why the tower cannot take it.
    pub fn grid(&self, img: &ImagePixels) -> Result<(usize, usize), ExecError> {
        let side = self.cfg.token_side();
        let (h, w) = (img.height, img.width);
        if h == 0 || w == 0 || !h.is_multiple_of(side) || !w.is_multiple_of(side) {
            return Err(ExecError::InvalidBatch(format!(
                "a {w}x{h} image: each side must be a positive multiple of {side}"
            )));
        }
        if img.pixels.len() != CHANNELS * h * w {
            return Err(ExecError::InvalidBatch(format!(
                "a {w}x{h} image with {} pixel values (expected {})",
                img.pixels.len(),
                CHANNELS * h * w
            )));
        }
        Ok((h / self.cfg.patch_size, w / self.cfg.patch_size))
    }

    /// Image tokens (output rows) of `img`.
    pub fn tokens(&self, img: &ImagePixels) -> Result<usize, ExecError> {
        let (gh, gw) = self.grid(img)?;
        let m = self.cfg.merge_size;
        Ok((gh / m) * (gw / m))
    }

    /// The patch vectors `[gh·gw, p·p·3]` of `img`: patches in row-major order over the grid,
    /// each flattened (row in patch, column in patch, channel) from the CHW pixels.
    pub fn patches(&self, img: &ImagePixels) -> Result<Vec<f32>, ExecError> {
        let (gh, gw) = self.grid(img)?;
        let (p, h, w) = (self.cfg.patch_size, img.height, img.width);
        let mut out = Vec::with_capacity(img.pixels.len());
        for pr in 0..gh {
            for pc in 0..gw {
                for r in 0..p {
                    let y = pr * p + r;
                    for c in 0..p {
                        let x = pc * p + c;
                        for ch in 0..CHANNELS {
                            out.push(img.pixels[(ch * h + y) * w + x]);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// The tower's output rows `[tokens, decoder hidden]` for `img`.
    pub fn encode(&self, be: &B, img: &ImagePixels) -> Result<B::Act, ExecError> {
        self.encode_traced(be, img, None)
    }

    /// [`VisionTower::encode`], also pushing to `trace` (golden tests) the patch embeddings, the
    /// residual stream after each block and the merged rows before `merge_norm`.
    pub fn encode_traced(
        &self,
        be: &B,
        img: &ImagePixels,
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<B::Act, ExecError> {
        let (gh, gw) = self.grid(img)?;
        let c = &self.cfg;
        let eps = c.rms_norm_eps;
        let n = gh * gw;
        let x = be.upload_act(
            n,
            c.patch_size * c.patch_size * CHANNELS,
            self.patches(img)?,
        )?;
        let mut x = self.patch_embed.apply(be, &x)?;
        let mut record = |a: &B::Act| -> OpResult<()> {
            if let Some(t) = trace.as_deref_mut() {
                t.push(be.to_host(a)?);
            }
            Ok(())
        };
        record(&x)?;
        let geom = VisionAttnGeom {
            heads: c.num_attention_heads,
            head_dim: c.head_dim(),
            grid_h: gh,
            grid_w: gw,
            rope_theta: c.rope_theta,
        };
        for b in &self.blocks {
            let qkv = b.qkv.apply(be, &be.rms_norm(&x, &b.norm1, eps)?)?;
            let o = be.vision_attention(&qkv, geom)?;
            be.add_assign(&mut x, &b.proj.apply(be, &o)?)?;
            let mut f = b.fc1.apply(be, &be.rms_norm(&x, &b.norm2, eps)?)?;
            be.gelu_tanh(&mut f)?;
            be.add_assign(&mut x, &b.fc2.apply(be, &f)?)?;
            record(&x)?;
        }
        let m = be.merge_patches(&x, gh, gw, c.merge_size)?;
        record(&m)?;
        let mut y = self
            .proj1
            .apply(be, &be.rms_norm(&m, &self.merge_norm, eps)?)?;
        be.gelu_tanh(&mut y)?;
        Ok(self.proj2.apply(be, &y)?)
    }

    pub fn out_width(&self) -> usize {
        self.out_width
    }
}

/// The key of a cached tower output: the content hash and the size it was computed for.
type MediaKey = ([u8; 32], usize, usize);

fn key_of(img: &ImagePixels) -> MediaKey {
    (img.content_hash, img.height, img.width)
}

/// Recently encoded images' tower outputs, most recent first.
pub struct MediaCache<B: Backend> {
    entries: Mutex<VecDeque<(MediaKey, B::Act)>>,
    capacity: usize,
    encoded: std::sync::atomic::AtomicUsize,
}

impl<B: Backend> MediaCache<B> {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(VecDeque::new()),
            capacity,
            encoded: Default::default(),
        }
    }

    /// Images encoded by the tower so far (cache misses): what the splice tests count.
    pub fn encoded(&self) -> usize {
        self.encoded.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn take(&self, key: &MediaKey) -> Option<B::Act> {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let at = e.iter().position(|(k, _)| k == key)?;
        e.remove(at).map(|(_, a)| a)
    }

    fn put_back(&self, items: Vec<(MediaKey, B::Act)>) {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        for item in items.into_iter().rev() {
            e.push_front(item);
        }
        e.truncate(self.capacity);
    }
}

/// One run of rows of a step that take tower output instead of token embeddings.
struct Splice<'a> {
    /// First row in the step's stacked rows.
    row: usize,
    len: usize,
    /// First row of the image's tower output.
    src_row: usize,
    image: &'a ImagePixels,
}

/// The spliced rows of this step: every image's span checked (against the tower and against
/// the sequence's other images), and the runs of this step's rows inside a span.
/// `seqs[k] = (start_pos, new tokens, media)`, `spans[k]` its stacked rows.
fn plan<'a, B: Backend>(
    tower: Option<&VisionTower<B>>,
    seqs: &[(usize, usize, &'a [MediaInput])],
    spans: &[(usize, usize)],
) -> Result<Vec<Splice<'a>>, ExecError> {
    let mut out = Vec::new();
    for (&(start, n, media), &(row0, _)) in seqs.iter().zip(spans) {
        if media.is_empty() {
            continue;
        }
        let tower = tower.ok_or_else(|| {
            ExecError::InvalidBatch("the batch has images, this model has no vision tower".into())
        })?;
        let mut by_pos: Vec<&MediaInput> = media.iter().collect();
        by_pos.sort_by_key(|m| m.position);
        for pair in by_pos.windows(2) {
            if pair[0].span().end > pair[1].position {
                return Err(ExecError::InvalidBatch(format!(
                    "images at positions {} and {} overlap",
                    pair[0].position, pair[1].position
                )));
            }
        }
        for m in by_pos {
            let want = tower.tokens(&m.image)?;
            if m.tokens != want {
                return Err(ExecError::InvalidBatch(format!(
                    "the {}x{} image at position {} spans {} tokens; the vision tower gives {want}",
                    m.image.width, m.image.height, m.position, m.tokens
                )));
            }
            let (a, b) = (m.position.max(start), m.span().end.min(start + n));
            if a < b {
                out.push(Splice {
                    row: row0 + (a - start),
                    len: b - a,
                    src_row: a - m.position,
                    image: &m.image,
                });
            }
        }
    }
    out.sort_by_key(|s| s.row);
    Ok(out)
}

/// `embedded` (the step's token embeddings, stacked) with the rows inside image spans
/// replaced by the tower's output rows, encoding only images not in `cache`.
pub(crate) fn splice<B: Backend>(
    be: &B,
    tower: Option<&VisionTower<B>>,
    cache: &MediaCache<B>,
    embedded: B::Act,
    seqs: &[(usize, usize, &[MediaInput])],
    spans: &[(usize, usize)],
) -> Result<B::Act, ExecError> {
    let runs = plan(tower, seqs, spans)?;
    let Some(tower) = tower.filter(|_| !runs.is_empty()) else {
        return Ok(embedded);
    };
    // This step's images, taken out of the cache (or encoded) and put back afterwards,
    // most recently used first.
    let mut local: Vec<(MediaKey, B::Act)> = Vec::new();
    let result = (|| {
        for r in &runs {
            let key = key_of(r.image);
            if local.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let act = match cache.take(&key) {
                Some(a) => a,
                None => {
                    cache
                        .encoded
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tower.encode(be, r.image)?
                }
            };
            local.push((key, act));
        }
        let mut pieces: Vec<B::Act> = Vec::with_capacity(2 * runs.len() + 1);
        let mut at = 0;
        for r in &runs {
            if r.row > at {
                pieces.push(be.slice_rows(&embedded, at, r.row)?);
            }
            let key = key_of(r.image);
            let (_, act) = local
                .iter()
                .find(|(k, _)| *k == key)
                .expect("every run's image was encoded above");
            pieces.push(be.slice_rows(act, r.src_row, r.src_row + r.len)?);
            at = r.row + r.len;
        }
        let total = be.rows(&embedded);
        if at < total {
            pieces.push(be.slice_rows(&embedded, at, total)?);
        }
        Ok(be.concat_rows(&pieces.iter().collect::<Vec<_>>())?)
    })();
    cache.put_back(local);
    result
}
