//! Ids of recently encoded client text, shared by every request of a server (or router).
//!
//! Multi-turn traffic re-sends the whole conversation each turn: every earlier message, the
//! system prompt and tool definitions come back verbatim, and BPE over them would be redone on
//! every turn, in the router and again in the replica. `encode_segments`
//! (segments.rs) encodes each stretch of text between two special tokens on its own,
//! so a stretch seen before maps to the same ids: caching by the exact text is exact.
//!
//! Bounded by bytes (text plus ids), least recently used evicted first; short stretches are not
//! cached (they are cheap to encode and would only churn the cache).

use std::sync::{Arc, Mutex};

use lru::LruCache;

/// Stretches shorter than this many bytes are encoded every time.
pub const MIN_CACHED_BYTES: usize = 256;
/// Bytes of text and ids the cache may hold.
pub const CACHE_BYTES: usize = 64 << 20;

/// Lookups and hits so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TextCacheStats {
    pub lookups: u64,
    pub hits: u64,
    pub bytes: usize,
}

#[derive(Debug)]
struct Inner {
    map: LruCache<Box<str>, Arc<[u32]>>,
    bytes: usize,
    stats: TextCacheStats,
}

/// The cache; cloning a `Tokenizer` shares it.
#[derive(Debug)]
pub struct TextCache {
    inner: Mutex<Inner>,
    budget: usize,
}

fn cost(text: &str, ids: &[u32]) -> usize {
    text.len() + 4 * ids.len()
}

impl TextCache {
    pub fn new(budget: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                map: LruCache::unbounded(),
                bytes: 0,
                stats: TextCacheStats::default(),
            }),
            budget,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves a consistent map: keep using it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `encode(text)`, from the cache when `text` was encoded before. The lock is not held
    /// while encoding, so two requests may encode the same new text at once (both get the same
    /// ids; the second insert replaces the first).
    pub fn get_or_encode<E>(
        &self,
        text: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        if text.len() < MIN_CACHED_BYTES {
            return encode(text);
        }
        {
            let mut g = self.lock();
            g.stats.lookups += 1;
            if let Some(ids) = g.map.get(text).cloned() {
                g.stats.hits += 1;
                return Ok(ids.to_vec());
            }
        }
        let ids = encode(text)?;
        let c = cost(text, &ids);
        if c <= self.budget {
            let mut g = self.lock();
            if let Some(old) = g.map.put(text.into(), ids.as_slice().into()) {
                g.bytes -= cost(text, &old);
            }
            g.bytes += c;
            while g.bytes > self.budget {
                match g.map.pop_lru() {
                    Some((k, v)) => g.bytes -= cost(&k, &v),
                    None => break,
                }
            }
        }
        Ok(ids)
    }

    pub fn stats(&self) -> TextCacheStats {
        let g = self.lock();
        TextCacheStats {
            bytes: g.bytes,
            ..g.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::convert::Infallible;

    fn fake(text: &str) -> Result<Vec<u32>, Infallible> {
        Ok(text.bytes().map(u32::from).collect())
    }

    #[test]
    fn repeats_hit_and_short_text_is_not_cached() {
        let c = TextCache::new(1 << 20);
        let long = "x".repeat(MIN_CACHED_BYTES);
        let mut calls = 0;
        for _ in 0..3 {
            let ids = c
                .get_or_encode(&long, |t| {
                    calls += 1;
                    fake(t)
                })
                .unwrap();
            assert_eq!(ids.len(), MIN_CACHED_BYTES);
        }
        assert_eq!(calls, 1);
        c.get_or_encode("short", fake).unwrap();
        let s = c.stats();
        assert_eq!((s.lookups, s.hits), (3, 2));
        assert_eq!(s.bytes, 5 * MIN_CACHED_BYTES);
    }

    #[test]
    fn errors_are_not_cached() {
        let c = TextCache::new(1 << 20);
        let long = "y".repeat(300);
        assert!(
            c.get_or_encode(&long, |_| Err::<Vec<u32>, _>("no"))
                .is_err()
        );
        assert_eq!(c.get_or_encode(&long, fake).unwrap().len(), 300);
        assert_eq!(c.stats().hits, 0);
    }

    proptest! {
        /// Whatever the sequence of texts: the ids are the encoder's, and the cache never holds
        /// more than its budget.
        #[test]
        fn cached_ids_are_the_encoders_and_the_budget_holds(
            picks in proptest::collection::vec(0usize..12, 1..80),
            budget in 1000usize..6000,
        ) {
            let texts: Vec<String> = (0..12).map(|i| format!("{i}").repeat(256 + 37 * i)).collect();
            let c = TextCache::new(budget);
            for p in picks {
                let got = c.get_or_encode(&texts[p], fake).unwrap();
                prop_assert_eq!(got, fake(&texts[p]).unwrap());
                prop_assert!(c.stats().bytes <= budget);
            }
        }
    }
}
