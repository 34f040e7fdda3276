//! Checks a plugin author runs natively with `cargo test`.

use crate::{Accumulator, ParseResult, PluginError, StreamingParser};

/// Feed `text` in chunks of `chunk_chars` characters (0 = whole) and accumulate the result.
pub fn parse_chunked<P: StreamingParser>(
    mut parser: P,
    text: &str,
    chunk_chars: usize,
) -> Result<ParseResult, PluginError> {
    let mut acc = Accumulator::default();
    if chunk_chars == 0 {
        acc.extend(parser.feed(text)?);
    } else {
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(chunk_chars) {
            let delta: String = chunk.iter().collect();
            acc.extend(parser.feed(&delta)?);
        }
    }
    acc.extend(parser.finish()?);
    Ok(acc.finish())
}

/// Feed `text` split at the given char offsets (sorted, in range) and accumulate the result.
pub fn parse_split_at<P: StreamingParser>(
    mut parser: P,
    text: &str,
    cuts: &[usize],
) -> Result<ParseResult, PluginError> {
    let chars: Vec<char> = text.chars().collect();
    let mut acc = Accumulator::default();
    let mut start = 0;
    for &cut in cuts.iter().chain(std::iter::once(&chars.len())) {
        let cut = cut.clamp(start, chars.len());
        let delta: String = chars[start..cut].iter().collect();
        acc.extend(parser.feed(&delta)?);
        start = cut;
    }
    acc.extend(parser.finish()?);
    Ok(acc.finish())
}

/// Assert that chunks of 1, 2, 3, 7 and 23 characters give the one-shot result; returns it.
pub fn assert_chunking_invariant<P: StreamingParser>(
    make: impl Fn() -> P,
    text: &str,
) -> ParseResult {
    let whole = make().parse_all(text).expect("one-shot parse failed");
    for n in [1, 2, 3, 7, 23] {
        let chunked = parse_chunked(make(), text, n).expect("chunked parse failed");
        assert_eq!(
            chunked, whole,
            "chunks of {n} chars differ from the one-shot parse of {text:?}"
        );
    }
    whole
}
