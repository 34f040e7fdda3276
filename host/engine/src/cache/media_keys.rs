//! What the prefix cache keys an image's positions by. Every image token is the same
//! `<|media_pad|>` id, so keyed by ids alone two different images would share cached KV and state.
//! Instead each position of an image span is keyed by the image's content hash and its offset in
//! the span, mapped above the vocabulary (bit 31 set) so it never equals a token id: the same
//! image in a later turn matches, a different image never does.
//!
//! The mapping is a keyed hash (SipHash with a per-process random key), so a client cannot search
//! offline for an image whose keys equal another request's: the keys hold 31 bits per position,
//! and a one-token image would otherwise be within reach of a brute-force search.

use std::borrow::Cow;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::OnceLock;

use k3_model::MediaInput;

/// Marks a key as an image position's (token ids are far below it).
const IMAGE_KEY_BIT: u32 = 1 << 31;

fn secret() -> &'static RandomState {
    static SECRET: OnceLock<RandomState> = OnceLock::new();
    SECRET.get_or_init(RandomState::new)
}

/// The cache key of `tokens` (a prefix of a sequence) whose images are `media`: the ids, with each
/// image span's positions replaced by keys of the image's content. Borrowed when no image falls in.
pub(crate) fn cache_key<'a>(tokens: &'a [u32], media: &[MediaInput]) -> Cow<'a, [u32]> {
    if media.iter().all(|m| m.position >= tokens.len()) {
        return Cow::Borrowed(tokens);
    }
    let mut keys = tokens.to_vec();
    for m in media {
        let end = m.span().end.min(keys.len());
        for (offset, key) in keys.iter_mut().enumerate().take(end).skip(m.position) {
            let h = secret().hash_one((&m.image.content_hash, offset - m.position));
            *key = IMAGE_KEY_BIT | (h as u32 & !IMAGE_KEY_BIT);
        }
    }
    Cow::Owned(keys)
}

/// Spans in order, inside the prompt, non-empty and disjoint.
pub(crate) fn validate_spans(media: &[MediaInput], prompt_len: usize) -> Result<(), String> {
    let mut end = 0;
    for (i, m) in media.iter().enumerate() {
        if m.tokens == 0 {
            return Err(format!("image {i} has no tokens"));
        }
        if m.position < end {
            return Err(format!(
                "image {i} starts at {} inside the one before",
                m.position
            ));
        }
        if m.span().end > prompt_len {
            return Err(format!(
                "image {i} spans positions {:?}, past the prompt's {prompt_len} tokens",
                m.span()
            ));
        }
        end = m.span().end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_model::ImagePixels;
    use std::sync::Arc;

    fn image(seed: u8) -> Arc<ImagePixels> {
        Arc::new(ImagePixels {
            height: 32,
            width: 64,
            pixels: vec![0.0; 3 * 32 * 64],
            content_hash: [seed; 32],
        })
    }

    fn at(position: usize, tokens: usize, seed: u8) -> MediaInput {
        MediaInput {
            position,
            tokens,
            image: image(seed),
        }
    }

    #[test]
    fn same_image_same_keys_different_image_different_keys() {
        let ids = [5u32, 7, 7, 9, 10];
        let a = cache_key(&ids, &[at(1, 2, 1)]);
        let b = cache_key(&ids, &[at(1, 2, 1)]);
        let c = cache_key(&ids, &[at(1, 2, 2)]);
        assert_eq!(a, b);
        assert_eq!(a[0], 5);
        assert_eq!(&a[3..], &[9, 10]);
        assert!(a[1] & IMAGE_KEY_BIT != 0 && a[2] & IMAGE_KEY_BIT != 0);
        assert_ne!(a[1], a[2], "offsets in the span key differently");
        assert_ne!(a[1], c[1]);
        assert_ne!(a[2], c[2]);
    }

    #[test]
    fn a_prefix_ending_inside_an_image_keys_its_part() {
        let ids = [5u32, 7, 7, 7];
        let full = cache_key(&ids, &[at(1, 3, 3)]);
        let part = cache_key(&ids[..2], &[at(1, 3, 3)]);
        assert_eq!(&full[..2], &part[..]);
        assert!(matches!(
            cache_key(&ids[..1], &[at(1, 3, 3)]),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn spans_are_checked() {
        assert!(validate_spans(&[at(1, 2, 1), at(3, 1, 2)], 4).is_ok());
        assert!(validate_spans(&[at(1, 2, 1), at(2, 1, 2)], 4).is_err());
        assert!(validate_spans(&[at(3, 2, 1)], 4).is_err());
        assert!(validate_spans(&[at(0, 0, 1)], 4).is_err());
    }
}
