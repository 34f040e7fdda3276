//! The host's public types: plain Rust, no wasmtime types, so the engine and HTTP crates can use
//! them freely.

use std::fmt;
use std::time::SystemTime;

use serde::Serialize;

/// A frontend stage; each has its own slot and WIT world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Stage {
    ChatTemplate,
    ReasoningParser,
    ToolParser,
    Media,
    Router,
}

impl Stage {
    pub const ALL: [Stage; 5] = [
        Stage::ChatTemplate,
        Stage::ReasoningParser,
        Stage::ToolParser,
        Stage::Media,
        Stage::Router,
    ];

    /// The stage's name as used in WIT and the admin API (`tool-parser`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::ChatTemplate => "chat-template",
            Stage::ReasoningParser => "reasoning-parser",
            Stage::ToolParser => "tool-parser",
            Stage::Media => "media",
            Stage::Router => "router",
        }
    }

    /// The WIT world a component for this stage must implement.
    pub fn world(self) -> &'static str {
        match self {
            Stage::ChatTemplate => "chat-template-plugin",
            Stage::ReasoningParser => "reasoning-parser-plugin",
            Stage::ToolParser => "tool-parser-plugin",
            Stage::Media => "media-plugin",
            Stage::Router => "router-plugin",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Stage {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Stage::ALL
            .into_iter()
            .find(|st| st.as_str() == s || st.as_str().replace('-', "_") == s)
            .ok_or_else(|| format!("unknown plugin stage {s:?} (expected one of chat-template, reasoning-parser, tool-parser, media, router)"))
    }
}

/// One streaming parser event. Markers never appear in `Content` / `Reasoning` text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ParseEvent {
    Content {
        text: String,
    },
    Reasoning {
        text: String,
    },
    /// A tool call's id and name, sent once when its open tag completes. `index` is 0-based
    /// within the response.
    ToolCallStart {
        index: u32,
        id: String,
        name: String,
    },
    /// A piece of the call's arguments JSON (pieces concatenate to a JSON object).
    ToolCallArguments {
        index: u32,
        delta: String,
    },
    /// The call ended; `complete == false` means the text ended inside it.
    ToolCallEnd {
        index: u32,
        complete: bool,
    },
}

/// A completed tool call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolCall {
    pub index: u32,
    pub id: String,
    pub name: String,
    /// A serialised JSON object.
    pub arguments: String,
}

/// A one-shot parse result; equals the accumulation of the streaming events.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ParseResult {
    pub content: Option<String>,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

impl ParseResult {
    /// Accumulate streamed events the way a client does: text concatenated, calls by index,
    /// calls that never completed dropped, empty text as `None`.
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a ParseEvent>) -> Self {
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut calls: Vec<(ToolCall, bool)> = Vec::new();
        for e in events {
            match e {
                ParseEvent::Content { text } => content.push_str(text),
                ParseEvent::Reasoning { text } => reasoning.push_str(text),
                ParseEvent::ToolCallStart { index, id, name } => calls.push((
                    ToolCall {
                        index: *index,
                        id: id.clone(),
                        name: name.clone(),
                        arguments: String::new(),
                    },
                    false,
                )),
                ParseEvent::ToolCallArguments { index, delta } => {
                    if let Some((c, _)) = calls.iter_mut().rev().find(|(c, _)| c.index == *index) {
                        c.arguments.push_str(delta);
                    }
                }
                ParseEvent::ToolCallEnd { index, complete } => {
                    if let Some((_, done)) = calls.iter_mut().rev().find(|(c, _)| c.index == *index)
                    {
                        *done = *complete;
                    }
                }
            }
        }
        ParseResult {
            content: (!content.is_empty()).then_some(content),
            reasoning: (!reasoning.is_empty()).then_some(reasoning),
            tool_calls: calls
                .into_iter()
                .filter(|(_, done)| *done)
                .map(|(c, _)| c)
                .collect(),
        }
    }
}

/// Options for a reasoning-parser stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningOptions {
    /// Thinking enabled for this request; when false all text is content.
    pub thinking: bool,
    /// The prompt already opened the reasoning channel (K3's generation prompt does).
    pub prompt_opens_reasoning: bool,
    pub extra_json: Option<String>,
}

impl Default for ReasoningOptions {
    fn default() -> Self {
        Self {
            thinking: true,
            prompt_opens_reasoning: true,
            extra_json: None,
        }
    }
}

/// Options for a tool-parser stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOptions {
    /// The request's `tools` JSON array, if any.
    pub tools_json: Option<String>,
    /// Invented call ids are `id_prefix` + index: make it unique per request.
    pub id_prefix: String,
    pub extra_json: Option<String>,
}

impl Default for ToolOptions {
    fn default() -> Self {
        Self {
            tools_json: None,
            id_prefix: "call_".into(),
            extra_json: None,
        }
    }
}

/// Typed chat-template options (`None` = not given: the template's default applies).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    pub thinking: Option<bool>,
    pub thinking_effort: Option<String>,
    /// JSON of the request's `tool_choice`.
    pub tool_choice_json: Option<String>,
    /// JSON of the request's `response_format`.
    pub response_format_json: Option<String>,
    /// JSON object of further `chat_template_kwargs`.
    pub extra_kwargs_json: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The tokenizer's special-token spellings: only these, and only inside template markup,
    /// become special tokens (see [`crate::ChatTemplates::render_segments`]). Empty: nothing
    /// is special, and the render comes back as text.
    pub special_tokens: Vec<String>,
}

/// A chat-template failure reported by the template plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", content = "message", rename_all = "kebab-case")]
pub enum TemplateError {
    /// The template text does not parse.
    #[error("chat template syntax error: {0}")]
    Syntax(String),
    /// The template's own `raise_exception` (a client error: HTTP 400).
    #[error("{0}")]
    Raised(String),
    /// The messages / tools / options were not valid input (HTTP 400).
    #[error("invalid chat template input: {0}")]
    InvalidInput(String),
    #[error("chat template render error: {0}")]
    Render(String),
}

impl TemplateError {
    /// Whether the client caused it (HTTP 400) rather than the template or server.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            TemplateError::Raised(_) | TemplateError::InvalidInput(_)
        )
    }
}

/// A media-stage failure: the plugin refused the image or the host refused the plugin's output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", content = "message", rename_all = "kebab-case")]
pub enum MediaError {
    /// The image is bad (not an image, truncated, a bomb, a lying MIME type...): the message
    /// names the image and the problem, e.g. `image 0: declared image/png but the data is
    /// JPEG`. A client error (HTTP 400).
    #[error("{0}")]
    InvalidImage(String),
    /// The plugin does not support these options (the server's settings).
    #[error("media plugin: unsupported: {0}")]
    Unsupported(String),
    #[error("media plugin internal error: {0}")]
    Internal(String),
    /// The plugin's answer broke the stage contract (sizes, pixel or token counts, the
    /// placeholder); the host refused it rather than hand the model garbage.
    #[error("media plugin {plugin} returned invalid output: {detail}")]
    BadOutput { plugin: String, detail: String },
}

impl MediaError {
    /// Whether the client caused it (HTTP 400) rather than the plugin or the server.
    pub fn is_client_error(&self) -> bool {
        matches!(self, MediaError::InvalidImage(_))
    }
}

/// An error a plugin returned on purpose (never poisons the instance).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", content = "message", rename_all = "kebab-case")]
pub enum GuestError {
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("internal plugin error: {0}")]
    Internal(String),
}

/// What a plugin reports about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PluginMetadata {
    pub name: String,
    pub version: String,
    pub stage: Stage,
    pub wit_version: String,
    pub description: String,
}

/// Counters of one loaded version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct VersionStats {
    /// Guest calls (instantiations, feeds, finishes, renders, parses).
    pub calls: u64,
    /// Calls that returned a plugin error (bad input etc.).
    pub errors: u64,
    /// Calls that trapped, timed out or ran out of memory.
    pub faults: u64,
    /// Streams / template sessions started on this version.
    pub sessions: u64,
    /// Total time spent inside guest calls, in nanoseconds.
    pub busy_ns: u64,
}

/// A loaded plugin version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionInfo {
    /// Host-assigned id, unique within the process.
    pub id: u64,
    pub stage: Stage,
    pub metadata: PluginMetadata,
    /// sha256 of the component bytes, hex.
    pub sha256: String,
    pub size_bytes: usize,
    #[serde(with = "unix_seconds")]
    pub loaded_at: SystemTime,
    pub active: bool,
    /// The version `rollback` would restore.
    pub previous: bool,
    pub stats: VersionStats,
}

mod unix_seconds {
    use std::time::{SystemTime, UNIX_EPOCH};

    pub fn serialize<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(
            t.duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
        )
    }
}

/// How the model must use the tools (WIT 0.3 `output-grammar.tool-choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarToolChoice {
    /// Calls are optional; strict tools are held to their schema once a call block opens.
    Auto,
    /// At least one call, to any of the tools.
    Required,
    /// At least one call, all to this function.
    Function(String),
    /// No calls.
    None,
}

/// What the tool parser's output grammar is asked for (WIT 0.3 `grammar-request`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarRequest {
    /// The request's `tools` (an OpenAI-shaped JSON array), if any.
    pub tools_json: Option<String>,
    pub tool_choice: GrammarToolChoice,
    /// The prompt ended inside the reasoning channel: the output starts with reasoning.
    pub prompt_opens_reasoning: bool,
    /// A Lark expression (llguidance's dialect) the response content must match.
    pub content_lark: Option<String>,
    /// Extra options as a JSON object.
    pub extra_json: Option<String>,
}

/// A constraint on the model's output (WIT 0.3 `output-grammar`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutputGrammar {
    /// A complete Lark grammar in llguidance's dialect (rule `start`).
    pub lark: String,
    /// `None`: the grammar applies from the first generated token. `Some(t)`: generation is
    /// free until the output ends with the text `t` (which may spell special tokens); the
    /// grammar applies to what follows.
    pub trigger: Option<String>,
}

/// What a routing policy sees of a request (the `router` interface's `request-summary`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteRequest {
    pub request_id: String,
    pub model: String,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// The prompt's chained block hashes (`k3_cache_events::block_hashes`).
    pub prefix_block_hashes: Vec<u64>,
    pub priority: i32,
}

/// What a routing policy sees of one replica (the `router` interface's `replica-state`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaView {
    pub id: String,
    pub healthy: bool,
    /// Requests waiting for a slot.
    pub queued: u32,
    pub running: u32,
    pub kv_free_blocks: u32,
    pub kv_total_blocks: u32,
    /// Leading blocks of the request the replica can restore: up to the deepest KDA checkpoint
    /// inside its cached prefix (KV past it would be recomputed).
    pub prefix_hit_blocks: u32,
}

/// A routing policy's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RouteChoice {
    pub replica_id: String,
    pub reason: String,
}
