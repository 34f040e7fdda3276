//! The optional `output-grammar` export of a tool parser (WIT 0.3): the grammar of the model's
//! output in the format the parser reads, for constrained decoding (`docs/plugins.md`,
//! "Output grammar").

use crate::PluginError;

/// How the model must use the tools (WIT `output-grammar.tool-choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Calls are optional; strict tools are held to their schema once a call block opens.
    Auto,
    /// At least one call, to any of the tools.
    Required,
    /// At least one call, all to this function.
    Function(String),
    /// No calls.
    None,
}

/// WIT `grammar-request`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarRequest {
    /// The request's `tools` (an OpenAI-shaped JSON array), if any.
    pub tools_json: Option<String>,
    pub tool_choice: ToolChoice,
    /// The prompt ended inside the reasoning channel: the output starts with reasoning.
    pub prompt_opens_reasoning: bool,
    /// A Lark expression the response content must match; `None` leaves it free.
    pub content_lark: Option<String>,
    pub extra_json: Option<String>,
}

/// WIT `output-grammar`: a complete Lark grammar (llguidance's dialect, rule `start`) and the
/// text after which it applies (`None`: from the first generated token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputGrammar {
    pub lark: String,
    pub trigger: Option<String>,
}

/// A tool parser that describes its output grammar; export it with
/// [`export_tool_parser_with_grammar!`](crate::export_tool_parser_with_grammar).
pub trait ToolGrammar {
    /// `Ok(None)`: the request needs no constraint. `Err(Unsupported)`: this parser cannot
    /// constrain it; `Err(InvalidInput)`: the request is wrong (e.g. an unknown function).
    fn grammar(request: GrammarRequest) -> Result<Option<OutputGrammar>, PluginError>;
}
