//! The forward pass of [`Model`]: the layer graph over a batch of sequences (docs/k3-model.md),
//! the mixers and the MoE, and the ReplaySSM commit after a verify.

use super::*;

impl<B: Backend> Model<B> {
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

    fn glu_of<'w>(&self, w: &'w GluW<B>) -> Glu<'w, B> {
        Glu {
            gate: &w.gate,
            up: &w.up,
            down: &w.down,
            situ: self.situ(),
        }
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
        // The last FFN's output, not yet added into the running sum `p`: the next norm that reads
        // `p` adds it in its own kernel (Backend::attn_res_norm's `add`); any other reader of
        // `p` adds it first.
        let mut pending: Option<B::Act> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let tapped = tap_layers.contains(&l);
            let x = match (&layer.attn_res, bank.is_empty()) {
                (Some(w), false) if !tapped => {
                    let src: Vec<&B::Act> = bank.iter().collect();
                    let cur = p.as_mut().expect("p is set between layers");
                    let add = pending.take();
                    be.attn_res_norm(&src, cur, add.as_ref(), &w.w, &layer.input_norm, eps)?
                }
                (res, empty) => {
                    if let Some(f) = pending.take() {
                        be.add_assign(p.as_mut().expect("p is set between layers"), &f)?;
                    }
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
                Ffn::Dense(w) => crate::backend::glu(be, &x, &self.glu_of(w))?,
                Ffn::Moe(w) => self.moe(&x, w, &spans)?,
            };
            match trace.as_deref_mut() {
                Some(tr) => {
                    be.add_assign(&mut pp, &f)?;
                    tr.push(be.to_host(&pp)?);
                }
                None => pending = Some(f),
            }
            p = Some(pp);
        }
        // Adjacent ranges merged: a batched decode wants every row, one range, so the final
        // norm runs over the whole act instead of gathering each row with its own copy.
        let wanted = merge_adjacent(
            seqs.iter()
                .zip(&spans)
                .filter_map(|(s, &(r0, r1))| s.logits_from.map(|f| (r0 + f, r1))),
        );
        let mut p = p.expect("p set");
        // The final AttnRes over every row takes the last FFN's output as its `add`; the tap
        // and a subset of rows need the sum first (a step that wants no logits, neither).
        let whole = wanted == [(0, total)];
        if (tap_layers.contains(&nl) || !(whole || wanted.is_empty()))
            && let Some(f) = pending.take()
        {
            be.add_assign(&mut p, &f)?;
        }
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
        let (w, norm) = (&self.final_res.w, &self.norm);
        let y = match mixed {
            Some(all) if whole => be.rms_norm(&all, norm, eps)?,
            Some(all) => be.rms_norm(&self.gather_rows(&all, &wanted)?, norm, eps)?,
            None if whole => {
                let src: Vec<&B::Act> = bank.iter().collect();
                be.attn_res_norm(&src, &mut p, pending.as_ref(), w, norm, eps)?
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
        let shared = self.glu_of(&w.shared);
        let (y_lat, s) =
            be.moe_routed_and_shared(&z, &logits, &w.bias, &w.experts, router, spans, x, &shared)?;
        let y_lat = match &w.norm {
            Some(n) => be.rms_norm(&y_lat, n, self.config.rms_norm_eps)?,
            None => y_lat,
        };
        let mut y = be.matmul(&y_lat, &w.up)?;
        be.add_assign(&mut y, &s)?;
        Ok(y)
    }
}

/// `ranges` (in row order) with each range that starts where the one before ends joined to it.
fn merge_adjacent(ranges: impl IntoIterator<Item = (usize, usize)>) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (r0, r1) in ranges {
        match out.last_mut() {
            Some(last) if last.1 == r0 => last.1 = r1,
            _ => out.push((r0, r1)),
        }
    }
    out
}

/// The results of one `Backend::matmuls` call as an array, one per weight passed.
fn results<A, const N: usize>(v: Vec<A>) -> OpResult<[A; N]> {
    let got = v.len();
    v.try_into().map_err(|_| {
        BackendError::InvalidArg(format!("matmuls returned {got} results for {N} weights"))
    })
}

#[cfg(test)]
mod tests {
    use super::merge_adjacent;

    #[test]
    fn merge_adjacent_joins_touching_ranges_only() {
        assert_eq!(merge_adjacent([(0, 1), (1, 2), (2, 3)]), [(0, 3)]);
        assert_eq!(
            merge_adjacent([(4, 5), (5, 9), (12, 13), (13, 14)]),
            [(4, 9), (12, 14)]
        );
        assert_eq!(merge_adjacent([(0, 2), (3, 4)]), [(0, 2), (3, 4)]);
        assert!(merge_adjacent([]).is_empty());
    }
}
