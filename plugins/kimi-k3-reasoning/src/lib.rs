//! The Kimi K3 reasoning parser plugin: a thin export of `kimi_k3_format::K3ReasoningParser`.

use k3_plugin_sdk::{
    Event, Info, Plugin, PluginError, ReasoningOptions, ReasoningParser, StreamingParser,
};
use kimi_k3_format::K3ReasoningParser;

pub struct KimiK3Reasoning(K3ReasoningParser);

impl Plugin for KimiK3Reasoning {
    const INFO: Info = Info::new(
        "kimi-k3-reasoning",
        env!("CARGO_PKG_VERSION"),
        "Kimi K3 think/response channels: reasoning vs content",
    );

    fn self_test() -> Result<(), String> {
        let text = "r<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|>";
        let r = KimiK3Reasoning::new(ReasoningOptions::default())
            .parse_all(text)
            .map_err(|e| e.to_string())?;
        if r.reasoning.as_deref() == Some("r") && r.content.as_deref() == Some("c") {
            Ok(())
        } else {
            Err(format!("self-test parse gave {r:?}"))
        }
    }
}

impl StreamingParser for KimiK3Reasoning {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        self.0.feed(delta)
    }
    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        self.0.finish()
    }
}

impl ReasoningParser for KimiK3Reasoning {
    fn new(options: ReasoningOptions) -> Self {
        Self(K3ReasoningParser::new(&options))
    }
}

k3_plugin_sdk::export_reasoning_parser!(KimiK3Reasoning);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_test_passes() {
        KimiK3Reasoning::self_test().unwrap();
    }
}
