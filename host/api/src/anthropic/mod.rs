//! The Anthropic Messages protocol.

pub mod count_tokens;
pub mod messages;
pub mod request;
