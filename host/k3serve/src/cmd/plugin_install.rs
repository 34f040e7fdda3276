//! Installing a plugin file into a plugin host, shared by `serve` and `router` so that both
//! read, load and report plugins alike.

use std::path::Path;

use anyhow::Context;
use k3_plugin_host::{PluginHost, Stage, VersionInfo};

/// Read the component at `path` and make it `stage`'s active version. `flags` names the
/// options that point at plugins (`--plugin-dir`, ...), for the hint when the file is missing.
pub fn install_file(
    host: &PluginHost,
    stage: Stage,
    path: &Path,
    flags: &str,
) -> anyhow::Result<VersionInfo> {
    let bytes = std::fs::read(path).with_context(|| {
        format!(
            "reading the {stage} plugin {} (build the plugins with scripts/build-plugins, or \
             point {flags} at them)",
            path.display()
        )
    })?;
    let info = host
        .install(stage, &bytes)
        .with_context(|| format!("loading the {stage} plugin {}", path.display()))?;
    tracing::info!(
        stage = %stage,
        plugin = %info.metadata.name,
        version = %info.metadata.version,
        "plugin active"
    );
    Ok(info)
}
