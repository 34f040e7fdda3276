//! Request bodies: size limit, JSON syntax and typed decoding, each failure naming what is wrong.

use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ErrorKind, ErrorStyle};
use crate::unknown_fields::UnknownFields;

/// Turn the raw body extraction result into bytes or a clean error (413 past the limit).
pub fn read_body(
    body: Result<Bytes, BytesRejection>,
    style: ErrorStyle,
) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let err = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                ErrorKind::RequestTooLarge,
                "request body is larger than the server's limit (--max-request-body-bytes)",
            )
            .with_code("request_too_large")
        } else {
            ApiError::new(
                ErrorKind::InvalidRequest,
                format!("could not read the request body: {rejection}"),
            )
        };
        err.styled(style)
    })
}

/// Parse a JSON object body into `T`. Syntax errors, wrong types and missing fields become 400s
/// whose `param` is the path of the offending field; fields `T` does not declare go to `unknown`
/// (ignored, or a 400 in strict mode).
pub fn parse_json<T: DeserializeOwned>(
    bytes: &[u8],
    style: ErrorStyle,
    unknown: &mut UnknownFields,
) -> Result<T, ApiError> {
    decode(bytes, unknown).map_err(|e| e.styled(style))
}

fn decode<T: DeserializeOwned>(bytes: &[u8], unknown: &mut UnknownFields) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            "request body is empty; expected a JSON object",
        )
        .with_code("invalid_json"));
    }
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("request body is not valid JSON: {e}"),
        )
        .with_code("invalid_json")
    })?;
    if !value.is_object() {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            "request body must be a JSON object",
        )
        .with_code("invalid_json"));
    }
    let mut ignored = Vec::new();
    let parsed = serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
        value,
        &mut |path: serde_ignored::Path<'_>| ignored.push(field_path(&path)),
    ))
    .map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        field_error(&path, &inner)
    })?;
    for path in ignored {
        unknown.found(path)?;
    }
    Ok(parsed)
}

/// A `serde_ignored` path in the form errors use: `messages[2].name`.
fn field_path(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", field_path(parent)),
        Path::Map { parent, key } => {
            let parent = field_path(parent);
            if parent.is_empty() {
                key.clone()
            } else {
                format!("{parent}.{key}")
            }
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => field_path(parent),
    }
}

/// Build the 400 for a serde error at `path` (serde_path_to_error's form: `a.b[2].c`, `.` = root).
fn field_error(path: &str, message: &str) -> ApiError {
    let base = if path == "." { "" } else { path };
    let join = |field: &str| {
        if base.is_empty() {
            field.to_string()
        } else {
            format!("{base}.{field}")
        }
    };
    if let Some(field) = backticked_after(message, "unknown field ") {
        // serde_path_to_error's path already ends at the unknown key.
        let param = if base.is_empty() {
            field
        } else {
            base.to_string()
        };
        return ApiError::new(
            ErrorKind::InvalidRequest,
            format!("unknown field '{param}' is not accepted here"),
        )
        .with_param(param)
        .with_code("unknown_field");
    }
    if let Some(field) = backticked_after(message, "missing field ") {
        let param = join(&field);
        return ApiError::new(
            ErrorKind::InvalidRequest,
            format!("missing required field '{param}'"),
        )
        .with_param(param)
        .with_code("missing_field");
    }
    let param = if base.is_empty() {
        None
    } else {
        Some(base.to_string())
    };
    let text = match &param {
        Some(p) => format!("invalid value for '{p}': {message}"),
        None => format!("invalid request: {message}"),
    };
    let mut err = ApiError::new(ErrorKind::InvalidRequest, text).with_code("invalid_type");
    err.param = param;
    err
}

/// The name in backticks that follows `prefix` in a serde message, e.g. "unknown field `foo`".
fn backticked_after(message: &str, prefix: &str) -> Option<String> {
    let rest = &message[message.find(prefix)? + prefix.len()..];
    let rest = rest.strip_prefix('`')?;
    Some(rest[..rest.find('`')?].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        x: f64,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        items: Vec<Inner>,
        opt: Option<Inner>,
    }

    fn err(body: &str) -> ApiError {
        parse_json::<Outer>(
            body.as_bytes(),
            ErrorStyle::OpenAi,
            &mut UnknownFields::strict(),
        )
        .unwrap_err()
    }

    #[test]
    fn unknown_fields_are_ignored_by_default_at_every_level() {
        let mut unknown = UnknownFields::lenient();
        let body = r#"{"name":"a","zzz":1,"items":[{"x":1},{"x":2,"y":[3]}],"opt":{"x":1,"w":{}}}"#;
        let parsed = parse_json::<Outer>(body.as_bytes(), ErrorStyle::OpenAi, &mut unknown);
        assert_eq!(parsed.unwrap().items.len(), 2);
        assert_eq!(unknown.paths(), ["zzz", "items[1].y", "opt.w"]);
    }

    #[test]
    fn names_the_failing_field() {
        let e = err(r#"{"name":"a","items":[{"x":1},{"x":"no"}]}"#);
        assert_eq!(e.param.as_deref(), Some("items[1].x"));
        assert!(e.message.contains("items[1].x"), "{}", e.message);

        let e = err(r#"{"name":"a","items":[{"x":1,"y":2}]}"#);
        assert_eq!(e.param.as_deref(), Some("items[0].y"));
        assert_eq!(e.code, Some("unknown_field"));

        let e = err(r#"{"items":[]}"#);
        assert_eq!(e.param.as_deref(), Some("name"));
        assert_eq!(e.code, Some("missing_field"));

        let e = err(r#"{"name":"a","items":[],"zzz":1}"#);
        assert_eq!(e.param.as_deref(), Some("zzz"));
    }

    #[test]
    fn rejects_bad_json_and_non_objects() {
        assert_eq!(err("{\"name\":").code, Some("invalid_json"));
        assert_eq!(err("[1,2]").code, Some("invalid_json"));
        assert_eq!(err("  ").code, Some("invalid_json"));
        assert_eq!(err("{").kind, ErrorKind::InvalidRequest);
    }
}
