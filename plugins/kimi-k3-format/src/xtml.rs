//! Streaming tokenizer for K3 "XTML": text, `<|open|>TAG attrs<|sep|>`, `<|close|>TAG<|sep|>`,
//! `<|end_of_msg|>`. It holds back any suffix that could still be (part of) a marker, so the
//! pieces it yields depend only on the text, never on how the text was chunked.
//!
//! Markers that form no tag (docs/k3-format.md §5, scanner): an open or close marker whose
//! `<|sep|>` never comes is [`Piece::Stray`] together with the known tag word and complete
//! attributes right after it, so dropping the piece never leaves `message` glued to the text; a
//! tag the end of the text cuts off is [`Piece::Unfinished`], all of it.

pub const OPEN: &str = "<|open|>";
pub const CLOSE: &str = "<|close|>";
pub const SEP: &str = "<|sep|>";
pub const END_OF_MSG: &str = "<|end_of_msg|>";
const MARKERS: [&str; 4] = [OPEN, CLOSE, SEP, END_OF_MSG];

/// The tag names of the K3 format (docs/k3-format.md §1–2). A malformed tag starting with one of
/// them takes the word with it (see [`Piece::Stray`]).
pub const TAG_WORDS: [&str; 7] = [
    "message", "think", "response", "tools", "call", "argument", "json",
];

/// A tag body longer than this (bytes between the marker and `<|sep|>`) is not a tag: the marker
/// is stray. Bounds how much text an unterminated marker can hold back.
pub const MAX_TAG_BODY: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tag {
    pub name: String,
    /// Attributes in order, values unescaped.
    pub attrs: Vec<(String, String)>,
    /// The tag exactly as it appeared, markers included.
    pub raw: String,
}

impl Tag {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Open(Tag),
    Close(Tag),
    EndOfMsg,
    /// A marker that does not form a tag: a lone `<|sep|>`, or `<|open|>`/`<|close|>` followed by
    /// another marker than `<|sep|>` or by more than [`MAX_TAG_BODY`] bytes without one. When a
    /// known tag word ([`TAG_WORDS`]) follows the marker, the word and the complete attributes
    /// after it belong to the piece. Holds the exact source text.
    Stray(String),
    /// A tag the end of the text cut off (`<|close|>mess`, `<|open|>call tool="f`, `<|close|>x<|se`):
    /// the marker and everything after it. Holds the exact source text.
    Unfinished(String),
}

impl Piece {
    /// The exact source text of this piece.
    pub fn raw(&self) -> &str {
        match self {
            Piece::Text(t) => t,
            Piece::Open(t) | Piece::Close(t) => &t.raw,
            Piece::EndOfMsg => END_OF_MSG,
            Piece::Stray(raw) | Piece::Unfinished(raw) => raw,
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct Scanner {
    buf: String,
}

/// What the bytes at a `<|` position are.
enum AtMarker {
    /// A complete piece spanning `len` bytes.
    Piece(Piece, usize),
    /// Not decidable yet: more text may complete a marker.
    NeedMore,
    /// `<|` that starts no marker; skip these bytes as text.
    NotMarker(usize),
}

impl Scanner {
    pub fn push(&mut self, delta: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(delta);
        let consumed = scan(&self.buf, false, out);
        self.buf.drain(..consumed);
    }

    /// End of stream: an unfinished tag is [`Piece::Unfinished`] and a partial marker is text.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let consumed = scan(&self.buf, true, out);
        debug_assert_eq!(consumed, self.buf.len());
        self.buf.clear();
    }
}

fn push_text(out: &mut Vec<Piece>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(Piece::Text(t)) = out.last_mut() {
        t.push_str(text);
    } else {
        out.push(Piece::Text(text.to_string()));
    }
}

/// Scan `buf`, appending pieces; returns how many bytes were consumed.
fn scan(buf: &str, at_end: bool, out: &mut Vec<Piece>) -> usize {
    let bytes = buf.as_bytes();
    let mut pos = 0;
    let mut text_start = 0;
    while pos < bytes.len() {
        let Some(off) = memchr_lt(&bytes[pos..]) else {
            pos = bytes.len();
            break;
        };
        let at = pos + off;
        match classify(&buf[at..], at_end) {
            AtMarker::Piece(piece, len) => {
                push_text(out, &buf[text_start..at]);
                out.push(piece);
                pos = at + len;
                text_start = pos;
            }
            AtMarker::NotMarker(len) => pos = at + len,
            AtMarker::NeedMore => {
                push_text(out, &buf[text_start..at]);
                return at;
            }
        }
    }
    push_text(out, &buf[text_start..pos]);
    pos
}

fn memchr_lt(b: &[u8]) -> Option<usize> {
    b.iter().position(|&c| c == b'<')
}

fn classify(rest: &str, at_end: bool) -> AtMarker {
    for marker in MARKERS {
        if rest.starts_with(marker) {
            return match marker {
                OPEN | CLOSE => tag_at(rest, marker, at_end),
                END_OF_MSG => AtMarker::Piece(Piece::EndOfMsg, marker.len()),
                _ => AtMarker::Piece(Piece::Stray(SEP.to_string()), SEP.len()),
            };
        }
    }
    if !at_end
        && MARKERS
            .iter()
            .any(|m| m.len() > rest.len() && m.starts_with(rest))
    {
        return AtMarker::NeedMore;
    }
    AtMarker::NotMarker(1)
}

/// `rest` starts with `marker` (open or close): find the `<|sep|>` that ends the tag.
fn tag_at(rest: &str, marker: &'static str, at_end: bool) -> AtMarker {
    let body_and_more = &rest[marker.len()..];
    // Not a tag: the marker, with the tag word and attributes that follow it (bounded, so the
    // decision sees the same bytes however the text was chunked).
    let stray = |body: &str| {
        let len =
            marker.len() + malformed_tag_len(&body.as_bytes()[..body.len().min(MAX_TAG_BODY)]);
        AtMarker::Piece(Piece::Stray(rest[..len].to_string()), len)
    };
    let unfinished = || AtMarker::Piece(Piece::Unfinished(rest.to_string()), rest.len());
    match body_and_more.find("<|") {
        Some(j) if j > MAX_TAG_BODY => stray(body_and_more),
        Some(j) => {
            let body = &body_and_more[..j];
            let after = &body_and_more[j..];
            let sep_prefix = after.len() < SEP.len() && SEP.starts_with(after);
            if after.starts_with(SEP) {
                let len = marker.len() + j + SEP.len();
                let tag = parse_tag(body, &rest[..len]);
                if marker == OPEN {
                    AtMarker::Piece(Piece::Open(tag), len)
                } else {
                    AtMarker::Piece(Piece::Close(tag), len)
                }
            } else if sep_prefix && !at_end {
                AtMarker::NeedMore
            } else if sep_prefix && is_tag_body_prefix(body) {
                unfinished()
            } else {
                stray(body)
            }
        }
        None if body_and_more.len() > MAX_TAG_BODY => stray(body_and_more),
        None if at_end && is_tag_body_prefix(body_and_more) => unfinished(),
        None if at_end => stray(body_and_more),
        None => AtMarker::NeedMore,
    }
}

/// How much of a malformed tag's body goes with its marker: a known tag word at its start and
/// the complete ` key="value"` attributes right after it; 0 when no known word starts it.
fn malformed_tag_len(body: &[u8]) -> usize {
    let Some(word) = TAG_WORDS.iter().find(|w| body.starts_with(w.as_bytes())) else {
        return 0;
    };
    let mut len = word.len();
    loop {
        let rest = &body[len..];
        let spaces = rest.iter().take_while(|&&c| c == b' ').count();
        let key = rest[spaces..]
            .iter()
            .take_while(|&&c| is_name_byte(c))
            .count();
        let value_start = spaces + key + 2;
        if spaces == 0 || key == 0 || rest.get(spaces + key..value_start) != Some(&b"=\""[..]) {
            return len;
        }
        let Some(close) = rest[value_start..].iter().position(|&c| c == b'"') else {
            return len;
        };
        len += value_start + close + 1;
    }
}

fn is_name_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'-'
}

/// Whether `body` could still grow into a tag body: a name, then ` key="value"` attributes,
/// every part possibly cut short.
fn is_tag_body_prefix(body: &str) -> bool {
    #[derive(Clone, Copy)]
    enum At {
        Name,
        Space,
        Key,
        Eq,
        Value,
        AfterValue,
    }
    let mut at = At::Name;
    for c in body.bytes() {
        at = match (at, c) {
            (At::Name | At::Key, c) if is_name_byte(c) => at,
            (At::Name | At::Space | At::AfterValue, b' ') => At::Space,
            (At::Space, c) if is_name_byte(c) => At::Key,
            (At::Key, b'=') => At::Eq,
            (At::Eq, b'"') => At::Value,
            (At::Value, b'"') => At::AfterValue,
            (At::Value, _) => At::Value,
            _ => return false,
        };
    }
    true
}

/// `name key="value" key2="value2"`; parsing stops at the first malformed attribute.
fn parse_tag(body: &str, raw: &str) -> Tag {
    let (name, mut rest) = match body.find(' ') {
        Some(i) => (&body[..i], &body[i..]),
        None => (body, ""),
    };
    let mut attrs = Vec::new();
    loop {
        rest = rest.trim_start_matches(' ');
        let Some(eq) = rest.find("=\"") else { break };
        let key = &rest[..eq];
        if key.is_empty() || key.contains(' ') {
            break;
        }
        let value_and_more = &rest[eq + 2..];
        let Some(end) = value_and_more.find('"') else {
            break;
        };
        attrs.push((key.to_string(), unescape_attr(&value_and_more[..end])));
        rest = &value_and_more[end + 1..];
    }
    Tag {
        name: name.to_string(),
        attrs,
        raw: raw.to_string(),
    }
}

/// Reverse of the template's escaping (`&` → `&amp;`, then `"` → `&quot;`), in one pass.
pub fn unescape_attr(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("&quot;") {
            out.push('"');
            rest = t;
        } else if let Some(t) = tail.strip_prefix("&amp;") {
            out.push('&');
            rest = t;
        } else {
            out.push('&');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The template's attribute escaping (for tests and for plugins that render XTML).
pub fn escape_attr(s: &str) -> String {
    s.replace('&', "&amp;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, chunk: usize) -> Vec<Piece> {
        let mut s = Scanner::default();
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(chunk.max(1)) {
            s.push(&c.iter().collect::<String>(), &mut out);
        }
        s.finish(&mut out);
        let mut merged = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    #[test]
    fn tags_attrs_and_escapes() {
        let text = "hi<|open|>call tool=\"a&quot;b&amp;quot;\" index=\"1\"<|sep|>x<|close|>call<|sep|><|end_of_msg|>";
        let p = pieces(text, 1000);
        assert_eq!(p.len(), 5);
        assert_eq!(p[0], Piece::Text("hi".into()));
        let Piece::Open(tag) = &p[1] else {
            panic!("{p:?}")
        };
        assert_eq!(tag.name, "call");
        assert_eq!(tag.attr("tool"), Some("a\"b&quot;"));
        assert_eq!(tag.attr("index"), Some("1"));
        assert!(matches!(&p[3], Piece::Close(t) if t.name == "call"));
        assert_eq!(p[4], Piece::EndOfMsg);
        for n in 1..10 {
            assert_eq!(pieces(text, n), p, "chunk {n}");
        }
    }

    #[test]
    fn stray_and_partial_markers() {
        // open marker interrupted by another marker: stray, then the next tag parses.
        let p = pieces("a<|open|>b<|open|>think<|sep|>c<|sep|>d<|clo", 1);
        assert_eq!(
            p.iter().map(Piece::raw).collect::<String>(),
            "a<|open|>b<|open|>think<|sep|>c<|sep|>d<|clo"
        );
        assert_eq!(p[1], Piece::Stray(OPEN.into()));
        assert!(matches!(&p[3], Piece::Open(t) if t.name == "think"));
        assert_eq!(p[5], Piece::Stray(SEP.into()));
        assert_eq!(p.last(), Some(&Piece::Text("d<|clo".into())));
        // `<|` that starts no marker is text.
        assert_eq!(
            pieces("a <|b|> c", 1),
            vec![Piece::Text("a <|b|> c".into())]
        );
    }

    #[test]
    fn tag_cut_off_by_the_end_is_unfinished_whole() {
        for tail in [
            "<|close|>message",
            "<|close|>mess",
            "<|close|>",
            "<|open|>call tool=\"get_wea",
            "<|open|>call tool=\"f\" index=\"1\"",
            "<|open|>call tool=\"f\" ",
            "<|close|>think<|se",
            "<|open|>resp",
        ] {
            let text = format!("the answer{tail}");
            for n in [1, 2, 3, 100] {
                assert_eq!(
                    pieces(&text, n),
                    vec![
                        Piece::Text("the answer".into()),
                        Piece::Unfinished(tail.into())
                    ],
                    "{text:?} in chunks of {n}"
                );
            }
        }
        // Not a tag body: the marker alone is stray, the rest text.
        assert_eq!(
            pieces("x<|open|>hello, world", 3),
            vec![
                Piece::Text("x".into()),
                Piece::Stray(OPEN.into()),
                Piece::Text("hello, world".into())
            ]
        );
    }

    #[test]
    fn malformed_tag_takes_its_known_word_and_attributes() {
        let cases = [
            // (text, stray piece, text after it)
            ("a<|close|>message<|end_of_msg|>", "<|close|>message", ""),
            (
                "a<|close|>think\nb<|open|>x<|sep|>",
                "<|close|>think",
                "\nb",
            ),
            ("a<|close|>thinkb<|open|>", "<|close|>think", "b"),
            (
                "a<|open|>call tool=\"f\" index=\"1\">b<|close|>",
                "<|open|>call tool=\"f\" index=\"1\"",
                ">b",
            ),
            ("a<|open|>callx=\"1\" b", "<|open|>call", "x=\"1\" b"),
            ("a<|open|>other b<|close|>", "<|open|>", "other b"),
        ];
        for (text, stray, after) in cases {
            for n in [1, 4, 100] {
                let p = pieces(text, n);
                assert_eq!(p[0], Piece::Text("a".into()), "{text:?}");
                assert_eq!(p[1], Piece::Stray(stray.into()), "{text:?} chunks of {n}");
                let rest: String = p[2..]
                    .iter()
                    .take_while(|p| matches!(p, Piece::Text(_)))
                    .map(Piece::raw)
                    .collect();
                assert_eq!(rest, after, "{text:?}");
                assert_eq!(p.iter().map(Piece::raw).collect::<String>(), text);
            }
        }
    }

    #[test]
    fn over_long_tag_body_is_stray() {
        let body = "x".repeat(MAX_TAG_BODY + 1);
        let text = format!("<|open|>{body}<|sep|>");
        let p = pieces(&text, 7);
        assert_eq!(p[0], Piece::Stray(OPEN.into()));
        assert_eq!(p, pieces(&text, 10_000));
        // a known word keeps its (bounded) attributes, however the text is cut
        let long = format!(
            "<|close|>think a=\"1\" b=\"{}\" {}",
            "y".repeat(MAX_TAG_BODY),
            "z".repeat(10)
        );
        let p = pieces(&long, 5);
        assert_eq!(p[0], Piece::Stray("<|close|>think a=\"1\"".into()));
        assert_eq!(p, pieces(&long, 10_000));
    }
}
