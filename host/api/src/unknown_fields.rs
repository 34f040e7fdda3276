//! Request fields this server does not know. By default they are accepted and ignored, as vLLM
//! does, because clients add their own fields (litellm's `provider_specific_fields` on messages,
//! OpenAI's newest top-level options): each field is warned about once per process and counted
//! in `/metrics` (`k3serve_ignored_request_fields_total{field}`). With `--strict-request-fields`
//! an unknown field is a 400 naming its path instead, so a typo (`max_token`) cannot pass
//! unnoticed.
//!
//! Typed request structs report what serde ignored (`serde_ignored`, in [`crate::body`]); the
//! hand-validated JSON parts (messages, tools) report their unknown keys through
//! [`UnknownFields::found`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::error::{ApiError, ErrorKind};

/// Most distinct field patterns tracked (warned about and labelled in `/metrics`); clients choose
/// the names, so past this many the rest share the label `other`.
pub const MAX_FIELD_PATTERNS: usize = 128;
/// The label of field patterns past [`MAX_FIELD_PATTERNS`].
pub const OTHER_FIELDS: &str = "(other)";

/// The process-wide record of ignored fields: counts per pattern, and which were warned about.
#[derive(Default)]
pub struct IgnoredFields {
    counts: Mutex<BTreeMap<String, u64>>,
}

impl IgnoredFields {
    /// Count one ignored field at `path`, warning the first time its pattern is seen.
    pub fn record(&self, path: &str) {
        let pattern = field_pattern(path);
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&pattern) {
            *n += 1;
            return;
        }
        if counts.len() >= MAX_FIELD_PATTERNS {
            let first_overflow = !counts.contains_key(OTHER_FIELDS);
            *counts.entry(OTHER_FIELDS.to_string()).or_default() += 1;
            if first_overflow {
                tracing::warn!(
                    "more than {MAX_FIELD_PATTERNS} distinct unknown request fields seen; \
                     further ones are ignored without a warning and counted as '{OTHER_FIELDS}'"
                );
            }
            return;
        }
        tracing::warn!(
            field = %pattern,
            "ignoring unknown request field '{pattern}' (warned once; \
             --strict-request-fields rejects unknown fields)"
        );
        counts.insert(pattern, 1);
    }

    /// `(pattern, count)` pairs in pattern order.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// A field path without its array indices: `messages[3].x` → `messages[].x`, so one metric
/// label and one warning cover a field wherever it appears.
pub fn field_pattern(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => {
                in_index = true;
                out.push('[');
            }
            ']' => {
                in_index = false;
                out.push(']');
            }
            c if in_index && c.is_ascii_digit() => {}
            c => out.push(c),
        }
    }
    out
}

/// One request's unknown fields: a 400 at the first in strict mode, otherwise collected and,
/// when this value is dropped, recorded in the process-wide [`IgnoredFields`].
pub struct UnknownFields {
    strict: bool,
    found: Vec<String>,
    sink: Option<Arc<IgnoredFields>>,
}

impl UnknownFields {
    /// Collect into `sink` (recorded on drop), or reject when `strict`.
    pub fn new(strict: bool, sink: Option<Arc<IgnoredFields>>) -> Self {
        UnknownFields {
            strict,
            found: Vec::new(),
            sink,
        }
    }

    /// Reject unknown fields; nothing is recorded.
    pub fn strict() -> Self {
        UnknownFields::new(true, None)
    }

    /// Ignore unknown fields without recording them anywhere but here ([`Self::paths`]).
    pub fn lenient() -> Self {
        UnknownFields::new(false, None)
    }

    /// A field at `path` that this server does not know.
    pub fn found(&mut self, path: impl Into<String>) -> Result<(), ApiError> {
        let path = path.into();
        if self.strict {
            return Err(unknown_field_error(path));
        }
        self.found.push(path);
        Ok(())
    }

    /// The unknown fields ignored so far, in the order met.
    pub fn paths(&self) -> &[String] {
        &self.found
    }
}

impl Drop for UnknownFields {
    fn drop(&mut self) {
        if let Some(sink) = &self.sink {
            for path in &self.found {
                sink.record(path);
            }
        }
    }
}

/// The strict mode's 400 for an unknown field.
pub fn unknown_field_error(path: String) -> ApiError {
    ApiError::new(
        ErrorKind::InvalidRequest,
        format!(
            "unknown field '{path}' is not accepted here (the server runs with \
             --strict-request-fields)"
        ),
    )
    .with_param(path)
    .with_code("unknown_field")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_drop_indices() {
        assert_eq!(
            field_pattern("messages[12].provider_specific_fields"),
            "messages[].provider_specific_fields"
        );
        assert_eq!(
            field_pattern("tools[0].function.strict2"),
            "tools[].function.strict2"
        );
        assert_eq!(field_pattern("verbosity"), "verbosity");
    }

    #[test]
    fn strict_rejects_lenient_records_on_drop() {
        let err = UnknownFields::strict().found("messages[1].x").unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[1].x"));
        assert_eq!(err.code, Some("unknown_field"));
        assert_eq!(err.status(), 400);

        let sink = Arc::new(IgnoredFields::default());
        for _ in 0..2 {
            let mut f = UnknownFields::new(false, Some(sink.clone()));
            f.found("messages[0].a").unwrap();
            f.found("messages[3].a").unwrap();
            f.found("b").unwrap();
        }
        assert_eq!(
            sink.snapshot(),
            vec![("b".to_string(), 2), ("messages[].a".to_string(), 4)]
        );
    }

    #[test]
    fn client_chosen_names_cannot_grow_the_label_set_without_bound() {
        let sink = IgnoredFields::default();
        for i in 0..MAX_FIELD_PATTERNS + 50 {
            sink.record(&format!("f{i}"));
        }
        let snap = sink.snapshot();
        assert_eq!(snap.len(), MAX_FIELD_PATTERNS + 1);
        assert!(snap.contains(&(OTHER_FIELDS.to_string(), 50)));
    }
}
