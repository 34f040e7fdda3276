//! The Anthropic Messages protocol.

pub mod messages;
pub mod request;
