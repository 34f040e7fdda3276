//! How big `serve` makes the KV/state arena: enough for `--max-num-seqs` full-length requests,
//! capped on a GPU by `--gpu-memory-utilization` (vLLM's flag: the share of the device's memory the
//! server may use, weights included).

/// Tokens per KV page.
pub const PAGE_TOKENS: usize = 16;
/// State blocks a running request holds (working, snapshot, two spares; see the engine).
const STATE_SLOTS_PER_REQUEST: usize = 4;
/// Extra state blocks per request slot for prefix-cache checkpoints.
const CHECKPOINT_BLOCKS_PER_SEQ: usize = 4;
/// Device memory kept out of the arena for work buffers that live outside it: the routed-expert
/// GEMM scratch (2 GiB of bf16 expert weights plus step-sized activations) and the expanded MLA
/// prefill's scratch (at most 2 GiB), plus cuBLAS workspaces.
pub const GPU_WORK_RESERVE_BYTES: usize = 6 << 30;

/// Arena bytes for `seqs` requests of `len` tokens plus checkpoint blocks.
pub fn arena_bytes_for(
    kv_page_bytes: usize,
    state_block_bytes: usize,
    seqs: usize,
    len: usize,
) -> usize {
    let pages = len.div_ceil(PAGE_TOKENS);
    seqs * ((STATE_SLOTS_PER_REQUEST + CHECKPOINT_BLOCKS_PER_SEQ) * state_block_bytes
        + pages * kv_page_bytes)
}

/// Device memory as the driver reports it after the weights are loaded.
#[derive(Debug, Clone, Copy)]
pub struct DeviceMemory {
    pub free: usize,
    pub total: usize,
}

/// `wanted` bytes, or less where the device's budget is smaller: `total · utilization`, minus what
/// is already in use (the weights, the context), minus [`GPU_WORK_RESERVE_BYTES`]. An error when
/// not even `minimum` (one full-length request) fits, naming the flags that help.
pub fn fit_arena(
    wanted: usize,
    minimum: usize,
    mem: DeviceMemory,
    utilization: f64,
) -> Result<usize, String> {
    let allowed = (mem.total as f64 * utilization) as usize;
    let used = mem.total.saturating_sub(mem.free);
    // allowed <= total, so this never exceeds what is free.
    let budget = allowed
        .saturating_sub(used)
        .saturating_sub(GPU_WORK_RESERVE_BYTES);
    if budget < minimum {
        return Err(format!(
            "the GPU has room for a {:.2} GB cache arena ({:.1} of {:.1} GB in use, \
             --gpu-memory-utilization {utilization}, {:.1} GB kept for work buffers), but one \
             full-length request needs {:.2} GB: lower --max-model-len or raise \
             --gpu-memory-utilization",
            budget as f64 / 1e9,
            used as f64 / 1e9,
            mem.total as f64 / 1e9,
            GPU_WORK_RESERVE_BYTES as f64 / 1e9,
            minimum as f64 / 1e9
        ));
    }
    Ok(wanted.min(budget))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: usize = 1 << 30;

    #[test]
    fn arena_is_sized_for_full_length_requests_with_checkpoints() {
        // 2 requests of 33 tokens: 3 pages of 16 tokens each, 8 state blocks each.
        assert_eq!(arena_bytes_for(100, 10, 2, 33), 2 * (8 * 10 + 3 * 100));
    }

    #[test]
    fn the_gpu_budget_caps_the_arena_and_refuses_what_cannot_hold_one_request() {
        let mem = DeviceMemory {
            free: 100 * GB,
            total: 140 * GB,
        };
        // 0.9 · 140 = 126 GB allowed, 40 in use, 6 reserved: 80 GB.
        assert_eq!(fit_arena(500 * GB, GB, mem, 0.9), Ok(80 * GB));
        assert_eq!(
            fit_arena(10 * GB, GB, mem, 0.9),
            Ok(10 * GB),
            "smaller wishes are kept"
        );
        let err = fit_arena(500 * GB, 90 * GB, mem, 0.9).unwrap_err();
        assert!(err.contains("--max-model-len"), "{err}");
        // A busy device: 140 allowed, 130 in use, 6 reserved leaves 4 GB.
        let busy = DeviceMemory {
            free: 10 * GB,
            total: 140 * GB,
        };
        assert_eq!(fit_arena(500 * GB, GB, busy, 1.0), Ok(4 * GB));
        assert!(fit_arena(500 * GB, 5 * GB, busy, 1.0).is_err());
        let quiet = DeviceMemory {
            free: 140 * GB,
            total: 140 * GB,
        };
        assert_eq!(fit_arena(500 * GB, GB, quiet, 1.0), Ok(134 * GB));
    }
}
