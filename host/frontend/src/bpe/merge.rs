//! BPE over one pre-token, in raw bytes: the same merge order as `tokenizers` (lowest merge rank
//! first, leftmost among equals, driven by a heap over a linked list of symbols), so the ids are
//! identical; the byte-to-unicode alphabet is only a spelling of the vocabulary and is undone at
//! load time.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

/// The BPE tables in byte space.
pub(crate) struct Bpe {
    /// Id of every single byte.
    byte_ids: [u32; 256],
    /// `(left id, right id)` packed in a `u64` → `(rank, merged id)`.
    merges: FxHashMap<u64, (u32, u32)>,
    /// Merged id of each rank in `merges` (ranks not in it: unused).
    rank_ids: Vec<u32>,
    /// Pre-tokens that are one token: vocabulary entries that BPE of their own bytes reaches in
    /// one piece (or every entry, when the model ignores merges for whole-vocabulary words).
    whole: FxHashMap<Box<[u8]>, u32>,
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
    alive: bool,
}

const NONE: u32 = u32::MAX;

/// Words up to this many bytes queue their merges in a plain list scanned for its minimum,
/// cheaper than a heap at that size; the order popped is the same.
const LIST_QUEUE_MAX: usize = 16;

/// Pending merges keyed `rank << 32 | position`, popped smallest first: lowest rank, then
/// leftmost, the order of `tokenizers`' heap. Equal keys are the same merge, so ties do not
/// matter.
#[derive(Default)]
struct Queue {
    list: Vec<u64>,
    heap: BinaryHeap<Reverse<u64>>,
    use_list: bool,
}

impl Queue {
    fn reset(&mut self, word_len: usize) {
        self.list.clear();
        self.heap.clear();
        self.use_list = word_len <= LIST_QUEUE_MAX;
    }

    #[inline]
    fn push(&mut self, rank: u32, pos: usize) {
        let key = ((rank as u64) << 32) | pos as u64;
        if self.use_list {
            self.list.push(key);
        } else {
            self.heap.push(Reverse(key));
        }
    }

    #[inline]
    fn pop(&mut self) -> Option<(u32, usize)> {
        let key = if self.use_list {
            let (i, _) = self.list.iter().enumerate().min_by_key(|&(_, k)| *k)?;
            self.list.swap_remove(i)
        } else {
            self.heap.pop()?.0
        };
        Some(((key >> 32) as u32, key as u32 as usize))
    }
}

/// Buffers reused across words.
#[derive(Default)]
pub(crate) struct Scratch {
    symbols: Vec<Symbol>,
    queue: Queue,
}

#[inline]
fn pair(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

impl Bpe {
    /// `vocab`: every token spelled as raw bytes; `merges`: pairs of byte strings by rank.
    /// `None` when a byte has no token (then `tokenizers` would emit unknowns or drop bytes)
    /// or a merge names a missing token.
    pub(crate) fn new(
        vocab: &FxHashMap<Box<[u8]>, u32>,
        merges: &[(Vec<u8>, Vec<u8>)],
        ignore_merges: bool,
    ) -> Option<Bpe> {
        let mut byte_ids = [0u32; 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            *id = *vocab.get(&[b as u8][..])?;
        }
        let mut merge_map = FxHashMap::default();
        let mut rank_ids = vec![0; merges.len()];
        for (rank, (a, b)) in merges.iter().enumerate() {
            let joined: Vec<u8> = a.iter().chain(b).copied().collect();
            let (a, b, m) = (
                vocab.get(&a[..])?,
                vocab.get(&b[..])?,
                vocab.get(&joined[..])?,
            );
            // As `tokenizers`: a repeated pair keeps its last rank.
            merge_map.insert(pair(*a, *b), (rank as u32, *m));
            rank_ids[rank] = *m;
        }
        let mut bpe = Bpe {
            byte_ids,
            merges: merge_map,
            rank_ids,
            whole: FxHashMap::default(),
        };
        let mut whole = FxHashMap::default();
        let mut scratch = Scratch::default();
        let mut ids = Vec::new();
        for (bytes, &id) in vocab {
            if !ignore_merges {
                ids.clear();
                bpe.merge(bytes, &mut scratch, &mut ids);
                if ids != [id] {
                    continue;
                }
            }
            whole.insert(bytes.clone(), id);
        }
        bpe.whole = whole;
        Some(bpe)
    }

    /// The single id of `word` if it is one token.
    #[inline]
    pub(crate) fn whole(&self, word: &[u8]) -> Option<u32> {
        match word {
            [b] => Some(self.byte_ids[*b as usize]),
            _ => self.whole.get(word).copied(),
        }
    }

    /// Appends the ids of `word` (non-empty) to `out`.
    pub(crate) fn merge(&self, word: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let Scratch { symbols, queue } = scratch;
        symbols.clear();
        queue.reset(word.len());
        let n = word.len() as u32;
        symbols.extend(word.iter().enumerate().map(|(i, &b)| Symbol {
            id: self.byte_ids[b as usize],
            prev: if i == 0 { NONE } else { i as u32 - 1 },
            next: if i as u32 + 1 == n {
                NONE
            } else {
                i as u32 + 1
            },
            alive: true,
        }));
        for i in 0..symbols.len().saturating_sub(1) {
            if let Some(&(rank, _)) = self.merges.get(&pair(symbols[i].id, symbols[i + 1].id)) {
                queue.push(rank, i);
            }
        }
        while let Some((rank, pos)) = queue.pop() {
            let new_id = self.rank_ids[rank as usize];
            let cur = symbols[pos];
            if !cur.alive || cur.next == NONE {
                continue;
            }
            let right = symbols[cur.next as usize];
            // A stale entry: the pair at `pos` changed since it was queued.
            match self.merges.get(&pair(cur.id, right.id)) {
                Some(&(_, id)) if id == new_id => {}
                _ => continue,
            }
            symbols[pos].id = new_id;
            symbols[pos].next = right.next;
            symbols[cur.next as usize].alive = false;
            if right.next != NONE {
                symbols[right.next as usize].prev = pos as u32;
            }
            if cur.prev != NONE {
                let prev = cur.prev as usize;
                if let Some(&(rank, _)) = self.merges.get(&pair(symbols[prev].id, new_id)) {
                    queue.push(rank, prev);
                }
            }
            if right.next != NONE {
                let next = symbols[right.next as usize].id;
                if let Some(&(rank, _)) = self.merges.get(&pair(new_id, next)) {
                    queue.push(rank, pos);
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }
}

/// Ids of the pre-tokens already seen in one encode call, keyed by their bytes in the input
/// (no copies); bounded by the input it serves.
#[derive(Default)]
pub(crate) struct WordCache<'t> {
    spans: FxHashMap<&'t [u8], (u32, u32)>,
    ids: Vec<u32>,
    scratch: Scratch,
}

impl<'t> WordCache<'t> {
    /// Appends the ids of the pre-token `word` to `out`.
    #[inline]
    pub(crate) fn encode(&mut self, bpe: &Bpe, word: &'t [u8], out: &mut Vec<u32>) {
        if let Some(id) = bpe.whole(word) {
            out.push(id);
            return;
        }
        if let Some(&(start, end)) = self.spans.get(word) {
            out.extend_from_slice(&self.ids[start as usize..end as usize]);
            return;
        }
        let start = self.ids.len();
        bpe.merge(word, &mut self.scratch, &mut self.ids);
        out.extend_from_slice(&self.ids[start..]);
        self.spans
            .insert(word, (start as u32, self.ids.len() as u32));
    }
}
