//! Streaming token ids → text.
//!
//! Byte-level tokenizers (the k3-mini kind): tokens are byte strings, so the detokenizer keeps the
//! bytes of an incomplete UTF-8 character and emits everything before it — exact, O(1) per token.
//!
//! Other decoders: decoding each token alone is wrong (some decoders change a token's text
//! depending on what precedes it), so each step decodes a short window — a few tokens already
//! emitted as context (the "prefix") plus the unread ones — and emits what the window decodes to
//! beyond what was already emitted (vLLM's prefix/read offsets). The window restarts whenever its
//! text is complete, so a step costs O(1) amortised, independent of sequence length.

use std::sync::Arc;

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Decoders replace an incomplete UTF-8 tail with U+FFFD; text before a trailing run of it is
/// final, the run itself may still turn into characters when more bytes come.
const REPLACEMENT: char = '\u{FFFD}';
/// Window mode: the window restarts after this many unread tokens even if its text still ends
/// incomplete, bounding the cost per step (emission stays correct: the unemitted tail is tracked).
const MAX_UNREAD_TOKENS: usize = 8;
/// Window mode: prompt tokens kept as decoding context for the first generated token.
const PROMPT_CONTEXT_TOKENS: usize = 4;

/// Incremental detokenizer of one generated sequence. Special tokens are kept verbatim. The
/// concatenated deltas, [`IncrementalDetokenizer::flush`] included, equal a decode of all tokens.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokenizer: Arc<Tokenizer>,
    /// Byte-level mode: bytes of an incomplete trailing character.
    pending: Vec<u8>,
    /// Window mode: context tokens (`..read`) followed by unread tokens (`read..`).
    window: Vec<u32>,
    read: usize,
    /// Window mode: the context tokens decoded on their own.
    prefix_text: String,
    /// Window mode: bytes of the window's text already emitted (or, for prompt context, never to be).
    emitted: usize,
}

impl IncrementalDetokenizer {
    /// Detokenizer for a sequence starting from nothing.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
            window: Vec::new(),
            read: 0,
            prefix_text: String::new(),
            emitted: 0,
        }
    }

    /// Detokenizer for tokens generated after `prompt`: for decoders that depend on context, its
    /// last few tokens serve as such, so the first token decodes as it would mid-text. The prompt
    /// itself is never emitted.
    pub fn with_prompt(tokenizer: Arc<Tokenizer>, prompt: &[u32]) -> Result<Self, TokenizerError> {
        if tokenizer.is_byte_level() {
            // Byte-level decoding does not depend on preceding tokens.
            return Ok(Self::new(tokenizer));
        }
        let context = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        let prefix_text = tokenizer.decode(context)?;
        Ok(Self {
            tokenizer,
            pending: Vec::new(),
            window: context.to_vec(),
            read: context.len(),
            emitted: prefix_text.len(),
            prefix_text,
        })
    }

    /// Adds one token; returns the text it completes: often the token's own text, empty while a
    /// multi-byte character is incomplete, several tokens' text once it completes.
    pub fn push(&mut self, token: u32) -> Result<String, TokenizerError> {
        if self.tokenizer.is_byte_level() {
            let bytes = self
                .tokenizer
                .token_bytes(token)
                .ok_or(TokenizerError::UnknownTokenId(token))?;
            self.pending.extend_from_slice(bytes);
            return Ok(self.take_complete_utf8());
        }
        if self.tokenizer.id_to_token(token).is_none() {
            return Err(TokenizerError::UnknownTokenId(token));
        }
        self.window.push(token);
        let text = self.tokenizer.decode(&self.window)?;
        let stable = text.trim_end_matches(REPLACEMENT).len();
        let delta = self.take_window_text(&text, stable);
        let complete = stable == text.len();
        if complete || self.window.len() - self.read >= MAX_UNREAD_TOKENS {
            self.restart_window()?;
        }
        Ok(delta)
    }

    /// Releases text held back for an incomplete character (end of the sequence); invalid
    /// bytes come out as U+FFFD, exactly as a whole-sequence decode shows them.
    pub fn flush(&mut self) -> Result<String, TokenizerError> {
        if !self.pending.is_empty() {
            let text = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            return Ok(text);
        }
        if self.window.is_empty() {
            return Ok(String::new());
        }
        let text = self.tokenizer.decode(&self.window)?;
        let delta = self.take_window_text(&text, text.len());
        self.restart_window()?;
        Ok(delta)
    }

    /// Byte-level mode: everything in `pending` except an incomplete character at its end.
    /// Invalid sequences become U+FFFD exactly where `String::from_utf8_lossy` (hence `decode`)
    /// puts them in the whole text.
    fn take_complete_utf8(&mut self) -> String {
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(valid) => {
                    out.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid_end = consumed + e.valid_up_to();
                    // Just validated by `from_utf8`.
                    out.push_str(
                        std::str::from_utf8(&self.pending[consumed..valid_end]).unwrap_or_default(),
                    );
                    match e.error_len() {
                        Some(invalid) => {
                            out.push(REPLACEMENT);
                            consumed = valid_end + invalid;
                        }
                        None => {
                            consumed = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }

    /// Window mode: the part of the window's `text` up to `end` not emitted yet.
    fn take_window_text(&mut self, text: &str, end: usize) -> String {
        // The window's text should extend what was emitted from it; if a decoder rewrote it,
        // continue after the common part rather than fail.
        let emitted = &self.prefix_text[..self.emitted.min(self.prefix_text.len())];
        let start = if text.starts_with(emitted) {
            self.emitted
        } else {
            common_prefix_len(text, emitted)
        };
        if end <= start {
            return String::new();
        }
        self.emitted = end;
        text[start..end].to_string()
    }

    /// Window mode: the unread tokens become the context of the next window. What of their text
    /// was emitted carries over: all of it, except a trailing incomplete character.
    fn restart_window(&mut self) -> Result<(), TokenizerError> {
        self.window.drain(..self.read);
        self.read = self.window.len();
        self.prefix_text = self.tokenizer.decode(&self.window)?;
        self.emitted = self.prefix_text.trim_end_matches(REPLACEMENT).len();
        Ok(())
    }
}

/// Byte length of the longest common prefix of `a` and `b` that ends on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|&((_, ca), cb)| ca != cb)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::common_prefix_len;

    #[test]
    fn common_prefix_respects_char_boundaries() {
        assert_eq!(common_prefix_len("héllo", "hélp"), 4);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
        assert_eq!(common_prefix_len("é", "è"), 0);
    }
}
