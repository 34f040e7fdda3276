//! The byte-level pre-tokenizer without a regex engine: GPT-2's pattern
//!
//! ```text
//! 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//! ```
//!
//! matched leftmost-first as `tokenizers`' `ByteLevel` does, after its `Digits` pre-tokenizer
//! (when present) has cut the text at numeric characters. Each alternative is a run of one
//! character class, so one forward scan with one character of lookahead reproduces it.

use std::sync::OnceLock;

use regex_syntax::hir::{Class as HirClass, HirKind};

/// The classes the pattern distinguishes; disjoint, so each character has exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Class {
    /// `[^\s\p{L}\p{N}]`
    Other = 0,
    /// `\p{L}`
    Letter = 1,
    /// `\p{N}` (the same set as `char::is_numeric`, which `Digits` splits on)
    Number = 2,
    /// `\s` (Unicode `White_Space`)
    Space = 3,
}

impl Class {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Class::Letter,
            2 => Class::Number,
            3 => Class::Space,
            _ => Class::Other,
        }
    }
}

/// How the `Digits` pre-tokenizer in front of `ByteLevel` cuts the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DigitSplit {
    /// No `Digits` pre-tokenizer.
    None,
    /// `individual_digits: true`: every numeric character is a piece of its own.
    Individual,
    /// `individual_digits: false`: runs of numeric characters are pieces of their own.
    Contiguous,
}

/// Character classes, taken from the Unicode tables of `regex-syntax`: the crate behind the
/// `fancy-regex` engine that `tokenizers` runs the pattern with, so both agree on every character.
pub(crate) struct CharClasses {
    /// Class of every code point below U+10000.
    bmp: Box<[u8]>,
    /// Sorted, disjoint `(first, last, class)` ranges above U+FFFF that are not `Other`.
    astral: Vec<(u32, u32, u8)>,
}

impl CharClasses {
    /// The shared table; `None` only if `regex-syntax` stopped describing these classes as
    /// Unicode ranges (then the caller falls back to `tokenizers`).
    pub(crate) fn get() -> Option<&'static CharClasses> {
        static TABLE: OnceLock<Option<CharClasses>> = OnceLock::new();
        TABLE.get_or_init(Self::build).as_ref()
    }

    fn build() -> Option<CharClasses> {
        let mut bmp = vec![Class::Other as u8; 0x10000].into_boxed_slice();
        let mut astral = Vec::new();
        for (pattern, class) in [
            (r"\p{L}", Class::Letter),
            (r"\p{N}", Class::Number),
            (r"\s", Class::Space),
        ] {
            let hir = regex_syntax::parse(pattern).ok()?;
            let HirKind::Class(HirClass::Unicode(ranges)) = hir.kind() else {
                return None;
            };
            for r in ranges.ranges() {
                let (first, last) = (r.start() as u32, r.end() as u32);
                for cp in first..=last.min(0xFFFF) {
                    bmp[cp as usize] = class as u8;
                }
                if last > 0xFFFF {
                    astral.push((first.max(0x10000), last, class as u8));
                }
            }
        }
        astral.sort_unstable();
        Some(CharClasses { bmp, astral })
    }

    /// Class and UTF-8 length of the character starting at byte `i` of valid UTF-8 `b`.
    #[inline(always)]
    fn at(&self, b: &[u8], i: usize) -> (Class, usize) {
        let x = b[i];
        if x < 0x80 {
            return (Class::from_u8(self.bmp[x as usize]), 1);
        }
        let (cp, len) = if x < 0xE0 {
            (((x as u32 & 0x1F) << 6) | (b[i + 1] as u32 & 0x3F), 2)
        } else if x < 0xF0 {
            (
                ((x as u32 & 0x0F) << 12)
                    | ((b[i + 1] as u32 & 0x3F) << 6)
                    | (b[i + 2] as u32 & 0x3F),
                3,
            )
        } else {
            (
                ((x as u32 & 0x07) << 18)
                    | ((b[i + 1] as u32 & 0x3F) << 12)
                    | ((b[i + 2] as u32 & 0x3F) << 6)
                    | (b[i + 3] as u32 & 0x3F),
                4,
            )
        };
        if cp < 0x10000 {
            return (Class::from_u8(self.bmp[cp as usize]), len);
        }
        let idx = self.astral.partition_point(|&(_, last, _)| last < cp);
        let class = match self.astral.get(idx) {
            Some(&(first, _, class)) if first <= cp => Class::from_u8(class),
            _ => Class::Other,
        };
        (class, len)
    }

    /// Whether the character ending at byte `end` (exclusive) is whitespace.
    pub(crate) fn space_before(&self, b: &[u8], end: usize) -> bool {
        let mut start = end - 1;
        while start > 0 && b[start] & 0xC0 == 0x80 {
            start -= 1;
        }
        self.at(b, start).0 == Class::Space
    }
}

/// Length of a contraction (`s t m d` or `re ve ll`, case-sensitive) after an apostrophe.
#[inline]
fn contraction(rest: &[u8]) -> Option<usize> {
    match rest {
        [b's' | b't' | b'm' | b'd', ..] => Some(1),
        [b'r', b'e', ..] | [b'v', b'e', ..] | [b'l', b'l', ..] => Some(2),
        _ => None,
    }
}

/// Calls `emit` with each pre-token of `text`, in order; together they cover `text`.
pub(crate) fn split<'t>(
    text: &'t str,
    classes: &CharClasses,
    digits: DigitSplit,
    mut emit: impl FnMut(&'t [u8]),
) {
    let b = text.as_bytes();
    let n = b.len();
    let cut_digits = digits != DigitSplit::None;
    let run = |mut q: usize, class: Class| {
        while q < n {
            let (c, len) = classes.at(b, q);
            if c != class {
                break;
            }
            q += len;
        }
        q
    };
    let mut p = 0;
    while p < n {
        let (class, len) = classes.at(b, p);
        let end = match class {
            Class::Number if digits == DigitSplit::Individual => p + len,
            Class::Letter | Class::Number => run(p + len, class),
            Class::Other => match (b[p] == b'\'').then(|| contraction(&b[p + 1..])) {
                Some(Some(l)) => p + 1 + l,
                _ => run(p + len, Class::Other),
            },
            Class::Space => {
                // ` ?\p{L}+`, ` ?\p{N}+` and ` ?[^\s\p{L}\p{N}]+` come before the whitespace
                // alternatives; a numeric character after the space is in another `Digits` piece.
                let next = if b[p] == b' ' && p + 1 < n {
                    Some(classes.at(b, p + 1))
                } else {
                    None
                };
                match next {
                    Some((c @ (Class::Letter | Class::Other), l)) => run(p + 1 + l, c),
                    Some((Class::Number, l)) if !cut_digits => run(p + 1 + l, Class::Number),
                    _ => {
                        // `\s+(?!\S)`: the whole run when it ends its piece, else all but its
                        // last character (which then leads the next pre-token); `\s+` when that
                        // leaves nothing.
                        let mut q = p + len;
                        let mut last = p;
                        while q < n {
                            let (c, l) = classes.at(b, q);
                            if c != Class::Space {
                                break;
                            }
                            last = q;
                            q += l;
                        }
                        let piece_ends =
                            q == n || (cut_digits && classes.at(b, q).0 == Class::Number);
                        if piece_ends || last == p { q } else { last }
                    }
                }
            }
        };
        emit(&b[p..end]);
        p = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str, digits: DigitSplit) -> Vec<&str> {
        let mut out = Vec::new();
        split(text, CharClasses::get().unwrap(), digits, |w| {
            out.push(std::str::from_utf8(w).unwrap())
        });
        out
    }

    #[test]
    fn gpt2_pattern_cases() {
        let d = DigitSplit::Individual;
        assert_eq!(
            words("Hello  world's 123!\n\n  x", d),
            [
                "Hello", " ", " world", "'s", " ", "1", "2", "3", "!", "\n\n ", " x"
            ]
        );
        assert_eq!(words("a  b", d), ["a", " ", " b"]);
        assert_eq!(words("a\n\n  b", d), ["a", "\n\n ", " b"]);
        assert_eq!(words("a\nb", d), ["a", "\n", "b"]);
        assert_eq!(words("x  ", d), ["x", "  "]);
        assert_eq!(words("a 12", d), ["a", " ", "1", "2"]);
        assert_eq!(words("a 12", DigitSplit::None), ["a", " 12"]);
        assert_eq!(words("a  12", DigitSplit::None), ["a", " ", " 12"]);
        assert_eq!(words("a  12", d), ["a", "  ", "1", "2"]);
        assert_eq!(
            words("a 12b", DigitSplit::Contiguous),
            ["a", " ", "12", "b"]
        );
        assert_eq!(
            words("don't 'll ''s", d),
            ["don", "'t", " '", "ll", " ''", "s"]
        );
        assert_eq!(words("x.'s", d), ["x", ".'", "s"]);
        assert_eq!(words("日本語 ok", d), ["日本語", " ok"]);
    }
}
