//! Gated-NoPE MLA over the paged latent cache (docs/k3-model.md): every sequence's short spans as
//! items of one absorbed launch sequence (append the latent rows, absorb W_UK into q, attend,
//! merge the position splits, W_UV), spans of 64+ new tokens through the expanded form
//! (prefill.rs).

pub mod prefill;

use crate::device::{CudaBackend, DeviceLinear, DeviceMat};
use crate::dispatch::MlaAttend;
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::launch::{float_offset, i32_of};
use cudarc::driver::CudaSlice;
use k3_model::backend::{MlaCacheLoc, MlaGeom};

/// `mla_absorbed`'s kv_b for the W_UK / W_UV products: bf16 as stored, or f32.
#[derive(Clone, Copy)]
enum KvB<'a> {
    Bf16(&'a CudaSlice<u16>),
    F32(&'a CudaSlice<f32>),
}

/// Tiles the f32 MLA attend prefetches into L2 ahead of the one it reads.
const MLA_TC_PREFETCH_TILES: i32 = 4;

impl CudaBackend {
    /// Absorbed MLA for `q` `[items, H·(nope+rope)]`: appends `kv_a` rows (one per item, at
    /// `append_at` byte offsets) and attends item i over `lens[i]` rows whose page starts (byte
    /// offsets including the layer offset) are `pages[i]`. Returns `o` `[items, H·v_dim]`. A bf16
    /// `kv_b` is read as stored (`mla_bf16_products` shapes); an f32 one (or another shape) goes
    /// through its f32 storage / copy and the f32 kernels.
    pub fn mla_absorbed(
        &self,
        arena: &mut CudaSlice<f32>,
        g: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        append_at: &[usize],
        pages: &[&[usize]],
        lens: &[usize],
        page_tokens: usize,
    ) -> Result<DeviceMat> {
        geometry::check_mla(&g)?;
        let (items, row, len) = (q.rows, g.row(), arena.len());
        if kv_a.rows != append_at.len()
            || kv_a.cols != row
            || pages.len() != items
            || lens.len() != items
        {
            return Err(CudaError::InvalidArg(
                "mla_absorbed: inconsistent item counts or row width".into(),
            ));
        }
        if q.cols != g.heads * (g.nope + g.rope)
            || kv_b.rows != g.heads * (g.nope + g.v_dim)
            || kv_b.cols != g.kv_lora
        {
            return Err(CudaError::InvalidArg(
                "mla_absorbed: q or kv_b shape".into(),
            ));
        }
        if page_tokens == 0 {
            return Err(CudaError::InvalidArg("page_tokens = 0".into()));
        }
        let dst: Vec<i64> = append_at
            .iter()
            .map(|&o| float_offset(o, row, len))
            .collect::<Result<_>>()?;
        let mut starts = Vec::new();
        let mut base = Vec::with_capacity(items);
        for (p, &l) in pages.iter().zip(lens) {
            if l == 0 || p.len() < l.div_ceil(page_tokens) {
                return Err(CudaError::InvalidArg(format!(
                    "{} pages for {l} positions",
                    p.len()
                )));
            }
            base.push(i32_of(starts.len(), "page table")?);
            for &s in &p[..l.div_ceil(page_tokens)] {
                starts.push(float_offset(s, page_tokens * row, len)?);
            }
        }
        // Splits from the longest length rounded up to a power of two, positions per split
        // from each item's own length (chunk 0, mla.cu): the launch then changes only when the
        // bucket does, not every step (graph.rs replays a step only if its launches are equal).
        let max_len = lens.iter().copied().max().unwrap_or(1).next_power_of_two();
        let attend = crate::dispatch::mla_attend(self.options.dtype, &self.limits);
        let sms = self.multiprocessors;
        let splits = match attend {
            MlaAttend::F32 => geometry::mla_splits_f32(items, g.heads, max_len, sms).0,
            MlaAttend::Bf16Mma => geometry::mla_splits_bf16(items, g.heads, max_len, sms),
            MlaAttend::PairWgmma => geometry::mla_splits_wgmma(items, g.heads, max_len, sms),
        };
        let chunk: i32 = 0;
        // Padded to a power of two for the same reason (entries past an item's pages are unread).
        starts.resize(starts.len().next_power_of_two(), 0);
        let lens32: Vec<i32> = lens
            .iter()
            .map(|&l| i32_of(l, "length"))
            .collect::<Result<_>>()?;
        let (dst, starts, base, lens_d) = (
            self.upload_slice(&dst)?,
            self.upload_slice(&starts)?,
            self.upload_slice(&base)?,
            self.upload_slice(&lens32)?,
        );
        let (t, lkv, rope, nope, vd, h) = (
            kv_a.rows as i32,
            g.kv_lora as i32,
            g.rope as i32,
            g.nope as i32,
            g.v_dim as i32,
            g.heads as i32,
        );
        if kv_a.rows > 0 {
            launch!(self, "mla_append_rows_f32", geometry::per_row(kv_a.rows, 128)?;
                &kv_a.buf, kv_norm, &mut *arena, &dst, &t, &lkv, &rope, &g.eps)?;
        }
        // W_UK / W_UV products: on bf16 kv_b as stored (tensor cores, each weight byte read once
        // for all items: mla.cu), else the f32 kernels. Both write every element of qt and o.
        let kv_w = match &kv_b.bf16 {
            Some(b) if geometry::mla_bf16_products(&g) => KvB::Bf16(b),
            _ => KvB::F32(&self.linear_f32(kv_b)?.buf),
        };
        let qt = self.output(items * g.heads, row)?;
        let it = i32_of(items, "items")?;
        match kv_w {
            KvB::Bf16(w) => launch!(self, "mla_absorb_q_bf16", geometry::mla_absorb_bf16(&g)?;
                &q.buf, w, &qt.buf, &it, &h, &nope, &rope, &vd, &lkv)?,
            KvB::F32(w) => {
                launch!(self, "mla_absorb_q_f32", Launch::new((items, g.heads, 1), 128)?;
                &q.buf, w, &qt.buf, &it, &h, &nope, &rope, &vd, &lkv)?
            }
        }
        // One split on the wgmma attend: it writes the final latent rows itself (no merge).
        let final_rows = splits == 1 && attend == MlaAttend::PairWgmma;
        // Neither is zeroed: each attend kernel writes every (item, head, split) partial row, an
        // empty split as (0, -inf, 0) (their contract, kernels/mla_attend_pair_wgmma.cu), and the
        // merge (or the one-split wgmma attend) every latent row.
        let lat = self.output(items * g.heads, g.kv_lora)?;
        let part = if final_rows {
            None
        } else {
            Some(self.output(items * g.heads * splits, g.kv_lora + 2)?)
        };
        let out = part.as_ref().unwrap_or(&lat);
        let (pt, sp, ch) = (page_tokens as i32, splits as i32, chunk);
        let scale = 1.0 / ((g.nope + g.rope) as f32).sqrt();
        // Attend on tensor cores, merge the splits, then W_UV once per call. F32: 3xTF32 (two
        // blocks per SM, L2 prefetch of MLA_TC_PREFETCH_TILES tiles ahead); Bf16Mma: one bf16 MMA
        // per product (kernels/mla_attend_bf16.cu); PairWgmma: the same rounding on wgmma
        // (kernels/mla_attend_pair_wgmma.cu). All write the same partials.
        match attend {
            MlaAttend::F32 => {
                let tc_mode = 1 | (MLA_TC_PREFETCH_TILES << 2);
                launch!(self, "mla_attend_tf32_f32", geometry::mla_attend_f32(&g, items, splits)?;
                    &qt.buf, &*arena, &starts, &base, &lens_d, &out.buf, &it, &h, &lkv, &rope, &pt, &sp, &ch,
                    &scale, &tc_mode)?;
            }
            MlaAttend::Bf16Mma => {
                launch!(self, "mla_attend_bf16_f32", geometry::mla_attend_bf16(&g, items, splits)?;
                    &qt.buf, &*arena, &starts, &base, &lens_d, &out.buf, &it, &h, &lkv, &rope, &pt, &sp, &ch,
                    &scale)?;
            }
            MlaAttend::PairWgmma => {
                let fin = i32::from(final_rows);
                launch!(self, "mla_attend_pair_wgmma_f32", geometry::mla_attend_pair_wgmma(&g, items, splits)?;
                    &qt.buf, &*arena, &starts, &base, &lens_d, &out.buf, &it, &h, &lkv, &rope, &pt, &sp, &ch,
                    &scale, &fin)?;
            }
        }
        if let Some(part) = &part {
            launch!(self, "mla_merge_f32", geometry::mla_merge(&g, items)?;
                &part.buf, &lat.buf, &it, &h, &lkv, &sp)?;
        }
        let o = self.output(items, g.heads * g.v_dim)?;
        match kv_w {
            KvB::Bf16(w) => launch!(self, "mla_out_proj_bf16", geometry::mla_out_proj_bf16(&g)?;
                &lat.buf, w, &o.buf, &it, &h, &nope, &vd, &lkv)?,
            KvB::F32(w) => launch!(self, "mla_out_proj_f32", geometry::mla_out_proj(&g, items)?;
                &lat.buf, w, &o.buf, &it, &h, &nope, &vd, &lkv)?,
        }
        Ok(o)
    }

    /// MLA over a batch of sequence spans: append each span's latent rows to its KV pages, then
    /// attend (absorbed decode, or the expanded prefill for long spans, in `mla_spans_mixed`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mla_spans(
        &self,
        arena: &mut CudaSlice<f32>,
        g: MlaGeom,
        q: &DeviceMat,
        kv_a: &DeviceMat,
        kv_norm: &CudaSlice<f32>,
        kv_b: &DeviceLinear,
        spans: &[(usize, usize)],
        locs: &[MlaCacheLoc<'_>],
    ) -> Result<DeviceMat> {
        if spans.len() != locs.len() || spans.last().map_or(0, |s| s.1) != q.rows {
            return Err(CudaError::InvalidArg(
                "MLA batch: spans do not cover the rows".into(),
            ));
        }
        let row_bytes = 4 * g.row();
        let mut seq_pages = Vec::with_capacity(locs.len());
        let (mut append_at, mut lens, mut owner) = (Vec::new(), Vec::new(), Vec::new());
        let mut pt = 0;
        for (i, (&(r0, r1), loc)) in spans.iter().zip(locs).enumerate() {
            pt = loc.page_tokens;
            if pt == 0 || (i > 0 && pt != locs[0].page_tokens) {
                return Err(CudaError::InvalidArg("page_tokens differ or are 0".into()));
            }
            let end = loc.start_pos + (r1 - r0);
            let npages = end.div_ceil(pt);
            if loc.pages.len() < npages {
                return Err(CudaError::InvalidArg(format!(
                    "{} KV pages for {end} positions",
                    loc.pages.len()
                )));
            }
            let pages: Vec<usize> = loc.pages[..npages]
                .iter()
                .map(|&p| p + loc.layer_offset)
                .collect();
            for pos in loc.start_pos..end {
                append_at.push(pages[pos / pt] + (pos % pt) * row_bytes);
                lens.push(pos + 1);
                owner.push(i);
            }
            seq_pages.push(pages);
        }
        // Sequences with many new tokens take the expanded form (mla/prefill.rs); the others
        // stay on this absorbed launch sequence.
        if spans
            .iter()
            .any(|&(r0, r1)| crate::mla::prefill::expanded(r1 - r0))
        {
            let starts: Vec<usize> = locs.iter().map(|l| l.start_pos).collect();
            return self.mla_spans_mixed(
                arena, g, q, kv_a, kv_norm, kv_b, spans, &starts, &seq_pages, pt,
            );
        }
        let tables: Vec<&[usize]> = owner.iter().map(|&i| &seq_pages[i][..]).collect();
        self.mla_absorbed(
            arena, g, q, kv_a, kv_norm, kv_b, &append_at, &tables, &lens, pt,
        )
    }
}
