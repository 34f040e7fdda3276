//! Where the default plugins live. `build.rs` builds the `plugins/` workspace for
//! `wasm32-wasip2` and bakes the output directory in; `K3_PLUGIN_DIR` overrides it at run time.

use std::path::PathBuf;

use crate::PluginHost;
use crate::error::PluginError;
use crate::types::{Stage, VersionInfo};

/// The default plugin per stage: (stage, file name in the plugin directory).
pub const DEFAULT_PLUGINS: [(Stage, &str); 4] = [
    (Stage::ChatTemplate, "kimi_k3_template.wasm"),
    (Stage::ReasoningParser, "kimi_k3_reasoning.wasm"),
    (Stage::ToolParser, "kimi_k3_tools.wasm"),
    (Stage::Media, "kimi_k3_media.wasm"),
];

/// The default router policy's file name in the plugin directory. Not in [`DEFAULT_PLUGINS`]:
/// only the router process (`k3serve router`) loads a router, and a replica has no use for one.
pub const DEFAULT_ROUTER_PLUGIN: &str = "router_kv_aware.wasm";

/// `$K3_PLUGIN_DIR`, else the directory `build.rs` built the plugins into
/// (`plugins/target/wasm32-wasip2/release`).
pub fn default_plugin_dir() -> PathBuf {
    match std::env::var_os("K3_PLUGIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("K3_BUILT_PLUGIN_DIR")),
    }
}

pub(crate) fn load_defaults(host: &PluginHost) -> Result<Vec<VersionInfo>, PluginError> {
    let dir = default_plugin_dir();
    DEFAULT_PLUGINS
        .iter()
        .map(|(stage, file)| {
            let path = dir.join(file);
            let bytes = std::fs::read(&path).map_err(|e| {
                PluginError::Io(format!(
                    "default {stage} plugin {}: {e} (build the plugins with scripts/build-plugins, or set K3_PLUGIN_DIR)",
                    path.display()
                ))
            })?;
            host.install(*stage, &bytes)
        })
        .collect()
}
