//! [`Frontend`]: the request path. A validated chat or completion request goes chat-template
//! plugin → tokenizer → engine; each generated token goes detokenizer → stop strings →
//! reasoning plugin → tool plugin ([`crate::pipeline`]) and comes out as [`GenEvent`]s. The
//! engine never sees HTTP or wasm; the HTTP layer sees only [`ChatBackend`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use k3_engine::{EngineHandle, MediaInput, Request, SubmitError};
use k3_plugin_host::{PluginHost, ReasoningOptions, ToolOptions};
use k3_sampling::StopChecker;
use k3_structured::GrammarPlan;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::admission::{check_prompt_bytes, check_stop_token_ids, content_bytes};
use crate::backend::ChatBackend;
use crate::constrain::{Constraints, Need, chat_needs_grammar, constrained_sampler};
use crate::detokenizer::IncrementalDetokenizer;
use crate::error::{BackendError, FrontendError};
use crate::events::{GenEvent, Generation};
use crate::media::{ImageBytes, MediaFetcher, expand_placeholders, prepare_images, take_images};
use crate::pipeline::{ParserPlan, ParserStages, RequestPath};
use crate::plugin_admin;
use crate::prompt::{encode_prompt, render};
use crate::request::{
    ChatGenRequest, CompletionGenRequest, PromptInput, SamplingOptions, ToolChoice, token_budget,
};
use crate::sampling_defaults::SamplingDefaults;
use crate::status::{
    BackendMetrics, ModelInfo, PluginStageInfo, PluginVersionInfo, PoolUsage, SpecDecodeMetrics,
};
use crate::tokenizer::Tokenizer;

/// Everything the frontend is built from.
pub struct FrontendParts {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub plugins: PluginHost,
    /// The model's Jinja chat template (from tokenizer_config.json).
    pub chat_template: String,
    pub model: ModelInfo,
    /// Token ids that end a turn (the engine was configured with the same ones).
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub defaults: SamplingDefaults,
    /// Bytes of one KV page and one state block: to tell the prefix cache's share of the pool.
    pub kv_page_bytes: usize,
    pub state_block_bytes: usize,
    /// Images: whether the model reads them, limits, and the URL fetcher.
    pub media: MediaFetcher,
}

/// Chat prompts shorter than this get no checkpoint hint (see `Frontend::next_turn_tail`).
const MIN_HINTED_PROMPT: usize = 256;

/// What a chat prompt is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Submit {
    /// A generation: the engine gets the checkpoint hint too.
    Engine,
    /// `/tokenize`: the ids alone.
    IdsOnly,
}

/// What a prompt carries to the engine besides its ids.
#[derive(Debug, Clone, Default)]
struct PromptExtras {
    media: Vec<MediaInput>,
    checkpoint_hint: Option<usize>,
}

/// The request path over one engine and one plugin host.
pub struct Frontend {
    parts: FrontendParts,
    next_id: AtomicU64,
    constraints: Constraints,
}

impl Frontend {
    pub fn new(parts: FrontendParts) -> Self {
        Frontend {
            parts,
            next_id: AtomicU64::new(1),
            constraints: Constraints::default(),
        }
    }

    /// Check the token limits, submit to the engine and start the request's path task.
    fn submit(
        &self,
        prompt: Vec<u32>,
        sampling: &SamplingOptions,
        parsers: Option<ParserStages>,
        prompt_text: Option<String>,
        prompt_param: &str,
        grammar: Option<GrammarPlan>,
        extras: PromptExtras,
    ) -> Result<Generation, BackendError> {
        if prompt.is_empty() {
            return Err(BackendError::InvalidRequest {
                message: "the prompt is empty".into(),
                param: Some(prompt_param.into()),
            });
        }
        let n = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        let max_tokens = token_budget(n, sampling.max_tokens, self.parts.model.max_model_len)?;
        let params = self.parts.defaults.params(sampling, max_tokens)?;
        let detok = IncrementalDetokenizer::with_prompt(self.parts.tokenizer.clone(), &prompt)
            .map_err(|e| BackendError::InvalidRequest {
                message: format!("the prompt cannot be decoded: {e}"),
                param: Some(prompt_param.into()),
            })?;
        let stop = StopChecker::new(&params, &self.parts.eos_token_ids);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let sampler = match grammar {
            Some(plan) => Some(constrained_sampler(
                &params,
                self.parts.vocab_size,
                &prompt,
                plan,
            )?),
            None => None,
        };
        let mut request = Request::new(id, prompt, params);
        request.sampler = sampler;
        request.media = extras.media;
        request.checkpoint_hint = extras.checkpoint_hint;
        let stream = self
            .parts
            .engine
            .submit(request)
            .map_err(|e| submit_error(e, prompt_param))?;
        let path = RequestPath {
            tokenizer: self.parts.tokenizer.clone(),
            detok,
            stop,
            parsers,
            logprobs: sampling.logprobs.is_some(),
            prompt_tokens: n,
        };
        let (tx, rx) = mpsc::channel::<GenEvent>(256);
        tokio::spawn(path.run(stream, tx));
        let events = futures::stream::unfold(rx, |mut rx| async move {
            let e = rx.recv().await?;
            Some((e, rx))
        })
        .boxed();
        Ok(Generation {
            prompt_tokens: n,
            prompt_text,
            events,
        })
    }

    /// The chat prompt's ids (template markup with special tokens, client text as text).
    #[cfg(test)]
    pub(crate) fn prompt_ids(&self, req: &ChatGenRequest) -> Result<Vec<u32>, BackendError> {
        self.chat_text_prompt(req)
    }

    /// Lift the request's images out of its messages and fetch them (async: URLs).
    async fn fetch_images(
        &self,
        req: &mut ChatGenRequest,
    ) -> Result<Vec<ImageBytes>, BackendError> {
        let refs = take_images(&mut req.messages);
        self.parts.media.fetch(refs).await
    }

    pub(crate) fn plugins(&self) -> &PluginHost {
        &self.parts.plugins
    }

    #[cfg(test)]
    pub(crate) fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.parts.tokenizer
    }

    fn chat_now(
        &self,
        req: ChatGenRequest,
        images: Vec<ImageBytes>,
    ) -> Result<Generation, BackendError> {
        let (ids, extras) = self.chat_prompt(&req, images, Submit::Engine)?;
        self.submit_chat(&req, ids, extras)
    }

    /// `n` choices of one chat request over one rendering of its prompt.
    fn chat_n_now(
        &self,
        req: ChatGenRequest,
        images: Vec<ImageBytes>,
        n: usize,
    ) -> Result<Vec<Generation>, BackendError> {
        let (ids, extras) = self.chat_prompt(&req, images, Submit::Engine)?;
        (0..n)
            .map(|i| self.submit_chat(&req.choice(i, n), ids.clone(), extras.clone()))
            .collect()
    }

    /// The prompt's ids and image spans: the text prompt ([`Frontend::chat_text_prompt`]) with
    /// each image's placeholder expanded to the tokens the media stage laid out for it.
    fn chat_prompt(
        &self,
        req: &ChatGenRequest,
        images: Vec<ImageBytes>,
        purpose: Submit,
    ) -> Result<(Vec<u32>, PromptExtras), BackendError> {
        let ids = self.chat_text_prompt(req)?;
        // The tail holds no image (images sit in messages, which the next turn shares), so it
        // keeps its length when placeholders expand.
        // Only a prompt going to the engine needs the next turn's checkpoint (a second render).
        let tail = match purpose {
            Submit::Engine => self.next_turn_tail(req, &ids),
            Submit::IdsOnly => None,
        };
        let hint = |ids: &[u32]| tail.map(|t| ids.len() - t);
        let Some(vision) = self
            .parts
            .media
            .settings()
            .vision
            .filter(|_| !images.is_empty())
        else {
            let checkpoint_hint = hint(&ids);
            return Ok((
                ids,
                PromptExtras {
                    media: Vec::new(),
                    checkpoint_hint,
                },
            ));
        };
        let prepared = prepare_images(&self.parts.plugins, &vision, images)?;
        let (ids, media) = expand_placeholders(&ids, &prepared, &vision, &self.parts.tokenizer)?;
        let checkpoint_hint = hint(&ids);
        Ok((
            ids,
            PromptExtras {
                media,
                checkpoint_hint,
            },
        ))
    }

    /// How many of a chat prompt's `ids` the conversation's next turn would not share: the
    /// template's per-request tail (a tool-choice message, the generation prompt). The engine
    /// leaves a KDA checkpoint where the tail starts, so the next turn restores from there
    /// instead of from the previous interval boundary the walk finds (docs/routing.md). Found
    /// by rendering the conversation one turn on, so it holds for any template; skipped for
    /// short prompts, where a checkpoint saves little.
    fn next_turn_tail(&self, req: &ChatGenRequest, ids: &[u32]) -> Option<usize> {
        if ids.len() < MIN_HINTED_PROMPT {
            return None;
        }
        let p = &self.parts;
        let mut next = req.clone();
        next.messages
            .push(serde_json::json!({"role": "assistant", "content": "."}));
        next.messages
            .push(serde_json::json!({"role": "user", "content": "."}));
        let segments = render(&p.plugins, &p.tokenizer, &p.chat_template, &next).ok()?;
        let next_ids = encode_prompt(&p.tokenizer, &segments).ok()?;
        let shared = ids
            .iter()
            .zip(&next_ids)
            .take_while(|(a, b)| a == b)
            .count();
        (shared > 0 && shared < ids.len()).then(|| ids.len() - shared)
    }

    /// The checks that cost nothing, then the prompt's ids: rendered, bounded again, tokenized.
    fn chat_text_prompt(&self, req: &ChatGenRequest) -> Result<Vec<u32>, BackendError> {
        let p = &self.parts;
        check_stop_token_ids(&req.sampling, p.vocab_size)?;
        check_prompt_bytes(
            &p.tokenizer,
            content_bytes(&req.messages),
            &req.sampling,
            p.model.max_model_len,
            "messages",
        )?;
        // The rendered prompt is bounded again before tokenizing: the template adds markup and
        // renders fields (tools) the first bound does not count.
        let segments = render(&p.plugins, &p.tokenizer, &p.chat_template, req)?;
        check_prompt_bytes(
            &p.tokenizer,
            segments.iter().map(|s| s.as_str().len()).sum(),
            &req.sampling,
            p.model.max_model_len,
            "messages",
        )?;
        encode_prompt(&p.tokenizer, &segments)
    }

    /// Submit one generation of `req` over its prompt `ids`, with its parser stages planned.
    fn submit_chat(
        &self,
        req: &ChatGenRequest,
        ids: Vec<u32>,
        extras: PromptExtras,
    ) -> Result<Generation, BackendError> {
        let p = &self.parts;
        let parsers = ParserStages::Planned(ParserPlan {
            plugins: p.plugins.clone(),
            reasoning: ReasoningOptions {
                thinking: req.thinking,
                prompt_opens_reasoning: req.thinking,
                extra_json: None,
            },
            tools: ToolOptions {
                tools_json: (!req.tools.is_empty())
                    .then(|| Value::Array(req.tools.clone()).to_string()),
                id_prefix: format!("call_{}_", short_id(&req.request_id)),
                extra_json: None,
            },
            emit_tool_calls: !req.tools.is_empty() && req.tool_choice != ToolChoice::None,
        });
        let grammar = self.chat_grammar(req)?;
        self.submit(
            ids,
            &req.sampling,
            Some(parsers),
            None,
            "messages",
            grammar,
            extras,
        )
    }

    fn complete_now(&self, req: CompletionGenRequest) -> Result<Generation, BackendError> {
        let tk = &self.parts.tokenizer;
        check_stop_token_ids(&req.sampling, self.parts.vocab_size)?;
        let (ids, text) = match req.prompt {
            PromptInput::Text(t) => {
                check_prompt_bytes(
                    tk,
                    t.len(),
                    &req.sampling,
                    self.parts.model.max_model_len,
                    "prompt",
                )?;
                let ids = tk.encode(&t).map_err(|e| {
                    BackendError::Internal(format!("tokenizing the prompt failed: {e}"))
                })?;
                (ids, t)
            }
            PromptInput::Tokens(ids) => {
                let text = tk.decode(&ids).map_err(|e| BackendError::InvalidRequest {
                    message: format!("'prompt' holds an invalid token id: {e}"),
                    param: Some("prompt".into()),
                })?;
                (ids, text)
            }
        };
        let echo = req.echo.then_some(text);
        let grammar = match &req.constraint {
            Some(c) => Some(self.constraints.for_completion(
                tk,
                &self.parts.eos_token_ids,
                self.parts.vocab_size,
                c,
                &req.constraint_param,
            )?),
            None => None,
        };
        self.submit(
            ids,
            &req.sampling,
            None,
            echo,
            "prompt",
            grammar,
            PromptExtras::default(),
        )
    }

    /// The grammar a chat request's output must follow, from the tool parser: `tool_choice`
    /// required / named, strict tools, and the content constraint.
    fn chat_grammar(&self, req: &ChatGenRequest) -> Result<Option<GrammarPlan>, BackendError> {
        let Some(need) = chat_needs_grammar(req) else {
            return Ok(None);
        };
        let content_lark = match &req.constraint {
            Some(c) => Some(c.to_lark_expr().map_err(|e| BackendError::InvalidRequest {
                message: format!("'{}': {e}", req.constraint_param),
                param: Some(req.constraint_param.clone()),
            })?),
            None => None,
        };
        let grammar = match self.output_grammar(
            &req.tools,
            &req.tool_choice,
            req.thinking,
            content_lark.as_deref(),
        ) {
            Ok(g) => g,
            // Strict tools under `auto` are held to their schema only where the parser can.
            Err(FrontendError::NoOutputGrammar { .. } | FrontendError::Unsupported(_))
                if need == Need::IfSupported =>
            {
                return Ok(None);
            }
            Err(e @ (FrontendError::NoOutputGrammar { .. } | FrontendError::Unsupported(_))) => {
                let param = match &req.tool_choice {
                    ToolChoice::Required | ToolChoice::Function(_) => "tool_choice".to_string(),
                    _ => req.constraint_param.clone(),
                };
                return Err(BackendError::NotSupported {
                    message: e.to_string(),
                    param: Some(param),
                });
            }
            Err(e) => return Err(e.into()),
        };
        let Some(grammar) = grammar else {
            return Ok(None);
        };
        let p = &self.parts;
        Ok(Some(self.constraints.for_chat(
            &p.tokenizer,
            &p.eos_token_ids,
            p.vocab_size,
            &grammar,
        )?))
    }
}

/// Run CPU work (a wasm template render, ~0.1-1 ms; tokenizing) without stalling the other
/// tasks of this worker thread: `block_in_place` hands them to another worker. A current-thread
/// runtime (tests) has no other worker, so there it simply runs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A short, filesystem/label-safe suffix of a request id for tool-call ids.
fn short_id(request_id: &str) -> String {
    let tail: String = request_id
        .chars()
        .rev()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    tail.chars().rev().collect()
}

fn submit_error(e: SubmitError, param: &str) -> BackendError {
    match e {
        SubmitError::ContextLengthExceeded { prompt, limit } => {
            BackendError::ContextLengthExceeded(format!(
                "this model's maximum context length is {limit} tokens, and the prompt has {prompt}"
            ))
        }
        SubmitError::PromptTooLargeForMemory => BackendError::ContextLengthExceeded(
            "the prompt needs more cache memory than this server has".into(),
        ),
        SubmitError::EmptyPrompt => BackendError::InvalidRequest {
            message: "the prompt is empty".into(),
            param: Some(param.into()),
        },
        SubmitError::InvalidSampling(message) => BackendError::InvalidRequest {
            message,
            param: None,
        },
        SubmitError::ZeroMaxTokens => BackendError::InvalidRequest {
            message: "max_tokens must be at least 1".into(),
            param: Some("max_tokens".into()),
        },
        SubmitError::InvalidMedia(m) => {
            BackendError::Internal(format!("the prompt's image layout is inconsistent: {m}"))
        }
        SubmitError::InvalidToken { token, vocab } => BackendError::InvalidRequest {
            message: format!("token id {token} is outside the vocabulary ({vocab} tokens)"),
            param: Some(param.into()),
        },
        SubmitError::Overloaded { waiting } => BackendError::Overloaded(format!(
            "the server is overloaded ({waiting} requests waiting); retry later"
        )),
        SubmitError::ShuttingDown => {
            BackendError::Unavailable("the server is shutting down".into())
        }
        SubmitError::DuplicateId(id) => {
            BackendError::Internal(format!("duplicate request id {id}"))
        }
    }
}

impl ChatBackend for Frontend {
    fn model(&self) -> ModelInfo {
        self.parts.model.clone()
    }

    fn chat(&self, mut request: ChatGenRequest) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move {
            let images = self.fetch_images(&mut request).await?;
            blocking(|| self.chat_now(request, images))
        })
    }

    fn chat_n(
        &self,
        request: ChatGenRequest,
        n: usize,
    ) -> BoxFuture<'_, Result<Vec<Generation>, BackendError>> {
        let mut request = request;
        Box::pin(async move {
            let images = self.fetch_images(&mut request).await?;
            blocking(|| self.chat_n_now(request, images, n))
        })
    }

    fn complete(
        &self,
        request: CompletionGenRequest,
    ) -> BoxFuture<'_, Result<Generation, BackendError>> {
        Box::pin(async move { blocking(|| self.complete_now(request)) })
    }

    fn tokenize_chat(
        &self,
        request: ChatGenRequest,
    ) -> BoxFuture<'_, Result<Vec<u32>, BackendError>> {
        let mut request = request;
        Box::pin(async move {
            let images = self.fetch_images(&mut request).await?;
            blocking(|| {
                self.chat_prompt(&request, images, Submit::IdsOnly)
                    .map(|(ids, _)| ids)
            })
        })
    }

    fn tokenize_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, BackendError> {
        self.parts
            .tokenizer
            .encode_with(text, add_special_tokens)
            .map_err(|e| BackendError::Internal(format!("tokenizing failed: {e}")))
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, BackendError> {
        self.parts
            .tokenizer
            .decode(tokens)
            .map_err(|e| BackendError::InvalidRequest {
                message: format!("'tokens' cannot be decoded: {e}"),
                param: Some("tokens".into()),
            })
    }

    fn token_strings(&self, tokens: &[u32]) -> Vec<Option<String>> {
        tokens
            .iter()
            .map(|&id| self.parts.tokenizer.id_to_token(id))
            .collect()
    }

    fn cache_events(&self) -> Option<crate::backend::CacheEventReceiver> {
        self.parts.engine.subscribe_cache()
    }

    fn replica_load(&self) -> Option<k3_cache_events::ReplicaLoad> {
        let p = &self.parts;
        Some(
            p.engine
                .metrics()
                .replica_load(p.kv_page_bytes, p.state_block_bytes),
        )
    }

    fn metrics(&self) -> BackendMetrics {
        let m = self.parts.engine.metrics();
        let cache_bytes = m.cache_kv_pages * self.parts.kv_page_bytes
            + m.cache_checkpoints * self.parts.state_block_bytes;
        let used = m.pool.kv_bytes + m.pool.state_bytes;
        let cap = m.pool.capacity_bytes as u64;
        let kind = |kind: &str, used: usize| PoolUsage {
            kind: kind.into(),
            used_bytes: used as u64,
            capacity_bytes: cap,
        };
        BackendMetrics {
            running: m.running as u64,
            waiting: m.waiting as u64,
            prefix_cache_queried_tokens: m.prompt_tokens,
            prefix_cache_hit_tokens: m.prefix_hit_tokens,
            pool: vec![
                kind("kv", m.pool.kv_bytes),
                kind("state", m.pool.state_bytes),
                kind("prefix_cache", cache_bytes),
                // What running requests hold: returns to 0 when the server is idle.
                kind("requests", used.saturating_sub(cache_bytes)),
            ],
            preemptions: m.preemptions,
            plugins: plugin_admin::counters(&self.parts.plugins),
            plugin_instances_in_use: self.parts.plugins.instances_in_use(),
            plugin_capacity_refusals: self.parts.plugins.capacity_refusals(),
            speculative: self
                .parts
                .engine
                .speculation_method()
                .map(|method| SpecDecodeMetrics {
                    method,
                    drafts: m.spec_verify_rounds,
                    draft_tokens: m.spec_draft_tokens,
                    accepted_tokens: m.spec_accepted_tokens,
                    accepted_by_position: m.spec_accepted_by_position.clone(),
                    verify_lengths: m.spec_verify_lengths.clone(),
                }),
        }
    }

    fn health(&self) -> Result<(), String> {
        plugin_admin::health(&self.parts.plugins)
    }

    fn list_plugins(&self) -> Vec<PluginStageInfo> {
        plugin_admin::list(&self.parts.plugins)
    }

    fn load_plugin(
        &self,
        stage: String,
        component: Bytes,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async move { plugin_admin::install(&self.parts.plugins, &stage, component).await })
    }

    fn rollback_plugin(
        &self,
        stage: String,
    ) -> BoxFuture<'_, Result<PluginVersionInfo, BackendError>> {
        Box::pin(async move { plugin_admin::rollback(&self.parts.plugins, &stage) })
    }

    /// The HTTP layer has already given running requests their grace period: end the rest now
    /// (their streams get a clear "shut down" error).
    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let engine = self.parts.engine.clone();
            let _ = tokio::task::spawn_blocking(move || engine.shutdown(Duration::ZERO)).await;
        })
    }
}
