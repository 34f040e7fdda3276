use crate::types::{GuestError, Stage, TemplateError};

/// Everything the plugin host can fail with. Load-time variants mean the component was refused
/// (the active version is untouched); call-time faults (`Trap`, `Timeout`, `MemoryLimit`) fail
/// only the call that hit them and discard its instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginError {
    #[error("no {0} plugin is active")]
    NoActivePlugin(Stage),
    #[error("no loaded {stage} plugin has version id {id}")]
    UnknownVersion { stage: Stage, id: u64 },
    #[error("no previous {0} version to roll back to")]
    NothingToRollBack(Stage),

    #[error("not a loadable WebAssembly component: {0}")]
    InvalidComponent(String),
    #[error(
        "component does not implement world `k3serve:plugin/{world}` (@0.1.0, @0.2.0 or @0.3.0) for the {stage} stage: {detail}"
    )]
    WrongWorld {
        stage: Stage,
        world: &'static str,
        detail: String,
    },
    #[error(
        "component targets WIT `{found}`, which this host does not serve (served: k3serve:plugin@0.1.x, @0.2.x and @0.3.x)"
    )]
    UnsupportedWitVersion { found: String },
    #[error("plugin metadata does not match the {stage} stage: {detail}")]
    MetadataMismatch { stage: Stage, detail: String },
    #[error("plugin {plugin} failed its self-test: {detail}")]
    SelfTestFailed { plugin: String, detail: String },

    #[error("plugin {plugin} trapped: {detail}")]
    Trap { plugin: String, detail: String },
    #[error("plugin {plugin} exceeded its time limit of {limit_ms} ms and was stopped")]
    Timeout { plugin: String, limit_ms: u64 },
    #[error("plugin {plugin} exceeded its memory limit of {limit_bytes} bytes and was stopped")]
    MemoryLimit { plugin: String, limit_bytes: usize },
    #[error("plugin {plugin}: {error}")]
    Guest { plugin: String, error: GuestError },
    #[error(transparent)]
    Template(TemplateError),
    /// The active tool parser does not export `output-grammar` (WIT 0.3), so it cannot say how
    /// to constrain tool calls.
    #[error(
        "the active tool parser ({plugin}) has no output grammar (the optional WIT 0.3 `output-grammar` export), so it cannot constrain the output"
    )]
    NoOutputGrammar { plugin: String },
    #[error("this {0} stream already failed or finished; start a new one")]
    StreamClosed(Stage),

    #[error("plugin engine error: {0}")]
    Engine(String),
    #[error("plugin I/O error: {0}")]
    Io(String),
}

impl PluginError {
    /// A fault that discarded the instance (trap, timeout, memory).
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            PluginError::Trap { .. }
                | PluginError::Timeout { .. }
                | PluginError::MemoryLimit { .. }
        )
    }
}
