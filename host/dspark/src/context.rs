//! One sequence's drafter context: for each recent processed position, what every drafter layer
//! reads of it (its key, RoPE applied, and value). Both depend only on the position's feature
//! row and the fixed weights, so they are projected once when the target's taps arrive instead
//! of once per block.

/// Shapes of the stored keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextShape {
    pub layers: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl ContextShape {
    /// Floats of one position's input row: per layer, all heads' key, then all heads' value.
    pub fn row_width(&self) -> usize {
        self.layers * 2 * self.heads * self.head_dim
    }
}

/// The most recent `capacity` positions' keys and values, in a ring. Positions are kept as the
/// target numbered them (a prefix-cache hit leaves gaps) and strictly increase.
///
/// Storage is head-major, `[layer][key|value][head][slot][head_dim]`, so the attention of one
/// head reads each of its keys and values from (at most two) contiguous runs.
#[derive(Debug, Clone)]
pub struct ContextCache {
    shape: ContextShape,
    capacity: usize,
    /// Allocated on the first insert.
    data: Vec<f32>,
    positions: Vec<usize>,
    /// Slot of the oldest row.
    start: usize,
    len: usize,
}

/// The rows of a [`ContextCache`] before some position, oldest first.
#[derive(Debug, Clone, Copy)]
pub struct ContextView<'a> {
    cache: Option<&'a ContextCache>,
    /// Up to two runs of consecutive slots: `(first slot, rows)`.
    runs: [(usize, usize); 2],
}

impl ContextView<'_> {
    /// No context at all.
    pub fn empty() -> Self {
        ContextView {
            cache: None,
            runs: [(0, 0); 2],
        }
    }

    pub fn len(&self) -> usize {
        self.runs[0].1 + self.runs[1].1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Head `head`'s keys (`value = false`) or values of layer `layer`, one `head_dim` row per
    /// position, oldest first.
    pub(crate) fn rows(
        &self,
        layer: usize,
        value: bool,
        head: usize,
    ) -> impl Iterator<Item = &[f32]> + '_ {
        self.cache.into_iter().flat_map(move |c| {
            let hd = c.shape.head_dim;
            let block = ((layer * 2 + usize::from(value)) * c.shape.heads + head) * c.capacity;
            self.runs.iter().flat_map(move |&(first, n)| {
                c.data[(block + first) * hd..(block + first + n) * hd].chunks_exact(hd)
            })
        })
    }
}

impl ContextCache {
    /// An empty cache of `capacity` positions (storage is taken when rows first arrive).
    pub fn new(shape: ContextShape, capacity: usize) -> Self {
        ContextCache {
            shape,
            capacity,
            data: Vec::new(),
            positions: Vec::new(),
            start: 0,
            len: 0,
        }
    }

    pub fn shape(&self) -> ContextShape {
        self.shape
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn slot(&self, i: usize) -> usize {
        (self.start + i) % self.capacity
    }

    /// The stored positions, oldest first.
    pub fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len).map(|i| self.positions[self.slot(i)])
    }

    /// Forget every position at or after `pos` (their rows are about to be replaced).
    pub fn truncate_from(&mut self, pos: usize) {
        while self.len > 0 && self.positions[self.slot(self.len - 1)] >= pos {
            self.len -= 1;
        }
    }

    /// Append the rows of positions `first_pos ..` ([`ContextShape::row_width`] floats each).
    /// Positions at or after `first_pos` already held are replaced (the target ran them again);
    /// the oldest rows leave once the ring is full.
    pub fn insert(&mut self, first_pos: usize, rows: &[f32]) {
        let width = self.shape.row_width();
        debug_assert!(rows.len().is_multiple_of(width.max(1)));
        self.truncate_from(first_pos);
        if self.capacity == 0 || width == 0 {
            return;
        }
        if self.data.is_empty() {
            self.data = vec![0.0; self.capacity * width];
            self.positions = vec![0; self.capacity];
        }
        let n = rows.len() / width;
        // Rows that would be evicted within this call are skipped.
        let skip = n.saturating_sub(self.capacity);
        let hd = self.shape.head_dim;
        for (i, row) in rows.chunks_exact(width).enumerate().skip(skip) {
            let slot = if self.len < self.capacity {
                self.len += 1;
                self.slot(self.len - 1)
            } else {
                let s = self.start;
                self.start = (self.start + 1) % self.capacity;
                s
            };
            // The row is `[layer][key|value][head][head_dim]`: block b of it goes to slot
            // `slot` of block b of the storage.
            for (b, part) in row.chunks_exact(hd).enumerate() {
                let at = (b * self.capacity + slot) * hd;
                self.data[at..at + hd].copy_from_slice(part);
            }
            self.positions[slot] = first_pos + i;
        }
    }

    /// The rows of positions before `pos`, oldest first.
    pub fn view_before(&self, pos: usize) -> ContextView<'_> {
        let n = self.positions().take_while(|&p| p < pos).count();
        if n == 0 {
            return ContextView::empty();
        }
        let first_run = n.min(self.capacity - self.start);
        ContextView {
            cache: Some(self),
            runs: [(self.start, first_run), (0, n - first_run)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: ContextShape = ContextShape {
        layers: 2,
        heads: 2,
        head_dim: 3,
    };

    /// Position p's row: every value encodes (p, layer, key|value, head, i).
    fn rows(first: usize, n: usize) -> Vec<f32> {
        (first..first + n)
            .flat_map(|p| (0..SHAPE.row_width()).map(move |j| (p * 1000 + j) as f32))
            .collect()
    }

    /// The positions a view yields, read back from every (layer, key|value, head) of it.
    fn seen(v: &ContextView<'_>) -> Vec<usize> {
        let mut out: Option<Vec<usize>> = None;
        for l in 0..SHAPE.layers {
            for (kv, value) in [false, true].into_iter().enumerate() {
                for h in 0..SHAPE.heads {
                    let base = ((l * 2 + kv) * SHAPE.heads + h) * SHAPE.head_dim;
                    let ps: Vec<usize> = v
                        .rows(l, value, h)
                        .map(|r| {
                            assert_eq!(r.len(), SHAPE.head_dim);
                            let x = r[0] as usize;
                            assert_eq!(x % 1000, base, "row of another layer or head");
                            x / 1000
                        })
                        .collect();
                    assert!(out.as_ref().is_none_or(|o| *o == ps));
                    out = Some(ps);
                }
            }
        }
        out.unwrap()
    }

    #[test]
    fn keeps_the_most_recent_rows_in_order() {
        let mut c = ContextCache::new(SHAPE, 4);
        c.insert(0, &rows(0, 3));
        assert_eq!(seen(&c.view_before(100)), [0, 1, 2]);
        c.insert(7, &rows(7, 3)); // a gap: 3..7 never ran
        assert_eq!(c.positions().collect::<Vec<_>>(), [2, 7, 8, 9]);
        assert_eq!(seen(&c.view_before(100)), [2, 7, 8, 9]);
        assert_eq!(seen(&c.view_before(9)), [2, 7, 8]);
        // More rows than fit in one call: only the last `capacity` are kept.
        c.insert(20, &rows(20, 9));
        assert_eq!(c.positions().collect::<Vec<_>>(), [25, 26, 27, 28]);
        assert_eq!(seen(&c.view_before(100)), [25, 26, 27, 28]);
        assert!(c.view_before(25).is_empty());
    }

    #[test]
    fn re_observed_positions_replace_the_old_rows() {
        let mut c = ContextCache::new(SHAPE, 5);
        c.insert(0, &rows(0, 5));
        c.insert(5, &rows(5, 2)); // wraps
        assert_eq!(seen(&c.view_before(100)), [2, 3, 4, 5, 6]);
        c.insert(3, &rows(30, 2));
        assert_eq!(c.positions().collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(seen(&c.view_before(100)), [2, 30, 31]);
    }

    #[test]
    fn zero_capacity_stores_nothing() {
        let mut c = ContextCache::new(SHAPE, 0);
        c.insert(0, &rows(0, 3));
        assert!(c.is_empty() && c.view_before(10).is_empty());
    }
}
