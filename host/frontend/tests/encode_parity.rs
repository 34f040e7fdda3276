//! The fast encoder gives the ids of the `tokenizers` crate: `encode` against its default,
//! `encode_text` against `encode_special_tokens`, on k3-mini's tokenizer and on variants of it
//! that exercise the other supported pre-tokenizer shapes, the added-token rules and the
//! fallback. Text: random Unicode, and mixtures of the pieces where pre-tokenizers disagree
//! (whitespace runs, contractions, digits, combining marks, emoji, CJK, RTL, controls, JSON,
//! code, special tokens whole and broken).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use k3_frontend::{IncrementalDetokenizer, Tokenizer};
use proptest::prelude::*;
use serde_json::{Value, json};

const SPECIALS: [&str; 8] = [
    "<|pad|>",
    "<|bos|>",
    "<|end_of_msg|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|kimi_image_placeholder|>",
    "<|media_pad|>",
];

fn k3_mini_json() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini/tokenizer.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn config_json() -> String {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini/tokenizer_config.json");
    std::fs::read_to_string(path).unwrap()
}

/// Our tokenizer, the `tokenizers` one it was loaded from, and a copy of that one reading
/// special tokens as text.
struct Case {
    name: &'static str,
    ours: Arc<Tokenizer>,
    hf: tokenizers::Tokenizer,
    hf_text: tokenizers::Tokenizer,
}

fn case(name: &'static str, json: Value, fast: bool) -> Case {
    let ours = Tokenizer::from_json(&json.to_string(), &config_json()).unwrap();
    assert_eq!(
        ours.uses_fast_encoder(),
        fast,
        "{name}: {:?}",
        ours.fast_encoder_unavailable()
    );
    let hf = ours.inner().clone();
    let mut hf_text = hf.clone();
    hf_text.set_encode_special_tokens(true);
    Case {
        name,
        ours: Arc::new(ours),
        hf,
        hf_text,
    }
}

fn cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| {
        let base = k3_mini_json();
        let with_pre = |pre: Value| {
            let mut j = base.clone();
            j["pre_tokenizer"] = pre;
            j
        };
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                                "trim_offsets": true, "use_regex": true});
        // Added tokens beyond the specials: a non-special one in raw text, and one matched
        // after normalization (there is none, so in the text left between the others), and a
        // special one overlapping a non-special one.
        let mut added = base.clone();
        let list = added["added_tokens"].as_array_mut().unwrap();
        for (id, content, special, normalized) in [
            (8192, "<|open|>tool", false, false),
            (8193, " tool_call", false, true),
            (8194, "|open", false, false),
        ] {
            list.push(json!({"id": id, "content": content, "single_word": false,
                             "lstrip": false, "rstrip": false,
                             "normalized": normalized, "special": special}));
        }
        // `add_prefix_space` is not reproduced: stays on `tokenizers`.
        let mut prefix = byte_level.clone();
        prefix["add_prefix_space"] = json!(true);
        vec![
            case("k3-mini", base.clone(), true),
            case("byte-level only", with_pre(byte_level.clone()), true),
            case(
                "contiguous digits",
                with_pre(json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": false}, byte_level.clone()]})),
                true,
            ),
            case("more added tokens", added, true),
            case("fallback", with_pre(prefix), false),
        ]
    })
}

fn check(text: &str) -> Result<(), TestCaseError> {
    check_ids(cases(), text)?;
    check_round_trip(text)
}

fn check_ids(cases: &[Case], text: &str) -> Result<(), TestCaseError> {
    for c in cases {
        let ids = c.ours.encode(text).unwrap();
        let hf = c.hf.encode(text, false).unwrap().get_ids().to_vec();
        prop_assert_eq!(&ids, &hf, "{}: encode {:?}", c.name, text);
        let ids = c.ours.encode_text(text).unwrap();
        let hf = c.hf_text.encode(text, false).unwrap().get_ids().to_vec();
        prop_assert_eq!(&ids, &hf, "{}: encode_text {:?}", c.name, text);
    }
    Ok(())
}

fn check_round_trip(text: &str) -> Result<(), TestCaseError> {
    // Round trip through the decoder and the streaming detokenizer, special tokens read as
    // text or not.
    let k3 = &cases()[0].ours;
    for ids in [k3.encode(text).unwrap(), k3.encode_text(text).unwrap()] {
        prop_assert_eq!(k3.decode(&ids).unwrap(), text);
        let mut detok = IncrementalDetokenizer::new(k3.clone());
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&detok.push(id).unwrap());
        }
        out.push_str(&detok.flush().unwrap());
        prop_assert_eq!(out, text);
    }
    Ok(())
}

/// Pieces where tokenizers differ in practice.
const PIECES: &[&str] = &[
    "the",
    " the",
    "The",
    "hello",
    " world",
    "é",
    "e\u{301}",
    "n\u{303}",
    "a\u{20dd}",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'",
    "''",
    " '",
    "’s",
    "don't",
    "I'M",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\n\n",
    " \n ",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{85}",
    "\u{180e}",
    "\u{200b}",
    "\u{feff}",
    "0",
    "1",
    "42",
    " 7",
    "x2",
    "2x",
    "3.14",
    "1e-9",
    "٣",
    "²",
    "½",
    "Ⅻ",
    "①",
    "𝟘",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "你好",
    "世界。",
    "日本語",
    "한국어",
    "مرحبا",
    "שָׁלוֹם",
    "\u{200f}",
    "\u{202e}",
    "Привет",
    "Ωμέγα",
    "\u{0}",
    "\u{1}",
    "\u{7f}",
    "\u{1b}[0m",
    "{\"key\": [1, 2.5, null, true], \"s\": \"a\\\"b\"}",
    "fn main() {\n    let x = 1;\n}",
    "\tif (a != b) { return -1; }",
    "<div class=\"x\">",
    "https://example.com/a?b=1&c=2",
    "#!",
    "...",
    "—",
    "«»",
    "<|",
    "|>",
    "<|open",
    "open|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "<|end_of_msg|>",
    "<|pad|>",
    "<|bos|>",
    "<|kimi_image_placeholder|>",
    "<|media_pad|>",
    "<|open|>tool",
    " tool_call",
    "|open",
    "<|<|sep|>|>",
    "𐍈",
    "\u{10ffff}",
    "\u{e000}",
];

fn text_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => any::<String>(),
        4 => prop::collection::vec(prop::sample::select(PIECES), 0..40).prop_map(|v| v.concat()),
        1 => (prop::sample::select(PIECES), 1..200usize, prop::sample::select(PIECES))
            .prop_map(|(a, n, b)| format!("{a}{}{b}", " ".repeat(n))),
        1 => prop::collection::vec(
            prop_oneof![
                "[a-zA-Z0-9 '\\n\\t]{0,12}",
                "\\PC{0,6}",
                prop::sample::select(SPECIALS.to_vec()).prop_map(str::to_string),
            ],
            0..20
        )
        .prop_map(|v| v.concat()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn ids_match_tokenizers(text in text_strategy()) {
        check(&text)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2))]

    /// Long inputs are encoded in parallel chunks; the cuts must not change any id.
    #[test]
    fn long_inputs_match_tokenizers(parts in prop::collection::vec(text_strategy(), 200..400)) {
        let mut text = String::new();
        while text.len() < 1_200_000 {
            for p in &parts {
                text.push_str(p);
            }
        }
        check_ids(&cases()[..1], &text)?;
    }
}

#[test]
fn every_special_token_alone_and_in_text() {
    let k3 = &cases()[0];
    for s in SPECIALS {
        let id = k3.ours.token_to_id(s).unwrap();
        assert_eq!(k3.ours.encode(s).unwrap(), vec![id]);
        let as_text = k3.ours.encode_text(s).unwrap();
        assert!(
            !as_text.contains(&id) && as_text.len() > 1,
            "{s}: {as_text:?}"
        );
        check(&format!("a{s}b {s}\n{s}{s} 1{s}2")).unwrap();
    }
}

#[test]
fn empty_and_whitespace_only() {
    for text in ["", " ", "\n", "   \n\t ", "\r\n\r\n"] {
        check(text).unwrap();
    }
}
