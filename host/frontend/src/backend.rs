//! The seam the HTTP layer calls: [`ChatBackend`]. [`crate::Frontend`] is the real one; the HTTP
//! tests script their own.

use futures::future::BoxFuture;
use k3_cache_events::{CacheEvent, ReplicaLoad};

use crate::error::BackendError;
use crate::events::Generation;
use crate::request::{ChatGenRequest, CompletionGenRequest};
use crate::status::{BackendMetrics, ModelInfo, PluginStageInfo, PluginVersionInfo};

/// The prefix cache's events, in order (see [`ChatBackend::cache_events`]).
pub type CacheEventReceiver = tokio::sync::mpsc::UnboundedReceiver<CacheEvent>;

/// Everything the HTTP layer needs from the rest of the server.
pub trait ChatBackend: Send + Sync + 'static {
    fn model(&self) -> ModelInfo;

    /// Render, tokenize and submit a chat request. Errors here are request errors (bad template
    /// input, prompt too long, overloaded); errors after the start arrive as [`GenEvent::Error`](crate::GenEvent::Error).
    fn chat(&self, request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>>;

    /// `n` generations of one chat request, choice `i` being [`ChatGenRequest::choice`]. A
    /// backend that renders the prompt once for all of them overrides this; the default submits
    /// each choice through [`ChatBackend::chat`].
    fn chat_n(
        &self,
        request: ChatGenRequest,
        n: usize,
    ) -> BoxFuture<'_, Result<Vec<Generation>, BackendError>> {
        Box::pin(async move {
            let mut gens = Vec::with_capacity(n);
            for i in 0..n {
                gens.push(self.chat(request.choice(i, n)).await?);
            }
            Ok(gens)
        })
    }

    fn complete(
        &self,
        request: CompletionGenRequest,
    ) -> BoxFuture<'_, Result<Generation, BackendError>>;

    /// The token ids `chat` would submit for `request` (rendered and tokenized, nothing run):
    /// `/tokenize` with messages and Anthropic's `count_tokens`.
    fn tokenize_chat(
        &self,
        request: ChatGenRequest,
    ) -> BoxFuture<'_, Result<Vec<u32>, BackendError>> {
        let _ = request;
        Box::pin(async { Err(not_supported("tokenizing")) })
    }

    /// Token ids of a raw text (special-token spellings become their ids, as completions
    /// prompts do); `add_special_tokens` runs the tokenizer's post-processor (bos/eos), if any.
    fn tokenize_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, BackendError> {
        let _ = (text, add_special_tokens);
        Err(not_supported("tokenizing"))
    }

    /// The text of `tokens`; an id outside the vocabulary is an invalid request.
    fn detokenize(&self, tokens: &[u32]) -> Result<String, BackendError> {
        let _ = tokens;
        Err(not_supported("detokenizing"))
    }

    /// The vocabulary's spelling of each id (`None` outside the vocabulary).
    fn token_strings(&self, tokens: &[u32]) -> Vec<Option<String>> {
        tokens.iter().map(|_| None).collect()
    }

    fn metrics(&self) -> BackendMetrics;

    /// Follow the prefix cache as events (a snapshot first); `None` when there is none.
    fn cache_events(&self) -> Option<CacheEventReceiver> {
        None
    }

    /// The load a router weighs; `None` when unknown.
    fn replica_load(&self) -> Option<ReplicaLoad> {
        None
    }

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

fn not_supported(what: &str) -> BackendError {
    BackendError::NotSupported {
        message: format!("this backend does not support {what}"),
        param: None,
    }
}
