//! Constrained decoding on the request path (`docs/architecture.md`, "Constrained decoding"):
//! which grammar a request gets, compiled over this model's tokenizer, and the sampler that
//! enforces it.

use std::sync::{Arc, OnceLock};

use k3_engine::{RequestSampler, TokenSampler};
use k3_sampling::SamplingParams;
use k3_structured::{
    ConstrainedSampler, ConstraintError, GrammarCompiler, GrammarPlan, OutputConstraint,
    TokenBytes, token_env,
};
use serde_json::Value;

use crate::error::BackendError;
use crate::request::{ChatGenRequest, ToolChoice};
use crate::tokenizer::Tokenizer;
use k3_plugin_host::OutputGrammar;

/// The grammar compiler of one model, built on first use (building the token trie takes a few
/// milliseconds; servers that never constrain never pay it).
#[derive(Default)]
pub(crate) struct Constraints {
    compiler: OnceLock<Result<Arc<GrammarCompiler>, ConstraintError>>,
}

impl Constraints {
    fn compiler(
        &self,
        tokenizer: &Tokenizer,
        eos: &[u32],
        vocab: usize,
    ) -> Result<Arc<GrammarCompiler>, BackendError> {
        self.compiler
            .get_or_init(|| {
                let tokens = vocabulary(tokenizer, vocab)?;
                Ok(Arc::new(GrammarCompiler::new(token_env(&tokens, eos)?)?))
            })
            .clone()
            .map_err(|e| BackendError::NotSupported {
                message: format!("constrained decoding is unavailable for this model: {e}"),
                param: None,
            })
    }

    /// Compile a constraint on the whole output (raw completions).
    pub(crate) fn for_completion(
        &self,
        tokenizer: &Tokenizer,
        eos: &[u32],
        vocab: usize,
        constraint: &OutputConstraint,
        param: &str,
    ) -> Result<GrammarPlan, BackendError> {
        let compiler = self.compiler(tokenizer, eos, vocab)?;
        let grammar = compiler
            .compile_constraint(constraint)
            .map_err(|e| invalid(e, param))?;
        Ok(GrammarPlan {
            grammar,
            trigger: None,
        })
    }

    /// Compile a tool parser's output grammar (chat).
    pub(crate) fn for_chat(
        &self,
        tokenizer: &Tokenizer,
        eos: &[u32],
        vocab: usize,
        grammar: &OutputGrammar,
    ) -> Result<GrammarPlan, BackendError> {
        let compiler = self.compiler(tokenizer, eos, vocab)?;
        let compiled = compiler.compile_lark(&grammar.lark).map_err(|e| {
            // The parser's grammar is built from the request's tools and content constraint.
            invalid(e, "tools")
        })?;
        Ok(GrammarPlan {
            grammar: compiled,
            trigger: grammar.trigger.clone(),
        })
    }
}

fn invalid(e: ConstraintError, param: &str) -> BackendError {
    BackendError::InvalidRequest {
        message: format!("'{param}': {e}"),
        param: Some(param.into()),
    }
}

/// Every id of the logits row as llguidance sees it: text bytes, special tokens by name, and
/// ids past the tokenizer unused.
fn vocabulary(tokenizer: &Tokenizer, vocab: usize) -> Result<Vec<TokenBytes>, ConstraintError> {
    if !tokenizer.is_byte_level() {
        return Err(ConstraintError::Tokenizer(
            "the tokenizer is not byte-level, so token bytes are unknown".into(),
        ));
    }
    Ok((0..vocab.max(tokenizer.vocab_size()) as u32)
        .map(|id| {
            if tokenizer.is_special(id) {
                match tokenizer.id_to_token(id) {
                    Some(name) => TokenBytes::Special(name),
                    None => TokenBytes::Unused,
                }
            } else {
                match tokenizer.token_bytes(id) {
                    Some(b) => TokenBytes::Text(b.to_vec()),
                    None => TokenBytes::Unused,
                }
            }
        })
        .collect())
}

/// The request's sampler behind the grammar. `min_tokens` does not apply: the grammar alone
/// decides where the output may end (holding EOS back past a finished grammar would leave no
/// token to sample).
pub(crate) fn constrained_sampler(
    params: &SamplingParams,
    vocab: usize,
    prompt: &[u32],
    plan: GrammarPlan,
) -> Result<Box<dyn TokenSampler>, BackendError> {
    let inner = RequestSampler::new(params, vocab, prompt).map_err(|message| {
        BackendError::InvalidRequest {
            message,
            param: None,
        }
    })?;
    let sampler = ConstrainedSampler::new(Box::new(inner), plan)
        .map_err(|e| BackendError::Internal(format!("starting the grammar worker failed: {e}")))?;
    Ok(Box::new(sampler))
}

/// Whether a chat request needs the tool parser's output grammar, and whether the parser may
/// decline: `tool_choice` required / named and a content constraint must be enforced; strict
/// tools under `auto` are enforced when the parser can.
pub(crate) fn chat_needs_grammar(req: &ChatGenRequest) -> Option<Need> {
    let strict_tools = req.tools.iter().any(|t| {
        t.pointer("/function/strict")
            .and_then(Value::as_bool)
            .unwrap_or(false)
    });
    match req.tool_choice {
        ToolChoice::Required | ToolChoice::Function(_) => Some(Need::Required),
        _ if req.constraint.is_some() => Some(Need::Required),
        ToolChoice::Auto if strict_tools => Some(Need::IfSupported),
        _ => None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Need {
    /// The request cannot be served without the grammar: a 400 when the parser has none.
    Required,
    /// Enforced when the parser can build it; served unconstrained otherwise.
    IfSupported,
}
