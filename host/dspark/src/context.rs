//! One sequence's drafter context: for each recent processed position, what every drafter layer
//! reads of it (its key, RoPE applied, and value). Both depend only on the position's feature
//! row and the fixed weights, so they are projected once when the target's taps arrive instead
//! of once per block.

/// The most recent `capacity` positions' rows, oldest first, in a ring. Positions are kept as the
/// target numbered them (a prefix-cache hit leaves gaps) and strictly increase.
#[derive(Debug, Clone)]
pub struct ContextCache {
    width: usize,
    capacity: usize,
    /// `capacity` slots of `width` floats; slot `(start + i) % capacity` is the i-th oldest row.
    rows: Vec<f32>,
    positions: Vec<usize>,
    start: usize,
    len: usize,
}

impl ContextCache {
    /// An empty cache of `capacity` rows of `width` floats (storage is taken as rows arrive).
    pub fn new(width: usize, capacity: usize) -> Self {
        ContextCache {
            width,
            capacity,
            rows: Vec::new(),
            positions: Vec::new(),
            start: 0,
            len: 0,
        }
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

    /// Floats per row.
    pub fn width(&self) -> usize {
        self.width
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

    /// Append the rows of positions `first_pos ..` (`width` floats each). Positions at or after
    /// `first_pos` already held are replaced (the target ran them again); the oldest rows leave
    /// once the ring is full.
    pub fn insert(&mut self, first_pos: usize, rows: &[f32]) {
        debug_assert!(rows.len().is_multiple_of(self.width.max(1)));
        self.truncate_from(first_pos);
        if self.capacity == 0 || self.width == 0 {
            return;
        }
        let n = rows.len() / self.width;
        // Rows that would be evicted within this call are skipped.
        let skip = n.saturating_sub(self.capacity);
        for (i, row) in rows.chunks_exact(self.width).enumerate().skip(skip) {
            let slot = if self.len < self.capacity {
                let s = self.slot(self.len);
                self.len += 1;
                s
            } else {
                let s = self.start;
                self.start = (self.start + 1) % self.capacity;
                s
            };
            if self.positions.len() <= slot {
                // Slots fill in order before the ring first wraps, so `slot` is the next one.
                self.positions.push(0);
                self.rows.extend_from_slice(row);
            } else {
                self.rows[slot * self.width..(slot + 1) * self.width].copy_from_slice(row);
            }
            self.positions[slot] = first_pos + i;
        }
    }

    /// The rows of positions before `pos`, oldest first.
    pub fn rows_before(&self, pos: usize) -> Vec<&[f32]> {
        (0..self.len)
            .map(|i| self.slot(i))
            .take_while(|&s| self.positions[s] < pos)
            .map(|s| &self.rows[s * self.width..(s + 1) * self.width])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(first: usize, n: usize) -> Vec<f32> {
        (first..first + n)
            .flat_map(|p| [p as f32, -(p as f32)])
            .collect()
    }

    fn firsts(c: &ContextCache, before: usize) -> Vec<f32> {
        c.rows_before(before).iter().map(|r| r[0]).collect()
    }

    #[test]
    fn keeps_the_most_recent_rows_in_order() {
        let mut c = ContextCache::new(2, 4);
        c.insert(0, &rows(0, 3));
        assert_eq!(firsts(&c, 100), vec![0.0, 1.0, 2.0]);
        c.insert(7, &rows(7, 3)); // a gap: 3..7 never ran
        assert_eq!(c.positions().collect::<Vec<_>>(), vec![2, 7, 8, 9]);
        assert_eq!(firsts(&c, 100), vec![2.0, 7.0, 8.0, 9.0]);
        assert_eq!(firsts(&c, 9), vec![2.0, 7.0, 8.0]);
        // More rows than fit in one call: only the last `capacity` are kept.
        c.insert(20, &rows(20, 9));
        assert_eq!(c.positions().collect::<Vec<_>>(), vec![25, 26, 27, 28]);
        assert_eq!(c.rows_before(100)[3], &[28.0, -28.0][..]);
    }

    #[test]
    fn re_observed_positions_replace_the_old_rows() {
        let mut c = ContextCache::new(2, 5);
        c.insert(0, &rows(0, 5));
        c.insert(5, &rows(5, 2)); // wraps
        let mut again = rows(3, 2);
        again[0] = 99.0;
        c.insert(3, &again);
        assert_eq!(c.positions().collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(firsts(&c, 100), vec![2.0, 99.0, 4.0]);
    }

    #[test]
    fn zero_capacity_stores_nothing() {
        let mut c = ContextCache::new(2, 0);
        c.insert(0, &rows(0, 3));
        assert!(c.is_empty() && c.rows_before(10).is_empty());
    }
}
