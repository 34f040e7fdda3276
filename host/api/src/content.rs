//! Message content with images, as both protocols send it, in the one shape the frontend reads:
//! a string when a message is text only, else an array of `{"type": "text", "text"}` and
//! `{"type": "image_url", "image_url": {"url", "detail"?}}` parts in order (an Anthropic image
//! becomes a `data:` URL). Consecutive text parts are joined by newlines, as text-only content is.
//! Fetching, decoding and limits are the frontend's (docs/http-api.md, "Images").

use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Part {
    Text(String),
    /// A normalised `image_url` part.
    Image(Value),
}

/// The content value for `parts`: a string without images, else the parts array.
pub(crate) fn content_value(parts: Vec<Part>) -> Value {
    if !parts.iter().any(|p| matches!(p, Part::Image(_))) {
        let texts: Vec<String> = parts
            .into_iter()
            .filter_map(|p| match p {
                Part::Text(t) => Some(t),
                Part::Image(_) => None,
            })
            .collect();
        return Value::String(texts.join("\n"));
    }
    let mut out: Vec<Value> = Vec::new();
    let mut text: Option<String> = None;
    for p in parts {
        match p {
            Part::Text(t) => match &mut text {
                Some(acc) => {
                    acc.push('\n');
                    acc.push_str(&t);
                }
                None => text = Some(t),
            },
            Part::Image(v) => {
                if let Some(t) = text.take() {
                    out.push(json!({"type": "text", "text": t}));
                }
                out.push(v);
            }
        }
    }
    if let Some(t) = text {
        out.push(json!({"type": "text", "text": t}));
    }
    Value::Array(out)
}

/// An OpenAI `image_url` part (`pp` names it in errors): `{"url": "...", "detail"?}` or a bare
/// URL string.
pub(crate) fn openai_image(part: &Map<String, Value>, pp: &str) -> Result<Part, ApiError> {
    let (url, detail) = match part.get("image_url") {
        Some(Value::String(u)) => (u.clone(), None),
        Some(Value::Object(o)) => {
            let url = match o.get("url") {
                Some(Value::String(u)) => u.clone(),
                _ => {
                    return Err(ApiError::invalid(
                        format!("{pp}.image_url.url"),
                        format!("'{pp}.image_url.url' must be a string"),
                    ));
                }
            };
            let detail = match o.get("detail") {
                None | Some(Value::Null) => None,
                Some(Value::String(d)) if matches!(d.as_str(), "auto" | "low" | "high") => {
                    Some(d.clone())
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        format!("{pp}.image_url.detail"),
                        format!("'{pp}.image_url.detail' must be \"auto\", \"low\" or \"high\""),
                    ));
                }
            };
            (url, detail)
        }
        _ => {
            return Err(ApiError::invalid(
                format!("{pp}.image_url"),
                format!("'{pp}.image_url' must be an object with a 'url'"),
            ));
        }
    };
    Ok(image_part(url, detail))
}

/// An Anthropic `image` block: `source` base64 (with `media_type`) or url.
pub(crate) fn anthropic_image(block: &Value, bp: &str) -> Result<Part, ApiError> {
    let source = match block.get("source") {
        Some(Value::Object(s)) => s,
        _ => {
            return Err(ApiError::invalid(
                format!("{bp}.source"),
                format!("'{bp}.source' must be an object"),
            ));
        }
    };
    let str_field = |k: &str| match source.get(k) {
        Some(Value::String(s)) => Ok(s.as_str()),
        _ => Err(ApiError::invalid(
            format!("{bp}.source.{k}"),
            format!("'{bp}.source.{k}' must be a string"),
        )),
    };
    match str_field("type")? {
        "base64" => {
            let media_type = str_field("media_type")?;
            let data = str_field("data")?;
            Ok(image_part(format!("data:{media_type};base64,{data}"), None))
        }
        "url" => Ok(image_part(str_field("url")?.to_string(), None)),
        other => Err(ApiError::not_supported(
            format!("{bp}.source.type"),
            format!("image sources of type \"{other}\" are not supported (use base64 or url)"),
        )),
    }
}

fn image_part(url: String, detail: Option<String>) -> Part {
    let mut image = Map::new();
    image.insert("url".into(), Value::String(url));
    if let Some(d) = detail {
        image.insert("detail".into(), Value::String(d));
    }
    Part::Image(json!({"type": "image_url", "image_url": image}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_only_joins_and_images_keep_order() {
        let t = |s: &str| Part::Text(s.into());
        assert_eq!(content_value(vec![t("a"), t("b")]), json!("a\nb"));
        let img = image_part("data:x".into(), None);
        assert_eq!(
            content_value(vec![t("a"), t("b"), img.clone(), t("c")]),
            json!([{"type": "text", "text": "a\nb"},
                   {"type": "image_url", "image_url": {"url": "data:x"}},
                   {"type": "text", "text": "c"}])
        );
    }

    #[test]
    fn anthropic_base64_becomes_a_data_url() {
        let b = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}});
        assert_eq!(
            anthropic_image(&b, "m").unwrap(),
            image_part("data:image/png;base64,AAA".into(), None)
        );
        let bad = json!({"type": "image", "source": {"type": "file", "file_id": "f"}});
        assert!(anthropic_image(&bad, "m").is_err());
    }
}
