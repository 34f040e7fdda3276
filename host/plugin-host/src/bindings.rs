//! wasmtime bindings for every served WIT version (`k3serve:plugin@0.1.0`, `@0.2.0`, `@0.3.0`), one
//! module per version and world; each version has its variants in `StagePre` (served side by
//! side). In each version the tool world's module owns the shared `types` and `log`
//! interfaces; the others reuse them. `conv` turns each version's types into the host's.

#![allow(clippy::all)]

pub mod v0_1 {
    pub mod tool {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.1",
            world: "tool-parser-plugin",
        });
    }

    pub mod reasoning {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.1",
            world: "reasoning-parser-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod template {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.1",
            world: "chat-template-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod media {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.1",
            world: "media-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod router {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.1",
            world: "router-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub use tool::k3serve::plugin::types;
}

pub mod v0_2 {
    pub mod tool {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.2",
            world: "tool-parser-plugin",
        });
    }

    pub mod reasoning {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.2",
            world: "reasoning-parser-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod template {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.2",
            world: "chat-template-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod media {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.2",
            world: "media-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod router {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.2",
            world: "router-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub use tool::k3serve::plugin::types;
}

pub mod v0_3 {
    pub mod tool {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.3",
            world: "tool-parser-plugin",
        });
    }

    pub mod reasoning {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.3",
            world: "reasoning-parser-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod template {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.3",
            world: "chat-template-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod media {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.3",
            world: "media-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub mod router {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.3",
            world: "router-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    /// 0.3's optional tool-parser addition: only its `output-grammar` export is used (looked
    /// up beside the `tool` world's exports of the same component).
    pub mod tool_grammar {
        wasmtime::component::bindgen!({
            path: "../../wit/v0.3",
            world: "tool-parser-grammar-plugin",
            with: {
                "k3serve:plugin/types": super::tool::k3serve::plugin::types,
                "k3serve:plugin/log": super::tool::k3serve::plugin::log,
            },
        });
    }

    pub use tool::k3serve::plugin::types;
}

/// Conversions from one version's `types` to the host's types.
macro_rules! conversions {
    ($version:ident) => {
        pub mod $version {
            #![allow(dead_code)]
            use super::super::$version::types as wit;
            use crate::types::{
                GuestError, ParseEvent, ParseResult, PluginMetadata, Stage, ToolCall,
            };

            pub fn event(e: wit::ParseEvent) -> ParseEvent {
                match e {
                    wit::ParseEvent::Content(text) => ParseEvent::Content { text },
                    wit::ParseEvent::Reasoning(text) => ParseEvent::Reasoning { text },
                    wit::ParseEvent::ToolCallStart(s) => ParseEvent::ToolCallStart {
                        index: s.index,
                        id: s.id,
                        name: s.name,
                    },
                    wit::ParseEvent::ToolCallArguments(a) => ParseEvent::ToolCallArguments {
                        index: a.index,
                        delta: a.delta,
                    },
                    wit::ParseEvent::ToolCallEnd(e) => ParseEvent::ToolCallEnd {
                        index: e.index,
                        complete: e.complete,
                    },
                }
            }

            pub fn result(r: wit::ParseResult) -> ParseResult {
                ParseResult {
                    content: r.content,
                    reasoning: r.reasoning,
                    tool_calls: r
                        .tool_calls
                        .into_iter()
                        .map(|c| ToolCall {
                            index: c.index,
                            id: c.id,
                            name: c.name,
                            arguments: c.arguments,
                        })
                        .collect(),
                }
            }

            pub fn guest_error(e: wit::PluginError) -> GuestError {
                match e {
                    wit::PluginError::InvalidInput(m) => GuestError::InvalidInput(m),
                    wit::PluginError::Unsupported(m) => GuestError::Unsupported(m),
                    wit::PluginError::Internal(m) => GuestError::Internal(m),
                }
            }

            pub fn stage(s: wit::Stage) -> Stage {
                match s {
                    wit::Stage::ChatTemplate => Stage::ChatTemplate,
                    wit::Stage::ReasoningParser => Stage::ReasoningParser,
                    wit::Stage::ToolParser => Stage::ToolParser,
                    wit::Stage::Media => Stage::Media,
                    wit::Stage::Router => Stage::Router,
                }
            }

            pub fn metadata(m: wit::PluginMetadata) -> PluginMetadata {
                PluginMetadata {
                    name: m.name,
                    version: m.version,
                    stage: stage(m.stage),
                    wit_version: m.wit_version,
                    description: m.description,
                }
            }
        }
    };
}

/// One module per served version, same functions in each.
pub mod conv {
    conversions!(v0_1);
    conversions!(v0_2);
    conversions!(v0_3);
}
