//! Streaming helpers for text formats with literal markers.

/// A piece of text as [`MarkerSplitter`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    Text(String),
    /// The index of the marker (in the list given to [`MarkerSplitter::new`]).
    Marker(usize),
}

/// Splits a stream of text deltas at fixed markers. It holds back any suffix that could still
/// become a marker, so the pieces do not depend on how the text was chunked.
#[derive(Debug, Clone)]
pub struct MarkerSplitter {
    markers: Vec<String>,
    buf: String,
}

impl MarkerSplitter {
    /// `markers` must be non-empty strings. When one marker is a prefix of another, list the
    /// longer first: at a given position the first listed match wins.
    pub fn new<S: Into<String>>(markers: impl IntoIterator<Item = S>) -> Self {
        let markers: Vec<String> = markers.into_iter().map(Into::into).collect();
        assert!(
            markers.iter().all(|m| !m.is_empty()),
            "markers must not be empty"
        );
        Self {
            markers,
            buf: String::new(),
        }
    }

    /// Add a delta; complete pieces are appended to `out`.
    pub fn push(&mut self, delta: &str, out: &mut Vec<Split>) {
        self.buf.push_str(delta);
        let mut pos = 0;
        let bytes = self.buf.as_bytes();
        let mut text_start = 0;
        while pos < bytes.len() {
            let rest = &self.buf[pos..];
            if let Some(i) = self
                .markers
                .iter()
                .position(|m| rest.starts_with(m.as_str()))
            {
                if text_start < pos {
                    out.push(Split::Text(self.buf[text_start..pos].to_string()));
                }
                out.push(Split::Marker(i));
                pos += self.markers[i].len();
                text_start = pos;
                continue;
            }
            if self
                .markers
                .iter()
                .any(|m| m.len() > rest.len() && m.starts_with(rest))
            {
                break; // a marker may start here: hold back from `pos`
            }
            pos += rest.chars().next().map_or(1, char::len_utf8);
        }
        if text_start < pos {
            out.push(Split::Text(self.buf[text_start..pos].to_string()));
        }
        self.buf.drain(..pos);
    }

    /// End of stream: whatever was held back is text.
    pub fn finish(&mut self, out: &mut Vec<Split>) {
        if !self.buf.is_empty() {
            out.push(Split::Text(std::mem::take(&mut self.buf)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str, chunk: usize) -> Vec<Split> {
        let mut s = MarkerSplitter::new(["<think>", "</think>"]);
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(chunk.max(1)) {
            s.push(&c.iter().collect::<String>(), &mut out);
        }
        s.finish(&mut out);
        // merge adjacent text so chunkings compare equal
        let mut merged: Vec<Split> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Split::Text(a)), Split::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    #[test]
    fn splits_independent_of_chunking() {
        let text = "a<think>é x</think>b</thin<think>";
        let want = run(text, 1000);
        assert_eq!(
            want,
            vec![
                Split::Text("a".into()),
                Split::Marker(0),
                Split::Text("é x".into()),
                Split::Marker(1),
                Split::Text("b</thin".into()),
                Split::Marker(0),
            ]
        );
        for n in 1..8 {
            assert_eq!(run(text, n), want, "chunk {n}");
        }
    }

    #[test]
    fn partial_marker_at_end_is_text() {
        assert_eq!(run("x</thi", 1), vec![Split::Text("x</thi".into())]);
    }
}
