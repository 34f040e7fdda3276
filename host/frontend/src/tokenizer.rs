//! The model's tokenizer: `tokenizer.json` (through the `tokenizers` crate) plus the bits of
//! `tokenizer_config.json` the server needs (chat template, bos/eos/pad).
//!
//! Encoding takes one of two paths, chosen at load time: byte-level BPE tokenizers of the GPT-2
//! family (k3-mini's kind) go through [`crate::bpe`], which gives the same ids several times
//! faster; any other `tokenizer.json` is encoded by the `tokenizers` crate. Decoding always goes
//! through the byte table or `tokenizers`, both exact.

use crate::text_cache::{CACHE_BYTES, TextCache};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::bpe::FastEncoder;

pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Why a tokenizer could not be loaded or used. Load errors name the file.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a valid tokenizer: {message}", path.display())]
    InvalidTokenizer { path: PathBuf, message: String },
    #[error("{}: invalid JSON: {source}", path.display())]
    InvalidJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: field `{field}`: {problem}", path.display())]
    BadField {
        path: PathBuf,
        field: &'static str,
        problem: String,
    },
    #[error("{}: `{field}` is {token:?}, which is not a token of {TOKENIZER_FILE}", path.display())]
    UnknownSpecialToken {
        path: PathBuf,
        field: &'static str,
        token: String,
    },
    #[error("cannot encode text: {0}")]
    Encode(String),
    #[error("token id {0} is not in the vocabulary")]
    UnknownTokenId(u32),
    #[error("cannot decode tokens: {0}")]
    Decode(String),
}

/// How text becomes ids.
#[derive(Debug, Clone)]
enum Encoder {
    /// The hand-written byte-level BPE path.
    Fast(Arc<FastEncoder>),
    /// `tokenizers` for everything else; `text` is a copy that reads special tokens as text.
    General {
        text: Box<tokenizers::Tokenizer>,
        /// Why the fast path does not apply.
        reason: String,
    },
}

/// A special token named in `tokenizer_config.json` (e.g. `eos_token`), with its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedToken {
    pub text: String,
    pub id: u32,
}

/// Tokenizer of one model directory.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The encoding path, decided at load time.
    encoder: Encoder,
    chat_template: Option<String>,
    bos: Option<NamedToken>,
    eos: Option<NamedToken>,
    pad: Option<NamedToken>,
    /// Ids of the added tokens flagged `special` (markers, bos/eos/pad...).
    special_ids: BTreeSet<u32>,
    /// Raw bytes of every token, indexed by id, when the decoder is byte-level (then decoding is
    /// exactly "concatenate the bytes, then UTF-8"); `None` for other decoders.
    token_bytes: Option<Vec<Option<Box<[u8]>>>>,
    /// The most text bytes one token can stand for, when that bounds a text's token count from
    /// below (no normalizer rewrites the text first); see [`Tokenizer::min_tokens_for_bytes`].
    max_token_bytes: Option<usize>,
    /// Ids of client text encoded recently (multi-turn prompts repeat their history).
    text_cache: Arc<TextCache>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` from a model directory.
    pub fn from_dir(model_dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = model_dir.as_ref();
        let tok_path = dir.join(TOKENIZER_FILE);
        let cfg_path = dir.join(TOKENIZER_CONFIG_FILE);
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| TokenizerError::Read {
                path: path.to_path_buf(),
                source,
            })
        };
        let tokenizer_json = read(&tok_path)?;
        let config_json = read(&cfg_path)?;
        Self::load(&tokenizer_json, &tok_path, &config_json, &cfg_path)
    }

    /// Same as [`Tokenizer::from_dir`] from the two files' contents (errors name the usual file names).
    pub fn from_json(
        tokenizer_json: &str,
        tokenizer_config_json: &str,
    ) -> Result<Self, TokenizerError> {
        Self::load(
            tokenizer_json,
            Path::new(TOKENIZER_FILE),
            tokenizer_config_json,
            Path::new(TOKENIZER_CONFIG_FILE),
        )
    }

    fn load(
        tokenizer_json: &str,
        tok_path: &Path,
        config_json: &str,
        cfg_path: &Path,
    ) -> Result<Self, TokenizerError> {
        let inner: tokenizers::Tokenizer =
            tokenizer_json.parse().map_err(|e: tokenizers::Error| {
                TokenizerError::InvalidTokenizer {
                    path: tok_path.to_path_buf(),
                    message: e.to_string(),
                }
            })?;
        let config: Value =
            serde_json::from_str(config_json).map_err(|source| TokenizerError::InvalidJson {
                path: cfg_path.to_path_buf(),
                source,
            })?;
        if !config.is_object() {
            return Err(TokenizerError::BadField {
                path: cfg_path.to_path_buf(),
                field: "(top level)",
                problem: "must be a JSON object".into(),
            });
        }
        let named = |field: &'static str| -> Result<Option<NamedToken>, TokenizerError> {
            let Some(text) = special_token_text(&config, field, cfg_path)? else {
                return Ok(None);
            };
            match inner.token_to_id(&text) {
                Some(id) => Ok(Some(NamedToken { text, id })),
                None => Err(TokenizerError::UnknownSpecialToken {
                    path: cfg_path.to_path_buf(),
                    field,
                    token: text,
                }),
            }
        };
        let bos = named("bos_token")?;
        let eos = named("eos_token")?;
        let pad = named("pad_token")?;
        let chat_template = chat_template(&config, cfg_path)?;
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        let token_bytes = match inner.get_decoder() {
            Some(tokenizers::DecoderWrapper::ByteLevel(_)) => Some(byte_level_token_table(&inner)),
            _ => None,
        };
        let max_token_bytes = max_token_bytes(&inner, token_bytes.as_deref());
        let encoder = match FastEncoder::from_hf(&inner) {
            Ok(fast) => Encoder::Fast(Arc::new(fast)),
            Err(reason) => {
                let mut text = inner.clone();
                text.set_encode_special_tokens(true);
                Encoder::General {
                    text: Box::new(text),
                    reason,
                }
            }
        };
        Ok(Self {
            inner,
            encoder,
            chat_template,
            bos,
            eos,
            pad,
            special_ids,
            token_bytes,
            max_token_bytes,
            text_cache: Arc::new(TextCache::new(CACHE_BYTES)),
        })
    }

    /// A lower bound on the tokens `text_bytes` bytes of text encode to (no token stands for more
    /// bytes than the longest one), so an oversize prompt can be refused before it is rendered
    /// or tokenized. `None` when the tokenizer normalizes text first, since a normalizer may
    /// shrink it and then no such bound holds.
    pub fn min_tokens_for_bytes(&self, text_bytes: usize) -> Option<usize> {
        let per_token = self.max_token_bytes?;
        Some(text_bytes.div_ceil(per_token.max(1)))
    }

    /// Token ids of `text`. Special tokens written in the text (`<|open|>`…) become their single
    /// ids; nothing is added around the text (chat templates write bos etc. themselves).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, false)
    }

    /// Token ids of client-supplied `text`: special-token spellings in it are read as ordinary
    /// text (`<|open|>` becomes the BPE tokens of those characters), exactly as `tokenizers` with
    /// `encode_special_tokens` does, so message content cannot forge markers. Non-special added
    /// tokens still match. Nothing is added around the text.
    /// Long texts seen recently come from a shared cache ([`TextCache`]).
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.text_cache
            .get_or_encode(text, |text| match &self.encoder {
                Encoder::Fast(fast) => Ok(fast.encode(text, false)),
                Encoder::General { text: general, .. } => hf_ids(general, text, false),
            })
    }

    /// As [`Tokenizer::encode`]; `add_special_tokens` runs the tokenizer's post-processor (bos/eos
    /// templates), if it has one.
    pub fn encode_with(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        match &self.encoder {
            Encoder::Fast(fast)
                if !add_special_tokens || self.inner.get_post_processor().is_none() =>
            {
                Ok(fast.encode(text, true))
            }
            _ => hf_ids(&self.inner, text, add_special_tokens),
        }
    }

    /// Whether encoding takes the fast byte-level BPE path (else `tokenizers`).
    pub fn uses_fast_encoder(&self) -> bool {
        matches!(self.encoder, Encoder::Fast(_))
    }

    /// Why encoding falls back to `tokenizers`; `None` on the fast path.
    pub fn fast_encoder_unavailable(&self) -> Option<&str> {
        match &self.encoder {
            Encoder::Fast(_) => None,
            Encoder::General { reason, .. } => Some(reason),
        }
    }

    /// Text of `ids` with special tokens kept verbatim (no spaces inserted between them).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.decode_with(ids, false)
    }

    /// As [`Tokenizer::decode`], optionally dropping special tokens. Unknown ids are an error
    /// (the `tokenizers` crate would silently drop them).
    pub fn decode_with(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, TokenizerError> {
        if let Some(&bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TokenizerError::UnknownTokenId(bad));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token's vocabulary string (for byte-level BPE, in the byte-to-unicode alphabet).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Ids of the added tokens flagged special, ascending.
    pub fn special_token_ids(&self) -> &BTreeSet<u32> {
        &self.special_ids
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    pub fn bos_token(&self) -> Option<&NamedToken> {
        self.bos.as_ref()
    }

    pub fn eos_token(&self) -> Option<&NamedToken> {
        self.eos.as_ref()
    }

    pub fn pad_token(&self) -> Option<&NamedToken> {
        self.pad.as_ref()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|t| t.id)
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos.as_ref().map(|t| t.id)
    }

    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad.as_ref().map(|t| t.id)
    }

    /// Whether the decoder is byte-level, so that [`Tokenizer::token_bytes`] is available.
    pub fn is_byte_level(&self) -> bool {
        self.token_bytes.is_some()
    }

    /// The exact bytes `id` contributes to decoded text (special tokens: their content), for
    /// byte-level tokenizers; `None` for other decoders or unknown ids. Decoding a sequence is the
    /// lossy UTF-8 of the concatenated bytes. Also what grammar-constrained decoding needs.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.as_ref()?.get(id as usize)?.as_deref()
    }

    /// The wrapped `tokenizers` tokenizer, for what this type does not expose.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Ids of `text` through `tokenizers`.
fn hf_ids(
    tokenizer: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizerError> {
    tokenizer
        .encode(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| TokenizerError::Encode(e.to_string()))
}

/// A special-token field: absent/null, a string, or an AddedToken object `{"content": …}`.
fn special_token_text(
    config: &Value,
    field: &'static str,
    path: &Path,
) -> Result<Option<String>, TokenizerError> {
    let bad = |problem: &str| TokenizerError::BadField {
        path: path.to_path_buf(),
        field,
        problem: problem.to_string(),
    };
    match config.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(bad("an object here needs a string `content`")),
        },
        Some(_) => Err(bad("must be a string, an object with `content`, or null")),
    }
}

/// `chat_template`: a string, or HF's list of named templates (the one named "default" is used).
fn chat_template(config: &Value, path: &Path) -> Result<Option<String>, TokenizerError> {
    let bad = |problem: &str| TokenizerError::BadField {
        path: path.to_path_buf(),
        field: "chat_template",
        problem: problem.to_string(),
    };
    match config.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            for entry in list {
                let name = entry.get("name").and_then(Value::as_str);
                let template = entry.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(_), Some(_)) => {}
                    _ => return Err(bad("list entries need string `name` and `template`")),
                }
            }
            Err(bad("the list has no template named \"default\""))
        }
        Some(_) => Err(bad("must be a string or a list of {name, template}")),
    }
}

/// Bytes of every token of a byte-level tokenizer, indexed by id. Mirrors the `tokenizers`
/// ByteLevel decoder: each character maps back to its byte; a token with a character outside the
/// byte alphabet (e.g. an added token such as "<|open|> x" with a space) contributes its UTF-8.
/// The longest text one token stands for: its decoded bytes for byte-level vocabularies, else
/// the length of its spelling (an over-estimate for `▁` or `<0x41>` spellings, which keeps the
/// bound a lower one). `None` when a normalizer runs first.
fn max_token_bytes(
    inner: &tokenizers::Tokenizer,
    token_bytes: Option<&[Option<Box<[u8]>>]>,
) -> Option<usize> {
    if inner.get_normalizer().is_some() {
        return None;
    }
    let longest = match token_bytes {
        Some(table) => table.iter().flatten().map(|b| b.len()).max(),
        None => inner.get_vocab(true).keys().map(String::len).max(),
    };
    longest.filter(|&n| n > 0)
}

fn byte_level_token_table(inner: &tokenizers::Tokenizer) -> Vec<Option<Box<[u8]>>> {
    let char_to_byte = crate::bpe::byte_level_char_to_byte();
    let vocab = inner.get_vocab(true);
    let len = vocab.values().max().map_or(0, |&m| m as usize + 1);
    let mut table: Vec<Option<Box<[u8]>>> = vec![None; len];
    for id in vocab.into_values() {
        // `id_to_token` resolves added tokens first, exactly as `decode` does.
        let Some(token) = inner.id_to_token(id) else {
            continue;
        };
        let mapped: Option<Vec<u8>> = token
            .chars()
            .map(|c| char_to_byte.get(c as usize).copied().flatten())
            .collect();
        table[id as usize] = Some(
            mapped
                .unwrap_or_else(|| token.into_bytes())
                .into_boxed_slice(),
        );
    }
    table
}
