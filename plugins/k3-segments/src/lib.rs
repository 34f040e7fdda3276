//! Which spans of a rendered chat prompt are template markup and which are client text.
//!
//! A chat template writes client strings (message content, names, tool-call arguments, tool
//! results, tool definitions, template kwargs) next to its own markers. Tokenizing the whole
//! output with special tokens recognised would let a client forge a marker by typing it
//! (`docs/k3-format.md`). *Taint by substitution* tells the two apart without trusting the
//! template to be written specially:
//!
//! 1. for each distinct first character of a special-token spelling (`<` for K3) choose a
//!    sentinel private-use character that no input mentions, literally or as a `\uXXXX` /
//!    `\UXXXXXXXX` escape (inputs: the client JSON and the template source);
//! 2. in every client string (JSON string values *and* keys) replace that character by its
//!    sentinel ([`Taint::taint_json`], [`Taint::taint_str`]);
//! 3. render;
//! 4. every special-token spelling still in the output was written by the template: it is
//!    [`Segment::Markup`]; the rest is [`Segment::Text`], with the sentinels mapped back
//!    ([`Taint::segments`]).
//!
//! Limits (see `docs/plugins.md`): a template that looks for markers *inside* client strings
//! (`'<think>' in content`, `content.split('</think>')`) no longer finds them; sorting or
//! comparing client strings that contain the first character may order them differently; a
//! template that escapes non-ASCII text (`tojson(ensure_ascii=true)`) prints the sentinel's
//! escape instead of the character; and a template that writes the start of a marker right
//! before client text (`'<|' ~ name`) lets the client complete it. The K3 template does none of
//! these.
//!
//! No dependencies: the host links this crate natively and the template plugins in wasm.

use std::collections::HashSet;
use std::fmt;

/// A span of a rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Segment {
    /// Written by the template: special-token spellings in it are special tokens.
    Markup(String),
    /// From the client: tokenized as ordinary text, whatever it spells.
    Text(String),
}

impl Segment {
    pub fn as_str(&self) -> &str {
        match self {
            Segment::Markup(s) | Segment::Text(s) => s,
        }
    }

    pub fn is_markup(&self) -> bool {
        matches!(self, Segment::Markup(_))
    }
}

/// The segments' text joined: what a plain-text render returns.
pub fn join(segments: &[Segment]) -> String {
    segments.iter().map(Segment::as_str).collect()
}

/// A piece of text split at special-token spellings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'t> {
    /// Exactly one special-token spelling.
    Special(&'t str),
    /// Text between special tokens (never empty).
    Plain(&'t str),
}

/// The tokenizer's special-token spellings, grouped by first character, longest first (so a
/// spelling that is a prefix of another loses, as in the tokenizer's own matching).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Specials {
    by_first: Vec<(char, Vec<String>)>,
}

impl Specials {
    /// Empty spellings are ignored.
    pub fn new<S: AsRef<str>>(spellings: impl IntoIterator<Item = S>) -> Self {
        let mut by_first: Vec<(char, Vec<String>)> = Vec::new();
        for s in spellings {
            let s = s.as_ref();
            let Some(first) = s.chars().next() else {
                continue;
            };
            match by_first.iter_mut().find(|(c, _)| *c == first) {
                Some((_, list)) if list.iter().any(|x| x == s) => {}
                Some((_, list)) => list.push(s.to_string()),
                None => by_first.push((first, vec![s.to_string()])),
            }
        }
        for (_, list) in &mut by_first {
            list.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        }
        Self { by_first }
    }

    pub fn is_empty(&self) -> bool {
        self.by_first.is_empty()
    }

    /// The distinct first characters of the spellings.
    pub fn first_chars(&self) -> impl Iterator<Item = char> + '_ {
        self.by_first.iter().map(|(c, _)| *c)
    }

    /// The special token spelled at the start of `s`, if any.
    fn match_at(&self, s: &str) -> Option<usize> {
        let first = s.chars().next()?;
        let (_, list) = self.by_first.iter().find(|(c, _)| *c == first)?;
        list.iter()
            .find(|m| s.starts_with(m.as_str()))
            .map(String::len)
    }

    /// Split `text` at special-token spellings (leftmost, then longest, like the tokenizer).
    pub fn split<'t>(&self, text: &'t str) -> Vec<Piece<'t>> {
        let mut out = Vec::new();
        let mut plain_start = 0;
        let mut pos = 0;
        while pos < text.len() {
            let rest = &text[pos..];
            if let Some(len) = self.match_at(rest) {
                if plain_start < pos {
                    out.push(Piece::Plain(&text[plain_start..pos]));
                }
                out.push(Piece::Special(&text[pos..pos + len]));
                pos += len;
                plain_start = pos;
            } else {
                pos += rest.chars().next().map_or(1, char::len_utf8);
            }
        }
        if plain_start < text.len() {
            out.push(Piece::Plain(&text[plain_start..]));
        }
        out
    }
}

/// Why no substitution could be set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaintError {
    /// The inputs mention every private-use character (only a hostile input does).
    NoSentinel,
}

impl fmt::Display for TaintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaintError::NoSentinel => f.write_str(
                "the request mentions every private-use character; no sentinel is left to mark client text",
            ),
        }
    }
}

impl std::error::Error for TaintError {}

/// One render's substitution: the specials and, per first character, its sentinel.
#[derive(Debug, Clone)]
pub struct Taint {
    specials: Specials,
    /// (original first character, sentinel)
    pairs: Vec<(char, char)>,
}

/// Private-use code points, in the order sentinels are tried.
fn candidates() -> impl Iterator<Item = char> {
    (0xE000..=0xF8FF)
        .chain(0xF0000..=0xFFFFD)
        .chain(0x10_0000..=0x10_FFFD)
        .filter_map(char::from_u32)
}

fn is_private_use(c: char) -> bool {
    matches!(c as u32, 0xE000..=0xF8FF | 0xF0000..=0xFFFFD | 0x10_0000..=0x10_FFFD)
}

fn hex(s: &str) -> Option<u32> {
    if s.bytes().all(|b| b.is_ascii_hexdigit()) {
        u32::from_str_radix(s, 16).ok()
    } else {
        None
    }
}

/// Every character `text` may stand for: its characters and the targets of `\uXXXX`
/// (surrogate pairs combined) and `\UXXXXXXXX` escapes, as JSON, Jinja and Python spell them.
/// Over-approximates on purpose (an escaped backslash still counts).
fn mentioned(text: &str, mut f: impl FnMut(char)) {
    let b = text.as_bytes();
    for (i, c) in text.char_indices() {
        f(c);
        if c != '\\' {
            continue;
        }
        let at = |from: usize, n: usize| text.get(from..from + n).and_then(hex);
        match b.get(i + 1) {
            Some(b'u') => {
                let Some(unit) = at(i + 2, 4) else { continue };
                if (0xD800..0xDC00).contains(&unit)
                    && b.get(i + 6) == Some(&b'\\')
                    && b.get(i + 7) == Some(&b'u')
                    && let Some(low) = at(i + 8, 4)
                    && (0xDC00..0xE000).contains(&low)
                {
                    let c = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
                    f(char::from_u32(c).unwrap_or('\u{FFFD}'));
                } else if let Some(c) = char::from_u32(unit) {
                    f(c);
                }
            }
            Some(b'U') => {
                if let Some(c) = at(i + 2, 8).and_then(char::from_u32) {
                    f(c);
                }
            }
            _ => {}
        }
    }
}

impl Taint {
    /// Choose sentinels that none of `inputs` mentions: pass every string the render will see
    /// (the client JSON texts *and* the template source).
    pub fn new<'a>(
        specials: Specials,
        inputs: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, TaintError> {
        let firsts: Vec<char> = specials.first_chars().collect();
        let mut used: HashSet<char> = firsts.iter().copied().collect();
        for text in inputs {
            mentioned(text, |c| {
                if is_private_use(c) {
                    used.insert(c);
                }
            });
        }
        let mut free = candidates().filter(|c| !used.contains(c));
        let pairs = firsts
            .into_iter()
            .map(|c| free.next().map(|s| (c, s)).ok_or(TaintError::NoSentinel))
            .collect::<Result<_, _>>()?;
        Ok(Self { specials, pairs })
    }

    pub fn specials(&self) -> &Specials {
        &self.specials
    }

    /// The sentinel standing for `c`, if `c` starts a special token.
    pub fn sentinel(&self, c: char) -> Option<char> {
        self.pairs.iter().find(|(o, _)| *o == c).map(|(_, s)| *s)
    }

    fn original(&self, c: char) -> Option<char> {
        self.pairs.iter().find(|(_, s)| *s == c).map(|(o, _)| *o)
    }

    /// `s` with every first character of a special token replaced by its sentinel.
    pub fn taint_str(&self, s: &str) -> String {
        s.chars().map(|c| self.sentinel(c).unwrap_or(c)).collect()
    }

    /// Like [`Taint::taint_str`] for every string (keys included) of a JSON text, decoding
    /// escapes; everything else is copied byte for byte, so numbers and key order are kept.
    pub fn taint_json(&self, json: &str) -> String {
        if self.pairs.is_empty() {
            return json.to_string();
        }
        let b = json.as_bytes();
        let mut out = String::with_capacity(json.len());
        let mut in_string = false;
        let mut i = 0;
        while i < json.len() {
            let c = json[i..].chars().next().unwrap_or('\u{FFFD}');
            let len = c.len_utf8();
            if !in_string {
                in_string = c == '"';
                out.push(c);
                i += len;
                continue;
            }
            match c {
                '"' => {
                    in_string = false;
                    out.push(c);
                    i += 1;
                }
                '\\' => {
                    let (decoded, raw_len) = decode_escape(json, i);
                    let raw = &json[i..i + raw_len];
                    match decoded.and_then(|d| self.sentinel(d)) {
                        Some(s) => out.push(s),
                        None => out.push_str(raw),
                    }
                    i += raw_len;
                }
                _ => {
                    out.push(self.sentinel(c).unwrap_or(c));
                    i += len;
                }
            }
            debug_assert!(i <= b.len());
        }
        out
    }

    /// Map sentinels back to the characters they stand for.
    pub fn untaint(&self, s: &str) -> String {
        if self.pairs.is_empty() {
            return s.to_string();
        }
        s.chars().map(|c| self.original(c).unwrap_or(c)).collect()
    }

    /// Split a render of tainted inputs: each special-token spelling left is the template's own
    /// ([`Segment::Markup`], adjacent ones merged); the text between is [`Segment::Text`] with
    /// the sentinels mapped back.
    pub fn segments(&self, rendered: &str) -> Vec<Segment> {
        let mut out: Vec<Segment> = Vec::new();
        for piece in self.specials.split(rendered) {
            match (piece, out.last_mut()) {
                (Piece::Special(s), Some(Segment::Markup(m))) => m.push_str(s),
                (Piece::Special(s), _) => out.push(Segment::Markup(s.to_string())),
                (Piece::Plain(p), _) => out.push(Segment::Text(self.untaint(p))),
            }
        }
        out
    }
}

/// The strings of one chat-template render that come from the client: the one place that says
/// which they are, for the guest SDK and the host's rule for v0.1 templates alike. `bos_token` /
/// `eos_token` and the template source come from the server and stay markup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStrings<'a> {
    pub messages_json: &'a str,
    pub tools_json: Option<&'a str>,
    pub thinking_effort: Option<&'a str>,
    pub tool_choice_json: Option<&'a str>,
    pub response_format_json: Option<&'a str>,
    pub extra_kwargs_json: Option<&'a str>,
}

/// [`ClientStrings`] after substitution.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaintedStrings {
    pub messages_json: String,
    pub tools_json: Option<String>,
    pub thinking_effort: Option<String>,
    pub tool_choice_json: Option<String>,
    pub response_format_json: Option<String>,
    pub extra_kwargs_json: Option<String>,
}

/// What the server puts into a render: the template source and the bos/eos spellings. They
/// stay markup, and the sentinels must not occur in them either.
#[derive(Debug, Clone, Copy)]
pub struct ServerStrings<'a> {
    pub template: &'a str,
    pub bos_token: Option<&'a str>,
    pub eos_token: Option<&'a str>,
}

impl ClientStrings<'_> {
    /// Choose sentinels absent from these strings and from `server`, and substitute them into
    /// every client string.
    pub fn taint(
        &self,
        specials: Specials,
        server: ServerStrings<'_>,
    ) -> Result<(Taint, TaintedStrings), TaintError> {
        let client = [
            Some(self.messages_json),
            self.tools_json,
            self.thinking_effort,
            self.tool_choice_json,
            self.response_format_json,
            self.extra_kwargs_json,
        ];
        let server = [Some(server.template), server.bos_token, server.eos_token];
        let inputs = client.into_iter().chain(server).flatten();
        let taint = Taint::new(specials, inputs)?;
        let json = |s: Option<&str>| s.map(|s| taint.taint_json(s));
        let tainted = TaintedStrings {
            messages_json: taint.taint_json(self.messages_json),
            tools_json: json(self.tools_json),
            thinking_effort: self.thinking_effort.map(|s| taint.taint_str(s)),
            tool_choice_json: json(self.tool_choice_json),
            response_format_json: json(self.response_format_json),
            extra_kwargs_json: json(self.extra_kwargs_json),
        };
        Ok((taint, tainted))
    }
}

/// The character a JSON escape starting at `i` (a backslash) stands for, and its length in
/// bytes. Malformed escapes decode to `None` and are copied as they are (the JSON parser
/// reports them).
fn decode_escape(json: &str, i: usize) -> (Option<char>, usize) {
    let b = json.as_bytes();
    let simple = |c: char| (Some(c), 2);
    match b.get(i + 1) {
        Some(b'"') => simple('"'),
        Some(b'\\') => simple('\\'),
        Some(b'/') => simple('/'),
        Some(b'b') => simple('\u{8}'),
        Some(b'f') => simple('\u{c}'),
        Some(b'n') => simple('\n'),
        Some(b'r') => simple('\r'),
        Some(b't') => simple('\t'),
        Some(b'u') => {
            let unit = |from: usize| json.get(from..from + 4).and_then(hex);
            let Some(hi) = unit(i + 2) else {
                return (None, 2);
            };
            if (0xD800..0xDC00).contains(&hi)
                && json.get(i + 6..i + 8) == Some("\\u")
                && let Some(lo) = unit(i + 8)
                && (0xDC00..0xE000).contains(&lo)
            {
                let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                return (char::from_u32(c), 12);
            }
            (char::from_u32(hi), 6)
        }
        // A lone trailing backslash or an unknown escape: copy the backslash and go on.
        Some(_) => (None, 1),
        None => (None, 1),
    }
}

#[cfg(test)]
mod tests;
