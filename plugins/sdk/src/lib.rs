//! SDK for k3serve plugins (WIT package `k3serve:plugin@0.3.0`).
//!
//! A plugin author writes an ordinary Rust type that implements [`Plugin`] plus one stage trait
//! ([`ReasoningParser`], [`ToolParser`], [`ChatTemplate`] or [`Router`]) and exports it with one
//! macro:
//!
//! ```ignore
//! struct MyParser { /* state */ }
//! impl k3_plugin_sdk::Plugin for MyParser {
//!     const INFO: k3_plugin_sdk::Info = k3_plugin_sdk::Info::new("my-parser", "0.1.0", "what it does");
//! }
//! impl k3_plugin_sdk::StreamingParser for MyParser { /* feed, finish */ }
//! impl k3_plugin_sdk::ReasoningParser for MyParser { /* new */ }
//! k3_plugin_sdk::export_reasoning_parser!(MyParser);
//! ```
//!
//! Natively (the host target) the SDK is plain Rust: the macro expands to nothing, so the same
//! crate is unit-tested with `cargo test`; [`testing`] has chunking checks. Built for
//! `wasm32-wasip2` the macro exports the component.

mod accumulate;
#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod adapters;
#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod bindings;
mod grammar;
pub mod router;
pub mod testing;
pub mod text;

pub use accumulate::Accumulator;
pub use grammar::{GrammarRequest, OutputGrammar, ToolChoice, ToolGrammar};
pub use k3_segments::Segment;
pub use router::{Replica, RouteChoice, RouteRequest, Router};

/// The WIT package version this SDK builds plugins against.
pub const WIT_VERSION: &str = "0.3.0";

/// One streaming event (WIT `parse-event`). Markers never appear in the text of events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Content(String),
    Reasoning(String),
    /// A call's open tag completed: its id and name, sent once.
    ToolCallStart {
        index: u32,
        id: String,
        name: String,
    },
    /// A piece of the call's arguments JSON.
    ToolCallArguments {
        index: u32,
        delta: String,
    },
    /// The call ended; `complete` is false when the text ended inside it.
    ToolCallEnd {
        index: u32,
        complete: bool,
    },
}

/// A completed tool call (WIT `tool-call`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub index: u32,
    pub id: String,
    pub name: String,
    /// A serialised JSON object.
    pub arguments: String,
}

/// A one-shot parse result (WIT `parse-result`): the accumulation of all streaming events.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParseResult {
    pub content: Option<String>,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

/// An error a plugin returns on purpose (WIT `plugin-error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginError {
    InvalidInput(String),
    Unsupported(String),
    Internal(String),
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PluginError::InvalidInput(m) => write!(f, "invalid input: {m}"),
            PluginError::Unsupported(m) => write!(f, "unsupported: {m}"),
            PluginError::Internal(m) => write!(f, "internal: {m}"),
        }
    }
}

impl std::error::Error for PluginError {}

/// WIT `reasoning-options`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningOptions {
    pub thinking: bool,
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

/// WIT `tool-options`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOptions {
    pub tools_json: Option<String>,
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

/// WIT `render-options`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    pub thinking: Option<bool>,
    pub thinking_effort: Option<String>,
    pub tool_choice_json: Option<String>,
    pub response_format_json: Option<String>,
    pub extra_kwargs_json: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The tokenizer's special-token spellings (WIT 0.2): see [`render_segments`].
    pub special_tokens: Vec<String>,
}

/// WIT `template-error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateError {
    Syntax(String),
    Raised(String),
    InvalidInput(String),
    Render(String),
}

impl std::fmt::Display for TemplateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateError::Syntax(m) => write!(f, "template syntax error: {m}"),
            TemplateError::Raised(m) => write!(f, "template raised: {m}"),
            TemplateError::InvalidInput(m) => write!(f, "invalid template input: {m}"),
            TemplateError::Render(m) => write!(f, "template render error: {m}"),
        }
    }
}

impl std::error::Error for TemplateError {}

/// What a plugin says about itself; the stage comes from the export macro used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    pub name: &'static str,
    pub version: &'static str,
    pub description: &'static str,
}

impl Info {
    pub const fn new(name: &'static str, version: &'static str, description: &'static str) -> Self {
        Self {
            name,
            version,
            description,
        }
    }
}

/// Every plugin: its identity and its own self-test (run by the host before activation).
pub trait Plugin {
    const INFO: Info;
    /// Check the plugin works; `Err` carries the reason. Keep it quick (milliseconds).
    fn self_test() -> Result<(), String> {
        Ok(())
    }
}

/// A parser fed one text delta at a time.
pub trait StreamingParser {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError>;
    /// Flush held-back text; no feed follows.
    fn finish(&mut self) -> Result<Vec<Event>, PluginError>;

    /// The one-shot parse: feeding everything at once, then finishing. Implementations that
    /// override it must stay identical to the streaming result.
    fn parse_all(mut self, text: &str) -> Result<ParseResult, PluginError>
    where
        Self: Sized,
    {
        let mut acc = Accumulator::default();
        acc.extend(self.feed(text)?);
        acc.extend(self.finish()?);
        Ok(acc.finish())
    }
}

/// The reasoning-parser stage.
pub trait ReasoningParser: StreamingParser + Sized + 'static {
    fn new(options: ReasoningOptions) -> Self;
}

/// The tool-parser stage.
pub trait ToolParser: StreamingParser + Sized + 'static {
    fn new(options: ToolOptions) -> Self;
}

/// The chat-template stage: compile once, render many times. A template renders text; the SDK
/// turns it into markup and client-text segments with [`render_segments`], so a template needs
/// no code of its own to keep client text from forging special tokens.
pub trait ChatTemplate: Sized + 'static {
    fn compile(source: &str) -> Result<Self, TemplateError>;
    fn render(
        &self,
        messages_json: &str,
        tools_json: Option<&str>,
        options: &RenderOptions,
    ) -> Result<String, TemplateError>;
}

/// Render `template` (compiled from `source`) into segments by taint substitution
/// (`k3_segments`): every client string — `messages_json`, `tools_json` and the client-supplied
/// options (`thinking_effort`, `tool_choice_json`, `response_format_json`,
/// `extra_kwargs_json`) — has the first character of each of `options.special_tokens` replaced
/// by a sentinel before the render, so the special-token spellings left in the output are the
/// template's own. `bos_token` / `eos_token` come from the server and stay markup. Error
/// messages get the sentinels mapped back.
pub fn render_segments<T: ChatTemplate>(
    template: &T,
    source: &str,
    messages_json: &str,
    tools_json: Option<&str>,
    options: &RenderOptions,
) -> Result<Vec<Segment>, TemplateError> {
    use k3_segments::{ClientStrings, ServerStrings, Specials};
    let client = ClientStrings {
        messages_json,
        tools_json,
        thinking_effort: options.thinking_effort.as_deref(),
        tool_choice_json: options.tool_choice_json.as_deref(),
        response_format_json: options.response_format_json.as_deref(),
        extra_kwargs_json: options.extra_kwargs_json.as_deref(),
    };
    let server = ServerStrings {
        template: source,
        bos_token: options.bos_token.as_deref(),
        eos_token: options.eos_token.as_deref(),
    };
    let (taint, t) = client
        .taint(Specials::new(&options.special_tokens), server)
        .map_err(|e| TemplateError::InvalidInput(e.to_string()))?;
    let tainted = RenderOptions {
        thinking_effort: t.thinking_effort,
        tool_choice_json: t.tool_choice_json,
        response_format_json: t.response_format_json,
        extra_kwargs_json: t.extra_kwargs_json,
        ..options.clone()
    };
    match template.render(&t.messages_json, t.tools_json.as_deref(), &tainted) {
        Ok(text) => Ok(taint.segments(&text)),
        Err(e) => Err(match e {
            TemplateError::Syntax(m) => TemplateError::Syntax(taint.untaint(&m)),
            TemplateError::Raised(m) => TemplateError::Raised(taint.untaint(&m)),
            TemplateError::InvalidInput(m) => TemplateError::InvalidInput(taint.untaint(&m)),
            TemplateError::Render(m) => TemplateError::Render(taint.untaint(&m)),
        }),
    }
}

/// Log levels of the host's `log` import.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
}

/// Send a message to the host's log (no-op natively). The host rate-limits and truncates.
pub fn log(level: LogLevel, message: &str) {
    #[cfg(target_arch = "wasm32")]
    adapters::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    let _ = (level, message);
}

/// Export a [`ReasoningParser`] + [`Plugin`] type as the `reasoning-parser-plugin` world.
#[macro_export]
macro_rules! export_reasoning_parser {
    ($parser:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type __K3Component = $crate::adapters::ReasoningComponent<$parser>;
            $crate::bindings::reasoning::__export_reasoning_world!(__K3Component with_types_in $crate::bindings::reasoning);
        };
    };
}

/// Export a [`ToolParser`] + [`Plugin`] type as the `tool-parser-plugin` world.
#[macro_export]
macro_rules! export_tool_parser {
    ($parser:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type __K3Component = $crate::adapters::ToolComponent<$parser>;
            $crate::bindings::tools::__export_tool_world!(__K3Component with_types_in $crate::bindings::tools);
        };
    };
}

/// Export a [`ToolParser`] + [`ToolGrammar`] + [`Plugin`] type as the
/// `tool-parser-grammar-plugin` world: the tool parser plus its `output-grammar`.
#[macro_export]
macro_rules! export_tool_parser_with_grammar {
    ($parser:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type __K3Component = $crate::adapters::ToolGrammarComponent<$parser>;
            $crate::bindings::tools_grammar::__export_tool_grammar_world!(__K3Component with_types_in $crate::bindings::tools_grammar);
        };
    };
}

/// Export a [`ChatTemplate`] + [`Plugin`] type as the `chat-template-plugin` world.
#[macro_export]
macro_rules! export_chat_template {
    ($template:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type __K3Component = $crate::adapters::TemplateComponent<$template>;
            $crate::bindings::template::__export_template_world!(__K3Component with_types_in $crate::bindings::template);
        };
    };
}

/// Export a [`Router`] + [`Plugin`] type as the `router-plugin` world.
#[macro_export]
macro_rules! export_router {
    ($router:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type __K3Component = $crate::adapters::RouterComponent<$router>;
            $crate::bindings::router::__export_router_world!(__K3Component with_types_in $crate::bindings::router);
        };
    };
}
