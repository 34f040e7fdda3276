//! One request's path through the frontend. For now: the tokenizer (prompt text → ids) and the
//! incremental detokenizer (generated ids → text deltas, special tokens kept for the parsers).

mod bpe;
mod detokenizer;
mod segments;
mod tokenizer;

pub use detokenizer::IncrementalDetokenizer;
pub use segments::{Segment, encode_segments, special_token_spellings};
pub use tokenizer::{NamedToken, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, TokenizerError};
