//! The Kimi K3 tool-call parser plugin: a thin export of `kimi_k3_format::K3ToolParser`, with
//! the grammar of its format (`kimi_k3_format::grammar`) as the `output-grammar` export.

use k3_plugin_sdk::{
    Event, GrammarRequest, Info, OutputGrammar, Plugin, PluginError, StreamingParser, ToolGrammar,
    ToolOptions, ToolParser,
};
use kimi_k3_format::K3ToolParser;

pub struct KimiK3Tools(K3ToolParser);

impl Plugin for KimiK3Tools {
    const INFO: Info = Info::new(
        "kimi-k3-tools",
        env!("CARGO_PKG_VERSION"),
        "Kimi K3 tools channel: streaming tool calls (name first, then argument deltas)",
    );

    fn self_test() -> Result<(), String> {
        let text = "hi<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>\
<|open|>argument key=\"n\" type=\"number\"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>";
        let r = KimiK3Tools::new(ToolOptions::default())
            .parse_all(text)
            .map_err(|e| e.to_string())?;
        match (r.content.as_deref(), r.tool_calls.as_slice()) {
            (Some("hi"), [c]) if c.name == "f" && c.arguments == "{\"n\":1}" => Ok(()),
            _ => Err(format!("self-test parse gave {r:?}")),
        }
    }
}

impl StreamingParser for KimiK3Tools {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        self.0.feed(delta)
    }
    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        self.0.finish()
    }
}

impl ToolParser for KimiK3Tools {
    fn new(options: ToolOptions) -> Self {
        Self(K3ToolParser::new(&options))
    }
}

impl ToolGrammar for KimiK3Tools {
    fn grammar(request: GrammarRequest) -> Result<Option<OutputGrammar>, PluginError> {
        kimi_k3_format::grammar::output_grammar(&request)
    }
}

k3_plugin_sdk::export_tool_parser_with_grammar!(KimiK3Tools);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_test_passes() {
        KimiK3Tools::self_test().unwrap();
    }
}
