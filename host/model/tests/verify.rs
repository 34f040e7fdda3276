//! Speculative verify and ReplaySSM commit on k3-mini (CPU backend) against plain decoding:
//! a verify pass writes no state, its logits rows and hidden-state taps are those decoding the
//! same tokens one at a time gives, and after committing an accepted prefix the state block and
//! every later step are those of decoding that prefix.

use anyhow::{Result, ensure};
use k3_backend_cpu::CpuBackend;
use k3_model::{
    Executor, ForwardBatch, ForwardOutput, LogitsWant, Model, ModelExecutor, SeqInput,
    VerifiedBlock,
};
use std::path::PathBuf;

const PAGE: usize = 4;
const PAGES: usize = 16;

struct Seq {
    state: usize,
    pages: Vec<usize>,
    pos: usize,
}

fn executor() -> Result<ModelExecutor<CpuBackend>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini");
    let model = Model::load_dir(&dir, CpuBackend::new())?;
    Ok(ModelExecutor::with_capacity(
        model,
        PAGE,
        2,
        PAGE * PAGES,
        1,
    )?)
}

fn step(
    exec: &mut ModelExecutor<CpuBackend>,
    s: &mut Seq,
    tokens: &[u32],
    want: LogitsWant,
    record: Option<usize>,
) -> Result<ForwardOutput> {
    let out = exec.forward(&ForwardBatch {
        seqs: vec![SeqInput {
            tokens,
            start_pos: s.pos,
            kv_pages: &s.pages,
            state_block: s.state,
            checkpoints: &[],
            logits: want,
        }],
        verify_records: vec![record],
        want_taps: vec![true],
        ..Default::default()
    })?;
    if record.is_none() {
        s.pos += tokens.len();
    }
    Ok(out)
}

fn argmax(row: &[f32]) -> u32 {
    k3_model::argmax(row)
}

#[test]
fn verify_and_commit_match_plain_decoding() -> Result<()> {
    let mut exec = executor()?;
    exec.set_hidden_taps(&[2, 5, 8])?;
    let lay = exec.layout();
    ensure!(lay.verify_tokens_max >= 8, "{lay:?}");
    let sb = lay.state_block_bytes;
    let pages = |first: usize| -> Vec<usize> {
        (0..PAGES)
            .map(|i| 3 * sb + (first + i) * lay.kv_page_bytes)
            .collect()
    };
    let (mut plain, mut spec) = (
        Seq {
            state: 0,
            pages: pages(0),
            pos: 0,
        },
        Seq {
            state: sb,
            pages: pages(PAGES),
            pos: 0,
        },
    );
    let record = 2 * sb;
    exec.arena_zero(0, 2 * sb)?;
    let prompt: Vec<u32> = vec![3, 220, 1204, 88, 301, 47, 5, 912, 33];
    step(&mut exec, &mut plain, &prompt, LogitsWant::Last, None)?;
    let o = step(&mut exec, &mut spec, &prompt, LogitsWant::Last, None)?;
    // Plain decoding: the next 8 greedy tokens, each step's row and taps.
    let mut next = argmax(o.row(0));
    let mut tokens = vec![next];
    let (mut rows, mut taps) = (Vec::new(), Vec::new());
    let mut states = vec![exec.arena_read(plain.state, sb)?];
    for _ in 0..8 {
        let o = step(&mut exec, &mut plain, &[next], LogitsWant::Last, None)?;
        rows.push(o.row(0).to_vec());
        taps.push(o.taps.clone());
        states.push(exec.arena_read(plain.state, sb)?);
        next = argmax(o.row(0));
        tokens.push(next);
    }
    // Verify the committed token and 5 drafts, the 4th of them wrong.
    let mut draft = tokens[..6].to_vec();
    draft[4] = (draft[4] + 1) % 8192;
    let before = exec.arena_read(spec.state, sb)?;
    let o = step(&mut exec, &mut spec, &draft, LogitsWant::All, Some(record))?;
    ensure!(
        exec.arena_read(spec.state, sb)? == before,
        "a verify wrote its state block"
    );
    ensure!(o.row_ranges[0].len() == 6 && o.tap_ranges[0].len() == 6);
    let width = o.tap_width;
    for j in 0..4 {
        // Rows of the tokens before the wrong draft (and the wrong draft's own, which still
        // sees only correct tokens before it).
        let row = o.row(o.row_ranges[0].start + j);
        ensure!(
            row == rows[j].as_slice(),
            "verify row {j} differs from decoding"
        );
        ensure!(
            o.taps[j * width..(j + 1) * width] == taps[j][..],
            "verify taps {j} differ from decoding"
        );
    }
    // Accept 3 drafts (+ the committed token): state equals decoding those 4 tokens.
    exec.commit_verified(&[VerifiedBlock {
        state_block: spec.state,
        record_block: record,
        tokens: 6,
        accepted: 4,
    }])?;
    ensure!(
        exec.arena_read(spec.state, sb)? == states[4],
        "the committed state differs from decoding the accepted tokens"
    );
    spec.pos += 4;
    // Decoding on from the commit gives the plain run's rows, bit for bit.
    for (j, &t) in tokens[4..8].iter().enumerate() {
        let o = step(&mut exec, &mut spec, &[t], LogitsWant::Last, None)?;
        ensure!(
            o.row(0) == rows[4 + j].as_slice(),
            "row {} after the commit",
            4 + j
        );
    }
    // Committing nothing leaves the state as it is; a bad count is refused.
    let at = exec.arena_read(spec.state, sb)?;
    step(
        &mut exec,
        &mut spec,
        &tokens[8..9],
        LogitsWant::All,
        Some(record),
    )?;
    exec.commit_verified(&[VerifiedBlock {
        state_block: spec.state,
        record_block: record,
        tokens: 1,
        accepted: 0,
    }])?;
    ensure!(exec.arena_read(spec.state, sb)? == at);
    let too_many = VerifiedBlock {
        state_block: spec.state,
        record_block: record,
        tokens: 1,
        accepted: 2,
    };
    ensure!(exec.commit_verified(&[too_many]).is_err());
    Ok(())
}
