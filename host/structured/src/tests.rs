//! Constrained sampling over a small synthetic vocabulary: printable ASCII one byte per token,
//! a few multi-byte tokens, and special tokens (EOS `<|end_of_msg|>`, `<|open|>`, `<|close|>`).

use std::sync::Arc;

use k3_engine::{Greedy, RequestSampler, TokenSampler};
use k3_model::select::token_mask_allows;
use llguidance::Matcher;
use proptest::prelude::*;
use serde_json::json;

use crate::*;

pub(crate) const EOS: u32 = 0;
pub(crate) const OPEN: u32 = 1;

/// The synthetic vocabulary (`width` ids; those past the named tokens are unused).
pub(crate) fn vocab(width: usize) -> Vec<TokenBytes> {
    let mut v = vec![
        TokenBytes::Special("<|end_of_msg|>".into()),
        TokenBytes::Special("<|open|>".into()),
        TokenBytes::Special("<|close|>".into()),
    ];
    v.extend((0x20u8..0x7f).map(|b| TokenBytes::Text(vec![b])));
    v.push(TokenBytes::Text(b"\n".to_vec()));
    for multi in [
        "true", "false", "null", "{\"", "\": ", "\", \"", "yes", "no", "tools",
    ] {
        v.push(TokenBytes::Text(multi.as_bytes().to_vec()));
    }
    assert!(v.len() <= width, "vocabulary wider than {width}");
    v.resize(width, TokenBytes::Unused);
    v
}

pub(crate) fn compiler(width: usize) -> GrammarCompiler {
    GrammarCompiler::new(token_env(&vocab(width), &[EOS]).unwrap()).unwrap()
}

fn id_of(text: &str) -> u32 {
    vocab(128)
        .iter()
        .position(|t| *t == TokenBytes::Text(text.as_bytes().to_vec()))
        .unwrap() as u32
}

fn text_of(tokens: &[u32]) -> String {
    let v = vocab(128);
    tokens
        .iter()
        .map(|&t| match &v[t as usize] {
            TokenBytes::Text(b) => String::from_utf8_lossy(b).into_owned(),
            TokenBytes::Special(n) => n.clone(),
            TokenBytes::Unused => "?".into(),
        })
        .collect()
}

/// Greedy through `sampler` over per-step logits from `logits(step)` until EOS or `max` tokens.
fn run(sampler: &mut dyn TokenSampler, max: usize, logits: impl Fn(usize) -> Vec<f32>) -> Vec<u32> {
    let mut out = Vec::new();
    for step in 0..max {
        let t = sampler.sample(&logits(step)).unwrap().token;
        out.push(t);
        if t == EOS {
            break;
        }
    }
    out
}

fn constrained(c: &GrammarCompiler, lark: &str, trigger: Option<&str>) -> ConstrainedSampler {
    let plan = GrammarPlan {
        grammar: c.compile_lark(lark).unwrap(),
        trigger: trigger.map(String::from),
    };
    ConstrainedSampler::new(Box::new(greedy()), plan).unwrap()
}

/// The request sampler at temperature 0: it samples whole rows and candidate lists alike.
fn greedy() -> RequestSampler {
    let params = k3_sampling::SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    RequestSampler::new(&params, 128, &[1]).unwrap()
}

/// Logits that favour, in turn, token ids in a fixed pseudo-random order: the model "wants"
/// something other than what the grammar allows most of the time.
fn noisy(seed: u64, width: usize) -> impl Fn(usize) -> Vec<f32> {
    move |step| {
        (0..width as u64)
            .map(|t| {
                let x = (t ^ seed.rotate_left(17) ^ (step as u64).wrapping_mul(0x9E37_79B9))
                    .wrapping_mul(0xBF58_476D_1CE4_E5B9);
                (x >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect()
    }
}

#[test]
fn errors_are_typed_by_field_and_grammars_are_cached() {
    let c = compiler(128);
    let bad_rx = OutputConstraint::Regex("a(".into());
    assert!(matches!(
        c.compile_constraint(&bad_rx),
        Err(ConstraintError::InvalidRegex(_))
    ));
    let bad_schema = OutputConstraint::JsonSchema {
        schema: json!({"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
        strict: true,
    };
    assert!(matches!(
        c.compile_constraint(&bad_schema),
        Err(ConstraintError::InvalidJsonSchema(_))
    ));
    assert!(matches!(
        c.compile_lark("start: undefined_rule"),
        Err(ConstraintError::InvalidGrammar(_))
    ));
    let choice = OutputConstraint::Choice(vec!["yes".into(), "no".into()]);
    c.compile_constraint(&choice).unwrap();
    c.compile_constraint(&choice).unwrap();
    assert_eq!(c.cached(), 1, "the same grammar compiles once");
}

#[test]
fn choice_and_regex_hold_against_a_model_that_wants_otherwise() {
    let c = compiler(128);
    for seed in 0..8 {
        let choice = OutputConstraint::Choice(vec!["yes".into(), "no".into(), "maybe".into()]);
        let grammar = c.compile_constraint(&choice).unwrap();
        let mut s = ConstrainedSampler::new(
            Box::new(Greedy::default()),
            GrammarPlan {
                grammar,
                trigger: None,
            },
        )
        .unwrap();
        let out = run(&mut s, 20, noisy(seed, 128));
        assert_eq!(out.last(), Some(&EOS), "{out:?}");
        let text = text_of(&out[..out.len() - 1]);
        assert!(["yes", "no", "maybe"].contains(&text.as_str()), "{text}");

        let rx = OutputConstraint::Regex(r"[0-9]{3}-[a-z]{2}".into());
        let grammar = c.compile_constraint(&rx).unwrap();
        let mut s = ConstrainedSampler::new(
            Box::new(Greedy::default()),
            GrammarPlan {
                grammar,
                trigger: None,
            },
        )
        .unwrap();
        let out = run(&mut s, 20, noisy(seed + 100, 128));
        let text = text_of(&out[..out.len() - 1]);
        assert_eq!(text.len(), 6, "{text}");
        assert!(
            text[..3].bytes().all(|b| b.is_ascii_digit()) && &text[3..4] == "-",
            "{text}"
        );
    }
}

#[test]
fn json_schema_output_parses_and_matches() {
    let c = compiler(128);
    let schema = json!({
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": false
    });
    for seed in 0..6 {
        let grammar = c
            .compile_constraint(&OutputConstraint::JsonSchema {
                schema: schema.clone(),
                strict: true,
            })
            .unwrap();
        let mut s = ConstrainedSampler::new(
            Box::new(Greedy::default()),
            GrammarPlan {
                grammar,
                trigger: None,
            },
        )
        .unwrap();
        let out = run(&mut s, 60, noisy(seed, 128));
        assert_eq!(out.last(), Some(&EOS), "{}", text_of(&out));
        let v: serde_json::Value = serde_json::from_str(&text_of(&out[..out.len() - 1])).unwrap();
        assert!(
            v["ok"].is_boolean() && v["n"].as_u64().is_some_and(|n| n <= 99),
            "{v}"
        );
    }
}

#[test]
fn a_trigger_leaves_text_free_until_it_appears() {
    let c = compiler(128);
    let lark = r#"start: "tools" <|close|>"#;
    let mut s = constrained(&c, lark, Some("<|open|>"));
    let free = id_of("z");
    // Free text the grammar would never allow, then the trigger, then the grammar.
    assert_eq!(s.sample(&one_hot(free, 128)).unwrap().token, free);
    assert!(!s.is_constrained());
    assert_eq!(s.sample(&one_hot(OPEN, 128)).unwrap().token, OPEN);
    assert!(s.is_constrained());
    let rest = run(&mut s, 10, |_| one_hot(free, 128));
    assert_eq!(
        text_of(&rest),
        "tools<|close|><|end_of_msg|>",
        "complete: EOS only"
    );
}

#[test]
fn candidates_use_the_pending_mask() {
    let c = compiler(128);
    let mut s = constrained(&c, r#"start: "no""#, None);
    let mask = s
        .pending_mask()
        .expect("constrained from the start")
        .wait()
        .unwrap();
    let no = id_of("no");
    assert!(
        token_mask_allows(&mask, no as usize) && !token_mask_allows(&mask, id_of("z") as usize)
    );
    // An executor that ignored the mask: the sampler still refuses forbidden candidates.
    let top = [(id_of("z"), 9.0), (no, 1.0)];
    assert_eq!(s.sample_top(&top).unwrap().token, no);
    assert!(
        s.sample_top(&[(id_of("z"), 1.0)]).is_err(),
        "nothing allowed left: an error"
    );
}

fn one_hot(t: u32, width: usize) -> Vec<f32> {
    let mut v = vec![0.0; width];
    v[t as usize] = 10.0;
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Against random logits, a constrained greedy run emits only tokens its mask allows at
    /// each step (checked with an independent matcher), and ends in EOS once complete.
    #[test]
    fn greedy_never_leaves_its_mask(seed in any::<u64>(), which in 0usize..3) {
        let c = compiler(128);
        let lark = [
            r#"start: %json {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "x-guidance": {"whitespace_flexible": false}}"#,
            r#"start: /[a-c]{1,4}(-[0-9])?/"#,
            r#"start: ("yes" | "no") <|close|>"#,
        ][which];
        let mut s = constrained(&c, lark, None);
        let mut reference: Matcher = c.compile_lark(lark).unwrap().matcher;
        let logits = noisy(seed, 128);
        for step in 0..40 {
            let allowed = reference.compute_mask_or_eos().unwrap();
            let t = s.sample(&logits(step)).unwrap().token;
            prop_assert!(allowed.is_allowed(t), "step {step}: token {t} outside the mask");
            if t == EOS {
                break;
            }
            reference.consume_token(t).unwrap();
        }
    }
}

/// Shared by the engine test: a tokenizer environment over `width` ids.
pub(crate) fn env(width: usize) -> llguidance::toktrie::TokEnv {
    token_env(&vocab(width), &[EOS]).unwrap()
}

#[test]
fn eos_and_width_come_from_the_environment() {
    let c = GrammarCompiler::new(env(130)).unwrap();
    assert_eq!((c.eos_tokens(), c.vocab_size()), (&[EOS][..], 130));
    assert!(token_env(&vocab(128), &[]).is_err());
    assert!(token_env(&vocab(128), &[500]).is_err());
    let _ = Arc::new(c);
}
