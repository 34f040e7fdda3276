//! The plugin host as the admin routes and `/metrics` see it: stages, versions and counters in
//! plain types, hot swap and rollback with their errors mapped to request errors.

use bytes::Bytes;
use k3_plugin_host::{PluginError, PluginHost, Stage, VersionInfo};

use crate::error::BackendError;
use crate::status::{PluginCounters, PluginStageInfo, PluginVersionInfo};

/// The stages a chat request runs through; serving needs an active version of each.
const REQUIRED_STAGES: [Stage; 3] = [
    Stage::ChatTemplate,
    Stage::ReasoningParser,
    Stage::ToolParser,
];

/// `Ok` when every stage a chat request needs has an active plugin.
pub(crate) fn health(host: &PluginHost) -> Result<(), String> {
    for stage in REQUIRED_STAGES {
        if host.active(stage).is_none() {
            return Err(format!("no active {stage} plugin"));
        }
    }
    Ok(())
}

pub(crate) fn counters(host: &PluginHost) -> Vec<PluginCounters> {
    host.list()
        .iter()
        .map(|v| PluginCounters {
            stage: v.stage.as_str().into(),
            version: format!("{}@{}#{}", v.metadata.name, v.metadata.version, v.id),
            calls: v.stats.calls,
            errors: v.stats.errors + v.stats.faults,
        })
        .collect()
}

pub fn list(host: &PluginHost) -> Vec<PluginStageInfo> {
    let all = host.list();
    let mut stages: Vec<Stage> = all.iter().map(|v| v.stage).collect();
    stages.sort();
    stages.dedup();
    stages
        .into_iter()
        .map(|stage| {
            let versions: Vec<PluginVersionInfo> = all
                .iter()
                .filter(|v| v.stage == stage)
                .map(version_info)
                .collect();
            PluginStageInfo {
                stage: stage.as_str().into(),
                active: versions.iter().find(|v| v.active).map(|v| v.id.clone()),
                versions,
            }
        })
        .collect()
}

/// Validate `component` for `stage` and make it the active version.
pub(crate) async fn install(
    host: &PluginHost,
    stage: &str,
    component: Bytes,
) -> Result<PluginVersionInfo, BackendError> {
    let stage = parse_stage(stage)?;
    let host = host.clone();
    // Compiling a component can take seconds: off the async threads.
    tokio::task::spawn_blocking(move || install_now(&host, stage, &component))
        .await
        .map_err(|e| BackendError::Internal(format!("plugin load task failed: {e}")))?
}

/// Validate `component` for `stage` and make it the active version, on the calling thread
/// (compiling takes a while: not on an async one).
pub fn install_now(
    host: &PluginHost,
    stage: Stage,
    component: &[u8],
) -> Result<PluginVersionInfo, BackendError> {
    let info = host.install(stage, component).map_err(load_error)?;
    Ok(version_info(&info))
}

pub fn rollback(host: &PluginHost, stage: &str) -> Result<PluginVersionInfo, BackendError> {
    let stage = parse_stage(stage)?;
    let info = host.rollback(stage).map_err(load_error)?;
    Ok(version_info(&info))
}

fn load_error(e: PluginError) -> BackendError {
    match e {
        PluginError::InvalidComponent(_)
        | PluginError::WrongWorld { .. }
        | PluginError::UnsupportedWitVersion { .. }
        | PluginError::MetadataMismatch { .. }
        | PluginError::SelfTestFailed { .. } => BackendError::PluginRejected(e.to_string()),
        PluginError::NothingToRollBack(_) => BackendError::InvalidRequest {
            message: e.to_string(),
            param: None,
        },
        other if other.is_capacity() => BackendError::Unavailable(other.to_string()),
        other => BackendError::Internal(other.to_string()),
    }
}

fn version_info(v: &VersionInfo) -> PluginVersionInfo {
    PluginVersionInfo {
        id: v.id.to_string(),
        name: v.metadata.name.clone(),
        version: v.metadata.version.clone(),
        digest: v.sha256.clone(),
        active: v.active,
        calls: v.stats.calls,
        errors: v.stats.errors + v.stats.faults,
    }
}

fn parse_stage(stage: &str) -> Result<Stage, BackendError> {
    stage.parse().map_err(BackendError::NotFound)
}
