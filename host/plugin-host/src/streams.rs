//! Streaming parser sessions: one store + one instance + one guest resource per stream, pinned
//! to the version that was active when the stream started.

use std::sync::Arc;

use wasmtime::Store;
use wasmtime::component::ResourceAny;

use crate::bindings::conv;
use crate::bindings::v0_1::reasoning::ReasoningParserPlugin;
use crate::bindings::v0_1::reasoning::exports::k3serve::plugin::reasoning_parser as rp;
use crate::bindings::v0_1::tool::ToolParserPlugin;
use crate::bindings::v0_1::tool::exports::k3serve::plugin::tool_parser as tp;
use crate::bindings::v0_2::reasoning::ReasoningParserPlugin as ReasoningParserPluginV0_2;
use crate::bindings::v0_2::reasoning::exports::k3serve::plugin::reasoning_parser as rp2;
use crate::bindings::v0_2::tool::ToolParserPlugin as ToolParserPluginV0_2;
use crate::bindings::v0_2::tool::exports::k3serve::plugin::tool_parser as tp2;
use crate::bindings::v0_3::reasoning::ReasoningParserPlugin as ReasoningParserPluginV0_3;
use crate::bindings::v0_3::reasoning::exports::k3serve::plugin::reasoning_parser as rp3;
use crate::bindings::v0_3::tool::ToolParserPlugin as ToolParserPluginV0_3;
use crate::bindings::v0_3::tool::exports::k3serve::plugin::tool_parser as tp3;
use crate::error::PluginError;
use crate::registry::{PluginVersion, StagePre};
use crate::runtime::{Runtime, StoreState};
use crate::types::{GuestError, ParseEvent, ParseResult, ReasoningOptions, Stage, ToolOptions};

enum Instance {
    Reasoning(ReasoningParserPlugin),
    Tool(ToolParserPlugin),
    ReasoningV0_2(ReasoningParserPluginV0_2),
    ToolV0_2(ToolParserPluginV0_2),
    ReasoningV0_3(ReasoningParserPluginV0_3),
    ToolV0_3(ToolParserPluginV0_3),
}

/// What the two stream types share.
struct Session {
    rt: Arc<Runtime>,
    version: Arc<PluginVersion>,
    store: Store<StoreState>,
    instance: Instance,
    handle: ResourceAny,
    closed: bool,
}

/// The same options record in each WIT version's module.
macro_rules! reasoning_options {
    ($m:ident, $o:expr) => {
        $m::ReasoningOptions {
            thinking: $o.thinking,
            prompt_opens_reasoning: $o.prompt_opens_reasoning,
            extra_json: $o.extra_json.clone(),
        }
    };
}

macro_rules! tool_options {
    ($m:ident, $o:expr) => {
        $m::ToolOptions {
            tools_json: $o.tools_json.clone(),
            id_prefix: $o.id_prefix.clone(),
            extra_json: $o.extra_json.clone(),
        }
    };
}

fn guest<T>(version: &PluginVersion, r: Result<T, GuestError>) -> Result<T, PluginError> {
    r.map_err(|error| PluginError::Guest {
        plugin: version.label.to_string(),
        error,
    })
}

/// Start a stream resource on a fresh instance: `(instance, handle)`.
macro_rules! start {
    ($rt:expr, $store:expr, $pre:expr, $api:ident, $resource:ident, $opts:expr) => {{
        let inst = $rt.call($store, |s| $pre.instantiate(s))?;
        let opts = $opts;
        let handle = $rt.call($store, |s| {
            inst.$api().$resource().call_constructor(s, &opts)
        })?;
        (inst, handle)
    }};
}

/// Feed or finish a stream resource; events converted with the version's `conv`.
macro_rules! feed {
    ($rt:expr, $store:expr, $api:expr, $handle:expr, $delta:expr, $finish:expr, $conv:ident) => {{
        let api = $api;
        let r = if $finish {
            $rt.call($store, |s| api.call_finish(s, $handle))?
        } else {
            $rt.call($store, |s| api.call_feed(s, $handle, $delta))?
        };
        r.map(|v| v.into_iter().map(conv::$conv::event).collect::<Vec<_>>())
            .map_err(conv::$conv::guest_error)
    }};
}

impl Session {
    fn start_reasoning(
        rt: &Arc<Runtime>,
        version: Arc<PluginVersion>,
        options: &ReasoningOptions,
    ) -> Result<Self, PluginError> {
        let mut store = rt.store(version.label.clone());
        let (instance, handle) = Runtime::timed(&version, || {
            let st = &mut store;
            Ok(match &version.pre {
                StagePre::Reasoning(pre) => {
                    let o = reasoning_options!(rp, options);
                    let (i, h) = start!(
                        rt,
                        st,
                        pre,
                        k3serve_plugin_reasoning_parser,
                        reasoning_stream,
                        o
                    );
                    (Instance::Reasoning(i), h)
                }
                StagePre::ReasoningV0_2(pre) => {
                    let o = reasoning_options!(rp2, options);
                    let (i, h) = start!(
                        rt,
                        st,
                        pre,
                        k3serve_plugin_reasoning_parser,
                        reasoning_stream,
                        o
                    );
                    (Instance::ReasoningV0_2(i), h)
                }
                StagePre::ReasoningV0_3(pre) => {
                    let o = reasoning_options!(rp3, options);
                    let (i, h) = start!(
                        rt,
                        st,
                        pre,
                        k3serve_plugin_reasoning_parser,
                        reasoning_stream,
                        o
                    );
                    (Instance::ReasoningV0_3(i), h)
                }
                _ => return Err(PluginError::NoActivePlugin(Stage::ReasoningParser)),
            })
        })?;
        // Counted once started: a capacity refusal is no session of this plugin.
        version.counters.session();
        Ok(Self {
            rt: rt.clone(),
            version,
            store,
            instance,
            handle,
            closed: false,
        })
    }

    fn start_tool(
        rt: &Arc<Runtime>,
        version: Arc<PluginVersion>,
        options: &ToolOptions,
    ) -> Result<Self, PluginError> {
        let mut store = rt.store(version.label.clone());
        let (instance, handle) = Runtime::timed(&version, || {
            let st = &mut store;
            Ok(match &version.pre {
                StagePre::Tool(pre) => {
                    let o = tool_options!(tp, options);
                    let (i, h) = start!(rt, st, pre, k3serve_plugin_tool_parser, tool_stream, o);
                    (Instance::Tool(i), h)
                }
                StagePre::ToolV0_2(pre) => {
                    let o = tool_options!(tp2, options);
                    let (i, h) = start!(rt, st, pre, k3serve_plugin_tool_parser, tool_stream, o);
                    (Instance::ToolV0_2(i), h)
                }
                StagePre::ToolV0_3(pre) => {
                    let o = tool_options!(tp3, options);
                    let pre = &pre.tool;
                    let (i, h) = start!(rt, st, pre, k3serve_plugin_tool_parser, tool_stream, o);
                    (Instance::ToolV0_3(i), h)
                }
                _ => return Err(PluginError::NoActivePlugin(Stage::ToolParser)),
            })
        })?;
        // Counted once started: a capacity refusal is no session of this plugin.
        version.counters.session();
        Ok(Self {
            rt: rt.clone(),
            version,
            store,
            instance,
            handle,
            closed: false,
        })
    }

    fn stage(&self) -> Stage {
        self.version.stage
    }

    /// `finish == false`: feed `delta`; `finish == true`: flush.
    fn call(&mut self, delta: &str, finish: bool) -> Result<Vec<ParseEvent>, PluginError> {
        if self.closed {
            return Err(PluginError::StreamClosed(self.stage()));
        }
        let Session {
            rt,
            version,
            store,
            instance,
            handle,
            ..
        } = self;
        let handle = *handle;
        let r = Runtime::timed(version, || {
            let events = match instance {
                Instance::Reasoning(inst) => {
                    let api = inst.k3serve_plugin_reasoning_parser().reasoning_stream();
                    feed!(rt, store, api, handle, delta, finish, v0_1)
                }
                Instance::Tool(inst) => {
                    let api = inst.k3serve_plugin_tool_parser().tool_stream();
                    feed!(rt, store, api, handle, delta, finish, v0_1)
                }
                Instance::ReasoningV0_2(inst) => {
                    let api = inst.k3serve_plugin_reasoning_parser().reasoning_stream();
                    feed!(rt, store, api, handle, delta, finish, v0_2)
                }
                Instance::ToolV0_2(inst) => {
                    let api = inst.k3serve_plugin_tool_parser().tool_stream();
                    feed!(rt, store, api, handle, delta, finish, v0_2)
                }
                Instance::ReasoningV0_3(inst) => {
                    let api = inst.k3serve_plugin_reasoning_parser().reasoning_stream();
                    feed!(rt, store, api, handle, delta, finish, v0_3)
                }
                Instance::ToolV0_3(inst) => {
                    let api = inst.k3serve_plugin_tool_parser().tool_stream();
                    feed!(rt, store, api, handle, delta, finish, v0_3)
                }
            };
            guest(version, events)
        });
        // A fault poisons the store: this stream is over (the next call says so clearly).
        if finish || matches!(&r, Err(e) if e.is_fault()) {
            self.closed = true;
        }
        r
    }

    fn info(&self) -> (u64, &str) {
        (self.version.id, &self.version.label)
    }
}

/// A reasoning-parser stream. Feed text deltas in order, then `finish`. Each call is a few
/// microseconds of CPU, fine to make from async code directly.
pub struct ReasoningStream(Session);

impl ReasoningStream {
    pub(crate) fn start(
        rt: &Arc<Runtime>,
        version: Arc<PluginVersion>,
        options: &ReasoningOptions,
    ) -> Result<Self, PluginError> {
        Session::start_reasoning(rt, version, options).map(Self)
    }

    pub fn feed(&mut self, delta: &str) -> Result<Vec<ParseEvent>, PluginError> {
        self.0.call(delta, false)
    }

    /// Flush held-back text; the stream is closed afterwards.
    pub fn finish(&mut self) -> Result<Vec<ParseEvent>, PluginError> {
        self.0.call("", true)
    }

    /// The version id and `name@version` this stream runs on.
    pub fn version(&self) -> (u64, &str) {
        self.0.info()
    }
}

/// A tool-parser stream; see [`ReasoningStream`].
pub struct ToolStream(Session);

impl ToolStream {
    pub(crate) fn start(
        rt: &Arc<Runtime>,
        version: Arc<PluginVersion>,
        options: &ToolOptions,
    ) -> Result<Self, PluginError> {
        Session::start_tool(rt, version, options).map(Self)
    }

    pub fn feed(&mut self, delta: &str) -> Result<Vec<ParseEvent>, PluginError> {
        self.0.call(delta, false)
    }

    pub fn finish(&mut self) -> Result<Vec<ParseEvent>, PluginError> {
        self.0.call("", true)
    }

    pub fn version(&self) -> (u64, &str) {
        self.0.info()
    }
}

/// One-shot parse in a fresh instance; the result converted with the version's `conv`.
macro_rules! parse_once {
    ($rt:expr, $version:expr, $pre:expr, $api:ident, $opts:expr, $text:expr, $conv:ident) => {{
        let mut store = $rt.store($version.label.clone());
        let opts = $opts;
        Runtime::timed(&$version, || {
            let inst = $rt.call(&mut store, |s| $pre.instantiate(s))?;
            let r = $rt.call(&mut store, |s| inst.$api().call_parse(s, &opts, $text))?;
            guest(
                $version,
                r.map(conv::$conv::result).map_err(conv::$conv::guest_error),
            )
        })
    }};
}

/// One-shot reasoning parse in a fresh instance.
pub(crate) fn parse_reasoning(
    rt: &Runtime,
    version: &PluginVersion,
    options: &ReasoningOptions,
    text: &str,
) -> Result<ParseResult, PluginError> {
    match &version.pre {
        StagePre::Reasoning(pre) => {
            let o = reasoning_options!(rp, options);
            parse_once!(
                rt,
                version,
                pre,
                k3serve_plugin_reasoning_parser,
                o,
                text,
                v0_1
            )
        }
        StagePre::ReasoningV0_2(pre) => {
            let o = reasoning_options!(rp2, options);
            parse_once!(
                rt,
                version,
                pre,
                k3serve_plugin_reasoning_parser,
                o,
                text,
                v0_2
            )
        }
        StagePre::ReasoningV0_3(pre) => {
            let o = reasoning_options!(rp3, options);
            parse_once!(
                rt,
                version,
                pre,
                k3serve_plugin_reasoning_parser,
                o,
                text,
                v0_3
            )
        }
        _ => Err(PluginError::NoActivePlugin(Stage::ReasoningParser)),
    }
}

/// One-shot tool parse in a fresh instance.
pub(crate) fn parse_tools(
    rt: &Runtime,
    version: &PluginVersion,
    options: &ToolOptions,
    text: &str,
) -> Result<ParseResult, PluginError> {
    match &version.pre {
        StagePre::Tool(pre) => {
            let o = tool_options!(tp, options);
            parse_once!(rt, version, pre, k3serve_plugin_tool_parser, o, text, v0_1)
        }
        StagePre::ToolV0_2(pre) => {
            let o = tool_options!(tp2, options);
            parse_once!(rt, version, pre, k3serve_plugin_tool_parser, o, text, v0_2)
        }
        StagePre::ToolV0_3(pre) => {
            let o = tool_options!(tp3, options);
            let pre = &pre.tool;
            parse_once!(rt, version, pre, k3serve_plugin_tool_parser, o, text, v0_3)
        }
        _ => Err(PluginError::NoActivePlugin(Stage::ToolParser)),
    }
}
