//! `POST /v1/responses` request body and its conversion into a chat-completions request.
//!
//! The Responses fields are rewritten into the chat request they mean (`input` → `messages`,
//! flat function tools → nested ones, `text.format` → `response_format`, `reasoning.effort` →
//! `reasoning_effort`, `max_output_tokens` → `max_completion_tokens`), which then goes through
//! the chat route's own validation, so both routes build their [`ChatGenRequest`] the same way.
//! Errors that validation finds name the chat field; [`FieldNames`] renames them back.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::backend::ChatGenRequest;
use crate::error::ApiError;
use crate::openai::chat_request::ChatCompletionRequest;
use crate::unknown_fields::UnknownFields;

use super::input::{ChatMessages, to_chat_messages};

/// The accepted fields. Others are handled as on the chat route.
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: String,
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<i64>,
    pub max_tool_calls: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_logprobs: Option<i64>,
    pub include: Option<Vec<String>>,
    pub reasoning: Option<Value>,
    pub text: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<Value>,
    pub store: Option<bool>,
    pub metadata: Option<Map<String, Value>>,
    pub user: Option<String>,
    pub previous_response_id: Option<String>,
    pub conversation: Option<Value>,
    pub background: Option<bool>,
    pub prompt: Option<Value>,
    pub truncation: Option<String>,
    pub service_tier: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub prompt_cache_retention: Option<String>,
    pub safety_identifier: Option<String>,
}

/// A validated request: the chat request to run, and what the response object echoes.
#[derive(Debug, Clone)]
pub struct ValidResponses {
    pub request: ChatGenRequest,
    pub stream: bool,
    pub parallel_tool_calls: bool,
    pub logprobs: bool,
    /// Request settings every response object repeats (`tools`, `tool_choice`, `text`, ...).
    pub echo: Map<String, Value>,
    pub names: FieldNames,
}

/// Where each chat message came from, to rename chat field paths in errors.
#[derive(Debug, Clone, Default)]
pub struct FieldNames {
    message_origins: Vec<String>,
}

impl FieldNames {
    /// The Responses field a chat field path (`messages[2].content`, `tools[0].function.name`,
    /// `response_format.json_schema.schema`) came from.
    pub fn rename(&self, param: &str) -> String {
        if let Some(rest) = param.strip_prefix("messages[")
            && let Some((index, tail)) = rest.split_once(']')
            && let Ok(i) = index.parse::<usize>()
            && let Some(origin) = self.message_origins.get(i)
        {
            return format!("{origin}{tail}");
        }
        if let Some(rest) = param.strip_prefix("tools[")
            && let Some((index, tail)) = rest.split_once(']')
        {
            let tail = tail.strip_prefix(".function").map_or(tail, |t| {
                if t.is_empty() || t.starts_with('.') {
                    t
                } else {
                    tail
                }
            });
            return format!("tools[{index}]{tail}");
        }
        for (chat, responses) in [
            ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"),
            ("tool_choice.function", "tool_choice"),
            ("max_completion_tokens", "max_output_tokens"),
            ("max_tokens", "max_output_tokens"),
            ("reasoning_effort", "reasoning.effort"),
            ("messages", "input"),
        ] {
            if let Some(tail) = param.strip_prefix(chat)
                && (tail.is_empty() || tail.starts_with('.') || tail.starts_with('['))
            {
                return format!("{responses}{tail}");
            }
        }
        param.to_string()
    }

    /// The same error, naming Responses fields in its `param` and message.
    pub fn rename_error(&self, mut error: ApiError) -> ApiError {
        if let Some(param) = error.param.take() {
            let renamed = self.rename(&param);
            error.message = error.message.replace(&param, &renamed);
            error.param = Some(renamed);
        }
        error
    }
}

fn not_stored(param: &str) -> ApiError {
    ApiError::not_supported(
        param,
        format!(
            "this server does not store responses or conversations, so '{param}' cannot be used; send the whole conversation in 'input' (stateless)"
        ),
    )
}

/// Responses' flat function tool → the chat form (`{"type":"function","function":{...}}`).
fn chat_tool(tool: &Value, i: usize, unknown: &mut UnknownFields) -> Result<Value, ApiError> {
    let p = format!("tools[{i}]");
    let Value::Object(obj) = tool else {
        return Err(ApiError::invalid(&p, format!("'{p}' must be an object")));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ApiError::not_supported(
                format!("{p}.type"),
                format!(
                    "tools of type \"{other}\" are not supported; this server runs function tools only"
                ),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                format!("{p}.type"),
                format!("'{p}.type' is required and must be \"function\""),
            ));
        }
    }
    if obj.contains_key("function") {
        return Err(ApiError::invalid(
            format!("{p}.function"),
            format!(
                "'{p}' has the chat completions shape; a Responses function tool is flat: {{\"type\":\"function\",\"name\",\"description\",\"parameters\",\"strict\"}}"
            ),
        ));
    }
    let mut function = Map::new();
    for (key, value) in obj {
        match key.as_str() {
            "type" => {}
            "name" | "description" | "parameters" | "strict" => {
                function.insert(key.clone(), value.clone());
            }
            _ => {
                unknown.found(format!("{p}.{key}"))?;
            }
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// Responses' `tool_choice` → the chat form.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) | Value::Null => Ok(choice.clone()),
        Value::Object(obj) => match obj.get("type").and_then(Value::as_str) {
            Some("function") => match obj.get("name") {
                Some(Value::String(name)) => {
                    Ok(json!({"type": "function", "function": {"name": name}}))
                }
                _ => Err(ApiError::invalid(
                    "tool_choice.name",
                    "a named 'tool_choice' needs {\"type\":\"function\",\"name\":...}",
                )),
            },
            Some(other) => Err(ApiError::not_supported(
                "tool_choice.type",
                format!(
                    "tool_choice of type \"{other}\" is not supported; use \"auto\", \"none\", \"required\" or {{\"type\":\"function\",\"name\":...}}"
                ),
            )),
            None => Err(ApiError::invalid(
                "tool_choice.type",
                "'tool_choice.type' is required",
            )),
        },
        _ => Err(ApiError::invalid(
            "tool_choice",
            "'tool_choice' must be a string or an object",
        )),
    }
}

/// `text.format` → the chat `response_format` it means (`None` for plain text).
fn chat_response_format(
    text: &Value,
    unknown: &mut UnknownFields,
) -> Result<Option<Value>, ApiError> {
    let Value::Object(text) = text else {
        return Err(ApiError::invalid("text", "'text' must be an object"));
    };
    for key in text.keys() {
        // `verbosity` is a hint this server has no lever for.
        if key != "format" && key != "verbosity" {
            unknown.found(format!("text.{key}"))?;
        }
    }
    let format = match text.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(f)) => f,
        Some(_) => {
            return Err(ApiError::invalid(
                "text.format",
                "'text.format' must be an object",
            ));
        }
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for (key, value) in format {
                match key.as_str() {
                    "type" => {}
                    "name" | "schema" | "strict" | "description" => {
                        schema.insert(key.clone(), value.clone());
                    }
                    _ => {
                        unknown.found(format!("text.format.{key}"))?;
                    }
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        Some(other) => Err(ApiError::invalid(
            "text.format.type",
            format!(
                "'text.format.type' must be text, json_object or json_schema (got \"{other}\")"
            ),
        )),
        None => Err(ApiError::invalid(
            "text.format.type",
            "'text.format.type' is required",
        )),
    }
}

/// `reasoning.effort` (`None` when absent or null).
fn reasoning_effort(
    reasoning: &Value,
    unknown: &mut UnknownFields,
) -> Result<Option<String>, ApiError> {
    let Value::Object(obj) = reasoning else {
        return Err(ApiError::invalid(
            "reasoning",
            "'reasoning' must be an object",
        ));
    };
    for key in obj.keys() {
        // Summaries are not generated: the reasoning item carries the full reasoning text.
        if !matches!(key.as_str(), "effort" | "summary" | "generate_summary") {
            unknown.found(format!("reasoning.{key}"))?;
        }
    }
    match obj.get("effort") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(e)) => Ok(Some(e.clone())),
        Some(_) => Err(ApiError::invalid(
            "reasoning.effort",
            "'reasoning.effort' must be a string",
        )),
    }
}

/// The chat-completions body this request means (every value is already the right JSON type).
#[derive(Serialize)]
struct ChatBody<'a> {
    model: &'a str,
    messages: &'a [Value],
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<Vec<Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs: Option<i64>,
}

impl ResponsesRequest {
    pub fn validate(
        self,
        request_id: String,
        unknown: &mut UnknownFields,
    ) -> Result<ValidResponses, ApiError> {
        if self.previous_response_id.is_some() {
            return Err(not_stored("previous_response_id"));
        }
        if self.conversation.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(not_stored("conversation"));
        }
        if self.background == Some(true) {
            return Err(ApiError::not_supported(
                "background",
                "background responses are not supported (nothing is stored to poll)",
            ));
        }
        if self.prompt.as_ref().is_some_and(|p| !p.is_null()) {
            return Err(ApiError::not_supported(
                "prompt",
                "stored prompt templates are not supported; send 'instructions' and 'input'",
            ));
        }
        if self.max_tool_calls.is_some() {
            return Err(ApiError::not_supported(
                "max_tool_calls",
                "'max_tool_calls' is not supported; 'parallel_tool_calls': false allows one call",
            ));
        }
        match self.truncation.as_deref() {
            None | Some("disabled") => {}
            Some("auto") => {
                return Err(ApiError::not_supported(
                    "truncation",
                    "truncation \"auto\" is not supported: a prompt longer than the context is a 400",
                ));
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "truncation",
                    format!("'truncation' must be \"auto\" or \"disabled\" (got \"{other}\")"),
                ));
            }
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' is only allowed when 'stream' is true",
            ));
        }
        let Some(input) = &self.input else {
            return Err(
                ApiError::invalid("input", "'input' is required").with_code("missing_field")
            );
        };
        let ChatMessages { messages, origins } =
            to_chat_messages(self.instructions.as_deref(), input, unknown)?;
        let names = FieldNames {
            message_origins: origins,
        };
        let tools = match &self.tools {
            None => None,
            Some(tools) => Some(
                tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| chat_tool(t, i, unknown))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let tool_choice = self
            .tool_choice
            .as_ref()
            .map(chat_tool_choice)
            .transpose()?;
        let response_format = match &self.text {
            Some(text) => chat_response_format(text, unknown)?,
            None => None,
        };
        let effort = match &self.reasoning {
            None | Some(Value::Null) => None,
            Some(r) => reasoning_effort(r, unknown)?,
        };
        let logprobs = self
            .include
            .iter()
            .flatten()
            .any(|i| i == "message.output_text.logprobs")
            || self.top_logprobs.is_some_and(|k| k > 0);
        let body = ChatBody {
            model: &self.model,
            messages: &messages,
            tools,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls,
            response_format,
            reasoning_effort: effort.clone(),
            temperature: self.temperature,
            top_p: self.top_p,
            max_completion_tokens: self.max_output_tokens,
            logprobs: logprobs.then_some(true),
            top_logprobs: self.top_logprobs.filter(|_| logprobs),
        };
        let chat: ChatCompletionRequest = serde_json::to_value(&body)
            .and_then(serde_json::from_value)
            .map_err(|e| {
                ApiError::new(
                    crate::error::ErrorKind::Internal,
                    format!("could not build the chat request: {e}"),
                )
            })?;
        let valid = chat
            .validate(request_id, unknown)
            .map_err(|e| names.rename_error(e))?;

        let mut echo = Map::new();
        echo.insert("instructions".into(), json!(self.instructions));
        echo.insert("max_output_tokens".into(), json!(self.max_output_tokens));
        echo.insert(
            "parallel_tool_calls".into(),
            json!(valid.parallel_tool_calls),
        );
        echo.insert("previous_response_id".into(), Value::Null);
        echo.insert(
            "reasoning".into(),
            json!({"effort": effort, "summary": null}),
        );
        echo.insert("store".into(), json!(false));
        echo.insert("temperature".into(), json!(self.temperature));
        echo.insert("top_p".into(), json!(self.top_p));
        echo.insert(
            "text".into(),
            self.text
                .as_ref()
                .and_then(|t| t.get("format"))
                .filter(|f| !f.is_null())
                .map_or_else(
                    || json!({"format": {"type": "text"}}),
                    |f| json!({"format": f}),
                ),
        );
        echo.insert(
            "tool_choice".into(),
            self.tool_choice.unwrap_or_else(|| json!("auto")),
        );
        echo.insert("tools".into(), Value::Array(self.tools.unwrap_or_default()));
        echo.insert("top_logprobs".into(), json!(self.top_logprobs));
        echo.insert("truncation".into(), json!("disabled"));
        echo.insert(
            "metadata".into(),
            Value::Object(self.metadata.unwrap_or_default()),
        );
        echo.insert("user".into(), json!(self.user));
        Ok(ValidResponses {
            request: valid.request,
            stream,
            parallel_tool_calls: valid.parallel_tool_calls,
            logprobs: valid.logprobs,
            echo,
            names,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ToolChoice;
    use crate::body::parse_json;
    use crate::error::ErrorStyle;

    fn validate(body: Value) -> Result<ValidResponses, ApiError> {
        let mut unknown = UnknownFields::strict();
        parse_json::<ResponsesRequest>(
            body.to_string().as_bytes(),
            ErrorStyle::OpenAi,
            &mut unknown,
        )?
        .validate("resp_1".into(), &mut unknown)
    }

    fn weather_tool() -> Value {
        json!({"type": "function", "name": "get_weather", "description": "d", "strict": true,
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}})
    }

    #[test]
    fn fields_map_onto_the_chat_request() {
        let v = validate(json!({
            "model": "m", "instructions": "be brief", "input": "hi",
            "tools": [weather_tool()], "tool_choice": "auto", "parallel_tool_calls": false,
            "max_output_tokens": 50, "temperature": 0.5, "top_p": 0.9,
            "reasoning": {"effort": "high", "summary": "auto"},
            "text": {"format": {"type": "json_schema", "name": "w", "strict": true,
                                "schema": {"type": "object"}}, "verbosity": "low"},
            "store": true, "metadata": {"k": "v"}, "user": "u", "stream": true,
            "include": ["reasoning.encrypted_content"], "truncation": "disabled",
        }))
        .unwrap();
        let r = &v.request;
        assert_eq!(r.request_id, "resp_1");
        assert_eq!(
            r.messages[0],
            json!({"role": "system", "content": "be brief"})
        );
        assert_eq!(r.messages[1], json!({"role": "user", "content": "hi"}));
        assert_eq!(r.tools[0]["function"]["name"], "get_weather");
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        assert_eq!(r.sampling.max_tokens, Some(50));
        assert_eq!(r.sampling.temperature, Some(0.5));
        assert!(r.thinking);
        assert_eq!(r.template_kwargs["thinking_effort"], "high");
        assert_eq!(
            r.template_kwargs["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "w", "strict": true, "schema": {"type": "object"}}})
        );
        assert!(v.stream && !v.parallel_tool_calls && !v.logprobs);
        assert_eq!(v.echo["tools"][0]["name"], "get_weather");
        assert_eq!(v.echo["store"], false);
        assert_eq!(v.echo["text"]["format"]["type"], "json_schema");

        let v = validate(
            json!({"model": "m", "input": "hi", "reasoning": {"effort": "none"},
                                "text": {"format": {"type": "json_object"}},
                                "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
        )
        .unwrap();
        assert!(!v.request.thinking);
        assert_eq!(
            v.request.template_kwargs["response_format"],
            json!({"type": "json_object"})
        );
        assert!(v.logprobs);
        assert_eq!(v.request.sampling.logprobs, Some(2));
    }

    #[test]
    fn tool_choice_maps_to_the_chat_form() {
        assert_eq!(
            chat_tool_choice(&json!("required")).unwrap(),
            json!("required")
        );
        assert_eq!(
            chat_tool_choice(&json!({"type": "function", "name": "f"})).unwrap(),
            json!({"type": "function", "function": {"name": "f"}})
        );
        let v = validate(
            json!({"model": "m", "input": "x", "tools": [weather_tool()],
                                "tool_choice": "none"}),
        )
        .unwrap();
        assert_eq!(v.request.tool_choice, ToolChoice::None);
    }

    #[test]
    fn unstored_state_is_a_clear_400() {
        for (field, value) in [
            ("previous_response_id", json!("resp_x")),
            ("conversation", json!("conv_x")),
        ] {
            let mut body = json!({"model": "m", "input": "x"});
            body[field] = value;
            let e = validate(body).unwrap_err();
            assert_eq!(e.status(), 400);
            assert_eq!(e.param.as_deref(), Some(field));
            assert_eq!(e.code, Some("not_supported"));
            assert!(e.message.contains("does not store"), "{}", e.message);
        }
    }

    #[test]
    fn errors_name_the_responses_field() {
        let cases = [
            (json!({"model": "m"}), "input"),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
                "tools[0].type",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}),
                "tools[0].function",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "bad name"}]}),
                "tools[0].name",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}]}),
                "tools[0].parameters.properties.a.type",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [weather_tool()],
                       "tool_choice": {"type": "function", "name": "nope"}}),
                "tool_choice.name",
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": {"type": "file_search"}}),
                "tool_choice.type",
            ),
            (
                json!({"model": "m", "input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (
                json!({"model": "m", "input": "x", "temperature": 9}),
                "temperature",
            ),
            (
                json!({"model": "m", "input": "x", "reasoning": {"effort": "huge"}}),
                "reasoning.effort",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}),
                "text.format.name",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}),
                "text.format.type",
            ),
            (
                json!({"model": "m", "input": "x", "truncation": "auto"}),
                "truncation",
            ),
            (
                json!({"model": "m", "input": "x", "background": true}),
                "background",
            ),
            (
                json!({"model": "m", "input": "x", "max_toks": 3}),
                "max_toks",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": 5}]}),
                "input[0].content",
            ),
        ];
        for (body, param) in cases {
            let e = validate(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert_eq!(e.status(), 400, "{body}");
            assert!(!e.message.contains("response_format"), "{}", e.message);
        }
    }

    #[test]
    fn chat_paths_rename_to_responses_paths() {
        let names = FieldNames {
            message_origins: vec!["instructions".into(), "input[0]".into(), "input[3]".into()],
        };
        assert_eq!(names.rename("messages[2].content"), "input[3].content");
        assert_eq!(names.rename("messages[0]"), "instructions");
        assert_eq!(names.rename("messages"), "input");
        assert_eq!(
            names.rename("tools[1].function.parameters"),
            "tools[1].parameters"
        );
        assert_eq!(names.rename("tools[1].function"), "tools[1]");
        assert_eq!(names.rename("tools[1].type"), "tools[1].type");
        assert_eq!(
            names.rename("response_format.json_schema.schema"),
            "text.format.schema"
        );
        assert_eq!(names.rename("response_format.type"), "text.format.type");
        assert_eq!(
            names.rename("tool_choice.function.name"),
            "tool_choice.name"
        );
        assert_eq!(names.rename("max_tokens"), "max_output_tokens");
        assert_eq!(names.rename("temperature"), "temperature");
    }
}
