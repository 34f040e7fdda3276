//! The tool parser's optional `output-grammar` export (WIT 0.3): the grammar of its output
//! format for constrained decoding. One call per request, in a fresh instance of the active
//! version; a tool parser without the export (any 0.1 / 0.2 one, or a 0.3 one that leaves it
//! out) answers [`PluginError::NoOutputGrammar`].

use crate::bindings::conv;
use crate::bindings::v0_3::tool_grammar::exports::k3serve::plugin::output_grammar as og;
use crate::error::PluginError;
use crate::registry::{PluginVersion, StagePre};
use crate::runtime::Runtime;
use crate::types::{GrammarRequest, GrammarToolChoice, OutputGrammar};

/// Whether `version` (a tool parser) exports `output-grammar`.
pub(crate) fn has_output_grammar(version: &PluginVersion) -> bool {
    matches!(&version.pre, StagePre::ToolV0_3(p) if p.grammar.is_some())
}

pub(crate) fn output_grammar(
    rt: &Runtime,
    version: &PluginVersion,
    request: &GrammarRequest,
) -> Result<Option<OutputGrammar>, PluginError> {
    let StagePre::ToolV0_3(pre) = &version.pre else {
        return Err(no_grammar(version));
    };
    let Some(indices) = &pre.grammar else {
        return Err(no_grammar(version));
    };
    let wit_request = og::GrammarRequest {
        tools_json: request.tools_json.clone(),
        tool_choice: match &request.tool_choice {
            GrammarToolChoice::Auto => og::ToolChoice::Auto,
            GrammarToolChoice::Required => og::ToolChoice::Required,
            GrammarToolChoice::Function(name) => og::ToolChoice::Function(name.clone()),
            GrammarToolChoice::None => og::ToolChoice::None,
        },
        prompt_opens_reasoning: request.prompt_opens_reasoning,
        content_lark: request.content_lark.clone(),
        extra_json: request.extra_json.clone(),
    };
    let mut store = rt.store(version.label.clone());
    Runtime::timed(version, || {
        let instance = rt.call(&mut store, |s| pre.tool.instance_pre().instantiate(s))?;
        let guest = rt.call(&mut store, |s| indices.load(s, &instance))?;
        let answer = rt.call(&mut store, |s| guest.call_grammar(s, &wit_request))?;
        answer
            .map(|g| {
                g.map(|g| OutputGrammar {
                    lark: g.lark,
                    trigger: g.trigger,
                })
            })
            .map_err(|e| PluginError::Guest {
                plugin: version.label.to_string(),
                error: conv::v0_3::guest_error(e),
            })
    })
}

fn no_grammar(version: &PluginVersion) -> PluginError {
    PluginError::NoOutputGrammar {
        plugin: version.label.to_string(),
    }
}
