//! Fast encoder for byte-level BPE tokenizers (the GPT-2 family, k3-mini's kind): ids identical
//! to `tokenizers`, several times faster on long inputs.
//!
//! It accepts only the configurations whose behaviour it reproduces exactly — no normalizer,
//! `ByteLevel` pre-tokenization with the GPT-2 pattern (optionally behind `Digits`), a BPE model
//! without dropout or subword affixes, plain added tokens — and is built from what `tokenizers`
//! itself loaded, so vocabulary, merge ranks and added-token ids are the ones it uses. Anything
//! else stays on `tokenizers` (see [`FastEncoder::from_hf`]).
//!
//! Why it is faster: no regex engine (one hand-written scan, see [`pretokenize`]); BPE in byte
//! space with a lookup of whole-token words and a per-call cache of the others; no offsets,
//! strings or `Encoding` built; very long inputs are cut at safe pre-token boundaries and encoded
//! on rayon's pool.

mod merge;
mod pretokenize;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use rayon::prelude::*;
use rustc_hash::FxHashMap;
use serde_json::Value;

use merge::{Bpe, WordCache};
use pretokenize::{CharClasses, DigitSplit};

/// Inputs shorter than this are encoded on the calling thread: each piece rebuilds its word
/// cache and the pool's threads compete with the server's, so on a two-core host splitting did
/// not pay even at half a megabyte.
const PARALLEL_MIN_BYTES: usize = 1024 * 1024;
/// Smallest piece of work handed to another thread.
const CHUNK_MIN_BYTES: usize = 256 * 1024;

/// Added tokens matched by one automaton, as `tokenizers` does: leftmost-longest.
struct AddedSet {
    automaton: AhoCorasick,
    /// Per pattern: its id, and whether it is special (skipped by [`FastEncoder::encode`] when
    /// special tokens are to be read as text).
    tokens: Vec<(u32, bool)>,
}

/// A run of the input: text to pre-tokenize, or an added token already resolved.
#[derive(Clone, Copy)]
enum Segment<'t> {
    Text(&'t str),
    Added(u32),
}

/// The fast path of [`crate::Tokenizer`]'s encoding.
pub(crate) struct FastEncoder {
    bpe: Bpe,
    classes: &'static CharClasses,
    digits: DigitSplit,
    /// Added tokens matched in the raw text (`normalized: false`), then in what is left
    /// (`normalized: true`; with no normalizer that text is the raw text).
    raw_added: Option<AddedSet>,
    normalized_added: Option<AddedSet>,
}

impl std::fmt::Debug for FastEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastEncoder")
            .field("digits", &self.digits)
            .finish_non_exhaustive()
    }
}

impl FastEncoder {
    /// The fast encoder for `tokenizer`, or why its configuration is not one this reproduces.
    pub(crate) fn from_hf(tokenizer: &tokenizers::Tokenizer) -> Result<FastEncoder, String> {
        let json = serde_json::to_value(tokenizer).map_err(|e| e.to_string())?;
        for field in ["normalizer", "truncation", "padding"] {
            if !json[field].is_null() {
                return Err(format!("has a {field}"));
            }
        }
        let digits = digit_split(&json["pre_tokenizer"])?;
        let classes = CharClasses::get().ok_or("no Unicode class tables")?;
        let bpe = bpe(&json["model"])?;

        let mut raw = Vec::new();
        let mut normalized = Vec::new();
        for token in json["added_tokens"]
            .as_array()
            .ok_or("no added_tokens list")?
        {
            let flag = |name: &str| token[name].as_bool().unwrap_or(false);
            if flag("single_word") || flag("lstrip") || flag("rstrip") {
                return Err("an added token strips or matches single words".into());
            }
            let content = token["content"].as_str().ok_or("added token content")?;
            let id = token["id"].as_u64().ok_or("added token id")? as u32;
            let list = if flag("normalized") {
                &mut normalized
            } else {
                &mut raw
            };
            list.push((content.to_string(), id, flag("special")));
        }
        Ok(FastEncoder {
            bpe,
            classes,
            digits,
            raw_added: added_set(raw)?,
            normalized_added: added_set(normalized)?,
        })
    }

    /// Token ids of `text`; `specials`: whether special added tokens spelled in the text become
    /// their ids (`tokenizers`' default) or are read as text (its `encode_special_tokens`).
    pub(crate) fn encode(&self, text: &str, specials: bool) -> Vec<u32> {
        let mut segments = Vec::new();
        self.segment(text, specials, &mut segments);
        if text.len() < PARALLEL_MIN_BYTES || rayon::current_num_threads() < 2 {
            return self.encode_segments(&segments);
        }
        let threads = rayon::current_num_threads();
        let target = (text.len() / threads).max(CHUNK_MIN_BYTES);
        let groups = self.chunk(&segments, target);
        let parts: Vec<Vec<u32>> = groups
            .par_iter()
            .map(|group| self.encode_segments(group))
            .collect();
        parts.concat()
    }

    fn encode_segments(&self, segments: &[Segment<'_>]) -> Vec<u32> {
        let bytes: usize = segments
            .iter()
            .map(|s| match s {
                Segment::Text(t) => t.len(),
                Segment::Added(_) => 0,
            })
            .sum();
        // Small vocabularies average under two bytes per token on mixed text.
        let mut out = Vec::with_capacity(bytes / 2 + segments.len());
        let mut cache = WordCache::default();
        for segment in segments {
            match *segment {
                Segment::Added(id) => out.push(id),
                Segment::Text(text) => {
                    pretokenize::split(text, self.classes, self.digits, |word| {
                        cache.encode(&self.bpe, word, &mut out)
                    })
                }
            }
        }
        out
    }

    /// Splits `text` at added tokens as `tokenizers`' added vocabulary does: raw-text tokens
    /// first, then normalized ones in the pieces between.
    fn segment<'t>(&self, text: &'t str, specials: bool, out: &mut Vec<Segment<'t>>) {
        let mut first = Vec::new();
        split_added(self.raw_added.as_ref(), text, specials, &mut first);
        for segment in first {
            match segment {
                Segment::Text(t) => split_added(self.normalized_added.as_ref(), t, specials, out),
                added => out.push(added),
            }
        }
    }

    /// Groups consecutive segments into pieces of about `target` bytes, cutting long text
    /// segments where a pre-token boundary does not depend on the text around it: between a
    /// non-whitespace character and an ASCII whitespace byte. No alternative of the pattern
    /// matches a non-space followed by a space, and the scan from a boundary on depends only on
    /// the text after it, so each piece pre-tokenizes as it would inside the whole.
    fn chunk<'t>(&self, segments: &[Segment<'t>], target: usize) -> Vec<Vec<Segment<'t>>> {
        let mut groups = Vec::new();
        let mut group = Vec::new();
        let mut size = 0;
        for segment in segments {
            let Segment::Text(mut text) = *segment else {
                group.push(*segment);
                continue;
            };
            while size + text.len() > target {
                let Some(cut) = self.safe_cut(text, target.saturating_sub(size)) else {
                    break;
                };
                group.push(Segment::Text(&text[..cut]));
                groups.push(std::mem::take(&mut group));
                size = 0;
                text = &text[cut..];
            }
            size += text.len();
            group.push(Segment::Text(text));
            if size >= target {
                groups.push(std::mem::take(&mut group));
                size = 0;
            }
        }
        if !group.is_empty() {
            groups.push(group);
        }
        groups
    }

    /// A byte offset in `1..text.len()` at or after `from` where `text` can be cut.
    fn safe_cut(&self, text: &str, from: usize) -> Option<usize> {
        let b = text.as_bytes();
        (from.max(1)..b.len()).find(|&i| {
            matches!(b[i], b' ' | b'\n' | b'\t' | b'\r') && !self.classes.space_before(b, i)
        })
    }
}

/// Appends the segments of `text` split at the tokens of `set`; matches of special tokens are
/// skipped (left in the text) when `specials` is false, exactly as `tokenizers` skips them.
fn split_added<'t>(
    set: Option<&AddedSet>,
    text: &'t str,
    specials: bool,
    out: &mut Vec<Segment<'t>>,
) {
    let Some(set) = set else {
        if !text.is_empty() {
            out.push(Segment::Text(text));
        }
        return;
    };
    let mut start = 0;
    for m in set.automaton.find_iter(text) {
        let (id, special) = set.tokens[m.pattern().as_usize()];
        if special && !specials {
            continue;
        }
        if start < m.start() {
            out.push(Segment::Text(&text[start..m.start()]));
        }
        out.push(Segment::Added(id));
        start = m.end();
    }
    if start < text.len() {
        out.push(Segment::Text(&text[start..]));
    }
}

fn added_set(tokens: Vec<(String, u32, bool)>) -> Result<Option<AddedSet>, String> {
    if tokens.is_empty() {
        return Ok(None);
    }
    let automaton = AhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build(tokens.iter().map(|t| &t.0))
        .map_err(|e| e.to_string())?;
    Ok(Some(AddedSet {
        automaton,
        tokens: tokens.into_iter().map(|(_, id, s)| (id, s)).collect(),
    }))
}

/// The `Digits` split in front of a `ByteLevel` pre-tokenizer that uses the GPT-2 pattern and
/// adds no prefix space; an error for any other pre-tokenizer.
fn digit_split(pre: &Value) -> Result<DigitSplit, String> {
    let byte_level = |v: &Value| {
        v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v["use_regex"] == true
    };
    if byte_level(pre) {
        return Ok(DigitSplit::None);
    }
    if pre["type"] == "Sequence" {
        match pre["pretokenizers"].as_array().map(Vec::as_slice) {
            Some([b]) if byte_level(b) => return Ok(DigitSplit::None),
            Some([d, b]) if d["type"] == "Digits" && byte_level(b) => {
                return Ok(match d["individual_digits"].as_bool() {
                    Some(true) => DigitSplit::Individual,
                    _ => DigitSplit::Contiguous,
                });
            }
            _ => {}
        }
    }
    Err(format!("pre-tokenizer {pre} is not GPT-2 byte-level"))
}

/// The BPE tables of a byte-level `BPE` model's JSON.
fn bpe(model: &Value) -> Result<Bpe, String> {
    if model["type"] != "BPE" {
        return Err("the model is not BPE".into());
    }
    if model["dropout"].as_f64().is_some_and(|d| d != 0.0) {
        return Err("BPE dropout".into());
    }
    for affix in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if model[affix].as_str().is_some_and(|s| !s.is_empty()) {
            return Err(format!("BPE {affix}"));
        }
    }
    let to_bytes = byte_level_decoder();
    let vocab_json = model["vocab"].as_object().ok_or("no BPE vocab")?;
    let mut vocab: FxHashMap<Box<[u8]>, u32> = FxHashMap::default();
    for (token, id) in vocab_json {
        // Entries outside the byte alphabet can never come out of byte-level BPE.
        if let Some(bytes) = to_bytes(token) {
            vocab.insert(bytes.into(), id.as_u64().ok_or("vocab id")? as u32);
        }
    }
    let mut merges = Vec::new();
    for m in model["merges"].as_array().ok_or("no BPE merges")? {
        let (a, b) = match m {
            Value::String(s) => s.split_once(' ').ok_or("merge without a space")?,
            Value::Array(p) if p.len() == 2 => (
                p[0].as_str().ok_or("merge part")?,
                p[1].as_str().ok_or("merge part")?,
            ),
            _ => return Err("merge is neither \"a b\" nor [a, b]".into()),
        };
        merges.push((
            to_bytes(a).ok_or("merge outside the byte alphabet")?,
            to_bytes(b).ok_or("merge outside the byte alphabet")?,
        ));
    }
    let ignore_merges = model["ignore_merges"].as_bool().unwrap_or(false);
    Bpe::new(&vocab, &merges, ignore_merges)
        .ok_or_else(|| "the vocabulary lacks a byte or a merged token".into())
}

/// Maps a token spelled in GPT-2's byte alphabet to its bytes (`None` if a character is outside).
fn byte_level_decoder() -> impl Fn(&str) -> Option<Vec<u8>> {
    let table = byte_level_char_to_byte();
    move |token: &str| {
        token
            .chars()
            .map(|c| table.get(c as usize).copied().flatten())
            .collect()
    }
}

/// Inverse of GPT-2's byte → printable-character table: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes are shifted, in order, to U+0100.. U+0143.
pub(crate) fn byte_level_char_to_byte() -> Vec<Option<u8>> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = vec![None; 256 + 68];
    let mut shifted = 0;
    for b in 0..=255u8 {
        if printable(b) {
            table[b as usize] = Some(b);
        } else {
            table[256 + shifted] = Some(b);
            shifted += 1;
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn k3_mini() -> &'static FastEncoder {
        static ENC: std::sync::OnceLock<FastEncoder> = std::sync::OnceLock::new();
        ENC.get_or_init(|| {
            let path = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../models/k3-mini/tokenizer.json"
            );
            let tok = tokenizers::Tokenizer::from_file(path).unwrap();
            FastEncoder::from_hf(&tok).unwrap()
        })
    }

    proptest! {
        /// Cutting at any target size gives the ids of the uncut text.
        #[test]
        fn cuts_do_not_change_ids(
            text in "([a-z]{1,6}|[ \\t\\n]{1,3}|[0-9]{1,3}|[.,'{}\"<|>]|é|日本|😀|<\\|sep\\|>){0,80}",
            target in 1usize..64,
        ) {
            let enc = k3_mini();
            let mut segments = Vec::new();
            enc.segment(&text, true, &mut segments);
            let whole = enc.encode_segments(&segments);
            let cut: Vec<u32> = enc
                .chunk(&segments, target)
                .iter()
                .flat_map(|g| enc.encode_segments(g))
                .collect();
            prop_assert_eq!(cut, whole);
        }
    }
}
