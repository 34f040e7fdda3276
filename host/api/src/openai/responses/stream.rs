//! Streaming `/v1/responses`: the generation's events as Responses SSE events, each
//! `event: <type>` + `data: {...,"sequence_number":n}`.
//!
//! `response.created`, `response.in_progress`; per output item `response.output_item.added`,
//! then for reasoning and text a `response.content_part.added`, `response.reasoning_text.delta`
//! / `response.output_text.delta` events, `*.done` and `response.content_part.done`; for a call
//! `response.function_call_arguments.delta` / `.done`; then `response.output_item.done`. The last
//! event is `response.completed` (or `response.incomplete` when `max_output_tokens` cut the
//! output) carrying the whole response; a failure is an `error` event instead.

use bytes::Bytes;
use serde_json::{Value, json};

use crate::backend::{FinishInfo, GenEvent, TokenLogprob};
use crate::error::ApiError;
use crate::generation::StreamFormat;
use crate::openai::chat_logprobs;
use crate::{random_id, sse};

use super::response::{ItemStatus, OutputItem, ResponseMeta, cut_short};

/// An output item of the stream with where it stands.
#[derive(Debug)]
struct StreamItem {
    item: OutputItem,
    /// The generation's call index, for a function call.
    call_index: Option<u32>,
    /// `None` while open; then how it ended.
    ended: Option<ItemStatus>,
}

pub struct ResponsesStream {
    meta: ResponseMeta,
    sequence: u64,
    items: Vec<StreamItem>,
    /// The reasoning or message item text currently goes to.
    open_text: Option<usize>,
    pending_logprobs: Vec<TokenLogprob>,
}

impl ResponsesStream {
    pub fn new(meta: ResponseMeta) -> Self {
        ResponsesStream {
            meta,
            sequence: 0,
            items: Vec::new(),
            open_text: None,
            pending_logprobs: Vec::new(),
        }
    }

    fn emit(&mut self, out: &mut Vec<Bytes>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.push(sse::event(kind, &data));
    }

    /// The response object with every item so far (open ones as in progress).
    fn snapshot(&self, finish: Option<&FinishInfo>) -> Value {
        let items: Vec<(OutputItem, ItemStatus)> = self
            .items
            .iter()
            .map(|s| (s.item.clone(), s.ended.unwrap_or(ItemStatus::InProgress)))
            .collect();
        self.meta.object(&items, finish)
    }

    fn open(&mut self, out: &mut Vec<Bytes>, item: OutputItem, call_index: Option<u32>) -> usize {
        let index = self.items.len();
        let json = item.to_json(ItemStatus::InProgress, self.meta.logprobs);
        self.items.push(StreamItem {
            item,
            call_index,
            ended: None,
        });
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": json}),
        );
        if let Some(part) = self.items[index].item.content_part(self.meta.logprobs) {
            let id = self.items[index].item.id().to_string();
            self.emit(
                out,
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
        }
        index
    }

    fn close(&mut self, out: &mut Vec<Bytes>, index: usize, status: ItemStatus) {
        if self.items[index].ended.is_some() {
            return;
        }
        self.items[index].ended = Some(status);
        let item = self.items[index].item.clone();
        let id = item.id().to_string();
        match &item {
            OutputItem::Reasoning { text, .. } => self.emit(
                out,
                "response.reasoning_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            ),
            OutputItem::Message { text, logprobs, .. } => {
                let logprobs = if self.meta.logprobs {
                    chat_logprobs(logprobs)
                } else {
                    json!([])
                };
                self.emit(
                    out,
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "text": text, "logprobs": logprobs}),
                );
            }
            OutputItem::FunctionCall {
                name, arguments, ..
            } => self.emit(
                out,
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "name": name,
                       "arguments": arguments}),
            ),
        }
        if let Some(part) = item.content_part(self.meta.logprobs) {
            self.emit(
                out,
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
        }
        let json = item.to_json(status, self.meta.logprobs);
        self.emit(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": json}),
        );
    }

    fn close_text(&mut self, out: &mut Vec<Bytes>) {
        if let Some(index) = self.open_text.take() {
            self.close(out, index, ItemStatus::Completed);
        }
    }

    /// The open text item of the kind `reasoning` says, opening one (and closing the other
    /// kind) when needed.
    fn text_item(&mut self, out: &mut Vec<Bytes>, reasoning: bool) -> usize {
        if let Some(index) = self.open_text {
            let is_reasoning = matches!(self.items[index].item, OutputItem::Reasoning { .. });
            if is_reasoning == reasoning {
                return index;
            }
            self.close_text(out);
        }
        let item = if reasoning {
            OutputItem::Reasoning {
                id: random_id("rs_"),
                text: String::new(),
            }
        } else {
            OutputItem::Message {
                id: random_id("msg_"),
                text: String::new(),
                logprobs: Vec::new(),
            }
        };
        let index = self.open(out, item, None);
        self.open_text = Some(index);
        index
    }

    fn call_item(&self, call_index: u32) -> Option<usize> {
        self.items
            .iter()
            .position(|s| s.call_index == Some(call_index))
    }

    fn finish(&mut self, out: &mut Vec<Bytes>, info: FinishInfo) {
        let cut = cut_short(&info);
        let status = if cut {
            ItemStatus::Incomplete
        } else {
            ItemStatus::Completed
        };
        if let Some(index) = self.open_text.take() {
            self.close(out, index, status);
        }
        // A call the generation never ended (it should not happen) ends with the response.
        for index in 0..self.items.len() {
            self.close(out, index, status);
        }
        // A call cut short stays in the response, `incomplete`, as in the non-streaming answer
        // (docs/k3-format.md §5).
        let response = self.snapshot(Some(&info));
        let kind = if cut {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(out, kind, json!({"response": response}));
    }
}

impl StreamFormat for ResponsesStream {
    fn start(&mut self) -> Vec<Bytes> {
        let mut out = Vec::new();
        let response = self.snapshot(None);
        self.emit(&mut out, "response.created", json!({"response": response}));
        self.emit(
            &mut out,
            "response.in_progress",
            json!({"response": response}),
        );
        out
    }

    fn event(&mut self, _choice: usize, event: GenEvent) -> Vec<Bytes> {
        let mut out = Vec::new();
        match event {
            GenEvent::Reasoning(delta) => {
                let index = self.text_item(&mut out, true);
                if let OutputItem::Reasoning { id, text } = &mut self.items[index].item {
                    text.push_str(&delta);
                    let id = id.clone();
                    self.emit(
                        &mut out,
                        "response.reasoning_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "delta": delta}),
                    );
                }
            }
            GenEvent::Content(delta) => {
                let index = self.text_item(&mut out, false);
                let pending = std::mem::take(&mut self.pending_logprobs);
                let logprobs = if self.meta.logprobs {
                    chat_logprobs(&pending)
                } else {
                    json!([])
                };
                if let OutputItem::Message {
                    id,
                    text,
                    logprobs: all,
                } = &mut self.items[index].item
                {
                    text.push_str(&delta);
                    all.extend(pending);
                    let id = id.clone();
                    self.emit(
                        &mut out,
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "delta": delta, "logprobs": logprobs}),
                    );
                }
            }
            GenEvent::ToolCallStart { index, id, name } => {
                self.close_text(&mut out);
                let item = OutputItem::FunctionCall {
                    id: random_id("fc_"),
                    call_id: id,
                    name,
                    arguments: String::new(),
                };
                self.open(&mut out, item, Some(index));
            }
            GenEvent::ToolCallArguments { index, delta } => {
                if let Some(at) = self.call_item(index)
                    && let OutputItem::FunctionCall { id, arguments, .. } = &mut self.items[at].item
                {
                    arguments.push_str(&delta);
                    let id = id.clone();
                    self.emit(
                        &mut out,
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": at, "delta": delta}),
                    );
                }
            }
            GenEvent::ToolCallEnd { index, complete } => {
                if let Some(at) = self.call_item(index) {
                    let status = if complete {
                        ItemStatus::Completed
                    } else {
                        ItemStatus::Incomplete
                    };
                    self.close(&mut out, at, status);
                }
            }
            GenEvent::Logprobs(lp) => {
                if self.meta.logprobs {
                    self.pending_logprobs.extend(lp);
                }
            }
            GenEvent::Finished(info) => self.finish(&mut out, info),
            // `stream_response` reports errors through `error()`.
            GenEvent::Error(_) => {}
        }
        out
    }

    fn end(&mut self) -> Vec<Bytes> {
        Vec::new()
    }

    fn error(&mut self, error: ApiError) -> Vec<Bytes> {
        let mut out = Vec::new();
        self.emit(
            &mut out,
            "error",
            json!({"code": error.code.unwrap_or(error.kind.type_str()), "message": error.message,
                   "param": error.param}),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::FinishReason;
    use serde_json::Map;

    fn stream() -> ResponsesStream {
        ResponsesStream::new(ResponseMeta {
            id: "resp_1".into(),
            created_at: 1,
            model: "k3-mini".into(),
            echo: Map::new(),
            logprobs: false,
        })
    }

    /// (event name, data) of each SSE chunk.
    fn parse(chunks: Vec<Bytes>) -> Vec<(String, Value)> {
        chunks
            .iter()
            .map(|c| {
                let text = std::str::from_utf8(c).unwrap();
                let (event, data) = text.trim_end().split_once('\n').unwrap();
                let name = event.strip_prefix("event: ").unwrap().to_string();
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(data["type"], name.as_str());
                (name, data)
            })
            .collect()
    }

    fn run(events: Vec<GenEvent>) -> Vec<(String, Value)> {
        let mut s = stream();
        let mut chunks = s.start();
        for e in events {
            chunks.extend(s.event(0, e));
        }
        chunks.extend(s.end());
        parse(chunks)
    }

    fn finished(reason: FinishReason) -> GenEvent {
        GenEvent::Finished(FinishInfo {
            reason,
            prompt_tokens: 3,
            completion_tokens: 4,
            cached_tokens: 0,
            timing: None,
        })
    }

    #[test]
    fn reasoning_then_text_streams_the_full_lifecycle() {
        let events = run(vec![
            GenEvent::Reasoning("Hm".into()),
            GenEvent::Reasoning("m.".into()),
            GenEvent::Content("Hi".into()),
            GenEvent::Content("!".into()),
            finished(FinishReason::Stop),
        ]);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (_, data)) in events.iter().enumerate() {
            assert_eq!(data["sequence_number"], i as u64);
        }
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        assert_eq!(events[6].1["text"], "Hmm.");
        assert_eq!(events[13].1["text"], "Hi!");
        assert_eq!(events[13].1["output_index"], 1);
        let done = &events[16].1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["id"], events[2].1["item"]["id"]);
        assert_eq!(done["output"][0]["content"][0]["text"], "Hmm.");
        assert_eq!(done["output"][1]["id"], events[9].1["item"]["id"]);
        assert_eq!(done["output"][1]["content"][0]["text"], "Hi!");
        assert_eq!(done["usage"]["output_tokens"], 4);
    }

    #[test]
    fn calls_stream_their_arguments_and_a_cut_call_is_dropped() {
        let events = run(vec![
            GenEvent::ToolCallStart {
                index: 0,
                id: "call_0".into(),
                name: "f".into(),
            },
            GenEvent::ToolCallArguments {
                index: 0,
                delta: "{\"a\":".into(),
            },
            GenEvent::ToolCallArguments {
                index: 0,
                delta: "1}".into(),
            },
            GenEvent::ToolCallEnd {
                index: 0,
                complete: true,
            },
            GenEvent::ToolCallStart {
                index: 1,
                id: "call_1".into(),
                name: "f".into(),
            },
            GenEvent::ToolCallArguments {
                index: 1,
                delta: "{\"a\":".into(),
            },
            GenEvent::ToolCallEnd {
                index: 1,
                complete: false,
            },
            finished(FinishReason::Length),
        ]);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        assert_eq!(events[2].1["item"]["call_id"], "call_0");
        assert_eq!(events[2].1["item"]["arguments"], "");
        assert_eq!(events[5].1["arguments"], "{\"a\":1}");
        assert_eq!(events[6].1["item"]["status"], "completed");
        assert_eq!(events[10].1["item"]["status"], "incomplete");
        let done = &events[11].1["response"];
        assert_eq!(done["status"], "incomplete");
        assert_eq!(done["incomplete_details"]["reason"], "max_output_tokens");
        let output = done["output"].as_array().unwrap();
        assert_eq!(output.len(), 2, "the cut call stays, incomplete");
        assert_eq!(output[0]["arguments"], "{\"a\":1}");
        assert_eq!(output[1]["status"], "incomplete");
    }

    #[test]
    fn an_error_is_an_error_event() {
        let mut s = stream();
        let mut chunks = s.start();
        chunks.extend(s.event(0, GenEvent::Content("x".into())));
        chunks.extend(s.error(ApiError::new(
            crate::error::ErrorKind::Plugin,
            "the tool parser trapped",
        )));
        let events = parse(chunks);
        let (name, data) = events.last().unwrap();
        assert_eq!(name, "error");
        assert_eq!(data["message"], "the tool parser trapped");
        assert_eq!(data["code"], "plugin_error");
        assert_eq!(data["sequence_number"], events.len() as u64 - 1);
    }
}
