//! Kimi K3 output parsers as a plain Rust library (docs/k3-format.md §5). The
//! `kimi-k3-reasoning` and `kimi-k3-tools` plugins wrap these types; natively they are tested
//! with `cargo test`, and the host's benchmark compares them with their wasm builds.
//!
//! Pipeline: model text → [`K3ReasoningParser`] → its content → [`K3ToolParser`].

pub mod grammar;
pub mod reasoning;
pub mod tools;
pub mod xtml;

pub use reasoning::K3ReasoningParser;
pub use tools::K3ToolParser;

#[cfg(test)]
mod grammar_tests;
#[cfg(test)]
mod tests;
