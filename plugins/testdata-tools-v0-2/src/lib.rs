//! TEST ONLY. The K3 tool parser exported directly against `k3serve:plugin@0.2.0` (no SDK
//! export: the SDK targets 0.3). The host must keep loading and running it, and report that it
//! has no output grammar (that export is new in 0.3).

#[cfg(target_arch = "wasm32")]
mod component {
    wit_bindgen::generate!({
        path: "../../wit/v0.2",
        world: "tool-parser-plugin",
    });

    use std::cell::RefCell;

    use exports::k3serve::plugin::tool_parser::{Guest as ToolGuest, GuestToolStream, ToolOptions};
    use k3_plugin_sdk::{Event, StreamingParser};
    use k3serve::plugin::types::{
        ParseEvent, ParseResult, PluginError, Stage, ToolCall, ToolCallArguments, ToolCallEnd,
        ToolCallStart,
    };
    use kimi_k3_format::K3ToolParser;

    struct V02;
    struct Stream(RefCell<K3ToolParser>);

    fn parser(o: ToolOptions) -> K3ToolParser {
        K3ToolParser::new(&k3_plugin_sdk::ToolOptions {
            tools_json: o.tools_json,
            id_prefix: o.id_prefix,
            extra_json: o.extra_json,
        })
    }

    fn error(e: k3_plugin_sdk::PluginError) -> PluginError {
        PluginError::Internal(e.to_string())
    }

    fn events(
        r: Result<Vec<Event>, k3_plugin_sdk::PluginError>,
    ) -> Result<Vec<ParseEvent>, PluginError> {
        let events = r.map_err(error)?;
        Ok(events
            .into_iter()
            .map(|e| match e {
                Event::Content(t) => ParseEvent::Content(t),
                Event::Reasoning(t) => ParseEvent::Reasoning(t),
                Event::ToolCallStart { index, id, name } => {
                    ParseEvent::ToolCallStart(ToolCallStart { index, id, name })
                }
                Event::ToolCallArguments { index, delta } => {
                    ParseEvent::ToolCallArguments(ToolCallArguments { index, delta })
                }
                Event::ToolCallEnd { index, complete } => {
                    ParseEvent::ToolCallEnd(ToolCallEnd { index, complete })
                }
            })
            .collect())
    }

    impl GuestToolStream for Stream {
        fn new(options: ToolOptions) -> Self {
            Self(RefCell::new(parser(options)))
        }
        fn feed(&self, delta: String) -> Result<Vec<ParseEvent>, PluginError> {
            events(self.0.borrow_mut().feed(&delta))
        }
        fn finish(&self) -> Result<Vec<ParseEvent>, PluginError> {
            events(self.0.borrow_mut().finish())
        }
    }

    impl ToolGuest for V02 {
        type ToolStream = Stream;
        fn parse(options: ToolOptions, text: String) -> Result<ParseResult, PluginError> {
            let r = parser(options).parse_all(&text).map_err(error)?;
            Ok(ParseResult {
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
            })
        }
    }

    impl Guest for V02 {
        fn metadata() -> PluginMetadata {
            PluginMetadata {
                name: "testdata-tools-v0-2".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                stage: Stage::ToolParser,
                wit_version: "0.2.0".into(),
                description: "the K3 tool parser against WIT 0.2".into(),
            }
        }
        fn self_test() -> Result<(), String> {
            Ok(())
        }
    }

    export!(V02);
}
