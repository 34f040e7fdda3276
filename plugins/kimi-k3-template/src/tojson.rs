//! HF transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)` semantics, without minijinja's HTML escaping.

use minijinja::value::{Kwargs, Value};
use minijinja::{Error, ErrorKind};
use serde_json::Value as Json;

pub fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: value is not JSON: {e}"),
        )
    })?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match i64::try_from(v.clone()) {
            Ok(n) => Some(" ".repeat(n.max(0) as usize)),
            Err(_) => Some(v.as_str().unwrap_or("").to_string()),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item(&Value::from(0))?;
            let b = v.get_item(&Value::from(1))?;
            (
                a.as_str().unwrap_or(",").to_string(),
                b.as_str().unwrap_or(":").to_string(),
            )
        }
        // Python's defaults: (', ', ': ') without indent, (',', ': ') with it.
        _ => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    let mut out = String::new();
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    write(&json, &style, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn newline(style: &Style, depth: usize, out: &mut String) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write(v: &Json, style: &Style, depth: usize, out: &mut String) {
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(style, depth + 1, out);
                write(item, style, depth + 1, out);
            }
            newline(style, depth, out);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(style, depth + 1, out);
                write_str(k, style, out);
                out.push_str(&style.key_sep);
                write(item, style, depth + 1, out);
            }
            newline(style, depth, out);
            out.push('}');
        }
        Json::String(s) => write_str(s, style, out),
        other => out.push_str(&other.to_string()),
    }
}

fn write_str(s: &str, style: &Style, out: &mut String) {
    let quoted = serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    if !style.ensure_ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
}
