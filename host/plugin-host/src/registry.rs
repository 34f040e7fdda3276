//! Stage slots and plugin versions: load → type-check against the world → metadata + self-test
//! + host smoke test → (activate) with an atomic swap; rollback; per-version counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use wasmtime::component::Component;

use crate::bindings::v0_1::{media, reasoning, router, template, tool};
use crate::bindings::{conv, v0_2, v0_3};
use crate::error::PluginError;
use crate::router::LiveRouter;
use crate::runtime::{Runtime, StoreState};
use crate::template::WarmTemplate;
use crate::types::{PluginMetadata, Stage, VersionInfo, VersionStats};

/// A WIT package version this host serves (`docs/plugins.md`, "Versioning").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WitVersion {
    V0_1,
    V0_2,
    V0_3,
}

impl WitVersion {
    /// What the package's version strings start with.
    fn prefix(self) -> &'static str {
        match self {
            WitVersion::V0_1 => "0.1.",
            WitVersion::V0_2 => "0.2.",
            WitVersion::V0_3 => "0.3.",
        }
    }
}

/// The type-checked, ready-to-instantiate form of a component, per world and WIT version.
pub(crate) enum StagePre {
    Template(template::ChatTemplatePluginPre<StoreState>),
    Reasoning(reasoning::ReasoningParserPluginPre<StoreState>),
    Tool(tool::ToolParserPluginPre<StoreState>),
    Media(media::MediaPluginPre<StoreState>),
    Router(router::RouterPluginPre<StoreState>),
    TemplateV0_2(v0_2::template::ChatTemplatePluginPre<StoreState>),
    ReasoningV0_2(v0_2::reasoning::ReasoningParserPluginPre<StoreState>),
    ToolV0_2(v0_2::tool::ToolParserPluginPre<StoreState>),
    MediaV0_2(v0_2::media::MediaPluginPre<StoreState>),
    RouterV0_2(v0_2::router::RouterPluginPre<StoreState>),
    TemplateV0_3(v0_3::template::ChatTemplatePluginPre<StoreState>),
    ReasoningV0_3(v0_3::reasoning::ReasoningParserPluginPre<StoreState>),
    ToolV0_3(ToolPreV0_3),
    MediaV0_3(v0_3::media::MediaPluginPre<StoreState>),
    RouterV0_3(v0_3::router::RouterPluginPre<StoreState>),
}

/// A 0.3 tool parser, and where its optional `output-grammar` export is (`None`: not exported).
pub(crate) struct ToolPreV0_3 {
    pub tool: v0_3::tool::ToolParserPluginPre<StoreState>,
    pub grammar: Option<OutputGrammarIndices>,
}

pub(crate) use v0_3::tool_grammar::exports::k3serve::plugin::output_grammar::GuestIndices as OutputGrammarIndices;

#[derive(Default)]
pub(crate) struct Counters {
    calls: AtomicU64,
    errors: AtomicU64,
    faults: AtomicU64,
    sessions: AtomicU64,
    busy_ns: AtomicU64,
}

impl Counters {
    pub fn record<R>(&self, took: Duration, r: &Result<R, PluginError>) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.busy_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        if matches!(r, Err(e) if e.is_capacity()) {
            return;
        }
        match r {
            Err(e) if e.is_fault() => {
                self.faults.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) => {}
        }
    }

    pub fn session(&self) {
        self.sessions.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> VersionStats {
        VersionStats {
            calls: self.calls.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            faults: self.faults.load(Ordering::Relaxed),
            sessions: self.sessions.load(Ordering::Relaxed),
            busy_ns: self.busy_ns.load(Ordering::Relaxed),
        }
    }
}

/// One loaded component. Streams hold an `Arc` to the version they started on, so a swap never
/// disturbs them; the version is freed when its last stream ends.
pub(crate) struct PluginVersion {
    pub id: u64,
    pub stage: Stage,
    pub metadata: PluginMetadata,
    pub label: Arc<str>,
    pub sha256: String,
    pub size_bytes: usize,
    pub loaded_at: SystemTime,
    pub pre: StagePre,
    pub counters: Counters,
    /// Warm chat-template instances (template stage only).
    pub template_pool: Mutex<Vec<WarmTemplate>>,
    /// The live router instance, state and all (router stage only; while active).
    pub router_live: Mutex<Option<LiveRouter>>,
}

#[derive(Default)]
struct Slot {
    active: ArcSwapOption<PluginVersion>,
    previous: ArcSwapOption<PluginVersion>,
    loaded: Mutex<Vec<Arc<PluginVersion>>>,
}

pub(crate) struct Registry {
    slots: [Slot; 5],
    /// Serialises admin operations (activate / rollback); the request path never takes it.
    admin: Mutex<()>,
    next_id: AtomicU64,
}

impl Registry {
    pub fn new() -> Self {
        Self {
            slots: Default::default(),
            admin: Mutex::new(()),
            next_id: AtomicU64::new(1),
        }
    }

    /// The active version of `stage`, pinned.
    pub fn active(&self, stage: Stage) -> Result<Arc<PluginVersion>, PluginError> {
        self.slots[stage.index()]
            .active
            .load_full()
            .ok_or(PluginError::NoActivePlugin(stage))
    }

    /// Whether `version` is its stage's active version now.
    pub fn is_active(&self, version: &Arc<PluginVersion>) -> bool {
        is(&self.slots[version.stage.index()].active, version)
    }

    /// Run `f`; if the engine was out of instance slots, drop the warm chat-template instances
    /// (a cache, and each holds a slot) and, if that freed any, run it once more.
    pub fn retry_on_capacity<R>(
        &self,
        f: impl Fn() -> Result<R, PluginError>,
    ) -> Result<R, PluginError> {
        match f() {
            Err(e) if e.is_capacity() && self.drop_warm_templates() > 0 => f(),
            r => r,
        }
    }

    /// Drop every loaded template version's warm instances; how many there were.
    fn drop_warm_templates(&self) -> usize {
        let versions = self.slots[Stage::ChatTemplate.index()]
            .loaded
            .lock()
            .clone();
        let dropped: usize = versions
            .iter()
            .map(|v| std::mem::take(&mut *v.template_pool.lock()).len())
            .sum();
        if dropped > 0 {
            tracing::info!(
                dropped,
                "plugin instance pool full: dropped warm template instances"
            );
        }
        dropped
    }

    pub fn load(
        &self,
        rt: &Arc<Runtime>,
        stage: Stage,
        bytes: &[u8],
    ) -> Result<VersionInfo, PluginError> {
        let (component, sha256) = rt.compile(bytes)?;
        if let Some(existing) = self.slots[stage.index()]
            .loaded
            .lock()
            .iter()
            .find(|v| v.sha256 == sha256)
        {
            return Ok(self.info(existing));
        }
        let wit = check_wit_version(rt, &component)?;
        let pre = type_check(rt, stage, &component, wit)?;
        let metadata = self_check(rt, stage, &pre, wit)?;
        let version = Arc::new(PluginVersion {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            stage,
            label: format!("{}@{}", metadata.name, metadata.version).into(),
            metadata,
            sha256,
            size_bytes: bytes.len(),
            loaded_at: SystemTime::now(),
            pre,
            counters: Counters::default(),
            template_pool: Mutex::new(Vec::new()),
            router_live: Mutex::new(None),
        });
        crate::smoke::run(rt, &version)?;
        let info = self.info(&version);
        let slot = &self.slots[stage.index()];
        let mut loaded = slot.loaded.lock();
        loaded.push(version);
        // Forget the oldest versions that are neither active nor the rollback target.
        while loaded.len() > rt.cfg.max_versions_per_stage.max(2) {
            let keep = |v: &Arc<PluginVersion>| is(&slot.active, v) || is(&slot.previous, v);
            match loaded.iter().position(|v| !keep(v)) {
                Some(i) => {
                    loaded.remove(i);
                }
                None => break,
            }
        }
        tracing::info!(stage = %stage, plugin = %info.metadata.name, version = %info.metadata.version, sha256 = %info.sha256, id = info.id, "plugin loaded");
        Ok(info)
    }

    pub fn activate(&self, stage: Stage, id: u64) -> Result<VersionInfo, PluginError> {
        let _admin = self.admin.lock();
        let slot = &self.slots[stage.index()];
        let version = slot
            .loaded
            .lock()
            .iter()
            .find(|v| v.id == id)
            .cloned()
            .ok_or(PluginError::UnknownVersion { stage, id })?;
        if is(&slot.active, &version) {
            return Ok(self.info(&version));
        }
        let old = slot.active.swap(Some(version.clone()));
        if let Some(old) = &old {
            drop_live_router(old);
        }
        if old.is_some() {
            slot.previous.store(old);
        }
        tracing::info!(stage = %stage, plugin = %version.label, id, "plugin activated");
        Ok(self.info(&version))
    }

    pub fn rollback(&self, stage: Stage) -> Result<VersionInfo, PluginError> {
        let _admin = self.admin.lock();
        let slot = &self.slots[stage.index()];
        let previous = slot
            .previous
            .load_full()
            .ok_or(PluginError::NothingToRollBack(stage))?;
        let current = slot.active.swap(Some(previous.clone()));
        if let Some(current) = &current {
            drop_live_router(current);
        }
        slot.previous.store(current);
        tracing::info!(stage = %stage, plugin = %previous.label, id = previous.id, "plugin rolled back");
        Ok(self.info(&previous))
    }

    pub fn list(&self) -> Vec<VersionInfo> {
        Stage::ALL
            .iter()
            .flat_map(|s| {
                self.slots[s.index()]
                    .loaded
                    .lock()
                    .iter()
                    .map(|v| self.info(v))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn info(&self, v: &Arc<PluginVersion>) -> VersionInfo {
        let slot = &self.slots[v.stage.index()];
        VersionInfo {
            id: v.id,
            stage: v.stage,
            metadata: v.metadata.clone(),
            sha256: v.sha256.clone(),
            size_bytes: v.size_bytes,
            loaded_at: v.loaded_at,
            active: is(&slot.active, v),
            previous: is(&slot.previous, v),
            stats: v.counters.snapshot(),
        }
    }
}

/// A swapped-out router version starts fresh if it is activated again, and its instance slot
/// is freed now. A call in flight holds the lock: `Router::choose` drops it when done.
fn drop_live_router(version: &PluginVersion) {
    if let Some(mut live) = version.router_live.try_lock() {
        live.take();
    }
}

fn is(cell: &ArcSwapOption<PluginVersion>, v: &Arc<PluginVersion>) -> bool {
    cell.load().as_ref().is_some_and(|a| Arc::ptr_eq(a, v))
}

fn export_names(rt: &Runtime, component: &Component) -> Vec<String> {
    component
        .component_type()
        .exports(&rt.engine)
        .map(|(name, _)| name.to_string())
        .collect()
}

/// The served WIT version a component's exports name; refuse any other version of our package.
/// A component exporting none of our interfaces is checked against 0.1 (and then fails the
/// type check with the world it lacks).
fn check_wit_version(rt: &Runtime, component: &Component) -> Result<WitVersion, PluginError> {
    let mut found = None;
    for name in export_names(rt, component) {
        let Some(rest) = name.strip_prefix("k3serve:plugin/") else {
            continue;
        };
        let Some((_, version)) = rest.split_once('@') else {
            continue;
        };
        let v = [WitVersion::V0_1, WitVersion::V0_2, WitVersion::V0_3]
            .into_iter()
            .find(|v| version.starts_with(v.prefix()))
            .ok_or_else(|| PluginError::UnsupportedWitVersion {
                found: format!("k3serve:plugin@{version}"),
            })?;
        if found.is_some_and(|f| f != v) {
            return Err(PluginError::InvalidComponent(
                "the component exports interfaces of two k3serve:plugin versions".into(),
            ));
        }
        found = Some(v);
    }
    Ok(found.unwrap_or(WitVersion::V0_1))
}

/// Resolve imports against the sandbox linker and exports against the stage's world.
fn type_check(
    rt: &Runtime,
    stage: Stage,
    component: &Component,
    wit: WitVersion,
) -> Result<StagePre, PluginError> {
    let wrong = |detail: String| PluginError::WrongWorld {
        stage,
        world: stage.world(),
        detail,
    };
    let pre = rt.linker.instantiate_pre(component).map_err(|e| {
        wrong(format!(
            "its imports cannot be satisfied by the sandbox: {e:#}"
        ))
    })?;
    let exports = || export_names(rt, component).join(", ");
    let missing = |e: wasmtime::Error| wrong(format!("{e:#} (component exports: [{}])", exports()));
    use WitVersion::{V0_1, V0_2, V0_3};
    Ok(match (wit, stage) {
        (V0_1, Stage::ChatTemplate) => {
            StagePre::Template(template::ChatTemplatePluginPre::new(pre).map_err(missing)?)
        }
        (V0_1, Stage::ReasoningParser) => {
            StagePre::Reasoning(reasoning::ReasoningParserPluginPre::new(pre).map_err(missing)?)
        }
        (V0_1, Stage::ToolParser) => {
            StagePre::Tool(tool::ToolParserPluginPre::new(pre).map_err(missing)?)
        }
        (V0_1, Stage::Media) => StagePre::Media(media::MediaPluginPre::new(pre).map_err(missing)?),
        (V0_1, Stage::Router) => {
            StagePre::Router(router::RouterPluginPre::new(pre).map_err(missing)?)
        }
        (V0_2, Stage::ChatTemplate) => StagePre::TemplateV0_2(
            v0_2::template::ChatTemplatePluginPre::new(pre).map_err(missing)?,
        ),
        (V0_2, Stage::ReasoningParser) => StagePre::ReasoningV0_2(
            v0_2::reasoning::ReasoningParserPluginPre::new(pre).map_err(missing)?,
        ),
        (V0_2, Stage::ToolParser) => {
            StagePre::ToolV0_2(v0_2::tool::ToolParserPluginPre::new(pre).map_err(missing)?)
        }
        (V0_2, Stage::Media) => {
            StagePre::MediaV0_2(v0_2::media::MediaPluginPre::new(pre).map_err(missing)?)
        }
        (V0_2, Stage::Router) => {
            StagePre::RouterV0_2(v0_2::router::RouterPluginPre::new(pre).map_err(missing)?)
        }
        (V0_3, Stage::ChatTemplate) => StagePre::TemplateV0_3(
            v0_3::template::ChatTemplatePluginPre::new(pre).map_err(missing)?,
        ),
        (V0_3, Stage::ReasoningParser) => StagePre::ReasoningV0_3(
            v0_3::reasoning::ReasoningParserPluginPre::new(pre).map_err(missing)?,
        ),
        (V0_3, Stage::ToolParser) => {
            // `output-grammar` is optional: absent is fine, present it must type-check.
            let exports_grammar = export_names(rt, component)
                .iter()
                .any(|n| n.starts_with("k3serve:plugin/output-grammar@"));
            let grammar = if exports_grammar {
                Some(OutputGrammarIndices::new(&pre).map_err(missing)?)
            } else {
                None
            };
            StagePre::ToolV0_3(ToolPreV0_3 {
                tool: v0_3::tool::ToolParserPluginPre::new(pre).map_err(missing)?,
                grammar,
            })
        }
        (V0_3, Stage::Media) => {
            StagePre::MediaV0_3(v0_3::media::MediaPluginPre::new(pre).map_err(missing)?)
        }
        (V0_3, Stage::Router) => {
            StagePre::RouterV0_3(v0_3::router::RouterPluginPre::new(pre).map_err(missing)?)
        }
    })
}

/// Instantiate once in a throwaway store: metadata must match the slot, self-test must pass.
fn self_check(
    rt: &Runtime,
    stage: Stage,
    pre: &StagePre,
    wit: WitVersion,
) -> Result<PluginMetadata, PluginError> {
    let label = format!("<loading {stage} plugin>").into();
    // A media plugin's self-test may decode a probe image: give it the media store's memory.
    let mut store = match stage {
        Stage::Media => rt.media_store(label),
        _ => rt.store(label),
    };
    macro_rules! meta_and_test {
        ($pre:expr, $conv:ident) => {{
            let inst = rt.call(&mut store, |s| $pre.instantiate(s))?;
            let meta = rt.call(&mut store, |s| inst.call_metadata(s))?;
            let test = rt.call(&mut store, |s| inst.call_self_test(s))?;
            (conv::$conv::metadata(meta), test)
        }};
    }
    let (meta, test) = match pre {
        StagePre::Template(p) => meta_and_test!(p, v0_1),
        StagePre::Reasoning(p) => meta_and_test!(p, v0_1),
        StagePre::Tool(p) => meta_and_test!(p, v0_1),
        StagePre::Media(p) => meta_and_test!(p, v0_1),
        StagePre::Router(p) => meta_and_test!(p, v0_1),
        StagePre::TemplateV0_2(p) => meta_and_test!(p, v0_2),
        StagePre::ReasoningV0_2(p) => meta_and_test!(p, v0_2),
        StagePre::ToolV0_2(p) => meta_and_test!(p, v0_2),
        StagePre::MediaV0_2(p) => meta_and_test!(p, v0_2),
        StagePre::RouterV0_2(p) => meta_and_test!(p, v0_2),
        StagePre::TemplateV0_3(p) => meta_and_test!(p, v0_3),
        StagePre::ReasoningV0_3(p) => meta_and_test!(p, v0_3),
        StagePre::ToolV0_3(p) => meta_and_test!(p.tool, v0_3),
        StagePre::MediaV0_3(p) => meta_and_test!(p, v0_3),
        StagePre::RouterV0_3(p) => meta_and_test!(p, v0_3),
    };
    if meta.stage != stage {
        return Err(PluginError::MetadataMismatch {
            stage,
            detail: format!("plugin {} says it is a {} plugin", meta.name, meta.stage),
        });
    }
    if !meta.wit_version.starts_with(wit.prefix()) {
        return Err(PluginError::MetadataMismatch {
            stage,
            detail: format!(
                "plugin {} reports WIT version {:?}, but its exports are {}x",
                meta.name,
                meta.wit_version,
                wit.prefix()
            ),
        });
    }
    if meta.name.is_empty() {
        return Err(PluginError::MetadataMismatch {
            stage,
            detail: "plugin reports an empty name".into(),
        });
    }
    test.map_err(|detail| PluginError::SelfTestFailed {
        plugin: meta.name.clone(),
        detail,
    })?;
    Ok(meta)
}
