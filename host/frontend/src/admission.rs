//! Refusing what cannot run before paying for it: a prompt whose text alone is more tokens than
//! the context holds is refused from its byte count, before the chat template renders it and
//! the tokenizer encodes it (both cost time and memory in proportion to the input); stop token
//! ids must exist in the vocabulary.

use serde_json::Value;

use crate::error::BackendError;
use crate::request::SamplingOptions;
use crate::tokenizer::Tokenizer;

/// Text bytes of the messages' `content` (a string, or the `text` of its parts). Every chat
/// template renders a message's content, so these bytes reach the tokenizer; other fields
/// (names, tool calls, reasoning) may be dropped or reshaped and are not counted.
pub(crate) fn content_bytes(messages: &[Value]) -> usize {
    messages
        .iter()
        .map(|m| match m.get("content") {
            Some(Value::String(s)) => s.len(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(str::len)
                .sum(),
            _ => 0,
        })
        .sum()
}

/// Refuse a prompt of `text_bytes` bytes when even its fewest possible tokens leave no room in
/// the context (the same rule as [`crate::token_budget`], applied to the lower bound, so it
/// never refuses a prompt the exact check would take).
pub(crate) fn check_prompt_bytes(
    tokenizer: &Tokenizer,
    text_bytes: usize,
    sampling: &SamplingOptions,
    max_model_len: u32,
    param: &str,
) -> Result<(), BackendError> {
    let Some(min_tokens) = tokenizer.min_tokens_for_bytes(text_bytes) else {
        return Ok(());
    };
    let asked = u64::from(sampling.max_tokens.unwrap_or(1).max(1));
    if min_tokens as u64 + asked <= u64::from(max_model_len) {
        return Ok(());
    }
    Err(BackendError::ContextLengthExceeded(format!(
        "this model's maximum context length is {max_model_len} tokens; the {text_bytes} bytes \
         of text in '{param}' are at least {min_tokens} tokens, and {asked} more are asked for \
         (reduce the prompt or max_tokens)"
    )))
}

/// Every `stop_token_ids` entry must be a token of the model.
pub(crate) fn check_stop_token_ids(
    sampling: &SamplingOptions,
    vocab_size: usize,
) -> Result<(), BackendError> {
    match sampling
        .stop_token_ids
        .iter()
        .position(|&id| id as usize >= vocab_size)
    {
        None => Ok(()),
        Some(i) => Err(BackendError::InvalidRequest {
            message: format!(
                "stop_token_ids[{i}] = {} is not a token of this model (its vocabulary has {vocab_size} ids)",
                sampling.stop_token_ids[i]
            ),
            param: Some(format!("stop_token_ids[{i}]")),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ChatBackend;
    use crate::request::{ChatGenRequest, ToolChoice};
    use proptest::prelude::*;
    use serde_json::json;
    use std::sync::OnceLock;

    fn tokenizer() -> &'static Tokenizer {
        static TOK: OnceLock<Tokenizer> = OnceLock::new();
        TOK.get_or_init(|| {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-mini");
            Tokenizer::from_dir(dir).unwrap()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The byte bound never exceeds the real token count, for mixed text and for long runs
        /// (which the longest tokens cover).
        #[test]
        fn byte_bound_is_a_lower_bound(
            text in "(\\PC{0,40}|[ =\\-_.a-z\\n]{0,80}){1,6}",
            run in 0usize..400,
            ch in prop::sample::select(vec![' ', '=', '-', '\n', 'a', '#', '\u{4e00}']),
        ) {
            let tok = tokenizer();
            let text = format!("{text}{}", ch.to_string().repeat(run));
            let exact = tok.encode_text(&text).unwrap().len();
            let bound = tok.min_tokens_for_bytes(text.len()).unwrap();
            prop_assert!(bound <= exact, "bound {bound} > exact {exact} for {text:?}");
        }
    }

    fn chat(text: String, max_tokens: Option<u32>, stop_token_ids: Vec<u32>) -> ChatGenRequest {
        ChatGenRequest {
            request_id: "chatcmpl-admission".into(),
            messages: vec![json!({"role": "user", "content": text})],
            tools: vec![],
            tool_choice: ToolChoice::None,
            thinking: false,
            template_kwargs: Default::default(),
            sampling: SamplingOptions {
                max_tokens,
                stop_token_ids,
                ..Default::default()
            },
            constraint: None,
            constraint_param: String::new(),
        }
    }

    /// A prompt far past the context is refused from its bytes: the template never runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn oversize_prompt_is_refused_before_the_template() {
        let b = crate::tests::backend_with_own_plugins();
        let before = crate::tests::template_renders(&b);
        let huge = "word ".repeat(400_000);
        let started = std::time::Instant::now();
        let err = b.chat(chat(huge, Some(8), vec![])).await.err().unwrap();
        assert!(
            matches!(&err, BackendError::ContextLengthExceeded(m) if m.contains("at least")),
            "{err:?}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert_eq!(
            crate::tests::template_renders(&b),
            before,
            "the template must not have run"
        );
        // Near the limit the exact check decides: a prompt that fits still runs.
        let g = b.chat(chat("word ".repeat(20), Some(4), vec![])).await;
        assert!(g.is_ok(), "{:?}", g.err());
        assert!(
            crate::tests::template_renders(&b) > before,
            "the counter must see renders"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_token_ids_must_be_in_the_vocabulary() {
        let b = crate::tests::backend();
        let err = b
            .chat(chat("hi".into(), Some(4), vec![5, 1 << 20]))
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&err, BackendError::InvalidRequest { param: Some(p), .. } if p == "stop_token_ids[1]"),
            "{err:?}"
        );
        assert!(b.chat(chat("hi".into(), Some(4), vec![5])).await.is_ok());
    }

    #[test]
    fn content_bytes_counts_strings_and_text_parts() {
        let messages = vec![
            json!({"role": "system", "content": "abc"}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "hello"},
                {"type": "image_url", "image_url": {"url": "data:..."}}
            ]}),
            json!({"role": "assistant", "content": null, "tool_calls": []}),
        ];
        assert_eq!(content_bytes(&messages), 8);
    }

    /// Parser streams start when a request produces output, not when it is queued: with one
    /// running sequence and an instance pool far smaller than two per submitted chat, every
    /// chat still completes (started eagerly, the fourth submission would find no instance).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_chats_hold_no_parser_instances() {
        let host = crate::tests::own_plugins(k3_plugin_host::PluginHostConfig {
            max_instances: 6,
            template_pool_size: 1,
            ..k3_plugin_host::PluginHostConfig::default()
        });
        if !host.uses_pooling_allocator() {
            return; // on-demand allocation has no instance limit to test against
        }
        let b = crate::tests::backend_with(
            host.clone(),
            k3_engine::EngineConfig {
                max_context: 512,
                max_running: 1,
                eos_token_ids: vec![2],
                ..k3_engine::EngineConfig::default()
            },
        );
        let mut gens = Vec::new();
        for i in 0..8 {
            let g = b.chat(chat(format!("story {i}"), Some(16), vec![])).await;
            gens.push(g.unwrap_or_else(|e| panic!("submission {i}: {e:?}")));
        }
        for (i, g) in gens.into_iter().enumerate() {
            let events: Vec<crate::GenEvent> = futures::StreamExt::collect(g.events).await;
            assert!(
                matches!(events.last(), Some(crate::GenEvent::Finished(_))),
                "chat {i} ended with {:?}",
                events.last()
            );
        }
        assert_eq!(host.capacity_refusals(), 0);
    }
}
