//! Tokenizer and incremental detokenizer, against a byte-level BPE tokenizer trained here (always)
//! and against the embedded model's `models/k3-mini` tokenizer (when it exists).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use k3_frontend::{IncrementalDetokenizer, Tokenizer, TokenizerError};
use proptest::prelude::*;
use tokenizers::AddedToken;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

const MARKERS: [&str; 4] = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"];
const SPECIALS: [&str; 7] = [
    "<|pad|>",
    "<|bos|>",
    "<|end_of_msg|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|media_pad|>",
];

/// A small corpus in the K3 chat format, with multi-byte scripts so merges span UTF-8 boundaries.
fn corpus() -> Vec<String> {
    let bodies = [
        "What is 17 + 25? Let me think: 17 + 25 = 42.",
        "Bonjour, ça va très bien, merci ! Où est la gare ?",
        "你好，世界。今天天气很好，我们去公园散步吧。",
        "こんにちは、元気ですか？ 東京は晴れです。",
        "Привет, как дела? Всё хорошо.",
        "emoji time 😀😃🎉 and 🇫🇷 flags, naïve café résumé",
        "call get_weather with city=\"Paris\" & unit=\"celsius\" → 21°C",
    ];
    let mut texts = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        texts.push(format!(
            "<|open|>message role=\"user\"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>\
             <|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>step {i}<|close|>think<|sep|>\
             <|open|>response<|sep|>{body}<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        ));
    }
    texts
}

/// Trains a byte-level BPE like `reference/scripts/train_tokenizer.py` (same pre-tokenizers,
/// decoder and special tokens, far smaller vocabulary) and writes a model directory.
fn trained_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let mut tok = tokenizers::Tokenizer::new(BPE::default());
        tok.with_pre_tokenizer(Some(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        tok.with_decoder(Some(ByteLevel::default()));
        let specials = SPECIALS
            .iter()
            .map(|s| AddedToken::from(s.to_string(), true))
            .collect();
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(500)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(specials)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        tok.train(&mut trainer, corpus().into_iter()).unwrap();

        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("k3-frontend-bpe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        tok.save(dir.join("tokenizer.json"), false).unwrap();
        let config = serde_json::json!({
            "bos_token": "<|bos|>",
            "eos_token": {"content": "<|end_of_msg|>", "special": true},
            "pad_token": "<|pad|>",
            "unk_token": null,
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        dir
    })
}

fn trained() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::from_dir(trained_dir()).unwrap()))
        .clone()
}

/// The trained tokenizer with its decoder wrapped in a `Sequence`: decodes identically but is not
/// recognised as byte-level, so the detokenizer takes its generic window path.
fn windowed() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = trained_dir();
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
                .unwrap();
        let decoder = json["decoder"].take();
        json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [decoder]});
        let config = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
        let tok = Tokenizer::from_json(&json.to_string(), &config).unwrap();
        assert!(!tok.is_byte_level());
        Arc::new(tok)
    })
    .clone()
}

fn k3_mini_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini")
}

/// The model's tokenizer when present; tests below always run on the trained one and also on this.
fn k3_mini() -> Option<Arc<Tokenizer>> {
    static TOK: OnceLock<Option<Arc<Tokenizer>>> = OnceLock::new();
    TOK.get_or_init(|| {
        let dir = k3_mini_dir();
        dir.join("tokenizer.json")
            .exists()
            .then(|| Arc::new(Tokenizer::from_dir(&dir).unwrap()))
    })
    .clone()
}

fn all_tokenizers() -> Vec<Arc<Tokenizer>> {
    let mut v = vec![trained(), windowed()];
    v.extend(k3_mini());
    v
}

/// Detokenizes `ids` one at a time; returns the deltas (flush included as the last one).
fn stream(tok: &Arc<Tokenizer>, ids: &[u32]) -> Vec<String> {
    let mut detok = IncrementalDetokenizer::new(tok.clone());
    let mut deltas: Vec<String> = ids.iter().map(|&id| detok.push(id).unwrap()).collect();
    deltas.push(detok.flush().unwrap());
    deltas
}

#[test]
fn loads_config_fields() {
    let tok = trained();
    assert_eq!(tok.bos_token().unwrap().text, "<|bos|>");
    assert_eq!(tok.eos_token_id(), tok.token_to_id("<|end_of_msg|>"));
    assert_eq!(tok.pad_token_id(), Some(0));
    assert!(tok.chat_template().unwrap().contains("messages"));
    for s in SPECIALS {
        let id = tok.token_to_id(s).unwrap();
        assert!(tok.is_special(id), "{s}");
        assert_eq!(tok.id_to_token(id).as_deref(), Some(s));
    }
    assert_eq!(tok.special_token_ids().len(), SPECIALS.len());
    assert!(!tok.is_special(tok.encode("a").unwrap()[0]));
    assert!(tok.vocab_size() > 256);
    // The training script's shape is the one the fast encoder reproduces.
    assert!(
        tok.uses_fast_encoder(),
        "{:?}",
        tok.fast_encoder_unavailable()
    );
}

#[test]
fn markers_are_single_tokens_and_decode_verbatim() {
    for tok in all_tokenizers() {
        let text =
            "<|open|>message role=\"user\"<|sep|>hi 你好<|close|>message<|sep|><|end_of_msg|>";
        let ids = tok.encode(text).unwrap();
        for m in MARKERS {
            let id = tok.token_to_id(m).unwrap();
            assert!(ids.contains(&id), "{m} is one token");
            assert_eq!(tok.encode(m).unwrap(), vec![id]);
        }
        assert_eq!(tok.decode(&ids).unwrap(), text);
        assert_eq!(stream(&tok, &ids).concat(), text);
        // Adjacent markers: no space inserted between them, in one decode or token by token.
        let adjacent: Vec<u32> = MARKERS
            .iter()
            .map(|m| tok.token_to_id(m).unwrap())
            .collect();
        assert_eq!(tok.decode(&adjacent).unwrap(), MARKERS.concat());
        assert_eq!(
            stream(&tok, &adjacent),
            vec!["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", ""]
        );
        assert_eq!(
            tok.decode_with(&ids, true).unwrap(),
            "message role=\"user\"hi 你好message"
        );
    }
}

#[test]
fn split_characters_are_held_back() {
    for tok in [trained(), windowed()] {
        split_characters_are_held_back_with(tok);
    }
}

fn split_characters_are_held_back_with(tok: Arc<Tokenizer>) {
    // Encoding single emoji/CJK chars in isolation leaves them as several byte tokens in this vocabulary.
    for text in ["🎉", "日本", "x🇫🇷y", "🤖"] {
        let ids = tok.encode(text).unwrap();
        let deltas = stream(&tok, &ids);
        assert_eq!(deltas.concat(), text);
        assert!(
            deltas.iter().all(|d| !d.contains('\u{FFFD}')),
            "{text}: {deltas:?}"
        );
        if text == "🤖" {
            assert!(ids.len() > 1, "unseen emoji is split into byte tokens");
            assert_eq!(deltas.iter().filter(|d| !d.is_empty()).count(), 1);
        }
    }
}

#[test]
fn prompt_context_is_not_emitted() {
    for tok in all_tokenizers() {
        let prompt = tok.encode("<|open|>response<|sep|>Hello").unwrap();
        let generated = tok.encode(" world, 世界!").unwrap();
        let mut detok = IncrementalDetokenizer::with_prompt(tok.clone(), &prompt).unwrap();
        let mut out = String::new();
        for &id in &generated {
            out.push_str(&detok.push(id).unwrap());
        }
        out.push_str(&detok.flush().unwrap());
        assert_eq!(out, " world, 世界!");
    }
}

#[test]
fn invalid_bytes_and_unknown_ids_do_not_panic() {
    let tok = trained();
    // Lone continuation bytes and truncated sequences straight from the byte alphabet.
    // Byte-level alphabet: 'Ã' = 0xC3 and 'ð' = 0xF0 (lead bytes), '¿' = 0xBF (continuation), 'ÿ' = 0xFF.
    let bytes: Vec<u32> = ["Ã", "¿", "ð", "ÿ", "¿"]
        .iter()
        .map(|t| tok.token_to_id(t).unwrap())
        .collect();
    let ids: Vec<u32> = bytes.iter().cycle().take(40).copied().collect();
    let out = stream(&tok, &ids).concat();
    assert!(out.contains('\u{FFFD}'));
    assert_eq!(out, tok.decode(&ids).unwrap());
    assert!(stream(&windowed(), &ids).concat().contains('\u{FFFD}'));

    let mut detok = IncrementalDetokenizer::new(tok.clone());
    assert!(matches!(
        detok.push(9_999_999),
        Err(TokenizerError::UnknownTokenId(9_999_999))
    ));
    assert!(matches!(
        tok.decode(&[1, 9_999_999]),
        Err(TokenizerError::UnknownTokenId(9_999_999))
    ));
}

#[test]
fn load_errors_name_the_file_and_problem() {
    let missing = Tokenizer::from_dir("/nonexistent/model").unwrap_err();
    assert!(matches!(missing, TokenizerError::Read { .. }));
    assert!(
        missing
            .to_string()
            .contains("/nonexistent/model/tokenizer.json"),
        "{missing}"
    );

    let tok_json = std::fs::read_to_string(trained_dir().join("tokenizer.json")).unwrap();
    let err = Tokenizer::from_json("{\"model\": 3}", "{}").unwrap_err();
    assert!(
        matches!(err, TokenizerError::InvalidTokenizer { .. }),
        "{err}"
    );
    assert!(err.to_string().starts_with("tokenizer.json:"), "{err}");

    let err = Tokenizer::from_json(&tok_json, "{not json").unwrap_err();
    assert!(matches!(err, TokenizerError::InvalidJson { .. }));
    assert!(
        err.to_string().starts_with("tokenizer_config.json:"),
        "{err}"
    );

    let err = Tokenizer::from_json(&tok_json, r#"{"eos_token": "<|nope|>"}"#).unwrap_err();
    assert!(
        err.to_string().contains("`eos_token` is \"<|nope|>\""),
        "{err}"
    );
    let err = Tokenizer::from_json(&tok_json, r#"{"bos_token": 5}"#).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::BadField {
                field: "bos_token",
                ..
            }
        ),
        "{err}"
    );
    let err = Tokenizer::from_json(
        &tok_json,
        r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::BadField {
                field: "chat_template",
                ..
            }
        ),
        "{err}"
    );

    let named = Tokenizer::from_json(
        &tok_json,
        r#"{"chat_template": [{"name": "default", "template": "T"}]}"#,
    )
    .unwrap();
    assert_eq!(named.chat_template(), Some("T"));
    assert_eq!(named.eos_token_id(), None);
}

#[test]
fn k3_mini_special_ids_follow_the_training_script() {
    let Some(tok) = k3_mini() else { return };
    // reference/scripts/train_tokenizer.py pins these ids.
    assert_eq!(tok.pad_token_id(), Some(0));
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token_id(), Some(2));
    assert_eq!(tok.token_to_id("<|open|>"), Some(3));
    assert!(tok.chat_template().is_some());
}

fn text_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        // Mostly-CJK/emoji text with spaces and digits, where byte-level merges split characters.
        prop::collection::vec(
            prop::sample::select(vec!["你", "好", "😀", "🎉", "é", " ", "1", "a", "\n", "Ω"]),
            0..30
        )
        .prop_map(|v| v.concat()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    #[test]
    fn incremental_detokenization_equals_full_decode(text in text_strategy(), marker_at in any::<prop::sample::Index>()) {
        // A marker inside the text as well, at a char boundary.
        let chars: Vec<char> = text.chars().collect();
        let cut = marker_at.index(chars.len() + 1);
        let text = format!("{}<|sep|>{}", chars[..cut].iter().collect::<String>(), chars[cut..].iter().collect::<String>());
        for tok in all_tokenizers() {
            if !tok.is_byte_level() && text.contains('\u{FFFD}') {
                continue; // the window path's documented limitation
            }
            let ids = tok.encode(&text).unwrap();
            let full = tok.decode(&ids).unwrap();
            prop_assert_eq!(&full, &text);
            let deltas = stream(&tok, &ids);
            prop_assert_eq!(deltas.concat(), full);
            let clean = deltas.iter().all(|d| !d.contains('\u{FFFD}')) || text.contains('\u{FFFD}');
            prop_assert!(clean, "a delta carries U+FFFD: {:?}", deltas);
        }
    }

    #[test]
    fn byte_level_matches_decode_even_for_invalid_bytes(raw in prop::collection::vec(any::<u32>(), 0..40)) {
        let tok = trained();
        prop_assert!(tok.is_byte_level());
        let ids: Vec<u32> = raw.iter().map(|r| r % tok.vocab_size() as u32).collect();
        prop_assert_eq!(stream(&tok, &ids).concat(), tok.decode(&ids).unwrap());
    }

    #[test]
    fn arbitrary_ids_never_fail(raw in prop::collection::vec(any::<u32>(), 0..40)) {
        let tok = windowed();
        let ids: Vec<u32> = raw.iter().map(|r| r % tok.vocab_size() as u32).collect();
        let deltas = stream(&tok, &ids);
        // Every delta is a String (valid UTF-8 by construction); with valid output it matches decode.
        let full = tok.decode(&ids).unwrap();
        if !full.contains('\u{FFFD}') {
            prop_assert_eq!(deltas.concat(), full);
        }
    }
}
