//! TEST ONLY. Passes its own self-test, but its one-shot `parse` disagrees with its streaming
//! result; the host's load-time smoke test must refuse it.

use k3_plugin_sdk::{
    Event, Info, ParseResult, Plugin, PluginError, ReasoningOptions, ReasoningParser,
    StreamingParser,
};

pub struct Inconsistent;

impl Plugin for Inconsistent {
    const INFO: Info = Info::new(
        "testdata-inconsistent",
        "0.0.1",
        "test plugin: stream and one-shot disagree",
    );
}

impl StreamingParser for Inconsistent {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        Ok(vec![Event::Content(delta.to_string())])
    }
    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        Ok(Vec::new())
    }
    fn parse_all(self, text: &str) -> Result<ParseResult, PluginError> {
        Ok(ParseResult {
            content: None,
            reasoning: Some(text.to_string()),
            tool_calls: Vec::new(),
        })
    }
}

impl ReasoningParser for Inconsistent {
    fn new(_: ReasoningOptions) -> Self {
        Inconsistent
    }
}

k3_plugin_sdk::export_reasoning_parser!(Inconsistent);
