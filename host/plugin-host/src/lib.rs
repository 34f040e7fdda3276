//! k3serve's WebAssembly plugin host (WIT packages `k3serve:plugin@0.1.0`, `@0.2.0` and
//! `@0.3.0`, served side by side; see `wit/` and `docs/plugins.md`).
//!
//! One wasmtime `Engine` (component model, pooling allocator, epoch interruption) runs the
//! frontend stages as sandboxed components: every store is capped in memory and time and gets a
//! deny-all WASI that never blocks (`sandbox_io`). A trap, timeout, memory overrun or denied
//! operation fails only the call that hit it and discards that instance; running out of
//! instance slots is [`PluginError::Capacity`], which is not held against the plugin. Each stage has a slot with an atomic swap: `load` (compile → type-check
//! against the world → the plugin's self-test → the host's smoke test), then `activate`; streams
//! already running finish on the version they started with; `rollback` restores the previous
//! version.
//!
//! The API is synchronous and every type is `Send`; no wasmtime type is public.
//! - parser calls (`feed`, `finish`, stream start ≈ tens of µs) are cheap enough to call
//!   directly from async tasks;
//! - router choices ([`Router::choose`], microseconds on a live instance) likewise;
//! - `load` (compiles: up to seconds on a cache miss), template renders (≈0.1–1 ms) and media
//!   processing (milliseconds per image) belong in `tokio::task::spawn_blocking`.
//!
//! ```no_run
//! # fn main() -> Result<(), k3_plugin_host::PluginError> {
//! use k3_plugin_host::*;
//! let host = PluginHost::new(PluginHostConfig::default())?;
//! host.load_default_plugins()?;
//! let mut stream = host.tool_stream(&ToolOptions { id_prefix: "call_req1_".into(), ..Default::default() })?;
//! for delta in ["Hi<|open|>tools<|sep|>", "..."] {
//!     for event in stream.feed(delta)? { /* forward to the client */ let _ = event; }
//! }
//! let _tail = stream.finish()?;
//! # Ok(()) }
//! ```

mod bindings;
mod config;
mod defaults;
mod error;
mod grammar;
mod media;
mod registry;
mod router;
mod runtime;
mod sandbox_io;
mod smoke;
mod streams;
mod template;
mod types;

use std::sync::Arc;

pub use config::PluginHostConfig;
pub use defaults::{DEFAULT_PLUGINS, DEFAULT_ROUTER_PLUGIN, default_plugin_dir};
pub use error::PluginError;
pub use k3_segments::Segment;
pub use media::{ImagePart, Media, MediaOptions, PreparedImage};
pub use router::Router;
pub use streams::{ReasoningStream, ToolStream};
pub use template::ChatTemplates;
pub use types::{
    GrammarRequest, GrammarToolChoice, GuestError, MediaError, OutputGrammar, ParseEvent,
    ParseResult, PluginMetadata, ReasoningOptions, RenderOptions, ReplicaView, RouteChoice,
    RouteRequest, Stage, TemplateError, ToolCall, ToolOptions, VersionInfo, VersionStats,
};

use registry::Registry;
use runtime::Runtime;

/// The plugin host. Cheap to clone (shared state); `Send + Sync`.
#[derive(Clone)]
pub struct PluginHost {
    rt: Arc<Runtime>,
    registry: Arc<Registry>,
}

impl PluginHost {
    /// Create the engine (one per process is the intent: share clones of this host).
    pub fn new(cfg: PluginHostConfig) -> Result<Self, PluginError> {
        Ok(Self {
            rt: Runtime::new(cfg)?,
            registry: Arc::new(Registry::new()),
        })
    }

    /// Whether the pooling allocator is in use (else on-demand allocation, see the logs).
    pub fn uses_pooling_allocator(&self) -> bool {
        self.rt.pooling
    }

    /// Plugin instances alive now (parser streams, warm and rendering templates, one-shot
    /// calls), out of `max_instances`; `None` without the pooling allocator. For `/metrics`.
    pub fn instances_in_use(&self) -> Option<u64> {
        self.rt.instances_in_use()
    }

    /// Instantiations refused so far with [`PluginError::Capacity`] (all plugins together).
    pub fn capacity_refusals(&self) -> u64 {
        self.rt.capacity_refusals()
    }

    /// Linear-memory bytes the pool keeps resident in its idle slots (at most the first
    /// 256 KiB of each; the rest is returned to the OS when an instance ends). `None`
    /// without the pooling allocator.
    pub fn idle_memory_resident(&self) -> Option<usize> {
        self.rt.idle_memory_resident()
    }

    /// Compile, type-check against `stage`'s world, and self-test a component. The result is
    /// loaded but not active; loading the same bytes again returns the existing version.
    pub fn load(&self, stage: Stage, wasm: &[u8]) -> Result<VersionInfo, PluginError> {
        self.registry
            .retry_on_capacity(|| self.registry.load(&self.rt, stage, wasm))
    }

    /// Make a loaded version the active one (atomic; running streams are unaffected).
    pub fn activate(&self, stage: Stage, version_id: u64) -> Result<VersionInfo, PluginError> {
        self.registry.activate(stage, version_id)
    }

    /// `load` then `activate`.
    pub fn install(&self, stage: Stage, wasm: &[u8]) -> Result<VersionInfo, PluginError> {
        let v = self.load(stage, wasm)?;
        self.activate(stage, v.id)
    }

    /// Swap the previous version back in (the current one becomes the rollback target).
    pub fn rollback(&self, stage: Stage) -> Result<VersionInfo, PluginError> {
        self.registry.rollback(stage)
    }

    /// Every loaded version with its flags and counters.
    pub fn list(&self) -> Vec<VersionInfo> {
        self.registry.list()
    }

    /// The active version of a stage, if any.
    pub fn active(&self, stage: Stage) -> Option<VersionInfo> {
        self.list()
            .into_iter()
            .find(|v| v.stage == stage && v.active)
    }

    /// The chat-template stage.
    pub fn chat_template(&self) -> ChatTemplates {
        ChatTemplates {
            rt: self.rt.clone(),
            registry: self.registry.clone(),
        }
    }

    /// The media stage: images to normalised pixels and placeholders (see [`Media::process`]).
    pub fn media(&self) -> Media {
        Media {
            rt: self.rt.clone(),
            registry: self.registry.clone(),
        }
    }

    /// The router stage: the active policy's choice of replica (see [`Router::choose`]).
    pub fn router(&self) -> Router {
        Router {
            rt: self.rt.clone(),
            registry: self.registry.clone(),
        }
    }

    /// Start a reasoning-parser stream on the active version (pinned for the stream's life).
    pub fn reasoning_stream(
        &self,
        options: &ReasoningOptions,
    ) -> Result<ReasoningStream, PluginError> {
        let version = self.registry.active(Stage::ReasoningParser)?;
        self.registry
            .retry_on_capacity(|| ReasoningStream::start(&self.rt, version.clone(), options))
    }

    /// Start a tool-parser stream on the active version (pinned for the stream's life).
    pub fn tool_stream(&self, options: &ToolOptions) -> Result<ToolStream, PluginError> {
        let version = self.registry.active(Stage::ToolParser)?;
        self.registry
            .retry_on_capacity(|| ToolStream::start(&self.rt, version.clone(), options))
    }

    /// One-shot reasoning parse of a complete output.
    pub fn parse_reasoning(
        &self,
        options: &ReasoningOptions,
        text: &str,
    ) -> Result<ParseResult, PluginError> {
        let version = self.registry.active(Stage::ReasoningParser)?;
        self.registry
            .retry_on_capacity(|| streams::parse_reasoning(&self.rt, &version, options, text))
    }

    /// One-shot tool-call parse of a complete output.
    pub fn parse_tools(
        &self,
        options: &ToolOptions,
        text: &str,
    ) -> Result<ParseResult, PluginError> {
        let version = self.registry.active(Stage::ToolParser)?;
        self.registry
            .retry_on_capacity(|| streams::parse_tools(&self.rt, &version, options, text))
    }

    /// The active tool parser's grammar for `request` (WIT 0.3 `output-grammar`): `Ok(None)`
    /// when the request needs no constraint, [`PluginError::NoOutputGrammar`] when the parser
    /// does not export one, [`PluginError::Guest`] when it refuses the request. Costs one
    /// instantiation plus the guest's work (well under a millisecond for K3): fine per request.
    pub fn output_grammar(
        &self,
        request: &GrammarRequest,
    ) -> Result<Option<OutputGrammar>, PluginError> {
        let version = self.registry.active(Stage::ToolParser)?;
        self.registry
            .retry_on_capacity(|| grammar::output_grammar(&self.rt, &version, request))
    }

    /// Whether the active tool parser exports `output-grammar`.
    pub fn tool_parser_has_output_grammar(&self) -> bool {
        self.registry
            .active(Stage::ToolParser)
            .is_ok_and(|v| grammar::has_output_grammar(&v))
    }

    /// Load and activate the default Kimi K3 plugins from [`default_plugin_dir`].
    pub fn load_default_plugins(&self) -> Result<Vec<VersionInfo>, PluginError> {
        defaults::load_defaults(self)
    }
}
