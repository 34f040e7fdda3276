//! A reasoning parser for models that wrap their reasoning in `<think>…</think>` (DeepSeek-R1,
//! Qwen3 style). Text inside the tags is reasoning, the rest content. With
//! `prompt_opens_reasoning` the output starts inside reasoning (the prompt ended in `<think>`).

use k3_plugin_sdk::text::{MarkerSplitter, Split};
use k3_plugin_sdk::{
    Event, Info, Plugin, PluginError, ReasoningOptions, ReasoningParser, StreamingParser,
};

const OPEN: usize = 0;

pub struct ThinkTags {
    thinking: bool,
    in_reasoning: bool,
    splitter: MarkerSplitter,
}

impl ThinkTags {
    fn handle(&mut self, pieces: Vec<Split>) -> Vec<Event> {
        let mut out: Vec<Event> = Vec::new();
        for piece in pieces {
            match piece {
                Split::Marker(m) => self.in_reasoning = self.thinking && m == OPEN,
                Split::Text(t) if self.in_reasoning => match out.last_mut() {
                    Some(Event::Reasoning(r)) => r.push_str(&t),
                    _ => out.push(Event::Reasoning(t)),
                },
                Split::Text(t) => match out.last_mut() {
                    Some(Event::Content(c)) => c.push_str(&t),
                    _ => out.push(Event::Content(t)),
                },
            }
        }
        out
    }
}

impl StreamingParser for ThinkTags {
    fn feed(&mut self, delta: &str) -> Result<Vec<Event>, PluginError> {
        let mut pieces = Vec::new();
        self.splitter.push(delta, &mut pieces);
        Ok(self.handle(pieces))
    }

    fn finish(&mut self) -> Result<Vec<Event>, PluginError> {
        let mut pieces = Vec::new();
        self.splitter.finish(&mut pieces);
        Ok(self.handle(pieces))
    }
}

impl ReasoningParser for ThinkTags {
    fn new(options: ReasoningOptions) -> Self {
        Self {
            thinking: options.thinking,
            in_reasoning: options.thinking && options.prompt_opens_reasoning,
            splitter: MarkerSplitter::new(["<think>", "</think>"]),
        }
    }
}

impl Plugin for ThinkTags {
    const INFO: Info = Info::new(
        "think-tags-reasoning",
        env!("CARGO_PKG_VERSION"),
        "<think>…</think> reasoning parser",
    );

    fn self_test() -> Result<(), String> {
        let opts = ReasoningOptions {
            thinking: true,
            prompt_opens_reasoning: false,
            extra_json: None,
        };
        let r = ThinkTags::new(opts)
            .parse_all("<think>hmm</think>Hello")
            .map_err(|e| e.to_string())?;
        if r.reasoning.as_deref() == Some("hmm") && r.content.as_deref() == Some("Hello") {
            Ok(())
        } else {
            Err(format!("unexpected parse: {r:?}"))
        }
    }
}

k3_plugin_sdk::export_reasoning_parser!(ThinkTags);

#[cfg(test)]
mod tests {
    use super::*;
    use k3_plugin_sdk::testing::assert_chunking_invariant;

    #[test]
    fn self_test_passes() {
        ThinkTags::self_test().unwrap();
    }

    #[test]
    fn splits_any_chunking_the_same() {
        let opts = ReasoningOptions {
            thinking: true,
            prompt_opens_reasoning: true,
            extra_json: None,
        };
        let r =
            assert_chunking_invariant(|| ThinkTags::new(opts.clone()), "plan </think>answer <thi");
        assert_eq!(r.reasoning.as_deref(), Some("plan "));
        assert_eq!(r.content.as_deref(), Some("answer <thi"));
    }

    #[test]
    fn thinking_off_is_all_content() {
        let opts = ReasoningOptions {
            thinking: false,
            prompt_opens_reasoning: false,
            extra_json: None,
        };
        let r = ThinkTags::new(opts).parse_all("<think>x</think>y").unwrap();
        assert_eq!((r.reasoning, r.content.as_deref()), (None, Some("xy")));
    }
}
