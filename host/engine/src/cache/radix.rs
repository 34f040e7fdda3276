//! The radix tree itself. Pure bookkeeping over [`BlockId`]s: it never touches the arena and never
//! frees; every block it lets go of is handed back to the caller to free in the pool.

use crate::memory::BlockId;
use k3_cache_events::{BlockRecord, CacheEvent, block_hash};
use std::collections::{BTreeSet, HashMap};

/// A tree node handle (stable while the node lives).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(u32);

impl NodeId {
    pub const ROOT: NodeId = NodeId(0);
}

#[derive(Debug)]
struct Node {
    parent: Option<NodeId>,
    /// Keyed by the child's first page of tokens (children of one node never share a first page).
    children: HashMap<Box<[u32]>, NodeId>,
    tokens: Vec<u32>,
    pages: Vec<BlockId>,
    /// The chained block hash of each page (`k3_cache_events::block_hashes` of the path).
    hashes: Vec<u64>,
    checkpoint: Option<BlockId>,
    /// Requests using this node's KV, counted on every node from the locked one up to the root.
    lock: u32,
    /// Holders about to copy this node's checkpoint (a restore being issued): not evictable.
    pins: u32,
    last_access: u64,
    /// Tokens from the root to the end of this node.
    end: usize,
}

/// Result of [`RadixCache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Deepest matched node holding a checkpoint (or the root): lock it while its KV is used.
    pub node: NodeId,
    /// Usable tokens: KV pages `pages` and the state `checkpoint` cover exactly `0..len`.
    pub len: usize,
    pub pages: Vec<BlockId>,
    pub checkpoint: Option<BlockId>,
    /// Tokens matched by the walk (≥ `len`); `walked - len` tokens must be replayed.
    pub walked: usize,
    /// Where this request should leave a new checkpoint (Marconi branch point), if anywhere.
    pub branch_at: Option<usize>,
}

/// Result of [`RadixCache::insert`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsertOutcome {
    /// The node ending exactly at the inserted length.
    pub node: NodeId,
    /// The tree's pages for the whole inserted path (the caller should use these from now on).
    pub path_pages: Vec<BlockId>,
    /// Blocks the caller must free: its duplicate pages, a checkpoint the tree already had,
    /// checkpoints evicted to respect the per-path cap.
    pub release: Vec<BlockId>,
    /// Whether the offered checkpoint was kept by the tree.
    pub checkpoint_kept: bool,
}

/// Which memory an eviction should free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictWant {
    /// State blocks: any checkpoint.
    State,
    /// KV pages: an unlocked leaf (with its checkpoint).
    Kv,
    /// Any bytes (unified pool): the least recently used candidate of either sort.
    Any,
}

#[derive(Debug)]
pub struct RadixCache {
    page: usize,
    interval: usize,
    per_path_cap: usize,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<u32>,
    clock: u64,
    /// Nodes holding a checkpoint, least recently used first (eviction order).
    lru: BTreeSet<(u64, NodeId)>,
    /// Changes since the last [`take_events`](Self::take_events), while someone listens.
    events: Option<Vec<CacheEvent>>,
}

impl RadixCache {
    /// `page`: tokens per KV page; `interval`: checkpoint alignment (a multiple of `page`);
    /// `per_path_cap`: most checkpoints on one root-to-leaf path (≥ 1).
    pub fn new(page: usize, interval: usize, per_path_cap: usize) -> Self {
        assert!(page > 0 && interval >= page && interval.is_multiple_of(page) && per_path_cap >= 1);
        let root = Node {
            parent: None,
            children: HashMap::new(),
            tokens: Vec::new(),
            pages: Vec::new(),
            hashes: Vec::new(),
            checkpoint: None,
            lock: 0,
            pins: 0,
            last_access: 0,
            end: 0,
        };
        Self {
            page,
            interval,
            per_path_cap,
            nodes: vec![Some(root)],
            free_ids: Vec::new(),
            clock: 0,
            lru: BTreeSet::new(),
            events: None,
        }
    }

    /// Start (or stop) recording changes as [`CacheEvent`]s.
    pub fn record_events(&mut self, on: bool) {
        if on != self.events.is_some() {
            self.events = on.then(Vec::new);
        }
    }

    /// The changes recorded since the last call, in order.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn emit(&mut self, event: CacheEvent) {
        if let Some(events) = self.events.as_mut() {
            events.push(event);
        }
    }

    /// Every held block, parents before children: a subscriber's starting point.
    pub fn block_records(&self) -> Vec<BlockRecord> {
        let mut out = Vec::with_capacity(self.page_count());
        let mut stack = vec![NodeId::ROOT];
        while let Some(id) = stack.pop() {
            let n = self.node(id);
            let last = n.hashes.len().saturating_sub(1);
            out.extend(n.hashes.iter().enumerate().map(|(i, &hash)| BlockRecord {
                hash,
                checkpoint: i == last && n.checkpoint.is_some(),
            }));
            stack.extend(n.children.values().copied());
        }
        out
    }

    /// Tokens per block (KV page).
    pub fn page_tokens(&self) -> usize {
        self.page
    }

    pub fn checkpoint_interval(&self) -> usize {
        self.interval
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id.0 as usize].as_ref().expect("live radix node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id.0 as usize].as_mut().expect("live radix node")
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Record an access, keeping the LRU index in step.
    fn touch(&mut self, id: NodeId, t: u64) {
        let n = self.nodes[id.0 as usize].as_mut().expect("live radix node");
        if n.checkpoint.is_some() {
            self.lru.remove(&(n.last_access, id));
            self.lru.insert((t, id));
        }
        n.last_access = t;
    }

    fn take_checkpoint(&mut self, id: NodeId) -> Option<BlockId> {
        let n = self.nodes[id.0 as usize].as_mut().expect("live radix node");
        let c = n.checkpoint.take();
        if c.is_some() {
            self.lru.remove(&(n.last_access, id));
            let hash = *n.hashes.last().expect("a checkpoint sits on a page");
            self.emit(CacheEvent::Checkpoint {
                hash,
                present: false,
            });
        }
        c
    }

    fn add_node(&mut self, node: Node) -> NodeId {
        match self.free_ids.pop() {
            Some(i) => {
                self.nodes[i as usize] = Some(node);
                NodeId(i)
            }
            None => {
                self.nodes.push(Some(node));
                NodeId((self.nodes.len() - 1) as u32)
            }
        }
    }

    /// Full pages of `a` and `b` that agree, from the start.
    fn common_pages(&self, a: &[u32], b: &[u32]) -> usize {
        a.chunks_exact(self.page)
            .zip(b.chunks_exact(self.page))
            .take_while(|(x, y)| x == y)
            .count()
    }

    /// Number of nodes holding a checkpoint.
    pub fn checkpoint_count(&self) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| n.checkpoint.is_some())
            .count()
    }

    /// KV pages held by the tree.
    pub fn page_count(&self) -> usize {
        self.nodes.iter().flatten().map(|n| n.pages.len()).sum()
    }

    /// Every block the tree owns (pages and checkpoints).
    pub fn owned_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.nodes
            .iter()
            .flatten()
            .flat_map(|n| n.pages.iter().copied().chain(n.checkpoint))
    }

    /// Walk `tokens` (whole pages only) and return the usable prefix. Touches the walked path
    /// (children more recent than parents, so ancestors are evicted first).
    pub fn match_prefix(&mut self, tokens: &[u32]) -> PrefixMatch {
        let mut cur = NodeId::ROOT;
        let mut pos = 0;
        let mut pages = Vec::new();
        let mut best = (NodeId::ROOT, 0usize, 0usize, None);
        let mut path = vec![NodeId::ROOT];
        loop {
            if tokens.len() - pos < self.page {
                break;
            }
            let Some(&child) = self.node(cur).children.get(&tokens[pos..pos + self.page]) else {
                break;
            };
            let n = self.node(child);
            let m = self.common_pages(&n.tokens, &tokens[pos..]);
            pages.extend_from_slice(&n.pages[..m]);
            pos += m * self.page;
            path.push(child);
            if m < n.pages.len() {
                break;
            }
            if let Some(c) = n.checkpoint {
                best = (child, pos, pages.len(), Some(c));
            }
            cur = child;
        }
        for id in path {
            let t = self.tick();
            self.touch(id, t);
        }
        let (node, len, npages, checkpoint) = best;
        pages.truncate(npages);
        let aligned = pos / self.interval * self.interval;
        let branch_at = (aligned > len).then_some(aligned);
        PrefixMatch {
            node,
            len,
            pages,
            checkpoint,
            walked: pos,
            branch_at,
        }
    }

    /// Insert `tokens` (a whole number of pages) with the caller's `pages` for them, and optionally
    /// the state after the last token. New suffix pages become the tree's; duplicates come back in
    /// `release`. The caller's lock is not changed.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        pages: &[BlockId],
        checkpoint: Option<BlockId>,
    ) -> InsertOutcome {
        assert_eq!(tokens.len() % self.page, 0, "insert must be page-aligned");
        assert_eq!(
            tokens.len() / self.page,
            pages.len(),
            "one page per page of tokens"
        );
        let mut release = Vec::new();
        let mut path_pages = Vec::with_capacity(pages.len());
        let mut cur = NodeId::ROOT;
        let mut pos = 0;
        while pos < tokens.len() {
            let key = &tokens[pos..pos + self.page];
            let now = self.tick();
            let Some(&child) = self.node(cur).children.get(key) else {
                let mut previous = self.node(cur).hashes.last().copied();
                let hashes: Vec<u64> = tokens[pos..]
                    .chunks_exact(self.page)
                    .map(|block| {
                        let h = block_hash(previous, block);
                        previous = Some(h);
                        h
                    })
                    .collect();
                self.emit(CacheEvent::Stored {
                    blocks: hashes
                        .iter()
                        .map(|&hash| BlockRecord {
                            hash,
                            checkpoint: false,
                        })
                        .collect(),
                });
                let leaf = Node {
                    parent: Some(cur),
                    children: HashMap::new(),
                    tokens: tokens[pos..].to_vec(),
                    pages: pages[pos / self.page..].to_vec(),
                    hashes,
                    checkpoint: None,
                    lock: 0,
                    pins: 0,
                    last_access: now,
                    end: tokens.len(),
                };
                path_pages.extend_from_slice(&leaf.pages);
                let id = self.add_node(leaf);
                self.node_mut(cur).children.insert(key.into(), id);
                cur = id;
                break;
            };
            let m = self.common_pages(&self.node(child).tokens, &tokens[pos..]);
            debug_assert!(m >= 1);
            let next = if m < self.node(child).pages.len() {
                self.split(child, m)
            } else {
                child
            };
            let first = pos / self.page;
            self.touch(next, now);
            let n = self.node(next);
            for (i, &tree_page) in n.pages.iter().enumerate() {
                let mine = pages[first + i];
                if mine != tree_page {
                    release.push(mine);
                }
                path_pages.push(tree_page);
            }
            pos += m * self.page;
            cur = next;
        }
        let mut checkpoint_kept = false;
        if let Some(c) = checkpoint {
            let interval = self.interval;
            let n = self.node_mut(cur);
            if cur == NodeId::ROOT || n.checkpoint.is_some() || !n.end.is_multiple_of(interval) {
                release.push(c);
            } else {
                n.checkpoint = Some(c);
                let key = (n.last_access, cur);
                let hash = *n.hashes.last().expect("a checkpoint sits on a page");
                self.lru.insert(key);
                self.emit(CacheEvent::Checkpoint {
                    hash,
                    present: true,
                });
                checkpoint_kept = true;
                self.enforce_path_cap(cur, &mut release);
            }
        }
        InsertOutcome {
            node: cur,
            path_pages,
            release,
            checkpoint_kept,
        }
    }

    /// Split `id` after its first `m` pages; returns the new upper node.
    fn split(&mut self, id: NodeId, m: usize) -> NodeId {
        let cut = m * self.page;
        let (parent, upper_tokens, upper_pages, upper_hashes, lock, last_access, end) = {
            let n = self.node_mut(id);
            let upper_tokens: Vec<u32> = n.tokens.drain(..cut).collect();
            let upper_pages: Vec<BlockId> = n.pages.drain(..m).collect();
            let upper_hashes: Vec<u64> = n.hashes.drain(..m).collect();
            (
                n.parent.expect("non-root"),
                upper_tokens,
                upper_pages,
                upper_hashes,
                n.lock,
                n.last_access,
                n.end,
            )
        };
        let key: Box<[u32]> = upper_tokens[..self.page].into();
        let lower_key: Box<[u32]> = self.node(id).tokens[..self.page].into();
        let upper = Node {
            parent: Some(parent),
            children: HashMap::from([(lower_key, id)]),
            tokens: upper_tokens,
            pages: upper_pages,
            hashes: upper_hashes,
            // The recurrent state cannot be cut: the new upper node starts as a tombstone.
            checkpoint: None,
            lock,
            pins: 0,
            last_access,
            end: end - self.node(id).tokens.len(),
        };
        let uid = self.add_node(upper);
        self.node_mut(id).parent = Some(uid);
        self.node_mut(parent).children.insert(key, uid);
        uid
    }

    /// Keep at most `per_path_cap` checkpoints on every root-to-leaf path through `at`, evicting
    /// least recently used ones (never `at` itself, the one just admitted).
    fn enforce_path_cap(&mut self, at: NodeId, release: &mut Vec<BlockId>) {
        let mut leaves = Vec::new();
        let mut stack = vec![at];
        while let Some(id) = stack.pop() {
            let n = self.node(id);
            if n.children.is_empty() {
                leaves.push(id);
            }
            stack.extend(n.children.values().copied());
        }
        for leaf in leaves {
            if self.nodes[leaf.0 as usize].is_none() {
                continue;
            }
            loop {
                let mut holders = Vec::new();
                let mut cur = Some(leaf);
                while let Some(id) = cur {
                    let n = self.node(id);
                    if n.checkpoint.is_some() {
                        holders.push((n.last_access, id));
                    }
                    cur = n.parent;
                }
                if holders.len() <= self.per_path_cap {
                    break;
                }
                let victim = holders
                    .iter()
                    .filter(|(_, id)| *id != at)
                    .min()
                    .map(|&(_, id)| id);
                let Some(victim) = victim else { break };
                release.extend(self.take_checkpoint(victim));
                self.prune(victim, release);
                if self.nodes[leaf.0 as usize].is_none() {
                    break;
                }
            }
        }
    }

    /// Keep `id`'s checkpoint from eviction until [`unpin`](Self::unpin) (while a restore from it
    /// is being issued).
    pub fn pin(&mut self, id: NodeId) {
        self.node_mut(id).pins += 1;
    }

    pub fn unpin(&mut self, id: NodeId) {
        let n = self.node_mut(id);
        assert!(n.pins > 0, "radix unpin without pin");
        n.pins -= 1;
    }

    /// Lock `id` and its ancestors (their KV is in use by a request).
    pub fn lock(&mut self, id: NodeId) {
        let mut cur = Some(id);
        while let Some(c) = cur {
            let n = self.node_mut(c);
            n.lock += 1;
            cur = n.parent;
        }
    }

    /// Undo one [`lock`](Self::lock); prunes what became useless, returning its blocks.
    pub fn unlock(&mut self, id: NodeId, release: &mut Vec<BlockId>) {
        let mut cur = Some(id);
        while let Some(c) = cur {
            let n = self.node_mut(c);
            assert!(n.lock > 0, "radix unlock without lock");
            n.lock -= 1;
            cur = n.parent;
        }
        self.prune(id, release);
    }

    /// Delete `id` and then its ancestors while each is an unlocked leaf without a checkpoint.
    fn prune(&mut self, id: NodeId, release: &mut Vec<BlockId>) {
        let mut cur = id;
        while cur != NodeId::ROOT {
            let n = self.node(cur);
            if !n.children.is_empty() || n.lock > 0 || n.checkpoint.is_some() {
                return;
            }
            let parent = n.parent.expect("non-root");
            let key: Box<[u32]> = n.tokens[..self.page].into();
            let node = self.nodes[cur.0 as usize].take().expect("live");
            self.free_ids.push(cur.0);
            release.extend(node.pages);
            self.emit(CacheEvent::Removed {
                hashes: node.hashes,
            });
            self.node_mut(parent).children.remove(&key);
            cur = parent;
        }
    }

    /// Evict the least recently used candidate for `want`; returns false when nothing is evictable.
    pub fn evict_one(&mut self, want: EvictWant, release: &mut Vec<BlockId>) -> bool {
        let victim = self.lru.iter().map(|&(_, id)| id).find(|&id| {
            let n = self.node(id);
            n.pins == 0
                && match want {
                    EvictWant::State | EvictWant::Any => true,
                    EvictWant::Kv => n.children.is_empty() && n.lock == 0,
                }
        });
        let Some(v) = victim else { return false };
        release.extend(self.take_checkpoint(v));
        self.prune(v, release);
        true
    }

    /// Evict everything not locked (admin flush, tests).
    pub fn evict_all(&mut self, release: &mut Vec<BlockId>) {
        while self.evict_one(EvictWant::Any, release) {}
    }

    /// Structural invariants; `Err` names the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let indexed: BTreeSet<(u64, NodeId)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                n.as_ref()
                    .filter(|n| n.checkpoint.is_some())
                    .map(|n| (n.last_access, NodeId(i as u32)))
            })
            .collect();
        if indexed != self.lru {
            return Err("checkpoint LRU index out of step with the tree".into());
        }
        let mut seen = std::collections::HashSet::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            let id = NodeId(i as u32);
            if n.tokens.len() != n.pages.len() * self.page {
                return Err(format!(
                    "{id:?}: {} tokens for {} pages",
                    n.tokens.len(),
                    n.pages.len()
                ));
            }
            for b in n.pages.iter().chain(n.checkpoint.iter()) {
                if !seen.insert(*b) {
                    return Err(format!("{b:?} held twice in the tree"));
                }
            }
            let child_locks: u32 = n.children.values().map(|c| self.node(*c).lock).sum();
            if child_locks > n.lock {
                return Err(format!(
                    "{id:?}: lock {} < children's {child_locks}",
                    n.lock
                ));
            }
            for (key, &c) in &n.children {
                let child = self.nodes[c.0 as usize]
                    .as_ref()
                    .ok_or(format!("dangling child {c:?}"))?;
                if child.parent != Some(id)
                    || child.tokens.is_empty()
                    || child.tokens[..self.page] != **key
                {
                    return Err(format!("{c:?}: bad parent link or key"));
                }
                if child.end != n.end + child.tokens.len() {
                    return Err(format!("{c:?}: end {} mismatch", child.end));
                }
            }
            if id == NodeId::ROOT {
                if n.checkpoint.is_some() || !n.tokens.is_empty() {
                    return Err("root holds data".into());
                }
                continue;
            }
            let previous = self
                .node(n.parent.ok_or("orphan node")?)
                .hashes
                .last()
                .copied();
            if n.hashes.len() != n.pages.len()
                || n.hashes.first() != Some(&block_hash(previous, &n.tokens[..self.page]))
            {
                return Err(format!("{id:?}: block hashes out of step with its tokens"));
            }
            if n.checkpoint.is_some() && !n.end.is_multiple_of(self.interval) {
                return Err(format!("{id:?}: checkpoint at unaligned {}", n.end));
            }
            if n.children.is_empty() && n.lock == 0 && n.checkpoint.is_none() {
                return Err(format!("{id:?}: unlocked leaf without checkpoint"));
            }
            let parent = n.parent.ok_or("orphan node")?;
            if self.nodes[parent.0 as usize].is_none() {
                return Err(format!("{id:?}: parent gone"));
            }
        }
        Ok(())
    }

    /// Whether no request holds a lock or pin anywhere (true whenever nothing is running).
    pub fn is_unreferenced(&self) -> bool {
        self.nodes
            .iter()
            .flatten()
            .all(|n| n.lock == 0 && n.pins == 0)
    }

    /// Checkpoints on the path ending at `id` (tests).
    pub fn path_checkpoints(&self, id: NodeId) -> usize {
        let mut count = 0;
        let mut cur = Some(id);
        while let Some(c) = cur {
            let n = self.node(c);
            count += usize::from(n.checkpoint.is_some());
            cur = n.parent;
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{BlockKind, MemoryPool, PoolMode};
    use k3_model::CacheLayout;
    use proptest::prelude::*;
    use std::collections::HashMap;

    const PAGE: usize = 2;
    const INTERVAL: usize = 4;

    /// A pool standing in for the arena, plus a record of which token prefix each checkpoint
    /// block was made for (so a match can be checked against the truth).
    struct World {
        pool: MemoryPool,
        tree: RadixCache,
        ckpt_of: HashMap<BlockId, Vec<u32>>,
        page_of: HashMap<BlockId, (Vec<u32>, usize)>,
        ops: Vec<crate::memory::ArenaOp>,
    }

    impl World {
        fn new(cap: usize) -> Self {
            let layout = CacheLayout {
                page_tokens: PAGE,
                kv_page_bytes: 8,
                state_block_bytes: 16,
                verify_tokens_max: 0,
                arena_bytes: 1 << 20,
            };
            Self {
                pool: MemoryPool::new(layout, PoolMode::Unified).unwrap(),
                tree: RadixCache::new(PAGE, INTERVAL, cap),
                ckpt_of: HashMap::new(),
                page_of: HashMap::new(),
                ops: Vec::new(),
            }
        }

        fn release(&mut self, blocks: Vec<BlockId>) {
            for b in blocks {
                self.ckpt_of.remove(&b);
                self.page_of.remove(&b);
                self.pool.free(b, &mut self.ops);
            }
        }

        /// What a request does: match, then insert its aligned prefix with fresh pages past the
        /// match and a checkpoint at the end.
        fn serve(&mut self, tokens: &[u32]) -> Result<(), TestCaseError> {
            let m = self.tree.match_prefix(tokens);
            prop_assert!(m.len <= m.walked && m.len.is_multiple_of(PAGE));
            if let Some(c) = m.checkpoint {
                prop_assert_eq!(
                    &self.ckpt_of[&c][..],
                    &tokens[..m.len],
                    "checkpoint for another prefix"
                );
            } else {
                prop_assert_eq!(m.len, 0);
            }
            for (i, p) in m.pages.iter().enumerate() {
                let (t, idx) = &self.page_of[p];
                prop_assert_eq!(*idx, i);
                prop_assert_eq!(&t[..], &tokens[i * PAGE..(i + 1) * PAGE]);
            }
            self.tree.lock(m.node);
            let end = tokens.len() / INTERVAL * INTERVAL;
            let mut inserts: Vec<usize> = m.branch_at.into_iter().collect();
            if end > m.len && Some(end) != m.branch_at {
                inserts.push(end);
            }
            let mut pages = m.pages.clone();
            let mut node = m.node;
            for at in inserts {
                while pages.len() < at / PAGE {
                    let i = pages.len();
                    let p = self.pool.alloc(BlockKind::Kv).unwrap();
                    self.page_of
                        .insert(p, (tokens[i * PAGE..(i + 1) * PAGE].to_vec(), i));
                    pages.push(p);
                }
                let c = self.pool.alloc(BlockKind::State).unwrap();
                self.ckpt_of.insert(c, tokens[..at].to_vec());
                let out = self
                    .tree
                    .insert(&tokens[..at], &pages[..at / PAGE], Some(c));
                pages.splice(..at / PAGE, out.path_pages.iter().copied());
                self.tree.lock(out.node);
                let mut rel = out.release;
                self.tree.unlock(node, &mut rel);
                node = out.node;
                self.release(rel);
            }
            let extra: Vec<BlockId> = pages
                .iter()
                .skip(node_end(&self.tree, node) / PAGE)
                .copied()
                .collect();
            let mut rel = extra;
            self.tree.unlock(node, &mut rel);
            self.release(rel);
            Ok(())
        }
    }

    fn node_end(tree: &RadixCache, id: NodeId) -> usize {
        tree.node(id).end
    }

    #[test]
    fn branch_point_is_reported_and_filled() {
        let mut w = World::new(4);
        let a: Vec<u32> = (0..12).collect();
        w.serve(&a).unwrap();
        // Diverges at token 6: walk reaches 6, branch point rounds down to 4.
        let mut b = a.clone();
        b[6] = 99;
        let m = w.tree.match_prefix(&b);
        assert_eq!((m.len, m.walked, m.branch_at), (0, 6, Some(4)));
        w.serve(&b).unwrap();
        let m = w.tree.match_prefix(&b);
        assert_eq!(m.len, 12);
        let mut c = a.clone();
        c[7] = 77;
        let m = w.tree.match_prefix(&c);
        assert_eq!((m.len, m.walked), (4, 6), "restores at the branch point");
        w.tree.check_invariants().unwrap();
    }

    #[test]
    fn tombstone_then_prune() {
        let mut w = World::new(4);
        let a: Vec<u32> = (0..8).collect();
        w.serve(&a).unwrap();
        let mut b = a.clone();
        b[5] = 50;
        w.serve(&b).unwrap();
        assert_eq!(w.tree.checkpoint_count(), 3);
        let mut rel = Vec::new();
        w.tree.evict_all(&mut rel);
        w.release(rel);
        assert_eq!(w.tree.checkpoint_count(), 0);
        assert_eq!(w.tree.page_count(), 0);
        assert_eq!(w.pool.free_bytes(), 1 << 20);
    }

    proptest! {
        #[test]
        fn tree_stays_consistent(
            reqs in prop::collection::vec((0usize..3, prop::collection::vec(0u32..3, 0..20)), 1..40),
            evictions in prop::collection::vec(0u8..4, 1..40),
            cap in 1usize..4,
        ) {
            let mut w = World::new(cap);
            let prefixes: [Vec<u32>; 3] = [vec![], (0..8).collect(), (0..16).map(|x| x % 5).collect()];
            for (i, (p, tail)) in reqs.iter().enumerate() {
                let mut t = prefixes[*p].clone();
                t.extend(tail);
                w.serve(&t)?;
                w.tree.check_invariants().map_err(TestCaseError::fail)?;
                let mut rel = Vec::new();
                match evictions[i % evictions.len()] {
                    0 => { w.tree.evict_one(EvictWant::State, &mut rel); }
                    1 => { w.tree.evict_one(EvictWant::Kv, &mut rel); }
                    _ => {}
                }
                w.release(rel);
                w.tree.check_invariants().map_err(TestCaseError::fail)?;
                let owned: std::collections::HashSet<_> = w.tree.owned_blocks().collect();
                let live: std::collections::HashSet<_> = w.pool.live_blocks().map(|b| b.0).collect();
                prop_assert_eq!(owned, live, "tree and pool disagree");
                for i in 0..w.tree.nodes.len() {
                    if w.tree.nodes[i].is_some() {
                        prop_assert!(w.tree.path_checkpoints(NodeId(i as u32)) <= cap, "per-path cap");
                    }
                }
            }
            let mut rel = Vec::new();
            w.tree.evict_all(&mut rel);
            w.release(rel);
            prop_assert_eq!(w.pool.free_bytes(), 1 << 20);
        }
    }
}
