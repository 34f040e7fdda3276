//! The wasmtime side: one `Engine` (component model, pooling allocator, epoch interruption), the
//! on-disk precompile cache, the shared `Linker`, and per-store sandboxing (memory cap, time cap,
//! deny-all WASI).

use std::collections::HashMap;
use std::hash::Hasher;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolConcurrencyLimitError, PoolingAllocationConfig,
    ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder, Trap,
};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView};

use crate::bindings::v0_1::tool::k3serve::plugin::log as wit_log;
use crate::bindings::v0_1::types::LogLevel;
use crate::bindings::v0_2::tool::k3serve::plugin::log as wit_log_v0_2;
use crate::bindings::v0_2::types::LogLevel as LogLevelV0_2;
use crate::bindings::v0_3::tool::k3serve::plugin::log as wit_log_v0_3;
use crate::bindings::v0_3::types::LogLevel as LogLevelV0_3;
use crate::config::PluginHostConfig;
use crate::error::PluginError;
use crate::registry::PluginVersion;
use crate::sandbox_io::{SandboxDenied, shadow_wasi_io};

/// Guest stderr kept per store (Rust panic messages end up here).
const STDERR_CAPTURE: usize = 16 << 10;
/// Log lines a store may send through the `log` import, and their maximum length.
const LOG_BUDGET: u32 = 256;
const LOG_LINE_MAX: usize = 2048;

pub(crate) struct Runtime {
    pub engine: Engine,
    pub linker: Linker<StoreState>,
    pub cfg: PluginHostConfig,
    epoch_ticks: u64,
    template_ticks: u64,
    media_ticks: u64,
    compat_hash: String,
    /// Compiled components by wasm sha256, so reloading the same bytes is free.
    compiled: Mutex<HashMap<String, Component>>,
    pub pooling: bool,
    /// Instantiations refused because every pool slot was taken (not counted per plugin).
    capacity_refusals: AtomicU64,
}

/// Per-store state: the sandbox's WASI view, limits and diagnostics.
pub(crate) struct StoreState {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
    /// This store's linear-memory cap (the media stage's is larger).
    memory_limit: usize,
    pub memory_exceeded: bool,
    /// The largest linear memory of this store so far (bytes): wasm memory never shrinks.
    pub memory_bytes: usize,
    stderr: MemoryOutputPipe,
    plugin: Arc<str>,
    log_budget: u32,
}

impl StoreState {
    pub(crate) fn table_mut(&mut self) -> &mut ResourceTable {
        &mut self.table
    }
}

impl WasiView for StoreState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// `StoreLimits` (with `trap_on_grow_failure`) that also remembers that the cap was hit, so a
/// failed growth is reported as a memory-limit error rather than a bare trap.
impl ResourceLimiter for StoreState {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let r = self.limits.memory_growing(current, desired, maximum);
        if matches!(r, Ok(true)) {
            self.memory_bytes = self.memory_bytes.max(desired);
        } else {
            self.memory_exceeded = true;
        }
        r
    }
    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }
    fn instances(&self) -> usize {
        self.limits.instances()
    }
    fn tables(&self) -> usize {
        self.limits.tables()
    }
    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

impl wit_log::Host for StoreState {
    fn log(&mut self, level: LogLevel, message: String) {
        if self.log_budget == 0 {
            return;
        }
        self.log_budget -= 1;
        let mut msg = message;
        if msg.len() > LOG_LINE_MAX {
            let mut cut = LOG_LINE_MAX;
            while !msg.is_char_boundary(cut) {
                cut -= 1;
            }
            msg.truncate(cut);
            msg.push('…');
        }
        let plugin = &*self.plugin;
        match level {
            LogLevel::Trace => tracing::trace!(target: "k3_plugin", plugin, "{msg}"),
            LogLevel::Debug => tracing::debug!(target: "k3_plugin", plugin, "{msg}"),
            LogLevel::Info => tracing::info!(target: "k3_plugin", plugin, "{msg}"),
            LogLevel::Warn => tracing::warn!(target: "k3_plugin", plugin, "{msg}"),
            LogLevel::Error => tracing::error!(target: "k3_plugin", plugin, "{msg}"),
        }
    }
}

/// Every served WIT version imports the same `log`.
impl wit_log_v0_2::Host for StoreState {
    fn log(&mut self, level: LogLevelV0_2, message: String) {
        let level = match level {
            LogLevelV0_2::Trace => LogLevel::Trace,
            LogLevelV0_2::Debug => LogLevel::Debug,
            LogLevelV0_2::Info => LogLevel::Info,
            LogLevelV0_2::Warn => LogLevel::Warn,
            LogLevelV0_2::Error => LogLevel::Error,
        };
        wit_log::Host::log(self, level, message);
    }
}

impl wit_log_v0_3::Host for StoreState {
    fn log(&mut self, level: LogLevelV0_3, message: String) {
        let level = match level {
            LogLevelV0_3::Trace => LogLevel::Trace,
            LogLevelV0_3::Debug => LogLevel::Debug,
            LogLevelV0_3::Info => LogLevel::Info,
            LogLevelV0_3::Warn => LogLevel::Warn,
            LogLevelV0_3::Error => LogLevel::Error,
        };
        wit_log::Host::log(self, level, message);
    }
}

/// Clocks frozen at zero: plugins get no time source (determinism, no timing side channel).
struct FrozenClock;
impl HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}
impl HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// Feeds `Hash` output into sha256 so the engine's compatibility hash becomes a stable string.
struct ShaHasher(Sha256);
impl Hasher for ShaHasher {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

fn engine_config(cfg: &PluginHostConfig, pooling: bool) -> Config {
    let mut c = Config::new();
    c.wasm_component_model(true)
        .epoch_interruption(true)
        .max_wasm_stack(1 << 20);
    if pooling {
        let n = cfg.max_instances.max(1);
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(n)
            .total_core_instances(n.saturating_mul(8))
            .total_memories(n.saturating_mul(2))
            .total_tables(n.saturating_mul(4))
            .max_memories_per_component(2)
            .max_tables_per_component(8)
            .max_core_instances_per_component(16)
            .max_memory_size(cfg.memory_limit.max(cfg.media_memory_limit))
            .linear_memory_keep_resident(256 << 10);
        c.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    }
    c
}

impl Runtime {
    pub fn new(cfg: PluginHostConfig) -> Result<Arc<Self>, PluginError> {
        // Pooling reserves address space for every slot up front; fall back to on-demand
        // allocation where the environment refuses that (e.g. a tight `ulimit -v`).
        let (engine, pooling) = match Engine::new(&engine_config(&cfg, true)) {
            Ok(e) => (e, true),
            Err(err) => {
                tracing::warn!("pooling allocator unavailable ({err}); using on-demand allocation");
                let e = Engine::new(&engine_config(&cfg, false))
                    .map_err(|e| PluginError::Engine(e.to_string()))?;
                (e, false)
            }
        };
        let mut linker = Linker::<StoreState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .and_then(|()| shadow_wasi_io(&mut linker))
            .map_err(|e| PluginError::Engine(e.to_string()))?;
        wit_log::add_to_linker::<StoreState, HasSelf<StoreState>>(&mut linker, |s| s)
            .map_err(|e| PluginError::Engine(e.to_string()))?;
        wit_log_v0_2::add_to_linker::<StoreState, HasSelf<StoreState>>(&mut linker, |s| s)
            .map_err(|e| PluginError::Engine(e.to_string()))?;
        wit_log_v0_3::add_to_linker::<StoreState, HasSelf<StoreState>>(&mut linker, |s| s)
            .map_err(|e| PluginError::Engine(e.to_string()))?;

        let mut h = ShaHasher(Sha256::new());
        std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut h);
        let compat_hash = hex::encode(&h.0.finalize()[..12]);

        let tick = cfg.epoch_tick.max(Duration::from_millis(1));
        let ticks = |d: Duration| (d.as_nanos() / tick.as_nanos()).max(1) as u64 + 1;
        let (epoch_ticks, template_ticks, media_ticks) = (
            ticks(cfg.call_timeout),
            ticks(cfg.template_timeout),
            ticks(cfg.media_timeout),
        );
        let weak = engine.weak();
        std::thread::Builder::new()
            .name("k3-plugin-epoch".into())
            .spawn(move || {
                while let Some(engine) = weak.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    std::thread::sleep(tick);
                }
            })
            .map_err(|e| PluginError::Engine(format!("cannot start the epoch ticker: {e}")))?;

        if let Some(dir) = &cfg.cache_dir {
            std::fs::create_dir_all(dir)
                .map_err(|e| PluginError::Io(format!("{}: {e}", dir.display())))?;
        }
        Ok(Arc::new(Self {
            engine,
            linker,
            cfg,
            epoch_ticks,
            template_ticks,
            media_ticks,
            compat_hash,
            compiled: Mutex::new(HashMap::new()),
            pooling,
            capacity_refusals: AtomicU64::new(0),
        }))
    }

    /// Compile (or fetch from the caches) a component. Returns it and its sha256 (hex).
    pub fn compile(&self, bytes: &[u8]) -> Result<(Component, String), PluginError> {
        check_header(bytes)?;
        let sha = hex::encode(Sha256::digest(bytes));
        if let Some(c) = self.compiled.lock().get(&sha) {
            return Ok((c.clone(), sha));
        }
        let component = match &self.cfg.cache_dir {
            Some(dir) => self.compile_cached(
                bytes,
                &dir.join(format!("{sha}-{}.cwasm", self.compat_hash)),
            )?,
            None => Component::new(&self.engine, bytes)
                .map_err(|e| PluginError::InvalidComponent(format!("{e:#}")))?,
        };
        self.compiled.lock().insert(sha.clone(), component.clone());
        Ok((component, sha))
    }

    fn compile_cached(&self, bytes: &[u8], path: &Path) -> Result<Component, PluginError> {
        if path.exists() {
            // SAFETY: files in the cache directory are written only by `precompile_component`
            // of an engine with the same compatibility hash (it is in the file name).
            match unsafe { Component::deserialize_file(&self.engine, path) } {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(
                        "discarding unusable cached component {}: {e}",
                        path.display()
                    );
                    let _ = std::fs::remove_file(path);
                }
            }
        }
        let cwasm = self
            .engine
            .precompile_component(bytes)
            .map_err(|e| PluginError::InvalidComponent(format!("{e:#}")))?;
        let tmp = unique_tmp(path);
        let written = std::fs::write(&tmp, &cwasm).and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!("cannot write component cache {}: {e}", path.display());
            // SAFETY: the bytes were produced just now by this engine.
            return unsafe { Component::deserialize(&self.engine, &cwasm) }
                .map_err(|e| PluginError::Engine(e.to_string()));
        }
        // SAFETY: as above; the file holds what this engine just produced.
        unsafe { Component::deserialize_file(&self.engine, path) }
            .map_err(|e| PluginError::Engine(e.to_string()))
    }

    /// A fresh sandboxed store for `plugin`.
    pub fn store(&self, plugin: Arc<str>) -> Store<StoreState> {
        self.store_limited(plugin, self.cfg.memory_limit)
    }

    /// A fresh sandboxed store for one media-stage call (`media_memory_limit`).
    pub fn media_store(&self, plugin: Arc<str>) -> Store<StoreState> {
        self.store_limited(plugin, self.cfg.media_memory_limit)
    }

    fn store_limited(&self, plugin: Arc<str>, memory_limit: usize) -> Store<StoreState> {
        let stderr = MemoryOutputPipe::new(STDERR_CAPTURE);
        // Deny-all WASI: no args, env, preopens or sockets; frozen clocks; fixed seeds.
        let wasi = WasiCtx::builder()
            .stderr(stderr.clone())
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock)
            .insecure_random_seed(0x6b33_7365_7276_6521)
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        let limits = StoreLimitsBuilder::new()
            .memory_size(memory_limit)
            .instances(32)
            .tables(32)
            .memories(4)
            .trap_on_grow_failure(true)
            .build();
        let state = StoreState {
            wasi,
            table: ResourceTable::new(),
            limits,
            memory_limit,
            memory_exceeded: false,
            memory_bytes: 0,
            stderr,
            plugin,
            log_budget: LOG_BUDGET,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| s as &mut dyn ResourceLimiter);
        store.set_epoch_deadline(self.epoch_ticks);
        store
    }

    /// Run one guest call under `call_timeout`, turning faults into clear errors.
    pub fn call<R>(
        &self,
        store: &mut Store<StoreState>,
        f: impl FnOnce(&mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        store.set_epoch_deadline(self.epoch_ticks);
        self.guarded(store, f, self.cfg.call_timeout)
    }

    /// Like [`Runtime::call`], under `template_timeout`.
    pub fn call_template<R>(
        &self,
        store: &mut Store<StoreState>,
        f: impl FnOnce(&mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        store.set_epoch_deadline(self.template_ticks);
        self.guarded(store, f, self.cfg.template_timeout)
    }

    /// Like [`Runtime::call`], under `media_timeout`.
    pub fn call_media<R>(
        &self,
        store: &mut Store<StoreState>,
        f: impl FnOnce(&mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        store.set_epoch_deadline(self.media_ticks);
        self.guarded(store, f, self.cfg.media_timeout)
    }

    /// Run `f`; a host function that panics while serving the guest (wasmtime carries the
    /// panic out of the wasm frames) becomes [`PluginError::HostPanic`], a fault, so the
    /// caller discards the store. Defence in depth: the sandbox's own io never panics.
    fn guarded<R>(
        &self,
        store: &mut Store<StoreState>,
        f: impl FnOnce(&mut Store<StoreState>) -> wasmtime::Result<R>,
        limit: Duration,
    ) -> Result<R, PluginError> {
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(&mut *store))) {
            Ok(r) => r.map_err(|e| self.fault(store, e, limit)),
            Err(panic) => {
                let detail = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a host function panicked".into());
                Err(PluginError::HostPanic {
                    plugin: store.data().plugin.to_string(),
                    detail,
                })
            }
        }
    }

    fn fault(&self, store: &Store<StoreState>, e: wasmtime::Error, limit: Duration) -> PluginError {
        let plugin = store.data().plugin.to_string();
        if let Some(full) = e
            .chain()
            .find_map(|c| c.downcast_ref::<PoolConcurrencyLimitError>())
        {
            self.capacity_refusals.fetch_add(1, Ordering::Relaxed);
            return PluginError::Capacity {
                plugin,
                detail: full.to_string(),
            };
        }
        if store.data().memory_exceeded {
            return PluginError::MemoryLimit {
                plugin,
                limit_bytes: store.data().memory_limit,
            };
        }
        if let Some(Trap::Interrupt) = e.downcast_ref::<Trap>() {
            return PluginError::Timeout {
                plugin,
                limit_ms: limit.as_millis() as u64,
            };
        }
        if let Some(denied) = e.chain().find_map(|c| c.downcast_ref::<SandboxDenied>()) {
            return PluginError::Denied {
                plugin,
                detail: denied.to_string(),
            };
        }
        let mut detail = match e.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            None => format!("{e:#}"),
        };
        let stderr = store.data().stderr.contents();
        let stderr = String::from_utf8_lossy(&stderr);
        let stderr = stderr.trim();
        if !stderr.is_empty() {
            detail.push_str(" (guest stderr: ");
            detail.push_str(stderr);
            detail.push(')');
        }
        PluginError::Trap { plugin, detail }
    }

    /// Run `f`, one call of `version`, and count it in its counters ([`PluginError::Capacity`]
    /// is not counted: it is not the plugin's doing). A fault or a capacity refusal is logged
    /// here, once, by kind: never with the error's text, which may quote the prompt.
    pub fn timed<R>(
        version: &PluginVersion,
        f: impl FnOnce() -> Result<R, PluginError>,
    ) -> Result<R, PluginError> {
        let t = Instant::now();
        let r = f();
        version.counters.record(t.elapsed(), &r);
        if let Err(e) = &r
            && (e.is_fault() || e.is_capacity())
        {
            tracing::warn!(
                stage = %version.stage,
                plugin = %version.label,
                version_id = version.id,
                kind = e.kind(),
                "plugin call failed"
            );
        }
        r
    }

    /// Component instances alive in the pool now (`None` without the pooling allocator).
    pub fn instances_in_use(&self) -> Option<u64> {
        self.engine
            .pooling_allocator_metrics()
            .map(|m| m.component_instances())
    }

    /// Linear-memory bytes kept resident by idle pool slots (`None` without pooling).
    pub fn idle_memory_resident(&self) -> Option<usize> {
        self.engine
            .pooling_allocator_metrics()
            .map(|m| m.unused_memory_bytes_resident())
    }

    pub fn capacity_refusals(&self) -> u64 {
        self.capacity_refusals.load(Ordering::Relaxed)
    }
}

fn unique_tmp(path: &Path) -> PathBuf {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    path.with_extension(format!("tmp{}-{n}", std::process::id()))
}

/// Refuse what is plainly not a component before handing bytes to the compiler.
fn check_header(bytes: &[u8]) -> Result<(), PluginError> {
    if bytes.starts_with(b"\x7fELF") {
        return Err(PluginError::InvalidComponent(
            "this is a precompiled native artifact; only .wasm components are accepted".into(),
        ));
    }
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(PluginError::InvalidComponent(format!(
            "bad magic: expected a WebAssembly component (\\0asm), got {} bytes starting {:02x?}",
            bytes.len(),
            &bytes[..bytes.len().min(8)]
        )));
    }
    if bytes[6..8] == [0, 0] {
        return Err(PluginError::InvalidComponent(
            "this is a core WebAssembly module, not a component; build the plugin for wasm32-wasip2".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host function that panics mid-call (wasmtime carries the panic out through the wasm
    /// frames) ends that call as a typed fault instead of unwinding into the caller's task.
    #[test]
    fn a_panic_inside_a_guest_call_is_a_host_panic_fault() {
        let rt = Runtime::new(PluginHostConfig {
            max_instances: 4,
            ..PluginHostConfig::default()
        })
        .unwrap();
        let mut store = rt.store("panicky@1".into());
        let r: Result<(), _> = rt.call(&mut store, |_| panic!("host bug while serving"));
        let e = r.unwrap_err();
        assert!(
            matches!(&e, PluginError::HostPanic { plugin, detail }
                if plugin == "panicky@1" && detail == "host bug while serving"),
            "{e}"
        );
        assert!(e.is_fault() && !e.is_capacity() && !e.is_resource_limit());
        let r: Result<(), _> = rt.call_template(&mut store, |_| panic!("{}", String::from("x")));
        assert!(matches!(r, Err(PluginError::HostPanic { detail, .. }) if detail == "x"));
    }
}
