//! Constrained decoding (see `docs/architecture.md`, "Constrained decoding"): an
//! [`OutputConstraint`] or a tool parser's output grammar is compiled by llguidance over the
//! model's tokenizer ([`GrammarCompiler`], cached), and a [`ConstrainedSampler`] masks each
//! step's logits with it, computing the next step's mask while the forward pass runs.

mod compiler;
mod constraint;
mod sampler;
mod tok_env;

#[cfg(test)]
mod tests;

pub use compiler::{CompiledGrammar, GrammarCompiler};
pub use constraint::OutputConstraint;
pub use sampler::{ConstrainedSampler, GrammarPlan};
pub use tok_env::{TokenBytes, token_env};

/// Why a constraint could not be used. Request-time errors (all but `Tokenizer`) are the
/// client's: the API answers them with a 400 naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    #[error("invalid JSON schema: {0}")]
    InvalidJsonSchema(String),
    #[error("invalid regex: {0}")]
    InvalidRegex(String),
    #[error("invalid choice: {0}")]
    InvalidChoice(String),
    #[error("invalid grammar: {0}")]
    InvalidGrammar(String),
    #[error("a Lark grammar cannot be embedded in a chat response; use it on completions")]
    NotEmbeddable,
    #[error("tokenizer cannot be used for constrained decoding: {0}")]
    Tokenizer(String),
}
