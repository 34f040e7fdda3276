//! The byte arena that holds both per-request memories: KDA state blocks and MLA KV pages.
//!
//! The engine decides *where* blocks live; the executor decides what is in them. Blocks are named
//! by stable [`BlockId`]s and resolved to byte offsets only when a step is launched, so the pool
//! may move blocks (compaction) without anyone else noticing. Every move is returned as an
//! [`ArenaOp`] that must be issued on the executor's ordered stream, in order, before the next
//! forward.

mod pool;

pub use pool::{BlockId, BlockKind, MemoryPool, PoolError, PoolMode, PoolUsage};

/// A byte operation on the arena, executed in order on the executor's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaOp {
    /// Copy `len` bytes from `src` to `dst` (never overlapping).
    Copy { src: usize, dst: usize, len: usize },
    /// Zero `len` bytes at `offset`.
    Zero { offset: usize, len: usize },
    /// Replay a verify pass's accepted prefix into its state block (speculative decoding).
    CommitVerified(k3_model::VerifiedBlock),
}

impl ArenaOp {
    /// Apply to the executor.
    pub fn apply(&self, exec: &mut dyn k3_model::Executor) -> Result<(), k3_model::ExecError> {
        match *self {
            ArenaOp::Copy { src, dst, len } => exec.arena_copy(src, dst, len),
            ArenaOp::Zero { offset, len } => exec.arena_zero(offset, len),
            ArenaOp::CommitVerified(b) => exec.commit_verified(&[b]),
        }
    }

    /// Apply to a plain byte buffer (property tests of the pool).
    pub fn apply_bytes(&self, arena: &mut [u8]) {
        match *self {
            ArenaOp::Copy { src, dst, len } => arena.copy_within(src..src + len, dst),
            ArenaOp::Zero { offset, len } => arena[offset..offset + len].fill(0),
            // Model state, not memory layout: nothing a pool test tracks.
            ArenaOp::CommitVerified(_) => {}
        }
    }
}
