//! Generic glue between the SDK's plain Rust traits and the generated WIT traits.
//! (wit-bindgen resources take `&self`, so per-stream state lives in a `RefCell`; a guest is
//! single-threaded.)

use std::cell::RefCell;
use std::marker::PhantomData;

use crate::{
    ChatTemplate, GrammarRequest, LogLevel, Plugin, ReasoningOptions, ReasoningParser,
    RenderOptions, Router, TemplateError, ToolChoice, ToolGrammar, ToolOptions, ToolParser,
};

/// Conversions for the shared `types` interface; each world module has its own copy of them.
macro_rules! common_conversions {
    ($world:ident) => {
        #[allow(dead_code)]
        mod $world {
            use crate::bindings::$world::k3serve::plugin::types as wit;

            pub fn event(e: crate::Event) -> wit::ParseEvent {
                match e {
                    crate::Event::Content(t) => wit::ParseEvent::Content(t),
                    crate::Event::Reasoning(t) => wit::ParseEvent::Reasoning(t),
                    crate::Event::ToolCallStart { index, id, name } => {
                        wit::ParseEvent::ToolCallStart(wit::ToolCallStart { index, id, name })
                    }
                    crate::Event::ToolCallArguments { index, delta } => {
                        wit::ParseEvent::ToolCallArguments(wit::ToolCallArguments { index, delta })
                    }
                    crate::Event::ToolCallEnd { index, complete } => {
                        wit::ParseEvent::ToolCallEnd(wit::ToolCallEnd { index, complete })
                    }
                }
            }

            pub fn events(
                r: Result<Vec<crate::Event>, crate::PluginError>,
            ) -> Result<Vec<wit::ParseEvent>, wit::PluginError> {
                r.map(|v| v.into_iter().map(event).collect()).map_err(error)
            }

            pub fn error(e: crate::PluginError) -> wit::PluginError {
                match e {
                    crate::PluginError::InvalidInput(m) => wit::PluginError::InvalidInput(m),
                    crate::PluginError::Unsupported(m) => wit::PluginError::Unsupported(m),
                    crate::PluginError::Internal(m) => wit::PluginError::Internal(m),
                }
            }

            pub fn result(
                r: Result<crate::ParseResult, crate::PluginError>,
            ) -> Result<wit::ParseResult, wit::PluginError> {
                r.map(|r| wit::ParseResult {
                    content: r.content,
                    reasoning: r.reasoning,
                    tool_calls: r
                        .tool_calls
                        .into_iter()
                        .map(|c| wit::ToolCall {
                            index: c.index,
                            id: c.id,
                            name: c.name,
                            arguments: c.arguments,
                        })
                        .collect(),
                })
                .map_err(error)
            }

            pub fn metadata(info: crate::Info, stage: wit::Stage) -> wit::PluginMetadata {
                wit::PluginMetadata {
                    name: info.name.into(),
                    version: info.version.into(),
                    stage,
                    wit_version: crate::WIT_VERSION.into(),
                    description: info.description.into(),
                }
            }
        }
    };
}

common_conversions!(reasoning);
common_conversions!(tools);
common_conversions!(tools_grammar);
common_conversions!(template);
common_conversions!(router);

/// Forward to the host's `log` import.
pub fn log(level: LogLevel, message: &str) {
    use crate::bindings::tools::k3serve::plugin::{log as host, types::LogLevel as L};
    let level = match level {
        LogLevel::Trace => L::Trace,
        LogLevel::Debug => L::Debug,
        LogLevel::Info => L::Info,
        LogLevel::Warn => L::Warn,
        LogLevel::Error => L::Error,
    };
    host::log(level, message);
}

// ---------------------------------------------------------------- reasoning-parser world

/// The exported component for a reasoning parser `P`.
pub struct ReasoningComponent<P>(PhantomData<P>);
/// The exported `reasoning-stream` resource.
pub struct ReasoningStreamAdapter<P>(RefCell<P>);

mod rp {
    pub use crate::bindings::reasoning as meta;
    pub use crate::bindings::reasoning::exports::k3serve::plugin::reasoning_parser as api;
    pub use crate::bindings::reasoning::k3serve::plugin::types as wit;
}

fn reasoning_options(o: rp::api::ReasoningOptions) -> ReasoningOptions {
    ReasoningOptions {
        thinking: o.thinking,
        prompt_opens_reasoning: o.prompt_opens_reasoning,
        extra_json: o.extra_json,
    }
}

impl<P: ReasoningParser> rp::api::GuestReasoningStream for ReasoningStreamAdapter<P> {
    fn new(options: rp::api::ReasoningOptions) -> Self {
        Self(RefCell::new(P::new(reasoning_options(options))))
    }
    fn feed(&self, delta: String) -> Result<Vec<rp::wit::ParseEvent>, rp::wit::PluginError> {
        reasoning::events(self.0.borrow_mut().feed(&delta))
    }
    fn finish(&self) -> Result<Vec<rp::wit::ParseEvent>, rp::wit::PluginError> {
        reasoning::events(self.0.borrow_mut().finish())
    }
}

impl<P: ReasoningParser + Plugin> rp::api::Guest for ReasoningComponent<P> {
    type ReasoningStream = ReasoningStreamAdapter<P>;
    fn parse(
        options: rp::api::ReasoningOptions,
        text: String,
    ) -> Result<rp::wit::ParseResult, rp::wit::PluginError> {
        reasoning::result(P::new(reasoning_options(options)).parse_all(&text))
    }
}

impl<P: ReasoningParser + Plugin> rp::meta::Guest for ReasoningComponent<P> {
    fn metadata() -> rp::wit::PluginMetadata {
        reasoning::metadata(P::INFO, rp::wit::Stage::ReasoningParser)
    }
    fn self_test() -> Result<(), String> {
        P::self_test()
    }
}

// ---------------------------------------------------------------- tool-parser worlds

/// The exported component for a tool parser `P` (world `tool-parser-plugin`).
pub struct ToolComponent<P>(PhantomData<P>);
/// The exported component for a tool parser `P` with its output grammar (world
/// `tool-parser-grammar-plugin`).
pub struct ToolGrammarComponent<P>(PhantomData<P>);
/// The exported `tool-stream` resource (of either world).
pub struct ToolStreamAdapter<P>(RefCell<P>);

/// The `tool-parser` interface and the world-level exports, for one world's bindings.
macro_rules! tool_world {
    ($world:ident, $component:ident) => {
        const _: () = {
            use crate::bindings::$world::exports::k3serve::plugin::tool_parser as api;
            use crate::bindings::$world::k3serve::plugin::types as wit;

            fn tool_options(o: api::ToolOptions) -> ToolOptions {
                ToolOptions {
                    tools_json: o.tools_json,
                    id_prefix: o.id_prefix,
                    extra_json: o.extra_json,
                }
            }

            impl<P: ToolParser> api::GuestToolStream for ToolStreamAdapter<P> {
                fn new(options: api::ToolOptions) -> Self {
                    Self(RefCell::new(P::new(tool_options(options))))
                }
                fn feed(&self, delta: String) -> Result<Vec<wit::ParseEvent>, wit::PluginError> {
                    $world::events(self.0.borrow_mut().feed(&delta))
                }
                fn finish(&self) -> Result<Vec<wit::ParseEvent>, wit::PluginError> {
                    $world::events(self.0.borrow_mut().finish())
                }
            }

            impl<P: ToolParser + Plugin> api::Guest for $component<P> {
                type ToolStream = ToolStreamAdapter<P>;
                fn parse(
                    options: api::ToolOptions,
                    text: String,
                ) -> Result<wit::ParseResult, wit::PluginError> {
                    $world::result(P::new(tool_options(options)).parse_all(&text))
                }
            }

            impl<P: ToolParser + Plugin> crate::bindings::$world::Guest for $component<P> {
                fn metadata() -> wit::PluginMetadata {
                    $world::metadata(P::INFO, wit::Stage::ToolParser)
                }
                fn self_test() -> Result<(), String> {
                    P::self_test()
                }
            }
        };
    };
}

tool_world!(tools, ToolComponent);
tool_world!(tools_grammar, ToolGrammarComponent);

mod og {
    pub use crate::bindings::tools_grammar::exports::k3serve::plugin::output_grammar as api;
    pub use crate::bindings::tools_grammar::k3serve::plugin::types as wit;
}

impl<P: ToolParser + Plugin + ToolGrammar> og::api::Guest for ToolGrammarComponent<P> {
    fn grammar(
        request: og::api::GrammarRequest,
    ) -> Result<Option<og::api::OutputGrammar>, og::wit::PluginError> {
        let tool_choice = match request.tool_choice {
            og::api::ToolChoice::Auto => ToolChoice::Auto,
            og::api::ToolChoice::Required => ToolChoice::Required,
            og::api::ToolChoice::Function(name) => ToolChoice::Function(name),
            og::api::ToolChoice::None => ToolChoice::None,
        };
        let request = GrammarRequest {
            tools_json: request.tools_json,
            tool_choice,
            prompt_opens_reasoning: request.prompt_opens_reasoning,
            content_lark: request.content_lark,
            extra_json: request.extra_json,
        };
        P::grammar(request)
            .map(|g| {
                g.map(|g| og::api::OutputGrammar {
                    lark: g.lark,
                    trigger: g.trigger,
                })
            })
            .map_err(tools_grammar::error)
    }
}

// ---------------------------------------------------------------- chat-template world

/// The exported component for a chat template `T`.
pub struct TemplateComponent<T>(PhantomData<T>);
/// The exported `template` resource: the compiled template, or why it failed to compile, and
/// its source (sentinels must not occur in it).
pub struct TemplateAdapter<T>(Result<T, TemplateError>, String);

mod ct {
    pub use crate::bindings::template as meta;
    pub use crate::bindings::template::exports::k3serve::plugin::chat_template as api;
    pub use crate::bindings::template::k3serve::plugin::types as wit;
}

fn render_options(o: ct::api::RenderOptions) -> RenderOptions {
    RenderOptions {
        add_generation_prompt: o.add_generation_prompt,
        thinking: o.thinking,
        thinking_effort: o.thinking_effort,
        tool_choice_json: o.tool_choice_json,
        response_format_json: o.response_format_json,
        extra_kwargs_json: o.extra_kwargs_json,
        bos_token: o.bos_token,
        eos_token: o.eos_token,
        special_tokens: o.special_tokens,
    }
}

fn segments(s: Vec<crate::Segment>) -> Vec<ct::api::Segment> {
    s.into_iter()
        .map(|s| match s {
            crate::Segment::Markup(m) => ct::api::Segment::Markup(m),
            crate::Segment::Text(t) => ct::api::Segment::Text(t),
        })
        .collect()
}

fn template_error(e: TemplateError) -> ct::api::TemplateError {
    match e {
        TemplateError::Syntax(m) => ct::api::TemplateError::Syntax(m),
        TemplateError::Raised(m) => ct::api::TemplateError::Raised(m),
        TemplateError::InvalidInput(m) => ct::api::TemplateError::InvalidInput(m),
        TemplateError::Render(m) => ct::api::TemplateError::Render(m),
    }
}

impl<T: ChatTemplate> ct::api::GuestTemplate for TemplateAdapter<T> {
    fn new(source: String) -> Self {
        Self(T::compile(&source), source)
    }
    fn check(&self) -> Result<(), ct::api::TemplateError> {
        self.0
            .as_ref()
            .map(|_| ())
            .map_err(|e| template_error(e.clone()))
    }
    fn render(
        &self,
        messages_json: String,
        tools_json: Option<String>,
        options: ct::api::RenderOptions,
    ) -> Result<Vec<ct::api::Segment>, ct::api::TemplateError> {
        let template = self.0.as_ref().map_err(|e| template_error(e.clone()))?;
        crate::render_segments(
            template,
            &self.1,
            &messages_json,
            tools_json.as_deref(),
            &render_options(options),
        )
        .map(segments)
        .map_err(template_error)
    }
}

impl<T: ChatTemplate + Plugin> ct::api::Guest for TemplateComponent<T> {
    type Template = TemplateAdapter<T>;
    fn render(
        source: String,
        messages_json: String,
        tools_json: Option<String>,
        options: ct::api::RenderOptions,
    ) -> Result<Vec<ct::api::Segment>, ct::api::TemplateError> {
        let template = T::compile(&source).map_err(template_error)?;
        crate::render_segments(
            &template,
            &source,
            &messages_json,
            tools_json.as_deref(),
            &render_options(options),
        )
        .map(segments)
        .map_err(template_error)
    }
}

impl<T: ChatTemplate + Plugin> ct::meta::Guest for TemplateComponent<T> {
    fn metadata() -> ct::wit::PluginMetadata {
        template::metadata(T::INFO, ct::wit::Stage::ChatTemplate)
    }
    fn self_test() -> Result<(), String> {
        T::self_test()
    }
}

// ---------------------------------------------------------------- router world

/// The exported component for a router `R`. The policy lives in the instance for its whole
/// life (created on the first `choose`), so its state carries over from call to call.
pub struct RouterComponent<R>(PhantomData<R>);

mod rt {
    pub use crate::bindings::router as meta;
    pub use crate::bindings::router::exports::k3serve::plugin::router as api;
    pub use crate::bindings::router::k3serve::plugin::types as wit;
}

thread_local! {
    /// The one policy of this instance (a component exports one router; a guest is
    /// single-threaded). Boxed as `Any` because a static cannot be generic.
    static ROUTER: RefCell<Option<Box<dyn std::any::Any>>> = const { RefCell::new(None) };
}

impl<R: Router + Plugin> rt::api::Guest for RouterComponent<R> {
    fn choose(
        request: rt::api::RequestSummary,
        replicas: Vec<rt::api::ReplicaState>,
    ) -> Result<rt::api::RouteChoice, rt::wit::PluginError> {
        let request = crate::RouteRequest {
            request_id: request.request_id,
            model: request.model,
            prompt_tokens: request.prompt_tokens,
            max_tokens: request.max_tokens,
            prefix_block_hashes: request.prefix_block_hashes,
            priority: request.priority,
        };
        let replicas: Vec<crate::Replica> = replicas
            .into_iter()
            .map(|r| crate::Replica {
                id: r.id,
                healthy: r.healthy,
                queued: r.queued,
                running: r.running,
                kv_free_blocks: r.kv_free_blocks,
                kv_total_blocks: r.kv_total_blocks,
                prefix_hit_blocks: r.prefix_hit_blocks,
            })
            .collect();
        ROUTER.with(|cell| {
            let mut slot = cell.borrow_mut();
            let state = slot.get_or_insert_with(|| Box::new(R::new()));
            let policy = state.downcast_mut::<R>().ok_or_else(|| {
                rt::wit::PluginError::Internal("router state type mismatch".into())
            })?;
            policy
                .choose(&request, &replicas)
                .map(|c| rt::api::RouteChoice {
                    replica_id: c.replica_id,
                    reason: c.reason,
                })
                .map_err(router::error)
        })
    }
}

impl<R: Router + Plugin> rt::meta::Guest for RouterComponent<R> {
    fn metadata() -> rt::wit::PluginMetadata {
        router::metadata(R::INFO, rt::wit::Stage::Router)
    }
    fn self_test() -> Result<(), String> {
        R::self_test()
    }
}
