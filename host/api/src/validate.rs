//! Validation shared by the protocols: sampling ranges, stop strings, tools and OpenAI-shaped
//! messages. Every failure is a 400 naming the parameter.

use serde_json::{Map, Value};

use crate::backend::SamplingOptions;
use crate::error::ApiError;
use crate::unknown_fields::UnknownFields;

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most choices one request may ask for.
pub const MAX_N: i64 = 16;
/// Most top logprobs per token.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Raw sampling fields as a protocol received them (already type-checked by serde).
#[derive(Debug, Default, Clone)]
pub struct SamplingFields {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    /// The name the protocol uses for the stop field (`stop` / `stop_sequences`).
    pub stop_param: &'static str,
    pub stop_token_ids: Option<Vec<u32>>,
    /// The max-tokens value and the name it came under.
    pub max_tokens: Option<(i64, &'static str)>,
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub logprobs: Option<u32>,
}

pub fn check_range(name: &str, value: f64, lo: f64, hi: f64) -> Result<(), ApiError> {
    if !value.is_finite() || value < lo || value > hi {
        return Err(ApiError::invalid(
            name,
            format!("'{name}' must be between {lo} and {hi}, got {value}"),
        ));
    }
    Ok(())
}

pub fn validate_sampling(f: &SamplingFields) -> Result<SamplingOptions, ApiError> {
    let mut out = SamplingOptions::default();
    if let Some(t) = f.temperature {
        check_range("temperature", t, 0.0, 2.0)?;
        out.temperature = Some(t as f32);
    }
    if let Some(p) = f.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("'top_p' must be in (0, 1], got {p}"),
            ));
        }
        out.top_p = Some(p as f32);
    }
    if let Some(k) = f.top_k {
        // -1 and 0 both mean "disabled", as in vLLM.
        if k < -1 {
            return Err(ApiError::invalid(
                "top_k",
                format!("'top_k' must be -1 (disabled), 0 (disabled) or positive, got {k}"),
            ));
        }
        out.top_k = (k > 0).then(|| k.min(u32::MAX as i64) as u32);
    }
    if let Some(p) = f.min_p {
        check_range("min_p", p, 0.0, 1.0)?;
        out.min_p = Some(p as f32);
    }
    if let Some(p) = f.presence_penalty {
        check_range("presence_penalty", p, -2.0, 2.0)?;
        out.presence_penalty = p as f32;
    }
    if let Some(p) = f.frequency_penalty {
        check_range("frequency_penalty", p, -2.0, 2.0)?;
        out.frequency_penalty = p as f32;
    }
    if let Some(p) = f.repetition_penalty {
        if !(p.is_finite() && p > 0.0 && p <= 10.0) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("'repetition_penalty' must be in (0, 10], got {p}"),
            ));
        }
        out.repetition_penalty = Some(p as f32);
    }
    // Any integer seed is accepted; negative ones wrap, so each still picks a distinct stream.
    out.seed = f.seed.map(|s| s as u64);
    out.stop = validate_stop(f.stop.as_ref(), f.stop_param)?;
    out.stop_token_ids = f.stop_token_ids.clone().unwrap_or_default();
    if let Some((m, name)) = f.max_tokens {
        if m < 1 {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' must be at least 1, got {m}"),
            ));
        }
        out.max_tokens = Some(m.min(u32::MAX as i64) as u32);
    }
    if let Some(m) = f.min_tokens {
        if m < 0 {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("'min_tokens' must be non-negative, got {m}"),
            ));
        }
        if let Some(max) = out.max_tokens
            && m as u64 > max as u64
        {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("'min_tokens' ({m}) must not exceed the maximum number of tokens ({max})"),
            ));
        }
        out.min_tokens = m.min(u32::MAX as i64) as u32;
    }
    out.ignore_eos = f.ignore_eos.unwrap_or(false);
    out.logprobs = f.logprobs;
    Ok(out)
}

fn validate_stop(stop: Option<&Value>, name: &str) -> Result<Vec<String>, ApiError> {
    let list = match stop {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![(s.clone(), name.to_string())],
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let Value::String(s) = item else {
                    return Err(ApiError::invalid(
                        format!("{name}[{i}]"),
                        format!("'{name}[{i}]' must be a string"),
                    ));
                };
                out.push((s.clone(), format!("{name}[{i}]")));
            }
            out
        }
        Some(_) => {
            return Err(ApiError::invalid(
                name,
                format!("'{name}' must be a string or an array of strings"),
            ));
        }
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            name,
            format!(
                "'{name}' may hold at most {MAX_STOP_STRINGS} strings, got {}",
                list.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (s, param) in list {
        if s.is_empty() {
            return Err(ApiError::invalid(
                &param,
                format!("'{param}' must not be an empty string"),
            ));
        }
        out.push(s);
    }
    Ok(out)
}

pub fn validate_n(n: Option<i64>) -> Result<usize, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_N).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("'n' must be between 1 and {MAX_N}, got {n}"),
        )),
    }
}

/// A tool or function name: what OpenAI accepts (`^[a-zA-Z0-9_-]{1,64}$`) plus `.` and `:`,
/// which namespaced tool catalogues use.
pub fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

/// Check a JSON schema is at least well-formed enough to describe arguments.
pub fn validate_parameters_schema(schema: &Value, param: &str) -> Result<(), ApiError> {
    let Value::Object(obj) = schema else {
        return Err(ApiError::invalid(
            param,
            format!("'{param}' must be a JSON Schema object"),
        ));
    };
    if let Some(t) = obj.get("type") {
        let ok = match t {
            Value::String(s) => s == "object",
            _ => false,
        };
        if !ok {
            return Err(ApiError::invalid(
                format!("{param}.type"),
                format!("'{param}.type' must be \"object\" (tool arguments are a JSON object)"),
            ));
        }
    }
    if let Some(props) = obj.get("properties") {
        let Value::Object(props) = props else {
            return Err(ApiError::invalid(
                format!("{param}.properties"),
                format!("'{param}.properties' must be an object mapping names to schemas"),
            ));
        };
        for (key, sub) in props {
            validate_subschema(sub, &format!("{param}.properties.{key}"))?;
        }
    }
    if let Some(required) = obj.get("required") {
        let Value::Array(items) = required else {
            return Err(ApiError::invalid(
                format!("{param}.required"),
                format!("'{param}.required' must be an array of property names"),
            ));
        };
        for (i, item) in items.iter().enumerate() {
            let Value::String(name) = item else {
                return Err(ApiError::invalid(
                    format!("{param}.required[{i}]"),
                    format!("'{param}.required[{i}]' must be a string"),
                ));
            };
            let declared = obj
                .get("properties")
                .and_then(Value::as_object)
                .is_some_and(|p| p.contains_key(name));
            if !declared {
                return Err(ApiError::invalid(
                    format!("{param}.required[{i}]"),
                    format!("required property '{name}' is not declared in '{param}.properties'"),
                ));
            }
        }
    }
    Ok(())
}

const SCHEMA_TYPES: [&str; 7] = [
    "string", "number", "integer", "boolean", "object", "array", "null",
];

fn validate_subschema(schema: &Value, param: &str) -> Result<(), ApiError> {
    match schema {
        // `true`/`false` are valid schemas.
        Value::Bool(_) => Ok(()),
        Value::Object(obj) => {
            if let Some(t) = obj.get("type") {
                let names: Vec<&Value> = match t {
                    Value::Array(items) => items.iter().collect(),
                    other => vec![other],
                };
                for name in names {
                    let ok = name.as_str().is_some_and(|s| SCHEMA_TYPES.contains(&s));
                    if !ok {
                        return Err(ApiError::invalid(
                            format!("{param}.type"),
                            format!(
                                "'{param}.type' must be one of {} (got {name})",
                                SCHEMA_TYPES.join(", ")
                            ),
                        ));
                    }
                }
            }
            if let Some(props) = obj.get("properties") {
                let Value::Object(props) = props else {
                    return Err(ApiError::invalid(
                        format!("{param}.properties"),
                        format!("'{param}.properties' must be an object"),
                    ));
                };
                for (key, sub) in props {
                    validate_subschema(sub, &format!("{param}.properties.{key}"))?;
                }
            }
            if let Some(items) = obj.get("items") {
                validate_subschema(items, &format!("{param}.items"))?;
            }
            Ok(())
        }
        _ => Err(ApiError::invalid(
            param,
            format!("'{param}' must be a JSON Schema object"),
        )),
    }
}

/// Validate OpenAI function tools; returns them normalised to
/// `{"type":"function","function":{"name","description"?,"parameters"}}`. Keys a tool does not
/// have go to `unknown`.
pub fn validate_tools(
    tools: &[Value],
    unknown: &mut UnknownFields,
) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(tools.len());
    let mut names = std::collections::HashSet::new();
    for (i, tool) in tools.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(obj) = tool else {
            return Err(ApiError::invalid(&p, format!("'{p}' must be an object")));
        };
        for key in obj.keys() {
            if key != "type" && key != "function" {
                unknown.found(format!("{p}.{key}"))?;
            }
        }
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    format!("'{p}.type' must be \"function\", got \"{other}\""),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    format!("'{p}.type' is required and must be \"function\""),
                ));
            }
        }
        let Some(Value::Object(func)) = obj.get("function") else {
            return Err(ApiError::invalid(
                format!("{p}.function"),
                format!("'{p}.function' is required and must be an object"),
            ));
        };
        for key in func.keys() {
            if !matches!(
                key.as_str(),
                "name" | "description" | "parameters" | "strict"
            ) {
                unknown.found(format!("{p}.function.{key}"))?;
            }
        }
        let name = match func.get("name") {
            Some(Value::String(n)) => n.clone(),
            _ => {
                return Err(ApiError::invalid(
                    format!("{p}.function.name"),
                    format!("'{p}.function.name' is required and must be a string"),
                ));
            }
        };
        if !valid_tool_name(&name) {
            return Err(ApiError::invalid(
                format!("{p}.function.name"),
                format!(
                    "'{p}.function.name' must be 1-64 characters of a-z, A-Z, 0-9, '_', '-', '.', ':' (got \"{name}\")"
                ),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(ApiError::invalid(
                format!("{p}.function.name"),
                format!("tool name \"{name}\" is declared more than once"),
            ));
        }
        let mut norm = Map::new();
        norm.insert("name".into(), Value::String(name));
        match func.get("description") {
            None | Some(Value::Null) => {}
            Some(Value::String(d)) => {
                norm.insert("description".into(), Value::String(d.clone()));
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.function.description"),
                    format!("'{p}.function.description' must be a string"),
                ));
            }
        }
        let params = match func.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
            Some(schema) => {
                validate_parameters_schema(schema, &format!("{p}.function.parameters"))?;
                schema.clone()
            }
        };
        norm.insert("parameters".into(), params);
        out.push(serde_json::json!({"type": "function", "function": Value::Object(norm)}));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sampling_ranges_name_the_parameter() {
        let f = SamplingFields {
            temperature: Some(3.0),
            ..Default::default()
        };
        assert_eq!(
            validate_sampling(&f).unwrap_err().param.as_deref(),
            Some("temperature")
        );
        let f = SamplingFields {
            top_p: Some(0.0),
            ..Default::default()
        };
        assert_eq!(
            validate_sampling(&f).unwrap_err().param.as_deref(),
            Some("top_p")
        );
        let f = SamplingFields {
            max_tokens: Some((0, "max_completion_tokens")),
            ..Default::default()
        };
        assert_eq!(
            validate_sampling(&f).unwrap_err().param.as_deref(),
            Some("max_completion_tokens")
        );
        let f = SamplingFields {
            stop: Some(json!(["a", 3])),
            stop_param: "stop",
            ..Default::default()
        };
        assert_eq!(
            validate_sampling(&f).unwrap_err().param.as_deref(),
            Some("stop[1]")
        );
        let f = SamplingFields {
            stop: Some(json!("x")),
            stop_param: "stop",
            top_k: Some(-1),
            seed: Some(-1),
            ..Default::default()
        };
        let ok = validate_sampling(&f).unwrap();
        assert_eq!(ok.stop, vec!["x".to_string()]);
        assert_eq!(ok.top_k, None);
        assert_eq!(ok.seed, Some(u64::MAX));
    }

    #[test]
    fn tool_schemas_are_checked() {
        let good = json!([{"type":"function","function":{"name":"add","parameters":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}}}]);
        assert_eq!(
            validate_tools(good.as_array().unwrap(), &mut UnknownFields::strict())
                .unwrap()
                .len(),
            1
        );

        let cases = [
            (
                json!([{"type":"function","function":{"name":"add","parameters":{"type":"string"}}}]),
                "tools[0].function.parameters.type",
            ),
            (
                json!([{"type":"function","function":{"name":"add","parameters":{"type":"object","properties":{"a":{"type":"int"}}}}}]),
                "tools[0].function.parameters.properties.a.type",
            ),
            (
                json!([{"type":"function","function":{"name":"add","parameters":{"type":"object","required":["b"]}}}]),
                "tools[0].function.parameters.required[0]",
            ),
            (
                json!([{"type":"function","function":{"name":"bad name"}}]),
                "tools[0].function.name",
            ),
            (json!([{"type":"retrieval"}]), "tools[0].type"),
            (
                json!([{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"a"}}]),
                "tools[1].function.name",
            ),
            (
                json!([{"type":"function","function":{"name":"a","parameters":[1]}}]),
                "tools[0].function.parameters",
            ),
        ];
        for (tools, param) in cases {
            let err = validate_tools(tools.as_array().unwrap(), &mut UnknownFields::strict())
                .unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{}", err.message);
        }
    }
}
