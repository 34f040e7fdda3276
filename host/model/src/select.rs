//! Host-side selection over logits: the top-k every backend's selection must reproduce, and the
//! token bitmasks of constrained decoding.

/// The `k` largest finite entries of `row` as `(index, value)`, largest first, ties to the lower
/// index; fewer when the row has fewer finite entries. Non-finite logits count as masked, as in
/// the samplers. The one definition every backend's selection must reproduce exactly.
pub fn top_k_of_row(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut c: Vec<(u32, f32)> = (0u32..)
        .zip(row.iter().copied())
        .filter(|(_, v)| v.is_finite())
        .collect();
    if k == 0 {
        return Vec::new();
    }
    if c.len() > k {
        c.select_nth_unstable_by(k - 1, rank);
        c.truncate(k);
    }
    c.sort_unstable_by(rank);
    c
}

/// [`top_k_of_row`] of each of the `rows` rows of `host` (row-major); empty when `host` does not
/// split into `rows` rows. What a backend does that selects on the host.
pub fn top_k_of_rows(host: &[f32], rows: usize, k: usize) -> Vec<Vec<(u32, f32)>> {
    if rows == 0 || !host.len().is_multiple_of(rows) {
        return Vec::new();
    }
    host.chunks(host.len() / rows)
        .map(|r| top_k_of_row(r, k))
        .collect()
}

/// [`top_k_of_rows`] after [`apply_token_mask`] on each row whose mask is `Some` (`masks`: one
/// entry per row). What a backend does that selects on the host.
pub fn top_k_of_rows_masked(
    mut host: Vec<f32>,
    rows: usize,
    k: usize,
    masks: &[Option<&[u32]>],
) -> Vec<Vec<(u32, f32)>> {
    if rows > 0 && host.len().is_multiple_of(rows) {
        let width = host.len() / rows;
        for (row, mask) in host.chunks_mut(width).zip(masks) {
            if let Some(m) = mask {
                apply_token_mask(row, m);
            }
        }
    }
    top_k_of_rows(&host, rows, k)
}

/// Whether a token bitmask allows token `t`: bit `t % 32` of word `t / 32` (32 tokens per word,
/// least significant bit first, as llguidance lays out its masks). Tokens past the mask's end
/// are forbidden.
pub fn token_mask_allows(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// Set every logit the mask forbids to negative infinity (see [`token_mask_allows`]).
pub fn apply_token_mask(row: &mut [f32], mask: &[u32]) {
    for (t, l) in row.iter_mut().enumerate() {
        if !token_mask_allows(mask, t) {
            *l = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_bits_are_lsb_first_and_short_masks_forbid_the_rest() {
        let mask = [0b101u32, 1 << 31];
        let allowed: Vec<usize> = (0..80).filter(|&t| token_mask_allows(&mask, t)).collect();
        assert_eq!(allowed, vec![0, 2, 63]);
        let mut row = vec![1.0f32; 70];
        apply_token_mask(&mut row, &mask);
        let finite: Vec<usize> = (0..70).filter(|&t| row[t].is_finite()).collect();
        assert_eq!(finite, vec![0, 2, 63]);
        assert_eq!(top_k_of_row(&row, 2), vec![(0, 1.0), (2, 1.0)]);
    }
}
