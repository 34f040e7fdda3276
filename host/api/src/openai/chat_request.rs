//! `POST /v1/chat/completions` request body and its validation into a [`ChatGenRequest`].

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::backend::{ChatGenRequest, ToolChoice};
use crate::error::ApiError;
use crate::openai::StreamOptions;
use crate::openai::messages::normalize_messages;
use crate::structured::{self, ConstraintFields};
use crate::unknown_fields::UnknownFields;
use crate::validate::{self, MAX_TOP_LOGPROBS, SamplingFields};

/// The accepted fields: OpenAI's, plus the vLLM/SGLang extras this server implements. Others go
/// to [`UnknownFields`]: ignored with a warning, or a 400 naming them in strict mode.
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    pub reasoning_effort: Option<String>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub logit_bias: Option<Map<String, Value>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    pub metadata: Option<Value>,
    pub store: Option<bool>,
    pub service_tier: Option<String>,
    pub skip_special_tokens: Option<bool>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    /// vLLM's choice of grammar engine: accepted and ignored (llguidance is the one engine).
    pub guided_decoding_backend: Option<String>,
}

/// A validated chat request with the HTTP-level options beside it.
#[derive(Debug, Clone)]
pub struct ValidChat {
    pub request: ChatGenRequest,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub parallel_tool_calls: bool,
}

/// Map `reasoning_effort` to the template's (thinking, thinking_effort).
pub fn reasoning_effort(effort: &str) -> Result<(bool, Option<&'static str>), ApiError> {
    Ok(match effort {
        "none" => (false, None),
        "minimal" | "low" => (true, Some("low")),
        "medium" => (true, Some("medium")),
        "high" => (true, Some("high")),
        "xhigh" | "max" => (true, Some("max")),
        other => {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!(
                    "'reasoning_effort' must be one of none, minimal, low, medium, high, xhigh, max (got \"{other}\")"
                ),
            ));
        }
    })
}

pub fn validate_response_format(rf: &Value) -> Result<Option<Value>, ApiError> {
    let Value::Object(obj) = rf else {
        return Err(ApiError::invalid(
            "response_format",
            "'response_format' must be an object",
        ));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(rf.clone())),
        Some("json_schema") => {
            let Some(Value::Object(js)) = obj.get("json_schema") else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "'response_format.json_schema' is required for type json_schema and must be an object",
                ));
            };
            if !matches!(js.get("name"), Some(Value::String(_))) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "'response_format.json_schema.name' is required and must be a string",
                ));
            }
            if let Some(schema) = js.get("schema")
                && !schema.is_object()
            {
                return Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "'response_format.json_schema.schema' must be a JSON Schema object",
                ));
            }
            Ok(Some(rf.clone()))
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "'response_format.type' must be text, json_object or json_schema (got \"{other}\")"
            ),
        )),
        None => Err(ApiError::invalid(
            "response_format.type",
            "'response_format.type' is required",
        )),
    }
}

/// Resolve `tool_choice` against the declared tools.
fn tool_choice(choice: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let default = if tools.is_empty() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    };
    match choice {
        None | Some(Value::Null) => Ok(default),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(default),
            // As in vLLM: "required" with no tools means no tool can be called.
            "required" if tools.is_empty() => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "'tool_choice' must be \"none\", \"auto\", \"required\" or a named function (got \"{other}\")"
                ),
            )),
        },
        Some(Value::Object(obj)) => {
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            let Some(name) = name else {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    "a named 'tool_choice' needs {\"type\":\"function\",\"function\":{\"name\":...}}",
                ));
            };
            let declared = tools
                .iter()
                .any(|t| t["function"]["name"].as_str() == Some(name));
            if !declared {
                return Err(ApiError::invalid(
                    "tool_choice.function.name",
                    format!(
                        "'tool_choice.function.name' is \"{name}\", which is not among the declared tools"
                    ),
                ));
            }
            Ok(ToolChoice::Function(name.to_string()))
        }
        Some(_) => Err(ApiError::invalid(
            "tool_choice",
            "'tool_choice' must be a string or an object",
        )),
    }
}

impl ChatCompletionRequest {
    pub fn validate(
        self,
        request_id: String,
        unknown: &mut UnknownFields,
    ) -> Result<ValidChat, ApiError> {
        let messages = normalize_messages(&self.messages, unknown)?;
        let tools = validate::validate_tools(self.tools.as_deref().unwrap_or(&[]), unknown)?;
        let choice = tool_choice(self.tool_choice.as_ref(), &tools)?;
        let n = validate::validate_n(self.n)?;
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' is only allowed when 'stream' is true",
            ));
        }
        let logprobs = self.logprobs.unwrap_or(false);
        let top = match self.top_logprobs {
            None => 0,
            Some(_) if !logprobs => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' needs 'logprobs' set to true",
                ));
            }
            Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => k as u32,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                ));
            }
        };
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(ApiError::not_supported(
                "logit_bias",
                "'logit_bias' is not supported yet",
            ));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => Some((m, "max_completion_tokens")),
            (None, Some(m)) => Some((m, "max_tokens")),
            (None, None) => None,
        };
        let sampling = validate::validate_sampling(&SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop: self.stop,
            stop_param: "stop",
            stop_token_ids: self.stop_token_ids,
            max_tokens,
            min_tokens: self.min_tokens,
            ignore_eos: self.ignore_eos,
            logprobs: logprobs.then_some(top),
        })?;

        let (mut thinking, effort) = match &self.reasoning_effort {
            Some(e) => reasoning_effort(e)?,
            None => (true, None),
        };
        let mut kwargs = Map::new();
        if let Some(effort) = effort {
            kwargs.insert("thinking_effort".into(), Value::String(effort.into()));
        }
        kwargs.insert(
            "tool_choice".into(),
            serde_json::to_value(&choice).unwrap_or(Value::Null),
        );
        if let Some(rf) = &self.response_format
            && let Some(rf) = validate_response_format(rf)?
        {
            kwargs.insert("response_format".into(), rf);
        }
        let constraint = structured::constraint(&ConstraintFields {
            response_format: self.response_format.as_ref(),
            structured_outputs: self.structured_outputs.as_ref(),
            guided_json: self.guided_json.as_ref(),
            guided_regex: self.guided_regex.as_ref(),
            guided_choice: self.guided_choice.as_ref(),
            guided_grammar: self.guided_grammar.as_ref(),
        })?;
        let (constraint, constraint_param) = match constraint {
            Some((c, p)) => (Some(c), p),
            None => (None, String::new()),
        };
        if let Some(extra) = self.chat_template_kwargs {
            for key in ["thinking", "enable_thinking"] {
                match extra.get(key) {
                    None | Some(Value::Null) => {}
                    Some(Value::Bool(b)) => thinking = *b,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            format!("chat_template_kwargs.{key}"),
                            format!("'chat_template_kwargs.{key}' must be a boolean"),
                        ));
                    }
                }
            }
            kwargs.extend(extra);
        }
        kwargs.insert("thinking".into(), Value::Bool(thinking));
        kwargs.remove("enable_thinking");
        Ok(ValidChat {
            request: ChatGenRequest {
                request_id,
                messages,
                tools,
                tool_choice: choice,
                thinking,
                template_kwargs: kwargs,
                sampling,
                constraint,
                constraint_param,
            },
            n,
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            logprobs,
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::parse_json;
    use crate::error::ErrorStyle;

    fn validate(body: &str) -> Result<ValidChat, ApiError> {
        let mut unknown = UnknownFields::strict();
        parse_json::<ChatCompletionRequest>(body.as_bytes(), ErrorStyle::OpenAi, &mut unknown)?
            .validate("r".into(), &mut unknown)
    }

    #[test]
    fn options_reach_the_template_kwargs() {
        let v = validate(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"reasoning_effort":"high",
                "response_format":{"type":"json_object"},"chat_template_kwargs":{"x":1},
                "max_tokens":5,"max_completion_tokens":7,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        let k = &v.request.template_kwargs;
        assert_eq!(k["thinking"], Value::Bool(true));
        assert_eq!(k["thinking_effort"], "high");
        assert_eq!(k["response_format"]["type"], "json_object");
        assert_eq!(k["x"], 1);
        assert_eq!(k["tool_choice"], "none");
        assert_eq!(v.request.sampling.max_tokens, Some(7));
        assert!(v.include_usage);

        let v = validate(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"reasoning_effort":"none"}"#,
        )
        .unwrap();
        assert!(!v.request.thinking);
        assert_eq!(v.request.template_kwargs["thinking"], Value::Bool(false));
        let v = validate(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false}}"#,
        )
        .unwrap();
        assert!(!v.request.thinking);
    }

    #[test]
    fn bad_options_are_named() {
        let cases = [
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"reasoning_effort":"huge"}"#,
                "reasoning_effort",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
                "top_logprobs",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{}}"#,
                "stream_options",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}"#,
                "n",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_token":3}"#,
                "max_token",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
                "temperature",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"yaml"}}"#,
                "response_format.type",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}}"#,
                "tool_choice.function.name",
            ),
        ];
        for (body, param) in cases {
            let e = validate(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert_eq!(e.status(), 400);
        }
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}]"#;
        let v = validate(&format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{tools},"tool_choice":"required"}}"#
        ))
        .unwrap();
        assert_eq!(v.request.tool_choice, ToolChoice::Required);
        let v = validate(&format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{tools},"tool_choice":{{"type":"function","function":{{"name":"f"}}}},"guided_regex":"a+","guided_decoding_backend":"xgrammar"}}"#
        ))
        .unwrap();
        assert_eq!(v.request.tool_choice, ToolChoice::Function("f".into()));
        assert_eq!(
            v.request.constraint,
            Some(crate::backend::OutputConstraint::Regex("a+".into()))
        );
        assert_eq!(v.request.constraint_param, "guided_regex");
    }
}
