//! The router stage (world `router-plugin`, any served WIT version): which replica serves a
//! request. A policy may keep state from call to call (a round-robin cursor), so each active
//! version has one live instance, behind a mutex, created on the first call. Every call runs
//! under the store's memory cap and `call_timeout` (epoch deadline); a trap, time-out, memory
//! overrun or error from the guest fails that call only and discards the instance, and the
//! next call starts a fresh one. A swap (install / activate / rollback) takes effect on the
//! next call: the new version gets its own instance, the outgoing one's is dropped.

use std::sync::Arc;

use wasmtime::Store;

use crate::bindings::{conv, v0_1, v0_2, v0_3};
use crate::error::PluginError;
use crate::registry::{PluginVersion, Registry, StagePre};
use crate::runtime::{Runtime, StoreState};
use crate::types::{ReplicaView, RouteChoice, RouteRequest, Stage};

/// A `reason` longer than this (bytes) is cut (plus an ellipsis): it only goes to logs.
const MAX_REASON_BYTES: usize = 512;

/// Asks the active router policy for a replica. Cheap to clone; `Send + Sync`. A call reuses
/// the live instance and costs tens of microseconds (`docs/plugins.md`, "The router stage");
/// calls are serialised per version, which is cheap at that cost.
#[derive(Clone)]
pub struct Router {
    pub(crate) rt: Arc<Runtime>,
    pub(crate) registry: Arc<Registry>,
}

impl Router {
    /// The active policy's choice among `replicas`. Errors: [`PluginError::NoActivePlugin`]
    /// without a router; [`PluginError::Guest`] when the policy refuses (no healthy replica);
    /// a fault ([`PluginError::is_fault`]: trap, [`PluginError::Timeout`],
    /// [`PluginError::MemoryLimit`]) when it misbehaves. Any error discards the instance.
    pub fn choose(
        &self,
        request: &RouteRequest,
        replicas: &[ReplicaView],
    ) -> Result<RouteChoice, PluginError> {
        let version = self.registry.active(Stage::Router)?;
        let result = self
            .registry
            .retry_on_capacity(|| choose_with(&self.rt, &version, request, replicas));
        // Swapped out while we were calling: free its instance slot now (activate could not,
        // we held the lock).
        if !self.registry.is_active(&version)
            && let Some(mut live) = version.router_live.try_lock()
        {
            live.take();
        }
        result
    }

    /// Name and version of the active policy (`name@version`), for logs and metrics.
    pub fn active_policy(&self) -> Option<String> {
        self.registry
            .active(Stage::Router)
            .ok()
            .map(|v| v.label.to_string())
    }
}

enum RouterInstance {
    V0_1(v0_1::router::RouterPlugin),
    V0_2(v0_2::router::RouterPlugin),
    V0_3(v0_3::router::RouterPlugin),
}

/// A version's live instance and its store.
pub(crate) struct LiveRouter {
    store: Store<StoreState>,
    instance: RouterInstance,
}

fn instantiate(rt: &Runtime, version: &PluginVersion) -> Result<LiveRouter, PluginError> {
    let mut store = rt.store(version.label.clone());
    let instance = rt.call(&mut store, |s| match &version.pre {
        StagePre::Router(pre) => pre.instantiate(s).map(RouterInstance::V0_1),
        StagePre::RouterV0_2(pre) => pre.instantiate(s).map(RouterInstance::V0_2),
        StagePre::RouterV0_3(pre) => pre.instantiate(s).map(RouterInstance::V0_3),
        _ => Err(wasmtime::Error::msg("not a router component")),
    })?;
    Ok(LiveRouter { store, instance })
}

/// One `choose` on the version's live instance (created if there is none), counted.
pub(crate) fn choose_with(
    rt: &Runtime,
    version: &Arc<PluginVersion>,
    request: &RouteRequest,
    replicas: &[ReplicaView],
) -> Result<RouteChoice, PluginError> {
    if !matches!(
        &version.pre,
        StagePre::Router(_) | StagePre::RouterV0_2(_) | StagePre::RouterV0_3(_)
    ) {
        return Err(PluginError::NoActivePlugin(Stage::Router));
    }
    let mut live = version.router_live.lock();
    let mut slot = match live.take() {
        Some(l) => l,
        None => {
            let l = Runtime::timed(version, || instantiate(rt, version))?;
            version.counters.session();
            l
        }
    };
    let result = Runtime::timed(version, || {
        call(rt, &mut slot, &version.label, request, replicas)
    });
    // After any error the instance's state is suspect (a trap leaves it half-updated): drop it.
    if result.is_ok() {
        *live = Some(slot);
    }
    result
}

/// One `choose` on a fresh instance, not counted (the load-time smoke test).
pub(crate) fn choose_once(
    rt: &Runtime,
    version: &PluginVersion,
    request: &RouteRequest,
    replicas: &[ReplicaView],
) -> Result<RouteChoice, PluginError> {
    let mut live = instantiate(rt, version)?;
    call(rt, &mut live, &version.label, request, replicas)
}

/// Each version's `choose`: the records are the same in 0.1, 0.2 and 0.3.
macro_rules! call_choose {
    ($rt:expr, $store:expr, $inst:expr, $v:ident, $plugin:expr, $request:expr, $replicas:expr) => {{
        use $v::router::exports::k3serve::plugin::router as r;
        let request = r::RequestSummary {
            request_id: $request.request_id.clone(),
            model: $request.model.clone(),
            prompt_tokens: $request.prompt_tokens,
            max_tokens: $request.max_tokens,
            prefix_block_hashes: $request.prefix_block_hashes.clone(),
            priority: $request.priority,
        };
        let replicas: Vec<r::ReplicaState> = $replicas
            .iter()
            .map(|x| r::ReplicaState {
                id: x.id.clone(),
                healthy: x.healthy,
                queued: x.queued,
                running: x.running,
                kv_free_blocks: x.kv_free_blocks,
                kv_total_blocks: x.kv_total_blocks,
                prefix_hit_blocks: x.prefix_hit_blocks,
            })
            .collect();
        let api = $inst.k3serve_plugin_router();
        let answer = $rt.call($store, |s| api.call_choose(s, &request, &replicas))?;
        answer
            .map(|c| RouteChoice {
                replica_id: c.replica_id,
                reason: c.reason,
            })
            .map_err(|e| PluginError::Guest {
                plugin: $plugin.to_string(),
                error: conv::$v::guest_error(e),
            })
    }};
}

fn call(
    rt: &Runtime,
    live: &mut LiveRouter,
    plugin: &str,
    request: &RouteRequest,
    replicas: &[ReplicaView],
) -> Result<RouteChoice, PluginError> {
    let store = &mut live.store;
    let mut choice = match &live.instance {
        RouterInstance::V0_1(i) => call_choose!(rt, store, i, v0_1, plugin, request, replicas),
        RouterInstance::V0_2(i) => call_choose!(rt, store, i, v0_2, plugin, request, replicas),
        RouterInstance::V0_3(i) => call_choose!(rt, store, i, v0_3, plugin, request, replicas),
    }?;
    if choice.reason.len() > MAX_REASON_BYTES {
        let mut cut = MAX_REASON_BYTES;
        while !choice.reason.is_char_boundary(cut) {
            cut -= 1;
        }
        choice.reason.truncate(cut);
        choice.reason.push('…');
    }
    Ok(choice)
}
