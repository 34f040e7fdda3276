//! A rendered chat prompt → token ids, with client text tokenized as text.
//!
//! The chat-template stage returns [`Segment`]s (template markup vs client text, see
//! `docs/plugins.md`). Only special-token spellings inside markup become special tokens. The
//! text between two special tokens — markup and client text alike — is encoded as one piece,
//! as the tokenizer does when it splits a whole prompt at its special tokens, so an ordinary
//! conversation gets exactly the ids it got before: BPE merges never cross a special token,
//! and a cut between markup and client text would otherwise change merges there.

pub use k3_segments::Segment;
use k3_segments::{Piece, Specials};

use crate::{Tokenizer, TokenizerError};

/// The tokenizer's special-token spellings, for the chat template's render options.
pub fn special_token_spellings(tokenizer: &Tokenizer) -> Vec<String> {
    tokenizer
        .special_token_ids()
        .iter()
        .filter_map(|&id| tokenizer.id_to_token(id))
        .collect()
}

/// Token ids of a rendered prompt: each special-token spelling inside [`Segment::Markup`] is
/// its special token; everything else goes through [`Tokenizer::encode_text`], one piece per
/// stretch between special tokens.
pub fn encode_segments(
    tokenizer: &Tokenizer,
    segments: &[Segment],
) -> Result<Vec<u32>, TokenizerError> {
    let specials = Specials::new(special_token_spellings(tokenizer));
    let mut ids = Vec::new();
    let mut text = String::new();
    let flush = |text: &mut String, ids: &mut Vec<u32>| -> Result<(), TokenizerError> {
        if !text.is_empty() {
            ids.extend(tokenizer.encode_text(text)?);
            text.clear();
        }
        Ok(())
    };
    for segment in segments {
        match segment {
            Segment::Text(t) => text.push_str(t),
            Segment::Markup(m) => {
                for piece in specials.split(m) {
                    match piece {
                        Piece::Plain(p) => text.push_str(p),
                        Piece::Special(s) => {
                            flush(&mut text, &mut ids)?;
                            ids.extend(tokenizer.encode(s)?);
                        }
                    }
                }
            }
        }
    }
    flush(&mut text, &mut ids)?;
    Ok(ids)
}
