//! What a replica's prefix cache holds, told as events, and the router's index over them
//! (docs/routing.md).
//!
//! A replica's cache is a radix tree over token ids whose nodes hold full KV pages and, sparsely,
//! KDA state checkpoints. Outside the replica it is described page by page: each full block of
//! `block_tokens` ids is named by a chained hash ([`block_hashes`]), so a block's hash names the
//! whole prefix up to its end, and a router can hash a prompt the same way without the tree. A
//! block is *usable* for a new request only up to the deepest block, inside the match, that ends
//! at a checkpoint: the recurrent state cannot be rebuilt from KV ([`PrefixHit`]).
//!
//! Events are JSON objects tagged by `"type"` ([`CacheEvent`]); a subscriber first gets a
//! [`CacheEvent::Snapshot`] of everything, then the changes in order.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The hash of one full block given the hash of the block before it (`None` for the first):
/// xxh3-64 of the block's ids as little-endian `u32`s, seeded with the previous hash (0 first).
pub fn block_hash(previous: Option<u64>, block: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(block.len() * 4);
    for id in block {
        bytes.extend_from_slice(&id.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, previous.unwrap_or(0))
}

/// The chained hashes of `tokens`' full blocks (a trailing partial block has none).
pub fn block_hashes(tokens: &[u32], block_tokens: usize) -> Vec<u64> {
    if block_tokens == 0 {
        return Vec::new();
    }
    let mut previous = None;
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            let h = block_hash(previous, block);
            previous = Some(h);
            h
        })
        .collect()
}

/// One cached block: its chained hash and whether a KDA checkpoint sits at its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    pub hash: u64,
    pub checkpoint: bool,
}

/// A replica's load, as a router weighs it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaLoad {
    /// Sequences in the running batch.
    pub running: u32,
    /// Requests admitted and waiting for a slot.
    pub waiting: u32,
    /// The unified pool (KV pages and state blocks), in bytes.
    pub free_pool_bytes: u64,
    pub total_pool_bytes: u64,
    /// The same pool in KV blocks of `block_tokens` tokens.
    pub free_blocks: u32,
    pub total_blocks: u32,
}

/// What changed in a replica's prefix cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CacheEvent {
    /// Everything the cache holds now; a subscriber's first event.
    Snapshot {
        block_tokens: u32,
        checkpoint_interval: u32,
        blocks: Vec<BlockRecord>,
        load: ReplicaLoad,
    },
    /// Blocks newly held, parents before children.
    Stored {
        blocks: Vec<BlockRecord>,
    },
    /// Blocks no longer held (their checkpoints with them).
    Removed {
        hashes: Vec<u64>,
    },
    /// A checkpoint placed at, or evicted from, the end of a held block.
    Checkpoint {
        hash: u64,
        present: bool,
    },
    /// The cache was emptied.
    Cleared,
    Load(ReplicaLoad),
}

/// How much of a prompt one replica holds, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Leading blocks held as KV.
    pub walked_blocks: u32,
    /// Leading blocks up to the deepest one ending at a checkpoint: what a request skips.
    pub usable_blocks: u32,
}

/// One replica's cache as seen from outside, kept from its events.
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    /// Held block hash → a checkpoint sits at its end.
    blocks: HashMap<u64, bool>,
    block_tokens: Option<usize>,
    checkpoint_interval: Option<usize>,
    load: Option<ReplicaLoad>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply one event. A [`CacheEvent::Snapshot`] replaces everything.
    pub fn apply(&mut self, event: &CacheEvent) {
        match event {
            CacheEvent::Snapshot {
                block_tokens,
                checkpoint_interval,
                blocks,
                load,
            } => {
                self.blocks = blocks.iter().map(|b| (b.hash, b.checkpoint)).collect();
                self.block_tokens = Some(*block_tokens as usize);
                self.checkpoint_interval = Some(*checkpoint_interval as usize);
                self.load = Some(*load);
            }
            CacheEvent::Stored { blocks } => {
                for b in blocks {
                    self.blocks.insert(b.hash, b.checkpoint);
                }
            }
            CacheEvent::Removed { hashes } => {
                for h in hashes {
                    self.blocks.remove(h);
                }
            }
            CacheEvent::Checkpoint { hash, present } => {
                // A checkpoint only ever sits on a held block; one naming another is stale.
                if let Some(flag) = self.blocks.get_mut(hash) {
                    *flag = *present;
                }
            }
            CacheEvent::Cleared => self.blocks.clear(),
            CacheEvent::Load(load) => self.load = Some(*load),
        }
    }

    /// Forget everything (the replica's stream broke: nothing is known until the next snapshot).
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// Whether a snapshot has been applied since the last reset.
    pub fn is_synced(&self) -> bool {
        self.block_tokens.is_some()
    }

    /// How many of `hashes` (a prompt's [`block_hashes`]) lead the replica's cache.
    pub fn matched(&self, hashes: &[u64]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        for (i, h) in hashes.iter().enumerate() {
            let Some(&checkpoint) = self.blocks.get(h) else {
                break;
            };
            hit.walked_blocks = i as u32 + 1;
            if checkpoint {
                hit.usable_blocks = hit.walked_blocks;
            }
        }
        hit
    }

    pub fn block_tokens(&self) -> Option<usize> {
        self.block_tokens
    }

    pub fn checkpoint_interval(&self) -> Option<usize> {
        self.checkpoint_interval
    }

    pub fn load(&self) -> Option<ReplicaLoad> {
        self.load
    }

    /// Held blocks and, of those, blocks with a checkpoint.
    pub fn counts(&self) -> (usize, usize) {
        (
            self.blocks.len(),
            self.blocks.values().filter(|c| **c).count(),
        )
    }

    /// Every held block (for comparing an index against the cache it mirrors).
    pub fn records(&self) -> Vec<BlockRecord> {
        let mut v: Vec<BlockRecord> = self
            .blocks
            .iter()
            .map(|(&hash, &checkpoint)| BlockRecord { hash, checkpoint })
            .collect();
        v.sort_by_key(|b| b.hash);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hashes_chain_and_ignore_the_partial_tail() {
        let a = block_hashes(&[1, 2, 3, 4, 5], 2);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], block_hash(None, &[1, 2]));
        assert_eq!(a[1], block_hash(Some(a[0]), &[3, 4]));
        // The same block after a different prefix is a different block.
        let b = block_hashes(&[9, 9, 3, 4], 2);
        assert_ne!(a[1], b[1]);
        assert!(block_hashes(&[1, 2, 3], 0).is_empty());
    }

    #[test]
    fn the_hash_is_fixed_across_processes() {
        // Replicas and routers of different builds must agree: the function is part of the wire.
        assert_eq!(block_hash(None, &[]), xxh3_64_with_seed(&[], 0));
        assert_eq!(
            block_hash(None, &[1]),
            xxh3_64_with_seed(&[1, 0, 0, 0], 0),
            "ids are little-endian u32"
        );
    }

    #[test]
    fn usable_stops_at_the_deepest_checkpoint() {
        let h = block_hashes(&(0..64).collect::<Vec<u32>>(), 8);
        let mut idx = PrefixIndex::new();
        assert!(!idx.is_synced());
        idx.apply(&CacheEvent::Snapshot {
            block_tokens: 8,
            checkpoint_interval: 32,
            blocks: h[..6]
                .iter()
                .enumerate()
                .map(|(i, &hash)| BlockRecord {
                    hash,
                    checkpoint: i == 3,
                })
                .collect(),
            load: ReplicaLoad::default(),
        });
        assert!(idx.is_synced());
        assert_eq!(
            idx.matched(&h),
            PrefixHit {
                walked_blocks: 6,
                usable_blocks: 4
            }
        );
        idx.apply(&CacheEvent::Checkpoint {
            hash: h[3],
            present: false,
        });
        assert_eq!(idx.matched(&h).usable_blocks, 0);
        idx.apply(&CacheEvent::Removed { hashes: vec![h[2]] });
        assert_eq!(idx.matched(&h).walked_blocks, 2);
        idx.apply(&CacheEvent::Cleared);
        assert_eq!(idx.matched(&h), PrefixHit::default());
    }

    #[test]
    fn events_round_trip_as_tagged_json() {
        let events = [
            CacheEvent::Stored {
                blocks: vec![BlockRecord {
                    hash: u64::MAX,
                    checkpoint: true,
                }],
            },
            CacheEvent::Removed { hashes: vec![7] },
            CacheEvent::Checkpoint {
                hash: 3,
                present: true,
            },
            CacheEvent::Cleared,
            CacheEvent::Load(ReplicaLoad {
                running: 1,
                waiting: 2,
                free_pool_bytes: 3,
                total_pool_bytes: 4,
                free_blocks: 5,
                total_blocks: 6,
            }),
        ];
        for e in events {
            let s = serde_json::to_string(&e).unwrap();
            assert!(s.starts_with("{\"type\":"), "{s}");
            assert_eq!(serde_json::from_str::<CacheEvent>(&s).unwrap(), e);
        }
        let s = serde_json::to_string(&CacheEvent::Load(ReplicaLoad::default())).unwrap();
        assert!(s.contains("\"type\":\"load\""), "{s}");
    }

    proptest! {
        /// Replaying any event sequence and then taking a snapshot of the result gives the same
        /// index as the replay, and a prompt's hit never exceeds its blocks or its walked part.
        #[test]
        fn hits_are_bounded(ops in proptest::collection::vec((0u8..4, 0usize..12), 0..60)) {
            let h = block_hashes(&(0..96).collect::<Vec<u32>>(), 8);
            let mut idx = PrefixIndex::new();
            for (op, i) in ops {
                let e = match op {
                    0 => CacheEvent::Stored { blocks: vec![BlockRecord { hash: h[i], checkpoint: i % 3 == 0 }] },
                    1 => CacheEvent::Removed { hashes: vec![h[i]] },
                    2 => CacheEvent::Checkpoint { hash: h[i], present: i % 2 == 0 },
                    _ => CacheEvent::Load(ReplicaLoad { running: i as u32, ..Default::default() }),
                };
                idx.apply(&e);
                let hit = idx.matched(&h);
                prop_assert!(hit.usable_blocks <= hit.walked_blocks);
                prop_assert!(hit.walked_blocks as usize <= h.len());
            }
            let mut copy = PrefixIndex::new();
            copy.apply(&CacheEvent::Snapshot { block_tokens: 8, checkpoint_interval: 32, blocks: idx.records(), load: ReplicaLoad::default() });
            prop_assert_eq!(copy.records(), idx.records());
            prop_assert_eq!(copy.matched(&h), idx.matched(&h));
        }
    }
}
