use crate::types::{GuestError, MediaError, Stage, TemplateError};

/// Everything the plugin host can fail with. Load-time variants mean the component was refused
/// (the active version is untouched); call-time faults ([`PluginError::is_fault`]) fail only
/// the call that hit them and discard its instance; [`PluginError::Capacity`] is the host's
/// condition, not the plugin's (`docs/plugins.md`, "Fault model").
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
    /// The plugin reached for something the sandbox denies in a way that cannot be answered
    /// with a WASI error code (it tried to wait: plugins have nothing to wait for).
    #[error("plugin {plugin} was stopped: {detail}")]
    Denied { plugin: String, detail: String },
    /// A host function panicked while serving the plugin (a host bug, contained to this call).
    #[error("the plugin host failed while serving plugin {plugin} and stopped the call: {detail}")]
    HostPanic { plugin: String, detail: String },
    /// Every plugin instance slot of the engine is taken (`PluginHostConfig::max_instances`).
    /// Not the plugin's fault: it is not counted against it; the request may be retried.
    #[error(
        "the server is at its plugin instance capacity ({detail}) and could not start {plugin}; retry later"
    )]
    Capacity { plugin: String, detail: String },
    #[error("plugin {plugin}: {error}")]
    Guest { plugin: String, error: GuestError },
    #[error(transparent)]
    Template(TemplateError),
    /// The media stage refused an image or returned invalid output
    /// ([`MediaError::is_client_error`] says whose fault).
    #[error(transparent)]
    Media(MediaError),
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
    /// A fault of the plugin that discarded the instance (trap, time or memory limit, denied
    /// operation, or a host panic while serving it); counted in the version's `faults`.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            PluginError::Trap { .. }
                | PluginError::Timeout { .. }
                | PluginError::MemoryLimit { .. }
                | PluginError::Denied { .. }
                | PluginError::HostPanic { .. }
        )
    }

    /// A per-call resource limit (time or memory) stopped the plugin. For a chat template this
    /// usually means the input was too large, which callers report as the client's error.
    pub fn is_resource_limit(&self) -> bool {
        matches!(
            self,
            PluginError::Timeout { .. } | PluginError::MemoryLimit { .. }
        )
    }

    /// The engine had no free instance slot: retry later; not counted against the plugin.
    pub fn is_capacity(&self) -> bool {
        matches!(self, PluginError::Capacity { .. })
    }

    /// A short stable name of the variant, for logs and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            PluginError::NoActivePlugin(_) => "no_active_plugin",
            PluginError::UnknownVersion { .. } => "unknown_version",
            PluginError::NothingToRollBack(_) => "nothing_to_roll_back",
            PluginError::InvalidComponent(_) => "invalid_component",
            PluginError::WrongWorld { .. } => "wrong_world",
            PluginError::UnsupportedWitVersion { .. } => "unsupported_wit_version",
            PluginError::MetadataMismatch { .. } => "metadata_mismatch",
            PluginError::SelfTestFailed { .. } => "self_test_failed",
            PluginError::Trap { .. } => "trap",
            PluginError::Timeout { .. } => "timeout",
            PluginError::MemoryLimit { .. } => "memory_limit",
            PluginError::Denied { .. } => "denied",
            PluginError::HostPanic { .. } => "host_panic",
            PluginError::Capacity { .. } => "capacity",
            PluginError::Guest { .. } => "guest",
            PluginError::Template(_) => "template",
            PluginError::Media(_) => "media",
            PluginError::NoOutputGrammar { .. } => "no_output_grammar",
            PluginError::StreamClosed(_) => "stream_closed",
            PluginError::Engine(_) => "engine",
            PluginError::Io(_) => "io",
        }
    }
}
