use std::path::PathBuf;
use std::time::Duration;

/// Plugin host settings. `Default` is sized for a server: 64 MiB per store, 250 ms per parser
/// call, 2 s per template render.
#[derive(Debug, Clone)]
pub struct PluginHostConfig {
    /// Directory for precompiled components (`<sha256>-<engine hash>.cwasm`); `None` compiles
    /// in memory on every start.
    pub cache_dir: Option<PathBuf>,
    /// Linear-memory cap per store (bytes). Growth past it traps and fails only that call.
    pub memory_limit: usize,
    /// CPU-time cap per parser / load-time call (epoch deadline; precision is `epoch_tick`).
    pub call_timeout: Duration,
    /// CPU-time cap per chat-template call (long conversations take longer to render).
    pub template_timeout: Duration,
    /// Epoch ticker period.
    pub epoch_tick: Duration,
    /// Concurrent plugin instances the pooling allocator reserves (every live stream holds one).
    pub max_instances: u32,
    /// Warm chat-template instances kept per version.
    pub template_pool_size: usize,
    /// Loaded (inactive) versions kept per stage; the oldest inactive ones are dropped.
    pub max_versions_per_stage: usize,
}

impl Default for PluginHostConfig {
    fn default() -> Self {
        Self {
            cache_dir: None,
            memory_limit: 64 << 20,
            call_timeout: Duration::from_millis(250),
            template_timeout: Duration::from_secs(2),
            epoch_tick: Duration::from_millis(10),
            max_instances: 1000,
            template_pool_size: 4,
            max_versions_per_stage: 8,
        }
    }
}

impl PluginHostConfig {
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }
}
