//! CPU backend for k3-model: f32 compute, AVX-512 where available, rayon threads.
//!
//! Dense weights arrive as f32 (k3-model widens bf16 once at load — for k3-mini that is ~90 MB
//! and the kernels then stream plain f32); routed experts stay MXFP4 and are decoded on the fly.

pub mod fastmath;
pub mod gemm;
pub mod kda;
pub mod kda_replay;
pub mod linalg;
pub mod mla;
pub mod mxfp4;
pub mod ops;
pub(crate) mod simd;
pub mod vision;

use k3_model::backend::{
    Backend, KdaGeom, KdaInputs, KdaParams, KdaStateLoc, MlaCacheLoc, MlaGeom, MxExpertsHost,
    RouterParams, SituParams, VisionAttnGeom, merge_patches_shape,
};
use k3_model::backend::{BackendError, KdaCommit, OpResult};
use mxfp4::{MxMatrix, mx_matmul, split_even_odd};
use rayon::prelude::*;

/// Row-major f32 activations `[rows, cols]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Mat {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "Mat data does not match its shape");
        Self { rows, cols, data }
    }
}

/// Dense weight `[rows = out, cols = in]`, packed for [`gemm`]; small matrices also keep their
/// row-major form (MLA's `kv_b` is read row-wise by the absorbed decode).
#[derive(Debug, Clone)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub packed: gemm::Packed,
    pub raw: Option<Vec<f32>>,
}

impl Linear {
    /// Row-major data (reconstructed from the panels when not kept).
    pub fn row_major(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.raw {
            Some(r) => std::borrow::Cow::Borrowed(r),
            None => {
                std::borrow::Cow::Owned((0..self.rows).flat_map(|j| self.packed.row(j)).collect())
            }
        }
    }
}

/// Tokens routed to one expert in one pass from which its MXFP4 matrices are decoded into
/// GEMM panels instead of being decoded inside every dot product.
const DENSE_EXPERT_MIN_TOKENS: usize = 16;

/// Matrices up to this many values keep a row-major copy next to the packed one.
const KEEP_RAW_MAX: usize = 1 << 18;

/// Routed experts of one layer.
pub struct Experts {
    pub latent: usize,
    pub inter: usize,
    pub w1: Vec<MxMatrix>,
    pub w3: Vec<MxMatrix>,
    pub w2: Vec<MxMatrix>,
}

/// The arena: f32 storage addressed in bytes (all offsets the model uses are 4-aligned).
pub struct Arena {
    data: Vec<f32>,
}

impl Arena {
    fn bytes(&self) -> &[u8] {
        // SAFETY: f32 storage viewed as bytes: u8 has alignment 1 and the length is exact.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.data.len() * 4) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; every byte pattern is a valid f32, so writes cannot create invalid values.
        unsafe {
            std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, self.data.len() * 4)
        }
    }
    pub fn floats(&self) -> &[f32] {
        &self.data
    }
    pub fn floats_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}

fn floats_at(byte_offset: usize) -> OpResult<usize> {
    if !byte_offset.is_multiple_of(4) {
        return Err(BackendError::InvalidArg(format!(
            "offset {byte_offset} is not 4-byte aligned"
        )));
    }
    Ok(byte_offset / 4)
}

/// `len` bytes at `offset` lie inside the arena.
fn byte_range(arena: &Arena, offset: usize, len: usize) -> OpResult<()> {
    if offset
        .checked_add(len)
        .is_none_or(|e| e > arena.data.len() * 4)
    {
        return Err(BackendError::OutOfBounds {
            offset,
            len,
            arena: arena.data.len() * 4,
        });
    }
    Ok(())
}

fn same_shape(a: &Mat, b: &Mat, what: &str) -> OpResult<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(BackendError::InvalidArg(format!(
            "{what}: {}x{} vs {}x{}",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

fn bounds(arena: &Arena, float_off: usize, len: usize) -> OpResult<()> {
    if float_off + len > arena.data.len() {
        return Err(BackendError::OutOfBounds {
            offset: float_off * 4,
            len: len * 4,
            arena: arena.data.len() * 4,
        });
    }
    Ok(())
}

/// A row-wise op over `rows` rows, split across threads for prefill-sized inputs. Each row's
/// result is computed the same way whatever the split.
fn by_rows(rows: usize, f: impl Fn(std::ops::Range<usize>) -> Vec<f32> + Sync) -> Vec<f32> {
    const MIN_ROWS: usize = 64;
    let threads = rayon::current_num_threads();
    if rows < 2 * MIN_ROWS || threads == 1 {
        return f(0..rows);
    }
    let per = rows.div_ceil(threads);
    let starts: Vec<usize> = (0..rows).step_by(per).collect();
    let parts: Vec<Vec<f32>> = starts
        .into_par_iter()
        .map(|a| f(a..(a + per).min(rows)))
        .collect();
    parts.concat()
}

fn kda_dims(g: KdaGeom) -> kda::Dims {
    kda::Dims {
        heads: g.heads,
        k: g.head_dim,
        conv: g.conv_kernel,
        lower_bound: g.gate_lower_bound,
    }
}

/// A speculative verify of one KDA layer (`KdaStateLoc::record`): the state at float offset
/// `off` is only read; the outputs come back and the ReplaySSM record goes to byte offset `dst`.
fn kda_verify(
    arena: &mut Arena,
    d: &kda::Dims,
    p: &KdaParams<'_, CpuBackend>,
    inp: &KdaInputs<'_, CpuBackend>,
    off: usize,
    dst: usize,
    checkpoints: &[(usize, usize)],
) -> OpResult<Mat> {
    if !checkpoints.is_empty() {
        return Err(BackendError::InvalidArg(
            "kda: a verify pass takes no checkpoints (it writes no state)".into(),
        ));
    }
    let t = inp.qkv[0].rows;
    let n = d.state_floats();
    let rec = floats_at(dst)?;
    let per_token = d.heads * (3 * d.k + 1) + 3 * d.hk();
    bounds(arena, rec, t * per_token)?;
    if off < rec + t * per_token && rec < off + n {
        return Err(BackendError::InvalidArg(
            "kda: the verify record overlaps the state".into(),
        ));
    }
    let (windows, s) = arena.data[off..off + n].split_at(3 * d.window_floats());
    let (o, record) = kda_replay::verify_layer(
        d,
        t,
        [&inp.qkv[0].data, &inp.qkv[1].data, &inp.qkv[2].data],
        [p.conv[0], p.conv[1], p.conv[2]],
        &inp.f.data,
        &inp.b.data,
        p.a_log,
        p.dt_bias,
        windows,
        s,
    );
    debug_assert_eq!(record.floats(), t * per_token);
    record.write_to(&mut arena.data[rec..rec + t * per_token]);
    Ok(Mat::new(t, d.hk(), o))
}

#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        Self
    }
}

impl Backend for CpuBackend {
    type Act = Mat;
    type Linear = Linear;
    type Vector = Vec<f32>;
    type Experts = Experts;
    type Arena = Arena;

    fn linear(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<Linear> {
        if data.len() != rows * cols {
            return Err(BackendError::InvalidArg(format!(
                "{} values for a {rows}x{cols} matrix",
                data.len()
            )));
        }
        let packed = gemm::Packed::new(&data, rows, cols).with_bf16();
        Ok(Linear {
            rows,
            cols,
            packed,
            raw: (data.len() <= KEEP_RAW_MAX).then_some(data),
        })
    }

    fn vector(&self, data: Vec<f32>) -> OpResult<Vec<f32>> {
        Ok(data)
    }

    fn experts(&self, h: MxExpertsHost) -> OpResult<Experts> {
        let conv = |v: Vec<k3_model::backend::MxMatrixHost>| -> Vec<MxMatrix> {
            v.into_iter()
                .map(|m| MxMatrix::new(m.rows, m.cols, m.packed, &m.scales))
                .collect()
        };
        Ok(Experts {
            latent: h.latent,
            inter: h.inter,
            w1: conv(h.w1),
            w3: conv(h.w3),
            w2: conv(h.w2),
        })
    }

    fn arena(&self, bytes: usize) -> OpResult<Arena> {
        Ok(Arena {
            data: vec![0f32; bytes / 4],
        })
    }

    fn arena_len(&self, arena: &Arena) -> usize {
        arena.data.len() * 4
    }

    fn arena_copy(&self, arena: &mut Arena, src: usize, dst: usize, len: usize) -> OpResult<()> {
        byte_range(arena, src, len)?;
        byte_range(arena, dst, len)?;
        arena.bytes_mut().copy_within(src..src + len, dst);
        Ok(())
    }

    fn arena_zero(&self, arena: &mut Arena, offset: usize, len: usize) -> OpResult<()> {
        byte_range(arena, offset, len)?;
        arena.bytes_mut()[offset..offset + len].fill(0);
        Ok(())
    }

    fn arena_read(&self, arena: &Arena, offset: usize, len: usize) -> OpResult<Vec<u8>> {
        byte_range(arena, offset, len)?;
        Ok(arena.bytes()[offset..offset + len].to_vec())
    }

    fn to_host(&self, a: &Mat) -> OpResult<Vec<f32>> {
        Ok(a.data.clone())
    }

    fn rows(&self, a: &Mat) -> usize {
        a.rows
    }

    fn slice_rows(&self, a: &Mat, start: usize, end: usize) -> OpResult<Mat> {
        if start > end || end > a.rows {
            return Err(BackendError::InvalidArg(format!(
                "rows {start}..{end} of a {}-row matrix",
                a.rows
            )));
        }
        Ok(Mat::new(
            end - start,
            a.cols,
            a.data[start * a.cols..end * a.cols].to_vec(),
        ))
    }

    fn concat_rows(&self, parts: &[&Mat]) -> OpResult<Mat> {
        let cols = parts.first().map_or(0, |m| m.cols);
        let mut data = Vec::with_capacity(parts.iter().map(|m| m.data.len()).sum());
        for m in parts {
            if m.cols != cols {
                return Err(BackendError::InvalidArg(
                    "concat_rows: widths differ".into(),
                ));
            }
            data.extend_from_slice(&m.data);
        }
        Ok(Mat::new(data.len() / cols.max(1), cols, data))
    }

    fn embed(&self, table: &Linear, ids: &[u32]) -> OpResult<Mat> {
        let d = table.cols;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(BackendError::InvalidArg(format!(
                "token id {id} outside the vocabulary of {}",
                table.rows
            )));
        }
        let mut data = Vec::with_capacity(ids.len() * d);
        for &i in ids {
            match &table.raw {
                Some(r) => data.extend_from_slice(&r[i as usize * d..(i as usize + 1) * d]),
                None => data.extend(table.packed.row(i as usize)),
            }
        }
        Ok(Mat::new(ids.len(), d, data))
    }

    fn matmul(&self, x: &Mat, w: &Linear) -> OpResult<Mat> {
        if x.cols != w.cols {
            return Err(BackendError::InvalidArg(format!(
                "matmul: x {}x{} with W {}x{}",
                x.rows, x.cols, w.rows, w.cols
            )));
        }
        Ok(Mat::new(
            x.rows,
            w.rows,
            gemm::gemm(&x.data, x.rows, &w.packed),
        ))
    }

    fn rms_norm(&self, x: &Mat, w: &Vec<f32>, eps: f32) -> OpResult<Mat> {
        let c = x.cols;
        Ok(Mat::new(
            x.rows,
            c,
            by_rows(x.rows, |r| {
                ops::rms_norm(&x.data[r.start * c..r.end * c], w, eps)
            }),
        ))
    }

    fn add_assign(&self, p: &mut Mat, a: &Mat) -> OpResult<()> {
        same_shape(p, a, "add_assign")?;
        p.data.iter_mut().zip(&a.data).for_each(|(x, y)| *x += y);
        Ok(())
    }

    fn upload_act(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<Mat> {
        if data.len() != rows * cols {
            return Err(BackendError::InvalidArg(format!(
                "{} values for a {rows}x{cols} activation",
                data.len()
            )));
        }
        Ok(Mat::new(rows, cols, data))
    }

    fn add_bias(&self, x: &mut Mat, b: &Vec<f32>) -> OpResult<()> {
        if b.len() != x.cols {
            return Err(BackendError::InvalidArg(format!(
                "add_bias: bias {} for width {}",
                b.len(),
                x.cols
            )));
        }
        for row in x.data.chunks_exact_mut(x.cols.max(1)) {
            row.iter_mut().zip(b).for_each(|(y, c)| *y += c);
        }
        Ok(())
    }

    fn gelu_tanh(&self, x: &mut Mat) -> OpResult<()> {
        x.data
            .par_chunks_mut(4096)
            .for_each(|c| c.iter_mut().for_each(|v| *v = vision::gelu_tanh(*v)));
        Ok(())
    }

    fn vision_attention(&self, qkv: &Mat, g: VisionAttnGeom) -> OpResult<Mat> {
        g.check(qkv.rows, qkv.cols)?;
        Ok(Mat::new(
            qkv.rows,
            g.heads * g.head_dim,
            vision::attention(&qkv.data, g),
        ))
    }

    fn merge_patches(&self, x: &Mat, grid_h: usize, grid_w: usize, merge: usize) -> OpResult<Mat> {
        let (rows, cols) = merge_patches_shape(x.rows, x.cols, grid_h, grid_w, merge)?;
        Ok(Mat::new(
            rows,
            cols,
            vision::merge(&x.data, x.cols, grid_h, grid_w, merge),
        ))
    }

    fn attn_res(&self, sources: &[&Mat], w: &Vec<f32>, eps: f32) -> OpResult<Mat> {
        let first = sources
            .first()
            .ok_or_else(|| BackendError::InvalidArg("attn_res with no sources".into()))?;
        for s in sources {
            same_shape(first, s, "attn_res")?;
        }
        let (rows, c) = (first.rows, first.cols);
        Ok(Mat::new(
            rows,
            c,
            by_rows(rows, |r| {
                let src: Vec<&[f32]> = sources
                    .iter()
                    .map(|m| &m.data[r.start * c..r.end * c])
                    .collect();
                ops::attn_res(&src, w, eps)
            }),
        ))
    }

    fn situ_glu(&self, gate: &Mat, up: &Mat, p: SituParams) -> OpResult<Mat> {
        same_shape(gate, up, "situ_glu")?;
        let c = gate.cols;
        Ok(Mat::new(
            gate.rows,
            c,
            by_rows(gate.rows, |r| {
                let rg = r.start * c..r.end * c;
                ops::situ_glu(&gate.data[rg.clone()], &up.data[rg], p.beta, p.linear_beta)
            }),
        ))
    }

    fn sigmoid_mul(&self, o: &mut Mat, gate: &Mat) -> OpResult<()> {
        same_shape(o, gate, "sigmoid_mul")?;
        o.data
            .iter_mut()
            .zip(&gate.data)
            .for_each(|(x, g)| *x *= fastmath::sigmoid(*g));
        Ok(())
    }

    fn gated_head_norm(
        &self,
        o: &Mat,
        gate: &Mat,
        w: &Vec<f32>,
        head_dim: usize,
        eps: f32,
    ) -> OpResult<Mat> {
        same_shape(o, gate, "gated_head_norm")?;
        if w.len() != head_dim {
            return Err(BackendError::InvalidArg(format!(
                "gated_head_norm: weight {} for head_dim {head_dim}",
                w.len()
            )));
        }
        let c = o.cols;
        Ok(Mat::new(
            o.rows,
            c,
            by_rows(o.rows, |r| {
                let rg = r.start * c..r.end * c;
                ops::gated_head_norm(&o.data[rg.clone()], &gate.data[rg], w, eps)
            }),
        ))
    }

    fn kda(
        &self,
        arena: &mut Arena,
        g: KdaGeom,
        p: &KdaParams<'_, Self>,
        inp: &KdaInputs<'_, Self>,
        loc: KdaStateLoc<'_>,
    ) -> OpResult<Mat> {
        let d = kda_dims(g);
        let t = inp.qkv[0].rows;
        let n = d.state_floats();
        let off = floats_at(loc.offset)?;
        bounds(arena, off, n)?;
        if let Some(dst) = loc.record {
            return kda_verify(arena, &d, p, inp, off, dst, loc.checkpoints);
        }
        let mut cps: Vec<(usize, usize)> = Vec::with_capacity(loc.checkpoints.len());
        for &(at, dst) in loc.checkpoints {
            let f = floats_at(dst)?;
            bounds(arena, f, n)?;
            cps.push((at, f));
        }
        cps.sort_unstable();
        let cuts: Vec<usize> = cps.iter().map(|c| c.0).collect();
        let (o, snaps) = kda::kda_layer(
            &d,
            t,
            [&inp.qkv[0].data, &inp.qkv[1].data, &inp.qkv[2].data],
            [p.conv[0], p.conv[1], p.conv[2]],
            &inp.f.data,
            &inp.b.data,
            p.a_log,
            p.dt_bias,
            &mut arena.data[off..off + n],
            &cuts,
        );
        for ((_, dst), snap) in cps.iter().zip(snaps) {
            arena.data[*dst..*dst + n].copy_from_slice(&snap);
        }
        Ok(Mat::new(t, d.hk(), o))
    }

    fn supports_kda_verify(&self) -> bool {
        true
    }

    fn verify_rows_as_decode(&self) -> bool {
        true
    }

    fn max_verify_tokens(&self) -> Option<usize> {
        Some(DENSE_EXPERT_MIN_TOKENS - 1)
    }

    fn kda_commit(&self, arena: &mut Arena, g: KdaGeom, commits: &[KdaCommit]) -> OpResult<()> {
        let d = kda_dims(g);
        let (n, wf) = (d.state_floats(), 3 * d.window_floats());
        for c in commits {
            if c.accepted > c.tokens {
                return Err(BackendError::InvalidArg(format!(
                    "kda_commit: {} accepted of {} verified tokens",
                    c.accepted, c.tokens
                )));
            }
            let (off, rec) = (floats_at(c.state)?, floats_at(c.record)?);
            let rec_len = c.tokens * g.record_floats_per_token();
            bounds(arena, off, n)?;
            bounds(arena, rec, rec_len)?;
            if off < rec + rec_len && rec < off + n {
                return Err(BackendError::InvalidArg(
                    "kda_commit: the record overlaps the state".into(),
                ));
            }
            let record =
                kda_replay::VerifyRecord::read_from(d, c.tokens, &arena.data[rec..rec + rec_len]);
            let (windows, s) = arena.data[off..off + n].split_at_mut(wf);
            kda_replay::commit_layer(s, windows, &record, c.accepted);
        }
        Ok(())
    }

    fn mla(
        &self,
        arena: &mut Arena,
        g: MlaGeom,
        q: &Mat,
        kv_a: &Mat,
        kv_norm: &Vec<f32>,
        kv_b: &Linear,
        loc: MlaCacheLoc<'_>,
    ) -> OpResult<Mat> {
        let d = mla::Dims {
            heads: g.heads,
            nope: g.nope,
            rope: g.rope,
            v_dim: g.v_dim,
            kv_lora: g.kv_lora,
        };
        let (t, row) = (q.rows, d.row());
        let end = loc.start_pos + t;
        let npages = end.div_ceil(loc.page_tokens);
        if loc.pages.len() < npages {
            return Err(BackendError::InvalidArg(format!(
                "{} KV pages for {end} positions",
                loc.pages.len()
            )));
        }
        let mut starts = Vec::with_capacity(npages);
        for &p in &loc.pages[..npages] {
            let f = floats_at(p + loc.layer_offset)?;
            bounds(arena, f, loc.page_tokens * row)?;
            starts.push(f);
        }
        let pages = mla::Pages {
            starts: &starts,
            page_tokens: loc.page_tokens,
        };
        // Append the new latent rows [RMSNorm(c_kv) ; k_r].
        for i in 0..t {
            let src = &kv_a.data[i * row..(i + 1) * row];
            let off = pages.row_offset(loc.start_pos + i, row);
            let normed = ops::rms_norm(&src[..d.kv_lora], kv_norm, g.eps);
            arena.data[off..off + d.kv_lora].copy_from_slice(&normed);
            arena.data[off + d.kv_lora..off + row].copy_from_slice(&src[d.kv_lora..]);
        }
        let o = if t == 1 {
            mla::attend_absorbed(&d, &q.data, end, &arena.data, &pages, &kv_b.row_major())
        } else {
            let lat = mla::gather(&arena.data, &pages, end, row);
            mla::attend_naive(&d, &q.data, t, loc.start_pos, &lat, &kv_b.row_major())
        };
        Ok(Mat::new(t, g.heads * g.v_dim, o))
    }

    /// Sequence by sequence: an expert's kernel depends on how many tokens it gets
    /// (`DENSE_EXPERT_MIN_TOKENS`), so grouping across sequences would make a sequence's
    /// results depend on the batch.
    fn moe_routed_batch(
        &self,
        z: &Mat,
        logits: &Mat,
        bias: &Vec<f32>,
        ex: &Experts,
        r: RouterParams,
        situ: SituParams,
        spans: &[(usize, usize)],
    ) -> OpResult<Mat> {
        if spans.len() <= 1 {
            return self.moe_routed(z, logits, bias, ex, r, situ);
        }
        let parts = spans
            .iter()
            .map(|&(r0, r1)| {
                let (z, l) = (
                    self.slice_rows(z, r0, r1)?,
                    self.slice_rows(logits, r0, r1)?,
                );
                self.moe_routed(&z, &l, bias, ex, r, situ)
            })
            .collect::<OpResult<Vec<Mat>>>()?;
        self.concat_rows(&parts.iter().collect::<Vec<_>>())
    }

    fn moe_routed(
        &self,
        z: &Mat,
        logits: &Mat,
        bias: &Vec<f32>,
        ex: &Experts,
        r: RouterParams,
        situ: SituParams,
    ) -> OpResult<Mat> {
        if z.cols != ex.latent || logits.cols != ex.w1.len() || z.rows != logits.rows {
            return Err(BackendError::InvalidArg(
                "moe_routed: z / logits / experts shapes differ".into(),
            ));
        }
        let (t, lt, k) = (z.rows, ex.latent, r.top_k);
        let (idx, wts) = ops::route(&logits.data, bias, k, r.renormalize, r.scaling);
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); ex.w1.len()];
        for (slot, &e) in idx.iter().enumerate() {
            by_expert[e].push(slot);
        }
        let zs = split_even_odd(&z.data, lt);
        let work: Vec<(usize, &Vec<usize>)> = by_expert
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .collect();
        let run = |&(e, slots): &(usize, &Vec<usize>)| -> (Vec<usize>, Vec<f32>) {
            let m = slots.len();
            // Few tokens: decode MXFP4 inside the dot products. Many (prefill): decode each
            // matrix once into GEMM panels, which is cheaper per token.
            let dense = m >= DENSE_EXPERT_MIN_TOKENS;
            let src = if dense { &z.data } else { &zs };
            let mut x = Vec::with_capacity(m * lt);
            for &s in slots {
                let tok = s / k;
                x.extend_from_slice(&src[tok * lt..(tok + 1) * lt]);
            }
            let y = if dense {
                let h1 = gemm::gemm_serial_vec(&x, m, &ex.w1[e].to_packed());
                let h3 = gemm::gemm_serial_vec(&x, m, &ex.w3[e].to_packed());
                let act = ops::situ_glu(&h1, &h3, situ.beta, situ.linear_beta);
                gemm::gemm_serial_vec(&act, m, &ex.w2[e].to_packed())
            } else {
                let mut h1 = vec![0f32; m * ex.inter];
                let mut h3 = vec![0f32; m * ex.inter];
                mx_matmul(&x, m, &ex.w1[e], &mut h1);
                mx_matmul(&x, m, &ex.w3[e], &mut h3);
                let act = split_even_odd(
                    &ops::situ_glu(&h1, &h3, situ.beta, situ.linear_beta),
                    ex.inter,
                );
                let mut y = vec![0f32; m * lt];
                mx_matmul(&act, m, &ex.w2[e], &mut y);
                y
            };
            (slots.clone(), y)
        };
        let results: Vec<(Vec<usize>, Vec<f32>)> = if t * k >= 16 {
            work.par_iter().map(run).collect()
        } else {
            work.iter().map(run).collect()
        };
        // Per (token, slot) expert outputs, then a fixed-order weighted sum per token.
        let mut per_slot = vec![0f32; t * k * lt];
        for (slots, y) in results {
            for (i, s) in slots.iter().enumerate() {
                per_slot[s * lt..(s + 1) * lt].copy_from_slice(&y[i * lt..(i + 1) * lt]);
            }
        }
        let mut out = vec![0f32; t * lt];
        for tok in 0..t {
            let o = &mut out[tok * lt..(tok + 1) * lt];
            for s in tok * k..(tok + 1) * k {
                let w = wts[s];
                for (y, v) in o.iter_mut().zip(&per_slot[s * lt..(s + 1) * lt]) {
                    *y += w * v;
                }
            }
        }
        Ok(Mat::new(t, lt, out))
    }
}
