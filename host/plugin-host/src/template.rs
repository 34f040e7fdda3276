//! Chat-template rendering through a small pool of warm instances per version: parsing a
//! template costs several times a render, so each warm instance keeps its compiled `template`
//! resources keyed by the template text's hash.

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use wasmtime::Store;
use wasmtime::component::ResourceAny;

use crate::bindings::v0_1::template::ChatTemplatePlugin;
use crate::bindings::v0_1::template::exports::k3serve::plugin::chat_template as ct;
use crate::error::PluginError;
use crate::registry::{PluginVersion, Registry, StagePre};
use crate::runtime::{Runtime, StoreState};
use crate::types::{RenderOptions, Stage, TemplateError};

/// Compiled templates one warm instance keeps; more distinct templates recycle the instance.
const TEMPLATES_PER_INSTANCE: usize = 8;
/// Renders before a warm instance is recycled (bounds heap fragmentation inside the guest).
const RENDERS_PER_INSTANCE: u32 = 10_000;

pub(crate) struct WarmTemplate {
    store: Store<StoreState>,
    instance: ChatTemplatePlugin,
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

fn template_error(e: ct::TemplateError) -> PluginError {
    PluginError::Template(match e {
        ct::TemplateError::Syntax(m) => TemplateError::Syntax(m),
        ct::TemplateError::Raised(m) => TemplateError::Raised(m),
        ct::TemplateError::InvalidInput(m) => TemplateError::InvalidInput(m),
        ct::TemplateError::Render(m) => TemplateError::Render(m),
    })
}

impl ChatTemplates {
    /// Render `messages_json` (the request's OpenAI `messages` array) with the model's Jinja
    /// `template` source. Template errors come back as [`PluginError::Template`].
    pub fn render(
        &self,
        template: &str,
        messages_json: &str,
        tools_json: Option<&str>,
        options: &RenderOptions,
    ) -> Result<String, PluginError> {
        let version = self.registry.active(Stage::ChatTemplate)?;
        render_with(
            &self.rt,
            &version,
            template,
            messages_json,
            tools_json,
            options,
        )
    }
}

pub(crate) fn render_with(
    rt: &Runtime,
    version: &Arc<PluginVersion>,
    template: &str,
    messages_json: &str,
    tools_json: Option<&str>,
    options: &RenderOptions,
) -> Result<String, PluginError> {
    let StagePre::Template(pre) = &version.pre else {
        return Err(PluginError::NoActivePlugin(Stage::ChatTemplate));
    };
    let warm = version.template_pool.lock().pop();
    let mut warm = match warm {
        Some(w) => w,
        None => {
            version.counters.session();
            let mut store = rt.store(version.label.clone());
            let instance = Runtime::timed(&version.counters, || {
                rt.call_template(&mut store, |s| pre.instantiate(s))
            })?;
            WarmTemplate {
                store,
                instance,
                compiled: HashMap::new(),
                renders: 0,
            }
        }
    };
    let key: [u8; 32] = Sha256::digest(template.as_bytes()).into();
    let opts = wit_options(options);
    let result = Runtime::timed(&version.counters, || {
        let WarmTemplate {
            store,
            instance,
            compiled,
            ..
        } = &mut warm;
        let api = instance.k3serve_plugin_chat_template().template();
        let handle = match compiled.get(&key) {
            Some(h) => *h,
            None => {
                let h = rt.call_template(store, |s| api.call_constructor(s, template))?;
                compiled.insert(key, h);
                h
            }
        };
        let rendered = rt.call_template(store, |s| {
            api.call_render(s, handle, messages_json, tools_json, &opts)
        })?;
        rendered.map_err(template_error)
    });
    warm.renders += 1;
    // A fault poisons the store: drop it. Otherwise return it to the pool if there is room.
    let reusable = !matches!(&result, Err(e) if e.is_fault())
        && warm.renders < RENDERS_PER_INSTANCE
        && warm.compiled.len() <= TEMPLATES_PER_INSTANCE;
    if reusable {
        let mut pool = version.template_pool.lock();
        if pool.len() < rt.cfg.template_pool_size {
            pool.push(warm);
        }
    }
    result
}
