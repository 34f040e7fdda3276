//! Streaming parser sessions: one store + one instance + one guest resource per stream, pinned
//! to the version that was active when the stream started.

use std::sync::Arc;

use wasmtime::Store;
use wasmtime::component::ResourceAny;

use crate::bindings::v0_1::reasoning::ReasoningParserPlugin;
use crate::bindings::v0_1::reasoning::exports::k3serve::plugin::reasoning_parser as rp;
use crate::bindings::v0_1::tool::ToolParserPlugin;
use crate::bindings::v0_1::tool::exports::k3serve::plugin::tool_parser as tp;
use crate::bindings::{self as conv, v0_1::types as wit};
use crate::error::PluginError;
use crate::registry::{PluginVersion, StagePre};
use crate::runtime::{Runtime, StoreState};
use crate::types::{ParseEvent, ParseResult, ReasoningOptions, Stage, ToolOptions};

enum Instance {
    Reasoning(ReasoningParserPlugin),
    Tool(ToolParserPlugin),
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

fn wit_reasoning_options(o: &ReasoningOptions) -> rp::ReasoningOptions {
    rp::ReasoningOptions {
        thinking: o.thinking,
        prompt_opens_reasoning: o.prompt_opens_reasoning,
        extra_json: o.extra_json.clone(),
    }
}

fn wit_tool_options(o: &ToolOptions) -> tp::ToolOptions {
    tp::ToolOptions {
        tools_json: o.tools_json.clone(),
        id_prefix: o.id_prefix.clone(),
        extra_json: o.extra_json.clone(),
    }
}

type GuestResult<T> = Result<T, wit::PluginError>;

fn guest<T>(version: &PluginVersion, r: GuestResult<T>) -> Result<T, PluginError> {
    r.map_err(|e| PluginError::Guest {
        plugin: version.label.to_string(),
        error: conv::guest_error(e),
    })
}

impl Session {
    fn start_reasoning(
        rt: &Arc<Runtime>,
        version: Arc<PluginVersion>,
        options: &ReasoningOptions,
    ) -> Result<Self, PluginError> {
        let StagePre::Reasoning(pre) = &version.pre else {
            return Err(PluginError::NoActivePlugin(Stage::ReasoningParser));
        };
        let mut store = rt.store(version.label.clone());
        version.counters.session();
        let (instance, handle) = Runtime::timed(&version.counters, || {
            let inst = rt.call(&mut store, |s| pre.instantiate(s))?;
            let opts = wit_reasoning_options(options);
            let handle = rt.call(&mut store, |s| {
                inst.k3serve_plugin_reasoning_parser()
                    .reasoning_stream()
                    .call_constructor(s, &opts)
            })?;
            Ok((inst, handle))
        })?;
        Ok(Self {
            rt: rt.clone(),
            version,
            store,
            instance: Instance::Reasoning(instance),
            handle,
            closed: false,
        })
    }

    fn start_tool(
        rt: &Arc<Runtime>,
        version: Arc<PluginVersion>,
        options: &ToolOptions,
    ) -> Result<Self, PluginError> {
        let StagePre::Tool(pre) = &version.pre else {
            return Err(PluginError::NoActivePlugin(Stage::ToolParser));
        };
        let mut store = rt.store(version.label.clone());
        version.counters.session();
        let (instance, handle) = Runtime::timed(&version.counters, || {
            let inst = rt.call(&mut store, |s| pre.instantiate(s))?;
            let opts = wit_tool_options(options);
            let handle = rt.call(&mut store, |s| {
                inst.k3serve_plugin_tool_parser()
                    .tool_stream()
                    .call_constructor(s, &opts)
            })?;
            Ok((inst, handle))
        })?;
        Ok(Self {
            rt: rt.clone(),
            version,
            store,
            instance: Instance::Tool(instance),
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
        let r = Runtime::timed(&version.counters, || {
            let events = match instance {
                Instance::Reasoning(inst) => {
                    let api = inst.k3serve_plugin_reasoning_parser().reasoning_stream();
                    if finish {
                        rt.call(store, |s| api.call_finish(s, handle))?
                    } else {
                        rt.call(store, |s| api.call_feed(s, handle, delta))?
                    }
                }
                Instance::Tool(inst) => {
                    let api = inst.k3serve_plugin_tool_parser().tool_stream();
                    if finish {
                        rt.call(store, |s| api.call_finish(s, handle))?
                    } else {
                        rt.call(store, |s| api.call_feed(s, handle, delta))?
                    }
                }
            };
            guest(version, events)
        });
        // A fault poisons the store: this stream is over (the next call says so clearly).
        if finish || matches!(&r, Err(e) if e.is_fault()) {
            self.closed = true;
        }
        Ok(r?.into_iter().map(conv::event).collect())
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

/// One-shot reasoning parse in a fresh instance.
pub(crate) fn parse_reasoning(
    rt: &Runtime,
    version: &PluginVersion,
    options: &ReasoningOptions,
    text: &str,
) -> Result<ParseResult, PluginError> {
    let StagePre::Reasoning(pre) = &version.pre else {
        return Err(PluginError::NoActivePlugin(Stage::ReasoningParser));
    };
    let mut store = rt.store(version.label.clone());
    let opts = wit_reasoning_options(options);
    Runtime::timed(&version.counters, || {
        let inst = rt.call(&mut store, |s| pre.instantiate(s))?;
        let r = rt.call(&mut store, |s| {
            inst.k3serve_plugin_reasoning_parser()
                .call_parse(s, &opts, text)
        })?;
        guest(version, r).map(conv::result)
    })
}

/// One-shot tool parse in a fresh instance.
pub(crate) fn parse_tools(
    rt: &Runtime,
    version: &PluginVersion,
    options: &ToolOptions,
    text: &str,
) -> Result<ParseResult, PluginError> {
    let StagePre::Tool(pre) = &version.pre else {
        return Err(PluginError::NoActivePlugin(Stage::ToolParser));
    };
    let mut store = rt.store(version.label.clone());
    let opts = wit_tool_options(options);
    Runtime::timed(&version.counters, || {
        let inst = rt.call(&mut store, |s| pre.instantiate(s))?;
        let r = rt.call(&mut store, |s| {
            inst.k3serve_plugin_tool_parser().call_parse(s, &opts, text)
        })?;
        guest(version, r).map(conv::result)
    })
}
