//! [`Frontend::output_grammar`]: the constraint for a request's tool calls and content, asked
//! of the active tool-parser plugin (its optional WIT 0.3 `output-grammar` export), so swapping
//! the parser swaps the constraint (docs/plugins.md, "Output grammar").

use k3_plugin_host::{GrammarRequest, GrammarToolChoice, GuestError, PluginError};
use serde_json::Value;

pub use k3_plugin_host::OutputGrammar;

use crate::error::{BackendError, FrontendError};
use crate::frontend::Frontend;
use crate::request::ToolChoice;

impl Frontend {
    /// The grammar the output of a request must follow, from the active tool parser: `tools`
    /// (OpenAI-shaped), the tool choice, whether the prompt opened the reasoning channel, and
    /// a Lark expression for the response content (e.g. `%json {...}` for `response_format`).
    /// `Ok(None)`: nothing to constrain (e.g. `auto` without strict tools and no content).
    /// A parser without the export gives [`FrontendError::NoOutputGrammar`].
    pub fn output_grammar(
        &self,
        tools: &[Value],
        choice: &ToolChoice,
        prompt_opens_reasoning: bool,
        content_lark: Option<&str>,
    ) -> Result<Option<OutputGrammar>, FrontendError> {
        let request = GrammarRequest {
            tools_json: (!tools.is_empty()).then(|| Value::Array(tools.to_vec()).to_string()),
            tool_choice: match choice {
                ToolChoice::Auto => GrammarToolChoice::Auto,
                ToolChoice::None => GrammarToolChoice::None,
                ToolChoice::Required => GrammarToolChoice::Required,
                ToolChoice::Function(name) => GrammarToolChoice::Function(name.clone()),
            },
            prompt_opens_reasoning,
            content_lark: content_lark.map(str::to_owned),
            extra_json: None,
        };
        self.plugins()
            .output_grammar(&request)
            .map_err(FrontendError::from)
    }
}

impl From<PluginError> for FrontendError {
    fn from(e: PluginError) -> Self {
        match e {
            PluginError::NoOutputGrammar { plugin } => FrontendError::NoOutputGrammar { plugin },
            PluginError::Guest {
                plugin,
                error: GuestError::InvalidInput(m),
            } => FrontendError::InvalidRequest(format!("{plugin}: {m}")),
            PluginError::Guest {
                plugin,
                error: GuestError::Unsupported(m),
            } => FrontendError::Unsupported(format!("{plugin}: {m}")),
            other if other.is_capacity() => FrontendError::Capacity(other.to_string()),
            other => FrontendError::Plugin(other.to_string()),
        }
    }
}

impl From<FrontendError> for BackendError {
    fn from(e: FrontendError) -> Self {
        let message = e.to_string();
        match e {
            FrontendError::NoOutputGrammar { .. } | FrontendError::Unsupported(_) => {
                BackendError::NotSupported {
                    message,
                    param: Some("tool_choice".into()),
                }
            }
            FrontendError::InvalidRequest(_) => BackendError::InvalidRequest {
                message,
                param: Some("tools".into()),
            },
            FrontendError::Plugin(_) => BackendError::Plugin(message),
            FrontendError::Capacity(_) => BackendError::Unavailable(message),
        }
    }
}
