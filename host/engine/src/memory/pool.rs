//! One arena, two block kinds, one contiguous gap.
//!
//! State blocks are packed from offset 0 upwards (block `i` at `i * state_bytes`), KV pages from the
//! top downwards (page `j` at `top - (j + 1) * page_bytes`). Free space is always the single gap
//! between the two stacks. Freeing a block in the middle of a stack moves that stack's end block
//! into the hole (an [`ArenaOp::Copy`]) and updates the indirection table, so the gap stays one
//! region and either kind can use all of it.
//!
//! [`PoolMode::Split`] keeps the same mechanics but caps each stack at a fixed share of the arena:
//! the classic "two pools sized at start-up" design, kept for comparison.

use super::ArenaOp;
use k3_model::CacheLayout;

/// Which memory a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// A KDA state block (all KDA layers' conv windows + recurrent states).
    State,
    /// An MLA latent KV page (`page_tokens` tokens, all MLA layers).
    Kv,
}

/// A stable name for a block; its byte offset may change when the pool compacts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(u32);

impl BlockId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// How the arena is divided between the two kinds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PoolMode {
    /// One arena, both kinds share the gap (the default).
    Unified,
    /// Two fixed pools: `state_fraction` of the arena for state blocks, the rest for KV pages.
    Split { state_fraction: f64 },
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("invalid cache layout: {0}")]
    InvalidLayout(String),
    #[error("invalid pool mode: {0}")]
    InvalidMode(String),
}

/// Occupancy by kind, in blocks and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolUsage {
    pub capacity_bytes: usize,
    pub free_bytes: usize,
    pub state_blocks: usize,
    pub state_bytes: usize,
    pub kv_pages: usize,
    pub kv_bytes: usize,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    kind: BlockKind,
    /// Position in its kind's stack.
    slot: usize,
}

/// The arena allocator. Pure bookkeeping: it never touches bytes, it returns the ops to issue.
#[derive(Debug)]
pub struct MemoryPool {
    state_bytes: usize,
    page_bytes: usize,
    /// End of the KV stack (KV pages occupy `[top - n * page_bytes, top)`).
    top: usize,
    /// Largest byte extent each stack may reach (both `top` in unified mode).
    state_limit: usize,
    kv_limit: usize,
    state_stack: Vec<BlockId>,
    kv_stack: Vec<BlockId>,
    entries: Vec<Option<Entry>>,
    free_ids: Vec<u32>,
}

impl MemoryPool {
    pub fn new(layout: CacheLayout, mode: PoolMode) -> Result<Self, PoolError> {
        if layout.state_block_bytes == 0 || layout.kv_page_bytes == 0 || layout.page_tokens == 0 {
            return Err(PoolError::InvalidLayout(format!(
                "zero-sized block in {layout:?}"
            )));
        }
        let top = layout.arena_bytes;
        let (state_limit, kv_limit) = match mode {
            PoolMode::Unified => (top, top),
            PoolMode::Split { state_fraction } => {
                if !(0.0..=1.0).contains(&state_fraction) {
                    return Err(PoolError::InvalidMode(format!(
                        "state_fraction {state_fraction} not in [0, 1]"
                    )));
                }
                let states = ((top as f64 * state_fraction) as usize) / layout.state_block_bytes;
                let state_region = states * layout.state_block_bytes;
                (state_region, top - state_region)
            }
        };
        Ok(Self {
            state_bytes: layout.state_block_bytes,
            page_bytes: layout.kv_page_bytes,
            top,
            state_limit,
            kv_limit,
            state_stack: Vec::new(),
            kv_stack: Vec::new(),
            entries: Vec::new(),
            free_ids: Vec::new(),
        })
    }

    pub fn block_bytes(&self, kind: BlockKind) -> usize {
        match kind {
            BlockKind::State => self.state_bytes,
            BlockKind::Kv => self.page_bytes,
        }
    }

    fn used_state(&self) -> usize {
        self.state_stack.len() * self.state_bytes
    }

    fn used_kv(&self) -> usize {
        self.kv_stack.len() * self.page_bytes
    }

    /// Whether `states` more state blocks and `pages` more KV pages fit right now.
    pub fn fits(&self, states: usize, pages: usize) -> bool {
        let s = self.used_state() + states * self.state_bytes;
        let k = self.used_kv() + pages * self.page_bytes;
        s <= self.state_limit && k <= self.kv_limit && s + k <= self.top
    }

    /// Whether `states` + `pages` could ever fit in an empty pool.
    pub fn could_ever_fit(&self, states: usize, pages: usize) -> bool {
        let s = states * self.state_bytes;
        let k = pages * self.page_bytes;
        s <= self.state_limit && k <= self.kv_limit && s + k <= self.top
    }

    pub fn alloc(&mut self, kind: BlockKind) -> Option<BlockId> {
        let (states, pages) = match kind {
            BlockKind::State => (1, 0),
            BlockKind::Kv => (0, 1),
        };
        if !self.fits(states, pages) {
            return None;
        }
        let id = match self.free_ids.pop() {
            Some(i) => BlockId(i),
            None => {
                self.entries.push(None);
                BlockId((self.entries.len() - 1) as u32)
            }
        };
        let stack = match kind {
            BlockKind::State => &mut self.state_stack,
            BlockKind::Kv => &mut self.kv_stack,
        };
        stack.push(id);
        self.entries[id.index()] = Some(Entry {
            kind,
            slot: stack.len() - 1,
        });
        Some(id)
    }

    fn slot_offset(&self, kind: BlockKind, slot: usize) -> usize {
        match kind {
            BlockKind::State => slot * self.state_bytes,
            BlockKind::Kv => self.top - (slot + 1) * self.page_bytes,
        }
    }

    fn entry(&self, id: BlockId) -> Entry {
        self.entries
            .get(id.index())
            .copied()
            .flatten()
            .unwrap_or_else(|| panic!("pool: {id:?} is not allocated (engine bookkeeping bug)"))
    }

    /// Current byte offset of a live block.
    pub fn offset(&self, id: BlockId) -> usize {
        let e = self.entry(id);
        self.slot_offset(e.kind, e.slot)
    }

    pub fn kind(&self, id: BlockId) -> BlockKind {
        self.entry(id).kind
    }

    pub fn is_live(&self, id: BlockId) -> bool {
        matches!(self.entries.get(id.index()), Some(Some(_)))
    }

    /// Free a block. If it was not its stack's end block, the end block moves into the hole; the
    /// copy is appended to `ops` (issue it before anything reads the moved block again).
    pub fn free(&mut self, id: BlockId, ops: &mut Vec<ArenaOp>) {
        let e = self.entry(id);
        let len = self.block_bytes(e.kind);
        let stack = match e.kind {
            BlockKind::State => &mut self.state_stack,
            BlockKind::Kv => &mut self.kv_stack,
        };
        let last = stack.len() - 1;
        if e.slot != last {
            let moved = stack[last];
            stack[e.slot] = moved;
            stack.pop();
            let src = self.slot_offset(e.kind, last);
            let dst = self.slot_offset(e.kind, e.slot);
            ops.push(ArenaOp::Copy { src, dst, len });
            if let Some(m) = self.entries[moved.index()].as_mut() {
                m.slot = e.slot;
            }
        } else {
            stack.pop();
        }
        self.entries[id.index()] = None;
        self.free_ids.push(id.0);
    }

    pub fn usage(&self) -> PoolUsage {
        PoolUsage {
            capacity_bytes: self.top,
            free_bytes: self.free_bytes(),
            state_blocks: self.state_stack.len(),
            state_bytes: self.used_state(),
            kv_pages: self.kv_stack.len(),
            kv_bytes: self.used_kv(),
        }
    }

    /// Bytes not held by any block (in split mode: the sum of both pools' free space).
    pub fn free_bytes(&self) -> usize {
        self.top - self.used_state() - self.used_kv()
    }

    /// Every live block: `(id, kind, offset, len)`.
    pub fn live_blocks(&self) -> impl Iterator<Item = (BlockId, BlockKind, usize, usize)> + '_ {
        self.state_stack
            .iter()
            .chain(self.kv_stack.iter())
            .map(|&id| {
                let e = self.entry(id);
                (
                    id,
                    e.kind,
                    self.slot_offset(e.kind, e.slot),
                    self.block_bytes(e.kind),
                )
            })
    }

    /// Internal consistency: tables agree, no byte owned twice, everything in bounds.
    pub fn check_invariants(&self) -> Result<(), String> {
        let live = self.entries.iter().filter(|e| e.is_some()).count();
        if live != self.state_stack.len() + self.kv_stack.len() {
            return Err(format!(
                "{live} live entries vs {} stacked blocks",
                self.state_stack.len() + self.kv_stack.len()
            ));
        }
        for (kind, stack) in [
            (BlockKind::State, &self.state_stack),
            (BlockKind::Kv, &self.kv_stack),
        ] {
            for (slot, id) in stack.iter().enumerate() {
                match self.entries.get(id.index()).copied().flatten() {
                    Some(e) if e.kind == kind && e.slot == slot => {}
                    other => return Err(format!("{id:?} at {kind:?}[{slot}] has entry {other:?}")),
                }
            }
        }
        if self.used_state() > self.state_limit || self.used_kv() > self.kv_limit {
            return Err("a stack exceeds its limit".into());
        }
        let mut spans: Vec<(usize, usize)> =
            self.live_blocks().map(|(_, _, o, l)| (o, o + l)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(format!("blocks overlap: {:?} and {:?}", w[0], w[1]));
            }
        }
        if let Some(last) = spans.last()
            && last.1 > self.top
        {
            return Err(format!("block {last:?} past arena end {}", self.top));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout(arena: usize) -> CacheLayout {
        CacheLayout {
            page_tokens: 4,
            kv_page_bytes: 24,
            state_block_bytes: 100,
            verify_tokens_max: 0,
            arena_bytes: arena,
        }
    }

    #[test]
    fn gap_is_shared_in_unified_mode() {
        let mut p = MemoryPool::new(layout(1000), PoolMode::Unified).unwrap();
        // 9 state blocks (900 B) leave room for 4 pages (96 B).
        for _ in 0..9 {
            p.alloc(BlockKind::State).unwrap();
        }
        for _ in 0..4 {
            p.alloc(BlockKind::Kv).unwrap();
        }
        assert!(p.alloc(BlockKind::Kv).is_none());
        assert!(p.alloc(BlockKind::State).is_none());
        p.check_invariants().unwrap();
    }

    #[test]
    fn split_mode_caps_each_kind() {
        let mut p = MemoryPool::new(
            layout(1000),
            PoolMode::Split {
                state_fraction: 0.5,
            },
        )
        .unwrap();
        let mut n = 0;
        while p.alloc(BlockKind::State).is_some() {
            n += 1;
        }
        assert_eq!(n, 5);
        assert!(p.free_bytes() >= 500, "KV half stays reserved");
        assert!(
            MemoryPool::new(
                layout(1000),
                PoolMode::Split {
                    state_fraction: 1.5
                }
            )
            .is_err()
        );
    }

    #[derive(Debug, Clone)]
    enum Action {
        Alloc(bool),
        Free(usize),
    }

    fn action() -> impl Strategy<Value = Action> {
        prop_oneof![
            any::<bool>().prop_map(Action::Alloc),
            any::<usize>().prop_map(Action::Free)
        ]
    }

    proptest! {
        /// Random alloc/free: no byte owned twice, compaction keeps every block's bytes, and
        /// freeing everything returns the whole arena.
        #[test]
        fn compaction_preserves_contents(actions in prop::collection::vec(action(), 1..200), split in any::<bool>()) {
            let mode = if split { PoolMode::Split { state_fraction: 0.4 } } else { PoolMode::Unified };
            let mut pool = MemoryPool::new(layout(2000), mode).unwrap();
            let mut arena = vec![0u8; 2000];
            let mut live: Vec<(BlockId, u8)> = Vec::new();
            let mut stamp = 1u8;
            let mut ops = Vec::new();
            for a in actions {
                match a {
                    Action::Alloc(state) => {
                        let kind = if state { BlockKind::State } else { BlockKind::Kv };
                        if let Some(id) = pool.alloc(kind) {
                            let off = pool.offset(id);
                            let len = pool.block_bytes(kind);
                            for (i, b) in arena[off..off + len].iter_mut().enumerate() {
                                *b = stamp ^ (i as u8);
                            }
                            live.push((id, stamp));
                            stamp = stamp.wrapping_add(1);
                        }
                    }
                    Action::Free(i) if !live.is_empty() => {
                        let (id, _) = live.swap_remove(i % live.len());
                        ops.clear();
                        pool.free(id, &mut ops);
                        for op in &ops {
                            op.apply_bytes(&mut arena);
                        }
                    }
                    Action::Free(_) => {}
                }
                pool.check_invariants().map_err(TestCaseError::fail)?;
                for &(id, s) in &live {
                    let off = pool.offset(id);
                    let len = pool.block_bytes(pool.kind(id));
                    for (i, b) in arena[off..off + len].iter().enumerate() {
                        prop_assert_eq!(*b, s ^ (i as u8));
                    }
                }
            }
            for (id, _) in live.drain(..) {
                pool.free(id, &mut ops);
            }
            prop_assert_eq!(pool.free_bytes(), 2000);
            prop_assert_eq!(pool.live_blocks().count(), 0);
        }
    }
}
