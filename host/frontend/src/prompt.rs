//! A chat request's prompt: the chat-template plugin renders the conversation as markup and
//! client-text segments, the tokenizer turns them into ids. Only the template's own special-token
//! spellings become special tokens, so text a client sends (content, names, arguments, tool
//! results, tool definitions, kwargs) cannot forge a turn (docs/k3-format.md, "Client text vs
//! markup"). Raw `/v1/completions` prompts are encoded with special tokens recognised.

use k3_plugin_host::{PluginError, PluginHost, RenderOptions, TemplateError};
use serde_json::{Map, Value};

use crate::error::BackendError;
use crate::request::ChatGenRequest;
use crate::segments::{Segment, encode_segments, special_token_spellings};
use crate::tokenizer::Tokenizer;

/// Tokenize rendered segments: markup with special tokens recognised, client text as text.
pub(crate) fn encode_prompt(
    tokenizer: &Tokenizer,
    segments: &[Segment],
) -> Result<Vec<u32>, BackendError> {
    encode_segments(tokenizer, segments)
        .map_err(|e| BackendError::Internal(format!("tokenizing the prompt failed: {e}")))
}

/// The template's inputs from the request: the template kwargs the WIT interface names become
/// typed options, the rest travel as JSON.
fn render_options(req: &ChatGenRequest, tokenizer: &Tokenizer) -> RenderOptions {
    let mut kwargs: Map<String, Value> = req.template_kwargs.clone();
    let take_str = |kwargs: &mut Map<String, Value>, k: &str| match kwargs.remove(k) {
        Some(Value::String(s)) => Some(s),
        Some(Value::Null) | None => None,
        Some(other) => Some(other.to_string()),
    };
    let add_generation_prompt = match kwargs.remove("add_generation_prompt") {
        Some(Value::Bool(b)) => b,
        _ => true,
    };
    kwargs.remove("thinking");
    let thinking_effort = take_str(&mut kwargs, "thinking_effort");
    let tool_choice_json = kwargs
        .remove("tool_choice")
        .filter(|v| !v.is_null())
        .map(|v| v.to_string());
    let response_format_json = kwargs
        .remove("response_format")
        .filter(|v| !v.is_null())
        .map(|v| v.to_string());
    RenderOptions {
        add_generation_prompt,
        thinking: Some(req.thinking),
        thinking_effort,
        tool_choice_json,
        response_format_json,
        extra_kwargs_json: (!kwargs.is_empty()).then(|| Value::Object(kwargs).to_string()),
        bos_token: tokenizer.bos_token().map(|t| t.text.clone()),
        eos_token: tokenizer.eos_token().map(|t| t.text.clone()),
        special_tokens: special_token_spellings(tokenizer),
    }
}

/// Render `req` into markup and client-text segments (not yet tokenized).
pub(crate) fn render(
    plugins: &PluginHost,
    tokenizer: &Tokenizer,
    chat_template: &str,
    req: &ChatGenRequest,
) -> Result<Vec<Segment>, BackendError> {
    let options = render_options(req, tokenizer);
    let messages = Value::Array(req.messages.clone()).to_string();
    let tools = (!req.tools.is_empty()).then(|| Value::Array(req.tools.clone()).to_string());
    let tools_len = tools.as_ref().map_or(0, String::len);
    plugins
        .chat_template()
        .render_segments(chat_template, &messages, tools.as_deref(), &options)
        .map_err(|e| match e {
            PluginError::Template(t) if t.is_client_error() => BackendError::Template(match t {
                TemplateError::Raised(m) | TemplateError::InvalidInput(m) => m,
                other => other.to_string(),
            }),
            e if e.is_resource_limit() && messages.len() + tools_len >= LARGE_TEMPLATE_INPUT => {
                let param = if tools_len > messages.len() {
                    "tools"
                } else {
                    "messages"
                };
                BackendError::InputTooLarge {
                    message: format!(
                        "the chat template ran out of its resources rendering this request ({e}); \
                         '{param}' is too large ({} bytes of JSON)",
                        tools_len.max(messages.len())
                    ),
                    param: param.into(),
                }
            }
            other => crate::error::plugin_failure(other),
        })
}

/// Template inputs (messages + tools JSON) from this size up that run the template into its
/// memory or time limit are the input's fault (a 400 naming the larger field); below it, the
/// same fault is the plugin's (a 500 counted against it). A render needs several times its input
/// in linear memory, so inputs this large can reach the default 64 MiB cap legitimately.
const LARGE_TEMPLATE_INPUT: usize = 1 << 20;

/// A request's prompt ids without an engine: what a router hashes to find the replica holding
/// the prefix. The same rendering and encoding as the request path, so the ids agree with the
/// replica's; an image's placeholder stays one id (the replica expands it), so only the blocks
/// before the first image can match.
pub struct PromptRenderer {
    pub tokenizer: std::sync::Arc<Tokenizer>,
    pub plugins: PluginHost,
    /// The model's Jinja chat template (from tokenizer_config.json).
    pub chat_template: String,
}

impl PromptRenderer {
    /// A chat request's ids (rendered by the chat-template plugin).
    pub fn chat_ids(&self, req: &ChatGenRequest) -> Result<Vec<u32>, BackendError> {
        // Image parts become placeholders, as on the request path (their bytes are not needed).
        let mut req = req.clone();
        crate::media::take_images(&mut req.messages);
        let segments = render(&self.plugins, &self.tokenizer, &self.chat_template, &req)?;
        encode_prompt(&self.tokenizer, &segments)
    }

    /// A raw completion prompt's ids (special-token spellings recognised).
    pub fn text_ids(&self, text: &str) -> Result<Vec<u32>, BackendError> {
        self.tokenizer
            .encode(text)
            .map_err(|e| BackendError::Internal(format!("tokenizing the prompt failed: {e}")))
    }
}
