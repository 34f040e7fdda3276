//! Prefix cache for a hybrid model: a radix tree over token ids whose nodes hold MLA KV pages and,
//! sparsely, KDA state checkpoints (the recurrent state after the node's last token).
//!
//! Rules (after SGLang's `MambaRadixCache` and Marconi):
//! - Every node boundary is page-aligned; the tree only ever holds full KV pages.
//! - A checkpoint sits at a node end that is a multiple of the checkpoint interval.
//! - A match is usable only up to the deepest matched node holding a checkpoint: the recurrent
//!   state cannot be rebuilt from KV, so KV without a state above it must be replayed.
//! - When a walk went deeper than that (the request diverges inside, or below, a cached path), the
//!   match reports a *branch point* (the walked length rounded down to the interval); the request
//!   checkpoints there during its prefill, so the next request diverging there restores directly.
//! - Checkpoints are capped per root-to-node path (LRU within the path) and evicted by global LRU;
//!   evicting one alone leaves a *tombstone* whose KV stays for descendants. A leaf with neither a
//!   checkpoint nor a lock is useless and is pruned at once.

mod media_keys;
mod radix;

pub(crate) use media_keys::{cache_key, validate_spans};

pub use radix::{EvictWant, InsertOutcome, NodeId, PrefixMatch, RadixCache};
