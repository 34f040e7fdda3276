//! The seam the HTTP layer calls: [`ChatBackend`]. [`crate::Frontend`] is the real one; the HTTP
//! tests script their own.

use futures::future::BoxFuture;

use crate::error::BackendError;
use crate::events::Generation;
use crate::request::{ChatGenRequest, CompletionGenRequest};
use crate::status::{BackendMetrics, ModelInfo, PluginStageInfo, PluginVersionInfo};

/// Everything the HTTP layer needs from the rest of the server.
pub trait ChatBackend: Send + Sync + 'static {
    fn model(&self) -> ModelInfo;

    /// Render, tokenize and submit a chat request. Errors here are request errors (bad template
    /// input, prompt too long, overloaded); errors after the start arrive as [`GenEvent::Error`](crate::GenEvent::Error).
    fn chat(&self, request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>>;

    fn complete(
        &self,
        request: CompletionGenRequest,
    ) -> BoxFuture<'_, Result<Generation, BackendError>>;

    fn metrics(&self) -> BackendMetrics;

    /// `Ok` when the server can take requests; the error says why not.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }

    fn list_plugins(&self) -> Vec<PluginStageInfo>;

    /// Validate a component for `stage` and make it the active version.
    fn load_plugin(
        &self,
        stage: String,
        component: bytes::Bytes,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>>;

    /// Re-activate the version that was active before the current one.
    fn rollback_plugin(
        &self,
        stage: String,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>>;

    /// Stop taking work and finish (or abort) what runs; called once at shutdown.
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}
