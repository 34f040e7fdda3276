//! llguidance's view of our tokenizer: every token's bytes in a [`TokTrie`], built from what the
//! frontend's tokenizer already knows (no second `tokenizers` crate).

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// One vocabulary entry as the tokenizer decodes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    /// Text bytes (byte-level BPE: exactly what the token adds to decoded text).
    Text(Vec<u8>),
    /// A special token and its name (e.g. `<|close|>`); grammars name it as `<|close|>`, and
    /// no text ever matches it.
    Special(String),
    /// An id with no token (padding up to the logits width): never allowed.
    Unused,
}

/// The tokenizer environment of one model: its trie, end-of-sequence ids and vocabulary width.
struct K3TokEnv {
    trie: TokTrie,
}

impl TokenizerEnv for K3TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy over the trie. Only used for bytes a grammar forces; the tokenization is declared
    /// non-canonical below, so llguidance never relies on it matching the model's BPE.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Build the environment: `tokens[id]` for every id of the logits row (`tokens.len()` is the
/// vocabulary width the masks cover); `eos` are the ids that end the output, allowed whenever
/// the grammar accepts (the first is llguidance's primary EOS).
pub fn token_env(tokens: &[TokenBytes], eos: &[u32]) -> Result<TokEnv, crate::ConstraintError> {
    let Some(&first_eos) = eos.first() else {
        return Err(crate::ConstraintError::Tokenizer(
            "no end-of-sequence token".into(),
        ));
    };
    let width = u32::try_from(tokens.len())
        .map_err(|_| crate::ConstraintError::Tokenizer("vocabulary too large".into()))?;
    if let Some(&bad) = eos.iter().find(|&&e| e >= width) {
        return Err(crate::ConstraintError::Tokenizer(format!(
            "end-of-sequence id {bad} is outside the vocabulary ({width})"
        )));
    }
    let words: Vec<Vec<u8>> = tokens
        .iter()
        .map(|t| match t {
            TokenBytes::Text(b) => b.clone(),
            TokenBytes::Special(name) => {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(name.as_bytes());
                w
            }
            TokenBytes::Unused => Vec::new(),
        })
        .collect();
    let mut info = TokRxInfo::new(width, first_eos);
    info.tok_end_of_turn = Some(first_eos);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
    Ok(Arc::new(K3TokEnv { trie }))
}
