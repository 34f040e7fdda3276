//! ReplaySSM for KDA on CUDA (docs/speculative-decoding.md, "ReplaySSM on CUDA"): the verify of
//! any mix of verifying, decoding and prefilling sequences of one layer, and the commit of
//! accepted prefixes.
//!
//! Verify runs `kda_verify_lines_f32`, the decode kernel's body stepped over each sequence's
//! tokens with the state held in registers: one launch for every verifying sequence and every
//! plain one-token decode of the batch, reading and writing the step's stacked rows in place (no
//! gather or scatter). A verifying sequence's state and windows are only read; its record goes to
//! the arena. Prefill chunks in the same batch take the chunked path, one per sequence. Commit
//! runs `kda_commit_lines_f32`: one launch replays every commit's accepted steps through the
//! decode step's own state half and rolls the windows.

use super::{KdaIn, KdaWeights, kda_parts};
use crate::device::{CudaBackend, DeviceMat};
use crate::error::{CudaError, Result};
use crate::geometry;
use crate::launch::{float_offset, i32_of};
use cudarc::driver::CudaSlice;
use k3_model::backend::{KdaCommit, KdaGeom, KdaInputs, KdaParams, KdaStateLoc};

/// The verify kernel (kernels/kda_decode.cu).
const KDA_VERIFY_KERNEL: &str = "kda_verify_lines_f32";
/// The commit (replay) kernel (kernels/kda_decode.cu).
const KDA_COMMIT_KERNEL: &str = "kda_commit_lines_f32";

/// One sequence of a `kda_verify_lines_f32` launch: `tokens` rows from `row` of the stacked
/// inputs and output; either a verify (`record`: state read only, the record written there) or a
/// plain one-token decode (state and windows written, and the optional checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KdaLine {
    pub row: usize,
    pub tokens: usize,
    pub state: usize,
    pub checkpoint: Option<usize>,
    pub record: Option<usize>,
}

/// How a batch with records splits: the kernel's lines and, by index into the spans, the prefill
/// chunks that take the chunked path.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ReplayPlan {
    pub lines: Vec<KdaLine>,
    pub chunks: Vec<usize>,
}

/// Sort the sequences of a batch (`spans[i]`: sequence i's rows, which must tile `0..rows` in
/// order; `locs[i]` its state) into kernel lines and prefill chunks.
pub(crate) fn plan(
    spans: &[(usize, usize)],
    locs: &[KdaStateLoc<'_>],
    rows: usize,
) -> Result<ReplayPlan> {
    if spans.len() != locs.len() || spans.is_empty() {
        return Err(CudaError::InvalidArg(format!(
            "KDA batch of {} spans and {} state locations",
            spans.len(),
            locs.len()
        )));
    }
    let mut plan = ReplayPlan::default();
    let mut next = 0;
    for (i, (&(r0, r1), loc)) in spans.iter().zip(locs).enumerate() {
        if r0 != next || r1 <= r0 {
            return Err(CudaError::InvalidArg(format!(
                "KDA batch span {i} is rows {r0}..{r1}; spans must tile the rows in order"
            )));
        }
        next = r1;
        let tokens = r1 - r0;
        match (loc.record, loc.checkpoints) {
            (Some(_), [_, ..]) => {
                return Err(CudaError::InvalidArg(format!(
                    "KDA span {i}: a speculative verify writes no checkpoints"
                )));
            }
            (Some(record), []) => plan.lines.push(KdaLine {
                row: r0,
                tokens,
                state: loc.offset,
                checkpoint: None,
                record: Some(record),
            }),
            (None, cps @ ([] | [(1, _)])) if tokens == 1 => plan.lines.push(KdaLine {
                row: r0,
                tokens: 1,
                state: loc.offset,
                checkpoint: cps.first().map(|&(_, dst)| dst),
                record: None,
            }),
            (None, _) => plan.chunks.push(i),
        }
    }
    if next != rows {
        return Err(CudaError::InvalidArg(format!(
            "KDA batch spans cover {next} of {rows} rows"
        )));
    }
    Ok(plan)
}

/// `[a, a + a_len)` and `[b, b + b_len)` (floats) overlap.
fn overlaps(a: i64, a_len: usize, b: i64, b_len: usize) -> bool {
    a < b + b_len as i64 && b < a + a_len as i64
}

impl CudaBackend {
    /// [`Backend::kda_batch`](k3_model::backend::Backend::kda_batch) when at least one sequence
    /// verifies (module doc). Returns the stacked `o`.
    pub(crate) fn kda_replay_batch(
        &self,
        arena: &mut CudaSlice<f32>,
        g: KdaGeom,
        p: &KdaParams<'_, Self>,
        inp: &KdaInputs<'_, Self>,
        spans: &[(usize, usize)],
        locs: &[KdaStateLoc<'_>],
    ) -> Result<DeviceMat> {
        let (w, x) = kda_parts(p, inp);
        let rows = x.q.rows;
        let plan = plan(spans, locs, rows)?;
        // Every row is written: by the lines kernel or by a chunk's copy below.
        let mut o = self.output(rows, g.hk())?;
        if !plan.lines.is_empty() {
            self.kda_lines(arena, g, &w, &x, &plan.lines, &o)?;
        }
        for &i in &plan.chunks {
            let (r0, r1) = spans[i];
            let part = |m: &DeviceMat| self.rows_of(m, r0, r1);
            let (q, k, v, f, b) = (part(x.q)?, part(x.k)?, part(x.v)?, part(x.f)?, part(x.b)?);
            let xi = KdaIn {
                q: &q,
                k: &k,
                v: &v,
                f: &f,
                b: &b,
            };
            let oi = self.kda_prefill(arena, g, &w, &xi, locs[i].offset, locs[i].checkpoints)?;
            let cols = g.hk();
            let src = oi.buf.slice(0..(r1 - r0) * cols);
            let mut dst = o.buf.slice_mut(r0 * cols..r1 * cols);
            self.copy_dtod(&src, &mut dst)?;
        }
        Ok(o)
    }

    /// One `kda_verify_lines_f32` launch over `lines`, writing their rows of `o` (`[rows, H·V]`,
    /// the stacked output of the step).
    pub(crate) fn kda_lines(
        &self,
        arena: &mut CudaSlice<f32>,
        g: KdaGeom,
        w: &KdaWeights<'_>,
        x: &KdaIn<'_>,
        lines: &[KdaLine],
        o: &DeviceMat,
    ) -> Result<()> {
        let l = geometry::kda_verify(&g, lines.len())?;
        let rows = x.q.rows;
        for m in [x.q, x.k, x.v, x.f] {
            if m.cols != g.hk() || m.rows != rows {
                return Err(CudaError::InvalidArg(format!(
                    "KDA verify input {}x{}, want {rows}x{}",
                    m.rows,
                    m.cols,
                    g.hk()
                )));
            }
        }
        if (x.b.rows, x.b.cols) != (rows, g.heads) || (o.rows, o.cols) != (rows, g.hk()) {
            return Err(CudaError::InvalidArg(
                "KDA verify beta logits or output shape".into(),
            ));
        }
        let (len, region) = (arena.len(), g.state_floats());
        let n = lines.len();
        let (mut offs, mut cks, mut recs) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut first, mut count) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for line in lines {
            if line.tokens == 0 || line.row + line.tokens > rows {
                return Err(CudaError::InvalidArg(format!(
                    "KDA verify rows {}..{} of {rows}",
                    line.row,
                    line.row + line.tokens
                )));
            }
            if line.record.is_none() && line.tokens != 1 {
                return Err(CudaError::InvalidArg(
                    "a KDA line without a record decodes one token".into(),
                ));
            }
            let off = float_offset(line.state, region, len)?;
            offs.push(off);
            cks.push(match line.checkpoint {
                Some(c) => float_offset(c, region, len)?,
                None => -1,
            });
            recs.push(match line.record {
                Some(r) => {
                    let rlen = geometry::kda_record_floats(&g, line.tokens);
                    let rec = float_offset(r, rlen, len)?;
                    if overlaps(rec, rlen, off, region) {
                        return Err(CudaError::InvalidArg(format!(
                            "KDA record at byte {r} overlaps its state at byte {}",
                            line.state
                        )));
                    }
                    rec
                }
                None => -1,
            });
            first.push(i32_of(line.row, "KDA verify row")?);
            count.push(i32_of(line.tokens, "KDA verify tokens")?);
        }
        let (offs, cks, recs) = (
            self.upload_slice(&offs)?,
            self.upload_slice(&cks)?,
            self.upload_slice(&recs)?,
        );
        let (first, count) = (self.upload_slice(&first)?, self.upload_slice(&count)?);
        let (nn, h, conv) = (n as i32, g.heads as i32, g.conv_kernel as i32);
        launch!(self, KDA_VERIFY_KERNEL, l;
            &x.q.buf, &x.k.buf, &x.v.buf, &x.f.buf, &x.b.buf, w.conv[0], w.conv[1], w.conv[2], w.a_log,
            w.dt_bias, arena, &offs, &cks, &recs, &first, &count, &o.buf, &nn, &h, &conv,
            &g.gate_lower_bound)
    }

    /// [`Backend::kda_commit`](k3_model::backend::Backend::kda_commit): one launch for every
    /// commit with something accepted.
    pub(crate) fn kda_commit_blocks(
        &self,
        arena: &mut CudaSlice<f32>,
        g: KdaGeom,
        commits: &[KdaCommit],
    ) -> Result<()> {
        geometry::check_kda(&g)?;
        let (len, region) = (arena.len(), g.state_floats());
        let mut seen: Vec<i64> = Vec::with_capacity(commits.len());
        let (mut offs, mut recs, mut tokens, mut accepted) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for c in commits {
            if c.accepted > c.tokens || c.tokens == 0 {
                return Err(CudaError::InvalidArg(format!(
                    "KDA commit of {} of {} verified tokens",
                    c.accepted, c.tokens
                )));
            }
            let off = float_offset(c.state, region, len)?;
            let rlen = geometry::kda_record_floats(&g, c.tokens);
            let rec = float_offset(c.record, rlen, len)?;
            if overlaps(rec, rlen, off, region) {
                return Err(CudaError::InvalidArg(format!(
                    "KDA record at byte {} overlaps its state at byte {}",
                    c.record, c.state
                )));
            }
            // Two commits into one state would race in the kernel (the trait asks for distinct ones).
            if seen.iter().any(|&s| overlaps(s, region, off, region)) {
                return Err(CudaError::InvalidArg(format!(
                    "KDA commits into overlapping states (byte {})",
                    c.state
                )));
            }
            seen.push(off);
            if c.accepted == 0 {
                continue; // nothing to replay, the windows stay
            }
            offs.push(off);
            recs.push(rec);
            tokens.push(i32_of(c.tokens, "KDA commit tokens")?);
            accepted.push(c.accepted as i32);
        }
        if offs.is_empty() {
            return Ok(());
        }
        let l = geometry::kda_commit(&g, offs.len())?;
        let (offs, recs) = (self.upload_slice(&offs)?, self.upload_slice(&recs)?);
        let (tokens, accepted) = (self.upload_slice(&tokens)?, self.upload_slice(&accepted)?);
        let (n, h, conv) = (l.grid.1 as i32, g.heads as i32, g.conv_kernel as i32);
        launch!(self, KDA_COMMIT_KERNEL, l;
            arena, &offs, &recs, &tokens, &accepted, &n, &h, &conv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(
        offset: usize,
        checkpoints: &[(usize, usize)],
        record: Option<usize>,
    ) -> KdaStateLoc<'_> {
        KdaStateLoc {
            offset,
            checkpoints,
            record,
        }
    }

    #[test]
    fn mixed_batches_split_into_lines_and_chunks() {
        // A verify of 4, a decode with its checkpoint, a prefill chunk, a plain decode.
        let ck = [(1, 900)];
        let chunk_ck = [(3, 800)];
        let locs = [
            loc(100, &[], Some(5000)),
            loc(200, &ck, None),
            loc(300, &chunk_ck, None),
            loc(400, &[], None),
        ];
        let spans = [(0, 4), (4, 5), (5, 10), (10, 11)];
        let p = plan(&spans, &locs, 11).unwrap();
        assert_eq!(p.chunks, vec![2]);
        assert_eq!(
            p.lines,
            vec![
                KdaLine {
                    row: 0,
                    tokens: 4,
                    state: 100,
                    checkpoint: None,
                    record: Some(5000)
                },
                KdaLine {
                    row: 4,
                    tokens: 1,
                    state: 200,
                    checkpoint: Some(900),
                    record: None
                },
                KdaLine {
                    row: 10,
                    tokens: 1,
                    state: 400,
                    checkpoint: None,
                    record: None
                },
            ]
        );
        // A verify of one token (no drafts: only the bonus position) is still a verify.
        let p = plan(&[(0, 1)], &[loc(0, &[], Some(64))], 1).unwrap();
        assert_eq!(p.lines[0].record, Some(64));
        // One token with a checkpoint elsewhere than after it is a chunk.
        let odd = [(0, 900)];
        let p = plan(&[(0, 1)], &[loc(0, &odd, None)], 1).unwrap();
        assert_eq!((p.lines.len(), p.chunks), (0, vec![0]));
    }

    #[test]
    fn bad_batches_are_refused() {
        let ck = [(2, 900)];
        // A verify with a checkpoint.
        assert!(plan(&[(0, 2)], &[loc(0, &ck, Some(64))], 2).is_err());
        // Spans with a gap, out of order, empty, or not covering the rows.
        let two = [loc(0, &[], Some(64)), loc(100, &[], None)];
        assert!(plan(&[(0, 2), (3, 4)], &two, 4).is_err());
        assert!(plan(&[(2, 3), (0, 2)], &two, 3).is_err());
        assert!(plan(&[(0, 0), (0, 1)], &two, 1).is_err());
        assert!(plan(&[(0, 2), (2, 3)], &two, 4).is_err());
        assert!(plan(&[(0, 2)], &two, 2).is_err(), "one span, two locations");
    }

    #[test]
    fn overlap_is_half_open() {
        assert!(overlaps(0, 10, 9, 1));
        assert!(!overlaps(0, 10, 10, 5));
        assert!(!overlaps(20, 5, 10, 10));
        assert!(overlaps(20, 5, 10, 11));
    }
}
