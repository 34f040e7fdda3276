//! A request body's prompt for a router (docs/routing.md): the same validation and conversion as
//! the route's handler, so the router renders and tokenizes exactly what the replica will. A body
//! the handler would refuse has no prompt here (`None`); the router still forwards it and the
//! replica answers with the protocol's error.

use k3_frontend::{ChatGenRequest, PromptInput};
use serde_json::Value;

use crate::anthropic::request::MessagesRequest;
use crate::openai::chat_request::ChatCompletionRequest;
use crate::openai::completions::{CompletionRequest, parse_prompts};
use crate::openai::responses::request::ResponsesRequest;
use crate::unknown_fields::UnknownFields;

/// The routes a router places by prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptRoute {
    ChatCompletions,
    Completions,
    Messages,
    Responses,
}

/// What a route's prompt is made from.
#[derive(Debug, Clone, PartialEq)]
pub enum RoutingPrompt {
    /// Rendered by the chat template.
    Chat(Box<ChatGenRequest>),
    /// A raw completion prompt.
    Completion(PromptInput),
}

/// The prompt of `body` on `route`, or `None` when the handler would refuse the body or it
/// holds several prompts (a batch of completions goes wherever the policy sends it).
pub fn routing_prompt(route: PromptRoute, body: &Value) -> Option<RoutingPrompt> {
    let mut unknown = UnknownFields::lenient();
    let id = String::from("route");
    let chat = match route {
        PromptRoute::ChatCompletions => {
            let req: ChatCompletionRequest = serde_json::from_value(body.clone()).ok()?;
            req.validate(id, &mut unknown).ok()?.request
        }
        PromptRoute::Messages => {
            let req: MessagesRequest = serde_json::from_value(body.clone()).ok()?;
            req.validate(id, &mut unknown).ok()?.request
        }
        PromptRoute::Responses => {
            let req: ResponsesRequest = serde_json::from_value(body.clone()).ok()?;
            req.validate(id, &mut unknown).ok()?.request
        }
        PromptRoute::Completions => {
            let req: CompletionRequest = serde_json::from_value(body.clone()).ok()?;
            let mut prompts = parse_prompts(&req.prompt).ok()?;
            return (prompts.len() == 1).then(|| RoutingPrompt::Completion(prompts.remove(0)));
        }
    };
    Some(RoutingPrompt::Chat(Box::new(chat)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_route_yields_the_handlers_prompt() {
        let chat = routing_prompt(
            PromptRoute::ChatCompletions,
            &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        );
        let Some(RoutingPrompt::Chat(c)) = chat else {
            panic!("{chat:?}")
        };
        assert_eq!(c.messages[0]["content"], "hi");
        let msgs = routing_prompt(
            PromptRoute::Messages,
            &json!({"model": "m", "max_tokens": 5, "system": "be brief",
                    "messages": [{"role": "user", "content": "hi"}]}),
        );
        assert!(matches!(msgs, Some(RoutingPrompt::Chat(_))), "{msgs:?}");
        let resp = routing_prompt(
            PromptRoute::Responses,
            &json!({"model": "m", "input": "hi"}),
        );
        assert!(matches!(resp, Some(RoutingPrompt::Chat(_))), "{resp:?}");
        assert_eq!(
            routing_prompt(
                PromptRoute::Completions,
                &json!({"model": "m", "prompt": [1, 2, 3]})
            ),
            Some(RoutingPrompt::Completion(PromptInput::Tokens(vec![
                1, 2, 3
            ])))
        );
    }

    #[test]
    fn bodies_the_handler_refuses_have_no_prompt() {
        for (route, body) in [
            (PromptRoute::ChatCompletions, json!({"model": "m"})),
            (PromptRoute::ChatCompletions, json!({"messages": "nope"})),
            (
                PromptRoute::Messages,
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            ),
            (
                PromptRoute::Completions,
                json!({"model": "m", "prompt": ["a", "b"]}),
            ),
            (
                PromptRoute::Responses,
                json!({"model": "m", "input": "hi", "previous_response_id": "x"}),
            ),
        ] {
            assert_eq!(routing_prompt(route, &body), None, "{route:?} {body}");
        }
    }
}
