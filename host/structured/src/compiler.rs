//! Grammar compilation, once per distinct grammar text: the compiled matcher is cached and each
//! request gets a deep copy (a plain clone would share the lexer state's lock across requests).

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory};
use parking_lot::Mutex;

use crate::{ConstraintError, OutputConstraint};

/// Distinct grammars kept compiled; past this the cache starts over (requests mostly repeat a
/// few schemas, and a recompile costs milliseconds).
const CACHE_ENTRIES: usize = 256;

/// A grammar ready to constrain one request: a fresh matcher at the start of the output.
pub struct CompiledGrammar {
    pub(crate) matcher: Matcher,
    pub(crate) env: TokEnv,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar").finish_non_exhaustive()
    }
}

impl CompiledGrammar {
    /// The token bitmask of the next token (what the sampler's worker computes each step).
    pub fn compute_mask(&mut self) -> Result<Vec<u32>, String> {
        self.matcher
            .compute_mask_or_eos()
            .map(|v| v.as_slice().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Advance past `token`.
    pub fn consume_token(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the grammar is complete and nothing may follow (only EOS is allowed).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Compiles grammars for one model's tokenizer.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    env: TokEnv,
    cache: Mutex<HashMap<String, Arc<Matcher>>>,
}

impl GrammarCompiler {
    pub fn new(env: TokEnv) -> Result<Self, ConstraintError> {
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstraintError::Tokenizer(e.to_string()))?;
        // Grammar errors come back as values; llguidance's own logging would only repeat them.
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            env,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Ids the grammar allows once it is complete (and that end an output).
    pub fn eos_tokens(&self) -> &[u32] {
        self.env.tok_trie().eos_tokens()
    }

    /// The vocabulary width masks cover.
    pub fn vocab_size(&self) -> usize {
        self.env.tok_trie().vocab_size()
    }

    /// A constraint on the whole output (raw completions); errors name the constraint's kind.
    pub fn compile_constraint(
        &self,
        constraint: &OutputConstraint,
    ) -> Result<CompiledGrammar, ConstraintError> {
        let lark = constraint.to_grammar()?;
        self.compile_lark(&lark).map_err(|e| match (e, constraint) {
            (ConstraintError::InvalidGrammar(m), OutputConstraint::JsonSchema { .. })
            | (ConstraintError::InvalidGrammar(m), OutputConstraint::JsonObject) => {
                ConstraintError::InvalidJsonSchema(m)
            }
            (ConstraintError::InvalidGrammar(m), OutputConstraint::Regex(_)) => {
                ConstraintError::InvalidRegex(m)
            }
            (ConstraintError::InvalidGrammar(m), OutputConstraint::Choice(_)) => {
                ConstraintError::InvalidChoice(m)
            }
            (e, _) => e,
        })
    }

    /// A complete Lark grammar (llguidance's dialect, rule `start`).
    pub fn compile_lark(&self, lark: &str) -> Result<CompiledGrammar, ConstraintError> {
        if let Some(m) = self.cache.lock().get(lark) {
            return Ok(self.ready(m));
        }
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let matcher = Matcher::new(self.factory.create_parser(grammar));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::InvalidGrammar(e));
        }
        let matcher = Arc::new(matcher);
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(lark.to_string(), matcher.clone());
        Ok(self.ready(&matcher))
    }

    /// How many grammars are compiled and cached.
    pub fn cached(&self) -> usize {
        self.cache.lock().len()
    }

    fn ready(&self, m: &Matcher) -> CompiledGrammar {
        CompiledGrammar {
            matcher: m.deep_clone(),
            env: self.env.clone(),
        }
    }
}
