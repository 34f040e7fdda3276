//! Chat-template rendering through a small pool of warm instances per version: parsing a
//! template costs several times a render, so each warm instance keeps its compiled `template`
//! resources keyed by the template text's hash.
//!
//! Renders come back as [`Segment`]s: template markup vs client text. A WIT 0.2/0.3 template says so
//! itself (given the special-token spellings); around a 0.1 template, which returns one string,
//! the host applies the same taint substitution (`k3_segments`) itself — the v0.1 rule in
//! `docs/plugins.md`.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use wasmtime::Store;
use wasmtime::component::ResourceAny;

use k3_segments::{ClientStrings, Segment, ServerStrings, Specials};

use crate::bindings::v0_1::template::ChatTemplatePlugin;
use crate::bindings::v0_1::template::exports::k3serve::plugin::chat_template as ct;
use crate::bindings::v0_2::template::ChatTemplatePlugin as ChatTemplatePluginV0_2;
use crate::bindings::v0_2::template::exports::k3serve::plugin::chat_template as ct2;
use crate::bindings::v0_3::template::ChatTemplatePlugin as ChatTemplatePluginV0_3;
use crate::bindings::v0_3::template::exports::k3serve::plugin::chat_template as ct3;
use crate::error::PluginError;
use crate::registry::{PluginVersion, Registry, StagePre};
use crate::runtime::{Runtime, StoreState};
use crate::types::{RenderOptions, Stage, TemplateError};

/// Compiled templates one warm instance keeps; more distinct templates recycle the instance.
const TEMPLATES_PER_INSTANCE: usize = 8;
/// Renders before a warm instance is recycled (bounds heap fragmentation inside the guest).
const RENDERS_PER_INSTANCE: u32 = 10_000;

enum TemplateInstance {
    V0_1(ChatTemplatePlugin),
    V0_2(ChatTemplatePluginV0_2),
    V0_3(ChatTemplatePluginV0_3),
}

pub(crate) struct WarmTemplate {
    store: Store<StoreState>,
    instance: TemplateInstance,
    compiled: HashMap<[u8; 32], ResourceAny>,
    renders: u32,
}

/// Renders prompts with the active chat-template plugin. Cheap to clone; `Send + Sync`.
/// A render takes ~0.1–1 ms: call it from `spawn_blocking` in async code.
#[derive(Clone)]
pub struct ChatTemplates {
    pub(crate) rt: Arc<Runtime>,
    pub(crate) registry: Arc<Registry>,
}

fn wit_options(o: &RenderOptions) -> ct::RenderOptions {
    ct::RenderOptions {
        add_generation_prompt: o.add_generation_prompt,
        thinking: o.thinking,
        thinking_effort: o.thinking_effort.clone(),
        tool_choice_json: o.tool_choice_json.clone(),
        response_format_json: o.response_format_json.clone(),
        extra_kwargs_json: o.extra_kwargs_json.clone(),
        bos_token: o.bos_token.clone(),
        eos_token: o.eos_token.clone(),
    }
}

/// 0.2's and 0.3's `render-options` (the same record in each version's module).
macro_rules! wit_options_segments {
    ($m:ident, $o:expr) => {
        $m::RenderOptions {
            add_generation_prompt: $o.add_generation_prompt,
            thinking: $o.thinking,
            thinking_effort: $o.thinking_effort.clone(),
            tool_choice_json: $o.tool_choice_json.clone(),
            response_format_json: $o.response_format_json.clone(),
            extra_kwargs_json: $o.extra_kwargs_json.clone(),
            bos_token: $o.bos_token.clone(),
            eos_token: $o.eos_token.clone(),
            special_tokens: $o.special_tokens.clone(),
        }
    };
}

/// Each version's `template-error`, with `fix` applied to the message (the v0.1 rule maps its
/// sentinels back).
macro_rules! template_error {
    ($m:ident, $e:expr, $fix:expr) => {
        PluginError::Template(match $e {
            $m::TemplateError::Syntax(m) => TemplateError::Syntax($fix(m)),
            $m::TemplateError::Raised(m) => TemplateError::Raised($fix(m)),
            $m::TemplateError::InvalidInput(m) => TemplateError::InvalidInput($fix(m)),
            $m::TemplateError::Render(m) => TemplateError::Render($fix(m)),
        })
    };
}

/// 0.2's and 0.3's `segment` list as the host's.
macro_rules! segments {
    ($m:ident, $s:expr) => {
        $s.into_iter()
            .map(|s| match s {
                $m::Segment::Markup(m) => Segment::Markup(m),
                $m::Segment::Text(t) => Segment::Text(t),
            })
            .collect::<Vec<_>>()
    };
}

impl ChatTemplates {
    /// Render `messages_json` (the request's OpenAI `messages` array) with the model's Jinja
    /// `template` source into markup and client-text segments: only special-token spellings
    /// (`options.special_tokens`) inside [`Segment::Markup`] may become special tokens.
    /// Template errors come back as [`PluginError::Template`].
    pub fn render_segments(
        &self,
        template: &str,
        messages_json: &str,
        tools_json: Option<&str>,
        options: &RenderOptions,
    ) -> Result<Vec<Segment>, PluginError> {
        let version = self.registry.active(Stage::ChatTemplate)?;
        self.registry.retry_on_capacity(|| {
            render_with(
                &self.rt,
                &version,
                template,
                messages_json,
                tools_json,
                options,
            )
        })
    }

    /// [`ChatTemplates::render_segments`] joined into one string (the text a v0.1 render gave).
    pub fn render(
        &self,
        template: &str,
        messages_json: &str,
        tools_json: Option<&str>,
        options: &RenderOptions,
    ) -> Result<String, PluginError> {
        self.render_segments(template, messages_json, tools_json, options)
            .map(|s| k3_segments::join(&s))
    }
}

pub(crate) fn render_with(
    rt: &Runtime,
    version: &Arc<PluginVersion>,
    template: &str,
    messages_json: &str,
    tools_json: Option<&str>,
    options: &RenderOptions,
) -> Result<Vec<Segment>, PluginError> {
    if !matches!(
        &version.pre,
        StagePre::Template(_) | StagePre::TemplateV0_2(_) | StagePre::TemplateV0_3(_)
    ) {
        return Err(PluginError::NoActivePlugin(Stage::ChatTemplate));
    }
    let warm = version.template_pool.lock().pop();
    let mut warm = match warm {
        Some(w) => w,
        None => {
            let mut store = rt.store(version.label.clone());
            let instance = Runtime::timed(version, || {
                rt.call_template(&mut store, |s| match &version.pre {
                    StagePre::Template(pre) => pre.instantiate(s).map(TemplateInstance::V0_1),
                    StagePre::TemplateV0_2(pre) => pre.instantiate(s).map(TemplateInstance::V0_2),
                    StagePre::TemplateV0_3(pre) => pre.instantiate(s).map(TemplateInstance::V0_3),
                    _ => unreachable!("checked above"),
                })
            })?;
            version.counters.session();
            WarmTemplate {
                store,
                instance,
                compiled: HashMap::new(),
                renders: 0,
            }
        }
    };
    let key: [u8; 32] = Sha256::digest(template.as_bytes()).into();
    let result = Runtime::timed(version, || {
        let WarmTemplate {
            store,
            instance,
            compiled,
            ..
        } = &mut warm;
        /// The compiled template resource of this instance (compiled on first use).
        macro_rules! handle {
            ($api:expr) => {
                match compiled.get(&key) {
                    Some(h) => *h,
                    None => {
                        let h = rt.call_template(store, |s| $api.call_constructor(s, template))?;
                        compiled.insert(key, h);
                        h
                    }
                }
            };
        }
        match instance {
            TemplateInstance::V0_2(inst) => {
                let api = inst.k3serve_plugin_chat_template().template();
                let handle = handle!(api);
                let opts = wit_options_segments!(ct2, options);
                let rendered = rt.call_template(store, |s| {
                    api.call_render(s, handle, messages_json, tools_json, &opts)
                })?;
                rendered
                    .map(|s| segments!(ct2, s))
                    .map_err(|e| template_error!(ct2, e, |m| m))
            }
            TemplateInstance::V0_3(inst) => {
                let api = inst.k3serve_plugin_chat_template().template();
                let handle = handle!(api);
                let opts = wit_options_segments!(ct3, options);
                let rendered = rt.call_template(store, |s| {
                    api.call_render(s, handle, messages_json, tools_json, &opts)
                })?;
                rendered
                    .map(|s| segments!(ct3, s))
                    .map_err(|e| template_error!(ct3, e, |m| m))
            }
            TemplateInstance::V0_1(inst) => {
                // The v0.1 rule: the host taints client strings around the one-string render.
                let client = ClientStrings {
                    messages_json,
                    tools_json,
                    thinking_effort: options.thinking_effort.as_deref(),
                    tool_choice_json: options.tool_choice_json.as_deref(),
                    response_format_json: options.response_format_json.as_deref(),
                    extra_kwargs_json: options.extra_kwargs_json.as_deref(),
                };
                let server = ServerStrings {
                    template,
                    bos_token: options.bos_token.as_deref(),
                    eos_token: options.eos_token.as_deref(),
                };
                let (taint, t) = client
                    .taint(Specials::new(&options.special_tokens), server)
                    .map_err(|e| {
                        PluginError::Template(TemplateError::InvalidInput(e.to_string()))
                    })?;
                let opts = ct::RenderOptions {
                    thinking_effort: t.thinking_effort,
                    tool_choice_json: t.tool_choice_json,
                    response_format_json: t.response_format_json,
                    extra_kwargs_json: t.extra_kwargs_json,
                    ..wit_options(options)
                };
                let api = inst.k3serve_plugin_chat_template().template();
                let handle = handle!(api);
                let rendered = rt.call_template(store, |s| {
                    api.call_render(s, handle, &t.messages_json, t.tools_json.as_deref(), &opts)
                })?;
                rendered
                    .map(|text| taint.segments(&text))
                    .map_err(|e| template_error!(ct, e, |m: String| taint.untaint(&m)))
            }
        }
    });
    warm.renders += 1;
    // A fault poisons the store: drop it. Otherwise return it to the pool if there is room.
    // An instance that grew past `template_keep_memory` (a huge prompt) is dropped too: its
    // memory cannot shrink, and its pool slot gives the pages back once it is freed.
    let reusable = !matches!(&result, Err(e) if e.is_fault())
        && warm.renders < RENDERS_PER_INSTANCE
        && warm.compiled.len() <= TEMPLATES_PER_INSTANCE
        && warm.store.data().memory_bytes <= rt.cfg.template_keep_memory;
    if reusable {
        let mut pool = version.template_pool.lock();
        if pool.len() < rt.cfg.template_pool_size {
            pool.push(warm);
        }
    }
    result
}
