//! Streaming tokenizer for K3 "XTML": text, `<|open|>TAG attrs<|sep|>`, `<|close|>TAG<|sep|>`,
//! `<|end_of_msg|>`. It holds back any suffix that could still be (part of) a marker, so the
//! pieces it yields depend only on the text, never on how the text was chunked.

pub const OPEN: &str = "<|open|>";
pub const CLOSE: &str = "<|close|>";
pub const SEP: &str = "<|sep|>";
pub const END_OF_MSG: &str = "<|end_of_msg|>";
const MARKERS: [&str; 4] = [OPEN, CLOSE, SEP, END_OF_MSG];

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
    /// A marker that does not form a tag (e.g. `<|open|>` never followed by `<|sep|>`).
    Stray(&'static str),
}

impl Piece {
    /// The exact source text of this piece.
    pub fn raw(&self) -> &str {
        match self {
            Piece::Text(t) => t,
            Piece::Open(t) | Piece::Close(t) => &t.raw,
            Piece::EndOfMsg => END_OF_MSG,
            Piece::Stray(m) => m,
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

    /// End of stream: an unfinished tag's marker is stray and a partial marker is text.
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
                _ => AtMarker::Piece(Piece::Stray(SEP), SEP.len()),
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
    let stray = AtMarker::Piece(Piece::Stray(marker), marker.len());
    match body_and_more.find("<|") {
        Some(j) if j > MAX_TAG_BODY => stray,
        Some(j) => {
            let after = &body_and_more[j..];
            if after.starts_with(SEP) {
                let body = &body_and_more[..j];
                let len = marker.len() + j + SEP.len();
                let tag = parse_tag(body, &rest[..len]);
                if marker == OPEN {
                    AtMarker::Piece(Piece::Open(tag), len)
                } else {
                    AtMarker::Piece(Piece::Close(tag), len)
                }
            } else if !at_end && after.len() < SEP.len() && SEP.starts_with(after) {
                AtMarker::NeedMore
            } else {
                stray
            }
        }
        None if body_and_more.len() > MAX_TAG_BODY || at_end => stray,
        None => AtMarker::NeedMore,
    }
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
        assert!(matches!(p[1], Piece::Stray(OPEN)));
        assert!(matches!(&p[3], Piece::Open(t) if t.name == "think"));
        assert!(matches!(p[5], Piece::Stray(SEP)));
        assert_eq!(p.last(), Some(&Piece::Text("d<|clo".into())));
        // unterminated tag at the end: its marker is stray, the rest text.
        let p = pieces("x<|open|>resp", 2);
        assert_eq!(
            p,
            vec![
                Piece::Text("x".into()),
                Piece::Stray(OPEN),
                Piece::Text("resp".into())
            ]
        );
        // `<|` that starts no marker is text.
        assert_eq!(
            pieces("a <|b|> c", 1),
            vec![Piece::Text("a <|b|> c".into())]
        );
    }

    #[test]
    fn over_long_tag_body_is_stray() {
        let body = "x".repeat(MAX_TAG_BODY + 1);
        let text = format!("<|open|>{body}<|sep|>");
        let p = pieces(&text, 7);
        assert_eq!(p[0], Piece::Stray(OPEN));
        assert_eq!(p, pieces(&text, 10_000));
    }
}
