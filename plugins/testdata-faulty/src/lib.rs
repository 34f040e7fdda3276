//! TEST ONLY. A tool parser that passes text through as content, except that a delta containing
//! `@@trap@@` panics (a trap), `@@loop@@` spins forever (a timeout) and `@@bomb@@` allocates
//! until the memory cap (a memory overrun). The host must contain each to the call that hit it.

use k3_plugin_sdk::{Event, Info, Plugin, PluginError, StreamingParser, ToolOptions, ToolParser};

pub struct Faulty;

impl Plugin for Faulty {
    const INFO: Info = Info::new(
        "testdata-faulty",
        "0.0.1",
        "test plugin that misbehaves on command",
    );
}

impl StreamingParser for Faulty {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        if delta.contains("@@trap@@") {
            panic!("deliberate trap requested by the test");
        }
        if delta.contains("@@loop@@") {
            let mut n: u64 = 0;
            loop {
                n = std::hint::black_box(n.wrapping_add(1));
            }
        }
        if delta.contains("@@bomb@@") {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(vec![1u8; 1 << 20]);
                std::hint::black_box(&hoard);
            }
        }
        if delta.contains("@@error@@") {
            return Err(PluginError::InvalidInput("deliberate plugin error".into()));
        }
        Ok(if delta.is_empty() {
            vec![]
        } else {
            vec![Event::Content(delta.to_string())]
        })
    }

    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        Ok(Vec::new())
    }
}

impl ToolParser for Faulty {
    fn new(_: ToolOptions) -> Self {
        Faulty
    }
}

k3_plugin_sdk::export_tool_parser!(Faulty);
